"""The autodiff of pallas_flash: one jax.custom_vjp per path. On the kernel path the forward
saves (q, k, v, bias, mask arrays, out, lse, log_sum, row_max) and the backward calls the
kernels' backward with the cotangents of both outputs; on the "xla" path the same rule wraps the
plain-jnp reference.

Each pass runs on Triton or, on Hopper for the calls it supports, on a Mosaic GPU kernel
(`KernelConfig.forward`, `KernelConfig.backward`); the forward of a few query tokens over a
longer key sequence also on the decode kernel (forward "decode", `triton.decode.
few_token_forward`). Every forward returns the same (out, lse, log_sum), so either backward
serves any forward; in float32 calls the Triton forward's row max also reaches the Triton
backward, which recomputes P from it exactly (`_takes_row_max`).

Derivatives of any order in reverse mode, and forward mode over reverse mode (`jax.hessian`),
work on every path: the kernel passes inside the rules are themselves differentiable, their
derivatives computed by differentiating the plain-jnp reference (which materialises the [T, S]
logits, so higher orders cost quadratic memory). The first-order backward runs the kernels only.
Forward mode on the attention itself fails on every path, "xla" included (the API refuses JVP
tracers with `api.ForwardModeError`; JAX refuses `jax.linearize` of a custom_vjp function), so
that code behaves the same on a laptop and on the GPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_flash import _partition, _vma, mosaic, triton
from pallas_flash._numerics import accumulation_dtype, sink_probability
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles, ForwardTiles
from pallas_flash.reference import reference_attention, with_sinks
from pallas_flash.triton import BlockSizes
from pallas_flash.triton.decode import few_token_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Everything static about one call: hashable, passed as a nondiff argument. Built by
    `pallas_flash.dispatch.choose`, the one place that decides which kernels run a call. Every
    backend's wrapper takes it whole (`_FORWARDS`, `_BACKWARDS`) and reads what it needs."""

    spec: MaskSpec
    scale: float
    soft_cap: float | None = None
    # > 0: dropout on P (seeds in MaskArrays.dropout_seeds), in every kernel.
    dropout_rate: float = 0.0
    block_sizes: BlockSizes
    interpret: bool
    # "triton"; "mosaic": the Mosaic GPU forward (Hopper; no bias or dense mask); or "decode":
    # the decode kernel (a few query tokens; geometry and sequence lengths only, 16-bit).
    forward: str = "triton"
    # "triton", or "mosaic": the Mosaic GPU backward (Hopper; the Mosaic forward's masks).
    backward: str = "triton"
    # The Mosaic kernels' tiles (None: their defaults for the shapes).
    mosaic_forward_tiles: ForwardTiles | None = None
    mosaic_backward_tiles: BackwardTiles | None = None
    # The GPU the kernels are compiled for (its SM count sizes persistent and split-KV grids);
    # None: the visible GPU's (the interpreter needs none).
    device: Device | None = None

    def __post_init__(self):
        if self.forward not in ("triton", "mosaic", "decode"):
            raise ValueError(
                f"KernelConfig.forward={self.forward!r} must be 'triton', 'mosaic' or 'decode'"
            )
        if self.backward not in ("triton", "mosaic"):
            raise ValueError(
                f"KernelConfig.backward={self.backward!r} must be 'triton' or 'mosaic'"
            )


def flash_attention_kernels(q, k, v, bias, arrays: MaskArrays, config: KernelConfig, sinks=None):
    """(out, lse) through the kernels, differentiable in q, k, v, bias and sinks.

    sinks: None, or float32 [B, N]: one more logit per row of head n of batch entry b, with no
    value, in the softmax's denominator (attention sinks); lse then includes it."""
    out, lse, _ = flash_attention_kernels_with_log_sum(q, k, v, bias, arrays, config, sinks)
    return out, lse


