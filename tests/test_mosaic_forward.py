"""The Mosaic GPU forward (pallas_flash.mosaic): lowering for an abstract H200 on CPU, the shape
rules of `why_not`, and numerics against the float64 oracle on a Hopper GPU.

Mosaic GPU kernels cannot run in the Pallas interpreter (wgmma, TMA, barriers). Lowering on CPU
runs Pallas' lowering, Mosaic GPU's layout inference and its dialect lowering, all in Python;
the GPU code generation (LLVM, ptxas) happens only when XLA compiles for a real GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.calls import (
    oracle_outputs_and_grads,
    outputs_and_grads,
    plain_fn,
    vmapped_outputs_and_grads,
)
from support.inputs import Problem, case_id, random_inputs, segment_arrays
from support.kernels import call_mosaic_forward
from support.mosaic_interpret import interpret_mosaic
from support.oracle import (
    attention_f64,
    attention_grads_f64,
    attention_in_dtype,
    attention_oracle_f64,
)
from support.tolerance import assert_bitwise_equal, assert_within_tolerance
from test_lowering import abstract_inputs, lower_for_h200, mosaic_opaque_i32s, triton_calls

import pallas_flash
from pallas_flash import device as device_lib
from pallas_flash import dispatch, masks
from pallas_flash._passes import KernelConfig
from pallas_flash.call import Call
from pallas_flash.device import DEFAULT_NUM_SMS, Device, gpu_compute_capability
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import forward as mosaic_forward_module
from pallas_flash.mosaic import schedule as mosaic_schedule
from pallas_flash.mosaic import tiles as mosaic_tiles
from pallas_flash.mosaic.schedule import (
    consumer_tile_range,
    cta_tile_range,
    mask_sides,
    segment_tile_plan,
)
from pallas_flash.mosaic.tiles import (
    NUM_CONSUMERS,
    SMEM_BYTES,
    ForwardTiles,
    default_tiles,
    why_not,
)
from pallas_flash.triton import backward as triton_backward


def abstract_qkv(p: Problem):
    q = jax.ShapeDtypeStruct((p.batch, p.q_len, p.num_heads, p.head_dim), p.jnp_dtype)
    kv = jax.ShapeDtypeStruct((p.batch, p.kv_len, p.num_kv_heads, p.head_dim), p.jnp_dtype)
    return q, kv, kv


def abstract_lse(p: Problem):
    return jax.ShapeDtypeStruct((p.batch, p.num_heads, p.q_len), jnp.float32)


# The long slice of the interpreted cases runs with PALLAS_FLASH_SWEEP set (and on the GPU
# suite's machine the compiled tests cover the same paths).
LONG = bool(os.environ.get("PALLAS_FLASH_SWEEP"))
long_only = pytest.mark.skipif(not LONG, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")


def forward_fn(p: Problem, tiles: ForwardTiles | None = None, **options):
    """The Mosaic forward for `p`; options: window, soft_cap."""
    return functools.partial(
        call_mosaic_forward, scale=p.scale, is_causal=p.is_causal, tiles=tiles, **options
    )


def segments_forward_fn(p: Problem, tiles: ForwardTiles | None = None, *, scale=None, **options):
    """The Mosaic forward for `p` as f(q, k, v, q_segment_ids, kv_segment_ids)."""
    scale = p.scale if scale is None else scale

    def run(q, k, v, q_ids, kv_ids):
        return call_mosaic_forward(
            q,
            k,
            v,
            scale=scale,
            is_causal=p.is_causal,
            segment_ids=(q_ids, kv_ids),
            tiles=tiles,
            **options,
        )

    return run


def abstract_ids(p: Problem):
    return (
        jax.ShapeDtypeStruct((p.batch, p.q_len), jnp.int32),
        jax.ShapeDtypeStruct((p.batch, p.kv_len), jnp.int32),
    )


# -- lowering for an abstract H200 (CPU) ----------------------------------------------------------

# Every head dim, causal and not, MHA / GQA / MQA, T == S, T < S and T > S, both dtypes.
LOWERING_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(1, 256, 512, 4, 1, 64, True, "f16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 128, True, "f16"),
    Problem(1, 128, 128, 2, 2, 128, True, "bf16"),
    Problem(1, 256, 256, 2, 2, 256, False, "bf16"),
    Problem(1, 512, 256, 4, 2, 256, True, "bf16"),
    Problem(1, 256, 512, 4, 4, 256, True, "f16"),
]


def custom_call_targets(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @(\w+)", text)


@pytest.mark.parametrize("p", LOWERING_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(2)
def test_lowers_for_h200(p):
    """One Mosaic GPU custom call on the [B, T, N, H] inputs as given: no transposes or copies
    in XLA around it, outputs out [B, T, N, H] and lse float32 [B, N, T]."""
    lowered = lower_for_h200(forward_fn(p), *abstract_inputs(p)[:3])
    text = lowered.as_text()
    assert custom_call_targets(text) == ["mosaic_gpu_v2"]
    assert "stablehlo.transpose" not in text
    out, lse = lowered.out_info
    assert (out.shape, out.dtype) == ((p.batch, p.q_len, p.num_heads, p.head_dim), p.jnp_dtype)
    assert (lse.shape, lse.dtype) == ((p.batch, p.num_heads, p.q_len), jnp.float32)


def test_lse_rows_of_a_ragged_last_tile_stay_in_their_head():
    """At T = 3000 the kernel writes lse [B, N, 3072] (whole tiles per head), sliced to T
    outside: with T innermost, a tile's rows past T must not land on the next head's rows."""
    p = Problem(1, 3000, 3000, 4, 2, 128, True, "bf16")
    text = lower_for_h200(forward_fn(p), *abstract_inputs(p)[:3]).as_text()
    call = next(line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line)
    assert "tensor<1x4x3072xf32>" in call.split("->")[-1], call[-300:]
    assert "tensor<1x4x3000xf32>" not in call.split("->")[-1]


@pytest.mark.parametrize(
    "tiles",
    [
        ForwardTiles(block_q=64, block_kv=64, num_stages=4),
        ForwardTiles(block_q=128, block_kv=64, num_stages=2),
        ForwardTiles(persistent=True, step_descriptors=True),
    ],
    ids=case_id,
)
def test_lowers_with_other_tiles(tiles):
    p = Problem(1, 512, 512, 2, 1, 128, True, "bf16")
    lowered = lower_for_h200(forward_fn(p, tiles), *abstract_inputs(p)[:3])
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]


def test_step_descriptors_keep_the_step_opaque_to_llvm(monkeypatch):
    """A plain call's KV loop runs over constant bounds, from which LLVM would bound the step
    and fold `launch.opaque_zero` to 0: the step reaches it through an empty inline asm tied
    to its register (in the lowered module with step_descriptors, not without)."""
    p = Problem(1, 1024, 1024, 2, 2, 64, False, "bf16")
    opaque_steps = [
        mosaic_opaque_i32s(
            monkeypatch,
            forward_fn(
                p,
                ForwardTiles(block_q=128, block_kv=128, persistent=True, step_descriptors=step),
            ),
            *abstract_inputs(p)[:3],
        )
        for step in (False, True)
    ]
    assert opaque_steps[0] == 0 and opaque_steps[1] >= 2, opaque_steps


# Windows (left, right) for lowering and numerics: narrow ones that leave whole row blocks
# empty when T > S, one tile wide, asymmetric, wider than S, and left-only with causal.
WINDOW_LOWERING_CASES = [
    (Problem(1, 256, 512, 4, 2, 128, False, "bf16"), (64, 32)),
    (Problem(1, 256, 512, 4, 2, 128, True, "bf16"), (100, 0)),
    (Problem(1, 512, 256, 4, 2, 64, False, "f16"), (0, 0)),
    (Problem(1, 512, 256, 4, 2, 64, True, "bf16"), (10, 3)),
    (Problem(1, 1024, 128, 2, 1, 128, True, "bf16"), (1, 0)),
    (Problem(1, 256, 256, 2, 2, 256, False, "bf16"), (1000, 1000)),
    (Problem(1, 256, 256, 2, 1, 256, True, "f16"), (127, 5)),
]


@pytest.mark.parametrize("p, window", WINDOW_LOWERING_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_lowers_with_a_window(p, window):
    lowered = lower_for_h200(forward_fn(p, window=window), *abstract_qkv(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    out, lse = lowered.out_info
    assert out.shape == (p.batch, p.q_len, p.num_heads, p.head_dim)
    assert lse.shape == (p.batch, p.num_heads, p.q_len)


@pytest.mark.parametrize(
    "p, window",
    [
        (Problem(1, 256, 512, 4, 2, 128, False, "bf16"), None),
        (Problem(1, 256, 256, 4, 2, 64, True, "f16"), None),
        (Problem(1, 512, 256, 4, 2, 256, True, "bf16"), (64, 0)),
        (Problem(1, 256, 512, 4, 2, 128, False, "bf16"), (32, 96)),
    ],
    ids=case_id,
)
@pytest.mark.ci_slice(2)
def test_lowers_with_a_soft_cap(p, window):
    lowered = lower_for_h200(forward_fn(p, window=window, soft_cap=30.0), *abstract_qkv(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]


# The last ones ragged: a last query tile past T, a last KV tile past S, fewer keys than a tile.
RANGE_SHAPES = [
    (256, 256),
    (256, 512),
    (512, 256),
    (1024, 128),
    (128, 1024),
    (384, 640),
    (200, 328),
    (333, 136),
    (8, 1000),
    (1000, 40),
]
RANGE_WINDOWS = [
    None,
    (0, 0),
    (1, 0),
    (0, 1),
    (5, 3),
    (63, 64),
    (64, 63),
    (100, 30),
    (127, 0),
    (300, 1000),
    (512, 0),
    (10**6, 10**6),
]


@pytest.mark.parametrize("block_q, block_kv", [(64, 128), (64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("q_len, kv_len", RANGE_SHAPES)
def test_tile_ranges_match_the_mask(q_len, kv_len, block_q, block_kv):
    """Against a brute-force visibility matrix, causal and not, over windows. Per consumer row
    block: [lo, hi) is exactly the tiles holding a key some row sees (or empty), tiles in
    [full_lo, full_hi) are seen whole by every row (no mask needed). Per CTA, what the drain
    scheme needs: every consumer range lies inside the CTA's range (a consumer drains the CTA
    steps around its own, and never waits for a tile the producer does not load), and the
    consumer ranges cover it (no tile is loaded that nobody reads). Ragged shapes: rows past T
    (computed, not kept) see what the geometry gives them; keys past S are hidden."""
    tiles = ForwardTiles(block_q=block_q, block_kv=block_kv)
    num_kv_tiles = -(-kv_len // block_kv)
    q_rows = -(-q_len // tiles.cta_rows) * tiles.cta_rows
    for is_causal in (False, True):
        for window in RANGE_WINDOWS:
            spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window)
            visible = np.broadcast_to(
                spec.geometry(np.arange(q_rows)[:, None], np.arange(num_kv_tiles * block_kv)),
                (q_rows, num_kv_tiles * block_kv),
            )
            for cta_start in range(0, q_len, tiles.cta_rows):
                first, end = cta_tile_range(spec, cta_start, tiles)
                # An empty range may lie past the last tile: nothing is loaded then.
                assert first == end or 0 <= first < end <= num_kv_tiles
                covered = set()
                for wg in range(NUM_CONSUMERS):
                    q_start = cta_start + wg * block_q
                    lo, full_lo, full_hi, hi = consumer_tile_range(
                        spec, q_start, (first, end), tiles
                    )
                    rows = visible[q_start : q_start + block_q].reshape(block_q, -1, block_kv)
                    seen, whole = rows.any(axis=(0, 2)), rows.all(axis=(0, 2))
                    case = (is_causal, window, q_start, (lo, full_lo, full_hi, hi), (first, end))
                    assert first <= lo <= full_lo <= full_hi <= hi <= end, case
                    if kv_len % block_kv == 0:
                        assert set(range(lo, hi)) == set(np.flatnonzero(seen)), case
                    else:
                        # Rows past every key may keep the ragged last tile (all masked).
                        assert set(np.flatnonzero(seen)) <= set(range(lo, hi)), case
                        assert hi - lo <= len(set(np.flatnonzero(seen))) + 1, case
                    assert whole[full_lo:full_hi].all(), case
                    # The loops that `_consume` does not emit without a left / right side (a
                    # ragged last KV tile counts as a right side).
                    mask_left, mask_right = mask_sides(spec, tiles)
                    mask_right = mask_right or kv_len % block_kv != 0
                    assert mask_left or first == lo == full_lo, case
                    assert mask_right or full_hi == hi == end, case
                    covered |= set(range(lo, hi))
                assert covered == set(range(first, end)), (is_causal, window, cta_start)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (100, 30), (127, 0), (512, 0)])
def test_tile_ranges_traced_match_python(is_causal, window):
    """The kernel computes the ranges on traced int32 program ids: same values as on ints."""
    tiles = ForwardTiles(block_q=64, block_kv=128)
    spec = MaskSpec(q_len=1024, kv_len=512, is_causal=is_causal, window=window)

    def ranges(cta_start):
        cta = cta_tile_range(spec, cta_start, tiles)
        consumers = [
            consumer_tile_range(spec, cta_start + wg * tiles.block_q, cta, tiles)
            for wg in range(NUM_CONSUMERS)
        ]
        return cta, consumers

    traced = jax.jit(lambda s: jax.tree.map(jnp.asarray, ranges(s)))
    for cta_start in range(0, spec.q_len, tiles.cta_rows):
        got = jax.tree.map(int, traced(jnp.int32(cta_start)))
        want = ranges(cta_start)
        assert got[0] == tuple(want[0]) and [tuple(c) for c in got[1]] == [
            tuple(c) for c in want[1]
        ], (cta_start, got, want)


# Segment ids (lengths folded in): causal and not, with windows and soft caps, T == S, T < S,
# T > S, every head dim, other tiles.
SEGMENT_LOWERING_CASES = [
    (Problem(2, 256, 256, 4, 2, 128, False, "bf16"), {}, None),
    (Problem(2, 256, 256, 4, 2, 64, True, "f16"), {}, None),
    (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), dict(window=(64, 0)), None),
    (Problem(1, 512, 256, 4, 1, 256, False, "bf16"), dict(window=(30, 90)), None),
    (Problem(2, 512, 256, 4, 2, 128, True, "bf16"), dict(soft_cap=20.0), None),
    (Problem(1, 512, 512, 2, 1, 64, True, "bf16"), {}, ForwardTiles(block_q=128, block_kv=128)),
    (Problem(1, 512, 512, 2, 1, 128, False, "f16"), {}, ForwardTiles(block_kv=64, num_stages=4)),
]


@pytest.mark.parametrize("p, options, tiles", SEGMENT_LOWERING_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_lowers_with_segment_ids(p, options, tiles):
    """One Mosaic GPU call; the tile plan is computed by XLA around it (no other custom call)."""
    fn = segments_forward_fn(p, tiles, **options)
    lowered = lower_for_h200(fn, *abstract_qkv(p), *abstract_ids(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    out, lse = lowered.out_info
    assert out.shape == (p.batch, p.q_len, p.num_heads, p.head_dim)
    assert lse.shape == (p.batch, p.num_heads, p.q_len)


SEGMENT_RANGE_WINDOWS = [None, (0, 0), (5, 3), (100, 30), (127, 0), (10**6, 10**6)]


@pytest.mark.parametrize("kind", ["one-document", "packed", "packed-lengths", "unsorted", "gap"])
@pytest.mark.parametrize("block_q, block_kv", [(64, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize(
    "q_len, kv_len", [(256, 256), (256, 512), (512, 256), (384, 640), (333, 136)]
)
@pytest.mark.ci_slice(10)
def test_segment_tile_plan_matches_the_mask(q_len, kv_len, block_q, block_kv, kind):
    """`segment_tile_plan` against the brute-force visibility (`masks.dense`), per batch entry,
    CTA and consumer, causal and not, over windows: the invariants its docstring lists. With
    one document the consumer ranges of blocks inside T are the geometry's exactly (a ragged
    last block is masked element-wise against the padding ids). Rows past T see nothing."""
    tiles = ForwardTiles(block_q=block_q, block_kv=block_kv)
    num_kv_tiles = -(-kv_len // block_kv)
    num_ctas = -(-q_len // tiles.cta_rows)
    arrays = segment_arrays(kind, 2, q_len, kv_len, seed=q_len + kv_len + block_q)
    for is_causal in (False, True):
        for window in SEGMENT_RANGE_WINDOWS:
            spec = MaskSpec(
                q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window, has_segments=True
            )
            plan = np.asarray(segment_tile_plan(spec, arrays, tiles))
            assert plan.shape == (2, num_ctas, NUM_CONSUMERS + 1, 4)
            visible = np.asarray(masks.dense(spec, arrays))[:, 0]
            pad_q, pad_kv = num_ctas * tiles.cta_rows - q_len, num_kv_tiles * block_kv - kv_len
            visible = np.pad(visible, ((0, 0), (0, pad_q), (0, pad_kv)))
            for b, cta in np.ndindex(plan.shape[:2]):
                first, first_again, end, end_again = plan[b, cta, NUM_CONSUMERS]
                assert first == first_again and end == end_again
                assert 0 <= first <= end <= num_kv_tiles
                visits = []
                for wg in range(NUM_CONSUMERS):
                    q_start = cta * tiles.cta_rows + wg * block_q
                    lo, full_lo, full_hi, hi = (int(x) for x in plan[b, cta, wg])
                    rows = visible[b, q_start : q_start + block_q].reshape(block_q, -1, block_kv)
                    seen, whole = rows.any(axis=(0, 2)), rows.all(axis=(0, 2))
                    case = (is_causal, window, b, q_start, (lo, full_lo, full_hi, hi))
                    assert first <= lo <= full_lo <= full_hi <= hi <= end, case
                    assert set(np.flatnonzero(seen)) <= set(range(lo, hi)), case
                    assert whole[full_lo:full_hi].all(), case
                    if lo < hi:
                        visits.append((lo, hi))
                    if kind == "one-document" and seen.any() and q_start + block_q <= q_len:
                        geometry = spec.kv_tile_range(q_start, block_q, block_kv)
                        assert (lo, full_lo, full_hi, hi) == tuple(geometry), case
                hull = (min(v[0] for v in visits), max(v[1] for v in visits)) if visits else (0, 0)
                assert (first, end) == hull, (is_causal, window, b, cta)


def test_segment_plans_include_the_hard_cases():
    """Among the plans of the range test: CTAs with no tile, consumers with no tile in a CTA
    with tiles, and CTAs whose consumers leave a gap in their hull (both drain it)."""
    tiles = ForwardTiles(block_q=64, block_kv=64)
    found = set()
    for kind in ("packed-lengths", "gap"):
        spec = MaskSpec(q_len=256, kv_len=512, has_segments=True)
        plan = np.asarray(segment_tile_plan(spec, segment_arrays(kind, 2, 256, 512), tiles))
        for b, cta in np.ndindex(plan.shape[:2]):
            first, _, _, end = plan[b, cta, NUM_CONSUMERS]
            ranges = [(lo, hi) for lo, _, _, hi in plan[b, cta, :NUM_CONSUMERS]]
            if first == end:
                found.add("empty cta")
            if first < end and any(lo == hi for lo, hi in ranges):
                found.add("idle consumer")
            covered = set().union(*(range(lo, hi) for lo, hi in ranges))
            if first < end and covered != set(range(first, end)):
                found.add("gap")
    assert found == {"empty cta", "idle consumer", "gap"}, found


# -- why_not / validation ------------------------------------------------------------------------

BF16 = jnp.bfloat16


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_supports_accepts(head_dim, is_causal):
    assert why_not((2, 256, 8, head_dim), (2, 512, 2, head_dim), BF16, is_causal=is_causal) is None
    assert (
        why_not((1, 128, 1, head_dim), (1, 256, 1, head_dim), jnp.float16, is_causal=True) is None
    )
    # Any lengths: ragged last tiles, lengths below one tile, lengths that are not multiples of 8.
    for q_len, kv_len in ((3000, 3000), (197, 197), (1, 1), (130, 333), (1000, 64)):
        shapes = (1, q_len, 4, head_dim), (1, kv_len, 2, head_dim)
        assert why_not(*shapes, BF16, is_causal=is_causal) is None


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, reason",
    [
        ((1, 0, 4, 128), (1, 1024, 4, 128), BF16, "q_len=0 and kv_len=1024 must be positive"),
        ((1, 256, 4, 128), (1, 0, 4, 128), BF16, "kv_len=0 must be positive"),
        ((1, 256, 4, 112), (1, 256, 4, 112), BF16, "head_dim=112 is not one of (64, 80, 96, 128"),
        ((1, 256, 4, 32), (1, 256, 4, 32), BF16, "head_dim=32"),
        ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, "dtype float32"),
        ((1, 256, 6, 128), (1, 256, 4, 128), BF16, "num_heads=6 must be divisible by"),
        ((1, 256, 4, 128), (2, 256, 4, 128), BF16, "batch or head dim"),
        ((256, 4, 128), (256, 4, 128), BF16, "must be [B, T, N, H]"),
    ],
)
def test_supports_rejects_with_reason(q_shape, k_shape, dtype, reason):
    for is_causal in (False, True):
        got = why_not(q_shape, k_shape, dtype, is_causal=is_causal)
        assert got is not None and reason in got, got


def test_supports_rejects_tiles_over_the_register_budget():
    wide = ForwardTiles(block_q=128, block_kv=128)
    got = why_not((1, 256, 2, 128), (1, 256, 2, 128), BF16, is_causal=False, tiles=wide)
    assert got is not None and "256 registers per thread" in got
    for head_dim, tiles in ((64, wide), (128, ForwardTiles(block_q=128, block_kv=64))):
        shapes = ((1, 256, 2, head_dim), (1, 256, 2, head_dim))
        assert why_not(*shapes, BF16, is_causal=False, tiles=tiles) is None


def test_supports_refuses_causal_on_miscompiling_cuda():
    shapes = ((1, 256, 2, 128), (1, 256, 2, 128), BF16)
    for version, refused in ((12080, True), (12090, True), (12091, False), (13000, False)):
        got = why_not(*shapes, is_causal=True, cuda_runtime_version=version)
        assert (got is not None and f"CUDA runtime {version}" in got) == refused, got
        assert why_not(*shapes, is_causal=False, cuda_runtime_version=version) is None


def test_the_dispatch_gives_the_mosaic_forward_only_what_it_takes():
    """Windows, soft caps and segment ids reach the Mosaic forward; a dense mask (whose arrays
    the kernel would drop) is refused by backend="mosaic" and left to Triton by None."""
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=True)
    shapes = dict(q_shape=(1, 256, 2, 128), k_shape=(1, 256, 2, 128), dtype=BF16)

    def forward(spec, soft_cap=None, backend="mosaic"):
        call = Call(spec=spec, soft_cap=soft_cap, **shapes)
        return dispatch.choose(call, Device.h200(), scale=0.1, backend=backend).forward

    assert forward(spec) == "mosaic"
    assert forward(dataclasses.replace(spec, window=(8, 0))) == "mosaic"
    assert forward(spec, soft_cap=30.0) == "mosaic"
    assert forward(dataclasses.replace(spec, has_segments=True)) == "mosaic"
    for masked in (
        dataclasses.replace(spec, mask_shape=(1, 1, 256, 256)),
        dataclasses.replace(spec, has_segments=True, mask_shape=(1, 1, 256, 256)),
    ):
        with pytest.raises(NotImplementedError, match="does not support this call \\(mask\\)"):
            forward(masked)
        assert forward(masked, backend=None) == "triton"
    common = dict(scale=0.1, block_sizes=pallas_flash.BlockSizes(), interpret=False)
    with pytest.raises(ValueError, match="forward='cuda' must be 'triton', 'mosaic' or 'decode'"):
        KernelConfig(spec=spec, forward="cuda", **common)


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(window=(-1, 0)), "window=(-1, 0) must be a (left, right) pair of ints >= 0"),
        (dict(window=(1, 2, 3)), "must be a (left, right) pair"),
        (dict(window=(1.0, 2)), "must be a (left, right) pair"),
        (dict(soft_cap=0.0), "soft_cap=0.0 must be a finite positive number"),
        (dict(soft_cap=float("inf")), "must be a finite positive number"),
        (dict(soft_cap=True), "must be a finite positive number"),
    ],
)
def test_supports_rejects_bad_options(options, reason):
    got = why_not((1, 256, 2, 128), (1, 256, 2, 128), BF16, is_causal=False, **options)
    assert got is not None and reason in got, got


def test_supports_accepts_windows_and_soft_caps():
    shapes = ((1, 256, 2, 128), (1, 512, 2, 128), BF16)
    for is_causal in (False, True):
        for options in (dict(window=(0, 0)), dict(window=[64, 10**6]), dict(soft_cap=5)):
            assert why_not(*shapes, is_causal=is_causal, **options) is None


def test_supports_refuses_windows_on_miscompiling_cuda():
    shapes = ((1, 256, 2, 128), (1, 256, 2, 128), BF16)
    got = why_not(*shapes, is_causal=False, window=(8, 8), cuda_runtime_version=12085)
    assert got is not None and "window=(8, 8) on CUDA runtime 12085" in got
    assert why_not(*shapes, is_causal=False, soft_cap=5.0, cuda_runtime_version=12085) is None


def test_persistent_tiles_count_the_second_q_buffer():
    """A persistent CTA holds two Q buffers per consumer: H=256 (64 x 64 tiles) no longer fits,
    H=128 and H=64 do."""
    plain, persistent = ForwardTiles(block_kv=64), ForwardTiles(block_kv=64, persistent=True)
    assert persistent.smem_bytes(256, 2) - plain.smem_bytes(256, 2) == 2 * 64 * 256 * 2
    got = why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False, tiles=persistent)
    assert got is not None and "shared memory" in got
    for head_dim, tiles in (
        (128, ForwardTiles(persistent=True)),
        (64, ForwardTiles(block_q=128, persistent=True)),
    ):
        shapes = (1, 512, 2, head_dim), (1, 512, 2, head_dim)
        assert why_not(*shapes, BF16, is_causal=True, tiles=tiles, segments=True) is None


@pytest.mark.parametrize(
    "p, tiles",
    [
        (
            Problem(8, 512, 512, 16, 4, 64, False, "bf16"),
            ForwardTiles(block_q=128, persistent=True),
        ),
        (Problem(1, 256, 512, 2, 1, 128, True, "f16"), ForwardTiles(persistent=True)),
    ],
    ids=case_id,
)
def test_persistent_lowers_with_a_cta_per_sm(p, tiles, monkeypatch):
    """One CTA per SM, or one per work item when there are fewer items than SMs."""
    grids = []
    kernel = mosaic_forward_module.plgpu.kernel

    def spy(*args, grid, **kwargs):
        grids.append(grid)
        return kernel(*args, grid=grid, **kwargs)

    monkeypatch.setattr(mosaic_forward_module.plgpu, "kernel", spy)
    lowered = lower_for_h200(forward_fn(p, tiles), *abstract_inputs(p)[:3])
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    items = p.batch * p.num_heads * (p.q_len // tiles.cta_rows)
    assert DEFAULT_NUM_SMS == 132  # the H200's, where no GPU says otherwise
    assert grids == [(min(items, 132),)]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "batch, heads, q_tiles, ctas",
    [
        (32, 32, 2, 132),
        (2, 3, 5, 4),
        (1, 2, 3, 8),
        (8, 16, 16, 132),
        (2, 16, 64, 132),
        (1, 16, 128, 132),
    ],
)
def test_persistent_work_covers_every_item_once(batch, heads, q_tiles, ctas, reverse):
    """CTA c's n-th item is item n * C + c of the order on even rounds, n * C + C - 1 - c on odd
    ones: every (batch, head, q_tile) once. Causal (reverse): the long query tiles come first,
    and no CTA takes the longest of every round."""
    work = mosaic_schedule._Work(batch, heads, q_tiles, reverse=reverse)
    order = [work.persistent_item(w) for w in range(work.total)]
    assert sorted(order) == sorted(np.ndindex(batch, heads, q_tiles))
    per_cta = []
    for c in range(ctas):
        count = int(work.persistent_count(c, ctas))
        places = [int(work.round_place(c, n, ctas)) for n in range(count)]
        per_cta.append([order[n * ctas + place] for n, place in enumerate(places)])
    assert sorted(item for items in per_cta for item in items) == sorted(order)
    if reverse:
        assert [q for _, _, q in order] == sorted((q for _, _, q in order), reverse=True)
        if work.total >= 2 * ctas:
            # Work per CTA in KV tiles (causal: q_tile + 1), against an even share.
            loads = [sum(q + 1 for _, _, q in items) for items in per_cta]
            mean = sum(loads) / ctas
            assert max(loads) <= 1.5 * min(loads), loads
            # Round-robin put the longest item of every round on CTA 0: about Q / 2 tiles
            # over the mean (63 of 1001 at B=1, 16 heads, 128 tiles); the snake, 2.
            if work.total >= 8 * ctas:
                assert max(loads) <= mean + q_tiles / 4 + 1, (max(loads), mean)
    else:
        assert [q for _, _, q in order[:q_tiles]] == list(range(q_tiles))  # one head's tiles


@pytest.mark.parametrize(
    "batch, heads, q_tiles, ctas",
    [
        (1, 3, 4, 4),  # no whole round of pairs: all tail
        (3, 1, 10, 4),  # the tail starts inside a head
        (1, 1, 8, 3),  # one head: the tail is that head's pairs alone
        (1, 5, 6, 7),
        (8, 16, 16, 132),  # the grid's causal 2k at H=128
        (4, 16, 32, 132),
        (1, 24, 12, 132),  # 144 pairs on 132 CTAs
        (1, 16, 128, 132),
    ],
)
def test_paired_work_covers_every_item_once(batch, heads, q_tiles, ctas):
    """Causal pairs: CTA c's items 2m and 2m + 1 (m < the pair rounds) are query tiles Q - 1 - i
    and i of one head, a round of them spanning few heads (their K/V shared in L2); the tail's
    single tiles go longest first in a snake. Every (batch, head, q_tile) once, and the work
    per CTA as even as the snake's over every item (or better)."""

    def per_cta(work):
        return [
            [tuple(int(x) for x in work.cta_item(c, n, ctas)) for n in range(count)]
            for c in range(ctas)
            for count in [int(work.persistent_count(c, ctas))]
        ]

    work = mosaic_schedule._Work(batch, heads, q_tiles, reverse=True, paired=True)
    tail = work.tail(ctas)
    items = per_cta(work)
    everything = [item for cta_items in items for item in cta_items]
    assert sorted(everything) == sorted(np.ndindex(batch, heads, q_tiles))
    assert tail.items == len(everything) - 2 * tail.pair_rounds * ctas
    for cta_items in items:
        pairs = cta_items[: 2 * tail.pair_rounds]
        for long, short in zip(pairs[::2], pairs[1::2]):
            assert long[:2] == short[:2] and long[2] + short[2] == q_tiles - 1, (long, short)
            assert long[2] > short[2]
    for m in range(tail.pair_rounds):
        heads_of_round = {cta_items[2 * m][:2] for cta_items in items}
        assert len(heads_of_round) <= -(-2 * ctas // q_tiles) + 1, (m, heads_of_round)
    # The tail, in the order CTAs take it, round by round: longest first.
    tail_order = [tail.item(r) for r in range(tail.items)]
    levels = [int(q) for _, q in tail_order]
    assert levels == sorted(levels, reverse=True)

    def load(cta_items):
        return sum(q + 2 for _, _, q in cta_items)  # KV tiles and a start per item

    snake = [load(c) for c in per_cta(mosaic_schedule._Work(batch, heads, q_tiles, True))]
    loads = [load(c) for c in items]
    mean = sum(loads) / ctas
    # Whole pairs to the end would leave CTAs a pair apart: 1.83 x the mean at 144 pairs on
    # 132 CTAs, 1.031 at the grid's 2k (where the snake's partial round gives 1.031 too).
    assert max(loads) <= max(snake) + 0.015 * mean, (max(loads) / mean, max(snake) / mean)
    if (batch, heads, q_tiles) == (8, 16, 16):
        assert max(loads) <= 1.01 * mean


def test_paired_work_needs_reverse_and_even_tiles():
    with pytest.raises(ValueError, match="even"):
        mosaic_schedule._Work(1, 2, 3, reverse=True, paired=True)
    with pytest.raises(ValueError, match="reverse"):
        mosaic_schedule._Work(1, 2, 4, reverse=False, paired=True)


@pytest.mark.parametrize(
    "q_len, kv_len, options, paired",
    [
        (2048, 2048, {}, True),
        (2048, 4096, {}, True),  # T < S: row i still sees keys 0..i
        (4096, 2048, {}, False),  # rows past S see every key: pairs of unequal work
        (1280, 1280, {}, False),  # 5 query tiles of 256 rows (block_q=128)
        (2048, 2048, dict(window=(256, 0)), False),
        (2048, 2048, dict(window=(4096, 0)), True),  # a window that hides nothing
        (2048, 2048, dict(segments=True), False),
        (2048, 2048, dict(is_causal=False), False),
        (2048, 2048, dict(persistent=False), False),
        (2048, 2048, dict(causal_pairs=False), False),
    ],
)
def test_paired_causal_rows(q_len, kv_len, options, paired):
    options = {"is_causal": True, "persistent": True, **options}
    spec = MaskSpec(
        q_len=q_len, kv_len=kv_len, is_causal=options["is_causal"], window=options.get("window")
    )
    tiles = ForwardTiles(
        block_q=128 if q_len == 1280 else 64,
        persistent=options["persistent"],
        causal_pairs=options.get("causal_pairs", True),
    )
    got = mosaic_schedule.paired_causal_rows(
        spec, tiles, has_segments=options.get("segments", False)
    )
    assert got == paired


def test_supports_rejects_tiles_over_shared_memory():
    tiles = ForwardTiles(block_q=64, block_kv=128, num_stages=2)
    got = why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False, tiles=tiles)
    assert got is not None and "shared memory" in got
    assert why_not((1, 256, 2, 256), (1, 256, 2, 256), BF16, is_causal=False) is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_len, kv_len", [(256, 512), (512, 2048), (384, 16384), (16384, 16384)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_default_tiles_are_supported(head_dim, q_len, kv_len, is_causal, segments):
    """The default tiles fit shared memory (with the id buffers of segment ids) and registers,
    and cover T (% 2 * block_q)."""
    tiles = default_tiles(
        head_dim, q_len=q_len, kv_len=kv_len, is_causal=is_causal, segments=segments
    )
    shapes = (2, q_len, 4, head_dim), (2, kv_len, 4, head_dim)
    assert why_not(*shapes, BF16, is_causal=is_causal, tiles=tiles, segments=segments) is None
    assert tiles.smem_bytes(head_dim, 2, segments=segments) <= SMEM_BYTES


