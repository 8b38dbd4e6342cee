"""The public entry point: validate, canonicalise, ask the dispatch for the kernels. No kernels
here."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from pallas_flash import _dropout, _host_only, dispatch, masks
from pallas_flash import device as device_lib
from pallas_flash._numerics import accumulation_dtype, log_sum_with_sinks
from pallas_flash._vjp import (
    KernelConfig,
    flash_attention_kernels,
    flash_attention_kernels_with_log_sum,
    flash_backward_kernels,
    reference_attention_vjp,
)
from pallas_flash.call import Call
from pallas_flash.dispatch import BACKENDS
from pallas_flash.masks import MaskSpec
from pallas_flash.reference import reference_backward, with_sinks
from pallas_flash.triton import BlockSizes

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
MAX_HEAD_DIM = 256


def flash_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    dropout_broadcast: bool = False,
    return_residuals: bool = False,
    return_log_sum: bool = False,
    backend: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    deterministic_grads: bool = True,
):
    """Exact softmax attention, FlashAttention-2 style, called like `jax.nn.dot_product_attention`.

    Shapes (B batch, T queries, S keys, N query heads, K key/value heads, H head dim)::

        query: (B, T, N, H)  or (T, N, H)
        key:   (B, S, K, H)  or (S, K, H)
        value: (B, S, K, Hv) or (S, K, Hv)
        out:   (B, T, N, Hv) in query's dtype

    N must be a multiple of K: query head n reads key/value head n // (N // K). For example with
    N = 8 and K = 2 (GQA), heads 0-3 read kv head 0 and heads 4-7 read kv head 1; K = 1 is MQA.
    T and S are any lengths >= 1 (T != S allowed); H and Hv are multiples of 8 up to 256 (Hv is
    usually H; multi-head latent attention takes H = 192, Hv = 128). The forwards (Mosaic,
    Triton, "xla") and the Mosaic backward take Hv natively: P.V, dO.V^T, dV and the output
    cost Hv columns, not H; the Triton backward runs on q, k and v zero-padded to max(H, Hv).
    Dtypes are float16, bfloat16 or float32 (all three arrays the same), or float64 under
    jax_enable_x64 on backend="xla" (which backend=None picks for it) and in the interpreter.
    Softmax and accumulation run in float32 (float64 for float64 inputs).

    Args:
      query, key, value: the arrays above.
      bias: float array broadcastable to (B, N, T, S) (each dim full or 1; fewer dims are
        left-padded with 1), added to the scaled logits. Differentiable: its gradient has the
        bias's own shape, summed over broadcast dims. A finite bias is not a mask: a row whose
        keys all carry the same bias (-1e30, finfo.min) gets the softmax of those logits (the
        mean of value), as in float32 XLA; only mask, lengths, segment ids, window and
        is_causal hide keys. Rows whose logits all lie beyond about 2**24 keep an exact
        forward but their gradients lose precision (lse, one float32, cannot hold log(S)
        next to such a logit); they stay finite.
      mask: bool array broadcastable to (B, N, T, S), True = attend. Other dtypes raise
        ValueError (pass `mask.astype(bool)`).
      scale: multiplies the logits q.k; defaults to 1 / sqrt(H).
      is_causal: query i sees key j only when j <= i, top-left aligned as in jax.nn, also when
        T != S. With T = 3, S = 5 ("x" = visible)::

            key:    0 1 2 3 4
            q 0:    x . . . .
            q 1:    x x . . .
            q 2:    x x x . .

      query_seq_lengths: int array (B,), each in [0, T]: rows at positions >= the length see
        no key (they output 0 and get zero gradient).
      key_value_seq_lengths: int array (B,), each in [0, S]: keys at positions >= the length
        are masked. Concrete lengths outside their range raise ValueError; traced ones (under
        jit) are clamped to it, on every backend (docs/numerics.md, "Sequence lengths").
      q_segment_ids: int array (B, T); kv_segment_ids: int array (B, S). A query sees a key only
        when their ids are equal (packed documents). With only q_segment_ids and T == S, keys use
        the same ids. Ids must lie in [-2**31 + 2, 2**31 - 1] (int32; the two smallest int32
        values mark padding): numpy ids outside raise ValueError. Wider jax arrays (int64 under
        jax_enable_x64, also traced) are renumbered exactly (by rank, one sort per call); int32
        jax arrays are used as they are, so traced ids must keep off the two padding values.
      local_window_size: w or (left, right): query i sees keys j with i - left <= j <= i + right
        (w means (w, w)); combines with is_causal.
      logits_soft_cap: c > 0: logits <- c * tanh(logits / c), applied to scale * q.k + bias.
      sinks: float array (N,) or None: attention sinks, one learned logit per query head added
        to every row's softmax denominator (as gpt-oss does): out = sum_j e^{s_j} v_j /
        (e^{sink} + sum_j e^{s_j}). Differentiable. A row that sees no key still outputs 0, and
        its lse is its sink. Works on every backend and mask: the kernels add it to the
        softmax's denominator in their epilogue (split-KV forwards and the "xla" reference
        rescale out and lse afterwards).
      dropout_rate: attention dropout, as in FlashAttention-2: each probability P_ij is kept
        with probability 1 - dropout_rate and scaled by 1 / (1 - dropout_rate), else zeroed,
        before P.V. A float in [0, 1); 0 (the default) is no dropout. The keep-mask is a hash of
        (dropout_rng, batch entry, query head, query position, key position): bitwise the same
        for the same key on every backend and tiling, regenerated by the backward (nothing of
        size T x S is stored). The lse returned is that of the un-dropped softmax. Runs on
        every backend, on Hopper's Mosaic kernels wherever they run the call without it.
      dropout_rng: a jax PRNG key (`jax.random.key`, or a raw uint32[2] `PRNGKey`), required
        when dropout_rate > 0; with dropout_rate 0 it is checked and unused.
      dropout_broadcast: one keep-mask over (query, key) shared by every batch entry and head
        (Flax's `broadcast_dropout`); False (the default) draws one per batch entry and head.
      return_residuals: also return lse, float32 (B, N, T) (float64 for float64 inputs): the
        natural-log logsumexp of each query row's logits (scaled, biased, soft-capped, masked;
        the sink included). Gradients flow through both outputs.
      return_log_sum: with return_residuals, also return log_sum, lse's dtype (B, N, T): the
        natural log of each row's softmax denominator relative to its largest logit (or its
        sink, if larger), so that lse = max + log_sum; 0 for rows that see no key. It is what
        `flash_attention_backward(..., log_sum=)` needs beside lse for exact gradients where
        keys tie at a row's max at logits beyond about 1e6 in magnitude, where float32 lse
        cannot hold the denominator next to the max. No gradient flows through it (it is
        returned under stop_gradient).
      backend: "triton" (Pallas kernels lowered through Triton, NVIDIA GPUs of compute
        capability >= 8.0), "mosaic" (Hopper only: the warp-specialised Pallas Mosaic GPU
        forward, and the Mosaic GPU backward where it applies (H 64/80/96/128/192/256, the
        forward's masks and dropout, block_sizes not given), else the Triton
        backward; raises NotImplementedError for a call the forward does not support: bias,
        dense mask, float32, head dims other than 64/80/96/128/192/256, causal or windowed
        calls on CUDA runtimes 12.8.0-12.9.0, whose ptxas miscompiles the mask) or "xla" (plain
        jnp, materialises the logits). None picks, on a GPU of compute
        capability >= 8.0: for T <= 16 query tokens over 64 or more keys (bfloat16 or
        float16; causal, windows, lengths, soft cap and sinks, but no bias, dense mask,
        segment ids, dropout or Hv != H; block_sizes None) the forward of `decode_attention`'s
        kernel (flash-decoding) with the Triton backward; else on Hopper the Mosaic forward
        when it supports the call, its grid fills the GPU and block_sizes is None, with the
        Mosaic backward for the calls it supports (the forward's masks and dropout; at H=64
        from 2048 keys); else "triton"; with `interpret=True` the same decode forward or
        "triton"; "xla" elsewhere.
      block_sizes: tiles of the Triton kernels (`BlockSizes`); None takes the autotune cache's
        entry for this GPU and shape class (`python -m pallas_flash.tune`), else the shipped
        defaults by head dim and dtype. Given with backend=None, the forward runs on Triton
        with these tiles (ValueError where backend=None runs "xla", which has no tiles); with
        backend="mosaic" they configure the backward only, and the forward fields (block_q,
        block_kv, num_warps, num_stages, kv_splits) must keep their defaults
        (NotImplementedError otherwise).
      interpret: run the Triton kernels in the Pallas interpreter (any platform, slow): for
        tests on CPU.
      deterministic_grads: True (the default): the gradients are bitwise the same on every run
        (where the Hopper backward computes dQ in its dK/dV kernel, `dispatch.fixed_dq_is_faster`,
        it adds integer partials, whose sum does not depend on their order). False lets the Hopper
        backward compute dQ in its dK/dV kernel and add each block of keys' share into dQ as float32
        by TMA reductions in the order they arrive (as FlashAttention-2 and -3 do by default): the
        same values within float32 rounding, not bitwise repeatable, and faster where the dispatch
        takes it (`dispatch.fused_dq_is_faster`: plain or causal calls of 2k tokens or more at H
        64 and 128; with a window or segment ids at H=128 plain ones from 4k and causal ones
        from 16k, at H=64 from 16k). Other calls and kernels are deterministic either way.

    Returns:
      out, or (out, lse) when return_residuals, (out, lse, log_sum) with return_log_sum too.
      A query row that sees no key outputs zeros, has lse = -inf and receives zero gradient.
      NaN or inf in key or value at a key a row cannot see (masked, past its length, another
      segment, outside the window, in the future) does not reach that row's output, lse or
      gradients; a row that sees such a key gets NaN or, where the kernels zero the key on a
      partially masked tile, a finite value.

    Sharding: under `jax.jit` with the inputs sharded over their batch and/or head axes (by
    `in_shardings`/`NamedSharding`, or by explicit sharding in types), every device runs the
    kernels on its own batch entries and heads, forward and backward, with no collective on
    q, k, v, out or their gradients (a bias broadcast over a sharded axis sums its gradient over
    those shards). The heads split in contiguous blocks that keep each kv head with its query
    heads, so their shard count must divide K. Mask arrays follow the batch and heads. The
    kernels cannot split the sequence or head-dim axes: an input sharded over them raises
    ValueError (when compiling, under automatic sharding); for a sharded sequence use
    `pallas_flash.ring_attention`. Under `jax.vmap` the mapped axes stay partitioned, except
    with a bias or dense mask (those calls run unpartitioned, gathering their inputs).

    Differentiation, the same on every backend: reverse mode to any order (`jax.grad`,
    `jax.vjp`, `jax.jacrev`, grad of grad) and forward over reverse (`jax.hessian`); beyond first
    order the derivatives are those of the plain-jnp reference, which materialises the
    (B, N, T, S) logits. Forward mode on the attention itself raises on every backend: `jax.jvp`
    and `jax.jacfwd` a `ForwardModeError` (a NotImplementedError and a TypeError) naming the
    alternatives, `jax.linearize` JAX's TypeError for custom_vjp functions: use `jax.grad`,
    `jax.vjp` or `jax.jacrev`.
    The kernels are chosen for the GPU the call is compiled for: the visible one, or the target
    of `pallas_flash.target(device)` (a `pallas_flash.Device`, e.g. `Device.h200()`), under
    which `jax.export(..., platforms=["cuda"])` on a host without that GPU packages the kernels
    it runs. A call traced with backend=None on a host without a GPU and without a target runs
    "xla" and raises NotImplementedError when lowered for a GPU; pass backend="xla" to export
    the reference on purpose.
    """
    _refuse_forward_mode(query, key, value, bias)
    if not isinstance(return_log_sum, (bool, np.bool_)):
        raise TypeError(f"return_log_sum={return_log_sum!r} must be a bool")
    if return_log_sum and not return_residuals:
        raise ValueError(
            "return_log_sum=True adds log_sum to the residuals (out, lse): it needs "
            "return_residuals=True"
        )
    call = _plan(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        return_residuals=return_residuals,
        backend=backend,
        block_sizes=block_sizes,
        interpret=interpret,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        dropout_broadcast=dropout_broadcast,
        deterministic_grads=deterministic_grads,
    )
    _check_sinks(sinks, call.query.shape[2])
    if call.config is None:
        results = reference_attention_vjp(
            call.query, call.key, call.value, call.bias, call.arrays, call.spec, call.scale,
            call.soft_cap, call.dropout_rate,
        )  # fmt: skip
        if call.traced_for_host:
            results = tuple(_host_only.host_only(x) for x in results)
        out, lse, log_sum = results
        if sinks is not None:
            # Both from the keys' lse and log_sum, before either takes the sinks in.
            (out, lse), log_sum = (
                with_sinks(out, lse, sinks, log_sum),
                log_sum_with_sinks(lse, log_sum, sinks),
            )
    else:
        # The kernels add the sink to each row's denominator in their epilogue: one float32
        # logit per (batch entry, head), so that the sinks split over devices and vmapped axes
        # as the batch and heads do.
        sink_args = ()
        if sinks is not None:
            b, _, n, _ = call.query.shape
            dtype = accumulation_dtype(call.query.dtype)
            sink_args = (jnp.broadcast_to(jnp.asarray(sinks).astype(dtype), (b, n)),)
        kernels = (
            flash_attention_kernels_with_log_sum if return_log_sum else flash_attention_kernels
        )
        out, lse, *log_sum = kernels(
            call.query, call.key, call.value, call.bias, call.arrays, call.config, *sink_args
        )
        log_sum = log_sum[0] if log_sum else None
    if call.unbatched:
        out, lse, log_sum = out[0], lse[0], None if log_sum is None else log_sum[0]
    if not return_residuals:
        return out
    if return_log_sum:
        return out, lse, jax.lax.stop_gradient(log_sum)
    return out, lse


def flash_attention_backward(
    query,
    key,
    value,
    out,
    lse,
    d_out,
    d_lse=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    log_sum=None,
    backend: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
):
    """(dq, dk, dv) of `flash_attention` at the given residuals, without its forward.

    `out` (B, T, N, Hv) and `lse` (B, N, T) are what `flash_attention(..., return_residuals=True)`
    returns, `d_out` and `d_lse` (None: zeros) their cotangents; the other arguments are the
    call's. The gradients are computed as the kernels' backward does: P = exp(logits - lse) and
    dS = P (dO V^T - delta), delta = rowsum(dO * out) - d_lse. So `out` and `lse` may also be
    those of a larger softmax whose keys include this call's (a ring's blocks, merged through
    lse): the result is then this call's share of that softmax's gradients. Same backends and
    kernel choice as `flash_attention`; no bias, mask or sinks.

    log_sum: None, or (B, N, T) in lse's dtype (float32; float64 for float64 inputs): the
    forward's log softmax denominator relative to each row's max, from
    `flash_attention(..., return_residuals=True, return_log_sum=True)` (of the larger softmax,
    when out and lse are). Every backward clamps the recomputed P at 1 / exp(log_sum), so that
    keys tying at a row's max get exactly 1 / (number of ties) at any logit magnitude, as in
    the call's own gradients. Without it the clamp is P <= 1: exact for one dominant logit,
    approximate (finite) where the largest logits exceed about 1e6 in magnitude and tie.
    """
    _refuse_forward_mode(query, key, value, out, lse, d_out, d_lse, log_sum)
    call = _plan(
        query,
        key,
        value,
        None,
        None,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        return_residuals=True,
        backend=backend,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    batched = (lambda x: x[None]) if call.unbatched else (lambda x: x)
    q = call.query
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    out_shape = (*q.shape[:3], call.value.shape[-1])
    # Checked as passed (unbatched: without the batch axis), which the messages quote.
    given = slice(1, None) if call.unbatched else slice(None)
    for name, x, shape in (
        ("out", out, out_shape),
        ("d_out", d_out, out_shape),
        ("lse", lse, lse_shape),
        ("d_lse", d_lse, lse_shape),
    ):
        if x is not None and tuple(getattr(x, "shape", ())) != shape[given]:
            raise ValueError(f"{name}.shape={_shape_of(x)} must be {shape[given]} for this query")
    rows = accumulation_dtype(q.dtype)  # lse's dtype
    if log_sum is not None:
        _check_log_sum(log_sum, lse_shape[given], rows)
        log_sum = batched(log_sum)
    out, d_out, lse = batched(out), batched(d_out), batched(lse)
    d_lse = jnp.zeros(lse_shape, rows) if d_lse is None else batched(d_lse)
    lse, d_lse = lse.astype(rows), d_lse.astype(rows)
    args = (q, call.key, call.value, None, call.arrays, out.astype(q.dtype), lse)
    if call.config is None:
        dq, dk, dv, _ = reference_backward(
            *args,
            d_out,
            d_lse,
            spec=call.spec,
            scale=call.scale,
            soft_cap=call.soft_cap,
            log_sum=log_sum,
        )
    else:
        dq, dk, dv, _ = flash_backward_kernels(
            *args, d_out.astype(q.dtype), d_lse, call.config, log_sum=log_sum
        )
    grads = (dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype))
    return tuple(g[0] for g in grads) if call.unbatched else grads


class _Call(NamedTuple):
    """One validated call: canonical (batched) operands and mask arrays, and the static choice
    of kernels (config None: the "xla" reference)."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    arrays: masks.MaskArrays
    spec: MaskSpec
    scale: float
    soft_cap: float | None
    config: KernelConfig | None
    unbatched: bool
    traced_for_host: bool
    dropout_rate: float = 0.0


