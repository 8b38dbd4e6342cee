"""Gradients dq, dk, dv of the Triton kernels (cotangents for out and lse) against the float64
oracle, and against finite differences (jax.test_util.check_grads) at tiny float32 shapes."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.test_util import check_grads
from support.backends import SWEEP_ONLY
from support.calls import flash_fn, oracle_outputs_and_grads, outputs_and_grads, plain_fn
from support.inputs import GPU_PROBLEMS, Problem, case_id, random_inputs
from support.tolerance import assert_within_tolerance

# Covering set: lengths 1 / 17 / 100 / 257 with T > S and T < S, head dims 8 to 256, MHA / GQA /
# MQA, causal and not, all dtypes, every block configuration (they set the dK/dV and dQ tiles).
# CI runs the first six (one per dtype among them); PALLAS_FLASH_SWEEP runs all.
PROBLEMS = [
    Problem(2, 17, 17, 2, 2, 32, True, "f32"),
    Problem(1, 1, 17, 2, 1, 64, False, "f32"),
    Problem(1, 17, 1, 4, 2, 64, True, "f32", "all16"),
    Problem(1, 257, 257, 6, 2, 128, True, "bf16", "q32kv16"),
    Problem(1, 257, 100, 3, 1, 48, True, "f16"),
    # H=80 and q32kv16 again below (causal, and at 128): PALLAS_FLASH_SWEEP.
    pytest.param(Problem(2, 100, 257, 4, 2, 80, False, "f32", "q32kv16"), marks=SWEEP_ONLY),
    Problem(1, 257, 100, 4, 1, 80, True, "f32"),
    Problem(1, 100, 257, 2, 2, 128, True, "f32", "all16"),
    Problem(1, 257, 17, 2, 2, 256, False, "f32"),
    pytest.param(Problem(1, 100, 17, 4, 2, 128, False, "bf16", "all16"), marks=SWEEP_ONLY),
    Problem(1, 100, 100, 2, 1, 256, True, "bf16", "q32kv16"),
    Problem(1, 17, 257, 2, 1, 8, True, "bf16"),
    Problem(1, 17, 100, 8, 1, 32, False, "f16", "q32kv16"),
    Problem(2, 257, 129, 4, 2, 64, True, "f32", "q16kv64"),
    Problem(1, 1, 100, 4, 2, 32, True, "f16", "q16kv64"),
]


def check_grads_against_oracle(p: Problem, mode: str, q_factor: float = 1.0):
    """out, lse, dq, dk, dv vs the float64 oracle with the 2x rule, random cotangents.
    `q_factor` (a power of two, so exact) scales the queries and so the logits."""
    (q, k, v, d_out, d_lse), (q64, *f64) = random_inputs(p)
    q, q64 = q * q_factor, q64 * q_factor

    def run(attn):
        return jax.jit(functools.partial(outputs_and_grads, attn))(q, k, v, d_out, d_lse)

    results = run(flash_fn(p, mode))
    assert [x.dtype for x in results[2:]] == [q.dtype] * 3
    oracles = oracle_outputs_and_grads(p, q64, *f64)
    assert_within_tolerance(results, run(plain_fn(p)), oracles, floor=p.floor)


@pytest.mark.parametrize("p", PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(5)
def test_grads_match_oracle(p, mode):
    check_grads_against_oracle(p, mode)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.ci_slice(1)
def test_large_logits(dtype, mode):
    """Logits of standard deviation ~16 (peaked softmax): the online softmax stays accurate."""
    check_grads_against_oracle(Problem(1, 100, 67, 4, 2, 64, True, dtype), mode, q_factor=16.0)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.ci_slice(1)
def test_grads_without_lse(dtype, mode):
    """return_residuals=False: only out has a cotangent (the oracle's d_lse is zero)."""
    p = Problem(2, 100, 67, 4, 2, 64, True, dtype, "q32kv16")
    (q, k, v, d_out, _), (*qkv64, d_out64, d_lse64) = random_inputs(p)

    def run(attn):
        def out_and_grads(q, k, v):
            out, vjp = jax.vjp(attn, q, k, v)
            return (out, *vjp(d_out))

        return jax.jit(out_and_grads)(q, k, v)

    results = run(flash_fn(p, mode, return_residuals=False))
    baselines = run(lambda q, k, v: plain_fn(p)(q, k, v)[0])
    out, _, *grads = oracle_outputs_and_grads(p, *qkv64, d_out64, np.zeros_like(d_lse64))
    assert_within_tolerance(
        results, baselines, (out, *grads), floor=p.floor, names=("out", "dq", "dk", "dv")
    )


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=case_id)
def test_grads_match_oracle_large(p):
    check_grads_against_oracle(p, "gpu")


# Finite differences in float32 (never in bf16: its rounding swamps any eps).
TINY_PROBLEMS = [
    Problem(1, 7, 5, 2, 1, 8, True, "f32", "all16"),
    Problem(1, 5, 9, 4, 2, 16, False, "f32", "all16"),
    Problem(2, 19, 19, 2, 2, 8, True, "f32", "all16"),
    Problem(1, 18, 3, 3, 3, 24, False, "f32", "all16"),
]


@pytest.mark.parametrize("p", TINY_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(2)
def test_check_grads(p, mode):
    (q, k, v, _, _), _ = random_inputs(p, seed=1)
    check_grads(
        jax.jit(flash_fn(p, mode)),
        (q, k, v),
        order=1,
        modes=("rev",),
        eps=1e-3,
        atol=2e-2,
        rtol=2e-2,
    )
