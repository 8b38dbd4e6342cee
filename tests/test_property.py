"""Property sweep: generated calls of `flash_attention` against the float64 oracle.

Hypothesis draws the configuration: shapes with odd sizes and T != S, batch 1-2, head dims 16 to
128, float32/bfloat16/float16, MHA/GQA/MQA, every mask argument and their combinations (causal,
windows, sequence lengths, segment ids sorted or not, a dense bool mask, a bias of every
broadcast shape and rank), soft caps, explicit scales, attention sinks (some at -inf) and
extreme values. Every output is checked: out, lse and the gradients of q, k, v, the bias and the
sinks for random cotangents of both outputs.

Tolerance (FlashAttention's rule): the error against the float64 oracle is at most twice that of
a plain attention computed in the input dtype (capped, so that a poor baseline cannot loosen the
bar without limit), plus a floor, both relative to the output's magnitude; non-finite values only
where the oracle has them (the -inf lse of rows that see no key).

Paths: the backend matrix (support.backends.backend_paths): backend="xla" and the Triton kernels
in the Pallas interpreter on CPU; on the GPU (the `gpu` marker) the compiled Triton kernels and
backend=None. The Mosaic GPU kernels (backend="mosaic": jax's Mosaic GPU interpreter on CPU, the
compiled kernels on Hopper) get their own sweep (`test_property_sweep_mosaic`) over the calls
they take, drawn from a fixed pool of static configurations with drawn data, so that a long
GPU run compiles each pool entry once. CI runs a fixed-seed slice;
PALLAS_FLASH_SWEEP=N runs N examples per path with fresh seeds; with PALLAS_FLASH_SWEEP_LOG=path
each example appends one JSON line (configuration, path, violations) there instead of failing, so
that a long sweep counts every failure; PALLAS_FLASH_SWEEP_SHARD=i/n splits the Mosaic sweep's
pool between n processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from support.backends import BACKEND_PATHS, backend_paths
from support.calls import MASK_ARGUMENTS, MASKED_OUTPUT_NAMES, masked_outputs_and_grads
from support.inputs import BLOCKS, rounded  # small tiles
from support.oracle import as4d, attention_oracle_f64, sum_to_shape, to64, visibility

import pallas_flash

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Added to 2 x (plain attention error), times max(1, largest |oracle|).
FLOOR = {"f32": 1e-5, "bf16": 1e-3, "f16": 1e-3}
# The baseline term counts at most this much (times the magnitude).
BASELINE_CAP = {"f32": 1e-4, "bf16": 5e-2, "f16": 1e-2}


SWEEP = int(os.environ.get("PALLAS_FLASH_SWEEP", "0"))
SWEEP_LOG = os.environ.get("PALLAS_FLASH_SWEEP_LOG")
# Examples per path: the fixed-seed CI slice, the GPU suite's default, or PALLAS_FLASH_SWEEP. The
# Mosaic sweep's: none in the interpreter in CI (the NaN-safety and Mosaic tests cover the
# kernels there), 24 on the GPU (each new pool entry compiles three kernels).
CI_EXAMPLES = {"xla": 3, "triton-interpret": 2, "mosaic-interpret": 1, "mosaic": 24}
GPU_EXAMPLES = 100


# Extreme values. Each kind changes the inputs of an otherwise ordinary configuration:
#   "none": standard normal q, k, v (and bias);
#   "large-logits": q and k scaled up, logits of a few hundred to a few thousand;
#   "neg-inf-bias": -inf bias entries, some on whole rows (which then see no key);
#   "large-negative-bias-entries": scattered finite bias entries of -1e3 to -1e30;
#   "large-negative-bias-rows": whole query rows with one finite bias of -1e20 to -1e30 (their
#     softmax is that of equal logits, as XLA computes it, not an empty row);
#   "finfo-min-bias-rows": whole query rows at the bias dtype's finfo.min;
#   "huge-logits": q and k around 1e4: |logits| near 1e9;
#   "nan-hidden-keys": NaN in V and inf in K at keys that no query row of their head group sees
#     (past the key length, hidden by the mask, segments, windows or causality).
EXTREMES = (
    "none",
    "large-logits",
    "neg-inf-bias",
    "large-negative-bias-entries",
    "large-negative-bias-rows",
    "finfo-min-bias-rows",
    "huge-logits",
    "nan-hidden-keys",
)


# -1e3 leaves the logit's own value visible in float32 (to 6e-5; at -1e4 the rounding alone
# exceeds the float32 tolerance); from -1e20 the logit is lost in float64 as in float32, so the
# oracle and a float32 softmax agree (between, e.g. at -1e10, float32 rounds the logits away and
# float64 does not: no float32 computation can match the oracle there).
LARGE_NEGATIVE_BIAS = np.array([-1e3, -1e20, -1e25, -1e30])


@dataclasses.dataclass(frozen=True)
class Config:
    """One call. `bias`/`mask`: shape codes right-aligned on (B, N, T, S), a letter the full dim,
    "1" a broadcast dim ("" a scalar bias); `segments`: None, "q" (query ids only, T == S) or
    "qkv"; `block`: a key of BLOCKS or None (the defaults) on the kernel paths."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    soft_cap: float | None = None
    scale: float | None = None
    bias: str | None = None
    bias_dtype: str | None = None
    mask: str | None = None
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: str | None = None
    num_segments: int = 2
    sorted_segments: bool = True
    extreme: str = "none"
    block: str | None = None
    sinks: bool = False

    def dims(self, code: str) -> tuple[int, ...]:
        full = {"b": self.batch, "n": self.num_heads, "t": self.q_len, "s": self.kv_len, "1": 1}
        return tuple(full[c] for c in code)


