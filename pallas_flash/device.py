"""The GPU that kernels are chosen for: a `Device` record, and the target of the calls traced now.

`Device.current()` reads the first visible GPU once. For cross-compilation (`jax.export` with
`platforms=["cuda"]` on a host without that GPU) a record is built for a named GPU
(`Device.h200()`, `Device.of_kind(...)`), from a `jax.sharding.AbstractDevice` or from a mesh,
and `target(device)` makes it the GPU that calls traced in its scope are chosen for. The
dispatch and the kernels' support checks read every GPU fact from the record.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re

import jax

try:
    # No public jax API says the CUDA runtime's version (docs/design.md, "Private jax").
    from jax._src.lib import cuda_versions
except ImportError:  # a jax without that module
    cuda_versions = None

# Compute capability by device kind, for records built from a kind alone (an abstract device, a
# named target). Longer names first, so that "NVIDIA A100" wins over "NVIDIA A10".
_COMPUTE_CAPABILITY = {
    "NVIDIA GH200": (9, 0),
    "NVIDIA H100": (9, 0),
    "NVIDIA H200": (9, 0),
    "NVIDIA H800": (9, 0),
    "NVIDIA A100": (8, 0),
    "NVIDIA A800": (8, 0),
    "NVIDIA A30": (8, 0),
    "NVIDIA A10": (8, 6),
    "NVIDIA L40": (8, 9),
    "NVIDIA L4": (8, 9),
    "NVIDIA GeForce RTX 4090": (8, 9),
    "NVIDIA B200": (10, 0),
    "NVIDIA GB200": (10, 0),
}
_KINDS = sorted(_COMPUTE_CAPABILITY, key=len, reverse=True)
_KIND_RE = re.compile(r"\b(" + "|".join(re.escape(k) for k in _KINDS) + r")\b")
# Streaming multiprocessors by kind, where every part of that name has the same count.
_NUM_SMS = {"NVIDIA H200": 132, "NVIDIA GH200": 132, "NVIDIA A100": 108}
# Where no GPU says otherwise (the CPU interpreter, a call of a kernel without a record): the
# H100's and H200's SM count.
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """An NVIDIA GPU as the choice of kernels sees it (hashable: it rides in the static config).

    Attributes:
      kind: jax's device_kind, e.g. "NVIDIA H200"; it keys the autotune cache.
      compute_capability: (major, minor), e.g. (9, 0) for Hopper.
      num_sms: streaming multiprocessors: the persistent Mosaic grid and the Triton split-KV
        rule fill the GPU with them.
      cuda_runtime_version: the CUDA runtime the kernels compile with (12080 = 12.8.0), or None
        when not known (a named target): the Mosaic kernels refuse causal masks and windows on
        12.8.0-12.9.0, whose ptxas miscompiles them.
    """

    kind: str
    compute_capability: tuple[int, int]
    num_sms: int
    cuda_runtime_version: int | None = None

    def __post_init__(self):
        cc = self.compute_capability
        if not (
            isinstance(cc, tuple)
            and len(cc) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)
        ):
            raise ValueError(f"Device.compute_capability={cc!r} must be a (major, minor) of ints")
        if not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool) or self.num_sms < 1:
            raise ValueError(f"Device.num_sms={self.num_sms!r} must be a positive int")

    @property
    def is_hopper(self) -> bool:
        return self.compute_capability == (9, 0)

    @classmethod
    def current(cls) -> Device | None:
        """The first visible NVIDIA GPU, read once per process; None without one."""
        return _current_device()

    @classmethod
    def of_kind(
        cls, kind: str, *, num_sms: int | None = None, cuda_runtime_version: int | None = None
    ) -> Device:
        """The record of a GPU named by its device kind (as `jax.Device.device_kind` spells it).
        Raises ValueError for a kind whose compute capability is not known here (build the
        record with `Device(...)` then) or whose SM count is not known and not given."""
        found = _KIND_RE.search(kind)
        if found is None:
            raise ValueError(
                f"device kind {kind!r} is not known to pallas_flash: build the record as "
                "Device(kind=..., compute_capability=(major, minor), num_sms=...)"
            )
        if num_sms is None:
            num_sms = _NUM_SMS.get(found.group(1))
            if num_sms is None:
                raise ValueError(f"the SM count of {kind!r} is not known: pass num_sms")
        return cls(
            kind=kind,
            compute_capability=_COMPUTE_CAPABILITY[found.group(1)],
            num_sms=num_sms,
            cuda_runtime_version=cuda_runtime_version,
        )

    @classmethod
    def h200(cls, *, cuda_runtime_version: int | None = None) -> Device:
        """An NVIDIA H200 (sm_90, 132 SMs)."""
        return cls.of_kind("NVIDIA H200", cuda_runtime_version=cuda_runtime_version)

    @classmethod
    def a100(cls) -> Device:
        """An NVIDIA A100 SXM (sm_80, 108 SMs)."""
        return cls.of_kind("NVIDIA A100-SXM4-80GB")

    @classmethod
    def from_abstract_device(cls, device: jax.sharding.AbstractDevice) -> Device:
        """The record of a `jax.sharding.AbstractDevice` (its kind and core count)."""
        if device.platform not in ("gpu", "cuda"):
            raise ValueError(f"{device} is not a GPU")
        return cls.of_kind(device.device_kind, num_sms=device.num_cores)

    @classmethod
    def from_mesh(cls, mesh) -> Device:
        """The record of the GPUs of a `jax.sharding.Mesh` (its devices) or `AbstractMesh` (its
        abstract device)."""
        if isinstance(mesh, jax.sharding.Mesh):
            return _record_of(mesh.devices.flat[0])
        abstract = getattr(mesh, "abstract_device", None)
        if abstract is None:
            raise ValueError(f"{mesh} names no device: give it an abstract_device")
        return cls.from_abstract_device(abstract)

    def abstract_device(self) -> jax.sharding.AbstractDevice:
        """This GPU as jax's AOT lowering names one (Pallas' Triton lowering reads it)."""
        return jax.sharding.AbstractDevice(
            device_kind=self.kind, num_cores=self.num_sms, platform="gpu"
        )


def _record_of(device) -> Device:
    """The record of a concrete jax GPU device."""
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split("."))
    except ValueError:
        raise ValueError(f"{device} is not an NVIDIA GPU (compute capability {cc!r})") from None
    return Device(
        kind=device.device_kind,
        compute_capability=(major, minor),
        num_sms=getattr(device, "core_count", None) or DEFAULT_NUM_SMS,
        cuda_runtime_version=_local_cuda_runtime_version(),
    )


@functools.cache
def _current_device() -> Device | None:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devices:
        return None
    try:
        return _record_of(devices[0])
    except ValueError:  # a GPU that is not NVIDIA's
        return None


def _local_cuda_runtime_version() -> int | None:
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()


_TARGET: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "pallas_flash_target", default=None
)


@contextlib.contextmanager
def target(device: Device):
    """Chooses kernels for `device` in calls traced in this scope, on any host.

    For `jax.export(..., platforms=["cuda"])` from a host without that GPU::

        with pallas_flash.target(pallas_flash.Device.h200()):
            exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes)

    The scope also sets jax's abstract mesh to one whose abstract device is `device` (keeping
    the current mesh's axes), which is how jax's own AOT lowering (Pallas' Triton kernels) names
    the GPU, and which makes jitted functions retrace for the target. Without a target, calls
    are chosen for the abstract mesh's GPU when it names one this host does not have, else for
    the visible GPU (`Device.current()`).
    """
    if not isinstance(device, Device):
        raise TypeError(f"target() takes a pallas_flash.Device, got {type(device).__name__}")
    mesh = jax.sharding.get_abstract_mesh()
    abstract = jax.sharding.AbstractMesh(
        mesh.axis_sizes,
        mesh.axis_names,
        axis_types=mesh.axis_types,
        abstract_device=device.abstract_device(),
    )
    token = _TARGET.set(device)
    try:
        with jax.sharding.use_abstract_mesh(abstract):
            yield device
    finally:
        _TARGET.reset(token)


def target_device() -> Device | None:
    """The GPU that a call traced now is chosen for: the `target` scope's; else the abstract
    mesh's GPU where it differs from the visible one (jax's own rule for an AOT target) and its
    kind is known here (`Device.of_kind`); else the visible GPU; else None."""
    chosen = _TARGET.get()
    if chosen is not None:
        return chosen
    running = Device.current()
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if (
        abstract is not None
        and abstract.platform in ("gpu", "cuda")
        and (running is None or abstract.device_kind != running.kind)
    ):
        try:
            return Device.from_abstract_device(abstract)
        except ValueError:  # a GPU this package has no record of (not NVIDIA's, or unknown)
            pass
    return running


# Readers of the visible GPU's record, for scripts and tests that ask what this host has.


def gpu_device_kind() -> str | None:
    """device_kind of the first visible GPU ("NVIDIA H200"), or None without one."""
    device = Device.current()
    return None if device is None else device.kind


def gpu_core_count() -> int:
    """Streaming multiprocessors of the first visible GPU; DEFAULT_NUM_SMS without one."""
    device = Device.current()
    return DEFAULT_NUM_SMS if device is None else device.num_sms


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first visible NVIDIA GPU, or None without one."""
    device = Device.current()
    return None if device is None else device.compute_capability
