"""FlashAttention-2 backward (Dao 2023, Algorithm 2): dK/dV, dQ and (when used) dBias kernels.

dK/dV runs over KV tiles and loops over the query tiles (and the query heads of its GQA group)
that see them; dQ runs over query tiles and loops over KV tiles. Neither uses atomics, so the
gradients are bitwise deterministic. P is recomputed from the saved lse; with an lse cotangent the
softmax gradient is dS = P * (dP - delta + dlse), folded into delta = rowsum(dO * O) - dlse. The
bias gradient is dS (through the soft cap), written by its own kernel so that XLA drops it when
nobody asks for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import _dropout, masks
from pallas_flash._numerics import (
    MIN_LOGIT,
    accumulation_dtype,
    lowered_reference,
    probability_bound,
    slack,
)
from pallas_flash._pallas_triton import CompilerParams, fold, load_rows, load_vector
from pallas_flash._vma import pallas_call
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.triton._common import (
    Operands,
    dot,
    dropout_cols,
    dropout_rows,
    finite_or_zero,
    load_pair_tile,
    load_range,
    logit_unit,
    recomputed_probs,
    scores,
    store_rows,
    tile_keep,
    visit_tiles,
)
from pallas_flash.triton.forward import (
    mask_operands,
    pair_spec,
    query_tile,
    tile_bias,
    tile_sizes,
    tile_visible,
    with_dropout_tables,
)
from pallas_flash.triton.tiles import padded_head_dim


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    max_ref,
    delta_ref,
    bound_ref,
    *refs,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    head_dim: int,
    group: int,
    block_q: int,
    block_kv: int,
    has_bias: bool,
    dropout_rate: float = 0.0,
    at_max: bool = False,
):
    """dK, dV of one KV tile of one KV head, summed over the query heads of its group.

    q_ref, do_ref: [T, group, Hp]; max_ref, delta_ref, bound_ref: [group, T]; k/v/dk/dv_ref:
    [block_kv, Hp].
    max_ref holds each row's reference in the units of `scores` (`reference_in_units`: its
    largest logit with at_max, else lse / unit), +inf for rows that see no key (P == 0 there).
    Optional operands: bias/mask [group|-, Tx, block_kv|1], q_seg [T], kv_seg [block_kv], ranges.
    Tiles are computed transposed ([block_kv, block_q]) so that dK and dV accumulate without
    transposing P and dS. With dropout, the dropout tables come last; the keep-mask is
    regenerated from the same global indices as in the forward.
    """
    *refs, dk_ref, dv_ref = refs
    ops = Operands(refs, spec, has_bias=has_bias, has_dropout=dropout_rate > 0)
    kv_tile, kv_head, batch = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_start = kv_tile * block_kv
    kv_rows = spec.kv_len - kv_start
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0
    k = load_rows(k_ref, 0, block_kv, kv_rows, head_dim, ragged=ragged_kv)
    v = load_rows(v_ref, 0, block_kv, kv_rows, head_dim, ragged=ragged_kv)
    kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    kv_seg = None
    if ops.kv_seg is not None:
        kv_seg = load_vector(
            ops.kv_seg, 0, block_kv, kv_rows, ragged=ragged_kv, other=masks.PAD_KV_SEGMENT
        )[:, None]

    def pair_tile(ref, q_start, head):
        head = head if ref.ndim == 3 else None
        tile = load_pair_tile(ref, q_start, block_q, spec.q_len, 0, block_kv, kv_rows, head=head)
        return tile.T

    unit = logit_unit(scale, has_bias, soft_cap)

    def body(i, carry, *, head, drop_col, masked: bool):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        q = load_rows(q_ref, q_start, block_q, spec.q_len, head_dim, ragged=ragged_q, head=head)
        do = load_rows(do_ref, q_start, block_q, spec.q_len, head_dim, ragged=ragged_q, head=head)
        max_u = load_vector(max_ref, q_start, block_q, spec.q_len, ragged=ragged_q, head=head)
        delta = load_vector(delta_ref, q_start, block_q, spec.q_len, ragged=ragged_q, head=head)
        bound = load_vector(bound_ref, q_start, block_q, spec.q_len, ragged=ragged_q, head=head)
        # -- recompute P^T [block_kv, block_q] --
        bias = None if ops.bias is None else pair_tile(ops.bias, q_start, head)
        u_t, dcap_t = scores(dot(k, q, trans_b=True), scale, bias, soft_cap)
        p_t = recomputed_probs(u_t, max_u[None, :], bound[None, :], unit, at_max=at_max)
        v_tile = v
        if masked:
            q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
            q_seg = mask = None
            if ops.q_seg is not None:
                q_seg = load_vector(
                    ops.q_seg, q_start, block_q, spec.q_len, ragged=True, other=masks.PAD_Q_SEGMENT
                )[None, :]
            if ops.mask is not None:
                mask = pair_tile(ops.mask, q_start, head)
            visible = masks.visible(spec, q_idx, kv_idx, q_seg, kv_seg, mask)
            if ragged_q:
                # Rows past T read q = 0: with inf in K at a key only they see (causal, T < S)
                # their logit is NaN, which P^T would carry into that key's dK and dV.
                visible = visible & (q_idx < spec.q_len)
            p_t = jnp.where(visible, p_t, 0.0)
            # A key hidden from some rows: NaN in its V row would reach them via 0 * NaN in dS.
            v_tile = finite_or_zero(v)
        dp_t = dot(v_tile, do, trans_b=True)
        if drop_col is None:
            dv = dv + dot(p_t.astype(do.dtype), do)
        else:
            # O = (P * Z) V with Z = keep / (1 - rate): dV = (P * Z)^T dO, dP = Z * (dO V^T).
            n = kv_head * group + head
            row_mul, row_add = dropout_rows(
                ops.dropout, batch, n, q_start, block_q, spec.q_len, ragged=ragged_q
            )
            keep_t = _dropout.keep(row_mul[None, :], row_add[None, :], drop_col, dropout_rate)
            z_t = _dropout.kept_scale(keep_t, dropout_rate)
            dv = dv + dot((p_t * z_t).astype(do.dtype), do)
            dp_t = dp_t * z_t
        # -- dS^T = P^T * (dP^T - delta), through the soft cap --
        ds_t = p_t * (dp_t - delta[None, :])
        if dcap_t is not None:
            ds_t = ds_t * dcap_t
            if masked:
                # inf in K at a hidden key makes its logit NaN, and tanh's derivative with it.
                ds_t = jnp.where(visible, ds_t, 0.0)
        dk = dk + dot(ds_t.astype(q.dtype), q)
        return dk, dv

    static_range = spec.q_tile_range(kv_start, block_q, block_kv)

    def head_body(head, carry):
        ranges = static_range
        n = kv_head * group + head
        if ops.ranges is not None:
            ranges = masks.intersect(ranges, load_range(ops.ranges, batch, n, kv_tile))
        drop_col = None
        if ops.dropout is not None:  # this head's key columns, once per head
            drop_col = dropout_cols(
                ops.dropout, batch, n, kv_start, block_kv, spec.kv_len, ragged=ragged_kv
            )[:, None]
        return visit_tiles(ranges, functools.partial(body, head=head, drop_col=drop_col), carry)

    hp = k_ref.shape[-1]
    zeros = jnp.zeros((block_kv, hp), accumulation_dtype(k_ref.dtype))
    dk, dv = jax.lax.fori_loop(0, group, head_body, (zeros, zeros))
    store_rows(dk_ref, dk * scale, 0, block_kv, kv_rows, head_dim)
    store_rows(dv_ref, dv, 0, block_kv, kv_rows, head_dim)


def tile_d_logits(q, k, v, do, rows, bias, visible, **options):
    """dS [block_q, block_kv] of one tile, w.r.t. the logits before the soft cap: P recomputed
    from the rows' (max_u, bound, delta) (`recomputed_probs`), zero where `visible` (None:
    everywhere visible) is False. options: `_tile_p_dp`'s."""
    p, dp, dcap = _tile_p_dp(q, k, v, do, rows, bias, visible, **options)
    ds = p * (dp - rows[2][:, None])
    if dcap is None:
        return ds
    ds = ds * dcap
    # inf in K at a hidden key makes its logit NaN, and tanh's derivative with it.
    return ds if visible is None else jnp.where(visible, ds, 0.0)


