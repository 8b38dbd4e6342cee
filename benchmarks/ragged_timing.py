"""Timing of `ragged_paged_attention` against its three speed goals (about 2 minutes on an H100).

    python benchmarks/ragged_timing.py OUT.jsonl   (GOALS="decode prefill mixed": which)

N=32 query heads over K=8 KV heads, H=128, bf16, pages of 16 in shuffled order (and of 128
where named). Each goal's calls run in one process on the same cache:

- decode: B sequences x 1 new token over caches of S keys (equal or ragged lengths): ragged
  against `paged_attention` (T=1) on the same pages. Goal: ragged >= 0.9x.
- prefill: B prompts of S tokens each (new tokens = keys, causal): ragged against
  `flash_attention(is_causal=True)` on the same tokens with contiguous K/V, the default call
  (the Mosaic kernels on Hopper) and backend="triton". Goal: ragged >= 0.9x.
- mixed: 1 prefill chunk of 2048 tokens (positions 2048-4095 of its cache) + 63 decode tokens
  over 4k caches: ragged against "padded" (one `paged_attention` of T=2048 for all 64
  sequences, the decode tokens last) and "split" (one `paged_attention` per kind, T=1 for the
  decode tokens and T=2048 for the chunk, in one jit). Goal: ragged faster than both.

Each row: wall ms (`median_ms`) and, on a GPU, kernel ms (`device_ms`, the kernels' time
without the host's dispatch), TB/s of the K/V bytes the batch must read and TFLOP/s of its
visible (query, key) pairs (4 H FLOPs each); ratios beside ragged's (other's kernel ms /
ragged's: > 1 means ragged is faster); max_abs_diff of each output against ragged's. On a CPU it
runs tiny shapes in the interpreter (a smoke test: times mean nothing).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench import device_ms, median_ms
from pallas_flash.device import gpu_compute_capability

N, K, H = 32, 8, 128


def paged_cache(lengths, page, seed=0, dtype=jnp.bfloat16, dense=None):
    """(k_pages, v_pages, block_tables) for sequences of `lengths` keys in shuffled pages of
    `page` keys; with dense = (k, v) [B, S, K, H] the pages hold those keys."""
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = int(-(-lengths.max() // page))
    num_pages = batch * max_pages
    perm = np.random.default_rng(seed).permutation(num_pages).reshape(batch, max_pages)
    tables = jnp.asarray(perm, jnp.int32)
    if dense is None:
        keys = jax.random.split(jax.random.key(seed), 2)
        shape = (num_pages, page, K, H)
        return (*(jax.random.normal(key, shape, dtype) for key in keys), tables)
    inverse = np.argsort(perm.reshape(-1))

    def pages(x):  # [B, S, K, H] -> pages in the tables' order
        x = jnp.pad(x, ((0, 0), (0, max_pages * page - x.shape[1]), (0, 0), (0, 0)))
        x = x.reshape(batch * max_pages, page, K, H)
        return x[inverse]

    return pages(dense[0]), pages(dense[1]), tables


def visible_pairs(q_lens, lengths) -> int:
    """(query, key) pairs a batch's new tokens see: token i of q_len at L - q_len + i sees
    L - q_len + i + 1 keys."""
    return int(sum(q * (L - q) + q * (q + 1) // 2 for q, L in zip(q_lens, lengths, strict=True)))


def ragged_args(q_rows, q_lens, lengths, k_pages, v_pages, tables):
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return (q_rows, k_pages, v_pages, tables, starts, jnp.asarray(lengths, jnp.int32))


def ragged_fn(interpret):
    return jax.jit(functools.partial(pallas_flash.ragged_paged_attention, interpret=interpret))


def decode_goal(shapes, interpret):
    """(name, {impl: (fn, args, to_rows)}, q_lens, lengths, kv_bytes) per shape."""
    for batch, seq, ragged, page in shapes:
        rng = np.random.default_rng(1)
        lengths = rng.integers(seq // 8, seq + 1, batch) if ragged else np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page)
        q = jax.random.normal(jax.random.key(2), (batch, 1, N, H), jnp.bfloat16)
        lens = jnp.asarray(lengths, jnp.int32)
        q_lens = [1] * batch
        calls = {
            "ragged": (
                ragged_fn(interpret),
                ragged_args(q[:, 0], q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
            "paged": (
                jax.jit(functools.partial(pallas_flash.paged_attention, interpret=interpret)),
                (q, k_pages, v_pages, tables, lens),
                lambda out: out[:, 0],
            ),
        }
        name = f"decode B{batch} S{seq}{' ragged' if ragged else ''} page{page}"
        yield name, calls, q_lens, lengths


def prefill_goal(shapes, interpret):
    for batch, seq, page in shapes:
        keys = jax.random.split(jax.random.key(3), 3)
        q = jax.random.normal(keys[0], (batch, seq, N, H), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, seq, K, H), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, seq, K, H), jnp.bfloat16)
        lengths = np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page, dense=(k, v))
        q_lens = [seq] * batch
        to_rows = lambda out: out.reshape(-1, N, H)  # noqa: E731
        calls = {
            "ragged": (
                ragged_fn(interpret),
                ragged_args(q.reshape(-1, N, H), q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
        }
        for impl, kw in (("flash", {}), ("flash_triton", dict(backend="triton"))):
            if interpret:
                kw = dict(backend="triton", interpret=True)
            calls[impl] = (
                jax.jit(
                    functools.partial(pallas_flash.flash_attention, is_causal=True, **kw),
                ),
                (q, k, v),
                to_rows,
            )
        yield f"prefill B{batch} S{seq} page{page}", calls, q_lens, lengths


def mixed_goal(shapes, interpret):
    for chunk, decodes, seq, page in shapes:
        batch = decodes + 1
        lengths = np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page)
        keys = jax.random.split(jax.random.key(4), 2)
        q_chunk = jax.random.normal(keys[0], (1, chunk, N, H), jnp.bfloat16)
        q_dec = jax.random.normal(keys[1], (decodes, 1, N, H), jnp.bfloat16)
        lens = jnp.asarray(lengths, jnp.int32)
        q_lens = [chunk] + [1] * decodes
        q_rows = jnp.concatenate([q_chunk[0], q_dec[:, 0]])
        paged = functools.partial(pallas_flash.paged_attention, interpret=interpret)

        def split(q_chunk, q_dec, kp, vp, t, lens):
            first = paged(q_chunk, kp, vp, t[:1], lens[:1])
            return first, paged(q_dec, kp, vp, t[1:], lens[1:])

        def padded(q_chunk, q_dec, kp, vp, t, lens):
            # Every sequence padded to the chunk's T: a decode token is its sequence's last.
            q_pad = jnp.zeros((decodes, chunk, N, H), q_dec.dtype).at[:, -1].set(q_dec[:, 0])
            return paged(jnp.concatenate([q_chunk, q_pad]), kp, vp, t, lens)

        both = (q_chunk, q_dec, k_pages, v_pages, tables, lens)
        calls = {
            "ragged": (
                ragged_fn(interpret),
                ragged_args(q_rows, q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
            "split": (
                jax.jit(split),
                both,
                lambda out: jnp.concatenate([out[0][0], out[1][:, 0]]),
            ),
            "padded": (
                jax.jit(padded),
                both,
                lambda out: jnp.concatenate([out[0], out[1:, -1]]),
            ),
        }
        yield f"mixed {chunk} + {decodes} x 1 over S{seq} page{page}", calls, q_lens, lengths


def run(out_path, goals, on_gpu):
    if on_gpu:
        shapes = {
            "decode": [
                (64, 4096, False, 16),
                (64, 4096, True, 16),
                (8, 32768, False, 16),
                (8, 32768, False, 128),
                (256, 1024, False, 16),
                (1, 32768, False, 16),
            ],
            "prefill": [(4, 2048, 16), (4, 2048, 128), (1, 8192, 16)],
            "mixed": [(2048, 63, 4096, 16), (2048, 63, 4096, 128), (512, 63, 4096, 16)],
        }
        interpret, repeats = False, 5
    else:
        print("No GPU: tiny shapes in the interpreter (times mean nothing).", flush=True)
        shapes = {
            "decode": [(3, 64, True, 16)],
            "prefill": [(2, 40, 16)],
            "mixed": [(24, 3, 64, 16)],
        }
        interpret, repeats = True, 1
    makers = dict(decode=decode_goal, prefill=prefill_goal, mixed=mixed_goal)
    summary = []
    with open(out_path, "a") if out_path else open(os.devnull, "w") as f:
        for goal in goals:
            for name, calls, q_lens, lengths in makers[goal](shapes[goal], interpret):
                kv_bytes = 2 * int(np.sum(lengths)) * K * H * 2
                flops = 4.0 * H * N * visible_pairs(q_lens, lengths)
                rows, outs = {}, {}
                for impl, (fn, args, to_rows) in calls.items():
                    row = dict(suite="ragged", goal=goal, case=name, impl=impl)
                    try:
                        ms = median_ms(fn, args, calls=10 if on_gpu else 1, repeats=repeats)
                        row.update(ms=round(ms, 5))
                        if on_gpu:
                            kernel_ms, kernels = device_ms(fn, args)
                            row.update(
                                kernel_ms=round(kernel_ms, 5),
                                kernels={k: round(t, 5) for k, t in kernels.items()},
                            )
                        timing = row.get("kernel_ms", ms)
                        row.update(
                            tbps=round(kv_bytes / timing / 1e9, 3),
                            tflops=round(flops / timing / 1e9, 1),
                        )
                        outs[impl] = to_rows(fn(*args)).astype(jnp.float32)
                    except Exception as e:  # noqa: BLE001 -- a failing comparator is data
                        row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    rows[impl] = row
                base = rows["ragged"]
                for impl, row in rows.items():
                    if impl in outs and "ragged" in outs:
                        diff = jnp.max(jnp.abs(outs[impl] - outs["ragged"]))
                        row["max_abs_diff"] = float(diff)
                    key = "kernel_ms" if on_gpu else "ms"
                    if impl != "ragged" and row.get(key) and base.get(key):
                        row["ratio"] = round(row[key] / base[key], 3)  # > 1: ragged faster
                        summary.append((goal, name, impl, row["ratio"]))
                    row.update(kv_bytes=kv_bytes, flops=flops)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(json.dumps(row), flush=True)
    print(
        "\nother / ragged time (> 1: ragged faster); goals: decode paged >= 0.9 means ratio "
        ">= 0.9, prefill flash ratio >= 0.9, mixed ratios > 1",
        flush=True,
    )
    for goal, name, impl, ratio in summary:
        print(f"  {goal:8s} {name:40s} {impl:13s} {ratio:.3f}", flush=True)


def main():
    goals = os.environ.get("GOALS", "decode prefill mixed").split()
    cc = gpu_compute_capability()
    run(sys.argv[1] if len(sys.argv) > 1 else None, goals, cc is not None and cc >= (8, 0))


if __name__ == "__main__":
    main()
