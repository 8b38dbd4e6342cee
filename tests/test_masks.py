"""The mask arguments of `flash_attention` (bias, mask, sequence lengths, segment ids, local
windows, soft cap, combined with is_causal) against a float64 numpy oracle.

The Triton kernels run in the Pallas interpreter on CPU. Tolerance rule (FlashAttention's tests):
the kernel's max abs error against the oracle is at most twice the error of the plain XLA backend
run in the same input dtype, plus a small floor relative to the output's magnitude. Every output
is checked: out, lse and the gradients of q, k, v and the bias, for random cotangents of both
outputs.

Also here: rows that see no key (exact zeros, lse = -inf, zero gradients, nothing non-finite), a
hypothesis property test over random shapes and mask combinations, argument validation, the xla
backend against the oracle, and a timing test showing that tiles a mask skips cost nothing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.backends import BACKEND_PATHS, SWEEP, backend_paths
from support.calls import masked_outputs_and_grads
from support.inputs import BLOCKS, case_id, rounded, uniform_block_sizes
from support.oracle import as4d, attention_oracle_f64, sum_to_shape, to64, visibility

import pallas_flash

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# Added to 2 x (xla backend error), times max(1, largest |oracle|).
FLOOR = {"f32": 1e-5, "bf16": 1e-3}
# The baseline term counts at most this much (times the magnitude): a broken xla backend must not
# hand the kernels a loose tolerance.
BASELINE_CAP = {"f32": 1e-4, "bf16": 5e-2}
GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def test_tests_import_this_worktree():
    """The package under test is the checkout these tests live in, not another install."""
    here = __file__.rsplit("/tests/", 1)[0]
    assert pallas_flash.__file__.startswith(here + "/pallas_flash/"), pallas_flash.__file__


# -- cases and random inputs ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call. `bias` and `mask` are shape codes, right-aligned on (B, N, T, S): a letter of
    "bnts" is that full dim, "1" a broadcast dim, e.g. "bnts", "n1s", "ts", "s". `segments`:
    None, "q" (q_segment_ids only, T == S) or "qkv"."""

    batch: int = 2
    q_len: int = 17
    kv_len: int = 17
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    dtype: str = "f32"
    block: str = "16"
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    soft_cap: float | None = None
    bias: str | None = None
    mask: str | None = None
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: str | None = None
    num_segments: int = 3
    unbatched: bool = False

    def dims(self, code: str) -> tuple[int, ...]:
        full = {"b": self.batch, "n": self.num_heads, "t": self.q_len, "s": self.kv_len, "1": 1}
        return tuple(full[c] for c in code)

    def __str__(self):
        parts = [
            f"B{self.batch}T{self.q_len}S{self.kv_len}N{self.num_heads}K{self.num_kv_heads}"
            f"H{self.head_dim}-{self.dtype}-blk{self.block}"
        ]
        parts += ["causal"] * self.is_causal
        parts += [f"win{self.window}".replace(" ", "")] * (self.window is not None)
        parts += [f"cap{self.soft_cap}"] * (self.soft_cap is not None)
        parts += [f"bias-{self.bias}"] * (self.bias is not None)
        parts += [f"mask-{self.mask}"] * (self.mask is not None)
        parts += ["qlen"] * self.q_lengths + ["kvlen"] * self.kv_lengths
        parts += [f"seg-{self.segments}"] * (self.segments is not None)
        parts += ["unbatched"] * self.unbatched
        return "-".join(parts)


