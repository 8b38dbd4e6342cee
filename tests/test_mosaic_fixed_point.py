"""The per-row fixed-point scales of the deterministic fused dQ (`pallas_flash.mosaic.fixed_point`):
the jnp form against float64 and brute force, and the Pallas kernels (in Pallas' interpreter)
against the jnp form, on odd sizes, masks and extreme rows. The kernels run compiled on the
H200 through the "fixed" cases of test_mosaic_backward_fused_dq."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.lowering import lower_for_h200

from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic.fixed_point import (
    FIXED_POINT_BITS,
    fixed_point_exponents,
    fixed_point_scales,
    l2_norm,
    largest_abs,
    seen_maxima,
)


def test_seen_maxima_are_the_maxima_over_the_keys_each_row_sees():
    """seen_maxima against a brute-force masked max (the mask's geometry), for random T, S,
    causal or not, windows from none to wider than both lengths, inf among the keys: rows past
    the last key, rows a window leaves without keys (0)."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        t, s = (int(x) for x in rng.integers(1, 300, size=2))
        window = None if rng.integers(3) == 0 else tuple(int(x) for x in rng.integers(0, 400, 2))
        spec = MaskSpec(q_len=t, kv_len=s, is_causal=bool(rng.integers(2)), window=window)
        x = np.abs(rng.normal(size=(3, 2, s, 2))) * np.exp(3 * rng.normal(size=(3, 2, s, 2)))
        x.reshape(-1)[rng.integers(x.size)] = np.inf
        x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
        got = np.asarray(seen_maxima(jnp.asarray(x, jnp.float32), spec, axis=2), np.float64)
        visible = np.broadcast_to(spec.geometry(np.arange(t)[:, None], np.arange(s)), (t, s))
        want = np.where(visible[None, None, :, :, None], x[:, :, None], 0.0).max(axis=3)
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want, err_msg=str(spec))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_norms_of_the_fixed_point_bound_match_float64_at_the_edges_of_the_range(dtype):
    """largest_abs and l2_norm (jitted, as in the backward) against float64, rows from 1e-30 to
    float32's largest: the max exactly, |.|_2 within rounding where it is finite in float32, inf
    where it overflows or the row holds NaN or inf. A max from 2^126 on made 1 / max subnormal,
    flushed to zero: |.|_2 read 0."""
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(9, 128)) * np.exp(rng.normal(size=(9, 1)))
    rows[0] *= 1e-30 / np.abs(rows[0]).max()
    rows[1] *= 1e30 / np.abs(rows[1]).max()
    rows[2] *= 3.0e38 / np.abs(rows[2]).max()  # max above 2^127, |.|_2 above float32's
    rows[3] = 0.0
    rows[3, 5] = 3.0e38  # |.|_2 = the max
    rows[4] = 0.0
    rows[5, 7], rows[6, 0], rows[7, 127] = np.nan, np.inf, -np.inf
    x = jnp.asarray(rows, dtype)
    exact = np.asarray(x.astype(jnp.float32), np.float64)
    largest, norm = jax.jit(lambda x: (largest_abs(x), l2_norm(x, largest_abs(x))))(x)
    largest, norm = np.asarray(largest, np.float64), np.asarray(norm, np.float64)
    finite = np.isfinite(exact).all(axis=1)
    np.testing.assert_array_equal(largest[finite], np.abs(exact[finite]).max(axis=1))
    assert (largest[~finite] == np.inf).all() and (norm[~finite] == np.inf).all()
    want = np.sqrt(np.sum(exact[finite] ** 2, axis=1))
    fits = want <= np.finfo(np.float32).max
    np.testing.assert_allclose(norm[finite][fits], want[fits], rtol=1e-6)
    assert (norm[finite][~fits] == np.inf).all() and (~fits).sum() == 1


