"""The one dispatch (`pallas_flash.dispatch`): the kernels and tiles chosen per call and device,
the `Device` record, and `jax.export` for CUDA from a CPU-only host.

The tables below pin the choice for a real H200 and an A100: they were recorded from the API
before the choice moved into `dispatch.choose` (forward, backward, the Triton tiles' fields that
differ from `BlockSizes()`, the Mosaic tiles' fields that differ from their classes' defaults,
and the Triton forward's split-KV count), so a change in any of them shows here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import AbstractDevice, AbstractMesh
from support.backends import has_gpu

import pallas_flash
from pallas_flash import dispatch, mosaic, tune, tune_cache
from pallas_flash.call import Call
from pallas_flash.device import Device, target_device
from pallas_flash.masks import MaskSpec
from pallas_flash.triton import BlockSizes
from pallas_flash.triton.forward import choose_kv_splits, tile_sizes
from pallas_flash.tune_cache import ShapeClass, TunedEntry

bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32


def qkv(q_shape, k_shape=None, dtype=bf16):
    k_shape = k_shape or q_shape
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, k_shape))


def zeros(*shape, dtype=jnp.int32):
    return jnp.zeros(shape, dtype)


# name: (q, k, v, flash_attention kwargs)
CALLS = {
    "plain-h128": (qkv((2, 1024, 8, 128), (2, 1024, 2, 128)), {}),
    "causal-h128": (qkv((2, 1024, 8, 128), (2, 1024, 2, 128)), dict(is_causal=True)),
    "plain-h64-short": (qkv((4, 1024, 8, 64)), {}),
    "causal-h64-short": (qkv((4, 1024, 8, 64)), dict(is_causal=True)),
    "plain-h64-2k": (qkv((4, 2048, 8, 64)), {}),
    "causal-h64-2k": (qkv((4, 2048, 8, 64)), dict(is_causal=True)),
    "causal-h64-16k": (qkv((1, 16384, 32, 64)), dict(is_causal=True)),
    "plain-h256": (qkv((2, 1024, 8, 256), (2, 1024, 2, 256)), {}),
    "causal-h256-long": (qkv((1, 8192, 8, 256)), dict(is_causal=True)),
    "causal-h192": (qkv((2, 1024, 8, 192), (2, 1024, 2, 192)), dict(is_causal=True)),
    "causal-h128-long": (qkv((1, 8192, 16, 128)), dict(is_causal=True)),
    "plain-h128-medium": (qkv((4, 4096, 16, 128)), {}),
    "short-keys-h128": (qkv((2, 1024, 8, 128), (2, 512, 8, 128)), dict(is_causal=True)),
    "short-keys-h64": (qkv((4, 1024, 8, 64), (4, 512, 8, 64)), {}),
    "odd-q-h64": (qkv((4, 384, 8, 64), (4, 1024, 8, 64)), {}),
    "small-grid-long-keys": (qkv((1, 128, 4, 128), (1, 32768, 4, 128)), {}),
    # 64 CTAs of 256 rows would leave half the GPU idle: 128 of 128 rows.
    "small-grid-h64": (qkv((1, 4096, 4, 64)), {}),
    "mqa": (qkv((2, 2048, 16, 128), (2, 2048, 1, 128)), dict(is_causal=True)),
    "f16": (qkv((2, 1024, 8, 128), dtype=f16), dict(is_causal=True)),
    "f32": (qkv((2, 1024, 8, 128), dtype=f32), dict(is_causal=True)),
    "odd-lengths": (qkv((2, 1000, 8, 128), (2, 1000, 2, 128)), dict(is_causal=True)),
    "head-dim-96": (qkv((2, 1024, 8, 96)), {}),
    "head-dim-32": (qkv((2, 1024, 8, 32)), {}),
    "bias": (qkv((2, 1024, 8, 128)), dict(bias=zeros(1, 8, 1024, 1024, dtype=bf16))),
    "mask": (qkv((2, 1024, 8, 128)), dict(mask=jnp.ones((1, 1, 1024, 1024), bool))),
    "mask-causal-f32": (
        qkv((2, 1024, 8, 64), dtype=f32),
        dict(is_causal=True, mask=jnp.ones((2, 1, 1024, 1024), bool)),
    ),
    "window": (qkv((2, 1024, 8, 128)), dict(is_causal=True, local_window_size=(256, 0))),
    "window-wide": (qkv((1, 8192, 8, 128)), dict(local_window_size=4096)),
    "soft-cap": (qkv((2, 1024, 8, 128)), dict(logits_soft_cap=30.0)),
    "segments": (qkv((2, 1024, 8, 128)), dict(is_causal=True, q_segment_ids=zeros(2, 1024))),
    "kv-lengths": (qkv((2, 1024, 8, 64)), dict(key_value_seq_lengths=jnp.array([5, 9]))),
    "q-lengths": (
        qkv((2, 2048, 8, 64)),
        dict(is_causal=True, query_seq_lengths=jnp.array([5, 9])),
    ),
    "block-sizes": (qkv((2, 1024, 8, 128)), dict(block_sizes=BlockSizes(block_q=64))),
    "triton": (qkv((2, 1024, 8, 128)), dict(backend="triton", is_causal=True)),
    "mosaic-h64-short": (qkv((4, 1024, 8, 64)), dict(backend="mosaic")),
    "mosaic-backward-tiles": (
        qkv((2, 1024, 8, 128)),
        dict(backend="mosaic", block_sizes=BlockSizes(block_q_dkv=64)),
    ),
    "mosaic-small-grid": (qkv((1, 128, 4, 128), (1, 32768, 4, 128)), dict(backend="mosaic")),
    "unbatched": (qkv((2048, 16, 128), (2048, 4, 128)), dict(is_causal=True)),
    "interpret": (qkv((2, 1024, 8, 128)), dict(interpret=True)),
    "mosaic-bias": (
        qkv((2, 1024, 8, 128)),
        dict(backend="mosaic", bias=zeros(1, 8, 1024, 1024, dtype=bf16)),
    ),
    "mosaic-f32": (qkv((2, 1024, 8, 128), dtype=f32), dict(backend="mosaic")),
    "mosaic-forward-tiles": (
        qkv((2, 1024, 8, 128)),
        dict(backend="mosaic", block_sizes=BlockSizes(block_q=64, kv_splits=2)),
    ),
    "dropout": (
        qkv((2, 1024, 8, 128), (2, 1024, 2, 128)),
        dict(is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    ),
    "dropout-h64-short": (
        qkv((4, 1024, 8, 64)),
        dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    ),
    "dropout-h256": (
        qkv((2, 1024, 8, 256), (2, 1024, 2, 256)),
        dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    ),
    "mosaic-dropout-h256": (
        qkv((2, 1024, 8, 256), (2, 1024, 2, 256)),
        dict(backend="mosaic", dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    ),
    # A few query tokens over a longer key sequence: the decode kernel's forward where it
    # expresses the call (`dispatch.few_tokens_on_decode`), else as any other call.
    "decode-t1": (qkv((8, 1, 32, 128), (8, 32768, 8, 128)), {}),
    "decode-t4-masked": (
        qkv((8, 4, 32, 128), (8, 4096, 8, 128)),
        dict(
            is_causal=True,
            local_window_size=(64, 0),
            logits_soft_cap=30.0,
            query_seq_lengths=zeros(8),
            key_value_seq_lengths=zeros(8),
        ),
    ),
    "decode-t16-f16": (qkv((2, 16, 32, 64), (2, 4096, 8, 64), dtype=f16), {}),
    "decode-t17": (qkv((8, 17, 32, 128), (8, 4096, 8, 128)), {}),
    "decode-short-keys": (qkv((8, 1, 32, 128), (8, 32, 8, 128)), {}),
    # Four tokens over 4k keys of one sequence: B * S below DECODE_ROUTE_MIN_BATCH_KEYS, where
    # the flash forward measured faster (compiled); the interpreter routes it.
    "decode-t4-b1-4k": (qkv((1, 4, 32, 128), (1, 4096, 8, 128)), {}),
    "decode-segments": (
        qkv((8, 4, 32, 128), (8, 4096, 8, 128)),
        dict(q_segment_ids=zeros(8, 4), kv_segment_ids=zeros(8, 4096)),
    ),
    "decode-bias": (
        qkv((8, 4, 32, 128), (8, 4096, 8, 128)),
        dict(bias=zeros(1, 32, 4, 4096, dtype=bf16)),
    ),
    "decode-mask": (
        qkv((8, 4, 32, 128), (8, 4096, 8, 128)),
        dict(mask=jnp.ones((1, 1, 4, 4096), bool)),
    ),
    "decode-f32": (qkv((8, 1, 32, 128), (8, 4096, 8, 128), dtype=f32), {}),
    "decode-dropout": (
        qkv((8, 4, 32, 128), (8, 4096, 8, 128)),
        dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    ),
    "decode-value-head-dim": (
        (
            jax.ShapeDtypeStruct((8, 1, 32, 192), bf16),
            jax.ShapeDtypeStruct((8, 4096, 8, 192), bf16),
            jax.ShapeDtypeStruct((8, 4096, 8, 128), bf16),
        ),
        {},
    ),
    "decode-triton": (qkv((8, 1, 32, 128), (8, 32768, 8, 128)), dict(backend="triton")),
    "decode-block-sizes": (
        qkv((8, 1, 32, 128), (8, 32768, 8, 128)),
        dict(block_sizes=BlockSizes()),
    ),
}

# name: (forward, backward, BlockSizes fields, Mosaic forward / backward tile fields, kv splits),
# or (exception, message) where the call raises.
MOSAIC_LACKS = "backend='mosaic' does not support this call ({}); backend='triton' or None runs it"
HOPPER_ONLY = (
    "backend='mosaic' needs a Hopper GPU (compute capability 9.0, found (8, 0)): its kernel uses "
    "sm_90a's wgmma and TMA; use backend='triton' or None"
)
# The Triton tiles' fields that differ from BlockSizes() (shipped tables and heuristics).
H128 = dict(
    block_kv=128, num_warps=8, block_q_dkv=64, num_warps_dkv=8, block_kv_dq=64, num_warps_dq=8
)
H128_FULL_SHORT = dict(block_q=64, block_q_dkv=64, num_warps_dkv=8, block_kv_dq=64, num_warps_dq=8)
# Rows that see ranges of keys (causal, windows, lengths, segments): the dK/dV kernel's 32 rows.
H128_RANGED = {name: v for name, v in H128.items() if name != "block_q_dkv"}
H128_FULL_SHORT_RANGED = {name: v for name, v in H128_FULL_SHORT.items() if name != "block_q_dkv"}
H128_CAUSAL_SHORT = dict(block_q=64, block_kv_dkv=64, block_kv_dq=64, num_warps_dq=8)
H64_FULL_SHORT = dict(block_q=64, num_stages_dkv=5, block_q_dq=64, block_kv_dq=64)
H64 = dict(block_q=64, block_kv_dq=64, num_warps_dq=8)
# The Mosaic forward's tiles at H=64 plain (T % 256 == 0): 128 rows per consumer, Q's
# descriptors rebuilt each step.
H64_WIDE = dict(block_q=128, persistent=True, step_descriptors=True)
# The Mosaic backward's dQ summed as integers in the dK/dV kernel, whose consumers rebuild
# their descriptors each step at H=128.
FIXED_H128 = dict(fused_dq="fixed", step_descriptors=True)
H256 = dict(
    num_warps=8,
    num_stages=2,
    block_q_dkv=64,
    block_kv_dkv=64,
    num_warps_dkv=8,
    num_stages_dkv=2,
    block_q_dq=64,
    num_stages_dq=1,
)
MOSAIC_H256 = dict(num_consumers=1, split_dkv=True)
F32 = dict(
    block_q=64, num_stages=2, block_kv_dkv=64, num_stages_dkv=2, block_q_dq=64, num_stages_dq=2
)
H128_MASKED = dict(
    block_kv=128,
    num_warps=8,
    num_stages=2,
    block_q_dkv=64,
    num_warps_dkv=8,
    num_stages_dkv=2,
    block_kv_dq=64,
    num_warps_dq=8,
    num_stages_dq=2,
)
INTERPRET = dict(block_q=32, block_kv=32, block_kv_dkv=32, block_q_dq=32)

H200 = {
    "plain-h128": ("mosaic", "mosaic", H128_FULL_SHORT, dict(persistent=True), {}, None),
    "causal-h128": ("mosaic", "mosaic", H128_CAUSAL_SHORT, dict(persistent=True), {}, None),
    "plain-h64-short": (
        "mosaic",
        "triton",
        H64_FULL_SHORT,
        H64_WIDE,
        None,
        None,
    ),
    "causal-h64-short": (
        "mosaic",
        "triton",
        dict(block_q=64, block_q_dq=64, block_kv_dq=64),
        dict(persistent=True),
        None,
        None,
    ),
    "plain-h64-2k": (
        "mosaic",
        "mosaic",
        dict(block_q=64, num_stages_dkv=5, block_kv_dq=64, num_warps_dq=8),
        H64_WIDE,
        {},
        None,
    ),
    "causal-h64-2k": ("mosaic", "mosaic", H64, dict(persistent=True), {}, None),
    # dQ summed as integers in the dK/dV kernel (deterministic, `dispatch.fixed_dq_is_faster`).
    "causal-h64-16k": (
        "mosaic",
        "mosaic",
        H64,
        dict(persistent=True),
        dict(fused_dq="fixed"),
        None,
    ),
    # H 192 and 256: the Mosaic backward with split dK/dV consumers (1.1-2.3x the Triton one).
    "plain-h256": ("mosaic", "mosaic", H256, dict(block_kv=64), MOSAIC_H256, None),
    "causal-h256-long": ("mosaic", "mosaic", H256, dict(block_kv=64), MOSAIC_H256, None),
    "causal-h192": ("mosaic", "mosaic", H256, dict(block_kv=64), dict(split_dkv=True), None),
    "causal-h128-long": ("mosaic", "mosaic", H128_RANGED, dict(persistent=True), FIXED_H128, None),
    "plain-h128-medium": ("mosaic", "mosaic", H128, dict(persistent=True), FIXED_H128, None),
    "short-keys-h128": ("mosaic", "mosaic", H128_CAUSAL_SHORT, dict(persistent=True), {}, None),
    "short-keys-h64": (
        "mosaic",
        "triton",
        H64_FULL_SHORT,
        dict(block_q=128, persistent=True),
        None,
        None,
    ),
    "odd-q-h64": ("mosaic", "triton", H64_FULL_SHORT, dict(persistent=True), None, None),
    "small-grid-long-keys": ("triton", "triton", H128, None, None, 16),
    "small-grid-h64": (
        "mosaic",
        "mosaic",
        dict(block_q=64, num_stages_dkv=5, block_kv_dq=64, num_warps_dq=8),
        dict(block_kv=256),
        dict(fused_dq="fixed"),
        None,
    ),
    "mqa": ("mosaic", "mosaic", H128_RANGED, dict(persistent=True), {}, None),
    "f16": ("mosaic", "mosaic", H128_RANGED, dict(persistent=True), {}, None),
    "f32": ("triton", "triton", F32, None, None, 1),
    # Any T and S, and H=96 (the forward as it is, the backward padded to 128): the Mosaic
    # kernels.
    "odd-lengths": ("triton", "triton", H128_CAUSAL_SHORT, None, None, 1),
    "head-dim-96": ("mosaic", "mosaic", H128_FULL_SHORT, dict(persistent=True), {}, None),
    "head-dim-32": ("triton", "triton", H64, None, None, 1),
    "bias": ("triton", "triton", H128_MASKED, None, None, 1),
    "mask": ("triton", "triton", H128_MASKED, None, None, 1),
    "mask-causal-f32": ("triton", "triton", F32, None, None, 1),
    # The Mosaic backward takes every mask of the Mosaic forward; H=64 below 2048 keys keeps
    # the Triton backward (kv-lengths).
    "window": ("mosaic", "mosaic", H128_FULL_SHORT_RANGED, dict(persistent=True), {}, None),
    "window-wide": ("mosaic", "mosaic", H128, dict(persistent=True), {}, None),
    "soft-cap": ("mosaic", "mosaic", H128_FULL_SHORT, dict(persistent=True), {}, None),
    "segments": ("mosaic", "mosaic", H128_FULL_SHORT_RANGED, dict(persistent=True), {}, None),
    "kv-lengths": ("mosaic", "triton", H64, dict(persistent=True), None, None),
    "q-lengths": ("mosaic", "mosaic", H64, dict(persistent=True), {}, None),
    "block-sizes": ("triton", "triton", dict(block_q=64), None, None, 1),
    "triton": ("triton", "triton", H128_CAUSAL_SHORT, None, None, 1),
    "mosaic-h64-short": (
        "mosaic",
        "mosaic",
        H64_FULL_SHORT,
        H64_WIDE,
        {},
        None,
    ),
    "mosaic-backward-tiles": (
        "mosaic",
        "triton",
        dict(block_q_dkv=64),
        dict(persistent=True),
        None,
        None,
    ),
    "mosaic-small-grid": ("mosaic", "mosaic", H128, dict(persistent=True), {}, None),
    "unbatched": ("mosaic", "mosaic", H128_RANGED, dict(persistent=True), {}, None),
    "interpret": ("triton", "triton", INTERPRET, None, None, 1),
    "mosaic-bias": (NotImplementedError, MOSAIC_LACKS.format("bias")),
    "mosaic-f32": (
        NotImplementedError,
        MOSAIC_LACKS.format("dtype float32 is not bfloat16 or float16"),
    ),
    "mosaic-forward-tiles": (
        NotImplementedError,
        MOSAIC_LACKS.format("block_sizes sets the Triton forward's block_q=64, kv_splits=2"),
    ),
    # Dropout takes the kernels of the same call without it.
    "dropout": ("mosaic", "mosaic", H128_CAUSAL_SHORT, dict(persistent=True), {}, None),
    "dropout-h64-short": (
        "mosaic",
        "triton",
        H64_FULL_SHORT,
        H64_WIDE,
        None,
        None,
    ),
    "dropout-h256": ("mosaic", "mosaic", H256, dict(block_kv=64), MOSAIC_H256, None),
    "mosaic-dropout-h256": ("mosaic", "mosaic", H256, dict(block_kv=64), MOSAIC_H256, None),
    # The decode kernel's forward, the Triton backward; else the Triton forward (the Mosaic
    # grid of a few tokens would not fill the GPU).
    "decode-t1": ("decode", "triton", H128, None, None, None),
    "decode-t4-masked": ("decode", "triton", H128_FULL_SHORT_RANGED, None, None, None),
    "decode-t16-f16": ("decode", "triton", H64, None, None, None),
    "decode-t17": ("triton", "triton", H128, None, None, 1),
    "decode-short-keys": ("triton", "triton", H128_FULL_SHORT, None, None, 1),
    "decode-t4-b1-4k": ("triton", "triton", H128, None, None, 8),
    "decode-segments": ("triton", "triton", H128_FULL_SHORT_RANGED, None, None, 1),
    "decode-bias": ("triton", "triton", H128_MASKED, None, None, 1),
    "decode-mask": ("triton", "triton", H128_MASKED, None, None, 1),
    "decode-f32": ("triton", "triton", F32, None, None, 1),
    "decode-dropout": ("triton", "triton", H128, None, None, 1),
    "decode-value-head-dim": ("triton", "triton", H256, None, None, 1),
    "decode-triton": ("triton", "triton", H128, None, None, 1),
    "decode-block-sizes": ("triton", "triton", {}, None, None, 1),
}
A100 = {
    "plain-h128": ("triton", "triton", H128, None, None, 1),
    "causal-h128": ("triton", "triton", H128_RANGED, None, None, 1),
    "plain-h64-short": ("triton", "triton", H64, None, None, 1),
    "causal-h64-short": ("triton", "triton", H64, None, None, 1),
    "plain-h64-2k": ("triton", "triton", H64, None, None, 1),
    "causal-h64-2k": ("triton", "triton", H64, None, None, 1),
    "causal-h64-16k": ("triton", "triton", H64, None, None, 1),
    "plain-h256": ("triton", "triton", H256, None, None, 1),
    "causal-h256-long": ("triton", "triton", H256, None, None, 1),
    "causal-h192": ("triton", "triton", H256, None, None, 1),
    "causal-h128-long": ("triton", "triton", H128_RANGED, None, None, 1),
    "plain-h128-medium": ("triton", "triton", H128, None, None, 1),
    "short-keys-h128": ("triton", "triton", H128_RANGED, None, None, 1),
    "short-keys-h64": ("triton", "triton", H64, None, None, 1),
    "odd-q-h64": ("triton", "triton", H64, None, None, 1),
    "small-grid-long-keys": ("triton", "triton", H128, None, None, 16),
    "small-grid-h64": ("triton", "triton", H64, None, None, 1),
    "mqa": ("triton", "triton", H128_RANGED, None, None, 1),
    "f16": ("triton", "triton", H128_RANGED, None, None, 1),
    "f32": ("triton", "triton", F32, None, None, 1),
    "odd-lengths": ("triton", "triton", H128_RANGED, None, None, 1),
    "head-dim-96": ("triton", "triton", H128, None, None, 1),
    "head-dim-32": ("triton", "triton", H64, None, None, 1),
    "bias": ("triton", "triton", H128_MASKED, None, None, 1),
    "mask": ("triton", "triton", H128_MASKED, None, None, 1),
    "mask-causal-f32": ("triton", "triton", F32, None, None, 1),
    "window": ("triton", "triton", H128_FULL_SHORT_RANGED, None, None, 1),
    "window-wide": ("triton", "triton", H128_RANGED, None, None, 1),
    "soft-cap": ("triton", "triton", H128, None, None, 1),
    "segments": ("triton", "triton", H128_FULL_SHORT_RANGED, None, None, 1),
    "kv-lengths": ("triton", "triton", H64, None, None, 1),
    "q-lengths": ("triton", "triton", H64, None, None, 1),
    "block-sizes": ("triton", "triton", dict(block_q=64), None, None, 1),
    "triton": ("triton", "triton", H128_RANGED, None, None, 1),
    "mosaic-h64-short": (ValueError, HOPPER_ONLY),
    "mosaic-backward-tiles": (ValueError, HOPPER_ONLY),
    "mosaic-small-grid": (ValueError, HOPPER_ONLY),
    "unbatched": ("triton", "triton", H128_RANGED, None, None, 1),
    "interpret": ("triton", "triton", INTERPRET, None, None, 1),
    "mosaic-bias": (ValueError, HOPPER_ONLY),
    "mosaic-f32": (ValueError, HOPPER_ONLY),
    "mosaic-forward-tiles": (ValueError, HOPPER_ONLY),
    "dropout": ("triton", "triton", H128_RANGED, None, None, 1),
    "dropout-h64-short": ("triton", "triton", H64, None, None, 1),
    "dropout-h256": ("triton", "triton", H256, None, None, 1),
    "mosaic-dropout-h256": (ValueError, HOPPER_ONLY),
    "decode-t1": ("decode", "triton", H128, None, None, None),
    "decode-t4-masked": ("decode", "triton", H128_FULL_SHORT_RANGED, None, None, None),
    "decode-t16-f16": ("decode", "triton", H64, None, None, None),
    "decode-t17": ("triton", "triton", H128, None, None, 1),
    "decode-short-keys": ("triton", "triton", H128, None, None, 1),
    "decode-t4-b1-4k": ("triton", "triton", H128, None, None, 7),
    "decode-segments": ("triton", "triton", H128_FULL_SHORT_RANGED, None, None, 1),
    "decode-bias": ("triton", "triton", H128_MASKED, None, None, 1),
    "decode-mask": ("triton", "triton", H128_MASKED, None, None, 1),
    "decode-f32": ("triton", "triton", F32, None, None, 1),
    "decode-dropout": ("triton", "triton", H128, None, None, 1),
    "decode-value-head-dim": ("triton", "triton", H256, None, None, 1),
    "decode-triton": ("triton", "triton", H128, None, None, 1),
    "decode-block-sizes": ("triton", "triton", {}, None, None, 1),
}

# The calls above whose forward the decode kernel runs (by default, on any GPU it runs on, and
# in the interpreter).
DECODE_FORWARD = {"decode-t1", "decode-t4-masked", "decode-t16-f16"}
# ... and in the interpreter, which routes calls too small to gain on a GPU.
DECODE_FORWARD_INTERPRETED = {"decode-t4-b1-4k"}


def changed_fields(tiles):
    """The fields of a tile dataclass that differ from its defaults (None stays None)."""
    if tiles is None:
        return None
    default = type(tiles)()
    return {
        f.name: getattr(tiles, f.name)
        for f in dataclasses.fields(tiles)
        if getattr(tiles, f.name) != getattr(default, f.name)
    }


def kv_splits(config, q_shape, k_shape):
    """The Triton forward's split count for the unsharded call (None for the Mosaic forward)."""
    if config.forward != "triton":
        return None
    bs = config.block_sizes
    block_q, block_kv = tile_sizes(bs.block_q, q_shape[1], bs.block_kv, k_shape[1])
    programs = pl.cdiv(q_shape[1], block_q) * q_shape[2] * q_shape[0]
    num_sms = 132 if config.device is None else config.device.num_sms
    return choose_kv_splits(
        bs.kv_splits, programs, pl.cdiv(k_shape[1], block_kv), config.interpret, num_sms=num_sms
    )