def flash_attention_kernels_with_log_sum(
    q, k, v, bias, arrays: MaskArrays, config: KernelConfig, sinks=None
):
    """(out, lse, log_sum) through the kernels: `flash_attention_kernels` and the forward's
    log_sum (`_forward`), a residual for a backward run apart (`flash_backward_kernels`). Its
    cotangent is dropped: callers hand it out under stop_gradient."""
    # Inside jax.shard_map the kernels' gradients vary over every manual axis any operand
    # varies over: the differentiable operands take that type first, so that one the same on
    # every device (a replicated bias or sinks) gets its gradient summed over them (the
    # transpose of the cast).
    q, k, v, bias, sinks = _vma.vary_like((q, k, v, bias, sinks), q, k, v, bias, arrays, sinks)
    return _kernels_with_log_sum(q, k, v, bias, arrays, config, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _kernels_with_log_sum(q, k, v, bias, arrays: MaskArrays, config: KernelConfig, sinks=None):
    return _forward(q, k, v, bias, arrays, sinks, config=config)[:3]


# Each pass is one jit'd function of the static config: a model that repeats a layer traces and
# lowers its kernels once (jax reuses the lowered function at every call site), so every site
# carries the same Mosaic GPU module, which the GPU compiles once by its hash.
# On a device mesh, `_partition.partitioned` runs each pass on every device's batch entries and
# heads.
@functools.partial(jax.jit, static_argnames="config")
def _forward(q, k, v, bias, arrays, sinks, *, config: KernelConfig):
    """(out, lse, log_sum, row_max): log_sum (each row's log softmax denominator relative to its
    max, from either forward) lets either backward recompute tied logits exactly at any
    magnitude; row_max (that max in the Triton forward's units, `triton.flash_forward`) lets
    the Triton backward recompute P free of lse's rounding, which float32 calls need
    (`_takes_row_max`). Elsewhere lse stands in its place, never read (`_backward_shard`)."""
    return tuple(
        _partition.partitioned(
            _forward_shard,
            config,
            ("q", "kv", "v", "pair", "arrays", "sinks"),
            ("o", "lse", "lse", "lse"),
            q,
            k,
            v,
            bias,
            arrays,
            sinks,
        )
    )


# Every backend's passes take one argument shape: the arrays, the mask's arrays (and sinks), and
# the call's KernelConfig, from which each reads what it needs.
_FORWARDS = {
    "triton": triton.flash_forward,
    "mosaic": mosaic.flash_forward,
    "decode": few_token_forward,
}
_BACKWARDS = {"triton": triton.flash_backward, "mosaic": mosaic.flash_backward}


def _forward_shard(q, k, v, bias, arrays, sinks, *, config: KernelConfig):
    if _takes_row_max(q, config):
        return triton.flash_forward(
            q, k, v, bias, arrays, sinks, config=config, with_log_sum=True, with_row_max=True
        )
    forward = _FORWARDS[config.forward]
    out, lse, log_sum = forward(q, k, v, bias, arrays, sinks, config=config, with_log_sum=True)
    return out, lse, log_sum, lse


def _takes_row_max(q, config: KernelConfig) -> bool:
    """Whether the Triton backward recomputes P from the Triton forward's row max: float32
    calls, whose P lse's rounding would move by ~3e-5 at logits in the hundreds. 16-bit calls
    round P to their dtype for the matmuls, far coarser, and keep one add per element fewer
    (`triton._common.recomputed_probs`)."""
    return config.forward == "triton" and config.backward == "triton" and q.dtype == jnp.float32


def _common_head_dim(*xs):
    """xs zero-padded to their largest head dim: the Triton backward takes one head dim, and
    runs a value head dim Hv != H so (zero columns leave q.k and dO.V^T unchanged; the
    gradients' extra columns are cut off)."""
    h = max(x.shape[-1] for x in xs)
    return tuple(
        x if x.shape[-1] == h else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, h - x.shape[-1]),))
        for x in xs
    )


def _fwd_rule(q, k, v, bias, arrays, config: KernelConfig, sinks):
    out, lse, log_sum, row_max = _differentiable_forward(q, k, v, bias, arrays, sinks, config)
    return (out, lse, log_sum), (q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max)


