"""Probe: the Mosaic GPU forward beside the Triton forward and cuDNN (forward only), with a few
tile settings. One JSON line per point to --out."""

import argparse
import json

import jax
import jax.numpy as jnp

from pallas_flash import bench, mosaic

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="probe_mosaic.jsonl")
parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 16384])
args = parser.parse_args()

TILES = {
    64: [(64, 128, 2), (128, 128, 2), (128, 64, 2), (64, 64, 2)],
    128: [(64, 128, 2), (64, 128, 3), (64, 64, 3), (64, 64, 4)],
    256: [(64, 64, 2), (64, 64, 3), (64, 128, 1 + 1)],
}
out = open(args.out, "a")
for h in args.head_dims:
    n = 2048 // h
    for t in args.seqs:
        b = 16384 // t
        q, k, v, _ = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
        for causal in (False, True):
            flops = bench.attention_flops(b, t, t, n, h, causal, "fwd")
            impls = {
                name: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd")
                for name, impl in (("triton", "pallas_flash_triton"), ("cudnn", "cudnn"))
            }
            for bq, bkv, st in TILES[h]:
                tiles = mosaic.ForwardTiles(block_q=bq, block_kv=bkv, num_stages=st)
                if mosaic.supports(q.shape, k.shape, q.dtype, is_causal=causal, tiles=tiles):
                    continue
                impls[f"mosaic_{bq}x{bkv}s{st}"] = jax.jit(
                    lambda q, k, v, do, tiles=tiles, causal=causal: mosaic.flash_forward(
                        q, k, v, scale=h**-0.5, is_causal=causal, tiles=tiles
                    )[0]
                )
            for name, f in impls.items():
                try:
                    ms = bench.median_ms(f, (q, k, v, None))
                    row = dict(
                        impl=name,
                        B=b,
                        T=t,
                        N=n,
                        H=h,
                        causal=causal,
                        ms=round(ms, 4),
                        tflops=round(flops / ms / 1e9, 1),
                    )
                except Exception as e:  # noqa: BLE001
                    row = dict(impl=name, B=b, T=t, N=n, H=h, causal=causal, error=str(e)[:300])
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
