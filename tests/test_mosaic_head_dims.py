"""The Mosaic GPU forward at head dims 80 and 96, which it runs as they are: Q, K, V and the
output tiles take a 32-byte (H=80, five 16-column tiles) or 64-byte (H=96, three 32-column tiles)
swizzle instead of a zero-padded copy at 128 columns.

Lowering for an abstract H200 runs jax's Mosaic GPU lowering down to the wgmma and TMA
instructions in Python: it is what checks on a CPU that the swizzles, tilings and wgmma shapes
of every kernel variant are legal (the interpreter does not model swizzles). The interpreted
cases check the unpadded wrapper and kernel numerics against the float64 oracle; the compiled
ones (marked gpu) the swizzled layouts themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    Problem,
    assert_within_tolerance,
    attention_oracle_f64,
    outputs_and_grads,
    random_inputs,
    segment_arrays,
)
from test_lowering import abstract_inputs, lower_for_h200
from test_mosaic_forward import (
    GARBAGE,
    check_default_call_on_hopper,
    check_masked,
    check_segments,
    custom_call_targets,
    masked_in_dtype,
    needs_hopper,
    public_fn,
    visibility,
)

from pallas_flash import _dropout, masks
from pallas_flash import device as device_lib
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import forward as mosaic_forward_module
from pallas_flash.mosaic.forward import flash_forward
from pallas_flash.mosaic.tiles import HEAD_DIMS, default_tiles, swizzle_bytes, why_not

SWEEP = bool(os.environ.get("PALLAS_FLASH_SWEEP"))
sweep_only = pytest.mark.skipif(not SWEEP, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")


def test_swizzle_is_the_widest_that_divides_a_row():
    """128 bytes wherever the head dim allows (as before), 64 at H=96 and 32 at H=80; each head
    dim is whole column tiles of its swizzle."""
    want = {64: 128, 80: 32, 96: 64, 128: 128, 192: 128, 256: 128}
    assert {h: swizzle_bytes(h, 2) for h in HEAD_DIMS} == want
    with pytest.raises(ValueError, match="head_dim=72"):
        swizzle_bytes(72, 2)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_budgets_count_the_head_dim_itself(head_dim):
    """Shared memory and registers at H, not at 128: tiles that fit at 96 but not at 128."""
    from pallas_flash.mosaic.tiles import ForwardTiles

    # 4 stages of 128-key K and V tiles: 160 KiB at H=80, 192 KiB at 96, 256 KiB at 128.
    tiles = ForwardTiles(block_q=64, block_kv=128, num_stages=4)
    q_shape, k_shape = (1, 512, 2, head_dim), (1, 512, 1, head_dim)
    assert why_not(q_shape, k_shape, jnp.bfloat16, is_causal=False, tiles=tiles) is None
    assert "shared memory" in why_not(
        (1, 512, 2, 128), (1, 512, 1, 128), jnp.bfloat16, is_causal=False, tiles=tiles
    )


# -- lowering for an abstract H200 (CPU) ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A forward call: the problem and what it adds (all off by default); persistent None takes
    the default tiles' schedule."""

    p: Problem
    value_head_dim: int | None = None
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    segments: bool = False
    sinks: bool = False
    dropout: float | None = None
    persistent: bool | None = None
    with_log_sum: bool = False

    def __str__(self):
        fields = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)[1:]
            if getattr(self, f.name) not in (None, False)
            or f.name == "persistent"
            and self.persistent is not None
        ]
        return "-".join([str(self.p), *fields])

    @property
    def hv(self) -> int:
        return self.p.head_dim if self.value_head_dim is None else self.value_head_dim

    def tiles(self):
        p = self.p
        tiles = default_tiles(
            p.head_dim,
            value_head_dim=self.hv,
            q_len=p.q_len,
            kv_len=p.kv_len,
            is_causal=p.is_causal,
            window=self.window,
            soft_cap=self.soft_cap,
            segments=self.segments,
        )
        if self.persistent is None:
            return tiles
        return dataclasses.replace(tiles, persistent=self.persistent)

    def fn(self):
        """f(q, k, v, *extras) -> (out, lse); extras: q and kv segment ids, sinks, dropout seeds,
        those the variant has, in that order."""
        tiles = self.tiles()

        def run(q, k, v, *extras):
            extras = list(extras)
            ids = (extras.pop(0), extras.pop(0)) if self.segments else None
            sinks = extras.pop(0) if self.sinks else None
            dropout = (self.dropout, extras.pop(0)) if self.dropout else None
            return flash_forward(
                q,
                k,
                v,
                scale=self.p.scale,
                is_causal=self.p.is_causal,
                window=self.window,
                soft_cap=self.soft_cap,
                segment_ids=ids,
                sinks=sinks,
                dropout=dropout,
                tiles=tiles,
                with_log_sum=self.with_log_sum,
            )

        return run

    def abstract_args(self):
        p, dtype = self.p, self.p.jnp_dtype
        args = [
            jax.ShapeDtypeStruct((p.batch, p.q_len, p.num_heads, p.head_dim), dtype),
            jax.ShapeDtypeStruct((p.batch, p.kv_len, p.num_kv_heads, p.head_dim), dtype),
            jax.ShapeDtypeStruct((p.batch, p.kv_len, p.num_kv_heads, self.hv), dtype),
        ]
        if self.segments:
            args += [
                jax.ShapeDtypeStruct((p.batch, p.q_len), jnp.int32),
                jax.ShapeDtypeStruct((p.batch, p.kv_len), jnp.int32),
            ]
        if self.sinks:
            args.append(jax.ShapeDtypeStruct((p.batch, p.num_heads), jnp.float32))
        if self.dropout:
            args.append(jax.ShapeDtypeStruct((p.batch, p.num_heads), jnp.int32))
        return args