def shape_code(draw, min_rank: int) -> str:
    rank = draw(st.integers(min_rank, 4))
    return "".join(draw(st.sampled_from([c, "1"])) for c in "bnts"[4 - rank :])


@st.composite
def configs(draw, extremes=EXTREMES):
    """Configurations; `extremes`: the kinds of extreme values to draw from."""
    num_kv_heads, group = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (1, 3)]))
    q_len = draw(st.integers(1, 80))
    kv_len = draw(st.one_of(st.just(q_len), st.integers(1, 80)))
    extreme = draw(st.sampled_from(extremes))
    needs_bias = extreme in (
        "neg-inf-bias",
        "large-negative-bias-entries",
        "large-negative-bias-rows",
        "finfo-min-bias-rows",
    )
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    bias = shape_code(draw, 0) if draw(st.booleans()) else None
    if needs_bias:
        # A bias with its own rows: the query axis full.
        bias = draw(st.sampled_from(["ts", "t1", "bnts", "1nts", "b1ts"]))
    return Config(
        batch=draw(st.integers(1, 2)),
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(range(16, 129, 8))),
        dtype=dtype,
        is_causal=draw(st.booleans()),
        window=draw(
            st.one_of(
                st.none(), st.integers(0, 24), st.tuples(st.integers(0, 24), st.integers(0, 24))
            )
        ),
        soft_cap=draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0, 30.0]))),
        scale=draw(st.one_of(st.none(), st.sampled_from([0.05, 0.3, 1.0]))),
        bias=bias,
        bias_dtype=None if bias is None else draw(st.sampled_from([dtype, "f32"])),
        mask=shape_code(draw, 2) if draw(st.booleans()) else None,
        q_lengths=draw(st.booleans()),
        kv_lengths=draw(st.booleans()) or extreme == "nan-hidden-keys",
        segments=draw(st.sampled_from([None, "qkv"] + ["q"] * (q_len == kv_len))),
        num_segments=draw(st.integers(1, 4)),
        sorted_segments=draw(st.booleans()),
        extreme=extreme,
        block=draw(st.one_of(st.none(), st.sampled_from(sorted(BLOCKS)))),
        # Drawn last: the draws before it, and so the examples without sinks, stay as they were.
        sinks=draw(st.booleans()),
    )


# -- inputs ---------------------------------------------------------------------------------------


