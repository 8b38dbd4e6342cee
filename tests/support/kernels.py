"""The Mosaic GPU wrappers called with their options spelled out, as the kernel tests call them:
each builds the `MaskSpec`, `MaskArrays` and `KernelConfig` that `dispatch.choose` and
`api.flash_attention` would hand the wrapper (`mosaic.flash_forward(q, k, v, bias, arrays,
sinks, config=...)`, every backend's one shape). The wrappers check nothing: a test of what a
call may not do goes through the API."""

from __future__ import annotations

from pallas_flash import mosaic
from pallas_flash._passes import KernelConfig
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.triton import BlockSizes


def mosaic_config(
    q,
    k,
    *,
    kernel: str,
    scale,
    is_causal=False,
    window=None,
    soft_cap=None,
    segment_ids=None,
    dropout=None,
    tiles=None,
    device=None,
):
    """(MaskArrays, KernelConfig) of a call of the Mosaic `kernel` ("forward" or "backward"):
    segment_ids a (q ids, kv ids) pair or None, dropout (rate, seeds [B, N]) or None; tiles
    None: the kernel's defaults."""
    spec = MaskSpec(
        q_len=q.shape[1],
        kv_len=k.shape[1],
        is_causal=is_causal,
        window=None if window is None else (int(window[0]), int(window[1])),
        has_segments=segment_ids is not None,
    )
    ids = (None, None) if segment_ids is None else tuple(segment_ids)
    rate, seeds = (0.0, None) if dropout is None else dropout
    config = KernelConfig(
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        dropout_rate=rate,
        block_sizes=BlockSizes(),
        interpret=False,
        forward="mosaic",
        backward="mosaic",
        mosaic_forward_tiles=tiles if kernel == "forward" else None,
        mosaic_backward_tiles=tiles if kernel == "backward" else None,
        device=device,
    )
    return MaskArrays(*ids, dropout_seeds=seeds), config


def call_mosaic_forward(
    q,
    k,
    v,
    *,
    scale,
    is_causal=False,
    window=None,
    soft_cap=None,
    segment_ids=None,
    tiles=None,
    device=None,
    sinks=None,
    dropout=None,
    with_log_sum=False,
):
    """`mosaic.flash_forward` of these options: (out, lse), with with_log_sum also log_sum."""
    arrays, config = mosaic_config(
        q,
        k,
        scale=scale,
        is_causal=is_causal,
        window=window,
        soft_cap=soft_cap,
        segment_ids=segment_ids,
        dropout=dropout,
        kernel="forward",
        tiles=tiles,
        device=device,
    )
    return mosaic.flash_forward(
        q, k, v, None, arrays, sinks, config=config, with_log_sum=with_log_sum
    )


def call_mosaic_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    d_lse,
    *,
    scale,
    is_causal=False,
    window=None,
    soft_cap=None,
    segment_ids=None,
    tiles=None,
    device=None,
    dropout=None,
    log_sum=None,
):
    """(dq, dk, dv) of `mosaic.flash_backward` with these options (d_lse None: zero)."""
    arrays, config = mosaic_config(
        q,
        k,
        scale=scale,
        is_causal=is_causal,
        window=window,
        soft_cap=soft_cap,
        segment_ids=segment_ids,
        dropout=dropout,
        kernel="backward",
        tiles=tiles,
        device=device,
    )
    return mosaic.flash_backward(
        q, k, v, None, arrays, out, lse, log_sum, None, d_out, d_lse, config=config
    )[:3]
