"""`--suite scale`: causal ring attention on 1, 2, 4, 8 devices of this host beside the plain
single-device call, then decode over a cache split over heads or sequence."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flash
from pallas_flash.bench.decode import decode_inputs
from pallas_flash.bench.timing import (
    Rows,
    attention_flops,
    make_inputs,
    median_ms,
    print_markdown,
    progress,
    recording_failure,
    tbps,
    timed_fn,
)

HELP = (
    "scale: causal ring attention on 1/2/4/8 devices of this host (--seqs: global lengths), "
    "then decode over a cache split over heads or sequence"
)
FLAGS = ("--repeats", "--seqs")


def run(args, *, on_gpu: bool) -> list[dict]:
    """Context parallelism: causal ring attention (zig-zag) on 1, 2, 4, 8 devices of this host
    at each global sequence length, beside the plain single-device call; then decode over a
    cache split across the devices (`decode_rows`).

    Per row: step ms (forward+backward), TFLOP/s per device (the causal FLOP count of the whole
    sequence over the devices) and the scaling efficiency: that rate over the plain call's rate
    at the longest length it ran (the single-device rate flattens there). On a GPU: bf16, B=1,
    N=16, H=128 (hidden 2048), 128k to 1M tokens, the plain call up to 128k. On a CPU (smoke
    run on fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=8): float32, N=2,
    H=64, backend="xla" inside the ring, 512 and 1024 tokens; those times say nothing about
    GPUs."""
    repeats = args.repeats if on_gpu else min(args.repeats, 3)
    counts = [c for c in (1, 2, 4, 8) if c <= jax.device_count()]
    rows = Rows(args.out)
    ring_rows(rows, args.seqs, counts, repeats, on_gpu)
    decode_rows(rows, counts, repeats, on_gpu)
    print_scale_tables(rows)
    return rows


def print_scale_tables(rows, out=None):
    """The ring's rows (step ms, TFLOP/s per device, efficiency), then decode's (ms, TB/s of
    K/V read summed over the devices and per device)."""
    ring = [r for r in rows if not r["impl"].startswith("decode")]
    decode = [r for r in rows if r["impl"].startswith("decode")]
    if ring:
        print_markdown(
            ["impl", "devices", "T", "fwd+bwd ms", "TFLOP/s per device", "efficiency"],
            [
                [r["impl"], r["devices"], r["T"], r.get("ms"), r.get("tflops_per_device")]
                + [r.get("efficiency")]
                for r in ring
            ],
            out=out,
        )
    if decode:
        print_markdown(
            ["impl", "devices", "B", "S", "ms", "TB/s", "TB/s per device"],
            [
                [r["impl"], r["devices"], r["B"], r["S"], r.get("ms"), r.get("tbps")]
                + [r.get("tbps_per_device")]
                for r in decode
            ],
            out=out,
        )


def ring_rows(rows, seqs, counts, repeats, on_gpu):
    """The ring's rows (and the plain call's) at each global length into rows."""
    if on_gpu:
        n, h, dtype, backend, plain_max = 16, 128, jnp.bfloat16, None, 1 << 17
        seqs = seqs or [1 << 17, 1 << 18, 1 << 19, 1 << 20]
    else:
        n, h, dtype, backend, plain_max = 2, 64, jnp.float32, "xla", 1024
        seqs = seqs or [512, 1024]
    plain_rate = None
    for seq in seqs:
        inputs = make_inputs(1, seq, seq, n, n, h, dtype)
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
            with recording_failure(row, "ms"):
                fn, placed = _ring_call(impl, devices, inputs, backend)
                ms = median_ms(timed_fn(fn, "fwd+bwd"), placed, calls=1, repeats=repeats)
                rate = flops / (ms * 1e-3) / devices / 1e12
                if impl == "plain":
                    plain_rate = rate
                row.update(
                    ms=round(ms, 3),
                    tflops_per_device=round(rate, 3),
                    efficiency=round(rate / plain_rate, 3) if plain_rate else None,
                )
            rows.add(row)
            progress(
                f"{impl:5s} devices={devices} T={seq:8d} {row.get('ms')} ms "
                f"{row.get('tflops_per_device')} TFLOP/s/device "
                f"efficiency {row.get('efficiency')} {row.get('error', '')}"
            )


def _ring_call(impl, devices, inputs, backend):
    """(fn of q, k, v, inputs placed for it): the plain call, or the ring over `devices`."""
    if impl == "plain":
        return functools.partial(
            pallas_flash.flash_attention, is_causal=True, backend=backend
        ), inputs
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
    return fn, [jax.device_put(pallas_flash.to_zigzag(x, devices), seq_sharded) for x in inputs]


def decode_rows(rows, counts, repeats, on_gpu):
    """Decode over a cache split across devices: its heads (tensor parallelism) or its
    sequence (context parallelism), one new token, on 1, 2, 4, 8 devices. Per row: ms per call
    and the TB/s of K/V read summed over the devices, and per device. On a GPU: bf16, B=8,
    128k keys, N=32 over K=8, H=128; on a CPU (the interpreter on fake devices) a toy."""
    if on_gpu:
        case = dict(B=8, S=1 << 17, N=32, K=8, H=128, T=1, page=None, ragged=False)
        dtype, interpret = jnp.bfloat16, False
    else:
        case = dict(B=2, S=256, N=4, K=2, H=32, T=1, page=None, ragged=False)
        dtype, interpret = jnp.float32, True
    q, k, v, lengths, _ = decode_inputs(case, dtype)
    kv_bytes = 2 * int(jnp.sum(lengths)) * case["K"] * case["H"] * jnp.dtype(dtype).itemsize
    fn = jax.jit(
        lambda q, k, v, lens: pallas_flash.decode_attention(
            q, k, v, key_value_seq_lengths=lens, interpret=interpret
        )
    )
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
            with recording_failure(row, "ms"):
                shardings = (queries, cache, cache, NamedSharding(mesh, P()))
                placed = [jax.device_put(x, s) for x, s in zip((q, k, v, lengths), shardings)]
                ms = median_ms(fn, placed, calls=10 if on_gpu else 1, repeats=repeats)
                rate = tbps(kv_bytes, ms)
                row.update(
                    ms=round(ms, 4), tbps=round(rate, 3), tbps_per_device=round(rate / devices, 3)
                )
            rows.add(row)
            progress(
                f"decode over {split:8s} devices={devices} {row.get('ms')} ms "
                f"{row.get('tbps')} TB/s ({row.get('tbps_per_device')} per device) "
                f"{row.get('error', '')}"
            )
