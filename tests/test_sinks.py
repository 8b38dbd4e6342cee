"""Attention sinks: one learned logit per query head in every row's softmax denominator.

Checked against two independent formulations: a float64 numpy softmax over the keys plus a sink
column (values, lse), and a float32 jnp softmax with the sink column concatenated (gradients in
q, k, v, bias and the sinks), on every path of the backend matrix (conftest.backend_paths), with
masks that leave rows empty, GQA and odd sizes (the Mosaic paths at their bfloat16 tile sizes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_paths

import pallas_flash

B, T, S, N, K, H = 2, 37, 29, 4, 2, 16
DTYPE = jnp.float32
# The Mosaic kernels' sizes: bfloat16, head dim 64, lengths in whole tiles.
MOSAIC_SIZES = dict(T=128, S=128, N=2, K=1, H=64, dtype=jnp.bfloat16)
# Max abs error against float64 per input dtype: float32 rounding, or bfloat16's (the kernels
# round P to bfloat16 for P V); a dropped or misplaced sink column is off by ~0.1 or more.
ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def sizes(path):
    return MOSAIC_SIZES if path.mosaic else dict(T=T, S=S, N=N, K=K, H=H, dtype=DTYPE)


def inputs(seed=0, *, T=T, S=S, N=N, K=K, H=H, dtype=DTYPE):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, H), dtype)
    sinks = 2.0 * jax.random.normal(keys[3], (N,))
    d_out = jax.random.normal(keys[4], (B, T, N, H), dtype)
    d_lse = jax.random.normal(keys[5], (B, N, T))
    # The second sequence has 5 keys: with causal attention its rows see 1..5 keys; lengths also
    # leave the first sequence's last rows without keys.
    kv_lengths = jnp.array([S, 5], jnp.int32)
    q_lengths = jnp.array([T - 7, T], jnp.int32)
    return q, k, v, sinks, d_out, d_lse, q_lengths, kv_lengths


def visible_keys(q_lengths, kv_lengths, T=T, S=S):
    """[B, T, S] bool: causal, within both lengths."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    vis = np.broadcast_to(j <= i, (B, T, S)).copy()
    vis &= np.arange(S)[None, None, :] < np.asarray(kv_lengths)[:, None, None]
    vis &= np.arange(T)[None, :, None] < np.asarray(q_lengths)[:, None, None]
    return vis


def sink_softmax_attention(q, k, v, sinks, visible, *, xp):
    """out [B, T, N, H], lse [B, N, T] of softmax over [keys..., sink] in numpy (float64) or jnp."""
    (_, T, N, H), K = q.shape, k.shape[2]
    group = N // K
    k, v = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    logits = xp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    logits = xp.where(visible[:, None], logits, -xp.inf)
    sink_col = xp.broadcast_to(sinks[None, :, None, None], (B, N, T, 1)).astype(logits.dtype)
    full = xp.concatenate([logits, sink_col], axis=-1)
    m = full.max(axis=-1, keepdims=True)
    e = xp.exp(full - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = e[..., :-1] / denom
    out = xp.einsum("bnts,bsnh->btnh", p, v)
    lse = (m + xp.log(denom))[..., 0]
    return out, lse


@pytest.mark.parametrize("path", backend_paths(mosaic=True))
def test_values_match_float64(path):
    size = sizes(path)
    q, k, v, sinks, *_, q_lengths, kv_lengths = inputs(**size)
    visible = visible_keys(q_lengths, kv_lengths, size["T"], size["S"])
    with path.scope():
        out, lse = jax.jit(
            lambda q, k, v, s: pallas_flash.flash_attention(
                q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_lengths,
                key_value_seq_lengths=kv_lengths, return_residuals=True, **path.kwargs,
            )
        )(q, k, v, sinks)  # fmt: skip
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, sinks)]
    want_out, want_lse = sink_softmax_attention(*f64, visible, xp=np)
    atol = ATOL[size["dtype"]]
    np.testing.assert_allclose(out, want_out, atol=atol)
    np.testing.assert_allclose(lse, want_lse, atol=atol)
    # Rows that see no key: out 0, lse = the head's sink.
    empty = ~visible.any(-1)  # [B, T]
    assert empty.any()
    assert np.all(out[empty] == 0)
    np.testing.assert_allclose(lse.transpose(0, 2, 1)[empty], np.broadcast_to(
        np.asarray(sinks), (int(empty.sum()), size["N"])), rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "path",
    backend_paths(
        mosaic=True,
        sweep=("mosaic-interpret",),
    ),
)
def test_gradients_match_the_sink_column_softmax(path):
    size = sizes(path)
    q, k, v, sinks, d_out, d_lse, q_lengths, kv_lengths = inputs(1, **size)
    visible = jnp.asarray(visible_keys(q_lengths, kv_lengths, size["T"], size["S"]))

    def ours(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_residuals=True, **path.kwargs,
        )  # fmt: skip

    def column(q, k, v, s):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        out, lse = sink_softmax_attention(q, k, v, s, visible, xp=jnp)
        rows = visible.any(-1)  # rows without keys: out 0 (and no gradient), as in the kernels
        return jnp.where(rows[:, :, None, None], out, 0.0), lse

    def grads(fn):
        # Cotangents in the dtypes of fn's outputs (the reference's are float32).
        (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
        return vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))

    with path.scope():
        got = [np.asarray(g, np.float32) for g in jax.jit(lambda: grads(ours))()]
    want = jax.jit(lambda: grads(column))()
    # bfloat16: the gradients' rounding grows with the sum over 128 rows or keys.
    atol = 1e-4 if size["dtype"] == jnp.float32 else 0.1
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, np.asarray(w, np.float32), atol=atol, err_msg=name)


def test_a_sink_of_minus_infinity_is_no_sink_and_stays_finite():
    q, k, v, _, d_out, d_lse, q_lengths, kv_lengths = inputs(2)
    kwargs = dict(
        is_causal=True, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        return_residuals=True, backend="xla",
    )  # fmt: skip
    with_none = pallas_flash.flash_attention(q, k, v, sinks=jnp.full((N,), -jnp.inf), **kwargs)
    plain = pallas_flash.flash_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(np.asarray(with_none[0]), np.asarray(plain[0]))
    _, vjp = jax.vjp(
        lambda q, s: pallas_flash.flash_attention(q, k, v, sinks=s, **kwargs),
        q, jnp.full((N,), -jnp.inf),
    )  # fmt: skip
    dq, dsinks = vjp((d_out, d_lse))
    assert np.all(np.isfinite(np.asarray(dq)))
    # A sink of -inf takes no share of any row; only the empty rows' lse (= the sink) depends on it.
    empty = ~visible_keys(q_lengths, kv_lengths).any(-1)  # [B, T]
    want = np.where(empty[:, None, :], np.asarray(d_lse), 0.0).sum(axis=(0, 2))
    np.testing.assert_allclose(np.asarray(dsinks), want, rtol=1e-6)


@pytest.mark.parametrize(
    "sinks, error, match",
    [
        (np.zeros((3,), np.float32), ValueError, r"sinks.shape=\(3,\) must be \(4,\)"),
        (np.zeros((4,), np.int32), TypeError, "sinks.dtype=int32 must be a floating dtype"),
        ([0.0] * 4, TypeError, "sinks must be an array"),
    ],
)
def test_bad_sinks_are_refused(sinks, error, match):
    q, k, v, *_ = inputs()
    with pytest.raises(error, match=match):
        pallas_flash.flash_attention(q, k, v, sinks=sinks)