@pytest.fixture
def chosen(kernel_configs, tune_cache_path):
    """chosen(device, name) -> the row of the tables for CALLS[name] through the public API
    under `pallas_flash.target(device)` (None: for this host's GPU), recording the KernelConfig
    instead of running. The shipped table only: a user's autotune cache must not change the
    pinned choice."""

    def run(device, name, **extra):
        args, kwargs = CALLS[name]
        kwargs = {**kwargs, **extra}
        scope = contextlib.nullcontext() if device is None else pallas_flash.target(device)
        with scope:
            try:
                jax.eval_shape(
                    lambda q, k, v: pallas_flash.flash_attention(q, k, v, **kwargs), *args
                )
            except (ValueError, NotImplementedError) as e:
                return type(e), str(e)
        (config,) = kernel_configs
        kernel_configs.clear()
        q, k = args[0].shape, args[1].shape
        if len(q) == 3:
            q, k = (1, *q), (1, *k)
        return (
            config.forward,
            config.backward,
            changed_fields(config.block_sizes),
            changed_fields(config.mosaic_forward_tiles),
            changed_fields(config.mosaic_backward_tiles),
            kv_splits(config, q, k),
        )

    return run


def test_the_tables_cover_every_call():
    assert set(H200) == set(A100) == set(CALLS)


