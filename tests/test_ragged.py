"""ragged_paged_attention against a float64 oracle: mixed batches of decode steps, prefill
chunks and sequences with no new token, padding rows, pages shuffled and partly filled, NaN in
unused pages, past each length and in the padding rows, windows, soft caps, sinks, GQA groups
1-16, H 64/80/128, a value head dim of its own, bf16 and f32; backend="xla", the interpreter
and compiled; the work plan's bounds; the reference gradient; validation; traced values."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS
from support.inputs import case_id
from support.ragged import Case, check, make_problem, run

import pallas_flash
from pallas_flash.triton import ragged as ragged_kernel
from pallas_flash.triton.tiles import RaggedBlockSizes, default_ragged_block_sizes

XLA = BACKEND_PATHS["xla"]
INTERPRET = BACKEND_PATHS["triton-interpret"]
GPU = BACKEND_PATHS["triton"]


CASES = [
    # Decode steps (split in three in the interpreter), a prefill chunk over earlier keys, a
    # sequence with no new token, one whose new tokens are all its keys, padding rows;
    # group 4; pages of 16 (a key tile inside a page).
    Case((1, 37, 0, 1, 5, 1, 19), (50, 60, 9, 1, 5, 77, 19), 8, 2, 64, 16, 5, pad=3),
    # Group 8, a head dim that pads (80 -> 128), pages of 8 (a key tile spans two pages),
    # a window, a soft cap and sinks; sequences with no token first and last.
    Case(
        (0, 3, 1, 26, 0),
        (4, 40, 33, 30, 0),
        8,
        1,
        80,
        8,
        6,
        window=11,
        soft_cap=5.0,
        sinks=True,
    ),
    # MHA in bfloat16 at H=128, a value head dim of its own (64), pages of 48 (no power of
    # two), decode rows of 3 tokens.
    Case((3, 20, 1), (3, 90, 48), 3, 3, 128, 48, 2, value_head_dim=64, pad=2, dtype="bfloat16"),
    # Group 16 (one token fills a decode tile), group 2, H=64 and 128 in both dtypes.
    Case((1, 2, 9, 1), (30, 2, 40, 1), 16, 1, 64, 16, 3, window=5, dtype="bfloat16"),
    Case((1, 4, 33, 0, 1), (64, 20, 50, 7, 9), 4, 2, 128, 16, 4, sinks=True, pad=1),
    Case((1, 1, 1), (70, 5, 128), 32, 8, 128, 32, 4, soft_cap=10.0, dtype="bfloat16"),
]


@pytest.mark.parametrize("c", CASES, ids=case_id)
@pytest.mark.ci_slice(2)
def test_matches_oracle(c):
    """backend="xla" and the kernel in the interpreter, in one jit."""
    args, sinks, oracle_inputs = make_problem(c)
    results = run(c, args, sinks, XLA, INTERPRET)
    check(c, results, oracle_inputs, sinks, ["xla", "interpret"])


# The launches' finishers and the rows of no key: max_query_len drops the prefill launch (the
# decode launch's merge writes the padding's 0); a split prefill launch, finished by its merge,
# beside an unsplit decode launch (its kernel writes the padding's 0); under jit, sequences of
# more new tokens than max_query_len output 0; a group wider than the decode tile.
HINTED = [
    (Case((1, 1, 0, 1, 1), (9, 40, 3, 1, 77), 8, 2, 64, 16, 5, pad=11, sinks=True), None),
    (
        Case((2, 37, 1, 0, 9), (50, 60, 9, 3, 19), 8, 2, 64, 16, 4, pad=3, soft_cap=5.0),
        dict(kv_splits=1, kv_splits_prefill=2),
    ),
    (Case((3, 37, 1, 9, 2), (50, 60, 9, 20, 19), 4, 1, 32, 8, 8, pad=2, sinks=True), None),
    # No sequence is decode-kind (the prefill launch takes them all; the decode launch writes
    # the padding's 0).
    (Case((1, 3, 0, 2), (5, 9, 2, 2), 32, 1, 16, 8, 2, pad=2, sinks=True), None),
]
# The third: sequences 1 and 3 have more (traced: they output 0).
HINTED_MAX = [1, 37, 3, 3]


@pytest.mark.parametrize(
    "c, tiles",
    [
        (dataclasses.replace(c, max_query_len=m), t)
        for (c, t), m in zip(HINTED, HINTED_MAX, strict=True)
    ],
    ids=lambda x: case_id(x) if isinstance(x, Case) else str(x),
)
@pytest.mark.ci_slice(1)
def test_max_query_len_and_finishers_match_oracle(c, tiles):
    args, sinks, oracle_inputs = make_problem(c)
    extra = {}
    if tiles is not None:
        extra["block_sizes"] = dataclasses.replace(
            default_ragged_block_sizes(c.head_dim, jnp.float32, group=1, interpret=True), **tiles
        )
    results = run(c, args, sinks, XLA) + run(c, args, sinks, INTERPRET, **extra)
    check(c, results, oracle_inputs, sinks, ["xla", "interpret"])


def test_decode_only_is_paged_attention():
    """A batch of one new token per sequence is paged_attention's T=1 call on the same pages
    (backend="xla": the two references agree)."""
    c = Case((1, 1, 1, 1), (17, 1, 40, 33), 8, 2, 64, 16, 3, window=9, sinks=True)
    args, sinks, _ = make_problem(c)
    q, k_pages, v_pages, tables, _, lengths = args
    kw = dict(local_window_size=c.window, sinks=sinks, backend="xla", return_residuals=True)
    out, lse = pallas_flash.ragged_paged_attention(*args, **kw)
    want, want_lse = pallas_flash.paged_attention(
        q[:, None], k_pages, v_pages, tables, lengths, **kw
    )
    np.testing.assert_allclose(out, want[:, 0], atol=1e-6)
    np.testing.assert_allclose(lse, want_lse[:, :, 0].T, atol=1e-6)


def test_gradient_through_the_reference():
    """The kernel path differentiates through the reference: its gradients are backend="xla"'s
    (q, both pools and the sinks); unused pages get none."""
    c = Case((1, 6, 0, 2), (9, 6, 3, 20), 4, 2, 32, 8, 3, sinks=True)
    args, sinks, _ = make_problem(c)
    q, k_pages, v_pages, tables, starts, lengths = args
    q = jnp.nan_to_num(q)  # padding rows: a cotangent there must not make NaN
    k_pages, v_pages = jnp.nan_to_num(k_pages), jnp.nan_to_num(v_pages)
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def grads(path):
        def loss(q, k_pages, v_pages, sinks):
            out = pallas_flash.ragged_paged_attention(
                q, k_pages, v_pages, tables, starts, lengths, sinks=sinks, **path.kwargs
            )
            return jnp.sum(out * d_out)

        return jax.grad(loss, argnums=(0, 1, 2, 3))

    both = jax.jit(lambda *a: (grads(INTERPRET)(*a), grads(XLA)(*a)))
    ours, ref = both(q, k_pages, v_pages, sinks)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.all(np.isfinite(a)) and np.any(a != 0)
    used = np.unique(np.asarray(tables)[np.asarray(tables) >= 0])
    unused = np.setdiff1d(np.arange(k_pages.shape[0]), used)
    assert np.all(np.asarray(ours[1])[unused] == 0)


def test_traced_values_are_made_safe():
    """Under jit nothing is checked: query_start_loc is clipped to [0, T] and made
    non-decreasing, rows of no sequence output 0, lengths past the capacity are clipped and
    lengths shorter than the new tokens leave the first tokens without keys, table entries
    are clipped into the pool: both paths agree, and every row is finite."""
    c = Case((2, 3, 4), (10, 20, 30), 4, 1, 32, 8, 4, pad=4)
    args, _, _ = make_problem(c)
    q, k_pages, v_pages, tables, _, _ = (jnp.nan_to_num(x) for x in args)
    # Made [1, 5, 5, 11] of T = 13 rows: row 0 and rows 11-12 in no sequence, sequence 1
    # empty. Sequence 0 (rows 1-4) has 2 keys: its tokens sit at positions -2..1; sequence 2
    # (rows 5-10) the capacity's 32, at positions 26..31.
    starts = jnp.asarray([1, 5, 3, 11], jnp.int32)
    lengths = jnp.asarray([2, 1, 500], jnp.int32)
    tables = tables.at[:, 0].set(jnp.asarray([-4, 1000, 2]))
    arrays = (q, k_pages, v_pages, tables, starts, lengths)
    [(out, lse), (ours, our_lse)] = run(c, arrays, None, XLA, INTERPRET)
    np.testing.assert_allclose(ours, out, atol=2e-5)
    np.testing.assert_allclose(our_lse, lse, atol=2e-5)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out))
    unseen = [0, 1, 2, 11, 12]
    assert not np.isfinite(lse[:, unseen]).any() and np.all(out[unseen] == 0)
    assert np.isfinite(np.delete(lse, unseen, axis=1)).all()


@pytest.mark.parametrize("cache", ["plain", "latent", "float8"])
@pytest.mark.ci_slice(1)
def test_float64_kernel_computes_in_float64(cache):
    """Float64 (x64 on in this test only) in the interpreter, both launches split (their merge
    kernels) and a prefill work list: plain pages, a shared latent cache and float8 pages with
    per-head scales agree with the float64 reference to float64's rounding (float32
    accumulators, or a key scale folded into the logits' scale in float32, would leave ~1e-8)."""
    rng = np.random.default_rng(7)
    tiles = RaggedBlockSizes(
        block_m=16, block_kv=16, kv_splits=2, block_m_prefill=16, block_kv_prefill=16
    )
    tiles = dataclasses.replace(tiles, kv_splits_prefill=2)
    with jax.enable_x64(True):
        starts = jnp.asarray([0, 1, 18, 18, 20])
        lengths = jnp.asarray([24, 17, 5, 20])
        tables = jnp.asarray(np.arange(12).reshape(4, 3)[::-1])
        head_dim = 136 if cache == "latent" else 40
        q = jnp.asarray(rng.standard_normal((23, 8, head_dim)))
        k = jnp.asarray(rng.standard_normal((12, 8, 2 if cache != "latent" else 1, head_dim)))
        v = jnp.asarray(rng.standard_normal((12, 8, 2, 24)))
        kw = {}
        if cache == "latent":
            v, kw = None, dict(value_head_dim=96)
        elif cache == "float8":
            k, v = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
            kw = dict(k_scale=jnp.asarray([0.3, 2.0]), v_scale=0.7)
        call = functools.partial(
            pallas_flash.ragged_paged_attention,
            q,
            k,
            v,
            tables,
            starts,
            lengths,
            sinks=jnp.asarray(rng.standard_normal(8)),
            logits_soft_cap=7.0 if cache == "plain" else None,
            return_residuals=True,
            **kw,
        )
        want = call(backend="xla")
        got = call(interpret=True, block_sizes=tiles)
        for x, y in zip(got, want, strict=True):
            assert x.dtype == jnp.float64
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-13)
    assert not jax.config.jax_enable_x64


