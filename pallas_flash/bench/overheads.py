"""`--suite overheads`: what attention sinks and dropout cost over the plain call, on the
default kernels (Mosaic on Hopper) and on Triton (GPU only).

B=4, T=S=4096, N=16, bf16, H in --head-dims, causal and not, forward and forward+backward (the
sinks' gradient taken too). Cases: "plain" (backend=None), "sinks" (sinks [N]), "dropout"
(rate 0.1), and each on backend="triton" ("triton", "triton_sinks", "triton_dropout"). The
table gives each case's ms and the ratios the goals name: sinks / plain and triton_sinks /
triton (goal <= 1.03), dropout / plain and triton_dropout / triton (goal <= 1.15).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench.timing import (
    Rows,
    attention_flops,
    make_inputs,
    median_ms,
    print_markdown,
    progress,
    recording_failure,
)

HELP = "overheads: sinks and dropout against the plain call, default and Triton (GPU only)"
FLAGS = ("--head-dims", "--causal", "--passes", "--repeats")
REPEATS = 3
B, T, N = 4, 4096, 16
# case: (flash_attention's keyword arguments, whether the call takes sinks)
CASES = {
    "plain": ({}, False),
    "sinks": ({}, True),
    "triton": (dict(backend="triton"), False),
    "triton_sinks": (dict(backend="triton"), True),
    "dropout": (dict(dropout_rate=0.1), False),
    "triton_dropout": (dict(backend="triton", dropout_rate=0.1), False),
}
# (case, its baseline) of the ratios the table gives
RATIOS = (
    ("sinks", "plain"),
    ("triton_sinks", "triton"),
    ("dropout", "plain"),
    ("triton_dropout", "triton"),
)


def timed(kwargs, with_sinks: bool, causal: bool, pass_: str):
    """jit of (q, k, v, do, sinks) -> the forward, or forward and backward (dsinks included
    where the call takes sinks)."""

    def fn(q, k, v, s):
        sinks = s if with_sinks else None
        return pallas_flash.flash_attention(q, k, v, is_causal=causal, sinks=sinks, **kwargs)

    if pass_ == "fwd":
        return jax.jit(lambda q, k, v, do, s: fn(q, k, v, s))

    def fwd_bwd(q, k, v, do, s):
        if with_sinks:
            _, vjp = jax.vjp(fn, q, k, v, s)
        else:
            _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, s), q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd)


def run(args, *, on_gpu: bool) -> list[dict]:
    if not on_gpu:
        raise SystemExit("--suite overheads needs an NVIDIA GPU (sm80+)")
    rows = Rows(args.out)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for h in args.head_dims:
        q, k, v, do = make_inputs(B, T, T, N, N, h, jnp.bfloat16)
        sinks = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
        for causal in causals:
            for pass_ in args.passes:
                for case, (kwargs, with_sinks) in CASES.items():
                    row = dict(suite="overheads", case=case, B=B, T=T, N=N, H=h, causal=causal)
                    row.update(dtype="bfloat16", **{"pass": pass_})
                    with recording_failure(row, "ms", "tflops"):
                        if kwargs.get("dropout_rate"):
                            kwargs = dict(kwargs, dropout_rng=jax.random.key(7))
                        f = timed(kwargs, with_sinks, causal, pass_)
                        ms = median_ms(f, (q, k, v, do, sinks), repeats=args.repeats)
                        flops = attention_flops(B, T, T, N, h, causal, pass_)
                        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                    rows.add(row)
                    progress(
                        f"H={h} causal={int(causal)} {pass_:7s} {case:15s} {row['ms']} ms "
                        f"{row['tflops']} TFLOP/s {row.get('error', '')}"
                    )
    print_overheads_table(rows)
    return rows


def print_overheads_table(rows, out=None):
    """Per head dim, causal and pass: each case's ms, and the ratios of RATIOS."""
    by = {}
    for r in rows:
        by.setdefault((r["H"], r["causal"], r["pass"]), {})[r["case"]] = r.get("ms")
    header = ["H", "causal", "pass", *(f"{c} ms" for c in CASES)]
    header += [f"{a} / {b}" for a, b in RATIOS]
    lines = []
    for (h, causal, pass_), ms in by.items():
        cells = [h, int(causal), pass_, *(ms.get(c) for c in CASES)]
        cells += [f"{ms[a] / ms[b]:.3f}" if ms.get(a) and ms.get(b) else None for a, b in RATIOS]
        lines.append(cells)
    print_markdown(header, lines, out=out)
