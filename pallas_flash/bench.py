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
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash import device as device_lib

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


def device_ms(f, args, *, calls: int = 20) -> tuple[float, dict[str, float]]:
    """(ms per call of f's GPU kernels, summed: the median over `calls` back-to-back calls
    after a warm-up; {kernel name: mean ms per call}), read from jax's profiler. Unlike
    `median_ms` it leaves out what the host spends dispatching a call and the gaps between
    kernels: what a call costs inside a larger jitted step (a model's decode step), where a
    short call's wall time is the host's. The median, not the mean: the same kernel's mean
    over 20 calls read 0.674 and 0.724 ms in one process on the H200
    (docs/notes/method.md, "Timing"). GPU only (the trace's /device:GPU planes)."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        paths = [
            os.path.join(root, name)
            for root, _, names in os.walk(trace_dir)
            for name in names
            if name.endswith(".xplane.pb")
        ]
        data = jax.profiler.ProfileData.from_file(paths[0])
    kernels: dict[str, float] = {}
    planes = []  # per GPU, (start, ms) of every kernel
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = []
        # Kernels run on the stream lines; the "XLA Ops" and "XLA Modules" lines repeat them.
        for line in plane.lines:
            if line.name.startswith("Stream"):
                for event in line.events:
                    ms = event.duration_ns / 1e6
                    kernels[event.name] = kernels.get(event.name, 0.0) + ms / calls
                    events.append((event.start_ns, ms))
        planes.append(events)
    return per_call_median(planes, calls), kernels


def per_call_median(planes, calls: int) -> float:
    """The median over calls of each call's summed kernel ms: each plane's (a GPU's) (start,
    ms) events taken in start order, as many per call, summed over the planes. The mean
    instead where a plane's events do not divide evenly into the calls."""
    sums = [0.0] * calls
    for events in planes:
        per_call, left = divmod(len(events), calls)
        if per_call == 0 or left:
            return sum(ms for events in planes for _, ms in events) / calls
        ordered = [ms for _, ms in sorted(events)]
        for i in range(calls):
            sums[i] += sum(ordered[i * per_call : (i + 1) * per_call])
    return statistics.median(sums)


def kernel_timing(f, args, flops: float) -> dict:
    """kernel_ms (f's kernels per call in jax's profiler, `device_ms`) and kernel_tflops."""
    ms = device_ms(f, args)[0]
    return dict(kernel_ms=round(ms, 4), kernel_tflops=round(flops / ms / 1e9, 1))


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
    kernel_time=False,
):
    """One measurement as a dict (ms and tflops are None, with an error, if the call failed).
    kernel_time (GPU only): also kernel_ms and kernel_tflops, the call's kernels in jax's
    profiler (`device_ms`), steadier than wall time for short calls."""
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
        timed = timed_fn(fn, pass_)
        ms = median_ms(timed, args, calls=calls, repeats=repeats)
        flops = attention_flops(b, t, s, n, h, causal, pass_)
        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        if kernel_time:
            row.update(kernel_timing(timed, args, flops))
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


