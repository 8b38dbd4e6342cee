"""The float64 oracle of every test (support.oracle.attention_oracle_f64) computes the same in numpy
(CPU runs) and in jax under float64 (the GPU suite's, on the GPU), with dropout's keep-mask
and without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.oracle import _oracle


@pytest.mark.parametrize("with_keep", [False, True])
def test_numpy_and_jax_oracles_agree(with_keep):
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 7, 11, 4, 2, 8
    rng = np.random.default_rng(0)
    q, d_out = (rng.standard_normal((batch, q_len, heads, head_dim)) for _ in range(2))
    k, v = (rng.standard_normal((batch, kv_len, kv_heads, head_dim)) for _ in range(2))
    d_lse = rng.standard_normal((batch, heads, q_len))
    bias = rng.standard_normal((1, heads, q_len, kv_len))
    visible = rng.random((batch, 1, q_len, kv_len)) < 0.6
    visible[1, 0, 3] = False  # a row that sees no key
    keep = rng.random((batch, heads, q_len, kv_len)) >= 0.3 if with_keep else None
    arrays = (q, k, v, d_out, d_lse, visible, bias, keep)
    kwargs = dict(scale=0.3, soft_cap=5.0, rate=0.3 if with_keep else 0.0)
    with np.errstate(divide="ignore"):
        want = _oracle(np, *arrays, **kwargs)
    with jax.enable_x64(True):
        got = _oracle(jnp, *(None if x is None else jnp.asarray(x) for x in arrays), **kwargs)
        got = {name: np.asarray(x) for name, x in got.items()}
    assert set(got) == {"out", "lse", "dq", "dk", "dv", "dlogits"}
    assert want["lse"][1, 0, 3] == -np.inf and np.all(want["out"][1, 3, 0] == 0)
    for name, x in want.items():
        assert got[name].dtype == np.float64, name
        np.testing.assert_allclose(got[name], x, rtol=1e-12, atol=1e-12, err_msg=name)
