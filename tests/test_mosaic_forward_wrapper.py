"""The Mosaic GPU forward's wrapper (pallas_flash.mosaic.forward.flash_forward) and the public
call on a Hopper: any T and S (padded to 8 or run in place) and head dims 80, 96 and 192;
`flash_attention` choosing the Mosaic forward, under vmap and with masks.
"""

from __future__ import annotations

import functools

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
from support.inputs import Problem, abstract_inputs, case_id, random_inputs
from support.lowering import lower_for_h200, triton_calls
from support.mosaic_forward import (
    GARBAGE,
    abstract_ids,
    abstract_lse,
    abstract_qkv,
    check_default_call_on_hopper,
    check_masked,
    check_segments,
    custom_call_targets,
    forward_fn,
    long_only,
    masked_in_dtype,
    needs_hopper,
    public_fn,
    segments_forward_fn,
    visibility,
)
from support.oracle import (
    attention_f64,
    attention_grads_f64,
    attention_in_dtype,
    attention_oracle_f64,
)
from support.tolerance import assert_within_tolerance

from pallas_flash import device as device_lib
from pallas_flash.device import Device
from pallas_flash.mosaic import forward as mosaic_forward_module
from pallas_flash.mosaic.tiles import (
    ForwardTiles,
)

# -- any T and S, head dims 80, 96 and 192 ---------------------------------------------------------


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