def shapes_grid():
    """The shapes suite: lengths that are not multiples of the tiles and head dims other than
    64/128, as models use them, at batches that fill an H200 (about 16k tokens or more).
    Llama-like T = S = 3000 (hidden 2048, H=128); ViT-B at 224 px (197 tokens, 12 heads of 64)
    and ViT-L at 384 px (577 tokens, 16 heads of 64); Phi-like H=80 and H=96 (32 heads) at 2k;
    H=192 at 4k (both on Mosaic, split dK/dV consumers). Before those, the calls off the FA2
    grid that real models make (H=128 unless said): MQA (32 query heads over 1 KV head, 2k,
    causal), GQA (32 over 8, 4k, causal), cross-attention (1k queries over 8k keys), one 64k
    causal GQA sequence, H=256 causal at 4k. Masked calls (windows, packed documents, padding)
    are the masks suite's."""
    yield dict(b=8, t=2048, s=2048, n=32, k=1, h=128, causal=True)
    yield dict(b=4, t=4096, s=4096, n=32, k=8, h=128, causal=True)
    yield dict(b=16, t=1024, s=8192, n=16, k=16, h=128, causal=False)
    yield dict(b=1, t=65536, s=65536, n=32, k=8, h=128, causal=True)
    yield dict(b=4, t=4096, s=4096, n=8, k=8, h=256, causal=True)
    yield dict(b=5, t=3000, s=3000, n=16, k=16, h=128, causal=True)
    yield dict(b=5, t=3000, s=3000, n=16, k=16, h=128, causal=False)
    yield dict(b=256, t=197, s=197, n=12, k=12, h=64, causal=False)
    yield dict(b=64, t=577, s=577, n=16, k=16, h=64, causal=False)
    for h in (96, 80):
        for causal in (True, False):
            yield dict(b=8, t=2048, s=2048, n=32, k=32, h=h, causal=causal)
    yield dict(b=4, t=4096, s=4096, n=16, k=16, h=192, causal=True)


def mosaic_calls(impl, p, dtype, pass_) -> int | None:
    """How many Mosaic GPU kernels the jitted call of a pallas_flash implementation launches
    (3: Mosaic forward and backward; 1: Mosaic forward, Triton backward; 0: Triton)."""
    if not impl.startswith("pallas_flash"):
        return None
    fn = attention_fn(impl, is_causal=p["causal"])
    args = make_inputs(p["b"], p["t"], p["s"], p["n"], p["k"], p["h"], dtype)
    try:
        return timed_fn(fn, pass_).lower(*args).as_text().count("mosaic_gpu_v2")
    except Exception:  # noqa: BLE001 -- the timing row records the failure
        return None


def print_table(rows, impls, out=sys.stdout, metric="tflops"):
    """TFLOP/s (or ms) per implementation, and pallas_flash / cudnn, per grid point and pass;
    also pallas_flash / cudnn in kernel time where the rows have it (run_point's kernel_time)."""
    by_point, kernels = {}, {}
    for r in rows:
        key = (r["H"], r["causal"], r["T"], r["S"], r["B"], r["N"], r["K"], r["pass"])
        by_point.setdefault(key, {})[r["impl"]] = r[metric]
        kernels.setdefault(key, {})[r["impl"]] = r.get("kernel_tflops")
    header = ["H", "causal", "seq", "B", "heads", "pass", *impls]
    if "cudnn" in impls and "pallas_flash" in impls:
        header.append("pf/cudnn")
        if any(r.get("kernel_tflops") for r in rows):
            header.append("pf/cudnn, kernels")
    print("| " + " | ".join(header) + " |", file=out)
    print("|" + "---|" * len(header), file=out)
    for key, vals in sorted(by_point.items()):
        h, causal, t, s, b, n, k, pass_ = key
        # T, or T/S for cross-attention; N, or N/K for GQA.
        seq, heads = str(t) if t == s else f"{t}/{s}", str(n) if n == k else f"{n}/{k}"
        cells = [str(h), str(int(causal)), seq, str(b), heads, pass_]
        cells += [
            "-" if vals.get(i) is None else f"{vals[i]:.{0 if metric == 'tflops' else 2}f}"
            for i in impls
        ]
        for column, got in (("pf/cudnn", vals), ("pf/cudnn, kernels", kernels[key])):
            if column in header:
                pf, cu = got.get("pallas_flash"), got.get("cudnn")
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
                f.flush()
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


