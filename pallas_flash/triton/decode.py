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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import masks
from pallas_flash.device import gpu_core_count
from pallas_flash.triton._common import (
    CompilerParams,
    dot,
    load_rows,
    logit_unit,
    scores,
    softmax_init,
    softmax_step,
    softmax_store,
    split_weights,
    visit_tiles,
)
from pallas_flash.triton.tiles import DecodeBlockSizes, padded_head_dim


def _decode_kernel(
    lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    scale: float,
    soft_cap,
    window_left: int | None,
    head_dim: int,
    q_len: int,
    group: int,
    block_m: int,
    block_kv: int,
    kv_splits: int,
    page_size: int | None,
):
    """One row tile of one (sequence, KV head, split): stream the split's key tiles with an
    online softmax.

    lengths_ref: [B] keys of each sequence (the new tokens included); q_ref, o_ref: [block_m, Hp]
    packed rows r = t * group + g (new token t, query head g of the group); lse_ref: [block_m].
    Contiguous cache: k_ref, v_ref [S, Hp]. Paged (page_size given): k_ref, v_ref
    [num_pages * page_size, Hp], the pages of this KV head end to end, and a table_ref
    [max_pages] before the outputs: key j of the sequence is row table[j // page_size] *
    page_size + j % page_size.
    """
    table_ref = refs[0] if page_size is not None else None
    o_ref, lse_ref = refs[-2:]
    num_rows = q_len * group
    m_start = pl.program_id(0) * block_m
    batch, split = pl.program_id(2) // kv_splits, pl.program_id(2) % kv_splits
    length = lengths_ref[batch]

    m_rows = num_rows - m_start  # rows of this tile that exist
    q = load_rows(q_ref, 0, block_m, m_rows, head_dim, ragged=num_rows % block_m != 0)
    # New token t of a sequence of `length` keys sits at position length - q_len + t (the new
    # tokens are the cache's last keys); rows past the packed rows take the last token's.
    rows = m_start + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    q_pos = length - q_len + jnp.minimum(jax.lax.div(rows, group), q_len - 1)

    def load_kv(ref, kv_start, masked: bool):
        if page_size is None:
            return load_rows(ref, kv_start, block_kv, length, head_dim, ragged=masked)
        return _load_paged(
            ref, table_ref, kv_start, length, head_dim, block_kv, page_size, masked=masked
        )

    unit = logit_unit(scale, False, soft_cap)

    def body(j, carry, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        # Keys past the sequence's length read as zero in the masked tiles: whatever the
        # cache holds there (stale values, NaN) never reaches a product.
        k = load_kv(k_ref, kv_start, masked)
        v = load_kv(v_ref, kv_start, masked)
        # -- compute the logits (in the units of `scores`, see there) --
        u, _ = scores(dot(q, k, trans_b=True), scale, None, soft_cap)
        visible = None
        if masked:
            kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = kv_idx <= q_pos  # causal among the new tokens; also kv_idx < length
            if window_left is not None:
                visible = visible & (kv_idx >= q_pos - window_left)
        return softmax_step(carry, u, v, unit, visible)

    carry = softmax_init(block_m, q_ref.shape[-1])
    carry = visit_tiles(
        _split_range(length, q_len, window_left, block_kv, split, kv_splits), body, carry
    )
    softmax_store(carry, unit, o_ref, lse_ref, block_m, m_rows, head_dim)


def _split_range(length, q_len: int, window_left: int | None, block_kv: int, split, splits: int):
    """The key tiles (lo, full_lo, full_hi, hi) of one split of a sequence of `length` keys.

    Tiles past the length are never visited. Fully visible: the tiles every new token sees
    whole (keys <= the first new token's position, and inside the last one's window). The
    sequence's tiles are cut into `splits` equal runs, so its cost follows its own length.
    """
    hi = pl.cdiv(length, block_kv)
    full_hi = jax.lax.div(jnp.maximum(length - q_len + 1, 0), block_kv)
    lo = full_lo = 0
    if window_left is not None:
        lo = jax.lax.div(jnp.maximum(length - q_len - window_left, 0), block_kv)
        full_lo = pl.cdiv(jnp.maximum(length - 1 - window_left, 0), block_kv)
    tiles = (lo, full_lo, full_hi, hi)
    if splits == 1:
        return masks.intersect(tiles, (lo, lo, hi, hi))
    chunk = pl.cdiv(jnp.maximum(hi - lo, 0), splits)
    start = lo + split * chunk
    end = jnp.minimum(start + chunk, hi)
    return masks.intersect(tiles, (start, start, end, end))


def _load_paged(ref, table_ref, kv_start, length, head_dim, block_kv, page_size, *, masked):
    """Keys [kv_start, kv_start + block_kv) of a paged sequence as a [block_kv, Hp] tile."""
    hp = ref.shape[-1]
    num_pages = ref.shape[0] // page_size
    col_mask = None
    if head_dim != hp:
        col_mask = jax.lax.broadcasted_iota(jnp.int32, (1, hp), 1) < head_dim
    if page_size % block_kv == 0:
        # The tile lies in one page: one table entry, and a contiguous load.
        page = jnp.clip(table_ref[jax.lax.div(kv_start, page_size)], 0, num_pages - 1)
        start = page * page_size + jax.lax.rem(kv_start, page_size)
        return load_rows(ref, start, block_kv, start + length - kv_start, head_dim, ragged=masked)
    # The tile spans several pages: a table entry per key, and a load gathered by rows.
    keys = kv_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    in_seq = keys < length
    pages = plgpu.load(table_ref.at[jax.lax.div(keys, page_size)], mask=in_seq, other=0)
    rows = jnp.clip(pages, 0, num_pages - 1) * page_size + jax.lax.rem(keys, page_size)
    mask = in_seq[:, None] if masked else None
    if col_mask is not None:
        mask = col_mask if mask is None else mask & col_mask
    # Two index arrays and no slice: the form both the Triton lowering and the interpreter
    # take for a gather.
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, hp), 1)
    tile = ref.at[rows[:, None], cols]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=jnp.broadcast_to(mask, (block_kv, hp)), other=0.0)


