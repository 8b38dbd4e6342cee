"""A value head dim other than the query/key head dim (value [B, S, K, Hv], out [B, T, N, Hv]),
as multi-head latent attention uses it (192 for q.k, 128 for v).

Checked against a float64 numpy softmax (values, lse) and a float32 jnp one at full precision
(gradients), on every path of the backend matrix (support.backends.backend_paths), with GQA, causal
masks, lengths, windows, odd sizes (the Mosaic paths at their bfloat16 tile sizes) and Hv both
below and above H; on the H200 at the MLA shape.

The Mosaic and Triton forwards take Hv natively (V tiles, accumulator and output at Hv): the
Mosaic kernel is checked on its own in the Mosaic GPU interpreter at ragged lengths, GQA, causal,
windowed and soft-capped, on persistent CTAs; Triton's split-KV path in the Pallas interpreter;
both are lowered for an abstract H200 with V and out unpadded. So does the Mosaic backward (V,
dO and dV at Hv): its kernels on their own against float64 in the interpreter (GQA, MQA, causal,
windows, soft caps, segment ids and lengths, NaN at hidden keys, head splits, split dK/dV
consumers), lowered through the public call with V, out and dO unpadded, and compiled on the
H200. The Triton backward takes one head dim: V, out and dO reach it zero-padded to max(H, Hv)
(the gradient checks above).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import SWEEP, backend_paths, has_hopper
from support.calls import outputs_and_grads
from support.inputs import case_id, uniform_block_sizes
from support.kernels import call_mosaic_backward, call_mosaic_forward
from support.lowering import lower_for_h200
from support.mosaic_backward import BackwardCase, check_mosaic_backward
from support.mosaic_interpret import interpret_mosaic
from support.oracle import attention_oracle_f64

import pallas_flash
from pallas_flash import api, dispatch, masks
from pallas_flash import device as device_lib
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.mosaic import backward_tiles as mosaic_backward_tiles
from pallas_flash.mosaic import tiles as mosaic_tiles

SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="slow on CPU: PALLAS_FLASH_SWEEP=1")

B, T, S, N, K = 2, 37, 45, 4, 2
# (H, Hv) per case: odd sizes in float32; the Mosaic kernels' head dims and tiles in bfloat16.
HEAD_DIMS = {"Hv<H": (24, 16), "Hv>H": (16, 40)}
# Hv < H is multi-head latent attention's (192, 128).
MOSAIC_HEAD_DIMS = {"Hv<H": (192, 128), "Hv>H": (64, 128)}
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
    # numpy's generator: jax.random would compile a program per shape and dtype.
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, head_dim), (B, S, K, head_dim), (B, S, K, value_head_dim))
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in (*shapes, (B, T, N, value_head_dim))
    )
    return q, k, v, d_out, jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)


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
@pytest.mark.ci_slice(2)
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
    want, _ = masked_attention_f64(q64, k64, v64, scale=1 / np.sqrt(192), visible=causal)
    err = np.abs(np.asarray(out, np.float64) - want).max()
    err_xla = np.abs(np.asarray(xla, np.float64) - want).max()
    assert out.shape == (1, 2048, 16, 128) and np.isfinite(err)
    assert err <= 2 * err_xla, (err, err_xla)


# -- the Mosaic forward at its own value head dim -------------------------------------------------

# (H, Hv, T, S, N, K, causal, options): MLA's head dims with GQA, causal, T and S off the tiles;
# Hv > H on persistent CTAs (3 CTAs for 4 work items: the output buffer is reused across items)
# with ragged S; in the sweep: a narrow head dim (96), Hv = 256, windows and soft caps.
MOSAIC_FORWARD_CASES = [
    pytest.param(192, 128, 100, 201, 2, 1, True, {}, id="mla-gqa-causal-ragged"),
    pytest.param(64, 128, 200, 130, 2, 1, False, {}, id="hv>h-persistent-ragged"),
    pytest.param(
        96, 64, 300, 100, 2, 2, True, dict(window=(40, 0)), id="h96-window", marks=SWEEP_ONLY
    ),
    pytest.param(
        128, 256, 70, 200, 2, 1, True, dict(soft_cap=5.0), id="hv256-soft-cap", marks=SWEEP_ONLY
    ),
    pytest.param(
        192,
        128,
        130,
        300,
        4,
        1,
        False,
        dict(window=(20, 70)),
        id="mla-mqa-window",
        marks=SWEEP_ONLY,
    ),  # fmt: skip
]


def bf16_inputs(H, Hv, T, S, N, K, seed):
    """q, k, v, d_out (bfloat16) and d_lse (float32) of one batch entry, any N and K."""
    rng = np.random.default_rng(seed)
    shapes = ((1, T, N, H), (1, S, K, H), (1, S, K, Hv), (1, T, N, Hv))
    xs = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in shapes]
    return (*xs, jnp.asarray(rng.standard_normal((1, N, T)), jnp.float32))


def visible_f64(T, S, *, is_causal, window):
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    vis = np.ones((T, S), bool)
    if is_causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    return vis


def masked_attention_f64(q, k, v, *, scale, visible, soft_cap=None):
    """out [B, T, N, Hv], lse [B, N, T] of the float64 oracle (rows that see no key: 0, -inf)."""
    r = attention_oracle_f64(q, k, v, scale=scale, visible=visible, soft_cap=soft_cap)
    return r["out"], r["lse"]


@pytest.mark.parametrize("H, Hv, T, S, N, K, is_causal, options", MOSAIC_FORWARD_CASES)
def test_mosaic_forward_takes_the_value_head_dim_interpreted(
    H, Hv, T, S, N, K, is_causal, options, monkeypatch
):
    """The Mosaic forward's kernel (interpreter, race detector on, garbage past the arrays'
    ends) on v [B, S, K, Hv]: out [B, T, N, Hv] and lse against float64, within twice the
    error of XLA's attention in bfloat16 (P rounded to bfloat16 for P V, as the kernel does)."""
    q, k, v, _, _ = bf16_inputs(H, Hv, T, S, N, K, seed=1)
    scale = 1.0 / np.sqrt(H)
    few_sms = dataclasses.replace(Device.h200(), num_sms=3)
    run = functools.partial(
        call_mosaic_forward, scale=scale, is_causal=is_causal, device=few_sms, **options
    )
    # Past the ends TMA reads finite garbage: rows past T are dropped, keys past S masked.
    with interpret_mosaic(oob_fill=7.0):
        out, lse = jax.jit(run)(q, k, v)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert out.shape == (1, T, N, Hv) and lse.shape == (1, N, T)
    visible = visible_f64(T, S, is_causal=is_causal, window=options.get("window"))
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    soft_cap = options.get("soft_cap")
    want_out, want_lse = masked_attention_f64(*f64, scale=scale, visible=visible, soft_cap=soft_cap)
    xla = jax.jit(
        functools.partial(
            pallas_flash.flash_attention, scale=scale, is_causal=is_causal,
            local_window_size=options.get("window"), logits_soft_cap=soft_cap, backend="xla",
        )
    )(q, k, v)  # fmt: skip
    xla_err = np.abs(np.asarray(xla, np.float64) - want_out).max()
    assert np.abs(out - want_out).max() <= 2 * xla_err + 1e-3
    empty = ~visible.any(axis=1)
    assert (out[:, empty] == 0).all() and np.isneginf(lse[:, :, empty]).all()
    np.testing.assert_allclose(lse[:, :, ~empty], want_lse[:, :, ~empty], atol=1e-4)


