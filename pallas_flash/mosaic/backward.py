"""FlashAttention backward for Hopper as warp-specialised Pallas Mosaic GPU kernels: the wrapper
(`flash_backward`).

FlashAttention-2's backward (Dao 2023, Algorithm 2) split as in FlashAttention-3 (Shah et al.
2024) but without float atomics: delta = rowsum(dO * O) - dlse in XLA, then two kernels (or
one, with the fused dQ; "fixed" first runs the two small Triton-lowered kernels of
`mosaic.fixed_point`), each in a module of its own:

- `dkv.py`: the dK/dV kernel, a CTA per block of keys of one KV head (or of a share of its
  query heads), whose consumers compute the tiles transposed (keys on rows);
- `dq.py`: the dQ kernel, a CTA per block of query rows of one head;
- `fused_dq.py`: with `BackwardTiles.fused_dq`, no dQ kernel: the dK/dV kernel's consumers also
  compute dQ's partial of each step and add it into dQ by TMA reductions (`DQSink`);
- `backward_tiles.py`: their tiles, budgets and rules (`why_not`); `_kernel_common.py`: what
  the kernels share inside their bodies.

Every head dim of HEAD_DIMS runs as it is, as in the forward: each shared-memory tile takes the
widest swizzle that divides its rows (`launch.smem_transforms`: 80 and 96 run on 32- and 64-byte
swizzles, not padded to 128). V, out, dO and dV may have a head dim Hv of their own (multi-head
latent attention's 192/128), taken as it is: the tiles of V and dO, the dV accumulator and
dP = dO V^T's contraction are Hv wide (with Hv's swizzle), those of Q, K, dQ and dK H wide.

Both write their gradients once (head splits: partials summed in XLA in a fixed order), so the
result is bitwise deterministic (the fused dQ's f32 adds aside). The residuals are those of
`pallas_flash.mosaic.forward` (and of the Triton forward): out, lse natural-log f32, and
log_sum (`flash_backward`).

Masks are the forward's (causal, local windows, segment ids with sequence lengths folded in, a
soft cap), from `pallas_flash.masks`: a CTA's producer streams the tiles of the hull of its
consumers' tile ranges, each consumer computes the tiles of its own range (masking element-wise
the ones that are not fully visible) and drains the other steps, as the forward's consumers do.
Without segment ids the ranges come from the geometry in the kernel; with them from a plan that
XLA computes first (`schedule.tile_plan`). Tiles that no row of a CTA sees are never loaded.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_flash import _dropout, masks
from pallas_flash._numerics import LOG2E, MIN_LOGIT, lowered_reference, probability_bound
from pallas_flash.device import DEFAULT_NUM_SMS, Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import fixed_point
from pallas_flash.mosaic.backward_tiles import BackwardTiles, default_tiles, head_splits
from pallas_flash.mosaic.dkv import dkv_call
from pallas_flash.mosaic.dq import dq_call
from pallas_flash.mosaic.launch import pad_ids, pad_to
from pallas_flash.mosaic.schedule import tile_plan
from pallas_flash.mosaic.tiles import aligned_len, cdiv


def flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: None,
    arrays: MaskArrays,
    out: jax.Array,
    lse: jax.Array,
    log_sum: jax.Array | None,
    row_max: None,
    d_out: jax.Array,
    d_lse: jax.Array | None,
    *,
    config,
    bias_gradient: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """Gradients of attention on Hopper (sm_90a) through Pallas Mosaic GPU, for a call the
    dispatch gave these kernels (`mosaic.why_not_backward`: nothing here checks it again).

    Args:
      q: [B, T, N, H], bfloat16 or float16; any T and S, H one of HEAD_DIMS.
      k: [B, S, K, H] in q's dtype; query head n reads kv head n // (N // K).
      v: [B, S, K, Hv] in q's dtype, Hv one of HEAD_DIMS too: the kernels take it as it is
        (dP = dO V^T contracts Hv columns, dV's accumulator has Hv); Hv != H as multi-head
        latent attention's (192, 128).
      bias, row_max: None (no bias; P is recomputed from lse): the arguments keep the
        backends' one shape (`triton.backward.flash_backward`'s).
      arrays: the forward's mask arrays (`flash_forward`): segment ids with spec.has_segments
        (query i sees key j only when their ids are equal); with dropout its seeds, whose
        keep-mask (`pallas_flash._dropout`) is regenerated here. With Z = keep / (1 - rate)
        the forward computed O = (P * Z) V, so dV = (P * Z)^T dO and dS = P * (Z * dP -
        delta); out and lse are the forward's (lse of the un-dropped softmax).
      out, d_out: [B, T, N, Hv] in q's dtype.
      lse: float32 [B, N, T], the natural-log log-sum-exp of the (soft-capped) logits saved by
        the forward; -inf for rows that see no key.
      log_sum: None, or float32 [B, N, T], the forward's log of each row's softmax denominator
        relative to its largest logit (`flash_forward(..., with_log_sum=True)`, or the Triton
        forward's): with it, the recomputed P is clamped at 1 / that denominator instead of 1,
        so keys that tie at a row's max get their exact P (1 / n for n ties) at any magnitude.
      d_lse: float32 [B, N, T], the cotangent of lse, or None for zero.
      config: the call's `KernelConfig`, as every backend's wrapper takes it. Read here: spec
        (is_causal, a window: query tiles that none of a CTA's keys' rows see (dK/dV), and KV
        tiles that none of its rows see (dQ), are not loaded; has_segments), scale, soft_cap
        (the gradients carry the cap's derivative 1 - tanh^2), dropout_rate,
        mosaic_backward_tiles (`BackwardTiles`; None: `default_tiles(H, Hv)`), device (its SM
        count sizes automatic head splits; None: the visible GPU's record, `Device.current()`).
      bias_gradient: as the Triton backward's; without a bias there is no dbias.

    Returns:
      dq [B, T, N, H], dk [B, S, K, H] and dv [B, S, K, Hv] in q's dtype, and dbias None; dk
      and dv are summed over the query heads of each kv head's group. Rows that see no key
      have dq 0, keys that no row sees dk and dv 0; with segment ids, causal or a window, NaN
      or inf in K or V at keys a row does not see does not reach that row's gradients.
    """
    del bias_gradient  # no bias
    assert bias is None and row_max is None, "the dispatch sends these calls to Triton"
    spec, tiles, scale = config.spec, config.mosaic_backward_tiles, config.scale
    soft_cap = config.soft_cap
    device = Device.current() if config.device is None else config.device
    segment_ids = (arrays.q_segment_ids, arrays.kv_segment_ids) if spec.has_segments else None
    dropout = (config.dropout_rate, arrays.dropout_seeds) if config.dropout_rate else None
    value_head_dim = v.shape[-1]
    tiles = default_tiles(q.shape[-1], value_head_dim) if tiles is None else tiles
    q_len, kv_len = q.shape[1], k.shape[1]
    # delta folds the lse cotangent in: dS = P * (dP - rowsum(dO * O) + dlse).
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    lse = lse.astype(jnp.float32)
    lse2, bound = _lse2_and_bound(lse, log_sum)
    if spec.has_key_ranges and not (tiles.fused_dq or tiles.producer_cleans_k):
        # Keys hidden from some rows may hold anything, and dQ += dS K multiplies their zero dS
        # by their K on the tensor cores: 0 * NaN would reach every row of the tile. So NaN and
        # inf in K become 0: here in one pass over K, or in shared memory by the fused dQ's
        # dK/dV consumers (each its keys, once) or with producer_cleans_k by the dQ kernel's
        # producer. Cleaning in the dQ kernel's consumers instead cost more: they share each
        # ring slot, so one cleaned every tile that either masks while the other waited, and
        # the dQ kernel took 45-60 us more on the H200 than this pass's ~40
        # (docs/notes/fused-dq.md, "Hidden keys' K"). Keys past S are padding of zeros.
        k = jnp.where(jnp.isfinite(k), k, jnp.zeros_like(k))
    # As in the forward: T and S padded to ROW_ALIGN, head dims as they are. The kernels read
    # the true T and S from spec; rows and keys past them are computed and not kept.
    q_to, kv_to = aligned_len(q_len), aligned_len(kv_len)
    q, d_out = pad_to(q, q_to), pad_to(d_out, q_to)
    k, v = pad_to(k, kv_to), pad_to(v, kv_to)
    # lse and delta keep T innermost: padded to whole query tiles of both kernels, so that no
    # tile's load runs into the next head's rows (see the forward's lse). The rows past T get
    # lse = +inf: P = 0 there, so they add nothing to dK and dV whatever their Q and dO.
    # lse and delta padded to whole query tiles of both kernels (`_rows_of_lse`).
    rows = math.lcm(tiles.block_q_dkv, tiles.cta_q_rows)
    lse_to = cdiv(q_len, rows) * rows
    lse2, delta, dq_unit = _rows_of_lse(
        lse, lse2, bound, delta, lse_to, tiles, k, v, d_out, spec=spec, scale=scale, ids=segment_ids
    )
    dkv_ids, dq_ids = _segment_plans(spec, tiles, segment_ids, q_to, kv_to)
    dkv_drop, dq_drop = _dropout_tables(dropout, tiles, q_len, kv_len, lse_to)
    kwargs = dict(
        spec=spec,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        tiles=tiles,
    )
    sms = DEFAULT_NUM_SMS if device is None else device.num_sms
    splits = head_splits(
        tiles,
        q.shape,
        k.shape,
        q.dtype.itemsize,
        num_sms=sms,
        causal=spec.is_causal,
        value_head_dim=value_head_dim,
        segments=segment_ids is not None,
        dropout=dropout is not None,
    )
    dk, dv, *fused_dq = dkv_call(
        q, k, v, d_out, lse2, delta, dkv_ids, dkv_drop, head_splits=splits, **kwargs
    )
    if splits > 1:
        dk, dv = (_summed_splits(x, k.shape, k.dtype, splits) for x in (dk, dv))
    if tiles.fused_dq:
        dq = _assembled_fused_dq(*fused_dq, tiles, q_len, scale=scale, unit=dq_unit, dtype=q.dtype)
    else:
        dq = dq_call(q, k, v, d_out, lse2, delta, dq_ids, dq_drop, **kwargs)
    if q_to != q_len:
        dq = dq[:, :q_len]
    if kv_to != kv_len:
        dk, dv = dk[:, :kv_len], dv[:, :kv_len]
    return dq, dk, dv, None


def _segment_plans(spec: MaskSpec, tiles: BackwardTiles, segment_ids, q_to: int, kv_to: int):
    """(dK/dV's, dQ's) ids: (q_segment_ids [B, T'], kv_segment_ids [B, S'], the kernel's tile
    plan, `schedule.tile_plan`), padded to T' = q_to and S' = kv_to; (None, None) without
    segment ids."""
    if segment_ids is None:
        return None, None
    q_ids = pad_ids(segment_ids[0], q_to, masks.PAD_Q_SEGMENT)
    kv_ids = pad_ids(segment_ids[1], kv_to, masks.PAD_KV_SEGMENT)
    arrays = MaskArrays(q_ids, kv_ids)
    plan = functools.partial(tile_plan, spec, arrays)
    # The split dK/dV consumers share the CTA's keys: one range for both.
    dkv_plan = plan(
        block_rows=tiles.block_kv_dkv,
        block_cols=tiles.block_q_dkv,
        num_consumers=tiles.dkv_key_blocks,
        over="kv",
    )
    dq_plan = plan(
        block_rows=tiles.block_q_dq,
        block_cols=tiles.block_kv_dq,
        num_consumers=tiles.num_consumers,
        over="q",
    )
    return (q_ids, kv_ids, dkv_plan), (q_ids, kv_ids, dq_plan)


def _dropout_tables(dropout, tiles: BackwardTiles, q_len: int, kv_len: int, lse_to: int):
    """(dK/dV's, dQ's) dropout tables: (rate, the rows' hashes, the keys'), from dropout =
    (rate, seeds [B, N]); (None, None) without dropout.

    The query rows' hashes [B, N, 2, T''] (one TMA copy per streamed tile or consumer's rows),
    padded as lse to lse_to rows; the keys' [B, N, S''], padded to whole CTAs of the dK/dV
    kernel and KV tiles of the dQ kernel (rows past T have P = 0, keys past S are masked or not
    kept: their hashes are never used). The dK/dV kernel takes the keys' as
    [B, N, S'' / block_kv_dkv, block_kv_dkv]: each consumer reads its own block of its CTA's
    keys."""
    if dropout is None:
        return None, None
    rate, seeds = dropout
    row_mul, row_add, col = _dropout.tables(seeds, q_len, kv_len)
    rows = jnp.stack([row_mul, row_add], axis=2)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, lse_to - q_len)))
    keys = math.lcm(tiles.cta_kv_rows, tiles.block_kv_dq)
    col = jnp.pad(col, ((0, 0), (0, 0), (0, cdiv(kv_len, keys) * keys - kv_len)))
    dkv_col = col.reshape(*col.shape[:2], -1, tiles.block_kv_dkv)
    rate = float(rate)
    return (rate, rows, dkv_col), (rate, rows, col)


def _summed_splits(partials, k_shape, dtype, splits: int):
    """dK or dV in dtype from the dK/dV kernel's f32 partials [B, S', K * splits, H or Hv], a
    KV head's splits side by side: summed one after the other, in the same order on every
    call."""
    split = jnp.unstack(partials.reshape(*k_shape[:3], splits, -1), axis=3)
    return functools.reduce(jnp.add, split).astype(dtype)


def _assembled_fused_dq(dq, tiles: BackwardTiles, q_len: int, *, scale: float, unit, dtype):
    """dQ [B, T', N, H] in dtype from the fused dQ's dQ^T: f32 [B, N, H, T''] unscaled, or one
    per kv tile to sum first ("slab", in a fixed order); int32 in each row's units of 2^-e with
    "fixed" (unit: f32 [B, N, T''], `fixed_point.fixed_point_scales`)."""
    if tiles.slab_dq:  # one partial per kv tile, summed in a fixed order
        dq = functools.reduce(jnp.add, jnp.unstack(dq))
    dq = dq[..., :q_len]
    if tiles.fixed_point_dq:
        dq = dq.astype(jnp.float32) * unit[:, :, None, :q_len]
    else:
        dq = dq * scale
    return jnp.transpose(dq, (0, 3, 1, 2)).astype(dtype)


def _lse2_and_bound(lse, log_sum):
    """(lse2, bound), f32 [B, N, T]: the rows' lse * log2(e) and the bound on their P.

    The kernels recompute P = exp2(min(S * scale * log2(e) - lse * log2(e), bound)), bound =
    -log2 of the row's softmax denominator relative to its max (0 without log_sum): the
    lowered reference puts the largest logits of a row on the clamp, so their P is exactly
    1 / l at any magnitude (`_numerics.lowered_reference`). Rows that saw no key (lse = -inf)
    and rows a sink of +inf takes (lse = +inf) get +inf, which makes their P exactly 0
    whatever their logits."""
    finite = jnp.isfinite(lse)
    lse2 = lowered_reference(jnp.where(finite, lse, 0.0)) * LOG2E
    lse2 = jnp.where(finite, jnp.maximum(lse2, MIN_LOGIT), jnp.inf)
    return lse2, probability_bound(log_sum, lse)


def _rows_of_lse(lse, lse2, bound, delta, lse_to: int, tiles, k, v, d_out, *, spec, scale, ids):
    """(the rows' lse2 and bound [B, N, 2, T''], delta [B, N, T''], dQ's unit or None): padded
    to lse_to = T'' rows; with fused_dq "fixed" the rows' scales 2^e a third row beside lse2
    and bound, and dQ's unit f32 [B, N, T''] (`fixed_point.fixed_point_scales` of the padded k,
    v and d_out, and of segment ids `ids`).

    T stays innermost: padded to whole query tiles of both kernels, so that no tile's load runs
    into the next head's rows (see the forward's lse). The rows past T get lse2 = +inf: P = 0
    there, so they add nothing to dK and dV whatever their Q and dO."""
    q_len = lse.shape[-1]
    pad_rows = ((0, 0), (0, 0), (0, lse_to - q_len))
    delta_rows = delta
    if lse_to != q_len:
        lse2, delta = jnp.pad(lse2, pad_rows, constant_values=jnp.inf), jnp.pad(delta, pad_rows)
        bound = jnp.pad(bound, pad_rows)
    rows_of_lse, dq_unit = [lse2, bound], None
    if tiles.fixed_point_dq:
        # Each row's dS is scaled by 2^e before dQ's wgmma; dQ = scale * 2^-e * its integer sum
        # (0 for rows without P, NaN for rows that see keys without a finite bound).
        row_scales, dq_unit = fixed_point.fixed_point_scales(
            k,
            v,
            d_out,
            delta_rows,
            lse,
            spec=spec,
            scale=scale,
            rows_out=lse_to,
            segment_ids=ids,
        )
        rows_of_lse.append(row_scales)
    # [B, N, 2 (3 with "fixed"), T'']: a tile's lse2 and bound rows (and the fixed point's
    # scales) land in one TMA copy.
    return jnp.stack(rows_of_lse, axis=2), delta, dq_unit
