"""The Mosaic GPU backward's dQ in the dK/dV kernel (pallas_flash.mosaic.fused_dq,
`BackwardTiles.fused_dq`): "add", "fixed" and the interpreter's "slab", against the float64
oracle in jax's Mosaic GPU interpreter and on a Hopper GPU, their lowering and determinism.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.calls import outputs_and_grads
from support.inputs import Problem, abstract_inputs, case_id, random_inputs
from support.kernels import call_mosaic_backward, call_mosaic_forward
from support.lowering import lower_for_h200, mosaic_opaque_i32s
from support.mosaic_backward import (
    MaskCase,
    abstract_backward_args,
    backward_fn,
    check_masked_backward,
    mosaic_fn,
)
from support.mosaic_forward import (
    custom_call_targets,
    long_only,
    needs_hopper,
)
from support.mosaic_interpret import interpret_mosaic
from support.tolerance import assert_bitwise_equal

import pallas_flash
from pallas_flash import dispatch
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles, backward_tiles
from pallas_flash.mosaic import fused_dq as fused_dq_module
from pallas_flash.mosaic import launch as mosaic_launch
from pallas_flash.reference import reference_attention

# -- dQ in the dK/dV kernel (BackwardTiles.fused_dq) ----------------------------------------------

# "slab" (each kv tile's partial apart, summed by XLA) runs the kernel of "add" but for the
# store: the interpreter has no TMA reductions. Causal GQA with a window, packed documents and
# lengths, NaN at hidden keys, three query tiles (the last ragged), head splits; two consumers
# taking turns at dQ's partial, with steps that one of them drains (the causal diagonal).
FUSED_CI_CASE = MaskCase(
    Problem(2, 130, 128, 4, 2, 64, True, "bf16"),
    window=(40, 0),
    kind="packed-lengths",
    tiles=BackwardTiles(dkv_head_splits=2, fused_dq="slab"),
    poison=True,
)
# H=128: each consumer computes its half of dQ^T's rows a step late (`fused_dq_rows`).
FUSED_CI_HALVES = MaskCase(
    Problem(1, 192, 256, 4, 2, 128, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# Non-causal, one KV head, a ragged T.
FUSED_CI_PLAIN = MaskCase(
    Problem(1, 200, 256, 2, 1, 64, False, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# Causal with S > T + 128: no row sees the last CTA's keys, whose dK and dV (zeros; f32
# partials, as the small grid is split by heads) its consumers still write: the outputs start
# uninitialised (NaN in the interpreter; a CTA that stored nothing fails this case).
FUSED_CI_UNSEEN_KEYS = MaskCase(
    Problem(1, 128, 384, 2, 1, 64, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")
)
# "fixed_slab": the integer partials of "fixed" (dS^T scaled by each row's 2^e, int32),
# stored apart. Causal halves at H=128 with a ragged T and NaN in K and V at the keys past T
# (in no row's bound); non-causal turns at H=64 with a soft cap and T != S.
FUSED_CI_FIXED = MaskCase(
    Problem(1, 200, 256, 4, 2, 128, True, "bf16"),
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
FUSED_CI_FIXED_CAPPED = MaskCase(
    Problem(2, 130, 200, 2, 1, 64, False, "bf16"),
    soft_cap=10.0,
    scale=1.0,
    tiles=BackwardTiles(fused_dq="fixed_slab"),
)
# A window (left and right of the diagonal, T != S): each row's bound from the keys inside it,
# NaN and inf past T outside every row's.
FUSED_CI_FIXED_WINDOW = MaskCase(
    Problem(1, 130, 200, 2, 1, 64, False, "bf16"),
    window=(50, 30),
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
# Packed documents with lengths: each row's bound from its own segment's keys (NaN and inf in
# other segments and past the lengths reach no row's).
FUSED_CI_FIXED_SEGMENTS = MaskCase(
    Problem(3, 200, 256, 4, 2, 64, True, "bf16"),  # batch 2's rows reach other documents' keys
    kind="packed-lengths",
    tiles=BackwardTiles(fused_dq="fixed_slab"),
    poison=True,
)
# The consumers' K, V (and the fused dQ's K^T and dS^T tiles) addressed through an opaque zero
# (`BackwardTiles.step_descriptors`, which the dispatch gives every fused dQ): "fixed_slab"'s
# causal halves at H=128 (its step -1 of zeros included), "slab"'s turns at H=64 with head
# splits, the two-kernel backward's plan of packed documents.
STEP_DESCRIPTOR_CASES = [
    dataclasses.replace(
        FUSED_CI_FIXED, tiles=BackwardTiles(fused_dq="fixed_slab", step_descriptors=True)
    ),
    dataclasses.replace(
        FUSED_CI_CASE,
        tiles=BackwardTiles(dkv_head_splits=2, fused_dq="slab", step_descriptors=True),
    ),
    MaskCase(
        Problem(2, 130, 128, 4, 2, 64, True, "bf16"),
        window=(40, 0),
        kind="packed-lengths",
        tiles=BackwardTiles(step_descriptors=True),
        poison=True,
    ),
]
FUSED_SWEEP_CASES = [
    dataclasses.replace(
        FUSED_CI_CASE, tiles=BackwardTiles(num_consumers=1, dkv_head_splits=2, fused_dq="slab")
    ),
    dataclasses.replace(
        FUSED_CI_CASE,
        p=Problem(2, 130, 256, 4, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="slab"),
    ),
    MaskCase(
        Problem(2, 130, 200, 2, 1, 64, False, "f16"),
        window=(50, 30),
        soft_cap=10.0,
        scale=1.0,
        tiles=BackwardTiles(fused_dq="slab"),
    ),
]


@pytest.mark.parametrize(
    "c",
    [
        FUSED_CI_CASE,
        FUSED_CI_HALVES,
        FUSED_CI_PLAIN,
        FUSED_CI_UNSEEN_KEYS,
        FUSED_CI_FIXED,
        FUSED_CI_FIXED_CAPPED,
        FUSED_CI_FIXED_WINDOW,
        FUSED_CI_FIXED_SEGMENTS,
        *(pytest.param(c, marks=long_only) for c in FUSED_SWEEP_CASES),
    ],
    ids=case_id,
)
def test_fused_dq_matches_oracle_interpreted(c):
    """dQ from the dK/dV kernel's steps (K^T dS^T per step, stored per block of keys) against
    the float64 oracle, masks, NaN at hidden keys and rows without keys included."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


