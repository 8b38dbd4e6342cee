"""Device-side experiments behind benchmarks/NOTES.md (not part of the library's API).

python benchmarks/experiments.py tiles-masked --out $OUT/tiles.jsonl
    forward tiles for the narrow masked workloads (1k causal window and 8 x 2k packed
    documents at 16k): time of each candidate against dense causal with the default tiles.
python benchmarks/experiments.py split-kv --out $OUT/split.jsonl
    B=1, N=8 at 32k (the anchors' small-grid point) and short query blocks over long keys
    (decode, chunked prefill) with kv_splits 1 (off) and 0 (auto), beside cuDNN.
python benchmarks/experiments.py mosaic-tiles --out $OUT/mosaic.jsonl [--head-dims 64 --seqs 512]
    the Mosaic GPU forward with several ForwardTiles beside the Triton forward and cuDNN
    (forward only, FA2-paper shapes).
python benchmarks/experiments.py mosaic-backward --out $OUT/mosaic-bwd.jsonl [--head-dims 64]
    forward+backward with the Mosaic backward's default tiles and candidate BackwardTiles,
    beside the default call, the Mosaic forward with the Triton backward, and cuDNN.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import bench, mosaic, tune, tune_cache
from pallas_flash.device import gpu_device_kind
from pallas_flash.triton.tiles import heuristic_block_sizes

# (block_q, block_kv, num_warps, num_stages) of the forward kernel.
MASKED_FORWARD_TILES = [
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (128, 128, 8, 4),
]


def _record(out, row):
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def _time(fn, pass_, shape, repeats=7):
    b, t, n, h = shape
    args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
    return round(bench.median_ms(bench.timed_fn(fn, pass_), args, repeats=repeats), 4)


def tiles_masked(out, seq=16384, heads=16, head_dim=128):
    shape = (1, seq, heads, head_dim)
    seg = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seq // 8)[None]
    cases = {
        "dense causal": dict(is_causal=True),
        "causal window 1024": dict(is_causal=True, local_window_size=(1024, 0)),
        "packed 8x2048": dict(is_causal=True, q_segment_ids=seg),
    }
    default = heuristic_block_sizes(head_dim, jnp.bfloat16)
    for case, kwargs in cases.items():
        tiles = MASKED_FORWARD_TILES[:1] if case == "dense causal" else MASKED_FORWARD_TILES
        for bq, bk, w, st in tiles:
            bs = dataclasses.replace(default, block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
            fn = functools.partial(
                pallas_flash.flash_attention, backend="triton", block_sizes=bs, **kwargs
            )
            for pass_ in ("fwd", "fwd+bwd") if (bq, bk, w, st) == (128, 128, 8, 3) else ("fwd",):
                row = dict(exp="tiles-masked", case=case, tiles=[bq, bk, w, st], pass_=pass_)
                try:
                    row["ms"] = _time(fn, pass_, shape)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                _record(out, row)


def split_kv(out):
    points = [  # (B, T, S, N, H, causal)
        (1, 32768, 32768, 8, 128, False),
        (1, 32768, 32768, 8, 128, True),
        (1, 128, 32768, 8, 128, False),
        (1, 16, 32768, 32, 128, False),
        (4, 256, 16384, 16, 128, False),
        (2, 1024, 65536, 8, 64, False),
    ]
    for b, t, s, n, h, causal in points:
        for impl, splits in (("pallas_flash", 1), ("pallas_flash", 0), ("cudnn", None)):
            bs = None
            if impl == "pallas_flash":
                bs = dataclasses.replace(heuristic_block_sizes(h, jnp.bfloat16), kv_splits=splits)
            passes = ("fwd", "fwd+bwd") if t >= 16384 and splits != 0 else ("fwd",)
            for pass_ in passes:
                row = bench.run_point(
                    impl, b, t, s, n, n, h, jnp.bfloat16, causal, pass_, block_sizes=bs
                )
                row.update(exp="split-kv", kv_splits=splits, pass_=pass_)
                _record(out, row)


# (block_q, block_kv, num_stages[, persistent]) of the Mosaic forward, per head dim.
MOSAIC_TILES = {
    64: [
        (64, 128, 2),
        (128, 128, 2),
        (128, 64, 2),
        (64, 64, 2),
        (64, 128, 3),
        (64, 256, 2),
        (128, 128, 2, True),
        (64, 128, 2, True),
    ],
    128: [(64, 128, 2), (64, 128, 3), (64, 64, 3), (64, 64, 4), (128, 64, 2), (64, 128, 2, True)],
    256: [(64, 64, 2), (64, 64, 3)],
}


def _time_impls(out, fns, args, flops, **row):
    """Times each jitted fn of {impl: fn(q, k, v, do)} on args and records a row per impl."""
    for impl, fn in fns.items():
        timed = dict(row, impl=impl)
        try:
            timed["ms"] = round(bench.median_ms(fn, args), 4)
            timed["tflops"] = round(flops / timed["ms"] / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            timed["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        _record(out, timed)


def _grid_points(head_dims, seqs):
    """(B, T, N, H, causal, args) of the FA2 paper's grid (16k tokens, hidden 2048)."""
    for h in head_dims:
        n = 2048 // h
        for t in seqs:
            b = 16384 // t
            args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
            for causal in (False, True):
                yield b, t, n, h, causal, args


