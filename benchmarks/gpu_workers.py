"""How many pytest processes share one GPU in `device_run.sh tests`, and how much of its memory
each may take; and which tests of a run failed for memory (to run again alone).

    python3 benchmarks/gpu_workers.py size [PROCESSES]    -> "WORKERS FRACTION"
    python3 benchmarks/gpu_workers.py memory-failures JUNIT.xml   -> node ids, one per line

The arithmetic (device_run.sh's header says why): each process costs WORKER_GIB of the smallest
visible GPU's memory.total, less RESERVE_GIB kept for the driver; workers = min(cores - 1,
(total - reserve) // WORKER_GIB), at least 1, unless PROCESSES fixes the count. Each process's
XLA allocator is capped (XLA_PYTHON_CLIENT_MEM_FRACTION) at its share of (total - reserve) less
CONTEXT_GIB, which its CUDA context and libraries hold outside the allocator.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

WORKER_GIB = float(os.environ.get("TEST_WORKER_GIB", 9))
RESERVE_GIB = float(os.environ.get("TEST_RESERVE_GIB", 2))
CONTEXT_GIB = float(os.environ.get("TEST_CONTEXT_GIB", 1))
# What a test that ran out of GPU memory says: XLA's allocator, or its autotuner when no config
# could get its buffers.
MEMORY = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|All configs failed during profiling")


def size(total_mib: float, cores: int, processes: int | None = None) -> tuple[int, float]:
    """(processes, memory fraction of each) for a GPU of total_mib MiB and a host of cores."""
    total = total_mib / 1024
    usable = total - RESERVE_GIB
    if processes is None:
        processes = max(1, min(cores - 1, math.floor(usable / WORKER_GIB)))
    share = usable / processes - CONTEXT_GIB
    fraction = math.floor(share / total * 1000) / 1000
    if fraction <= 0:
        raise ValueError(f"{processes} processes do not fit {total:.1f} GiB")
    return processes, fraction


def gpu_memory_mib() -> float:
    """memory.total of the smallest visible GPU, in MiB."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return min(float(x) for x in out.split())


def node_id(classname: str, name: str) -> str:
    """pytest's node id of a JUnit test case: the longest dotted prefix that is a file."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(path):
            return "::".join([path, *parts[i:], name])
    return "::".join([classname.replace(".", "/") + ".py", name])


def memory_failures(junit_path: str) -> list[str]:
    """Node ids of the failed or errored tests whose report says they ran out of GPU memory."""
    failed = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        for report in (*case.iter("failure"), *case.iter("error")):
            text = (report.get("message") or "") + (report.text or "")
            if MEMORY.search(text):
                failed.append(node_id(case.get("classname", ""), case.get("name", "")))
                break
    return failed


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "size":
        workers, fraction = size(
            gpu_memory_mib(), os.cpu_count() or 1, int(args[0]) if args else None
        )
        print(workers, fraction)
    elif command == "memory-failures":
        print("\n".join(memory_failures(args[0])))
    else:
        sys.exit(f"unknown command {command!r}")
