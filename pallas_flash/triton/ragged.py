"""Ragged paged attention: the new tokens of many sequences (decode steps and prefill chunks
side by side, concatenated) over one paged KV cache.

FlashAttention-2's forward loop (Dao 2023, Algorithm 1) over work items: XLA cuts each
sequence's packed rows (its new tokens times the query heads of one KV head, as the decode
kernel packs them) into row tiles before the kernels, and each program runs one tile of one KV
head over the key tiles its rows see, causally, streaming the sequence's pages
(`triton.decode`'s paged loads). Sequences come in two kinds, each in its own launch with its
own tiles (`RaggedBlockSizes`): those of at most `block_m` packed rows (a decode step: the
group of one token) take one small tile each and may split their keys over several programs
(Flash-Decoding), whose partial results merge by their softmax denominators; longer ones
(prefill chunks) are cut into large tiles, which skip the key tiles above the causal diagonal.
The work lists have a size fixed by the shapes (a bound on the tiles any batch of these
shapes can have); items past a batch's tiles store nothing. The output rows are written in
place: no transpose of the queries or the output.
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
from pallas_flash._pallas_triton import CompilerParams, cdiv, div, rem
from pallas_flash._vma import pallas_call
from pallas_flash.device import DEFAULT_NUM_SMS
from pallas_flash.reference import with_sinks
from pallas_flash.triton._common import (
    dot,
    logit_unit,
    merge_splits,
    scores,
    softmax_init,
    softmax_step,
    softmax_store,
    visit_tiles,
)
from pallas_flash.triton.decode import _load_paged, decode_block_sizes, splits_for_slots
from pallas_flash.triton.tiles import (
    DecodeBlockSizes,
    RaggedBlockSizes,
    decode_ctas_per_sm,
    default_ragged_block_sizes,
    padded_head_dim,
)

# The first packed row of an item past the batch's tiles: beyond every sequence's rows, so that
# the item's rows are all masked.
_NO_ROWS = 1 << 30


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of the kernel: the sequences of more than `min_rows` packed rows (and, with
    `max_rows`, at most that many: one tile each) in `block_m`-row tiles; `items` bounds their
    tiles in any batch of the call's shapes; `splits` programs share each tile's keys."""

    block_m: int
    block_kv: int
    num_warps: int
    num_stages: int
    splits: int
    items: int
    min_rows: int
    max_rows: int | None

    @property
    def name(self) -> str:
        """The kernel's name: pallas_flash_ragged_{decode,prefill}[_split]."""
        kind = "prefill" if self.max_rows is None else "decode"
        return f"pallas_flash_ragged_{kind}" + ("_split" if self.splits > 1 else "")


