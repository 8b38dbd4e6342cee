"""Quick timing of multi-head latent attention (H = 192, Hv = 128) against the plain H = 192 call
on the H200 (about a minute).

    python benchmarks/mla_timing.py OUT.jsonl

B=2, T=S=4096, N=K=16, bf16 (the models suite's DeepSeek row), causal and not. fwd and fwd+bwd
through `flash_attention` (backend=None) for "mla" and "plain" (H = Hv = 192); then, forward only,
the Mosaic forward at MLA's head dims with each tile candidate that its budgets take. FLOPs count
2 * pairs * (H + Hv) per head forward (x 3.5 forward+backward), as the models suite does. Prints
one JSON row per point and, at the end, MLA's time per FLOP over the plain call's (goal <= 1.05).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import median_ms, timed_fn
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic import tiles as mosaic_tiles

B, T, N, H, HV = 2, 4096, 16, 192, 128
TILE_CANDIDATES = [
    mosaic_tiles.ForwardTiles(block_q=64, block_kv=64, num_stages=2),
    mosaic_tiles.ForwardTiles(block_q=64, block_kv=64, num_stages=3),
    mosaic_tiles.ForwardTiles(block_q=64, block_kv=64, num_stages=2, persistent=True),
    mosaic_tiles.ForwardTiles(block_q=64, block_kv=128, num_stages=2),
]


def inputs(hv):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, N, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, N, hv), jnp.bfloat16)
    do = jax.random.normal(keys[3], (B, T, N, hv), jnp.bfloat16)
    return q, k, v, do


def flops(hv, causal, pass_):
    pairs = T * (T + 1) / 2 if causal else T * T
    return 2.0 * B * N * pairs * (H + hv) * (3.5 if pass_ == "fwd+bwd" else 1.0)


def main():
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    per_flop = {}

    def record(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    for causal in (False, True):
        for pass_ in ("fwd", "fwd+bwd"):
            for name, hv in (("mla", HV), ("plain", H)):
                fn = functools.partial(pallas_flash.flash_attention, is_causal=causal)
                ms = median_ms(timed_fn(fn, pass_), inputs(hv))
                per_flop[(name, causal, pass_)] = ms / flops(hv, causal, pass_)
                tflops = flops(hv, causal, pass_) / ms / 1e9
                record(dict(case=name, causal=causal, pass_=pass_, ms=ms, tflops=tflops))
        for tiles in TILE_CANDIDATES:
            reason = mosaic_tiles.why_not(
                (B, T, N, H), (B, T, N, H), jnp.bfloat16, value_head_dim=HV, is_causal=causal,
                tiles=tiles,
            )  # fmt: skip
            if reason:
                record(dict(case="mla_tiles", tiles=str(tiles), causal=causal, refused=reason))
                continue
            fn = functools.partial(
                mosaic_forward.flash_forward, scale=H**-0.5, is_causal=causal, tiles=tiles
            )
            ms = median_ms(timed_fn(fn, "fwd"), inputs(HV))
            tflops = flops(HV, causal, "fwd") / ms / 1e9
            row = dict(case="mla_tiles", tiles=str(tiles), causal=causal, ms=ms, tflops=tflops)
            record(row)
    for causal in (False, True):
        for pass_ in ("fwd", "fwd+bwd"):
            ratio = per_flop[("mla", causal, pass_)] / per_flop[("plain", causal, pass_)]
            print(f"causal={causal} {pass_}: MLA time per FLOP / plain's = {ratio:.3f}")


if __name__ == "__main__":
    main()