def _plan(
    query,
    key,
    value,
    bias,
    mask,
    *,
    scale,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    q_segment_ids,
    kv_segment_ids,
    local_window_size,
    logits_soft_cap,
    return_residuals,
    backend,
    block_sizes,
    interpret,
    dropout_rate=0.0,
    dropout_rng=None,
    dropout_broadcast=False,
    deterministic_grads=True,
) -> _Call:
    """Validates and canonicalises a call's arguments and chooses its kernels."""
    query, key, value, unbatched = _canonical_arrays(query, key, value)
    _check_options(scale, is_causal, return_residuals, backend, block_sizes, interpret)
    if not isinstance(deterministic_grads, bool):
        raise TypeError(f"deterministic_grads={deterministic_grads!r} must be a bool")
    dropout_rate = _canonical_dropout(dropout_rate, dropout_rng)
    if not isinstance(dropout_broadcast, bool):
        raise TypeError(f"dropout_broadcast={dropout_broadcast!r} must be a bool")
    batch, q_len, num_heads, head_dim = query.shape
    kv_len = key.shape[1]
    window = _canonical_window(local_window_size)
    soft_cap = _canonical_soft_cap(logits_soft_cap)
    bias = _canonical_pair_operand("bias", bias, query.shape, kv_len, unbatched)
    mask = _canonical_pair_operand("mask", mask, query.shape, kv_len, unbatched)
    q_segment_ids, kv_segment_ids = _canonical_segment_ids(
        q_segment_ids, kv_segment_ids, batch, q_len, kv_len, unbatched
    )
    for name, lengths, limit, axis in (
        ("query_seq_lengths", query_seq_lengths, q_len, "query.shape[1]"),
        ("key_value_seq_lengths", key_value_seq_lengths, kv_len, "key.shape[1]"),
    ):
        _check_lengths(name, lengths, batch, limit, f"{axis}={limit}", unbatched)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    arrays = masks.make_arrays(
        batch,
        q_len,
        kv_len,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        mask=mask,
    )
    if dropout_rate:
        arrays = arrays._replace(
            dropout_seeds=_dropout.head_seeds(
                dropout_rng, batch, query.shape[2], shared=bool(dropout_broadcast)
            )
        )
    spec = MaskSpec(
        q_len=q_len,
        kv_len=kv_len,
        is_causal=bool(is_causal),
        window=window,
        has_segments=arrays.q_segment_ids is not None,
        mask_shape=None if mask is None else tuple(mask.shape),
    )

    call = Call(
        q_shape=query.shape,
        k_shape=key.shape,
        dtype=query.dtype,
        spec=spec,
        soft_cap=soft_cap,
        has_bias=bias is not None,
        dropout_rate=dropout_rate,
        value_head_dim=value.shape[-1],
        deterministic_grads=deterministic_grads,
        lengths_only=q_segment_ids is None,
    )
    device = None if interpret or backend == "xla" else device_lib.target_device()
    config = dispatch.choose(
        call, device, scale=scale, backend=backend, block_sizes=block_sizes, interpret=interpret
    )
    # Without a GPU or a target, backend=None runs the reference: it must not be exported for a
    # GPU.
    traced_for_host = config is None and backend is None and device is None

    return _Call(
        query=query,
        key=key,
        value=value,
        bias=bias,
        arrays=arrays,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        config=config,
        unbatched=unbatched,
        traced_for_host=traced_for_host,
        dropout_rate=dropout_rate,
    )


