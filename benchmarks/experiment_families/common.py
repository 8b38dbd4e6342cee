"""What the experiment families share: a row written as JSON, the timing of one call or
of several implementations, the FA2 grid's points and the kernels timed at them."""

from __future__ import annotations

import json

import jax.numpy as jnp

from pallas_flash import bench, tune, tune_cache
from pallas_flash.device import gpu_device_kind
from pallas_flash.triton.tiles import heuristic_block_sizes


def record(out, row):
    """Prints the row as JSON and appends it to out (a JSON-lines file)."""
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def error_text(e: Exception, limit: int = 200) -> str:
    """A row's record of an exception: its type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:limit]}"


def time_pass(fn, pass_, shape, repeats=7):
    """Median ms of fn's pass_ on bf16 inputs of shape (B, T, N, H), self-attention."""
    b, t, n, h = shape
    args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
    return round(bench.median_ms(bench.timed_fn(fn, pass_), args, repeats=repeats), 4)


def time_impls(out, fns, args, flops, **row):
    """Times each jitted fn of {impl: fn(q, k, v, do)} on args and records a row per impl."""
    for impl, fn in fns.items():
        timed = dict(row, impl=impl)
        try:
            timed["ms"] = round(bench.median_ms(fn, args), 4)
            timed["tflops"] = round(flops / timed["ms"] / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            timed["error"] = error_text(e)
        record(out, timed)


def grid_points(head_dims, seqs):
    """(B, T, N, H, causal, args) of the FA2 paper's grid (16k tokens, hidden 2048)."""
    for h in head_dims:
        n = 2048 // h
        for t in seqs:
            b = 16384 // t
            args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
            for causal in (False, True):
                yield b, t, n, h, causal, args


def triton_tiles(h, causal, t):
    """The Triton tiles of a plain bf16 call on this GPU: its autotune entry, else the
    heuristics."""
    shape_class = tune_cache.ShapeClass.of(
        h, jnp.bfloat16, is_causal=causal, q_len=t, kv_len=t, masked=False
    )
    tuned = tune_cache.tuned_block_sizes(gpu_device_kind(), shape_class)
    return tuned or heuristic_block_sizes(h, jnp.bfloat16)


def mosaic_fn(t, n, h, causal, pass_, **kwargs):
    """The Mosaic kernels (tune.mosaic_kernels_fn) timed for pass_, or None for tiles the
    shapes do not take."""
    kernels = tune.mosaic_kernels_fn(
        (16384 // t, t, n, h),
        jnp.bfloat16,
        is_causal=causal,
        backend="mosaic",
        block_sizes=triton_tiles(h, causal, t),
        **kwargs,
    )
    return None if kernels is None else bench.timed_fn(lambda q, k, v: kernels(q, k, v)[0], pass_)