def _v(head_dim, is_causal=True, q_len=256, kv_len=384, dtype="bf16", **options):
    return Variant(Problem(2, q_len, kv_len, 4, 2, head_dim, is_causal, dtype), **options)


# Every kernel variant at H 96 and 80: causal (a CTA per item) and not (persistent by default),
# GQA throughout, T < S and T > S, windows (the masked steps zero non-finite V in pieces that
# follow the narrower column tiles), soft caps, segment ids, sinks, dropout, persistent and
# not against the default, a value head dim of its own (a separate output buffer and swizzle),
# the log_sum output.
# CI runs one slice per head dim; the rest with PALLAS_FLASH_SWEEP.
LOWERING_VARIANTS = [
    _v(96, window=(100, 0), sinks=True),
    _v(80, is_causal=False, segments=True, dropout=0.1, persistent=True),
    *[
        pytest.param(v, marks=sweep_only)
        for v in [
            _v(96, is_causal=False),
            _v(80),
            _v(96, is_causal=False, q_len=512, kv_len=256, dtype="f16"),
            _v(80, q_len=512, kv_len=256, persistent=True),
            _v(96, persistent=True, soft_cap=30.0),
            _v(80, is_causal=False, persistent=False),
            _v(80, window=(50, 60), soft_cap=20.0),
            _v(96, segments=True),
            _v(80, sinks=True, soft_cap=30.0),
            _v(96, is_causal=False, dropout=0.2, persistent=False),
            _v(80, segments=True, dropout=0.1, window=(100, 0)),
            _v(96, value_head_dim=80),
            _v(80, is_causal=False, value_head_dim=128),
            _v(128, is_causal=False, value_head_dim=96, persistent=True),
            _v(96, sinks=True, with_log_sum=True),
        ]
    ],
]


def _wgmma_module():
    import jax.experimental.mosaic.gpu  # noqa: F401  (loads the submodule)

    return sys.modules["jax.experimental.mosaic.gpu.wgmma"]


def operand_types(text: str) -> list[str]:
    """The tensor types of the Mosaic GPU custom call's operands."""
    call = next(line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line)
    operands = call.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
    return re.findall(r"tensor<[^>]*>", operands)


