"""Calling an attention function with its VJP in one jitted call, outputs and gradients
together: the kernels (`flash_fn`), the plain baseline (`plain_fn`) and the float64 oracle of a
`Problem`."""

from __future__ import annotations

import functools

import jax

import pallas_flash
from support.backends import kernel_kwargs
from support.inputs import Problem
from support.oracle import attention_f64, attention_grads_f64, attention_in_dtype

MASK_ARGUMENTS = ("mask", "q_lens", "kv_lens", "q_seg", "kv_seg")
MASKED_OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def masked_outputs_and_grads(attention, xs, **kwargs) -> dict:
    """out, lse, dq, dk, dv, dbias of one jitted call of `attention` (flash_attention or
    attention_reference) and its VJP. xs: q, k, v, bias, d_out, d_lse and the mask arguments
    (MASK_ARGUMENTS: dense mask, lengths, segment ids; None where absent), and optionally sinks
    (then dsinks too); kwargs: the rest."""

    def f(q, k, v, bias, sinks, d_out, d_lse, extra):
        def call(q, k, v, bias, sinks):
            return attention(
                q,
                k,
                v,
                bias,
                extra["mask"],
                query_seq_lengths=extra["q_lens"],
                key_value_seq_lengths=extra["kv_lens"],
                q_segment_ids=extra["q_seg"],
                kv_segment_ids=extra["kv_seg"],
                sinks=sinks,
                return_residuals=True,
                **kwargs,
            )

        (out, lse), vjp = jax.vjp(call, q, k, v, bias, sinks)
        *grads, dsinks = vjp((d_out, d_lse))
        results = dict(zip(MASKED_OUTPUT_NAMES, (out, lse, *grads), strict=True))
        return results if sinks is None else results | {"dsinks": dsinks}

    extra = {name: xs[name] for name in MASK_ARGUMENTS}
    args = [xs[name] for name in ("q", "k", "v", "bias")]
    return jax.jit(f)(*args, xs.get("sinks"), xs["d_out"], xs["d_lse"], extra)


def outputs_and_grads(attn, q, k, v, d_out, d_lse):
    """(out, lse, dq, dk, dv) of `attn(q, k, v) -> (out, lse)` for the given cotangents."""
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return (out, lse, *vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype))))


def vmapped_outputs_and_grads(attn, args, num_slices: int):
    """`outputs_and_grads` under jax.vmap over `num_slices` slices of the batch of `args`
    (q, k, v, d_out, d_lse), with the results put back as one batch (to compare with the
    oracle of the whole batch)."""
    split = [x.reshape(num_slices, -1, *x.shape[1:]) for x in args]
    mapped = jax.jit(jax.vmap(functools.partial(outputs_and_grads, attn)))(*split)
    return [x.reshape(-1, *x.shape[2:]) for x in mapped]


def flash_fn(p: Problem, mode: str, **overrides):
    """q, k, v -> (out, lse) through `pallas_flash.flash_attention` for problem `p`."""
    kwargs = dict(
        is_causal=p.is_causal,
        return_residuals=True,
        block_sizes=p.block_sizes,
        **kernel_kwargs(mode),
    )
    kwargs.update(overrides)
    return functools.partial(pallas_flash.flash_attention, **kwargs)


def plain_fn(p: Problem):
    return functools.partial(attention_in_dtype, scale=p.scale, is_causal=p.is_causal)


def oracle_outputs_and_grads(p: Problem, q, k, v, d_out, d_lse):
    """(out, lse, dq, dk, dv) in float64 for problem `p` (arguments as float64 arrays)."""
    out, lse = attention_f64(q, k, v, scale=p.scale, is_causal=p.is_causal)
    grads = attention_grads_f64(q, k, v, d_out, d_lse, scale=p.scale, is_causal=p.is_causal)
    return (out, lse, *grads)