def random_mask(rng, shape, cell: int = 16):
    """A bool mask of `shape` made of cell x cell (query, key) squares, independently 40% hidden,
    30% visible and 30% random: tiles the kernels skip, tiles they take as fully visible and
    tiles they mask element-wise, different per batch entry and head."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    t, s = shape4[2:]
    cells = (*shape4[:2], -(-t // cell), -(-s // cell))
    kind = rng.choice(3, size=cells, p=[0.4, 0.3, 0.3])
    kind = kind.repeat(cell, axis=2)[:, :, :t].repeat(cell, axis=3)[:, :, :, :s]
    mask = np.where(kind == 2, rng.random(shape4) < 0.7, kind == 1)
    return mask.reshape(shape)


def make_inputs(c: Case, seed: int):
    """Batched inputs of case `c`: (arrays for the call, float64 copies for the oracle).

    Both are dicts with q, k, v, bias, d_out, d_lse (the cotangents) and mask, q_lens, kv_lens,
    q_seg, kv_seg (None where the case has none).
    """
    rng = np.random.default_rng(seed)
    dtype = DTYPES[c.dtype]
    b, t, s, n, kh, h = c.batch, c.q_len, c.kv_len, c.num_heads, c.num_kv_heads, c.head_dim
    pairs = {
        "q": rounded(rng, (b, t, n, h), dtype),
        "k": rounded(rng, (b, s, kh, h), dtype),
        "v": rounded(rng, (b, s, kh, h), dtype),
        "d_out": rounded(rng, (b, t, n, h), dtype),
        "d_lse": rounded(rng, (b, n, t), jnp.float32),
        "bias": (None, None) if c.bias is None else rounded(rng, c.dims(c.bias), dtype),
    }
    xs = {name: pair[0] for name, pair in pairs.items()}
    x64 = {name: pair[1] for name, pair in pairs.items()}
    mask = None if c.mask is None else random_mask(rng, c.dims(c.mask))
    q_lens = None if not c.q_lengths else rng.integers(1, t + 1, size=b).astype(np.int32)
    kv_lens = None if not c.kv_lengths else rng.integers(1, s + 1, size=b).astype(np.int32)
    q_seg = kv_seg = None
    if c.segments is not None:
        # Packed documents: sorted ids; the kernels also accept unsorted ids (property test).
        q_seg = np.sort(rng.integers(0, c.num_segments, size=(b, t)), axis=1).astype(np.int32)
        if c.segments == "qkv":
            kv_seg = np.sort(rng.integers(0, c.num_segments, size=(b, s)), axis=1)
            kv_seg = kv_seg.astype(np.int32)
    extras = dict(mask=mask, q_lens=q_lens, kv_lens=kv_lens, q_seg=q_seg, kv_seg=kv_seg)
    x64.update(extras)
    xs.update({name: None if x is None else jnp.asarray(x) for name, x in extras.items()})
    return xs, x64


# -- float64 oracle -------------------------------------------------------------------------------


def oracle(c: Case, x64, scale: float | None = None):
    """The float64 oracle (support.oracle.attention_oracle_f64) of case `c`: out, lse and the
    gradients dq, dk, dv, dbias (dS summed over the bias's broadcast dims) for the cotangents
    d_out, d_lse."""
    q, k, v, d_out, d_lse = (x64[name] for name in ("q", "k", "v", "d_out", "d_lse"))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = None if x64["bias"] is None else as4d(x64["bias"])
    r = attention_oracle_f64(
        q,
        k,
        v,
        d_out,
        d_lse,
        scale=scale,
        visible=visibility(c, x64),
        bias=bias,
        soft_cap=c.soft_cap,
    )
    d_logits = r.pop("dlogits")
    r["dbias"] = None if bias is None else sum_to_shape(d_logits, x64["bias"].shape)
    return r


# -- running flash_attention ----------------------------------------------------------------------

KERNEL = "triton-interpret"  # the Triton kernels in the Pallas interpreter
XLA = "xla"  # the plain jnp backend: the tolerance rule's baseline


def call_kwargs(c: Case, which: str) -> dict:
    """The call kwargs of the backend matrix's path `which`, with the case's tiles."""
    return BACKEND_PATHS[which].call_kwargs(BLOCKS[c.block])


def unbatch(xs):
    """Drops the batch axis of the per-batch inputs (bias and mask codes of rank <= 3 have none)."""
    out = dict(xs)
    for name in ("q", "k", "v", "d_out", "d_lse", "q_seg", "kv_seg"):
        if out[name] is not None:
            out[name] = out[name][0]
    return out


def run(c: Case, xs, which: str, **overrides):
    """out, lse, dq, dk, dv, dbias of one jitted flash_attention call and its VJP (batched)."""
    kwargs = dict(
        is_causal=c.is_causal,
        local_window_size=c.window,
        logits_soft_cap=c.soft_cap,
        **call_kwargs(c, which),
    )
    kwargs.update(overrides)
    if c.unbatched:
        xs = unbatch(xs)

    res = masked_outputs_and_grads(pallas_flash.flash_attention, xs, **kwargs)
    if c.unbatched:
        res = {name: x if x is None or name == "dbias" else x[None] for name, x in res.items()}
    return res


def zero_empty_rows_dlse(c: Case, xs, x64):
    """The lse cotangent set to 0 at rows that see no key (where lse is the constant -inf)."""
    empty = ~visibility(c, x64).any(axis=-1)
    d_lse = np.where(empty, 0.0, x64["d_lse"])
    xs, x64 = dict(xs), dict(x64)
    xs["d_lse"] = jnp.asarray(d_lse, jnp.float32)
    x64["d_lse"] = d_lse
    return xs, x64


def tolerance_violations(c: Case, results, baselines, oracles):
    """Messages for outputs beyond 2 x (xla error) + floor, or non-finite where the oracle is
    finite, or whose -inf entries (lse of empty rows) differ from the oracle's."""
    msgs = []
    for name, want in oracles.items():
        got = results[name]
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape, (name, got.shape, want.shape)
        got, base = to64(got), to64(baselines[name])
        finite = np.isfinite(want)
        if not np.array_equal(got[~finite], want[~finite]):
            msgs.append(f"{name}: non-finite entries differ from the oracle's")
        if not np.isfinite(got[finite]).all():
            msgs.append(f"{name}: non-finite values where the oracle is finite")
            continue
        err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
        base_err = float(np.max(np.abs(base[finite] - want[finite]), initial=0.0))
        magnitude = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
        allowed = 2 * min(base_err, BASELINE_CAP[c.dtype] * magnitude) + FLOOR[c.dtype] * magnitude
        if not err <= allowed:
            msgs.append(
                f"{name}: error {err:.3g} > 2 x xla error {base_err:.3g} + floor "
                f"{FLOOR[c.dtype] * magnitude:.3g}"
            )
    return msgs


def check_against_oracle(c: Case, seed: int = 0):
    """Kernels (interpreter) vs the float64 oracle, with the xla backend as the baseline; returns
    (results, oracles, x64) for further checks."""
    xs, x64 = make_inputs(c, seed)
    xs, x64 = zero_empty_rows_dlse(c, xs, x64)
    results = run(c, xs, KERNEL)
    baselines = run(c, xs, XLA)
    oracles = oracle(c, x64)
    dtype = DTYPES[c.dtype]
    for name in ("out", "dq", "dk", "dv"):
        assert results[name].dtype == dtype, (name, results[name].dtype)
    assert results["lse"].dtype == jnp.float32
    if c.bias is not None:
        assert results["dbias"].shape == xs["bias"].shape
        assert results["dbias"].dtype == xs["bias"].dtype
    violations = tolerance_violations(c, results, baselines, oracles)
    assert not violations, f"{c}: " + "; ".join(violations)
    return results, oracles, x64


# -- each argument alone --------------------------------------------------------------------------

# Cases whose arguments other CI cases also cover (alone or combined) run with PALLAS_FLASH_SWEEP.
SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="covered by other CI cases: PALLAS_FLASH_SWEEP")