class ForwardModeError(NotImplementedError, TypeError):
    """Forward-mode differentiation of flash_attention (`jax.jvp`, `jax.jacfwd`): its derivative
    is a custom VJP on every backend. Also a TypeError, which JAX raises for the same reason where
    this check cannot see it (`jax.linearize`)."""


def _refuse_forward_mode(*operands):
    """Raises before tracing when an operand carries a forward-mode tangent (a JVP tracer: reverse
    mode, grad of grad and `jax.hessian` trace with linearize tracers and pass)."""
    if any(isinstance(x, ad.JVPTracer) for x in operands):
        raise ForwardModeError(
            "flash_attention does not support forward-mode differentiation (jax.jvp, "
            "jax.jacfwd) on any backend: its derivative is a custom VJP. Use reverse mode: "
            "jax.grad, jax.vjp or jax.jacrev (jax.hessian and grad of grad work)"
        )


def _canonical_arrays(query, key, value):
    """Checks ranks, shapes and dtypes; adds a batch axis to rank-3 inputs."""
    arrays = {"query": query, "key": key, "value": value}
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    for name, x in arrays.items():
        for axis, dim in enumerate(x.shape):
            if not isinstance(dim, (int, np.integer)):
                raise NotImplementedError(
                    f"{name}.shape[{axis}]={dim} is symbolic ({name}.shape={x.shape}): "
                    "flash_attention sizes its kernels' grids and tiles from concrete shapes, so "
                    "shape polymorphism (jax.export with symbolic dims) is not supported; export "
                    "one function per shape"
                )
    ranks = {name: x.ndim for name, x in arrays.items()}
    if set(ranks.values()) - {3, 4} or len(set(ranks.values())) != 1:
        raise ValueError(
            "query, key and value must all have rank 4 [B, T|S, N|K, H] or all rank 3 "
            f"[T|S, N|K, H]; got query.shape={query.shape}, key.shape={key.shape}, "
            f"value.shape={value.shape}"
        )
    _check_dtypes(arrays)
    # The checks read the shapes as passed (rank 3 or 4), which the messages quote.
    unbatched = query.ndim == 3
    t, n, h = query.shape[-3:]
    s, kh, kd = key.shape[-3:]
    b, kb = (1, 1) if unbatched else (query.shape[0], key.shape[0])
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"key.shape={key.shape} and value.shape={value.shape} must agree on "
            f"{'[S, K]' if unbatched else '[B, S, K]'} (the value head dim may differ)"
        )
    hv = value.shape[-1]
    if hv % 8 or hv > MAX_HEAD_DIM:
        raise ValueError(
            f"value head_dim={hv} (value.shape={value.shape}) must be a multiple of 8 and at "
            f"most {MAX_HEAD_DIM}"
        )
    if kb != b:
        raise ValueError(f"batch sizes differ: query.shape={query.shape}, key.shape={key.shape}")
    if min(t, s, n, kh, b, h) < 1:
        raise ValueError(
            f"every dimension must be >= 1; got query.shape={query.shape}, key.shape={key.shape}"
        )
    _check_heads(query, key)
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    return query, key, value, unbatched


