"""FlashAttention backward for Hopper as warp-specialised Pallas Mosaic GPU kernels.

FlashAttention-2's backward (Dao 2023, Algorithm 2) split as in FlashAttention-3 (Shah et al.
2024) but without float atomics: delta = rowsum(dO * O) - dlse in XLA, then two kernels (or
one, with the fused dQ below; "fixed" first runs the two small Triton-lowered kernels of
`mosaic.fixed_point`).

- dK/dV: a CTA owns `num_consumers * block_kv_dkv` keys of one KV head. Each consumer
  warpgroup keeps its `block_kv_dkv` rows of K and V in shared memory and its dK, dV in f32
  registers; the producer warpgroup streams Q, dO tiles (with their lse and delta rows) of every
  query head of the GQA group and every query tile that sees the CTA's keys through a TMA ring.
  The tiles are computed transposed (keys on rows: S^T = K Q^T), so that P^T and dS^T are
  register A operands of dV += P^T dO and dK += dS^T Q.
  With `dkv_head_splits` > 1 a KV head's group of query heads is shared by that many CTAs (more
  CTAs where few KV heads leave the grid under one wave: MQA), each writing f32 partial dK, dV
  that XLA sums.
  With `split_dkv` (H 192 and 256, where one warpgroup cannot hold both accumulators) a CTA
  owns `block_kv_dkv` keys and its two consumers split the work by accumulator: one computes
  P^T and keeps dV, the other computes dP^T and dS^T and keeps dK; P^T (times the soft cap's
  derivative) passes between them through shared memory.
- dQ: a CTA owns `num_consumers * block_q_dq` query rows of one head. Each consumer keeps Q, dO
  in shared memory and dQ in f32 registers; the producer streams K, V tiles through a TMA ring.
- Or, with `BackwardTiles.fused_dq`, no dQ kernel: the dK/dV kernel also computes dQ's
  partial of each step and adds it into dQ by TMA reductions, in arrival order (`_DQSink`):
  f32 adds ("add", not bitwise deterministic), or int32 adds of fixed-point partials
  ("fixed": each row's dS scaled by a power of two from a bound on its sums,
  `mosaic.fixed_point`; integer adds give the same bits in any order).

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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import _dropout, masks
from pallas_flash._numerics import (
    LOG2E,
    MIN_LOGIT,
    lowered_reference,
    probability_bound,
)
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import fixed_point, launch
from pallas_flash.mosaic._kernel_common import (
    clip,
    per_col,
    per_row,
    recomputed_probs,
    step_tile,
    step_zero,
    tile_keep,
    tile_smem,
    times,
    wgmma_iota,
    wgmma_zeros,
)
from pallas_flash.mosaic.backward_tiles import (
    BACKWARD_PRODUCER_REGISTERS,
    BackwardTiles,
    backward_consumer_registers,
    default_tiles,
    fused_dq_rows,
    head_splits,
    why_not,
)
from pallas_flash.mosaic.launch import (
    check_segment_ids,
    dropped_value,
    num_sms,
    pad_ids,
    pad_to,
    warp_specialised_kernel,
    warp_specialised_kernel_into,
    zero_non_finite,
)
from pallas_flash.mosaic.schedule import launch_group, launched_cta, tile_plan
from pallas_flash.mosaic.tiles import aligned_len, cdiv


def flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    window: tuple[int, int] | None = None,
    soft_cap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    tiles: BackwardTiles | None = None,
    device: Device | None = None,
    dropout: tuple[float, jax.Array] | None = None,
    log_sum: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of attention on Hopper (sm_90a) through Pallas Mosaic GPU.

    Args:
      q: [B, T, N, H], bfloat16 or float16; any T and S, H one of HEAD_DIMS.
      k: [B, S, K, H] in q's dtype; query head n reads kv head n // (N // K).
      v: [B, S, K, Hv] in q's dtype, Hv one of HEAD_DIMS too: the kernels take it as it is
        (dP = dO V^T contracts Hv columns, dV's accumulator has Hv); Hv != H as multi-head
        latent attention's (192, 128).
      out, d_out: [B, T, N, Hv] in q's dtype.
      lse: float32 [B, N, T], the natural-log log-sum-exp of the (soft-capped) logits saved by
        the forward; -inf for rows that see no key.
      d_lse: float32 [B, N, T], the cotangent of lse, or None for zero.
      scale: the forward's positive multiplier of q.k.
      is_causal: query i sees keys j <= i, top-left aligned.
      window: (left, right) ints >= 0, or None: query i sees keys j with
        i - left <= j <= i + right (and j <= i when causal). Query tiles that none of a CTA's
        keys' rows see (dK/dV), and KV tiles that none of its rows see (dQ), are not loaded.
      soft_cap: c > 0 or None: the forward's logits c * tanh(scale * q.k / c); the gradients
        carry its derivative 1 - tanh^2.
      segment_ids: (q_segment_ids int32 [B, T], kv_segment_ids int32 [B, S]) or None, as in
        `pallas_flash.mosaic.forward.flash_forward` (sequence lengths folded in as padding
        ids): query i sees key j only when their ids are equal.
      tiles: BackwardTiles; None picks `default_tiles(H)`.
      device: the GPU it is compiled for (its CUDA runtime is checked, its SM count sizes
        automatic head splits); None: the visible GPU's record (`Device.current()`).
      dropout: None, or (rate, seeds int32 [B, N]) as the forward took them: its keep-mask
        (`pallas_flash._dropout`) is regenerated here. With Z = keep / (1 - rate) the forward
        computed O = (P * Z) V, so dV = (P * Z)^T dO and dS = P * (Z * dP - delta); out and
        lse are the forward's (lse of the un-dropped softmax).
      log_sum: None, or float32 [B, N, T], the forward's log of each row's softmax denominator
        relative to its largest logit (`flash_forward(..., with_log_sum=True)`, or the Triton
        forward's): with it, the recomputed P is clamped at 1 / that denominator instead of 1,
        so keys that tie at a row's max get their exact P (1 / n for n ties) at any magnitude.

    Returns:
      dq [B, T, N, H], dk [B, S, K, H] and dv [B, S, K, Hv] in q's dtype; dk and dv are
      summed over the query heads of each kv head's group. Rows that see no key have dq 0,
      keys that no row sees dk and dv 0; with segment ids, causal or a window, NaN or inf in K
      or V at keys a row does not see does not reach that row's gradients.

    Raises:
      ValueError: shapes, dtypes, options or tiles the kernels do not support (see `why_not`).
    """
    device = Device.current() if device is None else device
    if reason := why_not(
        q.shape,
        k.shape,
        q.dtype,
        value_head_dim=v.shape[-1],
        is_causal=is_causal,
        window=window,
        soft_cap=soft_cap,
        segments=segment_ids is not None,
        dropout=dropout is not None,
        tiles=tiles,
        cuda_runtime_version=None if device is None else device.cuda_runtime_version,
    ):
        raise ValueError(reason)
    if dropout is not None:
        rate, seeds = dropout
        batch_heads = (q.shape[0], q.shape[2])
        if tuple(seeds.shape) != batch_heads or seeds.dtype != jnp.int32:
            raise ValueError(
                f"dropout seeds {tuple(seeds.shape)} {seeds.dtype} must be int32 of shape "
                f"{batch_heads}"
            )
        if not 0.0 < rate < 1.0:
            raise ValueError(f"dropout rate={rate!r} must lie in (0, 1)")
    value_head_dim = v.shape[-1]
    for name, x in (("v", v), ("out", out), ("d_out", d_out)):
        like = (*(k if name == "v" else q).shape[:3], value_head_dim)
        if x.ndim != 4 or x.shape != like or x.dtype != q.dtype:
            raise ValueError(
                f"{name} {x.shape} {x.dtype} must have shape {like} (v's head dim) and q's dtype"
            )
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive")
    if segment_ids is not None:
        check_segment_ids(segment_ids, q.shape[:2], k.shape[:2])
    tiles = default_tiles(q.shape[-1], value_head_dim) if tiles is None else tiles
    q_len, kv_len = q.shape[1], k.shape[1]
    spec = MaskSpec(
        q_len=q_len,
        kv_len=kv_len,
        is_causal=is_causal,
        window=None if window is None else (int(window[0]), int(window[1])),
        has_segments=segment_ids is not None,
    )
    # delta folds the lse cotangent in: dS = P * (dP - rowsum(dO * O) + dlse).
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    # The kernels recompute P = exp2(min(S * scale * log2(e) - lse * log2(e), bound)), bound =
    # -log2 of the row's softmax denominator relative to its max (0 without log_sum): the
    # lowered reference puts the largest logits of a row on the clamp, so their P is exactly
    # 1 / l at any magnitude (`_numerics.lowered_reference`). Rows that saw no key (lse = -inf)
    # and rows a sink of +inf takes (lse = +inf) get +inf, which makes their P exactly 0
    # whatever their logits.
    lse = lse.astype(jnp.float32)
    finite = jnp.isfinite(lse)
    lse2 = lowered_reference(jnp.where(finite, lse, 0.0)) * LOG2E
    lse2 = jnp.where(finite, jnp.maximum(lse2, MIN_LOGIT), jnp.inf)
    bound = probability_bound(log_sum, lse)
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
    rows = math.lcm(tiles.block_q_dkv, tiles.cta_q_rows)
    lse_to = cdiv(q_len, rows) * rows
    pad_rows = ((0, 0), (0, 0), (0, lse_to - q_len))
    delta_rows = delta
    if lse_to != q_len:
        lse2, delta = jnp.pad(lse2, pad_rows, constant_values=jnp.inf), jnp.pad(delta, pad_rows)
        bound = jnp.pad(bound, pad_rows)
    rows_of_lse = [lse2, bound]
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
            segment_ids=segment_ids,
        )
        rows_of_lse.append(row_scales)
    # [B, N, 2 (3 with "fixed"), T'']: a tile's lse2 and bound rows (and the fixed point's
    # scales) land in one TMA copy.
    lse2 = jnp.stack(rows_of_lse, axis=2)
    dkv_ids = dq_ids = None
    if segment_ids is not None:
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
        dkv_ids, dq_ids = (q_ids, kv_ids, dkv_plan), (q_ids, kv_ids, dq_plan)
    dkv_drop = dq_drop = None
    if dropout is not None:
        rate, seeds = dropout
        row_mul, row_add, col = _dropout.tables(seeds, q_len, kv_len)
        # The query rows' hashes [B, N, 2, T''] (one TMA copy per streamed tile or consumer's
        # rows), padded as lse; the keys' [B, N, S''], padded to whole CTAs of the dK/dV kernel
        # and KV tiles of the dQ kernel (rows past T have P = 0, keys past S are masked or not
        # kept: their hashes are never used). The dK/dV kernel takes the keys' as
        # [B, N, S'' / block_kv_dkv, block_kv_dkv]: each consumer reads its own block of its
        # CTA's keys.
        rows = jnp.stack([row_mul, row_add], axis=2)
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, lse_to - q_len)))
        keys = math.lcm(tiles.cta_kv_rows, tiles.block_kv_dq)
        col = jnp.pad(col, ((0, 0), (0, 0), (0, cdiv(kv_len, keys) * keys - kv_len)))
        dkv_col = col.reshape(*col.shape[:2], -1, tiles.block_kv_dkv)
        rate = float(rate)
        dkv_drop, dq_drop = (rate, rows, dkv_col), (rate, rows, col)
    kwargs = dict(
        spec=spec,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        tiles=tiles,
    )
    sms = num_sms() if device is None else device.num_sms
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
    dk, dv, *fused_dq = _dkv_call(
        q, k, v, d_out, lse2, delta, dkv_ids, dkv_drop, head_splits=splits, **kwargs
    )
    if splits > 1:
        # f32 partials [B, S', K * splits, H or Hv], a KV head's splits side by side: summed
        # one after the other, in the same order on every call.
        dk, dv = (
            functools.reduce(
                jnp.add, jnp.unstack(x.reshape(*k.shape[:3], splits, -1), axis=3)
            ).astype(k.dtype)
            for x in (dk, dv)
        )
    if tiles.fused_dq:
        (dq,) = fused_dq
        if tiles.slab_dq:  # one partial per kv tile, summed in a fixed order
            dq = functools.reduce(jnp.add, jnp.unstack(dq))
        dq = dq[..., :q_len]
        if tiles.fixed_point_dq:
            dq = dq.astype(jnp.float32) * dq_unit[:, :, None, :q_len]
        else:
            dq = dq * scale
        dq = jnp.transpose(dq, (0, 3, 1, 2)).astype(q.dtype)
    else:
        dq = _dq_call(q, k, v, d_out, lse2, delta, dq_ids, dq_drop, **kwargs)
    if q_to != q_len:
        dq = dq[:, :q_len]
    if kv_to != kv_len:
        dk, dv = dk[:, :kv_len], dv[:, :kv_len]
    return dq, dk, dv


