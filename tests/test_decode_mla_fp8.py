"""The decode calls' cache formats against a float64 oracle: a shared latent cache (MLA: values
are the keys' first value_head_dim columns, H = 576 = 512 + 64 and a smaller analogue whose
pieces pad), float8_e4m3fn caches with per-tensor and per-KV-head scales (extreme ones too),
both together, in decode_attention, paged_attention and ragged_paged_attention (backend="xla"
and the interpreter; compiled where a GPU is); speculative tokens (T = 4 and 16 over 16 query
heads per KV head); write_to_pages' quantisation; validation; lowering for an abstract H200.

The oracle's inputs are the dequantised caches (stored value times scale, in float64): a float8
call must give what dequantising first gives."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS, SWEEP
from support.inputs import case_id

import pallas_flash
from pallas_flash.triton import DecodeBlockSizes, RaggedBlockSizes

XLA = BACKEND_PATHS["xla"]
INTERPRET = BACKEND_PATHS["triton-interpret"]
GPU = BACKEND_PATHS["triton"]
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode problem. value_head_dim: a shared latent cache (no value cache); fp8:
    "tensor" or "head" scales of a float8_e4m3fn cache (None: the query's dtype); page: a paged
    cache's page size (None: contiguous)."""

    lengths: tuple[int, ...]
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    value_head_dim: int | None = None
    fp8: str | None = None
    page: int | None = None
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    dtype: str = "float32"
    extreme: bool = False  # scales far from 1 (per head: tiny and huge)

    @property
    def hv(self) -> int:
        return self.value_head_dim or self.head_dim

    def __str__(self):
        s = (
            f"L{'-'.join(map(str, self.lengths))}-T{self.q_len}-N{self.num_heads}"
            f"-K{self.num_kv_heads}-H{self.head_dim}-S{self.capacity}"
        )
        for name in ("value_head_dim", "fp8", "page", "window", "soft_cap"):
            if getattr(self, name) is not None:
                s += f"-{name}{getattr(self, name)}"
        return s + ("-sinks" if self.sinks else "") + ("-extreme" if self.extreme else "")


