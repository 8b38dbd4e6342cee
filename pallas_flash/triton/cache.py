"""How the decode and ragged kernels read a KV cache: its column pieces, where the values come
from, and the dequantisation of float8 caches.

Two formats beside the plain one (keys and values in caches of their own, in the queries'
dtype):

- A shared latent cache (DeepSeek's multi-head latent attention, FlashMLA's `head_dim_v`): one
  cache of H columns whose first Hv columns are also the values. A key tile is read once, as
  two column pieces of power-of-two widths (Triton's tiles are powers of two; H = 576 is 512 +
  64, not 1024): the first piece is the value tile too, and the logits are the sum of two
  products, one per piece. The queries come packed to the pieces' padded widths.
- Float8 caches with a float32 scale per KV head: tiles are loaded in float8 (half the bytes of
  bfloat16), converted to the products' dtype in registers (exactly: every e4m3 value is a
  bfloat16, float16 and float32 value), and the scales are applied outside the products: the
  key scale folds into the logits' scale, the value scale into the output. The products'
  dtype is the queries', except that bfloat16 queries take float16 products
  (`product_queries`): e4m3 becomes float16 two elements an instruction, bfloat16 only
  through float16 and one conversion an element.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash._pallas_triton import div, rem
from pallas_flash.triton.tiles import padded_head_dim


@dataclasses.dataclass(frozen=True)
class Piece:
    """Columns [col, col + width) of a cache row (or of a packed query row), loaded as a tile of
    `padded` columns (a power of two >= 16; columns past width read as zero)."""

    col: int
    width: int
    padded: int


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """The static layout of a call's cache, as the kernels read it.

    head_dim: H, the keys' (and queries') columns; value_head_dim: Hv, the values'. shared: the
    values are the keys' first Hv columns (one latent cache, no value operand). scaled: float32
    k_scale and v_scale operands [K] follow the cache operands (a float8 cache; the stored
    values times the scale are the keys and values)."""

    head_dim: int
    value_head_dim: int
    shared: bool = False
    scaled: bool = False

    @property
    def key_pieces(self) -> tuple[Piece, ...]:
        """The column pieces a key tile is read in: one, or with a shared cache whose keys are
        wider than its values, the values' columns and the rest."""
        h, hv = self.head_dim, self.value_head_dim
        if self.shared and hv < h:
            return (Piece(0, hv, padded_head_dim(hv)), Piece(hv, h - hv, padded_head_dim(h - hv)))
        return (Piece(0, h, padded_head_dim(h)),)

    @property
    def value_piece(self) -> Piece:
        return Piece(0, self.value_head_dim, padded_head_dim(self.value_head_dim))

    @property
    def key_block(self) -> int:
        """Columns of the key operand's block: its padded width, reaching past the last piece's
        padding (the interpreter pads the array to it; loads past H are masked)."""
        return max(p.col + p.padded for p in self.key_pieces)

    @property
    def query_pieces(self) -> tuple[Piece, ...]:
        """The pieces of a query row as `pack_queries` lays it out: one per key piece, each at
        its padded width (the packing pads them with zeros), or the plain row."""
        pieces = self.key_pieces
        if len(pieces) == 1:
            return pieces
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(offsets[-1] + p.padded)
        return tuple(Piece(o, p.padded, p.padded) for o, p in zip(offsets, pieces, strict=True))

    @property
    def query_block(self) -> int:
        return max(p.col + p.padded for p in self.query_pieces)

    @property
    def read_columns(self) -> int:
        """Padded columns of one key row (and value row) a key tile occupies on chip: for the
        tile estimates."""
        cols = sum(p.padded for p in self.key_pieces)
        return cols if self.shared else cols + self.value_piece.padded


