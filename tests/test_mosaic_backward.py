"""The Mosaic GPU backward (pallas_flash.mosaic.backward and its dK/dV and dQ kernels): lowering
for an abstract H200 on CPU, the kernels' tile ranges, and gradients against the float64
oracle, in jax's Mosaic GPU interpreter on CPU (tests/support/mosaic_interpret.py) and on a
Hopper GPU, at any T and S and head dims 80 and 96.

As for the forward (test_mosaic_forward.py), lowering on CPU runs Pallas' lowering, Mosaic GPU's
layout inference and its dialect lowering (shared-memory budget included) in Python; only the GPU
code generation waits for a real GPU. The tiles and `why_not` are
tests/test_mosaic_backward_tiles.py's; masks tests/test_mosaic_backward_masks.py's; the fused
dQ tests/test_mosaic_backward_fused_dq.py's; shared helpers live in
tests/support/mosaic_backward.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.calls import oracle_outputs_and_grads, outputs_and_grads, plain_fn
from support.inputs import Problem, abstract_inputs, case_id, random_inputs
from support.kernels import call_mosaic_backward
from support.lowering import lower_for_h200
from support.mosaic_backward import (
    abstract_backward_args,
    backward_fn,
    check_against_oracle,
    mosaic_fn,
)
from support.mosaic_forward import (
    GARBAGE,
    abstract_ids,
    custom_call_targets,
    long_only,
    needs_hopper,
)
from support.mosaic_forward import forward_fn as mosaic_forward_fn
from support.mosaic_interpret import interpret_mosaic
from support.tolerance import assert_bitwise_equal, assert_within_tolerance

import pallas_flash
from pallas_flash import _passes, dispatch, tune_cache
from pallas_flash import device as device_lib
from pallas_flash._passes import KernelConfig
from pallas_flash._vjp import flash_attention_kernels
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles, ForwardTiles, backward_tiles
from pallas_flash.mosaic import schedule as mosaic_schedule
from pallas_flash.mosaic.dkv import dkv_mask_sides, q_tile_ranges
from pallas_flash.mosaic.dq import dq_mask_sides, kv_tile_ranges
from pallas_flash.triton import BlockSizes

# -- lowering for an abstract H200 (CPU) ----------------------------------------------------------

# H 64, 128, 192 and 256, causal and not, MHA / GQA / MQA, T == S, T < S and T > S, both dtypes.
LOWERING_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(1, 256, 512, 4, 1, 64, True, "f16"),
    Problem(2, 512, 256, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 128, True, "f16"),
    Problem(1, 128, 128, 2, 2, 128, True, "bf16"),
    Problem(1, 1024, 1024, 8, 1, 128, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 256, True, "bf16"),
    Problem(1, 512, 256, 4, 1, 192, False, "f16"),
    pytest.param(Problem(2, 256, 256, 4, 4, 256, False, "f16"), marks=long_only),
    pytest.param(Problem(2, 512, 256, 4, 2, 192, True, "bf16"), marks=long_only),
]


@pytest.mark.parametrize("p", LOWERING_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(3)
def test_lowers_for_h200(p):
    """Two Mosaic GPU calls (dK/dV, dQ) on the inputs as given, no transposes in XLA around
    them; dq [B, T, N, H], dk and dv [B, S, K, H] in the input dtype."""
    lowered = lower_for_h200(backward_fn(p), *abstract_backward_args(p))
    text = lowered.as_text()
    assert custom_call_targets(text) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]
    assert "stablehlo.transpose" not in text
    dq, dk, dv = lowered.out_info
    q, k = abstract_inputs(p)[:2]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)


# Masks: windows causal and not, soft caps, segment ids, combined; T != S; one consumer, three
# stages, 128-row streamed tiles. Lowering runs Mosaic GPU's layout inference on the masks' id
# vectors and selects, which the interpreter does not.
MASKED_LOWERING_CASES = [
    pytest.param(
        Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        None,
    ),
    pytest.param(
        Problem(1, 512, 256, 4, 1, 64, False, "f16"),
        dict(window=(30, 90)),
        BackwardTiles(num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 256, 256, 4, 2, 128, False, "bf16"),
        dict(soft_cap=30.0),
        BackwardTiles(block_kv_dq=128),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 512, 512, 4, 2, 64, True, "bf16"),
        dict(segments=True),
        BackwardTiles(block_q_dkv=128, block_kv_dq=128),
        marks=long_only,
    ),
    # The split dK/dV consumers (defaults at H 192 and 256) with every mask.
    pytest.param(
        Problem(2, 256, 512, 4, 2, 256, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        None,
    ),
    pytest.param(
        Problem(1, 512, 256, 4, 1, 192, False, "f16"),
        dict(window=(30, 90), segments=True),
        None,
        marks=long_only,
    ),
    # Head splits: f32 partials from both consumers, with every mask.
    pytest.param(
        Problem(2, 256, 512, 4, 1, 128, True, "bf16"),
        dict(window=(64, 0), soft_cap=20.0, segments=True),
        BackwardTiles(dkv_head_splits=4),
    ),
]


@pytest.mark.parametrize("p, options, tiles", MASKED_LOWERING_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_lowers_with_masks(p, options, tiles):
    options = dict(options)
    segments = options.pop("segments", False)

    def backward(q, k, v, out, lse, d_out, d_lse, *ids):
        return call_mosaic_backward(
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            scale=p.scale,
            is_causal=p.is_causal,
            segment_ids=ids or None,
            tiles=tiles,
            **options,
        )

    ids = abstract_ids(p) if segments else ()
    lowered = lower_for_h200(backward, *abstract_backward_args(p), *ids)
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]


# Tiles other than the defaults that fit the register budget of `mosaic.backward_tiles.why_not`;
# dK/dV consumers split by accumulator at H 64 and 128 too (128-row streamed tiles fit there),
# and at H=192 with one dQ consumer and a third stage.
OTHER_TILES = [
    (64, BackwardTiles(num_consumers=1)),
    (128, BackwardTiles(num_consumers=1)),
    (64, BackwardTiles(num_stages=3)),
    (128, BackwardTiles(num_stages=3)),
    (64, BackwardTiles(block_q_dkv=128, block_kv_dq=128)),
    (128, BackwardTiles(block_kv_dq=128)),
    (128, BackwardTiles(split_dkv=True, block_q_dkv=128)),
    (64, BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1)),
    (192, BackwardTiles(split_dkv=True, num_consumers=1, num_stages=3)),
    # A KV head's group over two CTAs (f32 partials), and the automatic choice, which splits
    # the small grids of these tests as far as the group goes.
    (128, BackwardTiles(dkv_head_splits=2)),
    (64, BackwardTiles(num_consumers=1, dkv_head_splits=0)),
    (128, BackwardTiles(split_dkv=True, dkv_head_splits=2)),
    # K and V addressed through an opaque zero (descriptors rebuilt each step), split or not.
    (128, BackwardTiles(step_descriptors=True)),
    (64, BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1, step_descriptors=True)),
]
# Lowered with PALLAS_FLASH_SWEEP only (CI lowers one split tile).
SWEEP_ONLY_TILES = [OTHER_TILES[i] for i in (7, 8, 11, 13)]


@pytest.mark.parametrize(
    "head_dim, tiles",
    [x if x not in SWEEP_ONLY_TILES else pytest.param(*x, marks=long_only) for x in OTHER_TILES],
    ids=case_id,
)
@pytest.mark.ci_slice(2)
def test_lowers_with_other_tiles(head_dim, tiles):
    p = Problem(1, 512, 512, 4, 2, head_dim, True, "bf16")
    lowered = lower_for_h200(backward_fn(p, tiles), *abstract_backward_args(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]


def test_forward_and_backward_lower_to_three_mosaic_calls():
    """The custom function of the GPU tests: the forward kernel and the two backward kernels."""
    p = Problem(2, 256, 512, 4, 2, 128, True, "bf16")
    lowered = lower_for_h200(
        functools.partial(outputs_and_grads, mosaic_fn(p)), *abstract_inputs(p)
    )
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"] * 3


def kernel_config(p: Problem) -> KernelConfig:
    return KernelConfig(
        spec=MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal),
        scale=p.scale,
        block_sizes=None,
        interpret=False,
        forward="mosaic",
        backward="mosaic",
    )


def kernels_fn(p: Problem):
    """q, k, v -> (out, lse) through the library's custom_vjp with both Mosaic opt-ins."""
    config = kernel_config(p)
    return lambda q, k, v: flash_attention_kernels(q, k, v, None, MaskArrays(), config)


