"""Compile time of a jit(grad) over causal attention layers per backward form, each row in a
fresh process, with the XLA fusions of the compiled module counted: what grows with the depth.

    python benchmarks/compile_layers.py OUT.jsonl [FORM:LAYERS ...]

Forms: "two-kernel" (the Mosaic backward's dK/dV and dQ kernels), "add" (dQ in the dK/dV
kernel by f32 adds, deterministic_grads=False), "fixed" (by integer adds: the default from 8k
keys at H=128 causal; its per-row scales from two Pallas kernels, `mosaic.fixed_point`),
"fixed-xla" (those scales in jnp, as on a CPU), "fixed-bare" ("fixed" with its scales replaced
by constants: compile time only, its gradients are wrong). Default: each form at 1
and 24 layers. The shape is the compile suite's (`bench --suite compile`): B=1, T=8192, N=16,
H=128, bf16, causal, loss out.mean() per layer. One JSON row per run: form, layers, lower_s,
compile_s, fusions, custom_calls.
"""

import functools
import json
import subprocess
import sys
import time

SHAPE = (1, 8192, 16, 128)
FORMS = ("two-kernel", "add", "fixed", "fixed-xla", "fixed-bare")


def row(form: str, layers: int) -> dict:
    import jax
    import jax.numpy as jnp

    import pallas_flash
    from pallas_flash import dispatch
    from pallas_flash.bench import make_inputs

    if form == "two-kernel":  # no call is long enough for either fused form
        dispatch.FIXED_DQ_CAUSAL_MIN_LEN = {64: 1 << 30, 128: 1 << 30}
    from pallas_flash.mosaic import fixed_point

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

    b, t, n, h = SHAPE
    args = [make_inputs(b, t, t, n, n, h, jnp.bfloat16, seed=i)[:3] for i in range(layers)]
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


def main():
    if sys.argv[1] == "--row":
        print(json.dumps(row(sys.argv[2], int(sys.argv[3]))), flush=True)
        return
    out_path, points = sys.argv[1], sys.argv[2:] or [f"{f}:{n}" for f in FORMS for n in (1, 24)]
    with open(out_path, "a") as out:
        for point in points:
            form, layers = point.split(":")
            proc = subprocess.run(
                [sys.executable, __file__, "--row", form, layers], capture_output=True, text=True
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            result = json.loads(lines[-1]) if lines else dict(form=form, error=proc.stderr[-300:])
            print(json.dumps(result), flush=True)
            out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
