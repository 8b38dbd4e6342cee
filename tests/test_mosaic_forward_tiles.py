"""The Mosaic GPU forward's tiles (pallas_flash.mosaic.tiles, pallas_flash.mosaic.schedule): the
shape rules of `why_not`, the default tiles, the persistent and paired work schedules, and
tile validation.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import Problem, abstract_inputs, case_id
from support.lowering import lower_for_h200
from support.mosaic_forward import (
    custom_call_targets,
    forward_fn,
)

import pallas_flash
from pallas_flash import dispatch
from pallas_flash._passes import KernelConfig
from pallas_flash.call import Call
from pallas_flash.device import DEFAULT_NUM_SMS, Device
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import forward as mosaic_forward_module
from pallas_flash.mosaic import schedule as mosaic_schedule
from pallas_flash.mosaic import tiles as mosaic_tiles
from pallas_flash.mosaic.tiles import (
    SMEM_BYTES,
    ForwardTiles,
    default_tiles,
    why_not,
)

# -- why_not / validation ------------------------------------------------------------------------

BF16 = jnp.bfloat16


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_supports_accepts(head_dim, is_causal):
    assert why_not((2, 256, 8, head_dim), (2, 512, 2, head_dim), BF16, is_causal=is_causal) is None
    assert (
        why_not((1, 128, 1, head_dim), (1, 256, 1, head_dim), jnp.float16, is_causal=True) is None
    )
    # Any lengths: ragged last tiles, lengths below one tile, lengths that are not multiples of 8.
    for q_len, kv_len in ((3000, 3000), (197, 197), (1, 1), (130, 333), (1000, 64)):
        shapes = (1, q_len, 4, head_dim), (1, kv_len, 2, head_dim)
        assert why_not(*shapes, BF16, is_causal=is_causal) is None


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, reason",
    [
        ((1, 0, 4, 128), (1, 1024, 4, 128), BF16, "q_len=0 and kv_len=1024 must be positive"),
        ((1, 256, 4, 128), (1, 0, 4, 128), BF16, "kv_len=0 must be positive"),
        ((1, 256, 4, 112), (1, 256, 4, 112), BF16, "head_dim=112 is not one of (64, 80, 96, 128"),
        ((1, 256, 4, 32), (1, 256, 4, 32), BF16, "head_dim=32"),
        ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, "dtype float32"),
        ((1, 256, 6, 128), (1, 256, 4, 128), BF16, "num_heads=6 must be divisible by"),
        ((1, 256, 4, 128), (2, 256, 4, 128), BF16, "batch or head dim"),
        ((256, 4, 128), (256, 4, 128), BF16, "must be [B, T, N, H]"),
    ],
)
def test_supports_rejects_with_reason(q_shape, k_shape, dtype, reason):
    for is_causal in (False, True):
        got = why_not(q_shape, k_shape, dtype, is_causal=is_causal)
        assert got is not None and reason in got, got


def test_supports_rejects_tiles_over_the_register_budget():
    wide = ForwardTiles(block_q=128, block_kv=128)
    got = why_not((1, 256, 2, 128), (1, 256, 2, 128), BF16, is_causal=False, tiles=wide)
    assert got is not None and "256 registers per thread" in got
    for head_dim, tiles in ((64, wide), (128, ForwardTiles(block_q=128, block_kv=64))):
        shapes = ((1, 256, 2, head_dim), (1, 256, 2, head_dim))
        assert why_not(*shapes, BF16, is_causal=False, tiles=tiles) is None


def test_supports_refuses_causal_on_miscompiling_cuda():
    shapes = ((1, 256, 2, 128), (1, 256, 2, 128), BF16)
    for version, refused in ((12080, True), (12090, True), (12091, False), (13000, False)):
        got = why_not(*shapes, is_causal=True, cuda_runtime_version=version)
        assert (got is not None and f"CUDA runtime {version}" in got) == refused, got
        assert why_not(*shapes, is_causal=False, cuda_runtime_version=version) is None


def test_the_dispatch_gives_the_mosaic_forward_only_what_it_takes():
    """Windows, soft caps and segment ids reach the Mosaic forward; a dense mask (whose arrays
    the kernel would drop) is refused by backend="mosaic" and left to Triton by None."""
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=True)
    shapes = dict(q_shape=(1, 256, 2, 128), k_shape=(1, 256, 2, 128), dtype=BF16)

    def forward(spec, soft_cap=None, backend="mosaic"):
        call = Call(spec=spec, soft_cap=soft_cap, **shapes)
        return dispatch.choose(call, Device.h200(), scale=0.1, backend=backend).forward

    assert forward(spec) == "mosaic"
    assert forward(dataclasses.replace(spec, window=(8, 0))) == "mosaic"
    assert forward(spec, soft_cap=30.0) == "mosaic"
    assert forward(dataclasses.replace(spec, has_segments=True)) == "mosaic"
    for masked in (
        dataclasses.replace(spec, mask_shape=(1, 1, 256, 256)),
        dataclasses.replace(spec, has_segments=True, mask_shape=(1, 1, 256, 256)),
    ):
        with pytest.raises(NotImplementedError, match="does not support this call \\(mask\\)"):
            forward(masked)
        assert forward(masked, backend=None) == "triton"
    common = dict(scale=0.1, block_sizes=pallas_flash.BlockSizes(), interpret=False)
    with pytest.raises(ValueError, match="forward='cuda' must be 'triton', 'mosaic' or 'decode'"):
        KernelConfig(spec=spec, forward="cuda", **common)


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(window=(-1, 0)), "window=(-1, 0) must be a (left, right) pair of ints >= 0"),
        (dict(window=(1, 2, 3)), "must be a (left, right) pair"),
        (dict(window=(1.0, 2)), "must be a (left, right) pair"),
        (dict(soft_cap=0.0), "soft_cap=0.0 must be a finite positive number"),
        (dict(soft_cap=float("inf")), "must be a finite positive number"),
        (dict(soft_cap=True), "must be a finite positive number"),
    ],
)
def test_supports_rejects_bad_options(options, reason):
    got = why_not((1, 256, 2, 128), (1, 256, 2, 128), BF16, is_causal=False, **options)
    assert got is not None and reason in got, got


def test_supports_accepts_windows_and_soft_caps():
    shapes = ((1, 256, 2, 128), (1, 512, 2, 128), BF16)
    for is_causal in (False, True):
        for options in (dict(window=(0, 0)), dict(window=[64, 10**6]), dict(soft_cap=5)):
            assert why_not(*shapes, is_causal=is_causal, **options) is None


def test_supports_refuses_windows_on_miscompiling_cuda():
    shapes = ((1, 256, 2, 128), (1, 256, 2, 128), BF16)
    got = why_not(*shapes, is_causal=False, window=(8, 8), cuda_runtime_version=12085)
    assert got is not None and "window=(8, 8) on CUDA runtime 12085" in got
    assert why_not(*shapes, is_causal=False, soft_cap=5.0, cuda_runtime_version=12085) is None


def test_persistent_tiles_count_the_second_q_buffer():
    """A persistent CTA holds two Q buffers per consumer: H=256 (64 x 64 tiles) no longer fits,
    H=128 and H=64 do."""
    plain, persistent = ForwardTiles(block_kv=64), ForwardTiles(block_kv=64, persistent=True)
    assert persistent.smem_bytes(256, 2) - plain.smem_bytes(256, 2) == 2 * 64 * 256 * 2
    got = why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False, tiles=persistent)
    assert got is not None and "shared memory" in got
    for head_dim, tiles in (
        (128, ForwardTiles(persistent=True)),
        (64, ForwardTiles(block_q=128, persistent=True)),
    ):
        shapes = (1, 512, 2, head_dim), (1, 512, 2, head_dim)
        assert why_not(*shapes, BF16, is_causal=True, tiles=tiles, segments=True) is None


@pytest.mark.parametrize(
    "p, tiles",
    [
        (
            Problem(8, 512, 512, 16, 4, 64, False, "bf16"),
            ForwardTiles(block_q=128, persistent=True),
        ),
        (Problem(1, 256, 512, 2, 1, 128, True, "f16"), ForwardTiles(persistent=True)),
    ],
    ids=case_id,
)
def test_persistent_lowers_with_a_cta_per_sm(p, tiles, monkeypatch):
    """One CTA per SM, or one per work item when there are fewer items than SMs."""
    grids = []
    kernel = mosaic_forward_module.plgpu.kernel

    def spy(*args, grid, **kwargs):
        grids.append(grid)
        return kernel(*args, grid=grid, **kwargs)

    monkeypatch.setattr(mosaic_forward_module.plgpu, "kernel", spy)
    lowered = lower_for_h200(forward_fn(p, tiles), *abstract_inputs(p)[:3])
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    items = p.batch * p.num_heads * (p.q_len // tiles.cta_rows)
    assert DEFAULT_NUM_SMS == 132  # the H200's, where no GPU says otherwise
    assert grids == [(min(items, 132),)]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "batch, heads, q_tiles, ctas",
    [
        (32, 32, 2, 132),
        (2, 3, 5, 4),
        (1, 2, 3, 8),
        (8, 16, 16, 132),
        (2, 16, 64, 132),
        (1, 16, 128, 132),
    ],
)
def test_persistent_work_covers_every_item_once(batch, heads, q_tiles, ctas, reverse):
    """CTA c's n-th item is item n * C + c of the order on even rounds, n * C + C - 1 - c on odd
    ones: every (batch, head, q_tile) once. Causal (reverse): the long query tiles come first,
    and no CTA takes the longest of every round."""
    work = mosaic_schedule._Work(batch, heads, q_tiles, reverse=reverse)
    order = [work.persistent_item(w) for w in range(work.total)]
    assert sorted(order) == sorted(np.ndindex(batch, heads, q_tiles))
    per_cta = []
    for c in range(ctas):
        count = int(work.persistent_count(c, ctas))
        places = [int(work.round_place(c, n, ctas)) for n in range(count)]
        per_cta.append([order[n * ctas + place] for n, place in enumerate(places)])
    assert sorted(item for items in per_cta for item in items) == sorted(order)
    if reverse:
        assert [q for _, _, q in order] == sorted((q for _, _, q in order), reverse=True)
        if work.total >= 2 * ctas:
            # Work per CTA in KV tiles (causal: q_tile + 1), against an even share.
            loads = [sum(q + 1 for _, _, q in items) for items in per_cta]
            mean = sum(loads) / ctas
            assert max(loads) <= 1.5 * min(loads), loads
            # Round-robin put the longest item of every round on CTA 0: about Q / 2 tiles
            # over the mean (63 of 1001 at B=1, 16 heads, 128 tiles); the snake, 2.
            if work.total >= 8 * ctas:
                assert max(loads) <= mean + q_tiles / 4 + 1, (max(loads), mean)
    else:
        assert [q for _, _, q in order[:q_tiles]] == list(range(q_tiles))  # one head's tiles


@pytest.mark.parametrize(
    "batch, heads, q_tiles, ctas",
    [
        (1, 3, 4, 4),  # no whole round of pairs: all tail
        (3, 1, 10, 4),  # the tail starts inside a head
        (1, 1, 8, 3),  # one head: the tail is that head's pairs alone
        (1, 5, 6, 7),
        (8, 16, 16, 132),  # the grid's causal 2k at H=128
        (4, 16, 32, 132),
        (1, 24, 12, 132),  # 144 pairs on 132 CTAs
        (1, 16, 128, 132),
    ],
)
def test_paired_work_covers_every_item_once(batch, heads, q_tiles, ctas):
    """Causal pairs: CTA c's items 2m and 2m + 1 (m < the pair rounds) are query tiles Q - 1 - i
    and i of one head, a round of them spanning few heads (their K/V shared in L2); the tail's
    single tiles go longest first in a snake. Every (batch, head, q_tile) once, and the work
    per CTA as even as the snake's over every item (or better)."""

    def per_cta(work):
        return [
            [tuple(int(x) for x in work.cta_item(c, n, ctas)) for n in range(count)]
            for c in range(ctas)
            for count in [int(work.persistent_count(c, ctas))]
        ]

    work = mosaic_schedule._Work(batch, heads, q_tiles, reverse=True, paired=True)
    tail = work.tail(ctas)
    items = per_cta(work)
    everything = [item for cta_items in items for item in cta_items]
    assert sorted(everything) == sorted(np.ndindex(batch, heads, q_tiles))
    assert tail.items == len(everything) - 2 * tail.pair_rounds * ctas
    for cta_items in items:
        pairs = cta_items[: 2 * tail.pair_rounds]
        for long, short in zip(pairs[::2], pairs[1::2]):
            assert long[:2] == short[:2] and long[2] + short[2] == q_tiles - 1, (long, short)
            assert long[2] > short[2]
    for m in range(tail.pair_rounds):
        heads_of_round = {cta_items[2 * m][:2] for cta_items in items}
        assert len(heads_of_round) <= -(-2 * ctas // q_tiles) + 1, (m, heads_of_round)
    # The tail, in the order CTAs take it, round by round: longest first.
    tail_order = [tail.item(r) for r in range(tail.items)]
    levels = [int(q) for _, q in tail_order]
    assert levels == sorted(levels, reverse=True)

    def load(cta_items):
        return sum(q + 2 for _, _, q in cta_items)  # KV tiles and a start per item

    snake = [load(c) for c in per_cta(mosaic_schedule._Work(batch, heads, q_tiles, True))]
    loads = [load(c) for c in items]
    mean = sum(loads) / ctas
    # Whole pairs to the end would leave CTAs a pair apart: 1.83 x the mean at 144 pairs on
    # 132 CTAs, 1.031 at the grid's 2k (where the snake's partial round gives 1.031 too).
    assert max(loads) <= max(snake) + 0.015 * mean, (max(loads) / mean, max(snake) / mean)
    if (batch, heads, q_tiles) == (8, 16, 16):
        assert max(loads) <= 1.01 * mean


def test_paired_work_needs_reverse_and_even_tiles():
    with pytest.raises(ValueError, match="even"):
        mosaic_schedule._Work(1, 2, 3, reverse=True, paired=True)
    with pytest.raises(ValueError, match="reverse"):
        mosaic_schedule._Work(1, 2, 4, reverse=False, paired=True)


@pytest.mark.parametrize(
    "q_len, kv_len, options, paired",
    [
        (2048, 2048, {}, True),
        (2048, 4096, {}, True),  # T < S: row i still sees keys 0..i
        (4096, 2048, {}, False),  # rows past S see every key: pairs of unequal work
        (1280, 1280, {}, False),  # 5 query tiles of 256 rows (block_q=128)
        (2048, 2048, dict(window=(256, 0)), False),
        (2048, 2048, dict(window=(4096, 0)), True),  # a window that hides nothing
        (2048, 2048, dict(segments=True), False),
        (2048, 2048, dict(is_causal=False), False),
        (2048, 2048, dict(persistent=False), False),
        (2048, 2048, dict(causal_pairs=False), False),
    ],
)
def test_paired_causal_rows(q_len, kv_len, options, paired):
    options = {"is_causal": True, "persistent": True, **options}
    spec = MaskSpec(
        q_len=q_len, kv_len=kv_len, is_causal=options["is_causal"], window=options.get("window")
    )
    tiles = ForwardTiles(
        block_q=128 if q_len == 1280 else 64,
        persistent=options["persistent"],
        causal_pairs=options.get("causal_pairs", True),
    )
    got = mosaic_schedule.paired_causal_rows(
        spec, tiles, has_segments=options.get("segments", False)
    )
    assert got == paired


def test_supports_rejects_tiles_over_shared_memory():
    tiles = ForwardTiles(block_q=64, block_kv=128, num_stages=2)
    got = why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False, tiles=tiles)
    assert got is not None and "shared memory" in got
    assert why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False) is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_len, kv_len", [(256, 512), (512, 2048), (384, 16384), (16384, 16384)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_default_tiles_are_supported(head_dim, q_len, kv_len, is_causal, segments):
    """The default tiles fit shared memory (with the id buffers of segment ids) and registers,
    and cover T (% 2 * block_q)."""
    tiles = default_tiles(
        head_dim, q_len=q_len, kv_len=kv_len, is_causal=is_causal, segments=segments
    )
    shapes = (2, q_len, 4, head_dim), (2, kv_len, 4, head_dim)
    assert why_not(*shapes, BF16, is_causal=is_causal, tiles=tiles, segments=segments) is None
    assert tiles.smem_bytes(head_dim, 2, segments=segments) <= SMEM_BYTES