def sweep_only(case):
    return pytest.param(case, marks=SWEEP_ONLY)


SINGLE = [
    Case(bias="bnts", q_len=100, kv_len=37, num_heads=4, num_kv_heads=2),
    sweep_only(Case(bias="n1s", q_len=33, kv_len=70, block="32")),
    sweep_only(Case(bias="ts", q_len=17, kv_len=100)),
    sweep_only(Case(bias="b111", q_len=40, kv_len=23)),
    Case(mask="bnts", q_len=100, kv_len=37, num_heads=4, num_kv_heads=2),
    sweep_only(Case(mask="ts", q_len=37, kv_len=100, block="q16kv64")),
    sweep_only(Case(mask="b11s", batch=2, q_len=1, kv_len=70)),
    sweep_only(Case(q_lengths=True, q_len=100, kv_len=37)),
    sweep_only(Case(kv_lengths=True, q_len=37, kv_len=100)),
    sweep_only(Case(segments="q", q_len=100, kv_len=100, num_segments=5, block="32")),
    Case(segments="qkv", q_len=70, kv_len=17, block="q32kv16"),
    sweep_only(Case(segments="qkv", q_len=17, kv_len=1)),
    sweep_only(Case(window=7, q_len=100, kv_len=100)),
    Case(window=(9, 2), q_len=70, kv_len=33, block="q32kv16"),
    sweep_only(Case(window=(0, 12), q_len=33, kv_len=70, block="q16kv64")),
    Case(soft_cap=2.0, q_len=70, kv_len=37),
    Case(bias="s", batch=1, q_len=1, kv_len=100),
]


@pytest.mark.parametrize("c", SINGLE, ids=case_id)
@pytest.mark.ci_slice(3)
def test_each_argument_alone(c):
    check_against_oracle(c)


# -- combinations ---------------------------------------------------------------------------------

COMBINED = [
    # local windows with is_causal (top-left): the right side shrinks to 0
    sweep_only(Case(is_causal=True, window=(5, 9), q_len=100, kv_len=37)),
    Case(is_causal=True, window=3, q_len=37, kv_len=100, num_heads=4, num_kv_heads=1),
    # T != S with windows and segments
    sweep_only(
        Case(window=(11, 4), segments="qkv", q_len=100, kv_len=37, num_segments=2, block="q16kv64")
    ),
    sweep_only(Case(window=6, is_causal=True, segments="qkv", q_len=37, kv_len=100, block="32")),
    # lengths with segments (packed and padded) and a bias
    Case(q_lengths=True, kv_lengths=True, segments="q", q_len=70, kv_len=70, bias="1n1s"),
    # soft cap on top of a bias (cap applied to scale q.k + bias) with a mask
    sweep_only(Case(soft_cap=1.5, bias="bnts", mask="b1ts", q_len=33, kv_len=50)),
    # GQA with per-head mask and bias: the dK/dV kernel reads its group's heads
    Case(
        batch=1,
        num_heads=6,
        num_kv_heads=2,
        bias="nts",
        mask="n1s",
        q_len=40,
        kv_len=40,
        is_causal=True,
    ),
    # everything at once, odd sizes, multi-tile
    Case(
        batch=2,
        q_len=257,
        kv_len=100,
        num_heads=4,
        num_kv_heads=2,
        head_dim=40,
        block="32",
        is_causal=True,
        window=(40, 3),
        soft_cap=3.0,
        bias="b1ts",
        mask="n1s",
        q_lengths=True,
        kv_lengths=True,
        segments="qkv",
        num_segments=2,
    ),
    # unbatched (rank 3) inputs with a rank-3 mask and a rank-2 bias
    Case(
        batch=1,
        unbatched=True,
        bias="ts",
        mask="nts",
        segments="q",
        window=(4, 1),
        q_len=33,
        kv_len=33,
    ),
]


