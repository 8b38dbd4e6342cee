"""Attention sinks: one learned logit per query head in every row's softmax denominator.

The kernels add the sink to each row's denominator in their forward epilogue; the backward
kernels take the lse that includes it, and dsinks is computed from (out, lse) in XLA. Checked
against a float64 numpy softmax over the keys plus a sink column (values, lse) and its analytic
backward (gradients in q, k, v and the sinks), on every path of the backend matrix
(support.backends.backend_paths), with masks that leave rows empty (lengths, segment ids,
windows), a soft cap, GQA, split KV and odd sizes (the Mosaic paths at their bfloat16 tile sizes);
second order against the xla path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS, SWEEP, backend_paths

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


def sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse, *, soft_cap=None):
    """The float64 oracle with its analytic backward: (out, lse, dq, dk, dv, dsinks) of the
    softmax over [visible keys..., sink] (sinks [N] finite; visible [B|1, N|1, T, S]), logits
    scale * q.k (soft-capped: cap * tanh(. / cap)), for the cotangents d_out and d_lse."""
    q, k, v, sinks, d_out, d_lse = (
        np.asarray(x, np.float64) for x in (q, k, v, sinks, d_out, d_lse)
    )
    (b, _, n, h), kv_heads = q.shape, k.shape[2]
    group = n // kv_heads
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(h)
    raw = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    tanh = None if soft_cap is None else np.tanh(raw / soft_cap)
    logits = raw if soft_cap is None else soft_cap * tanh
    logits = np.where(visible, logits, -np.inf)
    sink = sinks[None, :, None]  # [1, N, 1]
    m = np.maximum(logits.max(axis=-1), sink)  # finite: the sinks are
    e = np.exp(logits - m[..., None])
    e_sink = np.exp(sink - m)
    denom = e.sum(axis=-1) + e_sink
    p, p_sink = e / denom[..., None], e_sink / denom
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    lse = m + np.log(denom)
    # dS = P (dP - delta + dlse) in the logits; the sink's column has dP = 0.
    delta = np.einsum("btnh,btnh->bnt", d_out, out) - d_lse
    ds = p * (np.einsum("btnh,bsnh->bnts", d_out, vr) - delta[..., None])
    if soft_cap is not None:
        ds = ds * (1.0 - tanh * tanh)
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dv = np.einsum("bnts,btnh->bsnh", p, d_out)
    dk, dv = (x.reshape(b, -1, kv_heads, group, h).sum(axis=3) for x in (dk, dv))
    d_sinks = -(p_sink * delta).sum(axis=(0, 2))
    return out, lse, dq, dk, dv, d_sinks


@pytest.mark.parametrize("path", backend_paths(mosaic=True))
@pytest.mark.ci_slice(2)
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


def outputs_and_grads(fn, q, k, v, sinks, d_out, d_lse):
    """(out, lse, dq, dk, dv, dsinks) of fn(q, k, v, sinks) -> (out, lse), jit'd, as float64."""

    def run(q, k, v, sinks):
        (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
        return (out, lse, *vjp((d_out, d_lse)))

    return [np.asarray(x, np.float64) for x in jax.jit(run)(q, k, v, sinks)]


# Gradients' max abs error against float64: float32 rounding; bfloat16's grows with the sums over
# 128 rows or keys. A wrong dsinks (sign, a missing row's term) is off by ~0.1 or more.
GRAD_ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 0.1}
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def assert_close_to_oracle(got, want, dtype):
    """got and want: (out, lse, dq, dk, dv, dsinks), or got their first len(got)."""
    for name, g, w in zip(NAMES, got, want[: len(got)]):
        assert np.all(np.isfinite(g)), name
        atol = ATOL[dtype] if name in ("out", "lse") else GRAD_ATOL[dtype]
        np.testing.assert_allclose(g, w, atol=atol, err_msg=name)


@pytest.mark.parametrize(
    "path",
    backend_paths(
        mosaic=True,
        sweep=("mosaic-interpret",),
    ),
)
def test_gradients_match_float64(path):
    """Values and gradients (dsinks included) against the float64 oracle's analytic backward,
    with causal masking and lengths that leave rows empty; on "xla" this also checks the
    oracle against jax's autodiff of the reference."""
    size = sizes(path)
    q, k, v, sinks, d_out, d_lse, q_lengths, kv_lengths = inputs(1, **size)
    visible = visible_keys(q_lengths, kv_lengths, size["T"], size["S"])[:, None]

    def ours(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_residuals=True, **path.kwargs,
        )  # fmt: skip

    with path.scope():
        got = outputs_and_grads(ours, q, k, v, sinks, d_out, d_lse)
    want = sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse)
    assert_close_to_oracle(got, want, size["dtype"])


