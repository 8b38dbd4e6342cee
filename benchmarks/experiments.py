"""Device-side experiments behind docs/notes/ (not part of the library's API).

python benchmarks/experiments.py tiles-masked --out $OUT/tiles.jsonl
    forward tiles for the narrow masked workloads (1k causal window and 8 x 2k packed
    documents at 16k): time of each candidate against dense causal with the default tiles.
python benchmarks/experiments.py split-kv --out $OUT/split.jsonl
    B=1, N=8 at 32k (the anchors' small-grid point) and short query blocks over long keys
    (decode, chunked prefill) with kv_splits 1 (off) and 0 (auto), beside cuDNN.
python benchmarks/experiments.py decode --out $OUT/decode.jsonl [--quick]
    decode_attention's split-KV and tile levers (DecodeBlockSizes) on the shapes short of
    3.8 TB/s (ragged lengths, T=16, 8k cache, GQA 16, B=1), on the headline shape, and in pages
    of 128: the default (the slots rule: 16 splits per sequence at B=8, 32k keys, XLA merge)
    and candidates, with memcpy of the same bytes. ms is device time per call (several calls
    in one jit: the host's dispatch of one call is not counted); ms_call (defaults only) times
    one call per dispatch, as the bench does; kernel_ms (on a GPU) is one call's kernels in
    jax's profiler. --cases picks shapes, --only candidates.
python benchmarks/experiments.py mosaic-tiles --out $OUT/mosaic.jsonl [--head-dims 64 --seqs 512]
    the Mosaic GPU forward with several ForwardTiles beside the Triton forward and cuDNN
    (forward only, FA2-paper shapes).
python benchmarks/experiments.py mosaic-backward --out $OUT/mosaic-bwd.jsonl [--head-dims 64]
    forward+backward with the Mosaic backward's default tiles
    (`mosaic.backward_tiles.default_tiles`) and candidate BackwardTiles, beside the default call,
    the Mosaic forward with the Triton backward, and cuDNN. At H 192 and 256 (e.g. `--head-dims 192
    256 --seqs 1024 4096`) the candidates that fit are the dK/dV consumers split by accumulator with
    one or two dQ consumers, and a third stage at H=192; at H 64 and 128 the split is a candidate
    too.
python benchmarks/experiments.py mosaic-gqa --out $OUT/mosaic-gqa.jsonl
    fwd+bwd of MQA and GQA calls (bf16, H=128: the issue's MQA 2k and GQA 4k probes, MQA
    at 8k, GQA 32/4 at 16k) with the dK/dV kernel's group of query heads summed in one CTA
    (dkv_head_splits=1, the default), split over 2, 4 and 8 CTAs, and the automatic choice
    (0; the impl name says what it chose), beside the default call and cuDNN.
python benchmarks/experiments.py mosaic-persistent --out $OUT/persistent.jsonl
    the Mosaic forward of masked and causal calls (windows, soft caps, segment ids, causal rows
    of 1k-16k, MHA and GQA) with its default tiles made persistent and not (and causal rows in
    the snake beside the default's pairs), in kernel time
    (jax's profiler), outputs compared, cuDNN beside where it runs the call: the measurements
    behind `mosaic.tiles.default_tiles`'s persistent rule. --smoke: `why_not` of each
    candidate at every case's shapes, no run.
python benchmarks/experiments.py fused-dq --out $OUT/fused.jsonl [--points 128:4096 64:16384:8]
        [--modes fused fixed step fixed_step fused_step clean] [--mask window:W|packed:D]
        [--kernel-time]
    fwd+bwd of the Mosaic backward with dQ in the dK/dV kernel ("fused": f32 adds, "fixed":
    integer adds) and its other forms, against the default two-kernel backward and cuDNN,
    with each form's dQ difference and repeatability: the measurements behind
    `dispatch.fused_dq_is_faster` and `fixed_dq_is_faster`.
python benchmarks/experiments.py mla --out $OUT/mla.jsonl
    MLA (H 192, Hv 128) against the plain H=192 call per FLOP, and the Mosaic forward's tile
    candidates at MLA's head dims (B=2, 4k, N=16, bf16: the models suite's DeepSeek row).
python benchmarks/experiments.py compile-forms --out $OUT/compile-forms.jsonl [--points fixed:24]
    compile time and XLA fusions of a jit(grad) over 1 and 24 causal layers per backward form
    (two-kernel, add, fixed, fixed-xla, fixed-bare), each row in a fresh process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import bench, mosaic, tune, tune_cache
from pallas_flash._passes import KernelConfig
from pallas_flash.bench import decode as decode_suite
from pallas_flash.bench.__main__ import given_flags
from pallas_flash.device import gpu_device_kind, target_device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic.schedule import paired_causal_rows
from pallas_flash.triton.tiles import heuristic_block_sizes

# (block_q, block_kv, num_warps, num_stages) of the forward kernel.
MASKED_FORWARD_TILES = [
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (128, 128, 8, 4),
]


def _record(out, row):
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def _time(fn, pass_, shape, repeats=7):
    b, t, n, h = shape
    args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
    return round(bench.median_ms(bench.timed_fn(fn, pass_), args, repeats=repeats), 4)


def tiles_masked(out, seq=16384, heads=16, head_dim=128):
    shape = (1, seq, heads, head_dim)
    seg = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seq // 8)[None]
    cases = {
        "dense causal": dict(is_causal=True),
        "causal window 1024": dict(is_causal=True, local_window_size=(1024, 0)),
        "packed 8x2048": dict(is_causal=True, q_segment_ids=seg),
    }
    default = heuristic_block_sizes(head_dim, jnp.bfloat16)
    for case, kwargs in cases.items():
        tiles = MASKED_FORWARD_TILES[:1] if case == "dense causal" else MASKED_FORWARD_TILES
        for bq, bk, w, st in tiles:
            bs = dataclasses.replace(default, block_q=bq, block_kv=bk, num_warps=w, num_stages=st)
            fn = functools.partial(
                pallas_flash.flash_attention, backend="triton", block_sizes=bs, **kwargs
            )
            for pass_ in ("fwd", "fwd+bwd") if (bq, bk, w, st) == (128, 128, 8, 3) else ("fwd",):
                row = dict(exp="tiles-masked", case=case, tiles=[bq, bk, w, st], pass_=pass_)
                try:
                    row["ms"] = _time(fn, pass_, shape)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                _record(out, row)


def split_kv(out):
    points = [  # (B, T, S, N, H, causal)
        (1, 32768, 32768, 8, 128, False),
        (1, 32768, 32768, 8, 128, True),
        (1, 128, 32768, 8, 128, False),
        (1, 16, 32768, 32, 128, False),
        (4, 256, 16384, 16, 128, False),
        (2, 1024, 65536, 8, 64, False),
    ]
    for b, t, s, n, h, causal in points:
        for impl, splits in (("pallas_flash", 1), ("pallas_flash", 0), ("cudnn", None)):
            bs = None
            if impl == "pallas_flash":
                bs = dataclasses.replace(heuristic_block_sizes(h, jnp.bfloat16), kv_splits=splits)
            passes = ("fwd", "fwd+bwd") if t >= 16384 and splits != 0 else ("fwd",)
            for pass_ in passes:
                row = bench.run_point(
                    impl, b, t, s, n, n, h, jnp.bfloat16, causal, pass_, block_sizes=bs
                )
                row.update(exp="split-kv", kv_splits=splits, pass_=pass_)
                _record(out, row)


# -- decode ------------------------------------------------------------------------------------

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
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            _record(out, row)
        if not smoke and case["T"] == 1 and case["page"] is None:
            cudnn = decode_suite.decode_fns(case, interpret=False)["cudnn"]
            row = dict(exp="decode", case=name, cand="cudnn")
            try:
                kernel_ms, _ = bench.device_ms(cudnn, (q, k, v, lengths, None))
                row.update(
                    kernel_ms=round(kernel_ms, 4), kernel_tbps=round(nbytes / kernel_ms / 1e9, 3)
                )
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            _record(out, row)
        # The ceiling: copies of the same bytes (TB/s counts bytes read and written).
        flat = jnp.zeros((nbytes // 2,), jnp.bfloat16)
        copies = jax.jit(lambda x: [x + i for i in range(calls_per_jit)])
        ms = bench.median_ms(copies, (flat,), calls=3, repeats=repeats) / calls_per_jit
        row = dict(exp="decode", case=name, cand="memcpy", ms=round(ms, 4))
        _record(out, dict(row, tbps=round(2 * nbytes / ms / 1e9, 3)))
        if not smoke:
            # A read of the same bytes alone (XLA's sum), in kernel time: launch and ramp
            # included, what a short call can reach.
            total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
            kernel_ms, kernels = bench.device_ms(total, (flat,))
            row = dict(exp="decode", case=name, cand="read", kernel_ms=round(kernel_ms, 4))
            row["kernels_us"] = {n: round(1e3 * t, 2) for n, t in kernels.items()}
            _record(out, dict(row, kernel_tbps=round(nbytes / kernel_ms / 1e9, 3)))
        del q, k, v, qs, flat


# (block_q, block_kv, num_stages[, persistent[, step_descriptors]]) of the Mosaic forward, per
# head dim.
MOSAIC_TILES = {
    64: [
        (64, 128, 2),
        (128, 128, 2),
        (128, 64, 2),
        (64, 64, 2),
        (64, 128, 3),
        (64, 256, 2),
        (128, 128, 2, True),
        (64, 128, 2, True),
        # 128 rows without the spills of 128 x 128 (Nsight Compute,
        # docs/notes/forward.md, "What limits the forward"): S and P of 64 keys.
        (128, 64, 2, True),
        (128, 64, 3, True),
        # Q's descriptors rebuilt each KV step (ForwardTiles.step_descriptors): the 128-row
        # consumer's spills.
        (128, 128, 2, True, True),
        (64, 128, 2, True, True),
        (64, 256, 2, False, True),
    ],
    128: [
        (64, 128, 2),
        (64, 128, 3),
        (64, 64, 3),
        (64, 64, 4),
        (128, 64, 2),
        (64, 128, 2, True),
        (64, 64, 2, True),
        (64, 64, 3, True),
    ],
    256: [(64, 64, 2), (64, 64, 3)],
}


def _time_impls(out, fns, args, flops, **row):
    """Times each jitted fn of {impl: fn(q, k, v, do)} on args and records a row per impl."""
    for impl, fn in fns.items():
        timed = dict(row, impl=impl)
        try:
            timed["ms"] = round(bench.median_ms(fn, args), 4)
            timed["tflops"] = round(flops / timed["ms"] / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            timed["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        _record(out, timed)


def _grid_points(head_dims, seqs):
    """(B, T, N, H, causal, args) of the FA2 paper's grid (16k tokens, hidden 2048)."""
    for h in head_dims:
        n = 2048 // h
        for t in seqs:
            b = 16384 // t
            args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
            for causal in (False, True):
                yield b, t, n, h, causal, args