@pytest.mark.parametrize("c", COMBINED, ids=case_id)
@pytest.mark.ci_slice(2)
def test_combined_arguments(c):
    check_against_oracle(c)


BF16 = [
    Case(dtype="bf16", is_causal=True, bias="bnts", segments="q", q_len=70, kv_len=70),
    sweep_only(
        Case(
            dtype="bf16",
            soft_cap=4.0,
            window=(8, 8),
            mask="b1ts",
            kv_lengths=True,
            q_len=33,
            kv_len=70,
            num_heads=4,
            num_kv_heads=2,
        )
    ),
]


@pytest.mark.parametrize("c", BF16, ids=case_id)
def test_bfloat16(c):
    check_against_oracle(c)


# -- rows that see no key -------------------------------------------------------------------------


def with_arrays(xs, x64, **arrays):
    """xs, x64 with some mask arrays replaced (numpy arrays)."""
    xs, x64 = dict(xs), dict(x64)
    for name, x in arrays.items():
        x64[name] = x
        xs[name] = jnp.asarray(x)
    return xs, x64


def empty_row_inputs(kind: str):
    """(case, xs, x64) where some query rows see no key, chosen by `kind`."""
    if kind == "query_seq_lengths":
        c = Case(q_lengths=True, q_len=40, kv_len=23, bias="bnts", num_heads=4, num_kv_heads=2)
        xs, x64 = make_inputs(c, 1)
        return (c, *with_arrays(xs, x64, q_lens=np.array([0, 19], np.int32)))
    if kind == "key_value_seq_lengths":
        c = Case(kv_lengths=True, q_len=23, kv_len=40, bias="b1ts", is_causal=True)
        xs, x64 = make_inputs(c, 2)
        return (c, *with_arrays(xs, x64, kv_lens=np.array([21, 0], np.int32)))
    if kind == "segments":
        # Query ids 7 and -1 have no key of that id.
        c = Case(segments="qkv", q_len=50, kv_len=33, bias="bnts", soft_cap=5.0)
        xs, x64 = make_inputs(c, 3)
        rng = np.random.default_rng(3)
        q_seg = rng.choice([0, 1, 7, -1], size=(c.batch, c.q_len)).astype(np.int32)
        kv_seg = rng.choice([0, 1, 2], size=(c.batch, c.kv_len)).astype(np.int32)
        return (c, *with_arrays(xs, x64, q_seg=q_seg, kv_seg=kv_seg))
    if kind == "window":
        # Query rows >= 19 are past the window's reach of the 17 keys.
        c = Case(window=(2, 2), is_causal=True, q_len=50, kv_len=17, bias="bnts")
        xs, x64 = make_inputs(c, 4)
        return c, xs, x64
    if kind == "mask":
        c = Case(mask="bnts", q_len=33, kv_len=40, bias="1nts", num_heads=4, num_kv_heads=2)
        xs, x64 = make_inputs(c, 5)
        mask = x64["mask"].copy()
        mask[0, 1, ::3, :] = False  # empty rows of one head
        mask[1, :, :, 5:20] = False  # keys no query sees
        return (c, *with_arrays(xs, x64, mask=mask))
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        sweep_only("query_seq_lengths"),
        "key_value_seq_lengths",
        "segments",
        sweep_only("window"),
        "mask",
    ],
)
@pytest.mark.ci_slice(1)
def test_rows_that_see_no_key(kind):
    """Empty rows output exactly 0 with lse = -inf, and gradients are exactly 0 for empty rows,
    keys no query sees and masked bias entries, even with a nonzero lse cotangent there; both
    backends."""
    c, xs, x64 = empty_row_inputs(kind)
    vis = visibility(c, x64)
    empty = ~vis.any(axis=-1)  # [B, N, T]
    assert empty.any() and not empty.all(), "the case must have empty and non-empty rows"
    assert x64["d_lse"][empty].all(), "the lse cotangent is nonzero at the empty rows"
    rows = np.transpose(empty, (0, 2, 1))  # [B, T, N]
    group = c.num_heads // c.num_kv_heads
    seen = vis.any(axis=2).reshape(c.batch, c.num_kv_heads, group, c.kv_len).any(axis=2)
    unseen = ~np.transpose(seen, (0, 2, 1))  # [B, S, K]: keys no query sees
    results = {which: run(c, xs, which) for which in (KERNEL, XLA)}
    for which, res in results.items():
        res = {name: to64(x) for name, x in res.items()}
        for name, x in res.items():
            assert not np.isnan(x).any(), (which, name)
            assert name == "lse" or np.isfinite(x).all(), (which, name)
        assert np.all(res["lse"][empty] == -np.inf), which
        assert np.isfinite(res["lse"][~empty]).all(), which
        assert np.all(res["out"][rows] == 0.0), which
        assert np.all(res["dq"][rows] == 0.0), which
        assert np.all(res["dk"][unseen] == 0.0), which
        assert np.all(res["dv"][unseen] == 0.0), which
        if c.bias == "bnts":
            assert np.all(res["dbias"][~vis] == 0.0), which
    # And everything against the oracle, which ignores the lse cotangent of empty rows.
    violations = tolerance_violations(c, results[KERNEL], results[XLA], oracle(c, x64))
    assert not violations, "; ".join(violations)


