"""What the ragged paged attention tests share (tests/test_ragged.py, tests/test_mosaic_ragged.py):
a batch (`Case`), its arguments with NaN where nothing may read and their float64 copies, the
float64 oracle, the paths' results in one jit and the check of each against the oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: new tokens and keys (the new ones included) per sequence, `pad` rows of q
    past the last sequence's, pages of `page` keys, `max_pages` per table row."""

    q_lens: tuple[int, ...]
    lengths: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page: int
    max_pages: int
    value_head_dim: int | None = None
    pad: int = 0
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    dtype: str = "float32"
    max_query_len: int | None = None

    @property
    def hv(self) -> int:
        return self.value_head_dim or self.head_dim

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens) + self.pad

    def __str__(self):
        s = (
            f"Q{_short(self.q_lens)}-L{_short(self.lengths)}"
            f"-N{self.num_heads}-K{self.num_kv_heads}-H{self.head_dim}-page{self.page}"
        )
        for name in ("value_head_dim", "pad", "window", "soft_cap", "max_query_len"):
            if getattr(self, name):
                s += f"-{name}{getattr(self, name)}"
        return s + ("-sinks" if self.sinks else "") + f"-{self.dtype}"


def _short(xs) -> str:
    """A case id's list of numbers: all of them, or for a long one its first three, count and
    sum."""
    if len(xs) <= 8:
        return "-".join(map(str, xs))
    return f"{'-'.join(map(str, xs[:3]))}-..{len(xs)}-sum{sum(xs)}"


def oracle(c: Case, q, k, v, sinks=None):
    """Float64 ragged attention: out [T, N, Hv], lse [N, T]. New token i of sequence b sits at
    position L_b - q_len_b + i and sees keys max(0, pos - window) <= j <= pos of its (dense)
    cache k[b], v[b]; with sinks [N] each row's softmax has one more column. Rows of no
    sequence (padding), and of a sequence of more new tokens than max_query_len, output 0 with
    lse -inf (the sink with sinks)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[2]
    scale = c.head_dim**-0.5
    out = np.zeros((num_tokens, num_heads, c.hv))
    lse = np.full((num_heads, num_tokens), -np.inf)
    start = 0
    for b, (q_len, length) in enumerate(zip(c.q_lens, c.lengths, strict=True)):
        if c.max_query_len is not None and q_len > c.max_query_len:
            start += q_len
            continue
        for i in range(q_len):
            pos = length - q_len + i
            lo = 0 if c.window is None else max(0, pos - c.window)
            keys = np.arange(lo, pos + 1)
            for n in range(num_heads):
                logits = scale * k[b, keys, n // group] @ q[start + i, n]
                if c.soft_cap is not None:
                    logits = c.soft_cap * np.tanh(logits / c.soft_cap)
                full = np.concatenate([logits, [] if sinks is None else [sinks[n]]])
                if not len(full):
                    continue
                m = full.max()
                p = np.exp(full - m)
                out[start + i, n] = p[: len(logits)] @ v[b, keys, n // group] / p.sum()
                lse[n, start + i] = m + np.log(p.sum())
        start += q_len
    if sinks is not None:  # rows of no key: lse is the sink
        lse = np.where(np.isneginf(lse), np.asarray(sinks)[:, None], lse)
    return out, lse


def make_problem(c: Case, seed=0):
    """The call's arguments (NaN in unused pages, past each length and in the padding rows of
    q; garbage in unused table entries; pages shuffled) and float64 copies (q, dense k, v)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(c.dtype)
    batch = len(c.q_lens)
    capacity = c.page * c.max_pages

    def rounded(shape):
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        return np.asarray(x.astype(jnp.float32), np.float64)

    q = rounded((c.num_tokens, c.num_heads, c.head_dim))
    k = rounded((batch, capacity, c.num_kv_heads, c.head_dim))
    v = rounded((batch, capacity, c.num_kv_heads, c.hv))
    num_pages = batch * c.max_pages + 2  # two pages no sequence uses
    tables = rng.permutation(num_pages)[: batch * c.max_pages].reshape(batch, c.max_pages)
    used = np.arange(c.max_pages)[None, :] < -(-np.asarray(c.lengths)[:, None] // c.page)
    tables = np.where(used, tables, -12345).astype(np.int32)  # garbage: never read
    k_pages = np.full((num_pages, c.page, c.num_kv_heads, c.head_dim), np.nan)
    v_pages = np.full((num_pages, c.page, c.num_kv_heads, c.hv), np.nan)
    for b in range(batch):
        for j in range(c.lengths[b]):
            page, row = tables[b, j // c.page], j % c.page
            k_pages[page, row], v_pages[page, row] = k[b, j], v[b, j]
    q_padded = q.copy()
    q_padded[sum(c.q_lens) :] = np.nan
    starts = np.concatenate([[0], np.cumsum(c.q_lens)]).astype(np.int32)
    args = (
        jnp.asarray(q_padded, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(tables),
        jnp.asarray(starts),
        jnp.asarray(c.lengths, jnp.int32),
    )
    sinks = None
    if c.sinks:
        sinks = jnp.asarray(np.linspace(-2.0, 3.0, c.num_heads), jnp.float32)
    return args, sinks, (q, k, v)


def run(c: Case, args, sinks, *paths, **extra):
    """[(out, lse)] of each path, in one jit."""

    def call(path):
        return functools.partial(
            pallas_flash.ragged_paged_attention,
            logits_soft_cap=c.soft_cap,
            local_window_size=c.window,
            sinks=sinks,
            return_residuals=True,
            max_query_len=c.max_query_len,
            **path.kwargs,
            **extra,
        )

    fns = [call(path) for path in paths]
    return jax.jit(lambda *args: [fn(*args) for fn in fns])(*args)


def check(c: Case, results, oracle_inputs, sinks, names):
    """Each result against the oracle: f32 within 2e-5; bf16 within twice the error of the
    reference run in bfloat16 (backend="xla", the first result) plus 1e-3. Every row finite
    (NaN in the pages and the padding never reaches one), padding rows 0."""
    want, want_lse = oracle(c, *oracle_inputs, None if sinks is None else np.asarray(sinks))
    errors = {}
    for name, (out, lse) in zip(names, results, strict=True):
        assert out.shape == (c.num_tokens, c.num_heads, c.hv)
        assert out.dtype == jnp.dtype(c.dtype) and lse.dtype == jnp.float32
        assert lse.shape == (c.num_heads, c.num_tokens)
        out = np.asarray(out.astype(jnp.float32), np.float64)
        assert np.all(np.isfinite(out)), f"{name}: NaN reached a row"
        assert np.all(out[sum(c.q_lens) :] == 0), f"{name}: padding rows are not 0"
        errors[name] = np.max(np.abs(out - want))
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=name)
        finite = np.isfinite(want_lse)
        lse_tol = 2e-5 if c.dtype == "float32" else 2e-2
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=lse_tol, err_msg=name)
    for name, error in errors.items():
        tol = 2e-5 if c.dtype == "float32" else 2 * errors[names[0]] + 1e-3
        assert error <= tol, f"{name}: max error {error} > {tol}"
