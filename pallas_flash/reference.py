"""Plain-jnp attention with an f32 softmax: the test oracle's twin and the "xla" backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import _dropout, masks
from pallas_flash._numerics import (
    LOG2E,
    accumulation_dtype,
    lowered_reference,
    probability_bound,
)
from pallas_flash.masks import MaskArrays, MaskSpec


def reference_attention(
    q,
    k,
    v,
    bias,
    arrays: MaskArrays,
    *,
    spec: MaskSpec,
    scale: float,
    soft_cap=None,
    dropout_rate: float = 0.0,
    with_log_sum: bool = False,
):
    """(out [B, T, N, Hv], lse [B, N, T]) by materialising the [B, N, T, S] logits (v: [B, S, K,
    Hv], Hv the value head dim, which may differ from q's and k's H). with_log_sum: also
    log_sum [B, N, T] float32, the log of each row's softmax denominator relative to its
    largest logit (0 for rows that see no key), as the kernels' forwards return it; it carries
    no derivative.

    With dropout_rate > 0, P.V uses P with the entries `_dropout.keep` drops set to 0 and the
    others scaled by 1 / (1 - dropout_rate) (seeds in arrays.dropout_seeds); lse is the
    un-dropped softmax's.

    Logits and softmax in f32, P cast to the value dtype for the second product (as the kernels
    do). Rows that see no key output 0 with lse = -inf, and their gradients are 0, not NaN.
    NaN or inf in K or V reaches only the rows that see that key (which get NaN).
    """
    batch, q_len, num_heads, _ = q.shape
    logits, visible, v = _logits(q, k, v, bias, arrays, spec=spec, scale=scale, soft_cap=soft_cap)
    num_kv_heads, group = logits.shape[1], logits.shape[2]
    precision = _precision(q)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum_safe = jnp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum_safe
    if dropout_rate:
        kept = _dropout.dense_keep(arrays.dropout_seeds, q_len, logits.shape[-1], dropout_rate)
        kept = kept.reshape(probs.shape)  # [B, N, T, S] -> [B, K, G, T, S]
        probs = probs * _dropout.kept_scale(kept, dropout_rate)
    out = jnp.einsum(
        "bkgts,bskh->btkgh",
        probs.astype(v.dtype),
        v,
        precision=precision,
        preferred_element_type=accumulation_dtype(q.dtype),
    )
    log_sum = jnp.log(row_sum_safe)[..., 0]
    lse = jnp.where(empty[..., 0], -jnp.inf, row_max[..., 0] + log_sum)
    out = out.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)

    def by_row(x):  # [B, K|1, G|1, T] -> [B, N, T]
        return jnp.broadcast_to(x, (batch, num_kv_heads, group, q_len)).reshape(
            batch, num_heads, q_len
        )

    if not with_log_sum:
        return out, by_row(lse)
    return out, by_row(lse), by_row(jax.lax.stop_gradient(log_sum))


def with_sinks(out, lse, sinks, log_sum=None):
    """(out, lse) of the softmax with one more logit per head, `sinks` ([N], or [B, N]), whose
    value is 0: the sink takes its share e^{sink} / (e^{sink} + e^{lse}) of each row away from
    the keys'. A row that sees no key (lse = -inf) keeps out 0 and gets lse = sink. The kernels
    apply the sink in their epilogue instead; this is the reference's and the decode path's.

    log_sum: the keys' log softmax denominator relative to their max (lse's part beyond it), or
    None for 0. With it the two shares come from the denominators, relative to the larger of
    the keys' max (lse - log_sum, which is the max itself where float32's lse rounds log_sum
    away) and the sink: a sink that ties with a max beyond ~1e6, where lse cannot hold the tie's
    log 2, still takes its share. Without it they come from lse."""
    acc = accumulation_dtype(lse.dtype)
    sinks = jnp.broadcast_to(jnp.asarray(sinks, acc)[..., None], lse.shape)
    # Rows that see no key (lse = -inf) take lse = sink; the inner wheres keep -inf - -inf (also
    # with a sink of -inf) out of the values and the gradients.
    empty = lse == -jnp.inf
    keys_lse = jnp.where(empty, 0.0, lse)
    log_sum = 0.0 if log_sum is None else jnp.where(empty, 0.0, log_sum.astype(acc))
    keys_max = keys_lse - log_sum
    top = jnp.maximum(keys_max, sinks)  # +inf where the sink is: the sink takes the row
    finite = jnp.isfinite(top)
    top = jnp.where(finite, top, 0.0)
    keys_den = jnp.where(finite, jnp.exp(jnp.where(finite, keys_max - top, 0.0) + log_sum), 0.0)
    sink_den = jnp.where(finite, jnp.exp(jnp.where(finite, sinks - top, 0.0)), 1.0)
    total = keys_den + sink_den  # >= 1: the larger of the two parts is at the top
    # A sink of -inf (or one whose share is 0) leaves lse as it is, bit for bit; one of +inf
    # is the row's lse, and d lse / d sink = 1 there.
    new_lse = jnp.where(finite, top + jnp.log(total), sinks)
    new_lse = jnp.where(empty, sinks, jnp.where(sink_den == 0.0, keys_lse, new_lse))
    keys_share = jnp.where(empty, 0.0, keys_den / total)
    scaled = out.astype(acc) * jnp.swapaxes(keys_share, 1, 2)[..., None]
    return scaled.astype(out.dtype), new_lse


def _precision(q):
    return jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None


def _logits(q, k, v, bias, arrays: MaskArrays, *, spec: MaskSpec, scale: float, soft_cap):
    """(logits [B, K, G, T, S] f32 with -inf where masked, visible [B|1, K|1, G|1, T, S], v with
    non-finite entries zeroed)."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads

    def by_group(x):  # [Bx, N|1, T, S] -> [Bx, K|1, G|1, T, S], matching the logits below
        if x.shape[1] == 1:
            return x[:, :, None]
        return x.reshape(x.shape[0], num_kv_heads, group, *x.shape[2:])

    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    # NaN or inf in a key's K or V row must reach only the rows that see the key: the products
    # run on zeroed copies (0 * NaN would reach every row, also through the gradients), and the
    # rows that see such a key get a NaN logit there.
    k_finite, v_finite = jnp.isfinite(k), jnp.isfinite(v)
    bad_key = ~(k_finite.all(-1) & v_finite.all(-1))  # [B, S, K]
    k = jnp.where(k_finite, k, jnp.zeros_like(k))
    v = jnp.where(v_finite, v, jnp.zeros_like(v))
    logits = (
        jnp.einsum(
            "btkgh,bskh->bkgts",
            qg,
            k,
            precision=_precision(q),
            preferred_element_type=accumulation_dtype(q.dtype),
        )
        * scale
    )
    if bias is not None:
        logits = logits + by_group(bias.astype(logits.dtype))
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    bad_key = jnp.transpose(bad_key, (0, 2, 1))[:, :, None, None, :]  # [B, K, 1, 1, S]
    logits = jnp.where(bad_key, jnp.nan, logits)
    visible = by_group(masks.dense(spec, arrays))
    logits = jnp.where(visible, logits, -jnp.inf)
    return logits, visible, v


