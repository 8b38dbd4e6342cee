"""Pallas Mosaic GPU kernels for Hopper (sm_90a): wgmma, TMA, warp specialisation."""

from pallas_flash.mosaic.forward import ForwardTiles, default_tiles, flash_forward, supports

__all__ = ["ForwardTiles", "default_tiles", "flash_forward", "supports"]