# The dQ kernel's producer zeroes NaN and inf in the K tiles a consumer masks (no XLA pass over
# K): causal GQA with a window, packed documents and lengths, NaN and inf at hidden keys, two
# consumers (tiles that only one masks) and one.
PRODUCER_CLEANS_K_CASES = [
    dataclasses.replace(FUSED_CI_CASE, tiles=BackwardTiles(producer_cleans_k=True)),
    dataclasses.replace(
        FUSED_CI_FIXED, tiles=BackwardTiles(producer_cleans_k=True, num_consumers=1)
    ),
]


@pytest.mark.parametrize("c", PRODUCER_CLEANS_K_CASES, ids=case_id)
def test_producer_cleans_k_matches_oracle_interpreted(c):
    """BackwardTiles.producer_cleans_k: the hidden keys' NaN and inf reach no row's dQ without
    the XLA pass over K (a producer that skips the clean fails the poisoned cases)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


@pytest.mark.parametrize("c", STEP_DESCRIPTOR_CASES, ids=case_id)
def test_step_descriptors_match_oracle_interpreted(c):
    """BackwardTiles.step_descriptors: the same buffers through an index that is always 0 (a
    1 would read the other consumer's keys and dS^T, or past the buffers)."""
    check_masked_backward(c, interpreted=True, mosaic_forward=False)


def test_step_descriptors_keep_the_step_opaque_to_llvm(monkeypatch):
    """A plain call's loop runs over constant bounds, from which LLVM bounded the step and
    folded `(step + 1) >> 31` to 0 (the H200's plain "fixed" kernel compiled to the same
    instructions with step_descriptors as without): the step reaches the shift through an
    empty inline asm tied to its register, which LLVM cannot see through."""
    p = Problem(1, 256, 256, 2, 2, 128, False, "bf16")
    opaque_steps = [
        mosaic_opaque_i32s(
            monkeypatch,
            backward_fn(p, BackwardTiles(fused_dq="fixed", step_descriptors=step_descriptors)),
            *abstract_backward_args(p),
        )
        for step_descriptors in (False, True)
    ]
    assert opaque_steps[0] == 0 and opaque_steps[1] >= 2, opaque_steps


def test_opaque_zero_is_zero_from_step_minus_one():
    steps = jnp.array([-1, 0, 1, 2**20, 2**31 - 2], jnp.int32)
    assert np.all(np.asarray(mosaic_launch.opaque_zero(steps)) == 0)
    assert int(mosaic_launch.opaque_zero(jnp.int32(-2))) == 1


@pytest.mark.parametrize(
    "p, tiles",
    [
        (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), BackwardTiles(fused_dq="add")),
        (Problem(1, 256, 192, 4, 1, 64, True, "f16"), BackwardTiles(fused_dq="add")),
        (Problem(2, 256, 512, 4, 2, 128, True, "bf16"), BackwardTiles(fused_dq="fixed")),
        (Problem(1, 256, 192, 4, 1, 64, False, "bf16"), BackwardTiles(fused_dq="fixed")),
        (
            Problem(2, 256, 512, 4, 2, 128, True, "bf16"),
            BackwardTiles(fused_dq="fixed", step_descriptors=True),
        ),
        pytest.param(
            Problem(1, 256, 192, 4, 1, 64, False, "f16"),
            BackwardTiles(fused_dq="add", num_consumers=1, dkv_head_splits=2),
            marks=long_only,
        ),
    ],
    ids=case_id,
)
def test_fused_dq_lowers_for_h200(monkeypatch, p, tiles):
    """One Mosaic GPU call (no dQ kernel), whose consumers add their partials by TMA
    reductions ("fixed": after the two Triton kernels of its row scales) into dQ's zeros, and
    write dK and dV whole into uninitialised buffers (AllocateBuffer, no zeros); dq [B, T, N,
    H] in the input dtype."""
    calls = []

    def spy(name):
        real = getattr(fused_dq_module.plgpu, name)

        def traced(*args, **kwargs):
            calls.append(kwargs.get("reduction_op", name))
            return real(*args, **kwargs)

        monkeypatch.setattr(fused_dq_module.plgpu, name, traced)

    spy("copy_smem_to_gmem")
    lowered = lower_for_h200(backward_fn(p, tiles), *abstract_backward_args(p))
    scales = ["__gpu"] * 2 if tiles.fixed_point_dq else []  # __gpu$xla.gpu.triton
    allocations = ["AllocateBuffer"] * 2  # dK and dV (or their partials)
    assert custom_call_targets(lowered.as_text()) == [*scales, *allocations, "mosaic_gpu_v2"]
    assert "add" in calls
    dq = lowered.out_info[0]
    q = abstract_inputs(p)[0]
    assert (dq.shape, dq.dtype) == (q.shape, q.dtype)


