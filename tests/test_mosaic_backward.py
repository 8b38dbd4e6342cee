"""The Mosaic GPU backward (pallas_flash.mosaic.backward): lowering for an abstract H200 on CPU,
the shape rules of `why_not`, and gradients against the float64 oracle, in jax's Mosaic
GPU interpreter on CPU (tests/mosaic_interpret.py) and on a Hopper GPU.

As for the forward (test_mosaic.py), lowering on CPU runs Pallas' lowering, Mosaic GPU's layout
inference and its dialect lowering (shared-memory budget included) in Python; only the GPU code
generation waits for a real GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    Problem,
    assert_bitwise_equal,
    assert_within_tolerance,
    oracle_outputs_and_grads,
    outputs_and_grads,
    plain_fn,
    random_inputs,
)
from mosaic_interpret import interpret_mosaic
from test_lowering import abstract_inputs, lower_for_h200
from test_mosaic_forward import GARBAGE, custom_call_targets, long_only, needs_hopper
from test_mosaic_forward import forward_fn as mosaic_forward_fn

import pallas_flash
from pallas_flash import device as device_lib
from pallas_flash import dispatch, tune_cache
from pallas_flash._vjp import KernelConfig, flash_attention_kernels
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles, ForwardTiles, flash_backward, flash_forward
from pallas_flash.mosaic import backward as mosaic_backward_module
from pallas_flash.mosaic import forward as mosaic_forward_module
from pallas_flash.mosaic.backward import SMEM_BYTES, _q_tile_range, default_tiles
from pallas_flash.triton import BlockSizes


def backward_fn(p: Problem, tiles: BackwardTiles | None = None):
    return functools.partial(flash_backward, scale=p.scale, is_causal=p.is_causal, tiles=tiles)


def mosaic_fn(p: Problem, tiles: BackwardTiles | None = None):
    """q, k, v -> (out, lse): the Mosaic forward, differentiated by the Mosaic backward."""

    @jax.custom_vjp
    def attention(q, k, v):
        return flash_forward(q, k, v, scale=p.scale, is_causal=p.is_causal)

    def fwd(q, k, v):
        out, lse = attention(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def bwd(residuals, cotangents):
        return backward_fn(p, tiles)(*residuals, *cotangents)

    attention.defvjp(fwd, bwd)
    return attention


def abstract_backward_args(p: Problem):
    """q, k, v, out, lse, d_out, d_lse as ShapeDtypeStructs."""
    q, k, v, d_out, lse = abstract_inputs(p)
    return q, k, v, q, lse, d_out, lse


# -- lowering for an abstract H200 (CPU) ----------------------------------------------------------

# H 64 and 128, causal and not, MHA / GQA / MQA, T == S, T < S and T > S, both dtypes.
LOWERING_PROBLEMS = [
    Problem(2, 256, 256, 4, 2, 64, False, "bf16"),
    Problem(1, 256, 512, 4, 1, 64, True, "f16"),
    Problem(2, 512, 256, 4, 2, 64, True, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, False, "bf16"),
    Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
    Problem(2, 512, 256, 4, 2, 128, True, "f16"),
    Problem(1, 128, 128, 2, 2, 128, True, "bf16"),
    Problem(1, 1024, 1024, 8, 1, 128, True, "bf16"),
]


@pytest.mark.parametrize("p", LOWERING_PROBLEMS, ids=str)
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


# Tiles other than the defaults that fit the register budget of `mosaic.backward.why_not`.
OTHER_TILES = [
    (64, BackwardTiles(num_consumers=1)),
    (128, BackwardTiles(num_consumers=1)),
    (64, BackwardTiles(num_stages=3)),
    (128, BackwardTiles(num_stages=3)),
    (64, BackwardTiles(block_q_dkv=128, block_kv_dq=128)),
    (128, BackwardTiles(block_kv_dq=128)),
]


@pytest.mark.parametrize("head_dim, tiles", OTHER_TILES, ids=str)
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


@pytest.mark.parametrize("q_len, kv_len", [(256, 256), (256, 512), (512, 256), (128, 1024)])
@pytest.mark.parametrize("block_q, rows", [(64, 64), (128, 64), (64, 128)])
def test_causal_q_tile_range_matches_the_mask(q_len, kv_len, block_q, rows):
    """Per block of keys: query tiles [first, end) are exactly those holding a row that sees
    some of the keys, and tiles [whole, end) see all of them in every row."""
    visible_keys = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
    for kv_start in range(0, kv_len, rows):
        tiles = visible_keys[:, kv_start : kv_start + rows].reshape(-1, block_q, rows)
        seen, whole_tiles = tiles.any(axis=(1, 2)), tiles.all(axis=(1, 2))
        first, whole = _q_tile_range(
            jnp.int32(kv_start), rows, q_len=q_len, block_q=block_q, is_causal=True
        )
        num_tiles = q_len // block_q
        assert int(first) == num_tiles - seen.sum() and seen[int(first) :].all()
        assert int(whole) == num_tiles - whole_tiles.sum() and whole_tiles[int(whole) :].all()


# -- why_not / validation ---------------------------------------------------------------

BF16 = jnp.bfloat16


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_supports_accepts(head_dim, is_causal):
    # Any lengths: ragged last tiles, lengths below one tile, lengths that are not multiples of 8.
    for q_len, kv_len in ((3000, 3000), (197, 197), (1, 1), (130, 333), (64, 1000)):
        shapes = (1, q_len, 4, head_dim), (1, kv_len, 2, head_dim)
        assert mosaic_backward_module.why_not(*shapes, BF16, is_causal=is_causal) is None
    assert (
        mosaic_backward_module.why_not(
            (2, 256, 8, head_dim), (2, 512, 2, head_dim), BF16, is_causal=is_causal
        )
        is None
    )
    assert (
        mosaic_backward_module.why_not(
            (1, 128, 1, head_dim), (1, 128, 1, head_dim), jnp.float16, is_causal=is_causal
        )
        is None
    )


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, reason",
    [
        ((1, 256, 4, 256), (1, 256, 4, 256), BF16, "head_dim=256: a consumer's dK and dV"),
        ((1, 256, 4, 256), (1, 256, 4, 256), BF16, "left to the Triton backward"),
        ((1, 256, 4, 192), (1, 256, 4, 192), BF16, "head_dim=192: a consumer's dK and dV"),
        ((1, 0, 4, 128), (1, 1024, 4, 128), BF16, "q_len=0 and kv_len=1024 must be positive"),
        ((1, 256, 4, 128), (1, 0, 4, 128), BF16, "kv_len=0 must be positive"),
        ((1, 256, 4, 112), (1, 256, 4, 112), BF16, "head_dim=112 is not one of (64, 80, 96, 128)"),
        ((1, 256, 4, 128), (1, 256, 4, 128), jnp.float32, "dtype float32"),
        ((1, 256, 6, 128), (1, 256, 4, 128), BF16, "num_heads=6 must be divisible by"),
        ((1, 256, 4, 128), (2, 256, 4, 128), BF16, "batch or head dim"),
        ((256, 4, 128), (256, 4, 128), BF16, "must be [B, T, N, H]"),
    ],
)
def test_supports_rejects_with_reason(q_shape, k_shape, dtype, reason):
    for is_causal in (False, True):
        got = mosaic_backward_module.why_not(q_shape, k_shape, dtype, is_causal=is_causal)
        assert got is not None and reason in got, got


def test_supports_rejects_tiles_over_shared_memory():
    tiles = BackwardTiles(num_stages=8)
    got = mosaic_backward_module.why_not(
        (1, 512, 2, 128), (1, 512, 2, 128), BF16, is_causal=False, tiles=tiles
    )
    assert got is not None and "shared memory in dK/dV" in got


@pytest.mark.parametrize(
    "head_dim, tiles, kernel",
    [
        (128, BackwardTiles(block_q_dkv=128), "256 f32 registers per thread in dK/dV"),
        (128, BackwardTiles(block_q_dq=128, num_consumers=1), "256 f32 registers per thread in dQ"),
        (64, BackwardTiles(block_kv_dkv=128, num_consumers=1), "in dK/dV at head_dim=64"),
    ],
)
def test_supports_rejects_tiles_that_would_spill(head_dim, tiles, kernel):
    shape = (1, 512, 2, head_dim)
    got = mosaic_backward_module.why_not(shape, shape, BF16, is_causal=True, tiles=tiles)
    assert got is not None and kernel in got and "spill" in got, got


def test_default_tiles_fit_shared_memory():
    for head_dim in (64, 128):
        tiles = default_tiles(head_dim)
        assert tiles.smem_bytes_dkv(head_dim, 2) <= SMEM_BYTES
        assert tiles.smem_bytes_dq(head_dim, 2) <= SMEM_BYTES


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q_dkv=96), "block_q_dkv=96 must be a positive multiple of 64"),
        (dict(block_kv_dq=32), "block_kv_dq=32 must be a positive multiple of 64"),
        (dict(block_kv_dkv=320), "block_kv_dkv=320 exceeds the wgmma limit of 256"),
        (dict(num_stages=1), "num_stages=1 must be an int >= 2"),
        (dict(num_consumers=3), "num_consumers=3 must be 1 or 2"),
    ],
)
def test_tiles_validate(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        BackwardTiles(**kwargs)


def test_flash_backward_raises_before_tracing():
    q = jnp.zeros((1, 128, 2, 128), BF16)
    k = jnp.zeros((1, 128, 2, 128), BF16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="head_dim=256"):
        q256 = jnp.zeros((1, 128, 2, 256), BF16)
        flash_backward(q256, q256, q256, q256, lse, q256, lse, scale=0.1, is_causal=False)
    with pytest.raises(ValueError, match="d_out"):
        flash_backward(q, k, k, q, lse, q.astype(jnp.float16), lse, scale=0.1, is_causal=False)
    with pytest.raises(ValueError, match="scale=0.0 must be positive"):
        flash_backward(q, k, k, q, lse, q, lse, scale=0.0, is_causal=False)


# -- numerics in the Mosaic GPU interpreter (CPU) --------------------------------------------------

# Small problems through every code path: H 64 and 128, causal and not, MHA / GQA / MQA, T < S
# and T > S, consumers that skip causal tiles, 1 and 2 consumers, 2 and 3 stages (rings that
# wrap), 128-row streamed tiles. B=1 and few heads: the interpreter takes seconds per problem.
INTERPRET_PROBLEMS = [
    (Problem(1, 128, 256, 2, 2, 64, False, "bf16"), None),
    (Problem(1, 256, 256, 4, 2, 64, True, "f16"), None),
    (Problem(1, 128, 256, 2, 1, 128, True, "bf16"), None),
    (Problem(1, 256, 128, 2, 1, 128, True, "bf16"), BackwardTiles(num_consumers=1)),
    (Problem(1, 256, 512, 1, 1, 64, False, "bf16"), BackwardTiles(num_stages=3)),
    (Problem(1, 384, 256, 2, 1, 64, True, "bf16"), BackwardTiles(num_consumers=1, num_stages=3)),
    (Problem(2, 256, 128, 2, 2, 128, False, "f16"), BackwardTiles(num_stages=3)),
    (Problem(1, 512, 512, 1, 1, 64, True, "bf16"), BackwardTiles(block_q_dkv=128, block_kv_dq=128)),
]


@pytest.mark.parametrize("p, tiles", INTERPRET_PROBLEMS, ids=str)
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


@pytest.mark.parametrize(
    "p",
    [Problem(1, 256, 256, 4, 2, 128, True, "bf16"), Problem(2, 256, 512, 2, 1, 128, False, "f16")],
    ids=str,
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


def test_tuned_tiles_through_the_default_call_match_oracle_interpreted(monkeypatch, tmp_path):
    """Mosaic tiles from the autotune cache reach both kernels through the public call (a
    spy records them) and the result still matches the float64 oracle."""
    p = Problem(1, 256, 256, 2, 1, 64, True, "bf16")
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    monkeypatch.setenv("PALLAS_FLASH_TUNE_CACHE", str(tmp_path / "tune.json"))
    tune_cache._load_tune_cache.cache_clear()
    forward = ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    backward = BackwardTiles(num_stages=3, block_kv_dq=128)
    shape_class = tune_cache.ShapeClass.of(
        64, jnp.bfloat16, is_causal=True, q_len=256, kv_len=256, masked=False
    )
    entry = tune_cache.TunedEntry(BlockSizes(), forward, backward)
    tune_cache.save_tuned(Device.h200().kind, {shape_class: entry})
    used = []
    for module, name in (
        (mosaic_forward_module, "flash_forward"),
        (mosaic_backward_module, "flash_backward"),
    ):
        original = getattr(module, name)

        def spy(*args, original=original, **kwargs):
            used.append(kwargs["tiles"])
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    # H=64 takes the Mosaic backward below 2k keys only when asked for.
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True, backend="mosaic"
    )
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    try:
        with interpret_mosaic():
            results = jax.jit(functools.partial(outputs_and_grads, attention))(
                q, k, v, d_out, d_lse
            )
            results = [np.asarray(x.astype(jnp.float32)) for x in results]
    finally:
        tune_cache._load_tune_cache.cache_clear()
    assert used == [forward, backward]
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


# -- numerics on a Hopper GPU ---------------------------------------------------------------------

# B=2, GQA (N=4, K=2) and MQA, H 64 and 128, causal and not; T < S and T > S.
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
]


def check_against_oracle(p: Problem, tiles: BackwardTiles | None = None):
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    run = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@pytest.mark.gpu
@pytest.mark.parametrize("p", GPU_PROBLEMS, ids=str)
def test_matches_oracle(p):
    """out, lse (Mosaic forward) and dq, dk, dv (Mosaic backward) against the float64 oracle."""
    needs_hopper()
    check_against_oracle(p)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tiles", OTHER_TILES, ids=str)
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


@pytest.mark.gpu
def test_deterministic():
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    args, _ = random_inputs(p)
    fn = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p)))
    assert_bitwise_equal(fn(*args), fn(*args))


@pytest.mark.parametrize(
    "spec_options, soft_cap, has_bias",
    [
        (dict(window=(8, 8)), None, False),
        (dict(has_segments=True), None, False),
        ({}, 30.0, False),
        ({}, None, True),
        (dict(mask_shape=(1, 1, 256, 256)), None, False),
    ],
)
def test_the_dispatch_never_gives_the_mosaic_backward_what_it_would_drop(
    spec_options, soft_cap, has_bias
):
    """The Mosaic backward takes only the causal flag: windows, segment ids, soft caps keep the
    Triton backward also with backend="mosaic"; a bias or dense mask keeps the whole call on
    Triton (None) or is refused (backend="mosaic")."""
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=True, **spec_options)
    call = Call(
        q_shape=(1, 256, 2, 128),
        k_shape=(1, 256, 2, 128),
        dtype=jnp.bfloat16,
        spec=spec,
        soft_cap=soft_cap,
        has_bias=has_bias,
    )
    assert dispatch.choose(call, Device.h200(), scale=0.1).backward == "triton"
    if has_bias or spec.mask_shape is not None:
        with pytest.raises(NotImplementedError, match="backend='mosaic' does not support"):
            dispatch.choose(call, Device.h200(), scale=0.1, backend="mosaic")
    else:
        config = dispatch.choose(call, Device.h200(), scale=0.1, backend="mosaic")
        assert (config.forward, config.backward) == ("mosaic", "triton")
    plain = dataclasses.replace(
        call, spec=MaskSpec(q_len=256, kv_len=256, is_causal=True), soft_cap=None, has_bias=False
    )
    assert dispatch.choose(plain, Device.h200(), scale=0.1, backend="mosaic").backward == "mosaic"


# -- any T and S, head dims 80 and 96 -------------------------------------------------------------

RAGGED_LOWERING_PROBLEMS = [
    Problem(1, 3000, 3000, 4, 2, 128, True, "bf16"),
    Problem(2, 197, 197, 4, 4, 96, False, "bf16"),
    pytest.param(Problem(1, 2048, 2048, 4, 4, 80, False, "f16"), marks=long_only),
    pytest.param(Problem(1, 577, 300, 2, 1, 64, True, "bf16"), marks=long_only),
    pytest.param(Problem(1, 3, 5, 2, 1, 128, False, "bf16"), marks=long_only),
]


@pytest.mark.parametrize("p", RAGGED_LOWERING_PROBLEMS, ids=str)
def test_lowers_with_any_lengths_and_head_dims(p):
    """Two Mosaic GPU calls; dq, dk, dv at the caller's T, S and H."""
    lowered = lower_for_h200(backward_fn(p), *abstract_backward_args(p))
    assert custom_call_targets(lowered.as_text()) == ["mosaic_gpu_v2", "mosaic_gpu_v2"]
    dq, dk, dv = lowered.out_info
    q, k = abstract_inputs(p)[:2]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
    assert (dk.shape, dk.dtype) == (dv.shape, dv.dtype) == (k.shape, k.dtype)


