"""The bench's timing library: the implementations by name, jit and warm-up, the median of
back-to-back calls, kernel times from jax's profiler, FLOP counts and rates, and the JSONL rows.

Every suite times through these functions, and so do `pallas_flash.tune` and the scripts in
benchmarks/ (through `pallas_flash.bench`, which re-exports them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import pallas_flash

PASSES = ("fwd", "fwd+bwd")


def attention_fn(impl: str, *, is_causal: bool, interpret: bool = False, block_sizes=None):
    """q, k, v -> out for one implementation name."""
    if impl in ("pallas_flash", "pallas_flash_triton", "pallas_flash_nondeterministic"):
        # "pallas_flash" is what a user gets (backend=None: the Mosaic GPU forward on Hopper
        # where it applies); "pallas_flash_triton" keeps every kernel on Triton;
        # "pallas_flash_nondeterministic" passes deterministic_grads=False (dQ's partials added
        # in any order, as cuDNN's backward adds them unless XLA's
        # --xla_gpu_deterministic_ops asks it not to).
        return functools.partial(
            pallas_flash.flash_attention,
            is_causal=is_causal,
            interpret=interpret,
            backend="triton" if impl == "pallas_flash_triton" else None,
            block_sizes=block_sizes,
            deterministic_grads=impl != "pallas_flash_nondeterministic",
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
    """FLOPs by the FlashAttention-2 paper's count: forward 4 * B * N * T * S * H, halved when
    causal; forward+backward 3.5 x forward (the backward is 2.5 x)."""
    flops = 4.0 * b * n * t * s * h
    if causal:
        flops /= 2
    return flops * (3.5 if pass_ == "fwd+bwd" else 1.0)


def tbps(nbytes: float, ms: float) -> float:
    """TB/s of moving `nbytes` in `ms` milliseconds."""
    return nbytes / ms / 1e9


def make_inputs(b, t, s, n, k, h, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, s, k, h), dtype)
    v = jax.random.normal(keys[2], (b, s, k, h), dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), dtype)
    return q, kk, v, do


def failure(e: Exception) -> str:
    """A row's `error` field: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:200]}"


@contextlib.contextmanager
def recording_failure(row: dict, *fields: str):
    """Runs the block that measures `row`: an exception from it becomes the row's `error`
    (`failure`), with `fields` (what the block would have measured) None. An implementation
    failing (out of memory, a shape it refuses) is data, not a crash."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- see the docstring
        row.update(dict.fromkeys(fields), error=failure(e))


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
    with recording_failure(row, "ms", "tflops"):
        fn = attention_fn(impl, is_causal=causal, interpret=interpret, block_sizes=block_sizes)
        args = make_inputs(b, t, s, n, k, h, dtype)
        timed = timed_fn(fn, pass_)
        ms = median_ms(timed, args, calls=calls, repeats=repeats)
        flops = attention_flops(b, t, s, n, h, causal, pass_)
        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        if kernel_time:
            row.update(kernel_timing(timed, args, flops))
    return row


class Rows(list):
    """The rows of one run, each also appended to the JSONL file at `path` as it is added (a
    run cut short keeps what it measured); path None: no file."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def add(self, row: dict) -> dict:
        # Every row names the card it was measured on: results are compared within one card.
        row.setdefault("device", jax.devices()[0].device_kind)
        self.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def progress(line: str) -> None:
    """One measurement's line, as it comes, on stderr: stdout holds the tables."""
    print(line, file=sys.stderr, flush=True)


def print_markdown(header, lines, *, title=None, out=None) -> None:
    """A markdown table (every header cell with its unit), after a blank line and its title;
    None cells print as "-". out: a file (None: stdout)."""
    out = out or sys.stdout
    print(file=out)
    if title:
        print(title, file=out)
    print("| " + " | ".join(header) + " |", file=out)
    print("|" + "---|" * len(header), file=out)
    for cells in lines:
        print("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |", file=out)