def test_fused_dq_tiles_validate():
    with pytest.raises(ValueError, match="fused_dq='sum' must be one of"):
        BackwardTiles(fused_dq="sum")
    with pytest.raises(ValueError, match="fused_dq needs split_dkv=False"):
        BackwardTiles(fused_dq="add", split_dkv=True)
    with pytest.raises(ValueError, match="producer_cleans_k is the dQ kernel's"):
        BackwardTiles(fused_dq="add", producer_cleans_k=True)
    with pytest.raises(ValueError, match="producer_cleans_k=1 must be a bool"):
        BackwardTiles(producer_cleans_k=1)
    why = functools.partial(
        backward_tiles.why_not, is_causal=True, tiles=BackwardTiles(fused_dq="add")
    )
    shapes = ((1, 256, 4, 96), (1, 256, 4, 96))
    assert "fused_dq needs a multiple of 64" in why(*shapes, jnp.bfloat16)
    shapes = ((1, 256, 4, 128), (1, 256, 4, 128))
    assert "not tested with dropout" in why(*shapes, jnp.bfloat16, dropout=True)
    assert why(*shapes, jnp.bfloat16) is None
    for mode in ("fixed", "fixed_slab"):
        fixed = functools.partial(why, tiles=BackwardTiles(fused_dq=mode))
        assert fixed(*shapes, jnp.bfloat16, window=(64, 0)) is None
        assert fixed(*shapes, jnp.bfloat16, segments=True) is None
        assert "bfloat16 only, not float16" in fixed(*shapes, jnp.float16)
        assert fixed(*shapes, jnp.bfloat16) is None
    # The staging tiles count in shared memory: with head splits' partials too they overflow.
    split = BackwardTiles(fused_dq="add", dkv_head_splits=2)
    assert "bytes of shared memory" in why(
        *((1, 256, 4, 128), (1, 256, 2, 128)), jnp.bfloat16, tiles=split
    )
    # One consumer at H=128 would hold dQ's whole partial of the step before beside S^T.
    alone = BackwardTiles(fused_dq="add", num_consumers=1)
    assert "224 f32 registers" in why(*shapes, jnp.bfloat16, tiles=alone)
    assert why(*((1, 256, 4, 64), (1, 256, 4, 64)), jnp.bfloat16, tiles=alone) is None


