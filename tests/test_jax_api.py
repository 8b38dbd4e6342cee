"""What the package needs from jax beyond its public API, checked on every jax CI runs (the
pinned one and the newest release): the Pallas Triton backend that the sm80 path is written in
(deprecated since jax 0.11, docs/backends.md), and each private name or patch listed in
docs/design.md ("Private jax"). Each test fails, naming what moved, on the first jax without it.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh
from support.lowering import triton_calls

import pallas_flash
from pallas_flash import _pallas_triton
from pallas_flash.device import Device
from pallas_flash.mosaic import _module_names

A100 = AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu")


def test_pallas_triton_lowers_the_sm80_kernels():
    """The day jax removes Pallas Triton, this fails: the A100's kernels (forward and backward,
    as the dispatch chooses them for sm80) need the replacement docs/backends.md names."""
    importlib.import_module("jax.experimental.pallas.triton")
    q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.bfloat16)

    def fn(q, k, v):
        out, vjp = jax.vjp(lambda *x: pallas_flash.flash_attention(*x, is_causal=True), q, k, v)
        return vjp(out)

    mesh = AbstractMesh((1,), ("x",), abstract_device=A100)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(q, q, q).lower(lowering_platforms=("cuda",))
    names = set(triton_calls(lowered))
    assert {"pallas_flash_forward", "pallas_flash_backward_dkv"} <= names, names


def test_the_quiet_triton_rule_is_registered():
    """Pallas' lowering-rule registry (`jax._src.pallas.core`) takes the rule that silences the
    Triton deprecation warning for the package's kernels (`_pallas_triton.CompilerParams`);
    without it the kernels fall back to jax's params and warn (test_lowering checks the
    warning itself)."""
    assert _pallas_triton.CompilerParams is not plgpu.CompilerParams, (
        "jax._src.pallas.core.{get,register}_lowering_rule moved: the kernels' Triton "
        "deprecation warning is no longer silenced"
    )


def test_mosaic_module_names_are_patched_where_jax_needs_it():
    """jax 0.11 serialises Mosaic GPU's per-process module name into the kernel the GPU caches:
    `_module_names` wraps `lower_mgpu_module` there, and only there (jax >= 0.12 leaves the
    name out). test_compile checks the result: one kernel lowered twice is one module."""
    patched = getattr(mosaic_gpu_core.lower_mgpu_module, "_pallas_flash_names", False)
    assert patched == _module_names.needed(), (
        f"jax {jax.__version__}: mosaic.gpu.core.lower_mgpu_module is "
        f"{'patched' if patched else 'not patched'}"
    )


def test_jax_still_names_its_cuda_versions_module():
    """`Device.cuda_runtime_version` reads `jax._src.lib.cuda_versions` (None on a jaxlib
    without CUDA): no public API says the CUDA runtime's version."""
    lib = importlib.import_module("jax._src.lib")
    assert hasattr(lib, "cuda_versions"), "jax._src.lib.cuda_versions is gone"


@pytest.mark.gpu
def test_the_gpu_record_knows_its_cuda_runtime():
    device = Device.current()
    assert isinstance(device.cuda_runtime_version, int), "jax._src.lib.cuda_versions gave none"
    assert device.cuda_runtime_version >= 12000