def test_default_tiles_at_h64_take_128_rows_when_plain_and_not_causal():
    def block_q(**kwargs):
        return default_tiles(64, **kwargs).block_q

    assert block_q(q_len=512, kv_len=512, is_causal=False) == 128
    assert block_q(q_len=2048, kv_len=2048, is_causal=False) == 128
    # Causal: masked diagonal steps zero non-finite V, which spills at 128 rows.
    assert block_q(q_len=16384, kv_len=16384, is_causal=True) == 64
    assert block_q(q_len=2048, kv_len=2048, is_causal=True) == 64
    assert block_q(q_len=384, kv_len=384, is_causal=False) == 64  # T % 256 != 0
    assert block_q(q_len=512, kv_len=512, is_causal=True, window=(64, 0)) == 64
    assert block_q(q_len=512, kv_len=512, is_causal=True, soft_cap=30.0) == 64
    assert block_q(q_len=512, kv_len=512, is_causal=True, segments=True) == 64
    assert default_tiles(128, q_len=512, kv_len=512, is_causal=True).block_q == 64


def test_default_tiles_at_h64_rebuild_q_descriptors_at_128_rows():
    """Plain H=64 rows of 128 query rows per consumer rebuild Q's descriptors each step (held,
    they spill) from 1k keys; 64-row consumers hold them, as do rows of 512 keys."""
    for kv_len, step in ((512, False), (1000, False), (1024, True), (4096, True), (16384, True)):
        tiles = default_tiles(64, q_len=1024, kv_len=kv_len, is_causal=False)
        assert (tiles.block_q, tiles.block_kv, tiles.step_descriptors) == (128, 128, step)
    # A small grid's 64-row tiles (the dispatch's wide=False).
    narrow = default_tiles(64, q_len=4096, kv_len=4096, is_causal=False, wide=False)
    assert (narrow.block_q, narrow.block_kv, narrow.step_descriptors) == (64, 256, False)
    for kwargs in (dict(is_causal=True), dict(is_causal=False, soft_cap=30.0)):
        tiles = default_tiles(64, q_len=1024, kv_len=1024, **kwargs)
        assert (tiles.block_q, tiles.step_descriptors) == (64, False)
    assert not default_tiles(128, q_len=1024, kv_len=1024, is_causal=False).step_descriptors


