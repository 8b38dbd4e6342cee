"""The float64 oracle of every test (forward and analytic backward, in numpy, or in jax under
float64 on a GPU) and plain attention computed in the input dtype, the baseline of the tolerance
rule (`support.tolerance`)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from support.backends import has_gpu


def to64(x):
    """x as a float64 numpy array (through float32, which holds every bf16 and f16 value)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _visible(q_len, kv_len, is_causal):
    visible = np.ones((q_len, kv_len), bool)
    if is_causal:
        visible &= np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
    return visible


# The oracle runs on the GPU where there is one (float64 matmuls there take milliseconds, on
# one CPU core per test process seconds: the GPU suite's bottleneck), else in numpy.
# PALLAS_FLASH_ORACLE=numpy or =jax chooses.
@functools.cache
def oracle_on_device() -> bool:
    return os.environ.get("PALLAS_FLASH_ORACLE", "jax" if has_gpu() else "numpy") == "jax"


def attention_oracle_f64(
    q,
    k,
    v,
    d_out=None,
    d_lse=None,
    *,
    scale,
    visible,
    bias=None,
    soft_cap=None,
    keep=None,
    rate=0.0,
    sinks=None,
):
    """The float64 oracle of every test: out [B, T, N, H], lse [B, N, T] and, with cotangents
    d_out [B, T, N, H] and d_lse [B, N, T], dq, dk, dv and dlogits [B, N, T, S] (the caller sums
    it to a bias's shape), as numpy arrays. Rows that see no key: out 0, lse -inf, zero gradient.

    With sinks [N] (attention sinks, -inf: none) each row's softmax denominator also holds
    exp(sink): P shrinks by it, lse includes it (a row that sees no key has lse = its sink and
    out 0), and dsinks [N] = sum over batch and rows of P_sink (d_lse - rowsum(dO O)). A row
    that sees no key (masked, or -inf bias) counts P_sink = 1 also at a sink of -inf: its lse
    is the sink (the library's convention, `test_sinks.py`).

    logits = soft_cap(scale q.k + bias), softmax over the `visible` keys ([T, S] or broadcastable
    to [B, N, T, S]). Backward: dP = dO V^T, dS = P (dP - rowsum(dO O) + dlse) (1 - tanh^2 under
    the soft cap), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, the last two summed over the
    query heads of each kv head's group.

    With dropout's keep-mask `keep` ([B, N, T, S], bool) and `rate`: P.V takes P * Z, Z = keep /
    (1 - rate), and so do dV and dP (dS = P (Z dP - rowsum(dO O) + dlse)); lse is the
    un-dropped softmax's.
    """
    arrays = [q, k, v, d_out, d_lse, visible, bias, keep, sinks]
    arrays = [None if x is None else np.asarray(x) for x in arrays]
    arrays = [x if x is None or x.dtype == bool else x.astype(np.float64) for x in arrays]
    if not oracle_on_device():
        with np.errstate(divide="ignore"):  # log(0) of the empty rows, replaced by -inf
            return _oracle(np, *arrays, scale=scale, soft_cap=soft_cap, rate=rate)
    with jax.enable_x64(True):
        result = _oracle(
            jnp,
            *(None if x is None else jnp.asarray(x) for x in arrays),
            scale=scale,
            soft_cap=soft_cap,
            rate=rate,
        )
        return {name: np.asarray(x) for name, x in result.items()}


