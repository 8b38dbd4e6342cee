"""Pallas Mosaic GPU kernels for Hopper (sm_90a): wgmma, TMA, warp specialisation.

What the dispatch (`pallas_flash.dispatch`) reads of this backend: why it cannot run on a device
or a call (a reason, or None when it can), its default tiles, and the two passes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.mosaic import backward_tiles
from pallas_flash.mosaic import tiles as forward_tiles
from pallas_flash.mosaic.backward import flash_backward
from pallas_flash.mosaic.backward_tiles import BackwardTiles
from pallas_flash.mosaic.forward import flash_forward
from pallas_flash.mosaic.tiles import ForwardTiles, default_tiles

__all__ = [
    "BackwardTiles",
    "ForwardTiles",
    "default_backward_tiles",
    "default_forward_tiles",
    "default_tiles",
    "flash_backward",
    "flash_forward",
    "why_not_backward",
    "why_not_device",
    "why_not_forward",
    "why_not_ragged_prefill",
]


def why_not_device(device: Device | None) -> str | None:
    """Why these kernels cannot run on `device` (None: no NVIDIA GPU), or None when they can:
    they are sm_90a code (wgmma, TMA)."""
    if device is None or not device.is_hopper:
        found = "none" if device is None else device.compute_capability
        return f"needs a Hopper GPU (compute capability 9.0, found {found})"
    return None


def why_not_forward(call: Call, device: Device, tiles: ForwardTiles | None = None) -> str | None:
    """Why the forward cannot run `call` on `device` with `tiles` (None: its defaults), named as
    the API names the options; None when it can."""
    if reason := forward_tiles.unsupported_options(call.spec, has_bias=call.has_bias):
        return reason
    return forward_tiles.why_not(
        call.q_shape,
        call.k_shape,
        call.dtype,
        value_head_dim=call.v_head_dim,
        is_causal=call.spec.is_causal,
        window=call.spec.window,
        soft_cap=call.soft_cap,
        segments=call.spec.has_segments,
        tiles=tiles,
        cuda_runtime_version=device.cuda_runtime_version,
    )


def why_not_backward(call: Call, device: Device, tiles: BackwardTiles | None = None) -> str | None:
    """Why the backward cannot run `call` on `device` with `tiles` (None: its defaults); None
    when it can. It takes a value head dim Hv != H as it is, as the forward does."""
    if reason := backward_tiles.unsupported_options(
        call.spec, soft_cap=call.soft_cap, has_bias=call.has_bias
    ):
        return reason
    return backward_tiles.why_not(
        call.q_shape,
        call.k_shape,
        call.dtype,
        value_head_dim=call.v_head_dim,
        is_causal=call.spec.is_causal,
        window=call.spec.window,
        soft_cap=call.soft_cap,
        segments=call.spec.has_segments,
        dropout=call.dropout_rate > 0,
        tiles=tiles,
        cuda_runtime_version=device.cuda_runtime_version,
    )


def why_not_ragged_prefill(
    q_shape,
    pages_shape,
    value_head_dim: int | None,
    dtype,
    *,
    cache_dtype,
    window_left: int | None,
    soft_cap: float | None,
    device: Device | None,
) -> str | None:
    """Why the prefill launch of `ragged_paged_attention` cannot run on the Mosaic kernel
    (`pallas_flash.mosaic.ragged`) on `device`, named as that API names the options; None when
    it can. q_shape [T, N, H], pages_shape [P, page_size, K, H]; value_head_dim: v_pages' Hv,
    None for a shared latent cache (v_pages=None)."""
    if reason := why_not_device(device):
        return reason
    if value_head_dim is None:
        return "a shared latent cache (v_pages=None, value_head_dim)"
    if jnp.dtype(cache_dtype) != jnp.dtype(dtype):
        return f"pages of dtype {jnp.dtype(cache_dtype).name} (k_scale, v_scale)"
    num_tokens, num_heads, head_dim = q_shape
    _, page_size, num_kv_heads, _ = pages_shape
    tiles = forward_tiles.ragged_prefill_tiles(head_dim, value_head_dim)
    if forward_tiles.page_copies(page_size, tiles.block_kv) is None:
        return (
            f"page_size={page_size} (the kernel takes a multiple of 8 that divides its "
            f"{tiles.block_kv}-key tiles or that they divide)"
        )
    return forward_tiles.why_not(
        (1, num_tokens, num_heads, head_dim),
        (1, page_size, num_kv_heads, head_dim),
        dtype,
        value_head_dim=value_head_dim,
        is_causal=True,
        window=None if window_left is None else (window_left, 0),
        soft_cap=soft_cap,
        # Its budget at one Q buffer per consumer (`ragged_prefill_q_buffers`).
        tiles=dataclasses.replace(tiles, persistent=False),
        cuda_runtime_version=device.cuda_runtime_version,
    )


def default_forward_tiles(call: Call, *, wide: bool = True) -> ForwardTiles:
    return forward_tiles.default_tiles(
        call.head_dim,
        value_head_dim=call.v_head_dim,
        q_len=call.q_len,
        kv_len=call.kv_len,
        is_causal=call.spec.is_causal,
        window=call.spec.window,
        soft_cap=call.soft_cap,
        segments=call.spec.has_segments,
        wide=wide,
    )


def default_backward_tiles(call: Call) -> BackwardTiles:
    return backward_tiles.default_tiles(call.head_dim, call.v_head_dim)