def test_fixed_dq_keeps_rows_of_a_huge_lse_in_range_interpreted():
    """Logits of 2^23 (|lse| ~ 8.4e6), where the backward's recomputed P is high by up to e^2
    (`_numerics.slack`, documented): "fixed_slab"'s dQ equals the two-kernel backward's
    within rounding instead of wrapping around int32."""
    batch, q_len, kv_len, heads, head_dim = 1, 64, 256, 1, 64
    c, a = 1024.0, 2.0**14
    alt = np.tile([1.0, -1.0], head_dim // 2)
    sign = np.tile([1.0, -1.0], kv_len // 2)
    q = np.full((batch, q_len, heads, head_dim), c)
    k = (c + sign[:, None] * a * alt[None, :])[None, :, None, :]
    v = np.broadcast_to(sign[:, None], (kv_len, head_dim))[None, :, None, :]
    d_out = np.ones((batch, q_len, heads, head_dim))
    q, k, v, d_out = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, d_out))
    scale = 0.125
    logits = np.einsum("bthd,bshd->bhts", np.float64(q), np.float64(k)) * scale
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    assert np.abs(lse).min() > 2.0**22
    p = np.exp(logits - lse[..., None])
    out = jnp.asarray(np.einsum("bhts,bshd->bthd", p, np.float64(v)), jnp.bfloat16)
    lse = jnp.asarray(lse, jnp.float32)

    def dq(tiles):
        fn = functools.partial(call_mosaic_backward, scale=scale, is_causal=False, tiles=tiles)
        with interpret_mosaic():
            return np.asarray(jax.jit(fn)(q, k, v, out, lse, d_out, None)[0], np.float32)

    default, fixed = dq(None), dq(BackwardTiles(fused_dq="fixed_slab"))
    assert np.isfinite(fixed).all()
    np.testing.assert_allclose(fixed, default, rtol=2e-2, atol=1e-2 * np.abs(default).max())


