"""Flash-decoding: attention of a few new query tokens over a KV cache, contiguous or paged.

The kernel is FlashAttention-2's forward loop (Dao 2023, Algorithm 1) reorganised for decode
(Dao et al., "Flash-Decoding", 2023): the queries are few, so one program holds all the query
rows that read the same K/V -- the group of query heads of one KV head, times the new tokens --
packed into the M dimension of one tile, and the key loop of each sequence is split over several
programs whose partial results merge by their logsumexp. Decode reads every cached key once per
step, so the kernel is bound by memory bandwidth; everything here serves reading K/V once, and
only the keys a sequence has.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import masks
from pallas_flash._numerics import LN2, accumulation_dtype
from pallas_flash._pallas_triton import CompilerParams, cdiv, div, fold, rem
from pallas_flash._vma import pallas_call
from pallas_flash.device import DEFAULT_NUM_SMS
from pallas_flash.triton._common import (
    dot,
    merge_parts_step,
    merge_splits,
    scores,
    softmax_init,
    softmax_step,
    softmax_store,
    visit_tiles,
)
from pallas_flash.triton.cache import (
    CacheFormat,
    load_paged_rows,
    load_piece_rows,
    logit_scale_and_unit,
    pack_queries,
    paged_rows,
    product_queries,
    read_tiles,
    scales_of,
)
from pallas_flash.triton.tiles import (
    DecodeBlockSizes,
    decode_ctas_per_sm,
    decode_merge,
    default_decode_block_sizes,
    padded_head_dim,
)


def _decode_kernel(
    lengths_ref,
    q_ref,
    k_ref,
    *refs,
    scale: float,
    soft_cap,
    window_left: int | None,
    fmt: CacheFormat,
    q_len: int,
    group: int,
    block_m: int,
    block_kv: int,
    schedule: Schedule,
    page_size: int | None,
    with_log_sum: bool,
    lookahead: bool = False,
):
    """One row tile of one (KV head, work item): stream the item's key tiles of its sequence
    with an online softmax.

    lengths_ref: [B] keys of each sequence (the new tokens included); q_ref: [B, block_m, Cq]
    packed rows r = t * group + g (new token t, query head g of the group), their columns as
    `fmt.query_pieces`; o_ref: [block_m, Hvp] and lse_ref: [block_m], the item's (partial,
    when split) result, and with `with_log_sum` a log_sum_ref [block_m] (`softmax_store`: what
    the merge weighs the items by, exact where lse rounds a row's denominator away).
    Contiguous cache: k_ref [B, S, Ck] and v_ref [B, S, Hvp]. Paged (page_size given): k_ref
    [num_pages * page_size, Ck] and v_ref [num_pages * page_size, Hvp], the pages of this KV
    head end to end, and a table_ref [B * max_pages] (the block table, flat) before the
    outputs: key j of sequence b is row table[b * max_pages + j // page_size] * page_size + j
    % page_size. A shared cache (`fmt.shared`) has no v_ref: the values are the keys' first
    columns. Which sequence and which of its tiles the item reads comes from `schedule` (the
    batch is not in the grid, so that a balanced schedule can give a sequence as many items as
    its length needs); where `schedule.planned`, from a runs_ref (`Schedule.plan_runs`'s
    table) after the block table. Where `fmt.scaled`, k_scale_ref and v_scale_ref [K] float32
    come last before the outputs. lookahead (paged only): each step looks up the next key
    tile's pages, so that the pipeliner can keep more than one tile in flight.
    """
    refs = list(refs)
    v_ref = None if fmt.shared else refs.pop(0)
    table_ref = refs.pop(0) if page_size is not None else None
    runs_ref = refs.pop(0) if schedule.planned else None
    k_scale_ref, v_scale_ref = (refs.pop(0), refs.pop(0)) if fmt.scaled else (None, None)
    log_sum_ref = refs.pop() if with_log_sum else None
    o_ref, lse_ref = refs
    num_rows = q_len * group
    m_start = pl.program_id(0) * block_m
    batch, length, (item_lo, item_hi) = schedule.item(lengths_ref, pl.program_id(2), runs_ref)

    ahead = schedule.ahead_of(lengths_ref, batch)
    m_rows = num_rows - m_start  # rows of this tile that exist
    qs = [
        load_piece_rows(
            q_ref, 0, block_m, m_rows, piece, ragged=num_rows % block_m != 0, lead=(batch,)
        )
        for piece in fmt.query_pieces
    ]
    qs, unscale = product_queries(qs, k_ref.dtype)  # float16 over float8 for bfloat16 queries
    # New token t of a sequence of `length` keys sits at position length - q_len + t (the new
    # tokens are the cache's last keys), or with `ahead` that many positions further (a
    # holder of a sequence's earlier keys: `Schedule.ahead`); rows past the packed rows take
    # the last token's.
    rows = m_start + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    end = length if ahead is None else length + ahead
    q_pos = end - q_len + jnp.minimum(div(rows, group), q_len - 1)

    # Where a paged tile's pages lie (`paged_rows`). With `lookahead` a step looks up the next
    # tile's (carried): its own loads then depend on no load of the step, and Triton's
    # pipeliner keeps num_stages - 1 tiles in flight; looked up in the step, the tile gets one
    # buffer in shared memory whatever num_stages.
    rows_of = None
    if page_size is not None:
        max_pages = table_ref.shape[0] // schedule.batch  # lengths_ref may hold the aheads
        rows_of = functools.partial(
            paged_rows, table_ref, batch * max_pages, length, block_kv, page_size, k_ref.shape[0]
        )

    def load_kv(kv_start, kv_rows, masked: bool):
        def load(ref, piece):
            if rows_of is not None:
                return load_paged_rows(
                    ref, kv_rows, kv_start, length, piece, block_kv, masked=masked
                )
            return load_piece_rows(
                ref, kv_start, block_kv, length, piece, ragged=masked, lead=(batch,)
            )

        return read_tiles(fmt, load, k_ref, v_ref, qs[0].dtype)

    k_scale, v_scale = scales_of(
        fmt, k_scale_ref, v_scale_ref, pl.program_id(1), accumulation_dtype(q_ref.dtype)
    )
    logit_scale, unit = logit_scale_and_unit(scale, soft_cap, k_scale)

    def body(j, carry, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        kv_rows = None
        if lookahead:
            *carry, kv_rows = carry
            carry = tuple(carry)
        elif rows_of is not None:
            kv_rows = rows_of(kv_start, visited=True)
        # Keys past the sequence's length read as zero in the masked tiles: whatever the
        # cache holds there (stale values, NaN) never reaches a product.
        ks, v = load_kv(kv_start, kv_rows, masked)
        # -- compute the logits (in the units of `scores`, see there) --
        qk = dot(qs[0], ks[0], trans_b=True)
        for q_piece, k_piece in zip(qs[1:], ks[1:], strict=True):
            qk = qk + dot(q_piece, k_piece, trans_b=True)
        if unscale is not None:
            qk = qk * unscale
        u, _ = scores(qk, logit_scale, None, soft_cap)
        visible = None
        if masked:
            kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = kv_idx <= q_pos  # causal among the new tokens; also kv_idx < length
            if ahead is not None:  # where the tokens sit past the keys, kv_idx < length is not
                visible = visible & (kv_idx < length)
            if window_left is not None:
                visible = visible & (kv_idx >= q_pos - window_left)
        carry = softmax_step(carry, u, v, unit, visible, hidden_values=hidden_values)
        return (*carry, rows_of(kv_start + block_kv)) if lookahead else carry

    # One new token with no window, at the end of its keys: a boundary tile hides only keys
    # past the length, which read as zero (the zeroing of V costs a latent cache's 512-column
    # tiles a trip through the registers, and spills).
    hidden_values = q_len > 1 or window_left is not None or ahead is not None
    carry = softmax_init(block_m, fmt.value_piece.padded, accumulation_dtype(q_ref.dtype))
    tiles = masks.intersect(
        _sequence_tiles(length, q_len, window_left, block_kv, ahead),
        (item_lo, item_lo, item_hi, item_hi),
    )
    if lookahead:
        *carry, _ = visit_tiles(tiles, body, (*carry, rows_of(tiles[0] * block_kv)))
        carry = tuple(carry)
    else:
        carry = visit_tiles(tiles, body, carry)
    if v_scale is not None:  # the values' scale, once on the unnormalised output
        carry = (carry[0] * v_scale, *carry[1:])
    softmax_store(
        carry,
        unit,
        o_ref,
        lse_ref,
        block_m,
        m_rows,
        fmt.value_head_dim,
        log_sum_ref=log_sum_ref,
    )


def _sequence_tiles(length, q_len: int, window_left: int | None, block_kv: int, ahead=None):
    """The key tiles (lo, full_lo, full_hi, hi) a sequence of `length` keys reads, its new
    tokens the last q_len of them, or with `ahead` (None: 0) that many positions past them.

    Tiles past the length are never visited. Fully visible: the tiles every new token sees
    whole (keys <= the first new token's position, and inside the last one's window; with
    ahead, and below the length).
    """
    end = length if ahead is None else length + ahead
    hi = cdiv(length, block_kv)
    full_hi = div(jnp.maximum(end - q_len + 1, 0), block_kv)
    if ahead is not None:
        full_hi = jnp.minimum(full_hi, div(length, block_kv))
    lo = full_lo = 0
    if window_left is not None:
        lo = div(jnp.maximum(end - q_len - window_left, 0), block_kv)
        full_lo = cdiv(jnp.maximum(end - 1 - window_left, 0), block_kv)
    return lo, full_lo, full_hi, hi


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which sequence, and which run of its key tiles, each work item (the grid's last axis)
    reads; shared by the decode kernel and the merge kernel.

    splits == 1: item b is sequence b, whole. kind "sequence": item b * splits + s is run s of
    sequence b's tiles cut into `splits` equal runs (a few scalar operations per program).
    kind "balanced": `items` items share the batch's tiles in runs of `chunk` tiles, chunk the
    smallest (at least `min_chunk`) for which the runs fit (sum_b ceil(tiles_b / chunk) <=
    items); sequence b takes items [start_b, start_b + count_b) in batch order, and items past
    the last are empty. XLA computes that plan once per call (`plan_runs`: a table the
    programs read their run from; the plan and the merge kernel cost 10-25 us a call on the
    H200, docs/notes/decode.md, "Dead ends").
    """

    kind: str
    batch: int
    splits: int
    items: int
    capacity: int
    q_len: int
    window_left: int | None
    block_kv: int
    min_chunk: int
    max_tiles: int
    # Whether the lengths operand also holds each sequence's `ahead` (after the B lengths):
    # how far past its last key its new tokens sit (a holder of a sequence's earlier keys, on
    # a cache split over devices).
    ahead: bool = False

    @property
    def planned(self) -> bool:
        """Whether the programs read their runs from `plan_runs`'s table."""
        return self.kind == "balanced" and self.splits > 1

    def length(self, lengths_ref, batch):
        return jnp.clip(lengths_ref[batch], 0, self.capacity)

    def ahead_of(self, lengths_ref, batch):
        """Sequence `batch`'s ahead (>= 0), or None without (`ahead`)."""
        return jnp.maximum(lengths_ref[self.batch + batch], 0) if self.ahead else None

    def _tiles(self, lengths, ahead=None):
        lo, _, _, hi = _sequence_tiles(lengths, self.q_len, self.window_left, self.block_kv, ahead)
        return jnp.maximum(hi - lo, 0), lo

    def plan_runs(self, lengths):
        """The balanced schedule's table, int32 [3 * items + 2 * B] (in XLA, before the
        kernels): per item its sequence, first tile and end tile (an empty run where first ==
        end), then per sequence its first item and item count (for the merge). lengths: [B],
        or with `ahead` [2B] (the lengths, then the aheads)."""
        lengths, ahead = jnp.asarray(lengths, jnp.int32), None
        if self.ahead:  # [2B]: the lengths, then the aheads
            lengths, ahead = lengths[: self.batch], jnp.maximum(lengths[self.batch :], 0)
        lengths = jnp.clip(lengths, 0, self.capacity)
        tiles, lo = self._tiles(lengths, ahead)
        lo = jnp.broadcast_to(lo, tiles.shape)  # 0 without a window
        # The smallest chunk in [1, max_tiles] whose runs fit the items; max_tiles always fits
        # (items >= B), so argmax finds a True.
        chunks = jnp.arange(1, max(self.max_tiles, 1) + 1, dtype=jnp.int32)[:, None]
        fits = jnp.sum((tiles[None, :] + chunks - 1) // chunks, axis=1) <= self.items
        chunk = jnp.maximum(jnp.argmax(fits).astype(jnp.int32) + 1, self.min_chunk)
        count = (tiles + chunk - 1) // chunk
        end = jnp.cumsum(count)
        start = end - count
        item = jnp.arange(self.items, dtype=jnp.int32)
        # Sequences whose items all lie before the item; an item past every sequence's items
        # is an empty run of the last sequence.
        seq = jnp.minimum(jnp.sum(end[None, :] <= item[:, None], axis=1), self.batch - 1)
        run = item - start[seq]
        first = lo[seq] + run * chunk
        last = jnp.where(run < count[seq], first + chunk, first)
        return jnp.concatenate([seq, first, last, start, count]).astype(jnp.int32)

    def item(self, lengths_ref, item, runs_ref=None):
        """(sequence, its length, (first tile, end tile)) of one item; the tile run may be
        empty (an unused item) or reach past the sequence's tiles (clipped by the caller).
        runs_ref: `plan_runs`'s table where `planned`."""
        if self.splits == 1:
            return item, self.length(lengths_ref, item), (0, self.max_tiles)
        if self.kind == "sequence":
            batch, split = div(item, self.splits), rem(item, self.splits)
            length = self.length(lengths_ref, batch)
            tiles, lo = self._tiles(length, self.ahead_of(lengths_ref, batch))
            chunk = div(tiles + self.splits - 1, self.splits)
            start = lo + split * chunk
            return batch, length, (start, start + chunk)
        batch = runs_ref[item]
        return (
            batch,
            self.length(lengths_ref, batch),
            (
                runs_ref[self.items + item],
                runs_ref[2 * self.items + item],
            ),
        )

    def items_of(self, batch, runs_ref=None):
        """(first item, item count) of a sequence, for the merge."""
        if self.kind == "sequence":
            return batch * self.splits, self.splits
        base = 3 * self.items
        return runs_ref[base + batch], runs_ref[base + self.batch + batch]


def _merge_kernel(
    runs_ref,
    o_parts_ref,
    lse_parts_ref,
    log_sum_parts_ref,
    o_ref,
    lse_ref,
    log_sum_ref,
    *,
    schedule: Schedule,
    num_rows: int,
    head_dim: int,
    block_r: int,
    block_c: int,
    col_tiles: int,
    chunk: int,
):
    """A tile of `block_r` packed rows and `block_c` columns of one (sequence, KV head): the
    sum of the rows' partial results over the sequence's items weighted by their softmax
    denominators (Flash-Decoding's reduction, as `_numerics.merge_weights`), `chunk` items per
    step: the items' loads are independent, so a step waits for one memory round trip, not
    one per item; grid axis 0 is the row tile times `col_tiles`, plus the column tile.
    o_parts_ref: [items + chunk - 1, block_r, block_c] f32 (the items, then
    padding that masked loads never read), lse_parts_ref and log_sum_parts_ref:
    [items + chunk - 1, block_r]; o_ref: [block_r, block_c], lse_ref and log_sum_ref:
    [block_r], stored by the first column tile. An online softmax over the steps: an item's
    row max is lse - log_sum and its denominator relative to that max exp(log_sum), both exact
    where lse alone has rounded the denominator away (keys that tie across items at |logits|
    beyond ~1e6). A row no item saw a key of outputs 0 with lse = -inf."""
    row_tile = div(pl.program_id(0), col_tiles)
    col_tile = rem(pl.program_id(0), col_tiles)
    r_rows = num_rows - row_tile * block_r  # rows of this tile that exist
    first, count = schedule.items_of(pl.program_id(2), runs_ref)
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1) < r_rows
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, 1, block_c), 2)
    col_ok = cols < head_dim - col_tile * block_c

    def body(j, carry):
        start = first + j * chunk
        in_run = (j * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)) < count
        ok = in_run & row_ok  # [chunk, block_r]
        parts_refs = (lse_parts_ref, log_sum_parts_ref, o_parts_ref)
        return merge_parts_step(carry, parts_refs, pl.ds(start, chunk), ok, col_ok)

    init = softmax_init(block_r, block_c, o_parts_ref.dtype)
    acc, m_i, l_i = fold(0, cdiv(count, chunk), body, init)
    # The partial lse are natural logs. The merged log_sum is relative to the largest item
    # max, the row's max.
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_r, 1), 0)
    plgpu.store(
        o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), mask=(rows < r_rows) & col_ok[0]
    )
    log_sum = jnp.log2(l_safe) * LN2
    lse = jnp.where(empty, -jnp.inf, m_i + log_sum)

    @pl.when(col_tile == 0)
    def _():
        plgpu.store(lse_ref, lse, mask=row_ok[0])
        plgpu.store(log_sum_ref, log_sum, mask=row_ok[0])


