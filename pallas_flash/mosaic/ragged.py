"""The prefill launch of ragged paged attention on Hopper: the Mosaic GPU forward's
warp-specialised kernel (`pallas_flash.mosaic.forward`: its consumers' `_consume`, its ring and
producer) over a paged KV cache and a work list.

A work item is one CTA tile (NUM_CONSUMERS * block_q new tokens of one sequence) of one query
head; XLA writes the list before the launch (`ragged_tile_plan`: per tile its sequence, first
token, position offset and the KV tile ranges of its CTA and consumers, as the forward's
segment plan; and the order of the items, `ragged_walk`), and a persistent grid walks it in a
snake. The order is the forward's causal pairs: a CTA takes a sequence's tiles (Q_b - 1 - i,
i) of one head, of equal work, one after the other, the pairs of a round a few neighbouring
heads of one sequence, so that their K/V stay in L2 (query head n reads KV head n // (N //
K)); the last rounds go as single tiles, the dearest first.

K/V tiles come from the pages by TMA: one copy per page into a ring slot where a page is
shorter than a KV tile (block_kv / page_size copies that arrive on the slot's barrier, each
with its bytes), a block_kv-row part of one page where a page holds several tiles; the page ids
are scalar loads from the block table, one step ahead of their copies. Q loads straight from
q's rows, a sequence's tiles from its first token rounded down to ROW_ALIGN (a TMA window into
q's token dim starts on its 8-row tiles): the up to 7 rows before it and the rows past its last
token are other sequences' tokens (or zeros past T), computed and not kept. The output is
stored in place, the whole 8-row groups of a sequence's rows by TMA and its first and last
groups, which hold other sequences' rows too, through a small buffer that XLA writes into the
output after the kernel; lse goes to a tile-padded buffer that XLA gathers from.

Token i of sequence b (new tokens q_len_b, keys L_b) sits at position L_b - q_len_b + i and
sees keys j <= that position (and j >= position - window_left): the forward's causal mask with
a per-item offset of the query positions. The tiles every row of a consumer sees whole are
never past L_b; the tiles that hold keys past L_b (whatever the pages hold there, NaN
included) are masked ones, whose non-finite V the consumer zeroes before P.V.

Which sequences run here is the caller's choice (`min_tokens` <= q_len_b <= `max_tokens`);
the other rows of the output are left for the other launch to write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.device import DEFAULT_NUM_SMS
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic.forward import _consume, _produce, _Ring, ring_scratch
from pallas_flash.mosaic.launch import (
    opaque_zero,
    warp_specialised_kernel,
)
from pallas_flash.mosaic.schedule import _Work
from pallas_flash.mosaic.tiles import (
    FORWARD_CONSUMER_REGISTERS,
    FORWARD_PRODUCER_REGISTERS,
    NUM_CONSUMERS,
    ROW_ALIGN,
    ForwardTiles,
    aligned_len,
    cdiv,
    page_copies,
    ragged_prefill_q_buffers,
    ragged_prefill_tiles,
)

# The plan's rows per tile: each consumer's (lo, full_lo, full_hi, hi), the CTA's (first,
# first, end, end), then the tile's (sequence, first token, position offset, tiles in all).
_CTA_ROW = NUM_CONSUMERS
_ITEM_ROW = NUM_CONSUMERS + 1
# ... and the sequence's (first token, end token, 0, 0).
_TOKENS_ROW = NUM_CONSUMERS + 2
# Rows of the fringe buffer per sequence: the ROW_ALIGN-row groups of q's rows that hold its
# first and its last token, where those groups hold other rows too.
_FRINGE = 2 * ROW_ALIGN


def tile_bound(num_tokens: int, batch: int, min_tokens: int, max_tokens: int, cta_rows: int):
    """The most CTA tiles any batch of these shapes has: the sequences of this launch have at
    least min_tokens and at most max_tokens new tokens each, and their tiles start up to
    ROW_ALIGN - 1 rows before their first token (`ragged_tile_plan`)."""
    most = min(num_tokens, max_tokens)
    if most < min_tokens:
        return 0
    longer = min(batch, num_tokens // max(min_tokens, 1))
    lead = ROW_ALIGN - 1
    return max(
        0,
        min(
            (num_tokens + longer * (cta_rows - 1 + lead)) // cta_rows,
            longer * cdiv(most + lead, cta_rows),
        ),
    )


def ragged_tile_plan(
    starts,
    lengths,
    *,
    capacity: int,
    min_tokens: int,
    max_tokens: int,
    window_left: int | None,
    tiles: ForwardTiles,
    num_tiles: int,
    num_heads: int,
    num_ctas: int,
):
    """(plan, walk, first_row, fits) in XLA: the tiles, int32 [num_tiles, NUM_CONSUMERS + 3, 4];
    the work list, int32 [num_tiles * num_heads] (`ragged_walk`); each sequence's first row in
    the tile-padded lse, less its first token's aligned row [B]; and whether this launch runs
    it [B] (`token_rows`). starts: the safe query starts [B + 1]; lengths [B] (clipped here to
    [0, capacity]).

    A sequence's tiles start at its first token rounded down to ROW_ALIGN (a TMA window's
    start in q's token dim must be a multiple of its 8-row tiles): up to 7 rows of q before it
    lead its first tile, computed and not kept, as are the rows past its last token.
    Tiles in sequence order; those past the batch's tiles (their count is the plan's [0,
    _ITEM_ROW, 3]) are never visited.

    Per tile: rows wg < NUM_CONSUMERS are consumer wg's KV tile range (lo, full_lo, full_hi, hi)
    for the sequence's tokens among its block_q rows, clamped into the CTA's; row _CTA_ROW the
    CTA's (first, first, end, end), the hull of its consumers' non-empty ranges
    (`schedule.tile_plan`'s rules, which `forward._consume` walks); row _ITEM_ROW (sequence,
    first row of q, the offset from a row of q to its position, the number of tiles); row
    _TOKENS_ROW (the sequence's first token, its end, 0, 0)."""
    cta_rows, block_kv = tiles.cta_rows, tiles.block_kv
    batch = lengths.shape[0]
    first_token, end_token = starts[:-1], starts[1:]
    q_lens = end_token - first_token
    aligned = first_token - lax.rem(first_token, ROW_ALIGN)
    lengths = jnp.clip(lengths, 0, capacity)
    fits = (q_lens >= min_tokens) & (q_lens <= max_tokens)
    seq_tiles = jnp.where(fits, _cdiv(end_token - aligned, cta_rows), 0)
    end = _running_sum(seq_tiles)
    first_tile = end - seq_tiles
    count = end[-1]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum(end[None, :] <= tile[:, None], axis=1), batch - 1)
    offsets = lengths - q_lens - first_token
    geometry = functools.partial(
        _tile_ranges, window_left=window_left, tiles=tiles, never=cdiv(capacity, block_kv)
    )
    # The tile's sequence's numbers, one gather.
    columns = (aligned, first_tile, offsets, lengths, first_token, end_token, seq_tiles)
    columns = jnp.stack(columns, axis=1)[seq]
    aligned_t, first_tile_t, offset, length, first_t, end_t, tiles_t = (
        columns[:, i] for i in range(7)
    )
    index = tile - first_tile_t
    row0 = aligned_t + index * cta_rows
    ranges, first, last = geometry(row0, first_t, end_t, offset, length)
    columns = [jnp.clip(x, first, last) for r in ranges for x in r]
    columns += [first, first, last, last, seq, row0, offset, jnp.broadcast_to(count, seq.shape)]
    columns += [first_t, end_t]  # and two zeros
    plan = _assemble(columns, num_tiles).reshape(num_tiles, _TOKENS_ROW + 1, 4)
    # Each sequence's pairs' cost: its first and last tiles' KV tiles.
    pair_cost = 0
    for row in (aligned, aligned + (seq_tiles - 1) * cta_rows):
        _, lo, hi = geometry(row, first_token, end_token, offsets, lengths)
        pair_cost = pair_cost + hi - lo
    walk = ragged_walk(
        last - first,
        seq,
        index,
        tiles_t,
        seq_tiles,
        pair_cost,
        count,
        num_heads=num_heads,
        num_ctas=num_ctas,
        paired=window_left is None,
    )
    return plan, walk, first_tile * cta_rows - aligned, fits