def choose_decode_splits(requested: int, programs: int, num_kv_tiles: int, block_kv: int) -> int:
    """Programs per sequence's key loop: `requested`, or with 0 (auto) enough for about eight
    programs per core -- a program streams one tile at a time, and several per core keep
    enough loads in flight to saturate memory -- each keeping at least 1024 keys, below which
    the merge costs more than the parallelism gains. On the H200 at 8 KV heads: B=8 with 32k
    keys reads 3.9 TB/s with 16 splits (3.7 with 9); 8k keys 3.3 TB/s with 8 (3.0 with 17);
    1k keys is fastest unsplit."""
    if requested:
        return max(1, min(requested, num_kv_tiles))
    target = 8 * gpu_core_count()
    if programs >= target:
        return 1
    return max(1, min(pl.cdiv(target, programs), num_kv_tiles * block_kv // 1024, 64))


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
):
    """out [B, T, N, H] in q's dtype and lse [B, N, T] float32 (natural log).

    q: [B, T, N, H]; lengths: int32 [B], 0 <= length <= capacity. Contiguous cache (block_tables
    None): k, v [B, S, K, H]. Paged: k, v [num_pages, page_size, K, H] and block_tables int32
    [B, max_pages].
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    hp = padded_head_dim(head_dim)
    num_rows = q_len * group
    block_m = min(block_sizes.block_m, max(16, 1 << (num_rows - 1).bit_length()))
    num_m_tiles = pl.cdiv(num_rows, block_m)
    paged = block_tables is not None
    if paged:
        page_size = k.shape[1]
        capacity = block_tables.shape[1] * page_size
        k = k.reshape(-1, num_kv_heads, head_dim)  # [num_pages * page_size, K, H]: free
        v = v.reshape(-1, num_kv_heads, head_dim)
    else:
        page_size = None
        capacity = k.shape[1]
    block_kv = min(block_sizes.block_kv, max(16, 1 << (capacity - 1).bit_length()))
    num_kv_tiles = pl.cdiv(capacity, block_kv)
    if window_left is not None:
        num_kv_tiles = min(num_kv_tiles, pl.cdiv(window_left + q_len, block_kv) + 1)
    splits = choose_decode_splits(
        block_sizes.kv_splits, num_m_tiles * num_kv_heads * batch, num_kv_tiles, block_kv
    )
    # Packed rows: [B, K, T * G, H], row t * G + g = token t of query head k * G + g.
    q_rows = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_rows, head_dim)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, capacity)

    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        soft_cap=soft_cap,
        window_left=window_left,
        head_dim=head_dim,
        q_len=q_len,
        group=group,
        block_m=block_m,
        block_kv=block_kv,
        kv_splits=splits,
        page_size=page_size,
    )
    lengths_spec = pl.BlockSpec((batch,), lambda m, h, z: (0,))
    q_spec = pl.BlockSpec((None, None, block_m, hp), lambda m, h, z: (z // splits, h, m, 0))
    operands = [lengths, q_rows, k, v]
    if paged:
        kv_spec = pl.BlockSpec((k.shape[0], None, hp), lambda m, h, z: (0, h, 0))
        table_spec = pl.BlockSpec((None, block_tables.shape[1]), lambda m, h, z: (z // splits, 0))
        in_specs = [lengths_spec, q_spec, kv_spec, kv_spec, table_spec]
        operands.append(jnp.asarray(block_tables, jnp.int32))
    else:
        kv_spec = pl.BlockSpec((None, capacity, None, hp), lambda m, h, z: (z // splits, 0, h, 0))
        in_specs = [lengths_spec, q_spec, kv_spec, kv_spec]
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_m_tiles, num_kv_heads, batch * splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_m, hp), lambda m, h, z: (z, h, m, 0)),
            pl.BlockSpec((None, None, block_m), lambda m, h, z: (z, h, m)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(
                (batch * splits, num_kv_heads, num_rows, head_dim),
                q.dtype if splits == 1 else jnp.float32,
            ),
            jax.ShapeDtypeStruct((batch * splits, num_kv_heads, num_rows), jnp.float32),
        ],
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="pallas_flash_decode",
    )(*operands)
    if splits > 1:
        out, lse = _combine_splits(out, lse, splits)
    out = out.astype(q.dtype).reshape(batch, num_kv_heads, q_len, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_heads, head_dim)
    lse = lse.reshape(batch, num_kv_heads, q_len, group).transpose(0, 1, 3, 2)
    return out, lse.reshape(batch, num_heads, q_len)


def _combine_splits(out, lse, splits: int):
    """The result over all splits from per-split results ([B * splits, K, M, H] and
    [B * splits, K, M]): weights exp(lse_s - lse)."""
    weights, l_sum, combined_lse = split_weights(lse, splits)
    out = out.reshape(-1, splits, *out.shape[1:])
    out = jnp.sum(weights[..., None] * out, axis=1) / l_sum[..., None]
    return out, combined_lse