def _triton_tiles(h, causal, t):
    """The Triton tiles of a plain bf16 call on this GPU: its autotune entry, else the
    heuristics."""
    shape_class = tune_cache.ShapeClass.of(
        h, jnp.bfloat16, is_causal=causal, q_len=t, kv_len=t, masked=False
    )
    tuned = tune_cache.tuned_block_sizes(gpu_device_kind(), shape_class)
    return tuned or heuristic_block_sizes(h, jnp.bfloat16)


def _mosaic_fn(t, n, h, causal, pass_, **kwargs):
    """The Mosaic kernels (tune.mosaic_kernels_fn) timed for pass_, or None for tiles the
    shapes do not take."""
    kernels = tune.mosaic_kernels_fn(
        (16384 // t, t, n, h),
        jnp.bfloat16,
        is_causal=causal,
        backend="mosaic",
        block_sizes=_triton_tiles(h, causal, t),
        **kwargs,
    )
    return None if kernels is None else bench.timed_fn(lambda q, k, v: kernels(q, k, v)[0], pass_)


def mosaic_tiles(out, head_dims=(64, 128, 256), seqs=(512, 2048, 16384), only=None):
    """Forward tiles against cuDNN and the Triton forward; only: the mosaic_* names to time
    (None: all of MOSAIC_TILES)."""
    for b, t, n, h, causal, args in _grid_points(head_dims, seqs):
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd")
            for impl in ("pallas_flash_triton", "cudnn")
        }
        for bq, bkv, stages, *flags in MOSAIC_TILES[h]:
            persistent, step = (*flags, False, False)[:2]
            tiles = mosaic.ForwardTiles(
                block_q=bq,
                block_kv=bkv,
                num_stages=stages,
                persistent=persistent,
                step_descriptors=step,
            )
            name = f"mosaic_{bq}x{bkv}s{stages}{'p' if persistent else ''}{'d' if step else ''}"
            if only and name not in only:
                continue
            fn = _mosaic_fn(t, n, h, causal, "fwd", forward_tiles=tiles)
            if fn is not None:
                fns[name] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd")
        _time_impls(out, fns, args, flops, exp="mosaic-tiles", B=b, T=t, N=n, H=h, causal=causal)


