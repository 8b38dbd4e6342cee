"""The Mosaic backward's experiments: tiles (`mosaic-backward`), the dK/dV kernel's head
splits (`mosaic-gqa`), and the forms of dQ (`fused-dq`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from experiment_families.common import (
    grid_points,
    mosaic_backward_call,
    mosaic_fn,
    mosaic_forward_call,
    record,
    time_impls,
    triton_tiles,
)
from pallas_flash import bench, mosaic, tune
from pallas_flash.device import target_device

# BackwardTiles fields of the candidates (besides the defaults); `mosaic.why_not_backward` drops
# those that would spill or overflow shared memory at a head dim, and a candidate equal to the
# head dim's defaults is not timed twice.
MOSAIC_BACKWARD_TILES = {
    "plain": {},
    # Causal grids in their own order, a head's tiles in turn (`schedule.grouped_launch`).
    "ungrouped": dict(grouped_launch=False),
    # The dK/dV consumers' K/V descriptors rebuilt each step, not held (with fused dQ:
    # `fused-dq`'s "fixed_step").
    "step": dict(step_descriptors=True),
    "stages3": dict(num_stages=3),
    "kvdq128": dict(block_kv_dq=128),
    "kvdq128_stages3": dict(block_kv_dq=128, num_stages=3),
    "qdkv128": dict(block_q_dkv=128),
    "qdq128": dict(block_q_dq=128),
    "qdkv128_qdq128": dict(block_q_dkv=128, block_q_dq=128),
    "one_consumer": dict(num_consumers=1),
    "split": dict(split_dkv=True),
    "split_qdkv128": dict(split_dkv=True, block_q_dkv=128),
    "split_qdkv128_kvdq128": dict(split_dkv=True, block_q_dkv=128, block_kv_dq=128),
    "split_one_dq_consumer": dict(split_dkv=True, num_consumers=1),
    "split_one_dq_consumer_stages3": dict(split_dkv=True, num_consumers=1, num_stages=3),
}


def mosaic_backward(out, head_dims=(64, 128), seqs=(512, 1024, 2048, 16384)):
    """fwd+bwd: the default call, cuDNN, the Mosaic forward with the Triton backward, and the
    Mosaic backward with its default tiles and each candidate of MOSAIC_BACKWARD_TILES."""
    for b, t, n, h, causal, args in grid_points(head_dims, seqs):
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd+bwd")
            for impl in ("pallas_flash", "cudnn")
        }
        fns["triton_bwd"] = mosaic_fn(t, n, h, causal, "fwd+bwd", backward="triton")
        candidates = {"default": mosaic.backward_tiles.default_tiles(h)}
        for name, fields in MOSAIC_BACKWARD_TILES.items():
            tiles = mosaic.BackwardTiles(**fields)
            if tiles not in candidates.values():
                candidates[name] = tiles
        for name, tiles in candidates.items():
            fn = mosaic_fn(t, n, h, causal, "fwd+bwd", backward_tiles=tiles)
            if fn is not None:
                fns[f"mosaic_bwd_{name}"] = fn
        flops = bench.attention_flops(b, t, t, n, h, causal, "fwd+bwd")
        time_impls(out, fns, args, flops, exp="mosaic-backward", B=b, T=t, N=n, H=h, causal=causal)


# (B, T, N, K, causal): the MQA and GQA probes of the shapes suite, and longer calls.
GQA_POINTS = [
    (8, 2048, 32, 1, True),
    (8, 2048, 32, 1, False),
    (4, 4096, 32, 8, True),
    (2, 8192, 32, 1, True),
    (1, 16384, 32, 4, True),
]


def mosaic_gqa(out, head_dim=128):
    """fwd+bwd of GQA/MQA calls: the default call, cuDNN, and the Mosaic kernels with the
    dK/dV kernel's head splits at 1, 2, 4, 8 and automatic (0)."""
    device = target_device()
    for b, t, n, k, causal in GQA_POINTS:
        args = bench.make_inputs(b, t, t, n, k, head_dim, jnp.bfloat16)
        fns = {
            impl: bench.timed_fn(bench.attention_fn(impl, is_causal=causal), "fwd+bwd")
            for impl in ("pallas_flash", "cudnn")
        }
        for splits in (1, 0, 2, 4, 8):
            tiles = mosaic.BackwardTiles(dkv_head_splits=splits)
            kernels = tune.mosaic_kernels_fn(
                (b, t, n, head_dim),
                jnp.bfloat16,
                is_causal=causal,
                backend="mosaic",
                block_sizes=triton_tiles(head_dim, causal, t),
                backward_tiles=tiles,
                num_kv_heads=k,
            )
            if kernels is None:
                continue
            name = f"mosaic_head_splits{splits}"
            if splits == 0:
                chosen = mosaic.backward_tiles.head_splits(
                    tiles,
                    (b, t, n, head_dim),
                    (b, t, k, head_dim),
                    2,
                    num_sms=device.num_sms,
                    causal=causal,
                )
                name = f"mosaic_head_splits_auto{chosen}"
            fns[name] = bench.timed_fn(lambda q, k_, v, f=kernels: f(q, k_, v)[0], "fwd+bwd")
        flops = bench.attention_flops(b, t, t, n, head_dim, causal, "fwd+bwd")
        time_impls(out, fns, args, flops, exp="mosaic-gqa", B=b, T=t, N=n, K=k, causal=causal)


