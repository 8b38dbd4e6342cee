"""Ragged paged attention: the new tokens of many sequences (decode steps and prefill chunks
side by side, concatenated) over one paged KV cache.

FlashAttention-2's forward loop (Dao 2023, Algorithm 1) over work items. A sequence's packed
rows are its new tokens times the query heads of one KV head (the decode kernel's packing: the
group shares one read of the KV head's pages). Sequences come in two kinds, each in its own
launch with its own tiles (`RaggedBlockSizes`; `Rows` says which rows each launch writes):

- decode: sequences of at most `block_m` packed rows (a decode step: the group of one token)
  take one small tile each; program b reads sequence b (no work list), and the keys of a tile
  may split over several programs (Flash-Decoding), whose partial results a merge kernel
  combines by their softmax denominators.
- prefill: longer sequences are cut into large tiles by a work list that XLA writes before the
  launch (of a size fixed by the shapes, a bound on the tiles any batch of these shapes can
  have; items past a batch's tiles store nothing); each tile skips the key tiles above the
  causal diagonal.

The kernel that finishes a launch's rows (the launch itself, or its merge after a split)
writes them in place into the flat [T * N, Hv] output, which the launches pass on to each
other: no transpose of the queries or the output, no scatter. The decode launch's finisher
also writes 0 into the rows of no sequence (an engine's padding) and of sequences with more
new tokens than the call allows (`max_query_len`). The lengths are clipped in the kernels;
XLA computes only the safe query starts (when traced) and the prefill work list.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import masks
from pallas_flash._numerics import accumulation_dtype
from pallas_flash._pallas_triton import CompilerParams, cdiv, div, fold, rem
from pallas_flash._vma import pallas_call
from pallas_flash.device import DEFAULT_NUM_SMS
from pallas_flash.triton._common import (
    dot,
    merge_parts_step,
    scores,
    softmax_init,
    softmax_step,
    softmax_store,
    visit_tiles,
)
from pallas_flash.triton.cache import (
    CacheFormat,
    load_paged_rows,
    load_piece_gathered,
    logit_scale_and_unit,
    pack_queries,
    paged_rows,
    product_queries,
    read_tiles,
    scales_of,
)
from pallas_flash.triton.decode import (
    MergeTiles,
    _ctas_per_sm,
    decode_block_sizes,
    splits_for_slots,
)
from pallas_flash.triton.tiles import (
    DecodeBlockSizes,
    RaggedBlockSizes,
    default_ragged_block_sizes,
    padded_head_dim,
)

# The first packed row of a prefill item past the batch's tiles: beyond every sequence's rows,
# so that the item's rows are all masked.
_NO_ROWS = 1 << 30


@dataclasses.dataclass(frozen=True)
class Rows:
    """Which launch writes which rows of a call of `num_tokens` tokens in `batch` sequences.

    Sequence b (< batch) owns tokens starts[b]:starts[b + 1] (the safe query starts:
    non-decreasing in [0, T]) and in each KV head their packed rows, q_len * group. It is
    decode-kind with 1..decode_rows packed rows (the decode launch writes it), prefill-kind with
    decode_rows + 1..prefill_rows (the prefill launch, present where prefill_rows >
    decode_rows). Two more sequences of no key hold the tokens outside every sequence: number
    `batch` those before starts[0], `batch + 1` those from starts[B]. They, and the sequences of
    more than prefill_rows packed rows (more new tokens than max_query_len), output 0 (lse
    -inf, or the sink): the decode launch writes those rows too."""

    num_tokens: int
    batch: int
    num_heads: int
    group: int
    capacity: int
    decode_rows: int
    prefill_rows: int

    @property
    def has_prefill(self) -> bool:
        return self.prefill_rows > self.decode_rows

    def sequence(self, starts_ref, lengths_ref, s):
        """(first token, new tokens, keys) of sequence s in [0, batch + 2), from the safe
        starts [B + 1] and the lengths [B] (clipped here to [0, capacity])."""
        b = self.batch
        start = jnp.where(s == b, 0, starts_ref[jnp.minimum(s, b)])
        end = jnp.where(s > b, self.num_tokens, starts_ref[jnp.where(s < b, s + 1, 0)])
        length = jnp.clip(lengths_ref[jnp.minimum(s, b - 1)], 0, self.capacity)
        return start, jnp.maximum(end - start, 0), jnp.where(s < b, length, 0)

    def zeroed(self, s, packed):
        """Whether sequence s, of `packed` rows, outputs 0 (the decode launch writes it)."""
        return (s >= self.batch) | (packed > self.prefill_rows)

    def flat(self, start, kv_head, p, valid):
        """(row of the flat output [T * N] where valid, else T * N (past it: stores there are
        masked), query head) of packed row p of KV head kv_head of a sequence whose tokens
        start at `start`: token start + p // group, query head kv_head * group + p % group."""
        head = kv_head * self.group + rem(p, self.group)
        flat = (start + div(p, self.group)) * self.num_heads + head
        return jnp.where(valid, flat, self.num_tokens * self.num_heads), head


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of the kernel: its kind's sequences ("decode": one `block_m`-row tile each,
    item b the batch's sequence b; "prefill": `block_m`-row tiles from a work list of `items`,
    a bound on their tiles in any batch of the call's shapes); `splits` programs share each
    tile's keys."""

    kind: str
    block_m: int
    block_kv: int
    num_warps: int
    num_stages: int
    splits: int
    items: int

    @property
    def name(self) -> str:
        """The kernel's name: pallas_flash_ragged_{decode,prefill}[_split] (its merge's:
        ..._merge)."""
        return f"pallas_flash_ragged_{self.kind}" + ("_split" if self.splits > 1 else "")

    @property
    def finished_items(self) -> int:
        """The items of the kernel that writes the launch's rows of the output: the decode
        launch's include the two sequences of no key (`Rows`)."""
        return self.items + 2 if self.kind == "decode" else self.items