def tile_capped_row_parts(q, k, v, do, rows, bias, visible, **options):
    """Row sums [block_q, 1] over one tile's keys of (P * dcap * dP, P * dcap, P * dP), from
    which `_dbias_kernel` forms each row's sum of dS with a delta of the backward's own P (a
    soft cap and a bias broadcast over the keys). options: `_tile_p_dp`'s."""
    p, dp, dcap = _tile_p_dp(q, k, v, do, rows, bias, visible, **options)
    pd = p * dcap
    if visible is not None:  # inf in K at a hidden key: NaN in dcap
        pd = jnp.where(visible, pd, 0.0)
    return tuple(jnp.sum(x, axis=1, keepdims=True) for x in (pd * dp, pd, p * dp))


def _tile_p_dp(
    q, k, v, do, rows, bias, visible, *, scale: float, soft_cap, kept_scale=None, at_max=False
):
    """(P, dP, dcap) of one tile (dcap None without a soft cap); P is 0 where `visible` is
    False. kept_scale: None, or dropout's Z (1 / (1 - rate) where kept, else 0): dP = Z * (dO
    V^T)."""
    max_u, bound, _ = rows
    u, dcap = scores(dot(q, k, trans_b=True), scale, bias, soft_cap)
    unit = logit_unit(scale, bias is not None, soft_cap)
    p = recomputed_probs(u, max_u[:, None], bound[:, None], unit, at_max=at_max)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
        # A key hidden from some rows: NaN in its V row would reach them via 0 * NaN in dP.
        v = finite_or_zero(v)
    dp = dot(do, v, trans_b=True)
    if kept_scale is not None:
        dp = dp * kept_scale
    return p, dp, dcap


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    max_ref,
    delta_ref,
    bound_ref,
    *refs,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    head_dim: int,
    block_q: int,
    block_kv: int,
    has_bias: bool,
    dropout_rate: float = 0.0,
    at_max: bool = False,
):
    """dQ of one query tile of one head: loop over KV tiles.

    q_ref, do_ref, dq_ref: [block_q, Hp]; k_ref, v_ref: [S, Hp]; max_ref, delta_ref, bound_ref:
    [block_q].
    Optional operands as in the forward kernel.
    """
    *refs, dq_ref = refs
    ops = Operands(refs, spec, has_bias=has_bias, has_dropout=dropout_rate > 0)
    tile_ds = functools.partial(tile_d_logits, scale=scale, soft_cap=soft_cap, at_max=at_max)
    tile = query_tile(pl.program_id(0), spec.q_len, block_q)
    head, batch = pl.program_id(1), pl.program_id(2)
    q_start = tile * block_q
    q_rows = spec.q_len - q_start
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0
    drop_rows = None
    if ops.dropout is not None:  # the rows' hashes, once per program
        row_mul, row_add = dropout_rows(
            ops.dropout, batch, head, q_start, block_q, spec.q_len, ragged=ragged_q
        )
        drop_rows = (row_mul[:, None], row_add[:, None])
    q = load_rows(q_ref, 0, block_q, q_rows, head_dim, ragged=ragged_q)
    do = load_rows(do_ref, 0, block_q, q_rows, head_dim, ragged=ragged_q)
    rows = tuple(
        load_vector(ref, 0, block_q, q_rows, ragged=ragged_q)
        for ref in (max_ref, bound_ref, delta_ref)
    )
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    q_seg = None
    if ops.q_seg is not None:
        q_seg = load_vector(
            ops.q_seg, 0, block_q, q_rows, ragged=ragged_q, other=masks.PAD_Q_SEGMENT
        )[:, None]

    def body(j, dq, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        k = load_rows(k_ref, kv_start, block_kv, spec.kv_len, head_dim, ragged=masked and ragged_kv)
        v = load_rows(v_ref, kv_start, block_kv, spec.kv_len, head_dim, ragged=masked and ragged_kv)
        bias = tile_bias(ops, spec, q_rows, kv_start, block_q, block_kv)
        visible = None
        if masked:
            visible = tile_visible(ops, spec, q_idx, q_seg, q_rows, kv_start, block_q, block_kv)
        z = None
        if drop_rows is not None:
            keep = tile_keep(
                ops.dropout,
                drop_rows,
                batch,
                head,
                kv_start,
                block_kv,
                spec.kv_len,
                dropout_rate,
                ragged=masked and ragged_kv,
            )
            z = _dropout.kept_scale(keep, dropout_rate)
        ds = tile_ds(q, k, v, do, rows, bias, visible, kept_scale=z)
        if masked:
            # dS is 0 at hidden keys, but 0 * NaN in dS.K is not.
            k = finite_or_zero(k)
        return dq + dot(ds.astype(k.dtype), k)

    ranges = spec.kv_tile_range(q_start, block_q, block_kv)
    if ops.ranges is not None:
        ranges = masks.intersect(ranges, load_range(ops.ranges, batch, head, tile))
    hp = q_ref.shape[-1]
    dq = visit_tiles(ranges, body, jnp.zeros((block_q, hp), accumulation_dtype(q_ref.dtype)))
    store_rows(dq_ref, dq * scale, 0, block_q, q_rows, head_dim)


def _dbias_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    max_ref,
    delta_ref,
    bound_ref,
    *refs,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    head_dim: int,
    group: int,
    block_q: int,
    block_kv: int,
    batches: int,
    heads: int,
    sum_rows: bool,
    sum_cols: bool,
    dropout_rate: float = 0.0,
    at_max: bool = False,
    capped_rows: bool = False,
):
    """dBias of one query tile of one (bias batch, bias head), summed over the bias's broadcast
    dims in registers: the loop over KV tiles sums, inside, over the `batches` x `heads` (batch,
    head) pairs that share the bias (one pair for a full bias). With sum_rows (bias broadcast over
    queries) each KV tile's column sums are written, one row per query tile (the caller adds the
    query tiles); with sum_cols (broadcast over keys) the row sums accumulate over the KV tiles and
    are written once. Nothing of shape [B, N, T, S] is written for a broadcast bias; the sums have
    a fixed order. Every output entry is written (zeros for tiles nobody sees).

    capped_rows (sum_cols with a soft cap): refs starts with dlse_ref [batches, heads, block_q],
    and each pair's row sum of dS = P * dcap * (dP - delta) is formed from the row sums
    (`tile_capped_row_parts`) as sum(P dcap dP) - (sum(P dP) - dlse) * sum(P dcap): with
    rowsum(P * dP), of the backward's own P, in place of rowsum(dO * out). The two agree but for
    rounding: out is the forward's, from P rounded to 16 bits for P V, then stored in 16 bits;
    the rows' differences, each times sum(P dcap) (no closed form cancels them as without a
    cap), summed over every row of a broadcast bias, were 3-6x the error of attention computed
    in 16 bits (docs/notes/numerics.md, "Sinks, biases and soft caps").

    q_ref, do_ref: [batches, block_q, heads, Hp]; k_ref, v_ref: [batches, S, kv heads, Hp];
    max_ref, delta_ref, bound_ref: [batches, heads, block_q]; bias [block_q|1, S|1]; q_seg
    [batches, block_q], kv_seg [batches, S]; mask [batches|1, heads|1, block_q|1, S|1]; ranges;
    out [block_q|1, S|1].
    """
    *refs, out_ref = refs
    dlse_ref = None
    if capped_rows:
        dlse_ref, *refs = refs
    ops = Operands(refs, spec, has_bias=True, has_dropout=dropout_rate > 0)
    tile_ds = functools.partial(tile_d_logits, scale=scale, soft_cap=soft_cap, at_max=at_max)
    tile_parts = functools.partial(
        tile_capped_row_parts, scale=scale, soft_cap=soft_cap, at_max=at_max
    )
    tile = query_tile(pl.program_id(0), spec.q_len, block_q)
    bias_head, bias_batch = pl.program_id(1), pl.program_id(2)
    q_start = tile * block_q
    q_rows = spec.q_len - q_start
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    members = batches * heads
    zero = jnp.int32(0)  # traced indices: the interpreter rejects Python ints in these indexers
    acc = accumulation_dtype(q_ref.dtype)

    def member(m):
        """(local batch, local head) of the m-th (batch, head) pair sharing the bias."""
        # lax.div/rem: jnp's floor division lowers to a comparison that Triton rejects. The loop
        # index is int64 under jax_enable_x64: the kernels index in int32.
        m = jax.lax.convert_element_type(m, jnp.int32)
        return jax.lax.div(m, jnp.int32(heads)), jax.lax.rem(m, jnp.int32(heads))

    def query_rows(m):
        """q, dO, the rows' (max_u, bound, delta) and segment ids of pair m's query tile."""
        bi, ni = member(m)
        rows = dict(ragged=ragged_q, head=ni, lead=(bi,))
        q_seg = None
        if ops.q_seg is not None:
            q_seg = load_vector(
                ops.q_seg,
                0,
                block_q,
                q_rows,
                ragged=ragged_q,
                other=masks.PAD_Q_SEGMENT,
                lead=(bi,),
            )[:, None]
        return (
            load_rows(q_ref, 0, block_q, q_rows, head_dim, **rows),
            load_rows(do_ref, 0, block_q, q_rows, head_dim, **rows),
            tuple(
                load_vector(ref, 0, block_q, q_rows, **rows)
                for ref in (max_ref, bound_ref, delta_ref)
            ),
            q_seg,
        )

    # One pair (a bias broadcast over queries/keys only): its rows stay loaded across KV tiles.
    hoisted = query_rows(zero) if members == 1 else None

    def d_logits(m, kv_start, bias, masked, parts=False):
        """dS of pair m's tile; with parts, `tile_capped_row_parts`'s row sums instead."""
        bi, ni = member(m)
        q, do, row_values, q_seg = hoisted or query_rows(m)
        kv_head = jax.lax.div(ni, jnp.int32(group)) if k_ref.shape[2] > 1 else zero
        keys = dict(ragged=masked and ragged_kv, head=kv_head, lead=(bi,))
        k = load_rows(k_ref, kv_start, block_kv, spec.kv_len, head_dim, **keys)
        v = load_rows(v_ref, kv_start, block_kv, spec.kv_len, head_dim, **keys)
        visible = None
        if masked:
            mask_lead = ()
            if ops.mask is not None:
                mb, mn = ops.mask.shape[0], ops.mask.shape[1]
                mask_lead = (bi if mb > 1 else zero, ni if mn > 1 else zero)
            visible = tile_visible(
                ops,
                spec,
                q_idx,
                q_seg,
                q_rows,
                kv_start,
                block_q,
                block_kv,
                seg_lead=(bi,),
                mask_lead=mask_lead,
            )
        z = None
        if ops.dropout is not None:
            # The global (batch, head) of pair m: blocks of `batches` x `heads` pairs.
            b, n = bias_batch * batches + bi, bias_head * heads + ni
            tile = dict(ragged=ragged_q)
            row_mul, row_add = dropout_rows(ops.dropout, b, n, q_start, block_q, spec.q_len, **tile)
            col = dropout_cols(
                ops.dropout, b, n, kv_start, block_kv, spec.kv_len, ragged=masked and ragged_kv
            )
            keep = _dropout.keep(row_mul[:, None], row_add[:, None], col[None, :], dropout_rate)
            z = _dropout.kept_scale(keep, dropout_rate)
        if parts:
            return tile_parts(q, k, v, do, row_values, bias, visible, kept_scale=z)
        return tile_ds(q, k, v, do, row_values, bias, visible, kept_scale=z)

    ranges = spec.kv_tile_range(q_start, block_q, block_kv)
    if ops.ranges is not None and members == 1:
        ranges = masks.intersect(ranges, load_range(ops.ranges, bias_batch, bias_head, tile))
    elif ops.ranges is not None:
        # The pairs' visible tiles differ (segment ids, lengths, a per-head mask): visit the union
        # of their ranges and mask every tile element-wise.
        def union(m, lo_hi):
            bi, ni = member(m)
            b = bi if batches > 1 else bias_batch
            n = ni if heads > 1 else bias_head
            lo, _, _, hi = masks.intersect(ranges, load_range(ops.ranges, b, n, tile))
            return jnp.minimum(lo_hi[0], lo), jnp.maximum(lo_hi[1], hi)

        big = jnp.int32(jnp.iinfo(jnp.int32).max)
        lo, hi = jax.lax.fori_loop(0, members, union, (big, jnp.int32(0)))
        lo = jnp.minimum(lo, hi)
        ranges = (lo, hi, hi, hi)

    # Rows past T and keys past S have dS == 0 (zero dO, masked P), so the sums need no masks.
    out_rows = 1 if sum_rows else block_q
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (out_rows, 1), 0) < (1 if sum_rows else q_rows)

    def store(kv_start, value, width):
        cols = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < spec.kv_len
        # int32 start indices for both dims: under jax_enable_x64 a `:` would index in int64,
        # which the interpreter cannot mix with the int32 kv_start.
        start = jax.lax.convert_element_type(kv_start, jnp.int32)
        tile = out_ref.at[pl.ds(zero, out_rows), pl.ds(start, width)]
        plgpu.store(tile, value.astype(out_ref.dtype), mask=row_ok & cols)

    def zero_body(j, carry):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        store(kv_start, jnp.zeros((out_rows, block_kv), acc), block_kv)
        return carry

    def tile_body(j, row_sums, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        bias = tile_bias(ops, spec, q_rows, kv_start, block_q, block_kv)  # shared by the pairs
        if members == 1:
            total = d_logits(zero, kv_start, bias, masked)
        else:
            total = jax.lax.fori_loop(
                0,
                members,
                lambda m, acc: acc + d_logits(m, kv_start, bias, masked),
                jnp.zeros((block_q, block_kv), acc),
            )
        if sum_rows:
            total = jnp.sum(total, axis=0, keepdims=True)
        if sum_cols:
            return row_sums + jnp.sum(total, axis=1, keepdims=True)
        store(kv_start, total, block_kv)
        return row_sums

    lo, _, _, hi = ranges
    row_sums = jnp.zeros((out_rows, 1), acc)
    if capped_rows:
        # Pair by pair: each pair's rows need all of its keys' sums before they combine.
        def pair_rows(m, row_sums):
            def parts_body(j, sums, *, masked: bool):
                kv_start = pl.multiple_of(j * block_kv, block_kv)
                bias = tile_bias(ops, spec, q_rows, kv_start, block_q, block_kv)
                parts = d_logits(m, kv_start, bias, masked, parts=True)
                return tuple(a + b for a, b in zip(sums, parts, strict=True))

            zeros = tuple(jnp.zeros((block_q, 1), acc) for _ in range(3))
            capped_dp, capped, dp = visit_tiles(ranges, parts_body, zeros)
            bi, ni = member(m)
            dlse = load_vector(dlse_ref, 0, block_q, q_rows, ragged=ragged_q, head=ni, lead=(bi,))
            rows = capped_dp - (dp - dlse[:, None]) * capped
            if sum_rows:
                rows = jnp.sum(rows, axis=0, keepdims=True)
            return row_sums + rows

        store(0, fold(0, members, pair_rows, row_sums), 1)
        return
    if not sum_cols:
        fold(0, lo, zero_body, 0)
    row_sums = visit_tiles(ranges, tile_body, row_sums)
    if sum_cols:
        store(0, row_sums, 1)
    else:
        fold(hi, pl.cdiv(spec.kv_len, block_kv), zero_body, 0)


def reference_in_units(lse, row_max, unit: float):
    """Each row's reference for `recomputed_probs` [B, N, T], in the units of `scores`: its
    largest logit (row_max, the Triton forward's), or without it lse / unit, lowered by the
    slack of its |lse| (`_numerics.slack`): a row's dominant logit, recomputed by another
    matmul, then lands on the clamp P <= 1 / l at any magnitude. +inf for rows that saw no key
    (lse == -inf) and rows a sink of +inf takes (lse == +inf): P is exactly 0 there."""
    seen = jnp.isfinite(lse)
    lse = jnp.where(seen, lse, 0.0)
    if row_max is None:
        reference = lowered_reference(lse) / unit
    else:
        reference = row_max - slack(lse) / unit
    # Held at MIN_LOGIT (`_numerics.lowered_reference`): never -inf for a row that saw a key.
    return jnp.where(seen, jnp.maximum(reference, MIN_LOGIT), jnp.inf)


def flash_backward(
    q,
    k,
    v,
    bias,
    arrays: MaskArrays,
    out,
    lse,
    log_sum,
    row_max,
    d_out,
    d_lse,
    *,
    config,
    bias_gradient: bool = True,
):
    """(dq, dk, dv, dbias) for the cotangents d_out [B, T, N, H] and d_lse [B, N, T] (float32).

    log_sum: None, or the forward's [B, N, T] log of each row's softmax denominator relative to
    its largest logit (`flash_forward(..., with_log_sum=True)`): with it, keys that tie at a
    row's largest logit get P = 1 / (number of ties) at any magnitude; without, P = 1 there
    once |lse| passes ~1e6 (exact for one dominant logit).
    row_max: None, or the Triton forward's row max [B, N, T] (`flash_forward(...,
    with_row_max=True)`, with its log_sum): P is then recomputed relative to it, free of lse's
    float32 rounding (an ulp of |lse| in every P, which float32 inputs with logits in the
    hundreds show); without, relative to lse, one add fewer per element (`recomputed_probs`).
    config: the call's `KernelConfig`, as `flash_forward` takes it (read here: spec, scale,
    soft_cap, dropout_rate, block_sizes, interpret).
    dbias is None without a bias or with bias_gradient=False, else the bias's shape and dtype
    (summed over its broadcast dims).
    """
    spec, scale, soft_cap = config.spec, config.scale, config.soft_cap
    block_sizes, interpret, dropout_rate = config.block_sizes, config.interpret, config.dropout_rate
    q_len, kv_len = q.shape[1], k.shape[1]
    has_bias = bias is not None
    assert row_max is None or log_sum is not None, "the row max goes with the forward's log_sum"

    # -- preprocess (XLA fuses it into one pass): delta, and each row's reference and clamp --
    acc = accumulation_dtype(q.dtype)  # float32, float64 for float64 inputs (the interpreter)
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(acc), d_out.astype(acc)) - d_lse.astype(acc)
    max_u = reference_in_units(lse, row_max, logit_unit(scale, has_bias, soft_cap))
    at_max = row_max is not None
    # P's clamp, in log2 units: P <= 1 / l.
    bound = probability_bound(log_sum, lse)

    rows = (max_u, delta, bound)
    # -- dK, dV: grid over KV tiles, each summing over its group's query heads --
    dk, dv = _dkv(q, k, v, bias, arrays, d_out, rows, config=config, at_max=at_max)
    # -- dQ, and dBias in its own kernel (XLA drops it when nobody asks): grids over query tiles --
    block_q, block_kv = tile_sizes(block_sizes.block_q_dq, q_len, block_sizes.block_kv_dq, kv_len)
    blocks = (block_q, block_kv)
    dq = _dq(q, k, v, bias, arrays, d_out, rows, config=config, at_max=at_max, blocks=blocks)
    dbias = None
    if has_bias and bias_gradient:
        dbias = _dbias(
            q,
            k,
            v,
            bias,
            arrays,
            d_out,
            max_u,
            delta,
            bound,
            spec=spec,
            scale=scale,
            soft_cap=soft_cap,
            block_q=block_q,
            block_kv=block_kv,
            block_sizes=block_sizes,
            interpret=interpret,
            dropout_rate=dropout_rate,
            at_max=at_max,
            d_lse=d_lse,
        )
    return dq, dk, dv, dbias


