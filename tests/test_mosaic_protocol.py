"""A pure-Python model of the Mosaic GPU forward's barrier protocol (pallas_flash.mosaic.forward),
run over the tile ranges the kernel computes for many shapes, windows and ring depths, and over
the per-CTA plans XLA computes from segment ids (`segment_tile_plan`, random ids).

A GPU hang is the likeliest failure of a warp-specialised kernel, and it cannot be seen on CPU:
this model replays, per CTA, the producer's TMA fills and refills and each consumer's waits and
arrivals (ready/free ring barriers, the shared schedule barrier) under random interleavings and
random TMA latencies, with mbarrier semantics as Mosaic GPU uses them: a barrier completes a
phase after `num_arrivals` arrivals (a ready barrier: when its copy lands), and every thread
waits by parity, keeping its own phase bit per barrier and flipping it on each wait. It reports
deadlocks, waits whose parity aliases (the barrier ran two phases ahead of the waiter), slots
overwritten while a consumer reads them, consumers reading the wrong tile, and copies still in
flight or unobserved at exit. A second model replays the consumer's float32 arithmetic in numpy
against the float64 oracle (masks, rows without keys, soft cap).

The op sequences below mirror `_produce`, `_consume.kv_step` and `_consume.drain_step`; keep them
in step with the kernel.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from support.inputs import case_id, segment_arrays
from support.oracle import attention_oracle_f64

from pallas_flash import masks
from pallas_flash._numerics import LN2, LOG2E, MIN_LOGIT
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic.schedule import (
    consumer_tile_range,
    cta_tile_range,
    mask_sides,
    segment_tile_plan,
)
from pallas_flash.mosaic.tiles import NUM_CONSUMERS, ForwardTiles

f32 = np.float32

READY = {"k": "k_ready", "v": "v_ready"}
FREE = {"k": "k_free", "v": "v_free"}


def producer_ops(first: int, end: int, num_tiles: int, stages: int):
    """`_produce`: fill the ring with the CTA's first tiles, then refill as slots free up."""
    for n in range(min(stages, num_tiles)):
        if first + n < end:
            yield ("issue", "k", n, first + n)
            yield ("issue", "v", n, first + n)
    for n in range(stages, end - first):
        slot = n % stages
        yield ("wait", FREE["k"], slot)
        yield ("issue", "k", slot, first + n)
        yield ("wait", FREE["v"], slot)
        yield ("issue", "v", slot, first + n)


def compute_step(tile: int, slot: int):
    """`kv_step`: Q.K^T, schedule sync, release K; softmax; V; P.V, release V."""
    yield ("wait", READY["k"], slot)
    yield ("read", "k", slot, tile)
    yield ("arrive", "schedule", 0)
    yield ("wait", "schedule", 0)
    yield ("done", "k", slot)
    yield ("arrive", FREE["k"], slot)
    yield ("arrive", "schedule", 0)
    yield ("wait", READY["v"], slot)
    yield ("wait", "schedule", 0)
    yield ("read", "v", slot, tile)
    yield ("done", "v", slot)
    yield ("arrive", FREE["v"], slot)


def drain_step(tile: int, slot: int, *, wait_ready: bool = True, sync: bool = True):
    """`drain_step`; the keyword arguments break it on purpose (the model must notice)."""
    if wait_ready:
        yield ("wait", READY["k"], slot)
    yield ("arrive", FREE["k"], slot)
    if sync:
        yield ("arrive", "schedule", 0)
        yield ("wait", "schedule", 0)
        yield ("arrive", "schedule", 0)
    if wait_ready:
        yield ("wait", READY["v"], slot)
    if sync:
        yield ("wait", "schedule", 0)
    yield ("arrive", FREE["v"], slot)


def consumer_ops(wg: int, first: int, end: int, lo: int, hi: int, stages: int, **drain_kwargs):
    """`_consume`: drain [first, lo), compute [lo, hi), drain [hi, end), with consumer 1's
    leading and consumer 0's trailing schedule sync."""
    if wg == 1:
        yield ("arrive", "schedule", 0)
        yield ("wait", "schedule", 0)
    for tile in range(first, lo):
        yield from drain_step(tile, (tile - first) % stages, **drain_kwargs)
    for tile in range(lo, hi):
        yield from compute_step(tile, (tile - first) % stages)
    for tile in range(hi, end):
        yield from drain_step(tile, (tile - first) % stages, **drain_kwargs)
    if wg == 0:
        yield ("arrive", "schedule", 0)
        yield ("wait", "schedule", 0)