def ragged_block_sizes(
    q_shape,
    batch: int,
    num_kv_heads: int,
    capacity: int,
    dtype,
    *,
    interpret: bool,
    page_size: int,
    window_left: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
    fmt: CacheFormat | None = None,
    cache_dtype=None,
) -> RaggedBlockSizes:
    """The default tiles of a call with queries of `q_shape` [T, N, H] in `batch` sequences
    over caches of up to `capacity` keys (of format `fmt` in `cache_dtype`, None: the plain
    cache in the queries' dtype): `default_ragged_block_sizes`, with the decode launch's key
    tile and pipeline those of `paged_attention` on its sequences, one new token each
    (`decode_block_sizes`: deeper pipelines of 32-key tiles where the split programs fill at
    most half the GPU)."""
    num_tokens, num_heads, head_dim = q_shape
    group = num_heads // num_kv_heads
    base = default_ragged_block_sizes(
        head_dim,
        dtype,
        group=group,
        interpret=interpret,
        page_size=page_size,
        fmt=fmt,
        cache_dtype=cache_dtype,
    )
    if interpret:
        return base
    decode = decode_block_sizes(
        (min(batch, num_tokens), 1, num_heads, head_dim),
        num_kv_heads,
        capacity,
        dtype,
        interpret=False,
        page_size=page_size,
        window_left=window_left,
        num_sms=num_sms,
        fmt=fmt,
        cache_dtype=cache_dtype,
    )
    return dataclasses.replace(
        base, block_kv=decode.block_kv, num_warps=decode.num_warps, num_stages=decode.num_stages
    )