# -- the work plan --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group, max_query_len", [(4, None), (1, 5), (16, None), (4, 1), (32, None)]
)
@pytest.mark.ci_slice(2)
def test_plan_covers_every_row_once(group, max_query_len):
    """For random batches of one call's shapes, every packed row of every token is written
    exactly once: by the decode launch (its tile of a decode-kind sequence, or 0 for the rows
    of no sequence, before the first or from the last one's end, and of sequences of more new
    tokens than max_query_len) or by a prefill item of the work list (`plan_items`), within
    its static bound."""
    rng = np.random.default_rng(group)
    num_tokens, batch, capacity = 70, 9, 200
    bs = RaggedBlockSizes(block_m=16, block_m_prefill=32)
    rows, launches = ragged_kernel.ragged_plan(
        num_tokens,
        batch,
        4 * group,
        4,
        64,
        capacity,
        jnp.bfloat16,
        bs,
        max_query_len=max_query_len,
    )
    assert [launch.kind for launch in launches] == ["prefill"] * rows.has_prefill + ["decode"]
    plan_items = jax.jit(ragged_kernel.plan_items, static_argnums=(1, 2))
    for _ in range(10):
        starts = np.sort(rng.integers(0, num_tokens + 1, size=batch + 1))
        starts[1 : rng.integers(1, batch)] = starts[0]  # some sequences with no token
        if rng.random() < 0.5:  # tokens short: 1-3 per sequence
            starts = np.minimum(np.cumsum(rng.integers(0, 4, size=batch + 1)), num_tokens)
        lengths = rng.integers(0, capacity, size=batch)
        covered = np.zeros(num_tokens * group, int)

        def cover(start, packed_rows, covered=covered):
            covered[start * group + packed_rows] += 1

        for launch in launches:
            if launch.kind == "decode":
                for s in range(batch + 2):
                    start, q_len, _ = (int(x) for x in rows.sequence(starts, lengths, s))
                    packed = q_len * group
                    if rows.zeroed(s, packed):
                        cover(start, np.arange(packed))
                    elif s < batch and packed <= rows.decode_rows:
                        assert packed <= launch.block_m
                        cover(start, np.arange(packed))
                continue
            work = np.asarray(plan_items(jnp.asarray(starts, jnp.int32), launch, rows))
            seqs, row0s = work[: launch.items], work[launch.items :]
            used = row0s < ragged_kernel._NO_ROWS
            for seq, row0 in zip(seqs[used], row0s[used], strict=True):
                q_len = starts[seq + 1] - starts[seq]
                assert rows.decode_rows < q_len * group <= rows.prefill_rows
                packed_rows = np.arange(row0, row0 + launch.block_m)
                cover(starts[seq], packed_rows[packed_rows < q_len * group])
        np.testing.assert_array_equal(covered, 1)