def test_mosaic_forward_lowers_with_v_and_out_unpadded():
    """MLA's (192, 128) lowered for an abstract H200: one Mosaic GPU call whose operands and
    result carry V and out at 128 columns (no copy of V padded to 192, out not sliced)."""
    b, t, n, k = 1, 1024, 4, 2
    q = jax.ShapeDtypeStruct((b, t, n, 192), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((b, t, k, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((b, t, k, 128), jnp.bfloat16)
    run = functools.partial(call_mosaic_forward, scale=0.1, is_causal=True)
    lowered = lower_for_h200(run, q, kk, v)
    text = lowered.as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line]
    assert len(calls) == 1 and "stablehlo.pad" not in text and "stablehlo.slice" not in text
    signature = calls[0].rsplit("} : ", 1)[1]
    assert signature == (
        f"(tensor<{b}x{t}x{n}x192xbf16>, tensor<{b}x{t}x{k}x192xbf16>, "
        f"tensor<{b}x{t}x{k}x128xbf16>) -> (tensor<{b}x{t}x{n}x128xbf16>, "
        f"tensor<{b}x{n}x{t}xf32>)"
    ), signature
    out, lse = lowered.out_info
    assert out.shape == (b, t, n, 128) and lse.shape == (b, n, t)


def test_mosaic_budgets_count_both_head_dims():
    """Shared memory holds K at H and V at Hv, and an output tile of its own when their
    padded head dims differ; the register budget is the [block_q, Hv] accumulator's."""
    tiles = mosaic_tiles.ForwardTiles(block_q=64, block_kv=64, num_stages=2)
    rows = tiles.cta_rows
    assert tiles.smem_bytes(192, 2, value_head_dim=128) == (
        rows * 192 * 2 + rows * 128 * 2 + 2 * 64 * (192 + 128) * 2 + 2 * rows * 4
    )
    assert tiles.smem_bytes(192, 2, value_head_dim=192) == tiles.smem_bytes(192, 2)
    wide = mosaic_tiles.ForwardTiles(block_q=128, block_kv=128, num_stages=2)
    shapes = dict(q_shape=(1, 512, 2, 128), k_shape=(1, 512, 2, 128), dtype=jnp.bfloat16)
    assert mosaic_tiles.why_not(**shapes, value_head_dim=64, is_causal=False, tiles=wide) is None
    reason = mosaic_tiles.why_not(**shapes, value_head_dim=128, is_causal=False, tiles=wide)
    assert "registers" in reason
    shapes = dict(shapes, q_shape=(1, 512, 2, 64), k_shape=(1, 512, 2, 64))
    assert "value_head_dim=256" in mosaic_tiles.why_not(
        **shapes, value_head_dim=256, is_causal=False, tiles=wide
    )
    assert "value_head_dim=32 is not one of" in mosaic_tiles.why_not(
        **shapes, value_head_dim=32, is_causal=False
    )
    mla = mosaic_tiles.default_tiles(192, value_head_dim=128, q_len=4096, kv_len=4096,
                                     is_causal=True)  # fmt: skip
    assert mla == mosaic_tiles.default_tiles(192, q_len=4096, kv_len=4096, is_causal=True)
    shapes = dict(q_shape=(1, 4096, 16, 192), k_shape=(1, 4096, 16, 192), dtype=jnp.bfloat16)
    assert mosaic_tiles.why_not(**shapes, value_head_dim=128, is_causal=True) is None


def test_the_dispatch_runs_mla_on_the_mosaic_forward():
    """On an H200 the default kernels of MLA's (192, 128) are the Mosaic forward and backward,
    both at both head dims (the backward's tiles those of 192); a value head dim the Mosaic
    forward does not take (Hv = 32) goes to Triton for both passes, and backend="mosaic"
    refuses it naming it (the backward takes every pair the forward takes)."""
    spec = masks.MaskSpec(q_len=4096, kv_len=4096, is_causal=True)
    mla = Call(
        q_shape=(2, 4096, 16, 192), k_shape=(2, 4096, 16, 192), dtype=jnp.bfloat16, spec=spec,
        value_head_dim=128,
    )  # fmt: skip
    config = dispatch.choose(mla, Device.h200(), scale=0.1)
    assert config.forward == "mosaic"
    assert config.mosaic_forward_tiles == mosaic_tiles.default_tiles(
        192, value_head_dim=128, q_len=4096, kv_len=4096, is_causal=True
    )
    assert config.backward == "mosaic"
    assert config.mosaic_backward_tiles == mosaic_backward_tiles.default_tiles(192, 128)
    plain = dataclasses.replace(mla, value_head_dim=None)
    assert config.block_sizes == dispatch.choose(plain, Device.h200(), scale=0.1).block_sizes
    odd = dataclasses.replace(
        mla, q_shape=(2, 4096, 16, 64), k_shape=(2, 4096, 16, 64), value_head_dim=32
    )
    odd_config = dispatch.choose(odd, Device.h200(), scale=0.1)
    assert (odd_config.forward, odd_config.backward) == ("triton", "triton")
    with pytest.raises(NotImplementedError, match=r"backend='mosaic' .*value_head_dim=32"):
        dispatch.choose(odd, Device.h200(), scale=0.1, backend="mosaic")


@pytest.mark.gpu
@pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
@pytest.mark.parametrize(
    "T, N, K, is_causal", [(3000, 16, 16, True), (4096, 16, 4, False), (1000, 8, 8, True)]
)
def test_mosaic_mla_matches_float64_on_gpu(T, N, K, is_causal):
    """MLA's (192, 128) compiled with backend="mosaic" (the Mosaic forward and backward, both
    at Hv = 128): out and lse within twice XLA's bfloat16 error of float64, gradients within
    twice XLA's of float32 at full precision; ragged T, GQA, causal and not."""
    q, k, v, d_out, d_lse = bf16_inputs(192, 128, T, T, N, K, seed=3)

    def attention(**kwargs):
        def fn(q, k, v):
            return pallas_flash.flash_attention(
                q, k, v, is_causal=is_causal, return_residuals=True, **kwargs
            )

        return fn

    def outputs_and_grads(fn, dtype):
        xs = [x.astype(dtype) for x in (q, k, v)]
        (out, lse), vjp = jax.vjp(fn, *xs)
        return [out, lse, *vjp((d_out.astype(out.dtype), d_lse))]

    got = jax.jit(lambda: outputs_and_grads(attention(backend="mosaic"), jnp.bfloat16))()
    xla = jax.jit(lambda: outputs_and_grads(attention(backend="xla"), jnp.bfloat16))()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda: outputs_and_grads(attention(backend="xla"), jnp.float32))()
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    visible = visible_f64(T, T, is_causal=is_causal, window=None)
    want[:2] = masked_attention_f64(q64, k64, v64, scale=1 / np.sqrt(192), visible=visible)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, x, w in zip(names, got, xla, want, strict=True):
        g, x, w = (np.asarray(a, np.float64) for a in (g, x, w))
        assert g.shape == w.shape, name
        err, xla_err = np.abs(g - w).max(), np.abs(x - w).max()
        assert err <= 2 * xla_err + 1e-3, (name, err, xla_err)


# -- the Triton forward at its own value head dim -------------------------------------------------


def test_triton_split_kv_forward_takes_the_value_head_dim():
    """The Triton forward's split-KV path (3 programs per query tile, merged by logsumexp) in the
    Pallas interpreter at Hv > H (padded tiles 64 and 32): out and lse against float64."""
    H, Hv, T, S = 24, 40, 33, 45
    q, k, v, _, _ = (x.astype(jnp.float32) for x in bf16_inputs(H, Hv, T, S, N, K, seed=2))
    tiles = dataclasses.replace(uniform_block_sizes(16), kv_splits=3)
    run = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True, backend="triton",
        interpret=True, block_sizes=tiles,
    )  # fmt: skip
    out, lse = (np.asarray(x, np.float64) for x in jax.jit(run)(q, k, v))
    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    want_out, want_lse = masked_attention_f64(
        *f64, scale=1 / np.sqrt(H), visible=visible_f64(T, S, is_causal=True, window=None)
    )
    assert out.shape == (1, T, N, Hv)
    np.testing.assert_allclose(out, want_out, atol=ATOL[jnp.float32][0])
    np.testing.assert_allclose(lse, want_lse, atol=ATOL[jnp.float32][0])


