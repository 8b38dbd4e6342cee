"""NaN safety: out, lse and every gradient are finite wherever float64 attention of the same
inputs is finite, on every path of the backend matrix (support.backends.backend_paths:
backend="xla", the Triton kernels interpreted on CPU or compiled, the default call; the Mosaic GPU
kernels in jax's Mosaic GPU interpreter or compiled, which refuse a bias or a dense mask).

- Large finite biases (-1e10, -1e30, finfo.min) on whole rows: a finite bias is not a mask, the
  row gets the softmax of its logits (the mean of V when they are all equal), as backend="xla"
  computes it; logits of |s| ~ 1e9 and 1e30.
- NaN and inf in K and V at keys a row cannot see (lengths, bool mask, segment ids, causal,
  window) never reach that row, also when the padding does not start on a tile boundary.
- Gradients with a bias under jax_enable_x64; segment ids that do not fit int32; clear errors.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import BACKEND_PATHS, SWEEP, backend_paths, has_gpu, has_hopper
from support.huge_logits import check_tied_huge_logits, tied_huge_logits
from support.inputs import BLOCK_SIZES, case_id, normal, uniform_block_sizes
from support.mosaic_interpret import interpret_mosaic
from support.oracle import attention_oracle_f64, to64
from support.tolerance import assert_close

import pallas_flash
from pallas_flash import masks

F32_MIN = float(np.finfo(np.float32).min)

# The checks with a bias or a dense mask run on the Mosaic paths too, which must refuse them.
REFUSE_BIAS = backend_paths(mosaic=True, refuses={"mosaic-interpret": "bias", "mosaic": "bias"})
REFUSE_MASK = backend_paths(mosaic=True, refuses={"mosaic-interpret": "mask", "mosaic": "mask"})


def path_kwargs(path, blocks: str | None = None) -> dict:
    return path.call_kwargs(None if blocks is None else BLOCK_SIZES[blocks])


def run(q, k, v, cotangents, *, bias=None, **kwargs):
    """[out, lse, dq, dk, dv(, dbias)] of flash_attention, one list per (d_out, d_lse) pair of
    `cotangents`, as float64 numpy arrays; one jit for all of them."""
    arrays = {name: x for name, x in kwargs.items() if hasattr(x, "shape")}
    static = {name: x for name, x in kwargs.items() if name not in arrays}

    def results(q, k, v, bias, arrays, cotangents):
        def attention(q, k, v, *bias):
            return pallas_flash.flash_attention(
                q, k, v, *bias, return_residuals=True, **static, **arrays
            )

        primals = (q, k, v) if bias is None else (q, k, v, bias)
        (out, lse), vjp = jax.vjp(attention, *primals)
        return [[out, lse, *vjp((d_out.astype(out.dtype), d_lse))] for d_out, d_lse in cotangents]

    got = jax.jit(results)(q, k, v, bias, arrays, cotangents)
    return [[np.asarray(x.astype(jnp.float32), np.float64) for x in r] for r in got]


# -- large finite biases and logits ---------------------------------------------------------------

# Rows of every head whose keys all carry one large finite bias, and that bias.
BIASED_ROWS = {slice(0, 3): -1e10, slice(3, 6): -1e30, slice(6, 9): F32_MIN}


# Keys hidden beside the bias: none, the causal ones (row i sees i + 1 keys), those past a key
# length, or those where the bias is -inf (both: every row sees 31): the biased rows' logits at
# those keys are -inf, not the bias.
HIDDEN_BESIDE_BIAS = {
    "none": {},
    "causal": dict(is_causal=True),
    "lengths": dict(key_value_seq_lengths=jnp.array([31], jnp.int32)),
    "bias_inf": {},
}


def visible_of(hidden: str, q_len: int, kv_len: int) -> np.ndarray:
    rows, keys = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if hidden == "causal":
        return keys <= rows
    limit = 31 if hidden in ("lengths", "bias_inf") else kv_len
    return np.broadcast_to(keys < limit, (q_len, kv_len))


@pytest.mark.parametrize("hidden", list(HIDDEN_BESIDE_BIAS))
@pytest.mark.parametrize("path", REFUSE_BIAS)
@pytest.mark.ci_slice(4)
def test_large_negative_bias_on_whole_rows_is_not_a_mask(path, hidden):
    """Rows whose keys all carry the same large finite bias (-1e10, -1e30, finfo.min) get the
    mean of V over the keys they see (their logits are equal in float32: the softmax of
    backend="xla") and lse = bias + log(their key count); the other rows match the float64
    oracle in out and lse; every gradient matches it (the backward recomputes the biased rows'
    P from their log_sum, not from lse, which cannot hold log(count) next to the bias in
    float32). With keys hidden beside the bias (causal, lengths) those rows' hidden logits are
    -inf next to a finite max of finfo.min: no -inf - -inf may reach them."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = 1, 17, 40, 2, 1, 16
    rng = np.random.default_rng(0)
    q, d_out = (normal(rng, (batch, q_len, heads, head_dim)) for _ in range(2))
    k, v = (normal(rng, (batch, kv_len, kv_heads, head_dim)) for _ in range(2))
    d_lse = normal(rng, (batch, heads, q_len))
    bias = jnp.zeros((1, 1, q_len, kv_len), jnp.float32)
    for rows, value in BIASED_ROWS.items():
        bias = bias.at[:, :, rows].set(value)
    if hidden == "bias_inf":
        bias = bias.at[..., 31:].set(-jnp.inf)
    n_biased = 3 * len(BIASED_ROWS)
    kwargs = dict(bias=bias, **HIDDEN_BESIDE_BIAS[hidden], **path_kwargs(path, "q32kv16"))
    with path.scope():
        ((out, lse, dq, dk, dv, dbias),) = run(q, k, v, [(d_out, d_lse)], **kwargs)

    visible = visible_of(hidden, q_len, kv_len)
    counts = visible.sum(axis=1)  # [T]
    v_heads = np.repeat(to64(v), heads // kv_heads, axis=2)  # [B, S, N, H]
    mean_v = np.einsum("ts,bsnh->btnh", visible / counts[:, None], v_heads)
    for rows, value in BIASED_ROWS.items():
        assert_close(f"out {value:g}", out[:, rows], mean_v[:, rows], atol=1e-5)
        want_lse = np.broadcast_to(value + np.log(counts[rows]), lse[:, :, rows].shape)
        assert_close(f"lse {value:g}", lse[:, :, rows], want_lse, atol=0, rtol=1e-6)

    def oracle_of(bias):
        return attention_oracle_f64(
            to64(q),
            to64(k),
            to64(v),
            to64(d_out),
            to64(d_lse),
            scale=head_dim**-0.5,
            visible=visible,
            bias=to64(bias),
        )

    oracle = oracle_of(bias)
    assert_close("out", out[:, n_biased:], oracle["out"][:, n_biased:], atol=1e-5)
    assert_close("lse", lse[:, :, n_biased:], oracle["lse"][:, :, n_biased:], atol=1e-5)
    # Gradients: the biased rows' P is 1 / S, the softmax of their logits as float32 holds them
    # (bias + q.k rounds to the bias). float64 resolves q.k next to -1e10 but not next to -1e30,
    # so the gradients' oracle takes -1e30 for -1e10; P does not depend on the bias otherwise.
    uniform = oracle_of(jnp.where(bias == -1e10, -1e30, bias))
    assert_close("dq", dq, uniform["dq"], atol=1e-4)
    assert_close("dk", dk, uniform["dk"], atol=1e-4)
    assert_close("dv", dv, uniform["dv"], atol=1e-4)
    want_dbias = uniform["dlogits"].sum((0, 1), keepdims=True)
    assert_close("dbias", dbias, want_dbias, atol=1e-5)


@pytest.mark.parametrize("path", REFUSE_BIAS)
def test_finfo_min_bias_in_bfloat16(path):
    """bfloat16 inputs with a bfloat16 bias of finfo(bfloat16).min on whole rows (the usual
    additive padding mask) and on some keys of the other rows."""
    batch, q_len, kv_len, heads, head_dim = 2, 33, 40, 2, 32
    rng = np.random.default_rng(1)
    q = normal(rng, (batch, q_len, heads, head_dim), jnp.bfloat16)
    k, v = (normal(rng, (batch, kv_len, heads, head_dim), jnp.bfloat16) for _ in range(2))
    big_neg = jnp.finfo(jnp.bfloat16).min
    bias = jnp.zeros((batch, 1, q_len, kv_len), jnp.bfloat16)
    bias = bias.at[:, :, :3].set(big_neg).at[1, :, :, 29:].set(big_neg)
    with path.scope():
        out, lse = jax.jit(
            functools.partial(
                pallas_flash.flash_attention, return_residuals=True, **path_kwargs(path, "all16")
            )
        )(q, k, v, bias)
        out, lse = to64(out), to64(lse)
    mean_v = np.broadcast_to(to64(v).mean(1)[:, None], out[:, :3].shape)
    assert_close("out (biased rows)", out[:, :3], mean_v, atol=2e-2)
    oracle = attention_oracle_f64(
        to64(q),
        to64(k),
        to64(v),
        scale=head_dim**-0.5,
        visible=np.ones((q_len, kv_len), bool),
        bias=to64(bias),
    )
    assert_close("out", out[:, 3:], oracle["out"][:, 3:], atol=2e-2)
    assert_close("lse", lse[..., 3:], oracle["lse"][..., 3:], atol=2e-2)


# One KV tile per row, or three split-KV chunks (the twins of the check below in different ones).
HUGE_LOGIT_TILES = {
    "q16kv64": BLOCK_SIZES["q16kv64"],
    "split3": pallas_flash.BlockSizes(block_q=16, block_kv=16, kv_splits=3),
}


@pytest.mark.parametrize("path", backend_paths())
@pytest.mark.parametrize(
    "dtype, tiles", [(jnp.float32, "split3"), (jnp.bfloat16, "q16kv64")], ids=["f32", "bf16"]
)
@pytest.mark.ci_slice(2)
def test_huge_logits(path, dtype, tiles):
    """Logits of |s| ~ 1e7 (head 0: where a backward that recomputes P from a rounded lse first
    goes wrong) and 1e30 (head 1), every key present twice: the softmax splits each row between
    the two keys of its largest logit, as in float64; lse matches to float32 precision, and
    every gradient to the inputs' precision relative to its magnitude (P of the tied keys is
    recomputed exactly, 1/2, from the forward's log_sum)."""
    batch, q_len, kv_len, heads, head_dim = 1, 19, 40, 2, 16
    rng = np.random.default_rng(2)
    q, d_out = (normal(rng, (batch, q_len, heads, head_dim), dtype) for _ in range(2))
    k, v = (normal(rng, (batch, kv_len, heads, head_dim), dtype) for _ in range(2))
    q = q * jnp.asarray([1e7, 1e30], dtype)[:, None]
    # Every key twice (with different values): each row's largest logit ties, P = 1/2 each.
    k = jnp.concatenate([k[:, : kv_len // 2]] * 2, axis=1)
    d_lse = normal(rng, (batch, heads, q_len))
    with path.scope():
        ((out, lse, *grads),) = run(
            q, k, v, [(d_out, d_lse)], scale=0.25, **path.call_kwargs(HUGE_LOGIT_TILES[tiles])
        )
    oracle = attention_oracle_f64(
        to64(q),
        to64(k),
        to64(v),
        to64(d_out),
        to64(d_lse),
        scale=0.25,
        visible=np.ones((q_len, kv_len), bool),
    )
    precision = 1e-6 if dtype == jnp.float32 else 2e-2
    assert_close("out", out, oracle["out"], atol=precision)
    assert_close("lse", lse, oracle["lse"], atol=0, rtol=1e-6)
    for name, got in zip(("dq", "dk", "dv"), grads):
        for head in range(heads):  # each head against its own magnitude
            want = oracle[name][:, :, head]
            assert_close(
                f"{name} head {head}", got[:, :, head], want, atol=precision * np.abs(want).max()
            )


# -- NaN and inf at keys a row cannot see --------------------------------------------------------


def poison(x, keys, values):
    """x [B, S, K, H] with some entries of the key positions `keys` ([B, S] bool) set to
    values[j % len(values)] (the j-th such key)."""
    out = np.asarray(x, np.float32).copy()
    b_idx, s_idx = np.nonzero(keys)
    for j, (b, s) in enumerate(zip(b_idx, s_idx)):
        out[b, s, j % out.shape[2], j % 3 :: 5] = values[j % len(values)]
    return jnp.asarray(out, x.dtype)


def assert_hidden_keys_reach_nothing(results, oracle, hidden):
    """results (out, lse, dq, dk, dv) of poisoned inputs match the float64 oracle of the clean
    ones (lse's -inf rows exactly), and the hidden keys ([B, S] bool) get dK and dV 0."""
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), results):
        want = oracle[name]
        if name == "lse":
            finite = np.isfinite(want)
            assert np.array_equal(got[~finite], want[~finite])
            got, want = got[finite], want[finite]
        if name in ("dk", "dv"):
            assert np.all(got[hidden] == 0.0), f"{name} is not 0 at hidden keys"
        assert_close(name, got, want, atol=1e-4)


@pytest.mark.parametrize("soft_cap", [None, 5.0], ids=["plain", "soft-cap"])
@pytest.mark.parametrize("path", REFUSE_MASK)
@pytest.mark.ci_slice(2)
def test_nan_and_inf_at_hidden_keys_do_not_reach_any_row(path, soft_cap):
    """NaN and +-inf in K and V at keys no row sees (past key lengths 37 and 20, not on a tile
    boundary; of a segment id no query has; hidden by a dense bool mask): out, lse and the
    gradients match the float64 oracle of the same inputs with those entries zeroed (GQA, odd
    sizes, 16-key tiles, the split-KV forward); the hidden keys' dK and dV are 0. With a soft
    cap the hidden keys' logits are NaN, and so is tanh's derivative there."""
    rng = np.random.default_rng(3)
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 17, 41, 2, 1, 16
    k_pos = np.arange(kv_len)
    lengths = np.array([37, 20])
    q_ids = rng.integers(0, 2, (batch, q_len))
    kv_ids = rng.integers(0, 3, (batch, kv_len))  # id 2: keys of no query's document
    masked_keys = rng.random((batch, kv_len)) < 0.2
    mask = np.broadcast_to(~masked_keys[:, None, None, :], (batch, 1, q_len, kv_len)).copy()
    mask[:, :, 3] &= k_pos < 20  # one row sees fewer keys still
    hidden = (k_pos >= lengths[:, None]) | (kv_ids == 2) | masked_keys
    visible = mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :]) & ~hidden[:, None, None]
    kwargs = dict(
        key_value_seq_lengths=jnp.asarray(lengths),
        q_segment_ids=jnp.asarray(q_ids),
        kv_segment_ids=jnp.asarray(kv_ids),
        mask=jnp.asarray(mask),
        logits_soft_cap=soft_cap,
        **path.call_kwargs(
            pallas_flash.BlockSizes(
                block_q=16,
                block_kv=16,
                block_q_dkv=16,
                block_kv_dkv=16,
                block_q_dq=16,
                block_kv_dq=16,
                kv_splits=2,
            )
        ),
    )
    q, d_out = (normal(rng, (batch, q_len, heads, head_dim)) for _ in range(2))
    k, v = (normal(rng, (batch, kv_len, kv_heads, head_dim)) for _ in range(2))
    d_lse = normal(rng, (batch, heads, q_len))
    k_bad = poison(k, hidden, [np.inf, np.nan, -np.inf])
    v_bad = poison(v, hidden, [np.nan, -np.inf, np.inf])
    with path.scope():
        (results,) = run(q, k_bad, v_bad, [(d_out, d_lse)], **kwargs)
    oracle = attention_oracle_f64(
        *(to64(x) for x in (q, k, v, d_out, d_lse)),
        scale=head_dim**-0.5,
        visible=visible,
        soft_cap=soft_cap,
    )
    assert_hidden_keys_reach_nothing(results, oracle, hidden)