# BackwardTiles fields of the candidates (besides the defaults); `mosaic.why_not_backward` drops
# those that would spill or overflow shared memory at a head dim, and a candidate equal to the
# head dim's defaults is not timed twice.
MOSAIC_BACKWARD_TILES = {
    "plain": {},
    # Causal grids in their own order, a head's tiles in turn (`schedule.grouped_launch`).
    "ungrouped": dict(grouped_launch=False),
    # The dK/dV consumers' K/V descriptors rebuilt each step, not held (with fused dQ:
    # `fused-dq`'s "fixed_step").
    "step": dict(step_descriptors=True),
    "stages3": dict(num_stages=3),
    "kvdq128": dict(block_kv_dq=128),
    "kvdq128_stages3": dict(block_kv_dq=128, num_stages=3),
    "qdkv128": dict(block_q_dkv=128),
    "qdq128": dict(block_q_dq=128),
    "qdkv128_qdq128": dict(block_q_dkv=128, block_q_dq=128),
    "one_consumer": dict(num_consumers=1),
    "split": dict(split_dkv=True),
    "split_qdkv128": dict(split_dkv=True, block_q_dkv=128),
    "split_qdkv128_kvdq128": dict(split_dkv=True, block_q_dkv=128, block_kv_dq=128),
    "split_one_dq_consumer": dict(split_dkv=True, num_consumers=1),
    "split_one_dq_consumer_stages3": dict(split_dkv=True, num_consumers=1, num_stages=3),
}


def mosaic_backward(out, head_dims=(64, 128), seqs=(512, 1024, 2048, 16384)):
    """fwd+bwd: the default call, cuDNN, the Mosaic forward with the Triton backward, and the
    Mosaic backward with its default tiles and each candidate of MOSAIC_BACKWARD_TILES."""
    for b, t, n, h, causal, args in _grid_points(head_dims, seqs):
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd+bwd")
            for impl in ("pallas_flash", "cudnn")
        }
        fns["triton_bwd"] = _mosaic_fn(t, n, h, causal, "fwd+bwd", backward="triton")
        candidates = {"default": mosaic.backward_tiles.default_tiles(h)}
        for name, fields in MOSAIC_BACKWARD_TILES.items():
            tiles = mosaic.BackwardTiles(**fields)
            if tiles not in candidates.values():
                candidates[name] = tiles
        for name, tiles in candidates.items():
            fn = _mosaic_fn(t, n, h, causal, "fwd+bwd", backward_tiles=tiles)
            if fn is not None:
                fns[f"mosaic_bwd_{name}"] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd+bwd")
        _time_impls(out, fns, args, flops, exp="mosaic-backward", B=b, T=t, N=n, H=h, causal=causal)