# The checks of the Mosaic kernels alone.
NOT_MOSAIC = tuple(name for name, path in BACKEND_PATHS.items() if not path.mosaic)


@pytest.mark.parametrize(
    "path",
    backend_paths(mosaic=True, exclude=NOT_MOSAIC, sweep=("mosaic-interpret",)),
)
def test_mosaic_gradients_match_float64(path):
    """The Mosaic forward's epilogue sink and the Mosaic backward on its lse (plain causal, no
    lengths: the calls the Mosaic backward takes), in the Mosaic interpreter and on the GPU."""
    q, k, v, sinks, d_out, d_lse, *_ = inputs(3, **MOSAIC_SIZES)
    visible = np.tril(np.ones((MOSAIC_SIZES["T"], MOSAIC_SIZES["S"]), bool))

    def ours(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, sinks=s, return_residuals=True, **path.kwargs
        )

    with path.scope():
        got = outputs_and_grads(ours, q, k, v, sinks, d_out, d_lse)
    want = sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse)
    assert_close_to_oracle(got, want, MOSAIC_SIZES["dtype"])


def segment_ids(length, ids):
    """int32 [B, length]: batch entry b split into len(ids[b]) documents of near-equal length."""
    rows = [np.repeat(np.asarray(i), -(-length // len(i)))[:length] for i in ids]
    return jnp.asarray(np.stack(rows), jnp.int32)


@pytest.mark.parametrize(
    "path",
    backend_paths(mosaic=True, sweep=("mosaic-interpret",)),
)
def test_window_segments_and_soft_cap_match_float64(path):
    """Sinks with a local window, packed documents (a query document with no key document:
    empty rows) and a soft cap, GQA: values, lse and gradients against float64."""
    check_window_segments_and_soft_cap(path, gradients=True)


@pytest.mark.parametrize(
    "path",
    backend_paths(mosaic=True, exclude=NOT_MOSAIC, sweep=("mosaic-interpret",)),
)
def test_values_with_window_segments_and_soft_cap(path):
    """The same, values and lse only, on the Mosaic forward (the gradients' Mosaic interpreter
    run is slow: it runs with PALLAS_FLASH_SWEEP)."""
    check_window_segments_and_soft_cap(path, gradients=False)


def check_window_segments_and_soft_cap(path, *, gradients: bool):
    size = sizes(path)
    q, k, v, sinks, d_out, d_lse, *_ = inputs(4, **size)
    t, s = size["T"], size["S"]
    # Document 7 of the first sequence's queries has no keys: its rows are empty.
    q_seg = segment_ids(t, [[1, 2, 7], [4, 5]])
    kv_seg = segment_ids(s, [[1, 2, 3], [4, 5]])
    window, cap = (9, 3), 4.0
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = (j >= i - window[0]) & (j <= i + window[1])
    visible = visible & (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])
    visible = visible[:, None]  # [B, 1, T, S]
    assert (~visible.any(-1)).any()

    def ours(q, k, v, sinks):
        return pallas_flash.flash_attention(
            q, k, v, sinks=sinks, local_window_size=window, logits_soft_cap=cap,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_residuals=True, **path.kwargs,
        )  # fmt: skip

    want = sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse, soft_cap=cap)
    with path.scope():
        if gradients:
            got = outputs_and_grads(ours, q, k, v, sinks, d_out, d_lse)
        else:
            got = [np.asarray(x, np.float64) for x in jax.jit(ours)(q, k, v, sinks)]
    assert_close_to_oracle(got, want, size["dtype"])


@pytest.mark.parametrize("path", backend_paths(exclude=("xla", "default")))
def test_split_kv_matches_float64(path):
    """Split KV (the chunks merged in XLA, which adds the sinks there): values and lse; the
    gradients too on the GPU and with PALLAS_FLASH_SWEEP (the backward is the plain one)."""
    q, k, v, sinks, d_out, d_lse, q_lengths, kv_lengths = inputs(5)
    visible = visible_keys(q_lengths, kv_lengths)[:, None]
    tiles = pallas_flash.BlockSizes(block_q=16, block_kv=16, kv_splits=2)

    def ours(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_residuals=True,
            **path.call_kwargs(block_sizes=tiles),
        )  # fmt: skip

    with path.scope():
        if path.gpu or SWEEP:
            got = outputs_and_grads(ours, q, k, v, sinks, d_out, d_lse)
        else:
            got = [np.asarray(x, np.float64) for x in jax.jit(ours)(q, k, v, sinks)]
    assert_close_to_oracle(got, sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse), DTYPE)