@pytest.mark.parametrize("path", backend_paths())
def test_keys_past_a_ragged_causal_query_tile_get_zero_gradients(path):
    """Causal, T = 61 < S = 99: keys 61-98 are hidden from every row, but keys up to the last
    query tile's end lie inside the causal geometry of that tile's rows past T (whose q reads
    as 0, so an inf in K gives them a NaN logit). NaN and inf in K and V there: out, lse and the
    gradients match the float64 oracle, and those keys' dK and dV are 0 (the Mosaic backward's
    case: test_mosaic_backward_masks.py, MASK_CI_CASES)."""
    rng = np.random.default_rng(5)
    batch, q_len, kv_len, heads, head_dim = 1, 61, 99, 2, 16
    visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
    hidden = np.broadcast_to(np.arange(kv_len) >= q_len, (batch, kv_len))
    q, d_out = (normal(rng, (batch, q_len, heads, head_dim)) for _ in range(2))
    k, v = (normal(rng, (batch, kv_len, heads, head_dim)) for _ in range(2))
    d_lse = normal(rng, (batch, heads, q_len))
    k_bad = poison(k, hidden, [np.inf, np.nan, -np.inf])
    v_bad = poison(v, hidden, [np.nan, -np.inf, np.inf])
    with path.scope():
        (results,) = run(
            q, k_bad, v_bad, [(d_out, d_lse)], is_causal=True, **path_kwargs(path, "all16")
        )
    oracle = attention_oracle_f64(
        to64(q),
        to64(k),
        to64(v),
        to64(d_out),
        to64(d_lse),
        scale=head_dim**-0.5,
        visible=np.broadcast_to(visible, (batch, 1, q_len, kv_len)),
    )
    assert_hidden_keys_reach_nothing(results, oracle, hidden)