# -- dK / dV --------------------------------------------------------------------------------------


def _dkv_geometry(spec: MaskSpec, tiles: BackwardTiles) -> MaskSpec:
    """spec with S rounded up to whole dK/dV CTAs: each key is a row of dK and dV there, and the
    rows past S are computed and not kept, so no query tile needs a mask for them."""
    cta_rows = tiles.cta_kv_rows
    return dataclasses.replace(spec, kv_len=cdiv(spec.kv_len, cta_rows) * cta_rows)


def _q_tile_ranges(spec: MaskSpec, tiles: BackwardTiles, cta_kv_start, kv_start):
    """((first, end), (lo, full_lo, full_hi, hi)) from the geometry: the query tiles (of
    block_q_dkv rows) that the dK/dV CTA whose keys start at cta_kv_start streams, and
    `MaskSpec.q_tile_range` of a consumer's keys from kv_start, clamped into them (a consumer
    whose keys no row sees gets an empty range inside the CTA's, and drains its steps)."""
    geometry = _dkv_geometry(spec, tiles)
    block_q = tiles.block_q_dkv
    first, _, _, end = geometry.q_tile_range(cta_kv_start, block_q, tiles.cta_kv_rows)
    ranges = geometry.q_tile_range(kv_start, block_q, tiles.block_kv_dkv)
    return (first, end), tuple(clip(x, first, end) for x in ranges)


def _dkv_mask_sides(spec: MaskSpec, tiles: BackwardTiles) -> tuple[bool, bool]:
    """(before, after): whether a dK/dV consumer's range may hold masked query tiles before its
    whole ones (keys hidden from earlier rows: causal, or the window's right side) and after
    them (keys hidden from later rows: the window's left side). Row i sees key j >= 0 once
    i >= j - right, for every key the kernel runs (j < S rounded up to its CTAs) once right >=
    that - 1; and once left >= R - 1 for every row i < R, R = T rounded up to block_q_dkv. With
    segment ids any tile may need the mask."""
    if spec.has_segments:
        return True, True
    keys = _dkv_geometry(spec, tiles).kv_len
    rows = cdiv(spec.q_len, tiles.block_q_dkv) * tiles.block_q_dkv
    return spec.right < keys - 1, spec.left < rows - 1


