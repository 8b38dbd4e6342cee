"""The forward's work schedule, planned in Python and XLA before the kernel runs: which CTA takes
which (batch, head, query tile), the KV tile ranges each CTA and consumer visits under the mask,
which sides of a range need the element-wise mask, and the per-tile plan of segment ids; and
the order in which the causal backward kernels' grids launch their CTAs (`grouped_launch`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import masks
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic._kernel_common import clip
from pallas_flash.mosaic.launch import pad_ids
from pallas_flash.mosaic.tiles import NUM_CONSUMERS, ForwardTiles, cdiv


@dataclasses.dataclass(frozen=True)
class _Work:
    """The work items, one per (batch, head, query tile) of cta_rows rows, and which CTA takes
    which. A CTA of the plain grid takes its own (batch, head, q_tile); the hardware launches
    the query tiles of one head next to each other (they share K/V in L2). A persistent CTA c
    of C takes one item of each round of C items of a fixed order: (batch, head, q_tile) with
    q_tile fastest, neighbours sharing K/V as in the grid, when every item costs the same; causal
    items grow with their query tile, so there q_tile is slowest: each round of C items is of
    one or two query tiles (when C <= B * N) and the CTAs stay balanced (with the tiles of a
    head as neighbours, C even and two tiles per head, every other CTA would get only the
    long ones). `reverse` (causal):
    query tile q_tile maps to Q - 1 - q_tile, so that the longest rows start first and the
    short ones fill in at the end. The rounds snake: CTA c takes the c-th item of even rounds
    and the (C - 1 - c)-th of odd ones, so that with the longest items first no CTA takes the
    longest of every round (in round-robin CTA 0 did: 3-6% over the mean work at the grid's
    causal 1k-16k, which the snake cuts to 0.1-0.2% from 4k).
    But each round of the snake spans up to C heads, whose K/V do not stay in L2 from one round
    to the next (the H=128 causal 2k forward read 1.18 GB from DRAM, 4.6 times q, k, v and out,
    at 76% of its bandwidth: Nsight Compute,
    docs/notes/forward.md, "Persistent CTAs and causal pairs"). `paired` (causal rows that
    see keys 0..i, an even number of query tiles Q): a head's query tiles go in pairs
    (Q - 1 - i, i), the long one first, of equal work (Q + 1 KV tiles' worth); a persistent CTA
    c takes pairs c, c + C, ... of the order (batch, head, pair) with the pair fastest, so that
    a round of C pairs spans about 2 C / Q heads. Whole pairs would leave the last round's
    CTAs a pair apart (the busiest 1.031x the mean work at the grid's causal shapes, 1.8x with
    144 pairs on 132 CTAs), so the last whole round and the partial one (the tail, `_Tail`)
    go as single query tiles, longest first, in a snake, with a round of the tail spanning the
    tail's few heads: modelled, the busiest CTA does 1.004-1.014x the mean work at the grid's
    shapes (the snake over every item 1.000-1.031x), at worst 5% more than the snake's busiest
    (B=2, 22 heads, 14 query tiles: one more short tile in the tail's partial round)."""

    batch: int
    num_heads: int
    num_q_tiles: int
    reverse: bool
    paired: bool = False

    def __post_init__(self):
        if self.paired and (not self.reverse or self.num_q_tiles % 2):
            raise ValueError(f"paired work needs reverse and an even num_q_tiles: {self}")

    @property
    def total(self) -> int:
        return self.batch * self.num_heads * self.num_q_tiles

    def count(self, persistent: bool):
        """Items this CTA walks: a Python int, or a traced int32 when persistent."""
        if not persistent:
            return 1
        return self.persistent_count(lax.axis_index("cta"), lax.axis_size("cta"))

    def persistent_count(self, cta, num_ctas: int):
        """Items CTA cta of num_ctas walks: every whole round's, and the last round's if its
        place there (`round_place`) is among the round's items; paired, two per round of
        whole pairs and then the tail's snake."""
        if self.paired:
            tail = self.tail(num_ctas)
            return 2 * tail.pair_rounds + self._snake_count(cta, tail.items, num_ctas)
        return self._snake_count(cta, self.total, num_ctas)

    def _snake_count(self, cta, items: int, num_ctas: int):
        """Items of a snake over `items` items that CTA cta takes."""
        rounds, left = divmod(items, num_ctas)
        return rounds + (self.round_place(cta, rounds, num_ctas) < left).astype(jnp.int32)

    def tail(self, num_ctas: int) -> _Tail:
        """The paired order's split into rounds of whole pairs and the tail of single tiles."""
        pairs_per_head = self.num_q_tiles // 2
        pairs = self.batch * self.num_heads * pairs_per_head
        pair_rounds = max(pairs // num_ctas - 1, 0)
        first = pair_rounds * num_ctas  # the tail's first pair
        return _Tail(
            pair_rounds=pair_rounds,
            items=2 * (pairs - first),
            first_head=first // pairs_per_head,
            first_pair=first % pairs_per_head,
            heads=self.batch * self.num_heads,
            num_q_tiles=self.num_q_tiles,
        )

    @staticmethod
    def round_place(cta, n, num_ctas: int):
        """CTA cta's place in round n (its n-th item is item n * C + place): c on even rounds,
        C - 1 - c on odd ones. Ints or int32 scalars, without a branch."""
        odd = lax.rem(jnp.asarray(n, jnp.int32), 2)
        return cta + odd * (num_ctas - 1 - 2 * cta)

    def item(self, n, persistent: bool):
        """(batch, head, q_tile) of this CTA's n-th item."""
        if persistent:
            cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
            return self.cta_item(cta, n, num_ctas)
        batch, head = lax.axis_index("batch"), lax.axis_index("head")
        q_tile = lax.axis_index("q_tile")
        if self.reverse:
            q_tile = self.num_q_tiles - 1 - q_tile
        return batch, head, q_tile

    def cta_item(self, cta, n, num_ctas: int):
        """(batch, head, q_tile) of CTA cta's n-th item (ints or int32 scalars)."""
        if not self.paired:
            return self.persistent_item(n * num_ctas + self.round_place(cta, n, num_ctas))
        n = jnp.asarray(n, jnp.int32)
        tail = self.tail(num_ctas)
        # Whole pairs: pair (n // 2) * C + c, its long tile at even n.
        pair = lax.div(n, 2) * num_ctas + cta
        pairs_per_head = self.num_q_tiles // 2
        batch_head, i = lax.div(pair, pairs_per_head), lax.rem(pair, pairs_per_head)
        q_tile = jnp.where(lax.rem(n, 2) == 0, self.num_q_tiles - 1 - i, i)
        # The tail: single tiles in a snake of its own.
        t = jnp.maximum(n - 2 * tail.pair_rounds, 0)
        tail_head, tail_q = tail.item(t * num_ctas + self.round_place(cta, t, num_ctas))
        in_tail = n >= 2 * tail.pair_rounds
        batch_head = jnp.where(in_tail, tail_head, batch_head)
        q_tile = jnp.where(in_tail, tail_q, q_tile)
        return lax.div(batch_head, self.num_heads), lax.rem(batch_head, self.num_heads), q_tile

    def persistent_item(self, w):
        """(batch, head, q_tile) of item w of the persistent order (ints or int32 scalars)."""
        if self.reverse:
            heads = self.batch * self.num_heads
            q_tile, batch_head = self.num_q_tiles - 1 - w // heads, w % heads
        else:
            q_tile, batch_head = w % self.num_q_tiles, w // self.num_q_tiles
        return batch_head // self.num_heads, batch_head % self.num_heads, q_tile


@dataclasses.dataclass(frozen=True)
class _Tail:
    """The single query tiles of the paired order's tail: its pairs from pair `first_pair` of
    head `first_head` (batch and head flattened) to the last head's last, longest first. The
    tile q of pair min(q, Q - 1 - q) is in the tail for the heads after first_head, and for
    first_head where that pair is at least first_pair: the levels q in [i0, Q - 1 - i0] (i0 =
    first_pair) have one head more than the i0 levels above and below them. Within a level,
    heads in order."""

    pair_rounds: int  # rounds of whole pairs before the tail
    items: int  # single tiles in the tail
    first_head: int
    first_pair: int
    heads: int
    num_q_tiles: int

    def item(self, rank):
        """(batch_head, q_tile) of the tail's rank-th tile (an int32 scalar, rank < items)."""
        q_tiles, i0, h0 = self.num_q_tiles, self.first_pair, self.first_head
        full = self.heads - 1 - h0  # heads whose every pair is in the tail
        above = i0 * full  # tiles of the levels Q - 1 .. Q - i0
        middle = (q_tiles - 2 * i0) * (full + 1)  # of the levels Q - 1 - i0 .. i0
        rank = jnp.asarray(rank, jnp.int32)
        mid = rank - above
        head = h0 + lax.rem(mid, full + 1)
        q_tile = q_tiles - 1 - i0 - lax.div(mid, full + 1)
        if full:  # else the tail is pairs of first_head alone: the middle levels only
            top_head = h0 + 1 + lax.rem(rank, full)
            top_q = q_tiles - 1 - lax.div(rank, full)
            low = rank - above - middle
            low_head = h0 + 1 + lax.rem(low, full)
            low_q = i0 - 1 - lax.div(low, full)
            head = jnp.where(rank < above, top_head, jnp.where(low >= 0, low_head, head))
            q_tile = jnp.where(rank < above, top_q, jnp.where(low >= 0, low_q, q_tile))
        return head, q_tile


def paired_causal_rows(spec: MaskSpec, tiles: ForwardTiles, *, has_segments: bool) -> bool:
    """Whether a persistent causal forward takes its query tiles in pairs of equal work
    (`_Work.paired`): tiles say so (`ForwardTiles.causal_pairs`), and rows i see keys 0..i (no
    left side of a window, no segment ids, T <= S, so that a query tile's work grows by the
    same with each tile), over an even number of CTA query tiles."""
    left, _ = mask_sides(spec, tiles)
    return (
        tiles.persistent
        and tiles.causal_pairs
        and spec.is_causal
        and not left
        and not has_segments
        and spec.q_len <= spec.kv_len
        and cdiv(spec.q_len, tiles.cta_rows) % 2 == 0
    )


# Of the H200's 50 MB L2, what the CTAs of a grid launched together may fill with the operand
# they stream (`launch_group`).
LAUNCH_L2_BYTES = 16 * 2**20


def launch_group(units: int, unit_bytes: int, *, is_causal: bool) -> int:
    """Units (a grid's batch entries times heads) that a causal grid launches together,
    longest tiles first (`grouped_launch`): as many as keep the operand their CTAs stream
    (unit_bytes each) within LAUNCH_L2_BYTES. 1 (the grid's own order) for other calls,
    whose tiles all cost the same."""
    if not is_causal:
        return 1
    return max(1, min(units, LAUNCH_L2_BYTES // max(unit_bytes, 1)))


def grouped_launch(unit, tile, *, units: int, tiles: int, group: int):
    """(unit, level) of the CTA that the hardware launches at grid position (unit, tile), the
    grid's tile axis fastest, when units go `group` at a time and, within a group, level by
    level (level 0, the longest tiles, first; each level's units in order).

    A causal backward kernel's grid in its own order (a unit's tiles longest first, then the
    next unit's) starts the last units' longest CTAs near the end of the launch: the hardware
    hands CTAs to SMs as they free up, so the kernel ran 3-7% past an even share of its work
    (modelled at the grid's causal 1k-8k, H=128; 16k 0.5%). A group of units at a time, level
    by level, keeps each group's longest CTAs first (0.0-2% over an even share), and the
    group's streamed operand (Q and dO, or K and V) shared in L2 as a unit's tiles were.
    Ints or int32 scalars; group 1 is the grid's own order."""
    if group == 1:
        return unit, tile
    position = unit * tiles + tile
    first = lax.div(position, group * tiles) * group  # the group's first unit
    size = jnp.minimum(group, units - first)  # the last group may be smaller
    rank = lax.rem(position, group * tiles)
    return first + lax.rem(rank, size), lax.div(rank, size)


def launched_cta(names, launch_units: int):
    """(batch, unit, tile) of this CTA from its grid position (axes `names`), the units going
    launch_units (batch, unit) pairs at a time (`grouped_launch`)."""
    batch, unit, tile = (lax.axis_index(name) for name in names)
    if launch_units == 1:
        return batch, unit, tile
    units = lax.axis_size(names[1])
    unit, tile = grouped_launch(
        batch * units + unit,
        tile,
        units=lax.axis_size(names[0]) * units,
        tiles=lax.axis_size(names[2]),
        group=launch_units,
    )
    return lax.div(unit, units), lax.rem(unit, units), tile


def cta_tile_range(spec: MaskSpec, cta_q_start, tiles: ForwardTiles):
    """(lo, hi): the KV tiles a CTA's producer streams, in order, for query rows
    [cta_q_start, cta_q_start + cta_rows): the union of its consumers' ranges (every tile in
    it is read by some consumer). Python ints or traced int32 scalars."""
    lo, _, _, hi = spec.kv_tile_range(cta_q_start, tiles.cta_rows, tiles.block_kv)
    return lo, hi


def consumer_tile_range(spec: MaskSpec, q_start, cta_range, tiles: ForwardTiles):
    """(lo, full_lo, full_hi, hi) of `MaskSpec.kv_tile_range` for a consumer's block_q rows
    from q_start, clamped into the CTA's range (lo, hi): the drain scheme of `_consume` walks
    [cta lo, lo) and [hi, cta hi). A consumer that sees keys has its range inside the CTA's
    already; one that sees none may get an empty range past the CTA's (lo = hi beyond the
    CTA's hi), which unclamped would drain steps that the producer never loads."""
    first, end = cta_range
    return tuple(
        clip(x, first, end) for x in spec.kv_tile_range(q_start, tiles.block_q, tiles.block_kv)
    )


def mask_sides(spec: MaskSpec, tiles: ForwardTiles) -> tuple[bool, bool]:
    """(left, right): whether the window's left side (the right side, or causality) hides any
    key from a row the kernel runs: rows i < R, R = T rounded up to the CTA's rows (rows past T
    run the same loops, on zeros, and are not kept). Row i >= 0 sees keys j >= i - left, all of
    them once left >= R - 1; keys j <= i + right, all j < S once right >= S - 1. Without a left
    side every consumer range starts at the CTA's first tile and is whole from there; without
    a right side it ends whole at the CTA's last (unless the last KV tile is ragged)."""
    rows = cdiv(spec.q_len, tiles.cta_rows) * tiles.cta_rows
    return spec.left < rows - 1, spec.right < spec.kv_len - 1


def segment_tile_plan(spec: MaskSpec, arrays: MaskArrays, tiles: ForwardTiles) -> jax.Array:
    """KV tile ranges of every CTA and consumer of the forward with segment ids: `tile_plan`
    over query rows, int32 [B, ceil(T / cta_rows), NUM_CONSUMERS + 1, 4]."""
    return tile_plan(
        spec,
        arrays,
        block_rows=tiles.block_q,
        block_cols=tiles.block_kv,
        num_consumers=NUM_CONSUMERS,
        over="q",
    )


def tile_plan(
    spec: MaskSpec,
    arrays: MaskArrays,
    *,
    block_rows: int,
    block_cols: int,
    num_consumers: int,
    over: str,
) -> jax.Array:
    """Tile ranges of every CTA and consumer with segment ids, computed by XLA before a kernel:
    int32 [B, num_ctas, num_consumers + 1, 4], indexed by the CTA's tile. The arrays' ids past T
    and S (if any) are padding ids.

    over="q" (the forward, dQ): a CTA owns num_consumers * block_rows query rows, a consumer
    block_rows of them, and ranges are of KV tiles of block_cols keys. over="kv" (dK/dV): a CTA
    owns num_consumers * block_rows keys, a consumer block_rows of them, and ranges are of query
    tiles of block_cols rows.

    Row wg < num_consumers is consumer wg's (lo, full_lo, full_hi, hi): the geometry's range
    (`MaskSpec.kv_tile_range` or `q_tile_range`) intersected with the ids' (`masks.tile_ranges`
    over its block_rows), clamped into the CTA's range. Row num_consumers is (first, first, end,
    end), the CTA's range: the hull of its consumers' non-empty ranges, (0, 0) when all are
    empty.

    What the drain scheme of the consumers rests on (tests check it against brute force):
    0 <= first <= lo <= full_lo <= full_hi <= hi <= end <= number of tiles for every consumer
    (each walks exactly the producer's steps [first, end), draining those outside [lo, hi));
    every pair a consumer's rows see lies in a tile of [lo, hi), and tiles in [full_lo, full_hi)
    are seen whole by every row. A tile of the hull that no consumer visits (a gap between two
    consumers' documents) is loaded and drained by both: correct, a little wasted bandwidth.
    With over="kv", keys past S count as seen (the kernel computes their rows of dK and dV and
    does not keep them).
    """
    if over == "q":
        own_len, num_tiles, pad = spec.q_len, cdiv(spec.kv_len, block_cols), masks.PAD_Q_SEGMENT
    elif over == "kv":
        own_len, num_tiles, pad = spec.kv_len, cdiv(spec.q_len, block_cols), masks.PAD_KV_SEGMENT
    else:
        raise ValueError(f"{over=} must be 'q' or 'kv'")
    num_rows = cdiv(own_len, num_consumers * block_rows) * num_consumers
    starts = jnp.arange(num_rows, dtype=jnp.int32) * block_rows
    # Rows past the CTAs' own length (a ragged last CTA's) see nothing: padding ids, whose tiles
    # visit no tile.
    own_to = num_rows * block_rows
    if over == "q":
        geometry = spec.kv_tile_range(starts, block_rows, block_cols)
        ids = pad_ids(arrays.q_segment_ids, own_to, pad)
        by_ids = masks.tile_ranges(
            dataclasses.replace(spec, q_len=own_to),
            arrays._replace(q_segment_ids=ids),
            block_rows,
            block_cols,
            over="q",
        )
    else:
        rows_spec = dataclasses.replace(spec, kv_len=own_to)
        geometry = rows_spec.q_tile_range(starts, block_cols, block_rows)
        ids = pad_ids(arrays.kv_segment_ids, own_to, pad)
        by_ids = masks.tile_ranges(
            rows_spec, arrays._replace(kv_segment_ids=ids), block_cols, block_rows, over="kv"
        )
    geometry = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32), (num_rows,)) for x in geometry)
    by_ids = by_ids[:, 0]  # [B, rows, 4]
    ranges = masks.intersect(geometry, tuple(by_ids[..., i] for i in range(4)))
    shape = (by_ids.shape[0], num_rows // num_consumers, num_consumers)
    lo, full_lo, full_hi, hi = (
        jnp.broadcast_to(x, shape[:1] + x.shape[-1:]).reshape(shape) for x in ranges
    )
    visits = lo < hi
    any_visit = visits.any(axis=-1)
    first = jnp.where(any_visit, jnp.min(jnp.where(visits, lo, num_tiles), axis=-1), 0)
    end = jnp.where(any_visit, jnp.max(jnp.where(visits, hi, 0), axis=-1), 0)
    consumers = jnp.stack(
        [jnp.clip(x, first[..., None], end[..., None]) for x in (lo, full_lo, full_hi, hi)],
        axis=-1,
    )
    cta = jnp.stack([first, first, end, end], axis=-1)[:, :, None]
    return jnp.concatenate([consumers, cta], axis=2).astype(jnp.int32)