class ProtocolError(AssertionError):
    pass


def simulate(producer, consumers, *, stages: int, seed: int) -> None:
    """Run the threads (op lists) under a random interleaving; raise ProtocolError on a hang,
    parity aliasing, a slot race, a wrong tile, or a copy left in flight or unobserved. Free
    and schedule barriers count one arrival per consumer."""
    rng = random.Random(seed)
    n_c = len(consumers)
    arrivals = {"k_free": n_c, "v_free": n_c, "schedule": n_c}
    completed: dict = {}  # (barrier, index) -> phases completed
    pending: dict = {}  # (barrier, index) -> arrivals in the current phase
    waits: dict = {}  # (thread, barrier, index) -> waits done (the thread's phase bit is & 1)
    in_flight: dict = {}  # (kind, slot) -> tile being copied
    content: dict = {}  # (kind, slot) -> tile that landed last
    readers: dict = {}  # (kind, slot) -> consumers reading it now
    threads = [list(producer), *(list(c) for c in consumers)]
    pcs = [0] * len(threads)

    def complete(key):
        completed[key] = completed.get(key, 0) + 1
        pending[key] = 0

    def can_run(t):
        op = threads[t][pcs[t]]
        if op[0] != "wait":
            return True
        key = op[1:]
        done, k = completed.get(key, 0), waits.get((t, *key), 0)
        if done >= k + 2:
            raise ProtocolError(f"thread {t} waits on {key} phase {k}; {done} phases completed")
        return done % 2 != k % 2  # mbarrier.try_wait.parity

    def run(t):
        op = threads[t][pcs[t]]
        pcs[t] += 1
        kind = op[0]
        if kind == "wait":
            waits[(t, *op[1:])] = waits.get((t, *op[1:]), 0) + 1
        elif kind == "arrive":
            key = op[1:]
            pending[key] = pending.get(key, 0) + 1
            if pending[key] == arrivals[key[0]]:
                complete(key)
        elif kind == "issue":
            _, buf, slot, tile = op
            if (buf, slot) in in_flight:
                raise ProtocolError(f"copy of tile {tile} into {buf}[{slot}]: one in flight")
            if readers.get((buf, slot)):
                raise ProtocolError(f"copy of tile {tile} into {buf}[{slot}] while it is read")
            in_flight[(buf, slot)] = tile
        elif kind == "read":
            _, buf, slot, tile = op
            if content.get((buf, slot)) != tile:
                raise ProtocolError(
                    f"consumer {t - 1} reads {buf}[{slot}] for tile {tile}, "
                    f"holding {content.get((buf, slot))}"
                )
            readers.setdefault((buf, slot), set()).add(t)
        elif kind == "done":
            readers[op[1:]].discard(t)

    while True:
        runnable = [t for t in range(len(threads)) if pcs[t] < len(threads[t]) and can_run(t)]
        events = [("thread", t) for t in runnable] + [("land", key) for key in in_flight]
        if not events:
            break
        what, which = rng.choice(events)
        if what == "thread":
            run(which)
        else:
            if readers.get(which):
                raise ProtocolError(f"copy lands in {which} while it is read")
            content[which] = in_flight.pop(which)
            complete((READY[which[0]], which[1]))
    stuck = [t for t in range(len(threads)) if pcs[t] < len(threads[t])]
    if stuck:
        ops = [threads[t][pcs[t]] for t in stuck]
        raise ProtocolError(f"deadlock: threads {stuck} blocked at {ops}")
    for key, done in completed.items():
        if key[0] in READY.values():
            for t in range(1, len(threads)):
                if waits.get((t, *key), 0) != done:
                    raise ProtocolError(f"consumer {t - 1} missed a phase of {key}")


