"""Plain-jnp attention with an f32 softmax: the test oracle's twin and the "xla" backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.masks import MaskSpec


def reference_attention(q, k, v, *, spec: MaskSpec, scale: float):
    """(out [B, T, N, H], lse [B, N, T]) by materialising the [B, N, T, S] logits.

    Logits and softmax in f32, P cast to the value dtype for the second product (as the kernels
    do). Rows that see no key output 0 with lse = -inf, and their gradients are 0, not NaN.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    logits = (
        jnp.einsum(
            "btkgh,bskh->bkgts", qg, k, precision=precision, preferred_element_type=jnp.float32
        )
        * scale
    )
    visible = spec.dense()[None, None, None]
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum_safe = jnp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum_safe
    out = jnp.einsum(
        "bkgts,bskh->btkgh",
        probs.astype(v.dtype),
        v,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(row_sum_safe))[..., 0]
    out = out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
    return out, lse.reshape(batch, num_heads, q_len)
