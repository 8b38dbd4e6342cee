"""Shared by the Triton kernels: tile loops and stores, softmax steps, mask and dropout operands
(their row and vector loads, `fold` and compiler params are `pallas_flash._pallas_triton`'s)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import _dropout
from pallas_flash._numerics import (
    LN2,
    LOG2E,
    MIN_LOGIT,
    accumulation_dtype,
    merge_weights,
    sink_against_keys,
)
from pallas_flash._pallas_triton import fold, load_vector


def dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T) on the matrix units with f32 accumulation; f32 inputs stay f32 (IEEE),
    f64 inputs (the interpreter's) f64."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)


def store_rows(ref, value, start, block: int, length: int, head_dim: int):
    """Stores a [block, Hp] tile at rows [start, start + block) of a [length, Hp] ref, masked
    to the first head_dim columns (a traced head_dim: a column tile's share of them)."""
    hp = ref.shape[-1]
    rows = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    mask = rows < length
    if not isinstance(head_dim, int) or head_dim != hp:
        mask = mask & (lax.broadcasted_iota(jnp.int32, (1, hp), 1) < head_dim)
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def visit_tiles(ranges, body, carry):
    """Runs body(j, carry, masked=...) over the tiles of a range (lo, full_lo, full_hi, hi):
    element-wise masking on the boundary tiles only, the fully visible ones in between."""
    lo, full_lo, full_hi, hi = ranges
    carry = fold(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = fold(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return fold(full_hi, hi, functools.partial(body, masked=True), carry)


def load_pair_tile(
    ref,
    q_start,
    block_q: int,
    q_len,
    kv_start,
    block_kv: int,
    kv_len,
    *,
    head=None,
    other=0,
    lead=(),
):
    """The [block_q, block_kv] tile of a per-(query, key) ref ([Tb, Sb], or [heads, Tb, Sb] read at
    `head`) for queries [q_start, +block_q) and keys [kv_start, +block_kv). A dim of size 1
    broadcasts: it is read once ([1, block_kv] etc.). Entries past q_len/kv_len read `other`.
    `lead` as in `_pallas_triton.load_rows`."""
    rows_dim, cols_dim = ref.shape[-2], ref.shape[-1]
    idx, mask = [], None
    if rows_dim == 1:
        idx.append(pl.ds(0, 1))
    else:
        idx.append(pl.ds(q_start, block_q))
        mask = (q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)) < q_len
    if cols_dim == 1:
        idx.append(pl.ds(0, 1))
    else:
        idx.append(pl.ds(kv_start, block_kv))
        cols = (kv_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)) < kv_len
        mask = cols if mask is None else mask & cols
    if head is not None:
        idx.insert(0, head)
    tile = ref.at[(*lead, *idx)]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=mask, other=other)


def load_range(ranges_ref, batch, head, tile):
    """(lo, full_lo, full_hi, hi) of one tile from a [Br, Nr, tiles, 4] int32 ref (Br, Nr of size
    1 broadcast)."""
    b = batch if ranges_ref.shape[0] > 1 else 0
    n = head if ranges_ref.shape[1] > 1 else 0
    return tuple(ranges_ref[b, n, tile, c] for c in range(4))


def logit_unit(scale: float, has_bias: bool, soft_cap) -> float:
    """The natural-log logit of one unit of what `scores` returns: logit = u * unit."""
    if soft_cap is not None:
        return float(soft_cap)
    return 1.0 if has_bias else float(scale)


def scores(qk, scale: float, bias, soft_cap):
    """The logits of the f32 tile q.k as (u, dcap): logit = u * logit_unit(...).

    u is q.k itself (no bias or soft cap), scale * q.k + bias, or tanh of that over the cap;
    dcap = 1 - tanh^2 is the soft cap's derivative (for the backward), or None. The kernels
    take the row max of u and compute exp2((u - max) * unit * log2(e)): the subtraction comes
    before any multiply, so no fused multiply-add can subtract an unrounded product from a
    rounded max (which lets exp2 overflow once |logit| > 2^24), and equal logits give p == 1.
    """
    if bias is None and soft_cap is None:
        return qk, None
    s = qk * scale
    if bias is not None:
        s = s + bias.astype(s.dtype)
    if soft_cap is None:
        return s, None
    t = jnp.tanh(s * (1.0 / soft_cap))
    return t, 1.0 - t * t