def _check_heads(query, key, names=("query", "key")):
    """The head rules of every entry point, on arrays [..., N|K, H] of at least one head:
    key's head dim is query's, N a multiple of K, H a multiple of 8 up to MAX_HEAD_DIM. The
    messages quote the shapes as passed, under `names`."""
    (n, h), (kh, kd) = query.shape[-2:], key.shape[-2:]
    q_name, k_name = names
    if kd != h:
        raise ValueError(
            f"head dims differ: {q_name}.shape={query.shape} has H={h}, "
            f"{k_name}.shape={key.shape} has H={kd}"
        )
    if n % kh:
        raise ValueError(
            f"num_heads={n} ({q_name}.shape={query.shape}) must be divisible by "
            f"num_kv_heads={kh} ({k_name}.shape={key.shape})"
        )
    if h % 8 or h > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={h} ({q_name}.shape={query.shape}) must be a multiple of 8 and at most "
            f"{MAX_HEAD_DIM}"
        )


def _check_dtypes(arrays: dict):
    """The dtypes of query, key and value ({name: array}, in that order; decode names its
    caches): one float dtype, float64 only where jax computes in it (jax_enable_x64)."""
    for name, x in arrays.items():
        if not any(x.dtype == d for d in _FLOAT_DTYPES):
            raise TypeError(f"{name}.dtype={x.dtype} must be float16, bfloat16, float32 or float64")
    if len({x.dtype for x in arrays.values()}) > 1:
        *first, last = arrays
        names = f"{', '.join(first)} and {last}"
        got = ", ".join(f"{name}.dtype={x.dtype}" for name, x in arrays.items())
        raise TypeError(f"{names} must share a dtype; got {got}")
    name, x = next(iter(arrays.items()))
    if x.dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise TypeError(
            f"{name}.dtype=float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', "
            "True), or within `with jax.enable_x64(True):`): without it jax computes in float32"
        )


