"""Forward pass (out and lse) of the Triton kernels against the float64 oracle, and the kernels
under jax transformations (rank-3 inputs, vmap, scan, checkpoint) and repeated calls."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import SWEEP
from support.calls import (
    flash_fn,
    oracle_outputs_and_grads,
    outputs_and_grads,
    plain_fn,
    vmapped_outputs_and_grads,
)
from support.inputs import GPU_PROBLEMS, Problem, case_id, random_inputs
from support.oracle import attention_f64, attention_grads_f64
from support.tolerance import assert_bitwise_equal, assert_within_tolerance, tolerance_violations

import pallas_flash

# A covering set rather than a product: every length (1, 17, 100, 257) on both sides with T > S and
# T < S, every head dim, MHA / GQA (groups of 2 and 3) / MQA, all dtypes, every block configuration.
PROBLEMS = [
    Problem(2, 17, 17, 2, 2, 32, True, "f32"),
    Problem(1, 1, 17, 2, 1, 64, False, "f32"),
    Problem(1, 17, 1, 4, 2, 64, True, "bf16", "all16"),
    Problem(2, 1, 1, 2, 1, 32, True, "bf16", "all16"),
    Problem(2, 100, 257, 4, 2, 80, False, "f32", "q32kv16"),
    Problem(1, 257, 100, 4, 1, 80, True, "bf16"),
    Problem(1, 100, 257, 2, 2, 128, True, "f16", "all16"),
    Problem(1, 257, 257, 6, 2, 128, True, "f32", "q32kv16"),
    Problem(1, 100, 17, 4, 2, 128, False, "f32", "all16"),
    Problem(1, 17, 100, 8, 1, 32, False, "bf16", "q32kv16"),
    Problem(1, 257, 257, 4, 4, 64, False, "f16"),
    Problem(2, 257, 129, 4, 2, 64, True, "bf16", "q16kv64"),
    Problem(1, 100, 100, 2, 1, 256, False, "bf16", "q32kv16"),
    Problem(1, 257, 17, 2, 2, 256, True, "f16"),
    Problem(1, 100, 257, 2, 2, 256, True, "f32", "all16"),
    Problem(1, 257, 100, 3, 1, 48, False, "f32", "q16kv64"),
    Problem(1, 17, 257, 2, 1, 8, True, "bf16"),
]


def forward(fn, q, k, v):
    return jax.jit(fn)(q, k, v)


def check_forward(p: Problem, mode: str):
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    out, lse = forward(flash_fn(p, mode), q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (p.batch, p.num_heads, p.q_len)
    baseline = forward(plain_fn(p), q, k, v)
    oracle = attention_f64(q64, k64, v64, scale=p.scale, is_causal=p.is_causal)
    assert_within_tolerance((out, lse), baseline, oracle, floor=p.floor, names=("out", "lse"))


@pytest.mark.parametrize("p", PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(5)
def test_forward_matches_oracle(p, mode):
    check_forward(p, mode)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.ci_slice(3)
def test_forward_dtypes(dtype, is_causal, mode):
    check_forward(Problem(2, 100, 67, 4, 2, 64, is_causal, dtype, "q32kv16"), mode)


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=case_id)
def test_forward_matches_oracle_large(p):
    check_forward(p, "gpu")


# The tolerance rule must reject a wrong kernel: a slightly wrong softmax scale fails it.
@pytest.mark.parametrize("dtype, factor", [("f32", 1.001), ("f16", 1.01), ("bf16", 1.05)])
@pytest.mark.ci_slice(1)
def test_wrong_scale_fails_the_tolerance_rule(dtype, factor):
    p = Problem(1, 100, 67, 4, 2, 64, True, dtype)
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    wrong = forward(flash_fn(p, "interpret", scale=p.scale * factor), q, k, v)
    baseline = forward(plain_fn(p), q, k, v)
    oracle = attention_f64(q64, k64, v64, scale=p.scale, is_causal=p.is_causal)
    violations = tolerance_violations(wrong, baseline, oracle, floor=p.floor, names=("out", "lse"))
    assert [v.split(":")[0] for v in violations] == ["out", "lse"]


# -- transformations ------------------------------------------------------------------------------

SMALL = Problem(2, 33, 40, 4, 2, 32, True, "f32", "all16")


def test_rank3_inputs(mode):
    """Unbatched [T, N, H] inputs give the batch-1 result without the batch axis: the same
    kernels on the same operands (test_lowering.py's
    test_unbatched_inputs_lower_the_batch_one_program), so out, lse and dv bit for bit. dq and
    dk also take delta = rowsum(dO * out) - d_lse, a reduction XLA computes beside the kernels
    and may order differently in two compiled programs (an ulp of delta in some rows, seen on
    an H100): those within a few ulps of their largest entry."""
    p = SMALL
    (q, k, v, d_out, d_lse), (q64, k64, v64, _, _) = random_inputs(p)
    fn = flash_fn(p, mode)
    unbatched = jax.jit(outputs_and_grads, static_argnums=0)(
        fn, q[0], k[0], v[0], d_out[0], d_lse[0]
    )
    batched = jax.jit(outputs_and_grads, static_argnums=0)(
        fn, q[:1], k[:1], v[:1], d_out[:1], d_lse[:1]
    )
    expected_shapes = [q.shape[1:], (p.num_heads, p.q_len), q.shape[1:], k.shape[1:], k.shape[1:]]
    assert [x.shape for x in unbatched] == expected_shapes
    want = [x[0] for x in batched]
    assert_bitwise_equal([unbatched[i] for i in (0, 1, 4)], [want[i] for i in (0, 1, 4)])
    for name, i in (("dq", 2), ("dk", 3)):
        got, expected = np.asarray(unbatched[i]), np.asarray(want[i])
        ulps = 16 * np.finfo(expected.dtype).eps * np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=0, atol=ulps, err_msg=name)
    oracle = attention_f64(q64[:1], k64[:1], v64[:1], scale=p.scale, is_causal=p.is_causal)
    baseline = forward(plain_fn(p), q[:1], k[:1], v[:1])
    assert_within_tolerance(
        [x[None] for x in unbatched[:2]], baseline, oracle, floor=p.floor, names=("out", "lse")
    )


def test_vmap_over_a_leading_axis(mode):
    """vmap over an extra leading axis: outputs and gradients of every slice match the oracle."""
    num_slices = 3
    # The oracle sees the slices as one batch of num_slices * B.
    p = dataclasses.replace(SMALL, batch=num_slices * SMALL.batch)
    args, f64 = random_inputs(p)
    attns = (flash_fn(p, mode), plain_fn(p))
    results, baselines = (vmapped_outputs_and_grads(attn, args, num_slices) for attn in attns)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


NUM_LAYERS = 3


def layers(attn, x, ks, vs):
    """x -> attn(x, k_l, v_l) for each layer l, with lax.scan over the stacked ks, vs."""

    def layer(x, kv):
        out, _ = attn(x, *kv)
        return out, None

    return jax.lax.scan(layer, x, (ks, vs))[0]


def layers_f64(p: Problem, x, ks, vs, d_out):
    """Float64 `layers` output and its gradients (dx, dks, dvs) for the cotangent d_out."""
    xs = [x]
    for k, v in zip(ks, vs, strict=True):
        xs.append(attention_f64(xs[-1], k, v, scale=p.scale, is_causal=p.is_causal)[0])
    dx, dks, dvs = d_out, [], []
    no_lse_cotangent = np.zeros((x.shape[0], x.shape[2], x.shape[1]))
    for x, k, v in reversed(list(zip(xs[:-1], ks, vs, strict=True))):
        dx, dk, dv = attention_grads_f64(
            x, k, v, dx, no_lse_cotangent, scale=p.scale, is_causal=p.is_causal
        )
        dks.insert(0, dk)
        dvs.insert(0, dv)
    return xs[-1], dx, np.stack(dks), np.stack(dvs)


def test_scan_over_layers(mode):
    """A lax.scan over layers: output and gradients match the float64 oracle."""
    p = SMALL
    layer_inputs = [random_inputs(p, seed=seed) for seed in range(NUM_LAYERS)]
    (x, _, _, d_out, _), (x64, _, _, d_out64, _) = layer_inputs[0]
    ks, vs = (jnp.stack([inputs[0][i] for inputs in layer_inputs]) for i in (1, 2))
    ks64, vs64 = ([inputs[1][i] for inputs in layer_inputs] for i in (1, 2))

    def run(attn):
        def out_and_grads(x, ks, vs):
            out, vjp = jax.vjp(functools.partial(layers, attn), x, ks, vs)
            return (out, *vjp(d_out))

        return jax.jit(out_and_grads)(x, ks, vs)

    assert_within_tolerance(
        run(flash_fn(p, mode)),
        run(plain_fn(p)),
        layers_f64(p, x64, ks64, vs64, d_out64),
        floor=p.floor,
        names=("out", "dx", "dks", "dvs"),
    )


def count_primitive(jaxpr, name: str) -> int:
    """Occurrences of primitive `name` in a jaxpr, inner jaxprs (scan, remat, pjit...) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += count_primitive(inner, name)
    return count


