"""decode_attention / paged_attention against a float64 oracle (ragged lengths, new tokens
aligned to the end of the cache, GQA, windows, soft caps, pages shuffled and partly filled, NaN in
unused cache slots), on the backend matrix (support.backends.backend_paths: backend="xla", the
interpreter, and compiled); write_to_pages; the
reference gradient; validation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS, SWEEP, backend_paths
from support.inputs import case_id

import pallas_flash
from pallas_flash.triton import DecodeBlockSizes
from pallas_flash.triton.tiles import decode_merge

XLA = BACKEND_PATHS["xla"]
GPU = BACKEND_PATHS["triton"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode problem: lengths per sequence (ragged; 0 and < T allowed), capacity S."""

    lengths: tuple[int, ...]
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    page: int | None = None  # page size of a paged cache, None for contiguous
    window: int | None = None
    soft_cap: float | None = None
    dtype: str = "float32"

    def __str__(self):
        s = (
            f"L{'-'.join(map(str, self.lengths))}-T{self.q_len}-N{self.num_heads}"
            f"-K{self.num_kv_heads}-H{self.head_dim}-S{self.capacity}"
        )
        for name in ("page", "window", "soft_cap"):
            if getattr(self, name) is not None:
                s += f"-{name}{getattr(self, name)}"
        return s + f"-{self.dtype}"


CASES = [
    # Group 4, three new tokens (causal among them), a window; one sequence full, one empty,
    # and length 2 < T: token 0 sees no key.
    # A head dim that pads to 128.
    Case((50, 17, 2, 0), 3, 8, 2, 80, 50, window=20),
    # Pages of 16 (a kernel tile inside a page), shuffled, last pages partly filled; soft cap.
    Case((70, 33, 5), 3, 8, 2, 64, 80, page=16, soft_cap=5.0),
    # Pages of 8: a kernel tile spans two pages (gathered rows); group 8.
    Case((37, 20), 1, 8, 1, 32, 40, page=8, window=11),
    # MHA (group 1), a page size that is no power of two.
    Case((90, 49), 2, 4, 4, 32, 96, page=48, soft_cap=3.0),
]