@pytest.mark.parametrize("path", backend_paths())
def test_nan_at_a_key_reaches_only_the_rows_that_see_it(path):
    """Causal with a window of 9 keys to the left: NaN and inf at key 24 of 50 (K and V) is
    seen by rows 24-33; the rows before and after match the float64 oracle in out, lse, dq."""
    rng = np.random.default_rng(4)
    batch, length, heads, head_dim, bad = 1, 50, 2, 16, 24
    q, k, v, d_out = (normal(rng, (batch, length, heads, head_dim)) for _ in range(4))
    d_lse = normal(rng, (batch, heads, length))
    pos_q, pos_k = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (pos_k <= pos_q) & (pos_k >= pos_q - 9)
    hidden_rows = ~visible[:, bad]
    k_bad = k.at[:, bad].set(jnp.nan)
    v_bad = v.at[:, bad].set(jnp.inf).at[:, bad, :, 0].set(jnp.nan)
    kwargs = dict(is_causal=True, local_window_size=(9, 0), **path_kwargs(path, "q32kv16"))
    with path.scope():
        ((out, lse, dq, _, _),) = run(q, k_bad, v_bad, [(d_out, d_lse)], **kwargs)
    oracle = attention_oracle_f64(
        to64(q), to64(k), to64(v), to64(d_out), to64(d_lse), scale=head_dim**-0.5, visible=visible
    )
    assert_close("out", out[:, hidden_rows], oracle["out"][:, hidden_rows], atol=1e-5)
    assert_close("lse", lse[..., hidden_rows], oracle["lse"][..., hidden_rows], atol=1e-5)
    assert_close("dq", dq[:, hidden_rows], oracle["dq"][:, hidden_rows], atol=1e-4)
    if path.name == "xla":  # the reference propagates NaN to the rows that see the key, as float64
        assert np.all(np.isnan(out[:, ~hidden_rows]))