def oracle(q, k, v, lengths, *, scale, window=None, soft_cap=None, sinks=None):
    """Float64 decode attention: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> out [B, T,
    N, Hv], lse [B, N, T]. Token t of sequence b sits at L_b - T + t and sees keys
    max(0, pos - window) <= j <= pos; with sinks [N] each row's softmax has one more column."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, num_heads, _ = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros((batch, q_len, num_heads, v.shape[-1]))
    lse = np.full((batch, num_heads, q_len), -np.inf)
    for b in range(batch):
        for t in range(q_len):
            pos = lengths[b] - q_len + t
            lo = 0 if window is None else max(0, pos - window)
            keys = np.arange(lo, pos + 1)
            for n in range(num_heads):
                logits = scale * k[b, keys, n // group] @ q[b, t, n]
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                full = np.concatenate([logits, [] if sinks is None else [sinks[n]]])
                if not len(full):
                    continue
                m = full.max()
                p = np.exp(full - m)
                out[b, t, n] = p[: len(logits)] @ v[b, keys, n // group] / p.sum()
                lse[b, n, t] = m + np.log(p.sum())
    return out, lse


def _scales(c: Case, rng, which: str):
    """A float8 cache's scale (float32: shape () per tensor, (K,) per head) for keys or
    values."""
    if c.fp8 == "tensor":
        return np.float32(0.3 if which == "k" else 0.05)
    if c.extreme:  # per head: tiny and huge, alternating
        big = 40.0 if which == "k" else 3e4
        return np.asarray([1e-4 if h % 2 else big for h in range(c.num_kv_heads)], np.float32)
    return np.asarray(rng.uniform(0.02, 0.5, c.num_kv_heads), np.float32)


def make_problem(c: Case, seed=0):
    """The call's arguments (a dict) and the oracle's float64 (q, k, v) [B, S, K, H|Hv]: the
    caches hold NaN past each length (and in unused pages; garbage in unused table entries,
    pages shuffled); a float8 cache holds random e4m3 values whose dequantised values (times
    the scales) the oracle reads."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(c.dtype)
    batch = len(c.lengths)

    def rounded(shape, to):
        x = jnp.asarray(rng.standard_normal(shape) * (8.0 if to == FP8 else 1.0), jnp.float32)
        return x.astype(to)

    q = rounded((batch, c.q_len, c.num_heads, c.head_dim), dtype)
    cache_dtype = FP8 if c.fp8 else dtype
    shape = (batch, c.capacity, c.num_kv_heads)
    k = rounded((*shape, c.head_dim), cache_dtype)
    v = None if c.value_head_dim else rounded((*shape, c.hv), cache_dtype)
    k_scale = v_scale = None
    k64 = np.asarray(k.astype(jnp.float32), np.float64)
    v64 = None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
    if c.fp8:
        k_scale = _scales(c, rng, "k")
        k64 = k64 * np.broadcast_to(k_scale, (c.num_kv_heads,))[:, None]
        if v is not None:
            v_scale = _scales(c, rng, "v")
            v64 = v64 * np.broadcast_to(v_scale, (c.num_kv_heads,))[:, None]
    if v64 is None:
        v64 = k64[..., : c.hv]
    unused = (np.arange(c.capacity)[None, :] >= np.asarray(c.lengths)[:, None])[..., None, None]
    with_nan = lambda x: jnp.where(unused, jnp.asarray(np.nan, x.dtype), x)  # noqa: E731
    args = dict(
        q=q,
        k=with_nan(k),
        v=None if v is None else with_nan(v),
        lengths=jnp.asarray(c.lengths, jnp.int32),
        value_head_dim=c.value_head_dim,
        k_scale=None if k_scale is None else jnp.asarray(k_scale),
        v_scale=None if v_scale is None else jnp.asarray(v_scale),
    )
    if c.page is not None:
        max_pages = -(-c.capacity // c.page)
        num_pages = batch * max_pages + 2  # two pages no sequence uses
        tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
        used = np.arange(max_pages)[None, :] < -(-np.asarray(c.lengths)[:, None] // c.page)
        tables = np.where(used, tables, -12345).astype(np.int32)  # garbage: never read

        def pages(x):
            if x is None:
                return None
            pool = np.full((num_pages, c.page, *x.shape[2:]), np.nan, np.float32)
            dense = np.asarray(x.astype(jnp.float32))
            for b in range(batch):
                for j in range(c.lengths[b]):
                    pool[tables[b, j // c.page], j % c.page] = dense[b, j]
            return jnp.asarray(pool).astype(x.dtype)

        args.update(k=pages(k), v=pages(v), tables=jnp.asarray(tables))
    sinks = None
    if c.sinks:
        sinks = np.linspace(-2.0, 3.0, c.num_heads).astype(np.float32)
        args["sinks"] = jnp.asarray(sinks)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    return args, (q64, k64, v64), sinks


def run(c: Case, args, *paths, **extra):
    """[(out, lse)] of each path, in one jit."""

    def call(path, a):
        kwargs = dict(
            value_head_dim=a["value_head_dim"],
            k_scale=a["k_scale"],
            v_scale=a["v_scale"],
            sinks=a.get("sinks"),
            logits_soft_cap=c.soft_cap,
            local_window_size=c.window,
            return_residuals=True,
            **path.kwargs,
            **extra,
        )
        if c.page is None:
            return pallas_flash.decode_attention(
                a["q"], a["k"], a["v"], key_value_seq_lengths=a["lengths"], **kwargs
            )
        return pallas_flash.paged_attention(
            a["q"], a["k"], a["v"], a["tables"], a["lengths"], **kwargs
        )

    static = {key: args[key] for key in ("value_head_dim",)}
    arrays = {key: x for key, x in args.items() if key not in static}
    return jax.jit(lambda a: [call(path, {**a, **static}) for path in paths])(arrays)


def check(c: Case, results, oracle_inputs, sinks, names, *, scale=None):
    """Each result against the float64 oracle on the dequantised inputs: float32 queries
    within 2e-5 of the output's largest magnitude; bfloat16 ones within twice the error of the
    reference in bfloat16 (the first result, backend="xla") plus 1e-3 of it. Every output
    finite (NaN in unused slots and pages never reaches a row)."""
    q, k, v = oracle_inputs
    want, want_lse = oracle(
        q,
        k,
        v,
        c.lengths,
        scale=c.head_dim**-0.5 if scale is None else scale,
        window=c.window,
        soft_cap=c.soft_cap,
        sinks=sinks,
    )
    magnitude = max(1.0, np.max(np.abs(want)))
    errors = {}
    for name, (out, lse) in zip(names, results, strict=True):
        assert out.shape == (*q.shape[:3], c.hv) and out.dtype == jnp.dtype(c.dtype), name
        out = np.asarray(out.astype(jnp.float32), np.float64)
        assert np.all(np.isfinite(out)), f"{name}: NaN from unused cache slots reached a row"
        errors[name] = np.max(np.abs(out - want))
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=name)
        finite = np.isfinite(want_lse)
        lse_tol = 2e-5 * max(1.0, np.max(np.abs(want_lse[finite]), initial=0))
        if c.dtype != "float32":
            lse_tol = 2e-2 * max(1.0, np.max(np.abs(want_lse[finite]), initial=0))
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=lse_tol, err_msg=name)
    for name, error in errors.items():
        tol = 2e-5 * magnitude
        if c.dtype != "float32":
            tol = 2 * errors[names[0]] + 1e-3 * magnitude
        assert error <= tol, f"{name}: max error {error} > {tol} ({errors})"


MLA_CASES = [
    # Values the first 96 of 136 columns (pieces of 96 and 40, padded to 128 and 64), 16 heads
    # on one latent head, two new tokens; an empty sequence, one shorter than T... as MLA.
    Case((37, 0, 1), 2, 16, 1, 136, 40, value_head_dim=96, window=20),
    # DeepSeek's shapes (512 + 64) in pages of 16, out of order; a soft cap.
    Case((40, 17), 1, 16, 1, 576, 48, value_head_dim=512, page=16, soft_cap=20.0),
    # Pages of 8 (key tiles gathered across pages), group 4 over two latent heads, sinks.
    Case((30, 9, 0), 3, 8, 2, 136, 32, value_head_dim=96, page=8, sinks=True),
    # Values as wide as the keys: one piece, read once for both.
    Case((21, 6), 2, 8, 1, 64, 24, value_head_dim=64),
]

FP8_CASES = [
    # Extreme per-head scales (1e-4 and 40 for keys, 1e-4 and 3e4 for values), GQA 4, three
    # new tokens, a window; an empty sequence.
    Case((50, 17, 0), 3, 8, 2, 64, 56, fp8="head", window=20, extreme=True),
    # Per-tensor scales, pages of 8 (gathered), bfloat16 queries, a soft cap and sinks.
    Case(
        (33, 12), 2, 8, 2, 80, 40, fp8="tensor", page=8, soft_cap=5.0, sinks=True, dtype="bfloat16"
    ),
    # Per-head scales in pages of 16, one new token.
    Case((40, 25), 1, 4, 2, 32, 48, fp8="head", page=16),
    # float8 with a shared latent cache (k_scale only), bfloat16 queries.
    Case((29, 3), 2, 16, 1, 136, 32, value_head_dim=96, fp8="head", page=16, dtype="bfloat16"),
]


@pytest.mark.parametrize("c", MLA_CASES, ids=case_id)
@pytest.mark.ci_slice(2)
def test_latent_cache_matches_oracle(c):
    """backend="xla" and the kernel in the interpreter (three splits merged), in one jit."""
    args, oracle_inputs, sinks = make_problem(c)
    results = run(c, args, XLA, INTERPRET)
    check(c, results, oracle_inputs, sinks, ["xla", "interpret"])


@pytest.mark.parametrize("c", FP8_CASES, ids=case_id)
@pytest.mark.ci_slice(2)
def test_float8_cache_matches_oracle(c):
    """backend="xla" and the kernel in the interpreter against the oracle on the dequantised
    cache; over pages also with the GPU's 4 stages, whose steps look up the next tile's pages
    (the kernel's lookahead: one key tile a page, or gathered), unsplit so that a program
    steps through several tiles."""
    args, oracle_inputs, sinks = make_problem(c)
    results = run(c, args, XLA, INTERPRET)
    names = ["xla", "interpret"]
    if c.page is not None:
        staged = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=4, kv_splits=1)
        results += run(c, args, INTERPRET, block_sizes=staged)
        names.append("interpret, 4 stages")
    check(c, results, oracle_inputs, sinks, names)


@pytest.mark.parametrize(
    "c",
    [
        # 16 speculative tokens over 16 query heads per KV head: 256 packed rows, 16 tiles.
        Case((60, 16, 40), 16, 16, 1, 64, 64, window=30),
        # 4 tokens in pages of 16, GQA 16 over two KV heads, float8 per head.
        Case((45, 4, 2), 4, 32, 2, 32, 48, page=16, fp8="head"),
    ],
    ids=case_id,
)
@pytest.mark.ci_slice(1)
def test_speculative_tokens_match_oracle(c):
    """T = 4 and 16 new tokens per sequence with 16 query heads per KV head, one shorter than
    T (its first tokens see no key), in the interpreter with 32-row tiles."""
    args, oracle_inputs, sinks = make_problem(c)
    bs = DecodeBlockSizes(block_m=32, block_kv=16, num_stages=1, kv_splits=2)
    [xla] = run(c, args, XLA)
    [ours] = run(c, args, INTERPRET, block_sizes=bs)
    check(c, [xla, ours], oracle_inputs, sinks, ["xla", "interpret"])


def test_speculative_default_tiles():
    """The GPU's default tiles of speculative calls: 128-row tiles from 128 packed rows (T=16
    over 8 or 16 heads per KV head: compute-bound), 64-row tiles of 32 keys in 4 stages from
    64."""
    from pallas_flash.triton.decode import decode_block_sizes

    def tiles(t, n, k):
        return decode_block_sizes(
            (8, t, n, 128), k, 32768, jnp.bfloat16, interpret=False, num_sms=132
        )

    for t, n, k in ((16, 32, 2), (16, 16, 1), (8, 16, 1)):  # 256, 256, 128 rows
        assert tiles(t, n, k).block_m == 128
    assert (tiles(16, 32, 8).block_m, tiles(16, 32, 8).block_kv) == (64, 32)  # 64 rows


def test_default_tiles():
    """The GPU's default tiles: MLA's 128 heads in 64-row tiles of 64 keys in 8 warps (32
    keys over a float8 latent cache, whose 64-key tiles overflow shared memory), 16 heads in
    16-row tiles of 64 keys in 4 warps; float8 caches take the bfloat16 tiles in twice the
    stages; the ragged kernel over MLA's latent cache keeps its prefill tiles at 64 rows (a
    128-row tile's 512 accumulator columns would not fit the registers) and its decode tiles at
    the group's rows."""
    from pallas_flash.triton.cache import CacheFormat
    from pallas_flash.triton.decode import decode_block_sizes
    from pallas_flash.triton.ragged import ragged_block_sizes

    mla = CacheFormat(576, 512, shared=True)
    bf16 = jnp.bfloat16

    def tiles(n, fmt=None, cache_dtype=None, h=576, k=1):
        return decode_block_sizes(
            (64, 1, n, h), k, 4096, bf16, interpret=False, fmt=fmt, cache_dtype=cache_dtype
        )

    assert tiles(128, mla) == DecodeBlockSizes(block_m=64, block_kv=64, num_warps=8)
    assert tiles(128, mla, FP8) == DecodeBlockSizes(
        block_m=64, block_kv=32, num_warps=8, num_stages=4
    )
    assert tiles(16, mla) == DecodeBlockSizes(block_kv=64, num_warps=4)
    assert tiles(32, mla, FP8) == DecodeBlockSizes(block_kv=64, num_warps=8, num_stages=4)
    assert tiles(32, None, FP8, h=128, k=8) == DecodeBlockSizes(block_kv=64, num_stages=4)
    # Pages of 128 take 128-key tiles, in 3 stages over float8 (0.88 of the read ceiling on
    # the H100 against 4 stages' 0.85).
    paged = decode_block_sizes(
        (64, 1, 32, 128), 8, 4096, bf16, interpret=False, cache_dtype=FP8, page_size=128
    )
    assert (paged.block_kv, paged.num_stages) == (128, 3)

    def ragged(n):
        return ragged_block_sizes(
            (300, n, 576), 65, 1, 4096, bf16, interpret=False, page_size=64, fmt=mla
        )

    big, small = ragged(128), ragged(16)
    assert (big.block_m, big.num_warps, big.block_m_prefill, big.num_warps_prefill) == (
        64,
        8,
        64,
        8,
    )
    assert (small.block_m, small.num_warps, small.block_kv_prefill) == (16, 4, 64)
    assert big.block_kv_prefill == 64  # paged_attention's key tile from 64 rows
    float8 = ragged_block_sizes(
        (300, 128, 576), 65, 1, 4096, bf16, interpret=False, page_size=64, fmt=mla, cache_dtype=FP8
    )
    assert float8.block_kv_prefill == 32  # 64-key tiles of a float8 cache: too much SMEM


# -- ragged_paged_attention --------------------------------------------------------------------


def _ragged_problem(c: Case, q_lens, seed=0):
    """A ragged batch on `make_problem`'s paged cache: sequence b brings q_lens[b] new tokens
    (its last keys), their queries concatenated, plus 2 padding rows (NaN). Returns (args,
    the oracle's out [T, N, Hv] and lse [N, T] by `oracle` per sequence)."""
    base = dataclasses.replace(c, q_len=max(q_lens))
    args, (q, k, v), sinks = make_problem(base, seed)
    rows, want, want_lse = [], [], []
    for b, q_len in enumerate(q_lens):
        if not q_len:
            continue
        tokens = slice(base.q_len - q_len, base.q_len)
        rows.append(np.asarray(args["q"].astype(jnp.float32))[b, tokens])
        out, lse = oracle(
            q[b : b + 1, tokens],
            k[b : b + 1],
            v[b : b + 1],
            [c.lengths[b]],
            scale=c.head_dim**-0.5,
            window=c.window,
            soft_cap=c.soft_cap,
            sinks=sinks,
        )
        want.append(out[0])
        want_lse.append(lse[0].T)
    pad = np.full((2, c.num_heads, c.head_dim), np.nan, np.float32)
    q_rows = jnp.asarray(np.concatenate([*rows, pad])).astype(args["q"].dtype)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    want = np.concatenate([*want, np.zeros((2, c.num_heads, c.hv))])
    # Padding rows see no key: lse -inf, or the sink's logit.
    pad_lse = np.full((2, c.num_heads), -np.inf) if sinks is None else np.tile(sinks, (2, 1))
    want_lse = np.concatenate([*want_lse, pad_lse]).T
    call_args = (q_rows, args["k"], args["v"], args["tables"], starts, args["lengths"])
    extra = {key: args[key] for key in ("value_head_dim", "k_scale", "v_scale")}
    return call_args, extra, args.get("sinks"), (want, want_lse)


# Both launches' keys split (their merge kernels), in-page key tiles (pages of 32).
_SPLIT_TILES = RaggedBlockSizes(
    block_m=16,
    block_kv=16,
    kv_splits=2,
    block_m_prefill=16,
    block_kv_prefill=16,
    kv_splits_prefill=3,
)


@pytest.mark.parametrize(
    "c, q_lens, block_sizes",
    [
        # A latent cache: a decode step, a prefill chunk of 9 over earlier keys, nothing.
        (Case((30, 20, 7), 1, 16, 1, 136, 32, value_head_dim=96, page=8), (1, 9, 0), None),
        # float8 per head, GQA 4, a window and sinks: two decode steps and a chunk.
        (
            Case((40, 18, 3), 1, 8, 2, 64, 48, fp8="head", page=16, window=9, sinks=True),
            (1, 12, 1),
            None,
        ),
        # A float8 latent cache (one scale), sinks, split launches.
        (
            Case(
                (40, 33, 20),
                1,
                16,
                1,
                136,
                48,
                value_head_dim=96,
                fp8="tensor",
                page=32,
                sinks=True,
            ),
            (2, 20, 1),
            _SPLIT_TILES,
        ),
    ],
    ids=case_id,
)
@pytest.mark.ci_slice(1)
def test_ragged_formats_match_oracle(c, q_lens, block_sizes):
    """ragged_paged_attention over a latent cache and a float8 one: backend="xla" and the
    interpreter against the oracle, padding rows 0."""
    args, extra, sinks, (want, want_lse) = _ragged_problem(c, q_lens)
    kw = dict(extra, sinks=sinks, local_window_size=c.window, return_residuals=True)

    def both(*args):
        call = functools.partial(pallas_flash.ragged_paged_attention, **kw)
        interpret = call(*args, **INTERPRET.kwargs, block_sizes=block_sizes)
        return call(*args, backend="xla"), interpret

    for name, (out, lse) in zip(["xla", "interpret"], jax.jit(both)(*args), strict=True):
        assert out.shape == want.shape, name
        out = np.asarray(out, np.float64)
        assert np.all(np.isfinite(out)), name
        np.testing.assert_allclose(out, want, atol=2e-5, err_msg=name)
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=name)
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=2e-5, err_msg=name)