def ragged_block_sizes(
    q_shape,
    num_seqs: int,
    num_kv_heads: int,
    capacity: int,
    dtype,
    *,
    interpret: bool,
    page_size: int,
    window_left: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> RaggedBlockSizes:
    """The default tiles of a call with queries of `q_shape` [T, N, H] in `num_seqs` sequences
    over caches of up to `capacity` keys: `default_ragged_block_sizes`, with the decode
    launch's key tile and pipeline those of `paged_attention` on its sequences, one new token
    each (`decode_block_sizes`: deeper pipelines of 32-key tiles where the split programs
    fill at most half the GPU)."""
    num_tokens, num_heads, head_dim = q_shape
    group = num_heads // num_kv_heads
    base = default_ragged_block_sizes(
        head_dim, dtype, group=group, interpret=interpret, page_size=page_size
    )
    if interpret:
        return base
    decode = decode_block_sizes(
        (min(num_seqs, num_tokens), 1, num_heads, head_dim),
        num_kv_heads,
        capacity,
        dtype,
        interpret=False,
        page_size=page_size,
        window_left=window_left,
        num_sms=num_sms,
    )
    return dataclasses.replace(
        base, block_kv=decode.block_kv, num_warps=decode.num_warps, num_stages=decode.num_stages
    )


def ragged_plan(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
    dtype,
    block_sizes: RaggedBlockSizes,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
) -> tuple[Launch, ...]:
    """The launches of a call with `num_tokens` query rows over `num_seqs` sequences (the
    batch's, plus the rows before the first and after the last: sequences with no key) of up
    to `capacity` keys: the decode launch where some sequence may fit its tile, the prefill
    launch where some may not. The item counts are bounds: a decode sequence has a token, so
    there are at most min(num_seqs, num_tokens); a prefill sequence more than block_m rows,
    and its tiles at most (its rows + block_m_prefill - 1) / block_m_prefill."""
    group = num_heads // num_kv_heads
    total_rows = num_tokens * group
    hp = padded_head_dim(head_dim)
    itemsize = jnp.dtype(dtype).itemsize

    def launch(block_m, block_kv, num_warps, num_stages, kv_splits, items, min_rows, max_rows):
        # The key tile clipped to the capacity; the requested split count, or the decode
        # kernel's "slots" rule for the launch's programs.
        block_kv = min(block_kv, max(16, 1 << (capacity - 1).bit_length()))
        num_kv_tiles = pl.cdiv(capacity, block_kv)
        if kv_splits:
            splits = max(1, min(kv_splits, num_kv_tiles))
        else:
            tiles = DecodeBlockSizes(
                block_m=block_m, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
            )
            slots = num_sms * decode_ctas_per_sm(tiles, block_m, hp, itemsize)
            programs = items * num_kv_heads
            splits = splits_for_slots(
                programs, num_kv_tiles, block_kv, slots=slots, block_m=block_m
            )
        return Launch(block_m, block_kv, num_warps, num_stages, splits, items, min_rows, max_rows)

    bs = block_sizes
    launches = []
    decode_rows = bs.block_m if group <= bs.block_m else 0
    if decode_rows:
        items = min(num_seqs, num_tokens)
        launches.append(
            launch(
                bs.block_m,
                bs.block_kv,
                bs.num_warps,
                bs.num_stages,
                bs.kv_splits,
                items,
                0,
                bs.block_m,
            )
        )
    if total_rows > decode_rows:
        block_m = min(bs.block_m_prefill, max(16, 1 << (total_rows - 1).bit_length()))
        longer = min(num_seqs, total_rows // (decode_rows + 1))
        items = (total_rows + longer * (block_m - 1)) // block_m
        launches.append(
            launch(
                block_m,
                bs.block_kv_prefill,
                bs.num_warps_prefill,
                bs.num_stages_prefill,
                bs.kv_splits_prefill,
                items,
                decode_rows,
                None,
            )
        )
    return tuple(launches)


def plan_items(starts, lengths, launch: Launch, group: int):
    """The launch's work list (in XLA, before the kernel), int32 [2 * (E + 1) + 2 * items]:
    the sequences' first rows `starts` [E + 1] and key counts `lengths` [E] (E sequences, in
    row order), a 0, then per item its sequence and the first of its packed rows in that
    sequence (`_NO_ROWS` for items past the batch's tiles, which then come last). Prefill
    items come in reverse order, so that each sequence's last tiles, which see the most keys,
    start first and the last wave is short."""
    rows = (starts[1:] - starts[:-1]) * group
    fits = rows > launch.min_rows
    if launch.max_rows is None:
        tiles = jnp.where(fits, pl.cdiv(rows, launch.block_m), 0)
    else:
        tiles = jnp.where(fits & (rows <= launch.max_rows), 1, 0)
    end = jnp.cumsum(tiles)
    count = end[-1]
    item = jnp.arange(launch.items, dtype=jnp.int32)
    if launch.max_rows is None:
        item = jnp.where(item < count, count - 1 - item, item)
    # The sequences whose tiles all lie before the item.
    seq = jnp.sum(end[None, :] <= item[:, None], axis=1).astype(jnp.int32)
    used = item < count
    seq = jnp.where(used, seq, 0)
    row0 = jnp.where(used, (item - (end - tiles)[seq]) * launch.block_m, _NO_ROWS)
    pad = jnp.zeros((1,), jnp.int32)
    return jnp.concatenate([starts, lengths, pad, seq, row0]).astype(jnp.int32)


def _ragged_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    table_ref,
    *refs,
    scale: float,
    soft_cap,
    window_left: int | None,
    head_dim: int,
    value_head_dim: int,
    num_heads: int,
    group: int,
    num_seqs: int,
    max_pages: int,
    page_size: int,
    launch: Launch,
    has_sinks: bool,
    aliased: bool,
):
    """One row tile of one (work item, KV head, split): stream the key tiles its rows see of
    its sequence's pages with an online softmax.

    plan_ref: `plan_items`'s table. q_ref: [T * N, Hp], row t * N + n = token t, query head n;
    k_ref, v_ref: [num_pages * page_size, Hp] (Hvp for v), this KV head's pages end to end;
    table_ref: [B * max_pages], the block table, flat (sequence s of the plan is the batch's
    s - 1: the plan's first sequence holds the rows before the batch's). Then sinks [N]
    float32 where has_sinks, the aliased previous output and lse where aliased (never read),
    and the outputs: unsplit, o_ref [T * N, Hvp] and lse_ref [T * N] (natural log), each
    program storing its tile's rows in place; split, the tile's partial result o_ref [block_m,
    Hvp], lse_ref and log_sum_ref [block_m] (`softmax_store`'s), merged by the wrapper.
    """
    refs = list(refs)
    sinks_ref = refs.pop(0) if has_sinks else None
    if aliased:
        refs = refs[2:]
    split = launch.splits > 1
    log_sum_ref = refs.pop() if split else None
    o_ref, lse_ref = refs
    block_m, block_kv = launch.block_m, launch.block_kv
    item = div(pl.program_id(0), launch.splits)
    kv_head = pl.program_id(1)
    items_at = 2 * (num_seqs + 1)
    seq = plan_ref[items_at + item]
    row0 = plan_ref[items_at + launch.items + item]
    start = plan_ref[seq]
    q_len = plan_ref[seq + 1] - start
    length = plan_ref[num_seqs + 1 + seq]
    rows_here = q_len * group - row0  # rows of this tile that exist (<= 0: none)

    # Row r of the tile is packed row p = row0 + r of the sequence: its new token p // group,
    # query head kv_head * group + p % group, row `flat` of q and the output. Rows past the
    # tile's take the sequence's first row (their loads and stores are masked).
    r = jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    in_tile = r < rows_here
    p = jnp.where(in_tile, row0 + r, 0)
    token = div(p, group)
    head = kv_head * group + rem(p, group)
    num_rows = q_ref.shape[0]
    flat = jnp.clip((start + token) * num_heads + head, 0, num_rows - 1)
    hp, hvp = q_ref.shape[-1], o_ref.shape[-1]
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, hp), 1)
    q = plgpu.load(
        q_ref.at[flat[:, None], cols], mask=in_tile[:, None] & (cols < head_dim), other=0.0
    )
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
    table_start = jnp.clip(seq - 1, 0, table_ref.shape[0] // max_pages - 1) * max_pages

    def load_kv(ref, dim, kv_start, masked: bool):
        return _load_paged(
            ref,
            table_ref,
            table_start,
            kv_start,
            length,
            dim,
            block_kv,
            page_size,
            masked=masked,
        )

    unit = logit_unit(scale, False, soft_cap)

    def body(j, carry, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        # Keys past the length read as zero in the masked tiles: whatever the pages hold there
        # (stale values, NaN) never reaches a product.
        k = load_kv(k_ref, head_dim, kv_start, masked)
        v = load_kv(v_ref, value_head_dim, kv_start, masked)
        u, _ = scores(dot(q, k, trans_b=True), scale, None, soft_cap)
        visible = None
        if masked:
            kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = kv_idx <= q_pos  # causal; also kv_idx < length
            if window_left is not None:
                visible = visible & (kv_idx >= q_pos - window_left)
        return softmax_step(carry, u, v, unit, visible)

    carry = visit_tiles(tiles, body, softmax_init(block_m, hvp, accumulation_dtype(q_ref.dtype)))
    if split:
        softmax_store(
            carry, unit, o_ref, lse_ref, block_m, rows_here, value_head_dim, log_sum_ref=log_sum_ref
        )
        return
    sink = None if sinks_ref is None else plgpu.load(sinks_ref.at[head])
    out_cols = jax.lax.broadcasted_iota(jnp.int32, (1, hvp), 1)
    # Masked rows' stores point past the output: the interpreter's masked scatter writes
    # every lane (a masked one its old value), and a lane aimed at a stored row would race it.
    rows = jnp.where(in_tile, flat, num_rows)
    softmax_store(
        carry,
        unit,
        o_ref.at[rows[:, None], out_cols],
        lse_ref.at[rows],
        block_m,
        rows_here,
        value_head_dim,
        sink=sink,
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
    *,
    scale: float,
    soft_cap,
    window_left: int | None,
    block_sizes: RaggedBlockSizes,
    interpret: bool,
    num_sms: int = DEFAULT_NUM_SMS,
):
    """out [T, N, Hv] in q's dtype and lse [N, T] float32 (natural log).

    q: [T, N, H]; k_pages [P, page_size, K, H], v_pages [P, page_size, K, Hv]; block_tables
    int32 [B, max_pages]; starts int32 [B + 1], non-decreasing in [0, T]: sequence b owns rows
    starts[b]:starts[b + 1]; lengths int32 [B] in [0, max_pages * page_size]: its keys, the
    new tokens the last of them (the API makes them so); sinks None or float32 [N]. Rows
    outside every sequence output 0 (lse -inf, or the sink). num_sms: the target GPU's SMs,
    for the split counts.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    value_head_dim = v_pages.shape[-1]
    group = num_heads // num_kv_heads
    batch, max_pages = block_tables.shape
    hp, hvp = padded_head_dim(head_dim), padded_head_dim(value_head_dim)
    # The batch's sequences, with the rows before the first and after the last as sequences
    # of no key (their rows output 0).
    starts = jnp.asarray(starts, jnp.int32)
    ends = jnp.concatenate([jnp.zeros((1,), jnp.int32), starts, jnp.full((1,), num_tokens)])
    keys = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(lengths, jnp.int32)])
    keys = jnp.concatenate([keys, jnp.zeros((1,), jnp.int32)])
    num_seqs = batch + 2
    launches = ragged_plan(
        num_tokens,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        max_pages * page_size,
        q.dtype,
        block_sizes,
        num_sms=num_sms,
    )
    q_flat = q.reshape(num_tokens * num_heads, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, num_kv_heads, value_head_dim)
    table = jnp.asarray(block_tables, jnp.int32).reshape(-1)
    sinks = None if sinks is None else jnp.asarray(sinks, accumulation_dtype(q.dtype))
    common = dict(
        q=q_flat,
        k=k_flat,
        v=v_flat,
        table=table,
        sinks=sinks,
        kernel=functools.partial(
            _ragged_kernel,
            scale=scale,
            soft_cap=soft_cap,
            window_left=window_left,
            head_dim=head_dim,
            value_head_dim=value_head_dim,
            num_heads=num_heads,
            group=group,
            num_seqs=num_seqs,
            max_pages=max_pages,
            page_size=page_size,
        ),
        hp=hp,
        hvp=hvp,
        interpret=interpret,
    )
    out = lse = None
    # Unsplit launches first: each writes its rows into the output in place (the first one
    # creates it); a split launch's merged rows are scattered into it after.
    for launch in sorted(launches, key=lambda launch: launch.splits > 1):
        plan = plan_items(ends, keys, launch, group)
        if launch.splits == 1:
            out, lse = _launch_in_place(launch, plan, out, lse, **common)
            continue
        merged, merged_lse, log_sum = _launch_split(launch, plan, **common)
        rows, head = _merged_rows(plan, launch, num_seqs, num_tokens, num_heads, num_kv_heads)
        if sinks is not None:  # one sink per merged row: [items * K * block_m, 1, 1]
            merged, merged_lse = with_sinks(
                merged.reshape(-1, 1, 1, value_head_dim),
                merged_lse.reshape(-1, 1, 1),
                sinks[head.reshape(-1, 1)],
                log_sum.reshape(-1, 1, 1),
            )
        if out is None:
            out = jnp.zeros((num_tokens * num_heads, value_head_dim), q.dtype)
            lse = jnp.full((num_tokens * num_heads,), -jnp.inf, accumulation_dtype(q.dtype))
        rows = rows.reshape(-1)
        out = out.at[rows].set(merged.reshape(-1, value_head_dim).astype(q.dtype), mode="drop")
        lse = lse.at[rows].set(merged_lse.reshape(-1), mode="drop")
    out = out.reshape(num_tokens, num_heads, value_head_dim)
    return out, lse.reshape(num_tokens, num_heads).T


def _merged_rows(
    plan, launch: Launch, num_seqs: int, num_tokens: int, num_heads: int, num_kv_heads
):
    """Where a split launch's merged rows [items, K, block_m] go: (their rows of the flat
    output [T * N], T * N (dropped) for rows of no token; their query heads)."""
    group = num_heads // num_kv_heads
    items_at = 2 * (num_seqs + 1)
    seq = plan[items_at : items_at + launch.items][:, None, None]
    row0 = plan[items_at + launch.items :][:, None, None]
    start, q_len = plan[seq], plan[seq + 1] - plan[seq]
    kv_head = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    p = row0 + jnp.arange(launch.block_m, dtype=jnp.int32)[None, None, :]
    head = kv_head * group + p % group
    flat = (start + p // group) * num_heads + head
    return jnp.where(p < q_len * group, flat, num_tokens * num_heads), head


def _launch_in_place(
    launch: Launch, plan, out, lse, *, q, k, v, table, sinks, kernel, hp, hvp, interpret
):
    """(out [T * N, Hv], lse [T * N]) with the launch's rows written; out and lse None (the
    first launch: its rows only are written) or the previous launch's, updated in place."""
    num_rows, value_head_dim = q.shape[0], v.shape[-1]
    whole = lambda *shape: pl.BlockSpec(shape, lambda z, h: (0,) * len(shape))  # noqa: E731
    operands = [plan, q, k, v, table]
    in_specs = [
        whole(plan.shape[0]),
        whole(num_rows, hp),
        pl.BlockSpec((k.shape[0], None, hp), lambda z, h: (0, h, 0)),
        pl.BlockSpec((v.shape[0], None, hvp), lambda z, h: (0, h, 0)),
        whole(table.shape[0]),
    ]
    if sinks is not None:
        operands.append(sinks)
        in_specs.append(whole(sinks.shape[0]))
    aliases = {}
    if out is not None:
        aliases = {len(operands): 0, len(operands) + 1: 1}
        operands += [out, lse]
        in_specs += [whole(num_rows, hvp), whole(num_rows)]
    return pallas_call(
        functools.partial(
            kernel, launch=launch, has_sinks=sinks is not None, aliased=bool(aliases)
        ),
        grid=(launch.items, k.shape[1]),
        in_specs=in_specs,
        out_specs=[whole(num_rows, hvp), whole(num_rows)],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, value_head_dim), q.dtype),
            jax.ShapeDtypeStruct((num_rows,), accumulation_dtype(q.dtype)),
        ],
        input_output_aliases=aliases,
        compiler_params=CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=launch.name,
    )(*operands)