def test_plan_launches():
    """Decode-only shapes (and calls whose max_query_len fits a decode tile) take only the
    decode launch; the prefill launch's items bound the tiles of the longest sequences;
    defaults follow the group."""
    plan = functools.partial(
        ragged_kernel.ragged_plan,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        capacity=4096,
        dtype=jnp.bfloat16,
        block_sizes=RaggedBlockSizes(),
    )
    rows, decode_only = plan(4, 4)
    assert [launch.kind for launch in decode_only] == ["decode"] and not rows.has_prefill
    assert decode_only[0].splits > 1  # 4 sequences fill no H100: their keys split
    # 8 tokens may be one sequence's 32 rows: a prefill launch too, unless the call says
    # each sequence has at most 4 (16 rows).
    rows, one_more = plan(8, 8)
    assert [launch.kind for launch in one_more] == ["prefill", "decode"]
    assert rows.decode_rows == 16 and rows.prefill_rows == 32
    rows, hinted = plan(8, 8, max_query_len=4)
    assert [launch.kind for launch in hinted] == ["decode"] and rows.prefill_rows == 16
    rows, one_token = plan(64, 64, max_query_len=1)
    assert [launch.kind for launch in one_token] == ["decode"] and rows.decode_rows == 4
    rows, mixed = plan(2111, 64)
    assert [launch.kind for launch in mixed] == ["prefill", "decode"]
    assert mixed[0].items >= 2048 * 4 // 128 and mixed[0].splits == 1
    # Sequences of at most 8 tokens (32 rows): one 32-row prefill tile each, at most.
    rows, capped = plan(2111, 64, max_query_len=8)
    assert rows.prefill_rows == 32 and capped[0].block_m == 32 and capped[0].items == 64
    assert default_ragged_block_sizes(128, jnp.bfloat16, group=32, interpret=False).block_m == 32
    assert default_ragged_block_sizes(128, jnp.bfloat16, group=2, interpret=False).block_m == 16


