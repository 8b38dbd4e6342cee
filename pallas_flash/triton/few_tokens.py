"""flash_attention's forward of a few query tokens over a longer key sequence on the decode
kernel (`decode.decode_forward`): the dispatch's rule of which calls it runs
(`why_not_few_token_forward`), jax.nn's top-left geometry in the kernel's terms
(`few_token_geometry`), and the wrapper, which takes the arguments every backend's forward takes
(`few_token_forward`)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_flash import masks
from pallas_flash._numerics import log_sum_with_sinks
from pallas_flash.call import Call
from pallas_flash.device import DEFAULT_NUM_SMS
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.reference import with_sinks
from pallas_flash.triton.decode import decode_block_sizes, decode_forward


def why_not_few_token_forward(call: Call) -> str | None:
    """Why `few_token_forward` cannot run `call`'s forward exactly, or None. It takes the
    geometry (is_causal, a window), sequence lengths, a soft cap and sinks; not a bias, a dense
    mask, segment ids (which may give a row keys that are no prefix), dropout, or a value head
    dim of its own (the kernel reads K and V at one head dim)."""
    if call.has_bias:
        return "bias"
    if call.spec.mask_shape is not None:
        return "dense mask"
    if call.spec.has_segments and not call.lengths_only:
        return "segment ids"
    if call.dropout_rate:
        return "dropout"
    if call.value_head_dim is not None:
        return f"value head dim {call.value_head_dim} != head dim {call.head_dim}"
    return None


def few_token_geometry(spec: MaskSpec) -> tuple[int, int, int | None]:
    """flash_attention's geometry of T = spec.q_len query tokens over S = spec.kv_len keys
    (top-left: query i sees keys j <= i + right, and j >= i - left; `MaskSpec.right` is 0 for
    is_causal, S - 1 or more for no right side) in the decode kernel's terms: (keys, reach,
    window_left). Token t sits at position t + reach (reach: the right side, clipped to S - 1)
    and sees keys j <= t + reach, and with window_left (None: no token's left side cuts a key)
    j >= t + reach - window_left = t - left. No token sees a key at or past `keys` =
    min(S, T + reach)."""
    q_len, kv_len = spec.q_len, spec.kv_len
    reach = min(spec.right, kv_len - 1)
    window_left = None if spec.left >= q_len - 1 else spec.left + reach
    return min(kv_len, q_len + reach), reach, window_left


def few_token_forward(q, k, v, bias, arrays: MaskArrays, sinks, *, config, with_log_sum=False):
    """(out [B, T, N, H] in q's dtype, lse [B, N, T]), with with_log_sum also log_sum [B, N, T],
    of `flash_attention`'s forward on the decode kernel, as the flash forward returns them
    (`flash_forward`, which takes the same arguments): for calls `why_not_few_token_forward`
    lets through (no bias; their segment arrays, if any, hold sequence lengths only). config:
    the call's `KernelConfig` (read here: spec, scale, soft_cap, interpret, and the device's SM
    count, which sizes the split of the keys; device None: DEFAULT_NUM_SMS).

    The keys no token sees (past `few_token_geometry`'s `keys`) are cut off; batch entry b's
    keys up to its length L_b (its key length clipped to them) are the kernel's sequence, and
    its tokens sit `ahead` = T + reach - L_b positions past them (`decode_forward`), so that
    token t sees keys j <= t + reach below L_b: every key below L_b without a right side,
    j <= t under is_causal. Rows past their query length output 0 with lse -inf (the sink,
    with sinks); sinks: None or float32 [B, N], added after the kernel as the split-KV
    forward's merge adds them."""
    assert bias is None, "the dispatch routes no bias to the decode kernel"
    spec, scale, soft_cap, interpret = config.spec, config.scale, config.soft_cap, config.interpret
    num_sms = DEFAULT_NUM_SMS if config.device is None else config.device.num_sms
    batch, q_len = q.shape[:2]
    keys, reach, window_left = few_token_geometry(spec)
    if keys < k.shape[1]:  # a copy of the keys the kernel reads anyway
        k, v = k[:, :keys], v[:, :keys]
    rows = None
    if spec.has_segments:  # lengths folded into the ids as padding: each row sees a prefix
        in_length = arrays.kv_segment_ids[:, :keys] != masks.PAD_KV_SEGMENT
        lengths = jnp.sum(in_length, axis=1, dtype=jnp.int32)
        rows = arrays.q_segment_ids != masks.PAD_Q_SEGMENT  # [B, T]
    else:
        lengths = jnp.full((batch,), keys, jnp.int32)
    block_sizes = decode_block_sizes(
        q.shape,
        k.shape[2],
        keys,
        q.dtype,
        interpret=interpret,
        window_left=window_left,
        num_sms=num_sms,
    )
    out, lse, log_sum = decode_forward(
        q,
        k,
        v,
        lengths,
        scale=scale,
        soft_cap=soft_cap,
        window_left=window_left,
        block_sizes=block_sizes,
        interpret=interpret,
        num_sms=num_sms,
        with_log_sum=True,
        ahead=q_len + reach - lengths,
        # With sinks, out is scaled by the keys' share before its one rounding to q's dtype.
        out_dtype=None if sinks is None else jnp.float32,
    )
    if rows is not None:
        out = jnp.where(rows[:, :, None, None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(rows[:, None, :], lse, -jnp.inf)
        log_sum = jnp.where(rows[:, None, :], log_sum, 0.0)
    if sinks is not None:
        (out, lse), log_sum = (
            with_sinks(out, lse, sinks, log_sum),
            log_sum_with_sinks(lse, log_sum, sinks),
        )
        out = out.astype(q.dtype)
    return (out, lse, log_sum) if with_log_sum else (out, lse)
