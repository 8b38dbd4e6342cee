"""The one jax.custom_vjp of pallas_flash: forward saves (q, k, v, out, lse), backward calls the
backend's backward with the cotangents of both outputs."""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_flash.config import BlockSizes
from pallas_flash.masks import MaskSpec
from pallas_flash.triton.backward import flash_backward
from pallas_flash.triton.forward import flash_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Everything static about one call: hashable, passed as a nondiff argument."""

    spec: MaskSpec
    scale: float
    block_sizes: BlockSizes
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention_kernels(q, k, v, config: KernelConfig):
    """(out, lse) through the Triton kernels, differentiable in q, k, v (through out and lse)."""
    out, lse = _forward(q, k, v, config)
    return out, lse


def _forward(q, k, v, config: KernelConfig):
    return flash_forward(
        q,
        k,
        v,
        spec=config.spec,
        scale=config.scale,
        block_sizes=config.block_sizes,
        interpret=config.interpret,
    )


def _fwd_rule(q, k, v, config: KernelConfig):
    out, lse = _forward(q, k, v, config)
    return (out, lse), (q, k, v, out, lse)


def _bwd_rule(config: KernelConfig, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out, d_lse = cotangents
    return flash_backward(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        d_lse,
        spec=config.spec,
        scale=config.scale,
        block_sizes=config.block_sizes,
        interpret=config.interpret,
    )


flash_attention_kernels.defvjp(_fwd_rule, _bwd_rule)