def recomputed_probs(u, ref, bound, unit: float, *, at_max: bool = False):
    """P = exp(u * unit - lse) of a backward tile from `ref`, lowered a few ulps
    (`_numerics.slack`; +inf for rows that see no key), and `bound` = -log2 of the row's
    softmax denominator relative to its max (`softmax_store`'s log_sum; 0: unknown), P <= 1 / l.
    u, recomputed by another matmul, can put a row's largest logits a few ulps above the
    reference; the clamp makes their P exactly 1 / l (1 for one dominant logit, 1 / n for n tied
    ones) at any magnitude, never an overflow.

    ref is lse in the units of u (P = exp2(min((u - ref) * unit2, bound))), or with at_max the
    row's largest logit in those units, the Triton forward's (P = exp2(min((u - ref) * unit2 +
    bound, bound))): u - ref is then exact where the two are close, while lse's float32
    rounding moves every P of a row by up to an ulp of |lse| / unit (float32 logits in the
    hundreds: 3e-5). The extra add per element costs the bfloat16 fwd+bwd 2-9% on the H200, so
    only float32 calls take it (docs/notes/numerics.md, "float32 at large logits")."""
    x = (u - ref) * (unit * LOG2E)
    if at_max:
        x = x + bound
    return jnp.exp2(jnp.minimum(x, bound))


