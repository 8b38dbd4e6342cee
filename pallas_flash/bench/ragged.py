"""`--suite ragged`: `ragged_paged_attention` against its speed goals (about 2 minutes on an H100
for the first three groups), each group's calls in one process on the same cache.

N=32 query heads over K=8 KV heads, H=128, bf16, pages of 16 in shuffled order (and of 128
where named), unless the group says otherwise. Groups (`--cases`, default all):

- decode: B sequences x 1 new token over caches of S keys (equal or ragged lengths): ragged
  against `paged_attention` (T=1) on the same pages. Goal: ragged >= 0.9x.
- prefill: B prompts of S tokens each (new tokens = keys, causal): ragged against
  `flash_attention(is_causal=True)` on the same tokens with contiguous K/V, the default call
  (the Mosaic kernels on Hopper) and backend="triton". Goal: ragged >= 0.9x.
- mixed: 1 prefill chunk of 2048 tokens (positions 2048-4095 of its cache) + 63 decode tokens
  over 4k caches: ragged against "padded" (one `paged_attention` of T=2048 for all 64
  sequences, the decode tokens last) and "split" (one `paged_attention` per kind, T=1 for the
  decode tokens and T=2048 for the chunk, in one jit). Goal: ragged faster than both.
- mla: the decode and mixed batches over MLA's latent pages (one KV head of 576 columns whose
  first 512 are the values, pages of 64), 128 and 16 query heads: ragged against
  `paged_attention` (decode) and "split" (mixed) on the same pages.
- fp8: the decode and mixed batches over float8_e4m3fn pages (per-head scales): ragged against
  `paged_attention` on the same pages, and against ragged over the same cache in bfloat16
  ("bf16").

"ragged" is the call as shapes alone allow (on Hopper its prefill launch on the Mosaic kernel
where that takes the call); "ragged_hint" passes max_query_len (the batch's most new tokens: 1
for a decode batch), where the imported pallas_flash has it; "ragged_triton" (prefill and
mixed, on a GPU) passes backend="triton": the Triton prefill launch.
--prefill-tiles BMxBKVxWxS ... (e.g. 128x64x4x2) adds a "ragged_tiles_BMxBKVxWxS" call per
entry to the prefill and mixed batches: the prefill launch with those tiles (block_m_prefill,
block_kv_prefill, num_warps_prefill, num_stages_prefill), the rest the call's defaults.

Each row: wall ms (`median_ms`) and, on a GPU, kernel ms (`device_ms`, the kernels' time
without the host's dispatch) with each kernel's ms (`kernels`), TB/s of the K/V bytes the
batch must read and TFLOP/s of its visible (query, key) pairs (2 (H + Hv) FLOPs each per query
head); each comparator's time over the ragged calls' (`ratio`: over ragged's, > 1 means ragged
is faster; `ratio_hint`: over ragged_hint's; `ratios`: over every ragged call's); max_abs_diff
of each output against ragged's; with --label (or --before) `label` and `run` (one id per
invocation). --before TREE first runs the same timings in a child process that imports
pallas_flash from TREE (a copy of an older package: TREE/pallas_flash; calls it lacks are
rows with their error), labelled "before", then this tree's, labelled "after", and prints each
call's time side by side (it needs --out, where both runs' rows go). On a CPU it runs tiny
shapes in the interpreter (a smoke test: times mean nothing).
"""

from __future__ import annotations

import argparse
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
from pallas_flash.bench.timing import Rows, device_ms, median_ms, print_markdown, progress

HELP = (
    "ragged: ragged_paged_attention against paged_attention, flash_attention, padding and one "
    "call per kind (--cases decode prefill mixed mla fp8; --prefill-tiles; --before TREE; tiny "
    "interpreted shapes on a CPU)"
)
FLAGS = ("--repeats", "--cases", "--prefill-tiles", "--before", "--label")
CASES = ("decode", "prefill", "mixed", "mla", "fp8")
REPEATS = 5

# A float8 cache's scale (normal values over it span e4m3's range).
FP8_SCALE = 0.05