def _dkv_call(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    ids,
    drop,
    *,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    tiles,
    head_splits: int = 1,
):
    """ids: None, or (q_segment_ids [B, T'], kv_segment_ids [B, S'], the dK/dV tile plan);
    drop: None, or (rate, the rows' hashes [B, N, 2, T''], the keys' [B, N, S'' / block_kv_dkv,
    block_kv_dkv]), the dropout tables.
    dk [B, S', K, H], dv [B, S', K, Hv] in k's dtype, or with head_splits > 1 f32 partials
    [B, S', K * head_splits, H or Hv] (a KV head's splits side by side) for the caller to
    sum. With tiles.fused_dq also dQ^T unscaled, f32: [B, N, H, T''] over whole query tiles
    ("add"), or [S'' / cta_kv_rows, B, N, H, T''], one per kv tile, for the caller to sum
    ("slab"); int32 in each row's units of 2^-e with "fixed" and "fixed_slab" (lse2 then has
    a third row, 2^e)."""
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, value_head_dim = k.shape[2], v.shape[3]
    n_c, n_s, block_q = tiles.dkv_consumers, tiles.num_stages, tiles.block_q_dkv
    has_ids = ids is not None
    has_drop = drop is not None
    # Split consumers share one block of K and V: the dV consumer reads only K, the dK consumer
    # only V, each loads its own (one TMA copy on its kv_loaded barrier, and its key ids).
    kv_blocks, kv_copies = tiles.dkv_key_blocks, 1 if tiles.split_dkv else 2
    group = num_heads // num_kv_heads // head_splits
    # A CTA streams the Q and dO rows of its share of the KV head's query heads.
    unit_bytes = group * spec.q_len * (head_dim + value_head_dim) * q.dtype.itemsize
    kernel = functools.partial(
        _dkv_kernel,
        spec=spec,
        qk_scale=scale * LOG2E,
        scale=scale,
        soft_cap=soft_cap,
        group=group,
        head_splits=head_splits,
        tiles=tiles,
        dropout_rate=drop[0] if has_drop else 0.0,
        launch_units=launch_group(
            batch * num_kv_heads * head_splits,
            unit_bytes,
            is_causal=spec.is_causal and tiles.grouped_launch,
        ),
    )
    scratch = dict(
        k_smem=tile_smem((kv_blocks, tiles.block_kv_dkv, head_dim), q.dtype),
        v_smem=tile_smem((kv_blocks, tiles.block_kv_dkv, value_head_dim), q.dtype),
        q_smem=tile_smem((n_s, block_q, head_dim), q.dtype),
        do_smem=tile_smem((n_s, block_q, value_head_dim), q.dtype),
        # lse2 and bound rows (and with fused_dq "fixed" the rows' scales)
        lse_smem=plgpu.SMEM((n_s, lse2.shape[2], block_q), jnp.float32),
        delta_smem=plgpu.SMEM((n_s, block_q), jnp.float32),
        # Two TMA copies arrive on each: K and V (split: K or V); Q and its lse rows; dO and its
        # delta rows. With segment ids the keys' ids land with K and V, the rows' ids with Q;
        # with dropout the rows' hashes and the CTA's keys' hashes (of the step's head) with Q.
        kv_loaded=plgpu.Barrier(num_arrivals=kv_copies + has_ids, num_barriers=n_c),
        q_ready=plgpu.Barrier(num_arrivals=2 + has_ids + 2 * has_drop, num_barriers=n_s),
        do_ready=plgpu.Barrier(num_arrivals=2, num_barriers=n_s),
        # A slot is free again once every consumer is done with it.
        q_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        do_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
    )
    if has_ids:
        scratch.update(
            kv_ids_smem=plgpu.SMEM((n_c, tiles.block_kv_dkv), jnp.int32),
            q_ids_smem=plgpu.SMEM((n_s, block_q), jnp.int32),
        )
    if has_drop:
        scratch.update(
            drop_rows_smem=plgpu.SMEM((n_s, 2, block_q), jnp.int32),
            drop_col_smem=plgpu.SMEM((n_s, kv_blocks, tiles.block_kv_dkv), jnp.int32),
        )
    if tiles.split_dkv:
        # P^T * dcap in f32, as the one-consumer kernel computes dS^T from it. One buffer: the
        # dK consumer copies it into registers as soon as it lands, long before the dV consumer
        # has the next one (a second buffer would not fit beside the ring at H=256).
        scratch.update(
            p_smem=plgpu.SMEM((tiles.block_kv_dkv, block_q), jnp.float32),
            p_ready=plgpu.Barrier(num_arrivals=1),
            p_free=plgpu.Barrier(num_arrivals=1),
        )
    out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    if head_splits > 1:
        # Partials stay f32 until XLA has summed them, as one CTA's accumulators would. Split
        # consumers stage one each; others stage dK then dV through one tile at H == Hv.
        def staging(consumers, columns):
            return plgpu.SMEM((*consumers, tiles.block_kv_dkv, columns), jnp.float32)

        consumers = () if tiles.split_dkv else (n_c,)
        scratch.update(dk_partial_smem=staging(consumers, head_dim))
        if tiles.split_dkv or value_head_dim != head_dim:
            scratch.update(dv_partial_smem=staging(consumers, value_head_dim))
        out_type = tuple(
            jax.ShapeDtypeStruct((*k.shape[:2], num_kv_heads * head_splits, h), jnp.float32)
            for h in (head_dim, value_head_dim)
        )
    # The last grid axis is launched first: neighbouring CTAs are KV tiles of one head and read
    # the same Q/dO from L2. Causal: tile 0 sees the most query tiles and starts first, a group
    # of heads at a time (`schedule.grouped_launch`).
    grid = (batch, num_kv_heads * head_splits, cdiv(spec.kv_len, tiles.cta_kv_rows))
    grid_args = dict(grid=grid, grid_names=("batch", "kv_head", "kv_tile"), num_consumers=n_c)
    operands = (q, k, v, d_out, lse2, delta, *(ids or ()), *(drop[1:] if has_drop else ()))
    if not tiles.fused_dq:
        return warp_specialised_kernel(
            kernel, out_type=out_type, scratch_types=scratch, **grid_args
        )(*operands)
    # Each consumer stores its step's dS^T (read as B by K^T dS^T) and stages the f32 partials
    # of the steps it computes (`_DQSink`).
    dq_dtype = jnp.int32 if tiles.fixed_point_dq else jnp.float32
    scratch.update(
        ds_smem=tile_smem((n_c, tiles.block_kv_dkv, block_q), q.dtype),
        dq_partial_smem=plgpu.SMEM((n_c, fused_dq_rows(tiles, head_dim), block_q), dq_dtype),
    )
    if n_c > 1:
        scratch.update(
            ds_ready=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_c),
            ds_read=plgpu.Barrier(num_arrivals=1, num_barriers=n_c),
        )
    # dQ^T starts at 0 (steps add into it) over whole query tiles.
    dq_shape = (batch, num_heads, head_dim, cdiv(q.shape[1], block_q) * block_q)
    if tiles.slab_dq:
        dq_shape = (grid[2], *dq_shape)
    # dK and dV (or their partials) are written whole, as without the fused dQ: they start
    # uninitialised (an allocation on the GPU, where zeros cost a pass over 2 x [B, S, K, H]).
    outputs = (launch.uninitialised(t.shape, t.dtype) for t in out_type)
    into = (*outputs, jnp.zeros(dq_shape, dq_dtype))
    return warp_specialised_kernel_into(kernel, into=into, scratch_types=scratch, **grid_args)(
        *operands
    )


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    *refs,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_loaded,
    q_ready,
    do_ready,
    q_free,
    do_free,
    kv_ids_smem=None,
    q_ids_smem=None,
    p_smem=None,
    p_ready=None,
    p_free=None,
    dk_partial_smem=None,
    dv_partial_smem=None,
    drop_rows_smem=None,
    drop_col_smem=None,
    ds_smem=None,
    dq_partial_smem=None,
    ds_ready=None,
    ds_read=None,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    group: int,
    head_splits: int,
    tiles: BackwardTiles,
    dropout_rate: float = 0.0,
    launch_units: int = 1,
):
    """One CTA: tiles.cta_kv_rows keys of one KV head (FA2 Algorithm 2, outer loop), over
    `group` of its query heads (all of them, or one of head_splits shares). The grid position
    (batch, kv_head, kv_tile) maps to the CTA's by `schedule.grouped_launch` over
    launch_units (batch, kv_head) pairs at a time.

    q_ref: [B, T', N, H], do_ref: [B, T', N, Hv]; k_ref, dk_ref: [B, S', K, H], v_ref,
    dv_ref: [B, S', K, Hv] (dk_ref and dv_ref with head_splits > 1 f32 partials
    [B, S', K * head_splits, ..]); lse2_ref: f32 [B, N, 2, T''], the rows' lse * log2(e) (+inf
    for rows without keys) and bound (`recomputed_probs`); delta_ref: f32 [B, N, T'']. With
    segment ids, refs starts with q_ids_ref [B, T'], kv_ids_ref [B, S'] and plan_ref [B,
    ceil(S / cta_kv_rows), dkv_key_blocks + 1, 4] (`schedule.tile_plan` over="kv"). With
    dropout_rate > 0 the dropout tables follow: drop_rows_ref [B, N, 2, T''] (the query rows'
    row_mul and row_add) and drop_col_ref [B, N, S'' / block_kv_dkv, block_kv_dkv] (the keys'
    col), each step's copied with its Q into the ring (the keys' of the step's head: the CTA's
    blocks). Grid axis "kv_head" c is KV head c // head_splits, query heads [c * group, (c + 1)
    * group), and row c of dk/dv_ref. The CTA
    streams query tiles [first, end): the producer's step s loads query head
    c * group + s // (end - first), query tile first + s % (end - first) into ring slot
    s % num_stages.
    With tiles.fused_dq, refs ends with dq_ref, f32 or int32 ("fixed") [B, N, H, T''] (dQ^T,
    or a slab of them per kv tile, `_DQSink`), to which the consumers add each step's K^T
    dS^T in turn.
    """
    dq_ref = refs[-1] if tiles.fused_dq else None
    *id_refs, dk_ref, dv_ref = refs[:-1] if tiles.fused_dq else refs
    drop_col_ref = id_refs.pop() if dropout_rate else None
    drop_rows_ref = id_refs.pop() if dropout_rate else None
    q_ids_ref, kv_ids_ref, plan_ref = id_refs or (None, None, None)
    batch, cta_head, kv_tile = launched_cta(("batch", "kv_head", "kv_tile"), launch_units)
    kv_head = lax.div(cta_head, jnp.int32(head_splits)) if head_splits > 1 else cta_head
    cta_kv_start = kv_tile * tiles.cta_kv_rows
    wg = lax.axis_index("wg")
    # Split consumers both own the CTA's one block of keys.
    block = 0 if tiles.split_dkv else wg
    kv_start = cta_kv_start + block * tiles.block_kv_dkv

    def tile_ranges():
        """(first, end) of the CTA and (lo, full_lo, full_hi, hi) of consumer wg's keys."""
        if plan_ref is None:
            return _q_tile_ranges(spec, tiles, cta_kv_start, kv_start)
        # Every thread of the CTA loads the same words: a broadcast from L2.
        cta = tuple(plan_ref[batch, kv_tile, tiles.dkv_key_blocks, i] for i in (0, 3))
        return cta, tuple(plan_ref[batch, kv_tile, block, i] for i in range(4))

    cta_range, _ = tile_ranges()
    ring = _QRing(
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        q_free,
        do_free,
        q_ids_smem,
        drop_rows_smem,
        drop_col_smem,
    )
    common = dict(batch=batch, cta_range=cta_range, group=group)

    n_c = tiles.dkv_consumers

    @pl.when(wg < n_c)
    def _consumer():
        plgpu.set_max_registers(backward_consumer_registers(n_c), action="increase")
        partials = None
        if dk_partial_smem is not None and tiles.split_dkv:
            partials = (dk_partial_smem, dv_partial_smem)
        elif dk_partial_smem is not None:
            dk_partial = dk_partial_smem.at[wg]
            partials = (
                dk_partial,
                dk_partial if dv_partial_smem is None else dv_partial_smem.at[wg],
            )
        dq_sink = None
        if tiles.fused_dq:
            dq_sink = _DQSink(
                ds_smem,
                k_smem,
                dq_partial_smem.at[wg],
                dq_ref,
                batch=batch,
                first_head=cta_head * group,
                consumer=wg,
                cta_tiles=cta_range[1] - cta_range[0],
                first=cta_range[0],
                ds_ready=ds_ready,
                ds_read=ds_read,
                slab=kv_tile if tiles.slab_dq else None,
                step_descriptors=tiles.step_descriptors,
            )
        consume = functools.partial(
            _consume_dkv,
            k_ref,
            v_ref,
            kv_ids_ref,
            dk_ref,
            dv_ref,
            k_smem,
            v_smem,
            None if kv_ids_smem is None else kv_ids_smem.at[wg],
            partials,
            kv_loaded.at[wg],
            ring,
            kv_head=kv_head,
            out_head=cta_head,
            kv_start=kv_start,
            ranges=tile_ranges()[1],
            spec=spec,
            qk_scale=qk_scale,
            scale=scale,
            soft_cap=soft_cap,
            tiles=tiles,
            key_block=block,
            dropout_rate=dropout_rate,
            dq_sink=dq_sink,
            **common,
        )
        if not tiles.split_dkv:
            consume()
            return
        # The dK consumer stages dK through K's buffer, which the dV consumer loads.
        handoff = _PHandoff(p_smem, p_ready, p_free, k_loaded=kv_loaded.at[0])
        for role, index in (("dv", 0), ("dk", 1)):
            pl.when(wg == index)(functools.partial(consume, role=role, handoff=handoff))

    @pl.when(wg == n_c)
    def _producer():
        plgpu.set_max_registers(BACKWARD_PRODUCER_REGISTERS, action="decrease")
        _produce_dkv(
            q_ref,
            do_ref,
            lse2_ref,
            delta_ref,
            q_ids_ref,
            ring,
            first_head=cta_head * group,
            tiles=tiles,
            drop_refs=(drop_rows_ref, drop_col_ref) if dropout_rate else None,
            kv_tile=kv_tile,
            **common,
        )


