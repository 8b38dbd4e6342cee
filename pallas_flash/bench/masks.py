"""`--suite masks`: packed documents, sliding windows and padded batches at 16k tokens, the
default call and the all-Triton call beside cuDNN's counterparts (GPU only)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench.timing import (
    PASSES,
    Rows,
    make_inputs,
    median_ms,
    print_markdown,
    progress,
    recording_failure,
    timed_fn,
)

HELP = "masks: packed documents, windows, padding (GPU only)"
FLAGS = ("--repeats",)


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


def run(args, *, on_gpu: bool) -> list[dict]:
    if not on_gpu:
        raise SystemExit("--suite masks needs an NVIDIA GPU (sm80+)")
    rows = Rows(args.out)
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
            with recording_failure(row, "ms"):
                inputs = make_inputs(b, t, t, n, n, h, jnp.bfloat16)
                row["ms"] = round(median_ms(timed_fn(fn, pass_), inputs, repeats=args.repeats), 4)
            rows.add(row)
            progress(f"{case:22s} {impl:22s} {pass_:7s} {row['ms']} ms {row.get('error', '')}")
    print_mask_table(rows)
    return rows


def print_mask_table(rows, out=None):
    """Per case and implementation: ms of each pass and its ratio to the default call's dense
    causal time."""
    dense = {
        r["pass"]: r["ms"]
        for r in rows
        if r["case"] == "dense causal" and r["impl"] == "pallas_flash"
    }
    header = ["case", "impl", "fwd ms", "fwd+bwd ms", "fwd / pallas_flash dense causal"]
    header.append("fwd+bwd / dense causal")
    lines = []
    for case, impl in dict.fromkeys((r["case"], r["impl"]) for r in rows):
        ms = {r["pass"]: r["ms"] for r in rows if r["case"] == case and r["impl"] == impl}
        ratio = [f"{ms[p] / dense[p]:.2f}" if ms.get(p) and dense.get(p) else "-" for p in PASSES]
        lines.append([case, impl, ms.get("fwd"), ms.get("fwd+bwd"), *ratio])
    print_markdown(header, lines, out=out)