@pytest.mark.parametrize("backend", [None, "mosaic"])
def test_wide_heads_take_the_split_mosaic_backward(chosen, backend):
    """H 192 and 256 on the H200: the Mosaic backward with split dK/dV consumers, by default as
    when asked for."""
    for name, tiles in (("plain-h256", MOSAIC_H256), ("causal-h192", dict(split_dkv=True))):
        row = chosen(Device.h200(), name, backend=backend)
        assert row[:2] == ("mosaic", "mosaic") and row[4] == tiles, (name, row)


@pytest.mark.parametrize("name", list(CALLS))
def test_h200_choice_is_pinned(chosen, name):
    assert chosen(Device.h200(), name) == H200[name]


@pytest.mark.parametrize("name", sorted(n for n in CALLS if n.startswith("decode-")))
def test_few_tokens_take_the_decode_forward_on_every_gpu(chosen, name):
    """A few query tokens over a longer key sequence run their forward on the decode kernel on
    the H100, the H200, sm80 and sm89 alike, and in the interpreter (so that the CPU tests run
    what the GPU does): never for a mask or option it cannot express (bias, dense mask,
    segment ids, dropout, a value head dim of its own), nor float32, more than
    DECODE_ROUTE_MAX_Q_LEN tokens, fewer than DECODE_ROUTE_MIN_KV_LEN keys, backend="triton"
    or the user's block_sizes."""
    devices = (
        Device.of_kind("NVIDIA H100 80GB HBM3", num_sms=132),
        Device.h200(),
        Device.a100(),
        Device.of_kind("NVIDIA L4", num_sms=58),
    )
    for device in devices:
        assert (chosen(device, name)[0] == "decode") == (name in DECODE_FORWARD), device
    if not has_gpu():
        routed = name in DECODE_FORWARD or name in DECODE_FORWARD_INTERPRETED
        assert (chosen(None, name, interpret=True)[0] == "decode") == routed