def oracle(q, k, v, lengths, *, scale, soft_cap, window, sinks=None, ahead=None):
    """Float64 decode attention: out [B, T, N, H], lse [B, N, T]. Token t of sequence b sits at
    position L_b - T + t and sees keys max(0, pos - window) <= j <= pos. With sinks [N], each
    row's softmax also has the column sinks[n] (attending to no value). With ahead [B], the
    tokens sit ahead[b] positions further, and see no key at or past L_b."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros((batch, q_len, num_heads, head_dim))
    lse = np.full((batch, num_heads, q_len), -np.inf)
    for b in range(batch):
        for t in range(q_len):
            pos = lengths[b] - q_len + t + (0 if ahead is None else ahead[b])
            lo = 0 if window is None else max(0, pos - window)
            last = min(pos, lengths[b] - 1)
            for n in range(num_heads):
                keys, values = k[b, lo : last + 1, n // group], v[b, lo : last + 1, n // group]
                logits = scale * keys @ q[b, t, n]
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                sink = [] if sinks is None else [float(sinks[n])]
                if last < lo:
                    logits = np.zeros(0)
                if not len(logits) + len(sink):
                    continue
                full = np.concatenate([logits, sink])
                m = full.max()
                p = np.exp(full - m)
                out[b, t, n] = p[: len(logits)] @ values[: len(logits)] / p.sum()
                lse[b, n, t] = m + np.log(p.sum())
    return out, lse


def make_problem(c: Case, seed=0):
    """q, a contiguous cache with NaN past each length, the same keys in shuffled pages (NaN in
    unused rows and pages, garbage in unused table entries), and float64 copies."""
    rng = np.random.default_rng(seed)
    batch = len(c.lengths)
    dtype = jnp.dtype(c.dtype)
    rounded = lambda shape: np.asarray(  # noqa: E731
        jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32), np.float64
    )
    q = rounded((batch, c.q_len, c.num_heads, c.head_dim))
    k = rounded((batch, c.capacity, c.num_kv_heads, c.head_dim))
    v = rounded((batch, c.capacity, c.num_kv_heads, c.head_dim))
    unused = np.arange(c.capacity)[None, :] >= np.asarray(c.lengths)[:, None]
    k_cache = np.where(unused[:, :, None, None], np.nan, k)
    v_cache = np.where(unused[:, :, None, None], np.nan, v)
    problem = dict(
        q=jnp.asarray(q, dtype),
        k=jnp.asarray(k_cache, dtype),
        v=jnp.asarray(v_cache, dtype),
        lengths=jnp.asarray(c.lengths, jnp.int32),
    )
    if c.page is not None:
        max_pages = -(-c.capacity // c.page)
        num_pages = batch * max_pages + 2  # two pages no sequence uses
        tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
        used = np.arange(max_pages)[None, :] < -(-np.asarray(c.lengths)[:, None] // c.page)
        tables = np.where(used, tables, -12345).astype(np.int32)  # garbage: never read
        pages = np.full((2, num_pages, c.page, c.num_kv_heads, c.head_dim), np.nan)
        for b in range(batch):
            for j in range(c.lengths[b]):
                page, row = tables[b, j // c.page], j % c.page
                pages[0, page, row], pages[1, page, row] = k[b, j], v[b, j]
        problem.update(
            k_pages=jnp.asarray(pages[0], dtype),
            v_pages=jnp.asarray(pages[1], dtype),
            tables=jnp.asarray(tables),
        )
    return problem, (q, k, v)


def run(c: Case, problem, *paths, **extra):
    """[(out, lse)] of each path (support.backends.BackendPath), computed in one jit."""

    def call(path):
        kwargs = dict(
            logits_soft_cap=c.soft_cap,
            local_window_size=c.window,
            return_residuals=True,
            **path.kwargs,
            **extra,
        )
        if c.page is None:
            return lambda q, k, v, lengths: pallas_flash.decode_attention(  # noqa: E731
                q, k, v, key_value_seq_lengths=lengths, **kwargs
            )
        return functools.partial(pallas_flash.paged_attention, **kwargs)

    if c.page is None:
        args = (problem["q"], problem["k"], problem["v"], problem["lengths"])
    else:
        keys = ("q", "k_pages", "v_pages", "tables", "lengths")
        args = tuple(problem[key] for key in keys)
    fns = [call(path) for path in paths]
    return jax.jit(lambda *args: [fn(*args) for fn in fns])(*args)


def check_against_oracle(c: Case, results, oracle_inputs, atol=2e-5, sinks=None):
    q, k, v = oracle_inputs
    want_out, want_lse = oracle(
        q,
        k,
        v,
        c.lengths,
        scale=c.head_dim**-0.5,
        soft_cap=c.soft_cap,
        window=c.window,
        sinks=sinks,
    )
    for out, lse in results:
        assert out.shape == q.shape and out.dtype == jnp.dtype(c.dtype)
        assert lse.shape == (len(c.lengths), c.num_heads, c.q_len) and lse.dtype == jnp.float32
        out = np.asarray(out.astype(jnp.float32), np.float64)
        assert np.all(np.isfinite(out)), "NaN from the unused cache slots reached the output"
        np.testing.assert_allclose(out, want_out, atol=atol, rtol=0)
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=atol, rtol=0)


@pytest.mark.parametrize("c", CASES, ids=case_id)
@pytest.mark.parametrize("path", backend_paths())
@pytest.mark.ci_slice(4)
def test_matches_oracle(path, c):
    """Each path (in the interpreter: three splits merged by lse)."""
    problem, oracle_inputs = make_problem(c)
    check_against_oracle(c, run(c, problem, path), oracle_inputs)


@pytest.mark.parametrize("c", CASES[:2], ids=case_id)
@pytest.mark.parametrize("path", backend_paths())
def test_sinks_match_oracle(path, c):
    """Attention sinks on the contiguous and the paged cache: the float64 softmax with a sink
    column; a token that sees no key outputs 0 with lse = its head's sink."""
    problem, oracle_inputs = make_problem(c)
    sinks = jnp.asarray(np.linspace(-2.0, 3.0, c.num_heads), jnp.float32)
    results = run(c, problem, path, sinks=sinks)
    check_against_oracle(c, results, oracle_inputs, sinks=np.asarray(sinks, np.float64))
    if 0 in c.lengths:
        b = c.lengths.index(0)
        for out, lse in results:
            assert np.all(np.asarray(out)[b] == 0)
            want = np.broadcast_to(np.asarray(sinks)[:, None], lse.shape[1:])
            np.testing.assert_array_equal(np.asarray(lse)[b], want)
    with pytest.raises(ValueError, match=r"sinks.shape=\(3,\) must be"):
        run(c, problem, path, sinks=sinks[:3])


@pytest.mark.gpu
def test_bf16_within_twice_the_xla_error():
    c = Case((60, 23), 3, 8, 2, 64, 64, page=16, dtype="bfloat16")
    problem, (q, k, v) = make_problem(c, seed=3)
    want, _ = oracle(q, k, v, c.lengths, scale=c.head_dim**-0.5, soft_cap=None, window=None)
    (xla, _), (ours, _) = run(c, problem, XLA, GPU)
    xla_err = np.max(np.abs(np.asarray(xla.astype(jnp.float32)) - want))
    assert np.max(np.abs(np.asarray(ours.astype(jnp.float32)) - want)) <= 2 * xla_err + 1e-3


def test_unsplit_eager_and_lengths_past_capacity():
    """One program per sequence (no merge; the oracle tests' default tiles split in three).
    Eager calls compile the kernel once. Traced lengths past the capacity are clipped to it:
    nothing is read past the cache."""
    from pallas_flash import _passes

    c = CASES[0]
    assert c.lengths[0] == c.capacity
    problem, oracle_inputs = make_problem(c)
    q, k, v = (problem[x] for x in ("q", "k", "v"))
    call = functools.partial(
        pallas_flash.decode_attention,
        q,
        k,
        v,
        local_window_size=c.window,
        return_residuals=True,
        interpret=True,
        block_sizes=DecodeBlockSizes(block_m=16, block_kv=16, kv_splits=1),
    )
    compiled = _passes._decode_forward._cache_size()
    result = call(key_value_seq_lengths=problem["lengths"])
    call(key_value_seq_lengths=problem["lengths"][::-1])
    assert _passes._decode_forward._cache_size() == compiled + 1
    check_against_oracle(c, [result], oracle_inputs)
    past = jax.jit(lambda lengths: call(key_value_seq_lengths=lengths))
    np.testing.assert_array_equal(past(problem["lengths"].at[0].add(50))[0], result[0])