def test_default_tiles_at_h64_take_128_rows_when_plain_and_not_causal():
    def block_q(**kwargs):
        return default_tiles(64, **kwargs).block_q

    assert block_q(q_len=512, kv_len=512, is_causal=False) == 128
    assert block_q(q_len=2048, kv_len=2048, is_causal=False) == 128
    # Causal: masked diagonal steps zero non-finite V, which spills at 128 rows.
    assert block_q(q_len=16384, kv_len=16384, is_causal=True) == 64
    assert block_q(q_len=2048, kv_len=2048, is_causal=True) == 64
    assert block_q(q_len=384, kv_len=384, is_causal=False) == 64  # T % 256 != 0
    assert block_q(q_len=512, kv_len=512, is_causal=True, window=(64, 0)) == 64
    assert block_q(q_len=512, kv_len=512, is_causal=True, soft_cap=30.0) == 64
    assert block_q(q_len=512, kv_len=512, is_causal=True, segments=True) == 64
    assert default_tiles(128, q_len=512, kv_len=512, is_causal=True).block_q == 64


def test_default_tiles_at_h64_rebuild_q_descriptors_at_128_rows():
    """Plain H=64 rows of 128 query rows per consumer rebuild Q's descriptors each step (held,
    they spill) from 1k keys; 64-row consumers hold them, as do rows of 512 keys."""
    for kv_len, step in ((512, False), (1000, False), (1024, True), (4096, True), (16384, True)):
        tiles = default_tiles(64, q_len=1024, kv_len=kv_len, is_causal=False)
        assert (tiles.block_q, tiles.block_kv, tiles.step_descriptors) == (128, 128, step)
    # A small grid's 64-row tiles (the dispatch's wide=False).
    narrow = default_tiles(64, q_len=4096, kv_len=4096, is_causal=False, wide=False)
    assert (narrow.block_q, narrow.block_kv, narrow.step_descriptors) == (64, 256, False)
    for kwargs in (dict(is_causal=True), dict(is_causal=False, soft_cap=30.0)):
        tiles = default_tiles(64, q_len=1024, kv_len=1024, **kwargs)
        assert (tiles.block_q, tiles.step_descriptors) == (64, False)
    assert not default_tiles(128, q_len=1024, kv_len=1024, is_causal=False).step_descriptors


