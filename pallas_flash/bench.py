"""`python -m pallas_flash.bench`: TFLOP/s of pallas_flash beside cuDNN and XLA attention.

On a GPU it runs the FlashAttention-2 paper's grid (bf16, 16k tokens per batch, hidden 2048, so
N = 2048 / H; H in {64, 128}; seq 512 to 16k; causal and not; forward and forward+backward) for
every implementation in one process on the same inputs, prints TFLOP/s and the ratio to cuDNN, and
writes one JSON object per line. On a CPU it runs a small interpret-mode demo and says so.

FLOPs follow the paper: forward 4 * B * N * T * S * H, halved when causal; forward+backward is
3.5 x forward (the backward is 2.5 x).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import config as config_lib

PASSES = ("fwd", "fwd+bwd")


def attention_fn(impl: str, *, is_causal: bool, interpret: bool = False, block_sizes=None):
    """q, k, v -> out for one implementation name."""
    if impl in ("pallas_flash", "pallas_flash_triton"):
        # "pallas_flash" is what a user gets (backend=None: the Mosaic GPU forward on Hopper
        # where it applies); "pallas_flash_triton" keeps every kernel on Triton.
        return functools.partial(
            pallas_flash.flash_attention,
            is_causal=is_causal,
            interpret=interpret,
            backend="triton" if impl == "pallas_flash_triton" else None,
            block_sizes=block_sizes,
        )
    if impl in ("cudnn", "xla"):
        return functools.partial(
            jax.nn.dot_product_attention, is_causal=is_causal, implementation=impl
        )
    if impl == "jax_pallas":
        # jax's own Pallas Triton attention (deprecated upstream, a peer here), called as the
        # anchors call it: default tiles, segment ids None.
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as jax_attention

        def fn(q, k, v):
            scale = 1.0 / q.shape[-1] ** 0.5
            return jax_attention.mha(q, k, v, None, sm_scale=scale, causal=is_causal)

        return fn
    raise ValueError(f"unknown implementation {impl!r}")


def timed_fn(fn, pass_: str):
    """A jitted function of (q, k, v, d_out) running the forward, or forward and backward."""
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v, do: fn(q, k, v))

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd)


def median_ms(f, args, *, calls: int = 10, repeats: int = 7) -> float:
    """Median over `repeats` of the wall time of `calls` back-to-back calls, per call, in ms."""
    jax.block_until_ready(f(*args))  # compile and warm up
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def attention_flops(b, t, s, n, h, causal: bool, pass_: str) -> float:
    flops = 4.0 * b * n * t * s * h
    if causal:
        flops /= 2
    return flops * (3.5 if pass_ == "fwd+bwd" else 1.0)


def make_inputs(b, t, s, n, k, h, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, s, k, h), dtype)
    v = jax.random.normal(keys[2], (b, s, k, h), dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), dtype)
    return q, kk, v, do


def run_point(
    impl,
    b,
    t,
    s,
    n,
    k,
    h,
    dtype,
    causal,
    pass_,
    *,
    interpret=False,
    calls=10,
    repeats=7,
    block_sizes=None,
):
    """One measurement as a dict (ms and tflops are None, with an error, if the call failed)."""
    row = dict(
        impl=impl,
        B=b,
        T=t,
        S=s,
        N=n,
        K=k,
        H=h,
        dtype=jnp.dtype(dtype).name,
        causal=bool(causal),
        **{"pass": pass_},
    )
    try:
        fn = attention_fn(impl, is_causal=causal, interpret=interpret, block_sizes=block_sizes)
        args = make_inputs(b, t, s, n, k, h, dtype)
        ms = median_ms(timed_fn(fn, pass_), args, calls=calls, repeats=repeats)
        row.update(
            ms=round(ms, 4),
            tflops=round(attention_flops(b, t, s, n, h, causal, pass_) / ms / 1e9, 1),
        )
    except Exception as e:  # noqa: BLE001 -- a peer failing (OOM, unsupported) is data, not a crash
        row.update(ms=None, tflops=None, error=f"{type(e).__name__}: {str(e)[:200]}")
    return row


def paper_grid(head_dims, seqs, tokens=16384, hidden=2048):
    for h in head_dims:
        for causal in (False, True):
            for seq in seqs:
                yield dict(
                    b=max(1, tokens // seq),
                    t=seq,
                    s=seq,
                    n=hidden // h,
                    k=hidden // h,
                    h=h,
                    causal=causal,
                )


def print_table(rows, impls, out=sys.stdout, metric="tflops"):
    """TFLOP/s (or ms) per implementation, and pallas_flash / cudnn, per grid point and pass."""
    by_point = {}
    for r in rows:
        key = (r["H"], r["causal"], r["T"], r["pass"])
        by_point.setdefault(key, {})[r["impl"]] = r[metric]
    header = ["H", "causal", "seq", "pass", *impls]
    if "cudnn" in impls and "pallas_flash" in impls:
        header.append("pf/cudnn")
    print("| " + " | ".join(header) + " |", file=out)
    print("|" + "---|" * len(header), file=out)
    for (h, causal, seq, pass_), vals in sorted(by_point.items()):
        cells = [str(h), str(int(causal)), str(seq), pass_]
        cells += [
            "-" if vals.get(i) is None else f"{vals[i]:.{0 if metric == 'tflops' else 2}f}"
            for i in impls
        ]
        if "pf/cudnn" in header:
            pf, cu = vals.get("pallas_flash"), vals.get("cudnn")
            cells.append("-" if not pf or not cu else f"{pf / cu:.2f}")
        print("| " + " | ".join(cells) + " |", file=out)


def mask_cases(seq=16384, heads=16, head_dim=128, docs=8):
    """(case, impl, fn, shape) for the masked workloads: the default call and the all-Triton
    call (backend="triton"), each beside its cuDNN counterpart.

    fn(q, k, v) -> out; shape = (B, T, N, H). Packed documents: `docs` documents of seq/docs in
    one row (segment ids, causal), against cuDNN dense causal over the row and on the documents as
    a batch. Sliding windows of 1k and 4k (causal). Padded batches: lengths between half and all
    of the row, with query_seq_lengths / key_value_seq_lengths.
    """
    row = (1, seq, heads, head_dim)
    doc = seq // docs
    seg = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), doc)[None]
    ours = {
        "pallas_flash": pallas_flash.flash_attention,  # the default call
        "pallas_flash_triton": functools.partial(pallas_flash.flash_attention, backend="triton"),
    }
    cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    batch, length = 8, 2048
    lengths = jnp.asarray([2048, 1024, 1536, 1100, 2000, 1800, 1300, 1700], jnp.int32)
    padded = (batch, length, heads, head_dim)
    # (case, kwargs of ours, shape, cuDNN's counterpart: (impl, fn, shape))
    cases = [
        (
            "dense causal",
            dict(is_causal=True),
            row,
            ("cudnn", functools.partial(cudnn, is_causal=True), row),
        ),
        (
            f"packed {docs}x{doc}",
            dict(is_causal=True, q_segment_ids=seg),
            row,
            (
                "cudnn (docs as batch)",
                functools.partial(cudnn, is_causal=True),
                (docs, doc, heads, head_dim),
            ),
        ),
        *(
            (
                f"causal window {window}",
                dict(is_causal=True, local_window_size=(window, 0)),
                row,
                (
                    "cudnn",
                    functools.partial(cudnn, is_causal=True, local_window_size=(window, 0)),
                    row,
                ),
            )
            for window in (1024, 4096)
        ),
        (
            f"padded {batch}x{length}",
            dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths),
            padded,
            (
                "cudnn",
                functools.partial(cudnn, query_seq_lengths=lengths, key_value_seq_lengths=lengths),
                padded,
            ),
        ),
    ]
    for case, kwargs, shape, (cudnn_impl, cudnn_fn, cudnn_shape) in cases:
        for impl, fn in ours.items():
            yield case, impl, functools.partial(fn, **kwargs), shape
        yield case, cudnn_impl, cudnn_fn, cudnn_shape


def run_mask_suite(out_path, repeats):
    rows = []
    with open(out_path, "a") as f:
        for case, impl, fn, (b, t, n, h) in mask_cases():
            for pass_ in PASSES:
                row = dict(
                    suite="masks",
                    case=case,
                    impl=impl,
                    B=b,
                    T=t,
                    S=t,
                    N=n,
                    K=n,
                    H=h,
                    dtype="bfloat16",
                    **{"pass": pass_},
                )
                try:
                    args = make_inputs(b, t, t, n, n, h, jnp.bfloat16)
                    row["ms"] = round(median_ms(timed_fn(fn, pass_), args, repeats=repeats), 4)
                except Exception as e:  # noqa: BLE001
                    row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                print(
                    f"{case:22s} {impl:22s} {pass_:7s} {row['ms']} ms {row.get('error', '')}",
                    flush=True,
                )
    dense = {
        r["pass"]: r["ms"]
        for r in rows
        if r["case"] == "dense causal" and r["impl"] == "pallas_flash"
    }
    print(
        "\n| case | impl | fwd ms | fwd+bwd ms | fwd / pallas_flash dense causal "
        "| fwd+bwd / dense causal |"
    )
    print("|---|---|---|---|---|---|")
    for case, impl in dict.fromkeys((r["case"], r["impl"]) for r in rows):
        ms = {r["pass"]: r["ms"] for r in rows if r["case"] == case and r["impl"] == impl}
        ratio = [f"{ms[p] / dense[p]:.2f}" if ms.get(p) and dense.get(p) else "-" for p in PASSES]
        print(
            f"| {case} | {impl} | {ms.get('fwd')} | {ms.get('fwd+bwd')} | {ratio[0]} | {ratio[1]} |"
        )


def run_scale_suite(out_path, repeats, seqs, on_gpu):
    """Context parallelism: causal ring attention (zig-zag) on 1, 2, 4, 8 devices of this host
    at each global sequence length, beside the plain single-device call.

    Per row: step ms (forward+backward), TFLOP/s per device (the causal FLOP count of the whole
    sequence over the devices) and the scaling efficiency: that rate over the plain call's rate
    at the longest length it ran (the single-device rate flattens there). On a GPU: bf16, B=1,
    N=16, H=128 (hidden 2048), 128k to 1M tokens, the plain call up to 128k. On a CPU (smoke
    run on fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=8): float32, N=2,
    H=64, backend="xla" inside the ring, 512 and 1024 tokens; those times say nothing about
    GPUs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if on_gpu:
        n, h, dtype, backend, plain_max, calls = 16, 128, jnp.bfloat16, None, 1 << 17, 1
        seqs = seqs or [1 << 17, 1 << 18, 1 << 19, 1 << 20]
    else:
        n, h, dtype, backend, plain_max, calls = 2, 64, jnp.float32, "xla", 1024, 1
        seqs = seqs or [512, 1024]
        repeats = min(repeats, 3)
    counts = [c for c in (1, 2, 4, 8) if c <= jax.device_count()]
    rows, plain_rate = [], None
    with open(out_path, "a") as f:
        for seq in seqs:
            args = make_inputs(1, seq, seq, n, n, h, dtype)
            flops = attention_flops(1, seq, seq, n, h, True, "fwd+bwd")
            points = [("plain", 1)] if seq <= plain_max else []
            points += [("ring", c) for c in counts if seq % (2 * c) == 0]
            for impl, devices in points:
                row = dict(
                    suite="scale",
                    impl=impl,
                    devices=devices,
                    T=seq,
                    N=n,
                    H=h,
                    causal=True,
                    dtype=jnp.dtype(dtype).name,
                    **{"pass": "fwd+bwd"},
                )
                try:
                    if impl == "plain":
                        fn = functools.partial(
                            pallas_flash.flash_attention, is_causal=True, backend=backend
                        )
                        placed = args
                    else:
                        mesh = jax.sharding.Mesh(jax.devices()[:devices], ("context",))
                        fn = functools.partial(
                            pallas_flash.ring_attention_sharded,
                            mesh=mesh,
                            context_axis="context",
                            is_causal=True,
                            layout="zigzag",
                            backend=backend,
                        )
                        # Inputs already in zig-zag order and sharded: the ring alone is timed.
                        seq_sharded = NamedSharding(mesh, P(None, "context"))
                        placed = [
                            jax.device_put(pallas_flash.to_zigzag(x, devices), seq_sharded)
                            for x in args
                        ]
                    ms = median_ms(timed_fn(fn, "fwd+bwd"), placed, calls=calls, repeats=repeats)
                    rate = flops / (ms * 1e-3) / devices / 1e12
                    if impl == "plain":
                        plain_rate = rate
                    row.update(
                        ms=round(ms, 3),
                        tflops_per_device=round(rate, 3),
                        efficiency=round(rate / plain_rate, 3) if plain_rate else None,
                    )
                except Exception as e:  # noqa: BLE001
                    row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(
                    f"{impl:5s} devices={devices} T={seq:8d} {row.get('ms')} ms "
                    f"{row.get('tflops_per_device')} TFLOP/s/device "
                    f"efficiency {row.get('efficiency')} {row.get('error', '')}",
                    flush=True,
                )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default per suite)")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["pallas_flash", "cudnn", "xla"],
        choices=["pallas_flash", "pallas_flash_triton", "cudnn", "xla", "jax_pallas"],
    )
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--out", default="bench.jsonl", help="JSONL file to append results to")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--suite",
        choices=["grid", "masks", "scale"],
        default="grid",
        help="grid: the FA2 paper's grid; masks: packed documents, windows, padding (GPU only); "
        "scale: causal ring attention on 1/2/4/8 devices of this host (--seqs: global lengths)",
    )
    args = parser.parse_args(argv)

    on_gpu = (config_lib.gpu_compute_capability() or (0, 0)) >= (8, 0)
    if args.suite == "scale":
        run_scale_suite(args.out, args.repeats, args.seqs, on_gpu)
        return
    args.seqs = args.seqs or [512, 1024, 2048, 4096, 8192, 16384]
    if args.suite == "masks":
        if not on_gpu:
            raise SystemExit("--suite masks needs an NVIDIA GPU (sm80+)")
        run_mask_suite(args.out, args.repeats)
        return
    if on_gpu:
        grid = list(paper_grid(args.head_dims, args.seqs))
        impls, interpret, dtype, calls = args.impls, False, jnp.bfloat16, 10
        print(
            f"GPU: {jax.devices()[0].device_kind}; {len(grid)} points x {len(args.passes)} "
            f"passes x {len(impls)} implementations",
            flush=True,
        )
    else:
        # A CPU has no Triton: run the kernels in the Pallas interpreter on a toy problem, beside
        # XLA, to show the pipeline works. These numbers say nothing about GPU speed.
        print(
            "No NVIDIA GPU of compute capability >= 8.0 found: running a small interpret-mode "
            "demo on the CPU (times are not GPU performance).",
            flush=True,
        )
        grid = [dict(b=1, t=256, s=256, n=2, k=2, h=64, causal=c) for c in (False, True)]
        impls, interpret, dtype, calls = ["pallas_flash", "xla"], True, jnp.float32, 1
        args.repeats = min(args.repeats, 3)
    if args.causal != "both":
        grid = [p for p in grid if p["causal"] == (args.causal == "yes")]

    rows = []
    total = len(grid) * len(args.passes) * len(impls)
    with open(args.out, "a") as f:
        for p in grid:
            for pass_ in args.passes:
                for impl in impls:
                    row = run_point(
                        impl,
                        p["b"],
                        p["t"],
                        p["s"],
                        p["n"],
                        p["k"],
                        p["h"],
                        dtype,
                        p["causal"],
                        pass_,
                        interpret=interpret,
                        calls=calls,
                        repeats=args.repeats,
                    )
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    shown = (
                        "failed: " + row["error"]
                        if row["tflops"] is None
                        else (f"{row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s")
                    )
                    print(
                        f"[{len(rows)}/{total}] {impl:12s} H={p['h']} seq={p['t']} "
                        f"causal={int(p['causal'])} {pass_:7s} {shown}",
                        flush=True,
                    )
    print()
    print_table(rows, impls, metric="tflops" if on_gpu else "ms")
    print(f"\nwrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
