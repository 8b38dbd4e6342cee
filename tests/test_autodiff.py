"""Derivatives beyond first-order reverse mode, the same on every path.

Reverse mode of any order and forward mode over reverse mode (`jax.hessian`) work on the xla
backend and on the kernels, checked against float64 central differences of the float64 oracle's
analytic gradient, and with `jax.test_util.check_grads(order=2)`. Forward mode on the attention
itself (`jax.jvp`, `jax.jacfwd`, `jax.linearize`) raises the same error on every path. The
first-order backward stays the kernels' alone: no [T, S] array outside them.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support.backends import BACKEND_PATHS, backend_paths, has_gpu
from support.oracle import attention_oracle_f64

import pallas_flash

XLA = BACKEND_PATHS["xla"]
# The slower checks (check_grads evaluates many transformed calls eagerly, ~10 s on 2 cores) run
# on the GPU, and on CPU with PALLAS_FLASH_SWEEP set (the long property sweep's switch).
LONG = bool(os.environ.get("PALLAS_FLASH_SWEEP")) or has_gpu()


@dataclasses.dataclass(frozen=True)
class Case:
    """A small f32 call with odd sizes; `bias`: its shape, right-aligned on (B, N, T, S)."""

    name: str
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: tuple[int, ...] | None = None
    is_causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    mask: bool = False
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None
    segments: bool = False

    def __str__(self):
        return self.name


CASES = [
    # GQA, a per-head bias, causal (T > S), soft cap and key lengths.
    Case("gqa-bias-causal-cap-kvlen", 2, 7, 5, 4, 2, 16, bias=(1, 4, 7, 5), is_causal=True,
         soft_cap=3.0, kv_lengths=(5, 3)),
    # MQA, a key-only bias, a window, a bool mask, segment ids and a query length that leaves
    # rows with no key (zero output, lse = -inf).
    Case("mqa-bias-window-mask-seg-qlen", 1, 9, 6, 2, 1, 8, bias=(6,), window=(3, 1), mask=True,
         q_lengths=(7,), segments=True),
]  # fmt: skip


def make_inputs(c: Case, seed: int = 0):
    """Differentiable inputs x = (q, k, v, bias), cotangents (d_out, d_lse), directions u (for x)
    and w (for the cotangents), all float64 numpy, and the mask arguments as a dict."""
    rng = np.random.default_rng(seed)
    q_shape = (c.batch, c.q_len, c.num_heads, c.head_dim)
    kv_shape = (c.batch, c.kv_len, c.num_kv_heads, c.head_dim)
    lse_shape = (c.batch, c.num_heads, c.q_len)
    shapes = [q_shape, kv_shape, kv_shape] + ([c.bias] if c.bias else [])
    # Rounded to float32 so that the oracle sees the values the paths see.
    normal = lambda shape: rng.standard_normal(shape).astype(np.float32).astype(np.float64)  # noqa: E731
    x = [normal(s) for s in shapes] + ([] if c.bias else [None])
    u = [normal(s) for s in shapes] + ([] if c.bias else [None])
    cts = [normal(q_shape), normal(lse_shape)]
    w = [normal(q_shape), normal(lse_shape)]
    extra = {}
    if c.mask:
        extra["mask"] = rng.random((1, 1, c.q_len, c.kv_len)) < 0.7
    if c.q_lengths:
        extra["query_seq_lengths"] = np.array(c.q_lengths, np.int32)
    if c.kv_lengths:
        extra["key_value_seq_lengths"] = np.array(c.kv_lengths, np.int32)
    if c.segments:
        extra["q_segment_ids"] = np.sort(rng.integers(0, 2, (c.batch, c.q_len)), 1).astype(np.int32)
        extra["kv_segment_ids"] = np.sort(rng.integers(0, 2, (c.batch, c.kv_len)), 1).astype(
            np.int32
        )
    return x, cts, u, w, extra


def visibility(c: Case, extra) -> np.ndarray:
    """[B, 1, T, S] bool: who may attend whom, from the arguments alone."""
    i, j = np.arange(c.q_len)[:, None], np.arange(c.kv_len)[None, :]
    vis = np.ones((c.batch, 1, c.q_len, c.kv_len), bool)
    if c.is_causal:
        vis &= j <= i
    if c.window:
        vis &= (i - c.window[0] <= j) & (j <= i + c.window[1])
    if "mask" in extra:
        vis &= extra["mask"]
    if "query_seq_lengths" in extra:
        vis &= (np.arange(c.q_len) < extra["query_seq_lengths"][:, None])[:, None, :, None]
    if "key_value_seq_lengths" in extra:
        vis &= (np.arange(c.kv_len) < extra["key_value_seq_lengths"][:, None])[:, None, None, :]
    if "q_segment_ids" in extra:
        q_ids, kv_ids = extra["q_segment_ids"], extra["kv_segment_ids"]
        vis &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    return vis


def oracle_f64(c: Case, extra, x, cts):
    """Float64 ((out, lse), (dq, dk, dv, dbias)) for inputs x and cotangents cts."""
    q, k, v, bias = x
    bias4 = None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    r = attention_oracle_f64(
        q,
        k,
        v,
        *cts,
        scale=1.0 / math.sqrt(c.head_dim),
        visible=visibility(c, extra),
        bias=bias4,
        soft_cap=c.soft_cap,
    )
    dbias = None
    if bias is not None:
        summed = tuple(d for d in range(4) if bias4.shape[d] == 1)
        dbias = r["dlogits"].sum(axis=summed, keepdims=True).reshape(bias.shape)
    return (r["out"], r["lse"]), (r["dq"], r["dk"], r["dv"], dbias)


def central_difference(f, x, u, eps=1e-4):
    """(f(x + eps u) - f(x - eps u)) / (2 eps) over pytrees of float64 arrays (None leaves)."""

    def step(sign):
        return f(jax.tree.map(lambda a, b: a + sign * eps * b, x, u))

    plus, minus = step(1.0), step(-1.0)
    with np.errstate(invalid="ignore"):  # -inf - -inf: lse of a row with no key
        return jax.tree.map(lambda p, m: (p - m) / (2 * eps), plus, minus)


def attention_fn(c: Case, extra, path):
    """(q, k, v, bias) -> (out, lse) on `path` (a support.backends.BackendPath)."""
    kwargs = dict(path.kwargs)
    kwargs.update({name: jnp.asarray(a) for name, a in extra.items()})

    def attention(q, k, v, bias):
        return pallas_flash.flash_attention(
            q,
            k,
            v,
            bias,
            is_causal=c.is_causal,
            local_window_size=c.window,
            logits_soft_cap=c.soft_cap,
            return_residuals=True,
            **kwargs,
        )

    return attention


def as_f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def max_relative_error(got, want) -> float:
    """max |got - want| / max(1, max |want|) over the finite entries of `want`, each leaf; -inf
    (lse of rows with no key) must match exactly."""
    worst = 0.0
    for g, o in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g = np.asarray(g, np.float64)
        assert g.shape == o.shape, (g.shape, o.shape)
        finite = np.isfinite(o)
        assert np.array_equal(g[~finite], o[~finite])
        assert np.isfinite(g[finite]).all()
        scale = max(1.0, float(np.max(np.abs(o[finite]), initial=0.0)))
        worst = max(worst, float(np.max(np.abs(g[finite] - o[finite]), initial=0.0)) / scale)
    return worst


# Float32 paths against float64 differences: rounding leaves ~1e-6; a wrong or missing term of
# the second derivative is of the order of the result.
SECOND_ORDER_RTOL = 1e-3


def _second_order_params():
    """Every case on every path but xla, which runs one (its derivatives are jax's own)."""
    return [
        pytest.param(c, *path.values, id=f"{c}-{path.id}", marks=path.marks)
        for path in backend_paths()
        for c in (CASES[1:2] if path.id == "xla" else CASES)
    ]


@pytest.mark.parametrize("c, path", _second_order_params())
@pytest.mark.ci_slice(1)
def test_second_order_matches_float64_differences(c, path):
    """With y(x) = (out, lse) and g(x, c) = the VJP of attention at x for cotangents c, of
    h(x, c) = (y(x), g(x, c)): reverse over reverse (the gradient of <g, u> + <y, w> in x and c)
    and forward over reverse (the JVP of h along (u, w)), against central differences of the
    float64 oracle's output and analytic gradient."""
    x, cts, u, w, extra = make_inputs(c)
    attention = attention_fn(c, extra, path)

    def h(x, cts):
        y, vjp = jax.vjp(attention, *x)
        return y, vjp(tuple(cts))

    def inner(x, cts, u, w):
        (out, lse), g = h(x, cts)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # -inf: rows with no key
        return (
            sum(jnp.vdot(a, b) for a, b in zip(g, u) if b is not None)
            + jnp.vdot(out, w[0])
            + jnp.vdot(lse, w[1])
        )

    args = as_f32((x, cts, u, w))
    rev_over_rev = jax.jit(jax.grad(inner, argnums=(0, 1)))(*args)
    fwd_over_rev = jax.jit(lambda x, cts, u, w: jax.jvp(h, (x, cts), (u, w))[1])(*args)

    def h64(xc):
        y, g = oracle_f64(c, extra, *xc)
        return list(y), list(g)

    # (J u, H_c u + J^T w): the derivative of lse of a row with no key (constant -inf) is 0.
    jac_u, hess_u = central_difference(h64, (x, cts), (u, [np.zeros_like(a) for a in w]))
    jac_u = [np.where(np.isfinite(d), d, 0.0) for d in jac_u]
    jac_t_w = oracle_f64(c, extra, x, w)[1]
    want_x = [None if a is None else a + b for a, b in zip(hess_u, jac_t_w)]
    assert max_relative_error(rev_over_rev, (want_x, jac_u)) < SECOND_ORDER_RTOL
    jvp_want = central_difference(h64, (x, cts), (u, w))
    jvp_want[0][:] = [np.where(np.isfinite(d), d, 0.0) for d in jvp_want[0]]
    assert max_relative_error(fwd_over_rev, jvp_want) < SECOND_ORDER_RTOL


@pytest.mark.skipif(not LONG, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")
@pytest.mark.parametrize("path", backend_paths())
def test_check_grads_second_order(path):
    """`jax.test_util.check_grads(order=2)` (reverse mode; the VJP of the VJP, the cotangents
    included) with GQA, a bias, causal masking and key lengths."""
    c = CASES[0]
    x, _, _, _, extra = make_inputs(c, seed=1)
    attention = jax.jit(attention_fn(c, extra, path))
    check_grads(attention, as_f32(x), order=2, modes=("rev",), eps=1e-3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", backend_paths(exclude=("xla",)))
def test_hessian_matches_between_paths(path):
    """`jax.hessian` (forward over reverse) of a scalar of the output in q, against the xla
    path's: the same second derivative whatever runs the first."""
    c = CASES[1]
    x, _, _, _, extra = make_inputs(c, seed=2)
    q, k, v, bias = as_f32(x)

    def hessian(path):
        attention = attention_fn(c, extra, path)
        scalar = lambda q: jnp.sum(jnp.sin(attention(q, k, v, bias)[0]))  # noqa: E731
        return jax.jit(jax.hessian(scalar))(q)

    got = hessian(path)
    assert got.shape == q.shape * 2
    want = np.asarray(hessian(XLA), np.float64)
    assert max_relative_error(got, want) < SECOND_ORDER_RTOL


FORWARD_MODE = {
    "jit-jvp": lambda f, q: jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q),
    "jacfwd": lambda f, q: jax.jacfwd(f)(q),
    "linearize": lambda f, q: jax.linearize(f, q)[1](q),
}


@pytest.mark.parametrize("how", sorted(FORWARD_MODE))
@pytest.mark.parametrize("path", backend_paths())
def test_forward_mode_raises_the_same_error_on_every_path(path, how):
    q = jnp.ones((1, 5, 2, 8)) / 3
    k = v = jnp.ones((1, 3, 1, 8)) / 5

    def attention(q):
        return pallas_flash.flash_attention(q, k, v, is_causal=True, **path.kwargs)

    if how == "linearize":  # linearize traces with linearize tracers: JAX's own error
        error, match = TypeError, "can't apply forward-mode autodiff"
    else:
        error, match = NotImplementedError, "forward-mode differentiation .* Use reverse mode"
    with pytest.raises(error, match=match) as info:
        FORWARD_MODE[how](attention, q)
    assert isinstance(info.value, TypeError)  # one exception type catches every mode


def test_first_order_backward_runs_only_the_kernels():
    """The gradient of a kernel call materialises no [T, S] array outside the kernels: the
    differentiable wrapping of the kernel passes costs the first-order backward nothing."""
    t, s = 40, 24
    q = jnp.ones((1, t, 2, 16))
    k = v = jnp.ones((1, s, 1, 16))

    def loss(q, k, v):
        out, lse = pallas_flash.flash_attention(
            q,
            k,
            v,
            is_causal=True,
            return_residuals=True,
            **BACKEND_PATHS["triton-interpret"].kwargs,
        )
        return jnp.sum(out) + jnp.sum(lse)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    eqns = list(_outer_eqns(jaxpr))
    shapes = [
        (eqn.primitive.name, var.aval.shape)
        for eqn in eqns
        for var in eqn.outvars
        if tuple(getattr(var.aval, "shape", ()))[-2:] == (t, s)
    ]
    assert not shapes, f"[T, S] arrays outside the kernels: {shapes}"
    kernels = [eqn for eqn in eqns if eqn.primitive.name == "pallas_call"]
    assert len(kernels) == 3, kernels  # the forward, dK/dV and dQ


def _outer_eqns(jaxpr):
    """Every equation, into sub-jaxprs but not into the kernels (pallas_call)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _outer_eqns(inner)


@pytest.mark.parametrize("path", backend_paths(exclude=("xla",)))
def test_decode_second_order_matches_xla(path):
    """decode_attention's kernel (differentiated through its reference): grad of grad and
    `jax.hessian` equal the xla backend's."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32) for _ in range(2))
    lengths = jnp.array([17, 40])

    def second_order(path):
        def f(q, k):
            return pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=lengths, **path.kwargs
            )

        def grad_k(q, k):
            return jax.grad(lambda q, k: jnp.sum(jnp.sin(f(q, k))), argnums=1)(q, k)

        grad_of_grad = jax.grad(lambda q, k: jnp.sum(jnp.sin(grad_k(q, k))), argnums=(0, 1))
        hessian = jax.hessian(lambda q: jnp.sum(jnp.sin(f(q, k))))
        return jax.jit(lambda q, k: (grad_of_grad(q, k), hessian(q)))(q, k)

    want = jax.tree.map(lambda x: np.asarray(x, np.float64), second_order(XLA))
    assert max_relative_error(second_order(path), want) < SECOND_ORDER_RTOL


# -- float64 ---------------------------------------------------------------------------------------

# Where float64 runs: backend="xla" (and backend=None, which picks it on a GPU too) and the
# Triton interpreter. The GPU kernels refuse it, naming the dtype.
FLOAT64_PATHS = backend_paths(
    mosaic=True, refuses={name: "float64" for name in ("triton", "mosaic", "mosaic-interpret")}
)


@pytest.mark.parametrize("path", FLOAT64_PATHS)
def test_check_grads_in_float64(path):
    """`jax.test_util.check_grads(order=2, modes=("rev",))` at its default (float64)
    tolerances, GQA, causal, key lengths; on backend="xla" with a bias and sinks too (the
    kernels' with them, and decode and paged attention: test_float64_sweep). x64 is on in this
    test only."""
    rng = np.random.default_rng(4)
    with jax.enable_x64(True), path.scope():
        q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in FLOAT64_SHAPES)
        bias, sinks = jnp.asarray(rng.standard_normal((4, 5, 7))), jnp.asarray([0.5, -1, 2, 0])
        assert q.dtype == jnp.float64
        args, options = (q, k, v), {}
        if path.name == "xla":
            args, options = (q, k, v, bias), dict(sinks=sinks)
        attention = _float64_attention(path, **options)
        out, lse = attention(*args)
        assert out.dtype == lse.dtype == jnp.float64
        check_grads(jax.jit(attention), args, order=2, modes=("rev",))
    assert not jax.config.jax_enable_x64


