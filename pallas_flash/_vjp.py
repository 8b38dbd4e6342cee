"""The one jax.custom_vjp of pallas_flash: forward saves (q, k, v, bias, mask arrays, out, lse),
backward calls the kernels' backward with the cotangents of both outputs.

Each pass runs on Triton or, on Hopper for the calls it supports, on a Mosaic GPU kernel
(`KernelConfig.forward`, `KernelConfig.backward`). Both forwards return the same (out, lse),
so either backward serves either forward."""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_flash import _partition
from pallas_flash.config import BlockSizes
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic
from pallas_flash.triton.backward import flash_backward
from pallas_flash.triton.forward import flash_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Everything static about one call: hashable, passed as a nondiff argument."""

    spec: MaskSpec
    scale: float
    soft_cap: float | None = None
    block_sizes: BlockSizes
    interpret: bool
    # "triton", or "mosaic": the Mosaic GPU forward (Hopper; no bias or dense mask; the API
    # checks `pallas_flash.mosaic.supports` before choosing it).
    forward: str = "triton"
    # "triton", or "mosaic": the Mosaic GPU backward (Hopper; H 64/128, plain and causal calls
    # only; the API checks `pallas_flash.mosaic.supports_backward` before choosing it).
    backward: str = "triton"
    # The Mosaic kernels' tiles (None: their defaults for the shapes), from the autotune cache.
    mosaic_forward_tiles: mosaic.ForwardTiles | None = None
    mosaic_backward_tiles: mosaic_backward.BackwardTiles | None = None

    def __post_init__(self):
        # Options a Mosaic kernel does not take would be silently dropped: they are refused
        # here whoever builds the config. The forward takes windows, soft caps and segment ids
        # (sequence lengths folded in); the backward only the causal flag.
        for pass_name, module in (("forward", mosaic), ("backward", mosaic_backward)):
            kernel = getattr(self, pass_name)
            if kernel not in ("triton", "mosaic"):
                raise ValueError(
                    f"KernelConfig.{pass_name}={kernel!r} must be 'triton' or 'mosaic'"
                )
            if kernel == "mosaic" and (
                unsupported := module.unsupported_options(
                    self.spec, soft_cap=self.soft_cap, has_bias=False
                )
            ):
                raise ValueError(f"KernelConfig.{pass_name}='mosaic' supports no {unsupported}")

    def kwargs(self):
        """Keyword arguments of the Triton kernels."""
        return dict(
            spec=self.spec,
            scale=self.scale,
            soft_cap=self.soft_cap,
            block_sizes=self.block_sizes,
            interpret=self.interpret,
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash_attention_kernels(q, k, v, bias, arrays: MaskArrays, config: KernelConfig):
    """(out, lse) through the kernels, differentiable in q, k, v and bias."""
    return _forward(q, k, v, bias, arrays, config=config)


# Each pass is one jit'd function of the static config: a model that repeats a layer traces and
# lowers its kernels once (jax reuses the lowered function at every call site), so every site
# carries the same Mosaic GPU module, which the GPU compiles once by its hash.
# On a device mesh, `_partition.partitioned` runs each pass on every device's batch entries and
# heads.
@functools.partial(jax.jit, static_argnames="config")
def _forward(q, k, v, bias, arrays, *, config: KernelConfig):
    return _partition.partitioned(
        _forward_shard,
        config,
        ("q", "kv", "kv", "pair", "arrays"),
        ("q", "lse"),
        q,
        k,
        v,
        bias,
        arrays,
    )


def _forward_shard(q, k, v, bias, arrays, *, config: KernelConfig):
    if config.forward == "mosaic":
        if bias is not None:  # the one option the config cannot see
            raise ValueError("KernelConfig.forward='mosaic' supports no bias")
        return mosaic.flash_forward(
            q,
            k,
            v,
            scale=config.scale,
            is_causal=config.spec.is_causal,
            window=config.spec.window,
            soft_cap=config.soft_cap,
            segment_ids=(
                (arrays.q_segment_ids, arrays.kv_segment_ids) if config.spec.has_segments else None
            ),
            tiles=config.mosaic_forward_tiles,
        )
    return flash_forward(q, k, v, bias, arrays, **config.kwargs())


def _fwd_rule(q, k, v, bias, arrays, config: KernelConfig):
    out, lse = _forward(q, k, v, bias, arrays, config=config)
    return (out, lse), (q, k, v, bias, arrays, out, lse)


def _bwd_rule(config: KernelConfig, residuals, cotangents):
    q, k, v, bias, arrays, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, dbias = _backward(q, k, v, bias, arrays, out, lse, d_out, d_lse, config=config)
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, arrays)


@functools.partial(jax.jit, static_argnames="config")
def _backward(q, k, v, bias, arrays, out, lse, d_out, d_lse, *, config: KernelConfig):
    return _partition.partitioned(
        _backward_shard,
        config,
        ("q", "kv", "kv", "pair", "arrays", "q", "lse", "q", "lse"),
        ("q", "kv", "kv", "pair"),
        q,
        k,
        v,
        bias,
        arrays,
        out,
        lse,
        d_out,
        d_lse,
    )


def _backward_shard(q, k, v, bias, arrays, out, lse, d_out, d_lse, *, config: KernelConfig):
    if config.backward == "mosaic":
        if bias is not None:  # the one option the config cannot see
            raise ValueError("KernelConfig.backward='mosaic' supports no bias")
        dq, dk, dv = mosaic_backward.flash_backward(
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            scale=config.scale,
            is_causal=config.spec.is_causal,
            tiles=config.mosaic_backward_tiles,
        )
        return dq, dk, dv, None
    return flash_backward(q, k, v, bias, arrays, out, lse, d_out, d_lse, **config.kwargs())


flash_attention_kernels.defvjp(_fwd_rule, _bwd_rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def with_reference_vjp(kernel, reference, *args):
    """kernel(*args), differentiated through reference(*args): for forward-only kernels (decode)
    whose reference is cheap to differentiate. Integer arguments get no cotangent."""
    return kernel(*args)


def _reference_fwd(kernel, reference, *args):
    return kernel(*args), args


def _reference_bwd(kernel, reference, args, cotangents):
    _, vjp = jax.vjp(reference, *args)
    grads = vjp(cotangents)
    return tuple(
        g if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else None for a, g in zip(args, grads)
    )


with_reference_vjp.defvjp(_reference_fwd, _reference_bwd)
