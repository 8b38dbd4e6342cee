"""Times the calls a change touches, in whichever tree of the package is imported, so that two
trees (main's and a change's) run in turns, each in its own process, on one GPU in one call:

    PYTHONPATH=TREE python benchmarks/change_timing.py LABEL OUT.jsonl [CASE ...]

Cases (default: all): "triton" (Triton fwd+bwd, bf16 and float32: the backward's P from the
forward's row max), "softcap" (the Mosaic kernels with Gemma 2's soft cap, forward and fwd+bwd,
and without the cap beside them), "masked" (the Mosaic backward's masked steps: causal and
windowed calls, a plain one beside them), "dropout" (the Mosaic kernels with dropout 0.1
beside the same calls without), "small-grid" (plain H=64 grids too small for 256-row CTAs, the
default beside backend="triton"). One JSON row per case and pass: label, case, ms
(median of 7 repeats of 10 calls), compile_s (the first call). PASSES="fwd+bwd" times one pass.
"""

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import make_inputs, median_ms, timed_fn

# (name, B, T, S, N, K, H, dtype, kwargs): the Triton backward at its FA2-grid sizes and a
# float32 call; Gemma 2 9B's attention (N 16, K 8, H 256, cap 50; the window layers' 4k window).
CASES = {
    "triton": [
        ("h128-4k-causal", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict(is_causal=True)),
        ("h64-4k", 4, 4096, 4096, 32, 32, 64, jnp.bfloat16, dict()),
        ("f32-h64-2k-causal", 2, 2048, 2048, 8, 8, 64, jnp.float32, dict(is_causal=True)),
    ],
    "softcap": [
        ("gemma2-8k-cap", 1, 8192, 8192, 16, 8, 256, jnp.bfloat16,
         dict(is_causal=True, logits_soft_cap=50.0)),
        ("gemma2-8k-window-cap", 1, 8192, 8192, 16, 8, 256, jnp.bfloat16,
         dict(is_causal=True, logits_soft_cap=50.0, local_window_size=(4095, 0))),
        ("gemma2-8k-nocap", 1, 8192, 8192, 16, 8, 256, jnp.bfloat16, dict(is_causal=True)),
        ("h128-8k-cap", 2, 8192, 8192, 16, 16, 128, jnp.bfloat16,
         dict(is_causal=True, logits_soft_cap=30.0)),
    ],
    "dropout": [
        ("h128-4k", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict()),
        ("h128-4k-dropout", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict(dropout_rate=0.1)),
        ("h128-4k-causal", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict(is_causal=True)),
        ("h128-4k-causal-dropout", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16,
         dict(is_causal=True, dropout_rate=0.1)),
        ("h64-4k", 4, 4096, 4096, 32, 32, 64, jnp.bfloat16, dict()),
        ("h64-4k-dropout", 4, 4096, 4096, 32, 32, 64, jnp.bfloat16, dict(dropout_rate=0.1)),
    ],
    "masked": [
        ("h128-4k-causal", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict(is_causal=True)),
        ("h128-16k-causal", 1, 16384, 16384, 16, 16, 128, jnp.bfloat16, dict(is_causal=True)),
        ("h64-4k-causal", 4, 4096, 4096, 32, 32, 64, jnp.bfloat16, dict(is_causal=True)),
        ("h128-4k-window", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16,
         dict(local_window_size=(1023, 0))),
        ("h128-4k", 4, 4096, 4096, 16, 16, 128, jnp.bfloat16, dict()),
    ],
    # Plain H=64 grids of 64-128 CTAs (of 128 query rows): the default (Mosaic) beside Triton.
    "small-grid": [
        ("h64-2k-n8", 1, 2048, 2048, 8, 8, 64, jnp.bfloat16, dict()),
        ("h64-2k-n8-triton", 1, 2048, 2048, 8, 8, 64, jnp.bfloat16, dict(backend="triton")),
        ("h64-4k-n4", 1, 4096, 4096, 4, 4, 64, jnp.bfloat16, dict()),
        ("h64-4k-n4-triton", 1, 4096, 4096, 4, 4, 64, jnp.bfloat16, dict(backend="triton")),
    ],
}  # fmt: skip


def main():
    label, out_path, *names = sys.argv[1:]
    with open(out_path, "a") as out:
        for case in names or list(CASES):
            backend = "triton" if case == "triton" else None
            for name, b, t, s, n, k, h, dtype, kwargs in CASES[case]:
                kwargs = dict(kwargs)
                case_backend = kwargs.pop("backend", backend)
                q, kk, v, do = make_inputs(b, t, s, n, k, h, dtype)
                if kwargs.get("dropout_rate"):
                    kwargs = dict(kwargs, dropout_rng=jax.random.key(0))
                fn = functools.partial(pallas_flash.flash_attention, backend=case_backend, **kwargs)
                for pass_ in os.environ.get("PASSES", "fwd fwd+bwd").split():
                    f = timed_fn(fn, pass_)
                    start = time.perf_counter()
                    jax.block_until_ready(f(q, kk, v, do))
                    compile_s = time.perf_counter() - start
                    row = dict(label=label, case=case, name=name, pass_=pass_,
                               ms=median_ms(f, (q, kk, v, do)), compile_s=compile_s)  # fmt: skip
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