@pytest.mark.parametrize("path", backend_paths(gpu=False))
def test_traced_lengths_outside_the_cache_are_clamped(path):
    """Lengths under jit are not read: past the capacity they act as the capacity, below 0 as
    0 (no key), on the contiguous and the paged cache (concrete ones raise:
    test_validation_*)."""
    q, k, v, _ = _arrays(t=2, s=16)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
    pages, tables = k.reshape(4, 8, 2, 32), jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    contiguous = jax.jit(
        lambda lengths: pallas_flash.decode_attention(
            q, k, v, key_value_seq_lengths=lengths, return_residuals=True, **path.kwargs
        )
    )
    paged = jax.jit(
        lambda lengths: pallas_flash.paged_attention(
            q, pages, pages, tables, lengths, return_residuals=True, **path.kwargs
        )
    )
    for attend in (contiguous, paged):
        want = attend(jnp.asarray([16, 0]))
        assert np.isneginf(np.asarray(want[1])[1]).all() and np.isfinite(want[1][0]).all()
        for x, y in zip(attend(jnp.asarray([23, -5])), want, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_float64_kernels_compute_in_float64():
    """Float64 (x64 on in this test only) in the interpreter: the split kernel with the XLA
    merge (contiguous) and with the merge kernel (paged, the balanced schedule) agree with the
    float64 reference to float64's rounding (float32 accumulators would leave ~1e-7)."""
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        q = jnp.asarray(rng.standard_normal((2, 2, 4, 16)))
        pages = [jnp.asarray(rng.standard_normal((12, 8, 2, 16))) for _ in range(2)]
        tables = jnp.asarray([[6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5]])
        k, v = (jnp.concatenate([x[6:], x[:6]]).reshape(2, 48, 2, 16) for x in pages)
        lengths = jnp.asarray([45, 30])
        tiles = DecodeBlockSizes(block_m=16, block_kv=16, kv_splits=3)
        calls = {
            "contiguous": lambda **kw: pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=lengths, return_residuals=True, **kw
            ),
            "paged": lambda **kw: pallas_flash.paged_attention(
                q, *pages, tables, lengths, return_residuals=True, **kw
            ),
        }
        for (name, call), merge, schedule in zip(
            calls.items(), ("xla", "kernel"), ("sequence", "balanced"), strict=True
        ):
            want = call(backend="xla")
            split = dataclasses.replace(tiles, merge=merge, schedule=schedule)
            got = call(interpret=True, block_sizes=split)
            for x, y in zip(got, want, strict=True):
                assert x.dtype == jnp.float64, name
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-13, err_msg=name)
    assert not jax.config.jax_enable_x64


def test_gradient_through_the_reference():
    c = Case((20, 9), 2, 4, 2, 32, 24)
    problem, _ = make_problem(c)
    k, v = problem["k"], problem["v"]  # NaN past the lengths: their gradient must stay 0
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(problem["q"].shape), jnp.float32)

    def grads(path):
        def loss(q, k, v):
            out = pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=problem["lengths"], **path.kwargs
            )
            return jnp.sum(out * d_out)

        return jax.grad(loss, argnums=(0, 1, 2))

    interpret = BACKEND_PATHS["triton-interpret"]
    both = jax.jit(lambda *args: (grads(interpret)(*args), grads(XLA)(*args)))
    ours, ref = both(problem["q"], k, v)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.all(np.isfinite(a)) and np.any(a != 0)
    unused = np.arange(c.capacity)[None, :] >= np.asarray(c.lengths)[:, None]
    assert np.all(np.asarray(ours[1])[unused] == 0) and np.all(np.asarray(ours[2])[unused] == 0)


def test_write_to_pages_prefill_then_decode():
    """A ragged prefill and a decode step written into shuffled pages read back as the
    contiguous keys; tokens past `counts` and unused pages stay untouched."""
    rng = np.random.default_rng(0)
    page, max_pages, heads, dim = 4, 3, 2, 8
    tables = jnp.asarray([[5, 0, 3], [1, 4, 2]], jnp.int32)
    pool = jnp.full((7, page, heads, dim), -1.0)
    prompt = jnp.asarray(rng.standard_normal((2, 6, heads, dim)), jnp.float32)
    counts = jnp.asarray([6, 3], jnp.int32)
    k_pages, v_pages = pallas_flash.write_to_pages(
        pool, pool, tables, prompt, -prompt, jnp.zeros(2, jnp.int32), counts=counts
    )
    step = jnp.asarray(rng.standard_normal((2, 1, heads, dim)), jnp.float32)
    k_pages, v_pages = pallas_flash.write_to_pages(k_pages, v_pages, tables, step, -step, counts)
    dense = np.asarray(k_pages)[np.asarray(tables)].reshape(2, max_pages * page, heads, dim)
    np.testing.assert_array_equal(dense[0, :6], prompt[0])
    np.testing.assert_array_equal(dense[0, 6], step[0, 0])
    np.testing.assert_array_equal(dense[1, :3], prompt[1, :3])
    np.testing.assert_array_equal(dense[1, 3], step[1, 0])
    assert np.all(dense[0, 7:] == -1) and np.all(dense[1, 4:] == -1)
    assert np.all(np.asarray(k_pages)[6] == -1)  # no table names page 6
    np.testing.assert_array_equal(v_pages, -k_pages * (k_pages != -1) - (k_pages == -1))