# -- write_to_pages ----------------------------------------------------------------------------


def test_write_to_pages_quantises():
    """float8 pages get x / scale rounded to the nearest e4m3 value (ties to even, as numpy's
    ml_dtypes converts), saturated to +-448 (never NaN from a large value), NaN kept; per-head
    and per-tensor scales; a shared latent cache (value_pages None) writes its keys only."""
    rng = np.random.default_rng(0)
    tables = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    pool = jnp.zeros((4, 4, 2, 16), FP8)
    key = rng.standard_normal((2, 3, 2, 16)).astype(np.float32) * 50
    key[0, 0, 0, :4] = [1e6, -1e6, np.nan, 448.0 * 0.5 + 1e-3]  # saturate, keep NaN
    key[1, 2, 1, :2] = [1.0625 * 0.25, 1.1875 * 0.25]  # halfway between e4m3 values at 1
    value = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)
    k_scale = np.asarray([0.5, 0.25], np.float32)
    v_scale = np.float32(0.01)
    positions = jnp.asarray([1, 4], jnp.int32)
    k_pages, v_pages = pallas_flash.write_to_pages(
        pool,
        pool,
        tables,
        jnp.asarray(key),
        jnp.asarray(value, jnp.bfloat16),
        positions,
        k_scale=jnp.asarray(k_scale),
        v_scale=v_scale,
    )
    assert k_pages.dtype == FP8 and v_pages.dtype == FP8

    def expected(x, scale):
        scaled = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[..., None]
        return np.clip(scaled, -448, 448).astype(FP8)  # numpy's (ml_dtypes') rounding

    want_k = expected(key, k_scale)
    want_v = expected(np.asarray(jnp.asarray(value, jnp.bfloat16).astype(jnp.float32)), v_scale)
    dense_k = np.asarray(k_pages)[np.asarray(tables)].reshape(2, 8, 2, 16)
    dense_v = np.asarray(v_pages)[np.asarray(tables)].reshape(2, 8, 2, 16)
    for b, p in enumerate((1, 4)):
        for got, want in ((dense_k, want_k), (dense_v, want_v)):
            np.testing.assert_array_equal(got[b, p : p + 3].view(np.uint8), want[b].view(np.uint8))
    assert float(dense_k[0, 1, 0, 0]) == 448.0 and float(dense_k[0, 1, 0, 1]) == -448.0
    assert np.isnan(float(dense_k[0, 1, 0, 2]))
    assert float(dense_k[1, 6, 1, 0]) == 1.0 and float(dense_k[1, 6, 1, 1]) == 1.25  # to even
    # A shared latent cache: one pool.
    latent, none = pallas_flash.write_to_pages(
        pool, None, tables, jnp.asarray(key), None, positions, k_scale=jnp.asarray(k_scale)
    )
    assert none is None
    np.testing.assert_array_equal(
        np.asarray(latent).view(np.uint8), np.asarray(k_pages).view(np.uint8)
    )


