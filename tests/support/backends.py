"""The backend matrix: the paths one behaviour must hold on (`BACKEND_PATHS`, and
`backend_paths` to parametrize a test over them), the Triton kernels' execution modes, whether
this host has the GPU a path needs, and PALLAS_FLASH_SWEEP (the slow cases)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from unittest import mock

import pytest

from pallas_flash import device as device_lib
from pallas_flash.device import Device, gpu_compute_capability


def has_gpu() -> bool:
    cc = gpu_compute_capability()
    return cc is not None and cc >= (8, 0)


def has_hopper() -> bool:
    return gpu_compute_capability() == (9, 0)


# "interpret": the Triton kernels in the Pallas interpreter on CPU; "gpu": compiled for the GPU.
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def kernel_kwargs(mode: str) -> dict:
    """Keyword arguments of `flash_attention` that run the Triton kernels in `mode` (the
    Triton paths of the backend matrix, BACKEND_PATHS)."""
    return BACKEND_PATHS["triton-interpret" if mode == "interpret" else "triton"].call_kwargs()


# Set (to anything) to run the matrix's slow cases too (the interpreters at larger sizes); the
# property sweep reads it as its number of examples.
SWEEP = bool(os.environ.get("PALLAS_FLASH_SWEEP"))
# Cases that others cover in CI, run with PALLAS_FLASH_SWEEP (slow on the 2-core CI machine).
SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="covered in CI by others: PALLAS_FLASH_SWEEP=1")


@dataclasses.dataclass(frozen=True, eq=False)
class BackendPath:
    """One way a call runs, as a test sees it: `kwargs` select it in `flash_attention`,
    `flash_attention_backward` and `decode_attention`; `scope()` surrounds tracing and running
    (and the conversion of the results to numpy, which must happen inside it).

    tiles: the path takes `block_sizes` (the Triton kernels); mosaic: it runs the Mosaic GPU
    kernels, which take bfloat16/float16, H 64/80/96/128/192/256 and any lengths, and
    whose backward runs at every head dim with the forward's masks (else the Triton backward
    runs, which the Mosaic interpreter cannot: forward-only checks there).
    """

    name: str
    kwargs: dict
    tiles: bool = False
    mosaic: bool = False
    gpu: bool = False
    interpreted: bool = False
    refuses: str | None = None

    def call_kwargs(self, block_sizes=None) -> dict:
        """`kwargs`, plus `block_sizes` on the paths that take them."""
        kwargs = dict(self.kwargs)
        if block_sizes is not None and self.tiles:
            kwargs["block_sizes"] = block_sizes
        return kwargs

    @contextlib.contextmanager
    def scope(self):
        """Where the path's calls are traced and run. Where the path refuses an option of the
        check (`backend_paths(refuses=...)`), a NotImplementedError must name it."""
        try:
            with self._runner():
                yield
        except NotImplementedError as e:
            if self.refuses is not None and self.refuses not in str(e):
                raise AssertionError(
                    f"{self.name} raised NotImplementedError without naming {self.refuses!r}: {e}"
                ) from e
            raise

    def _runner(self):
        if self.name != "mosaic-interpret":
            return contextlib.nullcontext()
        from support.mosaic_interpret import interpret_mosaic

        # The dispatch chooses for an H200; jax's Mosaic GPU interpreter runs the kernels.
        runner = contextlib.ExitStack()
        runner.enter_context(mock.patch.object(device_lib, "target_device", Device.h200))
        runner.enter_context(interpret_mosaic())
        return runner

    def __str__(self):
        return self.name


# The one list of paths. A new backend (or interpreter) is one entry here; every test that takes
# `backend_paths()` then runs its checks on it.
BACKEND_PATHS = {
    path.name: path
    for path in (
        BackendPath("xla", {"backend": "xla"}),
        BackendPath(
            "triton-interpret",
            {"backend": "triton", "interpret": True},
            tiles=True,
            interpreted=True,
        ),
        BackendPath("mosaic-interpret", {"backend": "mosaic"}, mosaic=True, interpreted=True),
        BackendPath("triton", {"backend": "triton"}, tiles=True, gpu=True),
        # What a user gets: on Hopper the Mosaic kernels where they take the call, else Triton.
        BackendPath("default", {}, gpu=True),
        BackendPath("mosaic", {"backend": "mosaic"}, mosaic=True, gpu=True),
    )
}


def backend_paths(
    *,
    cpu: bool = True,
    gpu: bool = True,
    mosaic: bool = False,
    refuses: dict[str, str] | None = None,
    skip: dict[str, str] | None = None,
    sweep: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> list:
    """The paths of BACKEND_PATHS as pytest params (ids: their names), for
    `@pytest.mark.parametrize("path", backend_paths(...))`.

    cpu / gpu: the paths that run on CPU (backend="xla" and the interpreters) / the compiled
    ones (marked `gpu`; the Mosaic ones also need Hopper). mosaic: include the Mosaic paths
    (the check's shapes and dtypes must be theirs; see BackendPath). refuses: {path: option}
    where the path does not take an option of the check: the API must raise
    NotImplementedError naming it (a strict xfail; `BackendPath.scope` checks the name).
    skip: {path: why} where the check cannot run on that path. sweep: paths run only with
    PALLAS_FLASH_SWEEP set (slow on CPU). exclude: paths the check is not about.
    """
    refuses, skip = refuses or {}, skip or {}
    unknown = (set(refuses) | set(skip) | set(sweep) | set(exclude)) - set(BACKEND_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}: not in {sorted(BACKEND_PATHS)}")
    params = []
    for name, path in BACKEND_PATHS.items():
        if (path.gpu and not gpu) or (not path.gpu and not cpu) or name in exclude:
            continue
        if path.mosaic and not mosaic:
            continue
        marks = []
        if path.gpu:
            marks.append(pytest.mark.gpu)
            if path.mosaic:
                marks.append(
                    pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
                )
        if name in skip:
            marks.append(pytest.mark.skip(reason=f"{name}: {skip[name]}"))
        if name in sweep:
            marks.append(
                pytest.mark.skipif(not SWEEP, reason=f"{name} is slow on CPU: PALLAS_FLASH_SWEEP=1")
            )
        if name in refuses:
            marks.append(
                pytest.mark.xfail(
                    raises=NotImplementedError,
                    strict=True,
                    reason=f"{name} refuses {refuses[name]} (NotImplementedError)",
                )
            )
            path = dataclasses.replace(path, refuses=refuses[name])
        params.append(pytest.param(path, id=name, marks=marks))
    return params