def _small_pool():
    """A pool of 5 pages of 4 rows, two sequences of 3 pages each, and one new token each."""
    pool = jnp.full((5, 4, 2, 8), -1.0)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 1]], jnp.int32)
    new = jnp.ones((2, 2, 2, 8))
    return pool, tables, new


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(positions=[0, -1]), r"positions=\[0, -1\] must be >= 0"),
        (
            dict(positions=[0, 11]),
            r"positions\[1\] \+ T = 11 \+ 2 = 13 must be <= block_tables.shape\[1\] \* "
            r"page_size = 3 \* 4 = 12 \(the slots of sequence 1\)",
        ),
        (
            dict(positions=[11, 0], counts=[2, 2]),
            r"positions\[0\] \+ counts\[0\] = 11 \+ 2 = 13 must be <= ",
        ),
        (dict(positions=[0, 0], counts=[3, 0]), r"counts=\[3, 0\] must lie in \[0, T=2\]"),
        (dict(positions=[0, 0], counts=[0, -1]), r"counts=\[0, -1\] must lie in \[0, T=2\]"),
        (
            dict(positions=[0, 3], tables=[[0, 1, 2], [3, -1, 1]]),
            r"block_tables\[1, 1\]=-1 must lie in \[0, num_pages=5\) \(sequence 1 writes "
            r"positions 3..4\)",
        ),
        (
            dict(positions=[8, 0], tables=[[0, 1, 5], [3, 4, 1]]),
            r"block_tables\[0, 2\]=5 must lie in \[0, num_pages=5\)",
        ),
    ],
    ids=["negative", "past-capacity", "past-capacity-counts", "counts-high", "counts-negative",
         "table-negative", "table-past-pool"],
)  # fmt: skip
def test_write_to_pages_refuses_tokens_it_cannot_place(args, message):
    """Concrete positions, counts and table entries of the pages written are checked: a token
    that has no slot or no page raises, naming the argument, its value and the rule."""
    pool, tables, new = _small_pool()
    tables = jnp.asarray(args.get("tables", tables), jnp.int32)
    counts = args.get("counts")
    counts = None if counts is None else jnp.asarray(counts, jnp.int32)
    positions = np.asarray(args["positions"], np.int32)
    with pytest.raises(ValueError, match=message):
        pallas_flash.write_to_pages(pool, pool, tables, new, new, positions, counts=counts)


def test_write_to_pages_accepts_what_it_can_place():
    """Entries of pages a sequence does not write may hold anything; a count of 0 writes
    nothing at any position up to the capacity; the last slot is writable."""
    pool, _, new = _small_pool()
    tables = jnp.asarray([[0, 1, 2], [-7, 99, 3]], jnp.int32)
    k_pages, _ = pallas_flash.write_to_pages(
        pool, pool, tables, new, new, np.asarray([10, 10]), counts=np.asarray([2, 1])
    )
    np.testing.assert_array_equal(k_pages[2, 2:], 1.0)
    np.testing.assert_array_equal(k_pages[3, 2], 1.0)
    assert int(jnp.sum(k_pages == 1.0)) == 3 * 2 * 8
    k_pages, _ = pallas_flash.write_to_pages(
        pool, pool, tables, new, new, np.asarray([12, 12]), counts=np.asarray([0, 0])
    )
    np.testing.assert_array_equal(k_pages, pool)


def test_write_to_pages_under_jit_drops_what_it_cannot_place():
    """Traced positions and tables: tokens at negative positions, past the sequence's slots or
    on a table entry outside the pool are written nowhere (a negative entry would otherwise
    index the pool from its end); the other tokens land, and no other page changes."""
    pool, tables, new = _small_pool()
    new = new * jnp.arange(1, 3, dtype=jnp.float32)[None, :, None, None]  # token t holds t + 1
    write = jax.jit(
        lambda tables, positions: pallas_flash.write_to_pages(
            pool, pool, tables, new, new, positions
        )[0]
    )
    # Sequence 0: token 0 at -1 (dropped), token 1 at 0; sequence 1: 11 (page 1, row 3), 12
    # (dropped).
    got = np.asarray(write(tables, jnp.asarray([-1, 11], jnp.int32)))
    want = np.asarray(pool).copy()
    want[0, 0], want[1, 3] = 2.0, 1.0
    np.testing.assert_array_equal(got, want)
    # A table entry of -1 and one of 5 (the pool has 5 pages): those tokens go nowhere.
    bad = jnp.asarray([[-1, 1, 2], [3, 5, 1]], jnp.int32)
    got = np.asarray(write(bad, jnp.asarray([2, 3], jnp.int32)))
    want = np.asarray(pool).copy()
    want[3, 3] = 1.0  # sequence 1's token 0 at position 3 (page 3); its token 1 is on page 5
    np.testing.assert_array_equal(got, want)


# -- validation -----------------------------------------------------------------------------------


def _arrays(b=2, t=1, n=4, kh=2, h=32, s=16, dtype=jnp.float32):
    q = jnp.zeros((b, t, n, h), dtype)
    k = jnp.zeros((b, s, kh, h), dtype)
    return q, k, k, jnp.full((b,), s, jnp.int32)