def test_default_tiles_at_h64_take_256_keys_on_long_plain_rows_of_other_lengths():
    """Plain rows of 4k-8k keys whose T is not a multiple of 256 (no 128-row consumers) take
    256-key tiles."""

    def block_kv(kv_len, is_causal=False, **kwargs):
        tiles = default_tiles(64, q_len=1000, kv_len=kv_len, is_causal=is_causal, **kwargs)
        return tiles.block_kv

    assert [block_kv(n) for n in (2048, 4096, 8192, 16384)] == [128, 256, 256, 128]
    assert [block_kv(n, True) for n in (4096, 8192, 16384)] == [128, 128, 128]
    assert block_kv(8192, window=(64, 0)) == block_kv(8192, soft_cap=30.0) == 128
    assert default_tiles(128, q_len=8192, kv_len=8192, is_causal=False).block_kv == 128


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_are_persistent_but_on_long_causal_rows(head_dim):
    def persistent(kv_len=1024, is_causal=False, q_len=None, **kwargs):
        q_len = kv_len if q_len is None else q_len
        tiles = default_tiles(head_dim, q_len=q_len, kv_len=kv_len, is_causal=is_causal, **kwargs)
        return tiles.persistent

    fits = head_dim <= 128  # H=256 has no room for a second Q buffer
    assert persistent() == persistent(kv_len=16384) == fits
    # Causal rows: up to 16k keys at H=64, 8k at H=128.
    longest = {64: 16384, 128: 8192, 256: 0}[head_dim]
    for kv_len in (512, 1024, 2048, 4096, 8192, 16384, 32768):
        assert persistent(kv_len, is_causal=True) == (kv_len <= longest), kv_len
        # Soft caps and segment ids as plain calls.
        assert persistent(kv_len, is_causal=True, soft_cap=30.0) == (kv_len <= longest)
        assert persistent(kv_len, is_causal=True, segments=True) == (kv_len <= longest)
        # A window that bounds nothing leaves the rows causal.
        window = (kv_len - 1, 0)
        assert persistent(kv_len, is_causal=True, window=window) == (kv_len <= longest)
        assert persistent(kv_len, is_causal=True, window=(1 << 30, 0)) == (kv_len <= longest)
    assert persistent(kv_len=16384, soft_cap=30.0) == persistent(segments=True) == fits
    # Top-left aligned causal rows see at most T keys.
    assert persistent(kv_len=16384, q_len=512, is_causal=True) == fits
    # A causal window of at most half the keys evens the rows out, up to (8192, 0).
    assert persistent(kv_len=16384, window=(8192, 0), is_causal=True) == fits
    assert persistent(kv_len=4096, window=(128, 0), is_causal=True) == fits
    assert persistent(kv_len=32768, window=(8193, 0), is_causal=True) == (head_dim == 64)
    assert not persistent(kv_len=65536, window=(32768, 0), is_causal=True)
    assert persistent(kv_len=32768, window=(16384, 16384)) == fits  # not causal