def _oracle(
    xp, q, k, v, d_out, d_lse, visible, bias, keep=None, sinks=None, *, scale, soft_cap, rate=0.0
):
    """attention_oracle_f64 in the array module xp (numpy, or jax.numpy under float64)."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    k_n, v_n = (xp.repeat(x, num_heads // num_kv_heads, axis=2) for x in (k, v))
    logits = scale * xp.einsum("btnh,bsnh->bnts", q, k_n, optimize=True)
    if bias is not None:
        logits = logits + bias
    d_cap = 1.0
    if soft_cap is not None:
        tanh = xp.tanh(logits / soft_cap)
        logits, d_cap = soft_cap * tanh, 1.0 - tanh * tanh
    row_max = xp.max(xp.where(visible, logits, -xp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks[None, :, None, None]  # [1, N, 1, 1]
        row_max = xp.maximum(row_max, sink)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    unnormalised = xp.where(visible, xp.exp(logits - row_max), 0.0)
    row_sum = unnormalised.sum(axis=-1, keepdims=True)
    if sinks is not None:
        sink_term = xp.exp(sink - row_max)
        row_sum = row_sum + sink_term
    empty = row_sum == 0.0
    row_sum = xp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum
    lse = xp.where(empty, -xp.inf, row_max + xp.log(row_sum))[..., 0]
    # Dropout's P * Z (Z = keep / (1 - rate)) where P.V and its derivatives use P.
    dropped = probs if keep is None else xp.where(keep, probs * (1.0 / (1.0 - rate)), 0.0)
    out = xp.einsum("bnts,bsnh->btnh", dropped, v_n, optimize=True)
    result = {"out": out, "lse": lse}
    if d_out is None:
        return result
    d_probs = xp.einsum("btnh,bsnh->bnts", d_out, v_n, optimize=True)
    if keep is not None:
        d_probs = xp.where(keep, d_probs * (1.0 / (1.0 - rate)), 0.0)
    delta = xp.einsum("btnh,btnh->bnt", d_out, out, optimize=True)
    d_logits = probs * (d_probs - delta[..., None] + d_lse[..., None]) * d_cap

    def group_sum(x):
        b, s, n, h = x.shape
        return x.reshape(b, s, num_kv_heads, n // num_kv_heads, h).sum(axis=3)

    result["dq"] = scale * xp.einsum("bnts,bsnh->btnh", d_logits, k_n, optimize=True)
    result["dk"] = group_sum(scale * xp.einsum("bnts,btnh->bsnh", d_logits, q, optimize=True))
    result["dv"] = group_sum(xp.einsum("bnts,btnh->bsnh", dropped, d_out, optimize=True))
    result["dlogits"] = d_logits
    if sinks is not None:
        no_key = ~xp.any(visible & (logits > -xp.inf), axis=-1)  # masked, or -inf bias
        p_sink = xp.where(no_key, 1.0, (sink_term / row_sum)[..., 0])  # [B, N, T]
        result["dsinks"] = (p_sink * (d_lse - delta)).sum(axis=(0, 2))
    return result


def attention_f64(q, k, v, *, scale, is_causal):
    """Float64 attention: out [B, T, N, H], lse [B, N, T] (natural log)."""
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    r = attention_oracle_f64(q, k, v, scale=scale, visible=visible)
    return r["out"], r["lse"]


def attention_grads_f64(q, k, v, d_out, d_lse, *, scale, is_causal):
    """Float64 (dq, dk, dv) for cotangents d_out [B, T, N, H] and d_lse [B, N, T]."""
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    r = attention_oracle_f64(q, k, v, d_out, d_lse, scale=scale, visible=visible)
    return r["dq"], r["dk"], r["dv"]


def dropout_oracle_f64(
    q, k, v, d_out, d_lse, *, scale, visible, keep, rate, bias=None, soft_cap=None
):
    """float64 out, lse, dq, dk, dv, dbias of softmax attention whose P.V uses P * Z, Z = keep /
    (1 - rate) ([B, N, T, S]); lse is the un-dropped softmax's. logits = soft_cap(scale q.k +
    bias), visible broadcastable to [B, N, T, S]. Rows that see no key: out 0, lse -inf,
    gradients 0. `attention_oracle_f64` with a keep-mask (numpy arrays; on the GPU where there
    is one)."""
    r = attention_oracle_f64(
        q, k, v, d_out, d_lse, scale=scale, visible=visible, bias=bias, soft_cap=soft_cap,
        keep=np.asarray(keep, bool), rate=rate,
    )  # fmt: skip
    return r["out"], r["lse"], r["dq"], r["dk"], r["dv"], r["dlogits"]


# -- plain attention in the input dtype (the baseline of the tolerance rule) ----------------------


def attention_in_dtype(q, k, v, *, scale, is_causal):
    """softmax(scale q k^T) v with every step in the input dtype: (out, lse as float32)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    logits = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v), lse.astype(jnp.float32)


def masked_in_dtype(q, k, v, *, scale, visible, soft_cap=None, keep=None, rate=0.0):
    """Plain attention with every step in the input dtype over a visibility broadcastable to
    [B, N, T, S] and an optional soft cap: the tolerance baseline of values and gradients. Rows
    that see no key: out 0, lse -inf, gradients 0 (no NaN through their empty softmax). keep:
    None, or a dropout keep-mask broadcastable to [B, N, T, S] at `rate` (P * keep / (1 - rate)
    multiplies V; lse stays the softmax's)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum
    if keep is not None:
        probs = probs * jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(q.dtype)
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(row_sum))[..., 0]
    return jnp.einsum("bnts,bsnh->btnh", probs, v), lse.astype(jnp.float32)


# -- the dense mask of a case's mask arguments, and the shapes of biases --------------------------


def as4d(x):
    """Left-pads the shape of a bias or mask with 1s to rank 4."""
    x = np.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def visibility(c, x64) -> np.ndarray:
    """Dense [B, N, T, S] bool: key j visible to query i when every argument allows it. c: a
    case with batch, q_len, kv_len, num_heads, is_causal and window (tests/test_masks.py's
    `Case`, tests/test_property.py's `Config`); x64: its mask, q_lens, kv_lens, q_seg and kv_seg
    as numpy arrays (None where the case has none)."""
    b, t, s, n = c.batch, c.q_len, c.kv_len, c.num_heads
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    geometry = np.ones((t, s), bool)
    if c.is_causal:
        geometry &= j <= i
    if c.window is not None:
        left, right = (c.window, c.window) if isinstance(c.window, int) else c.window
        geometry &= (i - left <= j) & (j <= i + right)
    vis = np.broadcast_to(geometry, (b, n, t, s)).copy()
    if x64["q_lens"] is not None:
        vis &= (np.arange(t)[None, :] < x64["q_lens"][:, None])[:, None, :, None]
    if x64["kv_lens"] is not None:
        vis &= (np.arange(s)[None, :] < x64["kv_lens"][:, None])[:, None, None, :]
    if x64["q_seg"] is not None:
        q_seg = x64["q_seg"]
        kv_seg = q_seg if x64["kv_seg"] is None else x64["kv_seg"]
        vis &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    if x64["mask"] is not None:
        vis &= as4d(x64["mask"])
    return vis


def sum_to_shape(x, shape):
    """Sums a [B, N, T, S] array over the dims a bias of `shape` was broadcast along."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(d for d in range(4) if shape4[d] == 1 and x.shape[d] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)
