"""The Mosaic GPU backward's tiles (pallas_flash.mosaic.backward_tiles): the shape rules of
`why_not`, shared-memory and register budgets, tile validation and head splits.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest

from pallas_flash.mosaic import BackwardTiles, backward_tiles
from pallas_flash.mosaic.backward_tiles import default_tiles
from pallas_flash.mosaic.tiles import SMEM_BYTES

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