def cta_plans(spec: MaskSpec, tiles: ForwardTiles):
    """Per CTA: (first, end, [(lo, hi) per consumer]) from the kernel's own range functions."""
    plans = set()
    for cta_start in range(0, spec.q_len, tiles.cta_rows):
        first, end = cta_tile_range(spec, cta_start, tiles)
        ranges = []
        for wg in range(NUM_CONSUMERS):
            q_start = cta_start + wg * tiles.block_q
            lo, _, _, hi = consumer_tile_range(spec, q_start, (first, end), tiles)
            ranges.append((lo, hi))
        plans.add((first, end, tuple(ranges)))
    return sorted(plans)


# Ragged ones too: the last query tile past T, the last KV tile past S, fewer keys than a tile.
SHAPES = [
    (128, 128),
    (256, 512),
    (512, 256),
    (1024, 128),
    (128, 1024),
    (384, 640),
    (200, 328),
    (333, 136),
    (8, 1000),
    (1000, 40),
]


def num_kv_tiles(kv_len: int, block_kv: int) -> int:
    return -(-kv_len // block_kv)


WINDOWS = [None, (0, 0), (1, 0), (5, 3), (63, 64), (100, 30), (127, 0), (300, 1000), (512, 0)]


def all_plans():
    """Distinct CTA plans over shapes, tiles, causal and windows (with the ring depth)."""
    plans = set()
    for q_len, kv_len in SHAPES:
        for block_q, block_kv in ((64, 64), (64, 128), (128, 64)):
            for stages in (2, 3, 4):
                tiles = ForwardTiles(block_q=block_q, block_kv=block_kv, num_stages=stages)
                for is_causal in (False, True):
                    for window in WINDOWS:
                        spec = MaskSpec(
                            q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window
                        )
                        for plan in cta_plans(spec, tiles):
                            plans.add((*plan, num_kv_tiles(kv_len, block_kv), stages))
    return sorted(plans)


PLANS = all_plans()


def run_plan(plan, seed, **drain_kwargs):
    first, end, ranges, num_tiles, stages = plan
    producer = producer_ops(first, end, num_tiles, stages)
    consumers = [
        consumer_ops(wg, first, end, lo, hi, stages, **drain_kwargs)
        for wg, (lo, hi) in enumerate(ranges)
    ]
    simulate(producer, consumers, stages=stages, seed=seed)


def test_the_plans_cover_the_hard_cases():
    """Among the plans: CTAs with no tile, consumers with no tile, leading and trailing drains,
    and CTAs with more tiles than ring slots."""
    assert any(first == end for first, end, *_ in PLANS)
    assert any(lo == hi and first < end for first, end, ranges, *_ in PLANS for lo, hi in ranges)
    assert any(first < lo < hi for first, _, ranges, *_ in PLANS for lo, hi in ranges)
    assert any(lo < hi < end for _, end, ranges, *_ in PLANS for lo, hi in ranges)
    assert any(end - first > stages for first, end, _, _, stages in PLANS)


def test_protocol_never_hangs_or_races():
    for i, plan in enumerate(PLANS):
        for seed in range(4):
            try:
                run_plan(plan, seed=1000 * i + seed)
            except ProtocolError as e:
                raise ProtocolError(f"{plan}: {e}") from None


def segment_plans():
    """Distinct CTA plans of `segment_tile_plan` over shapes, tiles, random ids (packed, with
    lengths, unsorted, with a gap), causal and windows (with the ring depth)."""
    plans = set()
    for q_len, kv_len in ((256, 256), (256, 512), (512, 256), (384, 640), (200, 328), (333, 136)):
        for block_q, block_kv in ((64, 64), (64, 128), (128, 64)):
            tiles = ForwardTiles(block_q=block_q, block_kv=block_kv)
            for kind in ("packed", "packed-lengths", "unsorted", "gap"):
                arrays = segment_arrays(kind, 2, q_len, kv_len, seed=q_len + block_kv)
                for is_causal, window in ((False, None), (True, None), (True, (40, 0))):
                    spec = MaskSpec(
                        q_len=q_len,
                        kv_len=kv_len,
                        is_causal=is_causal,
                        window=window,
                        has_segments=True,
                    )
                    plan = np.asarray(segment_tile_plan(spec, arrays, tiles)).tolist()
                    for per_batch in plan:
                        for cta in per_batch:
                            first, _, _, end = cta[NUM_CONSUMERS]
                            ranges = tuple((c[0], c[3]) for c in cta[:NUM_CONSUMERS])
                            for stages in (2, 3):
                                plans.add(
                                    (first, end, ranges, num_kv_tiles(kv_len, block_kv), stages)
                                )
    return sorted(plans)


SEGMENT_PLANS = segment_plans()


def test_segment_plans_cover_the_hard_cases():
    """Among the segment plans: CTAs with no tile, idle consumers, leading and trailing
    drains, gaps that both consumers drain, CTAs with more tiles than ring slots."""
    assert any(first == end for first, end, *_ in SEGMENT_PLANS)
    assert any(
        lo == hi and first < end for first, end, ranges, *_ in SEGMENT_PLANS for lo, hi in ranges
    )
    assert any(first < lo < hi for first, _, ranges, *_ in SEGMENT_PLANS for lo, hi in ranges)
    assert any(lo < hi < end for _, end, ranges, *_ in SEGMENT_PLANS for lo, hi in ranges)
    assert any(
        set().union(*(range(lo, hi) for lo, hi in ranges)) != set(range(first, end))
        for first, end, ranges, *_ in SEGMENT_PLANS
    )
    assert any(end - first > stages for first, end, _, _, stages in SEGMENT_PLANS)


def test_protocol_with_segment_plans_never_hangs_or_races():
    for i, plan in enumerate(SEGMENT_PLANS):
        for seed in range(3):
            try:
                run_plan(plan, seed=1000 * i + seed)
            except ProtocolError as e:
                raise ProtocolError(f"{plan}: {e}") from None


@pytest.mark.parametrize(
    "broken, match",
    [
        # Without the ready waits the drained consumer's phase bits fall behind.
        (dict(wait_ready=False), "phases completed|deadlock|reads|missed"),
        # Without the schedule syncs the two consumers' syncs no longer pair up.
        (dict(sync=False), "deadlock|phases completed"),
    ],
)
def test_the_model_catches_a_broken_drain(broken, match):
    """A drain with a leading skip (window) and a broken drain step must fail in the model."""
    failures = 0
    for i, plan in enumerate(PLANS):
        first, end, ranges, *_ = plan
        if not any(first < lo < hi for lo, hi in ranges):
            continue
        try:
            run_plan(plan, seed=i, **broken)
        except ProtocolError as e:
            assert np.any([s in str(e) for s in match.split("|")]), e
            failures += 1
    assert failures > 0


# -- the backward (pallas_flash.mosaic.backward) ---------------------------------------------------
# Its two kernels stream a ring of two buffers per step, freed separately: dQ streams KV tiles
# (V as "v", K as "k"), dK/dV streams (query head, query tile) steps (dO as "v", Q as "k").
# A consumer walks every step of the CTA, computing those of its range and draining the others;
# there is no schedule barrier. The op sequences mirror `dkv._produce_dkv`,
# `dq._dq_kernel._producer`, `dkv._KeySteps.dkdv_step / drain_step` and
# `dq._consume_dq.kv_step / drain_step`.


def backward_producer_ops(num_steps: int, stages: int):
    """Both producers: step n into slot n % stages, "v" waited for and loaded first."""
    for n in range(num_steps):
        slot = n % stages
        if n >= stages:
            yield ("wait", FREE["v"], slot)
        yield ("issue", "v", slot, n)
        if n >= stages:
            yield ("wait", FREE["k"], slot)
        yield ("issue", "k", slot, n)


def backward_compute_step(kernel: str, n: int, slot: int):
    if kernel == "dkv":  # S^T = K Q^T, then dV, dP^T (dO), free dO, dK (Q), free Q
        yield ("wait", READY["k"], slot)
        yield ("read", "k", slot, n)
        yield ("wait", READY["v"], slot)
    else:  # S = Q K^T and dP = dO V^T together, free V, dQ += dS K, free K
        yield ("wait", READY["k"], slot)
        yield ("wait", READY["v"], slot)
        yield ("read", "k", slot, n)
    yield ("read", "v", slot, n)
    yield ("done", "v", slot)
    yield ("arrive", FREE["v"], slot)
    yield ("done", "k", slot)
    yield ("arrive", FREE["k"], slot)


def backward_drain_step(kernel: str, slot: int):
    if kernel == "dkv":
        yield ("wait", READY["k"], slot)
        yield ("wait", READY["v"], slot)
        yield ("arrive", FREE["v"], slot)
        yield ("arrive", FREE["k"], slot)
    else:
        yield ("wait", READY["v"], slot)
        yield ("arrive", FREE["v"], slot)
        yield ("wait", READY["k"], slot)
        yield ("arrive", FREE["k"], slot)


def backward_consumer_ops(kernel: str, first, end, lo, hi, stages: int, group: int):
    """Per query head of the group (dK/dV; dQ has one): drain [first, lo), compute [lo, hi),
    drain [hi, end)."""
    for h in range(group):
        for tile in range(first, end):
            n = h * (end - first) + tile - first
            if lo <= tile < hi:
                yield from backward_compute_step(kernel, n, n % stages)
            else:
                yield from backward_drain_step(kernel, n % stages)


def backward_plans(shapes):
    """Distinct (kernel, first, end, ranges, stages, group) of both backward kernels: from the
    kernels' geometry range functions over shapes, tiles, causal and windows, and from the
    segment-id plans (`schedule.tile_plan`) over random ids."""
    from pallas_flash.mosaic.backward_tiles import BackwardTiles
    from pallas_flash.mosaic.dkv import q_tile_ranges
    from pallas_flash.mosaic.dq import kv_tile_ranges
    from pallas_flash.mosaic.schedule import tile_plan

    plans = set()
    for q_len, kv_len in shapes:
        for n_c, block_q, block_kv in ((2, 64, 64), (1, 64, 64), (2, 128, 128)):
            tiles = BackwardTiles(block_q_dkv=block_q, block_kv_dq=block_kv, num_consumers=n_c)
            for is_causal, window in (
                (False, None),
                (True, None),
                (True, (70, 0)),
                (False, (5, 60)),
            ):
                spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window)
                for kernel, cta_rows, rows, ranges_of, length in (
                    ("dkv", tiles.cta_kv_rows, tiles.block_kv_dkv, q_tile_ranges, kv_len),
                    ("dq", tiles.cta_q_rows, tiles.block_q_dq, kv_tile_ranges, q_len),
                ):
                    for cta_start in range(0, length, cta_rows):
                        ranges = []
                        for wg in range(n_c):
                            cta, mine = ranges_of(spec, tiles, cta_start, cta_start + wg * rows)
                            ranges.append((int(mine[0]), int(mine[3])))
                        first, end = int(cta[0]), int(cta[1])
                        for stages in (2, 3):
                            plans.add((kernel, first, end, tuple(ranges), stages, 2))
            if block_q != 64:
                continue  # the segment plans' tiles: 64 x 64 with one and two consumers
            spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=True, has_segments=True)
            for kind in ("packed-lengths", "gap"):
                arrays = segment_arrays(kind, 2, q_len, kv_len, seed=q_len + block_kv)
                for kernel, over, rows, cols in (
                    ("dkv", "kv", tiles.block_kv_dkv, tiles.block_q_dkv),
                    ("dq", "q", tiles.block_q_dq, tiles.block_kv_dq),
                ):
                    plan = tile_plan(
                        spec, arrays, block_rows=rows, block_cols=cols, num_consumers=n_c, over=over
                    )
                    for cta in np.asarray(plan).reshape(-1, n_c + 1, 4).tolist():
                        ranges = tuple((c[0], c[3]) for c in cta[:n_c])
                        plans.add((kernel, cta[n_c][0], cta[n_c][3], ranges, 2, 2))
    return sorted(plans)