def _bwd_rule(config: KernelConfig, residuals, cotangents):
    # With sinks, lse includes them: the kernels' P = exp(logits - lse) and delta = rowsum(dO *
    # out) are then those of the softmax over keys and sink, and so are dq, dk, dv and dbias.
    q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max = residuals
    d_out, d_lse, _ = cotangents
    dq, dk, dv, dbias = _differentiable_backward(
        q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, config
    )
    d_sinks = None
    if sinks is not None:
        d_sinks = sink_gradient(sinks, out, lse, log_sum, d_out, d_lse)
        d_sinks = _partition.with_sharding_of(d_sinks, sinks)
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, arrays), d_sinks


def _bias_gradient_in_closed_form(bias, config: KernelConfig) -> bool:
    """Whether the bias's gradient is `key_broadcast_bias_gradient`'s rather than the kernels'
    (a bias broadcast over the keys, no soft cap)."""
    return bias is not None and bias.shape[-1] == 1 and config.soft_cap is None


def key_broadcast_bias_gradient(bias, sinks, out, lse, log_sum, d_out, d_lse):
    """d bias of a bias [B|1, N|1, T|1, 1] broadcast over the keys (no soft cap): each row's
    sum over its keys of dS = P * (dP - delta), in closed form. With rowsum(P * dP) = dO . out
    and the keys' share of the row's softmax 1 - P_sink, that sum is P_sink (dO . out) +
    (1 - P_sink) d_lse: d_lse itself without sinks, 0 for rows that see no key. The kernels'
    sum of dS cancels to noise in 16-bit inputs (P rounded for P V in the forward, not in the
    backward); this is exact, and is what the XLA path's autodiff computes."""
    f32 = accumulation_dtype(lse.dtype)
    rows = jnp.where(jnp.isneginf(lse), 0.0, d_lse.astype(f32))  # [B, N, T]
    if sinks is not None:
        sinks = jnp.broadcast_to(jnp.asarray(sinks, f32), lse.shape[:-1])
        # A row that sees no key has P_sink = 1 and out = 0: its sum is 0. (lse == sink does
        # not tell it: a sink tied with a max beyond ~1e6 has lse == sink too.)
        p_sink = sink_probability(sinks, lse, log_sum)
        d_out_dot_out = jnp.einsum("btnh,btnh->bnt", d_out.astype(f32), out.astype(f32))
        rows = p_sink * d_out_dot_out + (1.0 - p_sink) * rows
    grad = rows[..., None]  # [B, N, T, 1]
    axes = tuple(i for i in range(3) if bias.shape[i] == 1 and grad.shape[i] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True).astype(bias.dtype)


def sink_gradient(sinks, out, lse, log_sum, d_out, d_lse):
    """d sinks [B, N] of a softmax whose lse [B, N, T] (and log_sum, or None) includes the sinks
    [B, N]: the sink's probability P_sink (`_numerics.sink_probability`) gives d lse / d sink =
    P_sink and d out / d sink = -P_sink out, so d sink = -sum over rows of P_sink
    (rowsum(dO * out) - d_lse). A row that sees no key has P_sink = 1."""
    f32 = accumulation_dtype(lse.dtype)
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(f32), out.astype(f32)) - d_lse
    return -jnp.sum(sink_probability(sinks, lse, log_sum) * delta, axis=-1)


@functools.partial(jax.jit, static_argnames="config")
def _backward(
    q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, *, config: KernelConfig
):
    return _partition.partitioned(
        _backward_shard,
        config,
        ("q", "kv", "v", "pair", "arrays", "sinks", "o", "lse", "lse", "lse", "o", "lse"),
        ("q", "kv", "v", "pair"),
        q,
        k,
        v,
        bias,
        arrays,
        sinks,
        out,
        lse,
        log_sum,
        row_max,
        d_out,
        d_lse,
    )