# -- validation -----------------------------------------------------------------------------------


def _valid():
    q = jnp.zeros((7, 4, 32))
    pages = jnp.zeros((5, 8, 2, 32))
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    starts = jnp.asarray([0, 3, 6], jnp.int32)
    lengths = jnp.asarray([16, 9], jnp.int32)
    return q, pages, pages, tables, starts, lengths


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=jnp.zeros((7, 4))), ValueError, r"q must have rank 3, got q.shape=\(7, 4\)"),
        (dict(q=jnp.zeros((7, 4, 32), jnp.int32)), TypeError, "q.dtype=int32 must be float"),
        (dict(q=jnp.zeros((7, 4, 32), jnp.bfloat16)), TypeError, "must share a dtype"),
        (dict(q=jnp.zeros((7, 3, 32))), ValueError, "num_heads=3 .* divisible by num_kv_heads=2"),
        (dict(q=jnp.zeros((7, 4, 16))), ValueError, "head dims differ"),
        (dict(v_pages=jnp.zeros((5, 4, 2, 32))), ValueError, "must agree in"),
        (dict(v_pages=jnp.zeros((5, 8, 2, 12))), ValueError, r"head dim 12 \(v_pages.shape"),
        (dict(tables=jnp.zeros((2, 2))), TypeError, "block_tables must be an integer array"),
        (dict(tables=jnp.zeros((2,), jnp.int32)), ValueError, r"block_tables.shape=\(2,\) must"),
        (dict(starts=jnp.asarray([0, 3])), ValueError, r"query_start_loc.shape=\(2,\) must be"),
        (dict(starts=jnp.asarray([1, 3, 6])), ValueError, r"query_start_loc\[0\]=1 must be 0"),
        (
            dict(starts=jnp.asarray([0, 4, 3])),
            ValueError,
            r"non-decreasing: query_start_loc\[1\]=4 > query_start_loc\[2\]=3",
        ),
        (dict(starts=jnp.asarray([0, 3, 8])), ValueError, r"query_start_loc\[-1\]=8 must be at"),
        (dict(lengths=jnp.asarray([16.0, 9.0])), TypeError, "kv_lengths must be an integer"),
        (dict(lengths=jnp.asarray([16])), ValueError, r"kv_lengths.shape=\(1,\) must be \(2,\)"),
        (dict(lengths=jnp.asarray([17, 9])), ValueError, r"kv_lengths=\[17, 9\] must lie in"),
        (dict(lengths=jnp.asarray([16, 2])), ValueError, r"kv_lengths\[1\]=2 must be at least"),
        (
            dict(tables=jnp.asarray([[0, 1], [2, 7]])),
            ValueError,
            r"block_tables\[1, 1\]=7 must lie in \[0, num_pages=5\)",
        ),
        (dict(sinks=jnp.zeros(3)), ValueError, r"sinks.shape=\(3,\) must be \(4,\)"),
        (dict(max_query_len=0), ValueError, "max_query_len=0 must be >= 1"),
        (dict(max_query_len=2.0), TypeError, "max_query_len must be a Python int or None"),
        (
            dict(max_query_len=2),
            ValueError,
            r"max_query_len=2 must be at least .* sequence 0 has query_start_loc\[1\] - "
            r"query_start_loc\[0\] = 3",
        ),
        (dict(scale=-1.0), ValueError, "scale=-1.0 must be a finite positive"),
        (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
        (dict(local_window_size=-1), ValueError, r"local_window_size=\(-1, -1\) must be >= 0"),
        (dict(backend="mosaic"), ValueError, "backend='mosaic' needs a Hopper GPU"),
        (dict(block_sizes=pallas_flash.DecodeBlockSizes()), TypeError, "RaggedBlockSizes"),
        (dict(backend="xla", block_sizes=RaggedBlockSizes()), ValueError, "needs backend="),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_validation(monkeypatch, change, error, match):
    """Each rule, named with the argument and its value, before anything runs."""
    from pallas_flash import ragged

    def must_not_run(*args, **kwargs):
        raise AssertionError("a path was called: validation did not stop the call")

    monkeypatch.setattr(ragged, "_ragged_forward", must_not_run)
    monkeypatch.setattr(ragged, "_ragged_reference", must_not_run)
    q, k_pages, v_pages, tables, starts, lengths = _valid()
    arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, tables=tables, starts=starts)
    arrays["lengths"] = lengths
    options = {}
    for name, value in change.items():
        (arrays if name in arrays else options)[name] = value
    with pytest.raises(error, match=match):
        pallas_flash.ragged_paged_attention(*arrays.values(), **options)