# A fixed slice in CI; all of them with PALLAS_FLASH_SWEEP.
BACKWARD_SHAPES = [(256, 512), (200, 328)]
if os.environ.get("PALLAS_FLASH_SWEEP"):
    BACKWARD_SHAPES += [(512, 256), (128, 1024), (1000, 40)]


def test_backward_protocol_never_hangs_or_races():
    plans = backward_plans(BACKWARD_SHAPES)
    # The hard cases: CTAs without steps, idle consumers, leading and trailing drains.
    assert any(first == end for _, first, end, *_ in plans)
    assert any(lo == hi and first < end for _, first, end, ranges, *_ in plans for lo, hi in ranges)
    assert any(first < lo < hi for _, first, _, ranges, *_ in plans for lo, hi in ranges)
    assert any(lo < hi < end for _, _, end, ranges, *_ in plans for lo, hi in ranges)
    for i, (kernel, first, end, ranges, stages, group) in enumerate(plans):
        steps = group * (end - first) if kernel == "dkv" else end - first
        if kernel == "dq":
            group = 1
        for seed in range(2):
            consumers = [
                backward_consumer_ops(kernel, first, end, lo, hi, stages, group)
                for lo, hi in ranges
            ]
            try:
                simulate(
                    backward_producer_ops(steps, stages), consumers, stages=stages, seed=i + seed
                )
            except ProtocolError as e:
                raise ProtocolError(f"{kernel, first, end, ranges, stages}: {e}") from None