@dataclasses.dataclass(frozen=True)
class _DQSink:
    """Where the dK/dV consumers put dQ's partial of each CTA step (tiles.fused_dq), transposed:
    (dS K)^T = K^T dS^T over the CTA's keys for the step's query tile, added by TMA into dq_ref
    [B, N, H, T''] f32 (dQ^T; int32 with "fixed"), or with `slab` (the CTA's kv tile) stored
    into dq_ref[slab] of [kv tiles, B, N, H, T''].

    Every consumer stores its dS^T of each step into its tile of ds_smem (zeros for a step it
    drains), and the partial is summed over every consumer's block of keys: one add of
    [H, block_q_dkv] per CTA step, not one per consumer (half the L2 reduction traffic with two
    consumers). A consumer computes a partial of step s at the start of step s + 1, in the same
    wgmma wait as its S^T there (on its own at a drained step, and after the last step):
    waiting for it on its own, right after dK, stopped the consumer until the tensor cores
    had drained both consumers' queues (docs/notes/fused-dq.md, "How the fused forms work").
    Two ways to share the work:
    - `halves` (`fused_dq_rows`): each consumer computes its half of dQ^T's rows (K's
      columns [c * H / 2, (c + 1) * H / 2) as A) of every step. ds_ready[s % 2] completes when
      both tiles of step s have landed (a prologue of zeros stands for step -1); ds_read[c]
      when the partner has read consumer c's tile, which c waits for before each store.
    - otherwise the consumers take turns: consumer s % consumers computes the whole partial of
      step s. ds_ready[c] completes when the tiles of a step that consumer c computes have
      landed, ds_read[c] when the partner has read c's tile (waited for before c's store at
      the step after one its partner computes). With one consumer neither barrier is needed.

    Transposed because dS^T is what a consumer holds, in registers: Mosaic GPU transposes no
    register tile, and a tile stored from registers cannot be read back as a transposed wgmma
    operand (layout inference finds no layout for both), so dS^T is stored as it is and read as
    B, K's tiles (loaded by TMA) as A transposed. ds_smem [consumers, block_kv_dkv,
    block_q_dkv] (16-bit, swizzled); k_smem [consumers, block_kv_dkv, H], the CTA's keys;
    partial_smem [rows, block_q_dkv] f32 (int32 with "fixed"; rows: H, or H / 2 in halves),
    this consumer's staging tile, one store in flight at a time. cta_tiles, first: the CTA's
    query tiles per head and the first (a step's head and tile)."""

    ds_smem: object
    k_smem: object
    partial_smem: object
    dq_ref: object
    batch: object
    first_head: object
    consumer: object
    cta_tiles: object
    first: object
    ds_ready: object = None  # Barrier(num_arrivals=consumers, num_barriers=consumers), 2 only
    ds_read: object = None  # Barrier(num_arrivals=1, num_barriers=consumers), 2 only
    slab: object = None
    step_descriptors: bool = False  # BackwardTiles.step_descriptors

    @property
    def consumers(self) -> int:
        return self.ds_smem.shape[0]

    @property
    def halves(self) -> bool:
        return self.partial_smem.shape[0] < self.k_smem.shape[-1]

    def _computes(self, step):
        """Whether this consumer computes (its rows of) CTA step `step`'s partial: always in
        halves or alone, on its turns otherwise."""
        if self.halves or self.consumers == 1:
            return True
        return lax.rem(step, jnp.int32(self.consumers)) == self.consumer

    def _partner_reads(self, step):
        """Whether the partner reads this consumer's tile of CTA step `step` (two consumers)."""
        return True if self.halves else jnp.logical_not(self._computes(step))

    def _adds_before(self, step):
        """Whether this consumer adds a partial of step - 1 at CTA step `step` (>= 0)."""
        return (step >= 1) & self._computes(step - 1)

    def start(self):
        """Before the first step. Halves: step -1's tiles are zeros (its partial is computed,
        never added), so that every step computes the partial of the one before."""
        if self.halves:
            self.ds_smem.at[self.consumer][...] = wgmma_zeros(self.ds_smem.shape[1:]).astype(
                self.ds_smem.dtype
            )
            plgpu.commit_smem()
            plgpu.barrier_arrive(self.ds_ready.at[1])

    def put(self, ds_t, step):
        """This consumer's dS^T of CTA step `step`: 16-bit registers [keys, rows], or None for
        a step outside its range (zeros)."""
        if self.halves:
            # The partner has read this tile of the step before (of step -1 at step 0).
            plgpu.barrier_wait(self.ds_read.at[self.consumer])
        elif self.consumers > 1:
            read = (step >= 1) & self._partner_reads(step - 1)
            pl.when(read)(lambda: plgpu.barrier_wait(self.ds_read.at[self.consumer]))
        tile = self.ds_smem.at[self.consumer]
        if ds_t is None:
            ds_t = wgmma_zeros(tile.shape).astype(tile.dtype)
        tile[...] = ds_t
        plgpu.commit_smem()
        if self.consumers > 1:
            plgpu.barrier_arrive(self.ds_ready.at[lax.rem(step, jnp.int32(self.consumers))])

    def issue(self, acc_ref, zero):
        """The wgmmas of dQ^T's partial (this consumer's rows) into acc_ref; the tiles at
        block + zero (`step_zero`)."""
        rows = self.partial_smem.shape[0]
        for block in range(self.consumers):
            k_t = self.k_smem.at[block + zero]
            if self.halves:
                k_t = k_t.at[:, pl.ds(self.consumer * rows, rows)]
            plgpu.wgmma(acc_ref, k_t.T, self.ds_smem.at[block + zero])

    def _wait_tiles(self, step):
        """Until every consumer's tile of CTA step `step` has landed."""
        if self.consumers > 1:
            ready = lax.rem(step + 2, jnp.int32(2)) if self.halves else self.consumer
            plgpu.barrier_wait(self.ds_ready.at[ready])

    def _read_done(self):
        if self.consumers > 1:
            plgpu.barrier_arrive(self.ds_read.at[1 - self.consumer])

    def with_st(self, st_issue, st_shape, step, zero):
        """At a computed CTA step `step`: S^T (st_issue(acc_ref) issues its wgmma), in the same
        wait as this consumer's partial of step - 1 where it has one, which is then added;
        returns S^T."""

        def with_partial():
            self._wait_tiles(step - 1)

            def both(refs):
                st_ref, dq_ref = refs
                st_issue(st_ref)
                self.issue(dq_ref, zero)

            s_t, partial = pl.run_state(both)(
                (
                    plgpu.ACC.init(wgmma_zeros(st_shape)),
                    plgpu.ACC.init(wgmma_zeros(self.partial_smem.shape)),
                )
            )
            self._read_done()
            if self.halves:  # step -1's partial (zeros) is computed, not added
                pl.when(step >= 1)(lambda: self._store(partial, step - 1))
            else:
                self._store(partial, step - 1)
            return s_t

        if self.halves:
            return with_partial()

        def alone():
            def st_into(acc_ref):
                st_issue(acc_ref)
                return acc_ref[...]

            return pl.run_scoped(st_into, plgpu.ACC(st_shape, jnp.float32))

        return lax.cond(self._adds_before(step), with_partial, alone)

    def drained(self, step):
        """At a CTA step `step` this consumer drains: its partial of step - 1 on its own."""
        if self.halves:
            partial = self._compute(step - 1)
            pl.when(step >= 1)(lambda: self._store(partial, step - 1))
        else:
            pl.when(self._adds_before(step))(lambda: self._add(step - 1))

    def _compute(self, step):
        """This consumer's partial of CTA step `step`, waited for."""
        self._wait_tiles(step)

        def dq_into(acc_ref):
            self.issue(acc_ref, step_zero(step, self.step_descriptors))
            return acc_ref[...]

        partial = pl.run_scoped(dq_into, plgpu.ACC(self.partial_smem.shape, jnp.float32))
        self._read_done()
        return partial

    def _add(self, step):
        self._store(self._compute(step), step)

    def _head_tile(self, step):
        """(query head, query tile) of CTA step `step`."""
        head = self.first_head + lax.div(step, self.cta_tiles)
        return head, step_tile(step, self.first, self.cta_tiles)

    def _store(self, partial, step):
        """Adds this consumer's partial of CTA step `step` into dQ^T (or stores it into its
        slab)."""
        rows, block_q = self.partial_smem.shape
        head, q_tile = self._head_tile(step)
        # The previous add of this consumer must have read the staging tile.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if self.partial_smem.dtype == jnp.int32:
            # fused_dq "fixed": to int32 (truncated), in the units its dS^T was scaled to.
            partial = launch.truncate_to_int32(partial)
        self.partial_smem[...] = partial
        plgpu.commit_smem()
        first_row = self.consumer * rows if self.halves else 0
        window = (self.batch, head, pl.ds(first_row, rows), pl.ds(q_tile * block_q, block_q))
        if self.slab is not None:
            plgpu.copy_smem_to_gmem(self.partial_smem, self.dq_ref.at[(self.slab, *window)])
            return
        plgpu.copy_smem_to_gmem(self.partial_smem, self.dq_ref.at[window], reduction_op="add")

    def finish(self, steps):
        """After the last of `steps` CTA steps, before this consumer's K buffer is overwritten:
        the last step's partial, then the partner's last read of this consumer's tile (and
        K), where it has one."""
        last = steps - 1
        pl.when((steps > 0) & self._computes(last))(lambda: self._add(last))
        if self.consumers > 1:
            partner_read = (steps > 0) & self._partner_reads(last)
            pl.when(partner_read)(lambda: plgpu.barrier_wait(self.ds_read.at[self.consumer]))


