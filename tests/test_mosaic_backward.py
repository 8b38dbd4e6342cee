"""The Mosaic GPU backward (pallas_flash.mosaic.backward): lowering for an abstract H200 on CPU,
the shape rules of `why_not`, and gradients against the float64 oracle, in jax's Mosaic
GPU interpreter on CPU (tests/support/mosaic_interpret.py) and on a Hopper GPU.

As for the forward (test_mosaic.py), lowering on CPU runs Pallas' lowering, Mosaic GPU's layout
inference and its dialect lowering (shared-memory budget included) in Python; only the GPU code
generation waits for a real GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.calls import oracle_outputs_and_grads, outputs_and_grads, plain_fn
from support.inputs import Problem, case_id, random_inputs, segment_arrays
from support.kernels import call_mosaic_backward, call_mosaic_forward
from support.mosaic_interpret import interpret_mosaic
from support.oracle import attention_oracle_f64, masked_in_dtype
from support.tolerance import OUTPUT_NAMES, assert_bitwise_equal, assert_within_tolerance
from test_lowering import abstract_inputs, lower_for_h200, mosaic_opaque_i32s
from test_mosaic_forward import (
    GARBAGE,
    abstract_ids,
    custom_call_targets,
    long_only,
    needs_hopper,
)
from test_mosaic_forward import forward_fn as mosaic_forward_fn

import pallas_flash
from pallas_flash import _passes, dispatch, masks, tune_cache
from pallas_flash import device as device_lib
from pallas_flash._passes import KernelConfig
from pallas_flash._vjp import flash_attention_kernels
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles, ForwardTiles, backward_tiles
from pallas_flash.mosaic import fused_dq as fused_dq_module
from pallas_flash.mosaic import launch as mosaic_launch
from pallas_flash.mosaic import schedule as mosaic_schedule
from pallas_flash.mosaic.backward_tiles import default_tiles
from pallas_flash.mosaic.dkv import dkv_mask_sides, q_tile_ranges
from pallas_flash.mosaic.dq import dq_mask_sides, kv_tile_ranges
from pallas_flash.mosaic.tiles import SMEM_BYTES
from pallas_flash.reference import reference_attention
from pallas_flash.triton import BlockSizes


def backward_fn(p: Problem, tiles: BackwardTiles | None = None, **options):
    return functools.partial(
        call_mosaic_backward, scale=p.scale, is_causal=p.is_causal, tiles=tiles, **options
    )


def mosaic_fn(p: Problem, tiles: BackwardTiles | None = None):
    """q, k, v -> (out, lse): the Mosaic forward, differentiated by the Mosaic backward."""

    @jax.custom_vjp
    def attention(q, k, v):
        return call_mosaic_forward(q, k, v, scale=p.scale, is_causal=p.is_causal)

    def fwd(q, k, v):
        out, lse = attention(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def bwd(residuals, cotangents):
        return backward_fn(p, tiles)(*residuals, *cotangents)

    attention.defvjp(fwd, bwd)
    return attention


def abstract_backward_args(p: Problem):
    """q, k, v, out, lse, d_out, d_lse as ShapeDtypeStructs."""
    q, k, v, d_out, lse = abstract_inputs(p)
    return q, k, v, q, lse, d_out, lse


# -- lowering for an abstract H200 (CPU) ----------------------------------------------------------

# H 64, 128, 192 and 256, causal and not, MHA / GQA / MQA, T == S, T < S and T > S, both dtypes.
LOWERING_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(1, 256, 512, 4, 1, 64, True, "f16"),
    Problem(2, 512, 256, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 128, True, "f16"),
    Problem(1, 128, 128, 2, 2, 128, True, "bf16"),
    Problem(1, 1024, 1024, 8, 1, 128, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 256, True, "bf16"),
    Problem(1, 512, 256, 4, 1, 192, False, "f16"),
    pytest.param(Problem(2, 256, 256, 4, 4, 256, False, "f16"), marks=long_only),
    pytest.param(Problem(2, 512, 256, 4, 2, 192, True, "bf16"), marks=long_only),
]


@pytest.mark.parametrize("p", LOWERING_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(3)
def test_lowers_for_h200(p):
    """Two Mosaic GPU calls (dK/dV, dQ) on the inputs as given, no transposes in XLA around
    them; dq [B, T, N, H], dk and dv [B, S, K, H] in the input dtype."""
    lowered = lower_for_h200(backward_fn(p), *abstract_backward_args(p))
    text = lowered.as_text()
    assert custom_call_targets(text) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]
    assert "stablehlo.transpose" not in text
    dq, dk, dv = lowered.out_info
    q, k = abstract_inputs(p)[:2]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)


# Masks: windows causal and not, soft caps, segment ids, combined; T != S; one consumer, three
# stages, 128-row streamed tiles. Lowering runs Mosaic GPU's layout inference on the masks' id
# vectors and selects, which the interpreter does not.
MASKED_LOWERING_CASES = [
    pytest.param(
        Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        None,
    ),
    pytest.param(
        Problem(1, 512, 256, 4, 1, 64, False, "f16"),
        dict(window=(30, 90)),
        BackwardTiles(num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 256, 256, 4, 2, 128, False, "bf16"),
        dict(soft_cap=30.0),
        BackwardTiles(block_kv_dq=128),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 512, 512, 4, 2, 64, True, "bf16"),
        dict(segments=True),
        BackwardTiles(block_q_dkv=128, block_kv_dq=128),
        marks=long_only,
    ),
    # The split dK/dV consumers (defaults at H 192 and 256) with every mask.
    pytest.param(
        Problem(2, 256, 512, 4, 2, 256, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        None,
    ),
    pytest.param(
        Problem(1, 512, 256, 4, 1, 192, False, "f16"),
        dict(window=(30, 90), segments=True),
        None,
        marks=long_only,
    ),
    # Head splits: f32 partials from both consumers, with every mask.
    pytest.param(
        Problem(2, 256, 512, 4, 1, 128, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        BackwardTiles(dkv_head_splits=4),
    ),
]


@pytest.mark.parametrize("p, options, tiles", MASKED_LOWERING_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_lowers_with_masks(p, options, tiles):
    options = dict(options)
    segments = options.pop("segments", False)

    def backward(q, k, v, out, lse, d_out, d_lse, *ids):
        return call_mosaic_backward(
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            scale=p.scale,
            is_causal=p.is_causal,
            segment_ids=ids or None,
            tiles=tiles,
            **options,
        )

    ids = abstract_ids(p) if segments else ()
    lowered = lower_for_h200(backward, *abstract_backward_args(p), *ids)
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]


# Tiles other than the defaults that fit the register budget of `mosaic.backward_tiles.why_not`;
# dK/dV consumers split by accumulator at H 64 and 128 too (128-row streamed tiles fit there),
# and at H=192 with one dQ consumer and a third stage.
OTHER_TILES = [
    (64, BackwardTiles(num_consumers=1)),
    (128, BackwardTiles(num_consumers=1)),
    (64, BackwardTiles(num_stages=3)),
    (128, BackwardTiles(num_stages=3)),
    (64, BackwardTiles(block_q_dkv=128, block_kv_dq=128)),
    (128, BackwardTiles(block_kv_dq=128)),
    (128, BackwardTiles(split_dkv=True, block_q_dkv=128)),
    (64, BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1)),
    (192, BackwardTiles(split_dkv=True, num_consumers=1, num_stages=3)),
    # A KV head's group over two CTAs (f32 partials), and the automatic choice, which splits
    # the small grids of these tests as far as the group goes.
    (128, BackwardTiles(dkv_head_splits=2)),
    (64, BackwardTiles(num_consumers=1, dkv_head_splits=0)),
    (128, BackwardTiles(split_dkv=True, dkv_head_splits=2)),
    # K and V addressed through an opaque zero (descriptors rebuilt each step), split or not.
    (128, BackwardTiles(step_descriptors=True)),
    (64, BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1, step_descriptors=True)),
]
# Lowered with PALLAS_FLASH_SWEEP only (CI lowers one split tile).
SWEEP_ONLY_TILES = [OTHER_TILES[i] for i in (7, 8, 11, 13)]


@pytest.mark.parametrize(
    "head_dim, tiles",
    [x if x not in SWEEP_ONLY_TILES else pytest.param(*x, marks=long_only) for x in OTHER_TILES],
    ids=case_id,
)
@pytest.mark.ci_slice(2)
def test_lowers_with_other_tiles(head_dim, tiles):
    p = Problem(1, 512, 512, 4, 2, head_dim, True, "bf16")
    lowered = lower_for_h200(backward_fn(p, tiles), *abstract_backward_args(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]


def test_forward_and_backward_lower_to_three_mosaic_calls():
    """The custom function of the GPU tests: the forward kernel and the two backward kernels."""
    p = Problem(2, 256, 512, 4, 2, 128, True, "bf16")
    lowered = lower_for_h200(
        functools.partial(outputs_and_grads, mosaic_fn(p)), *abstract_inputs(p)
    )
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"] * 3


def kernel_config(p: Problem) -> KernelConfig:
    return KernelConfig(
        spec=MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal),
        scale=p.scale,
        block_sizes=None,
        interpret=False,
        forward="mosaic",
        backward="mosaic",
    )


def kernels_fn(p: Problem):
    """q, k, v -> (out, lse) through the library's custom_vjp with both Mosaic opt-ins."""
    config = kernel_config(p)
    return lambda q, k, v: flash_attention_kernels(q, k, v, None, MaskArrays(), config)


def test_kernel_config_opt_in_lowers_to_mosaic_only():
    """KernelConfig(backward="mosaic"): the custom_vjp's backward runs the Mosaic kernels."""
    p = Problem(2, 256, 256, 4, 2, 64, False, "bf16")
    lowered = lower_for_h200(
        functools.partial(outputs_and_grads, kernels_fn(p)), *abstract_inputs(p)
    )
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"] * 3


# (T, S) and windows for the range checks below: T == S, T < S, T > S, ragged lengths; windows
# one-sided, two-sided, narrow (rows without keys when T > S) and wider than the sequences.
RANGE_LENGTHS = [(256, 256), (256, 512), (512, 256), (200, 136), (136, 328)]
RANGE_WINDOWS = [None, (0, 0), (5, 3), (100, 30), (127, 0), (0, 90), (10**6, 40)]
RANGE_TILES = [
    BackwardTiles(),
    BackwardTiles(num_consumers=1),
    BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    # Split dK/dV consumers: one key block per CTA, one range for both.
    BackwardTiles(split_dkv=True, block_q_dkv=128),
]