def pack_queries(q, fmt: CacheFormat):
    """q [..., H] laid out as `fmt.query_pieces` (in XLA, before the kernel): unchanged for one
    piece, or where the pieces need no padding; else each piece zero-padded to its tile."""
    pieces = fmt.key_pieces
    if len(pieces) == 1 or all(p.width == p.padded for p in pieces):
        return q
    pad = [(0, 0)] * (q.ndim - 1)
    return jnp.concatenate(
        [jnp.pad(q[..., p.col : p.col + p.width], [*pad, (0, p.padded - p.width)]) for p in pieces],
        axis=-1,
    )


def piece_columns(piece: Piece, block: int):
    """(the column indexer of `piece` in a ref of `block` columns, its [1, padded] column mask
    or None)."""
    whole = piece.col == 0 and piece.padded == block
    cols = slice(None) if whole else pl.ds(piece.col, piece.padded)
    mask = None
    if piece.width != piece.padded:
        mask = jax.lax.broadcasted_iota(jnp.int32, (1, piece.padded), 1) < piece.width
    return cols, mask


def load_piece_rows(ref, start, block: int, length, piece: Piece, *, ragged: bool, lead=()):
    """Rows [start, start + block) of `piece`'s columns of a [rows, C] ref: a [block, padded]
    tile; rows past `length` (with ragged) and columns past the piece read as zero."""
    cols, mask = piece_columns(piece, ref.shape[-1])
    if ragged:
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        row_mask = rows < length
        mask = row_mask if mask is None else row_mask & mask
    tile = ref.at[(*lead, pl.ds(start, block), cols)]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=mask, other=0.0)


def load_piece_gathered(ref, rows, row_mask, piece: Piece):
    """`piece`'s columns of the rows `rows` [R] of a [rows, C] ref, as an [R, padded] tile;
    rows where row_mask ([R] or None) is False and columns past the piece read as zero."""
    cols = piece.col + jax.lax.broadcasted_iota(jnp.int32, (1, piece.padded), 1)
    mask = None if row_mask is None else row_mask[:, None]
    if piece.width != piece.padded:
        col_mask = jax.lax.broadcasted_iota(jnp.int32, (1, piece.padded), 1) < piece.width
        mask = col_mask if mask is None else mask & col_mask
    tile = ref.at[rows[:, None], cols]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=jnp.broadcast_to(mask, (rows.shape[0], piece.padded)), other=0.0)


def product_queries(qs, cache_dtype):
    """(query pieces, unscale): the query pieces in the dtype of the products with a key tile
    of `cache_dtype`, and the [rows, 1] float32 factor that returns their q.k to the queries'
    units (None where the pieces are unchanged).

    bfloat16 queries over a float8 cache take float16 products. On sm90 e4m3 converts to
    float16 two elements an instruction (cvt.rn.f16x2.e4m3x2), but to bfloat16 only through
    float16 and one conversion an element (cvt.bf16.f16, F2F: 16 a clock an SM), which bounded
    the float8 decode loop (128 of them a thread per 64 x 128 tile pair; ptxas' reading,
    docs/notes/decode.md, "MLA, float8 caches and speculative tokens"). Each query row is
    scaled by a power of two that puts its largest magnitude in [2^14, 2^15): a bfloat16
    value is then a float16 value (float16 has more significand bits) unless it lies below
    2^-28 of its row's largest, where float16 is subnormal (such elements add under 2^-28 of
    the row's largest term to a logit), and no product overflows. The values' products then
    take p in float16 too (p in [0, 1]: finer than bfloat16 above 2^-14, zero below 2^-24)."""
    dtype = jnp.dtype(qs[0].dtype)
    cache_dtype = jnp.dtype(cache_dtype)
    if dtype != jnp.bfloat16 or cache_dtype.itemsize != 1:
        return qs, None
    amax = functools.reduce(
        jnp.maximum, [jnp.max(jnp.abs(q.astype(jnp.float32)), axis=1, keepdims=True) for q in qs]
    )
    # amax >= 0: its bits shifted by 23 are its biased exponent e (0 for 0 and subnormals, 255
    # for inf and NaN), amax in [2^(e - 127), 2^(e - 126)); the shift 2^s, s = 141 - e, is
    # clipped to normal float32 scales, whose reciprocals are exact.
    e = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(amax, jnp.int32), 23)
    s = jnp.clip(141 - e, -125, 125)
    scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(127 + s, 23), jnp.float32)
    unscale = jax.lax.bitcast_convert_type(jax.lax.shift_left(127 - s, 23), jnp.float32)
    return [(q.astype(jnp.float32) * scale).astype(jnp.float16) for q in qs], unscale


