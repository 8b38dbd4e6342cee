"""Compile time and XLA fusions per backward form (`compile-forms`)."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from experiment_families.common import record
from pallas_flash import bench

# -- compile time per backward form ------------------------------------------------------------

# The command line that runs one row in a child process (`--row FORM:LAYERS`).
CLI = str(pathlib.Path(__file__).resolve().parents[1] / "experiments.py")
COMPILE_FORMS = ("two-kernel", "add", "fixed", "fixed-xla", "fixed-bare")


def compile_form_row(form: str, layers: int) -> dict:
    """Compile time of a jit(grad) over `layers` causal attention layers with the backward in
    `form`, and the XLA fusions and custom calls of the compiled module: "two-kernel" (the
    Mosaic backward's dK/dV and dQ kernels), "add" (dQ in the dK/dV kernel by f32 adds,
    deterministic_grads=False), "fixed" (by integer adds: the default from 8k keys at H=128
    causal; its per-row scales from two Pallas kernels, `mosaic.fixed_point`), "fixed-xla"
    (those scales in jnp, as on a CPU), "fixed-bare" ("fixed" with its scales replaced by
    constants: compile time only, its gradients are wrong). The shape is the compile suite's:
    B=1, T=8192, N=16, H=128, bf16, loss out.mean() per layer. Patches the package: one row
    per process."""
    from pallas_flash import dispatch
    from pallas_flash.mosaic import fixed_point

    if form == "two-kernel":  # no call is long enough for either fused form
        dispatch.FIXED_DQ_CAUSAL_MIN_LEN = {64: 1 << 30, 128: 1 << 30}
    if form == "fixed-xla":
        scales = fixed_point.fixed_point_scales
        fixed_point.fixed_point_scales = functools.partial(scales, kernels=False)
    if form == "fixed-bare":

        def constant_scales(k, v, d_out, delta, lse, *, rows_out, **_):
            ones = jnp.ones((*lse.shape[:2], rows_out), jnp.float32)
            return ones * 2.0**8, ones * 2.0**-8

        fixed_point.fixed_point_scales = constant_scales
    deterministic = form != "add"

    def loss(qkvs):
        return sum(
            pallas_flash.flash_attention(q, k, v, is_causal=True, deterministic_grads=deterministic)
            .astype(jnp.float32)
            .mean()
            for q, k, v in qkvs
        )

    b, t, n, h = 1, 8192, 16, 128
    args = [bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16, seed=i)[:3] for i in range(layers)]
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).trace(args).lower()
    lowered_at = time.perf_counter()
    text = lowered.compile().as_text()
    compiled_at = time.perf_counter()
    return dict(
        form=form,
        layers=layers,
        lower_s=round(lowered_at - start, 2),
        compile_s=round(compiled_at - lowered_at, 2),
        fusions=text.count(" fusion("),
        custom_calls=text.count(" custom-call("),
    )


def compile_forms(out, points=None):
    """compile_form_row at each FORM:LAYERS point (default: each form at 1 and 24 layers),
    each in a fresh process."""
    for point in points or [f"{f}:{n}" for f in COMPILE_FORMS for n in (1, 24)]:
        proc = subprocess.run(
            [sys.executable, CLI, "compile-forms", "--row", point, "--out", os.devnull],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        form = point.split(":")[0]
        record(out, json.loads(lines[-1]) if lines else dict(form=form, error=proc.stderr[-300:]))
