"""The backend matrix itself (support.backends.BACKEND_PATHS): each path on CPU runs what its
name says, so that a check parametrised over `backend_paths()` cannot pass on the wrong backend;
and `backend_paths` refuses paths it does not know."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from support.backends import BACKEND_PATHS, backend_paths

import pallas_flash
from pallas_flash import device as device_lib
from pallas_flash.device import Device


def primitives(jaxpr):
    """The names of every primitive of `jaxpr` and its sub-jaxprs, kernels included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from primitives(inner)


# What each CPU path traces: the Triton kernels are pallas_calls; the Mosaic GPU kernels are
# traced as Pallas core maps over shared-memory scopes (run_scoped), not as pallas_calls.
KERNELS = {
    "xla": set(),
    "triton-interpret": {"pallas_call"},
    "mosaic-interpret": {"run_scoped"},
}


@pytest.mark.parametrize("path", backend_paths(gpu=False, mosaic=True))
def test_each_cpu_path_runs_its_kernels(path):
    """Traced for an H200 (as the Mosaic interpreter's scope does), at sizes every path takes."""
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with mock.patch.object(device_lib, "target_device", Device.h200):
        jaxpr = jax.make_jaxpr(lambda q: pallas_flash.flash_attention(q, q, q, **path.kwargs))(q)
    found = set(primitives(jaxpr.jaxpr)) & {"pallas_call", "run_scoped"}
    assert found == KERNELS[path.name], (path.name, found)


def test_every_cpu_path_is_checked_here():
    cpu_paths = {name for name, path in BACKEND_PATHS.items() if not path.gpu}
    assert cpu_paths == set(KERNELS)


def test_unknown_paths_are_refused():
    with pytest.raises(ValueError, match=r"unknown paths \['interpret'\]"):
        backend_paths(skip={"interpret": "no such path"})


def test_refusals_and_sweeps_mark_their_paths():
    params = {
        param.id: param
        for param in backend_paths(
            mosaic=True, refuses={"mosaic-interpret": "bias"}, sweep=("triton-interpret",)
        )
    }
    refused = params["mosaic-interpret"]
    assert refused.values[0].refuses == "bias"
    assert any(
        mark.name == "xfail"
        and mark.kwargs["raises"] is NotImplementedError
        and mark.kwargs["strict"]
        for mark in refused.marks
    )
    assert any(
        mark.name == "skipif" and "PALLAS_FLASH_SWEEP" in mark.kwargs["reason"]
        for mark in params["triton-interpret"].marks
    )
    assert all(
        param.values[0].refuses is None
        for name, param in params.items()
        if name != "mosaic-interpret"
    )
