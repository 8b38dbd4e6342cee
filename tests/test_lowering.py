"""Lowering of the forward and backward kernels through Triton for an abstract H200, on CPU.

The interpreter does not apply Triton's rules (power-of-two arrays, 2-D dots, ...); lowering for
an abstract GPU does, so it catches Triton-only errors without a GPU. The calls go through the
public API: inside the abstract mesh of an H200 (jax's AOT target, which Pallas' Triton lowering
reads) the dispatch chooses for that GPU (`pallas_flash.device.target_device`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from support.inputs import BLOCK_SIZES, Problem, abstract_inputs, case_id
from support.lowering import lower_for_h200, triton_calls

import pallas_flash
from pallas_flash import dispatch
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.triton.forward import choose_kv_splits, tile_sizes
from pallas_flash.triton.tiles import heuristic_block_sizes

DEPRECATION = "The Pallas Triton backend is deprecated"


def chosen_block_sizes(p: Problem, block_sizes=None):
    """The Triton tiles the dispatch gives `p` on an H200 (backend="triton")."""
    call = Call(
        q_shape=(p.batch, p.q_len, p.num_heads, p.head_dim),
        k_shape=(p.batch, p.kv_len, p.num_kv_heads, p.head_dim),
        dtype=p.jnp_dtype,
        spec=MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal),
    )
    config = dispatch.choose(
        call, Device.h200(), scale=p.scale, backend="triton", block_sizes=block_sizes
    )
    return config.block_sizes


def forward_and_backward(p: Problem, block_sizes=None, scale=None):
    """(out, lse, dq, dk, dv) of the public call with backend="triton"."""
    attention = functools.partial(
        pallas_flash.flash_attention,
        is_causal=p.is_causal,
        scale=p.scale if scale is None else scale,
        return_residuals=True,
        backend="triton",
        block_sizes=block_sizes,
    )

    def fn(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return out, lse, *vjp((d_out, d_lse))

    return fn


def expected_calls(p: Problem, bs) -> dict[str, dict[str, int]]:
    """The three kernels' grids and launch parameters for problem `p` and block sizes `bs`."""
    fwd_q, fwd_kv = tile_sizes(bs.block_q, p.q_len, bs.block_kv, p.kv_len)
    _, dkv_kv = tile_sizes(bs.block_q_dkv, p.q_len, bs.block_kv_dkv, p.kv_len)
    dq_q, _ = tile_sizes(bs.block_q_dq, p.q_len, bs.block_kv_dq, p.kv_len)
    fwd_tiles = pl.cdiv(p.q_len, fwd_q)
    # Small grids split the forward's KV loop over more programs (third grid axis).
    splits = choose_kv_splits(
        bs.kv_splits,
        fwd_tiles * p.num_heads * p.batch,
        pl.cdiv(p.kv_len, fwd_kv),
        False,
        num_sms=Device.h200().num_sms,
    )

    def call(tiles, heads, warps, stages, batch=p.batch):
        return dict(grid_x=tiles, grid_y=heads, grid_z=batch, num_warps=warps, num_stages=stages)

    return {
        "pallas_flash_forward": call(
            fwd_tiles, p.num_heads, bs.num_warps, bs.num_stages, p.batch * splits
        ),
        "pallas_flash_backward_dkv": call(
            pl.cdiv(p.kv_len, dkv_kv), p.num_kv_heads, bs.num_warps_dkv, bs.num_stages_dkv
        ),
        "pallas_flash_backward_dq": call(
            pl.cdiv(p.q_len, dq_q), p.num_heads, bs.num_warps_dq, bs.num_stages_dq
        ),
    }


