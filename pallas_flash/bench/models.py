"""`--suite models`: one call per model family's attention (Llama, Phi, Gemma 2, DeepSeek MLA,
gpt-oss sinks, ViT/BERT dropout) beside the nearest plain call and cuDNN's closest call; on a
CPU a tiny interpreted smoke run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash.bench.timing import (
    PASSES,
    Rows,
    kernel_timing,
    median_ms,
    print_markdown,
    progress,
    recording_failure,
    timed_fn,
)

HELP = (
    "models: one call per model family (Llama, Phi, Gemma 2, DeepSeek MLA, gpt-oss sinks, "
    "ViT/BERT dropout) beside the nearest plain call and cuDNN (a tiny interpreted smoke run "
    "on a CPU)"
)
FLAGS = ("--repeats",)
FLAGS_ON_CPU = ()  # the smoke run times each call once


def model_cases(scale: int = 1):
    """The models suite: one case per model family's attention, as the family runs it in bf16.

    Yields (family, variant, kwargs, shape, cudnn): the variant "model" is the family's call,
    "plain" the nearest call without the option cuDNN or the fast path lacks (sinks, dropout,
    soft cap, a value head dim of its own), timed beside it; shape = (B, T, N, K, H, Hv); cudnn:
    keyword arguments of `jax.nn.dot_product_attention(implementation="cudnn")` for its closest
    call, or None. `scale` divides the batch (a CPU smoke run)."""
    key = jax.random.key(11)
    window = lambda left: dict(local_window_size=(left, 0))  # noqa: E731
    families = [
        # (family, shape (B, T, N, K, H, Hv), the model's options, the plain call's, cuDNN's)
        ("Llama 3 8B, 3000 tokens", (2, 3000, 32, 8, 128, 128), {}, None, {}),
        ("Phi-3 mini, H=96", (4, 2048, 32, 32, 96, 96), {}, None, {}),
        (
            "Gemma 2 9B, soft cap, window 4k",
            (1, 8192, 16, 8, 256, 256),
            dict(logits_soft_cap=50.0, **window(4096)),
            window(4096),
            window(4096),
        ),
        ("DeepSeek V3 MLA, H 192/128", (2, 4096, 16, 16, 192, 128), {}, "same-head-dim", {}),
        (
            "gpt-oss, sinks, window 128",
            (2, 4096, 64, 8, 64, 64),
            dict(sinks="sinks", **window(128)),
            window(128),
            window(128),
        ),
        ("gpt-oss, sinks, full", (2, 4096, 64, 8, 64, 64), dict(sinks="sinks"), {}, {}),
        (
            "ViT-B/16 fine-tune, dropout 0.1",
            (256, 197, 12, 12, 64, 64),
            dict(dropout_rate=0.1, dropout_rng=key),
            {},
            {},
        ),
        (
            "BERT-base, 512 padded, dropout 0.1",
            (32, 512, 12, 12, 64, 64),
            dict(dropout_rate=0.1, dropout_rng=key, key_value_seq_lengths="lengths"),
            dict(key_value_seq_lengths="lengths"),
            dict(key_value_seq_lengths="lengths"),
        ),
    ]
    for family, shape, model, plain, cudnn in families:
        b, t, n, k, h, hv = shape
        shape = (max(1, b // scale), t, n, k, h, hv)
        causal = not family.startswith(("ViT", "BERT"))
        yield (
            family,
            "model",
            dict(is_causal=causal, **model),
            shape,
            (None if cudnn is None else dict(is_causal=causal, **cudnn)),
        )
        if plain == "same-head-dim":
            yield family, "plain", dict(is_causal=causal), (*shape[:5], h), None
        elif plain is not None:
            yield family, "plain", dict(is_causal=causal, **plain), shape, None


def _model_arrays(kwargs, shape, dtype):
    """(q, k, v, d_out) and the call's keyword arguments with its named arrays made: "sinks"
    (one logit per head), "lengths" (each sequence's keys, from half to all of T)."""
    b, t, n, k, h, hv = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
    v = jax.random.normal(keys[2], (b, t, k, hv), dtype)
    do = jax.random.normal(keys[3], (b, t, n, hv), dtype)
    made = {
        "sinks": jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32),
        "lengths": jnp.asarray(np.linspace(t // 2, t, b).astype(np.int32)),
    }
    kwargs = {name: made.get(x, x) if isinstance(x, str) else x for name, x in kwargs.items()}
    return (q, kk, v, do), kwargs


def _visible_pairs(t: int, kwargs) -> float:
    """The (query, key) pairs a causal / windowed / length-limited call computes, per head and
    batch entry on average (T = S)."""
    rows = np.arange(t)
    lo = np.zeros(t, np.int64)
    hi = np.full(t, t, np.int64)
    if kwargs.get("is_causal"):
        hi = rows + 1
    if "local_window_size" in kwargs:
        left, right = kwargs["local_window_size"]
        lo = np.maximum(lo, rows - left)
        hi = np.minimum(hi, rows + right + 1)
    pairs = np.maximum(hi - lo, 0)
    lengths = kwargs.get("key_value_seq_lengths")
    if lengths is not None:
        return float(np.mean([np.maximum(np.minimum(hi, n) - lo, 0).sum() for n in lengths]))
    return float(pairs.sum())


def run(args, *, on_gpu: bool) -> list[dict]:
    """Per model family (model_cases): ms of pallas_flash's call, of the nearest plain call and
    of cuDNN's closest call, forward and forward+backward, and TFLOP/s counting the visible
    pairs (2 * pairs * (H + Hv) per head forward; x 3.5 forward+backward). On a GPU also
    kernel_ms, the call's kernels in jax's profiler (`device_ms`): a lone call of ~0.2 ms
    shows the host's dispatch in its wall time, a model's jitted step does not. On a CPU: the
    cases at batch 1 and 1/64 of their lengths' work through the interpreter (a smoke run)."""
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rows = Rows(args.out)
    for family, variant, kwargs, shape, cudnn in model_cases(1 if on_gpu else 1 << 10):
        if not on_gpu:
            shape = (shape[0], min(shape[1], 64), *shape[2:])
        inputs, call_kwargs = _model_arrays(kwargs, shape, dtype)
        impls = [("pallas_flash", call_kwargs)]
        if cudnn is not None and on_gpu and variant == "model":
            impls.append(("cudnn", _model_arrays(cudnn, shape, dtype)[1]))
        pairs = _visible_pairs(shape[1], call_kwargs)
        for impl, kw in impls:
            name = impl if variant == "model" or impl == "cudnn" else "pallas_flash_plain"
            for pass_ in PASSES:
                row = _model_row(family, name, impl, kw, shape, dtype, pass_, inputs, pairs,
                                 repeats=args.repeats, on_gpu=on_gpu)  # fmt: skip
                rows.add(row)
                progress(
                    f"{family:36s} {name:20s} {pass_:7s} {row['ms']} ms {row['tflops']} "
                    f"TFLOP/s {row.get('error', '')}"
                )
    print_model_table(rows)
    return rows


def _model_row(family, name, impl, kw, shape, dtype, pass_, inputs, pairs, *, repeats, on_gpu):
    """One timed call of the models suite as a row."""
    b, t, n, k, h, hv = shape
    row = dict(
        suite="models",
        family=family,
        impl=name,
        B=b,
        T=t,
        N=n,
        K=k,
        H=h,
        Hv=hv,
        dtype=jnp.dtype(dtype).name,
        **{"pass": pass_},
    )
    if impl == "cudnn":
        fn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", **kw)
    else:
        fn = functools.partial(pallas_flash.flash_attention, interpret=not on_gpu, **kw)
    with recording_failure(row, "ms", "tflops"):
        timed = timed_fn(fn, pass_)
        ms = median_ms(timed, inputs, calls=10 if on_gpu else 1, repeats=repeats if on_gpu else 1)
        flops = 2.0 * b * n * pairs * (h + hv) * (3.5 if pass_ != "fwd" else 1)
        row.update(ms=round(ms, 4), tflops=float(f"{flops / ms / 1e9:.4g}"))
        if on_gpu:
            row.update(kernel_timing(timed, inputs, flops))
    return row


def print_model_table(rows, out=None):
    """Per family and pass: TFLOP/s of the model's call, the plain call and cuDNN (wall time),
    and the model's call's speed over cuDNN's (cuDNN's ms / ours) and over the plain call's
    (time per FLOP), in wall time and, where the rows have it, in kernel time."""
    by = {}
    for r in rows:
        by.setdefault((r["family"], r["pass"]), {})[r["impl"]] = r

    def ratio(num, den, key):
        both = num and den and num.get(key) and den.get(key)
        return f"{num[key] / den[key]:.2f}" if both else "-"

    def cell(r):
        return "-" if not r or r["tflops"] is None else f"{r['tflops']:.3g}"

    lines = []
    for (family, pass_), impls in by.items():
        ours, plain, cudnn = (impls.get(i) for i in ("pallas_flash", "pallas_flash_plain", "cudnn"))
        lines.append(
            [family, pass_, cell(ours), cell(plain), cell(cudnn)]
            + [ratio(cudnn, ours, "ms"), ratio(ours, plain, "tflops")]
            + [ratio(cudnn, ours, "kernel_ms"), ratio(ours, plain, "kernel_tflops")]
        )
    header = ["family", "pass", "pallas_flash TFLOP/s", "plain TFLOP/s", "cudnn TFLOP/s"]
    header += ["vs cudnn", "vs plain", "vs cudnn, kernels", "vs plain, kernels"]
    print_markdown(header, lines, out=out)