def test_block_sizes_validation():
    with pytest.raises(ValueError, match=r"RaggedBlockSizes.block_m=24 must be a power of two"):
        RaggedBlockSizes(block_m=24)
    with pytest.raises(ValueError, match=r"RaggedBlockSizes.kv_splits_prefill=-1 must be an int"):
        RaggedBlockSizes(kv_splits_prefill=-1)
    with pytest.raises(ValueError, match=r"RaggedBlockSizes.num_warps=3 must be a power of two"):
        RaggedBlockSizes(num_warps=3)


# -- lowering and compiled ------------------------------------------------------------------------


def test_lowers_for_h200():
    """The compiled kernels lower through Triton for an abstract H200, and each launch's rows
    are finished in place (no scatter): through the API with backend="triton" (its default
    tiles for that GPU: the prefill launch in place, the decode launch split and its merge
    kernel; sinks; pages of 16, so that a 64-key tile spans pages), and by default (the
    Mosaic prefill, the same decode launch); unsplit with pages of 128; both launches split, each
    with its merge; and a decode-only batch with max_query_len=1: the decode launch and its
    merge, and in XLA only the safe query starts (one reduce)."""
    from support.lowering import lower_for_h200

    sds = jax.ShapeDtypeStruct
    q, sinks = sds((300, 32, 128), jnp.bfloat16), sds((32,), jnp.float32)
    ints = sds((9,), jnp.int32), sds((8,), jnp.int32)
    tables = sds((8, 40), jnp.int32)

    def api(q, k_pages, v_pages, tables, starts, lengths, sinks, **kw):
        return pallas_flash.ragged_paged_attention(
            q, k_pages, v_pages, tables, starts, lengths, sinks=sinks, **kw
        )

    def kernels(text):
        return re.findall(r'name = \\?"(pallas_flash_ragged\w*)', text)

    pages = sds((400, 16, 8, 128), jnp.bfloat16)
    triton = functools.partial(api, backend="triton")
    text = lower_for_h200(triton, q, pages, pages, tables, *ints, sinks).as_text()
    assert kernels(text) == [
        "pallas_flash_ragged_prefill",
        "pallas_flash_ragged_decode_split",
        "pallas_flash_ragged_decode_merge",
    ]
    assert "scatter" not in text
    # The default on Hopper: the Mosaic prefill (tests/test_mosaic_ragged.py), the same
    # decode launch.
    text = lower_for_h200(api, q, pages, pages, tables, *ints, sinks).as_text()
    assert kernels(text) == ["pallas_flash_ragged_decode_split", "pallas_flash_ragged_decode_merge"]
    assert "mosaic_gpu" in text
    decode_only = functools.partial(api, max_query_len=1)
    lowered = lower_for_h200(decode_only, q, pages, pages, tables, *ints, sinks)
    assert kernels(lowered.as_text()) == [
        "pallas_flash_ragged_decode_split",
        "pallas_flash_ragged_decode_merge",
    ]
    hlo = lowered.compiler_ir("hlo").as_hlo_text()
    assert len(re.findall(r" reduce\(", hlo)) == 1 and "scatter" not in hlo
    pages = sds((400, 128, 8, 128), jnp.bfloat16)
    kw = dict(scale=0.1, soft_cap=None, window_left=None, interpret=False)
    for splits, names in [
        (1, ["pallas_flash_ragged_prefill", "pallas_flash_ragged_decode"]),
        (
            2,
            [
                "pallas_flash_ragged_prefill_split",
                "pallas_flash_ragged_prefill_merge",
                "pallas_flash_ragged_decode_split",
                "pallas_flash_ragged_decode_merge",
            ],
        ),
    ]:
        bs = RaggedBlockSizes(block_kv=128, kv_splits=splits, kv_splits_prefill=splits)
        f = functools.partial(ragged_kernel.ragged_forward, block_sizes=bs, **kw)
        assert kernels(lower_for_h200(f, q, pages, pages, tables, *ints, sinks).as_text()) == names


