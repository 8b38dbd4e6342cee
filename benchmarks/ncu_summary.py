"""The metrics that answered this project's questions, one column per kernel, from Nsight
Compute's raw page (`ncu --import REPORT --page raw --csv`, as `device_run.sh ncu` brings it
back gzipped):

    python benchmarks/ncu_summary.py benchmarks/results/h200-ncu-forward.csv.gz

Duration and clock, the pipes' activity (tensor, MUFU), issue-slot use, the warp stalls per
issued instruction that the notes quote (long scoreboard: memory and spill reloads; barrier; wait),
L2 hit rate, DRAM throughput and local-memory (spill) requests.
"""

from __future__ import annotations

import csv
import gzip
import sys

# (label, metric name in the raw page)
METRICS = [
    ("ms", "gpu__time_duration.sum"),
    ("SM GHz", "smsp__cycles_elapsed.avg.per_second"),
    ("tensor pipe %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU (MUFU) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA pipe %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue active %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("stall long scoreboard",
     "smsp__average_warps_issue_stalled_long_scoreboard" "_per_issue_active.ratio"),
    ("stall barrier", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"),
    ("stall wait", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("local (spill) requests", "derived__local_spilling_requests"),
    ("instructions", "smsp__inst_executed.sum"),
]  # fmt: skip


# ncu scales a duration's unit to its size: short kernels' come in us.
MILLISECONDS_PER = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def read_raw(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """(kernel names, one {metric: value} per kernel) of a raw page, gzipped or not; the
    kernels' durations (gpu__time_duration.sum) in ms whatever unit the page gives."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header, units, data = rows[0], dict(zip(rows[0], rows[1])), rows[2:]
    kernels = [dict(zip(header, row)) for row in data]
    duration = "gpu__time_duration.sum"
    for k in kernels:
        if duration in k and units.get(duration) in MILLISECONDS_PER:
            ms = number(k[duration]) * MILLISECONDS_PER[units[duration]]
            k[duration] = f"{ms:.6f}"
    return [k.get("Kernel Name", "?") for k in kernels], kernels


def number(value: str) -> float:
    """A raw page's value ("12,582,912", "97.65") as a float."""
    return float(value.replace(",", ""))


def summary(path: str) -> list[tuple[str, list[str]]]:
    """(label, values per kernel) of METRICS found in the raw page; '-' where absent."""
    names, kernels = read_raw(path)
    table = [("kernel", [name[:28] for name in names])]
    for label, metric in METRICS:
        table.append((label, [k.get(metric, "-") for k in kernels]))
    return table


def main():
    for path in sys.argv[1:]:
        print(path)
        for label, values in summary(path):
            print(f"{label:24} " + " | ".join(f"{v:>28}" for v in values))


if __name__ == "__main__":
    main()
