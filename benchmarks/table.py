"""The README's H200 table from the benchmark's JSONL and the anchors' peers.

    python benchmarks/table.py benchmarks/results/h200.jsonl \
        --anchors ../shared/anchors/h200-2026-11-29

Columns: TFLOP/s of pallas_flash, cuDNN and jax's Pallas attention (same run), the best of the
anchors' Triton/CUDA peers (jax's Pallas Triton, tokamax triton, FlashAttention-2 CUDA; their run
on the same H200), and pallas_flash over that peer (issue 5 asks >= 1.15) and over cuDNN.
"""

from __future__ import annotations

import argparse

from rows import load_anchors, load_ours


def table(rows, peers) -> str:
    ours = {(r["H"], r["causal"], r["seq"], r["pass_"], r["impl"]): r["tflops"] for r in rows}
    best = {}
    for r in peers:
        key = (r["H"], r["causal"], r["seq"], r["pass_"])
        if r["tflops"] > best.get(key, (0, ""))[0]:
            best[key] = (r["tflops"], r["impl"])
    lines = [
        "| H | causal | seq | pass | pallas_flash | cudnn | jax_pallas | best peer (anchors) "
        "| pf/peer | pf/cudnn |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    points = sorted({(h, c, s, p) for h, c, s, p, impl in ours if impl == "pallas_flash"})
    for h, c, s, p in points:
        pf = ours[(h, c, s, p, "pallas_flash")]
        cudnn = ours.get((h, c, s, p, "cudnn"))
        jp = ours.get((h, c, s, p, "jax_pallas"))
        peer = best.get((h, c, s, p))
        cells = [
            h,
            int(c),
            s,
            p,
            round(pf),
            round(cudnn) if cudnn else "-",
            round(jp) if jp else "-",
            f"{peer[0]:.0f} {peer[1]}" if peer else "-",
            f"{pf / peer[0]:.2f}" if peer else "-",
            f"{pf / cudnn:.2f}" if cudnn else "-",
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--anchors", help="directory of the anchors' JSONL")
    args = parser.parse_args()
    peers = load_anchors(args.anchors) if args.anchors else []
    print(table(load_ours(args.results), peers))


if __name__ == "__main__":
    main()
