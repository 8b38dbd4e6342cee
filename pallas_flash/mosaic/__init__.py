"""Pallas Mosaic GPU kernels for Hopper (sm_90a): wgmma, TMA, warp specialisation."""

from pallas_flash.mosaic.backward import BackwardTiles, flash_backward, supports_backward
from pallas_flash.mosaic.forward import ForwardTiles, default_tiles, flash_forward, supports

__all__ = [
    "BackwardTiles",
    "ForwardTiles",
    "default_tiles",
    "flash_backward",
    "flash_forward",
    "supports",
    "supports_backward",
]
