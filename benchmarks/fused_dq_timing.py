"""Forward+backward time of the Mosaic kernels with dQ computed in the dK/dV kernel
(`BackwardTiles(fused_dq="add")`: five matmuls per pair of tiles, dQ added by TMA reductions;
"fixed": the same adds of integers, deterministic) against the default two-kernel backward
(seven) and cuDNN, on the H200 (a few minutes).

    [MODES=default,fused,fixed] [MASK=window:W|packed:D] [KERNELS=1]
        python benchmarks/fused_dq_timing.py [OUT.jsonl] [H:SEQ ...]

(MODES may also name "step", "fixed_step", "fused_step" and "clean".)

FA2 grid points (bf16, 16k tokens per batch, N = 2048 / H), causal and not: POINTS, or the
H:SEQ pairs given (e.g. 64:2048 128:8192), or H:SEQ:K for GQA with K KV heads. "default",
"fused" and "fixed" are the Mosaic forward differentiated by `mosaic.flash_backward` with the
default tiles and with fused_dq="add" and "fixed";
"step", "fixed_step" and "fused_step" the two-kernel, "fixed" and "add" backwards with
`step_descriptors`; "clean" the two-kernel backward with `producer_cleans_k` (masked calls);
"cudnn" is `jax.nn.dot_product_attention(implementation="cudnn")` (with the window; not for
packed documents, which it takes no segment ids for). TFLOP/s count the pairs of the plain (or
causal) call, whatever MASK. Prints one JSON row per point and backward (ms, TFLOP/s by the FA2
count; with KERNELS=1 also each kernel's us per call from jax's profiler, `kernels_us`), then
per point the ratios, each fused dQ's largest difference from the default
backward's relative to dQ's largest magnitude, and whether two runs of it gave the same bits.
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

from pallas_flash.bench import attention_flops, device_ms, median_ms, timed_fn
from pallas_flash.mosaic import BackwardTiles, flash_backward, flash_forward

POINTS = [(128, 4096), (128, 16384), (64, 4096), (64, 16384)]


def mosaic_attention(tiles, *, scale, is_causal, **mask):
    """The Mosaic forward differentiated by `flash_backward` with these tiles; mask: window
    and/or segment_ids, as both take them."""

    @jax.custom_vjp
    def attention(q, k, v):
        return flash_forward(q, k, v, scale=scale, is_causal=is_causal, **mask)[0]

    def fwd(q, k, v):
        out, lse = flash_forward(q, k, v, scale=scale, is_causal=is_causal, **mask)
        return out, (q, k, v, out, lse)

    def bwd(residuals, d_out):
        return flash_backward(
            *residuals, d_out, None, scale=scale, is_causal=is_causal, tiles=tiles, **mask
        )

    attention.defvjp(fwd, bwd)
    return attention


def masks_of(spec: str, batch: int, seq: int):
    """MASK env: "" none; "window:W" a window of W keys left of the diagonal (and W right of it
    where not causal); "packed:D" D documents of seq / D tokens per sequence (segment ids).
    Returns (the Mosaic kernels' mask kwargs, cuDNN's through jax.nn or None where it has no
    such mask)."""
    if not spec:
        return {}, {}
    kind, size = spec.split(":")
    if kind == "window":
        width = int(size)
        return dict(window=(width, width)), dict(local_window_size=(width, width))
    if kind == "packed":
        ids = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) * int(size) // seq, (batch, seq))
        return dict(segment_ids=(ids, ids)), None
    raise ValueError(f"MASK={spec!r}: window:W or packed:D")


# Every backward this script can time (MODES env: a comma-separated subset, in this order).
TILES = {
    "default": None,
    "fused": BackwardTiles(fused_dq="add"),
    "fixed": BackwardTiles(fused_dq="fixed"),
    # The dK/dV consumers' operand descriptors rebuilt each step (not held across the loop).
    "step": BackwardTiles(step_descriptors=True),
    "fixed_step": BackwardTiles(fused_dq="fixed", step_descriptors=True),
    "fused_step": BackwardTiles(fused_dq="add", step_descriptors=True),
    # The two kernels, the dQ kernel's producer cleaning masked K tiles (no XLA pass over K).
    "clean": BackwardTiles(producer_cleans_k=True),
}


def main():
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    points = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[2:]] or POINTS
    points = [(*p, None)[:3] for p in points]  # (H, SEQ, KV heads or None: as many as N)
    modes = os.environ.get("MODES", "default,fused,fixed").split(",")
    modes = ["default", *(m for m in modes if m != "default")]
    mask_spec = os.environ.get("MASK", "")
    kernel_times = os.environ.get("KERNELS") == "1"

    def record(row):
        print(json.dumps(row), flush=True)
        if out:  # flushed: a stage cut by its timeout keeps the rows it printed
            out.write(json.dumps(row) + "\n")
            out.flush()

    for h, seq, kv_heads in points:
        b, n = 16384 // seq, 2048 // h
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [(b, seq, n if kv_heads is None or i in (0, 3) else kv_heads, h) for i in range(4)]
        args = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
        mask, cudnn_mask = masks_of(mask_spec, b, seq)
        for causal in (False, True):
            scale = h**-0.5
            if causal and "window" in mask:  # a causal window reaches left of the diagonal only
                mask["window"] = (mask["window"][0], 0)
                cudnn_mask["local_window_size"] = mask["window"]
            impls = {
                name: mosaic_attention(TILES[name], scale=scale, is_causal=causal, **mask)
                for name in modes
            }
            if cudnn_mask is not None:
                impls["cudnn"] = functools.partial(
                    jax.nn.dot_product_attention,
                    implementation="cudnn",
                    is_causal=causal,
                    **cudnn_mask,
                )
            ms = {}
            for name, fn in impls.items():
                try:
                    ms[name] = median_ms(timed_fn(fn, "fwd+bwd"), args)
                except Exception as error:  # cuDNN refuses some masks: the row says so
                    if name != "cudnn":
                        raise
                    record(dict(H=h, seq=seq, causal=causal, impl=name, error=str(error)[:200]))
                    continue
                tflops = attention_flops(b, seq, seq, n, h, causal, "fwd+bwd") / ms[name] / 1e9
                row = dict(H=h, seq=seq, K=kv_heads or n, causal=causal, impl=name, ms=ms[name])
                row |= dict(tflops=tflops, mask=mask_spec)
                if kernel_times:
                    kernel_ms, kernels = device_ms(timed_fn(fn, "fwd+bwd"), args)
                    row["kernel_ms"] = kernel_ms
                    row["kernels_us"] = {k: round(1e3 * t, 1) for k, t in kernels.items()}
                record(row)
            dq = {name: timed_fn(impls[name], "fwd+bwd")(*args)[0] for name in modes}
            summary = dict(H=h, seq=seq, K=kv_heads or n, causal=causal, summary="fwd+bwd")
            summary["mask"] = mask_spec
            reference = dq["default"].astype(jnp.float32)
            for name in modes[1:]:
                again = timed_fn(impls[name], "fwd+bwd")(*args)[0]
                difference = jnp.max(jnp.abs(dq[name].astype(jnp.float32) - reference))
                summary.update(
                    {
                        f"{name}_over_default": ms["default"] / ms[name],
                        f"{name}_over_cudnn": ms["cudnn"] / ms[name] if "cudnn" in ms else None,
                        f"{name}_dq_relative_difference": float(
                            difference / jnp.max(jnp.abs(reference))
                        ),
                        f"{name}_repeatable": bool(jnp.all(again == dq[name])),
                    }
                )
            if "cudnn" in ms:
                summary["default_over_cudnn"] = ms["cudnn"] / ms["default"]
            record(summary)


if __name__ == "__main__":
    main()