def _tile_ranges(row0, first, end, offset, length, *, window_left, tiles: ForwardTiles, never):
    """(consumers' (lo, full_lo, full_hi, hi), CTA's first, CTA's end) of the CTA tile from
    row0 of q of a sequence of tokens [first, end), offset from a row to its position, length
    keys (`ragged_tile_plan`); arrays of one shape. never: a bound on the KV tiles."""
    block_q, block_kv = tiles.block_q, tiles.block_kv
    ranges = []
    for wg in range(NUM_CONSUMERS):
        # The consumer's rows that are the sequence's tokens, and their positions p0..p1.
        lo_row = jnp.maximum(row0 + wg * block_q, first)
        hi_row = jnp.minimum(row0 + (wg + 1) * block_q, end)
        p0, p1 = lo_row + offset, hi_row - 1 + offset
        hi = jnp.where(hi_row > lo_row, _cdiv(jnp.clip(p1 + 1, 0, length), block_kv), 0)
        full_hi = jnp.maximum(p0 + 1, 0) // block_kv
        lo = full_lo = jnp.zeros_like(hi)
        if window_left is not None:
            lo = jnp.maximum(p0 - window_left, 0) // block_kv
            full_lo = _cdiv(jnp.maximum(p1 - window_left, 0), block_kv)
        ranges.append(masks.intersect((lo, full_lo, full_hi, hi), (0, 0, hi, hi)))
    visits = [r[0] < r[3] for r in ranges]
    any_visit = functools.reduce(jnp.logical_or, visits)
    first_kv = functools.reduce(
        jnp.minimum, [jnp.where(v, r[0], never) for v, r in zip(visits, ranges, strict=True)]
    )
    last_kv = functools.reduce(
        jnp.maximum, [jnp.where(v, r[3], 0) for v, r in zip(visits, ranges, strict=True)]
    )
    return ranges, jnp.where(any_visit, first_kv, 0), jnp.where(any_visit, last_kv, 0)