# -- the consumer's arithmetic ---------------------------------------------------------------------


ARITHMETIC_CASES = [
    # (T, S, causal, window, soft cap, scale): rows without keys, scales whose qk_scale takes
    # MIN_LOGIT past float32's range, soft caps that bite.
    (512, 256, True, (10, 3), None, 0.09),
    (1024, 128, False, (1, 0), None, 0.125),
    (512, 256, False, (0, 0), None, 2.0),
    (512, 256, False, (1000, 1000), None, 3.0),
    (256, 512, False, (64, 32), 5.0, 1.0),
    (512, 256, True, (64, 0), 10.0, 1.0),
    (512, 512, True, None, 30.0, 1.0),
]


@pytest.mark.parametrize("case", ARITHMETIC_CASES, ids=case_id)
def test_consumer_arithmetic_matches_oracle(case):
    """The kernel's float32 arithmetic (MIN_LOGIT start, -inf hidden logits, the row max
    subtracted before scaling, exp2 soft cap, guarded epilogue) replayed in numpy: no NaN, rows
    without keys give exactly 0 and -inf, the rest is within float32 rounding of the float64
    oracle."""
    q_len, kv_len, is_causal, window, soft_cap, scale = case
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 64)).astype(f32) for n in (q_len, kv_len, kv_len))
    spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window)
    keys = spec.geometry(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])
    visible = np.broadcast_to(keys, (q_len, kv_len))
    with np.errstate(invalid="raise"):
        out, lse = consumer_arithmetic(q, k, v, spec, scale, soft_cap, ForwardTiles(block_kv=64))
    oracle = attention_oracle_f64(
        *(x[None, :, None] for x in (q, k, v)), scale=scale, visible=visible, soft_cap=soft_cap
    )
    want_out, want_lse = oracle["out"][0, :, 0], oracle["lse"][0, 0]
    empty = ~visible.any(axis=1)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    np.testing.assert_allclose(out, want_out, atol=1e-4)
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=1e-4, rtol=1e-5)