def make_inputs(c: Config, seed: int):
    """(arrays of the call, float64 copies for the oracle), both dicts: q, k, v, bias, d_out,
    d_lse, and the mask arguments (None where absent). The float64 k and v hold zeros where the
    call's hold NaN or inf ("nan-hidden-keys"): values a row cannot see do not change it."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[c.dtype]
    b, t, s, n, kh, h = c.batch, c.q_len, c.kv_len, c.num_heads, c.num_kv_heads, c.head_dim
    qk_scale = {"large-logits": 6.0, "huge-logits": 1e4}.get(c.extreme, 1.0)
    pairs = {
        "q": rounded(rng, (b, t, n, h), dtype, qk_scale),
        "k": rounded(rng, (b, s, kh, h), dtype, qk_scale),
        "v": rounded(rng, (b, s, kh, h), dtype),
        "d_out": rounded(rng, (b, t, n, h), dtype),
        "d_lse": rounded(rng, (b, n, t), jnp.float32),
    }
    xs = {name: pair[0] for name, pair in pairs.items()}
    x64 = {name: pair[1] for name, pair in pairs.items()}

    extra = dict(mask=None, q_lens=None, kv_lens=None, q_seg=None, kv_seg=None)
    if c.mask is not None:
        shape = c.dims(c.mask)
        mask = rng.random(shape) < rng.choice([0.3, 0.7, 0.95])
        if len(shape) >= 2 and shape[-2] > 1:
            mask[..., rng.random(shape[-2]) < 0.1, :] = False  # rows that see no key
        extra["mask"] = mask
    if c.q_lengths:
        extra["q_lens"] = rng.integers(0, t + 1, size=b).astype(np.int32)
    if c.kv_lengths:
        extra["kv_lens"] = rng.integers(0, s + 1, size=b).astype(np.int32)
    if c.segments is not None:
        q_seg = rng.integers(0, c.num_segments, size=(b, t))
        kv_seg = rng.integers(0, c.num_segments, size=(b, s))
        if c.sorted_segments:
            q_seg, kv_seg = np.sort(q_seg, axis=1), np.sort(kv_seg, axis=1)
        extra["q_seg"] = q_seg.astype(np.int32)
        if c.segments == "qkv":
            extra["kv_seg"] = kv_seg.astype(np.int32)
    vis = visibility(c, extra)

    xs["bias"] = x64["bias"] = None
    if c.bias is not None:
        shape = c.dims(c.bias)
        bias = rng.standard_normal(shape) * rng.choice([1.0, 3.0])
        rows = rng.random(shape[-2] if len(shape) >= 2 else 1) < 0.3
        if c.extreme == "neg-inf-bias":
            bias = np.where(rng.random(shape) < 0.3, -np.inf, bias)
            bias[..., rows, :] = -np.inf
        elif c.extreme == "large-negative-bias-entries":
            big = rng.choice(LARGE_NEGATIVE_BIAS, size=shape)
            bias = np.where(rng.random(shape) < 0.3, big, bias)
        elif c.extreme == "large-negative-bias-rows":
            bias[..., rows, :] = rng.choice(LARGE_NEGATIVE_BIAS[1:])
        elif c.extreme == "finfo-min-bias-rows":
            bias[..., rows, :] = float(jnp.finfo(DTYPES[c.bias_dtype]).min)
        finfo = jnp.finfo(DTYPES[c.bias_dtype])
        bias = np.where(np.isfinite(bias), np.clip(bias, float(finfo.min), float(finfo.max)), bias)
        xs["bias"] = jnp.asarray(bias, DTYPES[c.bias_dtype])
        x64["bias"] = np.asarray(xs["bias"].astype(jnp.float32), np.float64)

    if c.extreme == "nan-hidden-keys":
        hidden = hidden_keys(c, vis)  # [B, S, K]
        k, v = np.asarray(xs["k"]).copy(), np.asarray(xs["v"]).copy()
        k[hidden] = np.inf
        v[hidden] = np.nan
        xs["k"], xs["v"] = jnp.asarray(k), jnp.asarray(v)
        x64["k"] = np.where(hidden[..., None], 0.0, x64["k"])
        x64["v"] = np.where(hidden[..., None], 0.0, x64["v"])

    x64.update(extra)
    xs.update({name: None if a is None else jnp.asarray(a) for name, a in extra.items()})
    xs["sinks"] = x64["sinks"] = None
    if c.sinks:  # drawn last, so that the other arrays of a seed stay as they were
        sinks = rng.standard_normal(n) * rng.choice([1.0, 4.0])
        sinks = np.where(rng.random(n) < 0.2, -np.inf, sinks).astype(np.float32)
        xs["sinks"], x64["sinks"] = jnp.asarray(sinks), np.asarray(sinks, np.float64)
    return xs, x64, vis


def hidden_keys(c: Config, vis) -> np.ndarray:
    """[B, S, K] bool: keys that no query row of the kv head's group sees."""
    group = c.num_heads // c.num_kv_heads
    seen = vis.reshape(c.batch, c.num_kv_heads, group, c.q_len, c.kv_len).any(axis=(2, 3))
    return ~np.swapaxes(seen, 1, 2)


def scale_of(c: Config) -> float:
    return 1.0 / math.sqrt(c.head_dim) if c.scale is None else c.scale


def oracle(c: Config, x64, vis):
    """The float64 out, lse, dq, dk, dv, dbias."""
    bias = None if x64["bias"] is None else as4d(x64["bias"])
    with np.errstate(over="ignore", invalid="ignore"):
        r = attention_oracle_f64(
            *(x64[name] for name in ("q", "k", "v", "d_out", "d_lse")),
            scale=scale_of(c),
            visible=vis,
            bias=bias,
            soft_cap=c.soft_cap,
            sinks=x64["sinks"],
        )
    dlogits = r.pop("dlogits")
    r["dbias"] = None if bias is None else sum_to_shape(dlogits, x64["bias"].shape)
    return r


# -- the paths and the baseline -------------------------------------------------------------------


def run_path(c: Config, xs, path):
    """out, lse, dq, dk, dv, dbias of one jitted flash_attention call and its VJP on `path` (a
    support.backends.BackendPath; the case's tiles where it takes them)."""
    kwargs = path.call_kwargs(None if c.block is None else BLOCKS[c.block])
    return masked_outputs_and_grads(
        pallas_flash.flash_attention,
        xs,
        scale=c.scale,
        is_causal=c.is_causal,
        local_window_size=c.window,
        logits_soft_cap=c.soft_cap,
        **kwargs,
    )