def ragged_walk(
    cost,
    seq,
    index,
    q_tiles,
    seq_tiles,
    pair_cost,
    count,
    *,
    num_heads: int,
    num_ctas: int,
    paired: bool,
):
    """The work list in XLA, int32 [num_tiles * N]: entry w is tile * N + head of the item that
    the persistent CTAs' snake puts at w (`_Work.round_place`: CTA c's n-th item is entry n * C
    + c on even rounds and n * C + C - 1 - c on odd ones), the first count * N entries a
    permutation of the batch's items (tile, head), the rest 0. cost [num_tiles]: each tile's KV
    tiles (its CTA's range); seq, index, q_tiles [num_tiles]: its sequence, its place there and
    the sequence's tiles; seq_tiles, pair_cost [B]: each sequence's tiles and the cost of its
    first and last together; count: the tiles in all.

    The forward's causal pairs (`schedule._Work.paired`) over ragged sequences: sequence b's Q_b
    tiles go in pairs (Q_b - 1 - i, i), which cost about the same under a causal mask whatever the
    cached prefix; a persistent CTA takes the long tile of a pair and then its short one,
    pairs of the order (sequence, head, i), i fastest, so that a round of C pairs spans a few
    heads of one sequence and their K/V stay in L2 (neighbouring heads share a KV head: GQA's
    group). Sequences go by their pairs' cost, dearest first (ties in batch order), and the
    rounds of pairs snake (CTA c takes pair k * C + `round_place(c, k)` of round k), so that
    no CTA takes the dearest pair of every round. As in the forward, the last whole round of
    pairs and the partial one go as single tiles (the tail), with the middle tiles of odd Q_b:
    by cost, dearest first (ties by tile, then head), in a snake of their own. Not paired (a
    window's left side, whose tiles cost about the same but its pairs do not), every item
    goes as the tail's do.

    Modelled (busiest CTA's KV tiles over the mean, N=32, 132 CTAs): four sequences of 2k
    tokens 1.009x, one of 8k 1.013x, sixteen of 512 1.031x; a snake over the tiles in batch
    order, each sequence's last tile first, 1.28x, 1.002x and 1.44x."""
    num_tiles = cost.shape[0]
    heads, ctas = num_heads, num_ctas
    size = num_tiles * heads
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    valid = tile < count
    pairs = seq_tiles // 2  # per head, [B]
    partner = q_tiles - 1 - index
    pair = jnp.minimum(index, partner)  # i of the tile's pair
    is_long = index > partner
    middle = index == partner
    # Sequences by their pairs' cost (pair 0's), dearest first, ties in batch order.
    batch = seq_tiles.shape[0]
    key = jnp.where(pairs > 0, pair_cost, -1)
    b = jnp.arange(batch, dtype=jnp.int32)
    before = (key[None, :] > key[:, None]) | (
        (key[None, :] == key[:, None]) & (b[None, :] < b[:, None])
    )
    pair_start = heads * jnp.sum(jnp.where(before, pairs[None, :], 0), axis=1)  # [B]
    total_pairs = heads * jnp.sum(pairs)
    pair_rounds = jnp.maximum(total_pairs // ctas - 1, 0) if paired else 0
    paired_pairs = pair_rounds * ctas
    # Pair unit u of (tile, head): the pairs of the order (sequence by cost, head, i).
    head = jnp.arange(heads, dtype=jnp.int32)[None, :]
    tile_pairs = q_tiles // 2
    start = pair_start[seq]
    unit = start[:, None] + head * jnp.maximum(tile_pairs, 1)[:, None] + pair[:, None]
    in_pairs = valid[:, None] & ~middle[:, None] & (unit < paired_pairs)
    k, place = unit // ctas, unit % ctas
    cta = _Work.round_place(place, k, ctas)  # round_place is its own inverse in a round
    paired_at = jnp.where(is_long[:, None], 2 * k * ctas + cta, (2 * k + 1) * ctas + ctas - 1 - cta)
    # The tail: tile t's heads from first_head on (all of them for a middle tile), ranked by
    # cost, dearest first, ties by tile then head.
    need = paired_pairs - start - pair  # heads h with unit >= paired_pairs
    first_head = jnp.where(middle, 0, jnp.clip(_cdiv_traced(need, tile_pairs), 0, heads))
    in_tail = jnp.where(valid, heads - first_head, 0)
    ahead = (cost[None, :] > cost[:, None]) | (
        (cost[None, :] == cost[:, None]) & (tile[None, :] < tile[:, None])
    )
    tail_start = 2 * paired_pairs + jnp.sum(jnp.where(ahead, in_tail[None, :], 0), axis=1)
    tail_at = tail_start[:, None] + head - first_head[:, None]
    at = jnp.where(in_pairs, paired_at, tail_at)
    at = jnp.where(valid[:, None] & (in_pairs | (head >= first_head[:, None])), at, size)
    entry = tile[:, None] * heads + head
    walk = jnp.zeros((size,), jnp.int32)
    return walk.at[at.reshape(-1)].set(entry.reshape(-1), mode="drop", unique_indices=True)


def _cdiv_traced(a, b):
    """ceil(a / b) of int32 arrays, b > 0 where it matters (a guarded 1 elsewhere)."""
    b = jnp.maximum(b, 1)
    return -((-a) // b)


def _assemble(columns, num_tiles: int):
    """[num_tiles, 4 * (NUM_CONSUMERS + 3)] int32: column k of row t is columns[k][t] (0 past
    the columns given): one elementwise select, a thread per entry, where a stack is a
    concatenate, whose XLA GPU emitter runs a thread per element of its largest operand (a
    tile's) that computes each operand in turn."""
    width = 4 * (_TOKENS_ROW + 1)
    k = lax.broadcasted_iota(jnp.int32, (num_tiles, width), 1)
    out = jnp.zeros((num_tiles, width), jnp.int32)
    for i, column in enumerate(columns):
        out = jnp.where(k == i, column.astype(jnp.int32)[:, None], out)
    return out


def _running_sum(x):
    """Running sums of the int32 vector x (a triangular sum, one small fusion, up to 1024
    entries; XLA's cumulative sum beyond)."""
    n = x.shape[0]
    if n > 1024:
        return jnp.cumsum(x)
    upto = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.sum(jnp.where(upto, x[None, :], 0), axis=1)


def _cdiv(a, b: int):
    return lax.div(a + (b - 1), jnp.int32(b))


def token_rows(starts, first_row, fits, num_tokens: int):
    """Each token's row in the tile-padded lse: token t of sequence b at first_row[b] + t
    (`ragged_tile_plan`'s first_row: the sequence's first tile's row less its aligned first
    token); 0 for the tokens of no sequence of this launch."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    batch = first_row.shape[0]
    seq = jnp.sum(starts[None, 1:] <= rows[:, None], axis=1).astype(jnp.int32)
    inside = (seq < batch) & (rows >= starts[0])
    seq = jnp.minimum(seq, batch - 1)
    return jnp.where(inside & fits[seq], first_row[seq] + rows, 0)


def ragged_prefill(
    q,
    k_pages,
    v_pages,
    block_tables,
    starts,
    lengths,
    sinks=None,
    *,
    scale: float,
    soft_cap,
    window_left: int | None,
    min_tokens: int,
    max_tokens: int,
    tiles: ForwardTiles | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
):
    """(out [T, N, Hv] in q's dtype, lse [N, T] float32, natural log) of the sequences with
    min_tokens <= q_len_b <= max_tokens new tokens; the other rows hold anything (the caller's
    other launch writes them).

    q [T, N, H], k_pages [P, page_size, K, H], v_pages [P, page_size, K, Hv] (bfloat16 or
    float16; H and Hv of the forward's HEAD_DIMS; page_size a multiple of 8 that divides
    block_kv or that block_kv divides: `page_copies`); block_tables int [B, max_pages]; starts
    int32 [B + 1] the safe query starts (non-decreasing in [0, T]); lengths int [B] (clipped
    here); sinks None or float32 [N]. Nothing here checks these (`pallas_flash.ragged` routes
    only such calls here)."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    value_head_dim = v_pages.shape[-1]
    batch, max_pages = block_tables.shape
    capacity = max_pages * page_size
    if tiles is None:
        tiles = ragged_prefill_tiles(head_dim, value_head_dim)
    cta_rows = tiles.cta_rows
    num_tiles = tile_bound(num_tokens, batch, min_tokens, max_tokens, cta_rows)
    out_dtype = q.dtype
    if num_tiles == 0:
        return (
            jnp.zeros((num_tokens, num_heads, value_head_dim), out_dtype),
            jnp.full((num_heads, num_tokens), -jnp.inf, jnp.float32),
        )
    starts = jnp.asarray(starts, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    num_ctas = min(num_tiles * num_heads, num_sms)
    plan, walk, first_row, fits = ragged_tile_plan(
        starts,
        lengths,
        capacity=capacity,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        window_left=window_left,
        tiles=tiles,
        num_tiles=num_tiles,
        num_heads=num_heads,
        num_ctas=num_ctas,
    )
    # Keys: positions < capacity, the KV tiles' count a whole number of tiles (no ragged last
    # tile: keys past a sequence's length are masked by position, in masked tiles).
    kv_len = cdiv(capacity, tiles.block_kv) * tiles.block_kv
    spec = MaskSpec(
        q_len=kv_len,
        kv_len=kv_len,
        is_causal=True,
        window=None if window_left is None else (int(window_left), 0),
    )
    q_to = aligned_len(num_tokens)
    q4 = q if q_to == num_tokens else jnp.pad(q, ((0, q_to - num_tokens), (0, 0), (0, 0)))
    table = jnp.asarray(block_tables, jnp.int32)
    copies = page_copies(page_size, tiles.block_kv)
    q_buffers = ragged_prefill_q_buffers(tiles, head_dim, value_head_dim, q.dtype.itemsize)
    kernel = functools.partial(
        _ragged_kernel,
        spec=spec,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        group=num_heads // num_kv_heads,
        tiles=tiles,
        page_size=page_size,
        copies=copies,
        q_buffers=q_buffers,
        has_sinks=sinks is not None,
    )

    # One arrival per page copy of a K or V tile, each with its bytes.
    scratch = ring_scratch(
        q.dtype,
        tiles,
        head_dim,
        value_head_dim,
        q_buffers=q_buffers * NUM_CONSUMERS,
        k_arrivals=copies,
        v_arrivals=copies,
    )
    padded_rows = num_tiles * cta_rows
    out_type = (
        jax.ShapeDtypeStruct((1, q_to, num_heads, value_head_dim), q.dtype),
        jax.ShapeDtypeStruct((batch * _FRINGE, num_heads, value_head_dim), q.dtype),
        jax.ShapeDtypeStruct((1, num_heads, padded_rows), jnp.float32),
    )
    grid = (num_ctas,)
    operands = [q4[None], k_pages, v_pages, table, plan, walk]
    if sinks is not None:
        operands.append(jnp.asarray(sinks, jnp.float32))
    out, fringe, lse = warp_specialised_kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=("cta",),
        num_consumers=NUM_CONSUMERS,
    )(*operands)
    out = _with_fringes(out[0], fringe, starts, fits)
    if q_to != num_tokens:
        out = out[:num_tokens]
    rows = token_rows(starts, first_row, fits, num_tokens)
    return out, lse[0][:, rows]


def _with_fringes(out, fringe, starts, fits):
    """out [T', N, Hv] with each sequence's fringe rows (`_ragged_kernel`) set from fringe
    [B * _FRINGE, N, Hv]: row j < ROW_ALIGN of sequence b's is token floor8(first) + j, row
    ROW_ALIGN + j token floor8(end) + j, where that token is the sequence's and not in its
    8-aligned interior (which the kernel stored in place)."""
    first, end = starts[:-1, None], starts[1:, None]
    j = jnp.arange(ROW_ALIGN, dtype=jnp.int32)[None, :]
    interior = first + lax.rem(ROW_ALIGN - lax.rem(first, ROW_ALIGN), ROW_ALIGN)
    head = first - lax.rem(first, ROW_ALIGN) + j
    tail = end - lax.rem(end, ROW_ALIGN) + j
    head_ok = (head >= first) & (head < jnp.minimum(interior, end))
    tail_ok = (tail >= jnp.maximum(tail - j, interior)) & (tail < end)
    rows = jnp.concatenate([jnp.where(head_ok, head, -1), jnp.where(tail_ok, tail, -1)], axis=1)
    rows = jnp.where(fits[:, None] & (rows >= 0), rows, out.shape[0])
    return out.at[rows.reshape(-1)].set(fringe, mode="drop")


def _ragged_kernel(
    q_ref,
    k_ref,
    v_ref,
    table_ref,
    plan_ref,
    walk_ref,
    *refs,
    q_smem,
    k_smem,
    v_smem,
    lse_smem,
    q_ready,
    k_ready,
    v_ready,
    k_free,
    v_free,
    schedule,
    o_smem=None,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    group: int,
    tiles: ForwardTiles,
    page_size: int,
    copies: int,
    q_buffers: int,
    has_sinks: bool,
):
    """One persistent CTA: its share of the work items (tile, head), in a snake over the
    rounds of C entries of the walk (`_Work.round_place`, `ragged_walk`).

    q_ref [1, T', N, H] (T' = T rounded up to ROW_ALIGN); k_ref [P, page_size, K, H], v_ref
    [P, page_size, K, Hv]; table_ref [B, max_pages]; plan_ref and walk_ref `ragged_tile_plan`'s;
    sinks_ref [N] float32 with has_sinks; out_ref [1, T', N, Hv] (rows of q's), fringe_ref
    [B * _FRINGE, N, Hv] and lse_ref [1, N, R], R = the plan's tiles * cta_rows (tile t's rows
    at t * cta_rows). q_buffers: Q buffers per consumer; with two the next item's Q loads at
    this one's start, with one after its epilogue. A consumer stores its rows of its sequence
    that fill whole ROW_ALIGN-row groups straight into out_ref (boxes of 64, 32, 16 and 8 rows:
    a TMA window into the token dim starts on its 8-row tiles), and the groups that hold the
    sequence's first or last token beside other rows into fringe_ref (rows 0..7 and 8..15 of
    the sequence's), which XLA writes into the output after (`_with_fringes`): nothing is
    stored into another sequence's rows. Scratch as `forward._forward_kernel`'s
    (persistent, no segment ids or dropout)."""
    sinks_ref = refs[0] if has_sinks else None
    out_ref, fringe_ref, lse_ref = refs[-3:]
    num_heads = q_ref.shape[2]
    num_pages, max_pages = k_ref.shape[0], table_ref.shape[1]
    cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
    count = plan_ref[0, _ITEM_ROW, 3]
    total = count * num_heads
    rounds = lax.div(total, num_ctas)
    left = total - rounds * num_ctas
    num_items = rounds + (_Work.round_place(cta, rounds, num_ctas) < left).astype(jnp.int32)
    wg = lax.axis_index("wg")

    def entry_of(n):
        """The walk's entry of this CTA's n-th item, entry w = n * C + its place in round n
        (tile 0 for an n past the CTA's items, whose plan is then read in bounds and not
        used)."""
        w = n * num_ctas + _Work.round_place(cta, n, num_ctas)
        return walk_ref[jnp.minimum(w, walk_ref.shape[0] - 1)]

    def item_of(entry):
        """(tile, head) of a walk entry, tile * N + head."""
        return lax.div(entry, num_heads), lax.rem(entry, num_heads)

    def cta_range_of(tile):
        return plan_ref[tile, _CTA_ROW, 0], plan_ref[tile, _CTA_ROW, 3]

    def ring(cta_range, steps_before):
        return _Ring(
            k_smem=k_smem,
            v_smem=v_smem,
            k_ready=k_ready,
            v_ready=v_ready,
            k_free=k_free,
            v_free=v_free,
            num_stages=tiles.num_stages,
            first_tile=cta_range[0],
            steps_before=steps_before,
        )

    def over_items(body, first_entry):
        """body(n, steps_before, (tile, head), next_entry) -> steps_before of item n + 1 over
        this CTA's items, each item's walk entry loaded two items ahead (first_entry item 0's),
        so that the next item's is there at an item's start."""

        def step(n, carry):
            steps_before, entry, next_entry = carry
            after_next = entry_of(n + 2)
            steps_before = body(n, steps_before, item_of(entry), next_entry)
            return steps_before, next_entry, after_next

        lax.fori_loop(0, num_items, step, (jnp.int32(0), first_entry, entry_of(1)))

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(FORWARD_CONSUMER_REGISTERS, action="increase")

        def buffer(n):
            return lax.rem(n, q_buffers) * NUM_CONSUMERS + wg

        def load_q(n, head, row0):
            """Item n's Q rows (of head), from row0 (its tile's first row of q)."""
            token = pl.multiple_of(row0 + wg * tiles.block_q, ROW_ALIGN)
            b = buffer(n)
            plgpu.copy_gmem_to_smem(
                q_ref.at[0, pl.ds(token, tiles.block_q), head], q_smem.at[b], q_ready.at[b]
            )

        first_entry = entry_of(0)
        first_tile, first_head = item_of(first_entry)
        pl.when(num_items > 0)(lambda: load_q(0, first_head, plan_ref[first_tile, _ITEM_ROW, 1]))

        def consume_item(n, steps_before, item, next_entry):
            tile, head = item
            # Every scalar of the plan that the item reads, and the next item's first row,
            # loaded together: one round trip to L2 at the item's start, not one per use.
            cta_range = cta_range_of(tile)
            ranges = tuple(plan_ref[tile, wg, i] for i in range(4))
            seq, row0, offset = (plan_ref[tile, _ITEM_ROW, i] for i in range(3))
            first, end = plan_ref[tile, _TOKENS_ROW, 0], plan_ref[tile, _TOKENS_ROW, 1]
            sink = None if sinks_ref is None else sinks_ref[head]
            next_tile, next_head = item_of(next_entry)
            next_row0 = plan_ref[next_tile, _ITEM_ROW, 1]
            if q_buffers == 2:
                pl.when(n + 1 < num_items)(lambda: load_q(n + 1, next_head, next_row0))
            # The consumer's rows in the padded lse; a row's position is its token's, the
            # lse row plus the offset.
            out_row = pl.multiple_of(tile * tiles.cta_rows + wg * tiles.block_q, tiles.block_q)
            base = pl.multiple_of(row0 + wg * tiles.block_q, ROW_ALIGN)
            q_offset = base + offset - out_row
            b = buffer(n)

            def store_out(o_smem):
                def store(src_row, rows, dst):
                    if not isinstance(src_row, int):
                        src_row = pl.multiple_of(src_row, ROW_ALIGN)
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(src_row, rows)], dst)

                # The whole 8-row groups of the sequence in this consumer's rows, [lo, hi).
                inner_first = first + lax.rem(ROW_ALIGN - lax.rem(first, ROW_ALIGN), ROW_ALIGN)
                inner_end = end - lax.rem(end, ROW_ALIGN)
                lo = jnp.clip(inner_first - base, 0, tiles.block_q)
                hi = jnp.clip(inner_end - base, 0, tiles.block_q)
                at, rows = lo, tiles.block_q
                while rows >= ROW_ALIGN:
                    take = hi - at >= rows

                    @pl.when(take)
                    def _store(at=at, rows=rows):
                        dst = pl.multiple_of(base + at, ROW_ALIGN)
                        store(at, rows, out_ref.at[0, pl.ds(dst, rows), head])

                    at = at + jnp.where(take, rows, 0)
                    rows //= 2
                # The fringe groups: the first token's (row 0 of the sequence's first tile's
                # first consumer) and the last token's.
                fringe = seq * _FRINGE
                head_group = first - lax.rem(first, ROW_ALIGN)

                @pl.when((head_group != first) & (base == head_group))
                def _head():
                    rows = pl.ds(pl.multiple_of(fringe, ROW_ALIGN), ROW_ALIGN)
                    store(0, ROW_ALIGN, fringe_ref.at[rows, head])

                tail = inner_end - base

                @pl.when((inner_end != end) & (tail >= 0) & (tail < tiles.block_q))
                def _tail():
                    rows = pl.ds(pl.multiple_of(fringe + ROW_ALIGN, ROW_ALIGN), ROW_ALIGN)
                    store(tail, ROW_ALIGN, fringe_ref.at[rows, head])

            def q_at(kv_tile):
                return q_smem.at[b + opaque_zero(kv_tile) if tiles.step_descriptors else b]

            _consume(
                out_ref,
                (lse_ref,),
                q_at,
                q_smem.at[b] if o_smem is None else o_smem.at[wg],
                lse_smem.at[wg],
                q_ready.at[b],
                schedule,
                ring(cta_range, steps_before),
                wg=wg,
                batch=0,
                head=head,
                q_start=out_row,
                q_offset=q_offset,
                store_out=store_out,
                cta_range=cta_range,
                ranges=ranges,
                q_ids_smem=None,
                sink=sink,
                spec=spec,
                scale=scale,
                soft_cap=soft_cap,
                tiles=tiles,
            )
            if q_buffers == 1:
                # The epilogue's copies have read the buffer (`_consume` waited for them).
                pl.when(n + 1 < num_items)(lambda: load_q(n + 1, next_head, next_row0))
            return steps_before + cta_range[1] - cta_range[0]

        over_items(consume_item, first_entry)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(FORWARD_PRODUCER_REGISTERS, action="decrease")

        def produce_item(n, steps_before, item, next_entry):
            del next_entry  # loaded for the next item
            tile, head = item
            cta_range = cta_range_of(tile)
            seq = plan_ref[tile, _ITEM_ROW, 0]
            kv_head = lax.div(head, jnp.int32(group))

            def pages(kv_tile):
                """The page ids of KV tile kv_tile's copies (clamped: the entries past the
                sequence's pages may hold anything, and the keys they give are masked)."""
                if copies == 1:
                    entries = [lax.div(kv_tile, page_size // tiles.block_kv)]
                else:
                    entries = [kv_tile * copies + j for j in range(copies)]
                return tuple(
                    jnp.clip(table_ref[seq, jnp.minimum(e, max_pages - 1)], 0, num_pages - 1)
                    for e in entries
                )

            def copy(gmem_ref, smem, ready, kv_tile, slot, page_ids):
                block_kv = tiles.block_kv
                if copies == 1:  # a tile is block_kv rows of one page
                    per_page = page_size // block_kv
                    first = pl.multiple_of(lax.rem(kv_tile, per_page) * block_kv, block_kv)
                    rows = (page_ids[0], pl.ds(first, block_kv), kv_head)
                    plgpu.copy_gmem_to_smem(gmem_ref.at[rows], smem.at[slot], ready.at[slot])
                    return
                for j, page in enumerate(page_ids):  # whole pages into consecutive rows
                    src = gmem_ref.at[page, :, kv_head]
                    dst = smem.at[slot, pl.ds(j * page_size, page_size)]
                    plgpu.copy_gmem_to_smem(src, dst, ready.at[slot])

            _produce(
                k_ref,
                v_ref,
                None,
                ring(cta_range, steps_before),
                batch=None,
                kv_head=kv_head,
                cta_hi=cta_range[1],
                tiles=tiles,
                copy=copy,
                ahead=pages,
            )
            return steps_before + cta_range[1] - cta_range[0]

        over_items(produce_item, entry_of(0))