# (B, T, N, K, causal): the MQA and GQA probes of the shapes suite, and longer calls.
GQA_POINTS = [
    (8, 2048, 32, 1, True),
    (8, 2048, 32, 1, False),
    (4, 4096, 32, 8, True),
    (2, 8192, 32, 1, True),
    (1, 16384, 32, 4, True),
]


def mosaic_gqa(out, head_dim=128):
    """fwd+bwd of GQA/MQA calls: the default call, cuDNN, and the Mosaic kernels with the
    dK/dV kernel's head splits at 1, 2, 4, 8 and automatic (0)."""
    device = target_device()
    for b, t, n, k, causal in GQA_POINTS:
        args = bench.make_inputs(b, t, t, n, k, head_dim, jnp.bfloat16)
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd+bwd")
            for impl in ("pallas_flash", "cudnn")
        }
        for splits in (1, 0, 2, 4, 8):
            tiles = mosaic.BackwardTiles(dkv_head_splits=splits)
            kernels = tune.mosaic_kernels_fn(
                (b, t, n, head_dim),
                jnp.bfloat16,
                is_causal=causal,
                backend="mosaic",
                block_sizes=_triton_tiles(head_dim, causal, t),
                backward_tiles=tiles,
                num_kv_heads=k,
            )
            if kernels is None:
                continue
            name = f"mosaic_head_splits{splits}"
            if splits == 0:
                chosen = mosaic.backward_tiles.head_splits(
                    tiles,
                    (b, t, n, head_dim),
                    (b, t, k, head_dim),
                    2,
                    num_sms=device.num_sms,
                    causal=causal,
                )
                name = f"mosaic_head_splits_auto{chosen}"
            fns[name] = bench.timed_fn(lambda q, k_, v, f=kernels: f(q, k_, v)[0], "fwd+bwd")
        flops = bench.attention_flops(b, t, t, n, head_dim, causal, "fwd+bwd")
        _time_impls(out, fns, args, flops, exp="mosaic-gqa", B=b, T=t, N=n, K=k, causal=causal)


