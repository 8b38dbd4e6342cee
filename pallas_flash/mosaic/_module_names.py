"""Stable names for this package's Mosaic GPU modules, so that one kernel compiles once.

Mosaic GPU names every module it lowers (`mosaic_gpu.dump_basename`, the stem of its debug dump
files) with a per-process counter, "anonymous_N", unless the module already has a name. The name
is part of the serialised module, and the GPU caches compiled kernels by the module's hash: the
same kernel lowered twice in one process is compiled twice. jit lowers a repeated kernel once,
but jax's SPMD partitioner lowers a `custom_partitioning` rule's function again at every call
site (`_partition.py`'s batch and head sharding under jit's automatic sharding), so a model's
every layer compiled its kernels again on a mesh (minutes for a deep model).

`install()` names each module whose kernel is this package's (its symbol starts with PREFIX) by
that symbol before Mosaic would number it, by wrapping `lower_mgpu_module` (jax has no public
hook for it). Other modules keep Mosaic's names. jax >= 0.12 leaves the name out of the module it
serialises and hashes, so there the patch is not installed; a jax 0.11 without the hook is left
as it is (tests/test_jax_api.py fails then). docs/design.md, "Private jax", lists it.
"""

from __future__ import annotations

import functools

import jax

PREFIX = "pallas_flash_"
_ATTRIBUTE = "mosaic_gpu.dump_basename"


def name(body) -> str:
    """The module name of a kernel body (a function or a functools.partial of one)."""
    while isinstance(body, functools.partial):
        body = body.func
    return PREFIX + getattr(body, "__name__", "kernel")


def needed() -> bool:
    """Whether this jax serialises a module's name into the kernel the GPU caches (jax 0.11)."""
    return jax.__version_info__ < (0, 12)


def install() -> None:
    if not needed():
        return
    try:
        from jax.experimental.mosaic.gpu import core
        from jax.extend.mlir import ir
    except ImportError:  # no Mosaic GPU in this jaxlib
        return
    lower = getattr(core, "lower_mgpu_module", None)
    if lower is None or getattr(lower, "_pallas_flash_names", False):
        return

    def lower_mgpu_module(module, *args, **kwargs):
        attributes = module.operation.attributes
        if "sym_name" in attributes and _ATTRIBUTE not in attributes:
            symbol = ir.StringAttr(attributes["sym_name"]).value
            if symbol.startswith(PREFIX):
                attributes[_ATTRIBUTE] = ir.StringAttr.get(symbol)
        return lower(module, *args, **kwargs)

    lower_mgpu_module._pallas_flash_names = True
    core.lower_mgpu_module = lower_mgpu_module