def read_tiles(fmt: CacheFormat, load, k_ref, v_ref, dtype):
    """(key pieces, value tile) of one key tile in `dtype` (the products'): `load(ref, piece)`
    reads a piece of the tile's rows; a shared cache's value tile is its first key piece (one
    read for both), a float8 one's tiles are converted in registers."""
    keys = [load(k_ref, piece) for piece in fmt.key_pieces]
    value = keys[0] if fmt.shared else load(v_ref, fmt.value_piece)
    keys = [k.astype(dtype) for k in keys]
    return keys, keys[0] if fmt.shared else value.astype(dtype)


def scales_of(fmt: CacheFormat, k_scale_ref, v_scale_ref, kv_head, dtype):
    """(k_scale, v_scale) scalars of this KV head in `dtype` (the softmax's: float64 for
    float64 queries, so that the key scale folds into the logits' scale unrounded), or (None,
    None) unscaled."""
    if not fmt.scaled:
        return None, None
    return k_scale_ref[kv_head].astype(dtype), v_scale_ref[kv_head].astype(dtype)


def logit_scale_and_unit(scale: float, soft_cap, k_scale):
    """(the logits' scale with the key scale folded in, the natural-log logit of one unit of
    what `_common.scores` returns with it): static floats when unscaled."""
    if k_scale is None:
        return scale, float(soft_cap) if soft_cap is not None else float(scale)
    logit_scale = k_scale * scale
    return logit_scale, float(soft_cap) if soft_cap is not None else logit_scale


def paged_rows(
    table_ref, table_start, length, block_kv, page_size, num_rows, kv_start, *, visited=False
):
    """Where keys [kv_start, kv_start + block_kv) of a paged sequence of `length` keys lie in
    its KV head's pages end to end ([num_rows, H]; the sequence's table entries start at
    table_ref[table_start]): the first row (a scalar) where a key tile lies in one page, else
    each key's row [block_kv]. Only the entries of pages below the length are read (0 else);
    with `visited` (a tile the step reads, below the length) a one-page tile's entry is read
    unmasked."""
    num_pages = num_rows // page_size
    if page_size % block_kv == 0:
        index = table_start + div(kv_start, page_size)
        if visited:
            entry = table_ref[index]
        else:
            entry = plgpu.load(table_ref.at[index], mask=kv_start < length, other=0)
        return jnp.clip(entry, 0, num_pages - 1) * page_size + rem(kv_start, page_size)
    keys = kv_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    entries = table_start + div(keys, page_size)
    pages = plgpu.load(table_ref.at[entries], mask=keys < length, other=0)
    return jnp.clip(pages, 0, num_pages - 1) * page_size + rem(keys, page_size)


def load_paged_rows(ref, kv_rows, kv_start, length, piece: Piece, block_kv, *, masked):
    """The [block_kv, piece.padded] tile of `piece`'s columns of keys [kv_start, kv_start +
    block_kv) at `paged_rows`' kv_rows: one contiguous load (a scalar first row) or a load
    gathered by rows (`load_piece_gathered`: two index arrays and no slice, the form both the
    Triton lowering and the interpreter take for a gather); with `masked`, keys past the
    length read as zero."""
    if kv_rows.ndim == 0:
        return load_piece_rows(
            ref, kv_rows, block_kv, kv_rows + length - kv_start, piece, ragged=masked
        )
    in_seq = None
    if masked:
        in_seq = kv_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0) < length
    return load_piece_gathered(ref, kv_rows, in_seq, piece)
