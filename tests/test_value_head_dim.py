"""A value head dim other than the query/key head dim (value [B, S, K, Hv], out [B, T, N, Hv]),
as multi-head latent attention uses it (192 for q.k, 128 for v).

Checked against a float64 numpy softmax (values, lse) and a float32 jnp one at full precision
(gradients), on every path of the backend matrix (conftest.backend_paths), with GQA, causal
masks, lengths, windows, odd sizes (the Mosaic paths at their bfloat16 tile sizes) and Hv both
below and above H; on the H200 at the MLA shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_paths

import pallas_flash
from pallas_flash import api

B, T, S, N, K = 2, 37, 45, 4, 2
# (H, Hv) per case: odd sizes in float32; the Mosaic kernels' head dims and tiles in bfloat16.
HEAD_DIMS = {"Hv<H": (24, 16), "Hv>H": (16, 40)}
MOSAIC_HEAD_DIMS = {"Hv<H": (128, 64), "Hv>H": (64, 128)}
MOSAIC_LEN = 128
# Max abs error of the values against float64, of the gradients against float32 (the kernels
# round P to bfloat16 for P V and dS for the products of the backward).
ATOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (2e-2, 0.1)}


def case_sizes(path, case):
    """(T, S, H, Hv, dtype) of `case` on `path`."""
    if path.mosaic:
        return (MOSAIC_LEN, MOSAIC_LEN, *MOSAIC_HEAD_DIMS[case], jnp.bfloat16)
    return (T, S, *HEAD_DIMS[case], jnp.float32)


def inputs(head_dim, value_head_dim, seed=0, *, T=T, S=S, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, N, head_dim), dtype)
    k = jax.random.normal(keys[1], (B, S, K, head_dim), dtype)
    v = jax.random.normal(keys[2], (B, S, K, value_head_dim), dtype)
    d_out = jax.random.normal(keys[3], (B, T, N, value_head_dim), dtype)
    d_lse = jax.random.normal(keys[4], (B, N, T))
    return q, k, v, d_out, d_lse


WINDOW = (9, 0)


def kv_lengths(S):
    return np.array([S, 20])


def visible_keys(T=T, S=S):
    """[B, T, S] bool: causal, a left window of 9, and the second sequence's 20 keys (its
    rows past 28 see none)."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    vis = np.broadcast_to((j <= i) & (j >= i - WINDOW[0]), (B, T, S)).copy()
    return vis & (np.arange(S)[None, None, :] < kv_lengths(S)[:, None, None])


