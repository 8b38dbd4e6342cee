"""Device-side experiments behind docs/notes/ (not part of the library's API).

python benchmarks/experiments.py tiles-masked --out $OUT/tiles.jsonl
    forward tiles for the narrow masked workloads (1k causal window and 8 x 2k packed
    documents at 16k): time of each candidate against dense causal with the default tiles.
python benchmarks/experiments.py split-kv --out $OUT/split.jsonl
    B=1, N=8 at 32k (the anchors' small-grid point) and short query blocks over long keys
    (decode, chunked prefill) with kv_splits 1 (off) and 0 (auto), beside cuDNN.
python benchmarks/experiments.py decode --out $OUT/decode.jsonl [--quick]
    decode_attention's split-KV and tile levers (DecodeBlockSizes) on the shapes short of
    3.8 TB/s (ragged lengths, T=16, 8k cache, GQA 16, B=1), on the headline shape, and in pages
    of 128: the default (the slots rule: 16 splits per sequence at B=8, 32k keys, XLA merge)
    and candidates, with memcpy of the same bytes. ms is device time per call (several calls
    in one jit: the host's dispatch of one call is not counted); ms_call (defaults only) times
    one call per dispatch, as the bench does; kernel_ms (on a GPU) is one call's kernels in
    jax's profiler. --cases picks shapes, --only candidates.
python benchmarks/experiments.py mosaic-tiles --out $OUT/mosaic.jsonl [--head-dims 64 --seqs 512]
    the Mosaic GPU forward with several ForwardTiles beside the Triton forward and cuDNN
    (forward only, FA2-paper shapes).
python benchmarks/experiments.py mosaic-backward --out $OUT/mosaic-bwd.jsonl [--head-dims 64]
    forward+backward with the Mosaic backward's default tiles
    (`mosaic.backward_tiles.default_tiles`) and candidate BackwardTiles, beside the default call,
    the Mosaic forward with the Triton backward, and cuDNN. At H 192 and 256 (e.g. `--head-dims 192
    256 --seqs 1024 4096`) the candidates that fit are the dK/dV consumers split by accumulator with
    one or two dQ consumers, and a third stage at H=192; at H 64 and 128 the split is a candidate
    too.
python benchmarks/experiments.py mosaic-gqa --out $OUT/mosaic-gqa.jsonl
    fwd+bwd of MQA and GQA calls (bf16, H=128: the issue's MQA 2k and GQA 4k probes, MQA
    at 8k, GQA 32/4 at 16k) with the dK/dV kernel's group of query heads summed in one CTA
    (dkv_head_splits=1, the default), split over 2, 4 and 8 CTAs, and the automatic choice
    (0; the impl name says what it chose), beside the default call and cuDNN.
python benchmarks/experiments.py mosaic-persistent --out $OUT/persistent.jsonl
    the Mosaic forward of masked and causal calls (windows, soft caps, segment ids, causal rows
    of 1k-16k, MHA and GQA) with its default tiles made persistent and not (and causal rows in
    the snake beside the default's pairs), in kernel time
    (jax's profiler), outputs compared, cuDNN beside where it runs the call: the measurements
    behind `mosaic.tiles.default_tiles`'s persistent rule. --smoke: `why_not` of each
    candidate at every case's shapes, no run.
python benchmarks/experiments.py fused-dq --out $OUT/fused.jsonl [--points 128:4096 64:16384:8]
        [--modes fused fixed step fixed_step fused_step clean] [--mask window:W|packed:D]
        [--kernel-time]
    fwd+bwd of the Mosaic backward with dQ in the dK/dV kernel ("fused": f32 adds, "fixed":
    integer adds) and its other forms, against the default two-kernel backward and cuDNN,
    with each form's dQ difference and repeatability: the measurements behind
    `dispatch.fused_dq_is_faster` and `fixed_dq_is_faster`.
python benchmarks/experiments.py mla --out $OUT/mla.jsonl
    MLA (H 192, Hv 128) against the plain H=192 call per FLOP, and the Mosaic forward's tile
    candidates at MLA's head dims (B=2, 4k, N=16, bf16: the models suite's DeepSeek row).
python benchmarks/experiments.py compile-forms --out $OUT/compile-forms.jsonl [--points fixed:24]
    compile time and XLA fusions of a jit(grad) over 1 and 24 causal layers per backward form
    (two-kernel, add, fixed, fixed-xla, fixed-bare), each row in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from pallas_flash.bench.__main__ import given_flags

# The families' package sits beside this file (run as a script, or loaded by path in the tests).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from experiment_families import (  # noqa: E402
    compile_forms,
    decode,
    mosaic_backward,
    mosaic_forward,
    triton_forward,
)

# name: (the flags it reads besides --out, fn(out, args)); another flag given is an error.
EXPERIMENTS = {
    "tiles-masked": ((), lambda out, a: triton_forward.tiles_masked(out)),
    "split-kv": ((), lambda out, a: triton_forward.split_kv(out)),
    "mosaic-tiles": (
        ("--head-dims", "--seqs", "--only"),
        lambda out, a: mosaic_forward.mosaic_tiles(out, a.head_dims, a.seqs, a.only),
    ),
    "mosaic-backward": (
        ("--head-dims", "--seqs"),
        lambda out, a: mosaic_backward.mosaic_backward(out, a.head_dims, a.seqs),
    ),
    "mosaic-gqa": ((), lambda out, a: mosaic_backward.mosaic_gqa(out)),
    "decode": (
        ("--quick", "--calls-per-jit", "--smoke", "--only", "--cases"),
        lambda out, a: decode.decode(
            out, a.quick, a.calls_per_jit, smoke=a.smoke, only=a.only, cases=a.cases
        ),
    ),
    "mosaic-persistent": (
        ("--smoke", "--cases"),
        lambda out, a: mosaic_forward.mosaic_persistent(out, smoke=a.smoke, cases=a.cases),
    ),
    "fused-dq": (
        ("--points", "--modes", "--mask", "--kernel-time"),
        lambda out, a: mosaic_backward.fused_dq(
            out, a.points, a.modes or ("fused", "fixed"), a.mask, a.kernel_time
        ),
    ),
    "mla": ((), lambda out, a: mosaic_forward.mla(out)),
    "compile-forms": (
        ("--points", "--row"),
        lambda out, a: compile_forms.compile_forms(out, a.points),
    ),
}


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("experiment", choices=list(EXPERIMENTS))
    parser.add_argument("--quick", action="store_true", help="decode: six shapes only")
    parser.add_argument(
        "--calls-per-jit", type=int, default=4, help="decode: calls timed in one jit"
    )
    parser.add_argument(
        "--only", nargs="+", help="decode: time only these candidates (default, full_waves, ...)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        help="decode: these shapes only (head, S1k, ...); mosaic-persistent: cases whose name"
        " contains one of these",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="decode: tiny interpreted shapes; mosaic-persistent: tile checks (CPU checks)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 16384])
    parser.add_argument(
        "--points",
        nargs="+",
        help="fused-dq: H:SEQ or H:SEQ:K (default 128:4096 128:16384 64:4096 64:16384); "
        "compile-forms: FORM:LAYERS (default each form at 1 and 24)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(mosaic_backward.FUSED_DQ_TILES),
        help="fused-dq: default fused fixed",
    )
    parser.add_argument("--mask", default="", help="fused-dq: window:W or packed:D")
    parser.add_argument(
        "--kernel-time", action="store_true", help="fused-dq: each kernel's time too"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # compile-forms: one row, in a child
    args = parser.parse_args()
    flags, run = EXPERIMENTS[args.experiment]
    unread = sorted(given_flags(sys.argv[1:]) - {"--out", *flags})
    if unread:
        parser.error(f"{args.experiment} does not take {', '.join(unread)}")
    if args.row:
        form, layers = args.row.split(":")
        print(json.dumps(compile_forms.compile_form_row(form, int(layers))), flush=True)
        return
    print("device:", jax.devices()[0].device_kind, flush=True)
    with open(args.out, "a") as out:
        run(out, args)


if __name__ == "__main__":
    main()