def test_validation_contiguous():
    q, k, v, lengths = _arrays()
    call = functools.partial(pallas_flash.decode_attention, key_value_seq_lengths=lengths)
    with pytest.raises(ValueError, match="query must have rank 4"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match="batch sizes differ"):
        call(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="num_heads=4 .* divisible by num_kv_heads=3"):
        call(q, *(jnp.zeros((2, 16, 3, 32)),) * 2)
    with pytest.raises(ValueError, match="head dims differ"):
        call(q, k[..., :16], v[..., :16])
    with pytest.raises(TypeError, match="must share a dtype"):
        call(q.astype(jnp.bfloat16), k, v)
    with pytest.raises(TypeError, match=r"query.dtype=int32"):
        call(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths=\[17, 16\] must lie in \[0, "):
        pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=jnp.asarray([17, 16]))
    with pytest.raises(ValueError, match="must lie in"):
        pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=jnp.asarray([-1, 16]))
    with pytest.raises(TypeError, match="key_value_seq_lengths must be an integer array"):
        pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths.astype(float))
    with pytest.raises(ValueError, match=r"key_value_seq_lengths.shape=\(3,\) must be \(2,\)"):
        pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=jnp.zeros(3, jnp.int32))
    with pytest.raises(NotImplementedError, match="backend='triton' or None"):
        call(q, k, v, backend="mosaic")
    with pytest.raises(TypeError, match="DecodeBlockSizes"):
        call(q, k, v, block_sizes=pallas_flash.BlockSizes())
    with pytest.raises(ValueError, match="needs backend='triton'"):
        call(q, k, v, backend="xla", block_sizes=DecodeBlockSizes())
    with pytest.raises(ValueError, match="logits_soft_cap"):
        call(q, k, v, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="block_kv=24 must be a power of two"):
        DecodeBlockSizes(block_kv=24)
    with pytest.raises(ValueError, match="schedule='batch' must be 'balanced' or 'sequence'"):
        DecodeBlockSizes(schedule="batch")
    with pytest.raises(ValueError, match="merge='xla' needs schedule='sequence'"):
        DecodeBlockSizes(schedule="balanced", merge="xla")
    with pytest.raises(ValueError, match="split_rule='waves' must be 'slots', 'cores', 'full-"):
        DecodeBlockSizes(split_rule="waves")
    with pytest.raises(ValueError, match="waves=0 must be an int >= 1"):
        DecodeBlockSizes(waves=0)
    with pytest.raises(ValueError, match="ctas_per_sm=-1 must be an int >= 0"):
        DecodeBlockSizes(ctas_per_sm=-1)


def test_validation_paged():
    q, _, _, _ = _arrays()
    pages = jnp.zeros((5, 8, 2, 32))
    tables = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    lengths = jnp.asarray([16, 9], jnp.int32)
    call = pallas_flash.paged_attention
    with pytest.raises(ValueError, match=r"lengths=\[17, 9\] must lie in \[0, block_tables"):
        call(q, pages, pages, tables, jnp.asarray([17, 9]))
    with pytest.raises(ValueError, match=r"block_tables.shape=\(1, 2\) must be \(2, max_pages\)"):
        call(q, pages, pages, tables[:1], lengths)
    with pytest.raises(TypeError, match="block_tables must be an integer array"):
        call(q, pages, pages, tables.astype(float), lengths)
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\]=7 must lie in \[0, num_pages=5\)"):
        call(q, pages, pages, jnp.asarray([[0, 1], [2, 7]]), lengths)
    with pytest.raises(ValueError, match="key_pages.shape=.* value_pages.shape"):
        call(q, pages, pages[:4], tables, lengths)
    with pytest.raises(ValueError, match="key must be"):
        pallas_flash.write_to_pages(pages, pages, tables, jnp.zeros((2, 1, 3, 32)), None, lengths)


def test_lowers_for_h200():
    """The compiled kernel (contiguous and both paged loads) lowers through Triton for an
    abstract H200, with a grid split over the sequence."""
    from support.lowering import lower_for_h200

    from pallas_flash.triton.decode import decode_forward

    sds = jax.ShapeDtypeStruct
    kw = dict(scale=0.1, soft_cap=None, window_left=None, interpret=False)
    q, lengths = sds((2, 4, 32, 128), jnp.bfloat16), sds((2,), jnp.int32)
    calls = [
        (DecodeBlockSizes(), (q, *(sds((2, 8192, 8, 128), jnp.bfloat16),) * 2, lengths)),
        *(
            (
                DecodeBlockSizes(block_kv=64),
                (
                    q,
                    *(sds((300, page, 8, 128), jnp.bfloat16),) * 2,
                    lengths,
                    sds((2, 99), jnp.int32),
                ),
            )
            for page in (16, 128)
        ),
    ]
    # The per-sequence schedule with the merge kernel, the balanced one (merged in the kernel).
    contiguous = calls[0][1]
    calls += [
        (DecodeBlockSizes(merge="kernel"), contiguous),
        (DecodeBlockSizes(split_rule="occupancy", schedule="balanced"), contiguous),
    ]
    for bs, args in calls:
        f = functools.partial(decode_forward, block_sizes=bs, **kw)
        text = lower_for_h200(f, *args).as_text()
        assert "pallas_flash_decode" in text
        # B=2 fills no GPU: every call splits, and merges as its block sizes say.
        assert ("pallas_flash_decode_merge" in text) == (decode_merge(bs) == "kernel")


# -- compiled, larger ----------------------------------------------------------------------------