@dataclasses.dataclass(frozen=True)
class Heads:
    """The attention's heads: N query heads over K KV heads of H columns; hv: a latent cache's
    values (its keys' first hv columns), None for values of their own; cache: the pages'
    dtype."""

    N: int = 32
    K: int = 8
    H: int = 128
    hv: int | None = None
    cache: str = "bfloat16"

    @property
    def value_dim(self) -> int:
        return self.hv or self.H

    @property
    def fp8(self) -> bool:
        return jnp.dtype(self.cache).itemsize == 1

    def kwargs(self) -> dict:
        """The calls' cache-format arguments."""
        kwargs = {}
        if self.hv:
            kwargs["value_head_dim"] = self.hv
        if self.fp8:
            scale = jnp.full((self.K,), FP8_SCALE, jnp.float32)
            kwargs["k_scale"] = scale
            if not self.hv:
                kwargs["v_scale"] = scale
        return kwargs

    def kv_bytes(self, lengths) -> int:
        columns = self.H if self.hv else 2 * self.H
        return int(np.sum(lengths)) * self.K * columns * jnp.dtype(self.cache).itemsize


GQA = Heads()


def paged_cache(lengths, page, heads: Heads = GQA, seed=0, dense=None):
    """(k_pages, v_pages, block_tables) for sequences of `lengths` keys in shuffled pages of
    `page` keys (v_pages None for a latent cache); with dense = (k, v) [B, S, K, H] (bf16) the
    pages hold those keys."""
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = int(-(-lengths.max() // page))
    num_pages = batch * max_pages
    perm = np.random.default_rng(seed).permutation(num_pages).reshape(batch, max_pages)
    tables = jnp.asarray(perm, jnp.int32)
    cache = jnp.dtype(heads.cache)

    def stored(x):
        return x if cache == jnp.bfloat16 else (x.astype(jnp.float32) / FP8_SCALE).astype(cache)

    if dense is None:
        keys = jax.random.split(jax.random.key(seed), 2)
        shape = (num_pages, page, heads.K, heads.H)
        k, v = (stored(jax.random.normal(key, shape, jnp.bfloat16)) for key in keys)
        return k, None if heads.hv else v, tables
    inverse = np.argsort(perm.reshape(-1))

    def pages(x):  # [B, S, K, H] -> pages in the tables' order
        x = jnp.pad(x, ((0, 0), (0, max_pages * page - x.shape[1]), (0, 0), (0, 0)))
        x = x.reshape(batch * max_pages, page, heads.K, heads.H)
        return stored(x[inverse])

    return pages(dense[0]), pages(dense[1]), tables


def visible_pairs(q_lens, lengths) -> int:
    """(query, key) pairs a batch's new tokens see: token i of q_len at L - q_len + i sees
    L - q_len + i + 1 keys."""
    return int(sum(q * (L - q) + q * (q + 1) // 2 for q, L in zip(q_lens, lengths, strict=True)))


def ragged_args(q_rows, q_lens, lengths, k_pages, v_pages, tables):
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return (q_rows, k_pages, v_pages, tables, starts, jnp.asarray(lengths, jnp.int32))


def ragged_fn(interpret, heads: Heads = GQA, **kwargs):
    return jax.jit(
        functools.partial(
            pallas_flash.ragged_paged_attention, interpret=interpret, **heads.kwargs(), **kwargs
        )
    )


def has_max_query_len() -> bool:
    """Whether the imported pallas_flash's ragged_paged_attention takes max_query_len."""
    return "max_query_len" in inspect.signature(pallas_flash.ragged_paged_attention).parameters


def parse_tiles(entry: str) -> tuple[int, int, int, int]:
    """A --prefill-tiles entry "BMxBKVxWxS": (block_m, block_kv, num_warps, num_stages)."""
    try:
        bm, bkv, warps, stages = (int(x) for x in entry.split("x"))
    except ValueError:
        raise ValueError(
            f"--prefill-tiles entry {entry!r} must be BMxBKVxWxS (block_m_prefill x "
            "block_kv_prefill x num_warps_prefill x num_stages_prefill), e.g. 128x64x4x2"
        ) from None
    return bm, bkv, warps, stages


def ragged_variants(calls, q_lens, interpret, heads: Heads = GQA, tiles=(), triton=False):
    """calls with "ragged_hint" (max_query_len) where the imported pallas_flash has it, with
    triton on a GPU "ragged_triton" (backend="triton": the Triton prefill launch where the
    default takes the Mosaic one on Hopper), and one call per prefill tile entry "BMxBKVxWxS"
    (`--prefill-tiles`), each on ragged's arguments with the call's default tiles but the
    prefill launch's."""
    _, args, to_rows = calls["ragged"]
    if has_max_query_len():
        hint = ragged_fn(interpret, heads, max_query_len=max(q_lens))
        calls["ragged_hint"] = (hint, args, to_rows)
    if triton and not interpret:
        calls["ragged_triton"] = (ragged_fn(interpret, heads, backend="triton"), args, to_rows)
    for entry in tiles:
        bm, bkv, warps, stages = parse_tiles(entry)
        q_rows, k_pages = args[0], args[1]
        default_tiles = pallas_flash.triton.ragged.ragged_block_sizes
        params = inspect.signature(default_tiles).parameters
        kwargs = {}
        if (heads.hv or heads.fp8) and "fmt" in params:  # where the tree knows formats
            from pallas_flash.triton.cache import CacheFormat

            fmt = CacheFormat(heads.H, heads.value_dim, shared=bool(heads.hv), scaled=heads.fp8)
            kwargs = dict(fmt=fmt, cache_dtype=k_pages.dtype)
        # An older tree counts the kernel's sequences (the batch's and two more).
        old = "num_seqs" in params
        device = pallas_flash.device.target_device()
        base = default_tiles(
            q_rows.shape,
            len(q_lens) + 2 * old,
            k_pages.shape[2],
            args[3].shape[1] * k_pages.shape[1],
            q_rows.dtype,
            interpret=interpret,
            page_size=k_pages.shape[1],
            num_sms=device.num_sms if device is not None else 132,
            **kwargs,
        )
        bs = dataclasses.replace(
            base,
            block_m_prefill=bm,
            block_kv_prefill=bkv,
            num_warps_prefill=warps,
            num_stages_prefill=stages,
        )
        calls[f"ragged_tiles_{entry}"] = (
            ragged_fn(interpret, heads, block_sizes=bs),
            args,
            to_rows,
        )
    return calls


def paged_fn(interpret, heads: Heads = GQA):
    return functools.partial(pallas_flash.paged_attention, interpret=interpret, **heads.kwargs())


def decode_goal(shapes, interpret, heads: Heads = GQA):
    """(name, {impl: (fn, args, to_rows)}, q_lens, lengths, heads) per shape: one new token per
    sequence, ragged against paged_attention (and, over float8 pages, against ragged over the
    same cache in bfloat16)."""
    for batch, seq, ragged, page in shapes:
        rng = np.random.default_rng(1)
        lengths = rng.integers(seq // 8, seq + 1, batch) if ragged else np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page, heads)
        q = jax.random.normal(jax.random.key(2), (batch, 1, heads.N, heads.H), jnp.bfloat16)
        lens = jnp.asarray(lengths, jnp.int32)
        q_lens = [1] * batch
        calls = {
            "ragged": (
                ragged_fn(interpret, heads),
                ragged_args(q[:, 0], q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
            "paged": (
                jax.jit(paged_fn(interpret, heads)),
                (q, k_pages, v_pages, tables, lens),
                lambda out: out[:, 0],
            ),
        }
        if heads.fp8:
            bf16 = dataclasses.replace(heads, cache="bfloat16")
            pages = paged_cache(lengths, page, bf16)
            calls["bf16"] = (
                ragged_fn(interpret, bf16),
                ragged_args(q[:, 0], q_lens, lengths, *pages),
                lambda out: out,
            )
        calls = ragged_variants(calls, q_lens, interpret, heads)
        name = f"decode B{batch} S{seq}{' ragged' if ragged else ''} page{page}{_tag(heads)}"
        yield name, calls, q_lens, lengths, heads


def _tag(heads: Heads) -> str:
    tag = f" N{heads.N}/K{heads.K} H{heads.H}" if heads != GQA else ""
    if heads.hv:
        tag += f" latent Hv{heads.hv}"
    return tag + (" fp8" if heads.fp8 else "")


def prefill_goal(shapes, interpret, tiles=()):
    for batch, seq, page in shapes:
        keys = jax.random.split(jax.random.key(3), 3)
        n, kh, h = GQA.N, GQA.K, GQA.H
        q = jax.random.normal(keys[0], (batch, seq, n, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, seq, kh, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, seq, kh, h), jnp.bfloat16)
        lengths = np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page, dense=(k, v))
        q_lens = [seq] * batch
        to_rows = functools.partial(jnp.reshape, shape=(-1, n, h))
        calls = {
            "ragged": (
                ragged_fn(interpret),
                ragged_args(q.reshape(-1, n, h), q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
        }
        calls = ragged_variants(calls, q_lens, interpret, GQA, tiles, triton=True)
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
        yield f"prefill B{batch} S{seq} page{page}", calls, q_lens, lengths, GQA


def mixed_goal(shapes, interpret, heads: Heads = GQA, padded: bool = True, tiles=()):
    for chunk, decodes, seq, page in shapes:
        batch = decodes + 1
        lengths = np.full(batch, seq)
        k_pages, v_pages, tables = paged_cache(lengths, page, heads)
        keys = jax.random.split(jax.random.key(4), 2)
        n, h = heads.N, heads.H
        q_chunk = jax.random.normal(keys[0], (1, chunk, n, h), jnp.bfloat16)
        q_dec = jax.random.normal(keys[1], (decodes, 1, n, h), jnp.bfloat16)
        lens = jnp.asarray(lengths, jnp.int32)
        q_lens = [chunk] + [1] * decodes
        q_rows = jnp.concatenate([q_chunk[0], q_dec[:, 0]])
        paged = paged_fn(interpret, heads)
        both = (q_chunk, q_dec, k_pages, v_pages, tables, lens)
        calls = {
            "ragged": (
                ragged_fn(interpret, heads),
                ragged_args(q_rows, q_lens, lengths, k_pages, v_pages, tables),
                lambda out: out,
            ),
            "split": (
                jax.jit(functools.partial(_split, paged)),
                both,
                lambda out: jnp.concatenate([out[0][0], out[1][:, 0]]),
            ),
        }
        if padded:
            calls["padded"] = (
                jax.jit(functools.partial(_padded, paged)),
                both,
                lambda out: jnp.concatenate([out[0], out[1:, -1]]),
            )
        if heads.fp8:
            bf16 = dataclasses.replace(heads, cache="bfloat16")
            pages = paged_cache(lengths, page, bf16)
            calls["bf16"] = (
                ragged_fn(interpret, bf16),
                ragged_args(q_rows, q_lens, lengths, *pages),
                lambda out: out,
            )
        calls = ragged_variants(calls, q_lens, interpret, heads, tiles, triton=True)
        name = f"mixed {chunk} + {decodes} x 1 over S{seq} page{page}{_tag(heads)}"
        yield name, calls, q_lens, lengths, heads


def _split(paged, q_chunk, q_dec, kp, vp, t, lens):
    """One paged call per kind: the chunk's, then the decode tokens'."""
    first = paged(q_chunk, kp, vp, t[:1], lens[:1])
    return first, paged(q_dec, kp, vp, t[1:], lens[1:])


def _padded(paged, q_chunk, q_dec, kp, vp, t, lens):
    """One paged call of every sequence padded to the chunk's T: a decode token is its
    sequence's last."""
    decodes, chunk = q_dec.shape[0], q_chunk.shape[1]
    q_pad = jnp.zeros((decodes, chunk, *q_dec.shape[2:]), q_dec.dtype).at[:, -1].set(q_dec[:, 0])
    return paged(jnp.concatenate([q_chunk, q_pad]), kp, vp, t, lens)


MLA = Heads(N=128, K=1, H=576, hv=512)


def mla_goal(shapes, interpret, tiles=()):
    """The decode batches over MLA's latent pages at 128 and 16 query heads, and a mixed batch
    at 128 (no padded call: T=2048 over 64 sequences and 128 heads is ~68 GiB of logits in
    the reference's way, and the kernel's padded rows cost what the point makes anyway)."""
    decode, mixed = shapes
    for n in (128, 16):
        yield from decode_goal(decode, interpret, dataclasses.replace(MLA, N=n))
    yield from mixed_goal(mixed, interpret, MLA, padded=False, tiles=tiles)


def fp8_goal(shapes, interpret, tiles=()):
    decode, mixed = shapes
    heads = dataclasses.replace(GQA, cache="float8_e4m3fn")
    yield from decode_goal(decode, interpret, heads)
    yield from mixed_goal(mixed, interpret, heads, padded=False, tiles=tiles)


def _shapes(on_gpu: bool) -> dict:
    if on_gpu:
        return {
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
            "mla": ([(64, 4096, False, 64), (64, 4096, True, 64)], [(512, 63, 4096, 64)]),
            "fp8": ([(64, 4096, False, 16), (8, 32768, False, 16)], [(2048, 63, 4096, 16)]),
        }
    return {
        "decode": [(3, 64, True, 16)],
        "prefill": [(2, 40, 16)],
        "mixed": [(24, 3, 64, 16)],
        "mla": ([(2, 64, True, 16)], [(8, 2, 48, 16)]),
        "fp8": ([(3, 64, True, 16)], [(24, 3, 64, 16)]),
    }


def run(args, *, on_gpu: bool) -> list[dict]:
    """Every group's rows (`--out` gets each as a line of JSON as it comes), then a table of
    the others' kernel time over ragged's (> 1: ragged faster) with the goals; with --before
    TREE, TREE's run first (`run_before`) and each call's time before and after."""
    before, label = getattr(args, "before", None), getattr(args, "label", None)
    tiles = getattr(args, "prefill_tiles", None) or ()
    for entry in tiles:
        parse_tiles(entry)
    run_id = getattr(args, "run", None) or time.strftime("%Y%m%d-%H%M%S")
    if before is not None:
        run_before(args, before, run_id)
        label = "after"
    if not on_gpu:
        print("No GPU: tiny shapes in the interpreter (times mean nothing).", flush=True)
    where = os.path.dirname(pallas_flash.__file__)
    print(f"pallas_flash from {where}" + (f" ({label})" if label else ""), flush=True)
    shapes = _shapes(on_gpu)
    interpret, repeats = not on_gpu, args.repeats if on_gpu else 1
    makers = dict(
        decode=decode_goal,
        prefill=functools.partial(prefill_goal, tiles=tiles),
        mixed=functools.partial(mixed_goal, tiles=tiles),
        mla=functools.partial(mla_goal, tiles=tiles),
        fp8=functools.partial(fp8_goal, tiles=tiles),
    )
    rows = Rows(args.out)
    key = "kernel_ms" if on_gpu else "ms"
    for goal in [g for g in CASES if g in (args.cases or CASES)]:
        for name, calls, q_lens, lengths, heads in makers[goal](shapes[goal], interpret):
            kv_bytes = heads.kv_bytes(lengths)
            flops = 2.0 * (heads.H + heads.value_dim) * heads.N * visible_pairs(q_lens, lengths)
            measured, outs = {}, {}
            for impl, (fn, args_, to_rows) in calls.items():
                row = dict(suite="ragged", goal=goal, case=name, impl=impl)
                if label is not None:
                    row.update(label=label, run=run_id)
                if impl == "ragged_hint":
                    row["max_query_len"] = max(q_lens)
                try:
                    ms = median_ms(fn, args_, calls=10 if on_gpu else 1, repeats=repeats)
                    row.update(ms=round(ms, 5))
                    if on_gpu:
                        kernel_ms, kernels = device_ms(fn, args_)
                        row.update(
                            kernel_ms=round(kernel_ms, 5),
                            kernels={k: round(t, 5) for k, t in kernels.items()},
                        )
                    timing = row.get("kernel_ms", ms)
                    row.update(
                        tbps=round(kv_bytes / timing / 1e9, 3),
                        tflops=round(flops / timing / 1e9, 1),
                    )
                    outs[impl] = to_rows(fn(*args_)).astype(jnp.float32)
                except Exception as e:  # noqa: BLE001 -- a failing comparator is data
                    row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                measured[impl] = row
            for impl, row in measured.items():
                if impl in outs and "ragged" in outs:
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(outs[impl] - outs["ragged"])))
                row.update(ratios_over_ragged(measured, impl, key))
                row.update(kv_bytes=kv_bytes, flops=flops)
                rows.add(row)
                shown = "failed: " + row["error"][:80] if row.get("ms") is None else ""
                if not shown:
                    shown = f"{row[key]:.4f} ms {row['tbps']:.2f} TB/s {row['tflops']:.1f} TFLOP/s"
                progress(f"{name:52s} {impl:24s} {shown}")
    print_ragged_table(rows)
    if before is not None:
        print_before_after(read_rows(args.out, run_id))
    return rows


def ratios_over_ragged(measured: dict, impl: str, key: str) -> dict:
    """A comparator's (an impl not named ragged*) time over each ragged call's, as fields:
    `ratios` {ragged call: ratio}, `ratio` over ragged's and `ratio_hint` over ragged_hint's
    (> 1: that ragged call is faster); none for the ragged calls or a failed measurement."""
    row = measured[impl]
    if impl.startswith("ragged") or not row.get(key):
        return {}
    bases = {b: r[key] for b, r in measured.items() if b.startswith("ragged") and r.get(key)}
    ratios = {b: round(row[key] / t, 3) for b, t in bases.items()}
    fields = dict(ratios=ratios)
    for base, field in (("ragged", "ratio"), ("ragged_hint", "ratio_hint")):
        if base in ratios:
            fields[field] = ratios[base]
    return fields


def run_before(args, tree: str, run_id: str) -> None:
    """--before TREE: this module's run in a child process whose pallas_flash is TREE's (TREE
    first on its PYTHONPATH; `python -P`, so neither this tree nor the working directory comes
    first), its rows labelled "before" and `run_id` appended to --out."""
    if not args.out:
        raise SystemExit("--before needs --out: the rows before and after are compared from it")
    if not os.path.isdir(os.path.join(tree, "pallas_flash")):
        raise SystemExit(f"--before {tree}: {tree}/pallas_flash is not a directory")
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--out", args.out]
    cmd += ["--label", "before", "--run", run_id, "--repeats", str(args.repeats)]
    if args.cases:
        cmd += ["--cases", *args.cases]
    tiles = getattr(args, "prefill_tiles", None)
    if tiles:
        cmd += ["--prefill-tiles", *tiles]
    path = [os.path.abspath(tree), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    subprocess.run(cmd, env=env, check=True)


def read_rows(path: str, run_id: str) -> list[dict]:
    """The rows of run `run_id` in the JSONL file at `path`."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("run") == run_id]


def print_before_after(rows, out=None):
    """Each call's kernel time (wall time where there is none) before and after, and after's
    over before's, from a --before run's rows (labels "before" and "after")."""
    times = {}
    for r in rows:
        times[(r["goal"], r["case"], r["impl"], r.get("label"))] = r.get("kernel_ms") or r.get("ms")
    calls = list(dict.fromkeys(call[:3] for call in times))
    lines = []
    for goal, case, impl in calls:
        before, after = (
            times.get((goal, case, impl, "before")),
            times.get((goal, case, impl, "after")),
        )
        change = f"{after / before:.3f}" if before and after else None
        lines.append([goal, case, impl, before, after, change])
    header = ["goal", "case", "impl", "before ms", "after ms", "after / before"]
    print_markdown(header, lines, title="before -> after (--before):", out=out)


def print_ragged_table(rows, out=None):
    """Each call's time (kernel time where measured), TB/s, TFLOP/s, and its time over ragged's
    and over ragged_hint's (> 1: ragged faster). Goals: decode ragged >= 0.9 x paged (ratio >=
    0.9), prefill >= 0.9 x flash (ratio >= 0.9), mixed faster than padded and split (ratios >
    1)."""
    kernel = any(r.get("kernel_ms") is not None for r in rows)
    key = "kernel_ms" if kernel else "ms"
    lines = []
    for r in rows:
        time = r.get(key)
        lines.append(
            [
                r["goal"],
                r["case"],
                r["impl"],
                None if time is None else f"{time:.4f}",
                None if time is None else f"{r['tbps']:.2f}",
                None if time is None else f"{r['tflops']:.1f}",
                None if "ratio" not in r else f"{r['ratio']:.3f}",
                None if "ratio_hint" not in r else f"{r['ratio_hint']:.3f}",
                None if "max_abs_diff" not in r else f"{r['max_abs_diff']:.2g}",
            ]
        )
    title = (
        f"ragged_paged_attention and its comparators, {'kernel' if kernel else 'wall'} time "
        "(other / ragged > 1: ragged faster; goals: decode paged >= 0.9, prefill flash >= 0.9, "
        "mixed > 1):"
    )
    header = ["goal", "case", "impl", "ms", "TB/s", "TFLOP/s", "other / ragged", "other / hint"]
    header.append("max |diff|")
    print_markdown(header, lines, title=title, out=out)


def main(argv=None) -> list[dict]:
    """--before's child process (`run_before`): the suite on the pallas_flash first on the
    path, with the flags `run_before` passes."""
    parser = argparse.ArgumentParser(prog="pallas_flash/bench/ragged.py", allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--cases", nargs="+", choices=CASES)
    parser.add_argument("--prefill-tiles", nargs="+")
    args = parser.parse_args(argv)
    on_gpu = (pallas_flash.device.gpu_compute_capability() or (0, 0)) >= (8, 0)
    return run(args, on_gpu=on_gpu)


if __name__ == "__main__":
    main()