def test_grads_without_residuals():
    """return_residuals=False: out alone, gradients from its cotangent (the oracle's d_lse = 0)."""
    c = Case(
        bias="1nts",
        segments="qkv",
        window=(6, 10),
        is_causal=True,
        q_len=50,
        kv_len=40,
        num_heads=4,
        num_kv_heads=2,
        block="q32kv16",
    )
    xs, x64 = make_inputs(c, 9)
    x64["d_lse"] = np.zeros_like(x64["d_lse"])
    names = ("mask", "q_lens", "kv_lens", "q_seg", "kv_seg")

    def grads(which):
        def f(q, k, v, bias, d_out, extra):
            def attention(q, k, v, bias):
                return pallas_flash.flash_attention(
                    q,
                    k,
                    v,
                    bias,
                    is_causal=c.is_causal,
                    local_window_size=c.window,
                    q_segment_ids=extra["q_seg"],
                    kv_segment_ids=extra["kv_seg"],
                    **call_kwargs(c, which),
                )

            out, vjp = jax.vjp(attention, q, k, v, bias)
            return dict(zip(("out", *GRAD_NAMES), (out, *vjp(d_out)), strict=True))

        args = [xs[name] for name in ("q", "k", "v", "bias", "d_out")]
        return jax.jit(f)(*args, {name: xs[name] for name in names})

    want = oracle(c, x64)
    del want["lse"]
    violations = tolerance_violations(c, grads(KERNEL), grads(XLA), want)
    assert not violations, "; ".join(violations)


# -- property test --------------------------------------------------------------------------------


@st.composite
def random_cases(draw):
    num_kv_heads, group = draw(st.sampled_from([(1, 1), (1, 2), (2, 2), (1, 4)]))
    q_len = draw(st.integers(1, 80))
    kv_len = draw(st.one_of(st.just(q_len), st.integers(1, 80)))
    window = draw(
        st.one_of(
            st.none(),
            st.integers(0, 24),
            st.tuples(st.integers(0, 24), st.integers(0, 24)),
        )
    )
    segments = draw(st.sampled_from([None, "qkv"] + ["q"] * (q_len == kv_len)))
    return Case(
        batch=draw(st.integers(1, 2)),
        q_len=q_len,
        kv_len=kv_len,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([8, 16, 40])),
        block=draw(st.sampled_from(sorted(BLOCKS))),
        is_causal=draw(st.booleans()),
        window=window,
        soft_cap=draw(st.one_of(st.none(), st.sampled_from([1.0, 4.0]))),
        bias=draw(st.one_of(st.none(), st.sampled_from(["bnts", "1nts", "b11s", "t1", "s"]))),
        mask=draw(st.one_of(st.none(), st.sampled_from(["bnts", "b1ts", "ts", "n1s", "bn11"]))),
        q_lengths=draw(st.booleans()),
        kv_lengths=draw(st.booleans()),
        segments=segments,
        num_segments=draw(st.integers(1, 4)),
    )


