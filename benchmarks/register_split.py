"""The Mosaic kernels' register split between the producer warpgroup and the consumers, probed
on the GPU:

    python benchmarks/register_split.py OUT_DIR [--kernels forward backward] [--producer 40 24]

For each producer count P, the consumers get min(240, (512 - P) / 2) registers (rounded down to
a multiple of 8: setmaxnreg's unit), in the kernels named by --kernels; the others keep the
package's split. Each P runs in child processes that patch the kernels' constants before
anything is traced (jax caches traced kernels by function, not by these constants, so one
process cannot hold two splits): one compiles RESOURCE_CASES with ptxas' report on
(`kernel_resources.py`: registers, spill bytes, SASS counts) into OUT_DIR/resources.jsonl; one
times TIMING_POINTS by kernel time (`bench.device_ms`, median call) into OUT_DIR/timing.jsonl.
The timings of two splits come from two processes: compare them with a case neither split
changes (up to 2.4% apart between processes:
docs/notes/tooling.md, "Mosaic kernels' registers and SASS").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# kernel_resources.py's cases compiled at each split.
RESOURCE_CASES = (
    "h64-16k",
    "h128-causal-fixed",
    "h128-fixed",
    "h128-causal",
    "h128-causal-fixed-step",
)
# (H, T, causal, pass, fused_dq): B * T = 16k tokens, N = 2048 / H, bf16. fused_dq: the Mosaic
# backward with BackwardTiles(fused_dq=...) under the Mosaic forward; None: the default call.
TIMING_POINTS = [
    (64, 2048, False, "fwd", None),
    (64, 16384, False, "fwd", None),
    (64, 4096, True, "fwd", None),
    (128, 2048, True, "fwd", None),
    (128, 16384, False, "fwd", None),
    (64, 16384, False, "fwd+bwd", None),
    (128, 4096, True, "fwd+bwd", None),
    (128, 4096, True, "fwd+bwd", "fixed"),
    (128, 16384, False, "fwd+bwd", None),
    (128, 16384, True, "fwd+bwd", "fixed"),
]


def consumer_registers(producer: int) -> int:
    """Registers of each of two consumers beside a producer of `producer`."""
    from pallas_flash.mosaic import tiles

    return tiles.consumer_registers(2, producer)


def patch(producer: int, kernels) -> None:
    """The kernels' constants, before anything is traced: every module that holds one."""
    from pallas_flash.mosaic import backward_tiles, dkv, dq, forward

    if "forward" in kernels:
        forward.FORWARD_PRODUCER_REGISTERS = producer
        forward.FORWARD_CONSUMER_REGISTERS = consumer_registers(producer)
    if "backward" in kernels:
        # backward_consumer_registers() follows backward_tiles' constant.
        for module in (backward_tiles, dkv, dq):
            module.BACKWARD_PRODUCER_REGISTERS = producer


def compile_case(producer, kernels, name):
    import kernel_resources

    patch(producer, kernels)
    kernel_resources.compile_case(name)


def time_points(producer, kernels, out_path):
    import jax.numpy as jnp

    import pallas_flash
    from pallas_flash import bench
    from pallas_flash.mosaic import BackwardTiles

    patch(producer, kernels)
    from experiment_families.mosaic_backward import mosaic_attention

    with open(out_path, "a") as out:
        for h, t, causal, pass_, fused in TIMING_POINTS:
            b, n = 16384 // t, 2048 // h
            args = bench.make_inputs(b, t, t, n, n, h, jnp.bfloat16)
            if fused is None:
                fn = functools.partial(pallas_flash.flash_attention, is_causal=causal)
            else:
                tiles = BackwardTiles(fused_dq=fused)
                fn = mosaic_attention(tiles, scale=h**-0.5, is_causal=causal)
            ms, _ = bench.device_ms(bench.timed_fn(fn, pass_), args)
            row = dict(
                producer=producer,
                consumers=consumer_registers(producer),
                kernels=list(kernels),
                H=h,
                T=t,
                causal=causal,
                pass_=pass_,
                fused_dq=fused,
                kernel_ms=round(ms, 4),
            )
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, mode, producer, kernels, *rest = sys.argv
        kernels = kernels.split(",")
        if mode == "compile":
            compile_case(int(producer), kernels, rest[0])
        else:
            time_points(int(producer), kernels, rest[0])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--kernels", nargs="+", default=["forward", "backward"])
    parser.add_argument("--producer", type=int, nargs="+", default=[40, 24])
    parser.add_argument("--no-resources", action="store_true")
    args = parser.parse_args()
    import kernel_resources

    os.makedirs(args.out_dir, exist_ok=True)
    kernels = ",".join(args.kernels)
    if not args.no_resources:
        jobs = [
            (
                f"{name}-{producer}",
                [sys.executable, __file__, "--child", "compile", str(producer), kernels, name],
                dict(producer=producer, kernels=args.kernels, case=name),
            )
            for producer in args.producer
            for name in RESOURCE_CASES
        ]
        with open(os.path.join(args.out_dir, "resources.jsonl"), "a") as out:
            kernel_resources.compile_in_children(args.out_dir, jobs, out)
    # Timings one process at a time, in turns.
    timing = os.path.join(args.out_dir, "timing.jsonl")
    for producer in args.producer:
        cmd = [sys.executable, __file__, "--child", "time", str(producer), kernels, timing]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
