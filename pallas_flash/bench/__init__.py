"""`python -m pallas_flash.bench`: TFLOP/s of pallas_flash beside cuDNN and XLA attention.

On a GPU it runs the FlashAttention-2 paper's grid (bf16, 16k tokens per batch, hidden 2048, so
N = 2048 / H; H in {64, 128}; seq 512 to 16k; causal and not; forward and forward+backward) for
every implementation in one process on the same inputs and prints a table of TFLOP/s and the ratio
to cuDNN (a line per measurement goes to stderr as it runs); `--out PATH` also appends every row
to PATH as a line of JSON, and without it no file is written. On a CPU it runs a small
interpret-mode demo and says so. `--suite` picks another suite
(`pallas_flash.bench.__main__.SUITES`: one module each).

FLOPs follow the paper: forward 4 * B * N * T * S * H, halved when causal; forward+backward is
3.5 x forward (the backward is 2.5 x).

The timing library (`pallas_flash.bench.timing`) is importable from here, for
`pallas_flash.tune` and the scripts in benchmarks/.
"""

from pallas_flash.bench.timing import (
    PASSES,
    Rows,
    attention_flops,
    attention_fn,
    device_ms,
    failure,
    kernel_timing,
    make_inputs,
    median_ms,
    per_call_median,
    recording_failure,
    run_point,
    tbps,
    timed_fn,
)

__all__ = [
    "PASSES",
    "Rows",
    "attention_flops",
    "attention_fn",
    "device_ms",
    "failure",
    "kernel_timing",
    "make_inputs",
    "median_ms",
    "per_call_median",
    "recording_failure",
    "run_point",
    "tbps",
    "timed_fn",
]