def plain_in_dtype(c: Config, x64, vis):
    """The baseline: out, lse, dq, dk, dv, dbias of attention computed as plain XLA computes it
    in the input dtype, every intermediate (logits, softmax, products, and the backward's) rounded
    to that dtype, from the oracle's inputs. The float64 oracle's formulas, rounded at each step,
    with the matmuls and row sums accumulated in float32 as XLA's are (a float64 accumulation
    would model a float32 attention more exact than any: with logits in the hundreds, q.k of
    ~1e3 carries several float32 ulps, which moves every P of the row and every gradient with
    it). numpy (but the soft cap's tanh: XLA's), so that the baseline costs little compilation."""
    dtype = DTYPES[c.dtype]

    def r(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(np.asarray(x, np.float32).astype(dtype), np.float64)

    def matmul(spec, *operands):
        """np.einsum accumulated in float32, its result rounded to the dtype."""
        return r(np.einsum(spec, *(np.asarray(x, np.float32) for x in operands)))

    q, k, v, d_out = (r(x64[name]) for name in ("q", "k", "v", "d_out"))
    d_lse = r(x64["d_lse"])
    group = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        logits = r(matmul("btnh,bsnh->bnts", q, k) * r(scale_of(c)))
        bias = None if x64["bias"] is None else r(as4d(x64["bias"]))
        if bias is not None:
            logits = r(logits + bias)
        d_cap = 1.0
        if c.soft_cap is not None:
            # XLA's float32 tanh (a few ulps), as plain attention computes it: 1 - tanh^2
            # amplifies its error where logits saturate the cap.
            tanh = r(jnp.tanh(jnp.asarray(r(logits / c.soft_cap), dtype)))
            logits, d_cap = r(c.soft_cap * tanh), r(1.0 - r(tanh * tanh))
        row_max = np.max(np.where(vis, logits, -np.inf), axis=-1, keepdims=True)
        sinks = None if x64["sinks"] is None else r(x64["sinks"])[None, :, None, None]
        if sinks is not None:
            row_max = np.maximum(row_max, sinks)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        p = np.where(vis, r(np.exp(r(logits - row_max))), 0.0)
        row_sum = r(np.asarray(p, np.float32).sum(axis=-1, keepdims=True))
        if sinks is not None:
            sink_term = r(np.exp(r(sinks - row_max)))
            row_sum = r(row_sum + sink_term)
        empty = row_sum == 0
        row_sum = np.where(empty, 1.0, row_sum)
        probs = r(p / row_sum)
        out = matmul("bnts,bsnh->btnh", probs, v)
        lse = np.where(empty, -np.inf, r(row_max + r(np.log(row_sum))))[..., 0]
        d_probs = matmul("btnh,bsnh->bnts", d_out, v)
        delta = matmul("btnh,btnh->bnt", d_out, out)
        d_logits = r(probs * r(d_probs - delta[..., None] + d_lse[..., None]))
        d_logits = r(d_logits * d_cap)
        d_logits = np.where(vis, d_logits, 0.0)

        def group_sum(x):
            b, s, n, h = x.shape
            return r(x.reshape(b, s, c.num_kv_heads, group, h).sum(axis=3))

        scale = r(scale_of(c))
        dq = r(matmul("bnts,bsnh->btnh", d_logits, k) * scale)
        dk = group_sum(r(matmul("bnts,btnh->bsnh", d_logits, q) * scale))
        dv = group_sum(matmul("bnts,btnh->bsnh", probs, d_out))
        dsinks = None
        if sinks is not None:
            # A row that sees no key: lse is its sink, also at -inf (`support.oracle._oracle`).
            no_key = ~np.any(vis & (logits > -np.inf), axis=-1)
            p_sink = np.where(no_key, 1.0, r(sink_term / row_sum)[..., 0])
            dsinks = r(np.sum(np.asarray(r(p_sink * r(d_lse - delta)), np.float32), axis=(0, 2)))
    dbias = None
    if bias is not None:
        dbias = sum_to_shape(d_logits, x64["bias"].shape)
        dbias = np.asarray(dbias.astype(np.float32).astype(DTYPES[c.bias_dtype]), np.float64)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias, dsinks=dsinks)


def violations(c: Config, results, baselines, oracles, names=MASKED_OUTPUT_NAMES) -> list[str]:
    """Messages for outputs beyond 2 x (plain error, capped) + floor, relative to the magnitude;
    non-finite values where the oracle is finite (but for overflow: an inf of the oracle's sign
    where the oracle, give or take the allowed error, rounds to inf in the output's dtype);
    -inf entries that differ from the oracle's."""
    msgs = []
    for name in names:
        want, got = oracles[name], results[name]
        if want is None:
            if got is not None:
                msgs.append(f"{name}: expected None")
            continue
        if got.shape != want.shape:
            msgs.append(f"{name}: shape {got.shape} != {want.shape}")
            continue
        edge = overflow_edge(got.dtype)
        got, base = to64(got), np.asarray(baselines[name], np.float64)
        finite = np.isfinite(want)
        if not np.array_equal(got[~finite], want[~finite]):
            msgs.append(f"{name}: non-finite entries differ from the oracle's")
        magnitude = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
        with np.errstate(invalid="ignore"):
            base_err = float(np.nanmax(np.abs(base[finite] - want[finite]), initial=0.0))
        if not np.isfinite(base[finite]).all():
            base_err = math.inf
        cap = BASELINE_CAP[c.dtype] * magnitude
        allowed = 2 * min(base_err, cap) + FLOOR[c.dtype] * magnitude
        # float16 gradients of logits ~1e9 reach 1e5: their float64 values are finite, their
        # float16 ones inf, of the same sign.
        overflowed = (
            finite
            & np.isinf(got)
            & (np.sign(got) == np.sign(want))
            & (np.abs(want) + allowed >= edge)
        )
        checked = finite & ~overflowed
        if not np.isfinite(got[checked]).all():
            msgs.append(f"{name}: {int((~np.isfinite(got[checked])).sum())} non-finite values")
            continue
        err = float(np.max(np.abs(got[checked] - want[checked]), initial=0.0))
        if not err <= allowed:
            msgs.append(
                f"{name}: error {err:.3g} > {allowed:.3g} (plain {c.dtype} error {base_err:.3g}, "
                f"magnitude {magnitude:.3g})"
            )
    return msgs