def test_default_tiles_at_h64_take_256_keys_on_long_plain_rows_of_other_lengths():
    """Plain rows of 4k-8k keys whose T is not a multiple of 256 (no 128-row consumers) take
    256-key tiles."""

    def block_kv(kv_len, is_causal=False, **kwargs):
        tiles = default_tiles(64, q_len=1000, kv_len=kv_len, is_causal=is_causal, **kwargs)
        return tiles.block_kv

    assert [block_kv(n) for n in (2048, 4096, 8192, 16384)] == [128, 256, 256, 128]
    assert [block_kv(n, True) for n in (4096, 8192, 16384)] == [128, 128, 128]
    assert block_kv(8192, window=(64, 0)) == block_kv(8192, soft_cap=30.0) == 128
    assert default_tiles(128, q_len=8192, kv_len=8192, is_causal=False).block_kv == 128


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_are_persistent_but_on_long_causal_rows(head_dim):
    def persistent(kv_len=1024, is_causal=False, q_len=None, **kwargs):
        q_len = kv_len if q_len is None else q_len
        tiles = default_tiles(head_dim, q_len=q_len, kv_len=kv_len, is_causal=is_causal, **kwargs)
        return tiles.persistent

    fits = head_dim <= 128  # H=256 has no room for a second Q buffer
    assert persistent() == persistent(kv_len=16384) == fits
    # Causal rows: up to 16k keys at H=64, 8k at H=128.
    longest = {64: 16384, 128: 8192, 256: 0}[head_dim]
    for kv_len in (512, 1024, 2048, 4096, 8192, 16384, 32768):
        assert persistent(kv_len, is_causal=True) == (kv_len <= longest), kv_len
        # Soft caps and segment ids as plain calls.
        assert persistent(kv_len, is_causal=True, soft_cap=30.0) == (kv_len <= longest)
        assert persistent(kv_len, is_causal=True, segments=True) == (kv_len <= longest)
        # A window that bounds nothing leaves the rows causal.
        window = (kv_len - 1, 0)
        assert persistent(kv_len, is_causal=True, window=window) == (kv_len <= longest)
        assert persistent(kv_len, is_causal=True, window=(1 << 30, 0)) == (kv_len <= longest)
    assert persistent(kv_len=16384, soft_cap=30.0) == persistent(segments=True) == fits
    # Top-left aligned causal rows see at most T keys.
    assert persistent(kv_len=16384, q_len=512, is_causal=True) == fits
    # A causal window of at most half the keys evens the rows out, up to (8192, 0).
    assert persistent(kv_len=16384, window=(8192, 0), is_causal=True) == fits
    assert persistent(kv_len=4096, window=(128, 0), is_causal=True) == fits
    assert persistent(kv_len=32768, window=(8193, 0), is_causal=True) == (head_dim == 64)
    assert not persistent(kv_len=65536, window=(32768, 0), is_causal=True)
    assert persistent(kv_len=32768, window=(16384, 16384)) == fits  # not causal