def finite_or_zero(x):
    """x with NaN and +-inf replaced by 0: for K and V tiles that hold keys some rows may not
    see, where a 0 probability times a NaN key would reach those rows."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros_like(x))


# -- online softmax (FA2 Algorithm 1), shared by the forward and decode kernels -------------------


def softmax_init(rows: int, hp: int, dtype):
    """The carry (acc, m_i, l_i) before the first KV tile, in `dtype` (`accumulation_dtype`).
    m_i starts at MIN_LOGIT, not -inf: the first tile's m_i - m_new is then finite, never
    -inf - -inf."""
    return (
        jnp.zeros((rows, hp), dtype),
        jnp.full((rows,), MIN_LOGIT, dtype),
        jnp.zeros((rows,), dtype),
    )


def merge_parts_step(carry, parts_refs, items, ok, col_ok):
    """One chunk of split results merged into the online softmax's carry (acc, m_i, l_i), in
    natural-log units. parts_refs: (lse, log_sum, out) of the parts, [items, rows] and [items,
    rows, cols]; items: the chunk's pl.ds; ok: [chunk, rows], which (part, row) pairs exist;
    col_ok: [cols], the columns inside the head. A part that saw no key of a row (lse -inf)
    weighs 0 for it; each part weighs by its denominator relative to the running max."""
    lse_parts_ref, log_sum_parts_ref, o_parts_ref = parts_refs
    acc, m_i, l_i = carry
    lse = plgpu.load(lse_parts_ref.at[items, :], mask=ok, other=-jnp.inf)
    log_sum = plgpu.load(log_sum_parts_ref.at[items, :], mask=ok, other=0.0)
    part = plgpu.load(o_parts_ref.at[items, :, :], mask=ok[:, :, None] & col_ok, other=0.0)
    seen = lse > -jnp.inf  # the part saw a key of the row
    row_max = jnp.where(seen, lse - log_sum, MIN_LOGIT)
    m_new = jnp.maximum(m_i, jnp.max(row_max, axis=0))
    weight = jnp.where(seen, jnp.exp((row_max - m_new[None, :]) + log_sum), 0.0)
    alpha = jnp.exp(m_i - m_new)
    acc = acc * alpha[:, None] + jnp.sum(weight[:, :, None] * part, axis=0)
    return acc, m_new, l_i * alpha + jnp.sum(weight, axis=0)


def softmax_step(carry, u, v, unit: float, visible=None, keep=None, hidden_values=True):
    """One KV tile of the online softmax: m_i is the running max of u (the logits in the units
    of `scores`), l_i the running sum of p, acc the unnormalised output (normalised once in
    `softmax_store`, FA2 change 1). unit: `logit_unit`, the natural-log logit of one unit of u.

    visible: None on a fully visible tile, else the [rows, block_kv] visibility of a boundary
    tile. Hidden logits become -inf, so p is exactly 0 with no select on p (m_i is finite), also
    for a NaN key; and V is zeroed where it is NaN or inf, since a row's hidden keys (padding,
    another document, a later new token) would otherwise reach it through 0 * NaN in p.v.

    keep: None, or the dropout keep-mask of the tile: dropped p leave p.v but stay in l_i (the
    softmax's sum), whose 1 / (1 - rate) `softmax_store` applies.

    hidden_values: False where no hidden key of a boundary tile holds a value (they all read
    as zero: keys past a sequence's length, masked at the load), so V needs no zeroing.
    """
    acc, m_i, l_i = carry
    unit2 = unit * LOG2E  # exp2((u - m) * unit2) == exp(logit - max logit)
    if visible is not None:
        u = jnp.where(visible, u, -jnp.inf)
        if hidden_values:
            v = finite_or_zero(v)
    m_new = jnp.maximum(m_i, jnp.max(u, axis=1))
    alpha = jnp.exp2((m_i - m_new) * unit2)
    p = jnp.exp2((u - m_new[:, None]) * unit2)
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    p_v = p if keep is None else jnp.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + dot(p_v.astype(v.dtype), v)
    return acc, m_new, l_i


def softmax_store(
    carry,
    unit: float,
    o_ref,
    lse_ref,
    block: int,
    rows,
    head_dim: int,
    out_scale: float = 1.0,
    sink=None,
    log_sum_ref=None,
    row_max_ref=None,
):
    """The epilogue: stores out = acc / l_i (times out_scale, dropout's 1 / (1 - rate)) and the
    natural-log lse of the first `rows` rows of the tile. Rows that saw no key (l_i == 0) output
    0 and have lse = -inf.

    log_sum_ref: None, or where to store log l_i, the log of the row's softmax denominator
    relative to its largest logit (lse = max logit + log l_i; 0 for rows that saw no key). A
    backward needs it apart from lse: beyond |lse| ~ 1e7 a float32 lse cannot hold log l_i
    next to the max, so the P of keys that tie at the max is recomputed from it (1 / l_i).
    row_max_ref: None, or where to store that largest logit in the units of u (the running max
    m_i, or the sink's where larger; MIN_LOGIT for rows that saw neither), from which the
    backward recomputes P exactly
    where lse's rounding would not (`recomputed_probs`).

    sink: None, or a float32 scalar, the natural-log logit of an attention sink: one more term
    e^{sink} in every row's denominator, with no value (`_numerics.sink_against_keys`); log_sum
    and row_max are then relative to the larger of the row max and the sink. A row that saw no
    key then outputs 0 with lse = sink (-inf for a sink of -inf)."""
    acc, m_i, l_i = carry
    keys_share = None
    top = m_i * unit  # the natural-log logit that lse adds log_sum to
    if sink is not None:
        m_i, keys_share, l_i, top = sink_against_keys(m_i, l_i, sink, unit)
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    if keys_share is None:
        out = acc / l_safe[:, None]
    else:
        out = acc * (keys_share / l_safe)[:, None]
    if out_scale != 1.0:
        out = out * out_scale
    store_rows(o_ref, out, 0, block, rows, head_dim)
    # l_i >= 1 (the row max's own term is exp2(0)), unless the max and the exponentials read u
    # apart: XLA (the interpreter) may contract scale * q.k + bias into an FMA in one of its
    # fusions and not in the other, an ulp of u apart (2 at |u| ~ 2e7), which would leave
    # log_sum < 0 and the backward's clamp P <= 2^-log_sum above 1. Held at 0: lse is the max.
    log_sum = jnp.maximum(jnp.log2(l_safe) * LN2, 0.0)
    lse = jnp.where(empty, -jnp.inf, top + log_sum)
    tile_rows = lax.broadcasted_iota(jnp.int32, (block,), 0)
    plgpu.store(lse_ref, lse, mask=tile_rows < rows)
    if log_sum_ref is not None:
        plgpu.store(log_sum_ref, log_sum, mask=tile_rows < rows)
    if row_max_ref is not None:
        plgpu.store(row_max_ref, m_i, mask=tile_rows < rows)


def merge_splits(lse, log_sum, splits: int, row_max=None, unit: float = 1.0):
    """The merge of split-KV partial results from their lse and log_sum [B * splits, ...]
    (natural log, `softmax_store`'s): (each split's weight in the merged output [B, splits,
    ...], `_numerics.merge_weights`'s; the merged lse [B, ...], from the splits' lse; the merged
    log_sum [B, ...]; the merged row max [B, ...] or None). Splits that saw no key weigh 0; rows
    no split saw a key of get lse -inf.

    row_max: None, or the splits' row maxima in the units of u (`softmax_store`), natural =
    row_max * unit: the weights and log_sum are then relative to the largest of them exactly,
    and the merged row max is that largest."""
    lse, log_sum = (x.reshape(-1, splits, *x.shape[1:]) for x in (lse, log_sum))
    merged_max = maxima = None
    if row_max is not None:
        row_max = row_max.reshape(lse.shape)
        maxima = row_max * unit
        merged_max = jnp.max(jnp.where(jnp.isfinite(lse), row_max, MIN_LOGIT), axis=1)
    weights, merged_log_sum = merge_weights(lse, log_sum, axis=1, maxima=maxima)
    top = jnp.max(lse, axis=1)
    finite = jnp.isfinite(top)
    safe_top = jnp.where(finite, top, 0.0)
    shares = jnp.sum(jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe_top[:, None]), 0.0), axis=1)
    merged_lse = jnp.where(finite, safe_top + jnp.log(jnp.where(finite, shares, 1.0)), -jnp.inf)
    return weights, merged_lse, merged_log_sum, merged_max


class Operands:
    """Named view of a kernel's optional refs, in the order the wrappers pass them:
    bias?, q_segment_ids?, kv_segment_ids?, mask?, ranges?, dropout tables (3)?, sinks?.

    dropout: None, or the whole `_dropout.tables` refs (row_mul [B, N, T], row_add [B, N, T],
    col [B, N, S], int32), read at the program's global (batch, head)."""

    def __init__(
        self, refs, spec, *, has_bias: bool, has_dropout: bool = False, has_sinks: bool = False
    ):
        refs = list(refs)
        take = lambda present: refs.pop(0) if present else None  # noqa: E731
        self.bias = take(has_bias)
        self.q_seg = take(spec.has_segments)
        self.kv_seg = take(spec.has_segments)
        self.mask = take(spec.mask_shape is not None)
        self.ranges = take(spec.has_arrays)
        self.dropout = tuple(take(has_dropout) for _ in range(3)) if has_dropout else None
        self.sinks = take(has_sinks)
        assert not refs, "unexpected extra refs"


def dropout_rows(tables, batch, head, start, block: int, length, *, ragged: bool):
    """(row_mul, row_add) [block] of the dropout tables (Operands.dropout) for rows [start,
    start + block) of (batch, head): the row side of `_dropout.keep`."""
    row_mul, row_add, _ = tables
    rows = dict(ragged=ragged, other=0, lead=(batch, head))
    return (
        load_vector(row_mul, start, block, length, **rows),
        load_vector(row_add, start, block, length, **rows),
    )


def tile_keep(tables, rows, batch, head, start, block: int, length, rate: float, *, ragged):
    """bool [rows, block]: the keep-mask of a tile whose rows' dropout tables are `rows` (the
    (multiplier, addend) pair of `dropout_rows`, as [rows, 1] columns) over key columns
    [start, start + block)."""
    col = dropout_cols(tables, batch, head, start, block, length, ragged=ragged)
    return _dropout.keep(*rows, col[None, :], rate)


def dropout_cols(tables, batch, head, start, block: int, length, *, ragged: bool):
    """col [block] of the dropout tables for key columns [start, start + block) of (batch,
    head): the column side of `_dropout.keep`."""
    return load_vector(tables[2], start, block, length, ragged=ragged, other=0, lead=(batch, head))
