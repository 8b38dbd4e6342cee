"""The Mosaic GPU backward's masks (windows, soft caps, segment ids and lengths) in its dK/dV and
dQ kernels: gradients against the float64 oracle in jax's Mosaic GPU interpreter and on a
Hopper GPU, NaN at hidden keys, and the public masked call on a Hopper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.calls import outputs_and_grads
from support.inputs import Problem, abstract_inputs, case_id, random_inputs
from support.kernels import call_mosaic_backward, call_mosaic_forward
from support.lowering import lower_for_h200
from support.mosaic_backward import (
    MaskCase,
    check_masked_backward,
    mask_options,
)
from support.mosaic_forward import (
    custom_call_targets,
    long_only,
    needs_hopper,
)
from support.mosaic_interpret import interpret_mosaic
from support.oracle import attention_oracle_f64
from support.tolerance import OUTPUT_NAMES, assert_bitwise_equal, assert_within_tolerance

import pallas_flash
from pallas_flash import device as device_lib
from pallas_flash import masks
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import BackwardTiles

# -- windows, soft caps, segment ids and lengths --------------------------------------------------


# In CI: small backward-only cases through most of the new paths (windows, a soft cap, packed
# documents with q and kv lengths, NaN at hidden keys, GQA, T != S, one consumer, H=256's split
# consumers, head splits). The rest, with the Mosaic forward's residuals too, runs with
# PALLAS_FLASH_SWEEP.
MASK_CI_CASES = [
    # H=256, its defaults: the dK/dV consumers split by accumulator (P^T * dcap handed over,
    # the dK consumer's own mask on dS^T against NaN in V at hidden keys, one tile range for
    # both, the plan of one key block per CTA) and one dQ consumer.
    MaskCase(
        Problem(2, 128, 192, 1, 1, 256, False, "bf16"),
        window=(30, 60),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        poison=True,
    ),
    # Head splits: each KV head's group of 2 over 2 CTAs (f32 partials summed in XLA), GQA with
    # two KV heads, causal with a window, packed documents, NaN at hidden keys (and at keys
    # 64-127, which no row sees: T < S).
    MaskCase(
        Problem(2, 64, 128, 4, 2, 64, True, "bf16"),
        window=(40, 0),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1, dkv_head_splits=2),
        poison=True,
    ),
    # A ragged last query tile, causal, T < S: keys T..63 are hidden from every row but lie
    # inside the geometry of the tile's rows past T, whose dS^T would carry V's NaN into dK.
    MaskCase(Problem(1, 61, 99, 2, 1, 64, True, "bf16"), poison=True),
]

# A ragged last KV tile; NaN at hidden keys with causal and a window; windows left-only /
# right-only / both, narrow ones leaving rows and whole CTAs without keys
# (T > S), wider than S; soft caps alone and causal; every segment kind (q lengths, kv lengths
# with a batch entry without keys, unsorted ids, a gap both consumers drain); H 64 and 128, f16,
# MQA and GQA; 1 consumer, 3 stages, 128-row streamed tiles.
MASK_SWEEP_CASES = [
    # Keys 67-255 of entry 0 (in a tile that rows of its second document see) and all keys of
    # entry 1 hold NaN and inf.
    MaskCase(
        Problem(2, 192, 256, 2, 1, 64, False, "bf16"),
        window=(30, 60),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1),
        poison=True,
    ),
    MaskCase(
        Problem(1, 256, 384, 2, 1, 64, True, "bf16"),
        window=(100, 0),
        soft_cap=10.0,
        scale=1.0,
    ),
    MaskCase(
        Problem(2, 256, 200, 2, 1, 64, False, "bf16"),
        window=(30, 60),
        kind="packed-lengths",
        tiles=BackwardTiles(num_consumers=1),
    ),
    MaskCase(
        Problem(2, 256, 256, 2, 1, 64, True, "bf16"), window=(80, 0), kind="lengths", poison=True
    ),
    MaskCase(Problem(1, 256, 512, 2, 1, 128, False, "bf16"), window=(64, 32)),
    MaskCase(Problem(1, 256, 512, 2, 2, 64, False, "f16"), window=(70, 10**6)),
    MaskCase(Problem(1, 256, 256, 2, 1, 128, False, "bf16"), window=(10**6, 40)),
    MaskCase(Problem(1, 512, 128, 2, 1, 64, True, "bf16"), window=(1, 0)),
    MaskCase(Problem(1, 384, 128, 2, 1, 128, False, "f16"), window=(10, 3)),
    MaskCase(Problem(1, 256, 256, 2, 1, 128, False, "bf16"), soft_cap=5.0, scale=1.0),
    MaskCase(Problem(1, 256, 512, 4, 2, 64, True, "f16"), soft_cap=30.0, scale=1.0),
    MaskCase(Problem(2, 256, 256, 2, 1, 128, True, "bf16"), kind="packed"),
    MaskCase(Problem(2, 256, 384, 2, 2, 64, False, "bf16"), kind="lengths"),
    MaskCase(Problem(2, 384, 256, 2, 1, 64, True, "bf16"), kind="packed-lengths"),
    MaskCase(Problem(1, 256, 256, 2, 1, 64, False, "bf16"), kind="unsorted"),
    MaskCase(
        Problem(1, 256, 512, 2, 1, 64, False, "bf16"),
        kind="gap",
        tiles=BackwardTiles(num_stages=3),
    ),
    MaskCase(
        Problem(1, 512, 512, 2, 1, 64, True, "bf16"),
        window=(70, 0),
        tiles=BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    ),
    MaskCase(
        Problem(2, 512, 256, 2, 1, 128, True, "bf16"),
        window=(64, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(num_consumers=1, num_stages=3),
    ),
    # The split dK/dV consumers: the defaults at H 192 and 256 with windows, soft caps and
    # segment ids (NaN at hidden keys), at H=64 with 128-row streamed tiles and 3 stages.
    MaskCase(
        Problem(1, 192, 256, 2, 1, 256, True, "bf16"),
        window=(40, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        poison=True,
    ),
    MaskCase(Problem(1, 256, 128, 2, 1, 192, False, "bf16"), window=(20, 70), kind="gap"),
    MaskCase(
        Problem(1, 384, 256, 2, 1, 64, True, "bf16"),
        window=(90, 0),
        kind="unsorted",
        tiles=BackwardTiles(split_dkv=True, block_q_dkv=128, num_stages=3),
    ),
    # Head splits with every mask, automatic (the whole group of 4 here), and beside the split
    # dK/dV consumers.
    MaskCase(
        Problem(2, 256, 200, 4, 1, 128, True, "bf16"),
        window=(60, 0),
        soft_cap=10.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(dkv_head_splits=0),
    ),
    MaskCase(
        Problem(1, 256, 256, 4, 2, 64, False, "bf16"),
        window=(20, 70),
        kind="gap",
        tiles=BackwardTiles(split_dkv=True, dkv_head_splits=2),
    ),
]


@pytest.mark.parametrize("c", MASK_CI_CASES, ids=case_id)
@pytest.mark.ci_slice(1)
def test_masked_matches_oracle_interpreted(c):
    """Windows, soft caps, segment ids and lengths in the Mosaic GPU interpreter (race
    detector on): the tile ranges and plans, drain steps, element-wise masks, the soft cap's
    derivative, rows without keys (dq 0) and keys no row sees (dk, dv 0)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