def _check_options(scale, is_causal, return_residuals, backend, block_sizes, interpret):
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"scale={scale!r} must be a Python float or None")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale!r} must be a finite positive number")
    for name, flag in (("is_causal", is_causal), ("return_residuals", return_residuals)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}={flag!r} must be a bool")
    if interpret is not None and not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret={interpret!r} must be a bool or None")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS} or None")
    if backend == "xla" and interpret:
        raise ValueError(
            "interpret=True runs the Triton kernels in the Pallas interpreter, but backend='xla' "
            "runs no kernel (plain jnp): drop interpret, or pass backend='triton'"
        )
    if backend == "mosaic" and interpret:
        raise ValueError(
            "interpret=True runs the Triton kernels in the Pallas interpreter; backend='mosaic' "
            "has no interpreted mode here: pass backend='triton' (or None) with interpret=True"
        )
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            "block_sizes must be a pallas_flash.BlockSizes or None, "
            f"got {type(block_sizes).__name__}"
        )
    if block_sizes is not None and backend == "xla":
        raise ValueError("block_sizes configures the Triton kernels: it needs backend='triton'")


def attention_reference(query, key, value, bias=None, mask=None, **kwargs):
    """`flash_attention` computed by plain jnp (materialised logits, f32 softmax).

    Same arguments (except backend, block_sizes, interpret), semantics and validation as
    `flash_attention`; it is the "xla" backend.
    """
    for name in ("backend", "block_sizes", "interpret"):
        if name in kwargs:
            raise TypeError(f"attention_reference() got an unexpected keyword argument {name!r}")
    return flash_attention(query, key, value, bias, mask, backend="xla", **kwargs)