def run_model_suite(out_path, repeats, *, on_gpu: bool):
    """Per model family (model_cases): ms of pallas_flash's call, of the nearest plain call and
    of cuDNN's closest call, forward and forward+backward, and TFLOP/s counting the visible
    pairs (2 * pairs * (H + Hv) per head forward; x 3.5 forward+backward). On a GPU also
    kernel_ms, the call's kernels in jax's profiler (`device_ms`): a lone call of ~0.2 ms
    shows the host's dispatch in its wall time, a model's jitted step does not. On a CPU: the
    cases at batch 1 and 1/64 of their lengths' work through the interpreter (a smoke run)."""
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rows = []
    with open(out_path, "a") as f:
        for family, variant, kwargs, shape, cudnn in model_cases(1 if on_gpu else 1 << 10):
            if not on_gpu:
                shape = (shape[0], min(shape[1], 64), *shape[2:])
            args, call_kwargs = _model_arrays(kwargs, shape, dtype)
            impls = [("pallas_flash", call_kwargs)]
            if cudnn is not None and on_gpu:
                impls.append(("cudnn", _model_arrays(cudnn, shape, dtype)[1]))
            b, t, n, _, h, hv = shape
            pairs = _visible_pairs(t, call_kwargs)
            for impl, kw in impls:
                for pass_ in PASSES:
                    name = impl if variant == "model" or impl == "cudnn" else "pallas_flash_plain"
                    if variant == "plain" and impl == "cudnn":
                        continue
                    row = dict(
                        suite="models",
                        family=family,
                        impl=name,
                        B=b,
                        T=t,
                        N=n,
                        K=shape[3],
                        H=h,
                        Hv=hv,
                        dtype=jnp.dtype(dtype).name,
                        **{"pass": pass_},
                    )
                    if impl == "cudnn":
                        fn = functools.partial(
                            jax.nn.dot_product_attention, implementation="cudnn", **kw
                        )
                    else:
                        fn = functools.partial(
                            pallas_flash.flash_attention, interpret=not on_gpu, **kw
                        )
                    try:
                        timed = timed_fn(fn, pass_)
                        ms = median_ms(
                            timed,
                            args,
                            calls=10 if on_gpu else 1,
                            repeats=repeats if on_gpu else 1,
                        )
                        flops = 2.0 * b * n * pairs * (h + hv) * (3.5 if pass_ != "fwd" else 1)
                        row.update(ms=round(ms, 4), tflops=float(f"{flops / ms / 1e9:.4g}"))
                        if on_gpu:
                            row.update(kernel_timing(timed, args, flops))
                    except Exception as e:  # noqa: BLE001 -- a peer refusing a shape is data
                        row.update(
                            ms=None, tflops=None, error=f"{type(e).__name__}: {str(e)[:200]}"
                        )
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(
                        f"{family:36s} {name:20s} {pass_:7s} {row['ms']} ms {row['tflops']} "
                        f"TFLOP/s {row.get('error', '')}",
                        flush=True,
                    )
    print_model_table(rows)
    return rows


def print_model_table(rows, out=sys.stdout):
    """Per family and pass: TFLOP/s of the model's call, the plain call and cuDNN (wall time),
    and the model's call's speed over cuDNN's (cuDNN's ms / ours) and over the plain call's
    (time per FLOP), in wall time and, where the rows have it, in kernel time."""
    by = {}
    for r in rows:
        by.setdefault((r["family"], r["pass"]), {})[r["impl"]] = r
    print(
        "\n| family | pass | pallas_flash | plain | cudnn | vs cudnn | vs plain "
        "| vs cudnn, kernels | vs plain, kernels |\n|---|---|---|---|---|---|---|---|---|",
        file=out,
    )

    def ratio(num, den, key):
        both = num and den and num.get(key) and den.get(key)
        return f"{num[key] / den[key]:.2f}" if both else "-"

    for (family, pass_), impls in by.items():
        ours, plain, cudnn = (impls.get(i) for i in ("pallas_flash", "pallas_flash_plain", "cudnn"))
        cell = lambda r: "-" if not r or r["tflops"] is None else f"{r['tflops']:.3g}"  # noqa: E731
        print(
            f"| {family} | {pass_} | {cell(ours)} | {cell(plain)} | {cell(cudnn)} "
            f"| {ratio(cudnn, ours, 'ms')} | {ratio(ours, plain, 'tflops')} "
            f"| {ratio(cudnn, ours, 'kernel_ms')} | {ratio(ours, plain, 'kernel_tflops')} |",
            file=out,
        )


