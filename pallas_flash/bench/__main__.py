"""The bench's command line: the registry of suites, and its flags built from it.

Each suite is a module of this package with `HELP` (one line for --help), `FLAGS` (the flags it
reads on a GPU besides --out), optionally `FLAGS_ON_CPU` (those it reads without one, where it
runs a fixed demo), `IMPLS` (the --impls it times), `CASES` (the --cases groups it runs) and
`REPEATS` (the --repeats default, 7 without it), and `run(args, *, on_gpu)` that times, prints
its table and returns its rows.
A flag given to a suite that does not read it is an error, not ignored.
"""

from __future__ import annotations

import argparse
import sys

from pallas_flash import bench
from pallas_flash import device as device_lib
from pallas_flash.bench import compile as compile_suite
from pallas_flash.bench import decode, grid, masks, models, overheads, ragged, scale, shapes
from pallas_flash.bench.timing import PASSES

SUITES = {
    "grid": grid,
    "shapes": shapes,
    "models": models,
    "masks": masks,
    "compile": compile_suite,
    "decode": decode,
    "ragged": ragged,
    "scale": scale,
    "overheads": overheads,
}

# The flags a suite may read (argparse keyword arguments); --suite and --out every suite takes.
FLAGS = {
    "--head-dims": dict(type=int, nargs="+", default=[64, 128], help="head dims of the grid"),
    "--seqs": dict(type=int, nargs="+", help="sequence lengths (default per suite)"),
    "--impls": dict(
        nargs="+",
        choices=list(dict.fromkeys(i for s in SUITES.values() for i in getattr(s, "IMPLS", ()))),
        help="implementations to time (default per suite); pallas_flash_window: a causal "
        "1024-key window (--suite compile only)",
    ),
    "--passes": dict(nargs="+", default=list(PASSES), choices=PASSES),
    "--causal": dict(choices=["both", "yes", "no"], default="both"),
    "--repeats": dict(type=int, help="samples per median (default per suite, mostly 7)"),
    "--quick": dict(action="store_true", help="decode: the headline shape and a few variants only"),
    "--layers": dict(type=int, nargs="+", help="--suite compile's layer counts"),
    "--cases": dict(
        nargs="+",
        help="decode: gqa mla fp8 speculative; ragged: decode prefill mixed mla fp8 (the case "
        "groups to run; default all)",
    ),
    "--prefill-tiles": dict(
        nargs="+",
        metavar="BMxBKVxWxS",
        help="ragged: one more call per entry in the prefill and mixed batches, its prefill "
        "launch's tiles (block_m, block_kv, num_warps, num_stages), e.g. 128x64x4x2",
    ),
    "--decode-tiles": dict(
        nargs="+",
        metavar="BMxBKVxWxS[xSPLITS]",
        help="decode: one more call per entry over each float8 or latent cache, its tiles "
        "(block_m, block_kv, num_warps, num_stages [, kv_splits]), e.g. 16x64x4x4 16x128x4x3",
    ),
    "--before": dict(
        metavar="TREE",
        help="ragged: first the same run on TREE/pallas_flash (an older copy) in a child "
        "process, then this tree's, and each call's time side by side (needs --out)",
    ),
    "--label": dict(help="ragged: a label for every row, with an id of the run"),
}


def suite_flags(suite: str, on_gpu: bool) -> tuple[str, ...]:
    """The flags besides --out that `suite` reads, on a GPU or (on_gpu False) without one."""
    module = SUITES[suite]
    return module.FLAGS if on_gpu else getattr(module, "FLAGS_ON_CPU", module.FLAGS)


def given_flags(argv) -> set[str]:
    """The flags (--name, with or without =value) on the command line argv."""
    return {token.split("=")[0] for token in argv if token.startswith("--") and token != "--"}


def check_flags(parser, argv, suite: str, on_gpu: bool) -> set[str]:
    """The flags given on the command line argv; parser.error naming those that `suite` would
    not read."""
    given = given_flags(argv)
    reads = suite_flags(suite, on_gpu)
    unread = sorted(given - {"--suite", "--out", *reads})
    if unread:
        demo = not on_gpu and hasattr(SUITES[suite], "FLAGS_ON_CPU")
        where = " without an NVIDIA GPU (a fixed demo)" if demo else ""
        parser.error(
            f"--suite {suite}{where} does not take {', '.join(unread)}; it takes "
            f"{', '.join(('--out', *reads))}"
        )
    return given


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pallas_flash.bench",
        description=bench.__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument(
        "--suite",
        choices=list(SUITES),
        default="grid",
        help="; ".join(module.HELP for module in SUITES.values()),
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="also append each row to PATH as a line of JSON (without it no file is written)",
    )
    for flag, kwargs in FLAGS.items():
        parser.add_argument(flag, **kwargs)
    return parser


def main(argv=None) -> list[dict]:
    parser = make_parser()
    args = parser.parse_args(argv)
    on_gpu = (device_lib.gpu_compute_capability() or (0, 0)) >= (8, 0)
    check_flags(parser, sys.argv[1:] if argv is None else argv, args.suite, on_gpu)
    module = SUITES[args.suite]
    unknown = [i for i in args.impls or () if i not in getattr(module, "IMPLS", ())]
    if unknown:
        parser.error(
            f"--suite {args.suite} does not time {', '.join(unknown)}; its --impls: "
            f"{', '.join(module.IMPLS)}"
        )
    unknown = [c for c in args.cases or () if c not in getattr(module, "CASES", ())]
    if unknown:
        parser.error(
            f"--suite {args.suite} has no case group {', '.join(unknown)}; its --cases: "
            f"{', '.join(getattr(module, 'CASES', ()))}"
        )
    if args.repeats is None:
        args.repeats = getattr(module, "REPEATS", 7)
    rows = module.run(args, on_gpu=on_gpu)
    if args.out:
        print(f"\nappended {len(rows)} rows to {args.out}")
    return rows


if __name__ == "__main__":
    main()