def test_fixed_point_exponents_of_a_huge_d_out_over_zero_values_are_finite():
    """dO of 1e37 (|dO|_1 past float32, |dO|_2 not) over V of zeros: dP = 0, so dQ is finite
    (0 with delta 0) in float64, and the rows keep a finite bound (inf * 0 was NaN)."""
    b, t, n, h = 1, 64, 2, 64
    k = jnp.asarray(np.random.default_rng(0).normal(size=(b, t, n, h)), jnp.float32)
    v = jnp.zeros((b, t, n, h), jnp.float32)
    d_out = jnp.full((b, t, n, h), 1e37, jnp.float32)
    rows = jnp.zeros((b, n, t), jnp.float32)
    for is_causal in (False, True):
        spec = MaskSpec(q_len=t, kv_len=t, is_causal=is_causal)
        _, finite = fixed_point_exponents(k, v, d_out, rows, rows, spec=spec, num_heads=n)
        assert np.asarray(finite).all()
    # A NaN in a row's dO still takes its bound away.
    d_nan = d_out.at[0, 3, 1, 0].set(jnp.nan)
    _, finite = fixed_point_exponents(k, v, d_nan, rows, rows, spec=spec, num_heads=n)
    assert not finite[0, 1, 3] and np.asarray(finite).sum() == finite.size - 1


