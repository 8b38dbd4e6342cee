"""`--suite decode`: decode_attention and paged_attention in TB/s of K/V read, beside
flash_attention on the same arrays, jax.nn's XLA and cuDNN attention, a device-to-device copy
and a read (XLA's sum) of the same bytes; on a CPU tiny interpreted shapes.

Case groups (`--cases`, default all): "gqa" (GQA decode at H=128: the headline shape and one
axis varied at a time), "mla" (multi-head latent attention over one latent cache of 576 = 512 +
64 columns: memory-bound at 16 or 32 heads a device, compute-bound at 128), "fp8" (each shape
over a float8_e4m3fn cache beside the same cache in bfloat16) and "speculative" (T = 4, 8, 16
new tokens over 4, 8 or 16 query heads per KV head). `--decode-tiles BMxBKVxWxS[xSPLITS] ...`
adds a "pallas_flash_BMxBKVxWxS[xSPLITS]" row per entry to each float8 or latent cache's case
(in place of its alternative-tiles row): one run compares candidate tiles on the same arrays
and ceilings. Each pallas_flash row also has its
TFLOP/s (2 (H + Hv) FLOPs per query head and visible key) and its ratios to the ceilings
measured in the same run: the read of its bytes (a plain reduction over an array of the
cache's size: the practical read ceiling) and a bfloat16 matmul (8192^3 through XLA)."""

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
    "the same arrays, and against the read and matmul ceilings (--cases gqa mla fp8 "
    "speculative; tiny interpreted shapes on a CPU)"
)
FLAGS = ("--repeats", "--quick", "--cases", "--decode-tiles")
FLAGS_ON_CPU = ("--repeats", "--cases", "--decode-tiles")
CASES = ("gqa", "mla", "fp8", "speculative")


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


def mla_cases(quick: bool = False):
    """Multi-head latent attention (DeepSeek-V2/V3 decode, FlashMLA's shapes): one latent KV
    head of H=576 whose first Hv=512 columns are the values, pages of 64. 128 query heads (one
    device) make a decode step compute-bound (~240 FLOPs a cache byte); 16 or 32 (tensor
    parallel over 8 or 4 devices) memory-bound."""
    base = dict(B=64, S=4096, N=128, K=1, H=576, T=1, ragged=False, page=64, hv=512)
    variants = [{}, dict(T=2), dict(N=16), dict(N=16, B=8, S=32768)]
    if not quick:
        variants += [
            dict(B=128, S=8192),
            dict(N=32),
            dict(N=16, B=1, S=65536),
            dict(N=16, ragged=True),
            dict(page=None),
            dict(cache="float8_e4m3fn"),
            dict(N=16, cache="float8_e4m3fn"),
        ]
    for v in variants:
        yield {**base, **v, "group": "mla"}


def fp8_cases(quick: bool = False):
    """GQA decode shapes over a float8_e4m3fn cache (per-head scales), each after the same
    cache in the queries' dtype (cache None: bfloat16 on a GPU)."""
    base = dict(B=8, S=32768, N=32, K=8, H=128, T=1, ragged=False, page=None)
    variants = [{}, dict(page=16)]
    if not quick:
        variants += [dict(T=4), dict(B=64, S=8192), dict(ragged=True), dict(B=1), dict(page=128)]
    for v in variants:
        for cache in (None, "float8_e4m3fn"):
            yield {**base, **v, "cache": cache, "group": "fp8"}


def speculative_cases(quick: bool = False):
    """T = 4, 8, 16 draft tokens verified in one step over 4, 8 or 16 query heads per KV head
    (N=32, H=128, bfloat16): 16 to 256 packed rows, compute-bound from about 64."""
    sizes = [(8, 32768), (64, 4096)] if not quick else [(8, 32768)]
    shapes = [(t, g) for t in (4, 8, 16) for g in (4, 8, 16)]
    if quick:
        shapes = [(4, 4), (16, 16)]
    for b, s in sizes:
        for t, g in shapes:
            yield dict(
                B=b, S=s, N=32, K=32 // g, H=128, T=t, ragged=False, page=None, group="speculative"
            )


