"""pallas_flash for flax.nnx: a drop-in `attention_fn` and a `MultiHeadAttention`.

Either pass the function to any nnx attention module::

    import functools
    from flax import nnx
    import pallas_flash.nnx

    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
        attention_fn=pallas_flash.nnx.dot_product_attention,
    )
    # Options go in with functools.partial, e.g. the kernels in the interpreter on CPU:
    attention_fn = functools.partial(
        pallas_flash.nnx.dot_product_attention, backend="triton", interpret=True
    )

or use the subclass, which adds `is_causal` as a default, `backend`, `interpret`, `block_sizes`
and segment ids at call time::

    layer = pallas_flash.nnx.MultiHeadAttention(
        num_heads=8, in_features=512, num_kv_heads=2, is_causal=True, decode=False,
        rngs=nnx.Rngs(0),
    )
    y = layer(x, q_segment_ids=document_ids)

Importing this module imports Flax; `import pallas_flash` alone does not.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from pallas_flash import flax_common
from pallas_flash.flax_common import FallbackWarning
from pallas_flash.triton import BlockSizes

__all__ = ["FallbackWarning", "MultiHeadAttention", "dot_product_attention"]


@flax_common.document
def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    input_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    kv_cache_length=None,
    sinks=None,
    deterministic_grads: bool = True,
):
    """`flax.nnx.dot_product_attention` computed by the pallas_flash kernels.

    The parameters up to `is_causal` are those of `flax.nnx.dot_product_attention`, by name and
    position; `flax.nnx.MultiHeadAttention` passes all of them but `bias` and `promote_dtype`.

    {shapes}

    Args:
      query, key, value: as above, promoted to one dtype by `promote_dtype` (to `dtype` if
        given); the kernels take float16, bfloat16 or float32 and H a multiple of 8 up to 256
        (float64 runs as in `flash_attention`: backend="xla" or interpret=True).
      {flax_arguments}
      module: sow the attention weights into this module (`nnx.Intermediate`). The kernels never
        form the weights, so such a call runs Flax's own attention (and warns once).
      promote_dtype: Flax's dtype promotion hook, `f((query, key, value), dtype=...)`.
      is_causal: query i sees keys j <= i (top-left aligned); the kernels' causal fast path.
      input_positions: accepted because `nnx.MultiHeadAttention` forwards it when given; plain
        attention has no use for positions (RoPE belongs in a wrapper that rotates query and key
        before calling this function), so it does not change the result.
      {options}

    Returns:
      {returns}
    """
    del input_positions  # see the docstring
    return flax_common.attention(
        query,
        key,
        value,
        bias,
        mask,
        # Causality and segments reach Flax's attention folded into its mask.
        flax_attention=functools.partial(nnx.dot_product_attention, promote_dtype=promote_dtype),
        promote=promote_dtype,
        broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
        module=module,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        backend=backend,
        interpret=interpret,
        block_sizes=block_sizes,
        kv_cache_length=kv_cache_length,
        sinks=sinks,
        deterministic_grads=deterministic_grads,
    )


class MultiHeadAttention(nnx.MultiHeadAttention):
    """`flax.nnx.MultiHeadAttention` running on pallas_flash.

    Same constructor (plus the arguments below), parameters, cache and call as Flax's module,
    so state moves between the two unchanged. `attention_fn` defaults to
    `pallas_flash.nnx.dot_product_attention`. GQA/MQA: `num_kv_heads` (Flax's argument) makes
    the key/value projections and the decode cache hold `num_kv_heads` heads, which the kernels
    read without repeating them. Decoding: `init_cache(...)`, then one token per call with
    `decode=True`, as in Flax; each step runs `pallas_flash.decode_attention` over the cache's
    filled slots (not a mask over the whole cache) when no mask is given and the attention
    function takes `kv_cache_length`.

    Args:
      *args, **kwargs: those of `flax.nnx.MultiHeadAttention` (num_heads, in_features, ...,
        num_kv_heads, ..., rngs).
      is_causal: the default of `__call__`'s `is_causal`: causal self-attention through the
        kernels' causal fast path, without a mask array. Flax ignores it in decode steps, where
        the cache mask already limits each query to the cached keys.
      backend, interpret, block_sizes: passed to the attention function (see
        `pallas_flash.flash_attention`); None leaves the function's own choice.
      deterministic_grads: False passes deterministic_grads=False to the attention function
        (faster gradients on Hopper, not bitwise repeatable; see `pallas_flash.flash_attention`).
      attention_fn: defaults to `pallas_flash.nnx.dot_product_attention`.
      attention_sinks: adds the parameter `sinks` `[num_heads]` (zeros, in `param_dtype`): one
        learned logit per head in each row's softmax denominator, as gpt-oss has; passed to the
        attention function as `sinks`.
    """

    def __init__(
        self,
        *args,
        is_causal: bool = False,
        backend: str | None = None,
        interpret: bool | None = None,
        block_sizes: BlockSizes | None = None,
        attention_fn=dot_product_attention,
        attention_sinks: bool = False,
        deterministic_grads: bool = True,
        **kwargs,
    ):
        super().__init__(*args, attention_fn=attention_fn, **kwargs)
        self.sinks = (
            nnx.Param(jnp.zeros((self.num_heads,), self.param_dtype)) if attention_sinks else None
        )
        self.is_causal = is_causal
        self.backend = backend
        self.interpret = interpret
        self.block_sizes = block_sizes
        self.deterministic_grads = deterministic_grads

    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        is_causal: bool | None = None,
        q_segment_ids=None,
        kv_segment_ids=None,
        **kwargs,
    ):
        """Flax's `__call__` plus segment ids; `is_causal` defaults to the constructor's.

        Args:
          inputs_q, inputs_k, inputs_v: as in Flax's module.
          is_causal: None uses the constructor's `is_causal`.
          q_segment_ids: int `[batch..., q_length]`; kv_segment_ids: int
            `[batch..., kv_length]` (defaults to q_segment_ids for self-attention): queries see
            keys of their own segment only (packed documents).
          **kwargs: Flax's keyword arguments: mask, deterministic, rngs, sow_weights, decode,
            out_sharding, qkv_sharding, input_positions.

        Returns:
          `[batch..., length, out_features]`.
        """
        if is_causal is None:
            is_causal = self.is_causal
        decode = kwargs.get("decode")
        decode = self.decode if decode is None else decode
        # A decode step's cache mask already limits each query to the cached keys; Flax before
        # 0.12.11 passed is_causal on to the attention function there (a causal mask of one
        # query row would keep key 0 alone), later versions drop it.
        is_causal = is_causal and not decode
        cache_index = None
        if decode and getattr(self, "cache_index", None) is not None:
            cache_index = self.cache_index[...]
        bound = flax_common.bind_module_options(
            self,
            cache_index=cache_index,
            mask=kwargs.get("mask"),
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            sinks=None if self.sinks is None else self.sinks[...],
        )
        with flax_common.attention_fn_swapped(self, bound):
            return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=is_causal, **kwargs)