def reference_backward(
    q,
    k,
    v,
    bias,
    arrays: MaskArrays,
    out,
    lse,
    d_out,
    d_lse,
    *,
    spec,
    scale,
    soft_cap=None,
    log_sum=None,
):
    """(dq, dk, dv, dbias) at the given residuals, as the kernels' backward computes them:
    P = exp(logits - lse) and dS = P (dO V^T - delta) with delta = rowsum(dO * out) - d_lse.
    `out` and `lse` may be those of a larger softmax this call's keys are a part of (a ring's
    block): the result is then this part's share of that softmax's gradients.

    P is recomputed as the kernels do (`_numerics`): from lse lowered by its magnitude's slack
    and clamped at 1 / l, l the row's softmax denominator relative to its max (exp(log_sum),
    float32 [B, N, T]; 1 without log_sum), so that the "xla" path gives the kernels' gradients
    at any logit magnitude, ties at a row's max included."""
    batch, q_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    f32 = accumulation_dtype(q.dtype)  # float64 for float64 inputs

    def by_group(x):  # [B, N, T] -> [B, K, G, T, 1]
        return x.reshape(batch, num_kv_heads, group, q_len)[..., None]

    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(f32), out.astype(f32)) - d_lse
    delta = by_group(delta)
    live = by_group(jnp.isfinite(lse))
    reference = by_group(lowered_reference(jnp.where(jnp.isfinite(lse), lse, 0.0)))
    bound = by_group(probability_bound(log_sum, lse))
    do = d_out.reshape(batch, q_len, num_kv_heads, group, v.shape[-1])

    def share(q, k, v, bias):
        # sum_ij P_ij (dO_i . v_j - delta_i): its derivative in logit ij is dS_ij, in v_j
        # sum_i P_ij dO_i.
        logits, visible, v = _logits(
            q, k, v, bias, arrays, spec=spec, scale=scale, soft_cap=soft_cap
        )
        p = _recomputed_probs((logits - reference) * LOG2E, bound)
        p = jnp.where(visible & live, p, 0.0)
        dp = jnp.einsum(
            "btkgh,bskh->bkgts", do, v, precision=_precision(q), preferred_element_type=f32
        )
        return jnp.sum(p * (dp - delta))

    if bias is None:
        dq, dk, dv = jax.grad(lambda q, k, v: share(q, k, v, None), argnums=(0, 1, 2))(q, k, v)
        return dq, dk, dv, None
    return jax.grad(share, argnums=(0, 1, 2, 3))(q, k, v, bias)


@jax.custom_jvp
def _recomputed_probs(x, bound):
    """The backwards' P = exp2(min(x, bound)) (x: log2 P recomputed from lse), differentiated as
    exp2(x / LOG2E), as the kernels' dS = P (dP - delta) is: the clamp only absorbs lse's
    rounding and moves no gradient."""
    return jnp.exp2(jnp.minimum(x, bound))


@_recomputed_probs.defjvp
def _recomputed_probs_jvp(primals, tangents):
    x, bound = primals
    p = _recomputed_probs(x, bound)
    return p, p * (tangents[0] / LOG2E)
