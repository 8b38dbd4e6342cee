"""`python -m pallas_flash.tune`: autotune BlockSizes on this GPU and fill the on-disk cache.

For each shape class (dtype, head dim, causal, masked, sequence bucket) it times a small search
space greedily -- forward tiles on the forward pass, then the dK/dV tiles and the dQ tiles on
forward+backward -- checks the winner against the reference, and stores it under the GPU's kind
(`jax.devices()[0].device_kind`) in the cache file (`config.tune_cache_path()`). `flash_attention`
uses a cache entry whenever its call falls in that class; without one it uses the shipped
heuristics.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import config as config_lib
from pallas_flash.config import BlockSizes, ShapeClass

KERNEL_FIELDS = ("block_q", "block_kv", "num_warps", "num_stages")

# Candidates per padded head dim: (block_q, block_kv, num_warps, num_stages) of one kernel.
# The forward list also seeds nothing else: each kernel is searched with the others fixed.
FORWARD = {
    64: [
        (128, 64, 4, 3),
        (128, 128, 4, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 3),
    ],
    128: [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 64, 8, 4),
        # Two programs per SM (<= 128 registers at 8 warps, <= 113 KiB of shared memory, read
        # with benchmarks/triton_ir.py): one program's softmax can overlap the other's MMAs.
        (128, 32, 8, 3),
        (64, 64, 4, 2),
    ],
    256: [(64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1)],
}
DKV = {
    64: [(32, 128, 4, 3), (64, 64, 4, 3), (32, 128, 4, 5), (64, 128, 8, 3), (32, 64, 4, 3)],
    # (32, 128, 8, 3): 218 registers and no spills, where the default spills (255 + 80 bytes).
    128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3)],
    256: [(64, 64, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1), (32, 64, 4, 2)],
}
DQ = {
    64: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 2)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    256: [(64, 32, 4, 1), (128, 32, 8, 1), (64, 16, 4, 2), (64, 32, 4, 2)],
}
SEQ_OF_CLASS = {"short": 1024, "medium": 4096, "long": 16384}


def candidates(table, head_dim):
    return table[min(max(head_dim, 64), 256)]


def search(start: BlockSizes, head_dim: int, measure) -> tuple[BlockSizes, dict]:
    """Greedy search: forward tiles on "fwd", then dK/dV and dQ tiles on "fwd+bwd".

    measure(block_sizes, pass_) -> milliseconds, or None when the candidate fails (too much
    shared memory, say). Returns the best BlockSizes and {pass: best ms}.
    """
    best, best_ms = start, {}
    for table, suffix, pass_ in (
        (FORWARD, "", "fwd"),
        (DKV, "_dkv", "fwd+bwd"),
        (DQ, "_dq", "fwd+bwd"),
    ):
        fields = [f + suffix for f in KERNEL_FIELDS]
        winner, winner_ms = best, None
        for values in candidates(table, head_dim):
            bs = dataclasses.replace(best, **dict(zip(fields, values)))
            ms = measure(bs, pass_)
            if ms is not None and (winner_ms is None or ms < winner_ms):
                winner, winner_ms = bs, ms
        best = winner
        if winner_ms is not None:
            best_ms[pass_] = winner_ms
    return best, best_ms


def _gpu_measure(shape_class: ShapeClass, log):
    """A measure function timing pallas_flash at the FA2-paper shape of the class."""
    from pallas_flash import bench

    seq = SEQ_OF_CLASS[shape_class.seq]
    heads = max(1, 2048 // shape_class.head_dim)
    batch = max(1, 16384 // seq)
    dtype = jnp.dtype(shape_class.dtype)

    def measure(bs, pass_):
        row = bench.run_point(
            "pallas_flash",
            batch,
            seq,
            seq,
            heads,
            heads,
            shape_class.head_dim,
            dtype,
            shape_class.is_causal,
            pass_,
            block_sizes=bs,
            repeats=3,
        )
        row.update(shape_class=shape_class.key(), block_sizes=dataclasses.asdict(bs))
        log(row)
        return row["ms"]

    return measure


def max_error(bs: BlockSizes, shape_class: ShapeClass) -> float:
    """Largest |kernel - f32 reference| over out and the gradients at a small odd shape."""
    dtype = jnp.dtype(shape_class.dtype)
    h = shape_class.head_dim
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, 200, 4, h), dtype)
    k = jax.random.normal(keys[1], (2, 333, 2, h), dtype)
    v = jax.random.normal(keys[2], (2, 333, 2, h), dtype)
    do = jax.random.normal(keys[3], (2, 200, 4, h), jnp.float32)

    def grads(fn, cast):
        out, vjp = jax.vjp(lambda *a: fn(*(x.astype(cast) for x in a)), q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    causal = shape_class.is_causal
    ours = jax.jit(
        lambda: grads(
            functools.partial(pallas_flash.flash_attention, is_causal=causal, block_sizes=bs), dtype
        )
    )()
    ref = jax.jit(
        lambda: grads(
            functools.partial(pallas_flash.attention_reference, is_causal=causal), jnp.float32
        )
    )()
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(ours, ref)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument(
        "--seqs", nargs="+", default=["short", "medium", "long"], choices=list(SEQ_OF_CLASS)
    )
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--cache", help="cache file (default: config.tune_cache_path())")
    parser.add_argument("--log", help="JSONL file for every measurement")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="largest |error| against the f32 reference a winner may have",
    )
    args = parser.parse_args(argv)

    kind = config_lib.gpu_device_kind()
    if kind is None or (config_lib.gpu_compute_capability() or (0, 0)) < (8, 0):
        raise SystemExit("pallas_flash.tune needs an NVIDIA GPU of compute capability >= 8.0")
    log_file = open(args.log, "a") if args.log else None

    def log(row):
        print(json.dumps(row), flush=True)
        if log_file:
            log_file.write(json.dumps(row) + "\n")

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    found = {}
    for h in args.head_dims:
        for seq in args.seqs:
            for causal in causals:
                shape_class = ShapeClass(
                    dtype=args.dtype,
                    head_dim=config_lib.padded_head_dim(h),
                    is_causal=causal,
                    masked=False,
                    seq=seq,
                )
                start = config_lib.heuristic_block_sizes(h, args.dtype)
                best, best_ms = search(start, shape_class.head_dim, _gpu_measure(shape_class, log))
                err = max_error(best, shape_class)
                ok = err <= args.tolerance
                log(
                    dict(
                        shape_class=shape_class.key(),
                        best=dataclasses.asdict(best),
                        ms=best_ms,
                        max_err=err,
                        kept=ok,
                    )
                )
                if ok:
                    found[shape_class] = best
    config_lib.save_tuned_block_sizes(kind, found, args.cache)
    print(
        f"wrote {len(found)} entries for {kind!r} to {args.cache or config_lib.tune_cache_path()}"
    )


if __name__ == "__main__":
    main()
