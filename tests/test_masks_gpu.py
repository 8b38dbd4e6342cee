"""Mask arguments compiled on the GPU: kernels (bf16) against the reference in f32 on the same
bf16-rounded inputs, forward, lse and every gradient. Skipped without a GPU (marker `gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash

pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 700, 900, 8, 2, 128
_RNG = np.random.default_rng(7)
_SEGMENTS = np.sort(_RNG.integers(0, 5, (B, T)), axis=1).astype(np.int32)

CASES = {
    "lengths": dict(
        query_seq_lengths=np.array([700, 0]), key_value_seq_lengths=np.array([500, 900])
    ),
    "segments-causal": dict(
        q_segment_ids=_SEGMENTS,
        kv_segment_ids=np.sort(_RNG.integers(0, 5, (B, S)), axis=1).astype(np.int32),
        is_causal=True,
    ),
    "window": dict(local_window_size=(100, 30)),
    "window-causal": dict(local_window_size=256, is_causal=True),
    "soft-cap": dict(logits_soft_cap=5.0, is_causal=True),
    "bias": dict(bias=(B, N, T, S)),
    "bias-broadcast-cap": dict(bias=(1, N, 1, S), logits_soft_cap=3.0),
    "mask": dict(mask=(B, 1, T, S)),
    "all": dict(
        mask=(1, N, T, S),
        bias=(T, S),
        is_causal=True,
        local_window_size=(300, 0),
        query_seq_lengths=np.array([650, 500]),
        key_value_seq_lengths=np.array([900, 420]),
    ),
}


def _materialise(kwargs, rng):
    out = {}
    for name, value in kwargs.items():
        if name == "bias":
            out[name] = jnp.asarray(rng.standard_normal(value), jnp.bfloat16)
        elif name == "mask":
            out[name] = jnp.asarray(rng.random(value) < 0.6)
        elif isinstance(value, np.ndarray):
            out[name] = jnp.asarray(value)
        else:
            out[name] = value
    return out


def _outputs(fn, q, k, v, bias, cotangents):
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    (out, lse), vjp = jax.vjp(lambda *a: fn(*a) if bias is not None else fn(*a, None), *primals)
    d_out, d_lse = cotangents
    d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))


@pytest.mark.parametrize("case", list(CASES))
def test_masks_compiled_match_reference(case):
    rng = np.random.default_rng(hash(case) % 2**32)
    kwargs = _materialise(CASES[case], rng)
    bias = kwargs.pop("bias", None)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    cot = (
        jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32),
        jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32),
    )
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731

    def call(backend, dtype_cast):
        def fn(q, k, v, bias):
            q, k, v, bias = (dtype_cast(x) for x in (q, k, v, bias))
            return pallas_flash.flash_attention(
                q, k, v, bias, return_residuals=True, backend=backend, **kwargs
            )

        return jax.jit(functools.partial(_outputs, fn))(q, k, v, bias, cot)

    ours = call("triton", lambda x: x)
    ref = call("xla", f32)  # f32 oracle on the rounded inputs
    low = call("xla", lambda x: x)  # plain attention in bf16: the error budget
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for name, a, r, lo in zip(names, ours, ref, low):
        a, r, lo = (np.asarray(x, np.float32) for x in (a, r, lo))
        assert np.all(np.isfinite(a) | np.isneginf(r)), f"{case}: {name} has NaN/inf"
        if name == "lse":
            np.testing.assert_array_equal(np.isneginf(a), np.isneginf(r))
            a, r, lo = (np.where(np.isfinite(r), x, 0.0) for x in (a, r, lo))
        err = np.max(np.abs(a - r))
        budget = 2 * np.max(np.abs(lo - r)) + 1e-2 * max(1.0, np.max(np.abs(r)))
        assert err <= budget, f"{case}: {name} error {err:.3g} > budget {budget:.3g}"
