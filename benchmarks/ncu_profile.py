"""The kernels of a few calls under Nsight Compute's hardware counters, on the GPU machine.

    ncu --profile-from-start off --clock-control none --set full -o $OUT/prof \
        python benchmarks/ncu_profile.py [CASE ...]
    ncu --import $OUT/prof.ncu-rep --page details --csv > $OUT/details.csv

Each case builds its inputs and compiles (and runs) its function once outside the profiled
range, then runs it once between cuProfilerStart and cuProfilerStop: with
`--profile-from-start off` ncu profiles only those kernels (the attention kernels, cuDNN's, and
the small XLA ops of the call). `--list` prints the cases. GPU only.
"""

from __future__ import annotations

import argparse
import ctypes
import functools

import jax
import jax.numpy as jnp
from experiment_families.common import mosaic_backward_call, mosaic_forward_call

import pallas_flash
from pallas_flash import bench, mosaic
from pallas_flash.bench import decode as decode_suite


def _attention(b, t, n, h, causal, impl):
    """fwd of the default call (impl "pallas_flash") or cuDNN's, as the bench times them."""
    fn = bench.attention_fn(impl, is_causal=causal)
    return jax.jit(fn), bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)[:3]


def _forward_with(b, t, n, h, causal, **options):
    """fwd of the default call with `options` (dropout, a soft cap) beside the plain one: what
    each option costs the forward's pipes and issue slots."""
    if options.get("dropout_rate"):
        options["dropout_rng"] = jax.random.key(0)
    fn = functools.partial(pallas_flash.flash_attention, is_causal=causal, **options)
    return jax.jit(fn), bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)[:3]


def _backward(b, t, n, h, causal, tiles, impl="mosaic"):
    """The Mosaic backward alone with `tiles` (its dK/dV and dQ kernels, or the fused one), on
    the Mosaic forward's out and lse; impl "cudnn": cuDNN's fwd+bwd."""
    q, k, v, do = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
    if impl == "cudnn":
        fn = bench.timed_fn(bench.attention_fn("cudnn", is_causal=causal), "fwd+bwd")
        return fn, (q, k, v, do)
    scale = h**-0.5
    out, lse, log_sum = jax.jit(
        functools.partial(mosaic_forward_call, scale=scale, is_causal=causal, with_log_sum=True)
    )(q, k, v)
    fn = jax.jit(
        functools.partial(mosaic_backward_call, scale=scale, is_causal=causal, tiles=tiles)
    )
    return (lambda *args: fn(*args, log_sum=log_sum)), (q, k, v, out, lse, do, None)


def _decode(b, t, n, h, causal, *, cache: int, kv_heads: int):
    """`decode_attention` of t new tokens per sequence over a full cache of `cache` keys and
    kv_heads KV heads (bf16), as the bench's decode suite builds and calls it (causal: unused)."""
    case = dict(B=b, S=cache, N=n, K=kv_heads, H=h, T=t, ragged=False, page=None)
    fn = decode_suite.decode_fns(case, interpret=False)["pallas_flash"]
    return fn, decode_suite.decode_inputs(case, jnp.bfloat16)


OURS = functools.partial(_attention, impl="pallas_flash")
CUDNN = functools.partial(_attention, impl="cudnn")
# name: (function of (b, t, n, h, causal) -> (fn, args), b, t, n, h, causal)
CASES = {
    "fwd-h64-16k": (OURS, 1, 16384, 32, 64, False),
    "fwd-h64-16k-cudnn": (CUDNN, 1, 16384, 32, 64, False),
    "fwd-h128-causal-2k": (OURS, 8, 2048, 16, 128, True),
    "fwd-h128-causal-2k-cudnn": (CUDNN, 8, 2048, 16, 128, True),
    # The options that cost the forward most (docs/notes/models.md): dropout (a hash, a
    # compare and a select per element) and Gemma 2's soft cap (two more MUFU ops per logit).
    "fwd-h128-4k": (OURS, 4, 4096, 16, 128, False),
    "fwd-h128-4k-dropout": (
        functools.partial(_forward_with, dropout_rate=0.1), 4, 4096, 16, 128, False
    ),
    "fwd-h256-4k": (OURS, 4, 4096, 8, 256, False),
    "fwd-h256-4k-softcap": (
        functools.partial(_forward_with, logits_soft_cap=50.0), 4, 4096, 8, 256, False
    ),
    "fwd-h256-4k-cudnn": (CUDNN, 4, 4096, 8, 256, False),
    "bwd-h128-16k": (
        functools.partial(_backward, tiles=mosaic.BackwardTiles()), 1, 16384, 16, 128, False
    ),
    "bwd-h128-16k-fixed": (
        functools.partial(_backward, tiles=mosaic.BackwardTiles(fused_dq="fixed")),
        1, 16384, 16, 128, False,
    ),
    # The dispatch's fused dQ: its consumers' descriptors rebuilt each step.
    "bwd-h128-16k-fixed-step": (
        functools.partial(
            _backward, tiles=mosaic.BackwardTiles(fused_dq="fixed", step_descriptors=True)
        ),
        1, 16384, 16, 128, False,
    ),
    "bwd-h128-causal-16k-fixed-step": (
        functools.partial(
            _backward, tiles=mosaic.BackwardTiles(fused_dq="fixed", step_descriptors=True)
        ),
        1, 16384, 16, 128, True,
    ),
    "bwd-h128-16k-cudnn": (
        functools.partial(_backward, tiles=None, impl="cudnn"), 1, 16384, 16, 128, False
    ),
    "bwd-h64-16k": (
        functools.partial(_backward, tiles=mosaic.BackwardTiles()), 1, 16384, 32, 64, False
    ),
    # The H=64 default's fused dQ (no spills by ptxas: what else limits it) and cuDNN's.
    "bwd-h64-16k-fixed": (
        functools.partial(_backward, tiles=mosaic.BackwardTiles(fused_dq="fixed")),
        1, 16384, 32, 64, False,
    ),
    "bwd-h64-16k-cudnn": (
        functools.partial(_backward, tiles=None, impl="cudnn"), 1, 16384, 32, 64, False
    ),
    # Decode's latency-bound shapes (N=32 over K=8, H=128, one token): local-memory traffic
    # and achieved occupancy (the bf16 kernel does not spill by ptxas on CPU: what is left is
    # latency; docs/notes/decode.md, "What is left"); the head shape beside them.
    "decode-b1-32k": (functools.partial(_decode, cache=32768, kv_heads=8), 1, 1, 32, 128, False),
    "decode-b8-1k": (functools.partial(_decode, cache=1024, kv_heads=8), 8, 1, 32, 128, False),
    "decode-b8-32k": (functools.partial(_decode, cache=32768, kv_heads=8), 8, 1, 32, 128, False),
}  # fmt: skip


def _profiler(call: str):
    """cuProfilerStart / cuProfilerStop of the CUDA driver: ncu's profiled range."""
    getattr(ctypes.CDLL("libcuda.so.1"), call)()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="default: every case")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    names = args.cases or list(CASES)
    if args.list:
        print("\n".join(CASES))
        return
    for name in names:
        make, b, t, n, h, causal = CASES[name]
        fn, fn_args = make(b, t, n, h, causal)
        jax.block_until_ready(fn(*fn_args))  # compile and warm up outside the profiled range
        _profiler("cuProfilerStart")
        jax.block_until_ready(fn(*fn_args))
        _profiler("cuProfilerStop")
        print(name, "profiled", flush=True)


if __name__ == "__main__":
    main()