@pytest.mark.parametrize(
    "b, s, k_heads, window",
    [(8, 8192, 16, None), (1, 131072, 8, None), (8, 131072, 32, (8192, 8192)), (1, 4096, 8, None)],
)
def test_fixed_point_exponents_trace_at_model_sizes(b, s, k_heads, window):
    """Causal calls of model sizes trace (abstractly), the large ones through lax.cummax."""
    spec = MaskSpec(q_len=s, kv_len=s, is_causal=True, window=window)
    kv = jax.ShapeDtypeStruct((b, s, k_heads, 128), jnp.bfloat16)
    d_out = jax.ShapeDtypeStruct((b, s, 2 * k_heads, 128), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((b, 2 * k_heads, s), jnp.float32)
    exponents, finite = jax.eval_shape(
        functools.partial(fixed_point_exponents, spec=spec, num_heads=2 * k_heads),
        kv,
        kv,
        d_out,
        rows,
        rows,
    )
    assert exponents.shape == finite.shape == (b, 2 * k_heads, s)


def test_fixed_point_exponents_of_a_constant_d_out_are_not_folded_at_compile_time():
    """A loss like out.mean() makes d_out a constant: XLA would fold its norms on the host
    while compiling (29 s at [1, 8192, 16, 128] on this CPU, 4-8 s per layer on the H200's),
    so fixed_point_exponents keeps them as the same reductions as for a d_out argument."""
    b, t, n, h = 1, 64, 2, 64
    spec = MaskSpec(q_len=t, kv_len=t, is_causal=True)
    inputs = (jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16),) * 3
    rows = (jax.ShapeDtypeStruct((b, n, t), jnp.float32),) * 2

    def reductions(fn, *args):
        text = jax.jit(fn).lower(*args).compile().as_text()
        return len(re.findall(r"\breduce\(", text))

    def exponents(k, v, d_out, delta, lse):
        return fixed_point_exponents(k, v, d_out, delta, lse, spec=spec, num_heads=n)

    def constant_d_out(k, v, delta, lse):
        return exponents(k, v, jnp.full((b, t, n, h), 0.5, jnp.bfloat16), delta, lse)

    given = reductions(exponents, *inputs, *rows)
    assert given >= 6  # max |K|; max and |.|_2 of V and of dO; |dO|_1
    assert reductions(constant_d_out, *inputs[:2], *rows) == given


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("t", [96, 300])  # 300 > S: causal rows past the last key see all
@pytest.mark.parametrize("window", [None, (40, 0), (30, 50)])
def test_fixed_point_exponents_bound_every_partial_sum(is_causal, group, t, window):
    """fused_dq "fixed": for every row, 2^e times the largest sum of |dS_ij K_jh| over the keys
    the row sees (what any partial sum of its dQ reaches at most, in float64 from the
    oracle's P and dP) stays under 2^FIXED_POINT_BITS; dQ summed as the kernel does (per block
    of 64 keys, truncated to integers) adds far less error per row than dS's rounding to
    bfloat16 (median 1%); a huge |lse| lowers e; huge keys past a causal row's diagonal leave
    its e as it was; NaN in a row's dO gives it no finite bound. Windows: the keys each row
    sees, none for the last rows when T > S."""
    rng = np.random.default_rng(7)
    b, s, k_heads, h = 2, 256, 2, 64
    n = k_heads * group
    # Rows of widely different magnitudes in q, k, v and dO.
    q = rng.normal(size=(b, t, n, h)) * np.exp(rng.normal(size=(b, t, n, 1)))
    k = rng.normal(size=(b, s, k_heads, h)) * np.exp(rng.normal(size=(b, s, k_heads, 1)))
    v = rng.normal(size=(b, s, k_heads, h)) * np.exp(rng.normal(size=(b, s, k_heads, 1)))
    d_out = rng.normal(size=(b, t, n, h)) * np.exp(2 * rng.normal(size=(b, t, n, 1)))
    d_lse = rng.normal(size=(b, n, t))
    spec = MaskSpec(q_len=t, kv_len=s, is_causal=is_causal, window=window)
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, kk) / 8.0
    visible = np.broadcast_to(spec.geometry(np.arange(t)[:, None], np.arange(s)[None, :]), (t, s))
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)  # rows a window leaves without keys: P = 0
    p = np.exp(logits - top)
    total = p.sum(-1, keepdims=True)
    p /= np.where(total > 0, total, 1.0)
    has_key = visible.any(-1)  # [T]
    out = np.einsum("bnts,bsnh->btnh", p, vv)
    delta = np.einsum("btnh,btnh->bnt", d_out, out) - d_lse
    dp = np.einsum("btnh,bsnh->bnts", d_out, vv)
    ds = p * (dp - delta[..., None])
    worst = np.einsum("bnts,bsnh->bnth", np.abs(ds), np.abs(kk)).max(-1)  # [B, N, T]

    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + top[..., 0]  # -inf without keys

    def exponents(k, v, d_out, lse=lse):
        args = (jnp.asarray(x, jnp.float32) for x in (k, v, d_out, delta, lse))
        e, finite = fixed_point_exponents(*args, spec=spec, num_heads=n)
        return np.asarray(e), np.asarray(finite)

    e, finite = exponents(k, v, d_out)
    assert finite.all()
    units = worst * np.exp2(e)
    assert (units < 2.0**FIXED_POINT_BITS).all(), units.max()
    # dQ as the kernel sums it: dS in bfloat16 (as both backwards take it), per block of 64
    # keys scaled by 2^e, truncated to integers. Its error per row against the same sum in
    # float64 is a small part of what dS's rounding to bfloat16 already costs the row.
    ds16 = np.asarray(jnp.asarray(ds, jnp.bfloat16).astype(jnp.float32), np.float64)
    unit = np.exp2(e)[..., None]
    parts = [
        np.trunc(np.einsum("bnts,bsnh->bnth", ds16[..., j : j + 64], kk[:, j : j + 64]) * unit)
        for j in range(0, s, 64)
    ]
    sums = np.cumsum(parts, axis=0)
    assert np.abs(sums).max() < 2.0**31
    exact = np.einsum("bnts,bsnh->bnth", ds, kk)
    rounded = np.einsum("bnts,bsnh->bnth", ds16, kk)
    fixed_error = np.abs(sums[-1] / unit - rounded).max(-1)[..., has_key]  # per row with keys
    bf16_error = np.abs(rounded - exact).max(-1)[..., has_key]
    assert np.median(fixed_error / bf16_error) <= 0.01, np.median(fixed_error / bf16_error)
    assert (fixed_error <= 0.5 * bf16_error).mean() >= 0.95, np.sort(fixed_error / bf16_error)
    # Rows of a huge |lse|, whose recomputed P the backward lowers its reference for (exp of
    # `_numerics.slack`, up to e^2 here): their e drops to keep the sums in range.
    e_huge, _ = exponents(k, v, d_out, lse=lse + 2.0**23)
    assert (e_huge <= e - 3)[..., has_key].all()
    if is_causal:
        # Keys past row 40's diagonal 1e15 times larger: rows up to 40 keep their e.
        k_huge, v_huge = k.copy(), v.copy()
        k_huge[:, 41:] *= 1e15
        v_huge[:, 41:] *= 1e15
        e_huge, _ = exponents(k_huge, v_huge, d_out)
        np.testing.assert_array_equal(e_huge[..., :41], e[..., :41])
        assert (e_huge[..., 41:] < e[..., 41:] - 80)[..., has_key[41:]].all()
    d_nan = d_out.copy()
    d_nan[0, 5, 1, 3] = np.nan
    _, finite = exponents(k, v, d_nan)
    assert not finite[0, 1, 5] and finite.sum() == finite.size - 1
    # NaN or inf in K or V at key 60 (of KV head 1, batch 1): every row that sees it loses its
    # finite bound (causal: rows 60 on; plain: all of its query heads' rows), the rest keep it.
    heads = np.arange(n) // group == 1
    sees = np.broadcast_to(spec.geometry(np.arange(t), 60), (t,))
    for name, value in (("k", np.nan), ("k", np.inf), ("v", np.nan), ("v", -np.inf)):
        bad = {"k": k.copy(), "v": v.copy()}
        bad[name][1, 60, 1, 7] = value
        _, finite = exponents(bad["k"], bad["v"], d_out)
        lost = np.zeros_like(finite)
        lost[1] = heads[:, None] & sees[None, :]
        np.testing.assert_array_equal(finite, ~lost, err_msg=f"{value} in {name}")


