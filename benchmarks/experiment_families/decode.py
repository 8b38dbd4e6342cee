"""decode_attention's split-KV and tile levers (`decode`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_flash
from experiment_families.common import error_text, record
from pallas_flash import bench
from pallas_flash.bench import decode as decode_suite

# name: dict(B, S, K, T, ragged) over B=8, S=32k, N=32, K=8, H=128, T=1, contiguous.
DECODE_SHAPES = {
    "head": {},
    "ragged": dict(ragged=True),
    "T16": dict(T=16),
    "S8k": dict(S=8192),
    "G16": dict(K=2),
    "B1": dict(B=1),
    "S1k": dict(S=1024),
    "G16xT16": dict(K=2, T=16),
    "G8xT16": dict(K=4, T=16),
    "P128": dict(page=128),
    "S128k": dict(S=131072),
}
# Candidates over the defaults (DecodeBlockSizes fields), per shape; every shape also runs
# "default" (the slots rule: two waves of CTA slots, lowered to a full last wave, splits of >= 1024
# keys unless cut in four or fewer, capped at 64, cut per sequence, merged in XLA), "cores" (the
# former default), "occupancy", "full_waves", "balanced", "balanced_cores" (the default's count,
# balanced) and "waves2".
DECODE_CANDIDATES = {
    "head": dict(
        occupancy_kernel_merge=dict(split_rule="occupancy", merge="kernel"),
        s16=dict(kv_splits=16),
        stages3=dict(num_stages=3),
        s8=dict(kv_splits=8),
    ),
    "ragged": dict(s16=dict(kv_splits=16), s32=dict(kv_splits=32)),
    "T16": dict(
        s4=dict(kv_splits=4),
        s8=dict(kv_splits=8),
        kv32=dict(block_kv=32),
        kv32s4_splits4=dict(block_kv=32, num_stages=4, kv_splits=4),
        kv32s4_kernel_merge=dict(block_kv=32, num_stages=4, merge="kernel"),
        m32=dict(block_m=32),
        stages1=dict(num_stages=1),
        balanced_stages1=dict(
            split_rule="occupancy", schedule="balanced", merge="kernel", num_stages=1
        ),
    ),
    "S8k": dict(s4=dict(kv_splits=4), s16=dict(kv_splits=16), stages3=dict(num_stages=3)),
    "G16": dict(s16=dict(kv_splits=16), s64=dict(kv_splits=64), stages3=dict(num_stages=3)),
    "B1": dict(
        s16=dict(kv_splits=16),
        s64=dict(kv_splits=64),
        stages3=dict(num_stages=3),
        kv128=dict(block_kv=128),
        # Deeper pipelines for a half wave of programs, and the merge in one kernel.
        kv32s4_kernel_merge=dict(block_kv=32, num_stages=4, merge="kernel"),
        kv32s4w2_kernel_merge=dict(block_kv=32, num_stages=4, num_warps=2, merge="kernel"),
        kv32s4_s64=dict(block_kv=32, num_stages=4, kv_splits=64),
        kv32s4_s48=dict(block_kv=32, num_stages=4, kv_splits=48),
        kv32s3=dict(block_kv=32, num_stages=3),
        kv32s5=dict(block_kv=32, num_stages=5),
        stages4=dict(num_stages=4),
        kv32s6=dict(block_kv=32, num_stages=6),
        kv32s8=dict(block_kv=32, num_stages=8),
        kv16s8=dict(block_kv=16, num_stages=8),
        w2=dict(num_warps=2),
        kv32s4w2=dict(block_kv=32, num_stages=4, num_warps=2),
        s16_stages4=dict(kv_splits=16, num_stages=4),
        s16_kv32s8=dict(kv_splits=16, block_kv=32, num_stages=8),
    ),
    "S1k": dict(
        s2=dict(kv_splits=2),
        s4=dict(kv_splits=4),
        s8=dict(kv_splits=8),
        s16=dict(kv_splits=16),
        unsplit=dict(kv_splits=1),
        kv128s1_kernel_merge=dict(block_kv=128, num_stages=1, merge="kernel"),
        kv32=dict(block_kv=32),
        kv32s3=dict(block_kv=32, num_stages=3),
        kv32_s8=dict(block_kv=32, kv_splits=8),
        stages3=dict(num_stages=3),
        w2=dict(num_warps=2),
        kv128s1=dict(block_kv=128, num_stages=1),
    ),
    "G16xT16": dict(
        m128w8=dict(block_m=128, num_warps=8),
        m32=dict(block_m=32),
        kv32s4_splits4=dict(block_kv=32, num_stages=4, kv_splits=4),
        m128w8_kv32s4=dict(block_m=128, num_warps=8, block_kv=32, num_stages=4),
        m128w8_s3=dict(block_m=128, num_warps=8, num_stages=3),
        m128w8_s4splits=dict(block_m=128, num_warps=8, kv_splits=4),
        m128w4=dict(block_m=128, num_warps=4),
        m128w4_kv32s4=dict(block_m=128, num_warps=4, block_kv=32, num_stages=4),
        m128w4_s4=dict(block_m=128, num_warps=4, kv_splits=4),
        m128w4_s16=dict(block_m=128, num_warps=4, kv_splits=16),
        m128w8_s8=dict(block_m=128, num_warps=8, kv_splits=8),
        m128w4_kernel_merge=dict(block_m=128, num_warps=4, merge="kernel"),
        m64w4_s8=dict(kv_splits=8),
        # A KV head's 256 rows in one tile: its K/V read once per split.
        m256w8=dict(block_m=256, num_warps=8),
        m256w8_kv32s4=dict(block_m=256, num_warps=8, block_kv=32, num_stages=4),
        m256w8_s16=dict(block_m=256, num_warps=8, kv_splits=16),
        m128w8_kv128=dict(block_m=128, num_warps=8, block_kv=128),
        m128w4_s3=dict(block_m=128, num_warps=4, num_stages=3),
    ),
    "G8xT16": dict(
        m128w4=dict(block_m=128, num_warps=4),
        m128w4_kv32s4=dict(block_m=128, num_warps=4, block_kv=32, num_stages=4),
        kv32s4=dict(block_kv=32, num_stages=4),
    ),
    "P128": {},
    "S128k": dict(s8=dict(kv_splits=8), s16=dict(kv_splits=16), s33=dict(kv_splits=33)),
}
DECODE_QUICK = ("head", "ragged", "T16", "S8k", "G16", "B1", "P128")


def decode(out, quick=False, calls_per_jit=4, smoke=False, only=None, cases=None):
    """smoke: tiny shapes in the interpreter, to check this code on a CPU; only: the candidate
    names to time (None: all); cases: the shapes (names of DECODE_SHAPES; None: all, or the
    quick ones). On a GPU each row also has the kernel time of one call (`kernel_ms`), and
    contiguous T=1 shapes a "cudnn" row."""
    from pallas_flash.device import DEFAULT_NUM_SMS
    from pallas_flash.triton import DecodeBlockSizes
    from pallas_flash.triton.decode import decode_plan

    device = pallas_flash.Device.current()
    num_sms = device.num_sms if device is not None else DEFAULT_NUM_SMS
    base = dict(B=8, S=32768, N=32, K=8, H=128, T=1, ragged=False, page=None)
    dtype, repeats = jnp.bfloat16, 5
    if smoke:
        base.update(S=256, N=8, K=2, H=64)
        dtype, repeats, calls_per_jit = jnp.float32, 1, 2
    for name in cases or (DECODE_QUICK if quick else DECODE_SHAPES):
        case = {**base, **DECODE_SHAPES[name]}
        if smoke:
            case.update(S=min(case["S"], 256), K=max(1, case["K"] // 4))
        q, k, v, lengths, tables = decode_suite.decode_inputs(case, dtype)
        qs = [q] + [q * (1 + i / 64) for i in range(1, calls_per_jit)]  # no CSE across calls
        nbytes = decode_suite.decode_kv_bytes(case, lengths, jnp.dtype(dtype).itemsize)
        default = DecodeBlockSizes(block_kv=16 if smoke else 128 if case["page"] else 64)
        candidates = {
            "default": {},
            "cores": dict(split_rule="cores"),
            "occupancy": dict(split_rule="occupancy"),
            "full_waves": dict(split_rule="full-waves"),
            "balanced": dict(split_rule="occupancy", schedule="balanced", merge="kernel"),
            # The default rule's split count, cut over the batch by length (planned in XLA).
            "balanced_cores": dict(schedule="balanced"),
            "waves2": dict(split_rule="occupancy", waves=2),
            # Twice the tiles in flight per program for the same shared memory.
            "kv32s4": dict(block_kv=32, num_stages=4),
            # The merge in one kernel (several items per step) instead of XLA's reductions.
            "kernel_merge": dict(merge="kernel"),
            **DECODE_CANDIDATES[name],
        }
        if only:
            candidates = {c: f for c, f in candidates.items() if c in only}
        for cand, fields in candidates.items():
            bs = dataclasses.replace(default, **fields)
            plan = decode_plan(q.shape, case["K"], case["S"], dtype, bs, num_sms=num_sms)
            row = dict(
                exp="decode",
                case=name,
                cand=cand,
                fields=fields,
                splits=plan.schedule.splits,
                ctas=plan.programs * plan.schedule.splits,
                slots=plan.slots,
                block_m=plan.block_m,
                block_kv=plan.block_kv,
                **{x: case[x] for x in ("B", "S", "K", "T", "ragged", "page")},
            )

            def one(q, k, v, lengths, bs=bs):
                kw = dict(block_sizes=bs, interpret=smoke)
                if tables is not None:
                    return pallas_flash.paged_attention(q, k, v, tables, lengths, **kw)
                return pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths, **kw)

            many = jax.jit(lambda qs, k, v, lengths, one=one: [one(x, k, v, lengths) for x in qs])
            try:
                ms = bench.median_ms(many, (qs, k, v, lengths), calls=3, repeats=repeats)
                row["ms"] = round(ms / calls_per_jit, 4)
                row["tbps"] = round(nbytes / row["ms"] / 1e9, 3)
                if cand == "default":
                    ms_call = bench.median_ms(jax.jit(one), (q, k, v, lengths), repeats=repeats)
                    row["ms_call"] = round(ms_call, 4)
                if not smoke:
                    # Kernel time of one call (the profiler's GPU events), as the suite reads.
                    kernel_ms, kernels = bench.device_ms(jax.jit(one), (q, k, v, lengths))
                    row["kernel_ms"] = round(kernel_ms, 4)
                    row["kernels_us"] = {n: round(1e3 * t, 2) for n, t in kernels.items()}
                    row["kernel_tbps"] = round(nbytes / kernel_ms / 1e9, 3)
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
            record(out, row)
        if not smoke and case["T"] == 1 and case["page"] is None:
            cudnn = decode_suite.decode_fns(case, interpret=False)["cudnn"]
            row = dict(exp="decode", case=name, cand="cudnn")
            try:
                kernel_ms, _ = bench.device_ms(cudnn, (q, k, v, lengths, None))
                row.update(
                    kernel_ms=round(kernel_ms, 4), kernel_tbps=round(nbytes / kernel_ms / 1e9, 3)
                )
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
            record(out, row)
        # The ceiling: copies of the same bytes (TB/s counts bytes read and written).
        flat = jnp.zeros((nbytes // 2,), jnp.bfloat16)
        copies = jax.jit(lambda x: [x + i for i in range(calls_per_jit)])
        ms = bench.median_ms(copies, (flat,), calls=3, repeats=repeats) / calls_per_jit
        row = dict(exp="decode", case=name, cand="memcpy", ms=round(ms, 4))
        record(out, dict(row, tbps=round(2 * nbytes / ms / 1e9, 3)))
        if not smoke:
            # A read of the same bytes alone (XLA's sum), in kernel time: launch and ramp
            # included, what a short call can reach.
            total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
            kernel_ms, kernels = bench.device_ms(total, (flat,))
            row = dict(exp="decode", case=name, cand="read", kernel_ms=round(kernel_ms, 4))
            row["kernels_us"] = {n: round(1e3 * t, 2) for n, t in kernels.items()}
            record(out, dict(row, kernel_tbps=round(nbytes / kernel_ms / 1e9, 3)))
        del q, k, v, qs, flat
