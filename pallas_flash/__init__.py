"""pallas_flash: FlashAttention-2 for JAX as Pallas GPU kernels."""

from pallas_flash.api import attention_reference, flash_attention
from pallas_flash.config import BlockSizes

__all__ = ["BlockSizes", "attention_reference", "flash_attention"]
__version__ = "0.1.0"
