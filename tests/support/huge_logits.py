"""Keys that tie at their rows' max at huge logits (~1e7 and ~1e9), each key three times: the
inputs and the check against the float64 oracle, shared by the NaN-safety tests
(tests/test_nan_safety.py) and ring attention's (tests/test_sharding_ring.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from support.inputs import normal
from support.oracle import attention_oracle_f64, to64
from support.tolerance import assert_close


def tied_huge_logits(dtype, is_causal, seed=11):
    """(q, k, v, d_out, d_lse), scale, visible of [1, 128, 2, 64] queries against 96 keys (32
    keys, three times each with their own values), logits ~1e7 in head 0 and ~1e9 in head 1
    from q and k themselves (float16 holds them; its gradients, with cotangents of 1e-3, too)."""
    q_len, kv_len, heads, head_dim = 128, 96, 2, 64
    rng = np.random.default_rng(seed)
    magnitude = np.asarray([700.0, 7000.0])[:, None]  # per head: |q.k| ~ 20 * magnitude^2
    q = jnp.asarray(rng.standard_normal((1, q_len, heads, head_dim)) * magnitude, dtype)
    k = jnp.asarray(rng.standard_normal((1, kv_len // 3, heads, head_dim)) * magnitude, dtype)
    k = jnp.concatenate([k] * 3, axis=1)
    v, d_out = (normal(rng, shape, dtype) for shape in ((1, kv_len, heads, head_dim), q.shape))
    d_out = d_out * jnp.asarray(1e-3, dtype)
    d_lse = normal(rng, (1, heads, q_len)) * 1e-3
    pos_q, pos_kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    visible = pos_kv <= pos_q if is_causal else np.ones((q_len, kv_len), bool)
    return (q, k, v, d_out, d_lse), 1.0, visible


def check_tied_huge_logits(results, args, scale, visible, dtype):
    """out and lse as float64's; dq, dk, dv to the inputs' precision relative to each head's
    magnitude: the tied keys' P is 1 / (number of ties) only when the backward clamps the
    recomputed P at 1 / l (the forward's log_sum) rather than 1."""
    out, lse, *grads = results
    with np.errstate(over="ignore"):  # exp of hidden logits, discarded by the oracle
        oracle = attention_oracle_f64(*(to64(x) for x in args), scale=scale, visible=visible)
    precision = 2e-2 if dtype == jnp.bfloat16 else 5e-3
    assert_close("out", out, oracle["out"], atol=precision)
    assert_close("lse", lse, oracle["lse"], atol=0, rtol=1e-6)
    for name, got in zip(("dq", "dk", "dv"), grads):
        for head in range(got.shape[2]):
            want = oracle[name][:, :, head]
            assert_close(
                f"{name} head {head}", got[:, :, head], want, atol=precision * np.abs(want).max()
            )