def ragged_plan(
    num_tokens: int,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
    dtype,
    block_sizes: RaggedBlockSizes,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    max_query_len: int | None = None,
    fmt: CacheFormat | None = None,
    cache_dtype=None,
) -> tuple[Rows, tuple[Launch, ...]]:
    """The `Rows` and the launches of a call with `num_tokens` query rows in `batch` sequences
    of up to `capacity` keys, each of at most `max_query_len` new tokens (None: T): the decode
    launch always (it also writes the rows that output 0), the prefill launch where some
    sequence may have more packed rows than a decode tile. The prefill items are a bound: a
    prefill sequence has more than decode_rows packed rows and at most prefill_rows, so there
    are at most min(B, total rows / (decode_rows + 1)) of them, and their tiles number at most
    (their rows + block_m - 1) / block_m each. fmt, cache_dtype: the cache's format and dtype
    where it is not keys and values of their own in the queries' dtype (for the CTAs an SM
    holds)."""
    group = num_heads // num_kv_heads
    total_rows = num_tokens * group
    most_tokens = num_tokens if max_query_len is None else min(num_tokens, max_query_len)
    most_rows = most_tokens * group
    bs = block_sizes
    decode_rows = min(bs.block_m, most_rows) if group <= bs.block_m else 0
    rows = Rows(
        num_tokens=num_tokens,
        batch=batch,
        num_heads=num_heads,
        group=group,
        capacity=capacity,
        decode_rows=decode_rows,
        prefill_rows=max(most_rows, decode_rows),
    )

    def fit(block, n):  # a tile shrunk to n (padded to a power of two, at least 16)
        return min(block, max(16, 1 << (n - 1).bit_length()))

    def launch(kind, block_m, block_kv, num_warps, num_stages, kv_splits, items, programs):
        # The key tile clipped to the capacity; the requested split count, or the decode
        # kernel's "slots" rule for the launch's `programs` (before splitting).
        block_kv = fit(block_kv, capacity)
        num_kv_tiles = pl.cdiv(capacity, block_kv)
        if kv_splits:
            splits = max(1, min(kv_splits, num_kv_tiles))
        else:
            tiles = DecodeBlockSizes(
                block_m=block_m, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
            )
            slots = num_sms * _ctas_per_sm(tiles, block_m, head_dim, dtype, fmt, cache_dtype)
            splits = splits_for_slots(
                programs, num_kv_tiles, block_kv, slots=slots, block_m=block_m
            )
        return Launch(kind, block_m, block_kv, num_warps, num_stages, splits, items)

    # The decode launch: one program per sequence and KV head (those of no token exit).
    launches = [
        launch(
            "decode",
            fit(bs.block_m, most_rows),
            bs.block_kv,
            bs.num_warps,
            bs.num_stages,
            bs.kv_splits,
            batch,
            min(batch, num_tokens) * num_kv_heads,
        )
    ]
    if rows.has_prefill:
        block_m = fit(bs.block_m_prefill, most_rows)
        longer = min(batch, total_rows // (decode_rows + 1))
        items = min(
            (total_rows + longer * (block_m - 1)) // block_m,
            longer * pl.cdiv(most_rows, block_m),
        )
        launches.insert(
            0,
            launch(
                "prefill",
                block_m,
                bs.block_kv_prefill,
                bs.num_warps_prefill,
                bs.num_stages_prefill,
                bs.kv_splits_prefill,
                items,
                items * num_kv_heads,
            ),
        )
    return rows, tuple(launches)


def plan_items(starts, launch: Launch, rows: Rows):
    """The prefill launch's work list (in XLA, before the kernel), int32 [2 * items]: per item
    its sequence and the first of its packed rows in that sequence (`_NO_ROWS` for items past
    the batch's tiles, which come last). starts: the safe query starts [B + 1]. Items come in
    reverse order, so that each sequence's last tiles, which see the most keys, start first
    and the last wave is short."""
    packed = (starts[1:] - starts[:-1]) * rows.group
    fits = (packed > rows.decode_rows) & (packed <= rows.prefill_rows)
    tiles = jnp.where(fits, cdiv(packed, launch.block_m), 0)
    end = _running_sum(tiles)
    count = end[-1]
    item = jnp.arange(launch.items, dtype=jnp.int32)
    item = jnp.where(item < count, count - 1 - item, item)
    # The sequences whose tiles all lie before the item.
    seq = jnp.sum(end[None, :] <= item[:, None], axis=1).astype(jnp.int32)
    used = item < count
    seq = jnp.where(used, seq, 0)
    row0 = jnp.where(used, (item - (end - tiles)[seq]) * launch.block_m, _NO_ROWS)
    return jnp.concatenate([seq, row0]).astype(jnp.int32)


def _running_sum(x):
    """jnp.cumsum of a short vector as one XLA reduce over a triangle (XLA's cumulative sum on
    the GPU is a reduce-window kernel of a few us), up to 1024 entries."""
    n = x.shape[0]
    if n > 1024:
        return jnp.cumsum(x)
    before = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.sum(jnp.where(before, x[None, :], 0), axis=1)


def _item(rows: Rows, launch: Launch, starts_ref, lengths_ref, work_ref, item):
    """(sequence, first packed row, first token, new tokens, keys, packed rows of the item's
    tile that exist (<= 0: none)) of one item of the launch."""
    if launch.kind == "decode":
        seq, row0 = item, 0
    else:
        seq, row0 = work_ref[item], work_ref[launch.items + item]
    start, q_len, length = rows.sequence(starts_ref, lengths_ref, seq)
    packed = q_len * rows.group
    if launch.kind == "decode":
        decode = (seq < rows.batch) & (packed <= rows.decode_rows)
        rows_here = jnp.where(decode, packed, 0)
    else:
        rows_here = packed - row0
    return seq, row0, start, q_len, length, rows_here


def _store_rows(rows: Rows, carry, unit, refs, start, kv_head, p, count, hv, col0=0):
    """Stores the carry (`softmax_store`: logits in units of `unit`) of packed rows p [block]
    (the first `count` of them exist) of a sequence whose tokens start at `start` into refs =
    (o_ref, lse_ref, sinks_ref or None): the flat output [T * N, Hvp] at columns col0 + the
    carry's, the flat lse [T * N], and each row's sink from sinks_ref [N]."""
    o_ref, lse_ref, sinks_ref = refs
    block, cols = carry[0].shape
    valid = jax.lax.broadcasted_iota(jnp.int32, (block,), 0) < count
    flat, head = rows.flat(start, kv_head, p, valid)
    sink = None if sinks_ref is None else plgpu.load(sinks_ref.at[head])
    out_cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    softmax_store(
        carry,
        unit,
        o_ref.at[flat[:, None], out_cols],
        lse_ref.at[flat],
        block,
        count,
        hv - col0,
        sink=sink,
    )


def _zero_rows(
    rows: Rows,
    refs,
    start,
    kv_head,
    packed,
    block: int,
    cols: int,
    hv,
    *,
    first=0,
    stride=1,
    col0=0,
):
    """Writes 0 (lse -inf, or the sink) into the `packed` rows of KV head kv_head of a
    sequence whose tokens start at `start` (`_store_rows`'s refs), in chunks of `block` rows
    by `cols` columns from col0: chunks first, first + stride, ..."""
    count = cdiv(packed, block)

    def body(j, carry):
        c = first + j * stride
        p = c * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
        empty = softmax_init(block, cols, refs[1].dtype)  # the lse ref's
        _store_rows(rows, empty, 1.0, refs, start, kv_head, p, packed - c * block, hv, col0)
        return carry

    fold(0, cdiv(jnp.maximum(count - first, 0), stride), body, ())


def _ragged_kernel(
    starts_ref,
    lengths_ref,
    q_ref,
    k_ref,
    *refs,
    scale: float,
    soft_cap,
    window_left: int | None,
    fmt: CacheFormat,
    rows: Rows,
    max_pages: int,
    page_size: int,
    launch: Launch,
    has_sinks: bool,
    aliased: bool,
):
    """One row tile of one (work item, KV head, split): stream the key tiles its rows see of
    its sequence's pages with an online softmax.

    starts_ref: the safe query starts [B + 1]; lengths_ref: [B] (clipped here); q_ref: [T * N,
    Cq], row t * N + n = token t, query head n, its columns as `fmt.query_pieces`; k_ref:
    [num_pages * page_size, Ck] and (unless `fmt.shared`: the values are the keys' first
    columns) v_ref [num_pages * page_size, Hvp], this KV head's pages end to end; table_ref:
    [B * max_pages], the block table, flat; k_scale_ref and v_scale_ref [K] float32 where
    `fmt.scaled`. Then the prefill launch's work list (`plan_items`), sinks [N] float32 where
    has_sinks, the
    aliased previous output and lse where aliased (never read), and the outputs: unsplit, o_ref
    [T * N, Hvp] and lse_ref [T * N] (natural log), each program storing its tile's rows in
    place (the decode launch's programs past the batch, and those of sequences that output 0,
    store zeros: `Rows`); split, the tile's partial result o_ref [block_m, Hvp], lse_ref and
    log_sum_ref [block_m] (`softmax_store`'s), which `_merge_kernel` finishes.
    """
    refs = list(refs)
    v_ref = None if fmt.shared else refs.pop(0)
    table_ref = refs.pop(0)
    k_scale_ref, v_scale_ref = (refs.pop(0), refs.pop(0)) if fmt.scaled else (None, None)
    work_ref = refs.pop(0) if launch.kind == "prefill" else None
    sinks_ref = refs.pop(0) if has_sinks else None
    if aliased:
        refs = refs[2:]
    split = launch.splits > 1
    log_sum_ref = refs.pop() if split else None
    o_ref, lse_ref = refs
    block_m, block_kv, group = launch.block_m, launch.block_kv, rows.group
    item = div(pl.program_id(0), launch.splits)
    kv_head = pl.program_id(1)
    seq, row0, start, q_len, length, rows_here = _item(
        rows, launch, starts_ref, lengths_ref, work_ref, item
    )

    # Row r of the tile is packed row p = row0 + r of the sequence (`Rows.flat`). Rows past
    # the tile's take the sequence's first row (their loads and stores are masked).
    r = jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    in_tile = r < rows_here
    p = jnp.where(in_tile, row0 + r, 0)
    token = div(p, group)
    flat, _ = rows.flat(start, kv_head, p, in_tile)
    flat = jnp.minimum(flat, q_ref.shape[0] - 1)  # in bounds (the masked rows')
    hvp, value_head_dim = o_ref.shape[-1], fmt.value_head_dim
    qs = [load_piece_gathered(q_ref, flat, in_tile, piece) for piece in fmt.query_pieces]
    qs, unscale = product_queries(qs, k_ref.dtype)  # float16 over float8 for bfloat16 queries
    # New token t sits at position length - q_len + t.
    q_pos = (length - q_len + token)[:, None]
    last_row = jnp.minimum(row0 + block_m, q_len * group) - 1
    first_pos = length - q_len + div(row0, group)
    last_pos = length - q_len + div(last_row, group)
    tiles = _tile_range(first_pos, last_pos, length, rows_here > 0, window_left, block_kv)
    if split:
        # Split s of the tile's key tiles cut into `splits` equal runs.
        s = rem(pl.program_id(0), launch.splits)
        lo, hi = tiles[0], tiles[3]
        chunk = cdiv(jnp.maximum(hi - lo, 0), launch.splits)
        first = lo + s * chunk
        tiles = masks.intersect(tiles, (first, first, first + chunk, first + chunk))
    table_start = jnp.clip(seq, 0, rows.batch - 1) * max_pages
    # Each step looks up the next key tile's pages: the loads of a tile then depend on no
    # load of the same step, and Triton's pipeliner keeps num_stages - 1 tiles in flight (with
    # the lookup in the step, one fewer).
    rows_of = functools.partial(
        paged_rows, table_ref, table_start, length, block_kv, page_size, k_ref.shape[0]
    )
    k_scale, v_scale = scales_of(
        fmt, k_scale_ref, v_scale_ref, kv_head, accumulation_dtype(q_ref.dtype)
    )
    logit_scale, unit = logit_scale_and_unit(scale, soft_cap, k_scale)

    def body(j, carry, *, masked: bool):
        *carry, kv_rows = carry
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        next_rows = rows_of(kv_start + block_kv)

        # Keys past the length read as zero in the masked tiles: whatever the pages hold there
        # (stale values, NaN) never reaches a product.
        def load(ref, piece):
            return load_paged_rows(ref, kv_rows, kv_start, length, piece, block_kv, masked=masked)

        ks, v = read_tiles(fmt, load, k_ref, v_ref, qs[0].dtype)
        qk = dot(qs[0], ks[0], trans_b=True)
        for q_piece, k_piece in zip(qs[1:], ks[1:], strict=True):
            qk = qk + dot(q_piece, k_piece, trans_b=True)
        if unscale is not None:
            qk = qk * unscale
        u, _ = scores(qk, logit_scale, None, soft_cap)
        visible = None
        if masked:
            kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = kv_idx <= q_pos  # causal; also kv_idx < length
            if window_left is not None:
                visible = visible & (kv_idx >= q_pos - window_left)
        return *softmax_step(tuple(carry), u, v, unit, visible), next_rows

    init = (
        *softmax_init(block_m, hvp, accumulation_dtype(q_ref.dtype)),
        rows_of(tiles[0] * block_kv),
    )
    *carry, _ = visit_tiles(tiles, body, init)
    carry = tuple(carry)
    if v_scale is not None:  # the values' scale, once on the unnormalised output
        carry = (carry[0] * v_scale, *carry[1:])
    if split:
        softmax_store(
            carry, unit, o_ref, lse_ref, block_m, rows_here, value_head_dim, log_sum_ref=log_sum_ref
        )
        return
    out_refs = (o_ref, lse_ref, sinks_ref)
    _store_rows(rows, carry, unit, out_refs, start, kv_head, p, rows_here, value_head_dim)
    if launch.kind == "decode":
        packed = q_len * group

        @pl.when(rows.zeroed(seq, packed))
        def _():
            _zero_rows(rows, out_refs, start, kv_head, packed, block_m, hvp, value_head_dim)


def _merge_kernel(
    starts_ref,
    lengths_ref,
    *refs,
    rows: Rows,
    launch: Launch,
    tiles: MergeTiles,
    row_tiles: int,
    col_tiles: int,
    value_head_dim: int,
    has_sinks: bool,
    aliased: bool,
):
    """Finishes a split launch: a tile of `block_r` packed rows and `block_c` columns of one
    (item, KV head), the sum of its splits' partial results weighted by their softmax
    denominators, `chunk` splits per step (their loads are independent: a step waits for one
    memory round trip), stored in place into the flat output (as `triton.decode`'s merge
    kernel, but for the rows of an item). Grid: (items, K, row tile * col_tiles + column
    tile). The decode launch's programs also write 0 into the rows of its items that output 0
    (`Rows`), their row tiles taking chunks of those rows in turn.

    refs: the prefill launch's work list; o_parts_ref [parts + chunk - 1, block_r, block_c]
    f32 (this KV head's, at this tile's rows and columns; the parts, then padding that masked
    loads never read), lse_parts_ref and log_sum_parts_ref [parts + chunk - 1, block_r]
    (`softmax_store`'s, natural log); sinks [N] where has_sinks; the aliased previous output and
    lse where aliased; o_ref [T * N, Hvp] and lse_ref [T * N]."""
    refs = list(refs)
    work_ref = refs.pop(0) if launch.kind == "prefill" else None
    o_parts_ref, lse_parts_ref, log_sum_parts_ref = refs[:3]
    refs = refs[3:]
    sinks_ref = refs.pop(0) if has_sinks else None
    if aliased:
        refs = refs[2:]
    o_ref, lse_ref = refs
    block_r, block_c, chunk = tiles.block_r, tiles.block_c, tiles.chunk
    splits = launch.splits
    item, kv_head = pl.program_id(0), pl.program_id(1)
    row_tile = div(pl.program_id(2), col_tiles)
    col_tile = rem(pl.program_id(2), col_tiles)
    seq, row0, start, q_len, _, rows_here = _item(
        rows, launch, starts_ref, lengths_ref, work_ref, item
    )
    r_rows = rows_here - row_tile * block_r  # rows of this tile that exist
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1) < r_rows
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, 1, block_c), 2)
    col_ok = cols < value_head_dim - col_tile * block_c

    def body(j, carry):
        first = item * splits + j * chunk
        in_run = (j * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)) < splits
        ok = in_run & row_ok  # [chunk, block_r]
        parts_refs = (lse_parts_ref, log_sum_parts_ref, o_parts_ref)
        return merge_parts_step(carry, parts_refs, pl.ds(first, chunk), ok, col_ok)

    # The merged carry is the online softmax's in natural-log units: acc and l relative to m.
    steps = (r_rows > 0).astype(jnp.int32) * cdiv(splits, chunk)
    carry = fold(0, steps, body, softmax_init(block_r, block_c, lse_ref.dtype))
    p = row0 + row_tile * block_r + jax.lax.broadcasted_iota(jnp.int32, (block_r,), 0)
    out_refs = (o_ref, lse_ref, sinks_ref)
    col0 = col_tile * block_c
    _store_rows(rows, carry, 1.0, out_refs, start, kv_head, p, r_rows, value_head_dim, col0)
    if launch.kind == "decode":
        packed = q_len * rows.group
        block_z = min(128, max(block_r, MergeTiles.BUDGET // block_c))

        @pl.when(rows.zeroed(seq, packed))
        def _():
            _zero_rows(
                rows,
                out_refs,
                start,
                kv_head,
                packed,
                block_z,
                block_c,
                value_head_dim,
                first=row_tile,
                stride=row_tiles,
                col0=col0,
            )


def _tile_range(first_pos, last_pos, length, any_rows, window_left: int | None, block_kv: int):
    """The key tiles (lo, full_lo, full_hi, hi) of a row tile whose tokens sit at positions
    first_pos..last_pos of a sequence of `length` keys (none where not any_rows).

    Tiles past the last token's position are never visited; fully visible: the tiles every
    token sees whole (keys <= the first token's position, and inside the last one's window)."""
    hi = cdiv(jnp.clip(last_pos + 1, 0, length), block_kv)
    hi = jnp.where(any_rows, hi, 0)
    full_hi = div(jnp.maximum(first_pos + 1, 0), block_kv)
    lo = full_lo = 0
    if window_left is not None:
        lo = div(jnp.maximum(first_pos - window_left, 0), block_kv)
        full_lo = cdiv(jnp.maximum(last_pos - window_left, 0), block_kv)
    return masks.intersect((lo, full_lo, full_hi, hi), (0, 0, hi, hi))


def ragged_forward(
    q,
    k_pages,
    v_pages,
    block_tables,
    starts,
    lengths,
    sinks=None,
    k_scale=None,
    v_scale=None,
    *,
    scale: float,
    soft_cap,
    window_left: int | None,
    block_sizes: RaggedBlockSizes,
    interpret: bool,
    num_sms: int = DEFAULT_NUM_SMS,
    max_query_len: int | None = None,
    value_head_dim: int | None = None,
    prefill=None,
):
    """out [T, N, Hv] in q's dtype and lse [N, T] float32 (natural log).

    q: [T, N, H]; k_pages [P, page_size, K, H], v_pages [P, page_size, K, Hv] (None: a shared
    latent cache, whose first value_head_dim columns are the values; float8 pages with k_scale
    and v_scale float32 [K], as `decode_forward`'s); block_tables int32 [B, max_pages]; starts
    int32 [B + 1], non-decreasing in [0, T]: sequence b owns rows starts[b]:starts[b + 1];
    lengths int32 [B]: its keys, the new tokens the last of them (clipped to [0, max_pages *
    page_size] here); sinks None or float32 [N]. Rows outside every sequence, and those of a
    sequence of more than max_query_len (None: T) new tokens, output 0 (lse -inf, or the
    sink). num_sms: the target GPU's SMs, for the split counts.

    prefill: None, or the kernel that runs the prefill launch's sequences in place of this
    module's: prefill(q, k_pages, v_pages, block_tables, starts, lengths, sinks, scale=,
    soft_cap=, window_left=, min_tokens=, max_tokens=, num_sms=) -> (out [T, N, Hv], lse [N,
    T]) with the rows of the sequences of min_tokens..max_tokens new tokens (the prefill kind
    of `Rows`) written, the others anything: the decode launch writes those in place.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    fmt = CacheFormat(
        head_dim,
        v_pages.shape[-1] if v_pages is not None else value_head_dim,
        shared=v_pages is None,
        scaled=k_scale is not None,
    )
    value_head_dim = fmt.value_head_dim
    batch, max_pages = block_tables.shape
    rows, launches = ragged_plan(
        num_tokens,
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        max_pages * page_size,
        q.dtype,
        block_sizes,
        num_sms=num_sms,
        max_query_len=max_query_len,
        fmt=fmt,
        cache_dtype=k_pages.dtype,
    )
    starts = jnp.asarray(starts, jnp.int32)
    sinks = None if sinks is None else jnp.asarray(sinks, accumulation_dtype(q.dtype))
    kernel = functools.partial(
        _ragged_kernel,
        scale=scale,
        soft_cap=soft_cap,
        window_left=window_left,
        fmt=fmt,
        rows=rows,
        max_pages=max_pages,
        page_size=page_size,
    )
    # The cache's operands (after the queries) and their blocks: this KV head's rows of the
    # key (and value) pages, the block table, the scales.
    pool_rows = num_pages * page_size

    def kv_spec(cols):
        return pl.BlockSpec((pool_rows, None, cols), lambda z, h: (0, h, 0))

    cache = [(k_pages.reshape(pool_rows, num_kv_heads, head_dim), kv_spec(fmt.key_block))]
    if v_pages is not None:
        v_flat = v_pages.reshape(pool_rows, num_kv_heads, value_head_dim)
        cache.append((v_flat, kv_spec(fmt.value_piece.padded)))
    table = jnp.asarray(block_tables, jnp.int32).reshape(-1)
    cache.append((table, _whole(table.shape[0])))
    if fmt.scaled:
        cache += [(jnp.asarray(x, jnp.float32), _whole(num_kv_heads)) for x in (k_scale, v_scale)]
    common = dict(
        starts=starts,
        lengths=jnp.asarray(lengths, jnp.int32),
        q=pack_queries(q.reshape(num_tokens * num_heads, head_dim), fmt),
        cache=cache,
        num_kv_heads=num_kv_heads,
        value_head_dim=value_head_dim,
        qp=fmt.query_block,
        hvp=fmt.value_piece.padded,
        interpret=interpret,
    )
    out = lse = None
    # Each launch's finisher writes its rows into the output in place (the first one creates
    # it; every row is some launch's).
    for launch in launches:
        if launch.kind == "prefill" and prefill is not None:
            out, lse = prefill(
                q,
                k_pages,
                v_pages,
                block_tables,
                starts,
                lengths,
                sinks,
                scale=scale,
                soft_cap=soft_cap,
                window_left=window_left,
                min_tokens=rows.decode_rows // rows.group + 1,
                max_tokens=rows.prefill_rows // rows.group,
                num_sms=num_sms,
            )
            out = out.reshape(num_tokens * num_heads, value_head_dim)
            lse = lse.T.reshape(num_tokens * num_heads).astype(accumulation_dtype(q.dtype))
            continue
        work = plan_items(starts, launch, rows) if launch.kind == "prefill" else None
        if launch.splits == 1:
            out, lse = _launch_in_place(
                launch, work, out, lse, kernel=kernel, sinks=sinks, **common
            )
        else:
            tiles = _merge_tiles(launch, rows, value_head_dim)
            parts = _launch_split(launch, work, tiles.chunk - 1, kernel=kernel, **common)
            out, lse = _merge(launch, rows, work, parts, tiles, out, lse, sinks=sinks, **common)
    out = out.reshape(num_tokens, num_heads, value_head_dim)
    return out, lse.reshape(num_tokens, num_heads).T


def _whole(*shape):
    """The BlockSpec of a whole array, for any grid of three or fewer axes."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _operands(work, *, starts, lengths, q, cache, qp, **_):
    """(operands, in_specs) of the kernel's inputs up to the work list. cache: the cache's
    (operand, block spec) pairs, as `_ragged_kernel` takes them; qp: the queries' block
    columns."""
    operands = [starts, lengths, q, *(x for x, _ in cache)]
    in_specs = [
        _whole(starts.shape[0]),
        _whole(lengths.shape[0]),
        _whole(q.shape[0], qp),
        *(spec for _, spec in cache),
    ]
    if work is not None:
        operands.append(work)
        in_specs.append(_whole(work.shape[0]))
    return operands, in_specs


def _with_output(operands, in_specs, out, lse, num_rows: int, hvp: int):
    """operands and in_specs with the previous output and lse appended where there is one
    (aliased to the outputs: the kernel writes its rows into them), and the aliases."""
    if out is None:
        return operands, in_specs, {}
    aliases = {len(operands): 0, len(operands) + 1: 1}
    return [*operands, out, lse], [*in_specs, _whole(num_rows, hvp), _whole(num_rows)], aliases


def _out_shapes(q, value_head_dim: int):
    num_rows = q.shape[0]
    return [
        jax.ShapeDtypeStruct((num_rows, value_head_dim), q.dtype),
        jax.ShapeDtypeStruct((num_rows,), accumulation_dtype(q.dtype)),
    ]


def _launch_in_place(
    launch: Launch,
    work,
    out,
    lse,
    *,
    kernel,
    sinks,
    interpret,
    num_kv_heads,
    value_head_dim,
    hvp,
    **arrays,
):
    """(out [T * N, Hv], lse [T * N]) with the launch's rows written; out and lse None (the
    first launch: its rows only are written) or the previous launch's, updated in place."""
    q = arrays["q"]
    num_rows = q.shape[0]
    operands, in_specs = _operands(work, **arrays)
    if sinks is not None:
        operands.append(sinks)
        in_specs.append(_whole(sinks.shape[0]))
    operands, in_specs, aliases = _with_output(operands, in_specs, out, lse, num_rows, hvp)
    return pallas_call(
        functools.partial(
            kernel, launch=launch, has_sinks=sinks is not None, aliased=bool(aliases)
        ),
        grid=(launch.finished_items, num_kv_heads),
        in_specs=in_specs,
        out_specs=[_whole(num_rows, hvp), _whole(num_rows)],
        out_shape=_out_shapes(q, value_head_dim),
        input_output_aliases=aliases,
        compiler_params=CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=launch.name,
    )(*operands)


def _merge_tiles(launch: Launch, rows: Rows, value_head_dim: int) -> MergeTiles:
    """The merge's tiles (`triton.decode.MergeTiles`' rule): up to 32 splits a step, rows of
    the launch's tiles that a sequence can fill, narrower columns before fewer rows within the
    step's budget of f32 elements."""
    most = launch.block_m if launch.kind == "prefill" else min(launch.block_m, rows.decode_rows)
    chunk = min(max(2, 1 << (launch.splits - 1).bit_length()), 32)
    block_r = min(16, max(2, 1 << (max(most, 1) - 1).bit_length()))
    block_c = padded_head_dim(value_head_dim)
    while chunk * block_r * block_c > MergeTiles.BUDGET and block_c > 16:
        block_c //= 2
    while chunk * block_r * block_c > MergeTiles.BUDGET and block_r > 2:
        block_r //= 2
    return MergeTiles(chunk, block_r, block_c)


def _launch_split(
    launch: Launch,
    work,
    pad: int,
    *,
    kernel,
    interpret,
    num_kv_heads,
    value_head_dim,
    hvp,
    **arrays,
):
    """The launch with each tile's keys split over `launch.splits` programs: the partial
    results (out [parts + pad, K, block_m, Hv] float32, lse and log_sum [parts + pad, K,
    block_m]; parts = items * splits, then `pad` of padding that the merge's masked loads may
    reach, never written)."""
    block_m, parts = launch.block_m, launch.items * launch.splits
    padded = parts + pad
    operands, in_specs = _operands(work, **arrays)
    row_spec = pl.BlockSpec((None, None, block_m), lambda z, h: (z, h, 0))
    acc = accumulation_dtype(arrays["q"].dtype)
    row_shape = jax.ShapeDtypeStruct((padded, num_kv_heads, block_m), acc)
    return pallas_call(
        functools.partial(kernel, launch=launch, has_sinks=False, aliased=False),
        grid=(parts, num_kv_heads),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_m, hvp), lambda z, h: (z, h, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((padded, num_kv_heads, block_m, value_head_dim), acc),
            row_shape,
            row_shape,
        ],
        compiler_params=CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=launch.name,
    )(*operands)


def _merge(
    launch: Launch,
    rows: Rows,
    work,
    parts,
    tiles: MergeTiles,
    out,
    lse,
    *,
    sinks,
    interpret,
    value_head_dim,
    hvp,
    **arrays,
):
    """(out [T * N, Hv], lse [T * N]) with the split launch's rows merged from its `parts`
    (`_launch_split`'s) and written in place (`_merge_kernel`), as `_launch_in_place`."""
    q, starts, lengths = arrays["q"], arrays["starts"], arrays["lengths"]
    num_rows = q.shape[0]
    o_parts, lse_parts, log_sum_parts = parts
    padded, num_kv_heads = o_parts.shape[:2]
    most = launch.block_m if launch.kind == "prefill" else min(launch.block_m, rows.decode_rows)
    row_tiles = pl.cdiv(max(most, 1), tiles.block_r)
    col_tiles = pl.cdiv(value_head_dim, tiles.block_c)  # none wholly past the head dim
    rt = lambda rc: div(rc, col_tiles)  # noqa: E731
    ct = lambda rc: rem(rc, col_tiles)  # noqa: E731
    operands = [starts, lengths]
    in_specs = [_whole(starts.shape[0]), _whole(lengths.shape[0])]
    if work is not None:
        operands.append(work)
        in_specs.append(_whole(work.shape[0]))
    operands += [o_parts, lse_parts, log_sum_parts]
    in_specs += [
        pl.BlockSpec(
            (padded, None, tiles.block_r, tiles.block_c), lambda i, h, rc: (0, h, rt(rc), ct(rc))
        ),
        pl.BlockSpec((padded, None, tiles.block_r), lambda i, h, rc: (0, h, rt(rc))),
        pl.BlockSpec((padded, None, tiles.block_r), lambda i, h, rc: (0, h, rt(rc))),
    ]
    if sinks is not None:
        operands.append(sinks)
        in_specs.append(_whole(sinks.shape[0]))
    operands, in_specs, aliases = _with_output(operands, in_specs, out, lse, num_rows, hvp)
    kernel = functools.partial(
        _merge_kernel,
        rows=rows,
        launch=launch,
        tiles=tiles,
        row_tiles=row_tiles,
        col_tiles=col_tiles,
        value_head_dim=value_head_dim,
        has_sinks=sinks is not None,
        aliased=bool(aliases),
    )
    return pallas_call(
        kernel,
        grid=(launch.finished_items, num_kv_heads, row_tiles * col_tiles),
        in_specs=in_specs,
        out_specs=[_whole(num_rows, hvp), _whole(num_rows)],
        out_shape=_out_shapes(q, value_head_dim),
        input_output_aliases=aliases,
        compiler_params=CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=launch.name.replace("_split", "_merge"),
    )(*operands)