# The calls whose Mosaic backward computes dQ in its dK/dV kernel with deterministic_grads=False
# on the H200: at H 64 and 128 from 2k tokens, with a window or segments at H=128 from 4k plain
# (16k causal) and at H=64 from 16k; not where the fused form does not apply (H 192/256) or the
# Triton backward runs.
FUSED_DQ_CALLS = {
    "causal-h64-16k",
    "small-grid-h64",
    "plain-h128-medium",
    "plain-h64-2k",
    "causal-h64-2k",
    "causal-h128-long",
    "window-wide",
}


@pytest.mark.parametrize("name", list(CALLS))
def test_nondeterministic_grads_fuse_dq_where_it_is_faster(chosen, name):
    """deterministic_grads=False changes the H200's choice only by fused_dq="add" in the Mosaic
    backward's tiles, for the calls where it measured faster; the A100's not at all."""
    row = chosen(Device.h200(), name, deterministic_grads=False)
    expected = H200[name]
    if name in FUSED_DQ_CALLS:
        assert expected[1] == "mosaic", expected
        fused = {**(expected[4] or {}), "fused_dq": "add"}
        if CALLS[name][0][0].shape[-1] > 64:
            fused["step_descriptors"] = True
        expected = (*expected[:4], fused, *expected[5:])
    assert row == expected
    assert chosen(Device.a100(), name, deterministic_grads=False) == A100[name]