def _is_int_array(x):
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)


def _canonical_window(window):
    if window is None:
        return None
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        window = (int(window), int(window))
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(
            f"local_window_size={window!r} must be an int or a (left, right) pair of ints"
        )
    if min(window) < 0:
        raise ValueError(f"local_window_size={window!r} must be >= 0")
    return int(window[0]), int(window[1])


def _canonical_soft_cap(cap):
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating, np.integer)):
        raise TypeError(f"logits_soft_cap={cap!r} must be a Python float or None")
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"logits_soft_cap={cap!r} must be a finite positive number")
    return float(cap)


def _canonical_pair_operand(name, x, q_shape, kv_len, unbatched):
    """bias/mask as 4-D [B|1, N|1, T|1, S|1]; checks dtype and broadcastability."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if name == "mask" and x.dtype != jnp.bool_:
        raise ValueError(
            f"mask.dtype={x.dtype} must be bool (True = attend); pass mask.astype(bool)"
        )
    if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"bias.dtype={x.dtype} must be a floating dtype")
    batch, q_len, num_heads, _ = q_shape
    full = (batch, num_heads, q_len, kv_len)
    rank = 3 if unbatched else 4
    if x.ndim > rank:
        raise ValueError(
            f"{name}.shape={tuple(x.shape)} has more than {rank} dims: it must be "
            f"broadcastable to {full[4 - rank :]}"
        )
    padded = (1,) * (4 - x.ndim) + tuple(x.shape)
    for have, want in zip(padded, full):
        if have not in (1, want):
            raise ValueError(
                f"{name}.shape={tuple(x.shape)} must be broadcastable to {full[4 - rank :]} "
                "(each dim full or 1, missing leading dims taken as 1)"
            )
    return jnp.reshape(x, padded)


def _canonical_segment_ids(q_ids, kv_ids, batch, q_len, kv_len, unbatched):
    q_ids, kv_ids = masks.pair_segment_ids(q_ids, kv_ids, q_len, kv_len)
    if q_ids is None:
        return None, None
    out = []
    for name, ids, length in (("q_segment_ids", q_ids, q_len), ("kv_segment_ids", kv_ids, kv_len)):
        if not _is_int_array(ids):
            got = getattr(ids, "dtype", type(ids).__name__)
            raise TypeError(f"{name} must be an integer array, got {got}")
        want = (length,) if unbatched else (batch, length)
        if tuple(ids.shape) != want:
            raise ValueError(f"{name}.shape={tuple(ids.shape)} must be {want}")
        ids = _checked_host_ids(name, ids)
        out.append(ids[None] if unbatched else ids)
    return tuple(out)


def _checked_host_ids(name, ids):
    """Host (numpy) segment ids: checked against the int32 range the kernels compare in, above
    the two padding ids, and returned as int32. Device arrays are not read back (that would
    wait for the device): int32 ones are taken as they are, wider ones (jax_enable_x64) are
    remapped exactly by masks.make_arrays."""
    if not isinstance(ids, np.ndarray):
        return ids
    lo, hi = masks.PAD_KV_SEGMENT + 1, np.iinfo(np.int32).max
    if ids.size and (int(ids.min()) < lo or int(ids.max()) > hi):
        raise ValueError(
            f"{name} ({ids.dtype}, shape {ids.shape}) holds ids in [{int(ids.min())}, "
            f"{int(ids.max())}]: ids must lie in [{lo}, {hi}] (int32, the two smallest values "
            "mark padding); renumber them, e.g. with np.unique(ids, return_inverse=True)"
        )
    return ids.astype(np.int32)


def _canonical_dropout(rate, rng) -> float:
    """The dropout rate as a Python float, after checking it and the key."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating, np.integer)):
        raise TypeError(f"dropout_rate={rate!r} must be a Python float")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate={rate!r} must lie in [0, 1)")
    if rng is None:
        if rate:
            raise ValueError(
                f"dropout_rate={rate} needs dropout_rng, a jax PRNG key (jax.random.key(seed))"
            )
        return rate
    if not hasattr(rng, "shape") or not hasattr(rng, "dtype"):
        raise TypeError(f"dropout_rng must be a jax PRNG key, got {type(rng).__name__}")
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(
                f"dropout_rng.shape={rng.shape} must be (): one key (split keys per call)"
            )
    elif rng.dtype != jnp.uint32 or tuple(rng.shape) != (2,):
        raise ValueError(
            f"dropout_rng (dtype {rng.dtype}, shape {tuple(rng.shape)}) must be a typed PRNG key "
            "of shape () or a raw uint32[2] key (jax.random.PRNGKey)"
        )
    return rate