def test_gradient_through_the_reference():
    """A latent cache in float8 differentiates through the reference (q and its scale): the
    interpreter's loss (the kernel's forward) and gradients are backend="xla"'s; the per-head
    key scale gets one."""
    c = Case((20, 9), 2, 8, 1, 136, 24, value_head_dim=96, fp8="head")
    args, _, _ = make_problem(c)
    k = jnp.nan_to_num(args["k"])  # a gradient through NaN slots would be NaN
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal((2, 2, 8, 96)), jnp.float32)

    def grads(path):
        def loss(q, k_scale):
            out = pallas_flash.decode_attention(
                q,
                k,
                None,
                key_value_seq_lengths=args["lengths"],
                value_head_dim=96,
                k_scale=k_scale,
                **path.kwargs,
            )
            return jnp.sum(out * d_out)

        return jax.value_and_grad(loss, argnums=(0, 1))

    (ours_loss, ours), (ref_loss, ref) = jax.jit(lambda *a: (grads(INTERPRET)(*a), grads(XLA)(*a)))(
        args["q"], args["k_scale"]
    )
    np.testing.assert_allclose(ours_loss, ref_loss, rtol=1e-5)
    assert ours[1].shape == (1,)  # a per-head scale's gradient
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.all(np.isfinite(a)) and np.any(a != 0)