GPU_CASES = [
    Case((4000, 1, 2500, 777), 1, 32, 8, 128, 4096, dtype="bfloat16"),
    Case((4000, 1, 2500, 777), 16, 32, 2, 128, 4096, dtype="bfloat16", window=1000),
    Case((3000, 45), 4, 16, 4, 256, 3000, page=16, dtype="bfloat16", soft_cap=30.0),
    Case((3000, 45), 1, 8, 8, 64, 3072, page=256, dtype="float16"),
    Case((3000, 45), 3, 64, 4, 128, 3000, page=48, dtype="bfloat16"),
    # 64 packed rows: the default's 32-key tiles in 4 stages, over pages of 16.
    Case((3000, 45, 16), 16, 32, 8, 128, 3008, page=16, dtype="bfloat16"),
    # One long sequence: 20 splits fill under half the slots, the default's 32-key tiles in 4
    # stages (the T=16 group-16 case above takes 128-row tiles).
    Case((20000,), 1, 32, 8, 128, 20480, dtype="bfloat16"),
    # A head dim that pads (80 -> 128) over 32 splits: the merge kernel's column tiles.
    Case((30000,), 1, 32, 8, 80, 32768, dtype="bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=case_id)
def test_gpu_matches_oracle(c):
    problem, (q, k, v) = make_problem(c)
    want, want_lse = oracle(
        q, k, v, c.lengths, scale=c.head_dim**-0.5, soft_cap=c.soft_cap, window=c.window
    )
    (xla, xla_lse), (ours, lse) = run(c, problem, XLA, GPU)
    xla, ours = (np.asarray(x.astype(jnp.float32)) for x in (xla, ours))
    assert np.all(np.isfinite(ours))
    assert np.max(np.abs(ours - want)) <= 2 * np.max(np.abs(xla - want)) + 1e-3
    lse, xla_lse = np.asarray(lse, np.float64), np.asarray(xla_lse, np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    lse_error = np.max(np.abs(lse[seen] - want_lse[seen]))
    assert lse_error <= 2 * np.max(np.abs(xla_lse[seen] - want_lse[seen])) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fields",
    [
        dict(kv_splits=1),
        dict(kv_splits=7),
        dict(merge="kernel"),
        dict(split_rule="full-waves"),
        dict(split_rule="occupancy", schedule="balanced"),
        dict(split_rule="occupancy", waves=2, num_stages=3),
    ],
    ids=case_id,
)
@pytest.mark.parametrize("c", [GPU_CASES[0], GPU_CASES[2]], ids=case_id)
def test_gpu_schedules_match_oracle(c, fields):
    """Every split lever compiled: unsplit, a forced split count, both schedules and merges."""
    problem, (q, k, v) = make_problem(c)
    want, _ = oracle(
        q, k, v, c.lengths, scale=c.head_dim**-0.5, soft_cap=c.soft_cap, window=c.window
    )
    bs = DecodeBlockSizes(block_kv=32 if c.head_dim > 128 else 64, **fields)
    # block_sizes is the kernel's: the XLA reference runs apart.
    [(xla, _)], [(ours, _)] = run(c, problem, XLA), run(c, problem, GPU, block_sizes=bs)
    xla, ours = (np.asarray(x.astype(jnp.float32)) for x in (xla, ours))
    assert np.all(np.isfinite(ours))
    assert np.max(np.abs(ours - want)) <= 2 * np.max(np.abs(xla - want)) + 1e-3


@pytest.mark.parametrize(
    "fields",
    [dict(merge="kernel"), dict(schedule="balanced")],
    ids=["sequence-kernel-merge", "balanced"],
)
def test_schedules_match_oracle(fields):
    """The per-sequence schedule with the merge kernel and the balanced schedule (the default
    tiles run the per-sequence schedule and XLA's merge), on the ragged contiguous case and a
    paged one."""
    path = BACKEND_PATHS["triton-interpret"]
    bs = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, kv_splits=3, **fields)
    for c in (CASES[2], CASES[0]) if SWEEP else (CASES[2],):
        problem, oracle_inputs = make_problem(c)
        check_against_oracle(c, run(c, problem, path, block_sizes=bs), oracle_inputs)


@pytest.mark.parametrize(
    "fields", [dict(), dict(schedule="balanced")], ids=["sequence", "balanced"]
)
@pytest.mark.parametrize("window", [None, 9, 18], ids=["full", "window", "wider-window"])
def test_tokens_ahead_of_the_keys_match_oracle(fields, window):
    """`decode_forward(..., ahead=)`: new tokens that sit ahead[b] positions past a sequence's
    keys (a device holding a sequence's earlier keys of a cache split over its sequence): each
    token sees the keys at or before it (none past the length) and within its window, against
    float64. Aheads of 0, within the tokens (the new tokens straddle the keys' end), and past
    them (every token sees every key, or with the window none), over 3 splits of 16-key tiles
    (a window of 18 holds a whole tile); NaN past each length."""
    from pallas_flash.triton.decode import decode_forward

    rng = np.random.default_rng(11)
    b, t, n, kh, h, s = 5, 3, 4, 2, 32, 40
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, kh, h)).astype(np.float32) for _ in range(2))
    lengths = np.array([40, 17, 33, 1, 0], np.int32)
    ahead = np.array([0, 1, 5, 30, 2], np.int32)
    past = np.arange(s)[None, :, None, None] >= lengths[:, None, None, None]
    k_nan, v_nan = np.where(past, np.nan, k), np.where(past, np.nan, v)
    bs = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, kv_splits=3, **fields)
    out, lse = decode_forward(
        q,
        k_nan,
        v_nan,
        lengths,
        scale=0.2,
        soft_cap=None,
        window_left=window,
        block_sizes=bs,
        interpret=True,
        ahead=ahead,
    )
    want_out, want_lse = oracle(
        q, k, v, lengths, scale=0.2, soft_cap=None, window=window, ahead=ahead
    )
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-5)