def _backward_shard(
    q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, *, config: KernelConfig
):
    """One shard's (dq, dk, dv, dbias). A bias broadcast over the keys gets its gradient in
    closed form, per row (`key_broadcast_bias_gradient`), and no dbias kernel runs."""
    head_dim, value_head_dim = q.shape[-1], v.shape[-1]
    # row_max: the Triton forward's where `_takes_row_max`, else a stand-in, not read.
    rows = (lse, log_sum, row_max if _takes_row_max(q, config) else None)
    closed_form = _bias_gradient_in_closed_form(bias, config)
    kernels = functools.partial(
        _BACKWARDS[config.backward], config=config, bias_gradient=not closed_form
    )
    # The Mosaic backward takes Hv != H as it is; the Triton backward takes one head dim.
    if head_dim == value_head_dim or config.backward == "mosaic":
        dq, dk, dv, dbias = kernels(q, k, v, bias, arrays, out, *rows, d_out, d_lse)
    else:
        padded = _common_head_dim(q, k, v, out, d_out)
        dq, dk, dv, dbias = kernels(
            *padded[:3], bias, arrays, *padded[3:4], *rows, padded[4], d_lse
        )
        dq, dk, dv = dq[..., :head_dim], dk[..., :head_dim], dv[..., :value_head_dim]
    if closed_form:
        dbias = key_broadcast_bias_gradient(bias, sinks, out, lse, log_sum, d_out, d_lse)
    return dq, dk, dv, dbias


_kernels_with_log_sum.defvjp(_fwd_rule, _bwd_rule)


def flash_backward_kernels(
    q, k, v, bias, arrays, out, lse, d_out, d_lse, config: KernelConfig, log_sum=None
):
    """(dq, dk, dv, dbias) of the kernels' backward at the given residuals (out, lse, and the
    forward's log_sum or None), which may be those of a larger softmax (a ring's merged
    blocks); differentiable as the rule's."""
    return _differentiable_backward(
        q, k, v, bias, arrays, None, out, lse, log_sum, None, d_out, d_lse, config
    )