def _triton_tiles(h, causal, t):
    """The Triton tiles of a plain bf16 call on this GPU: its autotune entry, else the
    heuristics."""
    shape_class = tune_cache.ShapeClass.of(
        h, jnp.bfloat16, is_causal=causal, q_len=t, kv_len=t, masked=False
    )
    tuned = tune_cache.tuned_block_sizes(gpu_device_kind(), shape_class)
    return tuned or heuristic_block_sizes(h, jnp.bfloat16)


def _mosaic_fn(t, n, h, causal, pass_, **kwargs):
    """The Mosaic kernels (tune.mosaic_kernels_fn) timed for pass_, or None for tiles the
    shapes do not take."""
    kernels = tune.mosaic_kernels_fn(
        (16384 // t, t, n, h),
        jnp.bfloat16,
        is_causal=causal,
        backend="mosaic",
        block_sizes=_triton_tiles(h, causal, t),
        **kwargs,
    )
    return None if kernels is None else bench.timed_fn(lambda q, k, v: kernels(q, k, v)[0], pass_)


def mosaic_tiles(out, head_dims=(64, 128, 256), seqs=(512, 2048, 16384)):
    for b, t, n, h, causal, args in _grid_points(head_dims, seqs):
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd")
            for impl in ("pallas_flash_triton", "cudnn")
        }
        for bq, bkv, stages, *persistent in MOSAIC_TILES[h]:
            tiles = mosaic.ForwardTiles(
                block_q=bq, block_kv=bkv, num_stages=stages, persistent=bool(persistent)
            )
            fn = _mosaic_fn(t, n, h, causal, "fwd", forward_tiles=tiles)
            if fn is not None:
                fns[f"mosaic_{bq}x{bkv}s{stages}{'p' if persistent else ''}"] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd")
        _time_impls(out, fns, args, flops, exp="mosaic-tiles", B=b, T=t, N=n, H=h, causal=causal)


# BackwardTiles fields of the candidates (besides the defaults); `mosaic.why_not_backward` drops
# those that would spill or overflow shared memory at a head dim.
MOSAIC_BACKWARD_TILES = {
    "stages3": dict(num_stages=3),
    "kvdq128": dict(block_kv_dq=128),
    "kvdq128_stages3": dict(block_kv_dq=128, num_stages=3),
    "qdkv128": dict(block_q_dkv=128),
    "qdq128": dict(block_q_dq=128),
    "qdkv128_qdq128": dict(block_q_dkv=128, block_q_dq=128),
    "one_consumer": dict(num_consumers=1),
}


def mosaic_backward(out, head_dims=(64, 128), seqs=(512, 1024, 2048, 16384)):
    """fwd+bwd: the default call, cuDNN, the Mosaic forward with the Triton backward, and the
    Mosaic backward with its default tiles and each candidate of MOSAIC_BACKWARD_TILES."""
    for b, t, n, h, causal, args in _grid_points(head_dims, seqs):
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd+bwd")
            for impl in ("pallas_flash", "cudnn")
        }
        fns["triton_bwd"] = _mosaic_fn(t, n, h, causal, "fwd+bwd", backward="triton")
        candidates = {"default": mosaic.BackwardTiles()}
        for name, fields in MOSAIC_BACKWARD_TILES.items():
            candidates[name] = mosaic.BackwardTiles(**fields)
        for name, tiles in candidates.items():
            fn = _mosaic_fn(t, n, h, causal, "fwd+bwd", backward_tiles=tiles)
            if fn is not None:
                fns[f"mosaic_bwd_{name}"] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd+bwd")
        _time_impls(out, fns, args, flops, exp="mosaic-backward", B=b, T=t, N=n, H=h, causal=causal)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "experiment", choices=["tiles-masked", "split-kv", "mosaic-tiles", "mosaic-backward"]
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 16384])
    args = parser.parse_args()
    print("device:", jax.devices()[0].device_kind, flush=True)
    with open(args.out, "a") as out:
        if args.experiment == "mosaic-tiles":
            mosaic_tiles(out, args.head_dims, args.seqs)
        elif args.experiment == "mosaic-backward":
            mosaic_backward(out, [h for h in args.head_dims if h <= 128], args.seqs)
        else:
            {"tiles-masked": tiles_masked, "split-kv": split_kv}[args.experiment](out)


if __name__ == "__main__":
    main()