# (problem, tiles, oob_fill): padded by the wrapper (T = 130 to 136, S = 197 to 200, H = 96 to
# 128), then ragged last tiles in the kernels (a last query tile of 8 rows in dK/dV, a last key
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
@pytest.mark.parametrize("p, tiles, oob_fill", RAGGED_INTERPRET_PROBLEMS, ids=str)
def test_any_lengths_and_head_dims_match_oracle_interpreted(p, tiles, oob_fill):
    """The Mosaic forward and backward at ragged lengths and padded head dims, with garbage
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
# at these shapes (and H=192 takes the Mosaic forward with the Triton backward).
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
        pytest.param(Problem(2, 1024, 1024, 16, 4, 192, True, "bf16"), 1, marks=long_only),
    ],
    ids=str,
)
def test_default_call_on_hopper_takes_mosaic_at_padded_head_dims(monkeypatch, p, mosaic_calls):
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
    ids=str,
)
def test_default_call_at_any_lengths_matches_oracle_interpreted(monkeypatch, p):
    """The public call on a Hopper (backend=None) at a length that is not a multiple of 8 and
    H=80: the Mosaic forward and backward, whole custom_vjp, in the interpreter."""
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
@pytest.mark.parametrize("p", RAGGED_GPU_PROBLEMS, ids=str)
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