@long_only
@pytest.mark.parametrize("c", MASK_CI_CASES + MASK_SWEEP_CASES, ids=case_id)
def test_masked_forward_and_backward_match_oracle_interpreted(c):
    """The Mosaic forward, then the Mosaic backward on its out and lse (the reference's
    residuals where K and V hold NaN: the Mosaic forward lets NaN in V at a hidden key reach
    the rows of its tile, test_nan_safety.py)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=not c.poison)


# Through the public call as a Hopper runs it: three Mosaic GPU calls (the forward, dK/dV, dQ)
# for each mask the Mosaic forward takes.
PUBLIC_MASKED_CALLS = [
    (Problem(1, 256, 256, 4, 2, 128, True, "bf16"), dict(local_window_size=(100, 0))),
    (Problem(1, 256, 512, 4, 2, 128, False, "bf16"), dict(logits_soft_cap=20.0)),
    (
        Problem(2, 256, 256, 4, 2, 128, True, "bf16"),
        dict(key_value_seq_lengths=np.array([200, 37]), query_seq_lengths=np.array([256, 99])),
    ),
]


def public_masked_fn(p: Problem, options: dict):
    return functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, **options
    )


@long_only
@pytest.mark.parametrize("p, options", PUBLIC_MASKED_CALLS, ids=case_id)
def test_default_masked_call_on_hopper_lowers_to_mosaic(monkeypatch, p, options):
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    fn = functools.partial(outputs_and_grads, public_masked_fn(p, options))
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets


def check_public_masked_call(p: Problem, options, results, inputs, f64):
    """The public masked call's results (out, lse, dq, dk, dv) against the float64 oracle of
    the same mask, within twice the xla backend's error."""
    xla = functools.partial(outputs_and_grads, public_masked_fn(p, {**options, "backend": "xla"}))
    baselines = jax.jit(xla)(*inputs)
    arrays = masks.make_arrays(
        p.batch,
        p.q_len,
        p.kv_len,
        query_seq_lengths=options.get("query_seq_lengths"),
        key_value_seq_lengths=options.get("key_value_seq_lengths"),
    )
    spec = MaskSpec(
        q_len=p.q_len,
        kv_len=p.kv_len,
        is_causal=p.is_causal,
        window=options.get("local_window_size"),
        has_segments=arrays.q_segment_ids is not None,
    )
    visible = np.asarray(masks.dense(spec, arrays))
    oracle = attention_oracle_f64(
        *f64, scale=p.scale, visible=visible, soft_cap=options.get("logits_soft_cap")
    )
    assert_within_tolerance(results, baselines, [oracle[n] for n in OUTPUT_NAMES], floor=p.floor)


