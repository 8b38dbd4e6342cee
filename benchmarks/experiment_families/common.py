"""What the experiment families share: a row written as JSON, the timing of one call or
of several implementations, the FA2 grid's points and the kernels timed at them, and the Mosaic
wrappers called with their options spelled out (`mosaic_forward_call`,
`mosaic_backward_call`)."""

from __future__ import annotations

import json

import jax.numpy as jnp

import pallas_flash
from pallas_flash import bench, mosaic, tune, tune_cache
from pallas_flash._passes import KernelConfig
from pallas_flash.device import gpu_device_kind
from pallas_flash.masks import MaskArrays, MaskSpec
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


def mosaic_config(
    q, k, *, scale, is_causal=False, window=None, soft_cap=None, segment_ids=None, tiles=None
):
    """(MaskArrays, KernelConfig) of a call of the Mosaic kernels, as the dispatch hands them to
    `mosaic.flash_forward` and `mosaic.flash_backward`: segment_ids a (q ids, kv ids) pair or
    None; tiles: the forward's `ForwardTiles` or the backward's `BackwardTiles` (None: the
    kernels' defaults)."""
    spec = MaskSpec(
        q_len=q.shape[1],
        kv_len=k.shape[1],
        is_causal=is_causal,
        window=window,
        has_segments=segment_ids is not None,
    )
    config = KernelConfig(
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        block_sizes=pallas_flash.BlockSizes(),
        interpret=False,
        forward="mosaic",
        backward="mosaic",
        mosaic_forward_tiles=tiles if isinstance(tiles, mosaic.ForwardTiles) else None,
        mosaic_backward_tiles=tiles if isinstance(tiles, mosaic.BackwardTiles) else None,
    )
    return MaskArrays(*(segment_ids or (None, None))), config


def mosaic_forward_call(q, k, v, *, sinks=None, with_log_sum=False, **options):
    """`mosaic.flash_forward` of a call of `mosaic_config(**options)`: (out, lse), with
    with_log_sum also log_sum."""
    arrays, config = mosaic_config(q, k, **options)
    return mosaic.flash_forward(
        q, k, v, None, arrays, sinks, config=config, with_log_sum=with_log_sum
    )


def mosaic_backward_call(q, k, v, out, lse, d_out, d_lse, *, log_sum=None, **options):
    """(dq, dk, dv) of `mosaic.flash_backward` of a call of `mosaic_config(**options)` (d_lse
    None: zero)."""
    arrays, config = mosaic_config(q, k, **options)
    return mosaic.flash_backward(
        q, k, v, None, arrays, out, lse, log_sum, None, d_out, d_lse, config=config
    )[:3]