def test_supports_counts_the_segment_id_buffers(monkeypatch):
    """Segment ids add the consumers' query ids and a ring of KV ids (int32) to shared memory;
    `why_not` checks the total (here against a budget that fits the tiles without ids)."""
    tiles = ForwardTiles(block_q=64, block_kv=128, num_stages=3)
    extra = tiles.smem_bytes(64, 2, segments=True) - tiles.smem_bytes(64, 2)
    assert extra == (2 * 64 + 3 * 128) * 4
    shapes = ((2, 256, 4, 64), (2, 512, 2, 64), BF16)
    for is_causal in (False, True):
        assert why_not(*shapes, is_causal=is_causal, segments=True) is None
        assert why_not(*shapes, is_causal=is_causal, window=(8, 0), segments=True) is None
    monkeypatch.setattr(mosaic_tiles, "SMEM_BYTES", tiles.smem_bytes(64, 2))
    assert why_not(*shapes, is_causal=False, tiles=tiles) is None
    got = why_not(*shapes, is_causal=False, tiles=tiles, segments=True)
    assert got is not None and "shared memory" in got, got


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=96), "block_q=96 must be a positive multiple of 64"),
        (dict(block_kv=32), "block_kv=32 must be a positive multiple of 64"),
        (dict(num_stages=1), "num_stages=1 must be an int >= 2"),
        (dict(persistent=1), "persistent=1 must be a bool"),
        (dict(causal_pairs=1), "causal_pairs=1 must be a bool"),
        (dict(step_descriptors=0), "step_descriptors=0 must be a bool"),
    ],
)
def test_tiles_validate(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        ForwardTiles(**kwargs)