def test_supports_counts_the_segment_id_buffers(monkeypatch):
    """Segment ids add the consumers' query ids and a ring of KV ids (int32) to shared memory;
    `why_not` checks the total (here against a budget that fits the tiles without ids)."""
    tiles = ForwardTiles(block_q=64, block_kv=128, num_stages=3)
    extra = tiles.smem_bytes(64, 2, segments=True) - tiles.smem_bytes(64, 2)
    assert extra == (2 * 64 + 3 * 128) * 4
    shapes = ((2, 256, 4, 64), (2, 512, 2, 64), BF16)
    for is_causal in (False, True):
        assert why_not(*shapes, is_causal=is_causal, segments=True) is None
        assert why_not(*shapes, is_causal=is_causal, window=(8, 0), segments=True) is None
    monkeypatch.setattr(mosaic_tiles, "SMEM_BYTES", tiles.smem_bytes(64, 2))
    assert why_not(*shapes, is_causal=False, tiles=tiles) is None
    got = why_not(*shapes, is_causal=False, tiles=tiles, segments=True)
    assert got is not None and "shared memory" in got, got


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=96), "block_q=96 must be a positive multiple of 64"),
        (dict(block_kv=32), "block_kv=32 must be a positive multiple of 64"),
        (dict(num_stages=1), "num_stages=1 must be an int >= 2"),
        (dict(persistent=1), "persistent=1 must be a bool"),
        (dict(causal_pairs=1), "causal_pairs=1 must be a bool"),
        (dict(step_descriptors=0), "step_descriptors=0 must be a bool"),
    ],
)
def test_tiles_validate(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        ForwardTiles(**kwargs)


# -- numerics in the Mosaic GPU interpreter (CPU) --------------------------------------------------

# Small problems through every code path: head dims, causal and not, MHA / GQA / MQA, T < S and
# T > S, one KV tile, drain steps (H=256: 64-key tiles), other tiles (128-row consumers, 4 stages).
INTERPRET_PROBLEMS = [
    (Problem(1, 256, 256, 2, 1, 64, True, "bf16"), None),
    (Problem(1, 256, 256, 2, 2, 64, False, "f16"), None),
    (Problem(1, 128, 512, 2, 1, 128, True, "bf16"), None),
    # T > S causal at 128 and f16 at 256: the masked and lowering cases cover them in CI.
    pytest.param(Problem(1, 512, 256, 2, 2, 128, True, "bf16"), None, marks=long_only),
    (Problem(1, 128, 128, 2, 1, 128, False, "bf16"), None),
    pytest.param(Problem(1, 256, 128, 2, 1, 256, True, "f16"), None, marks=long_only),
    (Problem(1, 128, 64, 1, 1, 256, True, "bf16"), None),
    (Problem(1, 512, 512, 2, 1, 64, True, "bf16"), ForwardTiles(block_q=128, block_kv=128)),
    (Problem(1, 512, 1024, 1, 1, 64, False, "bf16"), ForwardTiles(block_q=128, block_kv=128)),
    (Problem(1, 256, 512, 2, 1, 128, True, "bf16"), ForwardTiles(block_kv=64, num_stages=4)),
]


@pytest.mark.parametrize("p, tiles", INTERPRET_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(2)
def test_matches_oracle_interpreted(p, tiles):
    """The kernel's logic (tiles, masks, online softmax, barrier protocol, with the race detector
    on) against the float64 oracle; registers, layouts and ptxas are the GPU tests' part."""
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    with interpret_mosaic():
        out, lse = jax.jit(forward_fn(p, tiles))(q, k, v)
        out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    baseline = jax.jit(plain_fn(p))(q, k, v)
    oracle = attention_f64(q64, k64, v64, scale=p.scale, is_causal=p.is_causal)
    assert_within_tolerance((out, lse), baseline, oracle, floor=p.floor, names=("out", "lse"))


def test_mosaic_forward_feeds_the_triton_backward_interpreted():
    """The Triton backward (Pallas interpreter) on the Mosaic forward's out and lse (Mosaic
    interpreter): out, lse, dq, dk, dv against the float64 oracle. (One interpreter at a time:
    the Mosaic one takes over every pallas_call in its scope, so the two run apart.)"""
    p = Problem(2, 256, 512, 4, 2, 64, True, "bf16")
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        out, lse = jax.jit(forward_fn(p))(q, k, v)
        out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
    spec = MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=True)
    config = KernelConfig(
        spec=spec, scale=p.scale, block_sizes=pallas_flash.BlockSizes(), interpret=True
    )
    grads = jax.jit(functools.partial(triton_backward.flash_backward, config=config))(
        q, k, v, None, MaskArrays(), out, lse, None, None, d_out, d_lse
    )[:3]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    oracles = oracle_outputs_and_grads(p, *f64)
    assert_within_tolerance((out, lse, *grads), baselines, oracles, floor=p.floor)


# -- numerics on a Hopper GPU ---------------------------------------------------------------------

# B=2, GQA (N=4, K=2), every head dim, causal and not; T < S and T > S.
GPU_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 64, True, "f16"),
    Problem(2, 256, 256, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 256, 256, 4, 2, 256, False, "f16"),
    Problem(2, 256, 256, 4, 2, 256, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "f16"),
    Problem(2, 512, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 256, True, "f16"),
    Problem(2, 1024, 1024, 4, 1, 128, True, "bf16"),
    # One KV tile: the producer's ring fill stops at the tile count.
    Problem(2, 128, 128, 4, 2, 64, True, "bf16"),
    Problem(2, 128, 64, 4, 2, 256, True, "bf16"),
]