def overflow_edge(dtype) -> float:
    """The magnitude from which float64 values round to inf in `dtype`: its largest finite value
    plus half an ulp there."""
    largest = jnp.finfo(dtype).max
    below = jnp.nextafter(jnp.asarray(largest, dtype), jnp.asarray(0, dtype))
    return float(largest) + (float(largest) - float(below)) / 2


def check(c: Config, seed: int, path):
    xs, x64, vis = make_inputs(c, seed)
    try:
        results = run_path(c, xs, path)
        dtypes = {name: results[name].dtype for name in ("out", "lse", "dq", "dk", "dv")}
        want = dict.fromkeys(("out", "dq", "dk", "dv"), DTYPES[c.dtype]) | {"lse": jnp.float32}
        msgs = [
            f"{name}: dtype {dtypes[name]} != {want[name]}"
            for name in want
            if dtypes[name] != want[name]
        ]
        if c.bias is not None and results["dbias"].dtype != xs["bias"].dtype:
            msgs.append(f"dbias: dtype {results['dbias'].dtype} != {xs['bias'].dtype}")
        if c.sinks and results["dsinks"].dtype != xs["sinks"].dtype:
            msgs.append(f"dsinks: dtype {results['dsinks'].dtype} != {xs['sinks'].dtype}")
        names = MASKED_OUTPUT_NAMES + (("dsinks",) if c.sinks else ())
        baselines = plain_in_dtype(c, x64, vis)
        msgs += violations(c, results, baselines, oracle(c, x64, vis), names)
    except Exception as e:
        if not SWEEP_LOG:
            raise
        msgs = [f"raised {type(e).__name__}: {str(e)[:300]}"]
    report(c, seed, path, msgs)


def report(c: Config, seed: int, path, msgs: list[str]):
    """Appends the example to SWEEP_LOG, or fails on its violations."""
    if SWEEP_LOG:
        with open(SWEEP_LOG, "a") as log:
            row = dict(path=path.name, seed=seed, config=dataclasses.asdict(c), violations=msgs)
            log.write(json.dumps(row) + "\n")
        return
    assert not msgs, f"{c} seed={seed} on {path.name}: " + "; ".join(msgs)


def sweep_settings(path, examples: int | None = None):
    if examples is None:
        examples = SWEEP or CI_EXAMPLES.get(path.name, GPU_EXAMPLES)
    return settings(
        max_examples=examples,
        derandomize=not SWEEP,
        deadline=None,
        database=None,
        # No shrinking: a failing example is printed as drawn (its sizes are small already), and
        # a shrink of a compiled call takes minutes.
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )


@pytest.mark.parametrize("path", backend_paths())
def test_property_sweep(path):
    @sweep_settings(path)
    @given(c=configs(), seed=st.integers(0, 2**32 - 1))
    def sweep(c, seed):
        check(c, seed, path)

    sweep()


# -- the Mosaic GPU kernels ------------------------------------------------------------------------

# The extremes a call without a bias can carry.
MOSAIC_EXTREMES = ("none", "large-logits", "huge-logits", "nan-hidden-keys")
# Config fields that shape the compiled program; the rest (extremes, segment layouts, values of
# lengths and ids, seeds) are data.
STATIC_FIELDS = (
    "batch",
    "q_len",
    "kv_len",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "is_causal",
    "window",
    "soft_cap",
    "scale",
    "q_lengths",
    "kv_lengths",
    "segments",
)


