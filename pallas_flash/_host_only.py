"""A marker on results that `backend=None` computed with the "xla" backend because the host that
traced the call has no GPU. It is the identity, except that lowering it for a GPU platform raises:
`jax.export(..., platforms=["cuda"])` on such a host would otherwise package the plain-jnp
reference (the [T, S] logits in memory) where a GPU host, or `pallas_flash.target(device)`,
packages the kernels."""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_GPU_PLATFORMS = ("cuda", "rocm")

_MESSAGE = (
    "flash_attention(backend=None) was traced on a host without an NVIDIA GPU, where it runs "
    "the 'xla' backend (plain jnp, the [T, S] logits in memory); lowering it for a GPU platform "
    "(jax.export with platforms=['cuda']) would package that reference instead of the kernels. "
    "Export under `with pallas_flash.target(pallas_flash.Device.h200()):` (or the record of "
    "your GPU) or on a host with the target GPU, which picks the kernels, or pass "
    "backend='xla' to export the reference on purpose"
)

host_only_p = Primitive("pallas_flash_host_only")
host_only_p.def_impl(lambda x: x)
host_only_p.def_abstract_eval(lambda x: x)
ad.deflinear(host_only_p, lambda ct: [host_only_p.bind(ct)])
batching.primitive_batchers[host_only_p] = lambda args, dims: (host_only_p.bind(*args), dims[0])
mlir.register_lowering(host_only_p, lambda ctx, x: [x])


def _refuse_gpu_lowering(ctx, x):
    raise NotImplementedError(_MESSAGE)


for _platform in _GPU_PLATFORMS:
    mlir.register_lowering(host_only_p, _refuse_gpu_lowering, platform=_platform)


def host_only(x):
    """x, marked as computed for the tracing host's platform only (see the module docstring)."""
    return host_only_p.bind(x)