FLOAT64_SHAPES = ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8))


def _float64_attention(path, **options):
    def attention(q, k, v, bias=None, sinks=None):
        sinks = options.get("sinks", sinks)
        return pallas_flash.flash_attention(
            q, k, v, bias, is_causal=True, key_value_seq_lengths=np.array([7, 4]), sinks=sinks,
            return_residuals=True, **path.kwargs,
        )  # fmt: skip

    return attention


@pytest.mark.skipif(not LONG, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")
@pytest.mark.parametrize("path", backend_paths(gpu=False, exclude=("mosaic-interpret",)))
def test_float64_sweep(path):
    """check_grads(order=2, rev) in float64 at default tolerances: the kernels (interpreter)
    with a bias and sinks; decode_attention and paged_attention on both paths."""
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in FLOAT64_SHAPES)
        bias, sinks = jnp.asarray(rng.standard_normal((4, 5, 7))), jnp.asarray([0.5, -1, 2, 0])
        attention = _float64_attention(path)
        check_grads(jax.jit(attention), (q, k, v, bias, sinks), order=2, modes=("rev",))
        pages, tables = k.reshape(7, 2, 2, 8), jnp.asarray([[6, 0, 5, 1], [2, 4, 3, 0]])

        def decode(q, k, v, pages):
            lengths = np.array([7, 3])
            return (
                pallas_flash.decode_attention(
                    q, k, v, key_value_seq_lengths=lengths, return_residuals=True, **path.kwargs
                ),
                pallas_flash.paged_attention(q, pages, pages, tables, lengths, **path.kwargs),
            )

        check_grads(jax.jit(decode), (q[:, :2], k, v, pages), order=2, modes=("rev",))
