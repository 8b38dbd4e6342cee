"""TFLOP/s against sequence length per implementation, one panel per (head dim, causal, pass).

    python benchmarks/plot.py benchmarks/results/h200.jsonl \
        --anchors benchmarks/results/anchors-h200 --out benchmarks/results/h200.png

Reads the benchmark's JSONL (impl, T, H, causal, pass, tflops) and, with --anchors, the peers
measured by the anchors' scripts (their rows: kind "attn", impl, S, D, causal, pass_, tflops;
benchmarks/results/anchors-h200 from a device call right after the grid's, or
../shared/anchors): another process, so they are drawn dashed.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rows import load_anchors, load_ours  # noqa: E402


def plot(rows, out):
    impls = sorted({(r["impl"], r["anchor"]) for r in rows})
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per impl everywhere
    panels = sorted({(r["H"], r["causal"], r["pass_"]) for r in rows if not r["anchor"]})
    cols = 4
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, (h, causal, pass_) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["H"], r["causal"], r["pass_"]) == (h, causal, pass_)]
        for impl, anchor in sorted({(r["impl"], r["anchor"]) for r in sel}):
            pts = sorted(
                (r["seq"], r["tflops"]) for r in sel if r["impl"] == impl and r["anchor"] == anchor
            )
            ax.plot(
                *zip(*pts),
                "--" if anchor else "-",
                color=colors[(impl, anchor)],
                marker="o",
                ms=3,
                label=impl + (" (anchors)" if anchor else ""),
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"H={h} {'causal' if causal else 'non-causal'} {pass_}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--anchors", help="directory of the anchors' JSONL")
    parser.add_argument("--out", default="benchmarks/results/h200.png")
    args = parser.parse_args()
    rows = load_ours(args.results)
    if args.anchors:
        rows += load_anchors(args.anchors)
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