def chosen_fused_dq(q_shape, num_kv_heads, *, is_causal, dtype=bf16, deterministic_grads=True):
    """The H200's Mosaic backward's fused_dq for self-attention with queries of q_shape (None:
    the two-kernel backward)."""
    batch, length, _, head_dim = q_shape
    call = Call(
        q_shape=q_shape,
        k_shape=(batch, length, num_kv_heads, head_dim),
        dtype=jnp.dtype(dtype),
        spec=MaskSpec(q_len=length, kv_len=length, is_causal=is_causal),
        deterministic_grads=deterministic_grads,
    )
    config = dispatch.choose(call, Device.h200(), scale=0.1)
    assert config.backward == "mosaic"
    tiles = config.mosaic_backward_tiles
    # The fused dQ's consumers rebuild their descriptors each step where they spill (H=128);
    # the two kernels, and the fused dQ at H=64, hold them.
    assert tiles.step_descriptors == (tiles.fused_dq is not None and head_dim > 64)
    return tiles.fused_dq


@pytest.mark.parametrize(
    "shape, kv_heads, causal, dtype, expected",
    [
        ((1, 16384, 32, 64), 32, True, jnp.bfloat16, "fixed"),
        ((1, 8192, 32, 64), 32, True, jnp.bfloat16, None),
        ((2, 4096, 32, 64), 32, False, jnp.bfloat16, "fixed"),
        ((2, 2048, 32, 64), 32, False, jnp.bfloat16, None),
        ((1, 16384, 16, 128), 16, False, jnp.bfloat16, "fixed"),
        ((2, 8192, 16, 128), 16, False, jnp.bfloat16, "fixed"),
        ((4, 4096, 16, 128), 16, False, jnp.bfloat16, "fixed"),
        ((8, 2048, 16, 128), 16, False, jnp.bfloat16, None),
        ((1, 16384, 16, 128), 16, True, jnp.bfloat16, "fixed"),
        ((2, 8192, 16, 128), 16, True, jnp.bfloat16, "fixed"),
        ((4, 4096, 16, 128), 16, True, jnp.bfloat16, None),
        # GQA as MHA.
        ((2, 4096, 32, 64), 8, False, jnp.bfloat16, "fixed"),
        ((4, 4096, 16, 128), 4, False, jnp.bfloat16, "fixed"),
        ((2, 8192, 16, 128), 4, True, jnp.bfloat16, "fixed"),
        # float16's range cannot hold dS scaled until the dQ sums reach 2^30: two kernels.
        ((2, 4096, 32, 64), 32, False, jnp.float16, None),
    ],
)
def test_deterministic_grads_sum_dq_as_integers_where_it_is_faster(
    tune_cache_path, shape, kv_heads, causal, dtype, expected
):
    """The H200's default (bitwise deterministic) Mosaic backward computes dQ in its dK/dV
    kernel by integer adds (fused_dq="fixed") exactly where that measured faster."""
    assert chosen_fused_dq(shape, kv_heads, is_causal=causal, dtype=dtype) == expected


