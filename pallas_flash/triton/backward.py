"""FlashAttention-2 backward (Dao 2023, Algorithm 2): a dK/dV kernel and a dQ kernel.

dK/dV runs over KV tiles and loops over the query tiles (and the query heads of its GQA group)
that see them; dQ runs over query tiles and loops over KV tiles. Neither uses atomics, so the
gradients are bitwise deterministic. P is recomputed from the saved lse; with an lse cotangent the
softmax gradient is dS = P * (dP - delta + dlse), folded into delta = rowsum(dO * O) - dlse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_flash.config import BlockSizes, padded_head_dim
from pallas_flash.masks import MaskSpec
from pallas_flash.triton._common import (
    LOG2E,
    CompilerParams,
    dot,
    fold,
    load_rows,
    load_vector,
    store_rows,
)
from pallas_flash.triton.forward import query_tile, tile_sizes


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    spec: MaskSpec,
    scale: float,
    head_dim: int,
    group: int,
    block_q: int,
    block_kv: int,
):
    """dK, dV of one KV tile of one KV head, summed over the query heads of its group.

    q_ref, do_ref: [T, group, Hp]; lse_ref, delta_ref: [group, T]; k/v/dk/dv_ref: [block_kv, Hp].
    lse_ref holds lse * log2(e), with +inf for rows that see no key (so that P == 0 there).
    """
    kv_start = pl.program_id(0) * block_kv
    kv_rows = spec.kv_len - kv_start
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0
    qk_scale = scale * LOG2E
    k = load_rows(k_ref, 0, block_kv, kv_rows, head_dim, ragged=ragged_kv)
    v = load_rows(v_ref, 0, block_kv, kv_rows, head_dim, ragged=ragged_kv)
    kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)

    def body(i, carry, *, head, masked: bool):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        q = load_rows(q_ref, q_start, block_q, spec.q_len, head_dim, ragged=ragged_q, head=head)
        do = load_rows(do_ref, q_start, block_q, spec.q_len, head_dim, ragged=ragged_q, head=head)
        lse2 = load_vector(lse_ref, q_start, block_q, spec.q_len, ragged=ragged_q, head=head)
        delta = load_vector(delta_ref, q_start, block_q, spec.q_len, ragged=ragged_q, head=head)
        # -- recompute P^T [block_kv, block_q] --
        p_t = jnp.exp2(dot(k, q, trans_b=True) * qk_scale - lse2[None, :])
        if masked:
            q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
            p_t = jnp.where(spec.visible(q_idx, kv_idx), p_t, 0.0)
        dv = dv + dot(p_t.astype(do.dtype), do)
        # -- dS^T = P^T * (dP^T - delta) --
        dp_t = dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + dot(ds_t.astype(q.dtype), q)
        return dk, dv

    lo, full_lo, full_hi, hi = spec.q_tile_range(kv_start, block_q, block_kv)

    def head_body(head, carry):
        carry = fold(lo, full_lo, functools.partial(body, head=head, masked=True), carry)
        carry = fold(full_lo, full_hi, functools.partial(body, head=head, masked=False), carry)
        return fold(full_hi, hi, functools.partial(body, head=head, masked=True), carry)

    hp = k_ref.shape[-1]
    zeros = jnp.zeros((block_kv, hp), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, head_body, (zeros, zeros))
    store_rows(dk_ref, dk * scale, 0, block_kv, kv_rows, head_dim)
    store_rows(dv_ref, dv, 0, block_kv, kv_rows, head_dim)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    spec: MaskSpec,
    scale: float,
    head_dim: int,
    block_q: int,
    block_kv: int,
):
    """dQ of one query tile of one head: loop over the KV tiles it sees.

    q_ref, do_ref, dq_ref: [block_q, Hp]; k_ref, v_ref: [S, Hp]; lse_ref, delta_ref: [block_q].
    """
    q_start = query_tile(pl.program_id(0), spec.q_len, block_q) * block_q
    q_rows = spec.q_len - q_start
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0
    qk_scale = scale * LOG2E
    q = load_rows(q_ref, 0, block_q, q_rows, head_dim, ragged=ragged_q)
    do = load_rows(do_ref, 0, block_q, q_rows, head_dim, ragged=ragged_q)
    lse2 = load_vector(lse_ref, 0, block_q, q_rows, ragged=ragged_q)
    delta = load_vector(delta_ref, 0, block_q, q_rows, ragged=ragged_q)
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)

    def body(j, dq, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        k = load_rows(k_ref, kv_start, block_kv, spec.kv_len, head_dim, ragged=masked and ragged_kv)
        v = load_rows(v_ref, kv_start, block_kv, spec.kv_len, head_dim, ragged=masked and ragged_kv)
        p = jnp.exp2(dot(q, k, trans_b=True) * qk_scale - lse2[:, None])
        if masked:
            kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            p = jnp.where(spec.visible(q_idx, kv_idx), p, 0.0)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    hp = q_ref.shape[-1]
    dq = jnp.zeros((block_q, hp), jnp.float32)
    lo, full_lo, full_hi, hi = spec.kv_tile_range(q_start, block_q, block_kv)
    dq = fold(lo, full_lo, functools.partial(body, masked=True), dq)
    dq = fold(full_lo, full_hi, functools.partial(body, masked=False), dq)
    dq = fold(full_hi, hi, functools.partial(body, masked=True), dq)
    store_rows(dq_ref, dq * scale, 0, block_q, q_rows, head_dim)


def flash_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    d_lse,
    *,
    spec: MaskSpec,
    scale: float,
    block_sizes: BlockSizes,
    interpret: bool,
):
    """(dq, dk, dv) for the cotangents d_out [B, T, N, H] and d_lse [B, N, T] (float32)."""
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    hp = padded_head_dim(head_dim)

    # -- preprocess (XLA fuses it into one pass): delta, and lse in log2 units --
    delta = jnp.einsum(
        "btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32)
    ) - d_lse.astype(jnp.float32)
    # Rows that saw no key have lse == -inf; +inf makes exp2(s - lse) exactly 0 there.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)

    # -- dK, dV: grid over KV tiles, each summing over its group's query heads --
    block_q, block_kv = tile_sizes(block_sizes.block_q_dkv, q_len, block_sizes.block_kv_dkv, kv_len)
    dkv_kernel = functools.partial(
        _dkv_kernel,
        spec=spec,
        scale=scale,
        head_dim=head_dim,
        group=group,
        block_q=block_q,
        block_kv=block_kv,
    )
    kv_tile = pl.BlockSpec((None, block_kv, None, hp), lambda j, h, b: (b, j, h, 0))
    q_group = pl.BlockSpec((None, q_len, group, hp), lambda j, h, b: (b, 0, h, 0))
    row_group = pl.BlockSpec((None, group, q_len), lambda j, h, b: (b, h, 0))
    dk, dv = pl.pallas_call(
        dkv_kernel,
        grid=(pl.cdiv(kv_len, block_kv), num_kv_heads, batch),
        in_specs=[q_group, kv_tile, kv_tile, q_group, row_group, row_group],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps_dkv, num_stages=block_sizes.num_stages_dkv
        ),
        interpret=interpret,
        name="pallas_flash_backward_dkv",
    )(q, k, v, d_out, lse2, delta)

    # -- dQ: grid over query tiles --
    block_q, block_kv = tile_sizes(block_sizes.block_q_dq, q_len, block_sizes.block_kv_dq, kv_len)
    dq_kernel = functools.partial(
        _dq_kernel, spec=spec, scale=scale, head_dim=head_dim, block_q=block_q, block_kv=block_kv
    )
    q_tile = pl.BlockSpec(
        (None, block_q, None, hp), lambda i, n, b: (b, query_tile(i, q_len, block_q), n, 0)
    )
    kv_full = pl.BlockSpec((None, kv_len, None, hp), lambda i, n, b: (b, 0, n // group, 0))
    row_tile = pl.BlockSpec(
        (None, None, block_q), lambda i, n, b: (b, n, query_tile(i, q_len, block_q))
    )
    dq = pl.pallas_call(
        dq_kernel,
        grid=(pl.cdiv(q_len, block_q), num_heads, batch),
        in_specs=[q_tile, kv_full, kv_full, q_tile, row_tile, row_tile],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps_dq, num_stages=block_sizes.num_stages_dq
        ),
        interpret=interpret,
        name="pallas_flash_backward_dq",
    )(q, k, v, d_out, lse2, delta)
    return dq, dk, dv