# Default (GPU) block sizes for every padded head dim, causal and not, MHA / GQA / MQA, ragged
# and tiny lengths, every dtype.
PROBLEMS = [
    Problem(2, 1000, 1000, 8, 2, 128, True, "bf16"),
    Problem(1, 4096, 4096, 16, 16, 128, False, "bf16"),
    Problem(1, 257, 100, 4, 4, 80, False, "bf16"),
    Problem(1, 100, 257, 6, 2, 80, True, "f16"),
    Problem(1, 512, 512, 4, 1, 64, True, "f16"),
    Problem(2, 17, 1, 4, 2, 64, False, "f32"),
    Problem(1, 300, 300, 2, 2, 256, True, "bf16"),
    Problem(1, 100, 257, 6, 2, 256, False, "f32"),
    Problem(1, 1, 17, 2, 1, 32, True, "bf16"),
    Problem(1, 257, 257, 3, 1, 48, True, "f16"),
    Problem(1, 100, 100, 2, 2, 8, False, "bf16"),
]


@pytest.mark.parametrize("p", PROBLEMS, ids=case_id)
def test_lowers_forward_and_backward_with_default_block_sizes(p):
    lowered = lower_for_h200(forward_and_backward(p), *abstract_inputs(p))
    assert triton_calls(lowered) == expected_calls(p, chosen_block_sizes(p))


@pytest.mark.parametrize("blocks", sorted(set(BLOCK_SIZES) - {"default"}))
def test_lowers_with_the_test_block_sizes(blocks):
    """The block sizes the numeric tests use are valid on a GPU too."""
    p = Problem(1, 257, 100, 4, 2, 80, True, "bf16", blocks)
    lowered = lower_for_h200(forward_and_backward(p, p.block_sizes), *abstract_inputs(p))
    assert triton_calls(lowered) == expected_calls(p, p.block_sizes)


def with_tile(block_sizes, field: str, value: int):
    """A copy of `block_sizes` with `field` set to `value`, bypassing BlockSizes validation."""
    bad = dataclasses.replace(block_sizes)
    object.__setattr__(bad, field, value)
    return bad


@pytest.mark.parametrize("field", ["block_kv", "block_q_dkv", "block_kv_dq"])
def test_lowering_rejects_a_tile_that_is_not_a_power_of_two(field):
    """Why BlockSizes insists on powers of two: Triton refuses anything else."""
    p = Problem(1, 1000, 1000, 4, 2, 64, True, "bf16")
    bad = with_tile(BLOCK_SIZES["q32kv16"], field, 48)
    with pytest.raises(ValueError, match="power of 2.*48"):
        lower_for_h200(forward_and_backward(p, bad), *abstract_inputs(p))


# -- the deprecation warning of the Pallas Triton backend -----------------------------------------


def deprecation_warnings(lower):
    """The Pallas Triton deprecation warnings that `lower()` emits, with every warning shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lower()
    return [
        w
        for w in caught
        if issubclass(w.category, DeprecationWarning) and DEPRECATION in str(w.message)
    ]


def lower_stock_kernel():
    """A plain pallas_call with jax's own Triton compiler params."""

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def fn(x):
        return pl.pallas_call(
            add_one,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=plgpu.CompilerParams(num_warps=4),
        )(x)

    return lower_for_h200(fn, jax.ShapeDtypeStruct((16, 16), jnp.float32))


def test_our_kernels_lower_without_the_deprecation_warning():
    p = Problem(1, 129, 77, 4, 2, 64, True, "bf16")
    filters_before = list(warnings.filters)

    def lower():
        # A scale no other test uses, so that no cached lowering can hide a warning.
        lower_for_h200(forward_and_backward(p, scale=0.1234567), *abstract_inputs(p))

    assert deprecation_warnings(lower) == []
    assert warnings.filters == filters_before


def test_other_pallas_triton_kernels_keep_the_deprecation_warning():
    """The silencing is scoped to pallas_flash's kernels: jax's warning still reaches others."""
    assert len(deprecation_warnings(lower_stock_kernel)) == 1
    # Our kernels' lowering in between does not change that.
    p = Problem(1, 33, 33, 2, 2, 32, False, "bf16")
    lower_for_h200(forward_and_backward(p, scale=0.7654321), *abstract_inputs(p))
    assert len(deprecation_warnings(lower_stock_kernel)) == 1