def needs_hopper():
    cc = gpu_compute_capability()
    if cc is None or cc[0] != 9:
        pytest.skip(f"the Mosaic GPU forward needs sm_90 (Hopper); compute capability {cc}")


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=case_id)
def test_matches_oracle(p):
    needs_hopper()
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    out, lse = jax.jit(forward_fn(p))(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (p.batch, p.num_heads, p.q_len)
    baseline = jax.jit(plain_fn(p))(q, k, v)
    oracle = attention_f64(q64, k64, v64, scale=p.scale, is_causal=p.is_causal)
    assert_within_tolerance((out, lse), baseline, oracle, floor=p.floor, names=("out", "lse"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, tiles",
    [
        # 128 rows per consumer: measured faster at H=64 (causal, short rows), not yet default.
        (Problem(2, 512, 512, 4, 2, 64, True, "bf16"), ForwardTiles(block_q=128, block_kv=128)),
        (Problem(2, 512, 1024, 4, 2, 64, False, "f16"), ForwardTiles(block_q=128, block_kv=128)),
        (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), ForwardTiles(block_q=128, block_kv=64)),
        (Problem(1, 512, 512, 4, 1, 64, True, "bf16"), ForwardTiles(block_kv=64, num_stages=4)),
        # H=64's long-row default (64 x 256), at lengths that leave ragged key tiles.
        (Problem(2, 320, 1000, 4, 2, 64, False, "bf16"), ForwardTiles(block_kv=256)),
        (Problem(1, 640, 640, 4, 1, 64, True, "bf16"), ForwardTiles(block_kv=256)),
        # Persistent CTAs with more work items than SMs (256 and 512 items on 132 SMs).
        (
            Problem(8, 512, 512, 16, 4, 64, False, "bf16"),
            ForwardTiles(block_q=128, block_kv=128, persistent=True),
        ),
        (Problem(4, 1024, 1024, 16, 4, 128, True, "bf16"), ForwardTiles(persistent=True)),
        # Q's descriptors rebuilt every KV step (persistent: its two buffers in turn).
        (
            Problem(8, 512, 512, 16, 4, 64, False, "bf16"),
            ForwardTiles(block_q=128, block_kv=128, persistent=True, step_descriptors=True),
        ),
    ],
    ids=case_id,
)
def test_matches_oracle_with_other_tiles(p, tiles):
    needs_hopper()
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    out, lse = jax.jit(forward_fn(p, tiles))(q, k, v)
    baseline = jax.jit(plain_fn(p))(q, k, v)
    oracle = attention_f64(q64, k64, v64, scale=p.scale, is_causal=p.is_causal)
    assert_within_tolerance((out, lse), baseline, oracle, floor=p.floor, names=("out", "lse"))


@pytest.mark.gpu
def test_deterministic():
    needs_hopper()
    p = Problem(2, 512, 512, 4, 2, 128, True, "bf16")
    (q, k, v, _, _), _ = random_inputs(p)
    fn = jax.jit(forward_fn(p))
    assert_bitwise_equal(fn(q, k, v), fn(q, k, v))


def visibility(p: Problem, window) -> np.ndarray:
    """[T, S] boolean: key j visible to query i (MaskSpec.geometry)."""
    spec = MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal, window=window)
    keys = spec.geometry(np.arange(p.q_len)[:, None], np.arange(p.kv_len)[None, :])
    return np.broadcast_to(keys, (p.q_len, p.kv_len))


def masked_in_dtype(q, k, v, *, scale, visible, soft_cap=None):
    """Plain attention with every step in the input dtype over a [T, S] visibility and an
    optional soft cap: the tolerance baseline. Rows that see no key: out 0, lse -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    shift = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None].astype(logits.dtype)
    probs = jnp.where(visible, jnp.exp(logits - shift), 0.0).astype(q.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v), lse.astype(jnp.float32)


# (problem, Mosaic forward options, scale or None for 1/sqrt(H)). Windows: T > S with rows and
# whole CTAs that see no key, one-key windows, windows wider than S, left-only with causal;
# soft caps at scale 1 (logits of std sqrt(H), so that the cap bites), alone and with windows.
MASKED_GPU_CASES = [
    (Problem(2, 256, 512, 4, 2, 128, False, "bf16"), dict(window=(64, 32)), None),
    (Problem(2, 512, 512, 4, 2, 64, True, "bf16"), dict(window=(100, 0)), None),
    (Problem(2, 512, 256, 4, 2, 128, True, "f16"), dict(window=(10, 3)), None),
    (Problem(2, 1024, 128, 4, 1, 64, False, "bf16"), dict(window=(1, 0)), None),
    (Problem(2, 512, 256, 4, 2, 256, False, "bf16"), dict(window=(0, 0)), None),
    (Problem(1, 256, 256, 4, 2, 128, False, "bf16"), dict(window=(1000, 1000)), None),
    (Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"), dict(window=(300, 0)), None),
    (Problem(2, 256, 512, 4, 2, 128, False, "bf16"), dict(soft_cap=5.0), 1.0),
    (Problem(2, 512, 512, 4, 2, 64, True, "f16"), dict(soft_cap=30.0), 1.0),
    (Problem(2, 256, 256, 4, 2, 256, False, "bf16"), dict(soft_cap=20.0), None),
    (Problem(2, 512, 256, 4, 2, 256, True, "bf16"), dict(window=(64, 0), soft_cap=10.0), 1.0),
    (Problem(2, 512, 1024, 4, 2, 128, False, "bf16"), dict(window=(200, 300), soft_cap=20.0), 1.0),
]


def run_forward(fn, *args, interpreted: bool, oob_fill=0):
    """jit(fn)(*args) -> (out, lse) as float32 numpy arrays, on the GPU or, with `interpreted`,
    in the Mosaic GPU interpreter with the race detector on (converted inside its scope), where
    TMA loads read `oob_fill` past an array's end."""
    with interpret_mosaic(oob_fill=oob_fill) if interpreted else contextlib.nullcontext():
        out, lse = jax.jit(fn)(*args)
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def check_masked(p: Problem, options: dict, scale, tiles=None, *, interpreted=False, oob_fill=0):
    scale = p.scale if scale is None else scale
    window, soft_cap = options.get("window"), options.get("soft_cap")
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    run = functools.partial(
        call_mosaic_forward, scale=scale, is_causal=p.is_causal, tiles=tiles, **options
    )
    out, lse = run_forward(run, q, k, v, interpreted=interpreted, oob_fill=oob_fill)
    visible = visibility(p, window)
    oracle = attention_oracle_f64(q64, k64, v64, scale=scale, visible=visible, soft_cap=soft_cap)
    baseline = jax.jit(
        functools.partial(masked_in_dtype, scale=scale, visible=visible, soft_cap=soft_cap)
    )(q, k, v)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = ~visible.any(axis=1)  # [T]: rows that see no key
    assert (out[:, empty] == 0).all(), "rows that see no key must output exactly 0"
    assert np.isneginf(lse[:, :, empty]).all() and np.isfinite(lse[:, :, ~empty]).all()
    assert_within_tolerance(
        (out, lse), baseline, (oracle["out"], oracle["lse"]), floor=p.floor, names=("out", "lse")
    )


@pytest.mark.gpu
@pytest.mark.parametrize("p, options, scale", MASKED_GPU_CASES, ids=case_id)
def test_masked_matches_oracle(p, options, scale):
    needs_hopper()
    check_masked(p, options, scale)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, options, tiles",
    [
        (
            Problem(2, 512, 512, 4, 2, 128, True, "bf16"),
            dict(window=(70, 0)),
            ForwardTiles(block_q=128, block_kv=64),
        ),
        (
            Problem(1, 512, 256, 4, 1, 64, False, "bf16"),
            dict(window=(30, 90), soft_cap=10.0),
            ForwardTiles(block_kv=64, num_stages=4),
        ),
        (
            Problem(2, 1024, 512, 4, 2, 64, True, "f16"),
            dict(window=(5, 0)),
            ForwardTiles(block_q=128, block_kv=128, num_stages=3),
        ),
        (
            Problem(4, 1024, 1024, 8, 2, 128, True, "bf16"),
            dict(window=(300, 0)),
            ForwardTiles(persistent=True),
        ),
    ],
    ids=case_id,
)
def test_masked_matches_oracle_with_other_tiles(p, options, tiles):
    needs_hopper()
    check_masked(p, options, None, tiles)


@pytest.mark.gpu
def test_masked_deterministic():
    needs_hopper()
    p = Problem(2, 512, 256, 4, 2, 128, True, "bf16")
    (q, k, v, _, _), _ = random_inputs(p)
    fn = jax.jit(forward_fn(p, window=(40, 0), soft_cap=15.0))
    assert_bitwise_equal(fn(q, k, v), fn(q, k, v))


# (problem, segment kind, Mosaic forward options, scale or None for 1/sqrt(H)): packed documents,
# padding rows and a batch entry without keys (rows that see no key), unsorted ids, a gap that
# both consumers drain; with causal, windows and a soft cap; T == S, T < S, T > S.
SEGMENT_GPU_CASES = [
    (Problem(2, 256, 256, 4, 2, 128, False, "bf16"), "packed", {}, None),
    (Problem(2, 512, 512, 4, 2, 64, True, "bf16"), "packed-lengths", {}, None),
    (Problem(2, 256, 512, 4, 2, 128, True, "f16"), "lengths", {}, None),
    (Problem(2, 512, 256, 4, 2, 256, False, "bf16"), "unsorted", {}, None),
    (Problem(2, 256, 512, 4, 1, 128, False, "bf16"), "gap", {}, None),
    (Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"), "one-document", {}, None),
    (Problem(2, 512, 512, 4, 2, 128, True, "bf16"), "packed", dict(window=(100, 0)), None),
    (
        Problem(2, 512, 256, 4, 2, 128, False, "bf16"),
        "packed-lengths",
        dict(window=(30, 60), soft_cap=10.0),
        1.0,
    ),
]


def check_segments(
    p: Problem, kind: str, options: dict, scale, tiles=None, *, interpreted=False, oob_fill=0
):
    scale = p.scale if scale is None else scale
    window, soft_cap = options.get("window"), options.get("soft_cap")
    arrays = segment_arrays(kind, p.batch, p.q_len, p.kv_len)
    spec = MaskSpec(
        q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal, window=window, has_segments=True
    )
    visible = np.asarray(masks.dense(spec, arrays))  # [B, 1, T, S]
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    run = segments_forward_fn(p, tiles, scale=scale, **options)
    ids = (arrays.q_segment_ids, arrays.kv_segment_ids)
    out, lse = run_forward(run, q, k, v, *ids, interpreted=interpreted, oob_fill=oob_fill)
    oracle = attention_oracle_f64(q64, k64, v64, scale=scale, visible=visible, soft_cap=soft_cap)
    baseline = jax.jit(
        functools.partial(masked_in_dtype, scale=scale, visible=visible, soft_cap=soft_cap)
    )(q, k, v)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = ~visible[:, 0].any(axis=-1)  # [B, T]: rows that see no key
    assert (out[empty] == 0).all(), "rows that see no key must output exactly 0"
    lse_rows = lse.transpose(0, 2, 1)  # [B, T, N]
    assert np.isneginf(lse_rows[empty]).all() and np.isfinite(lse_rows[~empty]).all()
    assert_within_tolerance(
        (out, lse), baseline, (oracle["out"], oracle["lse"]), floor=p.floor, names=("out", "lse")
    )


@pytest.mark.gpu
@pytest.mark.parametrize("p, kind, options, scale", SEGMENT_GPU_CASES, ids=case_id)
def test_segments_match_oracle(p, kind, options, scale):
    needs_hopper()
    check_segments(p, kind, options, scale)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, kind, tiles",
    [
        (
            Problem(2, 512, 512, 4, 2, 64, True, "bf16"),
            "packed",
            ForwardTiles(block_q=128, block_kv=128),
        ),
        (
            Problem(1, 512, 256, 4, 1, 128, False, "f16"),
            "unsorted",
            ForwardTiles(block_kv=64, num_stages=4),
        ),
        (
            Problem(2, 256, 1024, 4, 2, 64, False, "bf16"),
            "gap",
            ForwardTiles(block_kv=64, num_stages=3),
        ),
        (
            Problem(8, 512, 512, 8, 2, 64, True, "bf16"),
            "packed-lengths",
            ForwardTiles(persistent=True),
        ),
    ],
    ids=case_id,
)
def test_segments_match_oracle_with_other_tiles(p, kind, tiles):
    needs_hopper()
    check_segments(p, kind, {}, None, tiles)


