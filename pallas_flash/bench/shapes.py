"""`--suite shapes`: the calls off the FA2 grid that models make, beside cuDNN (GPU only).

Lengths that are not multiples of the tiles and head dims other than 64/128, at batches that
fill an H200 (about 16k tokens or more); each row also counts the Mosaic GPU kernels its call
launches (`mosaic_calls`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.bench.grid import print_table, run_points, select_causal
from pallas_flash.bench.timing import Rows, attention_fn, make_inputs, timed_fn

HELP = (
    "shapes: lengths off the tile grid (3000, ViT's 197 and 577) and head dims 80, 96, 192, "
    "beside cuDNN (GPU only; --impls default pallas_flash, pallas_flash_triton, cudnn)"
)
FLAGS = ("--impls", "--passes", "--causal", "--repeats")
IMPLS = ("pallas_flash", "pallas_flash_triton", "cudnn", "xla", "jax_pallas")
DEFAULT_IMPLS = ["pallas_flash", "pallas_flash_triton", "cudnn"]


def shapes_grid():
    """The shapes suite: lengths that are not multiples of the tiles and head dims other than
    64/128, as models use them, at batches that fill an H200 (about 16k tokens or more).
    Llama-like T = S = 3000 (hidden 2048, H=128); ViT-B at 224 px (197 tokens, 12 heads of 64)
    and ViT-L at 384 px (577 tokens, 16 heads of 64); Phi-like H=80 and H=96 (32 heads) at 2k;
    H=192 at 4k (both on Mosaic, split dK/dV consumers). Before those, the calls off the FA2
    grid that real models make (H=128 unless said): MQA (32 query heads over 1 KV head, 2k,
    causal), GQA (32 over 8, 4k, causal), cross-attention (1k queries over 8k keys), one 64k
    causal GQA sequence, H=256 causal at 4k. Masked calls (windows, packed documents, padding)
    are the masks suite's."""
    yield dict(b=8, t=2048, s=2048, n=32, k=1, h=128, causal=True)
    yield dict(b=4, t=4096, s=4096, n=32, k=8, h=128, causal=True)
    yield dict(b=16, t=1024, s=8192, n=16, k=16, h=128, causal=False)
    yield dict(b=1, t=65536, s=65536, n=32, k=8, h=128, causal=True)
    yield dict(b=4, t=4096, s=4096, n=8, k=8, h=256, causal=True)
    yield dict(b=5, t=3000, s=3000, n=16, k=16, h=128, causal=True)
    yield dict(b=5, t=3000, s=3000, n=16, k=16, h=128, causal=False)
    yield dict(b=256, t=197, s=197, n=12, k=12, h=64, causal=False)
    yield dict(b=64, t=577, s=577, n=16, k=16, h=64, causal=False)
    for h in (96, 80):
        for causal in (True, False):
            yield dict(b=8, t=2048, s=2048, n=32, k=32, h=h, causal=causal)
    yield dict(b=4, t=4096, s=4096, n=16, k=16, h=192, causal=True)


def mosaic_calls(impl, p, dtype, pass_) -> int | None:
    """How many Mosaic GPU kernels the jitted call of a pallas_flash implementation launches
    (3: Mosaic forward and backward; 1: Mosaic forward, Triton backward; 0: Triton)."""
    if not impl.startswith("pallas_flash"):
        return None
    fn = attention_fn(impl, is_causal=p["causal"])
    args = make_inputs(p["b"], p["t"], p["s"], p["n"], p["k"], p["h"], dtype)
    try:
        return timed_fn(fn, pass_).lower(*args).as_text().count("mosaic_gpu_v2")
    except Exception:  # noqa: BLE001 -- the timing row records the failure
        return None


def run(args, *, on_gpu: bool) -> list[dict]:
    if not on_gpu:
        raise SystemExit("--suite shapes needs an NVIDIA GPU (sm80+)")
    grid = select_causal(list(shapes_grid()), args.causal)
    impls, dtype = args.impls or DEFAULT_IMPLS, jnp.bfloat16
    print(
        f"GPU: {jax.devices()[0].device_kind}; {len(grid)} shapes x {len(args.passes)} "
        f"passes x {len(impls)} implementations",
        flush=True,
    )
    rows = Rows(args.out)

    def extra(impl, p, pass_):
        return dict(suite="shapes", mosaic_calls=mosaic_calls(impl, p, dtype, pass_))

    run_points(
        rows,
        grid,
        impls,
        args.passes,
        dtype,
        interpret=False,
        calls=10,
        repeats=args.repeats,
        on_gpu=True,
        extra=extra,
    )
    print_table(rows, impls)
    return rows