def _dkv(q, k, v, bias, arrays: MaskArrays, d_out, rows, *, config, at_max: bool):
    """(dk, dv): the dK/dV kernel, a grid over KV tiles, each summing over its group's query
    heads. rows: the preprocess's (max_u, delta, bound) [B, N, T]."""
    spec, scale, soft_cap = config.spec, config.scale, config.soft_cap
    block_sizes, interpret, dropout_rate = config.block_sizes, config.interpret, config.dropout_rate
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    hp = padded_head_dim(head_dim)
    has_bias = bias is not None
    max_u, delta, bound = rows
    block_q, block_kv = tile_sizes(block_sizes.block_q_dkv, q_len, block_sizes.block_kv_dkv, kv_len)
    dkv_kernel = functools.partial(
        _dkv_kernel,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        head_dim=head_dim,
        group=group,
        block_q=block_q,
        block_kv=block_kv,
        has_bias=has_bias,
        dropout_rate=dropout_rate,
        at_max=at_max,
    )
    kv_tile = pl.BlockSpec((None, block_kv, None, hp), lambda j, h, b: (b, j, h, 0))
    q_group = pl.BlockSpec((None, q_len, group, hp), lambda j, h, b: (b, 0, h, 0))
    row_group = pl.BlockSpec((None, group, q_len), lambda j, h, b: (b, h, 0))

    def group_pair_spec(shape):
        bx, nx, tx, sx = shape
        block = (None, group if nx > 1 else None, tx, block_kv if sx > 1 else 1)
        return pl.BlockSpec(
            block, lambda j, h, b: (b if bx > 1 else 0, h if nx > 1 else 0, 0, j if sx > 1 else 0)
        )

    operands = [q, k, v, d_out, max_u, delta, bound]
    in_specs = [q_group, kv_tile, kv_tile, q_group, row_group, row_group, row_group]
    if has_bias:
        operands.append(bias)
        in_specs.append(group_pair_spec(bias.shape))
    if spec.has_segments:
        operands += [arrays.q_segment_ids, arrays.kv_segment_ids]
        in_specs += [
            pl.BlockSpec((None, q_len), lambda j, h, b: (b, 0)),
            pl.BlockSpec((None, block_kv), lambda j, h, b: (b, j)),
        ]
    if spec.mask_shape is not None:
        operands.append(arrays.mask)
        in_specs.append(group_pair_spec(arrays.mask.shape))
    ranges = masks.tile_ranges(spec, arrays, block_q, block_kv, over="kv")
    if ranges is not None:
        operands.append(ranges)
        in_specs.append(pl.BlockSpec(ranges.shape, lambda j, h, b: (0, 0, 0, 0)))
    operands, in_specs = with_dropout_tables(operands, in_specs, arrays, dropout_rate, spec)
    dk, dv = pallas_call(
        dkv_kernel,
        grid=(pl.cdiv(kv_len, block_kv), num_kv_heads, batch),
        in_specs=in_specs,
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps_dkv, num_stages=block_sizes.num_stages_dkv
        ),
        interpret=interpret,
        name="pallas_flash_backward_dkv",
    )(*operands)
    return dk, dv