def mosaic_static_pool(size: int = 48, seed: int = 0) -> list[dict]:
    """`size` static configurations of calls the Mosaic GPU kernels take (backend="mosaic"):
    16-bit, whole tiles (T a multiple of 128 query rows, S of 128 keys), every head dim they run
    (80, 96 padded to 128), GQA, causal, windows, soft caps, segment ids and lengths, no bias or
    dense mask. A
    fixed pool: a long sweep draws its examples from it and compiles each entry once."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(size):
        num_kv_heads, group = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)][rng.integers(5)]
        q_len = int(rng.choice([128, 256]))
        kv_len = int(rng.choice([128, 256, 384]))
        masked = i % 2  # every other entry: a window, a soft cap, segment ids or lengths
        pool.append(
            dict(
                batch=int(rng.integers(1, 3)),
                q_len=q_len,
                kv_len=kv_len,
                num_heads=num_kv_heads * group,
                num_kv_heads=num_kv_heads,
                head_dim=int([64, 80, 96, 128, 192, 256][i % 6]),
                dtype=["bf16", "f16"][rng.integers(2)],
                is_causal=bool(rng.integers(2)),
                window=(int(rng.integers(0, 200)), int(rng.integers(0, 200)))
                if masked and rng.random() < 0.4
                else None,
                soft_cap=float(rng.choice([5.0, 30.0])) if masked and rng.random() < 0.3 else None,
                scale=[None, 0.05, 0.3][rng.integers(3)],
                q_lengths=bool(masked and rng.random() < 0.3),
                kv_lengths=bool(masked and rng.random() < 0.5),
                segments=(["qkv"] + ["q"] * (q_len == kv_len))[rng.integers(1 + (q_len == kv_len))]
                if masked and rng.random() < 0.5
                else None,
            )
        )
    return pool


# PALLAS_FLASH_SWEEP_SHARD=i/n keeps the pool entries j with j % n == i: n processes (one per GPU)
# share a long sweep, each compiling its own entries only.
_SHARD, _SHARDS = map(int, os.environ.get("PALLAS_FLASH_SWEEP_SHARD", "0/1").split("/"))
MOSAIC_POOL = mosaic_static_pool()[_SHARD::_SHARDS]


@st.composite
def mosaic_configs(draw):
    """Configurations of MOSAIC_POOL with drawn data: the extremes of MOSAIC_EXTREMES (NaN at
    hidden keys brings key lengths: such entries draw another extreme when they have none),
    segment layouts, attention sinks (a second program per pool entry)."""
    static = draw(st.sampled_from(MOSAIC_POOL))
    extremes = MOSAIC_EXTREMES if static["kv_lengths"] else MOSAIC_EXTREMES[:-1]
    return Config(
        **static,
        num_segments=draw(st.integers(1, 3)),
        sorted_segments=draw(st.booleans()),
        extreme=draw(st.sampled_from(extremes)),
        sinks=draw(st.booleans()),
    )


def runs_mosaic_backward(c: Config) -> bool:
    """Whether the interpreted sweep checks the gradients of `c` (backend="mosaic" runs the
    Mosaic backward on every call of the pool): plain causal or full calls, to keep the
    interpreter's time; the masked backward has its own interpreter cases in
    test_mosaic_backward_masks.py."""
    plain = c.window is None and c.soft_cap is None and c.segments is None
    return plain and not (c.q_lengths or c.kv_lengths)


@functools.cache
def mosaic_program(static: tuple, path_name: str, grads: bool):
    """The jitted call of one static configuration on a path: (q, k, v, d_out, d_lse, mask
    arguments and sinks, None or [N]) -> out, lse and, with grads, dq, dk, dv (dbias None) and
    dsinks (None without sinks). Cached, so that examples of one pool entry reuse its compiled
    program (one with sinks, one without)."""
    c = dict(zip(STATIC_FIELDS, static, strict=True))

    def call(q, k, v, extra, sinks):
        return pallas_flash.flash_attention(
            q,
            k,
            v,
            query_seq_lengths=extra["q_lens"],
            key_value_seq_lengths=extra["kv_lens"],
            q_segment_ids=extra["q_seg"],
            kv_segment_ids=extra["kv_seg"],
            return_residuals=True,
            scale=c["scale"],
            is_causal=c["is_causal"],
            local_window_size=c["window"],
            logits_soft_cap=c["soft_cap"],
            sinks=sinks,
            **BACKEND_PATHS[path_name].call_kwargs(),
        )

    def program(q, k, v, d_out, d_lse, extra, sinks):
        if not grads:
            out, lse = call(q, k, v, extra, sinks)
            return dict(out=out, lse=lse)
        (out, lse), vjp = jax.vjp(lambda q, k, v, s: call(q, k, v, extra, s), q, k, v, sinks)
        dq, dk, dv, dsinks = vjp((d_out, d_lse))
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=None, dsinks=dsinks)

    return jax.jit(program)


def check_mosaic(c: Config, seed: int, path):
    """`check` through `mosaic_program`; values and gradients, or out and lse only where the
    interpreted sweep leaves the gradients out (`runs_mosaic_backward`)."""
    grads = not (path.interpreted and not runs_mosaic_backward(c))
    names = MASKED_OUTPUT_NAMES if grads else ("out", "lse")
    if grads and c.sinks:
        names += ("dsinks",)
    xs, x64, vis = make_inputs(c, seed)
    try:
        static = tuple(getattr(c, name) for name in STATIC_FIELDS)
        # The interpreter's state is reset per scope: a program traced in another is not reused.
        make = mosaic_program.__wrapped__ if path.interpreted else mosaic_program
        program = make(static, path.name, grads)
        extra = {name: xs[name] for name in MASK_ARGUMENTS if name != "mask"}
        results = program(xs["q"], xs["k"], xs["v"], xs["d_out"], xs["d_lse"], extra, xs["sinks"])
        results = {name: results[name] for name in names}
        wanted = oracle(c, x64, vis)
        msgs = violations(c, results, plain_in_dtype(c, x64, vis), wanted, names=names)
    except Exception as e:
        if not SWEEP_LOG:
            raise
        msgs = [f"raised {type(e).__name__}: {str(e)[:300]}"]
    report(c, seed, path, msgs)


MOSAIC_PATHS = backend_paths(
    mosaic=True,
    exclude=("xla", "triton-interpret", "triton", "default"),
    sweep=("mosaic-interpret",),
)


@pytest.mark.parametrize("path", MOSAIC_PATHS)
def test_property_sweep_mosaic(path):
    """The sweep on the Mosaic GPU kernels (backend="mosaic"), against the float64 oracle as
    the other paths' sweep: interpreted, values and gradients where the Mosaic backward runs
    the call, values elsewhere; compiled, all of them."""

    @sweep_settings(path)
    @given(c=mosaic_configs(), seed=st.integers(0, 2**32 - 1))
    def sweep(c, seed):
        with path.scope():
            check_mosaic(c, seed, path)

    sweep()


# A float16 bias of finfo.min on whole rows (each sees a window of 2 keys either side, some
# masked) whose logits float32 still tells apart: each such row spreads over its keys at
# |lse| ~65504, where every key but the largest gets P high by the backward's slack
# (`_numerics.BACKWARD_SLACK`); at 2^-20 the gradients missed the bar by 7% (dk 0.056 > 0.052).
FINFO_MIN_ROWS = Config(
    batch=1,
    q_len=29,
    kv_len=60,
    num_heads=4,
    num_kv_heads=1,
    head_dim=80,
    dtype="f16",
    window=2,
    bias="ts",
    bias_dtype="f16",
    mask="ts",
    q_lengths=True,
    kv_lengths=True,
    extreme="finfo-min-bias-rows",
)


@pytest.mark.parametrize("path", backend_paths())
def test_float16_rows_at_finfo_min(path):
    """The sweep's check on FINFO_MIN_ROWS with the seed that found it."""
    check(FINFO_MIN_ROWS, 4890031, path)