# -- the Mosaic backward's forms of dQ --------------------------------------------------------

# Every backward fused-dq can time (--modes: a subset; "default" is always timed, first).
FUSED_DQ_TILES = {
    "default": None,
    "fused": mosaic.BackwardTiles(fused_dq="add"),
    "fixed": mosaic.BackwardTiles(fused_dq="fixed"),
    # The dK/dV consumers' operand descriptors rebuilt each step (not held across the loop).
    "step": mosaic.BackwardTiles(step_descriptors=True),
    "fixed_step": mosaic.BackwardTiles(fused_dq="fixed", step_descriptors=True),
    "fused_step": mosaic.BackwardTiles(fused_dq="add", step_descriptors=True),
    # The two kernels, the dQ kernel's producer cleaning masked K tiles (no XLA pass over K).
    "clean": mosaic.BackwardTiles(producer_cleans_k=True),
}
FUSED_DQ_POINTS = ["128:4096", "128:16384", "64:4096", "64:16384"]


def mosaic_attention(tiles, *, scale, is_causal, **mask):
    """The Mosaic forward differentiated by `mosaic.flash_backward` with these tiles; mask:
    window and/or segment_ids, as both take them."""
    options = dict(scale=scale, is_causal=is_causal, **mask)

    @jax.custom_vjp
    def attention(q, k, v):
        return mosaic_forward_call(q, k, v, **options)[0]

    def fwd(q, k, v):
        out, lse = mosaic_forward_call(q, k, v, **options)
        return out, (q, k, v, out, lse)

    def bwd(residuals, d_out):
        return mosaic_backward_call(*residuals, d_out, None, tiles=tiles, **options)

    attention.defvjp(fwd, bwd)
    return attention


def _fused_dq_masks(spec: str, batch: int, seq: int, causal: bool):
    """--mask: "" none; "window:W" a window of W keys left of the diagonal (and W right of it
    where not causal); "packed:D" D documents of seq / D tokens per sequence (segment ids).
    Returns (the Mosaic kernels' mask kwargs, cuDNN's through jax.nn, or None where it has no
    such mask)."""
    if not spec:
        return {}, {}
    kind, size = spec.split(":")
    if kind == "window":
        window = (int(size), 0 if causal else int(size))
        return dict(window=window), dict(local_window_size=window)
    if kind == "packed":
        ids = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) * int(size) // seq, (batch, seq))
        return dict(segment_ids=(ids, ids)), None
    raise ValueError(f"--mask {spec!r}: window:W or packed:D")


