"""Times the Triton backward's dK/dV tiles at the shipped defaults and beside them (fwd+bwd,
bf16, in turns, beside cuDNN and the default call) on the masks suite's calls and dense ones:

    python benchmarks/dkv_tiles.py OUT.jsonl [--head-dims 128 64] [--turns 3] [--cases NAME ...]
        [--variants NAME ...]

The Triton backward is what `backend="triton"`, bias calls and GPUs before Hopper run. Each
variant replaces only the backward's fields of the shipped tiles; with block_sizes the forward
is Triton's in every variant (the default call may run the Mosaic kernels). One JSON row per
case, variant and turn: ms is the median of 7 repeats of 10 calls; compile_s the first call's.
"""

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import make_inputs, median_ms, timed_fn
from pallas_flash.triton.tiles import heuristic_block_sizes

LENGTHS = [2048, 1024, 1536, 1100, 2000, 1800, 1300, 1700]

# (case, (B, T, N, H-free), kwargs, narrow): the masks suite's calls (pallas_flash.bench).
ROW = (1, 16384, 16)
CASES = [
    ("causal window 1024", ROW, dict(is_causal=True, local_window_size=(1024, 0)), True),
    ("causal window 4096", ROW, dict(is_causal=True, local_window_size=(4096, 0)), False),
    ("padded 8x2048", (8, 2048, 16), dict(
        query_seq_lengths=jnp.asarray(LENGTHS, jnp.int32),
        key_value_seq_lengths=jnp.asarray(LENGTHS, jnp.int32)), False),
    ("dense causal 16k", ROW, dict(is_causal=True), False),
    ("dense 16k", ROW, dict(), False),
    ("dense 4k", (4, 4096, 16), dict(), False),
]  # fmt: skip

# Backward fields per head dim: (name, replacements of the shipped tiles).
VARIANTS = {
    128: [
        ("shipped", {}),
        ("dkv 64 rows", dict(block_q_dkv=64)),
        ("dkv 32 rows", dict(block_q_dkv=32)),
        ("dkv 64 rows, 2 stages", dict(block_q_dkv=64, num_stages_dkv=2)),
        ("dkv 32 rows, 4 warps", dict(block_q_dkv=32, num_warps_dkv=4)),
    ],
    64: [
        ("shipped", {}),
        ("dkv 2 stages", dict(num_stages_dkv=2)),
    ],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--cases", nargs="+", help="case names (default: all)")
    parser.add_argument("--variants", nargs="+", help="variant names (default: all)")
    args = parser.parse_args()
    cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    with open(args.out, "a") as out:
        for h in args.head_dims:
            for case, (b, t, n), kwargs, narrow in CASES:
                if args.cases and case not in args.cases:
                    continue
                inputs = make_inputs(b, t, t, n, n, h, jnp.bfloat16)
                # Every case but the dense ones has rows that see ranges of keys.
                ranged = bool(kwargs)
                base = heuristic_block_sizes(h, jnp.bfloat16, narrow=narrow, ranged=ranged)
                fns = {
                    "cudnn": timed_fn(functools.partial(cudnn, **kwargs), "fwd+bwd"),
                    "default call": timed_fn(
                        functools.partial(pallas_flash.flash_attention, **kwargs), "fwd+bwd"
                    ),
                }
                for name, fields in VARIANTS[h]:
                    if args.variants and name not in args.variants:
                        continue
                    tiles = dataclasses.replace(base, **fields)
                    fn = functools.partial(
                        pallas_flash.flash_attention, block_sizes=tiles, **kwargs
                    )
                    fns[name] = timed_fn(fn, "fwd+bwd")
                compile_s, times = {}, {name: [] for name in fns}
                for name, f in fns.items():
                    start = time.perf_counter()
                    try:
                        jax.block_until_ready(f(*inputs))
                        compile_s[name] = round(time.perf_counter() - start, 2)
                    except Exception as e:  # noqa: BLE001
                        print(f"{h} {case} {name}: {type(e).__name__}: {str(e)[:300]}")
                        compile_s[name] = None
                for turn in range(args.turns):
                    for name, f in fns.items():
                        if compile_s[name] is None:
                            continue
                        ms = median_ms(f, inputs)
                        times[name].append(ms)
                        row = dict(H=h, case=case, variant=name, turn=turn, ms=round(ms, 4),
                                   compile_s=compile_s[name])  # fmt: skip
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                cu = statistics.median(times["cudnn"]) if times["cudnn"] else None
                for name, ms in times.items():
                    if ms:
                        med = statistics.median(ms)
                        ratio = f"{cu / med:.3f}" if cu else "-"
                        print(f"H={h} {case:20s} {name:24s} {med:8.3f} ms  cudnn/this {ratio}",
                              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
