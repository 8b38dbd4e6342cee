"""Timing of `ragged_paged_attention` against its three speed goals (about 2 minutes on an H100).

    python benchmarks/ragged_timing.py OUT.jsonl [--before TREE]   (GOALS="decode prefill mixed")

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

"ragged" is the call as shapes alone allow; "ragged_hint" passes max_query_len (the batch's
most new tokens: 1 for a decode batch), where the imported pallas_flash has it.
PREFILL_TILES="BMxBKVxWxS ..." (e.g. "128x64x4x2") adds a "ragged_tiles_..." call per entry to
the prefill and mixed goals: the prefill launch with those tiles (block_m_prefill,
block_kv_prefill, num_warps_prefill, num_stages_prefill).

Each row: wall ms (`median_ms`) and, on a GPU, kernel ms (`device_ms`, the kernels' time
without the host's dispatch) with each kernel's ms (`kernels`), TB/s of the K/V bytes the
batch must read and TFLOP/s of its visible (query, key) pairs (4 H FLOPs each); ratios beside
ragged's (`ratio`: other's kernel ms / ragged's: > 1 means ragged is faster; `ratio_hint`: the
same against ragged_hint; `ratios`: against every ragged call); max_abs_diff of each output
against ragged's; `label` (LABEL) and `run` (one id per invocation). --before TREE first
runs the same timings in a child process that imports pallas_flash from TREE (a copy of an
older package: TREE/pallas_flash), labelled "before", then this tree's, labelled "after", and
prints each call's kernel ms side by side.
On a CPU it runs tiny shapes in the interpreter (a smoke test: times mean nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import subprocess
import sys
import time

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


def ragged_fn(interpret, **kwargs):
    return jax.jit(
        functools.partial(pallas_flash.ragged_paged_attention, interpret=interpret, **kwargs)
    )


def has_max_query_len() -> bool:
    """Whether the imported pallas_flash's ragged_paged_attention takes max_query_len."""
    return "max_query_len" in inspect.signature(pallas_flash.ragged_paged_attention).parameters


def ragged_variants(calls, q_lens, interpret, tiles=()):
    """calls with "ragged_hint" (max_query_len) where supported, and one call per prefill
    tile entry "BMxBKVxWxS" (`PREFILL_TILES`), each on ragged's arguments."""
    fn, args, to_rows = calls["ragged"]
    if has_max_query_len():
        calls["ragged_hint"] = (ragged_fn(interpret, max_query_len=max(q_lens)), args, to_rows)
    for entry in tiles:
        bm, bkv, warps, stages = (int(x) for x in entry.split("x"))
        k_pages = args[1]
        default_tiles = pallas_flash.triton.ragged.ragged_block_sizes
        # The older tree counts the kernel's sequences (the batch's and two more).
        old = "num_seqs" in inspect.signature(default_tiles).parameters
        device = pallas_flash.device.target_device()
        base = default_tiles(
            args[0].shape,
            len(q_lens) + 2 * old,
            k_pages.shape[2],
            args[3].shape[1] * k_pages.shape[1],
            args[0].dtype,
            interpret=interpret,
            page_size=k_pages.shape[1],
            num_sms=device.num_sms if device is not None else 132,
        )
        bs = dataclasses.replace(
            base,
            block_m_prefill=bm,
            block_kv_prefill=bkv,
            num_warps_prefill=warps,
            num_stages_prefill=stages,
        )
        calls[f"ragged_tiles_{entry}"] = (ragged_fn(interpret, block_sizes=bs), args, to_rows)
    return calls


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
        calls = ragged_variants(calls, q_lens, interpret)
        name = f"decode B{batch} S{seq}{' ragged' if ragged else ''} page{page}"
        yield name, calls, q_lens, lengths


def prefill_goal(shapes, interpret, tiles=()):
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
        calls = ragged_variants(calls, q_lens, interpret, tiles)
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


def mixed_goal(shapes, interpret, tiles=()):
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
        calls = ragged_variants(calls, q_lens, interpret, tiles)
        yield f"mixed {chunk} + {decodes} x 1 over S{seq} page{page}", calls, q_lens, lengths


