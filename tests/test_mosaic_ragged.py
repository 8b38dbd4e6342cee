"""The Mosaic GPU prefill of ragged paged attention (pallas_flash.mosaic.ragged): its work list
against brute force; its kernel in jax's Mosaic GPU interpreter against the float64 oracle
(alone, and beside the Triton decode launch in the Pallas interpreter): odd lengths, empty
sequences, shuffled pages with NaN past the lengths, cached prefixes, GQA groups 1-4, windows,
soft caps, sinks, pages of 8-256 keys, a value head dim of its own; lowering for an abstract
H200 and the routing of `ragged_paged_attention` there; compiled on Hopper (gpu)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS, SWEEP_ONLY, BackendPath, has_hopper
from support.inputs import case_id
from support.lowering import lower_for_h200
from support.mosaic_interpret import interpret_mosaic
from support.ragged import Case, check, make_problem, run

import pallas_flash
from pallas_flash import mosaic, ragged
from pallas_flash.device import Device
from pallas_flash.mosaic import ragged as mosaic_ragged
from pallas_flash.mosaic import schedule as mosaic_schedule
from pallas_flash.mosaic.tiles import NUM_CONSUMERS, ROW_ALIGN, ragged_prefill_tiles
from pallas_flash.triton import ragged as triton_ragged

XLA = BACKEND_PATHS["xla"]

# -- the work list (XLA), against brute force ------------------------------------------------------


def plan_of(
    q_lens,
    lengths,
    *,
    window,
    tiles,
    min_tokens=1,
    max_tokens=10**6,
    capacity=4096,
    num_heads=3,
    num_ctas=5,
    with_walk=False,
):
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tiles = mosaic_ragged.tile_bound(
        int(starts[-1]) + 3, len(q_lens), min_tokens, max_tokens, tiles.cta_rows
    )
    plan_fn = jax.jit(
        mosaic_ragged.ragged_tile_plan,
        static_argnames=(
            "capacity",
            "min_tokens",
            "max_tokens",
            "window_left",
            "tiles",
            "num_tiles",
            "num_heads",
            "num_ctas",
        ),
    )
    plan, walk, first_row, fits = plan_fn(
        jnp.asarray(starts),
        jnp.asarray(lengths, jnp.int32),
        capacity=capacity,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        window_left=window,
        tiles=tiles,
        num_tiles=num_tiles,
        num_heads=num_heads,
        num_ctas=num_ctas,
    )
    if with_walk:
        return np.asarray(plan), np.asarray(walk)
    rows = mosaic_ragged.token_rows(jnp.asarray(starts), first_row, fits, int(starts[-1]) + 3)
    return starts, np.asarray(plan), np.asarray(rows), np.asarray(fits)


@pytest.mark.parametrize(
    "window, block_kv", [(None, 128), (5, 64), (200, 128), (None, 64), (5, 128), (200, 64)]
)
@pytest.mark.ci_slice(3)
def test_plan_covers_every_token_and_key(window, block_kv):
    """Every token of a sequence of this launch lies in one tile's rows, where token_rows puts
    it; each consumer's range holds every key its tokens see, its full tiles are seen whole by
    all of them, and first <= lo <= full_lo <= full_hi <= hi <= end (lo = full_lo = first
    without a window: `_consume` drains nothing before its range there); the tiles' count
    stays within the bound."""
    tiles = dataclasses.replace(ragged_prefill_tiles(64), block_kv=block_kv)
    rng = np.random.default_rng(block_kv + (window or 0))
    q_lens = [0, 1, 7, 130, 3, 64, 65, 200, 9, 0, 128, 11]
    lengths = [q + int(rng.integers(0, 300)) for q in q_lens]
    starts, plan, rows, fits = plan_of(q_lens, lengths, window=window, tiles=tiles, min_tokens=3)
    item, tokens = mosaic_ragged._ITEM_ROW, mosaic_ragged._TOKENS_ROW
    count = plan[0, item, 3]
    assert count <= plan.shape[0]
    seen = np.zeros(starts[-1], bool)
    for tile in range(count):
        seq, row0, offset = plan[tile, item, :3]
        assert row0 % ROW_ALIGN == 0 and fits[seq]
        assert tuple(plan[tile, tokens]) == (starts[seq], starts[seq + 1], 0, 0)
        first, _, _, end = plan[tile, NUM_CONSUMERS]
        for wg in range(NUM_CONSUMERS):
            lo, full_lo, full_hi, hi = plan[tile, wg]
            assert first <= lo <= full_lo <= full_hi <= hi <= end
            if window is None:
                assert lo == full_lo == first
            for r in range(row0 + wg * tiles.block_q, row0 + (wg + 1) * tiles.block_q):
                if not starts[seq] <= r < starts[seq + 1]:
                    continue
                assert not seen[r]
                seen[r] = True
                assert rows[r] == tile * tiles.cta_rows + r - row0
                pos = r + offset
                keys = np.arange(max(0, pos - (window or pos)), pos + 1)
                assert np.all(keys >= lo * block_kv) and np.all(keys < hi * block_kv)
                full = np.arange(full_lo * block_kv, full_hi * block_kv)
                assert np.all((full <= pos) & (full >= pos - (window or pos)))
    q_lens = np.asarray(q_lens)
    want = np.repeat(q_lens >= 3, q_lens)
    np.testing.assert_array_equal(seen, want)


def cta_items(walk, count, num_heads, num_ctas):
    """Each CTA's items (tile, head) in its order, as `_ragged_kernel` walks the walk."""
    total = count * num_heads
    rounds, left = divmod(total, num_ctas)
    n = np.arange(rounds + 1)
    places = np.asarray(
        mosaic_schedule._Work.round_place(np.arange(num_ctas)[:, None], n[None, :], num_ctas)
    )
    per_cta = []
    for c in range(num_ctas):
        n_items = rounds + int(places[c, rounds] < left)
        entries = walk[n[:n_items] * num_ctas + places[c, :n_items]].tolist()
        per_cta.append([divmod(e, num_heads) for e in entries])
    return per_cta