def test_tokens_ahead_lower_for_h200():
    """The kernel with `ahead` (lengths and aheads in one operand, the per-sequence and the
    balanced schedules) lowers through Triton for an abstract H200."""
    from support.lowering import lower_for_h200

    from pallas_flash.triton.decode import decode_forward

    sds = jax.ShapeDtypeStruct
    q, rows = sds((2, 4, 32, 128), jnp.bfloat16), sds((2,), jnp.int32)
    cache = sds((2, 8192, 8, 128), jnp.bfloat16)
    for bs in (DecodeBlockSizes(), DecodeBlockSizes(split_rule="occupancy", schedule="balanced")):
        f = functools.partial(
            decode_forward,
            scale=0.1,
            soft_cap=None,
            window_left=100,
            interpret=False,
            block_sizes=bs,
        )
        text = lower_for_h200(
            lambda q, k, v, n, a, f=f: f(q, k, v, n, ahead=a), q, cache, cache, rows, rows
        )
        assert "pallas_flash_decode" in text.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300], ids=["full", "window"])
def test_gpu_tokens_ahead_match_oracle(window):
    """`ahead` compiled (default tiles, bfloat16, splits): as the interpreter's check above."""
    from pallas_flash.triton.decode import decode_forward

    rng = np.random.default_rng(12)
    b, t, n, kh, h, s = 6, 4, 16, 4, 128, 2048
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, kh, h)).astype(np.float32) for _ in range(2))
    lengths = np.array([2048, 1000, 1, 0, 2047, 640], np.int32)
    ahead = np.array([0, 2, 3, 1, 5000, 1], np.int32)
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out, lse = decode_forward(
        q16,
        k16,
        v16,
        lengths,
        scale=h**-0.5,
        soft_cap=None,
        window_left=window,
        block_sizes=DecodeBlockSizes(),
        interpret=False,
        ahead=ahead,
    )
    f64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q16, k16, v16)]
    want_out, want_lse = oracle(
        *f64, lengths, scale=h**-0.5, soft_cap=None, window=window, ahead=ahead
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2)
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], atol=2e-2)