SEGMENT_ARITHMETIC_CASES = [
    # (T, S, causal, window, soft cap, scale, segment kind)
    (512, 256, True, None, None, 0.125, "packed-lengths"),
    (256, 512, False, None, None, 2.0, "lengths"),
    (256, 512, False, (64, 32), 5.0, 1.0, "unsorted"),
    (512, 512, True, (100, 0), None, 0.09, "packed"),
    (256, 512, False, None, 30.0, 1.0, "gap"),
]


@pytest.mark.parametrize("case", SEGMENT_ARITHMETIC_CASES, ids=case_id)
def test_consumer_arithmetic_with_segments_matches_oracle(case):
    """The replay with segment ids and the ranges of `segment_tile_plan`: padding rows, rows of
    a batch entry without keys and rows whose document has no key in reach give exactly 0 and
    -inf, no NaN, the rest matches the float64 oracle."""
    q_len, kv_len, is_causal, window, soft_cap, scale, kind = case
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 64)).astype(f32) for n in (q_len, kv_len, kv_len))
    spec = MaskSpec(
        q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window, has_segments=True
    )
    arrays = segment_arrays(kind, 2, q_len, kv_len, seed=3)
    tiles = ForwardTiles(block_kv=64)
    for b in range(2):
        ids = (np.asarray(arrays.q_segment_ids[b]), np.asarray(arrays.kv_segment_ids[b]))
        visible = np.asarray(masks.dense(spec, MaskArrays(*(x[None] for x in ids))))[0, 0]
        with np.errstate(invalid="raise"):
            out, lse = consumer_arithmetic(q, k, v, spec, scale, soft_cap, tiles, ids=ids)
        oracle = attention_oracle_f64(
            *(x[None, :, None] for x in (q, k, v)), scale=scale, visible=visible, soft_cap=soft_cap
        )
        want_out, want_lse = oracle["out"][0, :, 0], oracle["lse"][0, 0]
        empty = ~visible.any(axis=1)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
        np.testing.assert_allclose(out, want_out, atol=1e-4)
        np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=1e-4, rtol=1e-5)


