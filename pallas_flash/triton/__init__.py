"""Pallas kernels lowered through Triton (NVIDIA GPUs of compute capability >= 8.0; the Pallas
interpreter on any host).

What the dispatch (`pallas_flash.dispatch`) reads of this backend: why it cannot run on a device
(it runs every call), its tiles (`BlockSizes`) for a call, and the two passes.
"""

from __future__ import annotations

from pallas_flash import config
from pallas_flash.call import Call
from pallas_flash.config import BlockSizes
from pallas_flash.device import Device
from pallas_flash.triton.backward import flash_backward
from pallas_flash.triton.forward import choose_kv_splits, flash_forward

__all__ = [
    "block_sizes",
    "choose_kv_splits",
    "flash_backward",
    "flash_forward",
    "why_not_device",
]

MIN_COMPUTE_CAPABILITY = (8, 0)


def why_not_device(device: Device | None) -> str | None:
    """Why these kernels cannot run compiled on `device` (None: no NVIDIA GPU), or None."""
    if device is None or device.compute_capability < MIN_COMPUTE_CAPABILITY:
        found = "none" if device is None else device.compute_capability
        return f"needs an NVIDIA GPU of compute capability >= 8.0 (found {found})"
    return None


def block_sizes(call: Call, device: Device | None, *, interpret: bool) -> BlockSizes:
    """The tiles of a call: small ones in the interpreter; else the autotune cache's entry for
    (device kind, shape class), else the shipped heuristics."""
    return config.default_block_sizes(
        call.head_dim,
        call.dtype,
        interpret=interpret,
        has_bias=call.has_bias,
        has_mask=call.spec.mask_shape is not None,
        is_causal=call.spec.is_causal,
        q_len=call.q_len,
        kv_len=call.kv_len,
        narrow=config.narrow_band(call.spec),
        device_kind=None if device is None else device.kind,
    )