@pytest.mark.parametrize("path", backend_paths(exclude=("xla",), sweep=("triton-interpret",)))
def test_second_order_matches_xla(path):
    """Reverse over reverse through the sinks (the kernels' passes are differentiated through
    the reference with the sinks): the gradient in (q, sinks) of <VJP, u>, against the xla
    path's."""
    q, k, v, sinks, d_out, d_lse, q_lengths, kv_lengths = inputs(6)
    u = jax.random.normal(jax.random.key(7), q.shape)

    def second(path):
        def inner(q, s):
            def attention(q, s):
                return pallas_flash.flash_attention(
                    q, k, v, is_causal=True, sinks=s, key_value_seq_lengths=kv_lengths,
                    return_residuals=True, **path.kwargs,
                )  # fmt: skip

            (out, lse), vjp = jax.vjp(attention, q, s)
            dq, ds = vjp((d_out, d_lse))
            return jnp.vdot(dq, u) + jnp.sum(ds * s) + jnp.vdot(out, d_out)

        with path.scope():
            return [np.asarray(x) for x in jax.jit(jax.grad(inner, argnums=(0, 1)))(q, sinks)]

    for got, want in zip(second(path), second(BACKEND_PATHS["xla"]), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("path", backend_paths(sweep=("triton-interpret",)))
def test_a_sink_of_minus_infinity_is_no_sink_and_stays_finite(path):
    q, k, v, _, d_out, d_lse, q_lengths, kv_lengths = inputs(2)
    kwargs = dict(
        is_causal=True, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        return_residuals=True, **path.kwargs,
    )  # fmt: skip
    no_sink = jnp.full((N,), -jnp.inf)

    def run(q, s):
        with_none = pallas_flash.flash_attention(q, k, v, sinks=s, **kwargs)
        plain = pallas_flash.flash_attention(q, k, v, **kwargs)
        _, vjp = jax.vjp(
            lambda q, s: pallas_flash.flash_attention(q, k, v, sinks=s, **kwargs), q, s
        )
        return with_none, plain, vjp((d_out, d_lse))

    with path.scope():
        with_none, plain, (dq, dsinks) = jax.tree.map(np.asarray, jax.jit(run)(q, no_sink))
    np.testing.assert_array_equal(with_none[0], plain[0])
    np.testing.assert_array_equal(with_none[1], plain[1])
    assert np.all(np.isfinite(dq))
    # A sink of -inf takes no share of any row; only the empty rows' lse (= the sink) depends on it.
    empty = ~visible_keys(q_lengths, kv_lengths).any(-1)  # [B, T]
    want = np.where(empty[:, None, :], np.asarray(d_lse), 0.0).sum(axis=(0, 2))
    np.testing.assert_allclose(dsinks, want, rtol=1e-6)


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


@pytest.mark.skipif(not SWEEP, reason="slow on CPU: PALLAS_FLASH_SWEEP=1")
@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_mosaic_forward_with_sinks_lowers_for_h200(soft_cap):
    """The Mosaic forward's epilogue with a sink lowers through Mosaic GPU's layout inference
    for an abstract H200 (the interpreter does not check layouts): a scalar per row block
    against row vectors in the WGMMA row layout."""
    from support.kernels import call_mosaic_forward
    from support.lowering import lower_for_h200

    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((2, 4), jnp.float32)

    def forward(q, k, v, sinks):
        return call_mosaic_forward(
            q, k, v, scale=0.1, is_causal=True, soft_cap=soft_cap, sinks=sinks
        )

    lowered = lower_for_h200(forward, q, kv, kv, sinks)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "options",
    [dict(), dict(logits_soft_cap=30.0), dict(key_value_seq_lengths=jnp.array([200, 77]))],
    ids=["plain", "soft-cap", "lengths"],
)
def test_triton_kernels_with_sinks_lower_for_h200(options):
    """The Triton forward's epilogue with a sink (against row vectors: the interpreter does
    not check the types Triton's ops need) and the backward after it lower for an abstract
    H200 into verified Triton modules."""
    from support.lowering import lower_for_h200

    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)

    def forward_and_backward(q, k, v, sinks):
        def attention(q, k, v, sinks):
            return pallas_flash.flash_attention(
                q, k, v, is_causal=True, sinks=sinks, backend="triton", **options
            )

        out, vjp = jax.vjp(attention, q, k, v, sinks)
        return out, vjp(out)

    text = lower_for_h200(forward_and_backward, q, kv, kv, sinks).as_text()
    assert "pallas_flash_forward" in text and "pallas_flash_backward_dq" in text


