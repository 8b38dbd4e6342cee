"""Lowering for an abstract H200 on a CPU, as the tests use it: `lower_for_h200` (the Triton
modules verified as they are lowered), and readers of what it lowered (Mosaic GPU optimisation
barriers, the Triton calls' launch parameters)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.experimental.mosaic.gpu.core as mosaic_gpu_core
from jax._src.pallas.triton import lowering as triton_lowering
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


@contextlib.contextmanager
def verified_triton_modules():
    """Pallas serialises each kernel's Triton module unverified: an op whose types do not
    match (a select of i1 and f32) fails only when the GPU's runtime parses it. Inside this
    context every module is verified as it is lowered, so that fails here, on CPU."""
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()
        return result

    triton_lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = lower


def lower_for_h200(fn, *args):
    """fn lowered for an abstract H200, its Triton modules verified."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh), verified_triton_modules():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# An empty inline asm with side effects whose i32 output is tied to its input: how Mosaic GPU
# lowers `lax.optimization_barrier` of a scalar (`launch.opaque_zero`'s step).
OPAQUE_I32_ASM = 'asm_dialect = att "", "=r,0"'


def mosaic_opaque_i32s(monkeypatch, fn, *args) -> int:
    """How many i32 optimization barriers the Mosaic GPU module of fn (lowered for an
    abstract H200, one Mosaic GPU kernel) holds."""
    modules = []
    serde = mosaic_gpu_core._run_serde_pass

    def spy(module, **kwargs):
        modules.append(str(module))
        return serde(module, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(mosaic_gpu_core, "_run_serde_pass", spy)
        lower_for_h200(fn, *args)
    (module,) = modules
    return module.count(OPAQUE_I32_ASM)


def triton_calls(lowered) -> dict[str, dict[str, int]]:
    """{kernel name: {grid_x, grid_y, grid_z, num_warps, num_stages}} of the Triton custom calls."""
    text = re.sub(r'ir = "[^"]*"', "ir = ...", lowered.as_text())  # the serialised Triton IR
    calls = {}
    for config in re.findall(r"mhlo\.backend_config = \{([^}]*)\}", text):
        name = re.search(r'name = "(\w+)"', config)
        if name is None:  # not a Triton call (the Mosaic GPU forward's config has no name)
            continue
        name = name.group(1)
        ints = re.findall(r"(grid_[xyz]|num_warps|num_stages) = (\d+) : i32", config)
        calls[name] = {key: int(value) for key, value in ints}
    return calls