@pytest.mark.parametrize("name", list(CALLS))
def test_a100_choice_is_pinned(chosen, name):
    assert chosen(Device.a100(), name) == A100[name]


# A Blackwell GPU (compute capability 10.0). The Mosaic kernels are Hopper code (sm_90a's wgmma),
# which sm_100 does not run; until kernels of its own exist (CONTRIBUTING.md, "Adding a GPU
# generation"), every call takes the A100's kernels and tiles (the shipped table has no B200
# entries), with the split-KV count of its own SMs.
B200 = Device.of_kind("NVIDIA B200", num_sms=148)


@pytest.mark.parametrize("name", list(CALLS))
def test_b200_runs_the_triton_kernels_until_it_has_its_own(chosen, name):
    row, a100 = chosen(B200, name), A100[name]
    if a100[0] is ValueError:
        assert row == (ValueError, a100[1].replace("found (8, 0)", "found (10, 0)"))
    else:
        assert row[:5] == a100[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CALLS))
def test_this_gpu_chooses_as_its_record_says(chosen, name):
    """On the GPU itself (no target): on an H200 the pinned table (causal Mosaic rows aside on
    CUDA 12.8.0-12.9.0), and on any GPU what its record chooses."""
    device = Device.current()
    assert device is not None and target_device() == device
    got = chosen(None, name)
    assert got == chosen(device, name)
    miscompiling = device.cuda_runtime_version in range(12080, 12091)
    if device.kind == "NVIDIA H200" and not miscompiling:
        assert device.compute_capability == (9, 0) and device.num_sms == 132
        assert got == H200[name]


# -- the Device record and the target --------------------------------------------------------------


def test_device_records():
    h200 = Device.h200()
    assert (h200.kind, h200.compute_capability, h200.num_sms) == ("NVIDIA H200", (9, 0), 132)
    assert h200.is_hopper and not Device.a100().is_hopper
    assert Device.a100().compute_capability == (8, 0) and Device.a100().num_sms == 108
    # A kind as jax spells it, with its part suffix; the SM count from the abstract device.
    abstract = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    h100 = Device.from_abstract_device(abstract)
    assert (h100.compute_capability, h100.num_sms) == ((9, 0), 132)
    assert Device.from_mesh(AbstractMesh((2,), ("x",), abstract_device=abstract)) == h100
    assert Device.of_kind("NVIDIA A10", num_sms=72).compute_capability == (8, 6)
    with pytest.raises(ValueError, match="'NVIDIA H100 PCIe' is not known: pass num_sms"):
        Device.of_kind("NVIDIA H100 PCIe")
    with pytest.raises(ValueError, match="'Quantum 9000' is not known to pallas_flash"):
        Device.of_kind("Quantum 9000")
    with pytest.raises(ValueError, match="compute_capability='9.0' must be a"):
        Device(kind="x", compute_capability="9.0", num_sms=1)
    with pytest.raises(TypeError, match="target\\(\\) takes a pallas_flash.Device"):
        with pallas_flash.target("NVIDIA H200"):
            pass


@pytest.mark.skipif(has_gpu(), reason="checks the target of a host without a GPU")
def test_target_device_without_a_gpu():
    assert Device.current() is None and target_device() is None
    with pallas_flash.target(Device.a100()):
        assert target_device() == Device.a100()
        assert jax.sharding.get_abstract_mesh().abstract_device.device_kind == Device.a100().kind
    assert target_device() is None
    # jax's own AOT target, an abstract mesh on a GPU: the kernels are chosen for it.
    abstract = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=abstract)):
        assert target_device() == Device.h200()
    for other in (
        AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu"),
        AbstractDevice(device_kind="AMD Instinct MI300X", num_cores=304, platform="gpu"),
    ):
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=other)):
            assert target_device() is None


def test_the_target_keeps_the_mesh_axes():
    mesh = AbstractMesh((1, 1), ("data", "model"))
    with jax.sharding.use_abstract_mesh(mesh), pallas_flash.target(Device.h200()):
        inner = jax.sharding.get_abstract_mesh()
        assert inner.axis_names == ("data", "model") and inner.axis_sizes == (1, 1)
        assert inner.abstract_device == Device.h200().abstract_device()


# -- jax.export for CUDA from a CPU-only host ------------------------------------------------------


def custom_calls(exported) -> list[str]:
    text = re.sub(r'(ir|module) = "[^"]*"', r"\1 = ...", exported.mlir_module())
    return sorted(re.findall(r"stablehlo\.custom_call @(\S+)\(", text))


def triton_kernel_names(exported) -> list[str]:
    text = re.sub(r'ir = "[^"]*"', "ir = ...", exported.mlir_module())
    return sorted(re.findall(r'name = "(pallas_flash_\w+)"', text))