@settings(
    max_examples=12 if SWEEP else 1,  # CI's slice: 1 drawn case
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(c=random_cases(), seed=st.integers(0, 2**32 - 1), shuffle=st.booleans())
def test_property_random_masks(c, seed, shuffle):
    """Random shapes and mask combinations; unsorted segment ids when `shuffle`."""
    xs, x64 = make_inputs(c, seed)
    if shuffle and c.segments is not None:
        rng = np.random.default_rng(seed + 1)
        arrays = {"q_seg": rng.permuted(x64["q_seg"], axis=1)}
        if c.segments == "qkv":
            arrays["kv_seg"] = rng.permuted(x64["kv_seg"], axis=1)
        xs, x64 = with_arrays(xs, x64, **arrays)
    xs, x64 = zero_empty_rows_dlse(c, xs, x64)
    results = run(c, xs, KERNEL)
    violations = tolerance_violations(c, results, run(c, xs, XLA), oracle(c, x64))
    assert not violations, f"{c}: " + "; ".join(violations)


# -- the xla backend ------------------------------------------------------------------------------

XLA_CASES = [
    Case(bias="n1s", mask="b1ts", is_causal=True, q_len=100, kv_len=37),
    Case(
        window=(5, 2),
        segments="qkv",
        soft_cap=2.0,
        q_len=37,
        kv_len=100,
        num_heads=4,
        num_kv_heads=2,
    ),
    Case(q_lengths=True, kv_lengths=True, segments="q", bias="bnts", q_len=57, kv_len=57),
    Case(batch=1, unbatched=True, mask="ts", bias="n11", window=3, q_len=20, kv_len=30),
]


@pytest.mark.parametrize(
    "bias_shape, kwargs",
    [
        ((1, 4, 40, 24), dict(is_causal=True)),
        ((2, 1, 40, 24), dict(q_segment_ids=np.repeat(np.arange(4, dtype=np.int32), 10)[None])),
        ((1, 1, 40, 24), dict(mask=np.tri(40, 24, dtype=bool)[None, None].repeat(4, axis=1))),
        ((2, 4, 1, 24), dict(is_causal=True)),
        ((2, 1, 40, 1), dict(local_window_size=(5, 3))),
        ((1, 1, 1, 24), dict(key_value_seq_lengths=np.array([24, 13], np.int32))),
    ],
    ids=["batch", "heads-segments", "both-mask", "queries", "heads-keys", "all-lengths"],
)
@pytest.mark.ci_slice(2)
def test_broadcast_bias_gradient_is_summed_in_the_kernel(bias_shape, kwargs, mode):
    """A broadcast bias gets its gradient without any [B, N, T, S] array (the kernel sums over
    the broadcast dims), and it matches the xla backend."""
    b, t, s, n, k, h = 2, 40, 24, 4, 2, 16
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    kk = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    kwargs = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in kwargs.items()}
    if "q_segment_ids" in kwargs:
        kwargs["q_segment_ids"] = jnp.repeat(kwargs["q_segment_ids"], b, axis=0)
        kwargs["kv_segment_ids"] = kwargs["q_segment_ids"][:, :s]

    def grad_bias(backend, **extra):
        def loss(bias):
            out = pallas_flash.flash_attention(q, kk, v, bias, backend=backend, **kwargs, **extra)
            return jnp.sum(out * jnp.cos(out))

        return jax.grad(loss)

    tiles = BLOCKS["q32kv16"] if mode == "interpret" else None
    ours = grad_bias("triton", interpret=mode == "interpret", block_sizes=tiles)
    text = str(jax.make_jaxpr(ours)(bias))
    assert f"[{b},{n},{t},{s}]" not in text.replace(" ", "")
    np.testing.assert_allclose(
        jax.jit(ours)(bias), jax.jit(grad_bias("xla"))(bias), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("path", backend_paths(sweep=("xla",)))
def test_key_broadcast_bias_gradient_in_16_bits(path, with_sinks):
    """A bfloat16 bias broadcast over the keys ([B, N, T, 1], GQA, causal): its gradient, each
    row's sum of dS over its 150 keys, cancels to d_lse (small here; with sinks P_sink (dO .
    out) + (1 - P_sink) d_lse). The kernels' own sum of dS was noise of the size of the answer
    (0.024 against 0.029 without sinks, 0.015 with); it is the XLA path's in float32 to 1% of
    its largest value."""
    b, t, s, n, k, h = 1, 40, 150, 4, 2, 32
    rng = np.random.default_rng(5)
    q, d_out = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16) for _ in range(2))
    kk, v = (jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.bfloat16) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((b, n, t, 1)), jnp.bfloat16)
    d_lse = jnp.asarray(rng.standard_normal((b, n, t)) * 1e-2, jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32) if with_sinks else None

    def grad_bias(inputs, **kwargs):
        def loss(bias):
            out, lse = pallas_flash.flash_attention(
                *inputs, bias, is_causal=True, sinks=sinks, return_residuals=True, **kwargs
            )
            return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)

        return jax.jit(jax.grad(loss))(bias)

    with path.scope():
        ours = grad_bias((q, kk, v), **path.call_kwargs())
    f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
    want = np.asarray(grad_bias(f32, backend="xla"))
    assert ours.dtype == bias.dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), want, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("c", XLA_CASES, ids=case_id)
def test_attention_reference_matches_oracle(c):
    """The xla backend (`attention_reference`) in float32 is close to the float64 oracle."""
    xs, x64 = make_inputs(c, 7)
    xs, x64 = zero_empty_rows_dlse(c, xs, x64)
    if c.unbatched:
        xs = unbatch(xs)

    got = masked_outputs_and_grads(
        pallas_flash.attention_reference,
        xs,
        is_causal=c.is_causal,
        local_window_size=c.window,
        logits_soft_cap=c.soft_cap,
    )
    if c.unbatched:
        got = {name: x if name == "dbias" else x[None] for name, x in got.items()}
    want = oracle(c, x64)
    for name, x in got.items():
        if want[name] is None:
            assert x is None, name
            continue
        x, w = to64(x), want[name]
        finite = np.isfinite(w)
        assert np.array_equal(x[~finite], w[~finite]), name
        magnitude = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
        np.testing.assert_allclose(
            x[finite], w[finite], rtol=0, atol=2e-5 * magnitude, err_msg=name
        )


# -- validation -----------------------------------------------------------------------------------

B, T, S, N, K, H = 2, 9, 12, 4, 2, 16


def ones(shape, dtype):
    return np.ones(shape, dtype)