def scales_of(inputs, spec: MaskSpec, *, kernels: bool, scale: float = 1.0, segment_ids=None):
    """fixed_point_scales of inputs (k, v, d_out, delta, lse), jitted, as numpy: (2^e, dQ unit)
    [B, N, T rounded up to 128]; kernels in Pallas' interpreter, or the jnp form."""
    fn = functools.partial(
        fixed_point_scales,
        spec=spec,
        scale=scale,
        rows_out=-(-spec.q_len // 128) * 128,
        kernels=kernels,
        interpret=True,
    )
    return [np.asarray(x) for x in jax.jit(fn)(*inputs, segment_ids=segment_ids)]


# (B, T, S, N, K, H, causal, window): odd lengths, T above and below S, GQA, each head dim the
# fused dQ takes (192 is padded to 256 columns in the kernels), blocks of keys whole and cut.
KERNEL_CASES = [
    (2, 100, 300, 4, 2, 64, True, None),
    (1, 200, 130, 2, 2, 192, False, None),
    (2, 257, 257, 4, 2, 128, True, (40, 0)),
    (1, 64, 500, 2, 1, 64, False, (30, 50)),
    (1, 300, 1000, 2, 1, 256, False, (200, 7)),
    (1, 333, 333, 2, 2, 128, False, None),
    (1, 400, 100, 2, 1, 64, False, (30, 10)),  # rows past S + right see no key
    (1, 300, 700, 2, 1, 64, True, (150, 40)),  # causal with a right reach: right 0
]


def _extreme_inputs(rng, b, t, s, n, k_heads, h, spec):
    """Rows of widely different magnitudes, with: a huge key and a NaN key that some rows
    cannot see (or all can, where every row sees every key), a zero key, a NaN in one row's dO,
    a huge dO row, and lse of -inf (no key), +inf (a sink), NaN, and past 1e8 and 1e30."""
    k = rng.normal(size=(b, s, k_heads, h)) * np.exp(rng.normal(size=(b, s, k_heads, 1)))
    v = rng.normal(size=(b, s, k_heads, h)) * np.exp(rng.normal(size=(b, s, k_heads, 1)))
    d_out = rng.normal(size=(b, t, n, h)) * np.exp(2 * rng.normal(size=(b, t, n, 1)))
    delta = rng.normal(size=(b, n, t)) * 10
    lse = rng.normal(size=(b, n, t)) * 10
    last = s - 1
    k[0, last, 0] *= 1e30
    v[0, last // 2, 0, 3] = np.nan
    k[0, 1, 0] = 0.0
    d_out[0, t // 3, 0, 1] = np.nan
    d_out[0, t // 2, 0] *= 1e30
    lse[0, 0, :5] = (-np.inf, np.inf, np.nan, 3e8, -1e30)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return bf16(k), bf16(v), bf16(d_out), f32(delta), f32(lse)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_give_the_jnp_forms_scales(case):
    """The two Pallas kernels (Pallas' interpreter) against the jnp form: each row's 2^e and
    dQ unit bitwise, NaN and 0 rows included, 0 past T; rows that cannot see the huge or NaN
    key keep their scale (a row's maxima are over the keys it sees, here key by key at the
    mask's boundary and by block maxima inside)."""
    b, t, s, n, k_heads, h, is_causal, window = case
    spec = MaskSpec(q_len=t, kv_len=s, is_causal=is_causal, window=window)
    inputs = _extreme_inputs(np.random.default_rng(t + s), b, t, s, n, k_heads, h, spec)
    scales = functools.partial(scales_of, inputs, spec, scale=0.125)
    (want_scales, want_unit), (got_scales, got_unit) = scales(kernels=False), scales(kernels=True)
    np.testing.assert_array_equal(got_scales, want_scales)
    np.testing.assert_array_equal(got_unit, want_unit)
    assert (got_scales[..., t:] == 0).all() and (got_unit[..., t:] == 0).all()
    unit = got_unit[..., :t]
    # Rows without a finite bound are NaN; rows whose lse is not finite are 0.
    assert np.isnan(unit).any() and (unit == 0).any() and np.isfinite(unit).mean() > 0.5
    assert (unit[0, 0, :3] == 0).all()


# (T, S, causal, window, chunk): geometries whose rows' maxima mix boundary blocks (key by key)
# and whole blocks (by their maxima) of 64 keys; chunk 2 reads the block maxima two at a time, so
# that the whole blocks span several chunks at these lengths.
MAXIMA_CASES = [
    (300, 700, False, None, 128),
    (700, 700, True, None, 2),
    (500, 900, False, (130, 200), 2),
    (450, 300, True, (100, 0), 2),
    (1000, 64, False, (0, 0), 2),  # windows that start past the last key: no whole block
    (333, 1000, True, (1000, 30), 2),
]


@pytest.mark.parametrize("case", MAXIMA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_read_the_maxima_of_the_keys_each_row_sees(monkeypatch, case):
    """Keys of max |K| = 2^p_j (p_j distinct), V of ones, dO = e_0, delta = lse = 0: a row's
    bound is 2^max p over the keys it sees, so its scale 2^e reads that max exactly (e = 29 -
    max p; 120 for a row that sees none). Both forms against brute force over the mask."""
    from pallas_flash.mosaic import fixed_point

    t, s, is_causal, window, chunk = case
    monkeypatch.setattr(fixed_point, "CHUNK", chunk)
    spec = MaskSpec(q_len=t, kv_len=s, is_causal=is_causal, window=window)
    rng = np.random.default_rng(s)
    p = rng.choice(np.arange(-60, 61), size=s, replace=s > 121)
    h = 64
    k = jnp.asarray(np.exp2(p)[None, :, None, None] * np.ones((1, s, 1, h)), jnp.bfloat16)
    v = jnp.ones((1, s, 1, h), jnp.bfloat16)
    d_out = jnp.zeros((1, t, 1, h), jnp.bfloat16).at[..., 0].set(1.0)
    rows = jnp.zeros((1, 1, t), jnp.float32)
    visible = np.broadcast_to(spec.geometry(np.arange(t)[:, None], np.arange(s)[None, :]), (t, s))
    seen = np.where(visible, p[None, :], -1000).max(-1)
    want = np.where(visible.any(-1), 29 - seen, 120)
    for kernels in (False, True):
        scales, _ = scales_of((k, v, d_out, rows, rows), spec, kernels=kernels)
        got = np.log2(np.asarray(scales[0, 0, :t], np.float64))
        np.testing.assert_array_equal(got, want, err_msg=f"kernels={kernels}")


# (T, S, causal, window, documents, sorted): packed documents long enough for whole blocks (2
# documents), short ones (6), and unsorted ids (tiles visited by the hull of their id ranges).
SEGMENT_CASES = [
    (300, 500, False, None, 2, True),
    (400, 400, True, None, 6, True),
    (350, 300, False, (60, 20), 2, True),
    (260, 330, False, None, 3, False),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_read_the_maxima_of_the_keys_of_each_rows_segment(case):
    """As above, with segment ids: documents of random lengths, each batch's own, with padding
    ids past a length (rows and keys of no segment): a row's max over the keys of its segment
    that its geometry lets it see (blocks whole by geometry and segments read by their maxima,
    the rest key by key, blocks no segment of the row reaches skipped). Two batches."""
    from pallas_flash.masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT

    t, s, is_causal, window, documents, in_order = case
    b, h = 2, 64
    spec = MaskSpec(q_len=t, kv_len=s, is_causal=is_causal, window=window, has_segments=True)
    rng = np.random.default_rng(t * s)

    def packed(length, pad_id):
        ids = rng.integers(0, documents, size=(b, length)).astype(np.int32)
        ids = np.sort(ids, axis=1) if in_order else ids
        ids[0, rng.integers(length // 2, length) :] = pad_id  # a length shorter than T or S
        return ids

    q_ids, kv_ids = packed(t, PAD_Q_SEGMENT), packed(s, PAD_KV_SEGMENT)
    p = rng.choice(np.arange(-60, 61), size=(b, s))
    k = jnp.asarray(np.exp2(p)[:, :, None, None] * np.ones((b, s, 1, h)), jnp.bfloat16)
    v = jnp.ones((b, s, 1, h), jnp.bfloat16)
    n = 2  # two query heads read the one KV head
    d_out = jnp.zeros((b, t, n, h), jnp.bfloat16).at[..., 0].set(1.0)
    rows = jnp.zeros((b, n, t), jnp.float32)
    geometry = spec.geometry(np.arange(t)[:, None], np.arange(s)[None, :])
    visible = geometry & (q_ids[:, :, None] == kv_ids[:, None, :])  # [B, T, S]
    seen = np.where(visible, p[:, None, :], -1000).max(-1)
    want = np.where(visible.any(-1), 29 - seen, 120)
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    for kernels in (False, True):
        inputs = (k, v, d_out, rows, rows)
        scales, _ = scales_of(inputs, spec, kernels=kernels, segment_ids=ids)
        got = np.log2(np.asarray(scales[..., :t], np.float64))
        np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape), str(kernels))


def test_kernels_sum_the_l1_norm_of_d_out_in_float32():
    """Rows of dO whose |.|_1 term wins the bound (K and V of ones, dO_i = 1, 1/2, ..., 2^-8):
    |dO|_1 = 2 - 2^-8, which bfloat16 rounds to 2, a bound a binade too high (and, rounded
    down elsewhere, too low): both forms sum it in float32, e = 29."""
    b, t, n, h = 1, 100, 2, 64
    spec = MaskSpec(q_len=t, kv_len=t, is_causal=True)
    ones = jnp.ones((b, t, n, h), jnp.bfloat16)
    row = np.zeros(h)
    row[:9] = np.exp2(-np.arange(9))
    d_out = jnp.asarray(np.broadcast_to(row, (b, t, n, h)), jnp.bfloat16)
    rows = jnp.zeros((b, n, t), jnp.float32)
    for kernels in (False, True):
        scales, _ = scales_of((ones, ones, d_out, rows, rows), spec, kernels=kernels)
        np.testing.assert_array_equal(np.asarray(scales[..., :t]), 2.0**29, err_msg=str(kernels))


@pytest.mark.parametrize("lse", [3e8, -1e12, 3e38])
def test_rows_of_a_huge_lse_keep_a_finite_bound(lse):
    """Past |lse| ~ 1.9e8 the factor by which the recomputed P may exceed the exact one
    overflows float32; each P is clamped to 1, so S bounds the row's sum of P instead: the row
    keeps a finite bound (it read none, a NaN dQ, where float64's is finite), and the bound
    still covers S keys of P = 1."""
    b, t, n, h = 1, 64, 2, 64
    rng = np.random.default_rng(1)
    k, v, d_out = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(3))
    delta = jnp.zeros((b, n, t), jnp.float32)
    spec = MaskSpec(q_len=t, kv_len=t, is_causal=False)
    e, finite = fixed_point_exponents(
        k, v, d_out, delta, jnp.full((b, n, t), lse, jnp.float32), spec=spec, num_heads=n
    )
    assert np.asarray(finite).all()
    # Every key at P = 1 (delta 0): row i's largest partial sum, sum_j |dO_i . V_j| |K_jh|,
    # stays under 2^FIXED_POINT_BITS in units of 2^-e.
    k64, v64, d64 = (np.asarray(x, np.float64) for x in (k, v, d_out))
    dp = np.abs(np.einsum("btnh,bsnh->bnts", d64, v64))
    worst = np.einsum("bnts,bsnh->bnth", dp, np.abs(k64)).max(-1)
    assert (worst * np.exp2(np.asarray(e, np.float64)) < 2.0**FIXED_POINT_BITS).all()


@pytest.mark.parametrize("segments", [False, True])
def test_the_backward_computes_the_scales_in_the_two_kernels(segments):
    """Lowered for an H200 (the Triton modules verified), the "fixed" backward computes the
    scales in the two kernels, no XLA reduction left of them (with segment ids, the tile ranges'
    and the attention kernels' plans aside)."""
    from support.kernels import call_mosaic_backward

    from pallas_flash.device import Device
    from pallas_flash.mosaic import BackwardTiles

    b, t, n, h = 1, 1000, 4, 128
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
    backward = functools.partial(
        call_mosaic_backward,
        scale=0.1,
        is_causal=True,
        tiles=BackwardTiles(fused_dq="fixed"),
        device=Device.h200(),
    )

    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def fn(q, k, v, out, lse, d_out, q_ids, kv_ids):
        segment_ids = (q_ids, kv_ids) if segments else None
        return backward(q, k, v, out, lse, d_out, None, segment_ids=segment_ids)

    text = lower_for_h200(fn, q, q, q, q, lse, q, ids, ids).as_text()
    assert text.count('"pallas_flash_fixed_point_keys"') == 1
    assert text.count('"pallas_flash_fixed_point_rows"') == 1
    assert segments or "stablehlo.reduce" not in text


@st.composite
def scale_problems(draw):
    """A call the row scales take: odd lengths either side of the 64-key blocks, GQA, the fused
    dQ's head dims, causal or not, a window or none, packed documents (sorted or not, with
    lengths) or none, and extreme rows (`_extreme_inputs`) or plain ones."""
    t, s = draw(st.integers(1, 400)), draw(st.integers(1, 400))
    k_heads, group = draw(st.sampled_from([(1, 1), (1, 2), (2, 2)]))
    window = draw(st.none() | st.tuples(st.integers(0, 300), st.integers(0, 300)))
    documents = draw(st.sampled_from([0, 1, 3]))
    return dict(
        b=draw(st.integers(1, 2)),
        t=t,
        s=s,
        k_heads=k_heads,
        n=k_heads * group,
        h=draw(st.sampled_from([64, 128, 192])),
        is_causal=draw(st.booleans()),
        window=window,
        documents=documents,
        in_order=draw(st.booleans()),
        extreme=draw(st.booleans()),
    )


@settings(
    max_examples=int(os.environ.get("PALLAS_FLASH_SWEEP") or 0) or 6,
    derandomize=not os.environ.get("PALLAS_FLASH_SWEEP"),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(c=scale_problems(), seed=st.integers(0, 2**32 - 1))
def test_kernels_give_the_jnp_forms_scales_on_random_calls(c, seed):
    """The kernels (Pallas' interpreter) against the jnp form, bitwise, on random calls (six in
    CI, derandomized; PALLAS_FLASH_SWEEP=N runs N fresh ones)."""
    from pallas_flash.masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT

    rng = np.random.default_rng(seed)
    b, t, s, n, h = c["b"], c["t"], c["s"], c["n"], c["h"]
    spec = MaskSpec(
        q_len=t,
        kv_len=s,
        is_causal=c["is_causal"],
        window=c["window"],
        has_segments=c["documents"] > 0,
    )
    if c["extreme"] and t >= 5 and s >= 2:  # `_extreme_inputs` writes five rows of lse
        inputs = _extreme_inputs(rng, b, t, s, n, c["k_heads"], h, spec)
    else:
        k, v = (rng.normal(size=(b, s, c["k_heads"], h)) for _ in range(2))
        d_out = rng.normal(size=(b, t, n, h))
        delta, lse = rng.normal(size=(b, n, t)), rng.normal(size=(b, n, t))
        inputs = tuple(
            jnp.asarray(x, dtype)
            for x, dtype in zip(
                (k, v, d_out, delta, lse), [jnp.bfloat16] * 3 + [jnp.float32] * 2, strict=True
            )
        )
    segment_ids = None
    if c["documents"]:

        def packed(length, pad_id):
            ids = rng.integers(0, c["documents"], size=(b, length)).astype(np.int32)
            ids = np.sort(ids, axis=1) if c["in_order"] else ids
            ids[0, rng.integers(0, length + 1) :] = pad_id
            return jnp.asarray(ids)

        segment_ids = (packed(t, PAD_Q_SEGMENT), packed(s, PAD_KV_SEGMENT))

    scales = functools.partial(scales_of, inputs, spec, scale=0.125, segment_ids=segment_ids)
    for want, got in zip(scales(kernels=False), scales(kernels=True), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"{c} seed={seed}")