def consumer_arithmetic(
    q, k, v, spec: MaskSpec, scale: float, soft_cap, tiles: ForwardTiles, ids=None
):
    """`_consume` in float32 numpy for one head, q [T, H], k and v [S, H]: the CTA and consumer
    ranges, the element-wise masks, the online softmax and the epilogue. ids: None or segment
    ids (q_ids [T], kv_ids [S]); the ranges then come from `segment_tile_plan`."""
    q_len, head_dim = q.shape
    block_q, block_kv = tiles.block_q, tiles.block_kv
    qk_scale = f32(scale * LOG2E)
    # The logits' units: q.k, or the capped logits in log2 units; unit converts to natural log.
    unit2, unit = (qk_scale, f32(scale)) if soft_cap is None else (f32(1.0), f32(LN2))
    out, lse = np.zeros((q_len, head_dim), f32), np.zeros(q_len, f32)
    mask_left, mask_right = mask_sides(spec, tiles)
    if ids is not None:
        plan = np.asarray(segment_tile_plan(spec, MaskArrays(*(x[None] for x in ids)), tiles))[0]
    for cta_start in range(0, q_len, tiles.cta_rows):
        if ids is None:
            cta_range = cta_tile_range(spec, cta_start, tiles)
        for wg in range(NUM_CONSUMERS):
            q_start = cta_start + wg * block_q
            if ids is None:
                lo, full_lo, full_hi, hi = consumer_tile_range(spec, q_start, cta_range, tiles)
            else:
                lo, full_lo, full_hi, hi = plan[cta_start // tiles.cta_rows, wg]
            acc = np.zeros((block_q, head_dim), f32)
            m_i, l_i = np.full(block_q, MIN_LOGIT, f32), np.zeros(block_q, f32)
            for tile in range(lo, hi):
                keys = slice(tile * block_kv, (tile + 1) * block_kv)
                qk = q[q_start : q_start + block_q] @ k[keys].T
                visible = None
                if not full_lo <= tile < full_hi:
                    q_pos = q_start + np.arange(block_q)[:, None]
                    kv_pos = tile * block_kv + np.arange(block_kv)[None, :]
                    visible = np.ones((block_q, block_kv), bool)
                    if mask_right:
                        visible &= kv_pos <= q_pos + spec.right
                    if mask_left:
                        visible &= kv_pos >= q_pos - spec.left
                    if ids is not None:
                        rows, keys_ids = ids[0][q_start : q_start + block_q], ids[1][keys]
                        visible &= rows[:, None] == keys_ids[None, :]
                s = qk
                if soft_cap is not None:
                    cap2 = f32(soft_cap * LOG2E)
                    e = np.exp2(qk * f32(2.0 * LOG2E * scale / soft_cap))
                    s = cap2 - f32(2.0 * cap2) / (e + f32(1.0))
                if visible is not None:
                    s = np.where(visible, s, f32(-np.inf))
                m_new = np.maximum(m_i, s.max(axis=1))
                with np.errstate(over="ignore"):  # MIN_LOGIT - m may round to -inf
                    p = np.exp2((s - m_new[:, None]) * unit2)
                    alpha = np.exp2((m_i - m_new) * unit2)
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + p @ v[keys]
                m_i = m_new
            empty = l_i == 0.0
            l_safe = np.where(empty, f32(1.0), l_i)
            out[q_start : q_start + block_q] = acc * (f32(1.0) / l_safe)[:, None]
            with np.errstate(divide="ignore", over="ignore"):  # empty rows: MIN_LOGIT * unit
                row_lse = np.where(empty, -np.inf, m_i * unit + np.log(l_safe))
            lse[q_start : q_start + block_q] = row_lse
    return out, lse