def test_kernel_config_opt_in_lowers_to_mosaic_only():
    """KernelConfig(backward="mosaic"): the custom_vjp's backward runs the Mosaic kernels."""
    p = Problem(2, 256, 256, 4, 2, 64, False, "bf16")
    lowered = lower_for_h200(
        functools.partial(outputs_and_grads, kernels_fn(p)), *abstract_inputs(p)
    )
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2"] * 3


# (T, S) and windows for the range checks below: T == S, T < S, T > S, ragged lengths; windows
# one-sided, two-sided, narrow (rows without keys when T > S) and wider than the sequences.
RANGE_LENGTHS = [(256, 256), (256, 512), (512, 256), (200, 136), (136, 328)]
RANGE_WINDOWS = [None, (0, 0), (5, 3), (100, 30), (127, 0), (0, 90), (10**6, 40)]
RANGE_TILES = [
    BackwardTiles(),
    BackwardTiles(num_consumers=1),
    BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    # Split dK/dV consumers: one key block per CTA, one range for both.
    BackwardTiles(split_dkv=True, block_q_dkv=128),
]


@pytest.mark.parametrize(
    "q_len, kv_len, tiles",
    [
        # A fixed slice in CI, the rest with PALLAS_FLASH_SWEEP.
        pytest.param(q_len, kv_len, tiles, marks=() if (i + j) % 5 == 0 else long_only)
        for i, (q_len, kv_len) in enumerate(RANGE_LENGTHS)
        for j, tiles in enumerate(RANGE_TILES)
    ],
    ids=case_id,
)
def test_geometry_tile_ranges_match_the_mask(q_len, kv_len, tiles):
    """The ranges the kernels compute from the geometry (no segment ids), against brute force
    over causal and windows. dK/dV: per consumer's keys, the query tiles holding a row (< T)
    that sees some of them lie in [lo, hi), tiles in [full_lo, full_hi) are seen whole by every
    row < T, the CTA streams the hull of its consumers' ranges; without a side that
    `dkv_mask_sides` reports, the masked and drained loops of that side are empty. dQ the
    same per consumer's rows over KV tiles, where keys past S count as hidden."""
    rows_q, rows_kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    for is_causal in (False, True):
        for window in RANGE_WINDOWS:
            spec = MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal, window=window)
            seen = np.asarray(spec.geometry(rows_q, rows_kv)) & np.ones((q_len, kv_len), bool)
            case = (is_causal, window)
            # -- dK/dV: per consumer's keys, over query tiles of block_q_dkv rows --
            block_q, block_kv = tiles.block_q_dkv, tiles.block_kv_dkv
            num_q = -(-q_len // block_q)
            before, after = dkv_mask_sides(spec, tiles)
            for cta_start in range(0, kv_len, tiles.cta_kv_rows):
                hull = set()
                for kv_start in range(cta_start, cta_start + tiles.cta_kv_rows, block_kv):
                    (first, end), ranges = q_tile_ranges(spec, tiles, cta_start, kv_start)
                    first, end = int(first), int(end)
                    lo, full_lo, full_hi, hi = (int(x) for x in ranges)
                    assert first <= lo <= full_lo <= full_hi <= hi <= end <= max(num_q, first)
                    keys = seen[:, kv_start : kv_start + block_kv]
                    padded = np.zeros((num_q * block_q, keys.shape[1]), bool)
                    padded[:q_len] = keys
                    by_tile = padded.reshape(num_q, block_q, -1)
                    visited = np.flatnonzero(by_tile.any(axis=(1, 2)))
                    assert all(lo <= t < hi for t in visited), (case, kv_start, ranges)
                    for t in range(full_lo, full_hi):
                        rows = min(block_q, q_len - t * block_q)
                        assert by_tile[t, :rows].all(), (case, kv_start, t)
                    assert before or lo == full_lo == first, (case, kv_start)
                    assert after or full_hi == hi == end, (case, kv_start)
                    hull |= set(range(lo, hi))
                assert hull <= set(range(first, end)), (case, cta_start)
                assert not hull or (min(hull), max(hull) + 1) == (first, end), (case, cta_start)
            # -- dQ: per consumer's rows, over KV tiles of block_kv_dq keys --
            block_q, block_kv = tiles.block_q_dq, tiles.block_kv_dq
            num_kv = -(-kv_len // block_kv)
            before, after = dq_mask_sides(spec, tiles)
            for cta_start in range(0, q_len, tiles.cta_q_rows):
                hull = set()
                for q_start in range(cta_start, cta_start + tiles.cta_q_rows, block_q):
                    (first, end), ranges = kv_tile_ranges(spec, tiles, cta_start, q_start)
                    first, end = int(first), int(end)
                    lo, full_lo, full_hi, hi = (int(x) for x in ranges)
                    assert first <= lo <= full_lo <= full_hi <= hi <= end <= max(num_kv, first)
                    rows = seen[q_start : q_start + block_q]
                    padded = np.zeros((rows.shape[0], num_kv * block_kv), bool)
                    padded[:, :kv_len] = rows
                    by_tile = padded.reshape(rows.shape[0], num_kv, block_kv)
                    visited = np.flatnonzero(by_tile.any(axis=(0, 2)))
                    assert all(lo <= t < hi for t in visited), (case, q_start, ranges)
                    for t in range(full_lo, full_hi):
                        assert by_tile[:, t].all(), (case, q_start, t)
                    assert before or lo == full_lo == first, (case, q_start)
                    assert after or full_hi == hi == end, (case, q_start)
                    hull |= set(range(lo, hi))
                assert hull <= set(range(first, end)), (case, cta_start)
                assert not hull or (min(hull), max(hull) + 1) == (first, end), (case, cta_start)


# -- numerics in the Mosaic GPU interpreter (CPU) --------------------------------------------------

# Small problems through every code path: H 64 and 128, causal and not, MHA / GQA / MQA, T < S
# and T > S, consumers that skip causal tiles, 1 and 2 consumers, 2 and 3 stages (rings that
# wrap), 128-row streamed tiles. B=1 and few heads: the interpreter takes seconds per problem.
INTERPRET_PROBLEMS = [
    (Problem(1, 128, 256, 2, 2, 64, False, "bf16"), None),
    pytest.param(Problem(1, 256, 256, 4, 2, 64, True, "f16"), None, marks=long_only),
    (Problem(1, 128, 256, 2, 1, 128, True, "bf16"), None),
    pytest.param(
        Problem(1, 256, 128, 2, 1, 128, True, "bf16"),
        BackwardTiles(num_consumers=1),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 512, 1, 1, 64, False, "bf16"), BackwardTiles(num_stages=3), marks=long_only
    ),
    pytest.param(
        Problem(1, 384, 256, 2, 1, 64, True, "bf16"),
        BackwardTiles(num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    pytest.param(
        Problem(2, 256, 128, 2, 2, 128, False, "f16"), BackwardTiles(num_stages=3), marks=long_only
    ),
    pytest.param(
        Problem(1, 512, 512, 1, 1, 64, True, "bf16"),
        BackwardTiles(block_q_dkv=128, block_kv_dq=128),
        marks=long_only,
    ),
    # H 192 and 256 (split dK/dV consumers; in CI through a masked case,
    # MASK_CI_CASES), with PALLAS_FLASH_SWEEP: causal GQA, T < S and T > S, rings that wrap,
    # the split at H 64 and 128 with 128-row streamed tiles, one dQ consumer with three stages
    # at H=192.
    pytest.param(Problem(1, 128, 128, 2, 1, 256, True, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 128, 192, 2, 1, 192, False, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 128, 256, 4, 2, 256, False, "bf16"), None, marks=long_only),
    pytest.param(Problem(1, 256, 128, 2, 1, 256, True, "f16"), None, marks=long_only),
    pytest.param(Problem(1, 256, 256, 4, 1, 192, True, "bf16"), None, marks=long_only),
    pytest.param(Problem(2, 128, 192, 2, 2, 192, False, "f16"), None, marks=long_only),
    pytest.param(
        Problem(1, 256, 256, 2, 1, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, block_q_dkv=128),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 256, 2, 1, 64, True, "bf16"),
        BackwardTiles(split_dkv=True, block_q_dkv=128, num_consumers=1),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 384, 256, 2, 1, 192, True, "bf16"),
        BackwardTiles(split_dkv=True, num_consumers=1, num_stages=3),
        marks=long_only,
    ),
    # Head splits (in CI through a masked case, MASK_CI_CASES): MQA's group of 4 over 2 CTAs
    # (two query heads each); GQA with two KV heads (each CTA's KV head and partials' row),
    # automatic: the whole group, one consumer; with the split dK/dV consumers.
    pytest.param(
        Problem(1, 128, 256, 4, 1, 128, True, "bf16"),
        BackwardTiles(dkv_head_splits=2),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 256, 128, 4, 2, 64, True, "f16"),
        BackwardTiles(num_consumers=1, dkv_head_splits=0),
        marks=long_only,
    ),
    pytest.param(
        Problem(1, 384, 256, 4, 2, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, dkv_head_splits=2),
        marks=long_only,
    ),
]


