"""`--suite decode`: decode_attention and paged_attention in TB/s of K/V read, beside
flash_attention on the same arrays, jax.nn's XLA and cuDNN attention and a device-to-device copy
of the same bytes; on a CPU tiny interpreted shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench.timing import (
    Rows,
    device_ms,
    median_ms,
    print_markdown,
    progress,
    recording_failure,
    tbps,
)

HELP = (
    "decode: decode_attention / paged_attention in TB/s of K/V read beside flash_attention on "
    "the same arrays (tiny interpreted shapes on a CPU)"
)
FLAGS = ("--repeats", "--quick")
FLAGS_ON_CPU = ("--repeats",)


def decode_cases(quick: bool = False):
    """The decode suite's shapes: dicts of B, S (cache capacity), N, K, H, T, ragged (lengths
    between S/32 and S, else all S) and page (page size, or None for a contiguous cache). The
    headline shape first (B=8, 32k keys, N=32 over K=8, H=128, one token), then one axis varied
    at a time."""
    base = dict(B=8, S=32768, N=32, K=8, H=128, T=1, ragged=False, page=None)
    variants = [
        {},
        dict(T=4),
        dict(T=16),
        dict(page=16),
        dict(page=128),
        dict(ragged=True),
    ]
    if not quick:
        variants += [
            dict(B=1),
            dict(B=64, S=8192),
            dict(B=256, S=8192),
            dict(S=1024),
            dict(S=8192),
            dict(S=131072),
            dict(K=32),  # GQA group 1
            dict(K=2),  # GQA group 16
            dict(K=2, T=16),
            dict(ragged=True, page=16),
        ]
    for v in variants:
        yield {**base, **v}


def _decode_lengths(case, seed=0):
    if not case["ragged"]:
        return jnp.full((case["B"],), case["S"], jnp.int32)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(case["S"] // 32, case["S"] + 1, case["B"]), jnp.int32)


def decode_inputs(case, dtype, seed=0):
    """(q, k, v, lengths, block_tables): contiguous caches, or with case["page"] pages in
    shuffled order (block_tables None for a contiguous cache)."""
    b, s, n, kh, h, t = (case[x] for x in ("B", "S", "N", "K", "H", "T"))
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    lengths = _decode_lengths(case, seed)
    page = case["page"]
    if page is None:
        shape = (b, s, kh, h)
        tables = None
    else:
        max_pages = s // page
        shape = (b * max_pages, page, kh, h)
        perm = np.random.default_rng(seed).permutation(b * max_pages)
        tables = jnp.asarray(perm.reshape(b, max_pages), jnp.int32)
    k = jax.random.normal(keys[1], shape, dtype)
    v = jax.random.normal(keys[2], shape, dtype)
    return q, k, v, lengths, tables


def flash_attention_decode(q, k, v, lengths, **kwargs):
    """`pallas_flash.flash_attention` on decode's arrays: T new tokens per sequence over a
    contiguous (B, S, K, H) cache of `lengths` keys each. Decode puts token t at position
    L - T + t, causal among the new tokens; flash_attention's is_causal is top-left aligned,
    so the call takes key_value_seq_lengths and, for T > 1, the window (S, S - T): token t sees
    keys up to S - T + t. Exactly decode's attention where every length is S (every T > 1 case
    of the GPU suite); with shorter lengths a token also sees the new tokens after it, the
    same K/V bytes read."""
    t, s = q.shape[1], k.shape[1]
    window = None if t == 1 else (s, s - t)
    return pallas_flash.flash_attention(
        q, k, v, key_value_seq_lengths=lengths, local_window_size=window, **kwargs
    )


def decode_fns(case, *, interpret: bool):
    """{impl: jitted fn(q, k, v, lengths, tables) -> out} for one case: "pallas_flash"
    (decode_attention, or paged_attention over pages), and over a contiguous cache
    "flash_attention" (`flash_attention_decode`) and jax.nn's attention (XLA, cuDNN), with the
    causal rule among the new tokens as a mask aligned to the end of each sequence."""
    if case["page"] is not None:
        fns = {
            "pallas_flash": lambda q, k, v, lens, tables: pallas_flash.paged_attention(
                q, k, v, tables, lens, interpret=interpret
            )
        }
    else:
        fns = {
            "pallas_flash": lambda q, k, v, lens, tables: pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=lens, interpret=interpret
            ),
            "flash_attention": lambda q, k, v, lens, tables: flash_attention_decode(
                q, k, v, lens, interpret=interpret
            ),
        }

        def jax_nn(impl):
            def fn(q, k, v, lens, tables):
                t, s = q.shape[1], k.shape[1]
                if t == 1:
                    return jax.nn.dot_product_attention(
                        q, k, v, key_value_seq_lengths=lens, implementation=impl
                    )
                pos = lens[:, None, None] - t + jnp.arange(t)[None, :, None]
                mask = (jnp.arange(s)[None, None, :] <= pos)[:, None]
                return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)

            return fn

        fns["xla"] = jax_nn("xla")
        if not interpret:
            fns["cudnn"] = jax_nn("cudnn")
    return {impl: jax.jit(fn) for impl, fn in fns.items()}


def decode_kv_bytes(case, lengths, itemsize: int) -> int:
    """Bytes of K and V a decode step must read: each sequence's own keys."""
    keys = int(np.minimum(np.asarray(lengths), case["S"]).sum())
    return 2 * keys * case["K"] * case["H"] * itemsize