# float32 logits in the hundreds (q and k scaled by 6, q.k of ~1400 before the scale), with
# windows and lengths: compiled on the H200 the default path's dq missed a bar whose baseline
# accumulated its matmuls in float64 (1.2x); `plain_in_dtype` accumulates in float32 as XLA does.
FLOAT32_LARGE_LOGITS = {
    21045714: Config(
        batch=1,
        q_len=77,
        kv_len=77,
        num_heads=2,
        num_kv_heads=1,
        head_dim=120,
        dtype="f32",
        window=(10, 15),
        q_lengths=True,
        extreme="large-logits",
    ),
    423933: Config(
        batch=1,
        q_len=31,
        kv_len=53,
        num_heads=3,
        num_kv_heads=1,
        head_dim=56,
        dtype="f32",
        window=(24, 10),
        q_lengths=True,
        kv_lengths=True,
        extreme="large-logits",
    ),
}


@pytest.mark.parametrize("seed", sorted(FLOAT32_LARGE_LOGITS))
@pytest.mark.parametrize("path", backend_paths())
@pytest.mark.ci_slice(2)
def test_float32_large_logits(path, seed):
    """The sweep's check on the float32 large-logit examples with the seeds that found them."""
    check(FLOAT32_LARGE_LOGITS[seed], seed, path)


# float32 logits in the hundreds on small tiles: lse / scale is ~1250 here (ulp 1.2e-4), so a
# backward that recomputed P against lse alone would move every P of a row by up to ~3e-5 of
# itself (dv 7.0e-5 in the interpreter, 7.3e-5 compiled, against the bar's 6.9e-5). The Triton
# backward refers P to the Triton forward's row max in the kernel's units, with log_sum apart
# (docs/notes/numerics.md, "float32 at large logits").
FLOAT32_LSE_ROUNDING = Config(
    batch=2,
    q_len=33,
    kv_len=33,
    num_heads=2,
    num_kv_heads=2,
    head_dim=88,
    dtype="f32",
    window=(17, 6),
    scale=0.3,
    q_lengths=True,
    segments="qkv",
    num_segments=1,
    extreme="large-logits",
    block="16",
)


@pytest.mark.parametrize("path", backend_paths(exclude=("triton",)))
def test_float32_logits_in_the_hundreds(path):
    """The sweep's check on FLOAT32_LSE_ROUNDING with the seed that found it."""
    check(FLOAT32_LSE_ROUNDING, 300, path)


# float32 huge logits whose q.k cancels: row 9's logit is 3.7e6 (|lse| 3.7e6, a slack of 0.89)
# but its q.k sums terms of ~1e8, so a backward that recomputes it by another accumulation order
# lands ~3 (natural log) below the forward's max and gets P = 0.04 for the row's one key. The
# Triton interpreter's dK/dV kernel does (XLA's CPU dot orders K Q^T and Q K^T apart); the GPU's
# float32 dot (FMA over the head dim, in order) does not: it passes compiled
# (docs/notes/numerics.md, "float32 at large logits").
FLOAT32_CANCELLING_LOGITS = Config(
    batch=1,
    q_len=17,
    kv_len=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=32,
    dtype="f32",
    extreme="huge-logits",
)


def _interpreter_recompute(params):
    """params with the Triton interpreter's an xfail (the recompute above, and below): strict on
    the jax releases whose CPU dots order the two products apart (0.11.2, 0.12.0.1); on 0.12.1
    the huge-logits case below passes."""
    strict = jax.__version_info__ < (0, 12, 1)
    for param in params:
        if param.id == "triton-interpret":
            why = "the interpreter recomputes the logits apart from its forward (an ulp of u)"
            param = pytest.param(
                *param.values,
                id=param.id,
                marks=[*param.marks, pytest.mark.xfail(strict=strict, reason=why)],
            )
        yield param


@pytest.mark.parametrize("path", list(_interpreter_recompute(backend_paths())))
def test_float32_logits_that_cancel(path):
    """The sweep's check on FLOAT32_CANCELLING_LOGITS (seed 1; the sweep found it at seed 10054
    of a larger call)."""
    check(FLOAT32_CANCELLING_LOGITS, 1, path)


