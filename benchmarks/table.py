"""The README's H200 table from the benchmark's JSONL and the anchors' peers.

    python benchmarks/table.py benchmarks/results/h200.jsonl \
        --anchors benchmarks/results/anchors-h200 ../shared/anchors/h200-2026-11-29 \
        [--compact 512 2048 16384]

Columns: TFLOP/s of pallas_flash, cuDNN and jax's Pallas attention (same run), the best of the
anchors' Triton/CUDA peers (jax's Pallas Triton, tokamax triton, FlashAttention-2 CUDA), and
pallas_flash over that peer (the target: >= 1.15) and over cuDNN. Each grid point takes its
peers from the first --anchors directory that has any (a later directory marked with *).
--compact: the README's short table, one row per (H, causal, seq), both passes side by side.
"""

from __future__ import annotations

import argparse

from rows import load_anchors, load_ours


def best_peers(peer_runs) -> dict:
    """{(H, causal, seq, pass): (tflops, impl label)}: the fastest peer of the first run (a list
    of anchor rows) that measured the point; labels of later runs end in '*'."""
    best = {}
    for run_index, peers in enumerate(peer_runs):
        found = {}
        for r in peers:
            key = (r["H"], r["causal"], r["seq"], r["pass_"])
            if r["tflops"] > found.get(key, (0, ""))[0]:
                found[key] = (r["tflops"], r["impl"] + ("*" if run_index else ""))
        for key, value in found.items():
            best.setdefault(key, value)
    return best


def table(rows, peer_runs) -> str:
    ours = {(r["H"], r["causal"], r["seq"], r["pass_"], r["impl"]): r["tflops"] for r in rows}
    best = best_peers(peer_runs)
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


def compact_table(rows, peer_runs, seqs) -> str:
    """One row per (H, causal, seq) of `seqs`: TFLOP/s of pallas_flash, cuDNN and the best peer,
    forward and forward+backward side by side (the README's short table)."""
    ours = {(r["H"], r["causal"], r["seq"], r["pass_"], r["impl"]): r["tflops"] for r in rows}
    best = best_peers(peer_runs)
    lines = [
        "| H | causal | seq | fwd | cuDNN | best peer | fwd+bwd | cuDNN | best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    points = sorted(
        {(h, c, s) for h, c, s, _, impl in ours if impl == "pallas_flash" and s in seqs}
    )
    for h, c, s in points:
        cells = [h, "yes" if c else "no", s]
        for p in ("fwd", "fwd+bwd"):
            pf = ours.get((h, c, s, p, "pallas_flash"))
            cudnn = ours.get((h, c, s, p, "cudnn"))
            peer = best.get((h, c, s, p))
            cells += [
                round(pf) if pf else "-",
                round(cudnn) if cudnn else "-",
                f"{peer[0]:.0f}" if peer else "-",
            ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument(
        "--anchors", nargs="*", default=[], help="directories of the anchors' JSONL, first wins"
    )
    parser.add_argument(
        "--compact", type=int, nargs="+", metavar="SEQ", help="the short table at these lengths"
    )
    args = parser.parse_args()
    rows, peer_runs = load_ours(args.results), [load_anchors(d) for d in args.anchors]
    if args.compact:
        print(compact_table(rows, peer_runs, set(args.compact)))
    else:
        print(table(rows, peer_runs))


if __name__ == "__main__":
    main()