# (name, B, T, N, K, H, causal, window, soft cap, segments per sequence)
PERSISTENT_CASES = [
    ("gpt-oss: sinks, window 128", 2, 4096, 64, 8, 64, True, (128, 0), None, 0),
    ("H64 window 1k at 8k", 2, 8192, 32, 8, 64, True, (1024, 0), None, 0),
    ("H128 window 128 at 4k", 4, 4096, 16, 8, 128, True, (128, 0), None, 0),
    ("H128 window 4k at 16k", 1, 16384, 16, 8, 128, True, (4096, 0), None, 0),
    ("H128 window 8k at 16k", 1, 16384, 16, 8, 128, True, (8192, 0), None, 0),
    ("H64 window 8k at 16k", 1, 16384, 32, 8, 64, True, (8192, 0), None, 0),
    ("H128 window 2k+2k at 8k", 2, 8192, 16, 8, 128, False, (2048, 2048), None, 0),
    ("H128 cap 30 causal 1k", 16, 1024, 16, 8, 128, True, None, 30.0, 0),
    ("H128 cap 30 causal 4k", 4, 4096, 16, 8, 128, True, None, 30.0, 0),
    ("H128 cap 30 causal 16k", 1, 16384, 16, 8, 128, True, None, 30.0, 0),
    ("H128 cap 30 4k", 4, 4096, 16, 8, 128, False, None, 30.0, 0),
    ("H128 4 documents causal 4k", 4, 4096, 16, 8, 128, True, None, None, 4),
    ("H128 4 documents causal 16k", 1, 16384, 16, 8, 128, True, None, None, 4),
    ("H64 2 documents causal 16k", 1, 16384, 32, 8, 64, True, None, None, 2),
    *(
        (f"H128 causal {t // 1024}k GQA", 16384 // t, t, 16, 8, 128, True, None, None, 0)
        for t in (2048, 4096, 8192, 16384)
    ),
    *(
        (f"H128 causal {t // 1024}k MHA", 16384 // t, t, 16, 16, 128, True, None, None, 0)
        for t in (1024, 2048, 4096, 8192, 16384)
    ),
    *(
        (f"H64 causal {t}", 16384 // t, t, 32, 32, 64, True, None, None, 0)
        for t in (512, 4096, 8192, 16384)
    ),
]


def mosaic_persistent(out, smoke=False, cases=None):
    """Each case's Mosaic forward with its default tiles, persistent and a CTA per item, and
    for causal calls whose query tiles go in pairs (`schedule.paired_causal_rows`) also
    persistent in the snake order: kernel ms (jax's profiler) as
    `{candidate}_ms`, the largest difference between each output and the CTA per item's,
    cuDNN's kernel ms where it runs the call (no soft cap or segment ids here). smoke: no run,
    only `why_not_{candidate}` at the case's shapes (None: the kernel takes it), on any
    machine. cases: names of PERSISTENT_CASES that contain one of these strings (None: all).
    """
    for name, b, t, n, k, h, causal, window, cap, docs in PERSISTENT_CASES:
        if cases and not any(c in name for c in cases):
            continue
        options = dict(is_causal=causal, window=window, soft_cap=cap)
        default = mosaic.default_tiles(h, q_len=t, kv_len=t, segments=bool(docs), **options)
        row = dict(exp="mosaic-persistent", case=name, B=b, T=t, N=n, K=k, H=h, causal=causal)
        row.update(window=window, soft_cap=cap, documents=docs, default=str(default))
        persistent = dataclasses.replace(default, persistent=True)
        candidates = {
            "per_item": dataclasses.replace(default, persistent=False),
            "persistent": persistent,
        }
        # The other order of causal items where the pairs apply: the snake.
        spec = MaskSpec(q_len=t, kv_len=t, is_causal=causal, window=window)
        if paired_causal_rows(spec, persistent, has_segments=bool(docs)):
            candidates["snake"] = dataclasses.replace(persistent, causal_pairs=False)
        if smoke:
            for candidate, tiles in candidates.items():
                row[f"why_not_{candidate}"] = mosaic.forward_tiles.why_not(
                    (b, t, n, h),
                    (b, t, k, h),
                    jnp.bfloat16,
                    segments=bool(docs),
                    tiles=tiles,
                    **options,
                )
            _record(out, row)
            continue
        q, kk, v, _ = bench.make_inputs(b, t, t, n, k, h, jnp.bfloat16)
        segment_ids = None
        if docs:
            ids = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // (t // docs), (b, t))
            segment_ids = (ids, ids)
        sinks = None
        if name.startswith("gpt-oss"):
            sinks = jnp.linspace(-1, 1, b * n, dtype=jnp.float32).reshape(b, n)
        outs = {}
        for candidate, tiles in candidates.items():
            fn = jax.jit(
                functools.partial(
                    mosaic_forward_call,
                    scale=h**-0.5,
                    segment_ids=segment_ids,
                    sinks=sinks,
                    tiles=tiles,
                    **options,
                )
            )
            outs[candidate] = fn(q, kk, v)[0].astype(jnp.float32)
            row[f"{candidate}_ms"] = round(bench.device_ms(fn, (q, kk, v))[0], 4)
        row["max_abs_diff"] = max(
            float(jnp.max(jnp.abs(x - outs["per_item"]))) for x in outs.values()
        )
        if cap is None and not docs:
            cudnn = jax.jit(
                functools.partial(
                    jax.nn.dot_product_attention,
                    is_causal=causal,
                    local_window_size=window,
                    implementation="cudnn",
                )
            )
            try:
                row["cudnn_ms"] = round(bench.device_ms(cudnn, (q, kk, v))[0], 4)
            except Exception as e:  # noqa: BLE001 -- cuDNN refusing a window is data
                row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:100]}"
        _record(out, row)


# -- the Mosaic backward's forms of dQ --------------------------------------------------------

# Every backward fused-dq can time (--modes: a subset; "default" is always timed, first).
FUSED_DQ_TILES = {
    "default": None,
    "fused": mosaic.BackwardTiles(fused_dq="add"),
    "fixed": mosaic.BackwardTiles(fused_dq="fixed"),
    # The dK/dV consumers' operand descriptors rebuilt each step (not held across the loop).
    "step": mosaic.BackwardTiles(step_descriptors=True),
    "fixed_step": mosaic.BackwardTiles(fused_dq="fixed", step_descriptors=True),
    "fused_step": mosaic.BackwardTiles(fused_dq="add", step_descriptors=True),
    # The two kernels, the dQ kernel's producer cleaning masked K tiles (no XLA pass over K).
    "clean": mosaic.BackwardTiles(producer_cleans_k=True),
}
FUSED_DQ_POINTS = ["128:4096", "128:16384", "64:4096", "64:16384"]


def mosaic_config(
    q, k, *, scale, is_causal=False, window=None, soft_cap=None, segment_ids=None, tiles=None
):
    """(MaskArrays, KernelConfig) of a call of the Mosaic kernels, as the dispatch hands them to
    `mosaic.flash_forward` and `mosaic.flash_backward`: segment_ids a (q ids, kv ids) pair or
    None; tiles: the forward's `ForwardTiles` or the backward's `BackwardTiles` (None: the
    kernels' defaults)."""
    spec = MaskSpec(
        q_len=q.shape[1],
        kv_len=k.shape[1],
        is_causal=is_causal,
        window=window,
        has_segments=segment_ids is not None,
    )
    config = KernelConfig(
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        block_sizes=pallas_flash.BlockSizes(),
        interpret=False,
        forward="mosaic",
        backward="mosaic",
        mosaic_forward_tiles=tiles if isinstance(tiles, mosaic.ForwardTiles) else None,
        mosaic_backward_tiles=tiles if isinstance(tiles, mosaic.BackwardTiles) else None,
    )
    return MaskArrays(*(segment_ids or (None, None))), config


def mosaic_forward_call(q, k, v, *, sinks=None, with_log_sum=False, **options):
    """`mosaic.flash_forward` of a call of `mosaic_config(**options)`: (out, lse), with
    with_log_sum also log_sum."""
    arrays, config = mosaic_config(q, k, **options)
    return mosaic.flash_forward(
        q, k, v, None, arrays, sinks, config=config, with_log_sum=with_log_sum
    )


def mosaic_backward_call(q, k, v, out, lse, d_out, d_lse, *, log_sum=None, **options):
    """(dq, dk, dv) of `mosaic.flash_backward` of a call of `mosaic_config(**options)` (d_lse
    None: zero)."""
    arrays, config = mosaic_config(q, k, **options)
    return mosaic.flash_backward(
        q, k, v, None, arrays, out, lse, log_sum, None, d_out, d_lse, config=config
    )[:3]


def mosaic_attention(tiles, *, scale, is_causal, **mask):
    """The Mosaic forward differentiated by `mosaic.flash_backward` with these tiles; mask:
    window and/or segment_ids, as both take them."""
    options = dict(scale=scale, is_causal=is_causal, **mask)

    @jax.custom_vjp
    def attention(q, k, v):
        return mosaic_forward_call(q, k, v, **options)[0]

    def fwd(q, k, v):
        out, lse = mosaic_forward_call(q, k, v, **options)
        return out, (q, k, v, out, lse)

    def bwd(residuals, d_out):
        return mosaic_backward_call(*residuals, d_out, None, tiles=tiles, **options)

    attention.defvjp(fwd, bwd)
    return attention


def _fused_dq_masks(spec: str, batch: int, seq: int, causal: bool):
    """--mask: "" none; "window:W" a window of W keys left of the diagonal (and W right of it
    where not causal); "packed:D" D documents of seq / D tokens per sequence (segment ids).
    Returns (the Mosaic kernels' mask kwargs, cuDNN's through jax.nn, or None where it has no
    such mask)."""
    if not spec:
        return {}, {}
    kind, size = spec.split(":")
    if kind == "window":
        window = (int(size), 0 if causal else int(size))
        return dict(window=window), dict(local_window_size=window)
    if kind == "packed":
        ids = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) * int(size) // seq, (batch, seq))
        return dict(segment_ids=(ids, ids)), None
    raise ValueError(f"--mask {spec!r}: window:W or packed:D")