@pytest.mark.parametrize(
    "q_len, kv_len, tiles",
    [
        # A fixed slice in CI, the rest with PALLAS_FLASH_SWEEP.
        pytest.param(q_len, kv_len, tiles, marks=() if (i + j) % 5 == 0 else long_only)
        for i, (q_len, kv_len) in enumerate(RANGE_LENGTHS)
        for j, tiles in enumerate(RANGE_TILES)
    ],
    ids=case_id,
)
def test_geometry_tile_ranges_match_the_mask(q_len, kv_len, tiles):
    """The ranges the kernels compute from the geometry (no segment ids), against brute force
    over causal and windows. dK/dV: per consumer's keys, the query tiles holding a row (< T)
    that sees some of them lie in [lo, hi), tiles in [full_lo, full_hi) are seen whole by every
    row < T, the CTA streams the hull of its consumers' ranges; without a side that
    `dkv_mask_sides` reports, the masked and drained loops of that side are empty. dQ the
    same per consumer's rows over KV tiles, where keys past S count as hidden."""
    rows_q, rows_kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    for is_causal in (False, True):
        for window in RANGE_WINDOWS:
            spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window)
            seen = np.asarray(spec.geometry(rows_q, rows_kv)) & np.ones((q_len, kv_len), bool)
            case = (is_causal, window)
            # -- dK/dV: per consumer's keys, over query tiles of block_q_dkv rows --
            block_q, block_kv = tiles.block_q_dkv, tiles.block_kv_dkv
            num_q = -(-q_len // block_q)
            before, after = dkv_mask_sides(spec, tiles)
            for cta_start in range(0, kv_len, tiles.cta_kv_rows):
                hull = set()
                for kv_start in range(cta_start, cta_start + tiles.cta_kv_rows, block_kv):
                    (first, end), ranges = q_tile_ranges(spec, tiles, cta_start, kv_start)
                    first, end = int(first), int(end)
                    lo, full_lo, full_hi, hi = (int(x) for x in ranges)
                    assert first <= lo <= full_lo <= full_hi <= hi <= end <= max(num_q, first)
                    keys = seen[:, kv_start : kv_start + block_kv]
                    padded = np.zeros((num_q * block_q, keys.shape[1]), bool)
                    padded[:q_len] = keys
                    by_tile = padded.reshape(num_q, block_q, -1)
                    visited = np.flatnonzero(by_tile.any(axis=(1, 2)))
                    assert all(lo <= t < hi for t in visited), (case, kv_start, ranges)
                    for t in range(full_lo, full_hi):
                        rows = min(block_q, q_len - t * block_q)
                        assert by_tile[t, :rows].all(), (case, kv_start, t)
                    assert before or lo == full_lo == first, (case, kv_start)
                    assert after or full_hi == hi == end, (case, kv_start)
                    hull |= set(range(lo, hi))
                assert hull <= set(range(first, end)), (case, cta_start)
                assert not hull or (min(hull), max(hull) + 1) == (first, end), (case, cta_start)
            # -- dQ: per consumer's rows, over KV tiles of block_kv_dq keys --
            block_q, block_kv = tiles.block_q_dq, tiles.block_kv_dq
            num_kv = -(-kv_len // block_kv)
            before, after = dq_mask_sides(spec, tiles)
            for cta_start in range(0, q_len, tiles.cta_q_rows):
                hull = set()
                for q_start in range(cta_start, cta_start + tiles.cta_q_rows, block_q):
                    (first, end), ranges = kv_tile_ranges(spec, tiles, cta_start, q_start)
                    first, end = int(first), int(end)
                    lo, full_lo, full_hi, hi = (int(x) for x in ranges)
                    assert first <= lo <= full_lo <= full_hi <= hi <= end <= max(num_kv, first)
                    rows = seen[q_start : q_start + block_q]
                    padded = np.zeros((rows.shape[0], num_kv * block_kv), bool)
                    padded[:, :kv_len] = rows
                    by_tile = padded.reshape(rows.shape[0], num_kv, block_kv)
                    visited = np.flatnonzero(by_tile.any(axis=(0, 2)))
                    assert all(lo <= t < hi for t in visited), (case, q_start, ranges)
                    for t in range(full_lo, full_hi):
                        assert by_tile[:, t].all(), (case, q_start, t)
                    assert before or lo == full_lo == first, (case, q_start)
                    assert after or full_hi == hi == end, (case, q_start)
                    hull |= set(range(lo, hi))
                assert hull <= set(range(first, end)), (case, cta_start)
                assert not hull or (min(hull), max(hull) + 1) == (first, end), (case, cta_start)


# -- why_not / validation ---------------------------------------------------------------

BF16 = jnp.bfloat16


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_supports_accepts(head_dim, is_causal):
    # Any lengths: ragged last tiles, lengths below one tile, lengths that are not multiples of 8.
    for q_len, kv_len in ((3000, 3000), (197, 197), (1, 1), (130, 333), (64, 1000)):
        shapes = (1, q_len, 4, head_dim), (1, kv_len, 2, head_dim)
        assert backward_tiles.why_not(*shapes, BF16, is_causal=is_causal) is None
    assert (
        backward_tiles.why_not(
            (2, 256, 8, head_dim), (2, 512, 2, head_dim), BF16, is_causal=is_causal
        )
        is None
    )
    assert (
        backward_tiles.why_not(
            (1, 128, 1, head_dim), (1, 128, 1, head_dim), jnp.float16, is_causal=is_causal
        )
        is None
    )


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, reason",
    [
        ((1, 0, 4, 128), (1, 1024, 4, 128), BF16, "q_len=0 and kv_len=1024 must be positive"),
        ((1, 256, 4, 128), (1, 0, 4, 128), BF16, "kv_len=0 must be positive"),
        (
            (1, 256, 4, 112),
            (1, 256, 4, 112),
            BF16,
            "head_dim=112 is not one of (64, 80, 96, 128, 192",
        ),
        ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, "dtype float32"),
        ((1, 256, 6, 128), (1, 256, 4, 128), BF16, "num_heads=6 must be divisible by"),
        ((1, 256, 4, 128), (2, 256, 4, 128), BF16, "batch or head dim"),
        ((256, 4, 128), (256, 4, 128), BF16, "must be [B, T, N, H]"),
    ],
)
def test_supports_rejects_with_reason(q_shape, k_shape, dtype, reason):
    for is_causal in (False, True):
        got = backward_tiles.why_not(q_shape, k_shape, dtype, is_causal=is_causal)
        assert got is not None and reason in got, got


def test_supports_rejects_tiles_over_shared_memory():
    tiles = BackwardTiles(num_stages=8)
    got = backward_tiles.why_not(
        (1, 512, 2, 128), (1, 512, 2, 128), BF16, is_causal=False, tiles=tiles
    )
    assert got is not None and "shared memory in dK/dV" in got


@pytest.mark.parametrize(
    "head_dim, tiles, kernel",
    [
        (128, BackwardTiles(block_q_dkv=128), "256 f32 registers per thread in dK/dV"),
        (128, BackwardTiles(block_q_dq=128, num_consumers=1), "256 f32 registers per thread in dQ"),
        (64, BackwardTiles(block_kv_dkv=128, num_consumers=1), "in dK/dV at head_dim=64"),
        # dK and dV of one consumer at H 192 and 256; the dK consumer with 128-row tiles.
        (192, BackwardTiles(), "256 f32 registers per thread in dK/dV"),
        (256, BackwardTiles(num_consumers=1), "320 f32 registers per thread in dK/dV"),
        (256, BackwardTiles(split_dkv=True, block_q_dkv=128), "256 f32 registers per thread"),
        (192, BackwardTiles(split_dkv=True, block_kv_dq=128), "224 f32 registers per thread in dQ"),
    ],
)
def test_supports_rejects_tiles_that_would_spill(head_dim, tiles, kernel):
    shape = (1, 512, 2, head_dim)
    got = backward_tiles.why_not(shape, shape, BF16, is_causal=True, tiles=tiles)
    assert got is not None and kernel in got and "spill" in got, got


def test_default_tiles_fit_shared_memory():
    for head_dim in (64, 128, 192, 256):
        tiles = default_tiles(head_dim)
        for segments in (False, True):
            assert tiles.smem_bytes_dkv(head_dim, 2, segments=segments) <= SMEM_BYTES
            assert tiles.smem_bytes_dq(head_dim, 2, segments=segments) <= SMEM_BYTES


