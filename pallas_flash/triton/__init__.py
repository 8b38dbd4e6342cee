"""Pallas kernels lowered through Triton (NVIDIA GPUs of compute capability >= 8.0; the Pallas
interpreter on any host).

What the dispatch (`pallas_flash.dispatch`) reads of this backend: why it cannot run on a device
(it runs every call), why the decode kernel cannot run a call's forward (`few_tokens.py`'s
`few_token_forward`), its tile classes and a call's default tiles (`tiles.py`: the shipped
tables and heuristics; the dispatch looks the autotune cache up first), and the two passes.
"""

from __future__ import annotations

from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.triton import tiles
from pallas_flash.triton.backward import flash_backward
from pallas_flash.triton.few_tokens import why_not_few_token_forward
from pallas_flash.triton.forward import choose_kv_splits, flash_forward
from pallas_flash.triton.tiles import (
    BlockSizes,
    DecodeBlockSizes,
    RaggedBlockSizes,
    default_decode_block_sizes,
    narrow_band,
    padded_head_dim,
)

__all__ = [
    "BlockSizes",
    "DecodeBlockSizes",
    "RaggedBlockSizes",
    "block_sizes",
    "choose_kv_splits",
    "default_decode_block_sizes",
    "flash_backward",
    "flash_forward",
    "narrow_band",
    "padded_head_dim",
    "why_not_device",
    "why_not_few_token_forward",
]

MIN_COMPUTE_CAPABILITY = (8, 0)


def why_not_device(device: Device | None) -> str | None:
    """Why these kernels cannot run compiled on `device` (None: no NVIDIA GPU), or None."""
    if device is None or device.compute_capability < MIN_COMPUTE_CAPABILITY:
        found = "none" if device is None else device.compute_capability
        return f"needs an NVIDIA GPU of compute capability >= 8.0 (found {found})"
    return None


def block_sizes(call: Call, *, interpret: bool) -> BlockSizes:
    """The tiles of a call without an autotune entry: small ones in the interpreter, else the
    shipped heuristics (by head dim and dtype; fewer stages with a bias or dense mask tile,
    smaller forward tiles for a narrow band of keys)."""
    return tiles.default_block_sizes(
        call.head_dim,
        call.dtype,
        interpret=interpret,
        masked=call.masked,
        narrow=narrow_band(call.spec),
        ranged=call.spec.has_key_ranges,
    )
