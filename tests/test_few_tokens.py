"""`flash_attention` with a few query tokens over a longer key sequence: the default dispatch runs
its forward on the decode kernel (`dispatch.few_tokens_on_decode`, `triton.few_tokens.
few_token_forward`), in the interpreter as on the GPU, and its backward on the flash backward.

Against the float64 oracle (support.oracle.attention_oracle_f64; support.tolerance's rule: twice the
error of plain attention computed in the input dtype, plus a floor): top-left causal rows
(query i sees keys j <= i, T != S), non-causal rows over every key below the key length,
windows on either side, soft caps, sinks, GQA groups 1, 4 and 8, query and key lengths (0
included: rows that see no key give 0 and lse -inf, or the sink), and NaN in K and V past the
key lengths; out, lse, log_sum (return_log_sum) and the gradients. Each case also checks that
the call took the decode kernel (its pallas_call in the traced program), so that dropping the
route fails here. Compiled for the GPU, a case's key sequence grows to the fewest keys the
dispatch routes there (`routed_kv_len`); the CPU checks that those calls take the route
(`test_the_gpu_cases_take_the_route`). Also: vmap.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import SWEEP, SWEEP_ONLY
from support.inputs import rounded
from support.oracle import attention_oracle_f64, to64

import pallas_flash
from pallas_flash import Device, dispatch

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
# Added to 2 x (plain attention's error in the input dtype), times max(1, largest |oracle|).
FLOOR = 1e-3

# The GPU the route checks trace for on the CPU (the route's thresholds are every GPU's).
H100 = Device.of_kind("NVIDIA H100 80GB HBM3", num_sms=132)


def mode_kwargs(mode: str) -> dict:
    """How each mode runs the default dispatch: the interpreter (the same choice of kernels, from
    DECODE_ROUTE_MIN_KV_LEN keys), or compiled for the GPU."""
    return dict(interpret=True) if mode == "interpret" else {}


def routed_kv_len(batch: int, q_len: int, kv_len: int) -> int:
    """The fewest keys, at least kv_len, over which a compiled call of `batch` sequences of
    `q_len` tokens takes the decode kernel: `dispatch.DECODE_ROUTE_MIN_BATCH_KEYS` keys per KV
    head over the batch."""
    most = 1 if q_len == 1 else dispatch.DECODE_ROUTE_MAX_Q_LEN
    return max(kv_len, -(-dispatch.DECODE_ROUTE_MIN_BATCH_KEYS[most] // batch))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: B sequences of T query tokens over S keys, N query heads over K KV heads.
    kv_lens / q_lens: per-sequence lengths, or None; nan: NaN in K and V past the key lengths;
    sinks: one logit per query head."""

    q_len: int
    kv_len: int
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "bf16"
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    soft_cap: float | None = None
    sinks: bool = False
    kv_lens: tuple[int, ...] | None = None
    q_lens: tuple[int, ...] | None = None
    nan: bool = False

    @property
    def batch(self) -> int:
        lens = self.kv_lens or self.q_lens
        return 2 if lens is None else len(lens)

    def __str__(self):
        parts = [
            f"T{self.q_len}S{self.kv_len}N{self.num_heads}K{self.num_kv_heads}H{self.head_dim}",
            self.dtype,
        ]
        parts += ["causal"] * self.is_causal
        if self.window is not None:
            parts.append(f"win{self.window}".replace(" ", ""))
        parts += [f"cap{self.soft_cap}"] * (self.soft_cap is not None)
        parts += ["sinks"] * self.sinks
        if self.kv_lens is not None:
            parts.append("kv" + "-".join(map(str, self.kv_lens)))
        if self.q_lens is not None:
            parts.append("q" + "-".join(map(str, self.q_lens)))
        parts += ["nan"] * self.nan
        return "-".join(parts)