def logits_shaped(exported, q_shape, k_shape) -> bool:
    """Whether the module holds a [B, N, T, S] tensor: the quadratic XLA attention."""
    batch, q_len, num_heads, _ = q_shape
    return f"tensor<{batch}x{num_heads}x{q_len}x{k_shape[1]}x" in exported.mlir_module()


def export_for_cuda(q_shape, k_shape, dtype=jnp.bfloat16, **kwargs):
    """jax.export for CUDA of the forward and the gradients of a causal call."""

    def loss(q, k, v):
        out = pallas_flash.flash_attention(q, k, v, is_causal=True, **kwargs)
        return out.astype(jnp.float32).sum()

    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, k_shape)]
    # Pallas' Triton custom call is not one of jax.export's stable targets: exporting one is
    # the user's explicit choice.
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*shapes)


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_export_for_an_h200_packages_the_mosaic_kernels():
    q_shape, k_shape = (2, 1024, 8, 128), (2, 1024, 2, 128)
    with pallas_flash.target(Device.h200()):
        exported = export_for_cuda(q_shape, k_shape)
    assert exported.platforms == ("cuda",)
    # The forward, the dK/dV and the dQ kernels.
    assert custom_calls(exported) == ["mosaic_gpu_v2"] * 3
    assert not logits_shaped(exported, q_shape, k_shape)


def test_nondeterministic_grads_keep_the_head_splits_of_mqa():
    """MQA whose dK/dV grid the two-kernel backward splits by heads keeps it (the fused dQ's
    staging leaves no shared memory for the splits); GQA at the same length takes the fused."""

    def fused_dq(num_kv_heads):
        return chosen_fused_dq(
            (1, 8192, 32, 64), num_kv_heads, is_causal=False, deterministic_grads=False
        )

    assert fused_dq(1) is None
    assert fused_dq(8) == "add"


def test_nondeterministic_grads_fuse_dq_for_gqa_at_h128_from_2k():
    """GQA at H=128 takes the fused dQ as MHA does, from 2k keys plain or causal (with step
    descriptors it measured 1.06-1.19x the two-kernel backward there; 16k tokens a call, as
    measured: a smaller grid keeps the two kernels' head splits)."""

    def fused_dq(num_kv_heads, length, is_causal=False):
        return chosen_fused_dq(
            (16384 // length, length, 16, 128),
            num_kv_heads,
            is_causal=is_causal,
            deterministic_grads=False,
        )

    for is_causal in (False, True):
        for length in (2048, 4096):
            assert fused_dq(4, length, is_causal) == fused_dq(16, length, is_causal) == "add"
        assert fused_dq(4, 1024, is_causal) is fused_dq(16, 1024, is_causal) is None


@pytest.mark.parametrize("deterministic_grads", [False, True])
@pytest.mark.parametrize("mask", ["window", "segments"])
def test_masked_calls_fuse_dq_only_where_measured_faster(mask, deterministic_grads):
    """With a window or segment ids, deterministic_grads=False takes the fused dQ ("add") at
    H=128 from 4k tokens plain and 16k causal, at H=64 from 16k, as measured (a window of 1024
    keys, 4 packed documents); the deterministic default keeps two kernels ("fixed" measured
    slower on such calls). 16k tokens a call."""

    def fused_dq(length, head_dim, is_causal):
        batch, num_heads = 16384 // length, 2048 // head_dim
        q_shape = (batch, length, num_heads, head_dim)
        window = (1024, 0 if is_causal else 1024) if mask == "window" else None
        call = Call(
            q_shape=q_shape,
            k_shape=q_shape,
            dtype=jnp.dtype(bf16),
            spec=MaskSpec(
                q_len=length,
                kv_len=length,
                is_causal=is_causal,
                window=window,
                has_segments=mask == "segments",
            ),
            deterministic_grads=deterministic_grads,
        )
        config = dispatch.choose(call, Device.h200(), scale=0.1)
        assert config.backward == "mosaic"
        return config.mosaic_backward_tiles.fused_dq

    fused = None if deterministic_grads else "add"
    assert fused_dq(4096, 128, False) == fused_dq(16384, 128, True) == fused
    assert fused_dq(16384, 64, False) == fused_dq(16384, 64, True) == fused
    assert fused_dq(2048, 128, False) is fused_dq(8192, 128, True) is None
    assert fused_dq(8192, 64, False) is fused_dq(8192, 64, True) is None


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_export_of_integer_summed_dq_packages_its_scale_kernels():
    """The default deterministic backward at H=128 from 8k causal keys sums dQ as integers in the
    dK/dV kernel: the export holds the forward, that kernel and the two Triton-lowered kernels
    of its per-row scales (so it needs the Triton check disabled, docs/backends.md), and
    dK and dV's uninitialised buffers, which that kernel writes whole (a stable target)."""
    q_shape = (1, 8192, 8, 128)
    with pallas_flash.target(Device.h200()):
        exported = export_for_cuda(q_shape, q_shape)
    kernels = ["__gpu$xla.gpu.triton"] * 2 + ["mosaic_gpu_v2"] * 2
    assert custom_calls(exported) == ["AllocateBuffer"] * 2 + kernels
    assert triton_kernel_names(exported) == [
        "pallas_flash_fixed_point_keys",
        "pallas_flash_fixed_point_rows",
    ]


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_nondeterministic_grads_export_no_dq_kernel():
    """deterministic_grads=False at H=64: the forward and one dK/dV kernel that also adds dQ
    (and writes dK and dV whole into uninitialised buffers)."""
    q_shape = (1, 4096, 8, 64)
    with pallas_flash.target(Device.h200()):
        exported = export_for_cuda(q_shape, q_shape, deterministic_grads=False)
    assert custom_calls(exported) == ["AllocateBuffer"] * 2 + ["mosaic_gpu_v2"] * 2
    assert not logits_shaped(exported, q_shape, q_shape)


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_export_of_a_masked_call_packages_the_triton_kernels():
    q_shape, k_shape = (2, 1024, 8, 128), (2, 1024, 2, 128)
    mask = jnp.ones((1, 1, 1024, 1024), bool)
    with pallas_flash.target(Device.h200()):
        exported = export_for_cuda(q_shape, k_shape, mask=mask)
    assert custom_calls(exported) == ["__gpu$xla.gpu.triton"] * 3
    assert triton_kernel_names(exported) == [
        "pallas_flash_backward_dkv",
        "pallas_flash_backward_dq",
        "pallas_flash_forward",
    ]
    assert not logits_shaped(exported, q_shape, k_shape)
    # An A100 target: the Triton kernels for the plain call too.
    with pallas_flash.target(Device.a100()):
        exported = export_for_cuda(q_shape, k_shape)
    assert custom_calls(exported) == ["__gpu$xla.gpu.triton"] * 3


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_a_jitted_function_retraces_for_the_target():
    """The target is part of jit's key (through the abstract mesh): the same jitted function
    runs the reference on this host and lowers the kernels for the target."""
    q_shape = (1, 256, 2, 128)
    q = jnp.ones(q_shape, jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=True))
    fn(q, q, q)  # traced and run on this host: the reference
    with pallas_flash.target(Device.h200()):
        exported = jax.export.export(fn, platforms=["cuda"])(q, q, q)
    assert custom_calls(exported) == ["mosaic_gpu_v2"]
    assert fn(q, q, q).shape == q_shape


