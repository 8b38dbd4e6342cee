"""What `pallas_flash.linen` and `pallas_flash.nnx` share: turning Flax's attention call into a
`flash_attention` call.

Flax hands an `attention_fn` arrays of shape `[batch..., length, heads, features]` (any number of
batch dims, including none), masks that may be float and that broadcast to
`[batch..., heads, q_length, kv_length]`, attention dropout, and weight-sowing requests that the
kernels cannot serve. This module

* flattens the batch dims into the one batch dim of the kernels (and back);
* turns masks into the boolean masks of the kernels' mask path (nonzero = attend, as Flax's
  `jnp.where(mask, ...)` reads them);
* runs active dropout in the kernels (their keep-mask, drawn from Flax's dropout rng);
* routes a call that must sow its attention weights to Flax's own attention (warning once per
  process);
* binds the options of the pallas_flash modules (`is_causal`, segment ids, backend, ...) into
  their `attention_fn` for one call;
* runs the modules' decode steps through `decode_attention` over the cache's filled slots
  (`kv_cache_length`) instead of a mask over the whole cache.

The drop-in functions' docstrings share their common paragraphs from here (`document`). It
imports no Flax: each wrapper passes in the Flax functions its fallback and dtype promotion
call. Nothing here is public API; `FallbackWarning` is re-exported by both wrappers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp

from pallas_flash import masks
from pallas_flash.api import flash_attention
from pallas_flash.decode import decode_attention


class FallbackWarning(UserWarning):
    """A call ran Flax's own attention instead of the pallas_flash kernels.

    Emitted once per process and reason: for sowing the attention weights (the kernels never
    materialise them).
    """


# Reasons already warned about in this process (warning at every trace of a training step
# would flood the log; one warning says what the user needs to know).
_warned: set[str] = set()


def _warn_once(reason: str, message: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    # stacklevel: _warn_once <- attention <- the Flax module or the user's call.
    warnings.warn(message, FallbackWarning, stacklevel=4)


_FALLBACK_MESSAGES = {
    "module": (
        "pallas_flash: sowing the attention weights (sow_weights=True / module=...) needs the "
        "materialised weights; such calls run Flax's own dot_product_attention. "
        "(Warned once per process.)"
    ),
}


def check_precision(precision) -> None:
    """Accepts what the kernels honour: None, a `jax.lax.Precision`, its name, or a pair of them.

    The kernels compute q.k and p.v with float32 accumulation, and float32 inputs at full
    float32 precision (`Precision.HIGHEST`); any such request is met or exceeded, so it does
    not change the computation. Explicit dot algorithms (`jax.lax.DotAlgorithmPreset`, ...)
    ask for a specific algorithm, which the kernels do not offer.
    """
    if precision is None:
        return
    items = precision if isinstance(precision, (tuple, list)) else (precision,)
    if isinstance(precision, (tuple, list)) and len(precision) != 2:
        raise ValueError(f"precision={precision!r}: a tuple must have two entries")
    for p in items:
        if p is None or isinstance(p, jax.lax.Precision):
            continue
        if isinstance(p, str):
            jax.lax.Precision(p)  # ValueError for a name that is not a precision
            continue
        raise NotImplementedError(
            f"precision={precision!r} is not supported by pallas_flash: pass None, a "
            "jax.lax.Precision or its name (the kernels accumulate in float32 and compute "
            "float32 inputs at full precision, which meets any such request)"
        )


def check_dropout(dropout_rate, deterministic, dropout_rng) -> bool:
    """Whether the call has active dropout; validates its arguments like Flax does."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate!r} must be in the range [0, 1)")
    active = dropout_rate > 0.0 and not deterministic
    if active and dropout_rng is None:
        raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False")
    return active


# The modules' options whose default is neither None nor False.
OPTION_DEFAULTS = {"deterministic_grads": True}