# (id, flash_attention kwargs, exception, a regex the message must match)
INVALID = [
    ("mask-int8", dict(mask=ones((B, N, T, S), np.int8)), ValueError, r"mask\.astype\(bool\)"),
    ("mask-int32", dict(mask=ones((T, S), np.int32)), ValueError, r"mask\.astype\(bool\)"),
    ("mask-float", dict(mask=ones((T, S), np.float32)), ValueError, r"mask\.astype\(bool\)"),
    ("mask-uint8", dict(mask=ones((S,), np.uint8)), ValueError, r"mask\.astype\(bool\)"),
    (
        "mask-shape",
        dict(mask=ones((B, N, T + 1, S), bool)),
        ValueError,
        r"mask\.shape=\(2, 4, 10, 12\) must be broadcastable to \(2, 4, 9, 12\)",
    ),
    (
        "mask-3d",
        dict(mask=ones((2, T, S + 1), bool)),
        ValueError,
        r"mask\.shape=\(2, 9, 13\) must be broadcastable to \(2, 4, 9, 12\)",
    ),
    ("mask-heads", dict(mask=ones((B, K, T, S), bool)), ValueError, r"mask\.shape"),
    ("mask-rank5", dict(mask=ones((1, B, N, T, S), bool)), ValueError, r"mask\.shape"),
    ("mask-list", dict(mask=[[True] * S] * T), TypeError, "mask"),
    ("bias-int", dict(bias=ones((B, N, T, S), np.int32)), TypeError, r"bias\.dtype"),
    ("bias-bool", dict(bias=ones((T, S), bool)), TypeError, r"bias\.dtype"),
    (
        "bias-shape",
        dict(bias=ones((T, S + 1), np.float32)),
        ValueError,
        r"bias\.shape=\(9, 13\) must be broadcastable",
    ),
    ("bias-batch", dict(bias=ones((B + 1, 1, 1, S), np.float32)), ValueError, r"bias\.shape"),
    ("bias-rank5", dict(bias=ones((1, B, N, T, S), np.float32)), ValueError, r"bias\.shape"),
    (
        "q-seg-shape",
        dict(q_segment_ids=ones((B, T + 1), np.int32), kv_segment_ids=ones((B, S), np.int32)),
        ValueError,
        r"q_segment_ids\.shape",
    ),
    (
        "q-seg-1d",
        dict(q_segment_ids=ones((T,), np.int32), kv_segment_ids=ones((B, S), np.int32)),
        ValueError,
        r"q_segment_ids\.shape",
    ),
    (
        "q-seg-float",
        dict(q_segment_ids=ones((B, T), np.float32), kv_segment_ids=ones((B, S), np.int32)),
        TypeError,
        "q_segment_ids",
    ),
    (
        "kv-seg-shape",
        dict(q_segment_ids=ones((B, T), np.int32), kv_segment_ids=ones((B, T), np.int32)),
        ValueError,
        r"kv_segment_ids\.shape",
    ),
    (
        "kv-seg-bool",
        dict(q_segment_ids=ones((B, T), np.int32), kv_segment_ids=ones((B, S), bool)),
        TypeError,
        "kv_segment_ids",
    ),
    ("kv-seg-alone", dict(kv_segment_ids=ones((B, S), np.int32)), ValueError, "q_segment_ids"),
    ("q-seg-alone-T!=S", dict(q_segment_ids=ones((B, T), np.int32)), ValueError, "kv_segment_ids"),
    (
        "q-lens-shape",
        dict(query_seq_lengths=ones((B, 1), np.int32)),
        ValueError,
        r"query_seq_lengths\.shape",
    ),
    (
        "q-lens-float",
        dict(query_seq_lengths=ones((B,), np.float32)),
        TypeError,
        "query_seq_lengths",
    ),
    (
        "kv-lens-shape",
        dict(key_value_seq_lengths=ones((B + 1,), np.int32)),
        ValueError,
        r"key_value_seq_lengths\.shape",
    ),
    ("kv-lens-list", dict(key_value_seq_lengths=[S] * B), TypeError, "key_value_seq_lengths"),
    (
        "q-lens-past-T",
        dict(query_seq_lengths=np.array([T + 1, 0])),
        ValueError,
        r"query_seq_lengths=\[10, 0\] must lie in \[0, query.shape\[1\]=9\]",
    ),
    (
        "q-lens-negative",
        dict(query_seq_lengths=np.array([3, -1])),
        ValueError,
        r"query_seq_lengths=\[3, -1\] must lie in \[0, query.shape\[1\]=9\]",
    ),
    (
        "kv-lens-past-S",
        dict(key_value_seq_lengths=jnp.array([S, S + 8])),
        ValueError,
        r"key_value_seq_lengths=\[12, 20\] must lie in \[0, key.shape\[1\]=12\]",
    ),
    (
        "kv-lens-negative",
        dict(key_value_seq_lengths=np.array([-2, S])),
        ValueError,
        r"key_value_seq_lengths=\[-2, 12\] must lie in \[0, key.shape\[1\]=12\]",
    ),
    ("window-negative", dict(local_window_size=-1), ValueError, "local_window_size"),
    ("window-pair-negative", dict(local_window_size=(3, -2)), ValueError, "local_window_size"),
    ("window-float", dict(local_window_size=2.5), TypeError, "local_window_size"),
    ("window-triple", dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    ("window-bool", dict(local_window_size=True), TypeError, "local_window_size"),
    ("window-str", dict(local_window_size="4"), TypeError, "local_window_size"),
    ("cap-zero", dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    ("cap-negative", dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    ("cap-inf", dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    ("cap-nan", dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    ("cap-str", dict(logits_soft_cap="1.0"), TypeError, "logits_soft_cap"),
]


@pytest.mark.usefixtures("no_compute")
@pytest.mark.parametrize("path", backend_paths(mosaic=True))
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [pytest.param(*rest, id=name) for name, *rest in INVALID],
)
def test_invalid_mask_arguments(kwargs, error, match, path):
    """The same error on every path, before any backend is chosen or run."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
    with path.scope(), pytest.raises(error, match=match):
        pallas_flash.flash_attention(q, k, v, **kwargs, **path.kwargs)


@pytest.mark.parametrize("path", backend_paths(mosaic=True, sweep=("mosaic-interpret",)))
def test_traced_lengths_outside_their_range_are_clamped(path):
    """Lengths under jit are not read: past T (S) they act as T (S), below 0 as 0, on every
    path (concrete ones raise: test_invalid_mask_arguments)."""
    rng = np.random.default_rng(0)
    dtype, head_dim = (jnp.bfloat16, 64) if path.mosaic else (jnp.float32, H)
    q = jnp.asarray(rng.standard_normal((B, T, N, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, head_dim)), dtype) for _ in range(2))

    @jax.jit
    def attend(q_lengths, kv_lengths):
        return pallas_flash.flash_attention(
            q, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_residuals=True, **path.kwargs,
        )  # fmt: skip

    with path.scope():
        for inside, outside in (
            (([T, 0], [0, S]), ([T + 5, -3], [-1, S + 7])),
            (([T, T - 2], [S, 3]), ([T + 1, T - 2], [S + 1, 3])),
        ):
            want = attend(*(jnp.asarray(x) for x in inside))
            got = attend(*(jnp.asarray(x) for x in outside))
            for x, y in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.usefixtures("no_compute")
def test_unbatched_errors_quote_the_shapes_passed():
    """Rank-3 inputs get a batch axis inside; the messages quote the shapes as passed."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((S, K, H)).astype(np.float32) for _ in range(2))
    with pytest.raises(
        ValueError, match=r"mask\.shape=\(2, 9, 12\) must be broadcastable to \(4, 9, 12\)"
    ):
        pallas_flash.flash_attention(q, k, v, mask=ones((2, T, S), bool))
    with pytest.raises(ValueError, match=r"bias\.shape=\(1, 4, 9, 12\) has more than 3 dims"):
        pallas_flash.flash_attention(q, k, v, bias=ones((1, N, T, S), np.float32))


@pytest.mark.usefixtures("no_compute")
def test_lengths_need_batched_inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    k, v = (rng.standard_normal((S, K, H)).astype(np.float32) for _ in range(2))
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        with pytest.raises(ValueError, match=name):
            pallas_flash.flash_attention(q, k, v, **{name: np.ones((1,), np.int32)})


# -- skipped tiles cost nothing -------------------------------------------------------------------


@pytest.fixture
def tile_visits(monkeypatch):
    """Counts the tiles the Triton kernels visit: every tile loop runs through `_common.fold`,
    whose body here reports each step to the host (the interpreter runs debug callbacks)."""
    from pallas_flash.triton import _common

    visits = []
    fold = _common.fold

    def counting_fold(lo, hi, body, carry):
        def counted(i, c):
            jax.debug.callback(lambda: visits.append(1))
            return body(i, c)

        return fold(lo, hi, counted, carry)

    monkeypatch.setattr(_common, "fold", counting_fold)
    return visits


def test_skipped_tiles_cost_nothing(tile_visits):
    """Forward + backward of a packed (4 documents of 128) or windowed (128, 0) causal call at
    T = S = 512 in tiles of 64 visits exactly the tiles its mask lets a row see, counted in the
    interpreter: the forward, dK/dV and dQ passes each visit every such (query, key) tile once."""
    seq, head_dim, block = 512, 32, 64
    tiles = seq // block
    rng = np.random.default_rng(11)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal((1, seq, 1, head_dim)), jnp.float32) for _ in range(4)
    )
    documents = 4
    segments = jnp.asarray(np.repeat(np.arange(documents, dtype=np.int32), seq // documents)[None])

    def visits(**mask):
        tile_visits.clear()

        def attention(q, k, v):
            return pallas_flash.flash_attention(
                q,
                k,
                v,
                is_causal=True,
                backend="triton",
                interpret=True,
                block_sizes=uniform_block_sizes(block),
                **mask,
            )

        out, vjp = jax.vjp(attention, q, k, v)
        jax.block_until_ready((out, vjp(d_out)))
        return len(tile_visits)

    passes = 3  # forward, dK/dV, dQ

    def causal_pairs(n):
        return n * (n + 1) // 2

    # A window of 128 keys to the left: query tile i sees key tiles i - 2 .. i.
    window_pairs = sum(min(i, 128 // block) + 1 for i in range(tiles))
    assert visits() == passes * causal_pairs(tiles)
    assert visits(q_segment_ids=segments) == passes * documents * causal_pairs(tiles // documents)
    assert visits(local_window_size=(128, 0)) == passes * window_pairs