@pytest.mark.parametrize(
    "head_dim, tiles, kernel",
    [
        # Two dQ consumers' Q and dO beside two 64-key K/V stages at H=256.
        (256, BackwardTiles(split_dkv=True), "shared memory in dQ"),
        # A third stage of the split dK/dV ring at H=256.
        (256, BackwardTiles(split_dkv=True, num_consumers=1, num_stages=3), "in dK/dV"),
    ],
)
def test_supports_rejects_split_tiles_over_shared_memory(head_dim, tiles, kernel):
    q_shape, k_shape = (1, 512, 4, head_dim), (1, 512, 2, head_dim)
    got = backward_tiles.why_not(q_shape, k_shape, BF16, is_causal=False, tiles=tiles)
    assert got is not None and kernel in got, got


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q_dkv=96), "block_q_dkv=96 must be a positive multiple of 64"),
        (dict(block_kv_dq=32), "block_kv_dq=32 must be a positive multiple of 64"),
        (dict(block_kv_dkv=320), "block_kv_dkv=320 exceeds the wgmma limit of 256"),
        (dict(num_stages=1), "num_stages=1 must be an int >= 2"),
        (dict(num_consumers=3), "num_consumers=3 must be 1 or 2"),
        (dict(split_dkv=1), "split_dkv=1 must be a bool"),
        (dict(grouped_launch=0), "grouped_launch=0 must be a bool"),
        (dict(step_descriptors=1), "step_descriptors=1 must be a bool"),
        (dict(dkv_head_splits=-1), "dkv_head_splits=-1 must be an int >= 0"),
        (dict(dkv_head_splits=True), "dkv_head_splits=True must be an int >= 0"),
        (dict(dkv_head_splits=2.0), "dkv_head_splits=2.0 must be an int >= 0"),
    ],
)
def test_tiles_validate(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        BackwardTiles(**kwargs)


def test_head_splits_must_divide_the_group():
    tiles = BackwardTiles(dkv_head_splits=3)
    q_shape, k_shape = (1, 512, 8, 128), (1, 512, 2, 128)
    got = backward_tiles.why_not(q_shape, k_shape, BF16, is_causal=True, tiles=tiles)
    assert got is not None and "group of 4 query heads over dkv_head_splits=3" in got, got
    q6 = (1, 512, 6, 128)
    assert backward_tiles.why_not(q6, k_shape, BF16, is_causal=True, tiles=tiles) is None


def test_head_splits_stage_partials_in_shared_memory():
    """Each dK/dV consumer stages its f32 partials in shared memory: tiles that fit without
    head splits may not with them, and the automatic choice then keeps one CTA per group."""
    q_shape, k_shape = (1, 512, 4, 128), (1, 512, 1, 128)
    tiles = BackwardTiles(num_stages=3)
    assert backward_tiles.why_not(q_shape, k_shape, BF16, is_causal=True, tiles=tiles) is None
    split = dataclasses.replace(tiles, dkv_head_splits=2)
    got = backward_tiles.why_not(q_shape, k_shape, BF16, is_causal=True, tiles=split)
    assert got is not None and "shared memory in dK/dV" in got, got
    auto = dataclasses.replace(tiles, dkv_head_splits=0)
    assert backward_tiles.why_not(q_shape, k_shape, BF16, is_causal=True, tiles=auto) is None
    assert backward_tiles.head_splits(auto, q_shape, k_shape, 2, num_sms=132, causal=True) == 1
    # The defaults' staging fits beside the segment ids' buffers at H 64 and 128.
    for head_dim in (64, 128):
        assert (
            default_tiles(head_dim).smem_bytes_dkv(head_dim, 2, segments=True, head_splits=2)
            <= SMEM_BYTES
        )


AUTO = BackwardTiles(dkv_head_splits=0)


@pytest.mark.parametrize(
    "q_shape, k_shape, tiles, causal, splits",
    [
        # MQA, 2k, 16k tokens: 128 CTAs of 128 keys, under one wave of 132 SMs. Causal: 4 CTAs
        # per KV head, the fewest giving two per SM; not causal: one wave is enough.
        ((8, 2048, 32, 128), (8, 2048, 1, 128), AUTO, True, 4),
        ((8, 2048, 32, 128), (8, 2048, 1, 128), AUTO, False, 1),
        # The same at 8k (B=2): 128 CTAs again; at 16k (B=1) 128 as well.
        ((2, 8192, 32, 128), (2, 8192, 1, 128), AUTO, True, 4),
        # GQA 32/8 at 4k: 1024 CTAs fill the GPU already.
        ((4, 4096, 32, 128), (4, 4096, 8, 128), AUTO, True, 1),
        # A small grid: the whole group, no further; MHA never splits.
        ((1, 1024, 2, 128), (1, 1024, 1, 128), AUTO, True, 2),
        ((1, 1024, 2, 128), (1, 1024, 1, 128), AUTO, False, 2),
        ((1, 1024, 4, 128), (1, 1024, 4, 128), AUTO, True, 1),
        # Only divisors of the group: 12 query heads, 8 CTAs need 33 per group: 12; not
        # causal 17 per group, also 12.
        ((1, 1024, 12, 64), (1, 1024, 1, 64), AUTO, True, 12),
        ((1, 1024, 12, 64), (1, 1024, 1, 64), AUTO, False, 12),
        # Ragged S counts whole CTAs: 3000 keys are 24 CTAs, times 11 = 264; not causal the
        # fewest divisor of 22 to one wave (132) is 11 as well.
        ((1, 3000, 22, 128), (1, 3000, 1, 128), AUTO, True, 11),
        ((1, 3000, 22, 128), (1, 3000, 1, 128), AUTO, False, 11),
        # Not causal, 96 CTAs (over half a wave): no split.
        ((6, 2048, 32, 128), (6, 2048, 1, 128), AUTO, False, 1),
        # H 192 and 256: split dK/dV consumers, never split automatically.
        ((8, 2048, 16, 256), (8, 2048, 1, 256), default_tiles(256), True, 1),
        ((8, 2048, 16, 192), (8, 2048, 1, 192), default_tiles(192), True, 1),
        # The default is automatic; what is asked for: as asked.
        ((8, 2048, 32, 128), (8, 2048, 1, 128), BackwardTiles(), True, 4),
        ((4, 4096, 32, 128), (4, 4096, 8, 128), BackwardTiles(dkv_head_splits=2), False, 2),
    ],
)
def test_head_splits(q_shape, k_shape, tiles, causal, splits):
    got = backward_tiles.head_splits(tiles, q_shape, k_shape, 2, num_sms=132, causal=causal)
    assert got == splits


# -- numerics in the Mosaic GPU interpreter (CPU) --------------------------------------------------

# Small problems through every code path: H 64 and 128, causal and not, MHA / GQA / MQA, T < S
# and T > S, consumers that skip causal tiles, 1 and 2 consumers, 2 and 3 stages (rings that
# wrap), 128-row streamed tiles. B=1 and few heads: the interpreter takes seconds per problem.
INTERPRET_PROBLEMS = [
    (Problem(1, 128, 256, 2, 2, 64, False, "bf16"), None),
    pytest.param(Problem(1, 256, 256, 4, 2, 64, True, "f16"), None, marks=long_only),
    (Problem(1, 128, 256, 2, 1, 128, True, "bf16"), None),
    pytest.param(
        Problem(1, 256, 128, 2, 1, 128, True, "bf16"),
        BackwardTiles(num_consumers=1),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 512, 1, 1, 64, False, "bf16"), BackwardTiles(num_stages=3), marks=long_only
    ),
    pytest.param(
        Problem(1, 384, 256, 2, 1, 64, True, "bf16"),
        BackwardTiles(num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 256, 128, 2, 2, 128, False, "f16"), BackwardTiles(num_stages=3), marks=long_only
    ),
    pytest.param(
        Problem(1, 512, 512, 1, 1, 64, True, "bf16"),
        BackwardTiles(block_q_dkv=128, block_kv_dq=128),
        marks=long_only,
    ),
    # H 192 and 256 (split dK/dV consumers; in CI through a masked case,
    # MASK_CI_CASES), with PALLAS_FLASH_SWEEP: causal GQA, T < S and T > S, rings that wrap,
    # the split at H 64 and 128 with 128-row streamed tiles, one dQ consumer with three stages
    # at H=192.
    pytest.param(Problem(1, 128, 128, 2, 1, 256, True, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 128, 192, 2, 1, 192, False, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 128, 256, 4, 2, 256, False, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 256, 128, 2, 1, 256, True, "f16"), None, marks=long_only),
    pytest.param(Problem(1, 256, 256, 4, 1, 192, True, "bf16"), None, marks=long_only),
    pytest.param(Problem(2, 128, 192, 2, 2, 192, False, "f16"), None, marks=long_only),
    pytest.param(
        Problem(1, 256, 256, 2, 1, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, block_q_dkv=128),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 256, 2, 1, 64, True, "bf16"),
        BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 384, 256, 2, 1, 192, True, "bf16"),
        BackwardTiles(split_dkv=True, num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    # Head splits (in CI through a masked case, MASK_CI_CASES): MQA's group of 4 over 2 CTAs
    # (two query heads each); GQA with two KV heads (each CTA's KV head and partials' row),
    # automatic: the whole group, one consumer; with the split dK/dV consumers.
    pytest.param(
        Problem(1, 128, 256, 4, 1, 128, True, "bf16"),
        BackwardTiles(dkv_head_splits=2),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 128, 4, 2, 64, True, "f16"),
        BackwardTiles(num_consumers=1, dkv_head_splits=0),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 384, 256, 4, 2, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, dkv_head_splits=2),
        marks=long_only,
    ),
]


@pytest.mark.parametrize("p, tiles", INTERPRET_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(1)
def test_matches_oracle_interpreted(p, tiles):
    """The Mosaic forward, then the Mosaic backward on its out and lse, both in the interpreter
    (race detector on): out, lse, dq, dk, dv against the float64 oracle. Checks the kernels'
    logic (tile ranges, masks, the lse cotangent, the barrier protocol); registers, layouts and
    ptxas are the GPU tests' part."""
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        out, lse = jax.jit(mosaic_forward_fn(p))(q, k, v)
        out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        grads = jax.jit(backward_fn(p, tiles))(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    results = (np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


def test_grouped_launch_matches_oracle_interpreted(monkeypatch):
    """Causal backward grids launched two heads at a time, level by level, over three heads (a
    smaller last group): dK/dV's and dQ's CTAs each find their (batch, head, tile)."""
    monkeypatch.setattr(mosaic_schedule, "LAUNCH_L2_BYTES", 128 * 1024)
    p = Problem(1, 256, 256, 3, 3, 64, True, "bf16")
    unit_bytes = p.q_len * 2 * p.head_dim * 2  # Q and dO (or K and V) of one head
    assert mosaic_schedule.launch_group(3, unit_bytes, is_causal=True) == 2
    test_matches_oracle_interpreted(p, None)


@pytest.mark.parametrize(
    "units, tiles, group", [(3, 4, 2), (6, 5, 3), (5, 3, 5), (7, 1, 3), (4, 4, 1), (16, 32, 16)]
)
def test_grouped_launch_is_a_permutation_longest_first(units, tiles, group):
    """Every grid position maps to one (unit, tile), a group of units at a time, level by level
    (the tiles' levels in order within a group); group 1 is the grid's own order."""
    order = [
        tuple(
            int(x)
            for x in mosaic_schedule.grouped_launch(u, t, units=units, tiles=tiles, group=group)
        )
        for u in range(units)
        for t in range(tiles)
    ]
    assert sorted(order) == [(u, t) for u in range(units) for t in range(tiles)]
    for first in range(0, units, group):
        members = range(first, min(first + group, units))
        block = order[first * tiles : (first + len(members)) * tiles]
        assert block == [(u, t) for t in range(tiles) for u in members]
    assert mosaic_schedule.launch_group(units, 1 << 30, is_causal=True) == 1
    assert mosaic_schedule.launch_group(units, 1, is_causal=False) == 1
    assert mosaic_schedule.launch_group(units, 1, is_causal=True) == units


@pytest.mark.parametrize(
    "p",
    [
        # test_mosaic_forward's masked default call runs the same path in CI.
        pytest.param(Problem(1, 128, 256, 4, 2, 128, True, "bf16"), marks=long_only),
        pytest.param(Problem(2, 256, 512, 2, 1, 128, False, "f16"), marks=long_only),
        pytest.param(Problem(1, 128, 256, 4, 2, 256, True, "bf16"), marks=long_only),
        pytest.param(Problem(1, 256, 128, 2, 1, 192, False, "bf16"), marks=long_only),
    ],
    ids=case_id,
)
def test_default_call_on_hopper_matches_oracle_interpreted(monkeypatch, p):
    """The public call as a Hopper runs it (backend=None: the Mosaic forward and backward),
    the whole custom_vjp in the interpreter: validation, dispatch, residuals, delta and the GQA
    head mapping, against the float64 oracle."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@long_only
def test_tuned_tiles_through_the_default_call_match_oracle_interpreted(
    monkeypatch, tune_cache_path
):
    """Mosaic tiles from the autotune cache reach both kernels through the public call (a
    spy records them) and the result still matches the float64 oracle."""
    p = Problem(1, 256, 256, 2, 1, 64, True, "bf16")
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    forward = ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    backward = BackwardTiles(num_stages=3, block_kv_dq=128)
    shape_class = tune_cache.ShapeClass.of(
        64, jnp.bfloat16, is_causal=True, q_len=256, kv_len=256, masked=False
    )
    entry = tune_cache.TunedEntry(BlockSizes(), forward, backward)
    tune_cache.save_tuned(Device.h200().kind, {shape_class: entry})
    used = []
    for table, tiles in (
        (_passes._FORWARDS, "mosaic_forward_tiles"),
        (_passes._BACKWARDS, "mosaic_backward_tiles"),
    ):
        original = table["mosaic"]

        def spy(*args, original=original, tiles=tiles, config, **kwargs):
            used.append(getattr(config, tiles))
            return original(*args, config=config, **kwargs)

        monkeypatch.setitem(table, "mosaic", spy)
    # H=64 takes the Mosaic backward below 2k keys only when asked for.
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True, backend="mosaic"
    )
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = jax.jit(functools.partial(outputs_and_grads, attention))(q, k, v, d_out, d_lse)
        results = [np.asarray(x.astype(jnp.float32)) for x in results]
    assert used == [forward, backward]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# -- numerics on a Hopper GPU ---------------------------------------------------------------------

# B=2, GQA (N=4, K=2) and MQA, H 64, 128, 192 and 256, causal and not; T < S and T > S.
GPU_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 64, True, "f16"),
    Problem(2, 256, 256, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "f16"),
    Problem(2, 512, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 64, False, "f16"),
    Problem(2, 1024, 1024, 4, 1, 128, True, "bf16"),
    Problem(2, 256, 256, 4, 2, 256, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 256, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 256, True, "f16"),
    Problem(2, 512, 256, 4, 1, 256, True, "bf16"),
    Problem(2, 1024, 1024, 4, 2, 256, True, "bf16"),
    Problem(2, 256, 256, 4, 2, 192, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 192, False, "bf16"),
    Problem(2, 512, 256, 4, 1, 192, True, "f16"),
    Problem(2, 1024, 1024, 4, 4, 192, True, "bf16"),
]


def check_against_oracle(p: Problem, tiles: BackwardTiles | None = None):
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    run = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=case_id)
def test_matches_oracle(p):
    """out, lse (Mosaic forward) and dq, dk, dv (Mosaic backward) against the float64 oracle."""
    needs_hopper()
    check_against_oracle(p)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tiles", OTHER_TILES, ids=case_id)
def test_matches_oracle_with_other_tiles(head_dim, tiles):
    needs_hopper()
    check_against_oracle(Problem(2, 512, 512, 4, 2, head_dim, True, "bf16"), tiles)
    check_against_oracle(Problem(1, 256, 512, 4, 1, head_dim, False, "f16"), tiles)


@pytest.mark.gpu
def test_kernel_config_opt_in_matches_oracle():
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    results = jax.jit(functools.partial(outputs_and_grads, kernels_fn(p)))(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# The split dK/dV consumers with head splits fit the shared memory only at H <= 128 (at 192
# the f32 partials' staging does not; the automatic rule leaves 192 unsplit).
DETERMINISM_GPU_CASES = [
    (128, None),
    (192, None),
    (256, None),
    (128, BackwardTiles(dkv_head_splits=4)),
    (128, BackwardTiles(split_dkv=True, dkv_head_splits=2)),
]


@pytest.mark.parametrize("head_dim, tiles", DETERMINISM_GPU_CASES, ids=case_id)
def test_deterministic_cases_fit(head_dim, tiles):
    """test_deterministic's tiles are ones the kernels take (budgets checked before tracing)."""
    p = Problem(2, 512, 512, 8, 2, head_dim, True, "bf16")
    q, k = (p.batch, p.q_len, p.num_heads, head_dim), (p.batch, p.kv_len, p.num_kv_heads, head_dim)
    assert backward_tiles.why_not(q, k, BF16, is_causal=True, tiles=tiles) is None


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tiles", DETERMINISM_GPU_CASES, ids=case_id)
def test_deterministic(head_dim, tiles):
    """Bitwise the same over repeated runs: a race on a staged shared-memory buffer (the split
    dK/dV consumers at H 192 and 256 stage through each other's K and V) shows first as a
    run-to-run difference."""
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, head_dim, True, "bf16")
    args, _ = random_inputs(p)
    fn = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))
    first = fn(*args)
    for _ in range(10):
        assert_bitwise_equal(fn(*args), first)


