"""The autodiff of pallas_flash: one jax.custom_vjp per path. On the kernel path the forward
saves (q, k, v, bias, mask arrays, out, lse, log_sum, row_max) and the backward calls the
kernels' backward with the cotangents of both outputs; on the "xla" path the same rule wraps the
plain-jnp reference.

Each pass goes down one way: `_forward` and `_backward` hand `_passes.forward` and
`_passes.backward` to `_partition.partitioned` (one device's shard on a mesh), which call the
backend wrappers that the `KernelConfig` names (Triton; on Hopper for the calls it supports,
Mosaic GPU; the forward of a few query tokens over a longer key sequence also the decode
kernel). Every forward returns the same (out, lse, log_sum), so either backward serves any
forward; in float32 calls the Triton forward's row max also reaches the Triton backward, which
recomputes P from it exactly (`_passes.takes_row_max`).

Derivatives of any order in reverse mode, and forward mode over reverse mode (`jax.hessian`),
work on every path: the kernel passes inside the rules are themselves differentiable, their
derivatives computed by differentiating the plain-jnp reference (which materialises the [T, S]
logits, so higher orders cost quadratic memory). The first-order backward runs the kernels only.
Forward mode on the attention itself fails on every path, "xla" included (the API refuses JVP
tracers with `api.ForwardModeError`; JAX refuses `jax.linearize` of a custom_vjp function), so
that code behaves the same on a laptop and on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash import _partition, _passes, _vma
from pallas_flash._numerics import accumulation_dtype, sink_probability
from pallas_flash._passes import KernelConfig
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.reference import reference_attention, with_sinks


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
# heads; on one device it calls the pass directly.
@functools.partial(jax.jit, static_argnames="config")
def _forward(q, k, v, bias, arrays, sinks, *, config: KernelConfig):
    """(out, lse, log_sum, row_max) of `_passes.forward` on every shard."""
    return tuple(
        _partition.partitioned(
            _passes.forward,
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
    """(dq, dk, dv, dbias) of `_passes.backward` on every shard."""
    return _partition.partitioned(
        _passes.backward,
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
    over the keys (`_passes.backward`); `sinks`: those lse includes, or None."""
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