def run_scale_suite(out_path, repeats, seqs, on_gpu):
    """Context parallelism: causal ring attention (zig-zag) on 1, 2, 4, 8 devices of this host
    at each global sequence length, beside the plain single-device call; then decode over a
    cache split across the devices (`_scale_decode_rows`).

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
        rows += _scale_decode_rows(f, counts, repeats, on_gpu)
    return rows


def _scale_decode_rows(f, counts, repeats, on_gpu):
    """Decode over a cache split across devices: its heads (tensor parallelism) or its
    sequence (context parallelism), one new token, on 1, 2, 4, 8 devices. Per row: ms per call
    and the TB/s of K/V read summed over the devices, and per device. On a GPU: bf16, B=8,
    128k keys, N=32 over K=8, H=128; on a CPU (the interpreter on fake devices) a toy."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if on_gpu:
        case = dict(B=8, S=1 << 17, N=32, K=8, H=128, T=1, page=None, ragged=False)
        dtype, interpret = jnp.bfloat16, False
    else:
        case = dict(B=2, S=256, N=4, K=2, H=32, T=1, page=None, ragged=False)
        dtype, interpret = jnp.float32, True
    q, k, v, lengths, _ = decode_inputs(case, dtype)
    kv_bytes = 2 * int(jnp.sum(lengths)) * case["K"] * case["H"] * jnp.dtype(dtype).itemsize
    rows = []
    for split in ("heads", "sequence"):
        for devices in counts:
            if split == "heads" and case["K"] % devices:
                continue
            mesh = jax.sharding.Mesh(jax.devices()[:devices], ("model",))
            if split == "heads":
                queries = cache = NamedSharding(mesh, P(None, None, "model"))
            else:
                queries, cache = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "model"))
            row = dict(suite="scale", impl=f"decode_{split}", devices=devices, **case)
            row.update(dtype=jnp.dtype(dtype).name, **{"pass": "fwd"})
            try:
                placed = [
                    jax.device_put(x, s)
                    for x, s in zip(
                        (q, k, v, lengths), (queries, cache, cache, NamedSharding(mesh, P()))
                    )
                ]
                fn = jax.jit(
                    lambda q, k, v, lens: pallas_flash.decode_attention(
                        q, k, v, key_value_seq_lengths=lens, interpret=interpret
                    )
                )
                ms = median_ms(fn, placed, calls=10 if on_gpu else 1, repeats=repeats)
                tbps = kv_bytes / (ms * 1e-3) / 1e12
                row.update(
                    ms=round(ms, 4), tbps=round(tbps, 3), tbps_per_device=round(tbps / devices, 3)
                )
            except Exception as e:  # noqa: BLE001
                row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(
                f"decode over {split:8s} devices={devices} {row.get('ms')} ms "
                f"{row.get('tbps')} TB/s ({row.get('tbps_per_device')} per device) "
                f"{row.get('error', '')}",
                flush=True,
            )
    return rows


# -- compile time ------------------------------------------------------------------------------


def layered_grad(impl, layers, *, is_causal=True, interpret=False):
    """jit(grad) of a loss over `layers` attention layers, each on its own q, k, v: what a model
    written as a Python loop over its layers asks the compiler to build."""
    if impl == "pallas_flash_window":
        fn = functools.partial(
            pallas_flash.flash_attention,
            is_causal=is_causal,
            local_window_size=(1024, 0),
            interpret=interpret,
        )
    else:
        fn = attention_fn(impl, is_causal=is_causal, interpret=interpret)

    def loss(qkvs):
        return sum(fn(q, k, v).astype(jnp.float32).mean() for q, k, v in qkvs)

    return jax.jit(jax.grad(loss))