def bind_options(attention_fn, **options):
    """`attention_fn` with the non-default `options` bound as keywords.

    Options at their default (None or False, or OPTION_DEFAULTS') are left out, so that a
    user's attention_fn that does not know them still works when they are not used. One that
    is used but not accepted raises instead of being dropped.
    """

    def at_default(name, value):
        if name in OPTION_DEFAULTS:
            return value is None or value == OPTION_DEFAULTS[name]
        return value is None or value is False

    options = {k: v for k, v in options.items() if not at_default(k, v)}
    if not options:
        return attention_fn
    params = inspect.signature(attention_fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        missing = [k for k in options if k not in params]
        if missing:
            raise TypeError(
                f"attention_fn={attention_fn!r} does not accept the keyword(s) {missing}, "
                "which this module was given; use pallas_flash's dot_product_attention (or a "
                "functools.partial of it)"
            )
    return functools.partial(attention_fn, **options)


def accepts_keyword(fn, name: str) -> bool:
    """Whether `fn` (a function or a functools.partial of one) takes the keyword `name`."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def bind_module_options(module, *, cache_index, mask, **call_options):
    """`module.attention_fn` with the module's options and this call's bound (`bind_options`).

    `module` is a pallas_flash attention module: its `backend`, `interpret`, `block_sizes` and
    `deterministic_grads` are bound with `call_options` (the call's segment ids, ...). In a
    decode step (`cache_index` not None: the slot Flax writes this step's token to) without a
    mask of the caller's, `kv_cache_length` is bound too when the function takes it, so that
    the step reads the cache's filled slots only.
    """
    attention_fn = module.attention_fn
    kv_cache_length = None
    decode_step = cache_index is not None and mask is None
    if decode_step and accepts_keyword(attention_fn, "kv_cache_length"):
        # Flax writes this step's token at cache_index, then masks the slots past it.
        kv_cache_length = cache_index + 1
    return bind_options(
        attention_fn,
        backend=module.backend,
        interpret=module.interpret,
        block_sizes=module.block_sizes,
        deterministic_grads=module.deterministic_grads,
        kv_cache_length=kv_cache_length,
        **call_options,
    )


@contextlib.contextmanager
def attention_fn_swapped(module, attention_fn):
    """Sets `module.attention_fn` for the duration of the block, restored even on errors.

    Flax's `__call__` reads `self.attention_fn`. linen modules are frozen, and an nnx module's
    static structure (which nnx.jit compares) must be the same after the call, so the field is
    set past the modules' `__setattr__` for the call only. That is invisible elsewhere:
    linen's `apply()` binds a clone of the module for the call.
    """
    original = module.attention_fn
    object.__setattr__(module, "attention_fn", attention_fn)
    try:
        yield
    finally:
        object.__setattr__(module, "attention_fn", original)


# What the two drop-in functions' docstrings share, filled in by `document`.
_DOCS = {
    "shapes": """\
Shapes: query `[batch..., T, N, H]`, key/value `[batch..., S, K, H]` (no batch dims, or
several, are fine), N a multiple of K (GQA: query head n reads kv head n // (N // K)); the
output is `[batch..., T, N, H]` in the promoted dtype.""",
    "flax_arguments": """\
bias: float, broadcastable to `[batch..., N, T, S]`, added to the scaled logits.
mask: broadcastable to `[batch..., N, T, S]`, bool or float (any nonzero value attends,
  as in Flax); it goes to the kernels' mask path. Includes the masks of decode steps.
broadcast_dropout, dropout_rng, dropout_rate, deterministic: Flax's attention dropout.
  Active dropout (`dropout_rate > 0` and not `deterministic`) runs in the kernels
  (`flash_attention`'s dropout_rate and dropout_rng): the same rate, a different mask
  sample than Flax's (a hash of dropout_rng and the positions); `broadcast_dropout`
  shares one mask over (query, key) among every batch entry and head, as in Flax.
dtype: the computation dtype; None infers it from the inputs.
precision: accepted and met: the kernels accumulate in float32 and compute float32 inputs
  at full precision. An explicit dot algorithm raises NotImplementedError.""",
    "options": """\
q_segment_ids, kv_segment_ids: int `[batch..., T]`, `[batch..., S]`: queries see keys of
  the same id only (packed documents). kv ids default to the query ids when T == S.
backend, interpret, block_sizes, deterministic_grads: as in
  `pallas_flash.flash_attention` (False: faster gradients on Hopper, not bitwise
  repeatable).
kv_cache_length: set by the pallas_flash attention module in decode steps (you need not):
  int scalar, the filled slots of the KV cache that key/value are, the step's token
  included. The call then runs `pallas_flash.decode_attention` over those slots only, and
  `mask` must be Flax's cache-occupancy mask, which it replaces.
sinks: None, or float `[N]`: attention sinks, one learned logit per query head in each
  row's softmax denominator (see `pallas_flash.flash_attention`); the modules pass their
  `sinks` parameter when built with `attention_sinks=True`. Not with a fallback to Flax's
  attention (sown weights): NotImplementedError.""",
    "returns": """\
`[batch..., T, N, H]`. A query row that sees no key outputs zeros (Flax's own attention
outputs the mean of all values there).""",
}


def document(fn):
    """Fills the placeholders of `fn`'s docstring: a line that holds only `{name}` becomes the
    text `_DOCS[name]`, indented as the placeholder is. What linen's and nnx's drop-in
    functions share is so written once."""
    lines = []
    for line in fn.__doc__.splitlines():
        name = line.strip()
        if name.startswith("{") and name.endswith("}"):
            indent = line[: len(line) - len(line.lstrip())]
            lines += [indent + text if text else text for text in _DOCS[name[1:-1]].splitlines()]
        else:
            lines.append(line)
    fn.__doc__ = "\n".join(lines)
    return fn


def _check_qkv(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or x.ndim < 3:
            raise ValueError(
                f"{name} must be an array of shape [batch..., length, heads, features], got "
                f"{getattr(x, 'shape', type(x).__name__)}"
            )
    if not (query.ndim == key.ndim == value.ndim):
        raise ValueError(
            f"query, key and value must have the same rank; got query.shape={query.shape}, "
            f"key.shape={key.shape}, value.shape={value.shape}"
        )
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise ValueError(
            f"batch dims must match; got query.shape={query.shape}, key.shape={key.shape}, "
            f"value.shape={value.shape}"
        )


def _flatten_pair_operand(name, x, batch_shape, pair_shape):
    """A mask/bias broadcastable to [batch..., N, T, S] (pair_shape: (N, T, S)) as
    [B|1, N|1, T|1, S|1] (B = prod); checked here, where the user's shape is known."""
    if x is None:
        return None
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    rank = len(batch_shape) + 3
    full = (*batch_shape, *pair_shape)
    if x.ndim > rank:
        raise ValueError(
            f"{name}.shape={x.shape} has more dims than [batch..., heads, q_length, kv_length] "
            f"= {full}"
        )
    given = x.shape
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
    if any(d not in (1, want) for d, want in zip(x.shape, full)):
        raise ValueError(
            f"{name}.shape={given} must be broadcastable to [batch..., heads, q_length, "
            f"kv_length] = {full} (each dim full or 1, missing leading dims taken as 1)"
        )
    lead, tail = x.shape[: len(batch_shape)], x.shape[len(batch_shape) :]
    if all(d == 1 for d in lead):
        return jnp.reshape(x, (1, *tail))
    # Mixed batch dims (some 1, some full) must be materialised to merge into one dim.
    x = jnp.broadcast_to(x, (*batch_shape, *tail))
    return jnp.reshape(x, (math.prod(batch_shape), *tail))


def _flatten_segment_ids(name, ids, batch_shape, length):
    if ids is None:
        return None
    want = (*batch_shape, length)
    if tuple(getattr(ids, "shape", ())) != want:
        raise ValueError(
            f"{name}.shape={getattr(ids, 'shape', None)} must be [batch..., length] = {want}"
        )
    return jnp.reshape(ids, (math.prod(batch_shape), length))


def attention(
    query,
    key,
    value,
    bias,
    mask,
    *,
    flax_attention,
    promote,
    broadcast_dropout,
    dropout_rng,
    dropout_rate,
    deterministic,
    dtype,
    precision,
    module,
    is_causal,
    q_segment_ids,
    kv_segment_ids,
    backend,
    interpret,
    block_sizes,
    kv_cache_length,
    sinks,
    deterministic_grads,
):
    """The body of both drop-in functions: their arguments, with the framework's parts passed in.

    Args:
      query, key, value: `[batch..., T|S, N|K, H]`.
      bias, mask: broadcastable to `[batch..., N, T, S]`; mask of any dtype, nonzero = attend.
      flax_attention: `f(query, key, value, bias, mask, **flax_arguments) -> out`, the
        framework's own attention with its own extra arguments bound, taking GQA heads and a
        bool mask of rank `query.ndim`; called only for a fallback.
      promote: `f((query, key, value), dtype=dtype) -> (query, key, value)`, the framework's
        dtype promotion.
      broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision, module:
        Flax's arguments (`flax_arguments` above), checked here. Active dropout runs in the kernels;
        a decode step with active dropout runs `flash_attention` with the cache mask. A
        `module` to sow the attention weights into runs `flax_attention` (warning once).
      is_causal, q_segment_ids, kv_segment_ids, backend, interpret, block_sizes,
        deterministic_grads: as in `flash_attention` (segment ids with the batch dims:
        `[batch..., T]`, `[batch..., S]`; decode steps' gradients are deterministic either
        way).
      kv_cache_length: None, or (in a decode step of the modules) the int count of filled
        cache slots, the step's tokens included: key/value are the whole cache, the queries
        are its last tokens, and `mask` is Flax's cache-occupancy mask (`arange(S) < length`),
        which `decode_attention` replaces by reading the filled slots only.
      sinks: None, or float `[N]`: attention sinks (see `flash_attention`).

    Returns:
      `[batch..., T, N, H]`. Query rows that see no key output zeros on both paths (Flax's own
      attention would average all values there).
    """
    check_precision(precision)
    dropout = check_dropout(dropout_rate, deterministic, dropout_rng)
    query, key, value = promote((query, key, value), dtype=dtype)
    _check_qkv(query, key, value)
    batch_shape = tuple(query.shape[:-3])
    batch = math.prod(batch_shape)
    q_len, kv_len = query.shape[-3], key.shape[-3]
    pair_shape = (query.shape[-2], q_len, kv_len)
    mask4 = _flatten_pair_operand("mask", mask, batch_shape, pair_shape)
    if mask4 is not None and mask4.dtype != jnp.bool_:
        # Flax applies masks as jnp.where(mask, logits, big_neg): any nonzero value attends.
        mask4 = mask4 != 0
    q_ids = _flatten_segment_ids("q_segment_ids", q_segment_ids, batch_shape, q_len)
    kv_ids = _flatten_segment_ids("kv_segment_ids", kv_segment_ids, batch_shape, kv_len)
    q_ids, kv_ids = masks.pair_segment_ids(q_ids, kv_ids, q_len, kv_len)

    if module is not None:
        if sinks is not None:
            raise NotImplementedError(
                "sinks with sown attention weights (sow_weights=True / module=...): such "
                "calls run Flax's own attention, which has no sinks"
            )
        _warn_once("module", _FALLBACK_MESSAGES["module"])
        flax_call = functools.partial(
            flax_attention,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
        )
        return _fallback(
            flax_call, query, key, value, bias, mask4, is_causal, q_ids, kv_ids, batch_shape
        )

    def flat(x):
        return jnp.reshape(x, (batch, *x.shape[-3:]))

    if (
        kv_cache_length is not None
        and bias is None
        and not is_causal
        and q_ids is None
        and not dropout
    ):
        lengths = jnp.minimum(jnp.asarray(kv_cache_length, jnp.int32), kv_len)
        out = decode_attention(
            flat(query),
            flat(key),
            flat(value),
            key_value_seq_lengths=jnp.broadcast_to(lengths, (batch,)),
            sinks=sinks,
            backend=backend,
            interpret=interpret,
        )
        return jnp.reshape(out, query.shape[:-1] + value.shape[-1:])

    out = flash_attention(
        flat(query),
        flat(key),
        flat(value),
        _flatten_pair_operand("bias", bias, batch_shape, pair_shape),
        mask4,
        is_causal=is_causal,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        sinks=sinks,
        dropout_rate=dropout_rate if dropout else 0.0,
        dropout_rng=dropout_rng if dropout else None,
        dropout_broadcast=bool(broadcast_dropout),
        backend=backend,
        interpret=interpret,
        block_sizes=block_sizes,
        deterministic_grads=deterministic_grads,
    )
    return jnp.reshape(out, query.shape[:-1] + value.shape[-1:])


def _fallback(flax_attention, query, key, value, bias, mask4, is_causal, q_ids, kv_ids, shape):
    """Flax's own attention with every mask argument folded into one dense bool mask."""
    q_len, kv_len = query.shape[-3], key.shape[-3]
    dense = mask4
    if is_causal:  # top-left aligned, as in flash_attention
        causal = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        dense = causal[None, None] if dense is None else dense & causal
    if q_ids is not None:
        same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
        dense = same if dense is None else dense & same
    if dense is None:
        return flax_attention(query, key, value, bias, None)
    # Back to Flax's rank: [B|1, ...] -> [batch..., ...] (or [1...] when it was broadcast).
    lead = shape if dense.shape[0] != 1 else (1,) * len(shape)
    dense = jnp.reshape(dense, (*lead, *dense.shape[1:]))
    out = flax_attention(query, key, value, bias, dense)
    # Rows that see no key: zeros, as the kernels give (Flax would average every value).
    visible = jnp.swapaxes(jnp.any(dense, axis=-1), -1, -2)[..., None]  # [batch..., T, N|1, 1]
    return jnp.where(visible, out, jnp.zeros((), out.dtype))