@pytest.mark.parametrize("variant", LOWERING_VARIANTS, ids=str)
def test_lowers_for_h200_without_padding_the_head_dim(variant, monkeypatch):
    """One Mosaic GPU call on q, k, v as the caller gave them (no pad, no [.., 128] operand),
    whose Q.K^T wgmmas (N = block_kv) take H's swizzle and whose P.V wgmmas (N = Hv) take Hv's."""
    wgmma = _wgmma_module()
    issued = set()
    original = wgmma.wgmma_m64

    def spy(*args, swizzle, n, **kwargs):
        issued.add((int(getattr(swizzle, "value", swizzle)), n))
        return original(*args, swizzle=swizzle, n=n, **kwargs)

    monkeypatch.setattr(wgmma, "wgmma_m64", spy)
    lowered = lower_for_h200(variant.fn(), *variant.abstract_args())
    text = lowered.as_text()
    assert custom_call_targets(text) == ["mosaic_gpu_v2"]
    p, dtype = variant.p, variant.p.dtype
    # (Index tables may be padded by nothing; no array of q's dtype is padded at all.)
    assert not [line for line in text.splitlines() if "stablehlo.pad" in line and dtype in line]
    q, k, v = (
        f"tensor<{p.batch}x{length}x{heads}x{h}x{dtype}>"
        for length, heads, h in (
            (p.q_len, p.num_heads, p.head_dim),
            (p.kv_len, p.num_kv_heads, p.head_dim),
            (p.kv_len, p.num_kv_heads, variant.hv),
        )
    )
    assert operand_types(text)[:3] == [q, k, v]
    out, *rows = lowered.out_info
    assert out.shape == (p.batch, p.q_len, p.num_heads, variant.hv)
    assert [r.shape for r in rows] == [(p.batch, p.num_heads, p.q_len)] * (1 + variant.with_log_sum)
    block_kv = variant.tiles().block_kv
    itemsize = jnp.dtype(p.jnp_dtype).itemsize
    assert issued == {
        (swizzle_bytes(p.head_dim, itemsize), block_kv),
        (swizzle_bytes(variant.hv, itemsize), variant.hv),
    }