def _launch_split(launch: Launch, plan, *, q, k, v, table, sinks, kernel, hp, hvp, interpret):
    """The launch with each tile's keys split over `launch.splits` programs, merged in XLA by
    their softmax denominators (`merge_splits`): (out [items, K, block_m, Hv] float32, lse and
    log_sum [items, K, block_m]), rows past an item's unwritten."""
    num_rows, value_head_dim = q.shape[0], v.shape[-1]
    num_kv_heads = k.shape[1]
    block_m, items, splits = launch.block_m, launch.items, launch.splits
    whole = lambda *shape: pl.BlockSpec(shape, lambda z, h: (0,) * len(shape))  # noqa: E731
    parts = items * splits
    row_spec = pl.BlockSpec((None, None, block_m), lambda z, h: (z, h, 0))
    row_shape = jax.ShapeDtypeStruct((parts, num_kv_heads, block_m), accumulation_dtype(q.dtype))
    out, lse, log_sum = pallas_call(
        functools.partial(kernel, launch=launch, has_sinks=False, aliased=False),
        grid=(parts, num_kv_heads),
        in_specs=[
            whole(plan.shape[0]),
            whole(num_rows, hp),
            pl.BlockSpec((k.shape[0], None, hp), lambda z, h: (0, h, 0)),
            pl.BlockSpec((v.shape[0], None, hvp), lambda z, h: (0, h, 0)),
            whole(table.shape[0]),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_m, hvp), lambda z, h: (z, h, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct(
                (parts, num_kv_heads, block_m, value_head_dim), accumulation_dtype(q.dtype)
            ),
            row_shape,
            row_shape,
        ],
        compiler_params=CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=interpret,
        name=launch.name,
    )(plan, q, k, v, table)
    weights, lse, log_sum, _ = merge_splits(lse, log_sum, splits)
    out = out.reshape(items, splits, *out.shape[1:])
    out = jnp.sum(weights[..., None] * out, axis=1)  # [items, K, block_m, Hv]
    return out, lse, log_sum
