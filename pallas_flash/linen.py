"""pallas_flash for flax.linen: a drop-in `attention_fn` and a `MultiHeadDotProductAttention`.

Either pass the function to any linen attention module::

    import functools
    import flax.linen as nn
    import pallas_flash.linen

    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=pallas_flash.linen.dot_product_attention
    )
    # Options go in with functools.partial, e.g. the kernels in the interpreter on CPU:
    attention_fn = functools.partial(
        pallas_flash.linen.dot_product_attention, backend="triton", interpret=True
    )

or use the subclass, which adds `is_causal` (the kernels' causal fast path: no dense mask, tiles
above the diagonal skipped), `backend`, `interpret`, `block_sizes` and segment ids at call time::

    layer = pallas_flash.linen.MultiHeadDotProductAttention(num_heads=8, is_causal=True)
    y = layer.apply(variables, x, q_segment_ids=document_ids)

Importing this module imports Flax; `import pallas_flash` alone does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from pallas_flash import flax_common
from pallas_flash.flax_common import FallbackWarning
from pallas_flash.triton import BlockSizes

__all__ = ["FallbackWarning", "MultiHeadDotProductAttention", "dot_product_attention"]


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
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    *,
    is_causal: bool = False,
    q_segment_ids=None,
    kv_segment_ids=None,
    backend: str | None = None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    kv_cache_length=None,
    sinks=None,
    deterministic_grads: bool = True,
):
    """`flax.linen.dot_product_attention` computed by the pallas_flash kernels.

    The parameters up to `attn_weights_value_einsum` are those of
    `flax.linen.dot_product_attention`, by name and position: linen modules pass an
    `attention_fn` only the keywords its signature names, so each is spelled out here.

    {shapes}

    Args:
      query, key, value: as above. Promoted to one dtype (`dtype` if given) as Flax does; the
        kernels take float16, bfloat16 or float32 and H a multiple of 8 up to 256 (float64
        runs as in `flash_attention`: backend="xla" or interpret=True).
      {flax_arguments}
      module: sow the attention weights into this module's 'intermediates'. The kernels never
        form the weights, so such a call runs Flax's own attention (and warns once).
      force_fp32_for_softmax: accepted; the kernels' softmax is always float32.
      einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: custom einsums
        (e.g. quantised ones) cannot run inside the kernels: anything but None raises
        NotImplementedError.
      is_causal: query i sees keys j <= i (top-left aligned); the kernels' causal fast path.
      {options}

    Returns:
      {returns}
    """
    for name, fn in (
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if fn is not None:
            raise NotImplementedError(
                f"{name}={fn!r}: custom einsums cannot run inside the pallas_flash kernels; "
                "use flax.linen.dot_product_attention for this module"
            )
    return flax_common.attention(
        query,
        key,
        value,
        bias,
        mask,
        flax_attention=functools.partial(
            _flax_attention, force_fp32_for_softmax=force_fp32_for_softmax
        ),
        promote=_promote,
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


def _promote(arrays, dtype):
    return promote_dtype(*arrays, dtype=dtype)


def _flax_attention(query, key, value, bias, mask, **kwargs):
    # flax.linen's attention wants equal head counts: repeat kv heads as GQA reads them.
    if key.shape[-2] != query.shape[-2]:
        group = query.shape[-2] // key.shape[-2]
        key, value = jnp.repeat(key, group, axis=-2), jnp.repeat(value, group, axis=-2)
    return nn.dot_product_attention(query, key, value, bias, mask, **kwargs)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """`flax.linen.MultiHeadDotProductAttention` running on pallas_flash.

    Same parameters (names, shapes, initialisers) and call as Flax's module, so variables move
    between the two unchanged. `attention_fn` defaults to `pallas_flash.linen.
    dot_product_attention`.

    Attributes (beyond Flax's):
      is_causal: causal self-attention through the kernels' causal fast path, without a mask
        array. Ignored in decode steps (`decode=True`), where the cache mask already limits
        each query to the cached keys; a length-1 causal query would see only key 0. Decode
        steps without a mask of the caller's run `pallas_flash.decode_attention` over the
        cache's filled slots (not a mask over the whole cache) when the attention function
        takes `kv_cache_length`.
      backend, interpret, block_sizes: passed to the attention function (see
        `pallas_flash.flash_attention`); None leaves the function's own choice.
      deterministic_grads: False passes deterministic_grads=False to the attention function
        (faster gradients on Hopper, not bitwise repeatable; see `pallas_flash.flash_attention`).
      attention_sinks: adds the parameter `sinks` `[num_heads]` (initialised to zeros, in
        `param_dtype`): one learned logit per head in each row's softmax denominator, as
        gpt-oss has; passed to the attention function as `sinks`.
    """

    attention_fn: Callable[..., Any] = dot_product_attention
    is_causal: bool = False
    attention_sinks: bool = False
    backend: str | None = None
    interpret: bool | None = None
    block_sizes: BlockSizes | None = None
    deterministic_grads: bool = True

    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        q_segment_ids=None,
        kv_segment_ids=None,
        **kwargs,
    ):
        """Flax's `__call__` plus segment ids.

        Args:
          inputs_q, inputs_k, inputs_v: as in Flax's module.
          q_segment_ids: int `[batch..., q_length]`; kv_segment_ids: int
            `[batch..., kv_length]` (defaults to q_segment_ids for self-attention): queries see
            keys of their own segment only (packed documents).
          **kwargs: Flax's keyword arguments: inputs_kv, mask, deterministic, dropout_rng,
            sow_weights.

        Returns:
          `[batch..., length, out_features]`.
        """
        cache_index = None
        if self.decode and self.has_variable("cache", "cache_index"):
            cache_index = self.get_variable("cache", "cache_index")
        bound = flax_common.bind_module_options(
            self,
            cache_index=cache_index,
            mask=kwargs.get("mask"),
            is_causal=self.is_causal and not self.decode,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
        )
        if self.attention_sinks:
            bound = self._with_sinks(bound)
        with flax_common.attention_fn_swapped(self, bound):
            return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)

    def _with_sinks(self, attention_fn):
        """attention_fn with the `sinks` parameter bound. The parameter is made when Flax's
        compact `__call__` calls the function, inside this module's scope; the wrapper keeps the
        function's signature, from which linen picks the keywords it passes."""

        @functools.wraps(attention_fn)
        def attention(*args, **kwargs):
            sinks = self.param(
                "sinks", nn.initializers.zeros_init(), (self.num_heads,), self.param_dtype
            )
            return attention_fn(*args, sinks=sinks, **kwargs)

        return attention