def fused_dq(out, points=None, modes=("fused", "fixed"), mask_spec="", kernel_time=False):
    """fwd+bwd of the Mosaic kernels with dQ computed in the dK/dV kernel (fused_dq "add":
    five matmuls per pair of tiles, dQ added by TMA reductions; "fixed": the same adds of
    integers, deterministic) and the other forms of FUSED_DQ_TILES, against the default
    two-kernel backward (seven) and cuDNN. points: "H:SEQ" or "H:SEQ:K" (K KV heads) at FA2
    grid shapes (bf16, 16k tokens per batch, N = 2048 / H), causal and not. TFLOP/s count the
    plain (or causal) call's pairs, whatever the mask. One row per point and backward
    (kernel_time: also kernel_ms and each kernel's us), then a summary per point: the ratios,
    each form's largest dQ difference from the default's relative to dQ's largest magnitude,
    and whether two runs gave the same bits."""
    modes = ["default", *(m for m in modes if m != "default")]
    for point in points or FUSED_DQ_POINTS:
        h, seq, *kv = (int(x) for x in point.split(":"))
        b, n = 16384 // seq, 2048 // h
        kv_heads = kv[0] if kv else n
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [(b, seq, kv_heads if i in (1, 2) else n, h) for i in range(4)]
        args = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
        for causal in (False, True):
            mask, cudnn_mask = _fused_dq_masks(mask_spec, b, seq, causal)
            point_row = dict(H=h, seq=seq, K=kv_heads, causal=causal, mask=mask_spec)
            impls = {
                name: mosaic_attention(FUSED_DQ_TILES[name], scale=h**-0.5, is_causal=causal,
                                        **mask)
                for name in modes
            }  # fmt: skip
            if cudnn_mask is not None:
                impls["cudnn"] = functools.partial(
                    jax.nn.dot_product_attention, implementation="cudnn", is_causal=causal,
                    **cudnn_mask,
                )  # fmt: skip
            ms = {}
            flops = bench.attention_flops(b, seq, seq, n, h, causal, "fwd+bwd")
            for name, fn in impls.items():
                row = dict(point_row, impl=name)
                try:
                    ms[name] = bench.median_ms(bench.timed_fn(fn, "fwd+bwd"), args)
                except Exception as e:  # cuDNN refuses some masks: the row says so
                    if name != "cudnn":
                        raise
                    _record(out, dict(row, error=str(e)[:200]))
                    continue
                row.update(ms=ms[name], tflops=flops / ms[name] / 1e9)
                if kernel_time:
                    kernel_ms, kernels = bench.device_ms(bench.timed_fn(fn, "fwd+bwd"), args)
                    row["kernel_ms"] = kernel_ms
                    row["kernels_us"] = {k: round(1e3 * t, 1) for k, t in kernels.items()}
                _record(out, row)
            _record(out, _fused_dq_summary(point_row, impls, modes, ms, args))


