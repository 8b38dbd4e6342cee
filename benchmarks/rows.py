"""Rows of the benchmark's JSONL and of the anchors' JSONL, in one shape: impl, seq, H, causal,
pass_, tflops, anchor (True for the anchors' peers, measured in another run)."""

from __future__ import annotations

import glob
import json
import os

# The Triton/CUDA peers of the performance target.
PEERS = ("jaxref_triton", "tokamax_triton", "torch_flash")


def load_ours(paths):
    """The benchmark's rows; a point measured again (a later line, same impl, shape and pass)
    replaces the earlier one. Rows marked superseded_by (a commit that changed that point's
    default after the run) are history, not the current default's speed: skipped."""
    latest = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                current = "superseded_by" not in r
                if r.get("tflops") is not None and "suite" not in r and current:
                    row = dict(
                        impl=r["impl"],
                        seq=r["T"],
                        H=r["H"],
                        causal=bool(r["causal"]),
                        pass_=r["pass"],
                        tflops=r["tflops"],
                        anchor=False,
                    )
                    latest[row["impl"], row["seq"], row["H"], row["causal"], row["pass_"]] = row
    return list(latest.values())


def load_anchors(directory, impls=PEERS):
    rows = []
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                # The FA2-paper grid only (16k tokens per batch), not the extra workloads.
                grid_point = r.get("B", 0) * r.get("S", 0) == 16384 and not r.get("window")
                if (
                    r.get("kind") == "attn"
                    and r.get("impl") in impls
                    and grid_point
                    and r.get("tflops")
                ):
                    rows.append(
                        dict(
                            impl=r["impl"],
                            seq=r["S"],
                            H=r["D"],
                            causal=bool(r["causal"]),
                            pass_=r["pass_"].replace("fwdbwd", "fwd+bwd"),
                            tflops=r["tflops"],
                            anchor=True,
                        )
                    )
    return rows