@pytest.mark.parametrize("head_dim", [96, pytest.param(80, marks=sweep_only)])
def test_default_call_runs_the_forward_unpadded_and_the_backward_padded(head_dim, monkeypatch):
    """backend=None on an H200 at H 80/96 (2k keys): the Mosaic forward on [.., H] operands,
    the Mosaic dK/dV and dQ kernels on the backward wrapper's copies at 128 columns."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    p = Problem(2, 2048, 2048, 8, 2, head_dim, True, "bf16")
    q = jax.ShapeDtypeStruct((p.batch, p.q_len, p.num_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((p.batch, p.kv_len, p.num_kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((p.batch, p.num_heads, p.q_len), jnp.float32)
    text = lower_for_h200(
        functools.partial(outputs_and_grads, public_fn(p)), q, kv, kv, q, lse
    ).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line]
    operands = [call.rsplit(" : (", 1)[1].split(") -> ", 1)[0] for call in calls]
    unpadded = [o for o in operands if f"x{head_dim}xbf16>" in o and "x128xbf16>" not in o]
    padded = [o for o in operands if "x128xbf16>" in o]
    assert len(calls) == 3 and len(unpadded) == 1 and len(padded) == 2, operands


# -- numerics in the Mosaic GPU interpreter (CPU) -------------------------------------------------


# Odd lengths (padded to 8 in T and S, not in H), garbage past the arrays' ends.
@pytest.mark.parametrize(
    "p, options",
    [
        (Problem(1, 61, 45, 2, 1, 80, False, "f16"), dict(window=(20, 9))),
        pytest.param(Problem(1, 77, 139, 2, 1, 96, True, "bf16"), {}, marks=sweep_only),
    ],
    ids=str,
)
def test_matches_oracle_interpreted(p, options, monkeypatch):
    monkeypatch.setattr(mosaic_forward_module, "num_sms", lambda: 3)
    check_masked(p, options, None, interpreted=True, oob_fill=GARBAGE)


# -- compiled on a Hopper GPU ---------------------------------------------------------------------


# (problem, options, tiles persistent or None for the default): plain, causal and not (the
# default's persistent and per-item schedules), GQA, odd lengths, T > S, masks.
GPU_CASES = [
    (Problem(2, 2048, 2048, 8, 2, 96, True, "bf16"), {}, None),
    (Problem(2, 2048, 2048, 8, 2, 80, True, "bf16"), {}, None),
    (Problem(2, 1024, 1024, 8, 8, 96, False, "f16"), {}, None),
    (Problem(2, 1024, 1024, 8, 4, 80, False, "bf16"), {}, None),
    (Problem(2, 1000, 777, 4, 2, 96, True, "bf16"), {}, None),
    (Problem(2, 333, 1001, 4, 1, 80, False, "f16"), {}, None),
    (Problem(2, 1024, 512, 4, 2, 96, True, "bf16"), {}, True),
    (Problem(2, 512, 1024, 4, 2, 80, False, "bf16"), {}, False),
    (Problem(2, 1000, 1000, 4, 2, 96, True, "bf16"), dict(window=(300, 0)), None),
    (Problem(2, 600, 900, 4, 2, 80, False, "bf16"), dict(window=(100, 200), soft_cap=20.0), None),
    (Problem(2, 512, 512, 4, 2, 96, False, "bf16"), dict(soft_cap=30.0), None),
]


def _tiles(p: Problem, options: dict, persistent):
    if persistent is None:
        return None
    tiles = default_tiles(
        p.head_dim, q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal, **options
    )
    return dataclasses.replace(tiles, persistent=persistent)


@pytest.mark.gpu
@pytest.mark.parametrize("p, options, persistent", GPU_CASES, ids=str)
def test_matches_oracle(p, options, persistent):
    needs_hopper()
    check_masked(p, options, None, _tiles(p, options, persistent))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, kind, options",
    [
        (Problem(2, 1024, 1024, 4, 2, 96, True, "bf16"), "packed-lengths", {}),
        (Problem(2, 197, 333, 4, 2, 80, False, "bf16"), "lengths", {}),
        (Problem(2, 512, 512, 4, 2, 80, True, "bf16"), "packed", dict(window=(100, 0))),
    ],
    ids=str,
)
def test_segments_match_oracle(p, kind, options):
    needs_hopper()
    check_segments(p, kind, options, None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, options",
    [
        (Problem(2, 1000, 1000, 4, 2, 96, True, "bf16"), {}),
        (Problem(2, 512, 777, 4, 2, 80, False, "bf16"), dict(soft_cap=30.0)),
    ],
    ids=str,
)
def test_sinks_match_oracle(p, options):
    """A sink joins each row's denominator: lse' = logaddexp(lse, sink), out' = out e^(lse -
    lse'), from the float64 oracle without it."""
    needs_hopper()
    (q, k, v, _, _), (q64, k64, v64, _, _) = random_inputs(p)
    sinks = jax.random.normal(jax.random.key(3), (p.batch, p.num_heads), jnp.float32) * 2.0
    run = jax.jit(functools.partial(flash_forward, scale=p.scale, is_causal=p.is_causal, **options))
    out, lse = run(q, k, v, sinks=sinks)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    visible = visibility(p, options.get("window"))
    soft_cap = options.get("soft_cap")
    oracle = attention_oracle_f64(q64, k64, v64, scale=p.scale, visible=visible, soft_cap=soft_cap)
    baseline = jax.jit(
        functools.partial(masked_in_dtype, scale=p.scale, visible=visible, soft_cap=soft_cap)
    )(q, k, v)

    def with_sinks(out, lse, sinks):
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        sunk = np.logaddexp(lse, np.asarray(sinks, np.float64)[:, :, None])  # [B, N, T]
        return out * np.exp(lse - sunk).transpose(0, 2, 1)[..., None], sunk

    want = with_sinks(oracle["out"], oracle["lse"], sinks)
    base = with_sinks(np.asarray(baseline[0], np.float32), baseline[1], sinks)
    assert_within_tolerance((out, lse), base, want, floor=p.floor, names=("out", "lse"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "p, segments",
    [
        (Problem(2, 1024, 1024, 4, 2, 96, True, "bf16"), False),
        (Problem(2, 512, 333, 4, 2, 80, False, "bf16"), True),
    ],
    ids=str,
)
def test_dropout_matches_oracle(p, segments):
    """The keep-mask of `pallas_flash._dropout` on P before P.V; lse the un-dropped one."""
    from test_dropout import dropout_oracle_f64

    needs_hopper()
    rate = 0.2
    (q, k, v, d_out, d_lse), (q64, k64, v64, do64, dl64) = random_inputs(p)
    seeds = _dropout.head_seeds(jax.random.key(5), p.batch, p.num_heads)
    spec = MaskSpec(q_len=p.q_len, kv_len=p.kv_len, is_causal=p.is_causal, has_segments=segments)
    ids, extra = None, {}
    if segments:
        arrays = segment_arrays("packed-lengths", p.batch, p.q_len, p.kv_len)
        ids = (arrays.q_segment_ids, arrays.kv_segment_ids)
        visible = np.asarray(masks.dense(spec, arrays))  # [B, 1, T, S]
        extra = dict(segment_ids=ids)
    else:
        visible = visibility(p, None)
    run = jax.jit(
        lambda q, k, v, seeds: flash_forward(
            q, k, v, scale=p.scale, is_causal=p.is_causal, dropout=(rate, seeds), **extra
        )
    )
    out, lse = run(q, k, v, seeds)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    keep = np.asarray(_dropout.dense_keep(seeds, p.q_len, p.kv_len, rate))
    want = dropout_oracle_f64(
        q64, k64, v64, do64, dl64, scale=p.scale, visible=visible, keep=keep, rate=rate
    )
    # bfloat16 inputs, P rounded to bfloat16 for P.V: the tolerance of the other bf16 checks
    # against the same oracle (the dropout tests'), at the output's scale.
    atol = 2e-2 * max(1.0, float(np.abs(want[0]).max()))
    np.testing.assert_allclose(out, want[0], rtol=0, atol=atol)
    finite = np.isfinite(want[1])
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], want[1][finite], rtol=0, atol=1e-2)