# The first CI_CASES run in CI on the CPU (`ci_slice`); together they cover every option. All of
# them compiled for the GPU, and with PALLAS_FLASH_SWEEP in the interpreter.
CASES = [
    # One token, GQA 8, every key below the length; an empty sequence; NaN past the lengths.
    Case(1, 257, num_heads=8, num_kv_heads=1, kv_lens=(257, 0, 100), nan=True),
    # Top-left causal: token t sees keys j <= t (and below the length: 2 < T for the second);
    # sinks, and a row past its query length.
    Case(3, 100, is_causal=True, sinks=True, kv_lens=(100, 2), q_lens=(3, 2), nan=True),
    # A window on both sides of non-causal rows (keys past the last token's right side cut
    # off), a soft cap, MHA, 16 tokens, an odd head dim, float16.
    Case(
        16,
        1000,
        num_heads=4,
        num_kv_heads=4,
        head_dim=40,
        dtype="f16",
        window=(5, 3),
        soft_cap=4.0,
    ),
    # Sinks with rows that see no key (key length 0, query length 1), a causal window, float16.
    Case(
        3,
        257,
        dtype="f16",
        is_causal=True,
        window=1,
        sinks=True,
        kv_lens=(0, 200),
        q_lens=(3, 1),
    ),
    # 16 tokens of GQA 8 (128 packed rows), causal, sinks and a soft cap.
    Case(16, 100, num_heads=16, num_kv_heads=2, is_causal=True, sinks=True, soft_cap=3.0),
    # Keys past the last token's right side are cut off (non-causal window right=40).
    Case(1, 1000, num_heads=4, num_kv_heads=1, window=(0, 40), kv_lens=(30, 1000), nan=True),
    Case(3, 1000, window=0, sinks=True),
    Case(16, 257, num_heads=8, num_kv_heads=1, q_lens=(16, 0), kv_lens=(257, 1), nan=True),
    Case(1, 100, num_heads=4, num_kv_heads=4, head_dim=80, soft_cap=2.0, sinks=True),
]
CI_CASES = 3
# The CPU's CI checks the gradients of this case only (the backward is the flash backward, fed
# the decode kernel's out, lse and log_sum, which every case checks); the others' run compiled
# and with PALLAS_FLASH_SWEEP.
CI_GRADIENTS = {str(CASES[1])}
# The cases compiled for the GPU: their keys as many as the dispatch routes there (the
# lengths, windows and masks are the interpreter's).
GPU_CASES = [
    dataclasses.replace(c, kv_len=routed_kv_len(c.batch, c.q_len, c.kv_len)) for c in CASES
]
PARAMS = [pytest.param(c, "interpret", id=f"{c}-interpret") for c in CASES] + [
    pytest.param(c, "gpu", id=f"{c}-gpu", marks=pytest.mark.gpu) for c in GPU_CASES
]


def make_inputs(c: Case, seed: int = 0):
    """(arrays for the call, float64 copies for the oracle): q, k, v, d_out, d_lse, sinks and
    the lengths. With c.nan, K and V hold NaN past each key length (the oracle's copies 0)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[c.dtype]
    b, t, s, n, kh, h = c.batch, c.q_len, c.kv_len, c.num_heads, c.num_kv_heads, c.head_dim
    pairs = {
        "q": rounded(rng, (b, t, n, h), dtype),
        "k": rounded(rng, (b, s, kh, h), dtype),
        "v": rounded(rng, (b, s, kh, h), dtype),
        "d_out": rounded(rng, (b, t, n, h), dtype),
        "d_lse": rounded(rng, (b, n, t), jnp.float32),
        "sinks": rounded(rng, (n,), jnp.float32, 2.0) if c.sinks else (None, None),
    }
    xs = {name: pair[0] for name, pair in pairs.items()}
    x64 = {name: pair[1] for name, pair in pairs.items()}
    for name, lens in (("kv_lens", c.kv_lens), ("q_lens", c.q_lens)):
        x64[name] = None if lens is None else np.asarray(lens, np.int32)
        xs[name] = None if lens is None else jnp.asarray(lens, jnp.int32)
    if c.nan:
        past = np.arange(s)[None, :, None, None] >= np.asarray(c.kv_lens)[:, None, None, None]
        for name in ("k", "v"):
            xs[name] = jnp.where(past, jnp.nan, xs[name]).astype(dtype)
            x64[name] = np.where(past, 0.0, x64[name])
    # Rows that see no key have the constant lse -inf (or the sink): no cotangent there.
    empty = ~visibility(c, x64).any(axis=-1)
    x64["d_lse"] = np.where(empty, 0.0, x64["d_lse"])
    xs["d_lse"] = jnp.asarray(x64["d_lse"], jnp.float32)
    return xs, x64


def visibility(c: Case, x64) -> np.ndarray:
    """[B, N, T, S] bool: jax.nn's top-left geometry, the window, and both lengths."""
    b, t, s, n = c.batch, c.q_len, c.kv_len, c.num_heads
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if c.is_causal:
        vis &= j <= i
    if c.window is not None:
        left, right = (c.window, c.window) if isinstance(c.window, int) else c.window
        vis &= (i - left <= j) & (j <= i + right)
    vis = np.broadcast_to(vis, (b, n, t, s)).copy()
    if x64["q_lens"] is not None:
        vis &= (np.arange(t)[None, :] < x64["q_lens"][:, None])[:, None, :, None]
    if x64["kv_lens"] is not None:
        vis &= (np.arange(s)[None, :] < x64["kv_lens"][:, None])[:, None, None, :]
    return vis


