"""Quick timing of the Mosaic forward at head dims 96 and 80 run as they are, against the same
forward on q, k, v zero-padded to 128 (out sliced back: what the wrapper did before) and cuDNN,
on the H200 (about a minute).

    python benchmarks/narrow_heads_timing.py [OUT.jsonl]

B=8, T=S=2048, N=K=32, bf16 (the shapes suite's Phi-like rows), causal and not. Forward only:
"native" and "padded" are `mosaic.flash_forward` (default tiles), "cudnn" is
`jax.nn.dot_product_attention(implementation="cudnn")`; then fwd+bwd through `flash_attention`
(backend=None: the Mosaic forward and backward, both at the head dim as it is) beside cuDNN's.
TFLOP/s count the head dim's own FLOPs (4 * pairs * H per head, x 3.5 forward+backward), for
every implementation. Prints one JSON row per point, then the ratios to cuDNN (forward, and
forward+backward).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import median_ms, timed_fn
from pallas_flash.mosaic import forward as mosaic_forward

B, T, N = 8, 2048, 32


def inputs(h):
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (B, T, N, h), jnp.bfloat16) for key in keys)


def flops(h, causal, pass_):
    pairs = T * (T + 1) / 2 if causal else T * T
    return 4.0 * B * N * pairs * h * (3.5 if pass_ == "fwd+bwd" else 1.0)


def padded_forward(q, k, v, *, scale, is_causal):
    h = q.shape[-1]
    pad = ((0, 0), (0, 0), (0, 0), (0, 128 - h))
    out, lse = mosaic_forward.flash_forward(
        *(jnp.pad(x, pad) for x in (q, k, v)), scale=scale, is_causal=is_causal
    )
    return out[..., :h], lse


def main():
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    ms_of = {}

    def record(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    for h in (96, 80):
        for causal in (True, False):
            scale = h**-0.5
            impls = {
                "native": functools.partial(
                    mosaic_forward.flash_forward, scale=scale, is_causal=causal
                ),
                "padded": functools.partial(padded_forward, scale=scale, is_causal=causal),
                "cudnn": functools.partial(cudnn, scale=scale, is_causal=causal),
            }
            for name, fn in impls.items():
                ms = median_ms(timed_fn(fn, "fwd"), inputs(h))
                ms_of[(h, causal, name)] = ms
                tflops = flops(h, causal, "fwd") / ms / 1e9
                record(dict(h=h, causal=causal, pass_="fwd", impl=name, ms=ms, tflops=tflops))
            for name, fn in (
                ("pallas_flash", functools.partial(pallas_flash.flash_attention, is_causal=causal)),
                ("cudnn", functools.partial(cudnn, is_causal=causal)),
            ):
                ms = median_ms(timed_fn(fn, "fwd+bwd"), inputs(h))
                ms_of[(h, causal, "fwd+bwd", name)] = ms
                tflops = flops(h, causal, "fwd+bwd") / ms / 1e9
                record(dict(h=h, causal=causal, pass_="fwd+bwd", impl=name, ms=ms, tflops=tflops))
    for h in (96, 80):
        for causal in (True, False):
            native, padded, cu = (ms_of[(h, causal, n)] for n in ("native", "padded", "cudnn"))
            record(
                dict(
                    h=h,
                    causal=causal,
                    summary="fwd",
                    native_over_cudnn=cu / native,
                    padded_over_cudnn=cu / padded,
                    speedup_over_padded=padded / native,
                )
            )
            ours, cu = (ms_of[(h, causal, "fwd+bwd", n)] for n in ("pallas_flash", "cudnn"))
            record(dict(h=h, causal=causal, summary="fwd+bwd", native_over_cudnn=cu / ours))


if __name__ == "__main__":
    main()
