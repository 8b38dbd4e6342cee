"""What the Mosaic GPU backward's tests share (tests/test_mosaic_backward*.py, and the dropout,
value-head-dim and head-dim tests): the backward and the differentiated Mosaic forward as
functions of a `Problem`, the oracle check, masked cases (`MaskCase`) with their check and their
poisoned keys, and calls at a value head dim of their own (`BackwardCase`) with their check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import masks
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles
from pallas_flash.reference import reference_attention
from support.calls import oracle_outputs_and_grads, outputs_and_grads, plain_fn
from support.inputs import Problem, abstract_inputs, case_id, random_inputs, segment_arrays
from support.kernels import call_mosaic_backward, call_mosaic_forward
from support.mosaic_interpret import interpret_mosaic
from support.oracle import attention_oracle_f64, masked_in_dtype
from support.tolerance import FLOOR, OUTPUT_NAMES, assert_within_tolerance


def backward_fn(p: Problem, tiles: BackwardTiles | None = None, **options):
    return functools.partial(
        call_mosaic_backward, scale=p.scale, is_causal=p.is_causal, tiles=tiles, **options
    )


def mosaic_fn(p: Problem, tiles: BackwardTiles | None = None):
    """q, k, v -> (out, lse): the Mosaic forward, differentiated by the Mosaic backward."""

    @jax.custom_vjp
    def attention(q, k, v):
        return call_mosaic_forward(q, k, v, scale=p.scale, is_causal=p.is_causal)

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


def check_against_oracle(p: Problem, tiles: BackwardTiles | None = None):
    (q, k, v, d_out, d_lse), f64 = random_inputs(p)
    run = jax.jit(functools.partial(outputs_and_grads, mosaic_fn(p, tiles)))
    results = run(q, k, v, d_out, d_lse)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain_fn(p)))(q, k, v, d_out, d_lse)
    assert_within_tolerance(results, baselines, oracle_outputs_and_grads(p, *f64), floor=p.floor)


@dataclasses.dataclass(frozen=True)
class MaskCase:
    """A masked call: `kind` a support.inputs.segment_arrays kind (segment ids with lengths folded
    in) or None; scale None for 1/sqrt(H) (soft caps at scale 1, so that the cap bites); poison:
    the kernels get K and V with NaN and inf at the keys that no row sees."""

    p: Problem
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    kind: str | None = None
    scale: float | None = None
    tiles: BackwardTiles | None = None
    poison: bool = False

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec(
            q_len=self.p.q_len,
            kv_len=self.p.kv_len,
            is_causal=self.p.is_causal,
            window=self.window,
            has_segments=self.kind is not None,
        )

    @property
    def logit_scale(self) -> float:
        return self.p.scale if self.scale is None else self.scale

    def arrays(self) -> MaskArrays:
        if self.kind is None:
            return MaskArrays()
        return segment_arrays(self.kind, self.p.batch, self.p.q_len, self.p.kv_len)

    def __str__(self):
        parts = [str(self.p)]
        for name in ("window", "soft_cap", "kind", "scale"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        if self.tiles is not None:
            parts.append(case_id(self.tiles).replace("BackwardTiles", ""))
        if self.poison:
            parts.append("nan-at-hidden-keys")
        return "-".join(parts)


def mask_options(c: MaskCase, arrays: MaskArrays) -> dict:
    """The mask keywords of the Mosaic forward and backward (`support.kernels`) for case c."""
    segment_ids = (arrays.q_segment_ids, arrays.kv_segment_ids) if c.kind is not None else None
    return dict(window=c.window, soft_cap=c.soft_cap, segment_ids=segment_ids)


def check_masked_backward(c: MaskCase, *, interpreted: bool, mosaic_forward: bool):
    """The Mosaic backward of case c against the float64 oracle, with plain attention in the
    input dtype as the tolerance baseline. Residuals from the Mosaic forward (checked too) or,
    to keep the interpreter's time to the backward, from the library's "xla" reference (f32
    softmax, out in the input dtype). With c.poison the kernels get K and V with NaN and inf
    at the keys that no row sees and must give the gradients of the clean inputs. Rows that see
    no key have dq exactly 0, keys that no row sees dk and dv exactly 0."""
    p, scale, spec, arrays = c.p, c.logit_scale, c.spec, c.arrays()
    (q, k_clean, v_clean, d_out, d_lse), f64 = random_inputs(p)
    k, v = hidden_key_poison(c) if c.poison else (k_clean, v_clean)
    options = mask_options(c, arrays)
    visible = np.asarray(masks.dense(spec, arrays))  # [B|1, 1, T, S]
    oracle = attention_oracle_f64(*f64, scale=scale, visible=visible, soft_cap=c.soft_cap)

    def reference(q, k, v):
        return reference_attention(
            q, k, v, None, arrays, spec=spec, scale=scale, soft_cap=c.soft_cap
        )

    plain = functools.partial(masked_in_dtype, scale=scale, visible=visible, soft_cap=c.soft_cap)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(
        q, k_clean, v_clean, d_out, d_lse
    )
    forward = functools.partial(call_mosaic_forward, scale=scale, is_causal=p.is_causal, **options)
    backward = functools.partial(
        call_mosaic_backward, scale=scale, is_causal=p.is_causal, tiles=c.tiles, **options
    )
    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        if mosaic_forward:
            out, lse = jax.jit(forward)(q, k, v)
            out, lse = jnp.asarray(np.asarray(out)), jnp.asarray(np.asarray(lse))
        else:
            out, lse = jax.jit(reference)(q, k_clean, v_clean)
        grads = jax.jit(backward)(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g.astype(jnp.float32)) for g in grads]
    names = ("dq", "dk", "dv")
    results = grads
    if mosaic_forward:
        names = ("out", "lse", *names)
        results = [np.asarray(out.astype(jnp.float32)), np.asarray(lse), *grads]
    for name, x in zip(("dq", "dk", "dv"), grads, strict=True):
        assert np.isfinite(x).all(), f"{name}: {np.sum(~np.isfinite(x))} non-finite values"
    dq, dk, dv = grads
    empty_rows = np.broadcast_to(~visible.any(axis=-1)[:, 0], (p.batch, p.q_len))  # [B, T]
    hidden_keys = np.broadcast_to(~visible.any(axis=-2)[:, 0], (p.batch, p.kv_len))  # [B, S]
    assert (dq[empty_rows] == 0).all(), "rows that see no key must have dq exactly 0"
    assert (dk[hidden_keys] == 0).all() and (dv[hidden_keys] == 0).all(), "hidden keys"
    oracles = [oracle[name] for name in names]
    baselines = [baselines[OUTPUT_NAMES.index(name)] for name in names]
    assert_within_tolerance(results, baselines, oracles, floor=p.floor, names=names)


def hidden_key_poison(c: MaskCase):
    """K and V of case c with NaN and +-inf at the keys that no row sees (past the kv lengths,
    of a segment no query has)."""
    p, arrays = c.p, c.arrays()
    visible = np.asarray(masks.dense(c.spec, arrays))
    hidden = np.broadcast_to(~visible.any(axis=-2)[:, 0], (p.batch, p.kv_len))
    (_, k, v, _, _), _ = random_inputs(p)
    values = np.array([np.nan, np.inf, -np.inf])
    k_bad, v_bad = np.asarray(k, np.float32).copy(), np.asarray(v, np.float32).copy()
    b_idx, s_idx = np.nonzero(hidden)
    for j, (b, s) in enumerate(zip(b_idx, s_idx)):
        k_bad[b, s, :, j % 3 :: 5] = values[j % 3]
        v_bad[b, s, :, (j + 1) % 3 :: 7] = values[(j + 1) % 3]
    return jnp.asarray(k_bad, k.dtype), jnp.asarray(v_bad, v.dtype)


# -- the backward at a value head dim of its own (the value-head-dim and head-dim tests) ----------


@dataclasses.dataclass(frozen=True)
class BackwardCase:
    """One call of the Mosaic backward at (H, Hv): q [B, T, N, H], k [B, S, K, H], v [B, S, K,
    Hv]; kind: None or a support.inputs.segment_arrays kind; poison: NaN and inf in K and V at the
    keys that no row sees."""

    H: int
    Hv: int
    B: int
    T: int
    S: int
    N: int
    K: int
    is_causal: bool
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    kind: str | None = None
    tiles: BackwardTiles | None = None
    poison: bool = False

    @property
    def spec(self) -> masks.MaskSpec:
        return masks.MaskSpec(
            q_len=self.T,
            kv_len=self.S,
            is_causal=self.is_causal,
            window=self.window,
            has_segments=self.kind is not None,
        )

    def __str__(self):
        parts = [f"H{self.H}-Hv{self.Hv}-B{self.B}-T{self.T}-S{self.S}-N{self.N}-K{self.K}"]
        parts.append("causal" if self.is_causal else "full")
        for name in ("window", "soft_cap", "kind"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        if self.tiles is not None:
            parts.append(case_id(self.tiles).replace("BackwardTiles", ""))
        return "-".join(parts + (["nan-at-hidden-keys"] if self.poison else []))


def check_mosaic_backward(c: BackwardCase, *, interpreted: bool):
    """flash_backward of case c (on the float64 oracle's out, rounded to bfloat16, and lse)
    against the float64 oracle, within twice plain bfloat16 attention's error: dq [B, T, N, H],
    dk [B, S, K, H], dv [B, S, K, Hv]; rows that see no key have dq exactly 0, keys no row sees
    dk and dv 0."""
    scale = 1.0 / np.sqrt(c.H)
    rng = np.random.default_rng(4)
    shapes = ((c.B, c.T, c.N, c.H), (c.B, c.S, c.K, c.H), (c.B, c.S, c.K, c.Hv))
    # Rounded in numpy (ml_dtypes): each eager jnp op would compile a program on CPU.
    q, k_clean, v_clean, d_out = (
        rng.standard_normal(shape).astype(jnp.bfloat16)
        for shape in (*shapes, (c.B, c.T, c.N, c.Hv))
    )
    d_lse = rng.standard_normal((c.B, c.N, c.T)).astype(np.float32)
    arrays = masks.MaskArrays() if c.kind is None else segment_arrays(c.kind, c.B, c.T, c.S)
    visible = np.asarray(masks.dense(c.spec, arrays))  # [B|1, 1, T, S]
    hidden_keys = np.broadcast_to(~visible.any(axis=-2)[:, 0], (c.B, c.S))
    k, v = k_clean, v_clean
    if c.poison:
        assert hidden_keys.any()
        hidden = hidden_keys[..., None, None]
        k, v = (
            np.where(hidden, np.where(np.arange(x.shape[-1]) % 2, np.nan, np.inf), x).astype(
                x.dtype
            )
            for x in (k, v)
        )
    f64 = [x.astype(np.float64) for x in (q, k_clean, v_clean, d_out, d_lse)]
    oracle = attention_oracle_f64(*f64, scale=scale, visible=visible, soft_cap=c.soft_cap)
    out, lse = oracle["out"].astype(jnp.bfloat16), oracle["lse"].astype(np.float32)
    plain = functools.partial(masked_in_dtype, scale=scale, visible=visible, soft_cap=c.soft_cap)
    baselines = jax.jit(functools.partial(outputs_and_grads, plain))(
        q, k_clean, v_clean, d_out, d_lse
    )[2:]
    segment_ids = None if c.kind is None else (arrays.q_segment_ids, arrays.kv_segment_ids)
    backward = functools.partial(
        call_mosaic_backward, scale=scale, is_causal=c.is_causal, window=c.window,
        soft_cap=c.soft_cap, segment_ids=segment_ids, tiles=c.tiles,
    )  # fmt: skip
    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        grads = jax.jit(backward)(q, k, v, out, lse, d_out, d_lse)
        grads = [np.asarray(g).astype(np.float32) for g in grads]
    dq, dk, dv = grads
    assert (dq.shape, dk.shape, dv.shape) == (shapes[0], shapes[1], shapes[2])
    for name, x in zip(("dq", "dk", "dv"), grads, strict=True):
        assert np.isfinite(x).all(), f"{name}: {np.sum(~np.isfinite(x))} non-finite values"
    empty_rows = np.broadcast_to(~visible.any(axis=-1)[:, 0], (c.B, c.T))
    assert (dq[empty_rows] == 0).all(), "rows that see no key must have dq exactly 0"
    assert (dk[hidden_keys] == 0).all() and (dv[hidden_keys] == 0).all(), "hidden keys"
    names = ("dq", "dk", "dv")
    oracles = [oracle[name] for name in names]
    assert_within_tolerance(grads, baselines, oracles, floor=FLOOR[jnp.bfloat16], names=names)