def causal_with_lengths(path, args, sinks, *, forward_only: bool):
    """[out, lse] (forward_only) or [out, lse, dq, dk, dv, dsinks], float64, of the causal call
    with `inputs`' lengths (args) and `sinks` on `path`."""
    q, k, v, _, d_out, d_lse, q_lengths, kv_lengths = args

    def fn(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_residuals=True, **path.kwargs,
        )  # fmt: skip

    with path.scope():
        if forward_only:
            return [np.asarray(x, np.float64) for x in jax.jit(fn)(q, k, v, sinks)]
        return outputs_and_grads(fn, q, k, v, sinks, d_out, d_lse)


@pytest.mark.parametrize("sink", [1e38, np.inf], ids=["1e38", "inf"])
@pytest.mark.parametrize("path", backend_paths(mosaic=True))
@pytest.mark.ci_slice(2)
def test_a_sink_beyond_float32_over_the_scale_takes_every_row(path, sink):
    """A finite sink of 1e38 at H = 64: 8e38 in the kernels' units (logit / scale), past
    float32, or a sink of +inf. It takes every row: out 0 and lse the sink, as in float64; the
    gradients are 0 but d sinks, the rows' sum of d_lse (P_sink = 1, delta = -d_lse). The
    Mosaic interpreter runs the forward only at 1e38 on CPU (its backward is slow there; the
    backward's part, lse = +inf, is the inf case's), every pass compiled."""
    size = sizes(path) | dict(H=64)
    args = inputs(8, **size)
    sinks = jnp.full((size["N"],), sink, jnp.float32)
    forward_only = path.mosaic and not path.gpu and sink != np.inf
    got = causal_with_lengths(path, args, sinks, forward_only=forward_only)
    out, lse = got[:2]
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, np.float64(np.float32(sink)))
    if forward_only:
        return
    d_lse = args[5]
    dq, dk, dv, dsinks = got[2:]
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_array_equal(grad, 0.0, err_msg=name)
    want = np.asarray(d_lse, np.float64).sum(axis=(0, 2))
    np.testing.assert_allclose(dsinks, want, rtol=1e-5)


@pytest.mark.parametrize("path", backend_paths(mosaic=True))
@pytest.mark.ci_slice(2)
def test_a_sink_below_float32_over_the_scale_matches_float64(path):
    """A finite sink of -1e38 at H = 64: -8e38 in the kernels' units (logit / scale), past
    float32. It takes no share of a row that sees a key, and a row that sees none gets out 0 and
    lse = the sink, as in float64: not lse -inf, and no NaN in d sinks (exp(sink - lse) * 0).
    The Mosaic interpreter runs the forward only on CPU."""
    size = sizes(path) | dict(H=64)
    args = q, k, v, _, d_out, d_lse, q_lengths, kv_lengths = inputs(9, **size)
    sinks = jnp.full((size["N"],), -1e38, jnp.float32)
    visible = visible_keys(q_lengths, kv_lengths, size["T"], size["S"])[:, None]
    assert (~visible.any(-1)).any()
    got = causal_with_lengths(path, args, sinks, forward_only=path.mosaic and not path.gpu)
    want = sink_attention_f64(q, k, v, sinks, visible, d_out, d_lse)
    assert_close_to_oracle(got, want, size["dtype"])