# -- validation --------------------------------------------------------------------------------


def test_validation():
    q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
    k8 = jnp.zeros((2, 16, 2, 64), FP8)
    k = jnp.zeros((2, 16, 2, 64), jnp.bfloat16)
    lengths = jnp.full((2,), 16, jnp.int32)
    call = functools.partial(pallas_flash.decode_attention, key_value_seq_lengths=lengths)
    with pytest.raises(ValueError, match="float8_e4m3fn needs k_scale and v_scale"):
        call(q, k8, k8)
    with pytest.raises(ValueError, match="float8_e4m3fn needs v_scale"):
        call(q, k8, k8, k_scale=1.0)
    with pytest.raises(ValueError, match="k_scale is for float8_e4m3fn caches"):
        call(q, k, k, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"k_scale.shape=\(3,\) must be \(\) .* or \(2,\)"):
        call(q, k8, k8, k_scale=jnp.ones(3), v_scale=1.0)
    with pytest.raises(TypeError, match="v_scale.dtype=int32 must be a floating dtype"):
        call(q, k8, k8, k_scale=1.0, v_scale=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match=r"k_scale=\[0.0, 1.0\] must be finite and > 0"):
        call(q, k8, k8, k_scale=jnp.asarray([0.0, 1.0]), v_scale=1.0)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        call(q, k8, k8, k_scale=float("nan"), v_scale=1.0)
    with pytest.raises(TypeError, match="must share a dtype, or the caches both be float8_e4m3fn"):
        call(q, k8, k)
    e5m2 = jnp.zeros((2, 16, 2, 64), jnp.float8_e5m2)
    with pytest.raises(TypeError, match="key_cache.dtype=float8_e5m2 must be float16"):
        call(q, e5m2, e5m2, k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="query.dtype=float8_e4m3fn"):
        call(q.astype(FP8), k8, k8, k_scale=1.0, v_scale=1.0)
    # A shared latent cache.
    latent = jnp.zeros((2, 16, 1, 576), jnp.bfloat16)
    q576 = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="value_cache=None .* needs value_head_dim"):
        call(q576, latent, None)
    with pytest.raises(ValueError, match="value_head_dim=512 is for a shared latent cache"):
        call(q576[..., :64], k, k, value_head_dim=512)
    with pytest.raises(ValueError, match="value_head_dim=520 must be a multiple of 8 in"):
        call(q576, latent, None, value_head_dim=520)
    with pytest.raises(ValueError, match="value_head_dim=100 must be a multiple of 8"):
        call(q576, latent, None, value_head_dim=100)
    with pytest.raises(TypeError, match="value_head_dim=512.0 must be an int"):
        call(q576, latent, None, value_head_dim=512.0)
    with pytest.raises(ValueError, match="at most value_head_dim \\+ 256"):
        call(q576, latent, None, value_head_dim=256)
    with pytest.raises(ValueError, match="v_scale is for a value cache of its own"):
        call(q576, latent.astype(FP8), None, value_head_dim=512, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="head_dim=576 .* at most 256"):
        call(q576, latent, latent)
    # paged, ragged and write_to_pages take the same rules.
    pages8 = jnp.zeros((4, 8, 2, 64), FP8)
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    with pytest.raises(ValueError, match="key_pages.dtype=float8_e4m3fn needs k_scale"):
        pallas_flash.paged_attention(q, pages8, pages8, tables, lengths)
    with pytest.raises(ValueError, match="k_pages.dtype=float8_e4m3fn needs k_scale"):
        pallas_flash.ragged_paged_attention(
            q[:, 0], pages8, pages8, tables, jnp.asarray([0, 1, 2]), lengths
        )
    with pytest.raises(ValueError, match="v_pages=None .* needs value_head_dim"):
        pallas_flash.ragged_paged_attention(
            q[:, 0], pages8, None, tables, jnp.asarray([0, 1, 2]), lengths, k_scale=1.0
        )
    new = jnp.zeros((2, 1, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="key_pages.dtype=float8_e4m3fn needs k_scale"):
        pallas_flash.write_to_pages(pages8, pages8, tables, new, new, lengths)
    with pytest.raises(TypeError, match="key.dtype=int32 must be float16, bfloat16 or float32"):
        pallas_flash.write_to_pages(
            pages8, pages8, tables, new.astype(jnp.int32), new, lengths, k_scale=1.0, v_scale=1.0
        )
    with pytest.raises(ValueError, match="value_pages=None .* takes value=None"):
        pallas_flash.write_to_pages(pages8, None, tables, new, new, lengths, k_scale=1.0)


def test_product_queries_scale_exactly():
    """bfloat16 queries over a float8 cache take float16 products: each row scaled by a power of
    two to a largest magnitude in [2^14, 2^15), so that q = q16 * unscale exactly for every
    element above 2^-28 of its row's largest, from rows of 1e-25 to 1e35 (and a zero row);
    other queries and caches are unchanged."""
    from pallas_flash.triton.cache import product_queries

    rng = np.random.default_rng(0)
    mags = np.array([1e-25, 3e-20, 1e-6, 0.7, 1.0, 2.0**15, 6e4, 1e20, 1e35, 0.0])
    q = rng.uniform(-1.0, 1.0, (mags.size, 40)) * mags[:, None]
    q[:, 0] = mags  # each row's largest magnitude, exactly
    q[:, 1] = mags * 2.0**-27  # the smallest that stays exact
    q = jnp.asarray(q, jnp.bfloat16)
    pieces = [q[:, :32], q[:, 32:]]  # a latent cache's two pieces share the row's scale
    (q0, q1), unscale = product_queries(pieces, FP8)
    assert q0.dtype == q1.dtype == jnp.float16 and unscale.shape == (mags.size, 1)
    q16 = np.concatenate([np.asarray(q0, np.float32), np.asarray(q1, np.float32)], axis=1)
    big = np.abs(q16).max(axis=1)
    assert np.all((big >= 2.0**14) & (big < 2.0**15) | (mags == 0))
    np.testing.assert_array_equal(q16 * np.asarray(unscale), np.asarray(q, np.float32))
    for dtype, cache in ((jnp.float16, FP8), (jnp.float32, FP8), (jnp.bfloat16, jnp.bfloat16)):
        same, none = product_queries([q.astype(dtype)], cache)
        assert none is None and same[0].dtype == dtype


def test_float8_needs_compute_capability_8_9():
    """On an A100 (8.0) a float8 cache runs the reference where no backend was named, and
    backend="triton" says why not."""
    from pallas_flash import device as device_lib

    a100 = device_lib.Device(kind="NVIDIA A100", compute_capability=(8, 0), num_sms=108)
    q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    k8 = jnp.zeros((1, 16, 2, 64), FP8)
    lengths = jnp.full((1,), 16, jnp.int32)
    call = functools.partial(
        pallas_flash.decode_attention, key_value_seq_lengths=lengths, k_scale=1.0, v_scale=1.0
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_lib, "target_device", lambda: a100)
        with pytest.raises(ValueError, match=r"float8_e4m3fn caches on GPUs of compute capab"):
            call(q, k8, k8, backend="triton")
        text = str(jax.make_jaxpr(lambda q, k: call(q, k, k))(q, k8))
        assert "pallas_call" not in text


# -- lowering for an abstract H200 -------------------------------------------------------------


def test_lowers_for_h200():
    """The compiled kernels lower through Triton for an abstract H200 (Triton's rules: power
    -of-two tiles, 2-D dots; float8 conversion at compute capability 9.0), their modules
    verified: MLA's 576 = 512 + 64 contiguous and paged (gathered key tiles) in bfloat16 and
    paged (in-page tiles) in float8, a float8 cache of its own, and the ragged launches over a
    float8 latent cache."""
    from support.lowering import lower_for_h200

    from pallas_flash.triton.decode import decode_forward
    from pallas_flash.triton.ragged import ragged_forward

    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    kw = dict(scale=0.1, soft_cap=None, window_left=None, interpret=False)
    lengths, tables = sds((4,), jnp.int32), sds((4, 40), jnp.int32)
    scale = sds((1,), jnp.float32)
    q = sds((4, 2, 128, 576), bf16)
    mla = DecodeBlockSizes(block_m=64, block_kv=64, num_warps=8, num_stages=2)
    mla_fp8 = DecodeBlockSizes(block_m=64, block_kv=32, num_warps=8, num_stages=4)
    calls = [  # (tiles, the operands, the scales or (), value_head_dim)
        (mla, (q, sds((4, 2048, 1, 576), bf16), None, lengths, None), (), 512),
        (mla, (q, sds((2000, 16, 1, 576), bf16), None, lengths, tables), (), 512),
        (mla_fp8, (q, sds((700, 64, 1, 576), FP8), None, lengths, tables), (scale, scale), 512),
    ]
    cache = sds((300, 16, 8, 128), FP8)
    per_head = (sds((8,), jnp.float32),) * 2
    q_gqa, tables_gqa = sds((4, 1, 32, 128), bf16), sds((4, 8), jnp.int32)
    calls.append(
        (DecodeBlockSizes(num_stages=4), (q_gqa, cache, cache, lengths, tables_gqa), per_head, None)
    )
    for bs, operands, scales, hv in calls:

        def f(*args, bs=bs, hv=hv):
            q, k, v, lengths, tables, *scales = args
            kwargs = dict(zip(("k_scale", "v_scale"), scales, strict=False))
            return decode_forward(
                q, k, v, lengths, tables, block_sizes=bs, value_head_dim=hv, **kw, **kwargs
            )

        text = lower_for_h200(f, *operands, *scales).as_text()
        assert "pallas_flash_decode" in text
    # Ragged: 1 prefill chunk and decode steps over MLA's latent pages, in float8.
    ragged = RaggedBlockSizes(
        block_m=64,
        block_kv=32,
        num_warps=8,
        num_stages=2,
        block_m_prefill=64,
        block_kv_prefill=32,
        num_warps_prefill=8,
        num_stages_prefill=2,
    )
    f = functools.partial(ragged_forward, block_sizes=ragged, value_head_dim=512, **kw)
    args = (
        sds((40, 128, 576), bf16),
        sds((700, 64, 1, 576), FP8),
        None,
        sds((8, 40), jnp.int32),
        sds((9,), jnp.int32),
        sds((8,), jnp.int32),
        None,
        scale,
        scale,
    )
    assert "pallas_flash_ragged" in lower_for_h200(f, *args).as_text()


# -- compiled ----------------------------------------------------------------------------------

GPU_CASES = [
    # DeepSeek's MLA decode: 128 heads on one latent head of 576, values 512, T = 1 and 2.
    Case((3000, 1, 2500, 777), 1, 128, 1, 576, 3072, value_head_dim=512, page=64, dtype="bfloat16"),
    Case((3000, 45), 2, 128, 1, 576, 3000, value_head_dim=512, dtype="bfloat16"),
    # 64-key tiles gathered from pages of 16.
    Case((3000, 45), 1, 128, 1, 576, 3008, value_head_dim=512, page=16, dtype="bfloat16"),
    Case(
        (3000, 45),
        1,
        128,
        1,
        576,
        3008,
        value_head_dim=512,
        page=16,
        fp8="tensor",
        dtype="bfloat16",
    ),
    # float8 caches of their own, per head, GQA 4 and MHA.
    Case((4000, 1, 2500, 777), 1, 32, 8, 128, 4096, fp8="head", dtype="bfloat16"),
    Case((3000, 45), 4, 16, 16, 64, 3072, page=16, fp8="tensor", soft_cap=30.0, dtype="bfloat16"),
    # Speculative: 16 tokens over 16 heads per KV head (256 rows: two 128-row tiles).
    Case((3000, 45, 16), 16, 32, 2, 128, 3008, page=16, dtype="bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=case_id)
def test_gpu_matches_oracle(c):
    args, oracle_inputs, sinks = make_problem(c)
    results = run(c, args, XLA, GPU)
    check(c, results, oracle_inputs, sinks, ["xla", "gpu"])


@pytest.mark.gpu
def test_gpu_ragged_latent_cache_matches_oracle():
    """ragged_paged_attention over MLA's latent pages: a 300-token prefill chunk and decode
    steps, bfloat16, compiled, against the oracle within twice the reference's error."""
    c = Case(
        (900, 300, 2000, 64), 1, 128, 1, 576, 2048, value_head_dim=512, page=64, dtype="bfloat16"
    )
    args, extra, sinks, (want, _) = _ragged_problem(c, (1, 300, 1, 2))
    call = functools.partial(pallas_flash.ragged_paged_attention, **extra)
    xla, ours = (
        np.asarray(jax.jit(functools.partial(call, backend=b))(*args).astype(jnp.float32))
        for b in ("xla", "triton")
    )
    assert np.all(np.isfinite(ours))
    assert np.max(np.abs(ours - want)) <= 2 * np.max(np.abs(xla - want)) + 1e-3


if SWEEP:

    @pytest.mark.parametrize("c", MLA_CASES + FP8_CASES, ids=case_id)
    def test_default_interpreter_tiles_match_oracle(c):
        """The sweep: every case with one program per sequence (no merge)."""
        args, oracle_inputs, sinks = make_problem(c)
        bs = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, kv_splits=1)
        [xla] = run(c, args, XLA)
        [ours] = run(c, args, INTERPRET, block_sizes=bs)
        check(c, [xla, ours], oracle_inputs, sinks, ["xla", "interpret"])