def fused_dq(out, points=None, modes=("fused", "fixed"), mask_spec="", kernel_time=False):
    """fwd+bwd of the Mosaic kernels with dQ computed in the dK/dV kernel (fused_dq "add":
    five matmuls per pair of tiles, dQ added by TMA reductions; "fixed": the same adds of
    integers, deterministic) and the other forms of FUSED_DQ_TILES, against the default
    two-kernel backward (seven) and cuDNN. points: "H:SEQ" or "H:SEQ:K" (K KV heads) at FA2
    grid shapes (bf16, 16k tokens per batch, N = 2048 / H), causal and not. TFLOP/s count the
    plain (or causal) call's pairs, whatever the mask. One row per point and backward
    (kernel_time: also kernel_ms and each kernel's us), then a summary per point: the ratios,
    each form's largest dQ difference from the default's relative to dQ's largest magnitude,
    and whether two runs gave the same bits."""
    modes = ["default", *(m for m in modes if m != "default")]
    for point in points or FUSED_DQ_POINTS:
        h, seq, *kv = (int(x) for x in point.split(":"))
        b, n = 16384 // seq, 2048 // h
        kv_heads = kv[0] if kv else n
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [(b, seq, kv_heads if i in (1, 2) else n, h) for i in range(4)]
        args = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
        for causal in (False, True):
            mask, cudnn_mask = _fused_dq_masks(mask_spec, b, seq, causal)
            point_row = dict(H=h, seq=seq, K=kv_heads, causal=causal, mask=mask_spec)
            impls = {
                name: mosaic_attention(FUSED_DQ_TILES[name], scale=h**-0.5, is_causal=causal,
                                        **mask)
                for name in modes
            }  # fmt: skip
            if cudnn_mask is not None:
                impls["cudnn"] = functools.partial(
                    jax.nn.dot_product_attention, implementation="cudnn", is_causal=causal,
                    **cudnn_mask,
                )  # fmt: skip
            ms = {}
            flops = bench.attention_flops(b, seq, seq, n, h, causal, "fwd+bwd")
            for name, fn in impls.items():
                row = dict(point_row, impl=name)
                try:
                    ms[name] = bench.median_ms(bench.timed_fn(fn, "fwd+bwd"), args)
                except Exception as e:  # cuDNN refuses some masks: the row says so
                    if name != "cudnn":
                        raise
                    record(out, dict(row, error=str(e)[:200]))
                    continue
                row.update(ms=ms[name], tflops=flops / ms[name] / 1e9)
                if kernel_time:
                    kernel_ms, kernels = bench.device_ms(bench.timed_fn(fn, "fwd+bwd"), args)
                    row["kernel_ms"] = kernel_ms
                    row["kernels_us"] = {k: round(1e3 * t, 1) for k, t in kernels.items()}
                record(out, row)
            record(out, _fused_dq_summary(point_row, impls, modes, ms, args))


def _fused_dq_summary(point_row, impls, modes, ms, args):
    """fused_dq's summary row of one point: each form's speed over the default's and
    cuDNN's, its dQ's largest difference from the default's, and whether it repeats."""
    dq = {name: bench.timed_fn(impls[name], "fwd+bwd")(*args)[0] for name in modes}
    summary = dict(point_row, summary="fwd+bwd")
    reference = dq["default"].astype(jnp.float32)
    for name in modes[1:]:
        again = bench.timed_fn(impls[name], "fwd+bwd")(*args)[0]
        difference = jnp.max(jnp.abs(dq[name].astype(jnp.float32) - reference))
        summary[f"{name}_over_default"] = ms["default"] / ms[name]
        summary[f"{name}_over_cudnn"] = ms["cudnn"] / ms[name] if "cudnn" in ms else None
        summary[f"{name}_dq_relative_difference"] = float(difference / jnp.max(jnp.abs(reference)))
        summary[f"{name}_repeatable"] = bool(jnp.all(again == dq[name]))
    if "cudnn" in ms:
        summary["default_over_cudnn"] = ms["cudnn"] / ms["default"]
    return summary