FUSED_ADD = BackwardTiles(fused_dq="add")
FUSED_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"), tiles=FUSED_ADD),
    MaskCase(Problem(2, 512, 1024, 8, 2, 128, False, "f16"), tiles=FUSED_ADD),
    MaskCase(Problem(2, 1024, 777, 8, 8, 64, True, "bf16"), tiles=FUSED_ADD),
    MaskCase(
        Problem(2, 512, 512, 4, 2, 128, True, "bf16"),
        window=(200, 0),
        soft_cap=20.0,
        kind="packed-lengths",
        scale=1.0,
        tiles=FUSED_ADD,
        poison=True,
    ),
    # MQA with head splits: one consumer at H=64 (at H=128 one consumer would hold 224
    # registers with dQ's partial beside S^T, two the splits' staging over shared memory).
    MaskCase(
        Problem(1, 2048, 2048, 16, 1, 64, True, "bf16"),
        tiles=BackwardTiles(fused_dq="add", num_consumers=1, dkv_head_splits=4),
    ),
    MaskCase(Problem(2, 512, 512, 4, 2, 64, True, "bf16"), tiles=BackwardTiles(fused_dq="slab")),
    # With the descriptors rebuilt each step, as the dispatch takes it.
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="add", step_descriptors=True),
        poison=True,
    ),
]
FUSED_FIXED = BackwardTiles(fused_dq="fixed")
FUSED_FIXED_MASKED_GPU_CASES = [
    # Windows: causal (Mistral's sliding window) at H=128 with step descriptors, and both sides
    # of the diagonal at H=64 with T != S.
    MaskCase(
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        window=(300, 0),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(1, 1000, 1500, 4, 2, 64, False, "bf16"),
        window=(200, 300),
        tiles=FUSED_FIXED,
        poison=True,
    ),
    # Segment ids with sequence lengths (packed documents): each row's bound from its segment's
    # keys, key by key; causal at H=128, and plain at H=64 with T != S.
    MaskCase(
        Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"),
        kind="packed-lengths",
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(2, 1000, 1300, 4, 2, 64, False, "bf16"),
        kind="packed-lengths",
        tiles=FUSED_FIXED,
        poison=True,
    ),
]
# "fixed": causal and not, ragged T and S, T != S, GQA, a soft cap, one consumer taking every
# step with head splits, NaN and inf at keys past the diagonal.
FUSED_FIXED_GPU_CASES = [
    MaskCase(Problem(2, 1024, 1024, 8, 2, 128, True, "bf16"), tiles=FUSED_FIXED),
    MaskCase(
        Problem(2, 1024, 1000, 8, 2, 128, True, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(Problem(2, 512, 1024, 8, 2, 128, False, "bf16"), tiles=FUSED_FIXED),
    MaskCase(Problem(2, 1024, 777, 8, 8, 64, True, "bf16"), tiles=FUSED_FIXED, poison=True),
    MaskCase(
        Problem(2, 2048, 1500, 8, 2, 64, False, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", step_descriptors=True),
        poison=True,
    ),
    MaskCase(
        Problem(1, 1000, 1500, 4, 2, 128, False, "bf16"),
        soft_cap=20.0,
        scale=1.0,
        tiles=FUSED_FIXED,
    ),
    MaskCase(
        Problem(1, 2048, 2048, 16, 1, 64, True, "bf16"),
        tiles=BackwardTiles(fused_dq="fixed", num_consumers=1, dkv_head_splits=4),
    ),
    *FUSED_FIXED_MASKED_GPU_CASES,
]


# "add" on the same masked calls: what the dispatch gives windows and packed documents with
# deterministic_grads=False.
FUSED_ADD_MASKED_GPU_CASES = [
    dataclasses.replace(c, tiles=dataclasses.replace(c.tiles, fused_dq="add"))
    for c in FUSED_FIXED_MASKED_GPU_CASES
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c", FUSED_GPU_CASES + FUSED_FIXED_GPU_CASES + FUSED_ADD_MASKED_GPU_CASES, ids=case_id
)
def test_fused_dq_matches_oracle(c):
    needs_hopper()
    check_masked_backward(c, interpreted=False, mosaic_forward=not c.poison)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, is_causal", [(64, True), (128, False)])
def test_nondeterministic_grads_match_the_deterministic_ones(head_dim, is_causal):
    """deterministic_grads=False through the public API (the fused dQ, `dispatch`): dK and dV
    equal to those of the default call (the same products in the same order), dQ within
    float32 rounding of its adds."""
    needs_hopper()
    shape = (1, 4096, 4, head_dim)
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def grads(deterministic_grads):
        def out(q, k, v):
            return pallas_flash.flash_attention(
                q, k, v, is_causal=is_causal, deterministic_grads=deterministic_grads
            )

        return jax.jit(lambda *a: jax.vjp(out, *a)[1](d_out))(q, k, v)

    (dq, dk, dv), (dq_fast, dk_fast, dv_fast) = grads(True), grads(False)
    for fast, default in ((dk_fast, dk), (dv_fast, dv)):
        np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(default, np.float32))
    dq, dq_fast = (np.asarray(x, np.float32) for x in (dq, dq_fast))
    assert np.all(np.isfinite(dq_fast))
    assert np.max(np.abs(dq_fast - dq)) <= 1e-2 * np.max(np.abs(dq))


@pytest.mark.gpu
def test_default_grads_sum_dq_as_integers_and_repeat_bitwise():
    """The default call where the dispatch takes fused_dq="fixed" (H=64, 4k, plain): its
    gradients are bitwise the same over repeated runs, dK and dV equal to those of
    deterministic_grads=False (the same products in the same order), dQ within rounding."""
    needs_hopper()
    shape = (1, 4096, 4, 64)
    call = Call(
        q_shape=shape,
        k_shape=shape,
        dtype=jnp.dtype(jnp.bfloat16),
        spec=MaskSpec(q_len=4096, kv_len=4096, is_causal=False),
    )
    config = dispatch.choose(call, Device.current(), scale=0.125)
    assert config.mosaic_backward_tiles.fused_dq == "fixed", config
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def grads(deterministic_grads):
        def out(q, k, v):
            return pallas_flash.flash_attention(q, k, v, deterministic_grads=deterministic_grads)

        return jax.jit(lambda *a: jax.vjp(out, *a)[1](d_out))(q, k, v)

    first = grads(True)
    for _ in range(3):
        assert_bitwise_equal(grads(True), first)
    (dq, dk, dv), (dq_fast, dk_fast, dv_fast) = first, grads(False)
    for fast, default in ((dk_fast, dk), (dv_fast, dv)):
        np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(default, np.float32))
    dq, dq_fast = (np.asarray(x, np.float32) for x in (dq, dq_fast))
    assert np.max(np.abs(dq_fast - dq)) <= 1e-2 * np.max(np.abs(dq))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p",
    [
        Problem(1, 4096, 4096, 8, 2, 128, True, "bf16"),
        Problem(1, 4096, 4096, 8, 2, 128, False, "bf16"),
        Problem(2, 2048, 3000, 8, 8, 64, False, "bf16"),
    ],
    ids=case_id,
)
def test_fused_dq_fixed_is_deterministic(p):
    """ "fixed" adds integers, in any order: bitwise the same dQ over repeated runs and as
    "fixed_slab"'s (its partials stored apart and summed by XLA), and within rounding of the
    two-kernel backward's."""
    needs_hopper()
    args, _ = random_inputs(p)

    def run(tiles):
        return jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))(*args)

    first = run(FUSED_FIXED)
    for _ in range(5):
        assert_bitwise_equal(run(FUSED_FIXED), first)
    assert_bitwise_equal(run(BackwardTiles(fused_dq="fixed_slab")), first)
    default = run(None)
    dq, dq_default = (np.asarray(x[2], np.float32) for x in (first, default))
    assert np.max(np.abs(dq - dq_default)) <= 1e-2 * np.max(np.abs(dq_default))


