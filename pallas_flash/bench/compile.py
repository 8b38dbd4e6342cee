"""`--suite compile`: lowering, compile and first-call time of a jit(grad) over 1, 6 and 24
causal attention layers, each (implementation, depth) in a fresh process; then the persistent
compilation cache, cold and warm.

`python -m pallas_flash.bench.compile SPEC` runs one row (SPEC: JSON of impl, layers, shape,
interpret) and prints it as JSON: the suite's subprocess.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench.timing import (
    Rows,
    attention_fn,
    make_inputs,
    print_markdown,
    progress,
    recording_failure,
)

HELP = "compile: lowering and compile time of a jit(grad) over 1, 6 and 24 causal layers"
FLAGS = ("--impls", "--layers")
IMPLS = ("pallas_flash", "pallas_flash_triton", "pallas_flash_window", "cudnn", "xla", "jax_pallas")


def layered_grad(impl, layers, *, is_causal=True, interpret=False):
    """jit(grad) of a loss over `layers` attention layers, each on its own q, k, v: what a model
    written as a Python loop over its layers asks the compiler to build."""
    if impl == "pallas_flash_window":
        fn = functools.partial(
            pallas_flash.flash_attention,
            is_causal=is_causal,
            local_window_size=(1024, 0),
            interpret=interpret,
        )
    else:
        fn = attention_fn(impl, is_causal=is_causal, interpret=interpret)

    def loss(qkvs):
        return sum(fn(q, k, v).astype(jnp.float32).mean() for q, k, v in qkvs)

    return jax.jit(jax.grad(loss))


def compile_row(impl, layers, b, t, n, h, dtype, *, interpret=False) -> dict:
    """Lowering, compile and first-call times of `layered_grad` in this process."""
    row = dict(
        suite="compile", impl=impl, layers=layers, B=b, T=t, N=n, H=h,
        dtype=jnp.dtype(dtype).name, causal=True,
        cache="on" if jax.config.jax_compilation_cache_dir else "off",
    )  # fmt: skip
    with recording_failure(row):
        args = [make_inputs(b, t, t, n, n, h, dtype, seed=i)[:3] for i in range(layers)]
        f = layered_grad(impl, layers, interpret=interpret)
        start = time.perf_counter()
        lowered = f.trace(args).lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
        jax.block_until_ready(compiled(args))
        called_at = time.perf_counter()
        row.update(
            lower_s=round(lowered_at - start, 3),
            compile_s=round(compiled_at - lowered_at, 3),
            first_call_ms=round((called_at - compiled_at) * 1e3, 1),
        )
    return row


def row_of_spec(spec: str) -> dict:
    """compile_row of a JSON spec (impl, layers, shape (B, T, N, H), interpret): float32 in
    the interpreter, else bf16."""
    spec = json.loads(spec)
    b, t, n, h = spec["shape"]
    dtype = jnp.float32 if spec["interpret"] else jnp.bfloat16
    return compile_row(spec["impl"], spec["layers"], b, t, n, h, dtype, interpret=spec["interpret"])


def _compile_row_in_subprocess(impl, layers, shape, *, interpret, cache_dir=None) -> dict:
    """compile_row in a fresh Python process: nothing compiled by earlier rows (jax's and Mosaic
    GPU's in-memory caches) helps it, as after a restart."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    spec = json.dumps(dict(impl=impl, layers=layers, shape=shape, interpret=interpret))
    proc = subprocess.run(
        [sys.executable, "-m", "pallas_flash.bench.compile", spec],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return dict(suite="compile", impl=impl, layers=layers, error=proc.stderr[-300:])


def run(args, *, on_gpu: bool) -> list[dict]:
    """One fresh process per (implementation, layer count); then the persistent compilation
    cache: the deepest model of each pallas_flash implementation compiled by two processes that
    share a new cache directory (the second should only load)."""
    if on_gpu:
        # One layer of a long-context model: B=1, T=8192, N=16, H=128, causal, bf16.
        impls = ["pallas_flash", "pallas_flash_triton", "pallas_flash_window", "cudnn"]
        shape, layer_counts, interpret = (1, 8192, 16, 128), args.layers or [1, 6, 24], False
    else:
        print("No NVIDIA GPU: compile times of the interpret-mode kernels on a toy model.")
        impls, shape, interpret = ["pallas_flash", "xla"], (1, 128, 2, 64), True
        layer_counts = args.layers or [1, 6]
    impls = args.impls or impls
    rows = Rows(args.out)

    def record(row, label=""):
        rows.add(row)
        shown = row.get("error") or (
            f"lower {row['lower_s']:.2f} s  compile {row['compile_s']:.2f} s  "
            f"first call {row['first_call_ms']:.0f} ms"
        )
        progress(f"{row['impl']:22s} L={row['layers']:3d} {label:12s} {shown}")

    for impl in impls:
        for layers in layer_counts:
            record(_compile_row_in_subprocess(impl, layers, shape, interpret=interpret))
    for impl in [i for i in impls if i.startswith("pallas_flash")]:
        with tempfile.TemporaryDirectory() as cache_dir:
            for label in ("cache cold", "cache warm"):
                row = _compile_row_in_subprocess(
                    impl, max(layer_counts), shape, interpret=interpret, cache_dir=cache_dir
                )
                row["cache"] = label.split()[1]
                record(row, label)
    print_compile_table(rows)
    return rows


def print_compile_table(rows, out=None):
    header = ["impl", "layers", "cache", "lower s", "compile s", "first call ms"]
    lines = [
        [r["impl"], r["layers"], r.get("cache")]
        + [r.get(k) for k in ("lower_s", "compile_s", "first_call_ms")]
        for r in rows
    ]
    print_markdown(header, lines, out=out)


if __name__ == "__main__":
    print(json.dumps(row_of_spec(sys.argv[1])), flush=True)