# float32 logits ~1e7-1e8 with a bias, one key per row: u = scale * q.k + bias, which XLA (the
# Triton interpreter) contracts into an FMA in one of the forward's fusions and not the other:
# the row max and the exponentials read u an ulp apart (2 at |u| ~ 2e7). log_sum came out at
# -2 (l < 1), the backward's clamp P <= 2^-log_sum above 1, and gradients off by up to 1e17
# (found by a CPU sweep); `softmax_store` holds log_sum at 0 since. What stays is a P of
# e^-2 where the exponentials' u is the larger (log_sum +2: an ulp, not an overflow). On the
# GPU each u is computed once.
FLOAT32_HUGE_LOGITS_WITH_A_BIAS = dataclasses.replace(
    FLOAT32_CANCELLING_LOGITS, q_len=16, head_dim=24, bias="ts", bias_dtype="f32"
)


@pytest.mark.parametrize("path", list(_interpreter_recompute(backend_paths())))
def test_float32_huge_logits_with_a_bias(path):
    """The sweep's check on FLOAT32_HUGE_LOGITS_WITH_A_BIAS (seed 3)."""
    check(FLOAT32_HUGE_LOGITS_WITH_A_BIAS, 3, path)


@pytest.mark.parametrize("seed", [1, 3])
def test_float32_huge_logits_with_a_bias_stay_bounded_in_the_interpreter(seed):
    """The interpreter's gradients on FLOAT32_HUGE_LOGITS_WITH_A_BIAS: off by an ulp's e^2 at
    most, never by orders of magnitude (P <= 1 in the backward: log_sum >= 0)."""
    c = FLOAT32_HUGE_LOGITS_WITH_A_BIAS
    xs, x64, vis = make_inputs(c, seed)
    results = run_path(c, xs, BACKEND_PATHS["triton-interpret"])
    want = oracle(c, x64, vis)
    for name in ("dq", "dk", "dv", "dbias"):
        magnitude = max(1.0, float(np.max(np.abs(want[name]))))
        err = float(np.max(np.abs(to64(results[name]) - want[name])))
        assert err <= magnitude, (name, err, magnitude)


# float16 with huge logits and scale 1 (q and k ~1e4, logits ~1e9): some float64 gradients
# pass 65504, so their float16 values are inf. The sweep's check once counted those infs as NaN
# safety failures; an inf of the oracle's sign is the float16 value of such a gradient.
FLOAT16_GRADIENT_OVERFLOW = Config(
    batch=2,
    q_len=16,
    kv_len=16,
    num_heads=4,
    num_kv_heads=1,
    head_dim=128,
    dtype="f16",
    window=21,
    scale=1.0,
    bias="",
    bias_dtype="f16",
    mask="11ts",
    kv_lengths=True,
    segments="qkv",
    num_segments=4,
    sorted_segments=False,
    extreme="huge-logits",
)


@pytest.mark.parametrize("path", backend_paths())
def test_float16_gradients_beyond_its_range(path):
    """The sweep's check on FLOAT16_GRADIENT_OVERFLOW with the seed that found it: every gradient
    whose float64 value float16 can hold is right, the others are inf of their sign."""
    check(FLOAT16_GRADIENT_OVERFLOW, 9103094, path)


def test_violations_accept_inf_only_where_the_dtype_overflows():
    """An inf of the oracle's sign passes where the oracle rounds to inf in the output's dtype;
    an inf elsewhere, one of the other sign, or a NaN there fails."""
    c = Config(batch=1, q_len=1, kv_len=1, num_heads=1, num_kv_heads=1, head_dim=4, dtype="f16")
    want = np.array([1.0, 70000.0, -80000.0, 2.0])

    def msgs(got):
        got = jnp.asarray(np.array(got), jnp.float16)
        return violations(c, {"dq": got}, {"dq": want}, {"dq": want}, names=("dq",))

    assert msgs([1.0, np.inf, -np.inf, 2.0]) == []
    assert msgs([1.0, np.inf, np.inf, 2.0]) == ["dq: 1 non-finite values"]
    assert msgs([1.0, np.nan, -np.inf, 2.0]) == ["dq: 1 non-finite values"]
    assert msgs([np.inf, np.inf, -np.inf, 2.0]) == ["dq: 1 non-finite values"]


# A bias broadcast over every dim (dbias sums dS over B, N, T and S) with a soft cap, MQA, a
# window and sinks: compiled on the H200 the Triton path's dbias missed the bar 2x (0.067 >
# 0.032) when each row's sum of dS took delta = rowsum(dO * out) from the 16-bit output
# (`triton.backward._dbias_kernel`'s capped_rows). Seed 330 is the same call without sinks.
CAPPED_BROADCAST_BIAS = Config(
    batch=2,
    q_len=58,
    kv_len=58,
    num_heads=4,
    num_kv_heads=1,
    head_dim=32,
    dtype="bf16",
    window=22,
    soft_cap=5.0,
    bias="11",
    bias_dtype="f32",
    mask="11",
    block="q32kv16",
    sinks=True,
)


@pytest.mark.parametrize("path", backend_paths())
@pytest.mark.parametrize("seed, sinks", [(326, True), (330, False)])
def test_capped_bias_broadcast_over_keys(path, seed, sinks):
    """The sweep's check on CAPPED_BROADCAST_BIAS with the seeds that found it."""
    check(dataclasses.replace(CAPPED_BROADCAST_BIAS, sinks=sinks), seed, path)