@long_only
@pytest.mark.parametrize("p, options", PUBLIC_MASKED_CALLS, ids=case_id)
def test_default_masked_call_on_hopper_matches_oracle_interpreted(monkeypatch, p, options):
    """backend=None on a Hopper with a window, a soft cap, lengths: validation, dispatch,
    residuals and the mask arrays through the custom_vjp to the Mosaic kernels."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    fn = functools.partial(outputs_and_grads, public_masked_fn(p, options))
    targets = custom_call_targets(lower_for_h200(fn, *abstract_inputs(p)).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    with interpret_mosaic():
        results = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fn)(q, k, v, d_out, d_lse)]
    check_public_masked_call(p, options, results, (q, k, v, d_out, d_lse), f64)


# -- on a Hopper GPU --

# B=2, GQA and MQA, H 64, 128, 192 and 256, T == S, T < S, T > S; windows causal and not (rows
# and CTAs without keys), soft caps, every segment kind, combinations; other tiles (the split
# dK/dV consumers at H 192 and 256 by default, and at H=128).
MASK_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"), window=(300, 0)),
    MaskCase(Problem(2, 512, 1024, 4, 2, 128, False, "bf16"), window=(200, 300)),
    MaskCase(Problem(2, 1024, 256, 4, 1, 64, False, "bf16"), window=(1, 0)),
    MaskCase(Problem(2, 512, 512, 4, 2, 64, True, "f16"), window=(100, 0)),
    MaskCase(Problem(2, 512, 512, 4, 2, 128, False, "bf16"), soft_cap=5.0, scale=1.0),
    MaskCase(Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"), soft_cap=30.0, scale=1.0),
    MaskCase(Problem(2, 512, 512, 4, 2, 128, False, "bf16"), kind="packed"),
    MaskCase(Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"), kind="packed-lengths"),
    MaskCase(Problem(2, 512, 1024, 4, 2, 128, True, "f16"), kind="lengths"),
    MaskCase(Problem(2, 512, 512, 4, 1, 128, False, "bf16"), kind="unsorted"),
    MaskCase(Problem(2, 512, 1024, 4, 2, 64, False, "bf16"), kind="gap"),
    MaskCase(
        Problem(2, 1024, 512, 4, 2, 128, True, "bf16"),
        window=(128, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
    ),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"),
        window=(300, 0),
        tiles=BackwardTiles(num_stages=3),
    ),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 64, True, "bf16"),
        window=(70, 0),
        kind="packed",
        tiles=BackwardTiles(block_q_dkv=128, block_kv_dq=128),
    ),
    MaskCase(
        Problem(2, 512, 512, 4, 2, 128, False, "bf16"),
        window=(30, 90),
        soft_cap=10.0,
        scale=1.0,
        tiles=BackwardTiles(num_consumers=1),
    ),
    MaskCase(
        Problem(2, 1024, 512, 4, 2, 256, True, "bf16"),
        window=(128, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
    ),
    MaskCase(Problem(2, 512, 1024, 4, 1, 256, False, "f16"), window=(200, 300)),
    MaskCase(Problem(2, 512, 512, 4, 2, 192, True, "bf16"), kind="lengths", soft_cap=10.0),
    MaskCase(Problem(2, 512, 1024, 4, 2, 192, False, "bf16"), kind="gap"),
    MaskCase(
        Problem(2, 1024, 1024, 4, 2, 128, True, "bf16"),
        window=(70, 0),
        kind="packed",
        tiles=BackwardTiles(split_dkv=True, block_q_dkv=128),
    ),
    # Head splits with masks: MQA over 4 CTAs per KV head, automatic on GQA.
    MaskCase(
        Problem(2, 1024, 1024, 8, 1, 128, True, "bf16"),
        window=(300, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=BackwardTiles(dkv_head_splits=4),
    ),
    MaskCase(
        Problem(2, 512, 1024, 8, 2, 64, False, "bf16"),
        window=(200, 300),
        kind="gap",
        tiles=BackwardTiles(dkv_head_splits=0),
    ),
    # The dQ kernel's producer cleans the masked K tiles (no XLA pass over K): causal with T !=
    # S at H=128, a window with packed documents at H=64, NaN and inf at hidden keys.
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(producer_cleans_k=True),
        poison=True,
    ),
    MaskCase(
        Problem(2, 1000, 1300, 4, 2, 64, False, "bf16"),
        window=(200, 300),
        kind="packed-lengths",
        tiles=BackwardTiles(producer_cleans_k=True),
        poison=True,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", MASK_GPU_CASES, ids=case_id)
def test_masked_matches_oracle(c):
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c",
    [
        MaskCase(
            Problem(2, 512, 512, 4, 2, 128, True, "bf16"),
            window=(200, 0),
            kind="lengths",
            poison=True,
        ),
        MaskCase(Problem(2, 384, 512, 4, 2, 64, False, "bf16"), kind="packed-lengths", poison=True),
        MaskCase(
            Problem(2, 384, 512, 4, 2, 256, True, "bf16"),
            window=(100, 0),
            soft_cap=10.0,
            kind="packed-lengths",
            scale=1.0,
            poison=True,
        ),
    ],
    ids=case_id,
)
def test_nan_at_hidden_keys_reaches_no_gradient(c):
    """Backward only, from the reference's residuals of the clean inputs (the Mosaic forward
    lets NaN in V at a hidden key reach the rows of its tile: test_nan_safety.py)."""
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=False)


@pytest.mark.gpu
@pytest.mark.parametrize("index", [11, 15])
def test_masked_deterministic(index):
    needs_hopper()
    c = MASK_GPU_CASES[index]
    (q, k, v, d_out, d_lse), _ = random_inputs(c.p)
    options = mask_options(c, c.arrays())
    out, lse = call_mosaic_forward(q, k, v, scale=c.logit_scale, is_causal=c.p.is_causal, **options)
    backward = jax.jit(
        functools.partial(
            call_mosaic_backward, scale=c.logit_scale, is_causal=c.p.is_causal, **options
        )
    )
    args = (q, k, v, out, lse, d_out, d_lse)
    assert_bitwise_equal(backward(*args), backward(*args))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, options",
    [
        *PUBLIC_MASKED_CALLS,
        (Problem(2, 2048, 2048, 8, 2, 128, True, "bf16"), dict(local_window_size=(512, 0))),
        (Problem(4, 2048, 2048, 8, 8, 64, False, "bf16"), dict(logits_soft_cap=30.0)),
    ],
    ids=case_id,
)
def test_default_masked_call_takes_mosaic_and_matches_oracle(p, options):
    """backend=None on the H200: three Mosaic calls, values and gradients against the
    float64 oracle."""
    needs_hopper()
    fn = jax.jit(functools.partial(outputs_and_grads, public_masked_fn(p, options)))
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    targets = custom_call_targets(fn.lower(q, k, v, d_out, d_lse).as_text())
    assert targets == ["mosaic_gpu_v2"] * 3, targets
    results = fn(q, k, v, d_out, d_lse)
    check_public_masked_call(p, options, results, (q, k, v, d_out, d_lse), f64)