@dataclasses.dataclass(frozen=True)
class _QRing:
    """The Q/dO shared-memory ring of the dK/dV kernel: step s lives in slot s % num_stages.
    q_ready completes when Q and its lse rows (and query ids, and dropout's hashes of the rows
    and of the CTA's keys) have landed, do_ready when dO and its delta rows have; q_free and
    do_free when every consumer is done reading them."""

    q_smem: object
    do_smem: object
    lse_smem: object
    delta_smem: object
    q_ready: object
    do_ready: object
    q_free: object
    do_free: object
    q_ids_smem: object = None
    drop_rows_smem: object = None  # [num_stages, 2, block_q_dkv]: row_mul, row_add
    drop_col_smem: object = None  # [num_stages, dkv_key_blocks, block_kv_dkv]

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.q_smem.shape[0]))


@dataclasses.dataclass(frozen=True)
class _PHandoff:
    """P^T * dcap from the dV consumer to the dK consumer of a split dK/dV CTA (split_dkv), one
    computed step at a time: p_ready completes when a step's tile is in p_smem, p_free when the
    dK consumer has copied it out (once more before its first step, so that the dV consumer
    waits for p_free before every write). k_loaded: the dV consumer's barrier on which K
    lands."""

    p_smem: object
    p_ready: object
    p_free: object
    k_loaded: object


def _produce_dkv(
    q_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    q_ids_ref,
    ring: _QRing,
    *,
    batch,
    first_head,
    cta_range,
    group: int,
    tiles: BackwardTiles,
    drop_refs=None,
    kv_tile=None,
):
    """Producer warpgroup: TMA Q, lse, dO, delta (and the rows' segment ids; with drop_refs,
    the dropout tables' hashes of the rows and of the CTA kv_tile's keys) of every (head,
    query tile) step, in order, over query heads [first_head, first_head + group) (`step_tile`)."""
    block_q, num_stages = tiles.block_q_dkv, tiles.num_stages
    first, end = cta_range
    cta_tiles = end - first

    @pl.loop(0, group * cta_tiles)
    def _step(step):
        slot = ring.slot(step)
        head = first_head + lax.div(step, cta_tiles)
        q_start = step_tile(step, first, cta_tiles) * block_q
        rows = (batch, pl.ds(q_start, block_q), head)
        vector = (batch, head, pl.ds(q_start, block_q))
        # The first num_stages steps fill empty slots; later ones wait for the consumers. Q and
        # dO are freed separately and dO first: its last readers (dV, dP^T) finish before Q's
        # (dK), so dO and delta are waited for and loaded first, Q and lse after.
        pl.when(step >= num_stages)(lambda: plgpu.barrier_wait(ring.do_free.at[slot]))
        plgpu.copy_gmem_to_smem(do_ref.at[rows], ring.do_smem.at[slot], ring.do_ready.at[slot])
        plgpu.copy_gmem_to_smem(
            delta_ref.at[vector], ring.delta_smem.at[slot], ring.do_ready.at[slot]
        )
        pl.when(step >= num_stages)(lambda: plgpu.barrier_wait(ring.q_free.at[slot]))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], ring.q_smem.at[slot], ring.q_ready.at[slot])
        lse_rows = lse2_ref.at[batch, head, :, pl.ds(q_start, block_q)]
        plgpu.copy_gmem_to_smem(lse_rows, ring.lse_smem.at[slot], ring.q_ready.at[slot])
        if q_ids_ref is not None:
            ids = q_ids_ref.at[batch, pl.ds(q_start, block_q)]
            plgpu.copy_gmem_to_smem(ids, ring.q_ids_smem.at[slot], ring.q_ready.at[slot])
        if drop_refs is not None:
            rows_ref, col_ref = drop_refs
            key_blocks = tiles.dkv_key_blocks
            hashes = rows_ref.at[batch, head, :, pl.ds(q_start, block_q)]
            plgpu.copy_gmem_to_smem(hashes, ring.drop_rows_smem.at[slot], ring.q_ready.at[slot])
            hashes = col_ref.at[batch, head, pl.ds(kv_tile * key_blocks, key_blocks)]
            plgpu.copy_gmem_to_smem(hashes, ring.drop_col_smem.at[slot], ring.q_ready.at[slot])


