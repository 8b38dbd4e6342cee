"""The Triton forward's experiments: tiles of masked calls (`tiles-masked`) and split-KV
(`split-kv`)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

import pallas_flash
from experiment_families.common import error_text, record, time_pass
from pallas_flash import bench
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
                    row["ms"] = time_pass(fn, pass_, shape)
                except Exception as e:  # noqa: BLE001
                    row["error"] = error_text(e)
                record(out, row)


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
                record(out, row)
