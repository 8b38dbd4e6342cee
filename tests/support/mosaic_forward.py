"""What the Mosaic GPU forward's tests share (tests/test_mosaic_forward*.py, and the backward's,
dropout's and head-dim tests): abstract inputs, the forward as a function of a `Problem`, the
checks of a masked or segmented forward against the float64 oracle, the public call on a Hopper,
and the markers of slow and Hopper-only cases.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import masks
from pallas_flash.device import gpu_compute_capability
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic.tiles import (
    ForwardTiles,
)
from support.calls import (
    oracle_outputs_and_grads,
    outputs_and_grads,
    plain_fn,
)
from support.inputs import Problem, random_inputs, segment_arrays
from support.kernels import call_mosaic_forward
from support.mosaic_interpret import interpret_mosaic
from support.oracle import (
    attention_oracle_f64,
)
from support.tolerance import assert_within_tolerance


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


def custom_call_targets(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @(\w+)", text)


def needs_hopper():
    cc = gpu_compute_capability()
    if cc is None or cc[0] != 9:
        pytest.skip(f"the Mosaic GPU forward needs sm_90 (Hopper); compute capability {cc}")


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


# What TMA reads past an array's end in the interpreter, instead of the hardware's zeros: finite
# (V past S meets a probability of exactly 0, and 0 * NaN would not be 0), and large enough that
# a key past S or a row past T leaking into a kept output shows at once.
GARBAGE = 1000.0


def public_fn(p: Problem, **kwargs):
    return functools.partial(
        pallas_flash.flash_attention, is_causal=p.is_causal, return_residuals=True, **kwargs
    )


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