def run(out_path, goals, on_gpu, *, label=None, run_id=None, tiles=()):
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
    print(f"pallas_flash from {os.path.dirname(pallas_flash.__file__)} ({label})", flush=True)
    makers = dict(
        decode=decode_goal,
        prefill=functools.partial(prefill_goal, tiles=tiles),
        mixed=functools.partial(mixed_goal, tiles=tiles),
    )
    summary = []
    with open(out_path, "a") if out_path else open(os.devnull, "w") as f:
        for goal in goals:
            for name, calls, q_lens, lengths in makers[goal](shapes[goal], interpret):
                kv_bytes = 2 * int(np.sum(lengths)) * K * H * 2
                flops = 4.0 * H * N * visible_pairs(q_lens, lengths)
                rows, outs = {}, {}
                for impl, (fn, args, to_rows) in calls.items():
                    row = dict(suite="ragged", goal=goal, case=name, impl=impl)
                    if label is not None:
                        row.update(label=label, run=run_id)
                    if impl == "ragged_hint":
                        row["max_query_len"] = max(q_lens)
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
                key = "kernel_ms" if on_gpu else "ms"
                for impl, row in rows.items():
                    if impl in outs and "ragged" in outs:
                        diff = jnp.max(jnp.abs(outs[impl] - outs["ragged"]))
                        row["max_abs_diff"] = float(diff)
                    bases = [b for b in rows if b.startswith("ragged") and rows[b].get(key)]
                    if not impl.startswith("ragged") and row.get(key):
                        # > 1: that ragged call is faster
                        ratios = {b: round(row[key] / rows[b][key], 3) for b in bases}
                        row["ratios"] = ratios
                        for base, field in (("ragged", "ratio"), ("ragged_hint", "ratio_hint")):
                            if base in ratios:
                                row[field] = ratios[base]
                        summary += [(goal, name, f"{impl} / {b}", r) for b, r in ratios.items()]
                    row.update(kv_bytes=kv_bytes, flops=flops)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(json.dumps(row), flush=True)
    print(
        f"\n[{label}] other / ragged time (> 1: ragged faster); goals: decode paged >= 0.9, "
        "prefill flash >= 0.9, mixed ratios > 1",
        flush=True,
    )
    for goal, name, impls, ratio in summary:
        print(f"  {goal:8s} {name:40s} {impls:28s} {ratio:.3f}", flush=True)


def compare(out_path, run_id):
    """Prints each call's kernel ms (wall ms off a GPU) before and after, from the run's rows."""
    rows = [json.loads(line) for line in open(out_path)]
    rows = [r for r in rows if r.get("run") == run_id]
    ms = {}
    for r in rows:
        ms[(r["goal"], r["case"], r["impl"], r["label"])] = r.get("kernel_ms") or r.get("ms")
    print("\nkernel ms, before -> after (after / before)", flush=True)
    seen = []
    for goal, case, impl, _ in ms:
        if (goal, case, impl) not in seen:
            seen.append((goal, case, impl))
    for goal, case, impl in seen:
        before, after = ms.get((goal, case, impl, "before")), ms.get((goal, case, impl, "after"))
        change = f"{after / before:.3f}" if before and after else "-"
        print(f"  {case:40s} {impl:24s} {before} -> {after} ({change})", flush=True)


def main():
    args = sys.argv[1:]
    before = None
    if "--before" in args:
        i = args.index("--before")
        before = args[i + 1]
        del args[i : i + 2]
    out_path = args[0] if args else None
    goals = os.environ.get("GOALS", "decode prefill mixed").split()
    tiles = os.environ.get("PREFILL_TILES", "").split()
    run_id = os.environ.get("RAGGED_RUN") or time.strftime("%Y%m%d-%H%M%S")
    label = os.environ.get("LABEL")
    if before is not None:
        if out_path is None:
            sys.exit("--before needs OUT.jsonl")
        env = dict(os.environ, LABEL="before", RAGGED_RUN=run_id)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(before)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        subprocess.run([sys.executable, __file__, out_path], env=env, check=True)
        label = "after"
    cc = gpu_compute_capability()
    on_gpu = cc is not None and cc >= (8, 0)
    run(out_path, goals, on_gpu, label=label, run_id=run_id, tiles=tiles)
    if before is not None:
        compare(out_path, run_id)


if __name__ == "__main__":
    main()