def choose_decode_splits(
    requested: int,
    programs: int,
    num_kv_tiles: int,
    block_kv: int,
    *,
    slots: int,
    waves: int = 1,
    min_split_keys: int = 256,
) -> int:
    """Programs per sequence's key loop: `requested`, or with 0 (auto) from occupancy.

    Decode streams memory: it runs at the bandwidth only while the GPU's CTA slots (`slots` =
    SMs x programs per SM) are busy, and each program keeps about one K/V tile in flight, so a
    partly filled last wave runs its few programs alone, at one program's latency-bound rate
    (the former rule's 17 splits at B=8, 32k keys made 1088 programs for 528 slots: two full
    waves and 32 programs after them). The rule finds the fewest splits whose programs fill
    at least `waves` waves and their last wave to 90%, then takes as many as those waves hold
    (or, when no count fills 90%, the fullest), each split keeping at least `min_split_keys`
    keys; no split is left without tiles."""
    if requested:
        return max(1, min(requested, num_kv_tiles))
    most = min(max(1, num_kv_tiles * block_kv // min_split_keys), num_kv_tiles)
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        ctas = programs * splits
        full_waves = max(waves, pl.cdiv(ctas, slots))
        fill = ctas / (full_waves * slots)
        if fill >= 0.9:
            # The most splits that these waves hold: their last wave as full as it gets.
            best = min(most, full_waves * slots // programs)
            break
        if fill > best_fill:
            best, best_fill = splits, fill
    # As many runs as cutting the tiles into `best` equal runs leaves non-empty.
    return pl.cdiv(num_kv_tiles, pl.cdiv(num_kv_tiles, best))


def _splits_toward(target: int, programs: int, most: int, slots: int | None) -> int:
    """Splits for about `target` programs in all (none where `programs` reach it), at most
    `most`; with `slots`, lowered to a full last wave (`_fill_last_wave`)."""
    if programs >= target:
        return 1
    splits = max(1, min(pl.cdiv(target, programs), most))
    return splits if slots is None else _fill_last_wave(programs, splits, slots)


def _fill_last_wave(programs: int, splits: int, slots: int) -> int:
    """`splits` lowered to the most splits whose programs fill their last wave of CTA slots to
    90%, if one does (a partly filled last wave runs its few programs alone, latency-bound);
    else `splits`."""
    for fewer in range(splits, 0, -1):
        ctas = programs * fewer
        if ctas / (pl.cdiv(ctas, slots) * slots) >= 0.9:
            return fewer
    return splits


def splits_per_core(
    programs: int, num_kv_tiles: int, block_kv: int, *, num_sms: int, slots: int | None = None
) -> int:
    """The "cores" rule: enough splits for about eight programs per SM (a program streams one
    tile at a time; several per SM keep enough loads in flight), each keeping at least 1024
    keys (below that the merge costs more than the parallelism gains), at most 64.

    With `slots` (the "full-waves" rule), the count is then lowered to the most splits whose
    programs fill their last wave of CTA slots to 90%, if one does: at B=8, 32k keys the cores
    count 17 makes 1088 programs for 528 slots, a last wave of 32 programs running alone; 16
    makes 1024, 1.94 waves."""
    most = min(num_kv_tiles * block_kv // 1024, 64)
    return _splits_toward(8 * num_sms, programs, most, slots)


def splits_for_slots(
    programs: int, num_kv_tiles: int, block_kv: int, *, slots: int, block_m: int = 16
) -> int:
    """The "slots" rule (the default): enough splits for two waves of the GPU's CTA slots
    (`slots`: SMs x the tiles' programs per SM), one wave for tiles of 64 or more rows (their
    f32 partials make the merge four times larger), lowered to the most whose last wave is 90%
    full; each split keeps at least 1024 keys (the merge's cost) except that any cache may be
    cut in four (a short cache is latency-bound: 1k keys read 1.7x faster in 4 splits of 256),
    at most 64 splits. Measured in kernel time on the H200 (docs/notes/decode.md, "The defaults"),
    TB/s, against the former "cores" rule: B=8 at 32k keys 4.36 against 4.07, at 128k 4.54
    against 3.96, 1k keys 2.96 against 1.71, ragged lengths 3.82 against 3.93; T=16 over 4
    heads per KV head (64-row tiles of 32 keys in 4 stages) 3.86 in 4 splits against 3.77 in
    8."""
    waves = 1 if block_m >= 64 else 2
    most = min(64, max(min(4, num_kv_tiles), num_kv_tiles * block_kv // 1024))
    return _splits_toward(waves * slots, programs, most, slots)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The launch of one decode call: tiles, the programs before splitting, the GPU's CTA
    slots for them, and the schedule of work items (its `splits`, `items`)."""

    block_m: int
    block_kv: int
    num_m_tiles: int
    num_kv_tiles: int
    programs: int
    slots: int
    schedule: Schedule


def decode_plan(
    q_shape,
    num_kv_heads: int,
    capacity: int,
    dtype,
    block_sizes: DecodeBlockSizes,
    *,
    window_left: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
    fmt: CacheFormat | None = None,
    cache_dtype=None,
) -> DecodePlan:
    """The `DecodePlan` of a call with queries of `q_shape` [B, T, N, H] over a cache of
    `capacity` keys per sequence on a GPU of `num_sms` SMs; fmt and cache_dtype: the cache's
    format and dtype where it is not keys and values of their own in the queries' dtype."""
    batch, q_len, num_heads, head_dim = q_shape
    num_rows = q_len * (num_heads // num_kv_heads)
    block_m = min(block_sizes.block_m, max(16, 1 << (num_rows - 1).bit_length()))
    num_m_tiles = pl.cdiv(num_rows, block_m)
    block_kv = min(block_sizes.block_kv, max(16, 1 << (capacity - 1).bit_length()))
    max_tiles = pl.cdiv(capacity, block_kv)
    num_kv_tiles = max_tiles
    if window_left is not None:
        num_kv_tiles = min(num_kv_tiles, pl.cdiv(window_left + q_len, block_kv) + 1)
    programs = num_m_tiles * num_kv_heads * batch
    # The CTAs one SM holds with the tiles as clipped to the call (a short cache's key tile).
    clipped = dataclasses.replace(block_sizes, block_kv=block_kv)
    slots = num_sms * _ctas_per_sm(clipped, block_m, head_dim, dtype, fmt, cache_dtype)
    if block_sizes.kv_splits or block_sizes.split_rule == "occupancy":
        splits = choose_decode_splits(
            block_sizes.kv_splits,
            programs,
            num_kv_tiles,
            block_kv,
            slots=slots,
            waves=block_sizes.waves,
            min_split_keys=block_sizes.min_split_keys,
        )
    elif block_sizes.split_rule == "slots":
        splits = splits_for_slots(programs, num_kv_tiles, block_kv, slots=slots, block_m=block_m)
    else:
        full_waves = block_sizes.split_rule == "full-waves"
        splits = splits_per_core(
            programs, num_kv_tiles, block_kv, num_sms=num_sms, slots=slots if full_waves else None
        )
    # A requested split count is met, and so are the other rules'; the occupancy rule keeps
    # min_split_keys per run.
    auto = not block_sizes.kv_splits and block_sizes.split_rule == "occupancy"
    min_chunk = max(1, block_sizes.min_split_keys // block_kv) if auto else 1
    schedule = Schedule(
        kind=block_sizes.schedule,
        batch=batch,
        splits=splits,
        items=batch * splits,
        capacity=capacity,
        q_len=q_len,
        window_left=window_left,
        block_kv=block_kv,
        min_chunk=min_chunk,
        max_tiles=max_tiles,
    )
    return DecodePlan(block_m, block_kv, num_m_tiles, num_kv_tiles, programs, slots, schedule)


def _ctas_per_sm(block_sizes, block_m: int, head_dim: int, dtype, fmt, cache_dtype) -> int:
    """`decode_ctas_per_sm` for a cache of format `fmt` (None: the plain one) in cache_dtype
    (None: the queries')."""
    itemsize = jnp.dtype(dtype).itemsize
    if fmt is None and cache_dtype is None:
        return decode_ctas_per_sm(block_sizes, block_m, padded_head_dim(head_dim), itemsize)
    if fmt is None:
        fmt = CacheFormat(head_dim, head_dim)
    return decode_ctas_per_sm(
        block_sizes,
        block_m,
        padded_head_dim(head_dim),
        itemsize,
        read_columns=fmt.read_columns,
        query_columns=sum(p.padded for p in fmt.query_pieces),
        value_hp=fmt.value_piece.padded,
        cache_itemsize=None if cache_dtype is None else jnp.dtype(cache_dtype).itemsize,
    )


def decode_block_sizes(
    q_shape,
    num_kv_heads: int,
    capacity: int,
    dtype,
    *,
    interpret: bool,
    page_size: int | None = None,
    window_left: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
    fmt: CacheFormat | None = None,
    cache_dtype=None,
) -> DecodeBlockSizes:
    """The default tiles of a call with queries of `q_shape` [B, T, N, H] over a cache of
    `capacity` keys (of format `fmt` in `cache_dtype`, None: the plain cache in the queries'
    dtype): `default_decode_block_sizes` for its rows, head dim, format and pages, except
    that a call whose split programs fill at most half a wave of CTA slots in runs of 1024 or
    more keys (the split cap, not the GPU, set their number: one sequence, or a few) takes
    32-key tiles in 4 stages. Each SM then holds one or two programs, and the loads each
    keeps in flight set the bandwidth: three 32-key tiles in the shared memory of one 64-key
    tile and its successor (B=1, 32k keys on the H200: 3.70 TB/s of kernel time against 3.40;
    short runs lose with them, 1k keys in 4 splits 2.74 against 2.95). Measured at H=128: a
    shared latent cache keeps its tiles."""
    batch, q_len, num_heads, head_dim = q_shape
    rows = q_len * (num_heads // num_kv_heads)
    base = default_decode_block_sizes(
        head_dim,
        dtype,
        interpret=interpret,
        page_size=page_size,
        rows=rows,
        fmt=fmt,
        cache_dtype=cache_dtype,
    )
    if interpret or base != DecodeBlockSizes(block_kv=64) or (fmt is not None and fmt.shared):
        return base
    plan = decode_plan(
        q_shape, num_kv_heads, capacity, dtype, base, window_left=window_left, num_sms=num_sms
    )
    splits = plan.schedule.splits
    keys_per_split = plan.num_kv_tiles * plan.block_kv // splits
    if 2 * plan.programs * splits <= plan.slots and keys_per_split >= 1024:
        return dataclasses.replace(base, block_kv=32, num_stages=4)
    return base


def decode_forward(
    q,
    k,
    v,
    lengths,
    block_tables=None,
    *,
    scale: float,
    soft_cap,
    window_left: int | None,
    block_sizes: DecodeBlockSizes,
    interpret: bool,
    num_sms: int = DEFAULT_NUM_SMS,
    with_log_sum: bool = False,
    ahead=None,
    out_dtype=None,
    value_head_dim: int | None = None,
    k_scale=None,
    v_scale=None,
):
    """out [B, T, N, Hv] in q's dtype (or out_dtype) and lse [B, N, T] float32 (natural log;
    float64 for float64 inputs, the interpreter's);
    with_log_sum: also log_sum [B, N, T] float32, each row's log softmax denominator relative
    to its max (`softmax_store`'s; what a sink's share is taken from where lse rounds it away).

    ahead: None, or int32 [B] >= 0: sequence b's new tokens sit ahead[b] positions past its
    lengths[b] keys (token t at lengths[b] + ahead[b] - T + t, seeing the keys at or before
    it, and within its window), as on a device that holds a sequence's earlier keys of a
    cache split over its sequence. out_dtype: out's dtype (None: q's; float32 for partial
    results that merge again).

    q: [B, T, N, H]; lengths: int32 [B] (clipped to [0, capacity]). Contiguous cache
    (block_tables None): k [B, S, K, H], v [B, S, K, Hv]. Paged: k [num_pages, page_size, K,
    H], v [num_pages, page_size, K, Hv] and block_tables int32 [B, max_pages]. v None: a shared
    latent cache, whose first value_head_dim columns are the values (read with the keys, once).
    k and v may be float8 (converted in the kernel, `cache.product_queries`) with k_scale and
    v_scale float32 [K] (the keys and values are the cache's times the scales of their KV head;
    v_scale is the key scale for a shared cache). num_sms: the target GPU's SMs
    (`Device.num_sms`), for the split count.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    fmt = CacheFormat(
        head_dim,
        v.shape[-1] if v is not None else value_head_dim,
        shared=v is None,
        scaled=k_scale is not None,
    )
    value_head_dim, hvp = fmt.value_head_dim, fmt.value_piece.padded
    num_rows = q_len * group
    paged = block_tables is not None
    if paged:
        page_size = k.shape[1]
        capacity = block_tables.shape[1] * page_size
        k = k.reshape(-1, num_kv_heads, head_dim)  # [num_pages * page_size, K, H]: free
        if v is not None:
            v = v.reshape(-1, num_kv_heads, value_head_dim)
    else:
        page_size = None
        capacity = k.shape[1]
    plan = decode_plan(
        q.shape,
        num_kv_heads,
        capacity,
        q.dtype,
        block_sizes,
        window_left=window_left,
        num_sms=num_sms,
        fmt=fmt,
        cache_dtype=k.dtype,
    )
    block_m, block_kv, schedule = plan.block_m, plan.block_kv, plan.schedule
    num_m_tiles, splits = plan.num_m_tiles, schedule.splits
    q_rows = _packed(q, num_kv_heads, fmt)
    out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"decode_forward: out_dtype={out_dtype} must be a floating dtype")
    lengths, schedule = _lengths_operand(lengths, ahead, schedule)

    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        soft_cap=soft_cap,
        window_left=window_left,
        fmt=fmt,
        q_len=q_len,
        group=group,
        block_m=block_m,
        block_kv=block_kv,
        schedule=schedule,
        page_size=page_size,
        with_log_sum=splits > 1 or with_log_sum,
        # Beyond 2 stages, where a paged tile's lookup in the step would cost buffers.
        lookahead=paged and block_sizes.num_stages > 2,
    )
    operands, in_specs, runs = _operands(
        lengths,
        q_rows,
        k,
        v,
        block_tables,
        k_scale,
        v_scale,
        fmt=fmt,
        schedule=schedule,
        block_m=block_m,
    )
    items = schedule.items
    merge_tiles = None
    if splits > 1 and decode_merge(block_sizes) == "kernel":
        merge_tiles = MergeTiles.of(schedule, num_rows, value_head_dim)
    # The merge kernel's steps read past the last item (masked): padding, never written.
    padded_items = items if merge_tiles is None else items + merge_tiles.chunk - 1
    row_spec = pl.BlockSpec((None, None, block_m), lambda m, h, z: (z, h, m))
    acc = accumulation_dtype(q.dtype)  # float32, float64 for float64 inputs (the interpreter)
    row_shape = jax.ShapeDtypeStruct((padded_items, num_kv_heads, num_rows), acc)
    # Split items also store log_sum, which their merge weighs them by (lse and log_sum).
    rows_out = 2 if splits > 1 or with_log_sum else 1
    out, *rows = pallas_call(
        kernel,
        grid=(num_m_tiles, num_kv_heads, items),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_m, hvp), lambda m, h, z: (z, h, m, 0)),
            *[row_spec] * rows_out,
        ],
        out_shape=[
            jax.ShapeDtypeStruct(
                (padded_items, num_kv_heads, num_rows, value_head_dim),
                out_dtype if splits == 1 else acc,
            ),
            *[row_shape] * rows_out,
        ],
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="pallas_flash_decode",
    )(*operands)
    if splits > 1 and merge_tiles is None:
        out, *rows = _combine_splits(out, *rows, splits)
    elif splits > 1:
        runs_or_any = lengths if runs is None else runs
        out, *rows = _merge(runs_or_any, out, *rows, schedule, merge_tiles, out_dtype, interpret)
    out = _unpacked(out.astype(out_dtype), q_len, group)
    return out, *(_by_head(row, q_len, group) for row in rows[: 2 if with_log_sum else 1])


def _lengths_operand(lengths, ahead, schedule: Schedule):
    """(lengths, schedule): the int32 lengths [B], followed by the aheads (one operand) when
    there are any, and the schedule told so."""
    batch = schedule.batch
    lengths = jnp.asarray(lengths, jnp.int32)
    if ahead is not None:  # one operand: the lengths, then the aheads
        if tuple(jnp.shape(ahead)) != (batch,) or not jnp.issubdtype(
            jnp.result_type(ahead), jnp.integer
        ):
            raise ValueError(
                f"decode_forward: ahead {jnp.shape(ahead)} {jnp.result_type(ahead)} must be an "
                f"integer array of shape ({batch},), one per sequence"
            )
        lengths = jnp.concatenate([lengths, jnp.asarray(ahead, jnp.int32)])
        schedule = dataclasses.replace(schedule, ahead=True)
    return lengths, schedule


def _operands(lengths, q_rows, k, v, block_tables, k_scale, v_scale, *, fmt, schedule, block_m):
    """(operands, in_specs, runs) of the split kernel over the packed rows q_rows [B, K, M, H]
    and the cache (k, v as `decode_forward` reshaped them; a paged cache's tables flattened).
    runs: `Schedule.plan_runs`'s table where the schedule is planned, else None."""
    batch, num_kv_heads = q_rows.shape[0], q_rows.shape[1]
    paged = block_tables is not None
    capacity = None if paged else k.shape[1]
    # Every block holds the whole batch: the schedule picks each item's sequence in the kernel.
    lengths_spec = pl.BlockSpec(lengths.shape, lambda m, h, z: (0,))
    q_spec = pl.BlockSpec((batch, None, block_m, fmt.query_block), lambda m, h, z: (0, h, m, 0))
    operands = [lengths, q_rows, k]

    def kv_spec(cols):  # this KV head's keys or values
        if paged:
            return pl.BlockSpec((k.shape[0], None, cols), lambda m, h, z: (0, h, 0))
        return pl.BlockSpec((batch, capacity, None, cols), lambda m, h, z: (0, 0, h, 0))

    in_specs = [lengths_spec, q_spec, kv_spec(fmt.key_block)]
    if v is not None:
        operands.append(v)
        in_specs.append(kv_spec(fmt.value_piece.padded))
    if paged:
        table = jnp.asarray(block_tables, jnp.int32).reshape(-1)
        in_specs.append(pl.BlockSpec((table.shape[0],), lambda m, h, z: (0,)))
        operands.append(table)
    runs = None
    if schedule.planned:
        runs = schedule.plan_runs(lengths)
        in_specs.append(pl.BlockSpec(runs.shape, lambda m, h, z: (0,)))
        operands.append(runs)
    if fmt.scaled:
        scale_spec = pl.BlockSpec((num_kv_heads,), lambda m, h, z: (0,))
        in_specs += [scale_spec, scale_spec]
        operands += [jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)]
    return operands, in_specs, runs


def _packed(q, num_kv_heads: int, fmt: CacheFormat):
    """q [B, T, N, H] -> packed rows [B, K, T * G, H] (`pack_queries`' columns), row t * G + g
    = token t of query head k * G + g."""
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q_rows = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, q_len * group, head_dim)
    return pack_queries(q_rows, fmt)


def _unpacked(out, q_len: int, group: int):
    """[B, K, T * G, Hv] packed rows -> [B, T, N, Hv]."""
    batch, num_kv_heads, _, value_head_dim = out.shape
    out = out.reshape(batch, num_kv_heads, q_len, group, value_head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_kv_heads * group, value_head_dim)


def _by_head(row, q_len: int, group: int):
    """[B, K, T * G] -> [B, N, T]."""
    batch, num_kv_heads, _ = row.shape
    row = row.reshape(batch, num_kv_heads, q_len, group).transpose(0, 1, 3, 2)
    return row.reshape(batch, num_kv_heads * group, q_len)


@dataclasses.dataclass(frozen=True)
class MergeTiles:
    """The merge kernel's tiles: `chunk` items per step, `block_r` packed rows and `block_c`
    columns per program. The split kernel pads its per-item results by chunk - 1 items, so
    that a step's loads stay in bounds in the interpreter too (masked there, never read)."""

    chunk: int
    block_r: int
    block_c: int

    # f32 elements of one step's partial results per program: 32 per thread of 4 warps, so
    # that the step's loads all issue before the first one is waited for.
    BUDGET = 4096

    @classmethod
    def of(cls, schedule: Schedule, num_rows: int, head_dim: int) -> MergeTiles:
        items = max(2, 1 << (schedule.splits - 1).bit_length())  # a sequence's, on average
        chunk = min(items, 32)
        block_r = min(16, max(2, 1 << (num_rows - 1).bit_length()))
        block_c = padded_head_dim(head_dim)
        # Narrower columns before fewer items: more programs, each one round trip.
        while chunk * block_r * block_c > cls.BUDGET and block_c > 16:
            block_c //= 2
        while chunk * block_r * block_c > cls.BUDGET and block_r > 2:
            block_r //= 2
        return cls(chunk, block_r, block_c)


def _merge(runs, out, lse, log_sum, schedule: Schedule, tiles: MergeTiles, dtype, interpret):
    """The merge kernel over per-item results (out [items + tiles.chunk - 1, K, M, H] f32, lse
    and log_sum [items + tiles.chunk - 1, K, M], the items then padding): ([B, K, M, H] in
    dtype, lse [B, K, M], log_sum [B, K, M]). runs: `Schedule.plan_runs`'s table where the
    schedule is planned (any int32 vector otherwise: unread)."""
    padded_items, num_kv_heads, num_rows, head_dim = out.shape
    batch = schedule.batch
    block_r, block_c = tiles.block_r, tiles.block_c
    col_tiles = pl.cdiv(head_dim, block_c)  # none wholly past the head dim
    kernel = functools.partial(
        _merge_kernel,
        schedule=schedule,
        num_rows=num_rows,
        head_dim=head_dim,
        block_r=block_r,
        block_c=block_c,
        col_tiles=col_tiles,
        chunk=tiles.chunk,
    )
    # Grid axis 0: the row tile and the column tile of a program, columns fastest.
    rows = lambda rc: div(rc, col_tiles)  # noqa: E731
    cols = lambda rc: rem(rc, col_tiles)  # noqa: E731
    return pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_r) * col_tiles, num_kv_heads, batch),
        in_specs=[
            pl.BlockSpec(runs.shape, lambda rc, h, b: (0,)),
            pl.BlockSpec(
                (padded_items, None, block_r, block_c), lambda rc, h, b: (0, h, rows(rc), cols(rc))
            ),
            pl.BlockSpec((padded_items, None, block_r), lambda rc, h, b: (0, h, rows(rc))),
            pl.BlockSpec((padded_items, None, block_r), lambda rc, h, b: (0, h, rows(rc))),
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, block_r, block_c), lambda rc, h, b: (b, h, rows(rc), cols(rc))
            ),
            pl.BlockSpec((None, None, block_r), lambda rc, h, b: (b, h, rows(rc))),
            pl.BlockSpec((None, None, block_r), lambda rc, h, b: (b, h, rows(rc))),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows), lse.dtype),
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows), lse.dtype),
        ],
        compiler_params=CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="pallas_flash_decode_merge",
    )(runs, out, lse, log_sum)


def _combine_splits(out, lse, log_sum, splits: int):
    """(out, lse, log_sum) over all splits from per-split results (out [B * splits, K, M, H],
    lse and log_sum [B * splits, K, M]; `merge_splits`)."""
    weights, combined_lse, combined_log_sum, _ = merge_splits(lse, log_sum, splits)
    out = out.reshape(-1, splits, *out.shape[1:])  # weights: [B, splits, K, M]
    return jnp.sum(weights[..., None] * out, axis=1), combined_lse, combined_log_sum
