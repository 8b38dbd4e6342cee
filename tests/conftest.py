"""pytest's hooks and the shared fixtures: the environment XLA must see before jax starts, the
`gpu` marker's skip and the `ci_slice` marker, the Triton kernels' execution `mode`, and
fixtures that isolate a test (no backend may run, fresh fallback warnings, a private autotune
cache). The helpers the tests import (the float64 oracle, the tolerance rule, random inputs, the
backend matrix) live in tests/support/.
"""

from __future__ import annotations

import collections
import glob
import os

# jax's Mosaic GPU interpreter (support/mosaic_interpret.py) runs a kernel's warpgroups as
# threads whose barrier waits are host callbacks, and XLA's CPU client may run such a callback on
# a thread of its pool, where it blocks until another warpgroup arrives. With a pool as small as
# the host's cores (2 in CI), the callback that launched the warpgroups and one blocked wait fill
# it, and the warpgroup that would arrive cannot run: a deadlock that depends on the scheduling.
# XLA sizes the pool from NPROC when it is set before the CPU backend starts.
os.environ.setdefault("NPROC", "8")

# On a machine without an NVIDIA GPU most of the suite's time is XLA's CPU compiling the
# interpreted kernels and the oracles; LLVM at optimisation level 0 compiles them in about 60%
# of the time (and runs them a little slower). Set before the CPU backend starts; left alone
# where a GPU is (its XLA fusions are compiled with this flag too).
if not glob.glob("/dev/nvidia[0-9]*") and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax.numpy as jnp
import pytest
from support.backends import MODES, SWEEP, has_gpu, kernel_kwargs

from pallas_flash import api, flax_common, tune_cache

# -- the gpu and ci_slice markers -----------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    _slice_for_ci(items)
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU of compute capability >= 8.0")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _slice_for_ci(items):
    """`@pytest.mark.ci_slice(n)` on a parametrized test: without PALLAS_FLASH_SWEEP, only its
    first n CPU cases (in parametrization order: put the ones that matter most first) run; the
    rest are the sweep's. Cases marked gpu are never sliced: they are the compiled checks."""
    if SWEEP:
        return
    seen = collections.Counter()
    for item in items:
        marker = item.get_closest_marker("ci_slice")
        if marker is None or item.get_closest_marker("gpu") is not None:
            continue
        if any(m.args and m.args[0] is True for m in item.iter_markers("skipif")):
            continue  # a case already left to the sweep (SWEEP_ONLY) is not counted
        key = (item.path, item.originalname)
        seen[key] += 1
        if seen[key] > marker.args[0]:
            item.add_marker(
                pytest.mark.skip(reason="beyond the CI slice: PALLAS_FLASH_SWEEP=1 runs it")
            )


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def flash_kwargs(mode) -> dict:
    """The call kwargs of the `mode` fixture's run: `flash_attention(q, k, v, **flash_kwargs)`."""
    return kernel_kwargs(mode)


@pytest.fixture
def no_compute(monkeypatch):
    """Makes any attempt to run a backend fail the test: errors must come from validation."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("a backend was called: validation did not stop the call")

    monkeypatch.setattr(api, "flash_attention_kernels", must_not_run)
    monkeypatch.setattr(api, "flash_attention_kernels_with_log_sum", must_not_run)
    monkeypatch.setattr(api, "reference_attention_vjp", must_not_run)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which fallback warnings this process has given, for this test only."""
    monkeypatch.setattr(flax_common, "_warned", set())


@pytest.fixture
def kernel_configs(monkeypatch) -> list:
    """Records, instead of running, the KernelConfig of each call that reaches the kernels
    (`api.flash_attention_kernels`, which then returns zeros): the list it appends them to."""
    configs = []

    def record(q, k, v, bias, arrays, config):
        configs.append(config)
        b, t, n, _ = q.shape
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((b, n, t), jnp.float32)

    monkeypatch.setattr(api, "flash_attention_kernels", record)
    return configs


@pytest.fixture
def tune_cache_path(tmp_path, monkeypatch):
    """This test's own autotune cache file (not written yet), in $PALLAS_FLASH_TUNE_CACHE: a
    user's cache cannot change a choice, and what the test saves stays its own."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("PALLAS_FLASH_TUNE_CACHE", str(path))
    tune_cache._load_tune_cache.cache_clear()
    yield path
    tune_cache._load_tune_cache.cache_clear()