def with_reference_vjp(kernel, reference, *args):
    """kernel(*args), differentiated through reference(*args): for forward-only kernels (decode)
    whose reference is cheap to differentiate. Integer (and None) arguments get no cotangent."""
    # The arguments vary over one set of manual axes, as in flash_attention_kernels_with_log_sum.
    inexact = [a is not None and jnp.issubdtype(a.dtype, jnp.inexact) for a in args]
    args = [_vma.vary_like(a, *args) if f else a for a, f in zip(args, inexact, strict=True)]
    return _with_reference_vjp(kernel, reference, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_reference_vjp(kernel, reference, *args):
    return kernel(*args)


def _reference_fwd(kernel, reference, *args):
    return _kernel_with_reference_jvp(kernel, reference, *args), args


# The kernel under an outer differentiation (second order): its tangent is the reference's.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_with_reference_jvp(kernel, reference, *args):
    return kernel(*args)


@_kernel_with_reference_jvp.defjvp
def _kernel_with_reference_jvp_rule(kernel, reference, primals, tangents):
    out = _kernel_with_reference_jvp(kernel, reference, *primals)
    return out, jax.jvp(reference, primals, tangents)[1]


def _reference_bwd(kernel, reference, args, cotangents):
    _, vjp = jax.vjp(reference, *args)
    grads = vjp(cotangents)
    return tuple(
        g if a is not None and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else None
        for a, g in zip(args, grads)
    )


_with_reference_vjp.defvjp(_reference_fwd, _reference_bwd)


# -- derivatives of the rules' kernel passes (second order and beyond) ----------------------------
# Under an outer differentiation the custom_vjp's rules run on traced values, and a pallas_call
# has no derivative of its own. Each pass is therefore a custom_jvp: its value is the kernels',
# its tangent that of the plain-jnp reference (reverse mode transposes that tangent). Without an
# outer differentiation these are plain calls of `_forward` and `_backward`.


def _reference_of(arrays, spec: MaskSpec, scale, soft_cap, dropout_rate, with_log_sum=False):
    """(q, k, v, bias) -> (out, lse), or with with_log_sum (out, lse, log_sum), of the plain-jnp
    reference for one call's static options."""
    return lambda q, k, v, bias: reference_attention(
        q,
        k,
        v,
        bias,
        arrays,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        dropout_rate=dropout_rate,
        with_log_sum=with_log_sum,
    )


def _reference(q, k, v, bias, sinks, arrays, config: KernelConfig):
    out, lse, log_sum = _reference_of(
        arrays, config.spec, config.scale, config.soft_cap, config.dropout_rate, True
    )(q, k, v, bias)
    return (out, lse) if sinks is None else with_sinks(out, lse, sinks, log_sum)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def _differentiable_forward(q, k, v, bias, arrays, sinks, config: KernelConfig):
    return _forward(q, k, v, bias, arrays, sinks, config=config)


@_differentiable_forward.defjvp
def _differentiable_forward_jvp(config: KernelConfig, primals, tangents):
    q, k, v, bias, arrays, sinks = primals
    out, lse, log_sum, row_max = _differentiable_forward(q, k, v, bias, arrays, sinks, config)
    _, (t_out, t_lse) = jax.jvp(
        lambda q, k, v, bias, sinks: _reference(q, k, v, bias, sinks, arrays, config),
        (q, k, v, bias, sinks),
        (*tangents[:4], tangents[5]),
    )
    # log_sum and row_max only serve the backward's recomputed P, and the backward's derivative
    # is the reference's: their tangents are never read.
    zeros = jax.tree.map(jnp.zeros_like, (log_sum, row_max))
    return (out, lse, log_sum, row_max), (t_out, t_lse, *zeros)


@functools.partial(jax.custom_jvp, nondiff_argnums=(12,))
def _differentiable_backward(
    q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, config: KernelConfig
):
    """(dq, dk, dv, dbias) of the kernels' backward, dbias in closed form for a bias broadcast
    over the keys (`_bias_gradient_in_closed_form`); `sinks`: those lse includes, or None."""
    return _backward(
        q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, config=config
    )


@_differentiable_backward.defjvp
def _differentiable_backward_jvp(config: KernelConfig, primals, tangents):
    q, k, v, bias, arrays, sinks, out, lse, _, _, d_out, d_lse = primals
    grads = _differentiable_backward(*primals, config)

    def reference_grads(q, k, v, bias, sinks, d_out, d_lse):
        _, vjp = jax.vjp(
            lambda q, k, v, bias: _reference(q, k, v, bias, sinks, arrays, config), q, k, v, bias
        )
        return vjp((d_out, d_lse))

    # The reference recomputes (out, lse) from (q, k, v, bias, sinks), so their tangents reach
    # the result through those of q, k, v, bias and sinks; the residuals' own tangents (always
    # those of the forward at the same point) would count them twice and are left out.
    tq, tk, tv, tbias, _, tsinks, _, _, _, _, td_out, td_lse = tangents
    _, grads_tangent = jax.jvp(
        reference_grads,
        (q, k, v, bias, sinks, d_out, d_lse),
        (tq, tk, tv, tbias, tsinks, td_out, td_lse),
    )
    return grads, grads_tangent


# -- the "xla" path -------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def reference_attention_vjp(
    q, k, v, bias, arrays: MaskArrays, spec: MaskSpec, scale, soft_cap, dropout_rate=0.0
):
    """(out, lse, log_sum) of `reference_attention` behind the same custom_vjp rule as the
    kernels: its gradients are jax's of the reference (log_sum carries none), and forward mode
    fails as it does on the kernels."""
    return _reference_of(arrays, spec, scale, soft_cap, dropout_rate, with_log_sum=True)(
        q, k, v, bias
    )


def _reference_fwd_rule(q, k, v, bias, arrays, spec, scale, soft_cap, dropout_rate):
    reference = _reference_of(arrays, spec, scale, soft_cap, dropout_rate, with_log_sum=True)
    results, vjp = jax.vjp(reference, q, k, v, bias)
    return results, (vjp, arrays)


def _reference_bwd_rule(spec, scale, soft_cap, dropout_rate, residuals, cotangents):
    del spec, scale, soft_cap, dropout_rate
    vjp, arrays = residuals
    return *vjp(cotangents), jax.tree.map(lambda _: None, arrays)


reference_attention_vjp.defvjp(_reference_fwd_rule, _reference_bwd_rule)