@pytest.mark.gpu
def test_segments_deterministic():
    needs_hopper()
    p = Problem(2, 512, 256, 4, 2, 128, True, "bf16")
    (q, k, v, _, _), _ = random_inputs(p)
    arrays = segment_arrays("packed-lengths", p.batch, p.q_len, p.kv_len)
    fn = jax.jit(segments_forward_fn(p, window=(40, 0)))
    ids = (arrays.q_segment_ids, arrays.kv_segment_ids)
    assert_bitwise_equal(fn(q, k, v, *ids), fn(q, k, v, *ids))


# -- windows, soft caps and segment ids in the Mosaic GPU interpreter (CPU) ----------------------

# (problem, Mosaic forward options, scale or None for 1/sqrt(H), tiles or None): windows causal
# and not, left-only and right-only, T < S and T > S, narrow ones leaving rows and whole CTAs
# without keys; soft caps at scale 1 (so that the cap bites), alone, causal and with a window;
# 128-row consumers over 64-key tiles and a 4-stage ring. H=256 (64-key tiles) and narrow
# windows give the consumers ranges that differ, hence drain steps.
MASKED_INTERPRET_CASES = [
    (Problem(1, 256, 512, 2, 1, 128, False, "bf16"), dict(window=(64, 32)), None, None),
    (Problem(1, 256, 512, 2, 2, 128, False, "f16"), dict(window=(70, 10**6)), None, None),
    (Problem(1, 256, 256, 2, 1, 128, False, "bf16"), dict(window=(10**6, 40)), None, None),
    (Problem(1, 512, 128, 2, 1, 64, True, "bf16"), dict(window=(1, 0)), None, None),
    pytest.param(  # H=256 masked: the causal window case below covers it in CI
        Problem(1, 512, 256, 2, 1, 256, False, "f16"),
        dict(window=(10, 3)),
        None,
        None,
        marks=long_only,
    ),
    (Problem(1, 256, 256, 2, 1, 128, False, "bf16"), dict(soft_cap=5.0), 1.0, None),
    (Problem(1, 256, 512, 2, 2, 64, True, "f16"), dict(soft_cap=30.0), 1.0, None),
    (
        Problem(1, 512, 256, 2, 1, 256, True, "bf16"),
        dict(window=(64, 0), soft_cap=10.0),
        1.0,
        None,
    ),
    (
        Problem(1, 512, 512, 2, 1, 128, True, "bf16"),
        dict(window=(70, 0)),
        None,
        ForwardTiles(block_q=128, block_kv=64),
    ),
    (
        Problem(1, 512, 256, 2, 1, 64, False, "bf16"),
        dict(window=(30, 90), soft_cap=10.0),
        None,
        ForwardTiles(block_kv=64, num_stages=4),
    ),
]


@pytest.mark.parametrize("p, options, scale, tiles", MASKED_INTERPRET_CASES, ids=case_id)
@pytest.mark.ci_slice(2)
def test_masked_matches_oracle_interpreted(p, options, scale, tiles):
    """Windows and soft caps: the tile ranges, drain steps, element-wise masks and empty rows
    (out exactly 0, lse -inf) against the float64 oracle, race detector on."""
    check_masked(p, options, scale, tiles, interpreted=True)


# (problem, segment kind, options, scale, tiles): packed documents (causal), padding with a
# batch entry that sees no key, packed documents with lengths under a window and a soft cap,
# a gap both consumers drain (64-key tiles, 3 stages), unsorted ids (every tile masked).
SEGMENT_INTERPRET_CASES = [
    (Problem(1, 256, 256, 2, 1, 128, True, "bf16"), "packed", {}, None, None),
    # Lengths and f16: the packed-lengths case and the masked cases cover them in CI.
    pytest.param(
        Problem(2, 256, 512, 2, 2, 64, False, "f16"), "lengths", {}, None, None, marks=long_only
    ),
    (
        Problem(2, 512, 256, 1, 1, 128, False, "bf16"),
        "packed-lengths",
        dict(window=(30, 60), soft_cap=10.0),
        1.0,
        None,
    ),
    (
        Problem(1, 256, 512, 2, 1, 64, False, "bf16"),
        "gap",
        {},
        None,
        ForwardTiles(block_kv=64, num_stages=3),
    ),
    (
        Problem(2, 512, 512, 2, 1, 64, True, "bf16"),
        "packed",
        dict(window=(100, 0)),
        None,
        ForwardTiles(block_q=128, block_kv=64),
    ),
]


@pytest.mark.parametrize("p, kind, options, scale, tiles", SEGMENT_INTERPRET_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_segments_match_oracle_interpreted(p, kind, options, scale, tiles):
    """Segment ids and lengths: the XLA tile plan read in the kernel, ids in shared memory
    (query ids with Q, KV ids in K's ring slot), rows without keys, race detector on."""
    check_segments(p, kind, options, scale, tiles, interpreted=True)


# Persistent CTAs in the interpreter, with 3 "SMs": each CTA walks several items (some one fewer),
# so the ring's slots and barrier phases run across items, and the next item's Q loads into the
# second buffer while the first's output is copied out. Items of different lengths (causal,
# windows), items without KV steps (a batch entry whose rows see no key), drain steps.
#
# With segment ids the interpreter itself sometimes hangs on a machine with few cores: a
# warpgroup's program stalls inside XLA before its first callback (consumer 0's first Q copy never
# lands; seen 2 times in 5 runs of the file on 2 cores, 1 in 14 alone, and every time on one core
# with a variant of the consumer that loads fewer plan words). It looks like XLA's CPU runtime
# running a program's independent callbacks on a pool as large as the machine, where blocked
# barrier waits can hold every thread. Those two cases run where there are 8 cores or more; the
# persistent kernel with segment ids passes compiled on the H200 (test_segments_match_oracle_with_
# other_tiles).
MANY_CORES = pytest.mark.skipif(
    (os.cpu_count() or 1) < 8,
    reason="the Mosaic GPU interpreter can hang on persistent CTAs with segment ids on few cores",
)
PERSISTENT_INTERPRET_CASES = [
    (Problem(2, 512, 512, 2, 1, 64, True, "bf16"), None, {}, ForwardTiles(block_q=128)),
    (Problem(2, 256, 512, 2, 2, 64, False, "f16"), None, {}, ForwardTiles()),
    (
        Problem(1, 512, 256, 2, 1, 128, True, "bf16"),
        None,
        {},
        ForwardTiles(block_kv=64, num_stages=3),
    ),
    (Problem(2, 512, 512, 1, 1, 128, True, "bf16"), None, dict(window=(70, 0)), ForwardTiles()),
    pytest.param(
        Problem(2, 512, 512, 2, 1, 128, True, "bf16"),
        "packed",
        {},
        ForwardTiles(),
        marks=MANY_CORES,
    ),
    pytest.param(
        Problem(2, 256, 512, 2, 2, 64, False, "f16"),
        "lengths",
        {},
        ForwardTiles(block_kv=64),
        marks=MANY_CORES,
    ),
]


@pytest.mark.parametrize("p, kind, options, tiles", PERSISTENT_INTERPRET_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_persistent_matches_oracle_interpreted(p, kind, options, tiles, monkeypatch):
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 3)
    tiles = dataclasses.replace(tiles, persistent=True)
    if kind is None:
        check_masked(p, options, None, tiles, interpreted=True)
    else:
        check_segments(p, kind, options, None, tiles, interpreted=True)


def test_persistent_snake_matches_oracle_interpreted(monkeypatch):
    """16 causal items on 5 CTAs: three whole rounds, the second backwards, and a fourth of one
    item, backwards (CTA 4 takes it): a count or place off by one hangs or leaves rows
    unwritten."""
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 5)
    p = Problem(2, 512, 512, 2, 1, 128, True, "bf16")
    check_masked(p, {}, None, ForwardTiles(persistent=True, causal_pairs=False), interpreted=True)


def test_step_descriptors_match_oracle_interpreted(monkeypatch):
    """ForwardTiles.step_descriptors: each consumer's Q through an index that is always 0, over
    persistent items that alternate Q's buffers (a 1 would read the other buffer's Q, or the
    other consumer's)."""
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 3)
    p = Problem(1, 500, 512, 3, 1, 64, True, "bf16")
    tiles = ForwardTiles(persistent=True, step_descriptors=True)
    check_masked(p, {}, None, tiles, interpreted=True)


def test_persistent_pairs_match_oracle_interpreted(monkeypatch):
    """Causal query tiles in pairs: 3 heads x 4 query tiles (ragged T) are 6 pairs on 3 CTAs,
    a round of whole pairs, then a tail of 6 single tiles that starts at the second pair of
    the second head; with GQA, so that each item's head maps to its KV head."""
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 3)
    p = Problem(1, 500, 512, 3, 1, 128, True, "bf16")
    tiles = ForwardTiles(persistent=True)
    spec = MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=True)
    assert mosaic_schedule.paired_causal_rows(spec, tiles, has_segments=False)
    tail = mosaic_schedule._Work(1, 3, 4, reverse=True, paired=True).tail(3)
    assert (tail.pair_rounds, tail.first_head, tail.first_pair, tail.items) == (1, 1, 1, 6)
    check_masked(p, {}, None, tiles, interpreted=True)


@pytest.mark.gpu
def test_segments_through_the_api_match_oracle(monkeypatch):
    """backend='mosaic' with segment ids: packed documents with query and key lengths, causal;
    out, lse and the Triton backward's gradients against the float64 oracle."""
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    (q, k, v, d_out, d_lse), (q64, k64, v64, d_out64, d_lse64) = random_inputs(p)
    rng = np.random.default_rng(1)
    ids = np.sort(rng.integers(0, 4, size=(p.batch, p.q_len)), axis=1).astype(np.int32)
    kwargs = dict(
        q_segment_ids=jnp.asarray(ids),
        kv_segment_ids=jnp.asarray(ids),
        query_seq_lengths=jnp.array([400, 512]),
        key_value_seq_lengths=jnp.array([512, 300]),
    )
    arrays = masks.make_arrays(p.batch, p.q_len, p.kv_len, **kwargs)
    spec = MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=True, has_segments=True)
    visible = np.asarray(masks.dense(spec, arrays))
    empty = ~visible[:, 0].any(axis=-1)  # [B, T]
    d_lse = jnp.where(empty[:, None], 0.0, d_lse)  # no gradient through an lse of -inf
    d_lse64 = np.where(empty[:, None], 0.0, d_lse64)
    run = jax.jit(functools.partial(outputs_and_grads, public_fn(p, backend="mosaic", **kwargs)))
    assert "mosaic_gpu_v2" in custom_call_targets(run.lower(q, k, v, d_out, d_lse).as_text())
    results = run(q, k, v, d_out, d_lse)
    plain = functools.partial(masked_in_dtype, scale=p.scale, visible=visible)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(q, k, v, d_out, d_lse)
    r = attention_oracle_f64(q64, k64, v64, d_out64, d_lse64, scale=p.scale, visible=visible)
    oracles = tuple(r[name] for name in ("out", "lse", "dq", "dk", "dv"))
    assert_within_tolerance(results, baselines, oracles, floor=p.floor)