def compile_row(impl, layers, b, t, n, h, dtype, *, interpret=False) -> dict:
    """Lowering, compile and first-call times of `layered_grad` in this process."""
    row = dict(
        suite="compile", impl=impl, layers=layers, B=b, T=t, N=n, H=h,
        dtype=jnp.dtype(dtype).name, causal=True,
        cache="on" if jax.config.jax_compilation_cache_dir else "off",
    )  # fmt: skip
    try:
        args = [make_inputs(b, t, t, n, n, h, dtype, seed=i)[:3] for i in range(layers)]
        f = layered_grad(impl, layers, interpret=interpret)
        start = time.perf_counter()
        lowered = f.trace(args).lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
        jax.block_until_ready(compiled(args))
        called_at = time.perf_counter()
        row.update(
            lower_s=round(lowered_at - start, 3),
            compile_s=round(compiled_at - lowered_at, 3),
            first_call_ms=round((called_at - compiled_at) * 1e3, 1),
        )
    except Exception as e:  # noqa: BLE001 -- an implementation failing is data, not a crash
        row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
    return row


def _compile_row_in_subprocess(impl, layers, shape, *, interpret, cache_dir=None) -> dict:
    """compile_row in a fresh Python process: nothing compiled by earlier rows (jax's and Mosaic
    GPU's in-memory caches) helps it, as after a restart."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    spec = json.dumps(dict(impl=impl, layers=layers, shape=shape, interpret=interpret))
    proc = subprocess.run(
        [sys.executable, "-m", "pallas_flash.bench", "--compile-row", spec],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return dict(suite="compile", impl=impl, layers=layers, error=proc.stderr[-300:])


def run_compile_suite(out_path, impls, layer_counts, shape, *, interpret):
    """One fresh process per (implementation, layer count); then the persistent compilation
    cache: the deepest model of each pallas_flash implementation compiled by two processes that
    share a new cache directory (the second should only load)."""
    rows = []

    def record(row, label=""):
        rows.append(row)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        shown = row.get("error") or (
            f"lower {row['lower_s']:.2f} s  compile {row['compile_s']:.2f} s  "
            f"first call {row['first_call_ms']:.0f} ms"
        )
        print(f"{row['impl']:22s} L={row['layers']:3d} {label:12s} {shown}", flush=True)

    for impl in impls:
        for layers in layer_counts:
            record(_compile_row_in_subprocess(impl, layers, shape, interpret=interpret))
    for impl in [i for i in impls if i.startswith("pallas_flash")]:
        with tempfile.TemporaryDirectory() as cache_dir:
            for label in ("cache cold", "cache warm"):
                row = _compile_row_in_subprocess(
                    impl, max(layer_counts), shape, interpret=interpret, cache_dir=cache_dir
                )
                row["cache"] = label.split()[1]
                record(row, label)
    print("\n| impl | layers | cache | lower s | compile s | first call ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [r.get(k, "-") for k in ("lower_s", "compile_s", "first_call_ms")]
        print(
            f"| {r['impl']} | {r['layers']} | {r.get('cache', '-')} | "
            + " | ".join(map(str, cells))
            + " |"
        )
    return rows


# -- decode ----------------------------------------------------------------------------------------


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


def _decode_lengths(case, seed=0):
    if not case["ragged"]:
        return jnp.full((case["B"],), case["S"], jnp.int32)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(case["S"] // 32, case["S"] + 1, case["B"]), jnp.int32)


def decode_inputs(case, dtype, seed=0):
    """(q, k, v, lengths, block_tables): contiguous caches, or with case["page"] pages in
    shuffled order (block_tables None for a contiguous cache)."""
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
    k = jax.random.normal(keys[1], shape, dtype)
    v = jax.random.normal(keys[2], shape, dtype)
    return q, k, v, lengths, tables


def decode_fns(case, *, interpret: bool):
    """{impl: jitted fn(q, k, v, lengths, tables) -> out} for one case. jax.nn's attention
    (XLA, cuDNN) takes the contiguous cache, with the causal rule among the new tokens as a
    mask aligned to the end of each sequence."""
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
            )
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


def decode_kv_bytes(case, lengths, itemsize: int) -> int:
    """Bytes of K and V a decode step must read: each sequence's own keys."""
    keys = int(np.minimum(np.asarray(lengths), case["S"]).sum())
    return 2 * keys * case["K"] * case["H"] * itemsize


