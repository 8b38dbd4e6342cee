"""The Mosaic forward's experiments: tiles (`mosaic-tiles`), persistent and per-item grids
(`mosaic-persistent`), and MLA's head dims (`mla`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_flash
from experiment_families.common import (
    error_text,
    grid_points,
    mosaic_fn,
    mosaic_forward_call,
    record,
    time_impls,
)
from pallas_flash import bench, mosaic
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic.schedule import paired_causal_rows

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


def mosaic_tiles(out, head_dims=(64, 128, 256), seqs=(512, 2048, 16384), only=None):
    """Forward tiles against cuDNN and the Triton forward; only: the mosaic_* names to time
    (None: all of MOSAIC_TILES)."""
    for b, t, n, h, causal, args in grid_points(head_dims, seqs):
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
            fn = mosaic_fn(t, n, h, causal, "fwd", forward_tiles=tiles)
            if fn is not None:
                fns[name] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd")
        time_impls(out, fns, args, flops, exp="mosaic-tiles", B=b, T=t, N=n, H=h, causal=causal)


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
            record(out, row)
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
                row["cudnn_error"] = error_text(e, 100)
        record(out, row)


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
                record(out, dict(case=name, causal=causal, pass_=pass_, ms=ms, tflops=tflops))
        for tiles in MLA_TILES:
            row = dict(case="mla_tiles", tiles=str(tiles), causal=causal)
            reason = mosaic.forward_tiles.why_not(
                (b, t, n, h), (b, t, n, h), jnp.bfloat16, value_head_dim=hv, is_causal=causal,
                tiles=tiles,
            )  # fmt: skip
            if reason:
                record(out, dict(row, refused=reason))
                continue
            fn = functools.partial(
                mosaic_forward_call, scale=h**-0.5, is_causal=causal, tiles=tiles
            )
            ms = bench.median_ms(bench.timed_fn(fn, "fwd"), inputs(hv))
            record(out, dict(row, ms=ms, tflops=flops(hv, causal, "fwd") / ms / 1e9))
    for causal in (False, True):
        for pass_ in bench.PASSES:
            ratio = per_flop["mla", causal, pass_] / per_flop["plain", causal, pass_]
            record(out, dict(summary="mla_over_plain_per_flop", causal=causal, pass_=pass_,
                              ratio=ratio))  # fmt: skip