def _dq(q, k, v, bias, arrays: MaskArrays, d_out, rows, *, config, at_max: bool, blocks):
    """dq: the dQ kernel, a grid over query tiles of blocks = (block_q, block_kv). rows: the
    preprocess's (max_u, delta, bound) [B, N, T]."""
    spec, scale, soft_cap = config.spec, config.scale, config.soft_cap
    block_sizes, interpret, dropout_rate = config.block_sizes, config.interpret, config.dropout_rate
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    hp = padded_head_dim(head_dim)
    has_bias = bias is not None
    max_u, delta, bound = rows
    block_q, block_kv = blocks
    q_tile = functools.partial(query_tile, q_len=q_len, block_q=block_q)
    q_spec = pl.BlockSpec((None, block_q, None, hp), lambda i, n, b: (b, q_tile(i), n, 0))
    kv_full = pl.BlockSpec((None, kv_len, None, hp), lambda i, n, b: (b, 0, n // group, 0))
    row_tile = pl.BlockSpec((None, None, block_q), lambda i, n, b: (b, n, q_tile(i)))
    operands = [q, k, v, d_out, max_u, delta, bound]
    in_specs = [q_spec, kv_full, kv_full, q_spec, row_tile, row_tile, row_tile]
    if has_bias:
        operands.append(bias)
        in_specs.append(pair_spec(bias.shape, block_q, q_tile))
    ranges = masks.tile_ranges(spec, arrays, block_q, block_kv, over="q")
    extra, extra_specs = mask_operands(spec, arrays, block_q, q_tile, ranges)
    extra, extra_specs = with_dropout_tables(extra, extra_specs, arrays, dropout_rate, spec)

    dq = pallas_call(
        functools.partial(
            _dq_kernel,
            spec=spec,
            scale=scale,
            soft_cap=soft_cap,
            head_dim=head_dim,
            block_q=block_q,
            block_kv=block_kv,
            has_bias=has_bias,
            dropout_rate=dropout_rate,
            at_max=at_max,
        ),
        grid=(pl.cdiv(q_len, block_q), num_heads, batch),
        in_specs=in_specs + extra_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps_dq, num_stages=block_sizes.num_stages_dq
        ),
        interpret=interpret,
        name="pallas_flash_backward_dq",
    )(*operands, *extra)
    return dq


def _dbias(
    q,
    k,
    v,
    bias,
    arrays,
    d_out,
    max_u,
    delta,
    bound,
    *,
    spec,
    scale,
    soft_cap,
    block_q,
    block_kv,
    block_sizes,
    interpret,
    dropout_rate=0.0,
    at_max=False,
    d_lse=None,
):
    """dBias with the bias's shape [Bb, Nb, Tb, Sb], summed over its broadcast dims in the kernel
    (_dbias_kernel); over queries, the per-query-tile sums are added here (in float32). d_lse
    [B, N, T] float32: the lse cotangent, which a bias broadcast over the keys with a soft cap
    reads (`_dbias_kernel`'s capped_rows)."""
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    hp = padded_head_dim(head_dim)
    bias_batch, bias_heads = bias.shape[0], bias.shape[1]
    sum_b, sum_n = bias_batch == 1 < batch, bias_heads == 1 < num_heads
    sum_rows, sum_cols = bias.shape[2] == 1 < q_len, bias.shape[3] == 1 < kv_len
    batches, heads = (batch if sum_b else 1), (num_heads if sum_n else 1)
    kv_heads = num_kv_heads if sum_n else 1
    q_tile = functools.partial(query_tile, q_len=q_len, block_q=block_q)

    def b_idx(b):
        return 0 if sum_b else b

    q_spec = pl.BlockSpec(
        (batches, block_q, heads, hp), lambda i, n, b: (b_idx(b), q_tile(i), 0 if sum_n else n, 0)
    )
    kv_spec = pl.BlockSpec(
        (batches, kv_len, kv_heads, hp),
        lambda i, n, b: (b_idx(b), 0, 0 if sum_n else n // group, 0),
    )
    row_spec = pl.BlockSpec(
        (batches, heads, block_q), lambda i, n, b: (b_idx(b), 0 if sum_n else n, q_tile(i))
    )
    operands = [q, k, v, d_out, max_u, delta, bound]
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, row_spec]
    capped_rows = sum_cols and soft_cap is not None
    if capped_rows:
        operands.append(d_lse.astype(delta.dtype))
        in_specs.append(row_spec)
    operands.append(bias)
    in_specs.append(pair_spec(bias.shape, block_q, q_tile))
    if spec.has_segments:
        operands += [arrays.q_segment_ids, arrays.kv_segment_ids]
        in_specs += [
            pl.BlockSpec((batches, block_q), lambda i, n, b: (b_idx(b), q_tile(i))),
            pl.BlockSpec((batches, kv_len), lambda i, n, b: (b_idx(b), 0)),
        ]
    if spec.mask_shape is not None:
        mb, mn, mt, ms = arrays.mask.shape
        block = (
            batches if mb > 1 else 1,
            heads if mn > 1 else 1,
            block_q if mt > 1 else 1,
            ms,
        )
        operands.append(arrays.mask)
        in_specs.append(
            pl.BlockSpec(
                block,
                lambda i, n, b: (
                    b_idx(b) if mb > 1 else 0,
                    (0 if sum_n else n) if mn > 1 else 0,
                    q_tile(i) if mt > 1 else 0,
                    0,
                ),
            )
        )
    ranges = masks.tile_ranges(spec, arrays, block_q, block_kv, over="q")
    if ranges is not None:
        operands.append(ranges)
        in_specs.append(pl.BlockSpec(ranges.shape, lambda i, n, b: (0, 0, 0, 0)))
    operands, in_specs = with_dropout_tables(operands, in_specs, arrays, dropout_rate, spec)
    kernel = functools.partial(
        _dbias_kernel,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        head_dim=head_dim,
        group=group,
        block_q=block_q,
        block_kv=block_kv,
        batches=batches,
        heads=heads,
        sum_rows=sum_rows,
        sum_cols=sum_cols,
        dropout_rate=dropout_rate,
        at_max=at_max,
        capped_rows=capped_rows,
    )
    num_q_tiles = pl.cdiv(q_len, block_q)
    out_rows, out_cols = (1 if sum_rows else block_q), (1 if sum_cols else kv_len)
    dbias = pallas_call(
        kernel,
        grid=(num_q_tiles, bias_heads, bias_batch),
        in_specs=in_specs,
        out_specs=pl.BlockSpec(
            (None, None, out_rows, out_cols), lambda i, n, b: (b, n, q_tile(i), 0)
        ),
        out_shape=jax.ShapeDtypeStruct(
            (bias_batch, bias_heads, num_q_tiles if sum_rows else q_len, out_cols),
            delta.dtype if sum_rows else bias.dtype,
        ),
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps_dq, num_stages=block_sizes.num_stages_dq
        ),
        interpret=interpret,
        name="pallas_flash_backward_dbias",
    )(*operands)
    if sum_rows:
        dbias = jnp.sum(dbias, axis=2, keepdims=True).astype(bias.dtype)
    return dbias