def test_triton_forward_lowers_with_v_and_out_unpadded():
    """MLA's (192, 128) on the Triton forward, lowered for an abstract H200: the kernel takes V
    and writes out at 128 columns (no copy of V padded to 192, out not sliced)."""
    b, t, n, k = 1, 1024, 16, 4  # a grid that fills the GPU: no split-KV
    q = jax.ShapeDtypeStruct((b, t, n, 192), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((b, t, k, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((b, t, k, 128), jnp.bfloat16)
    run = functools.partial(pallas_flash.flash_attention, is_causal=True, backend="triton")
    with mock.patch.object(device_lib, "target_device", Device.h200):
        text = lower_for_h200(run, q, kk, v).as_text()
    calls = [line for line in text.splitlines() if 'name = "pallas_flash_forward"' in line]
    assert len(calls) == 1 and "stablehlo.pad" not in text and "stablehlo.slice" not in text
    signature = calls[0].rsplit("} : ", 1)[1]
    assert signature == (
        f"(tensor<{b}x{t}x{n}x192xbf16>, tensor<{b}x{t}x{k}x192xbf16>, "
        f"tensor<{b}x{t}x{k}x128xbf16>) -> (tensor<{b}x{t}x{n}x128xbf16>, "
        f"tensor<{b}x{n}x{t}xf32>, tensor<{b}x{n}x{t}xf32>)"  # out, lse, log_sum
    ), signature


# -- the Mosaic backward at its own value head dim ------------------------------------------------


# In CI: MLA's (192, 128) at its defaults (split dK/dV consumers: dK staged through K's buffer,
# dV through V's), two query heads on one KV head, causal, ragged T and S, packed documents with
# lengths (rows and keys that see nothing), NaN at hidden keys. With PALLAS_FLASH_SWEEP:
# non-causal MQA with a window and a soft cap; Hv > H with GQA on two dK/dV consumers that hold
# both accumulators, with head splits (their partials staged through a tile of each head dim);
# split consumers with head splits; T < S causal (CTAs whose keys no row sees: the dK consumer
# takes no P^T); H and Hv on narrow swizzles (96, 80); (256, 128) with one dQ consumer.
def _tiles(split_dkv=False, dkv_head_splits=0):
    return mosaic_backward_tiles.BackwardTiles(split_dkv=split_dkv, dkv_head_splits=dkv_head_splits)


MOSAIC_BACKWARD_CASES = [
    pytest.param(
        BackwardCase(192, 128, 2, 70, 90, 2, 1, True, kind="packed-lengths", poison=True),
        id="mla-mqa-causal-lengths-nan",
    ),
    pytest.param(
        BackwardCase(192, 128, 1, 130, 300, 4, 1, False, window=(20, 70), soft_cap=10.0),
        id="mla-mqa-window-soft-cap",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        BackwardCase(64, 128, 2, 200, 130, 4, 2, True, kind="lengths", tiles=_tiles(False, 2)),
        id="hv>h-gqa-head-splits-lengths",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        BackwardCase(192, 128, 1, 70, 200, 4, 1, False, kind="unsorted", tiles=_tiles(True, 2)),
        id="mla-split-head-splits-unsorted",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        BackwardCase(128, 64, 1, 40, 200, 2, 1, True, window=(30, 0)),
        id="hv<h-t<s-causal-window",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        BackwardCase(96, 80, 1, 150, 99, 2, 2, False, kind="gap"),
        id="narrow-head-dims-gap",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        BackwardCase(256, 128, 1, 150, 150, 2, 1, True, soft_cap=5.0),
        id="h256-hv128-causal-soft-cap",
        marks=SWEEP_ONLY,
    ),
]


@pytest.mark.parametrize("c", MOSAIC_BACKWARD_CASES, ids=case_id)
def test_mosaic_backward_takes_the_value_head_dim_interpreted(c):
    """The Mosaic backward's kernels (interpreter, race detector on) on v, out, d_out at Hv:
    dq, dk and dv against float64 (see `check_mosaic_backward`)."""
    check_mosaic_backward(c, interpreted=True)


# Compiled on the H200: every interpreted case, and larger ones at MLA's head dims and at pairs
# of every split of the dK/dV consumers.
MOSAIC_BACKWARD_GPU_CASES = [
    *(x.values[0] for x in MOSAIC_BACKWARD_CASES),
    BackwardCase(192, 128, 2, 1000, 1000, 8, 2, True),
    BackwardCase(192, 128, 1, 2048, 2048, 16, 16, False),
    BackwardCase(192, 128, 2, 1000, 777, 4, 1, True, window=(200, 0), kind="packed-lengths"),
    BackwardCase(128, 64, 2, 1024, 1024, 4, 2, True),
    BackwardCase(64, 128, 2, 1024, 1024, 4, 4, False),
    BackwardCase(128, 256, 1, 1000, 1000, 4, 2, True),
    BackwardCase(256, 192, 1, 777, 1000, 4, 1, False, soft_cap=20.0),
    BackwardCase(
        64, 192, 2, 512, 512, 4, 1, True, tiles=mosaic_backward_tiles.default_tiles(64, 192)
    ),
    # Split consumers on CTAs whose keys no row sees (T < S, causal): the dK consumer stages dK
    # through K's buffer without ever taking a P^T.
    BackwardCase(192, 128, 1, 300, 1000, 4, 1, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
@pytest.mark.parametrize("c", MOSAIC_BACKWARD_GPU_CASES, ids=case_id)
def test_mosaic_backward_takes_the_value_head_dim_on_gpu(c):
    check_mosaic_backward(c, interpreted=False)


@pytest.mark.gpu
@pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
@pytest.mark.parametrize(
    "c",
    [
        BackwardCase(192, 128, 2, 1000, 1000, 8, 2, True),
        BackwardCase(192, 128, 1, 300, 1000, 4, 1, True),  # CTAs that take no P^T
    ],
    ids=case_id,
)
def test_mosaic_backward_split_epilogue_is_bitwise_repeatable_on_gpu(c):
    """The split dK/dV consumers at H != Hv stage dK through K's buffer and dV through V's,
    each after the other consumer's last read: a race there shows first as run-to-run
    differences."""
    rng = np.random.default_rng(7)
    q, k, v, out, d_out = (
        rng.standard_normal(shape).astype(jnp.bfloat16)
        for shape in (
            (c.B, c.T, c.N, c.H),
            (c.B, c.S, c.K, c.H),
            (c.B, c.S, c.K, c.Hv),
            (c.B, c.T, c.N, c.Hv),
            (c.B, c.T, c.N, c.Hv),
        )
    )
    lse = rng.standard_normal((c.B, c.N, c.T)).astype(np.float32) + 5.0
    backward = jax.jit(
        functools.partial(
            call_mosaic_backward, scale=c.H**-0.5, is_causal=c.is_causal, tiles=c.tiles
        )
    )
    first = [np.asarray(g) for g in backward(q, k, v, out, lse, d_out, None)]
    for _ in range(10):
        for want, got in zip(first, backward(q, k, v, out, lse, d_out, None), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)


def lowered_mosaic_signatures(text: str) -> list[str]:
    """The operand and result types of each Mosaic GPU call in a lowered module's text."""
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line]
    return [line.rsplit("} : ", 1)[1] for line in calls]


def test_mosaic_backward_lowers_with_v_and_d_out_unpadded():
    """MLA's (192, 128) through the public call as an H200 runs it (forward and backward, the
    MLA benchmark's shape with GQA), lowered for an abstract H200: three Mosaic GPU calls, the
    backward's two taking V, out and dO at 128 columns and the dK/dV call writing dV at 128;
    nothing padded to 192 or sliced back."""
    b, t, n, kh = 2, 4096, 16, 4
    q = jax.ShapeDtypeStruct((b, t, n, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kh, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((b, t, kh, 128), jnp.bfloat16)
    d_out = jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16)
    d_lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True
    )
    with mock.patch.object(device_lib, "target_device", Device.h200):
        lowered = lower_for_h200(
            functools.partial(outputs_and_grads, attention), q, k, v, d_out, d_lse
        )
    text = lowered.as_text()
    assert "stablehlo.pad" not in text and "stablehlo.slice" not in text
    _, dkv, dq = lowered_mosaic_signatures(text)
    q_t, k_t = f"tensor<{b}x{t}x{n}x192xbf16>", f"tensor<{b}x{t}x{kh}x192xbf16>"
    v_t, o_t = f"tensor<{b}x{t}x{kh}x128xbf16>", f"tensor<{b}x{t}x{n}x128xbf16>"
    # lse * log2(e) beside its rows' bound, and delta.
    bounded, rows = f"tensor<{b}x{n}x2x{t}xf32>", f"tensor<{b}x{n}x{t}xf32>"
    operands = f"({q_t}, {k_t}, {v_t}, {o_t}, {bounded}, {rows})"
    assert dkv == f"{operands} -> ({k_t}, {v_t})", dkv
    assert dq == f"{operands} -> {q_t}", dq
    assert [x.shape for x in lowered.out_info[2:]] == [q.shape, k.shape, v.shape]


# Lowering runs Mosaic GPU's layout inference and its shared-memory budget: MLA's defaults and
# head splits, Hv > H on consumers that hold both accumulators, (256, 128) with one dQ consumer.
BACKWARD_LOWERING_CASES = [
    pytest.param(192, 128, None, id="mla"),
    pytest.param(
        192,
        128,
        mosaic_backward_tiles.BackwardTiles(split_dkv=True, dkv_head_splits=2),
        id="mla-head-splits",
        marks=SWEEP_ONLY,
    ),
    pytest.param(
        64,
        128,
        mosaic_backward_tiles.BackwardTiles(dkv_head_splits=2),
        id="hv>h-head-splits",
        marks=SWEEP_ONLY,
    ),  # fmt: skip
    pytest.param(256, 128, None, id="h256-hv128", marks=SWEEP_ONLY),
    pytest.param(128, 64, None, id="hv<h", marks=SWEEP_ONLY),
]


@pytest.mark.parametrize("H, Hv, tiles", BACKWARD_LOWERING_CASES)
def test_mosaic_backward_lowers_at_both_head_dims(H, Hv, tiles):
    """flash_backward alone, lowered for an abstract H200 (MQA, 512 rows, causal): two Mosaic
    GPU calls; dq and dk at H, dv at Hv."""
    b, t, n, kh = 1, 512, 4, 1
    q = jax.ShapeDtypeStruct((b, t, n, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kh, H), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((b, t, kh, Hv), jnp.bfloat16)
    out = jax.ShapeDtypeStruct((b, t, n, Hv), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
    run = functools.partial(
        call_mosaic_backward, scale=0.1, is_causal=True, tiles=tiles,
        device=Device.h200(),
    )  # fmt: skip
    lowered = lower_for_h200(run, q, k, v, out, lse, out, lse)
    assert len(lowered_mosaic_signatures(lowered.as_text())) == 2
    assert [x.shape for x in lowered.out_info] == [q.shape, k.shape, v.shape]


def test_mosaic_backward_budgets_count_both_head_dims():
    """Shared memory holds K, Q at H and V, dO at Hv (and the head splits' f32 staging tiles of
    each); the dK/dV registers are dK's and dV's accumulators (split: the larger one); the
    dQ kernel's accumulator is [block_q_dq, H]."""
    bt = mosaic_backward_tiles.BackwardTiles
    plain, split = bt(), bt(split_dkv=True)
    for tiles in (plain, split):
        for splits in (1, 2):
            assert tiles.smem_bytes_dkv(192, 2, value_head_dim=192, head_splits=splits) == (
                tiles.smem_bytes_dkv(192, 2, head_splits=splits)
            )
    # K, V of one 64-key block; P^T; Q, dO and lse, bound, delta rows of a two-stage 64-row ring.
    assert split.smem_bytes_dkv(192, 2, value_head_dim=128) == (
        64 * (192 + 128) * 2 + 64 * 64 * 4 + 2 * 64 * ((192 + 128) * 2 + 12)
    )
    # The split consumers' f32 staging tiles: dK's [64, 192], dV's [64, 128].
    assert split.smem_bytes_dkv(192, 2, value_head_dim=128, head_splits=2) == (
        split.smem_bytes_dkv(192, 2, value_head_dim=128) + 64 * (192 + 128) * 4
    )
    # Two consumers holding both: a tile of each head dim apiece.
    assert plain.smem_bytes_dkv(64, 2, value_head_dim=128, head_splits=2) == (
        plain.smem_bytes_dkv(64, 2, value_head_dim=128) + 2 * 64 * (64 + 128) * 4
    )
    assert plain.smem_bytes_dq(192, 2, value_head_dim=128) == (
        128 * ((192 + 128) * 2 + 12) + 2 * 64 * (192 + 128) * 2
    )
    assert split.tile_registers(192, 128) == split.tile_registers(192)
    assert split.tile_registers(128, 192) == {"dK/dV": 160, "dQ": 128}
    assert plain.tile_registers(128, 64) == {"dK/dV": 160, "dQ": 128}
    assert mosaic_backward_tiles.default_tiles(192, 128) == mosaic_backward_tiles.default_tiles(192)
    assert mosaic_backward_tiles.default_tiles(64, 256) == mosaic_backward_tiles.default_tiles(256)
    shapes = dict(q_shape=(2, 4096, 16, 192), k_shape=(2, 4096, 16, 192), dtype=jnp.bfloat16)
    assert mosaic_backward_tiles.why_not(**shapes, value_head_dim=128, is_causal=True) is None
    reason = mosaic_backward_tiles.why_not(
        **shapes, value_head_dim=128, is_causal=True, tiles=plain
    )
    assert "value_head_dim=128" in reason and "would spill" in reason
    reason = mosaic_backward_tiles.why_not(**shapes, value_head_dim=32, is_causal=True)
    assert "value_head_dim=32 is not one of" in reason


def test_mosaic_backward_takes_every_pair_that_a_wider_square_call_fits():
    """Every (H, Hv) of HEAD_DIMS runs, with any mask, dropout and tiles (defaults, head
    splits, split consumers, one consumer), wherever H = Hv = max(H, Hv) rounded up to a
    multiple of 64 does: the budgets at (H, Hv) are within those at the wider square call, so
    narrower head dims (80, 96, an Hv of their own) never refuse tiles that it takes. One
    exception: head splits on consumers that hold both accumulators stage dK and dV through one
    f32 tile at H == Hv but through one of each at H != Hv, which at (96, 128) and (128, 96)
    overflows shared memory where (128, 128)'s one tile fits (automatic head splits leave them
    unsplit; `head_splits`)."""
    head_dims = mosaic_tiles.HEAD_DIMS
    bt = mosaic_backward_tiles.BackwardTiles
    all_tiles = (
        None, bt(dkv_head_splits=2), bt(split_dkv=True, dkv_head_splits=2),
        bt(num_consumers=1, split_dkv=True), bt(block_q_dkv=128, block_kv_dq=128, num_stages=3),
    )  # fmt: skip
    taken, refused = 0, set()
    for H, Hv in itertools.product(head_dims, head_dims):
        h = -(-max(H, Hv) // 64) * 64
        for causal, segments, dropout, tiles in itertools.product(
            (False, True), (False, True), (False, True), all_tiles
        ):
            options = dict(is_causal=causal, segments=segments, dropout=dropout, tiles=tiles)
            if mosaic_backward_tiles.why_not(
                (2, 512, 8, h), (2, 512, 4, h), jnp.bfloat16, **options
            ):
                continue
            taken += 1
            reason = mosaic_backward_tiles.why_not(
                (2, 512, 8, H), (2, 512, 4, H), jnp.bfloat16, value_head_dim=Hv, **options
            )
            if reason is not None:
                assert tiles == bt(dkv_head_splits=2), (H, Hv, options, reason)
                assert "shared memory in dK/dV" in reason, reason
                refused.add((H, Hv))
    assert taken > 500
    assert refused == {(96, 128), (128, 96)}


def test_backward_at_residuals_refuses_value_shapes_before_tracing():
    """out and d_out must have v's head dim Hv (the output's): ValueError naming the array, its
    shape and the rule, before any kernel is traced (the API checks; the kernels do not)."""
    q = jnp.zeros((1, 64, 2, 192), jnp.bfloat16)
    k = jnp.zeros((1, 64, 1, 192), jnp.bfloat16)
    v = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 64), jnp.float32)
    wide = jnp.zeros((1, 64, 2, 192), jnp.bfloat16)
    narrow = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    backward = functools.partial(pallas_flash.flash_attention_backward, q, k, v)
    with pytest.raises(ValueError, match=r"out.shape=\(1, 64, 2, 192\) must be \(1, 64, 2, 128\)"):
        backward(wide, lse, narrow)
    with pytest.raises(
        ValueError, match=r"d_out.shape=\(1, 64, 2, 192\) must be \(1, 64, 2, 128\)"
    ):
        backward(narrow, lse, wide)