# MQA and GQA with the dK/dV kernel's head splits: asked for and automatic (0: the whole group
# on these grids, far under one wave), causal and not, T != S, H 64 and 128, both dtypes.
HEAD_SPLIT_GPU_CASES = [
    (Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=4)),
    (Problem(2, 512, 1024, 8, 2, 128, False, "f16"), BackwardTiles(dkv_head_splits=2)),
    (Problem(2, 1024, 512, 16, 1, 64, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (Problem(1, 2048, 2048, 16, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, dkv_head_splits=2),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p, tiles", HEAD_SPLIT_GPU_CASES, ids=case_id)
def test_head_splits_match_oracle(p, tiles):
    needs_hopper()
    check_against_oracle(p, tiles)


@pytest.mark.parametrize(
    "spec_options, soft_cap",
    [
        (dict(window=(8, 8)), None),
        (dict(window=(100, 0)), None),
        (dict(has_segments=True), None),
        ({}, 30.0),
        (dict(window=(64, 0), has_segments=True), 20.0),
    ],
)
def test_the_dispatch_gives_the_mosaic_backward_every_mask_of_the_forward(spec_options, soft_cap):
    """Windows, segment ids (and lengths), soft caps: the Mosaic forward and backward, with
    backend=None and backend="mosaic"."""
    call = Call(
        q_shape=(1, 256, 2, 128),
        k_shape=(1, 256, 2, 128),
        dtype=jnp.bfloat16,
        spec=MaskSpec(q_len=256, kv_len=256, is_causal=True, **spec_options),
        soft_cap=soft_cap,
    )
    for backend in (None, "mosaic"):
        config = dispatch.choose(call, Device.h200(), scale=0.1, backend=backend)
        assert (config.forward, config.backward) == ("mosaic", "mosaic")


@pytest.mark.parametrize(
    "spec_options, has_bias", [({}, True), (dict(mask_shape=(1, 1, 256, 256)), False)]
)
def test_the_dispatch_never_gives_the_mosaic_backward_what_it_would_drop(spec_options, has_bias):
    """A bias or dense mask keeps the whole call on Triton (None) or is refused
    (backend="mosaic")."""
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=True, **spec_options)
    call = Call(
        q_shape=(1, 256, 2, 128),
        k_shape=(1, 256, 2, 128),
        dtype=jnp.bfloat16,
        spec=spec,
        has_bias=has_bias,
    )
    assert backward_tiles.unsupported_options(spec, soft_cap=None, has_bias=has_bias)
    assert dispatch.choose(call, Device.h200(), scale=0.1).backward == "triton"
    with pytest.raises(NotImplementedError, match="backend='mosaic' does not support"):
        dispatch.choose(call, Device.h200(), scale=0.1, backend="mosaic")


# -- any T and S, head dims 80 and 96 -------------------------------------------------------------

RAGGED_LOWERING_PROBLEMS = [
    Problem(1, 3000, 3000, 4, 2, 128, True, "bf16"),
    Problem(2, 197, 197, 4, 4, 96, False, "bf16"),
    pytest.param(Problem(1, 2048, 2048, 4, 4, 80, False, "f16"), marks=long_only),
    pytest.param(Problem(1, 577, 300, 2, 1, 64, True, "bf16"), marks=long_only),
    pytest.param(Problem(1, 3, 5, 2, 1, 128, False, "bf16"), marks=long_only),
]


@pytest.mark.parametrize("p", RAGGED_LOWERING_PROBLEMS, ids=case_id)
def test_lowers_with_any_lengths_and_head_dims(p):
    """Two Mosaic GPU calls; dq, dk, dv at the caller's T, S and H."""
    lowered = lower_for_h200(backward_fn(p), *abstract_backward_args(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]
    dq, dk, dv = lowered.out_info
    q, k = abstract_inputs(p)[:2]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)


# (problem, tiles, oob_fill): padded by the wrapper (T = 130 to 136, S = 197 to 200; H = 96 as
# it is), then ragged last tiles in the kernels (a last query tile of 8 rows in dK/dV, a last key
# tile of 8 keys in dQ) with garbage past the arrays' ends; in place with T = 136, S = 328;
# causal with T > S and GQA; one consumer and three stages at H=80; 3 queries and 5 keys.
RAGGED_INTERPRET_PROBLEMS = [
    (Problem(1, 130, 197, 2, 1, 96, False, "bf16"), None, GARBAGE),
    pytest.param(Problem(1, 136, 328, 2, 1, 64, False, "bf16"), None, GARBAGE, marks=long_only),
    pytest.param(Problem(1, 333, 130, 4, 2, 96, True, "f16"), None, 0, marks=long_only),
    pytest.param(
        Problem(1, 200, 200, 2, 1, 80, True, "bf16"),
        BackwardTiles(num_consumers=1, num_stages=3),
        GARBAGE,
        marks=long_only,
    ),
    pytest.param(Problem(1, 3, 5, 2, 2, 128, False, "bf16"), None, GARBAGE, marks=long_only),
]


@long_only  # slow in the interpreter: outside CI
@pytest.mark.parametrize("p, tiles, oob_fill", RAGGED_INTERPRET_PROBLEMS, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle_interpreted(p, tiles, oob_fill):
    """The Mosaic forward and backward at ragged lengths and narrow head dims, with garbage
    past the arrays' ends where given: out, lse, dq, dk, dv against the float64 oracle."""
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic(oob_fill=oob_fill):
        out, lse = jax.jit(mosaic_forward_fn(p))(q, k, v)
        out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        grads = jax.jit(backward_fn(p, tiles))(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    results = (np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# Through the public call as a Hopper runs it: the forward and both backward kernels are Mosaic
# at these shapes.
@pytest.mark.parametrize(
    "p, mosaic_calls",
    [
        # A ragged last tile at 3000 tokens: Mosaic.
        (Problem(1, 3000, 3000, 16, 8, 128, True, "bf16"), 3),
        (Problem(4, 2048, 2048, 16, 16, 96, False, "bf16"), 3),
        pytest.param(Problem(4, 2048, 2048, 16, 16, 80, True, "bf16"), 3, marks=long_only),
        # Ragged below 1024 tokens (dispatch.MOSAIC_RAGGED_MIN_LEN): Triton.
        pytest.param(Problem(64, 197, 197, 12, 12, 64, False, "bf16"), 0, marks=long_only),
        pytest.param(Problem(16, 577, 577, 16, 16, 128, False, "bf16"), 0, marks=long_only),
        pytest.param(Problem(2, 1024, 1024, 16, 4, 192, True, "bf16"), 3, marks=long_only),
    ],
    ids=case_id,
)
def test_default_call_on_hopper_takes_mosaic_at_narrow_head_dims(monkeypatch, p, mosaic_calls):
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets.count("mosaic_gpu_v2") == mosaic_calls, targets


@pytest.mark.parametrize(
    "p",
    [
        pytest.param(Problem(1, 197, 197, 4, 2, 80, True, "bf16"), marks=long_only),
        pytest.param(Problem(2, 130, 200, 2, 1, 128, False, "f16"), marks=long_only),
    ],
    ids=case_id,
)
def test_mosaic_call_at_any_lengths_matches_oracle_interpreted(monkeypatch, p):
    """The public call on a Hopper with backend="mosaic" (the default takes Triton below 1024
    ragged tokens) at a length that is not a multiple of 8 and H=80: the Mosaic forward and
    backward, whole custom_vjp, in the interpreter."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, backend="mosaic"
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# Shapes that real models use (Llama at an odd length, Phi at H 80 / 96, ViT at 197 and 577
# tokens), T != S, a few queries.
RAGGED_GPU_PROBLEMS = [
    Problem(1, 3000, 3000, 2, 1, 128, True, "bf16"),
    Problem(2, 2048, 2048, 4, 2, 96, True, "bf16"),
    Problem(2, 2048, 2048, 4, 4, 80, False, "f16"),
    Problem(4, 197, 197, 4, 4, 64, False, "bf16"),
    Problem(2, 577, 577, 4, 4, 128, False, "bf16"),
    Problem(2, 577, 300, 4, 2, 64, True, "bf16"),
    Problem(2, 130, 333, 4, 2, 128, False, "bf16"),
    Problem(2, 3, 5, 4, 2, 96, False, "bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p", RAGGED_GPU_PROBLEMS, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle(p):
    """out, lse (Mosaic forward) and dq, dk, dv (Mosaic backward) against the float64 oracle.
    The kernels are called directly."""
    needs_hopper()
    check_against_oracle(p)


@pytest.mark.gpu
def test_default_call_at_3000_tokens_takes_mosaic_and_matches_oracle():
    """backend=None at T = S = 3000, causal, H=128: ragged last tiles on the Mosaic forward and
    backward (three Mosaic calls in the lowered program), against the float64 oracle."""
    needs_hopper()
    p = Problem(1, 3000, 3000, 4, 2, 128, True, "bf16")
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True
    )
    run = jax.jit(functools.partial(outputs_and_grads, attention))
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    targets = custom_call_targets(run.lower(q, k, v, d_out, d_lse).as_text())
    assert targets.count("mosaic_gpu_v2") == 3, targets
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# -- windows, soft caps, segment ids and lengths --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MaskCase:
    """A masked call: `kind` a support.inputs.segment_arrays kind (segment ids with lengths folded
    in) or None; scale None for 1/sqrt(H) (soft caps at scale 1, so that the cap bites); poison:
    the kernels get K and V with NaN and inf at the keys that no row sees."""

    p: Problem
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    kind: str | None = None
    scale: float | None = None
    tiles: BackwardTiles | None = None
    poison: bool = False

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec(
            q_len=self.p.q_len,
            kv_len=self.p.kv_len,
            is_causal=self.p.is_causal,
            window=self.window,
            has_segments=self.kind is not None,
        )

    @property
    def logit_scale(self) -> float:
        return self.p.scale if self.scale is None else self.scale

    def arrays(self) -> MaskArrays:
        if self.kind is None:
            return MaskArrays()
        return segment_arrays(self.kind, self.p.batch, self.p.q_len, self.p.kv_len)

    def __str__(self):
        parts = [str(self.p)]
        for name in ("window", "soft_cap", "kind", "scale"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        if self.tiles is not None:
            parts.append(case_id(self.tiles).replace("BackwardTiles", ""))
        if self.poison:
            parts.append("nan-at-hidden-keys")
        return "-".join(parts)


def mask_options(c: MaskCase, arrays: MaskArrays) -> dict:
    """The mask keywords of the Mosaic forward and backward (`support.kernels`) for case c."""
    segment_ids = (arrays.q_segment_ids, arrays.kv_segment_ids) if c.kind is not None else None
    return dict(window=c.window, soft_cap=c.soft_cap, segment_ids=segment_ids)


def check_masked_backward(c: MaskCase, *, interpreted: bool, mosaic_forward: bool):
    """The Mosaic backward of case c against the float64 oracle, with plain attention in the
    input dtype as the tolerance baseline. Residuals from the Mosaic forward (checked too) or,
    to keep the interpreter's time to the backward, from the library's "xla" reference (f32
    softmax, out in the input dtype). With c.poison the kernels get K and V with NaN and inf
    at the keys that no row sees and must give the gradients of the clean inputs. Rows that see
    no key have dq exactly 0, keys that no row sees dk and dv exactly 0."""
    p, scale, spec, arrays = c.p, c.logit_scale, c.spec, c.arrays()
    (q, k_clean, v_clean, d_out, d_lse), f64 = random_inputs(p)
    k, v = hidden_key_poison(c) if c.poison else (k_clean, v_clean)
    options = mask_options(c, arrays)
    visible = np.asarray(masks.dense(spec, arrays))  # [B|1, 1, T, S]
    oracle = attention_oracle_f64(*f64, scale=scale, visible=visible, soft_cap=c.soft_cap)

    def reference(q, k, v):
        return reference_attention(
            q, k, v, None, arrays, spec=spec, scale=scale, soft_cap=c.soft_cap
        )

    plain = functools.partial(masked_in_dtype, scale=scale, visible=visible, soft_cap=c.soft_cap)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(
        q, k_clean, v_clean, d_out, d_lse
    )
    forward = functools.partial(call_mosaic_forward, scale=scale, is_causal=p.is_causal, **options)
    backward = functools.partial(
        call_mosaic_backward, scale=scale, is_causal=p.is_causal, tiles=c.tiles, **options
    )
    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        if mosaic_forward:
            out, lse = jax.jit(forward)(q, k, v)
            out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        else:
            out, lse = jax.jit(reference)(q, k_clean, v_clean)
        grads = jax.jit(backward)(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    names = ("dq", "dk", "dv")
    results = grads
    if mosaic_forward:
        names = ("out", "lse", *names)
        results = [np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads]
    for name, x in zip(("dq", "dk", "dv"), grads, strict=True):
        assert np.isfinite(x).all(), f"{name}: {np.sum(~np.isfinite(x))} non-finite values"
    dq, dk, dv = grads
    empty_rows = np.broadcast_to(~visible.any(axis=-1)[:, 0], (p.batch, p.q_len))  # [B, T]
    hidden_keys = np.broadcast_to(~visible.any(axis=-2)[:, 0], (p.batch, p.kv_len))  # [B, S]
    assert (dq[empty_rows] == 0).all(), "rows that see no key must have dq exactly 0"
    assert (dk[hidden_keys] == 0).all() and (dv[hidden_keys] == 0).all(), "hidden keys"
    oracles = [oracle[name] for name in names]
    baselines = [baselines[OUTPUT_NAMES.index(name)] for name in names]
    assert_within_tolerance(results, baselines, oracles, floor=p.floor, names=names)


# In CI: small backward-only cases through most of the new paths (windows, a soft cap, packed
# documents with q and kv lengths, NaN at hidden keys, GQA, T != S, one consumer, H=256's split
# consumers, head splits). The rest, with the Mosaic forward's residuals too, runs with
# PALLAS_FLASH_SWEEP.
MASK_CI_CASES = [
    # H=256, its defaults: the dK/dV consumers split by accumulator (P^T * dcap handed over,
    # the dK consumer's own mask on dS^T against NaN in V at hidden keys, one tile range for
    # both, the plan of one key block per CTA) and one dQ consumer.
    MaskCase(
        Problem(2, 128, 192, 1, 1, 256, False, "bf16"),
        window=(30, 60),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        poison=True,
    ),
    # Head splits: each KV head's group of 2 over 2 CTAs (f32 partials summed in XLA), GQA with
    # two KV heads, causal with a window, packed documents, NaN at hidden keys (and at keys
    # 64-127, which no row sees: T < S).
    MaskCase(
        Problem(2, 64, 128, 4, 2, 64, True, "bf16"),
        window=(40, 0),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1, dkv_head_splits=2),
        poison=True,
    ),
    # A ragged last query tile, causal, T < S: keys T..63 are hidden from every row but lie
    # inside the geometry of the tile's rows past T, whose dS^T would carry V's NaN into dK.
    MaskCase(Problem(1, 61, 99, 2, 1, 64, True, "bf16"), poison=True),
]

# A ragged last KV tile; NaN at hidden keys with causal and a window; windows left-only /
# right-only / both, narrow ones leaving rows and whole CTAs without keys
# (T > S), wider than S; soft caps alone and causal; every segment kind (q lengths, kv lengths
# with a batch entry without keys, unsorted ids, a gap both consumers drain); H 64 and 128, f16,
# MQA and GQA; 1 consumer, 3 stages, 128-row streamed tiles.
MASK_SWEEP_CASES = [
    # Keys 67-255 of entry 0 (in a tile that rows of its second document see) and all keys of
    # entry 1 hold NaN and inf.
    MaskCase(
        Problem(2, 192, 256, 2, 1, 64, False, "bf16"),
        window=(30, 60),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1),
        poison=True,
    ),
    MaskCase(
        Problem(1, 256, 384, 2, 1, 64, True, "bf16"),
        window=(100, 0),
        soft_cap=10.0,
        scale=1.0,
    ),
    MaskCase(
        Problem(2, 256, 200, 2, 1, 64, False, "bf16"),
        window=(30, 60),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1),
    ),
    MaskCase(
        Problem(2, 256, 256, 2, 1, 64, True, "bf16"), window=(80, 0), kind="lengths", poison=True
    ),
    MaskCase(Problem(1, 256, 512, 2, 1, 128, False, "bf16"), window=(64, 32)),
    MaskCase(Problem(1, 256, 512, 2, 2, 64, False, "f16"), window=(70, 10**6)),
    MaskCase(Problem(1, 256, 256, 2, 1, 128, False, "bf16"), window=(10**6, 40)),
    MaskCase(Problem(1, 512, 128, 2, 1, 64, True, "bf16"), window=(1, 0)),
    MaskCase(Problem(1, 384, 128, 2, 1, 128, False, "f16"), window=(10, 3)),
    MaskCase(Problem(1, 256, 256, 2, 1, 128, False, "bf16"), soft_cap=5.0, scale=1.0),
    MaskCase(Problem(1, 256, 512, 4, 2, 64, True, "f16"), soft_cap=30.0, scale=1.0),
    MaskCase(Problem(2, 256, 256, 2, 1, 128, True, "bf16"), kind="packed"),
    MaskCase(Problem(2, 256, 384, 2, 2, 64, False, "bf16"), kind="lengths"),
    MaskCase(Problem(2, 384, 256, 2, 1, 64, True, "bf16"), kind="packed-lengths"),
    MaskCase(Problem(1, 256, 256, 2, 1, 64, False, "bf16"), kind="unsorted"),
    MaskCase(
        Problem(1, 256, 512, 2, 1, 64, False, "bf16"),
        kind="gap",
        tiles=BackwardTiles(num_stages=3),
    ),
    MaskCase(
        Problem(1, 512, 512, 2, 1, 64, True, "bf16"),
        window=(70, 0),
        tiles=BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    ),
    MaskCase(
        Problem(2, 512, 256, 2, 1, 128, True, "bf16"),
        window=(64, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(num_consumers=1, num_stages=3),
    ),
    # The split dK/dV consumers: the defaults at H 192 and 256 with windows, soft caps and
    # segment ids (NaN at hidden keys), at H=64 with 128-row streamed tiles and 3 stages.
    MaskCase(
        Problem(1, 192, 256, 2, 1, 256, True, "bf16"),
        window=(40, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        poison=True,
    ),
    MaskCase(Problem(1, 256, 128, 2, 1, 192, False, "bf16"), window=(20, 70), kind="gap"),
    MaskCase(
        Problem(1, 384, 256, 2, 1, 64, True, "bf16"),
        window=(90, 0),
        kind="unsorted",
        tiles=BackwardTiles(split_dkv=True, block_q_dkv=128, num_stages=3),
    ),
    # Head splits with every mask, automatic (the whole group of 4 here), and beside the split
    # dK/dV consumers.
    MaskCase(
        Problem(2, 256, 200, 4, 1, 128, True, "bf16"),
        window=(60, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(dkv_head_splits=0),
    ),
    MaskCase(
        Problem(1, 256, 256, 4, 2, 64, False, "bf16"),
        window=(20, 70),
        kind="gap",
        tiles=BackwardTiles(split_dkv=True, dkv_head_splits=2),
    ),
]


@pytest.mark.parametrize("c", MASK_CI_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_masked_matches_oracle_interpreted(c):
    """Windows, soft caps, segment ids and lengths in the Mosaic GPU interpreter (race
    detector on): the tile ranges and plans, drain steps, element-wise masks, the soft cap's
    derivative, rows without keys (dq 0) and keys no row sees (dk, dv 0)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


@long_only
@pytest.mark.parametrize("c", MASK_CI_CASES + MASK_SWEEP_CASES, ids=case_id)
def test_masked_forward_and_backward_match_oracle_interpreted(c):
    """The Mosaic forward, then the Mosaic backward on its out and lse (the reference's
    residuals where K and V hold NaN: the Mosaic forward lets NaN in V at a hidden key reach
    the rows of its tile, test_nan_safety.py)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=not c.poison)


def hidden_key_poison(c: MaskCase):
    """K and V of case c with NaN and +-inf at the keys that no row sees (past the kv lengths,
    of a segment no query has)."""
    p, arrays = c.p, c.arrays()
    visible = np.asarray(masks.dense(c.spec, arrays))
    hidden = np.broadcast_to(~visible.any(axis=-2)[:, 0], (p.batch, p.kv_len))
    (_, k, v, _, _), _ = random_inputs(p)
    values = np.array([np.nan, np.inf, -np.inf])
    k_bad, v_bad = np.asarray(k, np.float32).copy(), np.asarray(v, np.float32).copy()
    b_idx, s_idx = np.nonzero(hidden)
    for j, (b, s) in enumerate(zip(b_idx, s_idx)):
        k_bad[b, s, :, j % 3 :: 5] = values[j % 3]
        v_bad[b, s, :, (j + 1) % 3 :: 7] = values[(j + 1) % 3]
    return jnp.asarray(k_bad, k.dtype), jnp.asarray(v_bad, v.dtype)


# Through the public call as a Hopper runs it: three Mosaic GPU calls (the forward, dK/dV, dQ)
# for each mask the Mosaic forward takes.
PUBLIC_MASKED_CALLS = [
    (Problem(1, 256, 256, 4, 2, 128, True, "bf16"), dict(local_window_size=(100, 0))),
    (Problem(1, 256, 512, 4, 2, 128, False, "bf16"), dict(logits_soft_cap=20.0)),
    (
        Problem(2, 256, 256, 4, 2, 128, True, "bf16"),
        dict(key_value_seq_lengths=np.array([200, 37]), query_seq_lengths=np.array([256, 99])),
    ),
]


def public_masked_fn(p: Problem, options: dict):
    return functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, **options
    )


@long_only
@pytest.mark.parametrize("p, options", PUBLIC_MASKED_CALLS, ids=case_id)
def test_default_masked_call_on_hopper_lowers_to_mosaic(monkeypatch, p, options):
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    fn = functools.partial(outputs_and_grads, public_masked_fn(p, options))
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets


def check_public_masked_call(p: Problem, options, results, inputs, f64):
    """The public masked call's results (out, lse, dq, dk, dv) against the float64 oracle of
    the same mask, within twice the xla backend's error."""
    xla = functools.partial(outputs_and_grads, public_masked_fn(p, {**options, "backend": "xla"}))
    baselines = jax.jit(xla)(*inputs)
    arrays = masks.make_arrays(
        p.batch,
        p.q_len,
        p.kv_len,
        query_seq_lengths=options.get("query_seq_lengths"),
        key_value_seq_lengths=options.get("key_value_seq_lengths"),
    )
    spec = MaskSpec(
        q_len=p.q_len,
        kv_len=p.kv_len,
        is_causal=p.is_causal,
        window=options.get("local_window_size"),
        has_segments=arrays.q_segment_ids is not None,
    )
    visible = np.asarray(masks.dense(spec, arrays))
    oracle = attention_oracle_f64(
        *f64, scale=p.scale, visible=visible, soft_cap=options.get("logits_soft_cap")
    )
    assert_within_tolerance(results, baselines, [oracle[n] for n in OUTPUT_NAMES], floor=p.floor)


@long_only
@pytest.mark.parametrize("p, options", PUBLIC_MASKED_CALLS, ids=case_id)
def test_default_masked_call_on_hopper_matches_oracle_interpreted(monkeypatch, p, options):
    """backend=None on a Hopper with a window, a soft cap, lengths: validation, dispatch,
    residuals and the mask arrays through the custom_vjp to the Mosaic kernels."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    fn = functools.partial(outputs_and_grads, public_masked_fn(p, options))
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    check_public_masked_call(p, options, results, (q, k, v, d_out, d_lse), f64)


# -- on a Hopper GPU --

# B=2, GQA and MQA, H 64, 128, 192 and 256, T == S, T < S, T > S; windows causal and not (rows
# and CTAs without keys), soft caps, every segment kind, combinations; other tiles (the split
# dK/dV consumers at H 192 and 256 by default, and at H=128).
MASK_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"), window=(300, 0)),
    MaskCase(Problem(2, 512, 1024, 4, 2, 128, False, "bf16"), window=(200, 300)),
    MaskCase(Problem(2, 1024, 256, 4, 1, 64, False, "bf16"), window=(1, 0)),
    MaskCase(Problem(2, 512, 512, 4, 2, 64, True, "f16"), window=(100, 0)),
    MaskCase(Problem(2, 512, 512, 4, 2, 128, False, "bf16"), soft_cap=5.0, scale=1.0),
    MaskCase(Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"), soft_cap=30.0, scale=1.0),
    MaskCase(Problem(2, 512, 512, 4, 2, 128, False, "bf16"), kind="packed"),
    MaskCase(Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"), kind="packed-lengths"),
    MaskCase(Problem(2, 512, 1024, 4, 2, 128, True, "f16"), kind="lengths"),
    MaskCase(Problem(2, 512, 512, 4, 1, 128, False, "bf16"), kind="unsorted"),
    MaskCase(Problem(2, 512, 1024, 4, 2, 64, False, "bf16"), kind="gap"),
    MaskCase(
        Problem(2, 1024, 512, 4, 2, 128, True, "bf16"),
        window=(128, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
    ),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"),
        window=(300, 0),
        tiles=BackwardTiles(num_stages=3),
    ),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"),
        window=(70, 0),
        kind="packed",
        tiles=BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    ),
    MaskCase(
        Problem(2, 512, 512, 4, 2, 128, False, "bf16"),
        window=(30, 90),
        soft_cap=10.0,
        scale=1.0,
        tiles=BackwardTiles(num_consumers=1),
    ),
    MaskCase(
        Problem(2, 1024, 512, 4, 2, 256, True, "bf16"),
        window=(128, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
    ),
    MaskCase(Problem(2, 512, 1024, 4, 1, 256, False, "f16"), window=(200, 300)),
    MaskCase(Problem(2, 512, 512, 4, 2, 192, True, "bf16"), kind="lengths", soft_cap=10.0),
    MaskCase(Problem(2, 512, 1024, 4, 2, 192, False, "bf16"), kind="gap"),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"),
        window=(70, 0),
        kind="packed",
        tiles=BackwardTiles(split_dkv=True, block_q_dkv=128),
    ),
    # Head splits with masks: MQA over 4 CTAs per KV head, automatic on GQA.
    MaskCase(
        Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"),
        window=(300, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(dkv_head_splits=4),
    ),
    MaskCase(
        Problem(2, 512, 1024, 8, 2, 64, False, "bf16"),
        window=(200, 300),
        kind="gap",
        tiles=BackwardTiles(dkv_head_splits=0),
    ),
    # The dQ kernel's producer cleans the masked K tiles (no XLA pass over K): causal with T !=
    # S at H=128, a window with packed documents at H=64, NaN and inf at hidden keys.
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(producer_cleans_k=True),
        poison=True,
    ),
    MaskCase(
        Problem(2, 1000, 1300, 4, 2, 64, False, "bf16"),
        window=(200, 300),
        kind="packed-lengths",
        tiles=BackwardTiles(producer_cleans_k=True),
        poison=True,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", MASK_GPU_CASES, ids=case_id)
def test_masked_matches_oracle(c):
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c",
    [
        MaskCase(
            Problem(2, 512, 512, 4, 2, 128, True, "bf16"),
            window=(200, 0),
            kind="lengths",
            poison=True,
        ),
        MaskCase(Problem(2, 384, 512, 4, 2, 64, False, "bf16"), kind="packed-lengths", poison=True),
        MaskCase(
            Problem(2, 384, 512, 4, 2, 256, True, "bf16"),
            window=(100, 0),
            soft_cap=10.0,
            kind="packed-lengths",
            scale=1.0,
            poison=True,
        ),
    ],
    ids=case_id,
)
def test_nan_at_hidden_keys_reaches_no_gradient(c):
    """Backward only, from the reference's residuals of the clean inputs (the Mosaic forward
    lets NaN in V at a hidden key reach the rows of its tile: test_nan_safety.py)."""
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=False)


@pytest.mark.gpu
@pytest.mark.parametrize("index", [11, 15])
def test_masked_deterministic(index):
    needs_hopper()
    c = MASK_GPU_CASES[index]
    (q, k, v, d_out, d_lse), _ = random_inputs(c.p)
    options = mask_options(c, c.arrays())
    out, lse = call_mosaic_forward(q, k, v, scale=c.logit_scale, is_causal=c.p.is_causal, **options)
    backward = jax.jit(
        functools.partial(
            call_mosaic_backward, scale=c.logit_scale, is_causal=c.p.is_causal, **options
        )
    )
    args = (q, k, v, out, lse, d_out, d_lse)
    assert_bitwise_equal(backward(*args), backward(*args))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, options",
    [
        *PUBLIC_MASKED_CALLS,
        (Problem(2, 2048, 2048, 8, 2, 128, True, "bf16"), dict(local_window_size=(512, 0))),
        (Problem(4, 2048, 2048, 8, 8, 64, False, "bf16"), dict(logits_soft_cap=30.0)),
    ],
    ids=case_id,
)
def test_default_masked_call_takes_mosaic_and_matches_oracle(p, options):
    """backend=None on the H200: three Mosaic calls, values and gradients against the
    float64 oracle."""
    needs_hopper()
    fn = jax.jit(functools.partial(outputs_and_grads, public_masked_fn(p, options)))
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    targets = custom_call_targets(fn.lower(q, k, v, d_out, d_lse).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    results = fn(q, k, v, d_out, d_lse)
    check_public_masked_call(p, options, results, (q, k, v, d_out, d_lse), f64)


# -- dQ in the dK/dV kernel (BackwardTiles.fused_dq) ----------------------------------------------

# "slab" (each kv tile's partial apart, summed by XLA) runs the kernel of "add" but for the
# store: the interpreter has no TMA reductions. Causal GQA with a window, packed documents and
# lengths, NaN at hidden keys, three query tiles (the last ragged), head splits; two consumers
# taking turns at dQ's partial, with steps that one of them drains (the causal diagonal).
FUSED_CI_CASE = MaskCase(
    Problem(2, 130, 128, 4, 2, 64, True, "bf16"),
    window=(40, 0),
    kind="packed-lengths",
    tiles=BackwardTiles(dkv_head_splits=2, fused_dq="slab"),
    poison=True,
)
# H=128: each consumer computes its half of dQ^T's rows a step late (`fused_dq_rows`).
FUSED_CI_HALVES = MaskCase(
    Problem(1, 192, 256, 4, 2, 128, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# Non-causal, one KV head, a ragged T.
FUSED_CI_PLAIN = MaskCase(
    Problem(1, 200, 256, 2, 1, 64, False, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# Causal with S > T + 128: no row sees the last CTA's keys, whose dK and dV (zeros; f32
# partials, as the small grid is split by heads) its consumers still write: the outputs start
# uninitialised (NaN in the interpreter; a CTA that stored nothing fails this case).
FUSED_CI_UNSEEN_KEYS = MaskCase(
    Problem(1, 128, 384, 2, 1, 64, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# "fixed_slab": the integer partials of "fixed" (dS^T scaled by each row's 2^e, int32),
# stored apart. Causal halves at H=128 with a ragged T and NaN in K and V at the keys past T
# (in no row's bound); non-causal turns at H=64 with a soft cap and T != S.
FUSED_CI_FIXED = MaskCase(
    Problem(1, 200, 256, 4, 2, 128, True, "bf16"),
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
FUSED_CI_FIXED_CAPPED = MaskCase(
    Problem(2, 130, 200, 2, 1, 64, False, "bf16"),
    soft_cap=10.0,
    scale=1.0,
    tiles=BackwardTiles(fused_dq="fixed_slab"),
)
# A window (left and right of the diagonal, T != S): each row's bound from the keys inside it,
# NaN and inf past T outside every row's.
FUSED_CI_FIXED_WINDOW = MaskCase(
    Problem(1, 130, 200, 2, 1, 64, False, "bf16"),
    window=(50, 30),
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
# Packed documents with lengths: each row's bound from its own segment's keys (NaN and inf in
# other segments and past the lengths reach no row's).
FUSED_CI_FIXED_SEGMENTS = MaskCase(
    Problem(3, 200, 256, 4, 2, 64, True, "bf16"),  # batch 2's rows reach other documents' keys
    kind="packed-lengths",
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
# The consumers' K, V (and the fused dQ's K^T and dS^T tiles) addressed through an opaque zero
# (`BackwardTiles.step_descriptors`, which the dispatch gives every fused dQ): "fixed_slab"'s
# causal halves at H=128 (its step -1 of zeros included), "slab"'s turns at H=64 with head
# splits, the two-kernel backward's plan of packed documents.
STEP_DESCRIPTOR_CASES = [
    dataclasses.replace(
        FUSED_CI_FIXED, tiles=BackwardTiles(fused_dq="fixed_slab", step_descriptors=True)
    ),
    dataclasses.replace(
        FUSED_CI_CASE,
        tiles=BackwardTiles(dkv_head_splits=2, fused_dq="slab", step_descriptors=True),
    ),
    MaskCase(
        Problem(2, 130, 128, 4, 2, 64, True, "bf16"),
        window=(40, 0),
        kind="packed-lengths",
        tiles=BackwardTiles(step_descriptors=True),
        poison=True,
    ),
]
FUSED_SWEEP_CASES = [
    dataclasses.replace(
        FUSED_CI_CASE, tiles=BackwardTiles(num_consumers=1, dkv_head_splits=2, fused_dq="slab")
    ),
    dataclasses.replace(
        FUSED_CI_CASE,
        p=Problem(2, 130, 256, 4, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="slab"),
    ),
    MaskCase(
        Problem(2, 130, 200, 2, 1, 64, False, "f16"),
        window=(50, 30),
        soft_cap=10.0,
        scale=1.0,
        tiles=BackwardTiles(fused_dq="slab"),
    ),
]


@pytest.mark.parametrize(
    "c",
    [
        FUSED_CI_CASE,
        FUSED_CI_HALVES,
        FUSED_CI_PLAIN,
        FUSED_CI_UNSEEN_KEYS,
        FUSED_CI_FIXED,
        FUSED_CI_FIXED_CAPPED,
        FUSED_CI_FIXED_WINDOW,
        FUSED_CI_FIXED_SEGMENTS,
        *(pytest.param(c, marks=long_only) for c in FUSED_SWEEP_CASES),
    ],
    ids=case_id,
)
def test_fused_dq_matches_oracle_interpreted(c):
    """dQ from the dK/dV kernel's steps (K^T dS^T per step, stored per block of keys) against
    the float64 oracle, masks, NaN at hidden keys and rows without keys included."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


# The dQ kernel's producer zeroes NaN and inf in the K tiles a consumer masks (no XLA pass over
# K): causal GQA with a window, packed documents and lengths, NaN and inf at hidden keys, two
# consumers (tiles that only one masks) and one.
PRODUCER_CLEANS_K_CASES = [
    dataclasses.replace(FUSED_CI_CASE, tiles=BackwardTiles(producer_cleans_k=True)),
    dataclasses.replace(
        FUSED_CI_FIXED, tiles=BackwardTiles(producer_cleans_k=True, num_consumers=1)
    ),
]


@pytest.mark.parametrize("c", PRODUCER_CLEANS_K_CASES, ids=case_id)
def test_producer_cleans_k_matches_oracle_interpreted(c):
    """BackwardTiles.producer_cleans_k: the hidden keys' NaN and inf reach no row's dQ without
    the XLA pass over K (a producer that skips the clean fails the poisoned cases)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


@pytest.mark.parametrize("c", STEP_DESCRIPTOR_CASES, ids=case_id)
def test_step_descriptors_match_oracle_interpreted(c):
    """BackwardTiles.step_descriptors: the same buffers through an index that is always 0 (a
    1 would read the other consumer's keys and dS^T, or past the buffers)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


def test_step_descriptors_keep_the_step_opaque_to_llvm(monkeypatch):
    """A plain call's loop runs over constant bounds, from which LLVM bounded the step and
    folded `(step + 1) >> 31` to 0 (the H200's plain "fixed" kernel compiled to the same
    instructions with step_descriptors as without): the step reaches the shift through an
    empty inline asm tied to its register, which LLVM cannot see through."""
    p = Problem(1, 256, 256, 2, 2, 128, False, "bf16")
    opaque_steps = [
        mosaic_opaque_i32s(
            monkeypatch,
            backward_fn(p, BackwardTiles(fused_dq="fixed", step_descriptors=step_descriptors)),
            *abstract_backward_args(p),
        )
        for step_descriptors in (False, True)
    ]
    assert opaque_steps[0] == 0 and opaque_steps[1] >= 2, opaque_steps


def test_opaque_zero_is_zero_from_step_minus_one():
    steps = jnp.array([-1, 0, 1, 2**20, 2**31 - 2], jnp.int32)
    assert np.all(np.asarray(mosaic_launch.opaque_zero(steps)) == 0)
    assert int(mosaic_launch.opaque_zero(jnp.int32(-2))) == 1


@pytest.mark.parametrize(
    "p, tiles",
    [
        (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), BackwardTiles(fused_dq="add")),
        (Problem(1, 256, 192, 4, 1, 64, True, "f16"), BackwardTiles(fused_dq="add")),
        (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), BackwardTiles(fused_dq="fixed")),
        (Problem(1, 256, 192, 4, 1, 64, False, "bf16"), BackwardTiles(fused_dq="fixed")),
        (
            Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
            BackwardTiles(fused_dq="fixed", step_descriptors=True),
        ),
        pytest.param(
            Problem(1, 256, 192, 4, 1, 64, False, "f16"),
            BackwardTiles(fused_dq="add", num_consumers=1, dkv_head_splits=2),
            marks=long_only,
        ),
    ],
    ids=case_id,
)
def test_fused_dq_lowers_for_h200(monkeypatch, p, tiles):
    """One Mosaic GPU call (no dQ kernel), whose consumers add their partials by TMA
    reductions ("fixed": after the two Triton kernels of its row scales) into dQ's zeros, and
    write dK and dV whole into uninitialised buffers (AllocateBuffer, no zeros); dq [B, T, N,
    H] in the input dtype."""
    calls = []

    def spy(name):
        real = getattr(fused_dq_module.plgpu, name)

        def traced(*args, **kwargs):
            calls.append(kwargs.get("reduction_op", name))
            return real(*args, **kwargs)

        monkeypatch.setattr(fused_dq_module.plgpu, name, traced)

    spy("copy_smem_to_gmem")
    lowered = lower_for_h200(backward_fn(p, tiles), *abstract_backward_args(p))
    scales = ["__gpu"] * 2 if tiles.fixed_point_dq else []  # __gpu$xla.gpu.triton
    allocations = ["AllocateBuffer"] * 2  # dK and dV (or their partials)
    assert custom_call_targets(lowered.as_text()) == [*scales, *allocations, "mosaic_gpu_v2"]
    assert "add" in calls
    dq = lowered.out_info[0]
    q = abstract_inputs(p)[0]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)


def test_fused_dq_tiles_validate():
    with pytest.raises(ValueError, match="fused_dq='sum' must be one of"):
        BackwardTiles(fused_dq="sum")
    with pytest.raises(ValueError, match="fused_dq needs split_dkv=False"):
        BackwardTiles(fused_dq="add", split_dkv=True)
    with pytest.raises(ValueError, match="producer_cleans_k is the dQ kernel's"):
        BackwardTiles(fused_dq="add", producer_cleans_k=True)
    with pytest.raises(ValueError, match="producer_cleans_k=1 must be a bool"):
        BackwardTiles(producer_cleans_k=1)
    why = functools.partial(
        backward_tiles.why_not, is_causal=True, tiles=BackwardTiles(fused_dq="add")
    )
    shapes = ((1, 256, 4, 96), (1, 256, 4, 96))
    assert "fused_dq needs a multiple of 64" in why(*shapes, jnp.bfloat16)
    shapes = ((1, 256, 4, 128), (1, 256, 4, 128))
    assert "not tested with dropout" in why(*shapes, jnp.bfloat16, dropout=True)
    assert why(*shapes, jnp.bfloat16) is None
    for mode in ("fixed", "fixed_slab"):
        fixed = functools.partial(why, tiles=BackwardTiles(fused_dq=mode))
        assert fixed(*shapes, jnp.bfloat16, window=(64, 0)) is None
        assert fixed(*shapes, jnp.bfloat16, segments=True) is None
        assert "bfloat16 only, not float16" in fixed(*shapes, jnp.float16)
        assert fixed(*shapes, jnp.bfloat16) is None
    # The staging tiles count in shared memory: with head splits' partials too they overflow.
    split = BackwardTiles(fused_dq="add", dkv_head_splits=2)
    assert "bytes of shared memory" in why(
        *((1, 256, 4, 128), (1, 256, 2, 128)), jnp.bfloat16, tiles=split
    )
    # One consumer at H=128 would hold dQ's whole partial of the step before beside S^T.
    alone = BackwardTiles(fused_dq="add", num_consumers=1)
    assert "224 f32 registers" in why(*shapes, jnp.bfloat16, tiles=alone)
    assert why(*((1, 256, 4, 64), (1, 256, 4, 64)), jnp.bfloat16, tiles=alone) is None


def test_fixed_dq_keeps_rows_of_a_huge_lse_in_range_interpreted():
    """Logits of 2^23 (|lse| ~ 8.4e6), where the backward's recomputed P is high by up to e^2
    (`_numerics.slack`, documented): "fixed_slab"'s dQ equals the two-kernel backward's
    within rounding instead of wrapping around int32."""
    batch, q_len, kv_len, heads, head_dim = 1, 64, 256, 1, 64
    c, a = 1024.0, 2.0**14
    alt = np.tile([1.0, -1.0], head_dim // 2)
    sign = np.tile([1.0, -1.0], kv_len // 2)
    q = np.full((batch, q_len, heads, head_dim), c)
    k = (c + sign[:, None] * a * alt[None, :])[None, :, None, :]
    v = np.broadcast_to(sign[:, None], (kv_len, head_dim))[None, :, None, :]
    d_out = np.ones((batch, q_len, heads, head_dim))
    q, k, v, d_out = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, d_out))
    scale = 0.125
    logits = np.einsum("bthd,bshd->bhts", np.float64(q), np.float64(k)) * scale
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    assert np.abs(lse).min() > 2.0**22
    p = np.exp(logits - lse[..., None])
    out = jnp.asarray(np.einsum("bhts,bshd->bthd", p, np.float64(v)), jnp.bfloat16)
    lse = jnp.asarray(lse, jnp.float32)

    def dq(tiles):
        fn = functools.partial(call_mosaic_backward, scale=scale, is_causal=False, tiles=tiles)
        with interpret_mosaic():
            return np.asarray(jax.jit(fn)(q, k, v, out, lse, d_out, None)[0], np.float32)

    default, fixed = dq(None), dq(BackwardTiles(fused_dq="fixed_slab"))
    assert np.isfinite(fixed).all()
    np.testing.assert_allclose(fixed, default, rtol=2e-2, atol=1e-2 * np.abs(default).max())


FUSED_ADD = BackwardTiles(fused_dq="add")
FUSED_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"), tiles=FUSED_ADD),
    MaskCase(Problem(2, 512, 1024, 8, 2, 128, False, "f16"), tiles=FUSED_ADD),
    MaskCase(Problem(2, 1024, 777, 8, 8, 64, True, "bf16"), tiles=FUSED_ADD),
    MaskCase(
        Problem(2, 512, 512, 4, 2, 128, True, "bf16"),
        window=(200, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=FUSED_ADD,
        poison=True,
    ),
    # MQA with head splits: one consumer at H=64 (at H=128 one consumer would hold 224
    # registers with dQ's partial beside S^T, two the splits' staging over shared memory).
    MaskCase(
        Problem(1, 2048, 2048, 16, 1, 64, True, "bf16"),
        tiles=BackwardTiles(fused_dq="add", num_consumers=1, dkv_head_splits=4),
    ),
    MaskCase(Problem(2, 512, 512, 4, 2, 64, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")),
    # With the descriptors rebuilt each step, as the dispatch takes it.
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="add", step_descriptors=True),
        poison=True,
    ),
]
FUSED_FIXED = BackwardTiles(fused_dq="fixed")
FUSED_FIXED_MASKED_GPU_CASES = [
    # Windows: causal (Mistral's sliding window) at H=128 with step descriptors, and both sides
    # of the diagonal at H=64 with T != S.
    MaskCase(
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        window=(300, 0),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(1, 1000, 1500, 4, 2, 64, False, "bf16"),
        window=(200, 300),
        tiles=FUSED_FIXED,
        poison=True,
    ),
    # Segment ids with sequence lengths (packed documents): each row's bound from its segment's
    # keys, key by key; causal at H=128, and plain at H=64 with T != S.
    MaskCase(
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        kind="packed-lengths",
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(2, 1000, 1300, 4, 2, 64, False, "bf16"),
        kind="packed-lengths",
        tiles=FUSED_FIXED,
        poison=True,
    ),
]
# "fixed": causal and not, ragged T and S, T != S, GQA, a soft cap, one consumer taking every
# step with head splits, NaN and inf at keys past the diagonal.
FUSED_FIXED_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"), tiles=FUSED_FIXED),
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(Problem(2, 512, 1024, 8, 2, 128, False, "bf16"), tiles=FUSED_FIXED),
    MaskCase(Problem(2, 1024, 777, 8, 8, 64, True, "bf16"), tiles=FUSED_FIXED, poison=True),
    MaskCase(
        Problem(2, 2048, 1500, 8, 2, 64, False, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(1, 1000, 1500, 4, 2, 128, False, "bf16"),
        soft_cap=20.0,
        scale=1.0,
        tiles=FUSED_FIXED,
    ),
    MaskCase(
        Problem(1, 2048, 2048, 16, 1, 64, True, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", num_consumers=1, dkv_head_splits=4),
    ),
    *FUSED_FIXED_MASKED_GPU_CASES,
]


# "add" on the same masked calls: what the dispatch gives windows and packed documents with
# deterministic_grads=False.
FUSED_ADD_MASKED_GPU_CASES = [
    dataclasses.replace(c, tiles=dataclasses.replace(c.tiles, fused_dq="add"))
    for c in FUSED_FIXED_MASKED_GPU_CASES
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c", FUSED_GPU_CASES + FUSED_FIXED_GPU_CASES + FUSED_ADD_MASKED_GPU_CASES, ids=case_id
)
def test_fused_dq_matches_oracle(c):
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=not c.poison)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, is_causal", [(64, True), (128, False)])
def test_nondeterministic_grads_match_the_deterministic_ones(head_dim, is_causal):
    """deterministic_grads=False through the public API (the fused dQ, `dispatch`): dK and dV
    equal to those of the default call (the same products in the same order), dQ within
    float32 rounding of its adds."""
    needs_hopper()
    shape = (1, 4096, 4, head_dim)
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def grads(deterministic_grads):
        def out(q, k, v):
            return pallas_flash.flash_attention(
                q, k, v, is_causal=is_causal, deterministic_grads=deterministic_grads
            )

        return jax.jit(lambda *a: jax.vjp(out, *a)[1](d_out))(q, k, v)

    (dq, dk, dv), (dq_fast, dk_fast, dv_fast) = grads(True), grads(False)
    for fast, default in ((dk_fast, dk), (dv_fast, dv)):
        np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(default, np.float32))
    dq, dq_fast = (np.asarray(x, np.float32) for x in (dq, dq_fast))
    assert np.all(np.isfinite(dq_fast))
    assert np.max(np.abs(dq_fast - dq)) <= 1e-2 * np.max(np.abs(dq))


@pytest.mark.gpu
def test_default_grads_sum_dq_as_integers_and_repeat_bitwise():
    """The default call where the dispatch takes fused_dq="fixed" (H=64, 4k, plain): its
    gradients are bitwise the same over repeated runs, dK and dV equal to those of
    deterministic_grads=False (the same products in the same order), dQ within rounding."""
    needs_hopper()
    shape = (1, 4096, 4, 64)
    call = Call(
        q_shape=shape,
        k_shape=shape,
        dtype=jnp.dtype(jnp.bfloat16),
        spec=MaskSpec(q_len=4096, kv_len=4096, is_causal=False),
    )
    config = dispatch.choose(call, Device.current(), scale=0.125)
    assert config.mosaic_backward_tiles.fused_dq == "fixed", config
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def grads(deterministic_grads):
        def out(q, k, v):
            return pallas_flash.flash_attention(q, k, v, deterministic_grads=deterministic_grads)

        return jax.jit(lambda *a: jax.vjp(out, *a)[1](d_out))(q, k, v)

    first = grads(True)
    for _ in range(3):
        assert_bitwise_equal(grads(True), first)
    (dq, dk, dv), (dq_fast, dk_fast, dv_fast) = first, grads(False)
    for fast, default in ((dk_fast, dk), (dv_fast, dv)):
        np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(default, np.float32))
    dq, dq_fast = (np.asarray(x, np.float32) for x in (dq, dq_fast))
    assert np.max(np.abs(dq_fast - dq)) <= 1e-2 * np.max(np.abs(dq))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p",
    [
        Problem(1, 4096, 4096, 8, 2, 128, True, "bf16"),
        Problem(1, 4096, 4096, 8, 2, 128, False, "bf16"),
        Problem(2, 2048, 3000, 8, 8, 64, False, "bf16"),
    ],
    ids=case_id,
)
def test_fused_dq_fixed_is_deterministic(p):
    """ "fixed" adds integers, in any order: bitwise the same dQ over repeated runs and as
    "fixed_slab"'s (its partials stored apart and summed by XLA), and within rounding of the
    two-kernel backward's."""
    needs_hopper()
    args, _ = random_inputs(p)

    def run(tiles):
        return jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))(*args)

    first = run(FUSED_FIXED)
    for _ in range(5):
        assert_bitwise_equal(run(FUSED_FIXED), first)
    assert_bitwise_equal(run(BackwardTiles(fused_dq="fixed_slab")), first)
    default = run(None)
    dq, dq_default = (np.asarray(x[2], np.float32) for x in (first, default))
    assert np.max(np.abs(dq - dq_default)) <= 1e-2 * np.max(np.abs(dq_default))