@pytest.mark.parametrize("p, tiles", INTERPRET_PROBLEMS, ids=case_id)
@pytest.mark.ci_slice(1)
def test_matches_oracle_interpreted(p, tiles):
    """The Mosaic forward, then the Mosaic backward on its out and lse, both in the interpreter
    (race detector on): out, lse, dq, dk, dv against the float64 oracle. Checks the kernels'
    logic (tile ranges, masks, the lse cotangent, the barrier protocol); registers, layouts and
    ptxas are the GPU tests' part."""
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        out, lse = jax.jit(mosaic_forward_fn(p))(q, k, v)
        out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        grads = jax.jit(backward_fn(p, tiles))(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    results = (np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


def test_grouped_launch_matches_oracle_interpreted(monkeypatch):
    """Causal backward grids launched two heads at a time, level by level, over three heads (a
    smaller last group): dK/dV's and dQ's CTAs each find their (batch, head, tile)."""
    monkeypatch.setattr(mosaic_schedule, "LAUNCH_L2_BYTES", 128 * 1024)
    p = Problem(1, 256, 256, 3, 3, 64, True, "bf16")
    unit_bytes = p.q_len * 2 * p.head_dim * 2  # Q and dO (or K and V) of one head
    assert mosaic_schedule.launch_group(3, unit_bytes, is_causal=True) == 2
    test_matches_oracle_interpreted(p, None)


@pytest.mark.parametrize(
    "units, tiles, group", [(3, 4, 2), (6, 5, 3), (5, 3, 5), (7, 1, 3), (4, 4, 1), (16, 32, 16)]
)
def test_grouped_launch_is_a_permutation_longest_first(units, tiles, group):
    """Every grid position maps to one (unit, tile), a group of units at a time, level by level
    (the tiles' levels in order within a group); group 1 is the grid's own order."""
    order = [
        tuple(
            int(x)
            for x in mosaic_schedule.grouped_launch(u, t, units=units, tiles=tiles, group=group)
        )
        for u in range(units)
        for t in range(tiles)
    ]
    assert sorted(order) == [(u, t) for u in range(units) for t in range(tiles)]
    for first in range(0, units, group):
        members = range(first, min(first + group, units))
        block = order[first * tiles : (first + len(members)) * tiles]
        assert block == [(u, t) for t in range(tiles) for u in members]
    assert mosaic_schedule.launch_group(units, 1 << 30, is_causal=True) == 1
    assert mosaic_schedule.launch_group(units, 1, is_causal=False) == 1
    assert mosaic_schedule.launch_group(units, 1, is_causal=True) == units


@pytest.mark.parametrize(
    "p",
    [
        # test_mosaic_forward_masks' masked default call runs the same path in CI.
        pytest.param(Problem(1, 128, 256, 4, 2, 128, True, "bf16"), marks=long_only),
        pytest.param(Problem(2, 256, 512, 2, 1, 128, False, "f16"), marks=long_only),
        pytest.param(Problem(1, 128, 256, 4, 2, 256, True, "bf16"), marks=long_only),
        pytest.param(Problem(1, 256, 128, 2, 1, 192, False, "bf16"), marks=long_only),
    ],
    ids=case_id,
)
def test_default_call_on_hopper_matches_oracle_interpreted(monkeypatch, p):
    """The public call as a Hopper runs it (backend=None: the Mosaic forward and backward),
    the whole custom_vjp in the interpreter: validation, dispatch, residuals, delta and the GQA
    head mapping, against the float64 oracle."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@long_only
def test_tuned_tiles_through_the_default_call_match_oracle_interpreted(
    monkeypatch, tune_cache_path
):
    """Mosaic tiles from the autotune cache reach both kernels through the public call (a
    spy records them) and the result still matches the float64 oracle."""
    p = Problem(1, 256, 256, 2, 1, 64, True, "bf16")
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    forward = ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    backward = BackwardTiles(num_stages=3, block_kv_dq=128)
    shape_class = tune_cache.ShapeClass.of(
        64, jnp.bfloat16, is_causal=True, q_len=256, kv_len=256, masked=False
    )
    entry = tune_cache.TunedEntry(BlockSizes(), forward, backward)
    tune_cache.save_tuned(Device.h200().kind, {shape_class: entry})
    used = []
    for table, tiles in (
        (_passes._FORWARDS, "mosaic_forward_tiles"),
        (_passes._BACKWARDS, "mosaic_backward_tiles"),
    ):
        original = table["mosaic"]

        def spy(*args, original=original, tiles=tiles, config, **kwargs):
            used.append(getattr(config, tiles))
            return original(*args, config=config, **kwargs)

        monkeypatch.setitem(table, "mosaic", spy)
    # H=64 takes the Mosaic backward below 2k keys only when asked for.
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True, backend="mosaic"
    )
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = jax.jit(functools.partial(outputs_and_grads, attention))(q, k, v, d_out, d_lse)
        results = [np.asarray(x.astype(jnp.float32)) for x in results]
    assert used == [forward, backward]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# -- numerics on a Hopper GPU ---------------------------------------------------------------------

# B=2, GQA (N=4, K=2) and MQA, H 64, 128, 192 and 256, causal and not; T < S and T > S.
GPU_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 64, True, "f16"),
    Problem(2, 256, 256, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "f16"),
    Problem(2, 512, 256, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 64, False, "f16"),
    Problem(2, 1024, 1024, 4, 1, 128, True, "bf16"),
    Problem(2, 256, 256, 4, 2, 256, False, "bf16"),
    Problem(2, 256, 256, 4, 2, 256, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 256, True, "f16"),
    Problem(2, 512, 256, 4, 1, 256, True, "bf16"),
    Problem(2, 1024, 1024, 4, 2, 256, True, "bf16"),
    Problem(2, 256, 256, 4, 2, 192, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 192, False, "bf16"),
    Problem(2, 512, 256, 4, 1, 192, True, "f16"),
    Problem(2, 1024, 1024, 4, 4, 192, True, "bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=case_id)
def test_matches_oracle(p):
    """out, lse (Mosaic forward) and dq, dk, dv (Mosaic backward) against the float64 oracle."""
    needs_hopper()
    check_against_oracle(p)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tiles", OTHER_TILES, ids=case_id)
def test_matches_oracle_with_other_tiles(head_dim, tiles):
    needs_hopper()
    check_against_oracle(Problem(2, 512, 512, 4, 2, head_dim, True, "bf16"), tiles)
    check_against_oracle(Problem(1, 256, 512, 4, 1, head_dim, False, "f16"), tiles)


@pytest.mark.gpu
def test_kernel_config_opt_in_matches_oracle():
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    results = jax.jit(functools.partial(outputs_and_grads, kernels_fn(p)))(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# The split dK/dV consumers with head splits fit the shared memory only at H <= 128 (at 192
# the f32 partials' staging does not; the automatic rule leaves 192 unsplit).
DETERMINISM_GPU_CASES = [
    (128, None),
    (192, None),
    (256, None),
    (128, BackwardTiles(dkv_head_splits=4)),
    (128, BackwardTiles(split_dkv=True, dkv_head_splits=2)),
]


@pytest.mark.parametrize("head_dim, tiles", DETERMINISM_GPU_CASES, ids=case_id)
def test_deterministic_cases_fit(head_dim, tiles):
    """test_deterministic's tiles are ones the kernels take (budgets checked before tracing)."""
    p = Problem(2, 512, 512, 8, 2, head_dim, True, "bf16")
    q, k = (p.batch, p.q_len, p.num_heads, head_dim), (p.batch, p.kv_len, p.num_kv_heads, head_dim)
    assert backward_tiles.why_not(q, k, jnp.bfloat16, is_causal=True, tiles=tiles) is None


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tiles", DETERMINISM_GPU_CASES, ids=case_id)
def test_deterministic(head_dim, tiles):
    """Bitwise the same over repeated runs: a race on a staged shared-memory buffer (the split
    dK/dV consumers at H 192 and 256 stage through each other's K and V) shows first as a
    run-to-run difference."""
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, head_dim, True, "bf16")
    args, _ = random_inputs(p)
    fn = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))
    first = fn(*args)
    for _ in range(10):
        assert_bitwise_equal(fn(*args), first)