def suite_cases(groups, quick: bool = False):
    """The cases of the named groups, in `CASES` order."""
    makers = dict(gqa=decode_cases, mla=mla_cases, fp8=fp8_cases, speculative=speculative_cases)
    for group in CASES:
        if group in groups:
            yield from ({**case, "group": group} for case in makers[group](quick))


def _decode_lengths(case, seed=0):
    if not case["ragged"]:
        return jnp.full((case["B"],), case["S"], jnp.int32)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(case["S"] // 32, case["S"] + 1, case["B"]), jnp.int32)


def decode_inputs(case, dtype, seed=0):
    """(q, k, v, lengths, block_tables): contiguous caches, or with case["page"] pages in
    shuffled order (block_tables None for a contiguous cache); v None for a latent cache
    (case["hv"]); a float8 cache (case["cache"]) holds the normal values over 0.05 per head."""
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
    cache = jnp.dtype(case.get("cache") or dtype)  # None: the queries' dtype

    def stored(key):
        x = jax.random.normal(key, shape, dtype)
        return x if cache == dtype else (x / FP8_SCALE).astype(cache)

    k = stored(keys[1])
    v = None if case.get("hv") else stored(keys[2])
    return q, k, v, lengths, tables


# A float8 cache's scale in the decode suite (normal values over it span e4m3's range).
FP8_SCALE = 0.05


def cache_kwargs(case) -> dict:
    """The decode calls' cache-format arguments of a case: a latent cache's value_head_dim, a
    float8 cache's scales (per KV head)."""
    kwargs = {}
    if case.get("hv"):
        kwargs["value_head_dim"] = case["hv"]
    if case.get("cache") and jnp.dtype(case["cache"]).itemsize == 1:
        scale = jnp.full((case["K"],), FP8_SCALE, jnp.float32)
        kwargs["k_scale"] = scale
        if not case.get("hv"):
            kwargs["v_scale"] = scale
    return kwargs


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


def parse_decode_tiles(entry: str) -> pallas_flash.DecodeBlockSizes:
    """A --decode-tiles entry "BMxBKVxWxS" or "BMxBKVxWxSxSPLITS": DecodeBlockSizes(block_m,
    block_kv, num_warps, num_stages[, kv_splits]), the other fields the defaults' (block_m is
    clamped to a call's packed rows; kv_splits 0 or left out: the split rule's count)."""
    names = ("block_m", "block_kv", "num_warps", "num_stages", "kv_splits")
    try:
        fields = [int(x) for x in entry.split("x")]
        if len(fields) not in (4, 5):
            raise ValueError("4 or 5 fields")
        return pallas_flash.DecodeBlockSizes(**dict(zip(names, fields, strict=False)))
    except ValueError as error:
        raise ValueError(
            f"--decode-tiles entry {entry!r} must be BMxBKVxWxS or BMxBKVxWxSxSPLITS (block_m x "
            f"block_kv x num_warps x num_stages [x kv_splits]), e.g. 16x64x4x4: {error}"
        ) from None


def decode_fns(case, *, interpret: bool, tiles=()):
    """{impl: jitted fn(q, k, v, lengths, tables) -> out} for one case: "pallas_flash"
    (decode_attention, or paged_attention over pages), and over a contiguous cache
    "flash_attention" (`flash_attention_decode`) and jax.nn's attention (XLA, cuDNN), with the
    causal rule among the new tokens as a mask aligned to the end of each sequence. A latent
    or float8 cache (which jax.nn's attention does not take): "pallas_flash" and "xla", its
    reference (backend="xla": dequantises, materialises the logits), and per `tiles` entry
    (--decode-tiles) "pallas_flash_<entry>" with those tiles."""
    if case.get("hv") or case.get("cache"):  # a latent or float8 cache
        return _format_fns(case, interpret=interpret, tiles=tiles)
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


def _format_fns(case, *, interpret: bool, tiles=()):
    kwargs = cache_kwargs(case)

    def call(**backend):
        def fn(q, k, v, lens, tables):
            if tables is None:
                return pallas_flash.decode_attention(
                    q, k, v, key_value_seq_lengths=lens, **kwargs, **backend
                )
            return pallas_flash.paged_attention(q, k, v, tables, lens, **kwargs, **backend)

        return jax.jit(fn)

    fns = {"pallas_flash": call(interpret=interpret), "xla": call(backend="xla")}
    alternative = alternative_tiles(case)
    if tiles:
        for entry in tiles:
            block_sizes = parse_decode_tiles(entry)
            fns[f"pallas_flash_{entry}"] = call(block_sizes=block_sizes, interpret=interpret)
    elif alternative is not None and not interpret:
        fns["pallas_flash_alt"] = call(block_sizes=alternative)
    return fns


def alternative_tiles(case) -> pallas_flash.DecodeBlockSizes | None:
    """Tiles beside the defaults (`pallas_flash_alt` rows): over a latent cache from 64 packed
    rows the tiles of the other key width (32 keys for a bfloat16 cache, 64 for float8, which
    may not fit), 32-key tiles in 8 warps for fewer rows; a float8 cache's tiles in the
    bfloat16 defaults' 2 stages (not doubled)."""
    rows = case["T"] * case["N"] // case["K"]
    if case.get("hv"):
        if rows >= 64:
            block_kv = 64 if case.get("cache") else 32
            return pallas_flash.DecodeBlockSizes(block_m=64, block_kv=block_kv, num_warps=8)
        return pallas_flash.DecodeBlockSizes(block_m=64, block_kv=32, num_warps=8)
    if case.get("cache"):
        return pallas_flash.DecodeBlockSizes(block_kv=128 if case["page"] == 128 else 64)
    return None


def decode_kv_bytes(case, lengths, itemsize: int) -> int:
    """Bytes of K and V a decode step must read: each sequence's own keys (a latent cache's
    one row of H columns for both; itemsize: the cache's)."""
    keys = int(np.minimum(np.asarray(lengths), case["S"]).sum())
    columns = case["H"] if case.get("hv") else 2 * case["H"]
    return keys * case["K"] * columns * itemsize


def decode_flops(case, lengths) -> float:
    """FLOPs of a decode step: 2 (H + Hv) per query head and visible (token, key) pair (QK and
    PV), token t of T at position L - T + t seeing L - T + t + 1 keys."""
    t = case["T"]
    lens = np.minimum(np.asarray(lengths, np.int64), case["S"])
    pairs = np.maximum(lens[:, None] - t + np.arange(t)[None, :] + 1, 0).sum()
    hv = case.get("hv") or case["H"]
    return 2.0 * (case["H"] + hv) * case["N"] * float(pairs)


def matmul_ceiling(dtype, *, on_gpu: bool, repeats: int) -> dict:
    """The run's matmul ceiling: an n x n x n matmul through XLA (n = 8192 in bfloat16 on a
    GPU; 256 on a CPU), as a row (impl "matmul") with its TFLOP/s, in kernel time on a GPU."""
    n = 8192 if on_gpu else 256
    a = jnp.ones((n, n), dtype)
    fn = jax.jit(jnp.matmul)
    flops = 2.0 * n**3
    row = dict(suite="decode", group="ceiling", impl="matmul", dtype=jnp.dtype(dtype).name, n=n)
    with recording_failure(row, "ms", "tflops"):  # a failed ceiling is data
        ms = median_ms(fn, (a, a), calls=10 if on_gpu else 1, repeats=repeats)
        row.update(ms=round(ms, 5), tflops=round(flops / ms / 1e9, 2))
        if on_gpu:
            kernel_ms, _ = device_ms(fn, (a, a))
            row.update(
                device_ms=round(kernel_ms, 5), device_tflops=round(flops / kernel_ms / 1e9, 2)
            )
    return row


def run(args, *, on_gpu: bool) -> list[dict]:
    """Per case: ms and TB/s of K/V bytes read for pallas_flash, flash_attention, jax.nn's XLA
    and cuDNN attention (a latent or float8 cache: pallas_flash and its XLA reference), a
    device-to-device copy of the same bytes (its TB/s counts the bytes read and written) and a
    read of them (XLA's sum: the practical ceiling of a read-only kernel); pallas_flash's rows
    also their TFLOP/s and their shares of the read and of the run's matmul ceiling."""
    repeats = args.repeats
    groups = args.cases or CASES
    tiles = getattr(args, "decode_tiles", None) or ()
    for entry in tiles:  # a bad entry fails before anything is timed
        parse_decode_tiles(entry)
    if on_gpu:
        cases, dtype, interpret, calls = (
            list(suite_cases(groups, args.quick)),
            jnp.bfloat16,
            False,
            10,
        )
    else:
        print(
            "No NVIDIA GPU of compute capability >= 8.0 found: running tiny decode shapes in the "
            "Pallas interpreter (times are not GPU performance).",
            flush=True,
        )
        cases = [c for c in _cpu_cases() if c["group"] in groups]
        dtype, interpret, calls, repeats = jnp.float32, True, 1, min(repeats, 2)
    rows = Rows(args.out)
    ceiling = rows.add(matmul_ceiling(dtype, on_gpu=on_gpu, repeats=repeats))
    progress(f"{'matmul ceiling':34s} {'matmul':15s} {_shown(ceiling, 'tflops')}")
    for case in cases:
        q, k, v, lengths, tables = decode_inputs(case, dtype)
        nbytes = decode_kv_bytes(case, lengths, jnp.dtype(k.dtype).itemsize)
        flops = decode_flops(case, lengths)
        flat = jnp.zeros((nbytes // 2,), jnp.bfloat16)
        fns = decode_fns(case, interpret=interpret, tiles=tiles)
        runs = [(impl, fn, (q, k, v, lengths, tables)) for impl, fn in fns.items()]
        runs.append(("memcpy", jax.jit(jnp.copy), (flat,)))
        runs.append(("read", jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), (flat,)))
        case_rows = []
        for impl, fn, inputs in runs:
            row = dict(suite="decode", impl=impl, dtype=jnp.dtype(dtype).name, **case)
            traffic = 2 * nbytes if impl == "memcpy" else nbytes
            row.update(_decode_timing(fn, inputs, traffic, calls, repeats, on_gpu))
            row["kv_bytes"] = nbytes
            if impl not in ("memcpy", "read"):
                row["flops"] = flops
            case_rows.append(row)
        _add_ceilings(case_rows, ceiling)
        for row in case_rows:
            rows.add(row)
            shown = _shown(row, "tbps")
            if row.get("device_ms") is not None:
                shown += f", kernels {row['device_ms']:.4f} ms {row['device_tbps']:.2f} TB/s"
            if "of_roofline" in row:
                shown += f", {row['of_roofline']:.2f} of the roofline ({row['bound']}-bound)"
            progress(f"{_decode_name(case):34s} {row['impl']:15s} {shown}")
        del q, k, v, flat
    print_decode_table([r for r in rows if r["impl"] != "matmul"])
    print_ceiling_table(rows)
    return rows


def _cpu_cases():
    """The CPU demo's tiny shapes, one group at a time."""
    small = dict(B=2, S=256, N=8, K=2, H=64, ragged=False, page=None, group="gqa")
    yield from (
        dict(small, T=t, ragged=r, page=p) for t, r, p in ((1, False, None), (4, True, None))
    )
    yield dict(small, T=1, ragged=True, page=16)
    yield dict(B=1, S=64, N=16, K=1, H=576, T=1, ragged=False, page=16, hv=512, group="mla")
    for cache in (None, "float8_e4m3fn"):
        yield dict(small, T=1, page=16, cache=cache, group="fp8")
    yield dict(small, T=4, N=16, K=1, group="speculative")


def _shown(row, rate: str) -> str:
    if row.get("ms") is None:
        return "failed: " + row.get("error", "")[:80]
    unit = "TFLOP/s" if rate == "tflops" else "TB/s"
    return f"{row['ms']:.4f} ms {row[rate]:.2f} {unit}"


def _add_ceilings(case_rows, ceiling):
    """Each implementation's TFLOP/s and its shares of the case's read ceiling (the "read"
    row) and the run's matmul ceiling, in kernel time where measured (else wall time); "bound":
    which ceiling takes longer for the case's bytes and FLOPs, "of_roofline" the time that
    ceiling takes over the implementation's."""
    read = next(r for r in case_rows if r["impl"] == "read")
    for row in case_rows:
        if "flops" not in row or row.get("ms") is None:
            continue
        key = "device_ms" if row.get("device_ms") is not None else "ms"
        ms = row[key]
        row["tflops"] = round(row["flops"] / row["ms"] / 1e9, 2)
        if row.get("device_ms") is not None:
            row["device_tflops"] = round(row["flops"] / row["device_ms"] / 1e9, 2)
        read_ms = read.get(key)
        matmul_tflops = ceiling.get("device_tflops" if key == "device_ms" else "tflops")
        if not read_ms or not matmul_tflops:
            continue
        matmul_ms = row["flops"] / matmul_tflops / 1e9
        row["of_read"] = round(read_ms / ms, 3)
        row["of_matmul"] = round(matmul_ms / ms, 3)
        row["bound"] = "memory" if read_ms >= matmul_ms else "compute"
        row["of_roofline"] = round(max(read_ms, matmul_ms) / ms, 3)


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
    if case.get("hv"):
        name += f" latent Hv{case['hv']}"
    if case["ragged"]:
        name += " ragged"
    if case["page"]:
        name += f" page{case['page']}"
    if case.get("cache"):
        name += " fp8"
    elif case.get("group") == "fp8":  # the float8 case's twin in the queries' dtype
        name += " bf16"
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


def print_ceiling_table(rows, out=None):
    """pallas_flash (and its rows of other tiles) against the ceilings measured in the same
    run: per case its time (kernel
    time where measured), TB/s and the share of the read ceiling (a plain reduction over the
    same bytes), TFLOP/s and the share of the matmul ceiling, which ceiling bounds the case
    (the longer of the two times) and the share of that bound's time ("of roofline")."""
    measured = [r for r in rows if r["impl"].startswith("pallas_flash") and "of_roofline" in r]
    if not measured:
        return
    ceiling = next((r for r in rows if r["impl"] == "matmul"), {})
    kernel = any(r.get("device_ms") is not None for r in measured)
    lines = []
    for r in measured:
        ms = r["device_ms"] if kernel else r["ms"]
        tb = r["device_tbps"] if kernel else r["tbps"]
        tf = r["device_tflops"] if kernel else r["tflops"]
        lines.append(
            [
                _decode_name(r),
                r["impl"],
                f"{ms:.4f}",
                f"{tb:.2f}",
                f"{r['of_read']:.2f}",
                f"{tf:.1f}",
                f"{r['of_matmul']:.2f}",
                r["bound"],
                f"{r['of_roofline']:.2f}",
            ]
        )
    rate = ceiling.get("device_tflops" if kernel else "tflops")
    title = (
        f"pallas_flash against the read ceiling (XLA's sum of the same bytes) and the matmul "
        f"ceiling ({rate} TFLOP/s), {'kernel' if kernel else 'wall'} time:"
    )
    header = ["case", "impl", "ms", "TB/s", "of read", "TFLOP/s", "of matmul", "bound"]
    header.append("of roofline")
    print_markdown(header, lines, title=title, out=out)
