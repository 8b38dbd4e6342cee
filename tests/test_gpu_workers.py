"""benchmarks/gpu_workers.py: how many test processes share a GPU in `device_run.sh tests`, each
one's memory cap, and which failures were for memory (run again alone)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_workers.py"
_spec = importlib.util.spec_from_file_location("gpu_workers", PATH)
gpu_workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_workers)


@pytest.mark.parametrize(
    "total_mib, cores, processes, want",
    [
        (143771, 16, None, (15, 0.058)),  # H200 (nvidia-smi's memory.total): 8.2 GiB each
        (81559, 16, None, (8, 0.109)),  # H100 80 GB: 8.7 GiB each
        (81559, 4, None, (3, 0.312)),  # few cores
        (81559, 16, 4, (4, 0.231)),  # the groups side by side
    ],
)
def test_workers_and_their_memory_caps(total_mib, cores, processes, want):
    workers, fraction = gpu_workers.size(total_mib, cores, processes)
    assert (workers, fraction) == want
    total = total_mib / 1024
    # Every cap and its CUDA context fit beside the others, less the driver's reserve.
    assert workers * (fraction * total + gpu_workers.CONTEXT_GIB) <= total - gpu_workers.RESERVE_GIB


def test_too_many_processes_for_the_gpu_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        gpu_workers.size(8192, 16, 20)


def test_memory_failures_are_read_from_the_junit_report(tmp_path, monkeypatch):
    monkeypatch.chdir(PATH.parents[1])
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_api" name="test_a[x y]">'
        '<failure message="jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_api" name="test_b"><error message="setup">'
        "INTERNAL: All configs failed during profiling</error></testcase>"
        '<testcase classname="tests.test_api" name="test_c">'
        '<failure message="AssertionError: 1 != 2">trace</failure></testcase>'
        '<testcase classname="tests.test_api" name="test_d" />'
        "</testsuite></testsuites>"
    )
    assert gpu_workers.memory_failures(str(report)) == [
        "tests/test_api.py::test_a[x y]",
        "tests/test_api.py::test_b",
    ]