def test_checkpoint(mode):
    """jax.checkpoint recomputes the forward kernel in the backward pass; results still match."""
    p = SMALL
    args, f64 = random_inputs(p)

    def run(attn, remat=True):
        fn = functools.partial(outputs_and_grads, jax.checkpoint(attn) if remat else attn)
        return jax.jit(fn)(*args), jax.make_jaxpr(fn)(*args).jaxpr

    results, remat_jaxpr = run(flash_fn(p, mode))
    assert count_primitive(remat_jaxpr, "pallas_call") == 4  # forward twice, dK/dV, dQ
    assert count_primitive(run(flash_fn(p, mode), remat=False)[1], "pallas_call") == 3
    oracles = oracle_outputs_and_grads(p, *f64)
    assert_within_tolerance(results, run(plain_fn(p))[0], oracles, floor=p.floor)


# -- determinism ----------------------------------------------------------------------------------


def check_deterministic(p: Problem, mode: str):
    """Two calls (separately compiled) give bitwise equal out, lse and gradients."""
    (q, k, v, d_out, d_lse), _ = random_inputs(p)
    first = jax.jit(outputs_and_grads, static_argnums=0)(flash_fn(p, mode), q, k, v, d_out, d_lse)
    again = jax.jit(functools.partial(outputs_and_grads, flash_fn(p, mode)))
    assert_bitwise_equal(again(q, k, v, d_out, d_lse), first)
    assert_bitwise_equal(again(q, k, v, d_out, d_lse), first)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in first)


def test_deterministic(mode):
    if mode == "interpret" and not SWEEP:
        pytest.skip("the interpreter runs programs in order: the GPU case is the check; SWEEP")
    check_deterministic(Problem(1, 100, 67, 4, 2, 64, True, "bf16", "q32kv16"), mode)


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS[:3], ids=case_id)
def test_deterministic_large(p):
    check_deterministic(p, "gpu")


def test_flash_kwargs_select_the_kernels(flash_kwargs):
    """The mode's call kwargs run the Triton kernels (not the xla backend)."""
    (q, k, v, _, _), _ = random_inputs(SMALL)
    jaxpr = jax.make_jaxpr(functools.partial(pallas_flash.flash_attention, **flash_kwargs))
    assert count_primitive(jaxpr(q, k, v).jaxpr, "pallas_call") == 1