def _fused_dq_summary(point_row, impls, modes, ms, args):
    """fused_dq's summary row of one point: each form's speed over the default's and
    cuDNN's, its dQ's largest difference from the default's, and whether it repeats."""
    dq = {name: bench.timed_fn(impls[name], "fwd+bwd")(*args)[0] for name in modes}
    summary = dict(point_row, summary="fwd+bwd")
    reference = dq["default"].astype(jnp.float32)
    for name in modes[1:]:
        again = bench.timed_fn(impls[name], "fwd+bwd")(*args)[0]
        difference = jnp.max(jnp.abs(dq[name].astype(jnp.float32) - reference))
        summary[f"{name}_over_default"] = ms["default"] / ms[name]
        summary[f"{name}_over_cudnn"] = ms["cudnn"] / ms[name] if "cudnn" in ms else None
        summary[f"{name}_dq_relative_difference"] = float(difference / jnp.max(jnp.abs(reference)))
        summary[f"{name}_repeatable"] = bool(jnp.all(again == dq[name]))
    if "cudnn" in ms:
        summary["default_over_cudnn"] = ms["cudnn"] / ms["default"]
    return summary


# -- multi-head latent attention -----------------------------------------------------------------

MLA_SHAPE = (2, 4096, 16, 192, 128)  # B, T = S, N = K, H, Hv: the models suite's DeepSeek row
MLA_TILES = [
    mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=2),
    mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=3),
    mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=2, persistent=True),
    mosaic.ForwardTiles(block_q=64, block_kv=128, num_stages=2),
]


def mla(out):
    """MLA (H = 192, Hv = 128) against the plain H = Hv = 192 call, causal and not, fwd and
    fwd+bwd through `flash_attention`; then, forward only, the Mosaic forward at MLA's head
    dims with each tile candidate of MLA_TILES that its budgets take. FLOPs count
    2 * pairs * (H + Hv) per head forward (x 3.5 forward+backward), as the models suite does;
    the last rows give MLA's time per FLOP over the plain call's (goal <= 1.05)."""
    b, t, n, h, hv = MLA_SHAPE

    def inputs(hv):
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [(b, t, n, h), (b, t, n, h), (b, t, n, hv), (b, t, n, hv)]
        return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]

    def flops(hv, causal, pass_):
        pairs = t * (t + 1) / 2 if causal else t * t
        return 2.0 * b * n * pairs * (h + hv) * (3.5 if pass_ == "fwd+bwd" else 1.0)

    per_flop = {}
    for causal in (False, True):
        for pass_ in bench.PASSES:
            for name, value_dim in (("mla", hv), ("plain", h)):
                fn = functools.partial(pallas_flash.flash_attention, is_causal=causal)
                ms = bench.median_ms(bench.timed_fn(fn, pass_), inputs(value_dim))
                per_flop[name, causal, pass_] = ms / flops(value_dim, causal, pass_)
                tflops = flops(value_dim, causal, pass_) / ms / 1e9
                _record(out, dict(case=name, causal=causal, pass_=pass_, ms=ms, tflops=tflops))
        for tiles in MLA_TILES:
            row = dict(case="mla_tiles", tiles=str(tiles), causal=causal)
            reason = mosaic.forward_tiles.why_not(
                (b, t, n, h), (b, t, n, h), jnp.bfloat16, value_head_dim=hv, is_causal=causal,
                tiles=tiles,
            )  # fmt: skip
            if reason:
                _record(out, dict(row, refused=reason))
                continue
            fn = functools.partial(
                mosaic_forward_call, scale=h**-0.5, is_causal=causal, tiles=tiles
            )
            ms = bench.median_ms(bench.timed_fn(fn, "fwd"), inputs(hv))
            _record(out, dict(row, ms=ms, tflops=flops(hv, causal, "fwd") / ms / 1e9))
    for causal in (False, True):
        for pass_ in bench.PASSES:
            ratio = per_flop["mla", causal, pass_] / per_flop["plain", causal, pass_]
            _record(out, dict(summary="mla_over_plain_per_flop", causal=causal, pass_=pass_,
                              ratio=ratio))  # fmt: skip


# -- compile time per backward form ------------------------------------------------------------

COMPILE_FORMS = ("two-kernel", "add", "fixed", "fixed-xla", "fixed-bare")