# -- the Mosaic GPU kernels -----------------------------------------------------------------------


def mosaic_kernels(scale, is_causal, *, segment_ids=None):
    """q, k, v -> (out, lse) through the Mosaic forward, differentiated by the Mosaic backward
    (segment_ids: forward only)."""
    from support.kernels import call_mosaic_backward, call_mosaic_forward

    @jax.custom_vjp
    def attention(q, k, v):
        return call_mosaic_forward(
            q, k, v, scale=scale, is_causal=is_causal, segment_ids=segment_ids
        )

    def fwd(q, k, v):
        out, lse = attention(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def bwd(residuals, cotangents):
        return call_mosaic_backward(*residuals, *cotangents, scale=scale, is_causal=is_causal)

    attention.defvjp(fwd, bwd)
    return attention


def mosaic_huge_logits(magnitude, is_causal):
    rng = np.random.default_rng(5)
    shape = (1, 128, 1, 64)
    q, k, v, d_out = (normal(rng, shape, jnp.bfloat16) for _ in range(4))
    d_lse = normal(rng, (1, 1, 128))
    scale = magnitude / 8.0
    fn = mosaic_kernels(scale, is_causal)
    pos = np.arange(128)
    visible = pos[None, :] <= pos[:, None] if is_causal else np.ones((128, 128), bool)
    with np.errstate(over="ignore"):  # exp of the masked logits, discarded by the oracle
        oracle = attention_oracle_f64(
            to64(q), to64(k), to64(v), to64(d_out), to64(d_lse), scale=scale, visible=visible
        )
    return fn, (q, k, v, d_out, d_lse), oracle


def check_huge_logits(results, oracle):
    """out and lse as the float64 oracle's; dq, dk and dv too, to bfloat16's precision relative
    to their magnitude (~1e29 at logits of 1e30): P of each row's dominant logit is recomputed
    exactly in the backward, whatever the magnitude."""
    out, lse, *grads = (to64(x) for x in results)
    assert_close("out", out, oracle["out"], atol=1e-2)
    assert_close("lse", lse, oracle["lse"], atol=0, rtol=1e-5)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert_close(name, got, oracle[name], atol=1e-2 * np.abs(oracle[name]).max())


def outputs_and_grads(fn, q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    return (out, lse, *vjp((d_out, d_lse)))


def test_mosaic_huge_logits_interpreted():
    """The Mosaic forward and backward (jax's Mosaic GPU interpreter), causal (masked and
    unmasked steps), with logits ~ 1e30."""
    fn, args, oracle = mosaic_huge_logits(1e30, is_causal=True)
    with interpret_mosaic():
        results = jax.jit(functools.partial(outputs_and_grads, fn))(*args)
        results = [np.asarray(x.astype(jnp.float32)) for x in results]
    check_huge_logits(results, oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("magnitude", [1e4, 1e9, 1e30])
@pytest.mark.parametrize("is_causal", [False, True])
def test_mosaic_huge_logits_gpu(magnitude, is_causal):
    if pallas_flash.device.gpu_compute_capability() != (9, 0):
        pytest.skip("the Mosaic GPU kernels need sm_90")
    fn, args, oracle = mosaic_huge_logits(magnitude, is_causal)
    check_huge_logits(jax.jit(functools.partial(outputs_and_grads, fn))(*args), oracle)


# Ties at the row max with logits of ~1e7 (head 0, where a clamp at 1 first goes wrong) and ~1e9
# (head 1): every key three times, so the Mosaic kernels' tiles and a ragged last KV tile hold
# tied keys. CI runs one non-causal bfloat16 case in the interpreter; the rest with
# PALLAS_FLASH_SWEEP or on the GPU.
TIED_PATHS = backend_paths(mosaic=True, sweep=("triton-interpret",))
TIED_CASES = [
    pytest.param(jnp.bfloat16, False, id="bf16"),
    pytest.param(jnp.float16, True, id="f16-causal"),
]


@pytest.mark.parametrize("path", TIED_PATHS)
@pytest.mark.parametrize("dtype, is_causal", TIED_CASES)
@pytest.mark.ci_slice(1)
def test_tied_huge_logits(path, dtype, is_causal):
    """Keys that tie at their rows' max at |logits| ~1e7 and ~1e9 get P = 1/3 each in every
    backward (Mosaic's included, after either forward): gradients as float64's."""
    if not SWEEP and not path.gpu and (dtype, is_causal) != (jnp.bfloat16, False):
        pytest.skip("CI time: PALLAS_FLASH_SWEEP=1")
    args, scale, visible = tied_huge_logits(dtype, is_causal)
    q, k, v, d_out, d_lse = args
    with path.scope():
        ((out, lse, *grads),) = run(
            q, k, v, [(d_out, d_lse)], scale=scale, is_causal=is_causal, **path.call_kwargs()
        )
    check_tied_huge_logits([out, lse, *grads], args, scale, visible, dtype)


@pytest.mark.parametrize(
    "interpreted", [True, pytest.param(False, marks=pytest.mark.gpu)], ids=["interpret", "gpu"]
)
def test_tied_huge_logits_triton_backward_after_mosaic_forward(interpreted):
    """The Triton backward after the Mosaic forward (KernelConfig forward="mosaic",
    backward="triton") takes the Mosaic forward's log_sum: tied keys at ~1e7 and ~1e9 get
    their exact P."""
    if not interpreted and not has_hopper():
        pytest.skip("the Mosaic GPU kernels need sm_90")
    from pallas_flash._passes import KernelConfig
    from pallas_flash._vjp import flash_attention_kernels
    from pallas_flash.masks import MaskArrays, MaskSpec

    dtype = jnp.bfloat16
    args, scale, visible = tied_huge_logits(dtype, False)
    q, k, v, d_out, d_lse = args
    config = KernelConfig(
        spec=MaskSpec(q_len=q.shape[1], kv_len=k.shape[1], is_causal=False),
        scale=scale,
        block_sizes=uniform_block_sizes(64),
        interpret=interpreted,
        forward="mosaic",
        backward="triton",
    )

    # Interpreted: the Mosaic forward in jax's Mosaic GPU interpreter, the Triton backward in
    # the Pallas interpreter (the first traces its kernel inside the context, the second outside).
    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: flash_attention_kernels(q, k, v, None, MaskArrays(), config), q, k, v
        )
        out, lse = to64(out), to64(lse)
    got = [out, lse, *(to64(x) for x in vjp((d_out, d_lse)))]
    check_tied_huge_logits(got, args, scale, visible, dtype)


# The Triton forward in two KV chunks (keys 0-63 and 64-95): two copies of each tied key in
# one, the third in the other, so that the chunks' merge must weigh them by their denominators.
SPLIT_KV = pallas_flash.BlockSizes(block_q=64, block_kv=32, kv_splits=2)


@pytest.mark.parametrize("path", backend_paths(mosaic=True))
@pytest.mark.ci_slice(1)
def test_tied_huge_logits_at_the_residuals(path):
    """flash_attention_backward at the residuals of flash_attention(return_log_sum=True) --
    out, lse and log_sum -- gives float64's gradients to keys that tie at ~1e7 and ~1e9, on
    every path (the Triton forward split over KV); log_sum itself is float64's log(3)."""
    dtype = jnp.bfloat16
    args, scale, visible = tied_huge_logits(dtype, False)
    kwargs = dict(scale=scale, **path.call_kwargs(SPLIT_KV))

    def run(q, k, v, d_out, d_lse):
        out, lse, log_sum = pallas_flash.flash_attention(
            q, k, v, return_residuals=True, return_log_sum=True, **kwargs
        )
        grads = pallas_flash.flash_attention_backward(
            q, k, v, out, lse, d_out, d_lse, log_sum=log_sum, **kwargs
        )
        return out, lse, log_sum, *grads

    with path.scope():
        out, lse, log_sum, *grads = (to64(x) for x in jax.jit(run)(*args))
    check_tied_huge_logits([out, lse, *grads], args, scale, visible, dtype)
    # Every row's largest logit is one of the 32 distinct keys, three times over: exp(log_sum)
    # is 3 plus the other keys' shares, which vanish at these magnitudes.
    assert_close("log_sum", log_sum, np.log(3.0), atol=1e-5)


# Whole Mosaic tiles in 16 bits: every path takes these calls, the Mosaic kernels included (their
# forward and, for the causal call, their backward); the Triton interpreter is slow at them.
NAN_IN_TILE_PATHS = backend_paths(mosaic=True, sweep=("triton-interpret",))


@pytest.mark.parametrize("path", NAN_IN_TILE_PATHS)
@pytest.mark.ci_slice(1)
def test_nan_at_hidden_keys_inside_a_partly_visible_tile(path):
    """NaN and inf in K and V at keys a row cannot see but other rows of its tiles do: key 40
    of 128 under a causal mask (rows 0-39 match the float64 oracle in out, lse and dq; the
    Mosaic forward zeroes NaN in the V tile of a masked step, its dQ kernel in the K tile of a
    diagonal step), and keys 100-127 past a key length of 100, inside the one 128-key tile
    (every row matches in out and lse; forward only: the Mosaic backward takes no lengths)."""
    rng = np.random.default_rng(8)
    batch, length, heads, kv_heads, head_dim, bad = 1, 128, 1, 1, 64, 40
    q, d_out = (normal(rng, (batch, length, heads, head_dim), jnp.bfloat16) for _ in range(2))
    k, v = (normal(rng, (batch, length, kv_heads, head_dim), jnp.bfloat16) for _ in range(2))
    d_lse = normal(rng, (batch, heads, length))
    pos = np.arange(length)
    k_bad = k.at[:, bad, :, ::2].set(jnp.inf).at[:, bad, :, 1::2].set(jnp.nan)
    v_bad = v.at[:, bad, :, ::2].set(jnp.nan).at[:, bad, :, 1::2].set(-jnp.inf)
    rows = pos < bad
    with path.scope():
        ((out, lse, dq, _, _),) = run(
            q, k_bad, v_bad, [(d_out, d_lse)], is_causal=True, **path.call_kwargs()
        )
    oracle = attention_oracle_f64(
        *(to64(x) for x in (q, k, v, d_out, d_lse)),
        scale=head_dim**-0.5,
        visible=pos[None, :] <= pos[:, None],
    )
    assert_close("out", out[:, rows], oracle["out"][:, rows], atol=2e-2)
    assert_close("lse", lse[..., rows], oracle["lse"][..., rows], atol=1e-4)
    assert_close("dq", dq[:, rows], oracle["dq"][:, rows], atol=2e-2)

    past = pos >= 100
    k_bad = k.at[:, past, :, ::2].set(jnp.inf).at[:, past, :, 1::2].set(jnp.nan)
    v_bad = v.at[:, past, :, ::2].set(jnp.nan).at[:, past, :, 1::2].set(jnp.inf)
    lengths = jnp.asarray([100])
    with path.scope():
        out, lse = jax.jit(
            functools.partial(
                pallas_flash.flash_attention, return_residuals=True, **path.call_kwargs()
            )
        )(q, k_bad, v_bad, key_value_seq_lengths=lengths)
        out, lse = to64(out), to64(lse)
    oracle = attention_oracle_f64(
        to64(q), to64(k), to64(v), scale=head_dim**-0.5, visible=np.broadcast_to(~past, (1, 128))
    )
    assert_close("out (lengths)", out, oracle["out"], atol=2e-2)
    assert_close("lse (lengths)", lse, oracle["lse"], atol=1e-4)


def mosaic_forward_nan_case(options: dict, poisoned, seed: int = 9):
    """The inputs of the Mosaic forward (bf16, [1, 256, 2, 64] queries, one kv head) with NaN in V
    and inf in K at the `poisoned` keys, the same without them (for the float64 oracle), its
    keyword arguments, the [T, S] visibility and the rows that see no poisoned key.
    options: is_causal, window, documents (segment ids: queries 90+ and keys 150+ in a second
    document, keys past 230 padding)."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (1, 256, 2, 64), jnp.bfloat16)
    k, v = (normal(rng, (1, 256, 1, 64), jnp.bfloat16) for _ in range(2))
    pos = np.arange(256)
    visible = np.ones((256, 256), bool)
    if options["is_causal"]:
        visible &= pos[None, :] <= pos[:, None]
    if "window" in options:
        left, right = options["window"]
        visible &= (pos[None, :] >= pos[:, None] - left) & (pos[None, :] <= pos[:, None] + right)
    kwargs = {name: value for name, value in options.items() if name != "documents"}
    if options.get("documents"):
        arrays = masks.make_arrays(
            1,
            256,
            256,
            q_segment_ids=(pos >= 90)[None].astype(np.int32),
            kv_segment_ids=(pos >= 150)[None].astype(np.int32),
            key_value_seq_lengths=np.array([230]),
        )
        q_ids, kv_ids = arrays.q_segment_ids, arrays.kv_segment_ids
        kwargs["segment_ids"] = (q_ids, kv_ids)
        visible &= np.asarray(q_ids[0])[:, None] == np.asarray(kv_ids[0])[None, :]
    poisoned = np.asarray(poisoned)
    k_bad = k.at[:, poisoned].set(jnp.inf)
    v_bad = v.at[:, poisoned].set(jnp.nan)
    clean = ~visible[:, poisoned].any(axis=1)
    return (q, k_bad, v_bad), (q, k, v), kwargs, visible, clean


SLOW_INTERPRETED = pytest.mark.skipif(
    not SWEEP, reason="slow in the Mosaic interpreter: PALLAS_FLASH_SWEEP=1"
)
# (options, poisoned keys): causal (keys on the consumers' diagonal tiles), a window on both
# sides, two documents with padding past a key length (keys of both, and padding keys).
MOSAIC_FORWARD_NAN_CASES = [
    (dict(is_causal=True), [100, 101, 127, 200]),
    (dict(is_causal=False, window=(40, 70)), [5, 200]),
    (dict(is_causal=True, documents=True), [10, 160, *range(235, 256)]),
]


def check_mosaic_forward_nan(options, poisoned, *, interpreted: bool):
    from support.kernels import call_mosaic_forward

    bad, good, kwargs, visible, clean = mosaic_forward_nan_case(options, poisoned)
    fn = jax.jit(functools.partial(call_mosaic_forward, scale=0.125, **kwargs))
    with interpret_mosaic() if interpreted else contextlib.nullcontext():
        out, lse = (to64(x) for x in fn(*bad))
    assert clean.sum() > 50
    oracle = attention_oracle_f64(*(to64(x) for x in good), scale=0.125, visible=visible)
    assert_close("out", out[:, clean], oracle["out"][:, clean], atol=2e-2)
    finite = np.isfinite(oracle["lse"][0, 0]) & clean
    assert_close("lse", lse[..., finite], oracle["lse"][..., finite], atol=1e-4)


@pytest.mark.parametrize(
    "options, poisoned",
    [pytest.param(*case, marks=SLOW_INTERPRETED) for case in MOSAIC_FORWARD_NAN_CASES],
    ids=case_id,
)
def test_mosaic_forward_nan_at_hidden_keys_interpreted(options, poisoned):
    """The Mosaic forward (jax's Mosaic GPU interpreter): NaN in V and inf in K at keys hidden
    from some rows of their tile by causality, a window or segment ids (documents, padding past
    a key length); every row that sees none of them matches the float64 oracle."""
    check_mosaic_forward_nan(options, poisoned, interpreted=True)


@pytest.mark.gpu
@pytest.mark.parametrize("options, poisoned", MOSAIC_FORWARD_NAN_CASES, ids=case_id)
def test_mosaic_forward_nan_at_hidden_keys_gpu(options, poisoned):
    if pallas_flash.device.gpu_compute_capability() != (9, 0):
        pytest.skip("the Mosaic GPU kernels need sm_90")
    check_mosaic_forward_nan(options, poisoned, interpreted=False)


@pytest.mark.gpu
def test_mosaic_forward_nan_in_value_past_key_lengths_gpu():
    if pallas_flash.device.gpu_compute_capability() != (9, 0):
        pytest.skip("the Mosaic GPU kernels need sm_90")
    rng = np.random.default_rng(8)
    q, k, v = (normal(rng, (1, 256, 2, 64), jnp.bfloat16) for _ in range(3))
    v = v.at[:, 200:].set(jnp.nan)  # past the length, inside the last 128-key tile
    out = pallas_flash.flash_attention(
        q, k, v, key_value_seq_lengths=jnp.asarray([200]), backend="mosaic"
    )
    assert np.all(np.isfinite(to64(out)))


# -- jax_enable_x64, segment ids, errors ---------------------------------------------------------


def test_gradients_with_a_bias_under_x64():
    """Under jax_enable_x64 (float32 inputs), gradients with a bias broadcast over heads (the
    dBias kernel sums over them) match the float64 oracle; GQA, causal, int64 segment ids."""
    batch, q_len, heads, kv_heads, head_dim = 1, 17, 4, 2, 16
    with jax.enable_x64(True):
        rng = np.random.default_rng(6)
        q, d_out = (normal(rng, (batch, q_len, heads, head_dim)) for _ in range(2))
        k, v = (normal(rng, (batch, q_len, kv_heads, head_dim)) for _ in range(2))
        d_lse = normal(rng, (batch, heads, q_len))
        bias = normal(rng, (batch, 1, q_len, q_len))
        ids_np = np.array([[0] * 9 + [1] * 8] * batch)
        ids = jnp.asarray(ids_np, jnp.int64)
        kwargs = dict(
            is_causal=True,
            q_segment_ids=ids,
            **path_kwargs(BACKEND_PATHS["triton-interpret"], "all16"),
        )
        (results,) = run(q, k, v, [(d_out, d_lse)], bias=bias, **kwargs)
    visible = np.tril(np.ones((q_len, q_len), bool)) & (ids_np[0][:, None] == ids_np[0])
    oracle = attention_oracle_f64(
        to64(q),
        to64(k),
        to64(v),
        to64(d_out),
        to64(d_lse),
        scale=head_dim**-0.5,
        visible=visible,
        bias=to64(bias),
    )
    oracle["dbias"] = oracle["dlogits"].sum(1, keepdims=True)
    for name, got in zip(("out", "lse", "dq", "dk", "dv", "dbias"), results):
        assert_close(name, got, oracle[name], atol=1e-4)


def test_segment_ids_that_do_not_fit_int32_raise():
    q = jnp.zeros((1, 8, 1, 16))
    for ids in (np.array([[0] * 4 + [2**31] * 4]), np.array([[masks.PAD_KV_SEGMENT] * 8])):
        with pytest.raises(ValueError, match=r"q_segment_ids \(int\d+, shape \(1, 8\)\).*must lie"):
            pallas_flash.flash_attention(q, q, q, q_segment_ids=ids, backend="xla")


def test_int64_segment_ids_are_renumbered_exactly():
    """Under x64, device int64 ids 0 and 2**32 (equal once wrapped to int32) stay apart, also
    traced: the result equals that of ids 0 and 1 (the ids reach every path the same way,
    through masks.make_arrays)."""
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        q, k, v = (normal(rng, (1, 20, 2, 16)) for _ in range(3))
        wide = jnp.asarray([[0] * 9 + [2**32] * 11], jnp.int64)
        narrow = jnp.asarray([[0] * 9 + [1] * 11], jnp.int32)
        fn = jax.jit(
            lambda ids: pallas_flash.flash_attention(q, k, v, q_segment_ids=ids, backend="xla")
        )
        np.testing.assert_array_equal(np.asarray(fn(wide)), np.asarray(fn(narrow)))


def test_zero_head_dim_raises():
    q = jnp.zeros((1, 4, 2, 0))
    with pytest.raises(
        ValueError, match=r"every dimension must be >= 1.*query.shape=\(1, 4, 2, 0\)"
    ):
        pallas_flash.flash_attention(q, q, q, backend="xla")


def test_symbolic_sequence_length_raises():
    t = jax.export.symbolic_shape("t")[0]
    spec = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    fn = jax.jit(lambda q: pallas_flash.flash_attention(q, q, q))
    with pytest.raises(NotImplementedError, match=r"query.shape\[1\]=t is symbolic"):
        jax.export.export(fn, platforms=["cpu"])(spec)


@pytest.mark.skipif(has_gpu(), reason="the CPU messages")
def test_backend_errors_name_what_runs():
    q = jnp.zeros((1, 4, 1, 16))
    with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU") as info:
        pallas_flash.flash_attention(q, q, q, backend="mosaic")
    assert "backend='triton' with interpret=True" in str(info.value)
    with pytest.raises(ValueError, match="backend='xla' runs no kernel") as info:
        pallas_flash.flash_attention(q, q, q, backend="xla", interpret=True)
    assert "Mosaic" not in str(info.value)