@pytest.mark.gpu
def test_fused_dq_fixed_keeps_rows_from_huge_keys_they_cannot_see():
    """Causal "fixed": keys 1e15 times larger past a row's diagonal (a cache's stale entries)
    leave that row's dQ as it is with them cleared: its fixed point's unit comes from the
    keys it sees."""
    needs_hopper()
    p = Problem(1, 1024, 1024, 4, 2, 128, True, "bf16")
    (q, k, v, d_out, _), _ = random_inputs(p)
    huge_k = k.at[:, 512:].multiply(1e15)
    huge_v = v.at[:, 512:].multiply(1e15)
    backward = jax.jit(backward_fn(p, FUSED_FIXED))
    out, lse = jax.jit(functools.partial(call_mosaic_forward, scale=p.scale, is_causal=True))(
        q, k, v
    )
    clean = backward(q, k, v, out, lse, d_out, None)[0]
    huge = backward(q, huge_k, huge_v, out, lse, d_out, None)[0]
    np.testing.assert_array_equal(
        np.asarray(huge[:, :512], np.float32), np.asarray(clean[:, :512], np.float32)
    )


def test_fused_dq_fixed_keeps_rows_from_huge_keys_of_other_documents_interpreted():
    """Packed documents, "fixed_slab": the second document's keys 1e15 times larger leave the
    first document's dQ bitwise as it is without them: each row's fixed point comes from the
    keys of its own segment."""
    p = Problem(1, 256, 256, 2, 1, 64, False, "bf16")
    (q, k, v, d_out, _), _ = random_inputs(p)
    ids = jnp.asarray(np.arange(256) >= 128, jnp.int32)[None]
    spec = MaskSpec(q_len=256, kv_len=256, is_causal=False, has_segments=True)
    arrays = MaskArrays(ids, ids)

    def forward(q, k, v):
        return reference_attention(q, k, v, None, arrays, spec=spec, scale=p.scale, soft_cap=None)

    out, lse = jax.jit(forward)(q, k, v)[:2]
    backward = jax.jit(
        functools.partial(
            call_mosaic_backward,
            scale=p.scale,
            is_causal=False,
            tiles=BackwardTiles(fused_dq="fixed_slab"),
            segment_ids=(ids, ids),
        )
    )
    huge_k, huge_v = k.at[:, 128:].multiply(1e15), v.at[:, 128:].multiply(1e15)
    with interpret_mosaic():
        clean = np.asarray(backward(q, k, v, out.astype(q.dtype), lse, d_out, None)[0], np.float32)
        huge = np.asarray(
            backward(q, huge_k, huge_v, out.astype(q.dtype), lse, d_out, None)[0], np.float32
        )
    assert np.abs(clean[:, :128]).max() > 0
    np.testing.assert_array_equal(huge[:, :128], clean[:, :128])


@pytest.mark.gpu
def test_fused_dq_slab_is_deterministic():
    """ "slab" sums its partials in a fixed order: bitwise the same over repeated runs ("add"
    is not: its TMA adds land in any order)."""
    needs_hopper()
    p = Problem(2, 512, 512, 8, 2, 128, True, "bf16")
    args, _ = random_inputs(p)
    fn = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, BackwardTiles(fused_dq="slab"))))
    first = fn(*args)
    for _ in range(5):
        assert_bitwise_equal(fn(*args), first)
