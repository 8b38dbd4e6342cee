"""The tolerance rule (FlashAttention's tests): a result's max abs error against the float64
oracle must be at most twice the error of plain attention computed in the input dtype
(`support.oracle.attention_in_dtype`, `masked_in_dtype`), plus a small floor (FLOOR[dtype] times
the largest magnitude of the output, or times 1 if that is smaller); bitwise equality; and a
closeness check that also requires every value finite (`assert_close`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from support.oracle import to64

# Added to 2 x (plain attention error). Small against the errors a wrong kernel makes (see
# test_triton_forward.py::test_wrong_scale_fails_the_tolerance_rule), large against rounding noise.
FLOOR = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3, jnp.float16: 1e-3}

# The outputs of `support.calls.outputs_and_grads`, in its order.
OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv")


def max_abs_error(x, oracle) -> float:
    x = to64(x)
    assert x.shape == oracle.shape, (x.shape, oracle.shape)
    finite = np.isfinite(oracle)
    # Where the oracle is infinite (lse of an empty row) the result must match exactly.
    assert np.array_equal(x[~finite], oracle[~finite])
    return float(np.max(np.abs(x[finite] - oracle[finite]), initial=0.0))


def tolerance_violations(results, baselines, oracles, *, floor, names=OUTPUT_NAMES):
    """The messages of the outputs whose error exceeds 2 x the baseline error + floor, the floor
    taken relative to the output's magnitude (at least 1)."""
    violations = []
    for name, result, baseline, oracle in zip(names, results, baselines, oracles, strict=True):
        err = max_abs_error(result, oracle)
        base_err = max_abs_error(baseline, oracle)
        finite = oracle[np.isfinite(oracle)]
        abs_floor = floor * max(1.0, float(np.max(np.abs(finite), initial=0.0)))
        if not err <= 2 * base_err + abs_floor:
            violations.append(
                f"{name}: error {err:.3g} > 2 x plain-attention error {base_err:.3g} "
                f"+ floor {abs_floor:.3g}"
            )
    return violations


def assert_within_tolerance(results, baselines, oracles, *, floor, names=OUTPUT_NAMES):
    violations = tolerance_violations(results, baselines, oracles, floor=floor, names=names)
    assert not violations, "; ".join(violations)


def assert_close(name, got, want, *, atol, rtol=0.0, where=None):
    """Every value of `got` (at `where`, None: everywhere) finite and within atol + rtol |want|
    of `want`; a failure names `name` and the largest error."""
    got, want = np.asarray(got), np.asarray(want)
    if where is not None:
        got, want = got[where], want[where]
    assert np.all(np.isfinite(got)), f"{name}: {np.sum(~np.isfinite(got))} non-finite values"
    err = np.abs(got - want) - rtol * np.abs(want)
    assert np.max(err, initial=0.0) <= atol, f"{name}: max error {np.max(err):.3g} > {atol:.3g}"


def assert_bitwise_equal(a, b):
    """Equal pytrees of arrays, bit for bit (so -0.0 != 0.0 and NaN payloads count)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        if x.tobytes() != y.tobytes():
            np.testing.assert_array_equal(x, y)  # a readable diff where the values differ
            raise AssertionError("arrays are equal as numbers but differ in their bits")