def _consume_dkv(
    k_ref,
    v_ref,
    kv_ids_ref,
    dk_ref,
    dv_ref,
    k_blocks,
    v_blocks,
    kv_ids_smem,
    partials,
    kv_loaded,
    ring: _QRing,
    *,
    batch,
    kv_head,
    out_head,
    kv_start,
    cta_range,
    ranges,
    group: int,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    tiles: BackwardTiles,
    role: str = "dkdv",
    handoff: _PHandoff | None = None,
    key_block=0,
    dropout_rate: float = 0.0,
    dq_sink: _DQSink | None = None,
):
    """Consumer warpgroup: dK, dV of block_kv_dkv keys over every query head of the group and
    every query tile that sees them. Per head it walks every CTA step of cta_range = (first,
    end): it computes the tiles of its own range (lo, full_lo, full_hi, hi), masking element-wise
    those outside [full_lo, full_hi), and drains the others (see drain_step).

    role (split_dkv): "dv" computes P^T (and P^T * dcap), hands P^T * dcap over and keeps dV;
    "dk" takes it, computes dP^T and dS^T and keeps dK. Both own the CTA's keys: one range, so
    they compute and drain the same steps.

    K and V come from KV head kv_head; dK and dV go to head out_head of dk_ref and dv_ref, as
    f32 partials through partials = (dK's staging tile, dV's) when it is given (head
    splits), else through the dead K and V buffers.

    key_block: the consumer's block of the CTA's keys: its K and V in k_blocks and v_blocks
    [key blocks, block_kv_dkv, ..], its slice of the ring's key hashes.
    dropout_rate > 0: dV = (P^T * Z^T) dO, dS^T = P^T * dcap * (Z^T * dP^T - delta) with
    Z = keep / (1 - rate) (see `probs_t`).
    dq_sink (role "dkdv" only): each computed step also puts dS K, dQ's partial, there."""
    block_q, block_kv = tiles.block_q_dkv, tiles.block_kv_dkv
    k_smem, v_smem = k_blocks.at[key_block], v_blocks.at[key_block]
    head_dim, value_head_dim, dtype = k_smem.shape[-1], v_smem.shape[-1], k_smem.dtype

    def kv_at(zero):
        """(K, V) of this consumer's keys as a step's wgmmas read them, at key_block + zero
        (`step_zero`)."""
        if not tiles.step_descriptors:
            return k_smem, v_smem
        return k_blocks.at[key_block + zero], v_blocks.at[key_block + zero]

    first, end = cta_range
    cta_tiles = end - first
    lo, full_lo, full_hi, hi = ranges
    before, after = _dkv_mask_sides(spec, tiles)
    kv_rows = (batch, pl.ds(kv_start, block_kv), kv_head)
    out_rows = (batch, pl.ds(kv_start, block_kv), out_head)
    if role != "dk":
        plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, kv_loaded)
    if role != "dv":
        plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, kv_loaded)
    if kv_ids_ref is not None:
        ids = kv_ids_ref.at[batch, pl.ds(kv_start, block_kv)]
        plgpu.copy_gmem_to_smem(ids, kv_ids_smem, kv_loaded)
    tile_shape = (block_kv, block_q)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    keep_scale = 1.0 / (1.0 - dropout_rate) if dropout_rate else 1.0
    # dK's factor, applied once in the epilogue: the softmax scale, and with dropout the keep
    # scale that `ds_of` leaves out of dS^T (one multiply per element fewer).
    dk_scale = scale * keep_scale
    # The keys' segment ids [block_kv] (row layout): loaded once kv_loaded completes, before the
    # loops trace visible_in, which reads them.
    kv_seg = None

    def visible_in(i, slot):
        # Keys are rows here, query rows are columns. Rows past T have P = 0, but dS^T = P^T *
        # (dP^T - delta) is NaN there when V is at a key that only they see (a hidden key
        # between T and the last query tile's end, causal): they are masked in a ragged last
        # tile (with segment ids their padding ids do it).
        q_pos = i * block_q + wgmma_iota(tile_shape, 1)
        kv_pos = kv_start + wgmma_iota(tile_shape, 0)
        if kv_seg is None:
            visible = masks.visible(spec, q_pos, kv_pos)
            if spec.q_len % block_q:
                visible = visible & (q_pos < spec.q_len)
            return visible
        # The query tile's ids ride in Q's slot: read before the slot is released.
        q_seg = plgpu.load(ring.q_ids_smem.at[slot], layout=col_layout)
        return masks.visible(
            spec, q_pos, kv_pos, per_col(q_seg, tile_shape), per_row(kv_seg, tile_shape)
        )

    def keep_t(slot):
        """(keep^T, the keys' hashes) of the step in ring slot `slot`. The step's hashes share
        Q's slot: read before it is released (probs_t and dk_update each read them: the mask
        is not held across the wgmma between them)."""
        q_hashes = [plgpu.load(ring.drop_rows_smem.at[slot, j], layout=col_layout) for j in (0, 1)]
        kv_hashes = plgpu.load(
            ring.drop_col_smem.at[slot, key_block], layout=plgpu.Layout.WGMMA.reduce(1)
        )
        return tile_keep(q_hashes, kv_hashes, tile_shape, rate=dropout_rate, q_axis=1), kv_hashes

    def probs_t(i, slot, step, zero, *, masked: bool):
        """(P^T, P^T * dcap) of query tile i, whose Q and lse are in ring slot `slot`.

        With dropout P^T * keep^T: dV takes it, scaled by 1 / (1 - rate) once in the epilogue;
        dS^T computes the mask again (`ds_of`).

        step: the CTA step, zero its `step_zero`; with dq_sink, S^T's wait also takes this
        consumer's dQ partial of the step before (`_DQSink.with_st`)."""

        # -- S^T = K Q^T [block_kv, block_q]: keys on rows, so P^T and dS^T are A operands --
        def st_issue(acc_ref):
            plgpu.wgmma(acc_ref, kv_at(zero)[0], ring.q_smem.at[slot].T)

        def st_into(acc_ref):
            st_issue(acc_ref)
            return acc_ref[...]

        if dq_sink is not None:
            s_t = dq_sink.with_st(st_issue, tile_shape, step, zero)
        else:
            s_t = pl.run_scoped(st_into, plgpu.ACC(tile_shape, jnp.float32))
        lse2, bound = (plgpu.load(ring.lse_smem.at[slot, j], layout=col_layout) for j in (0, 1))
        # pd_t = P^T * dcap replaces P^T in f32 once p_in is taken: a soft cap costs no tile.
        p_t, pd_t = recomputed_probs(
            s_t, lse2, bound, per_col, qk_scale=qk_scale, scale=scale, soft_cap=soft_cap
        )
        if masked:
            # A select, not a product: NaN in K at a hidden key is in S^T.
            visible = visible_in(i, slot)
            p_t = jnp.where(visible, p_t, 0.0)
            pd_t = p_t if soft_cap is None else jnp.where(visible, pd_t, 0.0)
        if dropout_rate:
            keep, kv_hashes = keep_t(slot)
            p_t = jnp.where(keep, p_t, per_row(dropped_value(kv_hashes), tile_shape))
        return p_t, pd_t

    def ds_of(pd_t, dp_t, delta, slot):
        """dS^T = P^T * dcap * (Z^T * dP^T - delta), Z = keep / (1 - rate) with dropout: there
        it is returned over 1 / (1 - rate), P^T * dcap * (keep^T * dP^T - delta * (1 - rate)),
        and dK's epilogue multiplies it back (dk_scale)."""
        if not dropout_rate:
            return pd_t * (dp_t - per_col(delta, tile_shape))
        keep, _ = keep_t(slot)
        delta = per_col(delta * (1.0 - dropout_rate), tile_shape)
        return pd_t * (jnp.where(keep, dp_t, 0.0) - delta)

    def dkdv_step(i, carry, *, base, masked: bool):
        dk, dv = carry
        step = base + i - first
        slot = ring.slot(step)
        zero = step_zero(step, tiles.step_descriptors)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        p_t, pd_t = probs_t(i, slot, step, zero, masked=masked)

        # -- dV += P^T dO and dP^T = V dO^T, issued together: one wgmma wait for both --
        plgpu.barrier_wait(ring.do_ready.at[slot])
        p_in = p_t.astype(dtype)

        def dv_dpt_into(refs):
            dv_ref, dpt_ref = refs
            plgpu.wgmma(dv_ref, p_in, ring.do_smem.at[slot])
            plgpu.wgmma(dpt_ref, kv_at(zero)[1], ring.do_smem.at[slot].T)

        dv, dp_t = pl.run_state(dv_dpt_into)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(wgmma_zeros(tile_shape)))
        )
        delta = plgpu.load(ring.delta_smem.at[slot], layout=col_layout)
        plgpu.barrier_arrive(ring.do_free.at[slot])
        return dk_update(dk, pd_t, dp_t, delta, i, slot, step, masked=masked), dv

    def dk_update(dk, pd_t, dp_t, delta, i, slot, step, *, masked: bool):
        # -- dS^T = P^T * dcap * (dP^T - delta); dK += dS^T Q (scaled once in the epilogue) --
        ds_t = ds_of(pd_t, dp_t, delta, slot)
        if masked:
            # NaN in V at a hidden key is in dP^T, and 0 * NaN is NaN. probs_t zeroed pd_t
            # wherever the mask hides a pair, so the select reads pd_t instead of the mask:
            # the mask held across the dV and dP^T wgmma (or its positions recomputed) spilled
            # registers at H=128 (a visible pair whose P underflows to 0 gets dS^T = 0, as it
            # would from finite inputs).
            ds_t = jnp.where(pd_t == 0.0, 0.0, ds_t)
        ds_in = ds_t.astype(dtype)
        if dq_sink is not None:
            ds_dq = ds_in
            if tiles.fixed_point_dq:
                # Each query row's (column's) 2^e, exact in 16 bits (`fixed_point`'s scales).
                row_scale = plgpu.load(ring.lse_smem.at[slot, 2], layout=col_layout)
                ds_dq = ds_in * per_col(row_scale.astype(dtype), tile_shape)
            # Stored before dK's wgmma: the other consumer may read it too.
            dq_sink.put(ds_dq, step)

        def dk_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, ring.q_smem.at[slot])

        dk = pl.run_state(dk_into)(plgpu.ACC.init(dk))
        plgpu.barrier_arrive(ring.q_free.at[slot])
        return dk

    def dv_step(i, carry, *, base, masked: bool):
        (dv,) = carry
        step = base + i - first
        slot = ring.slot(step)
        zero = step_zero(step, tiles.step_descriptors)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        p_t, pd_t = probs_t(i, slot, step, zero, masked=masked)
        # Q's (and the query ids' and hashes') last reader in this consumer was S^T (and the
        # masks): free them for the producer before dV's wgmma.
        plgpu.barrier_arrive(ring.q_free.at[slot])
        # The buffer holds the previous step's tile until the dK consumer has copied it out.
        plgpu.barrier_wait(handoff.p_free)
        handoff.p_smem[...] = pd_t
        plgpu.barrier_arrive(handoff.p_ready)
        plgpu.barrier_wait(ring.do_ready.at[slot])
        p_in = p_t.astype(dtype)

        def dv_into(acc_ref):
            plgpu.wgmma(acc_ref, p_in, ring.do_smem.at[slot])

        dv = pl.run_state(dv_into)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(ring.do_free.at[slot])
        return (dv,)

    def dk_step(i, carry, *, base, masked: bool):
        (dk,) = carry
        step = base + i - first
        slot = ring.slot(step)
        zero = step_zero(step, tiles.step_descriptors)
        plgpu.barrier_wait(ring.do_ready.at[slot])

        # -- dP^T = V dO^T; it runs beside the dV consumer's S^T --
        def dpt_into(acc_ref):
            plgpu.wgmma(acc_ref, kv_at(zero)[1], ring.do_smem.at[slot].T)
            return acc_ref[...]

        dp_t = pl.run_scoped(dpt_into, plgpu.ACC(tile_shape, jnp.float32))
        delta = plgpu.load(ring.delta_smem.at[slot], layout=col_layout)
        plgpu.barrier_arrive(ring.do_free.at[slot])
        plgpu.barrier_wait(handoff.p_ready)
        pd_t = plgpu.load(handoff.p_smem, layout=plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(handoff.p_free)
        # Q (and the query ids the mask reads) after the handoff: the dV consumer's S^T needed
        # it first.
        plgpu.barrier_wait(ring.q_ready.at[slot])
        return (dk_update(dk, pd_t, dp_t, delta, i, slot, step, masked=masked),)

    q_step = {"dkdv": dkdv_step, "dv": dv_step, "dk": dk_step}[role]

    def drain_step(i, carry, *, base):
        # A CTA step outside this consumer's range: waited for (each barrier's phase is
        # tracked per thread and flips on every wait) and freed unread, so that the ring moves
        # on for the other consumer. With dq_sink its dS^T is 0, and this consumer's partial of
        # the step before (if it has one) is computed on its own.
        step = base + i - first
        slot = ring.slot(step)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        plgpu.barrier_wait(ring.do_ready.at[slot])
        plgpu.barrier_arrive(ring.do_free.at[slot])
        plgpu.barrier_arrive(ring.q_free.at[slot])
        if dq_sink is not None:
            dq_sink.drained(step)
            dq_sink.put(None, step)
        return carry

    def head_loop(h, carry):
        base = h * cta_tiles  # the producer's step of this head's tile `first`
        masked_step = functools.partial(q_step, base=base, masked=True)
        drain = functools.partial(drain_step, base=base)
        # In the producer's order. Without a side its loops are empty: not emitted.
        if before:
            lax.fori_loop(first, lo, drain, None)
            carry = lax.fori_loop(lo, full_lo, masked_step, carry)
        carry = lax.fori_loop(
            full_lo, full_hi, functools.partial(q_step, base=base, masked=False), carry
        )
        if after:
            carry = lax.fori_loop(full_hi, hi, masked_step, carry)
            lax.fori_loop(hi, end, drain, None)
        return carry

    dk_zeros, dv_zeros = (
        wgmma_zeros((block_kv, head_dim)),
        wgmma_zeros((block_kv, value_head_dim)),
    )
    plgpu.barrier_wait(kv_loaded)
    if dq_sink is not None and spec.has_key_ranges:
        # dQ's partials multiply a hidden key's zero dS by its K (see flash_backward): this
        # consumer's keys are cleaned once, before its partner's first partial reads them
        # (after this consumer's first dS^T, `_DQSink`).
        zero_non_finite(k_smem)
    if kv_ids_smem is not None:
        kv_seg = plgpu.load(kv_ids_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    # Each split consumer stages its result through a dead buffer of its accumulator's width.
    # At H == Hv that is the buffer it loaded and read itself (dV through K's, dK through V's):
    # no wait on the other consumer. At H != Hv the widths cross (dV through V's, dK through
    # K's), so each waits until the other consumer's last read of that buffer is done.
    crossed = partials is None and value_head_dim != head_dim
    if role == "dv":
        (dv,) = lax.fori_loop(0, group, head_loop, (dv_zeros,))
        if crossed:
            # The dK consumer has copied out the last P^T: after its last dP^T, V's last
            # reader (and after V landed: it arrives on p_free first once V has).
            plgpu.barrier_wait(handoff.p_free)
        staging = partials[1] if partials is not None else (v_smem if crossed else k_smem)
        _store_rows(staging, times(dv, keep_scale), dv_ref.at[out_rows])
        return
    if role == "dk":
        # The buffer starts empty: the dV consumer's first wait on p_free passes.
        plgpu.barrier_arrive(handoff.p_free)
        (dk,) = lax.fori_loop(0, group, head_loop, (dk_zeros,))
        if crossed:
            # K's last reader, the dV consumer's last S^T, came before the last P^T this
            # consumer took; wait for K to have landed too, for a CTA whose keys no row sees
            # (no P^T at all).
            plgpu.barrier_wait(handoff.k_loaded)
        staging = partials[0] if partials is not None else (k_smem if crossed else v_smem)
        _store_rows(staging, dk * dk_scale, dk_ref.at[out_rows])
        return
    if dq_sink is not None:
        dq_sink.start()
    dk, dv = lax.fori_loop(0, group, head_loop, (dk_zeros, dv_zeros))
    if dq_sink is not None:
        dq_sink.finish(group * cta_tiles)
    if partials is not None:
        # -- epilogue: the f32 partials one after the other through the staging tiles --
        _store_rows(partials[0], dk * dk_scale, dk_ref.at[out_rows])
        _store_rows(partials[1], times(dv, keep_scale), dv_ref.at[out_rows])
        return

    # -- epilogue: K and V are dead (their last readers, this consumer's wgmmas, are done) --
    k_smem[...] = (dk * dk_scale).astype(dtype)
    v_smem[...] = times(dv, keep_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_rows])
    plgpu.wait_smem_to_gmem(0)


def _store_rows(smem, value, gmem):
    """value in smem's dtype through smem (dead by now, or a staging tile) to gmem by TMA."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


# -- dQ -------------------------------------------------------------------------------------------


def _kv_tile_ranges(spec: MaskSpec, tiles: BackwardTiles, cta_q_start, q_start):
    """((first, end), (lo, full_lo, full_hi, hi)) from the geometry: the KV tiles (of
    block_kv_dq keys) that the dQ CTA whose rows start at cta_q_start streams, and
    `MaskSpec.kv_tile_range` of a consumer's rows from q_start, clamped into them."""
    block_kv = tiles.block_kv_dq
    first, _, _, end = spec.kv_tile_range(cta_q_start, tiles.cta_q_rows, block_kv)
    ranges = spec.kv_tile_range(q_start, tiles.block_q_dq, block_kv)
    return (first, end), tuple(clip(x, first, end) for x in ranges)


def _dq_mask_sides(spec: MaskSpec, tiles: BackwardTiles) -> tuple[bool, bool]:
    """(before, after): whether a dQ consumer's range may hold masked KV tiles before its whole
    ones (the window's left side hides keys from some row i < R, R = T rounded up to the CTAs,
    unless left >= R - 1) and after them (causal or the window's right side, unless right >=
    S - 1; a ragged last KV tile, whose keys past S are masked). With segment ids any tile may
    need the mask."""
    if spec.has_segments:
        return True, True
    rows = cdiv(spec.q_len, tiles.cta_q_rows) * tiles.cta_q_rows
    ragged_kv = spec.kv_len % tiles.block_kv_dq != 0
    return spec.left < rows - 1, spec.right < spec.kv_len - 1 or ragged_kv


def _dq_call(
    q, k, v, d_out, lse2, delta, ids, drop, *, spec: MaskSpec, scale: float, soft_cap, tiles
):
    """ids: None, or (q_segment_ids [B, T'], kv_segment_ids [B, S'], the dQ tile plan); drop:
    None, or (rate, the rows' hashes [B, N, 2, T''], the keys' [B, N, S'']), the dropout
    tables."""
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, value_head_dim = k.shape[2], v.shape[3]
    n_c, n_s, block_q = tiles.num_consumers, tiles.num_stages, tiles.block_q_dq
    has_ids = ids is not None
    has_drop = drop is not None
    num_q_tiles = cdiv(spec.q_len, tiles.cta_q_rows)
    group = num_heads // num_kv_heads
    # A CTA streams its KV head's K and V, which the group's query heads share.
    unit_bytes = spec.kv_len * (head_dim + value_head_dim) * q.dtype.itemsize // group
    kernel = functools.partial(
        _dq_kernel,
        spec=spec,
        qk_scale=scale * LOG2E,
        scale=scale,
        soft_cap=soft_cap,
        group=group,
        num_q_tiles=num_q_tiles,
        tiles=tiles,
        dropout_rate=drop[0] if has_drop else 0.0,
        launch_units=launch_group(
            batch * num_heads, unit_bytes, is_causal=spec.is_causal and tiles.grouped_launch
        ),
    )
    scratch = dict(
        q_smem=tile_smem((n_c, block_q, head_dim), q.dtype),
        do_smem=tile_smem((n_c, block_q, value_head_dim), q.dtype),
        lse_smem=plgpu.SMEM((n_c, 2, block_q), jnp.float32),  # lse2 and bound rows
        delta_smem=plgpu.SMEM((n_c, block_q), jnp.float32),
        k_smem=tile_smem((n_s, tiles.block_kv_dq, head_dim), q.dtype),
        v_smem=tile_smem((n_s, tiles.block_kv_dq, value_head_dim), q.dtype),
        # Four TMA copies arrive on it: Q, dO, lse rows, delta rows (and the rows' segment ids,
        # and dropout's hashes of the rows).
        q_loaded=plgpu.Barrier(num_arrivals=4 + has_ids + has_drop, num_barriers=n_c),
        # With segment ids a KV tile's ids ride in K's ring slot, and with dropout its keys'
        # hashes: a copy each.
        k_ready=plgpu.Barrier(num_arrivals=1 + has_ids + has_drop, num_barriers=n_s),
        v_ready=plgpu.Barrier(num_barriers=n_s),
        k_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        v_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
    )
    if has_ids:
        scratch.update(
            q_ids_smem=plgpu.SMEM((n_c, block_q), jnp.int32),
            kv_ids_smem=plgpu.SMEM((n_s, tiles.block_kv_dq), jnp.int32),
        )
    if has_drop:
        scratch.update(
            drop_rows_smem=plgpu.SMEM((n_c, 2, block_q), jnp.int32),
            drop_col_smem=plgpu.SMEM((n_s, tiles.block_kv_dq), jnp.int32),
        )
    if tiles.producer_cleans_k and spec.has_key_ranges:
        # A K tile that the producer cleans lands on this barrier, not on k_ready, which the
        # producer arrives on in the copy's place once the tile is clean.
        scratch.update(k_landed=plgpu.Barrier(num_barriers=n_s))
    return warp_specialised_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch,
        grid=(batch, num_heads, num_q_tiles),
        grid_names=("batch", "head", "q_tile"),
        num_consumers=n_c,
    )(q, k, v, d_out, lse2, delta, *(ids or ()), *(drop[1:] if has_drop else ()))


