"""Forward+backward time of the Mosaic kernels with dQ computed in the dK/dV kernel
(`BackwardTiles(fused_dq="add")`: five matmuls per pair of tiles, dQ added by TMA reductions;
"ordered": the same adds in a fixed order, deterministic) against the default two-kernel
backward (seven) and cuDNN, on the H200 (a few minutes).

    python benchmarks/fused_dq_timing.py [OUT.jsonl] [H:SEQ ...]

FA2 grid points (bf16, 16k tokens per batch, N = 2048 / H), causal and not: POINTS, or the
H:SEQ pairs given (e.g. 64:2048 128:8192, where `dispatch.fused_dq_is_faster` has no
measurement yet). "default",
"fused" and "ordered" are the Mosaic forward differentiated by `mosaic.flash_backward` with
the default tiles and with fused_dq="add" and "ordered"; "cudnn" is
`jax.nn.dot_product_attention(implementation="cudnn")`. Prints one JSON row per point (ms,
TFLOP/s by the FA2 count), dQ's largest difference from the default backward's relative to
dQ's largest magnitude, whether two runs of "ordered" gave the same bits, then the ratios.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

from pallas_flash.bench import attention_flops, median_ms, timed_fn
from pallas_flash.mosaic import BackwardTiles, flash_backward, flash_forward

POINTS = [(128, 4096), (128, 16384), (64, 4096), (64, 16384)]


def mosaic_attention(tiles, *, scale, is_causal):
    @jax.custom_vjp
    def attention(q, k, v):
        return flash_forward(q, k, v, scale=scale, is_causal=is_causal)[0]

    def fwd(q, k, v):
        out, lse = flash_forward(q, k, v, scale=scale, is_causal=is_causal)
        return out, (q, k, v, out, lse)

    def bwd(residuals, d_out):
        return flash_backward(
            *residuals, d_out, None, scale=scale, is_causal=is_causal, tiles=tiles
        )

    attention.defvjp(fwd, bwd)
    return attention


def main():
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    points = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[2:]] or POINTS

    def record(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    for h, seq in points:
        b, n = 16384 // seq, 2048 // h
        keys = jax.random.split(jax.random.key(0), 4)
        args = [jax.random.normal(key, (b, seq, n, h), jnp.bfloat16) for key in keys]
        for causal in (False, True):
            scale = h**-0.5
            impls = {
                "default": mosaic_attention(None, scale=scale, is_causal=causal),
                "fused": mosaic_attention(
                    BackwardTiles(fused_dq="add"), scale=scale, is_causal=causal
                ),
                "ordered": mosaic_attention(
                    BackwardTiles(fused_dq="ordered"), scale=scale, is_causal=causal
                ),
                "cudnn": functools.partial(
                    jax.nn.dot_product_attention, implementation="cudnn", is_causal=causal
                ),
            }
            ms = {}
            for name, fn in impls.items():
                ms[name] = median_ms(timed_fn(fn, "fwd+bwd"), args)
                tflops = attention_flops(b, seq, seq, n, h, causal, "fwd+bwd") / ms[name] / 1e9
                record(dict(H=h, seq=seq, causal=causal, impl=name, ms=ms[name], tflops=tflops))
            names = ("default", "fused", "ordered", "ordered")
            dq = [timed_fn(impls[name], "fwd+bwd")(*args)[0] for name in names]
            repeatable = bool(jnp.all(dq[2] == dq[3]))
            dq = [x.astype(jnp.float32) for x in dq]

            def error(x):
                return float(jnp.max(jnp.abs(x - dq[0])) / jnp.max(jnp.abs(dq[0])))

            record(
                dict(
                    H=h,
                    seq=seq,
                    causal=causal,
                    summary="fwd+bwd",
                    fused_over_default=ms["default"] / ms["fused"],
                    fused_over_cudnn=ms["cudnn"] / ms["fused"],
                    ordered_over_default=ms["default"] / ms["ordered"],
                    ordered_over_cudnn=ms["cudnn"] / ms["ordered"],
                    default_over_cudnn=ms["cudnn"] / ms["default"],
                    dq_relative_difference=error(dq[1]),
                    ordered_dq_relative_difference=error(dq[2]),
                    ordered_repeatable=repeatable,
                )
            )


if __name__ == "__main__":
    main()