def run(args, *, on_gpu: bool) -> list[dict]:
    """Per case: ms and TB/s of K/V bytes read for pallas_flash, flash_attention, jax.nn's XLA
    and cuDNN attention, and a device-to-device copy of the same bytes (its TB/s counts the
    bytes read and written: the practical ceiling of a read-only kernel)."""
    repeats = args.repeats
    if on_gpu:
        cases, dtype, interpret, calls = list(decode_cases(args.quick)), jnp.bfloat16, False, 10
    else:
        print(
            "No NVIDIA GPU of compute capability >= 8.0 found: running tiny decode shapes in the "
            "Pallas interpreter (times are not GPU performance).",
            flush=True,
        )
        cases = [
            dict(B=2, S=256, N=8, K=2, H=64, T=t, ragged=r, page=p)
            for t, r, p in ((1, False, None), (4, True, None), (1, True, 16))
        ]
        dtype, interpret, calls, repeats = jnp.float32, True, 1, min(repeats, 2)
    rows = Rows(args.out)
    for case in cases:
        q, k, v, lengths, tables = decode_inputs(case, dtype)
        nbytes = decode_kv_bytes(case, lengths, jnp.dtype(dtype).itemsize)
        flat = jnp.zeros((nbytes // 2,), jnp.bfloat16)
        runs = [
            (impl, fn, (q, k, v, lengths, tables))
            for impl, fn in decode_fns(case, interpret=interpret).items()
        ]
        runs.append(("memcpy", jax.jit(jnp.copy), (flat,)))
        for impl, fn, inputs in runs:
            row = dict(suite="decode", impl=impl, dtype=jnp.dtype(dtype).name, **case)
            traffic = 2 * nbytes if impl == "memcpy" else nbytes
            row.update(_decode_timing(fn, inputs, traffic, calls, repeats, on_gpu))
            row["kv_bytes"] = nbytes
            rows.add(row)
            shown = (
                f"{row['ms']:.4f} ms {row['tbps']:.2f} TB/s"
                if row["ms"] is not None
                else "failed: " + row["error"][:80]
            )
            if row.get("device_ms") is not None:
                shown += f", kernels {row['device_ms']:.4f} ms {row['device_tbps']:.2f} TB/s"
            progress(f"{_decode_name(case):34s} {impl:15s} {shown}")
        del q, k, v, flat
    print_decode_table(rows)
    return rows


def _decode_timing(fn, inputs, traffic, calls, repeats, on_gpu) -> dict:
    """ms and tbps of fn moving `traffic` bytes; on a GPU also its kernels' time (device_ms,
    device_tbps, kernels)."""
    got = {}
    with recording_failure(got, "ms", "tbps"):  # cuDNN refusing T=1 is data
        ms = median_ms(fn, inputs, calls=calls, repeats=repeats)
        got.update(ms=round(ms, 5), tbps=round(tbps(traffic, ms), 4))
        if on_gpu:
            kernel_ms, kernels = device_ms(fn, inputs)
            got.update(
                device_ms=round(kernel_ms, 5),
                device_tbps=round(tbps(traffic, kernel_ms), 4),
                kernels={name: round(t, 5) for name, t in kernels.items()},
            )
    return got


def _decode_name(case) -> str:
    name = f"B{case['B']} S{case['S']} N{case['N']}/K{case['K']} H{case['H']} T{case['T']}"
    if case["ragged"]:
        name += " ragged"
    if case["page"]:
        name += f" page{case['page']}"
    return name


def print_decode_table(rows, out=None):
    """One table of each call's wall time (`ms`, host dispatch included) and, where measured,
    one of its kernels' time (`device_ms`), each cell "ms (TB/s of K/V read)"; pallas_flash is
    decode_attention (paged_attention over pages), flash_attention the same arrays through
    `flash_attention_decode`. The last columns: flash_attention's speed over pallas_flash's,
    and pallas_flash's TB/s over a copy's."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by_case = {}
    for r in rows:
        by_case.setdefault(_decode_name(r), {})[r["impl"]] = r
    for key, title in (("ms", "wall time per call"), ("device_ms", "kernel time per call")):
        if not any(r.get(key) is not None for r in rows):
            continue
        rate = "tbps" if key == "ms" else "device_tbps"
        lines = []
        for name, got in by_case.items():
            timed = [got.get(i, {}) for i in impls]
            cells = [None if r.get(key) is None else f"{r[key]:.3f} ({r[rate]:.2f})" for r in timed]
            pf, fa, mc = (
                got.get(i, {}).get(key) for i in ("pallas_flash", "flash_attention", "memcpy")
            )
            cells.append(f"{pf / fa:.2f}" if pf and fa else None)
            # pf's TB/s over memcpy's (which counts bytes read and written)
            cells.append(f"{mc / (2 * pf):.2f}" if pf and mc else None)
            lines.append([name, *cells])
        header = ["case", *(f"{i} ms (TB/s)" for i in impls), "flash_attention / pf speed"]
        header.append("pf / memcpy")
        print_markdown(header, lines, title=f"{title}, ms (TB/s of K/V read):", out=out)