# Calls the default dispatch gives the Mosaic forward on an H200 (grids that fill it, ragged
# tiles only from 1k tokens): odd lengths, T != S, GQA and MHA.
DEFAULT_CALL_GPU_CASES = [
    Problem(2, 2048, 2048, 8, 2, 96, True, "bf16"),
    Problem(2, 2048, 2048, 8, 8, 80, False, "bf16"),
    Problem(2, 1500, 1500, 16, 2, 96, False, "bf16"),
    Problem(2, 1100, 2500, 16, 4, 80, True, "bf16"),
]


@pytest.mark.parametrize("p", DEFAULT_CALL_GPU_CASES, ids=str)
def test_default_call_cases_take_the_mosaic_forward_on_h200(p, monkeypatch):
    """What test_default_call_matches_oracle asserts on the GPU, checked here by lowering for
    an abstract H200: its cases must be ones the dispatch gives the Mosaic forward."""
    monkeypatch.setattr(device_lib, "target_device", Device.h200)
    text = lower_for_h200(public_fn(p), *abstract_inputs(p)[:3]).as_text()
    assert custom_call_targets(text) == ["mosaic_gpu_v2"]


@pytest.mark.gpu
@pytest.mark.parametrize("p", DEFAULT_CALL_GPU_CASES, ids=str)
def test_default_call_matches_oracle(p):
    """out, lse and dq, dk, dv of backend=None: the unpadded Mosaic forward's out and lse feed
    the backward (the Mosaic one, which pads to 128 in its wrapper, from 2k keys; else
    Triton)."""
    check_default_call_on_hopper(p)
