"""pallas_flash: FlashAttention-2 for JAX as Pallas GPU kernels.

Flax users import the wrappers explicitly (this package itself does not import Flax):
`pallas_flash.linen` and `pallas_flash.nnx` each hold a drop-in `dot_product_attention` for the
`attention_fn` of Flax's attention modules, and a subclass of the module
(`MultiHeadDotProductAttention` / `MultiHeadAttention`).
"""

from pallas_flash.api import (
    ForwardModeError,
    attention_reference,
    flash_attention,
    flash_attention_backward,
)
from pallas_flash.decode import decode_attention, paged_attention, write_to_pages
from pallas_flash.device import Device, target
from pallas_flash.ragged import ragged_paged_attention
from pallas_flash.sharding import (
    from_zigzag,
    ring_attention,
    ring_attention_sharded,
    to_zigzag,
    zigzag_indices,
)
from pallas_flash.triton import BlockSizes, DecodeBlockSizes, RaggedBlockSizes

__all__ = [
    "BlockSizes",
    "DecodeBlockSizes",
    "Device",
    "ForwardModeError",
    "RaggedBlockSizes",
    "attention_reference",
    "decode_attention",
    "flash_attention",
    "flash_attention_backward",
    "from_zigzag",
    "paged_attention",
    "ragged_paged_attention",
    "ring_attention",
    "ring_attention_sharded",
    "target",
    "to_zigzag",
    "write_to_pages",
    "zigzag_indices",
]
__version__ = "0.1.0"