def _masked_by_any(ranges, tile):
    """Whether KV tile `tile` is masked for some consumer, of ranges (every consumer's (lo,
    full_lo, full_hi, hi))."""
    masked = False
    for lo, full_lo, full_hi, hi in ranges:
        masked = masked | ((lo <= tile) & (tile < full_lo)) | ((full_hi <= tile) & (tile < hi))
    return masked


def _load_clean_k(k_tile, k_slot, k_ready, k_landed, *, masked):
    """The dQ kernel's producer (`BackwardTiles.producer_cleans_k`): K of a tile into k_slot,
    arriving on k_ready; where a consumer masks the tile (`masked`), NaN and inf in it become 0
    first (dQ += dS K multiplies a hidden key's zero dS by its K): the copy lands on k_landed,
    the producer cleans the slot and arrives on k_ready in the copy's place. The consumers wait
    on k_ready alone, whichever way the tile came."""

    @pl.when(masked)
    def _():
        plgpu.copy_gmem_to_smem(k_tile, k_slot, k_landed)
        plgpu.barrier_wait(k_landed)
        # In 64 x 64 pieces (Mosaic GPU's layouts take no smaller slice of a swizzled tile): 32
        # elements a thread, over the producer's 24 registers; ptxas may spill them here
        # (`benchmarks/kernel_resources.py` would say).
        zero_non_finite(k_slot)
        plgpu.barrier_arrive(k_ready)

    pl.when(jnp.logical_not(masked))(lambda: plgpu.copy_gmem_to_smem(k_tile, k_slot, k_ready))