# Every mask operand lowered for the H200 (forward and backward, dBias included): tiles of the
# pair operands, scalar loads of the tile ranges, tanh of the soft cap. Values: flash_attention
# keyword arguments, with the shapes of the array ones.
MASKED = {
    "window-causal": dict(local_window_size=(64, 0), is_causal=True),
    "segments": dict(q_segment_ids=(2, 1000), kv_segment_ids=(2, 900)),
    "mask": dict(mask=(2, 1, 1000, 900)),
    "bias-soft-cap": dict(bias=(1, 8, 1000, 900), logits_soft_cap=5.0),
    "broadcast-bias-segments-mask": dict(
        bias=(2, 1, 1, 900), q_segment_ids=(2, 1000), kv_segment_ids=(2, 900), mask=(1, 8, 1, 900)
    ),
    "key-broadcast-bias-window": dict(
        bias=(1, 8, 1000, 1), local_window_size=(100, 0), is_causal=True
    ),
    # The dbias kernel's capped rows: each pair's row sums over its keys, then delta's fix.
    "broadcast-bias-soft-cap": dict(bias=(1, 1, 1, 1), logits_soft_cap=5.0, is_causal=True),
    "key-broadcast-bias-soft-cap": dict(bias=(2, 8, 1000, 1), logits_soft_cap=5.0),
}
_ARRAY_DTYPES = dict(
    bias=jnp.bfloat16, mask=jnp.bool_, q_segment_ids=jnp.int32, kv_segment_ids=jnp.int32
)


@pytest.mark.parametrize("case", list(MASKED))
def test_lowers_mask_operands(case):
    kwargs = dict(MASKED[case])
    arrays = {
        name: jax.ShapeDtypeStruct(kwargs.pop(name), dtype)
        for name, dtype in _ARRAY_DTYPES.items()
        if name in kwargs
    }
    bias = arrays.pop("bias", None)
    bs = heuristic_block_sizes(128, jnp.bfloat16, masked=True)
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, 1000, 8, 128), jnp.bfloat16), sds((2, 900, 2, 128), jnp.bfloat16)

    def fn(q, k, v, bias, arrays):
        def attention(q, k, v, bias):
            return pallas_flash.flash_attention(
                q, k, v, bias, scale=0.1, backend="triton", block_sizes=bs, **arrays, **kwargs
            )

        out, vjp = jax.vjp(attention, q, k, v, bias)
        return vjp(out)

    lowered = lower_for_h200(fn, q, kv, kv, bias, arrays)
    names = set(triton_calls(lowered))
    assert {
        "pallas_flash_forward",
        "pallas_flash_backward_dkv",
        "pallas_flash_backward_dq",
    } <= names
    # A bias broadcast over the keys, without a soft cap, gets its gradient in closed form.
    kernel_dbias = bias is not None and (bias.shape[-1] != 1 or "logits_soft_cap" in kwargs)
    assert ("pallas_flash_backward_dbias" in names) == kernel_dbias


# A few query tokens over a longer key sequence: the default call's forward is the decode kernel
# (`dispatch.few_tokens_on_decode`), the backward the flash one. Values: flash_attention keyword
# arguments (array ones as shapes), and whether the decode kernel splits its key loop and runs
# its merge kernel (a causal call reads its first T keys only: one tile).
FEW_TOKENS = {
    "t1": (dict(), True),
    "t4-causal-lengths-sinks": (
        dict(
            is_causal=True,
            query_seq_lengths=(2,),
            key_value_seq_lengths=(2,),
            sinks=(8,),
            logits_soft_cap=30.0,
        ),
        False,
    ),
    "t4-window-both-sides": (dict(local_window_size=(2, 100)), True),
}