def oracle(c: Case, x64) -> dict:
    """out, lse, dq, dk, dv (dsinks) in float64, and log_sum: lse less the row's largest
    visible logit (or its sink, where larger; 0 for rows with neither)."""
    visible = visibility(c, x64)
    scale = 1.0 / math.sqrt(c.head_dim)
    r = attention_oracle_f64(
        *(x64[name] for name in ("q", "k", "v", "d_out", "d_lse")),
        scale=scale,
        visible=visible,
        soft_cap=c.soft_cap,
        sinks=x64["sinks"],
    )
    r.pop("dlogits")
    k = np.repeat(x64["k"], c.num_heads // c.num_kv_heads, axis=2)
    logits = scale * np.einsum("btnh,bsnh->bnts", x64["q"], k)
    if c.soft_cap is not None:
        logits = c.soft_cap * np.tanh(logits / c.soft_cap)
    top = np.max(np.where(visible, logits, -np.inf), axis=-1)
    if c.sinks:
        top = np.maximum(top, x64["sinks"][None, :, None])
    seen = np.isfinite(top)
    r["log_sum"] = np.where(seen, r["lse"] - np.where(seen, top, 0.0), 0.0)
    return r


def run(c: Case, xs, *, grads: bool = True, **kwargs) -> tuple[dict, set[str]]:
    """(out, lse, log_sum, and with grads dq, dk, dv (and dsinks)) of one jitted call and its
    VJP; the names of the pallas_calls in its traced program."""
    traced, args = trace(c, xs, grads=grads, **kwargs)
    return traced.lower().compile()(*args), pallas_call_names(traced)


def pallas_call_names(traced) -> set[str]:
    return set(re.findall(r"pallas_flash_\w+", str(traced.jaxpr)))


def trace(c: Case, xs, *, grads: bool = True, **kwargs):
    """The jitted call (and its VJP with grads) traced, and its arguments."""

    def f(q, k, v, sinks, d_out, d_lse):
        def call(q, k, v, sinks):
            return pallas_flash.flash_attention(
                q,
                k,
                v,
                is_causal=c.is_causal,
                local_window_size=c.window,
                logits_soft_cap=c.soft_cap,
                query_seq_lengths=xs["q_lens"],
                key_value_seq_lengths=xs["kv_lens"],
                sinks=sinks,
                return_residuals=True,
                return_log_sum=True,
                **kwargs,
            )

        if not grads:
            return dict(zip(("out", "lse", "log_sum"), call(q, k, v, sinks), strict=True))
        (out, lse, log_sum), vjp = jax.vjp(call, q, k, v, sinks)
        dq, dk, dv, dsinks = vjp((d_out, d_lse, jnp.zeros_like(log_sum)))
        results = dict(out=out, lse=lse, log_sum=log_sum, dq=dq, dk=dk, dv=dv)
        return results if sinks is None else results | {"dsinks": dsinks}

    args = [xs[name] for name in ("q", "k", "v", "sinks", "d_out", "d_lse")]
    return jax.jit(f).trace(*args), args


def plain_in_dtype(c: Case, x64) -> dict:
    """The tolerance rule's baseline: plain attention with every step in the input dtype (the
    sinks a column of the softmax with no value), on the oracle's copies of the inputs (no NaN),
    and its gradients by jax's autodiff."""
    dtype = DTYPES[c.dtype]
    visible = jnp.asarray(visibility(c, x64))
    group = c.num_heads // c.num_kv_heads

    def attend(q, k, v, sinks):
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(c.head_dim**-0.5, dtype)
        if c.soft_cap is not None:
            logits = c.soft_cap * jnp.tanh(logits / c.soft_cap)
        logits, vis = jnp.where(visible, logits, -jnp.inf), visible
        if sinks is not None:
            column = jnp.broadcast_to(sinks.astype(dtype)[None, :, None, None], (*vis.shape[:3], 1))
            logits = jnp.concatenate([logits, column], axis=-1)
            vis = jnp.concatenate([vis, jnp.ones_like(vis[..., :1])], axis=-1)
        row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        unnormalised = jnp.where(vis, jnp.exp(logits - row_max), 0.0)
        row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
        empty = row_sum == 0.0
        probs = unnormalised / jnp.where(empty, 1.0, row_sum)
        out = jnp.einsum("bnts,bsnh->btnh", probs[..., : c.kv_len], v)
        lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
        return out, lse[..., 0].astype(jnp.float32)

    def cast(name, to=dtype):
        return None if x64[name] is None else jnp.asarray(x64[name], to)

    args = (cast("q"), cast("k"), cast("v"), cast("sinks", jnp.float32))
    (out, lse), vjp = jax.vjp(attend, *args)
    dq, dk, dv, dsinks = vjp((cast("d_out"), cast("d_lse", jnp.float32)))
    results = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    return results | {"dsinks": dsinks} if c.sinks else results


def violations(c: Case, results, baselines, oracles) -> list[str]:
    """Outputs beyond 2 x (the baseline's error) + floor, non-finite where the oracle is
    finite, or whose infinite entries (lse of rows that see no key) differ from the oracle's."""
    msgs = []
    for name, want in oracles.items():
        got, base = to64(results[name]), to64(baselines[name])
        assert got.shape == want.shape, (name, got.shape, want.shape)
        finite = np.isfinite(want)
        if not np.array_equal(got[~finite], want[~finite]):
            msgs.append(f"{name}: non-finite entries differ from the oracle's")
        if not np.isfinite(got[finite]).all():
            msgs.append(f"{name}: non-finite values where the oracle is finite")
            continue
        err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
        base_err = float(np.max(np.abs(base[finite] - want[finite]), initial=0.0))
        magnitude = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
        allowed = 2 * base_err + FLOOR * magnitude
        if not err <= allowed:
            msgs.append(f"{name}: error {err:.3g} > allowed {allowed:.3g} (plain {base_err:.3g})")
    return msgs


@pytest.mark.parametrize(("c", "mode"), PARAMS)
@pytest.mark.ci_slice(CI_CASES)
def test_routed_call_matches_float64(c, mode):
    xs, x64 = make_inputs(c)
    grads = mode == "gpu" or SWEEP or str(c) in CI_GRADIENTS
    results, names = run(c, xs, grads=grads, **mode_kwargs(mode))
    assert "pallas_flash_decode" in names, names
    assert "pallas_flash_forward" not in names, names
    if mode == "interpret":  # the GPU's backward is the dispatch's, pinned in test_dispatch.py
        assert ("pallas_flash_backward_dkv" in names) == grads, names
    oracles = {name: x for name, x in oracle(c, x64).items() if name in results}
    # log_sum (return_log_sum): the row's log denominator relative to its max, in float32 from
    # the same logits.
    np.testing.assert_allclose(to64(results["log_sum"]), oracles.pop("log_sum"), atol=1e-4)
    found = violations(c, results, plain_in_dtype(c, x64), oracles)
    assert not found, f"{c}: " + "; ".join(found)
    # Rows that see no key: exact zeros.
    empty = ~visibility(c, x64).any(axis=-1)  # [B, N, T]
    out = to64(results["out"]).transpose(0, 2, 1, 3)  # [B, N, T, H]
    assert np.all(out[empty] == 0)
    assert np.all(to64(results["log_sum"])[empty] == 0)


def tied_huge_logits(mode: str):
    """test_tied_huge_logits' call in `mode` (its vjp jitted), its arguments and cotangents: 3
    tokens over 80 keys in the interpreter, over as many as the dispatch routes compiled."""
    kv_len = 80 if mode == "interpret" else routed_kv_len(1, 3, 80)
    rng = np.random.default_rng(2)
    q, d_out = (rounded(rng, (1, 3, 2, 16), jnp.bfloat16)[0] for _ in range(2))
    k, v = (rounded(rng, (1, kv_len, 2, 16), jnp.bfloat16)[0] for _ in range(2))
    q = q * jnp.asarray([1e7, 1e30], jnp.bfloat16)[:, None]
    k = jnp.concatenate([k[:, : kv_len // 2]] * 2, axis=1)
    d_lse = rounded(rng, (1, 2, 3), jnp.float32)[0]

    def f(q, k, v):
        def attention(q, k, v):
            return pallas_flash.flash_attention(
                q, k, v, scale=0.25, return_residuals=True, **mode_kwargs(mode)
            )

        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return out, lse, *vjp((d_out, d_lse))

    return jax.jit(f), (q, k, v), (d_out, d_lse)


@pytest.mark.parametrize(
    "mode",
    [pytest.param("interpret", marks=SWEEP_ONLY), pytest.param("gpu", marks=pytest.mark.gpu)],
)
def test_tied_huge_logits(mode):
    """Logits of |s| ~ 1e7 (head 0) and 1e30 (head 1), every key present twice: each row splits
    between the two keys of its largest logit, as in float64, through the decode kernel's split
    key loop and merge (weighed by each part's log_sum, not by lse alone) and the backward's P
    recomputed from log_sum (test_nan_safety.py's check, for 3 tokens over a longer key
    sequence)."""
    f, (q, k, v), (d_out, d_lse) = tied_huge_logits(mode)
    traced = f.trace(q, k, v)
    assert "pallas_flash_decode" in str(traced.jaxpr)
    got = [to64(x) for x in traced.lower().compile()(q, k, v)]
    want = attention_oracle_f64(
        *(to64(x) for x in (q, k, v, d_out, d_lse)),
        scale=0.25,
        visible=np.ones((q.shape[1], k.shape[1]), bool),
    )
    np.testing.assert_allclose(got[0], want["out"], atol=2e-2)
    np.testing.assert_allclose(got[1], want["lse"], rtol=1e-6)
    for name, grad in zip(("dq", "dk", "dv"), got[2:]):
        for head in range(2):  # each head against its own magnitude
            scale = np.abs(want[name][:, :, head]).max()
            err = np.abs(grad[:, :, head] - want[name][:, :, head]).max()
            assert err <= 2e-2 * scale, (name, head, err, scale)


def test_vmapped_routed_call_matches_the_batch():
    """jax.vmap over a leading axis gives the batched call's values (the forward: the
    backward is the flash backward's, whose vmap other tests cover)."""
    c = Case(3, 100, is_causal=True, kv_lens=(100, 7))
    xs, _ = make_inputs(c)

    def call(q, k, v, lens):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=lens, interpret=True
        )

    args = [xs["q"], xs["k"], xs["v"], xs["kv_lens"]]
    mapped = jax.jit(jax.vmap(call))(*(x[:, None] for x in args))
    np.testing.assert_array_equal(to64(mapped[:, 0]), to64(jax.jit(call)(*args)))


def test_the_route_is_the_dispatchs():
    """The calls of this file take the decode kernel by the dispatch's rule (so that the
    constants cannot move past the tested sizes unnoticed)."""
    assert dispatch.DECODE_ROUTE_MAX_Q_LEN >= max(c.q_len for c in CASES)
    assert dispatch.DECODE_ROUTE_MIN_KV_LEN <= min(c.kv_len for c in CASES)


def test_the_gpu_cases_take_the_route():
    """The GPU variants' calls, traced here for an H100, run their forward on the decode kernel
    (the GPU tests assert it too; this fails on the CPU should the dispatch's compiled
    thresholds move past their shapes)."""
    with pallas_flash.target(H100):
        for c in GPU_CASES:
            names = pallas_call_names(trace(c, make_inputs(c)[0], grads=False)[0])
            assert "pallas_flash_decode" in names and "pallas_flash_forward" not in names, c
        f, args, _ = tied_huge_logits("gpu")
        assert "pallas_flash_decode" in str(f.trace(*args).jaxpr)