@pytest.mark.parametrize(
    "q_lens, lengths, window, heads, ctas, bound",
    [
        # Four 2k sequences at N=32 on 132 CTAs (B4 S2k): the forward's pairs' balance (1.0085).
        ((2048,) * 4, (2048,) * 4, None, 32, 132, 1.01),
        # Ragged lengths, cached prefixes, empty sequences and odd tile counts (middle tiles).
        ((0, 1000, 517, 3, 0, 300, 2048), (0, 1000, 2000, 100, 9, 300, 3000), None, 8, 20, 1.06),
        ((700, 5, 1300), (900, 5, 1500), None, 5, 7, 1.1),
        # A window: no pairs, every item by cost.
        ((2048,) * 2, (2048,) * 2, 300, 8, 20, 1.04),
    ],
)
def test_walk_runs_every_item_once_in_pairs(q_lens, lengths, window, heads, ctas, bound):
    """The CTAs' snake over the walk runs every (tile, head) of the batch once; the rounds of
    pairs give a CTA a sequence's tiles (Q_b - 1 - i, i) of one head, the long one first, and
    the pairs of a round the few heads of one or two sequences; the modelled work (KV tiles)
    of the busiest CTA stays within `bound` of the mean."""
    tiles = ragged_prefill_tiles(128)
    plan, walk = plan_of(
        q_lens,
        lengths,
        window=window,
        tiles=tiles,
        capacity=4096,
        num_heads=heads,
        num_ctas=ctas,
        with_walk=True,
    )
    item, cta = mosaic_ragged._ITEM_ROW, mosaic_ragged._CTA_ROW
    count = int(plan[0, item, 3])
    assert walk.shape == (plan.shape[0] * heads,)
    assert not walk[count * heads :].any()  # read (in bounds) past a CTA's items, not run
    per_cta = cta_items(walk, count, heads, ctas)
    runs = sorted(x for items in per_cta for x in items)
    assert runs == sorted(np.ndindex(count, heads))
    seq = plan[:, item, 0]
    first_tile = {s: int(np.argmax(seq[:count] == s)) for s in set(seq[:count].tolist())}
    num_tiles = {s: int(np.sum(seq[:count] == s)) for s in first_tile}
    paired = 0
    for items in per_cta:
        for (long, h0), (short, h1) in zip(items[::2], items[1::2], strict=False):
            s = seq[long]
            i, j = long - first_tile[s], short - first_tile[s]
            if seq[short] != s or h0 != h1 or i + j != num_tiles[s] - 1 or i <= j:
                break
            paired += 1
    pairs = heads * sum(n // 2 for n in num_tiles.values())
    if window is None:
        # Every whole round of pairs but the last (the tail goes as single tiles).
        assert paired >= max(pairs // ctas - 1, 0) * ctas, (paired, pairs)
        if pairs >= 2 * ctas:
            assert paired > 0
    cost = plan[:, cta, 3] - plan[:, cta, 0]
    loads = [sum(int(cost[t]) for t, _ in items) for items in per_cta]
    assert max(loads) <= bound * np.mean(loads), (max(loads), np.mean(loads))


# -- the kernel in the Mosaic GPU interpreter (CPU) ----------------------------------------------


def interpreted_prefill(*args, **kwargs):
    """`ragged._mosaic_prefill` in jax's Mosaic GPU interpreter (eager: the Triton launches
    around it run in the Pallas interpreter, outside it)."""
    with interpret_mosaic():
        return jax.block_until_ready(ragged._mosaic_prefill(*args, **kwargs))


def mosaic_and_xla(c: Case, args, sinks, *, min_tokens: int = 1):
    """[xla's (out, lse), the Mosaic prefill's rows of sequences of min_tokens or more new
    tokens with xla's elsewhere]."""
    (xla,) = run(c, args, sinks, XLA)
    q, k_pages, v_pages, tables, starts, lengths = args
    out, lse = interpreted_prefill(
        q,
        k_pages,
        v_pages,
        tables,
        starts,
        lengths,
        sinks,
        scale=c.head_dim**-0.5,
        soft_cap=c.soft_cap,
        window_left=c.window,
        min_tokens=min_tokens,
        max_tokens=q.shape[0],
        num_sms=3,  # several items a CTA: the ring and Q buffers run on across items
    )
    token_seq = np.repeat(np.arange(len(c.q_lens)), c.q_lens)
    mine = np.zeros(c.num_tokens, bool)
    mine[: len(token_seq)] = np.asarray(c.q_lens)[token_seq] >= min_tokens
    merged_out = jnp.where(mine[:, None, None], out, xla[0])
    merged_lse = jnp.where(mine[None, :], lse, xla[1])
    assert mine.any()
    return [xla, (merged_out, merged_lse)]


# Odd lengths, empty sequences, cached prefixes (L > q_len), shuffled pages with NaN past the
# lengths and in unused pages, padding rows (NaN in q).
KERNEL_CASES = [
    # Group 4, pages of 64 (two copies a 128-key tile), a window and sinks; sequences that
    # start and end inside 8-row groups (one within a single group).
    Case(
        (5, 70, 0, 2, 130),
        (5, 300, 9, 9, 200),
        4,
        1,
        64,
        64,
        6,
        dtype="bfloat16",
        window=100,
        sinks=True,
    ),
    # Group 1 in float16, pages of 256 (two tiles a page), a soft cap.
    pytest.param(
        Case((129, 1, 64), (129, 500, 300), 4, 4, 128, 256, 2, dtype="float16", soft_cap=5.0),
        marks=SWEEP_ONLY,
    ),
    # Pages of 8 (16 copies a tile), padding rows.
    pytest.param(
        Case((20, 140), (30, 141), 2, 2, 64, 8, 20, dtype="bfloat16", pad=5), marks=SWEEP_ONLY
    ),
    # H=256 (one Q buffer a consumer: the next item's Q loads after this one's epilogue),
    # pages of 16, group 2.
    Case((70, 9, 130), (100, 9, 140), 2, 1, 256, 16, 10, dtype="bfloat16"),
    # Rounds of pairs (`ragged_walk`) on the 3 CTAs: two sequences of two tiles over
    # different prefixes, a middle tile between them; group 2, pages of 32 (the walk itself:
    # test_walk_runs_every_item_once_in_pairs; on a GPU the 2048-token case has pairs).
    pytest.param(
        Case((250, 3, 140), (300, 3, 140), 4, 2, 64, 32, 12, dtype="bfloat16"),
        marks=SWEEP_ONLY,
    ),
    # A value head dim of its own (128 / 64), group 2, pages of 16.
    pytest.param(
        Case((66, 9), (80, 9), 4, 2, 128, 16, 6, value_head_dim=64, dtype="bfloat16"),
        marks=SWEEP_ONLY,
    ),
]


@pytest.mark.parametrize("c", KERNEL_CASES, ids=case_id)
def test_kernel_matches_oracle_in_interpreter(c):
    args, sinks, oracle_inputs = make_problem(c)
    results = mosaic_and_xla(c, args, sinks, min_tokens=2)
    check(c, results, oracle_inputs, sinks, ["xla", "mosaic"])


@SWEEP_ONLY
def test_kernel_without_items_in_interpreter():
    """A batch with no sequence of this launch (all shorter than min_tokens, the work list's
    bound not 0): every CTA exits without an item, no barrier waits forever."""
    c = Case((1, 1, 1), (5, 9, 3), 2, 1, 64, 16, 2, dtype="bfloat16")
    args, _, _ = make_problem(c)
    kwargs = dict(scale=0.1, soft_cap=None, window_left=None, min_tokens=2, max_tokens=3)
    assert mosaic_ragged.tile_bound(3, 3, 2, 3, 128) == 1
    out, lse = interpreted_prefill(*args, None, num_sms=4, **kwargs)
    assert out.shape == (3, 2, 64) and lse.shape == (2, 3)


def test_prefill_launch_in_the_ragged_call_in_interpreter():
    """`triton.ragged.ragged_forward` with the Mosaic prefill (`prefill=`, as the ragged call
    passes it on Hopper): decode steps, an empty sequence and padding rows on the Triton decode
    launch (Pallas interpreter), chunks of 70 and 75 tokens over cached prefixes on the Mosaic
    kernel (Mosaic GPU interpreter); group 4, pages of 16, a window, a soft cap, sinks."""
    c = Case(
        (1, 70, 0, 3, 75, 1),
        (50, 100, 9, 9, 150, 7),
        4,
        1,
        64,
        16,
        10,
        dtype="bfloat16",
        pad=3,
        sinks=True,
        window=90,
        soft_cap=5.0,
    )
    args, sinks, oracle_inputs = make_problem(c)
    q, k_pages, v_pages, tables, starts, lengths = args
    block_sizes = triton_ragged.ragged_block_sizes(
        q.shape, 6, 1, 16 * 10, q.dtype, interpret=True, page_size=16
    )
    calls = []

    def prefill(*a, **kw):
        calls.append(kw)
        return interpreted_prefill(*a, **kw)

    out, lse = triton_ragged.ragged_forward(
        *args,
        sinks,
        scale=c.head_dim**-0.5,
        soft_cap=c.soft_cap,
        window_left=c.window,
        block_sizes=block_sizes,
        interpret=True,
        prefill=prefill,
    )
    assert [(kw["min_tokens"], kw["max_tokens"]) for kw in calls] == [(5, c.num_tokens)]
    check(c, run(c, args, sinks, XLA) + [(out, lse)], oracle_inputs, sinks, ["xla", "mosaic"])


# -- lowering for an abstract H200 (CPU) and the routing -----------------------------------------


def abstract_args(num_tokens, batch, heads, kv_heads, head_dim, hv, page, max_pages, dtype):
    s = jax.ShapeDtypeStruct
    pages = batch * max_pages
    return (
        s((num_tokens, heads, head_dim), dtype),
        s((pages, page, kv_heads, head_dim), dtype),
        s((pages, page, kv_heads, hv), dtype),
        s((batch, max_pages), jnp.int32),
        s((batch + 1,), jnp.int32),
        s((batch,), jnp.int32),
    )


LOWERING = [
    # (T, B, N, K, H, Hv, page, max_pages, window, soft cap, sinks)
    (300, 4, 8, 2, 64, 64, 64, 16, 100, None, True),
    (200, 3, 4, 4, 128, 128, 256, 4, None, 30.0, False),
    (200, 3, 4, 2, 256, 256, 32, 16, None, 30.0, True),
    (300, 4, 8, 2, 128, 128, 16, 64, None, None, False),
    (200, 3, 4, 1, 192, 128, 128, 8, None, None, True),
    (100, 2, 4, 4, 96, 96, 8, 64, None, None, False),
]


@pytest.mark.parametrize("case", LOWERING, ids=lambda c: f"H{c[4]}-Hv{c[5]}-page{c[6]}")
@pytest.mark.ci_slice(3)
def test_kernel_lowers_for_h200(case):
    *shape, window, soft_cap, sinks = case
    args = abstract_args(*shape, jnp.bfloat16)
    if sinks:
        args += (jax.ShapeDtypeStruct((shape[2],), jnp.float32),)
    fn = functools.partial(
        mosaic_ragged.ragged_prefill,
        scale=0.1,
        soft_cap=soft_cap,
        window_left=window,
        min_tokens=2,
        max_tokens=shape[0],
    )
    lowered = lower_for_h200(fn, *args)
    assert "mosaic_gpu" in lowered.as_text()
    out, lse = lowered.out_info
    assert out.shape == (shape[0], shape[2], shape[5]) and lse.shape == (shape[2], shape[0])


def public_call(**options):
    def call(q, k_pages, v_pages, tables, starts, lengths):
        return pallas_flash.ragged_paged_attention(
            q, k_pages, v_pages, tables, starts, lengths, **options
        )

    return call


@pytest.mark.parametrize(
    "backend, mosaic_kernels", [(None, 1), ("mosaic", 1), ("triton", 0)], ids=str
)
def test_the_ragged_call_routes_its_prefill_for_h200(backend, mosaic_kernels):
    """On an H200 (abstract) the prefill launch takes the Mosaic kernel unless backend="triton";
    the decode launch stays Triton's."""
    args = abstract_args(300, 4, 8, 2, 128, 128, 16, 64, jnp.bfloat16)
    text = lower_for_h200(public_call(backend=backend), *args).as_text()
    assert text.count("mosaic_gpu") >= mosaic_kernels
    assert ("mosaic_gpu" in text) == bool(mosaic_kernels)
    assert "pallas_flash_ragged_decode" in text
    assert ("pallas_flash_ragged_prefill" in text) != bool(mosaic_kernels)


def test_the_ragged_call_keeps_triton_where_mosaic_does_not_take_it():
    """backend=None on an H200 runs the Triton prefill for what the Mosaic kernel does not take
    (pages of 12 keys); backend="mosaic" raises NotImplementedError naming it."""
    args = abstract_args(300, 4, 8, 2, 128, 128, 12, 64, jnp.bfloat16)
    text = lower_for_h200(public_call(), *args).as_text()
    assert "mosaic_gpu" not in text and "pallas_flash_ragged_prefill" in text
    with pytest.raises(NotImplementedError, match="backend='mosaic'.*page_size=12"):
        lower_for_h200(public_call(backend="mosaic"), *args)


def test_block_sizes_keep_or_refuse_the_mosaic_prefill():
    """block_sizes configure the Triton launches: with backend=None the prefill stays Triton's;
    backend="mosaic" takes the decode launch's fields and refuses the prefill launch's."""
    args = abstract_args(300, 4, 8, 2, 128, 128, 16, 64, jnp.bfloat16)
    decode_tiles = pallas_flash.RaggedBlockSizes(block_m=32)
    text = lower_for_h200(public_call(block_sizes=decode_tiles), *args).as_text()
    assert "mosaic_gpu" not in text and "pallas_flash_ragged_prefill" in text
    text = lower_for_h200(public_call(backend="mosaic", block_sizes=decode_tiles), *args)
    assert "mosaic_gpu" in text.as_text()
    prefill_tiles = pallas_flash.RaggedBlockSizes(block_m_prefill=64)
    with pytest.raises(NotImplementedError, match="block_m_prefill=64"):
        lower_for_h200(public_call(backend="mosaic", block_sizes=prefill_tiles), *args)


def test_why_not_ragged_prefill():
    h200 = Device.h200()
    why = functools.partial(
        mosaic.why_not_ragged_prefill, window_left=None, soft_cap=None, device=h200
    )
    bf16 = jnp.bfloat16
    assert why((300, 8, 128), (64, 16, 2, 128), 128, bf16, cache_dtype=bf16) is None
    assert why((300, 8, 64), (64, 256, 2, 64), 64, bf16, cache_dtype=bf16) is None
    assert why((300, 8, 256), (64, 16, 2, 256), 256, bf16, cache_dtype=bf16) is None
    reasons = {
        "Hopper": why((9, 8, 128), (64, 16, 2, 128), 128, bf16, cache_dtype=bf16, device=None),
        "latent": why((9, 8, 128), (64, 16, 1, 128), None, bf16, cache_dtype=bf16),
        "float8_e4m3fn": why(
            (9, 8, 128), (9, 16, 2, 128), 128, bf16, cache_dtype=jnp.float8_e4m3fn
        ),
        "float32": why((9, 8, 128), (9, 16, 2, 128), 128, jnp.float32, cache_dtype=jnp.float32),
        "page_size=12": why((9, 8, 128), (9, 12, 2, 128), 128, bf16, cache_dtype=bf16),
        "page_size=4": why((9, 8, 128), (9, 4, 2, 128), 128, bf16, cache_dtype=bf16),
        "head_dim=32": why((9, 8, 32), (9, 16, 2, 32), 32, bf16, cache_dtype=bf16),
    }
    for name, reason in reasons.items():
        assert reason is not None and name in reason, (name, reason)


# -- compiled on Hopper (gpu) ----------------------------------------------------------------------

DEFAULT = BackendPath("default", {}, gpu=True)
MOSAIC = BackendPath("mosaic", {"backend": "mosaic"}, gpu=True)

GPU_CASES = [
    *(c.values[0] if hasattr(c, "values") else c for c in KERNEL_CASES),
    # Long chunks beside decode steps, GQA 8, pages of 16, bf16.
    Case(
        (1000, 1, 1, 517, 0, 2048, 3),
        (1000, 300, 4000, 1517, 5, 3000, 9000),
        32,
        4,
        128,
        16,
        600,
        pad=5,
        dtype="bfloat16",
    ),
    # Pages of 128 (one tile a page), a window, a soft cap and sinks, H=64.
    Case(
        (333, 129, 64, 1),
        (2000, 129, 64, 70),
        16,
        2,
        64,
        128,
        20,
        window=300,
        soft_cap=30.0,
        sinks=True,
        dtype="bfloat16",
    ),
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
@pytest.mark.parametrize("c", GPU_CASES, ids=case_id)
def test_gpu_matches_oracle(c):
    args, sinks, oracle_inputs = make_problem(c)
    results = run(c, args, sinks, XLA, DEFAULT, MOSAIC)
    check(c, results, oracle_inputs, sinks, ["xla", "default", "mosaic"])