@pytest.mark.parametrize(
    "tiles",
    [(2, 2, 32), (8, 4, 128), (32, 16, 16)],
    ids=["steps-of-2-narrow-columns", "one-step", "chunk-past-the-items"],
)
def test_merge_kernel_matches_xla_merge(tiles):
    """The merge kernel (interpreter) against XLA's merge of the same partial results: several
    steps of items, column tiles over a head dim that pads (80 -> 128), row tiles over 5
    rows, items that saw no key of a row (lse -inf, NaN where they stored nothing) and a row
    no item saw (0, lse -inf)."""
    from pallas_flash.triton.decode import MergeTiles, Schedule, _combine_splits, _merge

    batch, splits, num_kv_heads, num_rows, head_dim = 2, 5, 2, 5, 80
    chunk, block_r, block_c = tiles
    schedule = Schedule("sequence", batch, splits, batch * splits, 64, 1, None, 16, 1, 4)
    rng = np.random.default_rng(3)
    shape = (batch * splits, num_kv_heads, num_rows)
    out = rng.standard_normal((*shape, head_dim)).astype(np.float32)
    lse = (20 * rng.standard_normal(shape)).astype(np.float32)
    log_sum = rng.uniform(0, 3, shape).astype(np.float32)
    unseen = rng.uniform(size=shape) < 0.3
    unseen[:, 1, 4] = True  # row 4 of KV head 1: no item saw a key
    lse[unseen], log_sum[unseen], out[unseen] = -np.inf, 0.0, 0.0
    want = _combine_splits(*(jnp.asarray(x) for x in (out, lse, log_sum)), splits)
    pad = np.full((chunk - 1, *shape[1:]), np.nan, np.float32)
    padded = [
        np.concatenate([x, np.broadcast_to(pad[..., None], (chunk - 1, *x.shape[1:]))])
        if x.ndim == 4
        else np.concatenate([x, pad])
        for x in (out, lse, log_sum)
    ]
    got = _merge(
        jnp.zeros((batch,), jnp.int32),
        *(jnp.asarray(x) for x in padded),
        schedule,
        MergeTiles(chunk, block_r, block_c),
        jnp.float32,
        interpret=True,
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
    assert np.all(np.asarray(got[0])[:, 1, 4] == 0) and np.asarray(got[1])[:, 1, 4].max() == -np.inf


def test_merge_tiles_fit_their_budget():
    """MergeTiles: a sequence's items per step up to 32, narrower columns before fewer rows,
    within 4096 f32 elements per step."""
    from pallas_flash.triton.decode import MergeTiles, Schedule

    def tiles(splits, rows, head_dim):
        schedule = Schedule("sequence", 8, splits, 8 * splits, 32768, 1, None, 64, 1, 512)
        t = MergeTiles.of(schedule, rows, head_dim)
        assert t.chunk * t.block_r * t.block_c <= MergeTiles.BUDGET
        return t.chunk, t.block_r, t.block_c

    assert tiles(32, 4, 128) == (32, 4, 32)  # B=1, 32k keys: 32 splits of a group of 4
    assert tiles(16, 4, 128) == (16, 4, 64)
    assert tiles(4, 64, 128) == (4, 16, 64)  # T=16 over 4 heads per KV head
    assert tiles(3, 1, 80) == (4, 2, 128)
    assert tiles(64, 16, 256) == (32, 8, 16)


def tied_huge_logits_problem(seed=5):
    """A one-token decode (B=2, N=4 over K=2, H=64, float32) whose logits are ~1e7 in KV head 0
    and ~1e9 in KV head 1, against 96 cached keys that hold 32 keys three times each (at j,
    j + 32 and j + 64) with their own values: a split at key 48 gives a row's tied keys to its
    two parts 2:1 or 1:2, so the merge must weigh parts by their denominators (their lse
    rounds them away at these magnitudes)."""
    rng = np.random.default_rng(seed)
    batch, num_heads, num_kv_heads, head_dim, distinct = 2, 4, 2, 64, 32
    magnitude = np.asarray([700.0, 7000.0])[None, None, :, None]  # per KV head
    q = rng.standard_normal((batch, 1, num_heads, head_dim))
    q = q * np.repeat(magnitude, num_heads // num_kv_heads, axis=2)
    k = rng.standard_normal((batch, distinct, num_kv_heads, head_dim)) * magnitude
    k = np.concatenate([k] * 3, axis=1)
    v = rng.standard_normal(k.shape)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize(
    "path, fields",
    [
        (XLA, None),
        (BACKEND_PATHS["triton-interpret"], dict(merge="xla")),
        (BACKEND_PATHS["triton-interpret"], dict(merge="kernel")),
        pytest.param(GPU, dict(merge="xla"), marks=pytest.mark.gpu),
        pytest.param(GPU, dict(merge="kernel"), marks=pytest.mark.gpu),
    ],
    ids=[
        "xla",
        "interpret-xla-merge",
        "interpret-kernel-merge",
        "gpu-xla-merge",
        "gpu-kernel-merge",
    ],
)
def test_split_merge_of_tied_huge_logits(path, fields):
    """Keys tying at their rows' max at |logits| ~1e7 and ~1e9, split 2:1 between two KV
    chunks: out is float64's (each tied key's value weighs 1/3), with either merge."""
    q, k, v = tied_huge_logits_problem()
    lengths = np.asarray([96, 96])
    extra = (
        {}
        if fields is None
        else dict(
            block_sizes=DecodeBlockSizes(
                block_m=16, block_kv=16, num_stages=1, kv_splits=2, **fields
            )
        )
    )
    with path.scope():
        out, lse = pallas_flash.decode_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
            key_value_seq_lengths=jnp.asarray(lengths, jnp.int32),
            scale=1.0,
            return_residuals=True,
            **path.kwargs,
            **extra,
        )
    with np.errstate(over="ignore"):
        want_out, want_lse = oracle(q, k, v, lengths, scale=1.0, soft_cap=None, window=None)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, atol=0, rtol=1e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    "path, fields",
    [
        (XLA, None),
        (BACKEND_PATHS["triton-interpret"], dict(kv_splits=1)),
        (BACKEND_PATHS["triton-interpret"], dict(kv_splits=2, merge="xla")),
        (BACKEND_PATHS["triton-interpret"], dict(kv_splits=2, merge="kernel")),
        (BACKEND_PATHS["triton-interpret"], dict(kv_splits=2, schedule="balanced")),
        pytest.param(GPU, dict(kv_splits=1), marks=pytest.mark.gpu),
        pytest.param(GPU, dict(kv_splits=2, merge="kernel"), marks=pytest.mark.gpu),
    ],
    ids=[
        "xla",
        "interpret-unsplit",
        "interpret-xla-merge",
        "interpret-kernel-merge",
        "interpret-balanced",
        "gpu-unsplit",
        "gpu-kernel-merge",
    ],
)
def test_a_sink_tied_with_a_huge_logit_takes_its_share(path, fields, paged):
    """Two new tokens per head over 32 cached keys whose logits (scale 1) are 1e9 at keys 0 and
    16 (one per page, one per split) and 0 elsewhere, with a sink of 1e9: float32's lse cannot
    hold the keys' log 2, yet the sink takes a third of each row as in float64 (out = a third of
    each tied key's value; lse = 1e9), split or not, contiguous or paged (the kernels return
    the keys' log_sum, which the sink's share is taken from)."""
    magnitude, num_keys, page = 1e9, 32, 16
    rng = np.random.default_rng(13)
    q = jnp.zeros((1, 2, 2, 16), jnp.float32).at[..., 0].set(1.0)
    k = jnp.zeros((1, num_keys, 2, 16), jnp.float32).at[:, (0, page), :, 0].set(magnitude)
    v = jnp.asarray(rng.standard_normal((1, num_keys, 2, 16)), jnp.float32)
    sinks = jnp.full((2,), magnitude, jnp.float32)
    lengths = jnp.asarray([num_keys], jnp.int32)
    kwargs = dict(scale=1.0, sinks=sinks, return_residuals=True, **path.kwargs)
    if fields is not None:
        kwargs["block_sizes"] = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, **fields)
    with path.scope():
        if paged:  # the two pages in reverse order
            pages = lambda x: x[0].reshape(2, page, 2, 16)[::-1]  # noqa: E731
            tables = jnp.asarray([[1, 0]], jnp.int32)
            out, lse = pallas_flash.paged_attention(
                q, pages(k), pages(v), tables, lengths, **kwargs
            )
        else:
            out, lse = pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=lengths, **kwargs
            )
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    tied = np.asarray(v, np.float64)[:, (0, page)].sum(axis=1, keepdims=True)
    want = np.broadcast_to(tied / 3, out.shape)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_allclose(lse, magnitude, rtol=1e-7)