GPU_CASES = [
    # The mixed batch of the speed goal, smaller: one prefill chunk over earlier keys, decode
    # steps over ragged caches, sequences with no token, padding.
    Case(
        (1000,) + (1,) * 40 + (0, 7),
        (3000,) + tuple(range(100, 4100, 100)) + (50, 2000),
        32,
        8,
        128,
        16,
        250,
        pad=13,
        dtype="bfloat16",
    ),
    Case(
        (1, 700, 1, 300),
        (4000, 700, 9, 2500),
        16,
        1,
        64,
        16,
        250,
        window=300,
        soft_cap=30.0,
        dtype="float16",
    ),
    Case(
        (1,) * 16 + (16,) * 4,
        tuple(range(300, 5100, 300)) + (16, 100, 3000, 5000),
        64,
        4,
        128,
        128,
        40,
        sinks=True,
        dtype="bfloat16",
    ),
    Case((600, 1, 3), (1200, 800, 3), 8, 8, 256, 48, 30, value_head_dim=128, dtype="bfloat16"),
    Case((257, 1, 2), (300, 299, 2), 6, 2, 80, 16, 20, dtype="float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=case_id)
def test_gpu_matches_oracle(c):
    args, sinks, oracle_inputs = make_problem(c)
    results = run(c, args, sinks, XLA, GPU)
    check(c, results, oracle_inputs, sinks, ["xla", "triton"])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bs",
    [
        RaggedBlockSizes(kv_splits=1),
        RaggedBlockSizes(kv_splits=5, kv_splits_prefill=3),
        RaggedBlockSizes(block_m=32, block_kv=32, block_m_prefill=64, block_kv_prefill=128),
    ],
    ids=["unsplit", "split5-prefill-split3", "decode32x32-prefill64x128"],
)
def test_gpu_tiles_and_splits_match_oracle(bs):
    c = GPU_CASES[0]
    args, sinks, oracle_inputs = make_problem(c)
    results = run(c, args, sinks, XLA) + run(c, args, sinks, GPU, block_sizes=bs)
    check(c, results, oracle_inputs, sinks, ["xla", "triton"])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c",
    [
        # A decode step of 40 sequences over ragged caches, padded to a bucket of 48 tokens:
        # the decode launch alone, split, its merge writing the padding's 0.
        Case(
            (1,) * 40,
            tuple(range(100, 4100, 100)),
            32,
            8,
            128,
            16,
            250,
            pad=8,
            dtype="bfloat16",
            max_query_len=1,
        ),
        # Speculative tokens (4 a sequence) over 128-key pages, sinks; two sequences of more
        # tokens than max_query_len output 0.
        Case(
            (4,) * 10 + (9, 6),
            tuple(range(300, 3300, 300)) + (700, 900),
            16,
            4,
            128,
            128,
            30,
            pad=3,
            sinks=True,
            dtype="bfloat16",
            max_query_len=4,
        ),
        dataclasses.replace(GPU_CASES[0], max_query_len=1000),
    ],
    ids=case_id,
)
def test_gpu_max_query_len_matches_oracle(c):
    args, sinks, oracle_inputs = make_problem(c)
    results = run(c, args, sinks, XLA, GPU)
    check(c, results, oracle_inputs, sinks, ["xla", "triton"])
