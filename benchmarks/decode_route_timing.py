"""flash_attention with a few query tokens over a long key sequence against decode_attention on
the same arrays (issue 45): the default call (whose forward the dispatch runs on the decode
kernel, `dispatch.few_tokens_on_decode`), the flash forward as before (backend="triton"),
decode_attention, and jax.nn's XLA attention, in TB/s of K/V read.

    python benchmarks/decode_route_timing.py [--short] [--out ROWS.jsonl] [--smoke]

Shapes: N=32 query heads over K=8, H=128, bfloat16, T 1 and 4 new tokens, B=1 at 128k keys,
B=8 at 32k, B=64 at 4k. --short instead sweeps the key length (64 to 4k keys at B=1 and 8; the
default call, the flash forward and decode_attention): the crossover that
`dispatch.DECODE_ROUTE_MIN_KV_LEN` should sit at. Each call is timed over
enough copies of the inputs, used in turn, that they do not fit in L2 together: wall time
(the median over 7 repeats of 20 calls) and kernel time (jax's profiler, `bench.device_ms`).
One JSON row per (shape, implementation) on stdout (and appended to --out), then a table.
--smoke: tiny shapes in the Pallas interpreter on CPU (checks that the script runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import bench, dispatch
from pallas_flash.call import Call
from pallas_flash.masks import MaskSpec

N, K, H = 32, 8, 128
ISSUE_SHAPES = [(1, 131072), (8, 32768), (64, 4096)]
SHORT_SHAPES = [(b, s) for b in (1, 8) for s in (64, 256, 1024, 4096)]
# The implementations the --short sweep times (the crossover is between these).
SHORT_IMPLS = ("flash_attention", "flash_forward", "decode_attention")
SMOKE_SHAPES = [(2, 128)]
# Inputs cycle over copies of at least this many bytes of K/V in all (4x the H100's 50 MB L2).
ROTATE_BYTES = 200e6
MAX_COPIES = 1024


def implementations(interpret: bool) -> dict:
    """{name: fn(q, k, v, lengths) -> out}, each jitted."""
    kwargs = dict(interpret=True) if interpret else {}
    fns = {
        # The default call: the decode kernel's forward where the dispatch routes it.
        "flash_attention": lambda q, k, v, lens: pallas_flash.flash_attention(q, k, v, **kwargs),
        # The same with the valid cache prefix given (the serving case).
        "flash_attention_lengths": lambda q, k, v, lens: pallas_flash.flash_attention(
            q, k, v, key_value_seq_lengths=lens, **kwargs
        ),
        # The flash forward (what the default call ran before the route).
        "flash_forward": lambda q, k, v, lens: pallas_flash.flash_attention(
            q, k, v, backend="triton", **kwargs
        ),
        "decode_attention": lambda q, k, v, lens: pallas_flash.decode_attention(
            q, k, v, key_value_seq_lengths=lens, **kwargs
        ),
    }
    if not interpret:
        fns["xla"] = lambda q, k, v, lens: jax.nn.dot_product_attention(
            q, k, v, implementation="xla"
        )
    return {name: jax.jit(fn) for name, fn in fns.items()}


def inputs(batch: int, q_len: int, kv_len: int, copies: int, dtype=jnp.bfloat16):
    """`copies` independent (q, k, v, lengths) of one shape (lengths all kv_len)."""
    sets = []
    for i in range(copies):
        keys = jax.random.split(jax.random.key(i), 3)
        q = jax.random.normal(keys[0], (batch, q_len, N, H), dtype)
        k = jax.random.normal(keys[1], (batch, kv_len, K, H), dtype)
        v = jax.random.normal(keys[2], (batch, kv_len, K, H), dtype)
        sets.append((q, k, v, jnp.full((batch,), kv_len, jnp.int32)))
    return sets


def wall_ms(fn, sets, *, calls: int = 20, repeats: int = 7) -> float:
    """The median over `repeats` of `calls` back-to-back calls (inputs in turn), ms per call."""
    for args in sets:
        jax.block_until_ready(fn(*args))
    times = []
    cycle = itertools.cycle(sets)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*next(cycle))
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def kernel_ms(fn, sets) -> float:
    """The call's GPU kernels, ms per call (inputs in turn; `bench.device_ms`)."""
    cycle = itertools.cycle(sets)
    return bench.device_ms(lambda: fn(*next(cycle)), ())[0]


def run(shapes, out_path, *, interpret: bool, only=None):
    rows = []
    on_gpu = jax.default_backend() == "gpu"
    fns = implementations(interpret)
    if only is not None:
        fns = {name: fn for name, fn in fns.items() if name in only}
    for (batch, kv_len), q_len in itertools.product(shapes, (1, 4)):
        kv_bytes = 2 * batch * kv_len * K * H * 2
        copies = 1 if interpret else min(MAX_COPIES, max(2, -(-int(ROTATE_BYTES) // kv_bytes)))
        sets = inputs(batch, q_len, kv_len, copies)
        routed = dispatch.few_tokens_on_decode(
            Call(
                q_shape=sets[0][0].shape,
                k_shape=sets[0][1].shape,
                dtype=jnp.bfloat16,
                spec=MaskSpec(q_len=q_len, kv_len=kv_len),
            )
        )
        for name, fn in fns.items():
            row = dict(B=batch, T=q_len, S=kv_len, N=N, K=K, H=H, dtype="bfloat16", impl=name)
            row.update(copies=copies, routed=routed, device=jax.devices()[0].device_kind)
            try:
                ms = wall_ms(fn, sets, calls=2 if interpret else 20, repeats=1 if interpret else 7)
                row.update(ms=round(ms, 4), tbps=round(kv_bytes / ms / 1e9, 3))
                if on_gpu:
                    kms = kernel_ms(fn, sets)
                    row.update(kernel_ms=round(kms, 4), kernel_tbps=round(kv_bytes / kms / 1e9, 3))
            except Exception as e:  # noqa: BLE001 (a row that fails is reported, not fatal)
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del sets
    return rows


def print_table(rows, out=sys.stdout):
    """One line per shape: each implementation's TB/s (kernel time where measured, else wall),
    and flash_attention's share of decode_attention's."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    metric = "kernel_tbps" if any("kernel_tbps" in r for r in rows) else "tbps"
    print(f"\nTB/s of K/V read ({metric}; wall TB/s in brackets)", file=out)
    print("| B | T | S | " + " | ".join(impls) + " | flash / decode |", file=out)
    print("|---" * (4 + len(impls)) + "|", file=out)
    shapes = dict.fromkeys((r["B"], r["T"], r["S"]) for r in rows)
    for b, t, s in shapes:
        by_impl = {r["impl"]: r for r in rows if (r["B"], r["T"], r["S"]) == (b, t, s)}
        cells = []
        for impl in impls:
            r = by_impl.get(impl, {})
            cells.append(
                "error" if "error" in r else f"{r.get(metric, '-')} ({r.get('tbps', '-')})"
            )
        flash, decode = by_impl.get("flash_attention", {}), by_impl.get("decode_attention", {})
        ratio = "-"
        if flash.get(metric) and decode.get(metric):
            ratio = f"{flash[metric] / decode[metric]:.2f}"
        print(f"| {b} | {t} | {s} | " + " | ".join(cells) + f" | {ratio} |", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="sweep short key lengths instead")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter")
    parser.add_argument("--out", default=None, help="append the JSON rows to this file")
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHORT_SHAPES if args.short else ISSUE_SHAPES
    only = SHORT_IMPLS if args.short else None
    print_table(run(shapes, args.out, interpret=args.smoke, only=only))


if __name__ == "__main__":
    main()
