"""Facts about the GPU that the kernels run on: kind, compute capability, SM count, CUDA runtime.

Each is read from the first visible GPU; without one they say so (None) or give the H200's value
where a number is needed (the CPU interpreter, lowering for an abstract H200).
"""

from __future__ import annotations

import jax

try:
    from jax._src.lib import cuda_versions
except ImportError:  # a jaxlib built without CUDA
    cuda_versions = None


def gpu_device_kind() -> str | None:
    """device_kind of the first visible GPU ("NVIDIA H200"), or None without one."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0].device_kind if devices else None


def gpu_core_count() -> int:
    """Streaming multiprocessors of the first visible GPU; 132 (the H100's and H200's) without
    one, or where the device does not say: the CPU interpreter, lowering for an abstract H200."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return 132
    return (getattr(devices[0], "core_count", None) if devices else None) or 132


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first visible NVIDIA GPU, or None without one."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    if cc is None:
        return None
    major, minor = str(cc).split(".")
    return int(major), int(minor)


def cuda_runtime_version() -> int | None:
    """The CUDA runtime version as an int (12080 = 12.8.0), or None without CUDA."""
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()