def run_decode_suite(out_path, repeats, *, quick: bool, on_gpu: bool):
    """Per case: ms and TB/s of K/V bytes read for pallas_flash, jax.nn's XLA and cuDNN
    attention, and a device-to-device copy of the same bytes (its TB/s counts the bytes read
    and written: the practical ceiling of a read-only kernel)."""
    if on_gpu:
        cases, dtype, interpret, calls = list(decode_cases(quick)), jnp.bfloat16, False, 10
    else:
        print(
            "No NVIDIA GPU of compute capability >= 8.0 found: running tiny decode shapes in the "
            "Pallas interpreter (times are not GPU performance).",
            flush=True,
        )
        cases = [
            dict(B=2, S=256, N=8, K=2, H=64, T=t, ragged=r, page=p)
            for t, r, p in ((1, False, None), (4, True, None), (1, True, 16))
        ]
        dtype, interpret, calls, repeats = jnp.float32, True, 1, min(repeats, 2)
    rows = []
    with open(out_path, "a") as f:
        for case in cases:
            q, k, v, lengths, tables = decode_inputs(case, dtype)
            nbytes = decode_kv_bytes(case, lengths, jnp.dtype(dtype).itemsize)
            flat = jnp.zeros((nbytes // 2,), jnp.bfloat16)
            runs = [
                (impl, fn, (q, k, v, lengths, tables))
                for impl, fn in decode_fns(case, interpret=interpret).items()
            ]
            runs.append(("memcpy", jax.jit(jnp.copy), (flat,)))
            for impl, fn, args in runs:
                row = dict(suite="decode", impl=impl, dtype=jnp.dtype(dtype).name, **case)
                traffic = 2 * nbytes if impl == "memcpy" else nbytes
                try:
                    ms = median_ms(fn, args, calls=calls, repeats=repeats)
                    row.update(ms=round(ms, 5), tbps=round(traffic / ms / 1e9, 4))
                    if on_gpu:
                        kernel_ms, kernels = device_ms(fn, args)
                        row.update(
                            device_ms=round(kernel_ms, 5),
                            device_tbps=round(traffic / kernel_ms / 1e9, 4),
                            kernels={name: round(t, 5) for name, t in kernels.items()},
                        )
                except Exception as e:  # noqa: BLE001 -- cuDNN refusing T=1 is data
                    row.update(ms=None, tbps=None, error=f"{type(e).__name__}: {str(e)[:200]}")
                row["kv_bytes"] = nbytes
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                shown = (
                    f"{row['ms']:.4f} ms {row['tbps']:.2f} TB/s"
                    if row["ms"] is not None
                    else "failed: " + row["error"][:80]
                )
                if row.get("device_ms") is not None:
                    shown += f", kernels {row['device_ms']:.4f} ms {row['device_tbps']:.2f} TB/s"
                print(f"{_decode_name(case):34s} {impl:13s} {shown}", flush=True)
            del q, k, v, flat
    print_decode_table(rows)


def _decode_name(case) -> str:
    name = f"B{case['B']} S{case['S']} N{case['N']}/K{case['K']} H{case['H']} T{case['T']}"
    if case["ragged"]:
        name += " ragged"
    if case["page"]:
        name += f" page{case['page']}"
    return name


def print_decode_table(rows, out=sys.stdout):
    """One table of each call's wall time (`ms`, host dispatch included) and, where measured,
    one of its kernels' time (`device_ms`)."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by_case = {}
    for r in rows:
        by_case.setdefault(_decode_name(r), {})[r["impl"]] = r
    for key, title in (("ms", "wall time per call"), ("device_ms", "kernel time per call")):
        if not any(r.get(key) is not None for r in rows):
            continue
        rate = "tbps" if key == "ms" else "device_tbps"
        print(f"\n{title}, ms (TB/s of K/V read):", file=out)
        print("| case | " + " | ".join(impls) + " | pf / memcpy |", file=out)
        print("|---|" + "---|" * (len(impls) + 1), file=out)
        for name, got in by_case.items():
            cells = [
                "-"
                if got.get(i, {}).get(key) is None
                else f"{got[i][key]:.3f} ({got[i][rate]:.2f})"
                for i in impls
            ]
            # pf's TB/s over memcpy's (which counts bytes read and written)
            pf, mc = got.get("pallas_flash", {}).get(key), got.get("memcpy", {}).get(key)
            cells.append(f"{mc / (2 * pf):.2f}" if pf and mc else "-")
            print(f"| {name} | " + " | ".join(cells) + " |", file=out)


# The flags each suite reads on a GPU (--out: every suite); another one given is an error, not
# ignored.
SUITE_FLAGS = {
    "grid": ("--head-dims", "--seqs", "--impls", "--passes", "--causal", "--repeats"),
    "shapes": ("--impls", "--passes", "--causal", "--repeats"),
    "models": ("--repeats",),
    "masks": ("--repeats",),
    "compile": ("--impls", "--layers"),
    "decode": ("--repeats", "--quick"),
    "scale": ("--repeats", "--seqs"),
}
# Without a GPU the grid, models and decode suites run fixed interpreted demos, which read
# fewer (the models demo times each call once; the decode demo's shapes are all tiny).
SUITE_FLAGS_ON_CPU = {
    "grid": ("--passes", "--causal", "--repeats"),
    "models": (),
    "decode": ("--repeats",),
}


def suite_flags(suite: str, on_gpu: bool) -> tuple[str, ...]:
    """The flags besides --out that `suite` reads, on a GPU or (on_gpu False) without one."""
    return SUITE_FLAGS[suite] if on_gpu else SUITE_FLAGS_ON_CPU.get(suite, SUITE_FLAGS[suite])


def given_flags(argv) -> set[str]:
    """The flags (--name, with or without =value) on the command line argv."""
    return {token.split("=")[0] for token in argv if token.startswith("--") and token != "--"}


def _given_flags(parser, argv, suite: str, on_gpu: bool) -> set[str]:
    """The flags given on the command line argv; parser.error naming those that `suite` would
    not read."""
    given = given_flags(argv)
    reads = suite_flags(suite, on_gpu)
    unread = sorted(given - {"--suite", "--out", *reads})
    if unread:
        demo = not on_gpu and suite in SUITE_FLAGS_ON_CPU
        where = " without an NVIDIA GPU (a fixed demo)" if demo else ""
        parser.error(
            f"--suite {suite}{where} does not take {', '.join(unread)}; it takes "
            f"{', '.join(('--out', *reads))}"
        )
    return given


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default per suite)")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["pallas_flash", "cudnn", "xla"],
        choices=[
            "pallas_flash",
            "pallas_flash_triton",
            "pallas_flash_window",
            "cudnn",
            "xla",
            "jax_pallas",
        ],
        help="pallas_flash_window: a causal 1024-key window (--suite compile only)",
    )
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--out", default="bench.jsonl", help="JSONL file to append results to")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--suite",
        choices=["grid", "shapes", "models", "masks", "compile", "decode", "scale"],
        default="grid",
        help="grid: the FA2 paper's grid; shapes: lengths off the tile grid (3000, ViT's 197 "
        "and 577) and head dims 80, 96, 192, beside cuDNN (GPU only; --impls default "
        "pallas_flash, pallas_flash_triton, cudnn); models: one call per model family (Llama, "
        "Phi, Gemma 2, DeepSeek MLA, gpt-oss sinks, ViT/BERT dropout) beside the nearest plain "
        "call and cuDNN (a tiny interpreted smoke run on a CPU); masks: packed documents, "
        "windows, padding (GPU only); "
        "compile: lowering and compile time of a jit(grad) over 1, 6 and 24 causal layers; "
        "decode: decode_attention / paged_attention in TB/s of K/V read (tiny interpreted "
        "shapes on a CPU); scale: causal ring attention on 1/2/4/8 devices of this host "
        "(--seqs: global lengths), then decode over a cache split over heads or sequence",
    )
    parser.add_argument(
        "--quick", action="store_true", help="decode: the headline shape and a few variants only"
    )
    parser.add_argument("--layers", type=int, nargs="+", help="--suite compile's layer counts")
    parser.add_argument("--compile-row", help=argparse.SUPPRESS)  # one row, in a subprocess
    args = parser.parse_args(argv)

    if args.compile_row:
        spec = json.loads(args.compile_row)
        b, t, n, h = spec["shape"]
        dtype = jnp.float32 if spec["interpret"] else jnp.bfloat16
        row = compile_row(
            spec["impl"], spec["layers"], b, t, n, h, dtype, interpret=spec["interpret"]
        )
        print(json.dumps(row), flush=True)
        return
    on_gpu = (device_lib.gpu_compute_capability() or (0, 0)) >= (8, 0)
    given = _given_flags(parser, sys.argv[1:] if argv is None else argv, args.suite, on_gpu)
    if "pallas_flash_window" in args.impls and args.suite != "compile":
        parser.error("--impls pallas_flash_window is a compile-suite row (a causal 1024 window)")
    if args.suite == "scale":
        run_scale_suite(args.out, args.repeats, args.seqs, on_gpu)
        return
    args.seqs = args.seqs or [512, 1024, 2048, 4096, 8192, 16384]
    if args.suite == "compile":
        if on_gpu:
            # One layer of a long-context model: B=1, T=8192, N=16, H=128, causal, bf16.
            impls = ["pallas_flash", "pallas_flash_triton", "pallas_flash_window", "cudnn"]
            shape, layers, interpret = (1, 8192, 16, 128), args.layers or [1, 6, 24], False
        else:
            print("No NVIDIA GPU: compile times of the interpret-mode kernels on a toy model.")
            impls, shape, interpret = ["pallas_flash", "xla"], (1, 128, 2, 64), True
            layers = args.layers or [1, 6]
        if "--impls" in given:
            impls = args.impls
        run_compile_suite(args.out, impls, layers, shape, interpret=interpret)
        return
    if args.suite == "decode":
        run_decode_suite(args.out, args.repeats, quick=args.quick, on_gpu=on_gpu)
        return
    if args.suite == "models":
        run_model_suite(args.out, args.repeats, on_gpu=on_gpu)
        return
    if args.suite == "masks":
        if not on_gpu:
            raise SystemExit("--suite masks needs an NVIDIA GPU (sm80+)")
        run_mask_suite(args.out, args.repeats)
        return
    if args.suite == "shapes" and not on_gpu:
        raise SystemExit("--suite shapes needs an NVIDIA GPU (sm80+)")
    if args.suite == "shapes":
        grid = list(shapes_grid())
        impls, interpret, dtype, calls = args.impls, False, jnp.bfloat16, 10
        if "--impls" not in given:
            impls = ["pallas_flash", "pallas_flash_triton", "cudnn"]
        print(
            f"GPU: {jax.devices()[0].device_kind}; {len(grid)} shapes x {len(args.passes)} "
            f"passes x {len(impls)} implementations",
            flush=True,
        )
    elif on_gpu:
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
                        kernel_time=on_gpu,
                    )
                    if args.suite == "shapes":
                        row.update(suite="shapes", mosaic_calls=mosaic_calls(impl, p, dtype, pass_))
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    shown = (
                        "failed: " + row["error"]
                        if row["tflops"] is None
                        else (f"{row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s")
                    )
                    kernels = (
                        f" mosaic_calls={row['mosaic_calls']}" if "mosaic_calls" in row else ""
                    )
                    print(
                        f"[{len(rows)}/{total}] {impl:12s} H={p['h']} T={p['t']} S={p['s']} "
                        f"B={p['b']} N={p['n']} K={p['k']} "
                        f"causal={int(p['causal'])} {pass_:7s} {shown}{kernels}",
                        flush=True,
                    )
    print()
    print_table(rows, impls, metric="tflops" if on_gpu else "ms")
    print(f"\nwrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
