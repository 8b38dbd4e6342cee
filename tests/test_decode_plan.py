"""The decode kernels' plan, without running them: the split count of each rule, the slots and
waves it fills, the default tiles, the occupancy estimate, and the schedules' items (read from a
kernel in the interpreter). The results against the oracle are in test_decode.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.triton import DecodeBlockSizes
from pallas_flash.triton.tiles import decode_merge


def test_choose_decode_splits():
    from pallas_flash.triton.decode import choose_decode_splits

    split = functools.partial(choose_decode_splits, slots=528)
    assert split(5, 64, 3, 64) == 3  # asked for: never more than the tiles
    assert split(0, 64, 512, 64) == 8  # one wave: 512 programs for 528 slots
    assert split(0, 64, 512, 64, waves=2) == 16
    assert split(0, 8, 512, 64) == 64  # B=1: 60 runs would leave 8 tiles in the last; 64 of 8
    assert split(0, 64, 16, 64) == 4  # 1k keys: at least 256 keys per split (the fullest)
    assert split(0, 64, 16, 64, min_split_keys=1024) == 1
    assert split(0, 512, 512, 64) == 1  # a full wave needs none
    assert split(0, 2048, 128, 64) == 1  # nor 3.9 full waves
    assert split(0, 600, 512, 64) == 4  # 600 alone: a wave and 72 programs; 2400 fill 4.5
    assert split(0, 300, 512, 64) == 5  # 1500 programs fill 2.8 waves


def test_full_waves_rule():
    """The cores rule's split count, lowered to a full last wave, on an H200's 132 SMs: 528
    slots for 16-row tiles (T=1), 264 for 64-row ones (T=16, pages of 128)."""
    from pallas_flash.triton.decode import decode_plan

    def splits(b, t, k, s, rule):
        bs = DecodeBlockSizes(split_rule=rule)
        return decode_plan((b, t, 32, 128), k, s, jnp.bfloat16, bs).schedule.splits

    assert (splits(8, 1, 8, 32768, "cores"), splits(8, 1, 8, 32768, "full-waves")) == (17, 16)
    assert (splits(8, 16, 8, 32768, "cores"), splits(8, 16, 8, 32768, "full-waves")) == (17, 16)
    # Counts whose last wave is already full, or capped by the keys, stay as they were.
    for shape in [(1, 1, 8, 32768), (8, 1, 8, 8192), (8, 1, 2, 32768), (256, 1, 8, 8192)]:
        assert splits(*shape, "full-waves") == splits(*shape, "cores"), shape


def test_decode_plan_fills_the_gpu():
    """The bench's shapes on an H200 with the occupancy rule: the CTAs fill one wave of the
    slots (132 SMs x the tiles' CTAs per SM: 4 for 16-row tiles, 2 for 64-row ones)."""
    from pallas_flash.triton.decode import decode_plan

    def plan(b, t, k, s, **fields):
        fields = {"split_rule": "occupancy", "schedule": "balanced", **fields}
        return decode_plan((b, t, 32, 128), k, s, jnp.bfloat16, DecodeBlockSizes(**fields))

    p = plan(8, 1, 8, 32768)
    assert (p.block_m, p.slots, p.schedule.splits, p.schedule.items) == (16, 528, 8, 64)
    p = plan(8, 16, 8, 32768)
    assert (p.block_m, p.slots, p.schedule.splits) == (64, 264, 4)
    assert plan(1, 1, 8, 32768).schedule.splits == 64
    assert plan(256, 1, 8, 8192).schedule.splits == 1
    assert plan(8, 1, 8, 32768, ctas_per_sm=8).schedule.splits == 16
    p = plan(8, 1, 8, 32768, kv_splits=5, schedule="sequence")
    assert (p.schedule.kind, p.schedule.splits, p.schedule.items) == ("sequence", 5, 40)


def test_default_decode_plan_fills_two_waves_of_slots():
    """The default "slots" rule on an H200 (528 slots for 16-row tiles, 264 for 64-row ones):
    two waves of slots (one for 64-row tiles), lowered to a last wave 90% full; at least 1024
    keys per split unless the cache is cut in four or fewer; at most 64; the per-sequence
    schedule, merged in the merge kernel."""
    from pallas_flash.triton.decode import decode_plan

    def plan(b, t, k, s, num_sms=132, **fields):
        bs = DecodeBlockSizes(**fields)
        return decode_plan((b, t, 32, 128), k, s, jnp.bfloat16, bs, num_sms=num_sms)

    p = plan(8, 1, 8, 32768)
    assert (p.programs, p.slots, p.schedule.kind, p.schedule.splits) == (64, 528, "sequence", 16)
    assert decode_merge(DecodeBlockSizes()) == "kernel"
    assert plan(8, 1, 8, 131072).schedule.splits == 16  # 17 would leave 32 programs alone
    p = plan(8, 16, 8, 32768)  # 64-row tiles: 264 slots, one wave (a smaller merge)
    assert (p.slots, p.schedule.splits) == (264, 4)
    assert plan(8, 16, 2, 32768).schedule.splits == 4  # 4 row tiles per KV head: 256 programs
    assert plan(1, 1, 8, 32768).schedule.splits == 32  # 1056 / 8 programs, capped at 32 runs
    assert plan(8, 1, 8, 8192).schedule.splits == 8  # 1024 keys per split
    assert plan(8, 1, 8, 1024).schedule.splits == 4  # a short cache: 4 splits of 256
    assert plan(8, 1, 8, 128).schedule.splits == 2  # no split without a tile
    # A cache shorter than the key tile clips it, and the slots are counted for the clipped tile.
    assert (plan(8, 1, 8, 32).block_kv, plan(8, 1, 8, 32).slots) == (32, 660)
    assert plan(8, 1, 2, 32768).schedule.splits == 32  # GQA 16: 512 programs, 0.97 wave
    assert plan(256, 1, 8, 32768).schedule.splits == 1  # 2048 programs already
    assert plan(8, 1, 8, 32768, num_sms=108).schedule.splits == 13  # A100: 832 of 864 slots
    # The former default, "cores": eight programs per SM, 1024 keys per split.
    assert plan(8, 1, 8, 32768, split_rule="cores").schedule.splits == 17
    assert plan(8, 1, 8, 1024, split_rule="cores").schedule.splits == 1


def test_default_decode_tiles():
    """The shipped tiles by call: 64-key tiles in 2 stages; 128-key tiles for pages of a
    multiple of 128; 32-key tiles for H=256 and float32; 32-key tiles in 4 stages where 64 or
    more packed rows (new tokens x query heads per KV head) fill a 64-row wgmma tile, 128-row
    tiles of 64 keys from 128 rows."""
    from pallas_flash.triton import default_decode_block_sizes as tiles

    def kv_stages(*args, **kwargs):
        bs = tiles(*args, interpret=False, **kwargs)
        return bs.block_m, bs.block_kv, bs.num_stages

    assert kv_stages(128, jnp.bfloat16) == (64, 64, 2)
    assert kv_stages(128, jnp.bfloat16, rows=16) == (64, 64, 2)
    assert kv_stages(128, jnp.bfloat16, rows=64) == (64, 32, 4)
    assert kv_stages(128, jnp.bfloat16, rows=127) == (64, 32, 4)
    assert kv_stages(128, jnp.bfloat16, rows=128) == (128, 64, 2)
    assert kv_stages(128, jnp.bfloat16, rows=256, page_size=16) == (128, 64, 2)
    assert kv_stages(128, jnp.bfloat16, rows=64, page_size=128) == (64, 128, 2)
    assert kv_stages(256, jnp.bfloat16, rows=64) == (64, 32, 2)
    assert kv_stages(128, jnp.float32, rows=64) == (64, 32, 2)
    assert tiles(128, jnp.bfloat16, interpret=True, rows=64).block_kv == 16


def test_default_tiles_deepen_the_pipeline_of_a_half_wave():
    """decode_block_sizes on an H200 (132 SMs, 528 slots for 16-row tiles): 32-key tiles in
    4 stages where the split programs fill at most half the slots in runs of >= 1024 keys;
    the rows' tiles otherwise."""
    from pallas_flash.triton.decode import decode_block_sizes

    def kv_stages(b, t, k, s, **kwargs):
        bs = decode_block_sizes(
            (b, t, 32, 128), k, s, jnp.bfloat16, interpret=False, num_sms=132, **kwargs
        )
        return bs.block_m, bs.block_kv, bs.num_stages

    assert kv_stages(1, 1, 8, 32768) == (64, 32, 4)  # 32 splits of 1024: 256 programs
    assert kv_stages(1, 1, 8, 16384) == (64, 32, 4)  # 16 splits: 128 programs
    assert kv_stages(2, 1, 8, 32768) == (64, 64, 2)  # 512 programs
    assert kv_stages(8, 1, 8, 32768) == (64, 64, 2)
    assert kv_stages(8, 1, 8, 8192) == (64, 64, 2)  # 512 of 528 slots
    assert kv_stages(8, 1, 8, 1024) == (64, 64, 2)  # runs of 256 keys
    assert kv_stages(1, 1, 8, 32768, window_left=2047) == (64, 64, 2)  # 2k keys: 4 splits
    assert kv_stages(1, 1, 8, 32768, page_size=16) == (64, 32, 4)
    assert kv_stages(1, 1, 8, 32768, page_size=128) == (64, 128, 2)  # the pages' tiles
    assert kv_stages(1, 16, 2, 32768) == (128, 64, 2)  # rows' tiles
    interpreted = decode_block_sizes((1, 1, 32, 128), 8, 32768, jnp.bfloat16, interpret=True)
    assert (interpreted.block_kv, interpreted.num_stages) == (16, 1)


def test_ctas_per_sm_estimate():
    """The occupancy estimate against ptxas' reading of the Triton kernels for sm_90a (H=128,
    bf16; benchmarks/triton_ir.py): (block_m, block_kv, warps, stages) -> CTAs per SM."""
    from pallas_flash.triton.tiles import decode_ctas_per_sm

    read = {(16, 64, 4, 2): 4, (16, 64, 4, 3): 3, (16, 128, 4, 2): 2, (32, 32, 4, 2): 4}
    read |= {(32, 64, 4, 2): 3, (64, 64, 4, 2): 2, (64, 64, 4, 1): 3, (16, 32, 4, 4): 4}
    for (m, kv, w, st), ctas in read.items():
        bs = DecodeBlockSizes(block_m=m, block_kv=kv, num_warps=w, num_stages=st)
        assert decode_ctas_per_sm(bs, m, 128, 2) == ctas, (m, kv, w, st)
    assert decode_ctas_per_sm(DecodeBlockSizes(ctas_per_sm=7), 16, 128, 2) == 7


def _schedule_items(lengths, capacity, splits, *, q_len=1, window_left=None, kind="balanced"):
    """(sequence, first tile, end tile) of each item of a schedule, read from a kernel in the
    interpreter, and the schedule."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from pallas_flash.triton.decode import Schedule

    block_kv = 16
    schedule = Schedule(
        kind=kind,
        batch=len(lengths),
        splits=splits,
        items=len(lengths) * splits,
        capacity=capacity,
        q_len=q_len,
        window_left=window_left,
        block_kv=block_kv,
        min_chunk=1,
        max_tiles=-(-capacity // block_kv),
    )

    lengths = jnp.asarray(lengths, jnp.int32)
    # The planned schedule's table as the decode call makes it (XLA, before the kernel).
    runs = schedule.plan_runs(lengths) if schedule.planned else jnp.zeros((1,), jnp.int32)

    def kernel(lengths_ref, runs_ref, o_ref):
        item = pl.program_id(0)
        batch, length, (first, end) = schedule.item(
            lengths_ref, item, runs_ref if schedule.planned else None
        )
        plgpu.store(o_ref, jnp.stack([batch, length, first, end]))

    out = pl.pallas_call(
        kernel,
        grid=(schedule.items,),
        in_specs=[
            pl.BlockSpec(lengths.shape, lambda i: (0,)),
            pl.BlockSpec(runs.shape, lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((schedule.items, 4), jnp.int32),
        interpret=True,
    )(lengths, runs)
    return np.asarray(out), schedule


def test_balanced_schedule_covers_each_sequence_once():
    """Ragged lengths (one sequence long, one empty, one past the capacity): every item runs
    at most `chunk` tiles, the items of a sequence tile its keys once, in order, and a sequence
    takes items in proportion to its length (the former per-sequence cut gave every sequence
    the same number of runs, so the long one's runs were each as long as an unsplit short
    sequence)."""
    lengths, capacity, splits = (1000, 40, 0, 300, 9999), 1024, 4
    items, _ = _schedule_items(lengths, capacity, splits)
    tiles = [-(-min(n, capacity) // 16) for n in lengths]
    runs = {b: [] for b in range(len(lengths))}
    for b, length, first, end in items:
        assert length == min(lengths[b], capacity)
        end = min(end, tiles[b])
        if end > first:
            runs[b].append((first, end))
    # The runs are as short as fit in the items: 8 tiles (149 tiles, 20 items; 7 would take 23).
    chunk = max(e - f for r in runs.values() for f, e in r)
    fits = lambda c: sum(-(-t // c) for t in tiles) <= len(lengths) * splits  # noqa: E731
    assert chunk == 8 and fits(chunk) and not fits(chunk - 1)
    for b, r in runs.items():
        covered = [t for f, e in r for t in range(f, e)]
        assert covered == list(range(tiles[b])), b
    assert [len(runs[b]) for b in range(len(lengths))] == [8, 1, 0, 3, 8]
    # With a window, a sequence's runs start at its window's first tile.
    items, _ = _schedule_items(lengths, capacity, splits, q_len=3, window_left=100)
    for b, _, first, end in items:
        if end > first and lengths[b] > 200:
            assert first >= (min(lengths[b], capacity) - 3 - 100) // 16


def test_sequence_schedule_cuts_each_sequence_alike():
    items, _ = _schedule_items((64, 16), 64, 2, kind="sequence")
    np.testing.assert_array_equal(
        items, [[0, 64, 0, 2], [0, 64, 2, 4], [1, 16, 0, 1], [1, 16, 1, 2]]
    )