def _check_log_sum(log_sum, shape, dtype):
    """log_sum of flash_attention_backward: lse's dtype (float32, float64 for float64 calls)
    and shape."""
    dtype = jnp.dtype(dtype)
    if not hasattr(log_sum, "shape") or not hasattr(log_sum, "dtype"):
        raise TypeError(
            f"log_sum must be a {dtype} array of shape {shape} (flash_attention's with "
            f"return_log_sum=True) or None, got {type(log_sum).__name__}"
        )
    if log_sum.dtype != dtype:
        raise TypeError(
            f"log_sum.dtype={log_sum.dtype} must be {dtype} (flash_attention's log_sum, as it "
            "returns it)"
        )
    if tuple(log_sum.shape) != tuple(shape):
        raise ValueError(
            f"log_sum.shape={tuple(log_sum.shape)} must be {tuple(shape)}, the shape of lse, "
            "for this query"
        )


def _shape_of(x):
    """x's shape as a tuple, or its type's name where it has none."""
    return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


def _check_sinks(sinks, num_heads):
    if sinks is None:
        return
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise TypeError(
            f"sinks must be an array of shape ({num_heads},), got {type(sinks).__name__}"
        )
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks.dtype={sinks.dtype} must be a floating dtype")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"sinks.shape={tuple(sinks.shape)} must be ({num_heads},): one logit per query head"
        )


