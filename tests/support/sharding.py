"""What the mesh tests share (tests/test_sharding.py, tests/test_sharding_ring.py): the flags of
the child process on 8 CPU devices that runs their multi-device tests, random inputs, a loss that
reaches out and lse, a closeness check that keeps the infinities, and the collectives in compiled
HLO.

jax fixes its device count when it starts, so the multi-device tests run in one child pytest
process on `NUM_DEVICES` CPU devices (PALLAS_FLASH_SHARDING_CHILD=1, which
test_sharding.py's `test_on_8_cpu_devices` starts over both files); PALLAS_FLASH_SHARDING_ALL=1
runs their full case matrices (the CI runs a fixed slice).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from support.backends import BACKEND_PATHS

CHILD = os.environ.get("PALLAS_FLASH_SHARDING_CHILD") == "1"
ALL_CASES = os.environ.get("PALLAS_FLASH_SHARDING_ALL") == "1"
NUM_DEVICES = 8
INTERPRET = BACKEND_PATHS["triton-interpret"].kwargs


def hlo_collectives(hlo: str):
    """(kind, result shape) of every cross-device collective in compiled HLO text."""
    pattern = (
        r"= (\([^)]*\)|\S+) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)"
    )
    return [(kind, shape) for shape, kind in re.findall(pattern + r"(?:-start)?\(", hlo)]


def qkv_inputs(batch, q_len, kv_len, num_heads, num_kv_heads, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, q_len, num_heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, kv_len, num_kv_heads, head_dim)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    return q, k, v, d_out


def weighted_loss(attn, d_out):
    """A scalar whose gradient reaches out and lse with random weights (lse -inf rows dropped)."""

    def loss(*args):
        out, lse = attn(*args)
        lse_term = jnp.where(jnp.isfinite(lse), lse, 0.0) * jnp.linspace(0.5, 1.5, lse.shape[-1])
        return jnp.sum(out * d_out) + jnp.sum(lse_term)

    return loss


def assert_close(got, want, atol=2e-5):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        np.testing.assert_array_equal(np.isinf(x), np.isinf(y))
        finite = np.isfinite(y)
        np.testing.assert_allclose(x[finite], y[finite], atol=atol, rtol=2e-5)