@pytest.mark.gpu
def test_fused_dq_fixed_keeps_rows_from_huge_keys_they_cannot_see():
    """Causal "fixed": keys 1e15 times larger past a row's diagonal (a cache's stale entries)
    leave that row's dQ as it is with them cleared: its fixed point's unit comes from the
    keys it sees."""
    needs_hopper()
    p = Problem(1, 1024, 1024, 4, 2, 128, True, "bf16")
    (q, k, v, d_out, _), _ = random_inputs(p)
    huge_k = k.at[:, 512:].multiply(1e15)
    huge_v = v.at[:, 512:].multiply(1e15)
    backward = jax.jit(backward_fn(p, FUSED_FIXED))
    out, lse = jax.jit(functools.partial(call_mosaic_forward, scale=p.scale, is_causal=True))(
        q, k, v
    )
    clean = backward(q, k, v, out, lse, d_out, None)[0]
    huge = backward(q, huge_k, huge_v, out, lse, d_out, None)[0]
    np.testing.assert_array_equal(
        np.asarray(huge[:, :512], np.float32), np.asarray(clean[:, :512], np.float32)
    )


def test_fused_dq_fixed_keeps_rows_from_huge_keys_of_other_documents_interpreted():
    """Packed documents, "fixed_slab": the second document's keys 1e15 times larger leave the
    first document's dQ bitwise as it is without them: each row's fixed point comes from the
    keys of its own segment."""
    p = Problem(1, 256, 256, 2, 1, 64, False, "bf16")
    (q, k, v, d_out, _), _ = random_inputs(p)
    ids = jnp.asarray(np.arange(256) >= 128, jnp.int32)[None]
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=False, has_segments=True)
    arrays = MaskArrays(ids, ids)

    def forward(q, k, v):
        return reference_attention(q, k, v, None, arrays, spec=spec, scale=p.scale, soft_cap=None)

    out, lse = jax.jit(forward)(q, k, v)[:2]
    backward = jax.jit(
        functools.partial(
            call_mosaic_backward,
            scale=p.scale,
            is_causal=False,
            tiles=BackwardTiles(fused_dq="fixed_slab"),
            segment_ids=(ids, ids),
        )
    )
    huge_k, huge_v = k.at[:, 128:].multiply(1e15), v.at[:, 128:].multiply(1e15)
    with interpret_mosaic():
        clean = np.asarray(backward(q, k, v, out.astype(q.dtype), lse, d_out, None)[0], np.float32)
        huge = np.asarray(
            backward(q, huge_k, huge_v, out.astype(q.dtype), lse, d_out, None)[0], np.float32
        )
    assert np.abs(clean[:, :128]).max() > 0
    np.testing.assert_array_equal(huge[:, :128], clean[:, :128])


@pytest.mark.gpu
def test_fused_dq_slab_is_deterministic():
    """ "slab" sums its partials in a fixed order: bitwise the same over repeated runs ("add"
    is not: its TMA adds land in any order)."""
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    args, _ = random_inputs(p)
    fn = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, BackwardTiles(fused_dq="slab"))))
    first = fn(*args)
    for _ in range(5):
        assert_bitwise_equal(fn(*args), first)