# MQA and GQA with the dK/dV kernel's head splits: asked for and automatic (0: the whole group
# on these grids, far under one wave), causal and not, T != S, H 64 and 128, both dtypes.
HEAD_SPLIT_GPU_CASES = [
    (Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=4)),
    (Problem(2, 512, 1024, 8, 2, 128, False, "f16"), BackwardTiles(dkv_head_splits=2)),
    (Problem(2, 1024, 512, 16, 1, 64, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (Problem(1, 2048, 2048, 16, 1, 128, True, "bf16"), BackwardTiles(dkv_head_splits=0)),
    (
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        BackwardTiles(split_dkv=True, dkv_head_splits=2),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p, tiles", HEAD_SPLIT_GPU_CASES, ids=case_id)
def test_head_splits_match_oracle(p, tiles):
    needs_hopper()
    check_against_oracle(p, tiles)


@pytest.mark.parametrize(
    "spec_options, soft_cap",
    [
        (dict(window=(8, 8)), None),
        (dict(window=(100, 0)), None),
        (dict(has_segments=True), None),
        ({}, 30.0),
        (dict(window=(64, 0), has_segments=True), 20.0),
    ],
)
def test_the_dispatch_gives_the_mosaic_backward_every_mask_of_the_forward(spec_options, soft_cap):
    """Windows, segment ids (and lengths), soft caps: the Mosaic forward and backward, with
    backend=None and backend="mosaic"."""
    call = Call(
        q_shape=(1, 256, 2, 128),
        k_shape=(1, 256, 2, 128),
        dtype=jnp.bfloat16,
        spec=MaskSpec(q_len=256, kv_len=256, is_causal=True, **spec_options),
        soft_cap=soft_cap,
    )
    for backend in (None, "mosaic"):
        config = dispatch.choose(call, Device.h200(), scale=0.1, backend=backend)
        assert (config.forward, config.backward) == ("mosaic", "mosaic")


@pytest.mark.parametrize(
    "spec_options, has_bias", [({}, True), (dict(mask_shape=(1, 1, 256, 256)), False)]
)
def test_the_dispatch_never_gives_the_mosaic_backward_what_it_would_drop(spec_options, has_bias):
    """A bias or dense mask keeps the whole call on Triton (None) or is refused
    (backend="mosaic")."""
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=True, **spec_options)
    call = Call(
        q_shape=(1, 256, 2, 128),
        k_shape=(1, 256, 2, 128),
        dtype=jnp.bfloat16,
        spec=spec,
        has_bias=has_bias,
    )
    assert backward_tiles.unsupported_options(spec, soft_cap=None, has_bias=has_bias)
    assert dispatch.choose(call, Device.h200(), scale=0.1).backward == "triton"
    with pytest.raises(NotImplementedError, match="backend='mosaic' does not support"):
        dispatch.choose(call, Device.h200(), scale=0.1, backend="mosaic")


# -- any T and S, head dims 80 and 96 -------------------------------------------------------------

RAGGED_LOWERING_PROBLEMS = [
    Problem(1, 3000, 3000, 4, 2, 128, True, "bf16"),
    Problem(2, 197, 197, 4, 4, 96, False, "bf16"),
    pytest.param(Problem(1, 2048, 2048, 4, 4, 80, False, "f16"), marks=long_only),
    pytest.param(Problem(1, 577, 300, 2, 1, 64, True, "bf16"), marks=long_only),
    pytest.param(Problem(1, 3, 5, 2, 1, 128, False, "bf16"), marks=long_only),
]


@pytest.mark.parametrize("p", RAGGED_LOWERING_PROBLEMS, ids=case_id)
def test_lowers_with_any_lengths_and_head_dims(p):
    """Two Mosaic GPU calls; dq, dk, dv at the caller's T, S and H."""
    lowered = lower_for_h200(backward_fn(p), *abstract_backward_args(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]
    dq, dk, dv = lowered.out_info
    q, k = abstract_inputs(p)[:2]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)


# (problem, tiles, oob_fill): padded by the wrapper (T = 130 to 136, S = 197 to 200; H = 96 as
# it is), then ragged last tiles in the kernels (a last query tile of 8 rows in dK/dV, a last key
# tile of 8 keys in dQ) with garbage past the arrays' ends; in place with T = 136, S = 328;
# causal with T > S and GQA; one consumer and three stages at H=80; 3 queries and 5 keys.
RAGGED_INTERPRET_PROBLEMS = [
    (Problem(1, 130, 197, 2, 1, 96, False, "bf16"), None, GARBAGE),
    pytest.param(Problem(1, 136, 328, 2, 1, 64, False, "bf16"), None, GARBAGE, marks=long_only),
    pytest.param(Problem(1, 333, 130, 4, 2, 96, True, "f16"), None, 0, marks=long_only),
    pytest.param(
        Problem(1, 200, 200, 2, 1, 80, True, "bf16"),
        BackwardTiles(num_consumers=1, num_stages=3),
        GARBAGE,
        marks=long_only,
    ),
    pytest.param(Problem(1, 3, 5, 2, 2, 128, False, "bf16"), None, GARBAGE, marks=long_only),
]


@long_only  # slow in the interpreter: outside CI
@pytest.mark.parametrize("p, tiles, oob_fill", RAGGED_INTERPRET_PROBLEMS, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle_interpreted(p, tiles, oob_fill):
    """The Mosaic forward and backward at ragged lengths and narrow head dims, with garbage
    past the arrays' ends where given: out, lse, dq, dk, dv against the float64 oracle."""
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic(oob_fill=oob_fill):
        out, lse = jax.jit(mosaic_forward_fn(p))(q, k, v)
        out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        grads = jax.jit(backward_fn(p, tiles))(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    results = (np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# Through the public call as a Hopper runs it: the forward and both backward kernels are Mosaic
# at these shapes.
@pytest.mark.parametrize(
    "p, mosaic_calls",
    [
        # A ragged last tile at 3000 tokens: Mosaic.
        (Problem(1, 3000, 3000, 16, 8, 128, True, "bf16"), 3),
        (Problem(4, 2048, 2048, 16, 16, 96, False, "bf16"), 3),
        pytest.param(Problem(4, 2048, 2048, 16, 16, 80, True, "bf16"), 3, marks=long_only),
        # Ragged below 1024 tokens (dispatch.MOSAIC_RAGGED_MIN_LEN): Triton.
        pytest.param(Problem(64, 197, 197, 12, 12, 64, False, "bf16"), 0, marks=long_only),
        pytest.param(Problem(16, 577, 577, 16, 16, 128, False, "bf16"), 0, marks=long_only),
        pytest.param(Problem(2, 1024, 1024, 16, 4, 192, True, "bf16"), 3, marks=long_only),
    ],
    ids=case_id,
)
def test_default_call_on_hopper_takes_mosaic_at_narrow_head_dims(monkeypatch, p, mosaic_calls):
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets.count("mosaic_gpu_v2") == mosaic_calls, targets


@pytest.mark.parametrize(
    "p",
    [
        pytest.param(Problem(1, 197, 197, 4, 2, 80, True, "bf16"), marks=long_only),
        pytest.param(Problem(2, 130, 200, 2, 1, 128, False, "f16"), marks=long_only),
    ],
    ids=case_id,
)
def test_mosaic_call_at_any_lengths_matches_oracle_interpreted(monkeypatch, p):
    """The public call on a Hopper with backend="mosaic" (the default takes Triton below 1024
    ragged tokens) at a length that is not a multiple of 8 and H=80: the Mosaic forward and
    backward, whole custom_vjp, in the interpreter."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, backend="mosaic"
    )
    fn = functools.partial(outputs_and_grads, attention)
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# Shapes that real models use (Llama at an odd length, Phi at H 80 / 96, ViT at 197 and 577
# tokens), T != S, a few queries.
RAGGED_GPU_PROBLEMS = [
    Problem(1, 3000, 3000, 2, 1, 128, True, "bf16"),
    Problem(2, 2048, 2048, 4, 2, 96, True, "bf16"),
    Problem(2, 2048, 2048, 4, 4, 80, False, "f16"),
    Problem(4, 197, 197, 4, 4, 64, False, "bf16"),
    Problem(2, 577, 577, 4, 4, 128, False, "bf16"),
    Problem(2, 577, 300, 4, 2, 64, True, "bf16"),
    Problem(2, 130, 333, 4, 2, 128, False, "bf16"),
    Problem(2, 3, 5, 4, 2, 96, False, "bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p", RAGGED_GPU_PROBLEMS, ids=case_id)
def test_any_lengths_and_head_dims_match_oracle(p):
    """out, lse (Mosaic forward) and dq, dk, dv (Mosaic backward) against the float64 oracle.
    The kernels are called directly."""
    needs_hopper()
    check_against_oracle(p)


@pytest.mark.gpu
def test_default_call_at_3000_tokens_takes_mosaic_and_matches_oracle():
    """backend=None at T = S = 3000, causal, H=128: ragged last tiles on the Mosaic forward and
    backward (three Mosaic calls in the lowered program), against the float64 oracle."""
    needs_hopper()
    p = Problem(1, 3000, 3000, 4, 2, 128, True, "bf16")
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True
    )
    run = jax.jit(functools.partial(outputs_and_grads, attention))
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    targets = custom_call_targets(run.lower(q, k, v, d_out, d_lse).as_text())
    assert targets.count("mosaic_gpu_v2") == 3, targets
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)