# -- the tuner chooses through the dispatch ------------------------------------------------------


def test_tuner_times_the_kernels_the_api_runs(monkeypatch):
    """At H=64 below 2048 keys the default call runs the Mosaic forward with the Triton
    backward; the tuner's kernels are the same, and Mosaic backward tiles do not apply there."""
    seen = []

    def record(q, k, v, bias, arrays, config):
        seen.append(config)
        return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    monkeypatch.setattr(tune, "flash_attention_kernels", record)
    shape = (16, 1024, 32, 64)
    kwargs = dict(is_causal=True, block_sizes=BlockSizes(), device=Device.h200())
    fn = tune.mosaic_kernels_fn(shape, jnp.bfloat16, **kwargs)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    jax.eval_shape(fn, q, q, q)
    assert (seen[-1].forward, seen[-1].backward) == ("mosaic", "triton")
    tiles = mosaic.BackwardTiles(num_stages=3)
    assert tune.mosaic_kernels_fn(shape, jnp.bfloat16, backward_tiles=tiles, **kwargs) is None
    # backend="mosaic" (what the tuner's error check and the experiments run): both Mosaic.
    fn = tune.mosaic_kernels_fn(shape, jnp.bfloat16, backend="mosaic", **kwargs)
    jax.eval_shape(fn, q, q, q)
    assert (seen[-1].forward, seen[-1].backward) == ("mosaic", "mosaic")
    # From 2048 keys the default call takes the Mosaic backward, with the candidate tiles.
    long = (4, 4096, 32, 64)
    fn = tune.mosaic_kernels_fn(long, jnp.bfloat16, backward_tiles=tiles, **kwargs)
    q = jax.ShapeDtypeStruct(long, jnp.bfloat16)
    jax.eval_shape(fn, q, q, q)
    assert seen[-1].backward == "mosaic" and seen[-1].mosaic_backward_tiles == tiles


def test_tuner_kernels_take_num_kv_heads(monkeypatch):
    """tune.mosaic_kernels_fn with num_kv_heads (the GQA/MQA experiments): k and v get K heads,
    and backward tiles with head splits reach the Mosaic backward where they divide the group."""
    seen = []

    def record(q, k, v, bias, arrays, config):
        seen.append((k.shape, config))
        return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    monkeypatch.setattr(tune, "flash_attention_kernels", record)
    shape = (8, 2048, 32, 128)
    kwargs = dict(is_causal=True, block_sizes=BlockSizes(), device=Device.h200(), backend="mosaic")
    tiles = mosaic.BackwardTiles(dkv_head_splits=4)
    fn = tune.mosaic_kernels_fn(shape, jnp.bfloat16, backward_tiles=tiles, num_kv_heads=1, **kwargs)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 2048, 1, 128), jnp.bfloat16)
    jax.eval_shape(fn, q, k, k)
    k_shape, config = seen[-1]
    assert k_shape == k.shape and config.backward == "mosaic"
    assert config.mosaic_backward_tiles == tiles
    # 8 CTAs per KV head do not divide a group of 4 (32 query heads over 8 KV heads).
    tiles = mosaic.BackwardTiles(dkv_head_splits=8)
    assert (
        tune.mosaic_kernels_fn(shape, jnp.bfloat16, backward_tiles=tiles, num_kv_heads=8, **kwargs)
        is None
    )


@pytest.mark.parametrize("card, fixed", [("NVIDIA H200", False), ("NVIDIA H100 80GB HBM3", True)])
def test_fixed_dq_thresholds_are_the_cards(tune_cache_path, card, fixed):
    """A plain H=128 call of 2k tokens takes the integer-summed fused dQ on the H100, where it
    measured 1.04x the two kernels, and keeps the two kernels on the H200 (1.00x)."""
    call = Call(
        q_shape=(8, 2048, 16, 128),
        k_shape=(8, 2048, 16, 128),
        dtype=jnp.dtype(bf16),
        spec=MaskSpec(q_len=2048, kv_len=2048),
    )
    config = dispatch.choose(call, Device.of_kind(card, num_sms=132), scale=0.1)
    assert config.backward == "mosaic"
    assert (config.mosaic_backward_tiles.fused_dq == "fixed") == fixed


def test_cached_backward_tiles_serve_deterministic_calls_only(tune_cache_path):
    """An autotune entry's Mosaic backward tiles (measured on the default, deterministic
    backward) reach the default call; deterministic_grads=False keeps the dispatch's f32-add
    fused dQ where that is faster."""
    card = "NVIDIA H100 80GB HBM3"
    tiles = mosaic.BackwardTiles(block_q_dkv=128, block_q_dq=128)
    cls = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=False, masked=False, seq="medium")
    tune_cache.save_tuned(card, {cls: TunedEntry(BlockSizes(), None, tiles)})
    device = Device.of_kind(card, num_sms=132)
    call = Call(
        q_shape=(8, 2048, 32, 64),
        k_shape=(8, 2048, 32, 64),
        dtype=jnp.dtype(bf16),
        spec=MaskSpec(q_len=2048, kv_len=2048),
    )
    assert dispatch.choose(call, device, scale=0.1).mosaic_backward_tiles == tiles
    any_order = dataclasses.replace(call, deterministic_grads=False)
    chosen = dispatch.choose(any_order, device, scale=0.1).mosaic_backward_tiles
    assert chosen.fused_dq == "add"