def _check_int_vector(name, x, batch):
    """x must be an integer array of shape (batch,)."""
    if not _is_int_array(x):
        got = getattr(x, "dtype", type(x).__name__)
        raise TypeError(f"{name} must be an integer array, got {got}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be ({batch},)")


def _concrete(x):
    """x as a numpy array, or None when it is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_lengths(name, lengths, batch, limit: int, limit_text: str, unbatched=False):
    """Sequence lengths, the one rule of every entry point (docs/numerics.md, "Sequence
    lengths"): an integer array (B,) whose values, when concrete (not traced), lie in
    [0, limit]; limit_text says where limit comes from ("key.shape[1]=16"). Traced lengths are
    not read: outside [0, limit] they act as clamped to it, on every path."""
    if lengths is None:
        return
    if unbatched:
        raise ValueError(f"{name} needs batched inputs (rank 4)")
    _check_int_vector(name, lengths, batch)
    values = _concrete(lengths)
    if values is None:
        return
    bad = (values < 0) | (values > limit)
    if bad.any():
        quoted = f"{name}={values.tolist()}"
        if values.size > 8:
            i = int(np.argmax(bad))
            quoted = f"{name}[{i}]={int(values[i])}"
        raise ValueError(
            f"{quoted} must lie in [0, {limit_text}] (traced lengths outside are clamped to it)"
        )