def tied_sink_case(magnitude):
    """Two query rows per head over 32 keys whose logits (scale 1) are `magnitude` at key 0 and
    0 elsewhere, with a sink of `magnitude`: the sink ties with the row's max, and float64 gives
    key 0 and the sink half of the row each."""
    rng = np.random.default_rng(11)
    q = jnp.zeros((1, 2, 2, 16), jnp.float32).at[..., 0].set(1.0)
    k = jnp.zeros((1, 32, 2, 16), jnp.float32).at[:, 0, :, 0].set(magnitude)
    v = jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((1, 2, 2, 16)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((1, 2, 2)), jnp.float32)
    sinks = jnp.full((2,), magnitude, jnp.float32)
    # float64: key 0 and the sink share the row (the other keys' e^(0 - magnitude) vanish).
    want_out = np.broadcast_to(np.asarray(v, np.float64)[:, :1] / 2, (1, 2, 2, 16))
    delta = np.einsum("btnh,btnh->bnt", np.asarray(d_out, np.float64), want_out) - d_lse
    want_dsinks = -(0.5 * delta).sum(axis=(0, 2))
    return q, k, v, sinks, d_out, d_lse, want_out, want_dsinks


SPLIT_TILES = pallas_flash.BlockSizes(block_q=16, block_kv=16, kv_splits=2)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-kv"])
@pytest.mark.parametrize("magnitude", [1e7, 1e9], ids=["1e7", "1e9"])
@pytest.mark.parametrize("path", backend_paths())
@pytest.mark.ci_slice(3)
def test_a_sink_tied_with_a_huge_logit_takes_its_share(path, magnitude, split):
    """A sink equal to a row's largest logit at |logit| >= 1e7, where float32's lse rounds the
    log 2 of the tie away: the sink still takes half of the row (out, d sinks), as in float64,
    on every path, split KV included (the sink's share comes from the row's denominators, not
    from exp(sink - lse))."""
    if split and path.name in ("xla", "default"):
        pytest.skip("split KV is a Triton forward's tiling")
    q, k, v, sinks, d_out, d_lse, want_out, want_dsinks = tied_sink_case(magnitude)
    kwargs = path.call_kwargs(SPLIT_TILES) if split else path.kwargs

    def fn(q, k, v, s):
        return pallas_flash.flash_attention(
            q, k, v, sinks=s, scale=1.0, return_residuals=True, **kwargs
        )

    with path.scope():
        out, lse, dq, dk, dv, dsinks = outputs_and_grads(fn, q, k, v, sinks, d_out, d_lse)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=1e-5)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(grad)), name


@pytest.mark.parametrize("path", backend_paths())
def test_a_sink_tied_with_a_huge_bias_takes_its_share(path):
    """The additive-padding form of the tie: every key's logit is a bias of -1e30 (q = k = 0,
    one bias broadcast over the keys, whose gradient has a closed form) and so is the sink:
    each of the 33 terms takes 1/33 of every row, as in float64 (out, d sinks, d bias)."""
    rng = np.random.default_rng(12)
    q = jnp.zeros((1, 2, 1, 16), jnp.float32)
    k = jnp.zeros((1, 32, 1, 16), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 32, 1, 16)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((1, 2, 1, 16)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((1, 1, 2)), jnp.float32)
    bias = jnp.full((1, 1, 1, 1), -1e30, jnp.float32)
    sinks = jnp.full((1,), -1e30, jnp.float32)

    def results(bias, sinks):
        def fn(bias, sinks):
            return pallas_flash.flash_attention(
                q, k, v, bias, sinks=sinks, return_residuals=True, **path.kwargs
            )

        (out, lse), vjp = jax.vjp(fn, bias, sinks)
        return (out, *vjp((d_out, d_lse)))

    with path.scope():
        out, dbias, dsinks = (np.asarray(x, np.float64) for x in jax.jit(results)(bias, sinks))
    v64, d_out64, d_lse64 = (np.asarray(x, np.float64) for x in (v, d_out, d_lse))
    want_out = np.broadcast_to(v64.sum(axis=1, keepdims=True) / 33, out.shape)
    d_out_dot_out = np.einsum("btnh,btnh->bnt", d_out64, want_out)
    want_dsinks = -(d_out_dot_out - d_lse64).sum(axis=(0, 2)) / 33
    want_dbias = (d_out_dot_out / 33 + d_lse64 * 32 / 33).sum()
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dbias.sum(), want_dbias, rtol=1e-4, atol=1e-5)