@dataclasses.dataclass(frozen=True)
class _KVRing:
    """The K/V shared-memory ring of the dQ kernel: KV tile `first + s` lives in slot
    s % num_stages. *_ready complete when TMA has landed a tile (K's with its segment ids and
    dropout's key hashes), *_free when every consumer is done reading it."""

    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    first: object  # the CTA's first KV tile
    kv_ids_smem: object = None
    drop_col_smem: object = None

    def slot(self, tile):
        return lax.rem(tile - self.first, jnp.int32(self.k_smem.shape[0]))


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    *refs,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_loaded,
    k_ready,
    v_ready,
    k_free,
    v_free,
    q_ids_smem=None,
    kv_ids_smem=None,
    drop_rows_smem=None,
    drop_col_smem=None,
    k_landed=None,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    group: int,
    num_q_tiles: int,
    tiles: BackwardTiles,
    dropout_rate: float = 0.0,
    launch_units: int = 1,
):
    """One CTA: num_consumers * block_q_dq query rows of one head against its keys (FA2
    Algorithm 2's dQ, as its own kernel: no atomics). The grid position (batch, head,
    q_tile) maps to the CTA's by `schedule.grouped_launch` over launch_units (batch, head)
    pairs at a time. The CTA streams KV tiles [first, end),
    tile first + s into ring slot s % num_stages. With segment ids, refs starts with q_ids_ref
    [B, T'], kv_ids_ref [B, S'] and plan_ref [B, ceil(T / cta_q_rows), num_consumers + 1, 4]
    (`schedule.tile_plan` over="q"). With dropout_rate > 0 the dropout tables follow:
    drop_rows_ref [B, N, 2, T''] (each consumer's rows' copied with its Q) and drop_col_ref
    [B, N, S''] (a KV tile's copied with its K)."""
    *id_refs, dq_ref = refs
    drop_col_ref = id_refs.pop() if dropout_rate else None
    drop_rows_ref = id_refs.pop() if dropout_rate else None
    q_ids_ref, kv_ids_ref, plan_ref = id_refs or (None, None, None)
    batch, head, q_tile = launched_cta(("batch", "head", "q_tile"), launch_units)
    if spec.is_causal:
        # The last query tiles see the most keys: launch them first (as in the forward).
        q_tile = num_q_tiles - 1 - q_tile
    cta_q_start = q_tile * tiles.cta_q_rows
    block_kv = tiles.block_kv_dq
    wg = lax.axis_index("wg")
    q_start = cta_q_start + wg * tiles.block_q_dq

    def tile_ranges(consumer=wg):
        """(first, end) of the CTA and (lo, full_lo, full_hi, hi) of a consumer (wg's)."""
        if plan_ref is None:
            consumer_start = cta_q_start + consumer * tiles.block_q_dq
            return _kv_tile_ranges(spec, tiles, cta_q_start, consumer_start)
        # Every thread of the CTA loads the same words: a broadcast from L2.
        cta = tuple(plan_ref[batch, q_tile, tiles.num_consumers, i] for i in (0, 3))
        return cta, tuple(plan_ref[batch, q_tile, consumer, i] for i in range(4))

    cta_range, _ = tile_ranges()
    first, end = cta_range
    ring = _KVRing(
        k_smem, v_smem, k_ready, v_ready, k_free, v_free, first, kv_ids_smem, drop_col_smem
    )

    @pl.when(wg < tiles.num_consumers)
    def _consumer():
        plgpu.set_max_registers(backward_consumer_registers(tiles.num_consumers), action="increase")
        q_rows = (batch, pl.ds(q_start, tiles.block_q_dq), head)
        vector = (batch, head, pl.ds(q_start, tiles.block_q_dq))
        q_smem_c, do_smem_c = q_smem.at[wg], do_smem.at[wg]
        lse_smem_c, delta_smem_c = lse_smem.at[wg], delta_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem_c, q_loaded.at[wg])
        lse_rows = lse2_ref.at[batch, head, :, pl.ds(q_start, tiles.block_q_dq)]
        plgpu.copy_gmem_to_smem(lse_rows, lse_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem_c, q_loaded.at[wg])
        q_ids_smem_c = None
        if q_ids_ref is not None:
            q_ids_smem_c = q_ids_smem.at[wg]
            ids = q_ids_ref.at[batch, pl.ds(q_start, tiles.block_q_dq)]
            plgpu.copy_gmem_to_smem(ids, q_ids_smem_c, q_loaded.at[wg])
        drop_rows_smem_c = None
        if drop_rows_ref is not None:
            drop_rows_smem_c = drop_rows_smem.at[wg]
            hashes = drop_rows_ref.at[batch, head, :, pl.ds(q_start, tiles.block_q_dq)]
            plgpu.copy_gmem_to_smem(hashes, drop_rows_smem_c, q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])
        dq = _consume_dq(
            q_smem_c,
            do_smem_c,
            lse_smem_c,
            delta_smem_c,
            q_ids_smem_c,
            ring,
            q_start=q_start,
            cta_range=cta_range,
            ranges=tile_ranges()[1],
            spec=spec,
            qk_scale=qk_scale,
            scale=scale,
            soft_cap=soft_cap,
            tiles=tiles,
            drop_rows_smem=drop_rows_smem_c,
            dropout_rate=dropout_rate,
        )
        # -- epilogue: Q is dead (its last reader, the final S = Q K^T, is done) --
        q_smem_c[...] = (dq * scale).astype(q_smem_c.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem_c, dq_ref.at[q_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == tiles.num_consumers)
    def _producer():
        plgpu.set_max_registers(BACKWARD_PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))
        consumer_ranges = None
        if k_landed is not None:
            consumer_ranges = [tile_ranges(c)[1] for c in range(tiles.num_consumers)]

        @pl.loop(first, end)
        def _step(tile):
            slot = ring.slot(tile)
            refill = tile - first >= tiles.num_stages
            rows = (batch, pl.ds(tile * block_kv, block_kv), kv_head)
            # K and V are freed separately and V first: dP = dO V^T is done before dQ += dS K,
            # so V is waited for and loaded first, K after.
            pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])
            pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            # The tile's key ids and hashes first: a K tile that the producer cleans holds it
            # up until it has landed.
            if kv_ids_ref is not None:
                ids = kv_ids_ref.at[batch, pl.ds(tile * block_kv, block_kv)]
                plgpu.copy_gmem_to_smem(ids, kv_ids_smem.at[slot], k_ready.at[slot])
            if drop_col_ref is not None:  # the query head's key hashes
                hashes = drop_col_ref.at[batch, head, pl.ds(tile * block_kv, block_kv)]
                plgpu.copy_gmem_to_smem(hashes, drop_col_smem.at[slot], k_ready.at[slot])
            if consumer_ranges is None:
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            else:
                _load_clean_k(
                    k_ref.at[rows],
                    k_smem.at[slot],
                    k_ready.at[slot],
                    k_landed.at[slot],
                    masked=_masked_by_any(consumer_ranges, tile),
                )


def _consume_dq(
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    q_ids_smem,
    ring: _KVRing,
    *,
    q_start,
    cta_range,
    ranges,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    tiles: BackwardTiles,
    drop_rows_smem=None,
    dropout_rate: float = 0.0,
):
    """Consumer warpgroup: dQ / scale of block_q_dq query rows. It walks every CTA step of
    cta_range = (first, end): it computes the tiles of its own range (lo, full_lo, full_hi, hi),
    masking element-wise those outside [full_lo, full_hi), and drains the others (waits for
    them and frees them unread, so that the other consumer's tiles can land in their slots).

    drop_rows_smem: None, or the SMEM [2, block_q_dq] of the rows' dropout hashes (loaded);
    with dropout_rate > 0, dS = P * dcap * (Z * dP - delta), Z from the rows' and the KV
    tile's hashes."""
    block_q, block_kv = tiles.block_q_dq, tiles.block_kv_dq
    head_dim, dtype = q_smem.shape[-1], q_smem.dtype
    tile_shape = (block_q, block_kv)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    lse2, bound = (plgpu.load(lse_smem.at[j], layout=row_layout) for j in (0, 1))
    delta = plgpu.load(delta_smem, layout=row_layout)
    q_seg = None if q_ids_smem is None else plgpu.load(q_ids_smem, layout=row_layout)
    drop_rows = None
    if drop_rows_smem is not None:
        drop_rows = [plgpu.load(drop_rows_smem.at[j], layout=row_layout) for j in (0, 1)]
    first, end = cta_range
    lo, full_lo, full_hi, hi = ranges
    before, after = _dq_mask_sides(spec, tiles)

    def visible_in(tile, slot):
        q_pos = q_start + wgmma_iota(tile_shape, 0)
        kv_pos = tile * block_kv + wgmma_iota(tile_shape, 1)
        if q_seg is None:
            return masks.visible(spec, q_pos, kv_pos)
        # The KV tile's ids ride in K's slot, released after dQ += dS K.
        kv_seg = plgpu.load(ring.kv_ids_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        return masks.visible(
            spec, q_pos, kv_pos, per_row(q_seg, tile_shape), per_col(kv_seg, tile_shape)
        )

    def kv_step(tile, dq, *, masked: bool):
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_wait(ring.v_ready.at[slot])

        # -- S = Q K^T and dP = dO V^T, issued together: one wgmma wait for both --
        def s_dp_into(s_ref, dp_ref):
            plgpu.wgmma(s_ref, q_smem, ring.k_smem.at[slot].T)
            plgpu.wgmma(dp_ref, do_smem, ring.v_smem.at[slot].T)
            return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(
            s_dp_into,
            plgpu.ACC(tile_shape, jnp.float32),
            plgpu.ACC(tile_shape, jnp.float32),
        )
        plgpu.barrier_arrive(ring.v_free.at[slot])
        # dS = P * dcap * (dP - delta): only P * dcap is needed here.
        _, pd = recomputed_probs(
            s, lse2, bound, per_row, qk_scale=qk_scale, scale=scale, soft_cap=soft_cap
        )
        delta_t = per_row(delta, tile_shape)
        if drop_rows is None:
            ds = pd * (dp - delta_t)
        else:
            # O = (P * Z) V: dS = P * dcap * (Z * dP - delta). The KV tile's hashes ride in K's
            # slot, released after dQ += dS K.
            kv_hashes = plgpu.load(ring.drop_col_smem.at[slot], layout=col_layout)
            keep = tile_keep(drop_rows, kv_hashes, tile_shape, rate=dropout_rate, q_axis=0)
            ds = pd * jnp.where(keep, dp * (1.0 / (1.0 - dropout_rate)) - delta_t, -delta_t)
        if masked:
            # Select dS, not P: NaN in V at a key a row cannot see is in dP, and 0 * NaN is NaN.
            ds = jnp.where(visible_in(tile, slot), ds, 0.0)
        ds_in = ds.astype(dtype)

        # -- dQ += dS K --
        def dq_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, ring.k_smem.at[slot])

        dq = pl.run_state(dq_into)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(ring.k_free.at[slot])
        return dq

    def drain_step(tile, carry):
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_arrive(ring.v_free.at[slot])
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_arrive(ring.k_free.at[slot])
        return carry

    masked_step = functools.partial(kv_step, masked=True)
    dq = wgmma_zeros((block_q, head_dim))
    # In the producer's order. Without a side its loops are empty: not emitted.
    if before:
        lax.fori_loop(first, lo, drain_step, None)
        dq = lax.fori_loop(lo, full_lo, masked_step, dq)
    dq = lax.fori_loop(full_lo, full_hi, functools.partial(kv_step, masked=False), dq)
    if after:
        dq = lax.fori_loop(full_hi, hi, masked_step, dq)
        lax.fori_loop(hi, end, drain_step, None)
    return dq