def test_masked_default_call_on_hopper_matches_oracle_interpreted(monkeypatch):
    """The public forward as a Hopper runs it (backend=None) with segment ids, lengths and a
    causal window, in the interpreter: the API's mask arrays reach the Mosaic forward; out and
    lse against the float64 oracle (the gradients: test_mosaic_backward.py)."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    p = Problem(2, 256, 256, 4, 2, 128, True, "bf16")
    (q, k, v, d_out, d_lse), (q64, k64, v64, d_out64, d_lse64) = random_inputs(p)
    ids = np.sort(np.random.default_rng(3).integers(0, 3, (p.batch, p.q_len)), axis=1)
    kwargs = dict(
        q_segment_ids=jnp.asarray(ids, jnp.int32),
        kv_segment_ids=jnp.asarray(ids, jnp.int32),
        query_seq_lengths=jnp.array([200, 256]),
        key_value_seq_lengths=jnp.array([256, 130]),
        local_window_size=(100, 0),
    )
    call = jax.jit(public_fn(p, **kwargs))
    lowered = lower_for_h200(call, *abstract_inputs(p)[:3])
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    array_kwargs = {name: value for name, value in kwargs.items() if name != "local_window_size"}
    arrays = masks.make_arrays(p.batch, p.q_len, p.kv_len, **array_kwargs)
    spec = MaskSpec(
        q_len=p.q_len, kv_len=p.kv_len, is_causal=True, window=(100, 0), has_segments=True
    )
    visible = np.asarray(masks.dense(spec, arrays))
    with interpret_mosaic():
        out, lse = (np.asarray(x.astype(jnp.float32)) for x in call(q, k, v))
    plain = functools.partial(masked_in_dtype, scale=p.scale, visible=visible)
    baselines = jax.jit(plain)(q, k, v)
    r = attention_oracle_f64(q64, k64, v64, d_out64, d_lse64, scale=p.scale, visible=visible)
    assert_within_tolerance(
        (out, lse), baselines, (r["out"], r["lse"]), floor=p.floor, names=("out", "lse")
    )


# -- any T and S, head dims 80, 96 and 192 ---------------------------------------------------------

# What TMA reads past an array's end in the interpreter, instead of the hardware's zeros: finite
# (V past S meets a probability of exactly 0, and 0 * NaN would not be 0), and large enough that
# a key past S or a row past T leaking into a kept output shows at once.
GARBAGE = 1000.0

# Lengths that are multiples of 8 run in place (TMA windows past the arrays' ends); others are
# padded to 8 by the wrapper; head dims 80/96 and 192 (64-key tiles) run as they are.
RAGGED_LOWERING_CASES = [
    (Problem(2, 197, 197, 4, 4, 64, False, "bf16"), {}),
    (Problem(1, 1000, 1000, 4, 2, 192, True, "bf16"), {}),
    pytest.param(Problem(1, 577, 577, 2, 2, 64, True, "f16"), {}, marks=long_only),
    pytest.param(Problem(1, 2048, 2048, 4, 2, 80, False, "bf16"), {}, marks=long_only),
    pytest.param(
        Problem(1, 300, 1000, 2, 1, 128, False, "bf16"),
        dict(window=(100, 50), soft_cap=20.0),
        marks=long_only,
    ),
    pytest.param(Problem(1, 1, 5, 2, 1, 64, False, "bf16"), {}, marks=long_only),
]


@pytest.mark.parametrize("p, options", RAGGED_LOWERING_CASES, ids=case_id)
def test_lowers_with_any_lengths_and_head_dims(p, options):
    """One Mosaic GPU call; out [B, T, N, H] and lse [B, N, T] at the caller's T and H."""
    lowered = lower_for_h200(forward_fn(p, **options), *abstract_qkv(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    out, lse = lowered.out_info
    assert (out.shape, out.dtype) == ((p.batch, p.q_len, p.num_heads, p.head_dim), p.jnp_dtype)
    assert (lse.shape, lse.dtype) == ((p.batch, p.num_heads, p.q_len), jnp.float32)


def test_lowers_with_segment_ids_at_any_lengths():
    p = Problem(2, 197, 333, 4, 2, 96, True, "bf16")
    run = segments_forward_fn(p, window=(50, 0))
    lowered = lower_for_h200(run, *abstract_qkv(p), *abstract_ids(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    assert lowered.out_info[0].shape == (p.batch, p.q_len, p.num_heads, p.head_dim)


def test_lengths_not_multiples_of_8_are_padded_and_others_run_in_place():
    """The wrapper pads T and S to 8 (Mosaic GPU tiles the TMA windows' rows by 8), and nothing
    else: at T = S = 3000, H = 128 the kernel reads q, k, v as given (the one slice is the
    lse's, written over whole tiles); at H = 96 only q's T is padded, not H."""
    p = Problem(1, 3000, 3000, 4, 2, 128, True, "bf16")
    text = lower_for_h200(forward_fn(p), *abstract_qkv(p)).as_text()
    assert "stablehlo.pad" not in text
    slices = [line for line in text.splitlines() if "stablehlo.slice" in line]
    assert len(slices) == 1 and "tensor<1x4x3072xf32>) -> tensor<1x4x3000xf32>" in slices[0]
    p = Problem(1, 197, 200, 4, 2, 96, True, "bf16")
    text = lower_for_h200(forward_fn(p), *abstract_qkv(p)).as_text()
    assert "tensor<1x200x4x96xbf16>" in text  # q padded in T; k, v as given
    assert "x128xbf16>" not in text
    assert text.count("stablehlo.pad") == 1 and "stablehlo.slice" in text


# (problem, Mosaic forward options, tiles, oob_fill): in place with TMA windows past the ends
# (T = S = 200), 8 queries in a CTA of 256 rows, padded by the wrapper (T = 130, S = 333;
# H = 96 as it is), causal with T > S and GQA, a window, H 96 causal and 192 (64-key tiles), a
# call of 5 queries and 3 keys at H=80, persistent CTAs.
RAGGED_INTERPRET_CASES = [
    (Problem(1, 200, 200, 2, 1, 64, False, "bf16"), {}, None, GARBAGE),
    # A left side no real row feels (left >= T - 1) that hides keys from the rows past T that
    # consumer 1 runs: it must still walk the producer's first step (else the ring deadlocks).
    (
        Problem(1, 8, 200, 1, 1, 64, False, "bf16"),
        dict(window=(7, 0)),
        ForwardTiles(block_q=128, block_kv=64),
        GARBAGE,
    ),
    (Problem(1, 130, 333, 2, 1, 96, False, "f16"), {}, None, 0),
    (Problem(1, 200, 136, 2, 1, 64, True, "bf16"), {}, None, GARBAGE),
    pytest.param(Problem(1, 333, 136, 4, 2, 64, True, "bf16"), {}, None, GARBAGE, marks=long_only),
    pytest.param(
        Problem(1, 200, 328, 2, 1, 128, False, "bf16"),
        dict(window=(50, 20)),
        None,
        GARBAGE,
        marks=long_only,
    ),
    pytest.param(Problem(1, 200, 200, 2, 2, 96, True, "bf16"), {}, None, GARBAGE, marks=long_only),
    pytest.param(
        Problem(1, 136, 200, 2, 1, 192, False, "f16"),
        dict(soft_cap=20.0),
        None,
        GARBAGE,
        marks=long_only,
    ),
    pytest.param(Problem(1, 5, 3, 1, 1, 80, False, "bf16"), {}, None, 0, marks=long_only),
    pytest.param(
        Problem(2, 200, 328, 2, 1, 64, False, "bf16"),
        {},
        ForwardTiles(persistent=True),
        GARBAGE,
        marks=long_only,
    ),
]


# Ragged last tiles: the interpreter is slow on these lengths, so beyond
# test_lse_rows_of_a_ragged_last_tile_stay_in_their_head they run with PALLAS_FLASH_SWEEP.
@long_only
@pytest.mark.parametrize("p, options, tiles, oob_fill", RAGGED_INTERPRET_CASES, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle_interpreted(
    p, options, tiles, oob_fill, monkeypatch
):
    """Ragged last query and key tiles: keys past S masked, rows past T not kept, with garbage
    past the arrays' ends; head dims 80 and 96: out, lse against the float64 oracle."""
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 3)
    check_masked(p, options, None, tiles, interpreted=True, oob_fill=oob_fill)


@long_only
def test_segments_at_any_lengths_match_oracle_interpreted():
    """Key ids past S read as 0 (the hardware's fill), which equals document 0's id: only the
    bound on S keeps those keys out. Queries and keys past their lengths, T = S = 200."""
    p = Problem(2, 200, 200, 1, 1, 64, True, "bf16")
    check_segments(p, "packed-lengths", {}, None, interpreted=True)


RAGGED_GPU_CASES = [
    (Problem(1, 3000, 3000, 4, 2, 128, True, "bf16"), {}),
    (Problem(8, 197, 197, 12, 12, 64, False, "bf16"), {}),
    (Problem(4, 577, 577, 16, 16, 64, False, "f16"), {}),
    (Problem(2, 2048, 2048, 8, 2, 96, True, "bf16"), {}),
    (Problem(2, 2048, 2048, 8, 8, 80, False, "bf16"), {}),
    (Problem(2, 1000, 1000, 8, 2, 192, True, "bf16"), {}),
    (Problem(2, 130, 333, 4, 2, 128, False, "f16"), {}),
    (Problem(2, 1, 7, 4, 1, 64, False, "bf16"), {}),
    (Problem(2, 1000, 777, 4, 2, 128, True, "bf16"), dict(window=(300, 0))),
    (Problem(2, 600, 900, 4, 2, 96, False, "bf16"), dict(window=(100, 200), soft_cap=20.0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p, options", RAGGED_GPU_CASES, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle(p, options):
    needs_hopper()
    check_masked(p, options, None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, kind",
    [
        (Problem(2, 1000, 1000, 4, 2, 128, True, "bf16"), "packed-lengths"),
        (Problem(2, 197, 333, 4, 2, 80, False, "bf16"), "lengths"),
    ],
    ids=case_id,
)
def test_segments_at_any_lengths_match_oracle(p, kind):
    needs_hopper()
    check_segments(p, kind, {}, None)


# -- through the public API: the Mosaic forward, the Triton backward ------------------------------


def public_fn(p: Problem, **kwargs):
    return functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, **kwargs
    )


@pytest.mark.parametrize(
    "p, mosaic_calls, triton_backward",
    [
        # H 64/128 (from 2k keys at H=64) and 256 (split dK/dV consumers): the Mosaic forward,
        # dK/dV and dQ kernels.
        (Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"), 3, []),
        (Problem(2, 2048, 2048, 8, 2, 64, False, "bf16"), 3, []),
        (Problem(2, 1024, 1024, 8, 2, 256, True, "bf16"), 3, []),
        # H=64 below 2k keys: the Triton backward reads the Mosaic forward's out, lse.
        (
            Problem(4, 1024, 1024, 8, 2, 64, True, "bf16"),
            1,
            ["pallas_flash_backward_dkv", "pallas_flash_backward_dq"],
        ),
    ],
    ids=case_id,
)
@pytest.mark.ci_slice(2)
def test_default_call_on_hopper_lowers_to_the_chosen_kernels(
    monkeypatch, p, mosaic_calls, triton_backward
):
    """backend=None on a Hopper GPU: the Mosaic forward, and the Mosaic backward where it is
    supported and measured faster, else the Triton dK/dV and dQ kernels."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    lowered = lower_for_h200(
        functools.partial(outputs_and_grads, public_fn(p)), *abstract_inputs(p)
    )
    assert custom_call_targets(lowered.as_text()).count("mosaic_gpu_v2") == mosaic_calls
    assert sorted(triton_calls(lowered)) == triton_backward


# Shapes the default call sends to the Mosaic forward; T < S and T > S; GQA.
PUBLIC_GPU_PROBLEMS = [
    Problem(2, 256, 512, 8, 2, 64, True, "bf16"),
    Problem(2, 512, 256, 8, 2, 128, True, "f16"),
    Problem(2, 512, 512, 8, 8, 128, False, "bf16"),
    Problem(2, 256, 256, 8, 4, 256, True, "bf16"),
    Problem(2, 2048, 2048, 8, 2, 64, True, "bf16"),  # H=64 from 2k keys: the Mosaic backward
]


@pytest.mark.gpu
@pytest.mark.parametrize("p", PUBLIC_GPU_PROBLEMS, ids=case_id)
def test_default_call_on_hopper_matches_oracle(p):
    """out, lse and dq, dk, dv of backend=None against the float64 oracle, and the lowered call
    holds the Mosaic kernel (so this is the Mosaic forward feeding the Triton backward)."""
    check_default_call_on_hopper(p)


def check_default_call_on_hopper(p: Problem):
    """The public call's out, lse and gradients (backend=None, compiled on this Hopper) against
    the float64 oracle, the lowered call holding a Mosaic kernel."""
    needs_hopper()
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    run = jax.jit(functools.partial(outputs_and_grads, public_fn(p)))
    assert "mosaic_gpu_v2" in custom_call_targets(run.lower(q, k, v, d_out, d_lse).as_text())
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@pytest.mark.gpu
def test_default_call_with_a_large_scale_matches_oracle():
    """scale=2 (qk_scale ~ 2.9: masked logits times it leave float32's range, exp2 gives 0)
    reaches both the Mosaic forward and the Triton backward."""
    needs_hopper()
    p, scale = Problem(2, 256, 512, 4, 2, 128, True, "bf16"), 2.0
    (q, k, v, d_out, d_lse), (q64, k64, v64, d_out64, d_lse64) = random_inputs(p)
    run = jax.jit(functools.partial(outputs_and_grads, public_fn(p, scale=scale)))
    results = run(q, k, v, d_out, d_lse)
    plain = functools.partial(attention_in_dtype, scale=scale, is_causal=True)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(q, k, v, d_out, d_lse)
    oracles = (
        *attention_f64(q64, k64, v64, scale=scale, is_causal=True),
        *attention_grads_f64(q64, k64, v64, d_out64, d_lse64, scale=scale, is_causal=True),
    )
    assert all(bool(jnp.isfinite(x).all()) for x in results)
    assert_within_tolerance(results, baselines, oracles, floor=p.floor)


@pytest.mark.gpu
def test_vmap_over_a_leading_axis():
    """vmap of the default call (Mosaic forward): Pallas batches the kernel by adding a grid axis;
    every slice's outputs and gradients match the float64 oracle."""
    needs_hopper()
    num_slices = 3
    p = Problem(num_slices * 2, 256, 256, 4, 2, 128, True, "bf16")
    args, f64 = random_inputs(p)
    results, baselines = (
        vmapped_outputs_and_grads(attn, args, num_slices) for attn in (public_fn(p), plain_fn(p))
    )
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


def test_vmap_lowers_to_one_mosaic_call(monkeypatch):
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    p = Problem(2, 256, 256, 4, 2, 64, True, "bf16")
    q, k, v = (jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in abstract_inputs(p)[:3])
    lowered = lower_for_h200(jax.vmap(public_fn(p, backend="mosaic")), q, k, v)
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    out, lse = lowered.out_info
    assert out.shape == (3, 2, 256, 4, 64) and lse.shape == (3, 2, 4, 256)


def test_vmap_with_segment_ids_lowers_to_one_mosaic_call(monkeypatch):
    """Segment ids and key lengths under vmap, marked verified: the tile plan is batched in
    XLA, the kernel stays one Mosaic GPU call."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    p = Problem(2, 256, 256, 4, 2, 64, True, "bf16")
    q, k, v = (jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in abstract_qkv(p))
    ids = jax.ShapeDtypeStruct((3, p.batch, p.q_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((3, p.batch), jnp.int32)

    def attention(q, k, v, ids, lengths):
        call = public_fn(p, backend="mosaic", q_segment_ids=ids, key_value_seq_lengths=lengths)
        return call(q, k, v)

    lowered = lower_for_h200(jax.vmap(attention), q, k, v, ids, lengths)
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"]
    out, lse = lowered.out_info
    assert out.shape == (3, 2, 256, 4, 64) and lse.shape == (3, 2, 4, 256)


@pytest.mark.parametrize("option", ["window", "soft_cap", "segments"])
@pytest.mark.ci_slice(1)
def test_masked_default_call_lowers_to_the_mosaic_forward_and_backward(monkeypatch, option):
    """backend=None on Hopper: windows, soft caps and segment ids take the Mosaic forward and
    the Mosaic backward (three Mosaic calls, no Triton kernel)."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    p = Problem(2, 1024, 1024, 8, 2, 128, True, "bf16")
    kwargs = {
        "window": dict(local_window_size=(256, 0)),
        "soft_cap": dict(logits_soft_cap=30.0),
        "segments": dict(
            q_segment_ids=jnp.zeros((2, 1024), jnp.int32),
            key_value_seq_lengths=jnp.array([1000, 17]),
        ),
    }
    q, k, v = abstract_qkv(p)

    fn = functools.partial(outputs_and_grads, public_fn(p, **kwargs[option]))
    lowered = lower_for_h200(fn, q, k, v, q, abstract_lse(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"] * 3
    assert triton_calls(lowered) == {}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, kwargs",
    [
        (Problem(2, 512, 256, 8, 2, 128, True, "bf16"), dict(local_window_size=(40, 0))),
        (Problem(2, 256, 512, 8, 2, 64, False, "f16"), dict(local_window_size=(64, 100))),
        (Problem(2, 512, 512, 8, 2, 128, True, "bf16"), dict(logits_soft_cap=5.0)),
    ],
    ids=case_id,
)
def test_masked_call_through_the_api_matches_oracle(monkeypatch, p, kwargs):
    """backend='mosaic' with masks: out, lse and the Triton backward's
    gradients from the Mosaic forward's residuals, against the float64 oracle."""
    needs_hopper()
    (q, k, v, d_out, d_lse), (q64, k64, v64, d_out64, d_lse64) = random_inputs(p)
    window, soft_cap = kwargs.get("local_window_size"), kwargs.get("logits_soft_cap")
    visible = visibility(p, window)
    empty = ~visible.any(axis=1)
    d_lse = jnp.where(empty[None, None], 0.0, d_lse)  # no gradient through an lse of -inf
    d_lse64 = np.where(empty[None, None], 0.0, d_lse64)
    run = jax.jit(functools.partial(outputs_and_grads, public_fn(p, backend="mosaic", **kwargs)))
    assert "mosaic_gpu_v2" in custom_call_targets(run.lower(q, k, v, d_out, d_lse).as_text())
    results = run(q, k, v, d_out, d_lse)
    plain = functools.partial(masked_in_dtype, scale=p.scale, visible=visible, soft_cap=soft_cap)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(q, k, v, d_out, d_lse)
    r = attention_oracle_f64(
        q64, k64, v64, d_out64, d_lse64, scale=p.scale, visible=visible, soft_cap=soft_cap
    )
    oracles = tuple(r[name] for name in ("out", "lse", "dq", "dk", "dv"))
    assert_within_tolerance(results, baselines, oracles, floor=p.floor)


# -- log_sum --------------------------------------------------------------------------------------


def log_sum_case():
    """q, k, v, sinks and the float64 log_sum [B, N, T] of a non-causal call with window (8, 0)
    over 96 keys: rows 104 and on see no key (log_sum 0, their lse the sink); head 1's sink of
    30 outweighs every row's keys, head 0's of 0.5 does not."""
    p = Problem(1, 128, 96, 2, 1, 64, False, "bf16")
    (q, k, v, _, _), (q64, k64, _, _, _) = random_inputs(p, seed=4)
    sinks = jnp.asarray([[0.5, 30.0]], jnp.float32)
    rows, keys = np.arange(p.q_len)[:, None], np.arange(p.kv_len)[None, :]
    visible = (keys <= rows) & (keys >= rows - 8)
    k64 = np.repeat(k64, p.num_heads // p.num_kv_heads, axis=2)
    logits = np.where(visible, p.scale * np.einsum("btnh,bsnh->bnts", q64, k64), -np.inf)
    top = np.maximum(logits.max(axis=-1), np.asarray(sinks, np.float64)[..., None])
    terms = np.exp(logits - top[..., None]).sum(axis=-1)
    log_sum = np.log(terms + np.exp(np.asarray(sinks, np.float64)[..., None] - top))
    return p, (q, k, v, sinks), log_sum


def check_log_sum(persistent: bool, *, interpreted: bool):
    """with_log_sum: log_sum, the log of each row's denominator relative to the larger of its
    max and its sink, as float64's (0 for rows that see no key), and out and lse bitwise those
    of the call without it."""
    p, (q, k, v, sinks), want = log_sum_case()
    tiles = ForwardTiles(persistent=persistent)

    def forward(with_log_sum):
        return call_mosaic_forward(
            q,
            k,
            v,
            scale=p.scale,
            is_causal=False,
            window=(8, 0),
            sinks=sinks,
            tiles=tiles,
            with_log_sum=with_log_sum,
        )

    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        out, lse, log_sum = jax.jit(lambda: forward(True))()
        plain_out, plain_lse = jax.jit(lambda: forward(False))()
        out, lse, log_sum, plain_out, plain_lse = (
            np.asarray(x.astype(jnp.float32)) for x in (out, lse, log_sum, plain_out, plain_lse)
        )
    assert_bitwise_equal(out, plain_out)
    assert_bitwise_equal(lse, plain_lse)
    assert np.all(log_sum[:, :, 104:] == 0.0)
    np.testing.assert_allclose(log_sum, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("persistent", [True, pytest.param(False, marks=long_only)])
def test_log_sum_matches_oracle_interpreted(persistent, monkeypatch):
    """Persistent: both items (heads) on one CTA, whose second epilogue reuses the rows'
    staging buffer."""
    monkeypatch.setattr(mosaic_forward_module, "DEFAULT_NUM_SMS", 1)
    check_log_sum(persistent, interpreted=True)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [True, False])
def test_log_sum_matches_oracle(persistent):
    needs_hopper()
    check_log_sum(persistent, interpreted=False)