@pytest.mark.parametrize("case", list(FEW_TOKENS))
def test_few_tokens_lower_the_decode_kernel(case):
    kwargs, merged = FEW_TOKENS[case]
    kwargs = dict(kwargs)
    arrays = {
        name: jax.ShapeDtypeStruct(kwargs.pop(name), jnp.float32 if name == "sinks" else jnp.int32)
        for name in ("query_seq_lengths", "key_value_seq_lengths", "sinks")
        if name in kwargs
    }
    q_len = 1 if case == "t1" else 4
    # Two sequences of the fewest keys over which a compiled call of 4 tokens takes the route.
    kv_len = dispatch.DECODE_ROUTE_MIN_BATCH_KEYS[dispatch.DECODE_ROUTE_MAX_Q_LEN] // 2
    sds = jax.ShapeDtypeStruct
    q, kv = sds((2, q_len, 8, 128), jnp.bfloat16), sds((2, kv_len, 2, 128), jnp.bfloat16)

    def fn(q, k, v, arrays):
        def attention(q, k, v):
            return pallas_flash.flash_attention(q, k, v, **arrays, **kwargs)

        out, vjp = jax.vjp(attention, q, k, v)
        return vjp(out)

    lowered = lower_for_h200(fn, q, kv, kv, arrays)
    names = set(triton_calls(lowered))
    assert {"pallas_flash_decode", "pallas_flash_backward_dkv", "pallas_flash_backward_dq"} <= (
        names
    ), names
    assert "pallas_flash_forward" not in names, names
    assert ("pallas_flash_decode_merge" in names) == merged, names


def kernel_calls_and_ops(lowered) -> tuple[list[str], list[str]]:
    """The kernels' custom calls (target and attributes: launch parameters and the serialised
    kernel) in program order, and the ops of the kernels' passes (`_forward` then `_backward`,
    the functions they call inlined) by name, sharding constraints left out."""
    text = re.sub(r"\s*loc\(#loc\d*\)", "", lowered.as_text())
    calls = re.findall(r"stablehlo\.custom_call (@\S+)\([^)]*\) (\{.*\}) :", text)
    bodies = dict(re.findall(r"func\.func private @(\w+)\((.*?)\n  \}", text, re.DOTALL))

    def ops(name):
        for called, op in re.findall(r"= (?:call @(\w+)|([a-z_]+\.[a-z_]+))", bodies[name]):
            if called:
                yield from ops(called)
            elif op != "sdy.sharding_constraint":
                yield op

    return [" ".join(c) for c in calls], [*ops("_forward"), *ops("_backward")]


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(dict(backend="triton", block_sizes=BLOCK_SIZES["all16"]), id="triton"),
        pytest.param(dict(backend="mosaic"), id="mosaic"),
    ],
)
def test_unbatched_inputs_lower_the_batch_one_program(kernels):
    """Unbatched [T, N, H] inputs lower to the batch-1 call's kernels (the same launches and
    serialised kernels, in the same order) and the same ops around them: the programs differ
    by the batch axis added and removed only. (XLA may still round its own reductions among
    those ops differently in the two compiled programs: test_rank3_inputs.)"""
    from support.calls import outputs_and_grads

    triton = kernels["backend"] == "triton"
    # test_rank3_inputs' problem on the Triton kernels; the Mosaic kernels take H=128 in bf16.
    (t, s, n, kh, h), dtype = (
        ((33, 40, 4, 2, 32), jnp.float32)
        if triton
        else (
            (257, 300, 4, 2, 128),
            jnp.bfloat16,
        )
    )
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=True, return_residuals=True, **kernels
    )
    fn = functools.partial(outputs_and_grads, attention)
    programs = []
    for lead in ((), (1,)):
        q, kv = (jax.ShapeDtypeStruct(lead + x, dtype) for x in ((t, n, h), (s, kh, h)))
        rows = jax.ShapeDtypeStruct(lead + (n, t), jnp.float32)
        programs.append(kernel_calls_and_ops(lower_for_h200(fn, q, kv, kv, q, rows)))
    (unbatched_calls, unbatched_ops), (batched_calls, batched_ops) = programs
    assert len(batched_calls) >= 3, batched_calls  # the forward and the backward's kernels
    assert unbatched_calls == batched_calls
    assert unbatched_ops == batched_ops
