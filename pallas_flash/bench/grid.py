"""`--suite grid` (the default): the FlashAttention-2 paper's grid beside cuDNN and XLA.

On a GPU: bf16, 16k tokens per batch, hidden 2048 (N = 2048 / H), H in --head-dims, seq 512 to
16k (--seqs), causal and not, forward and forward+backward, every implementation in one process
on the same inputs; TFLOP/s by the paper's count and the ratio to cuDNN. On a CPU: a small
interpret-mode demo beside XLA, to show the pipeline works (its times say nothing of a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.bench.timing import Rows, print_markdown, progress, run_point

HELP = "grid: the FA2 paper's grid"
FLAGS = ("--head-dims", "--seqs", "--impls", "--passes", "--causal", "--repeats")
# Without a GPU: a fixed interpreted demo, which reads fewer.
FLAGS_ON_CPU = ("--passes", "--causal", "--repeats")
IMPLS = (
    "pallas_flash",
    "pallas_flash_nondeterministic",
    "pallas_flash_triton",
    "cudnn",
    "xla",
    "jax_pallas",
)
DEFAULT_IMPLS = ["pallas_flash", "cudnn", "xla"]
DEFAULT_SEQS = [512, 1024, 2048, 4096, 8192, 16384]


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


def print_table(rows, impls, out=None, metric="tflops"):
    """TFLOP/s (or ms) per implementation, and pallas_flash / cudnn, per grid point and pass;
    also pallas_flash / cudnn in kernel time where the rows have it (run_point's kernel_time)."""
    by_point, kernels = {}, {}
    for r in rows:
        key = (r["H"], r["causal"], r["T"], r["S"], r["B"], r["N"], r["K"], r["pass"])
        by_point.setdefault(key, {})[r["impl"]] = r[metric]
        kernels.setdefault(key, {})[r["impl"]] = r.get("kernel_tflops")
    unit = "TFLOP/s" if metric == "tflops" else "ms"
    header = ["H", "causal", "seq", "B", "heads", "pass", *(f"{i} {unit}" for i in impls)]
    ratios = []
    if "cudnn" in impls and "pallas_flash" in impls:
        ratios.append(("pf/cudnn", by_point))
        if any(r.get("kernel_tflops") for r in rows):
            ratios.append(("pf/cudnn, kernels", kernels))
    header += [name for name, _ in ratios]
    lines = []
    for key, vals in sorted(by_point.items()):
        h, causal, t, s, b, n, k, pass_ = key
        # T, or T/S for cross-attention; N, or N/K for GQA.
        seq, heads = str(t) if t == s else f"{t}/{s}", str(n) if n == k else f"{n}/{k}"
        cells = [str(h), str(int(causal)), seq, str(b), heads, pass_]
        cells += [
            "-" if vals.get(i) is None else f"{vals[i]:.{0 if metric == 'tflops' else 2}f}"
            for i in impls
        ]
        for _, got in ratios:
            pf, cu = got[key].get("pallas_flash"), got[key].get("cudnn")
            cells.append("-" if not pf or not cu else f"{pf / cu:.2f}")
        lines.append(cells)
    print_markdown(header, lines, out=out)


def run_points(rows, grid, impls, passes, dtype, *, interpret, calls, repeats, on_gpu, extra=None):
    """Times every (point, pass, implementation) into rows, a progress line each; extra(impl,
    point, pass) -> more fields for a row (the shapes suite's)."""
    total = len(grid) * len(passes) * len(impls)
    for p in grid:
        for pass_ in passes:
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
                    repeats=repeats,
                    kernel_time=on_gpu,
                )
                if extra is not None:
                    row.update(extra(impl, p, pass_))
                rows.add(row)
                shown = (
                    "failed: " + row["error"]
                    if row["tflops"] is None
                    else (f"{row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s")
                )
                kernels = f" mosaic_calls={row['mosaic_calls']}" if "mosaic_calls" in row else ""
                progress(
                    f"[{len(rows)}/{total}] {impl:12s} H={p['h']} T={p['t']} S={p['s']} "
                    f"B={p['b']} N={p['n']} K={p['k']} "
                    f"causal={int(p['causal'])} {pass_:7s} {shown}{kernels}"
                )


def select_causal(grid, causal: str):
    """The grid's points of --causal: both, yes or no."""
    return grid if causal == "both" else [p for p in grid if p["causal"] == (causal == "yes")]


def run(args, *, on_gpu: bool) -> list[dict]:
    repeats = args.repeats
    if on_gpu:
        grid = list(paper_grid(args.head_dims, args.seqs or DEFAULT_SEQS))
        impls, interpret, dtype, calls = args.impls or DEFAULT_IMPLS, False, jnp.bfloat16, 10
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
        repeats = min(repeats, 3)
    grid = select_causal(grid, args.causal)
    rows = Rows(args.out)
    run_points(
        rows,
        grid,
        impls,
        args.passes,
        dtype,
        interpret=interpret,
        calls=calls,
        repeats=repeats,
        on_gpu=on_gpu,
    )
    print_table(rows, impls, metric="tflops" if on_gpu else "ms")
    return rows