def compile_form_row(form: str, layers: int) -> dict:
    """Compile time of a jit(grad) over `layers` causal attention layers with the backward in
    `form`, and the XLA fusions and custom calls of the compiled module: "two-kernel" (the
    Mosaic backward's dK/dV and dQ kernels), "add" (dQ in the dK/dV kernel by f32 adds,
    deterministic_grads=False), "fixed" (by integer adds: the default from 8k keys at H=128
    causal; its per-row scales from two Pallas kernels, `mosaic.fixed_point`), "fixed-xla"
    (those scales in jnp, as on a CPU), "fixed-bare" ("fixed" with its scales replaced by
    constants: compile time only, its gradients are wrong). The shape is the compile suite's:
    B=1, T=8192, N=16, H=128, bf16, loss out.mean() per layer. Patches the package: one row
    per process."""
    from pallas_flash import dispatch
    from pallas_flash.mosaic import fixed_point

    if form == "two-kernel":  # no call is long enough for either fused form
        dispatch.FIXED_DQ_CAUSAL_MIN_LEN = {64: 1 << 30, 128: 1 << 30}
    if form == "fixed-xla":
        scales = fixed_point.fixed_point_scales
        fixed_point.fixed_point_scales = functools.partial(scales, kernels=False)
    if form == "fixed-bare":

        def constant_scales(k, v, d_out, delta, lse, *, rows_out, **_):
            ones = jnp.ones((*lse.shape[:2], rows_out), jnp.float32)
            return ones * 2.0**8, ones * 2.0**-8

        fixed_point.fixed_point_scales = constant_scales
    deterministic = form != "add"

    def loss(qkvs):
        return sum(
            pallas_flash.flash_attention(q, k, v, is_causal=True, deterministic_grads=deterministic)
            .astype(jnp.float32)
            .mean()
            for q, k, v in qkvs
        )

    b, t, n, h = 1, 8192, 16, 128
    args = [bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16, seed=i)[:3] for i in range(layers)]
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).trace(args).lower()
    lowered_at = time.perf_counter()
    text = lowered.compile().as_text()
    compiled_at = time.perf_counter()
    return dict(
        form=form,
        layers=layers,
        lower_s=round(lowered_at - start, 2),
        compile_s=round(compiled_at - lowered_at, 2),
        fusions=text.count(" fusion("),
        custom_calls=text.count(" custom-call("),
    )


def compile_forms(out, points=None):
    """compile_form_row at each FORM:LAYERS point (default: each form at 1 and 24 layers),
    each in a fresh process."""
    for point in points or [f"{f}:{n}" for f in COMPILE_FORMS for n in (1, 24)]:
        proc = subprocess.run(
            [sys.executable, __file__, "compile-forms", "--row", point, "--out", os.devnull],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        form = point.split(":")[0]
        _record(out, json.loads(lines[-1]) if lines else dict(form=form, error=proc.stderr[-300:]))


# name: (the flags it reads besides --out, fn(out, args)); another flag given is an error.
EXPERIMENTS = {
    "tiles-masked": ((), lambda out, a: tiles_masked(out)),
    "split-kv": ((), lambda out, a: split_kv(out)),
    "mosaic-tiles": (
        ("--head-dims", "--seqs", "--only"),
        lambda out, a: mosaic_tiles(out, a.head_dims, a.seqs, a.only),
    ),
    "mosaic-backward": (
        ("--head-dims", "--seqs"),
        lambda out, a: mosaic_backward(out, a.head_dims, a.seqs),
    ),
    "mosaic-gqa": ((), lambda out, a: mosaic_gqa(out)),
    "decode": (
        ("--quick", "--calls-per-jit", "--smoke", "--only", "--cases"),
        lambda out, a: decode(
            out, a.quick, a.calls_per_jit, smoke=a.smoke, only=a.only, cases=a.cases
        ),
    ),
    "mosaic-persistent": (
        ("--smoke", "--cases"),
        lambda out, a: mosaic_persistent(out, smoke=a.smoke, cases=a.cases),
    ),
    "fused-dq": (
        ("--points", "--modes", "--mask", "--kernel-time"),
        lambda out, a: fused_dq(
            out, a.points, a.modes or ("fused", "fixed"), a.mask, a.kernel_time
        ),
    ),
    "mla": ((), lambda out, a: mla(out)),
    "compile-forms": (("--points", "--row"), lambda out, a: compile_forms(out, a.points)),
}


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("experiment", choices=list(EXPERIMENTS))
    parser.add_argument("--quick", action="store_true", help="decode: six shapes only")
    parser.add_argument(
        "--calls-per-jit", type=int, default=4, help="decode: calls timed in one jit"
    )
    parser.add_argument(
        "--only", nargs="+", help="decode: time only these candidates (default, full_waves, ...)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        help="decode: these shapes only (head, S1k, ...); mosaic-persistent: cases whose name"
        " contains one of these",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="decode: tiny interpreted shapes; mosaic-persistent: tile checks (CPU checks)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 16384])
    parser.add_argument(
        "--points",
        nargs="+",
        help="fused-dq: H:SEQ or H:SEQ:K (default 128:4096 128:16384 64:4096 64:16384); "
        "compile-forms: FORM:LAYERS (default each form at 1 and 24)",
    )
    parser.add_argument(
        "--modes", nargs="+", choices=list(FUSED_DQ_TILES), help="fused-dq: default fused fixed"
    )
    parser.add_argument("--mask", default="", help="fused-dq: window:W or packed:D")
    parser.add_argument(
        "--kernel-time", action="store_true", help="fused-dq: each kernel's time too"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # compile-forms: one row, in a child
    args = parser.parse_args()
    flags, run = EXPERIMENTS[args.experiment]
    unread = sorted(given_flags(sys.argv[1:]) - {"--out", *flags})
    if unread:
        parser.error(f"{args.experiment} does not take {', '.join(unread)}")
    if args.row:
        form, layers = args.row.split(":")
        print(json.dumps(compile_form_row(form, int(layers))), flush=True)
        return
    print("device:", jax.devices()[0].device_kind, flush=True)
    with open(args.out, "a") as out:
        run(out, args)


if __name__ == "__main__":
    main()