def softmax_attention(q, k, v, visible, *, xp):
    """out [B, T, N, Hv], lse [B, N, T] in numpy (float64) or jnp (float32, full precision)."""
    k, v = xp.repeat(k, N // K, axis=2), xp.repeat(v, N // K, axis=2)
    extra = {} if xp is np else dict(precision=jax.lax.Precision.HIGHEST)
    logits = xp.einsum("btnh,bsnh->bnts", q, k, **extra) / np.sqrt(q.shape[-1])
    logits = xp.where(visible[:, None], logits, -xp.inf)
    # Rows that see no key: out 0, lse -inf, no gradient (as the kernels give).
    m = logits.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.where(visible[:, None], xp.exp(logits - m), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    empty = denom == 0.0
    denom = xp.where(empty, 1.0, denom)
    out = xp.einsum("bnts,bsnh->btnh", e / denom, v, **extra)
    return out, xp.where(empty, -xp.inf, m + xp.log(denom))[..., 0]


def call(q, k, v, kwargs):
    return pallas_flash.flash_attention(
        q, k, v, is_causal=True, local_window_size=WINDOW,
        key_value_seq_lengths=kv_lengths(k.shape[1]), return_residuals=True, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(HEAD_DIMS))
@pytest.mark.parametrize("path", backend_paths(mosaic=True, sweep=("mosaic-interpret",)))
def test_values_match_float64(path, case):
    T, S, H, Hv, dtype = case_sizes(path, case)
    q, k, v, _, _ = inputs(H, Hv, T=T, S=S, dtype=dtype)
    with path.scope():
        out, lse = jax.jit(lambda q, k, v: call(q, k, v, path.kwargs))(q, k, v)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert out.shape == (B, T, N, Hv) and lse.shape == (B, N, T)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    want_out, want_lse = softmax_attention(*f64, visible_keys(T, S), xp=np)
    np.testing.assert_allclose(out, want_out, atol=ATOL[dtype][0])
    np.testing.assert_allclose(lse, want_lse, atol=ATOL[dtype][0])


@pytest.mark.parametrize("case", sorted(HEAD_DIMS))
@pytest.mark.parametrize(
    "path",
    backend_paths(
        mosaic=True,
        sweep=("mosaic-interpret",),
    ),
)
def test_gradients_match_float32(path, case):
    T, S, H, Hv, dtype = case_sizes(path, case)
    q, k, v, d_out, d_lse = inputs(H, Hv, T=T, S=S, dtype=dtype)

    def grads(fn):
        # Cotangents in the dtypes of fn's outputs (the reference's are float32).
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        return vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))

    def reference(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return softmax_attention(q, k, v, jnp.asarray(visible_keys(T, S)), xp=jnp)

    with path.scope():
        got = jax.jit(lambda: grads(lambda q, k, v: call(q, k, v, path.kwargs)))()
        got = [np.asarray(g, np.float32) for g in got]
    want = jax.jit(lambda: grads(reference))()
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, np.asarray(w), atol=ATOL[dtype][1], err_msg=name)


def test_backward_at_residuals_takes_the_value_head_dim():
    q, k, v, d_out, d_lse = inputs(24, 16)
    (out, lse), pullback = jax.vjp(lambda q, k, v: call(q, k, v, {"backend": "xla"}), q, k, v)
    want = pullback((d_out, d_lse))
    got = api.flash_attention_backward(
        q, k, v, out, lse, d_out, d_lse, is_causal=True, local_window_size=WINDOW,
        key_value_seq_lengths=kv_lengths(S), backend="triton", interpret=True,
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


@pytest.mark.parametrize(
    "v_shape, match",
    [
        ((B, S, K, 20), r"value head_dim=20 .* must be a multiple of 8"),
        ((B, S, K, 264), r"value head_dim=264 .* at most 256"),
        ((B, S + 1, K, 16), r"must agree on \[B, S, K\]"),
        ((B, S, N, 16), r"must agree on \[B, S, K\]"),
    ],
)
def test_bad_value_shapes_are_refused(v_shape, match):
    q, k, *_ = inputs(24, 16)
    with pytest.raises(ValueError, match=match):
        pallas_flash.flash_attention(q, k, jnp.zeros(v_shape), backend="xla")


@pytest.mark.gpu
def test_mla_head_dims_on_gpu():
    """(192, 128) as multi-head latent attention uses it, bf16, causal, 2k tokens, compiled with
    the default kernels: values within twice XLA's bf16 error of the float64 oracle."""
    shape = dict(B=1, T=2048, N=16)
    rng = np.random.default_rng(0)
    q64 = rng.standard_normal((shape["B"], shape["T"], shape["N"], 192))
    k64 = rng.standard_normal((shape["B"], shape["T"], shape["N"], 192))
    v64 = rng.standard_normal((shape["B"], shape["T"], shape["N"], 128))
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q64, k64, v64))
    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=True))(q, k, v)
    xla = jax.jit(
        lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=True, backend="xla")
    )(q, k, v)
    causal = np.tril(np.ones((shape["T"], shape["T"]), bool))
    logits = np.einsum("btnh,bsnh->bnts", q64, k64) / np.sqrt(192)
    logits = np.where(causal, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v64)
    err = np.abs(np.asarray(out, np.float64) - want).max()
    err_xla = np.abs(np.asarray(xla, np.float64) - want).max()
    assert out.shape == (1, 2048, 16, 128) and np.isfinite(err)
    assert err <= 2 * err_xla, (err, err_xla)
