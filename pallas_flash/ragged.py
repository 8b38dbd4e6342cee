"""Ragged paged attention (continuous batching with chunked prefill): validation, backend
choice, the reference. No kernels here (`pallas_flash.triton.ragged` holds them, and
`pallas_flash.mosaic.ragged` the prefill launch's on Hopper)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import api, decode, kv_cache, mosaic
from pallas_flash import device as device_lib
from pallas_flash._numerics import accumulation_dtype
from pallas_flash._vjp import with_reference_vjp
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import ragged as mosaic_ragged
from pallas_flash.reference import reference_attention, with_sinks
from pallas_flash.triton.cache import CacheFormat
from pallas_flash.triton.ragged import ragged_block_sizes, ragged_forward
from pallas_flash.triton.tiles import RaggedBlockSizes


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    query_start_loc,
    kv_lengths,
    *,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    sinks=None,
    max_query_len: int | None = None,
    return_residuals: bool = False,
    backend: str | None = None,
    block_sizes: RaggedBlockSizes | None = None,
    interpret: bool | None = None,
    value_head_dim: int | None = None,
    k_scale=None,
    v_scale=None,
):
    """Attention of the new tokens of many sequences over one paged KV cache, in one call.

    The batch mixes decode steps (one new token), speculative tokens and prefill chunks
    (hundreds), as a serving engine's continuous batching does (vLLM's `cu_seqlens_q`,
    `seqused_k` and `block_table`). Shapes (T new tokens in all, B sequences, N query heads,
    K key/value heads, H head dim, Hv value head dim, P pages of `page_size` keys)::

        q:               (T, N, H)    the new tokens of all sequences, concatenated
        k_pages:         (P, page_size, K, H)
        v_pages:         (P, page_size, K, Hv)
        block_tables:    (B, max_pages) int: sequence b's key j is in page
                         block_tables[b, j // page_size], row j % page_size
        query_start_loc: (B + 1,) int: sequence b owns rows
                         query_start_loc[b]:query_start_loc[b + 1] of q
        kv_lengths:      (B,) int: L_b, the keys in the cache of sequence b, its new tokens
                         included (they are its last q_len_b keys)
        out:             (T, N, Hv)   in q's dtype

    New token i of sequence b sits at position L_b - q_len_b + i and sees the keys up to
    there, causally (the new tokens' keys and values must already be in the pages:
    `write_to_pages`). With q_len = 3 and L = 6 ("x" = visible)::

        key:        0 1 2 3 4 5 | 6 7 ...
        token 0:    x x x x . . | . .
        token 1:    x x x x x . | . .
        token 2:    x x x x x x | . .

    Query head n reads key/value head n // (N // K). Rows past query_start_loc[B] (padding
    to a bucket) and rows that see no key output 0. Pages are laid out, shared and read as in
    `paged_attention`: nothing past L_b is read.

    Args:
      q, k_pages, v_pages: the arrays above; float16, bfloat16 or float32, all the same, or
        the pages float8_e4m3fn (with k_scale and v_scale); H and Hv multiples of 8 up to 256.
        v_pages None: a shared latent cache (value_head_dim).
      block_tables, query_start_loc, kv_lengths: integer arrays as above. Concrete ones are
        checked (ValueError): query_start_loc starts at 0, never decreases and ends at most at
        T; 0 <= kv_lengths[b] <= max_pages * page_size and kv_lengths[b] >= q_len_b; the
        table entries a sequence reads lie in [0, P). Traced ones are made safe instead
        (docs/serving.md, "Semantics").
      scale: multiplies the logits q.k; defaults to 1 / sqrt(H).
      logits_soft_cap: c > 0: logits <- c * tanh(logits / c).
      local_window_size: w or (left, right): a token at position p sees keys j >= p - left
        (right is moot under the causal rule).
      sinks: None, or float (N,): one learned logit per query head in each row's softmax
        denominator, attending to no value (as in `flash_attention`).
      max_query_len: None, or a Python int >= 1: the most new tokens any sequence has (vLLM's
        `max_query_len`, FlashAttention's `max_seqlen_q`). A static hint that lets the kernel
        skip what shapes alone cannot rule out: with max_query_len * (N // K) at most the
        decode tile's rows (1 for decode-only batches), there is no prefill launch. Checked
        against query_start_loc when concrete (ValueError); under jit, a sequence with more
        new tokens outputs 0 in all its rows (lse -inf, or the sink).
      return_residuals: also return lse, float32 (N, T), natural log (-inf for rows that see
        no key; the sink's logit with sinks).
      backend: "triton" (the Pallas kernels, NVIDIA GPUs of compute capability >= 8.0),
        "mosaic" (Hopper: the prefill launch on a Mosaic GPU kernel, the decode launch on
        Triton's; NotImplementedError for what it does not take: float8 pages, a latent
        cache, float32, head dims outside 64/80/96/128/192/256, pages not a multiple of 8 keys
        that divide or are divided by its key tile), "xla" (the reference in plain jnp:
        materialises each token's sequence of keys, in chunks) or None (on Hopper as
        "mosaic" where it takes the call, else Triton on such a GPU or with interpret=True,
        else "xla"). interpret=True runs the Triton kernels in the interpreter, whatever the
        backend.
      block_sizes: the Triton launches' tiles (`RaggedBlockSizes`); None picks them. Given,
        backend=None runs the prefill launch on Triton's kernel; backend="mosaic" takes the
        decode launch's and refuses the prefill launch's fields (NotImplementedError).
      interpret: run the kernel in the Pallas interpreter (any platform, slow): for tests.
      value_head_dim: with v_pages None, Hv: the values are the first Hv columns of k_pages
        (multi-head latent attention's one latent cache, as in `paged_attention`: H = 576,
        Hv = 512, K = 1), read once for both; refused with v_pages.
      k_scale, v_scale: for float8_e4m3fn pages (required there, refused otherwise): float32
        of shape () or (K,), as in `paged_attention`.

    Returns:
      out, or (out, lse) when return_residuals. Differentiable in q, the pages, the scales and
      sinks: the kernel has no backward of its own, and gradients come from the reference
      (backend="xla").
    """
    q, k_pages, v_pages = _check_arrays(q, k_pages, v_pages)
    names = ("k_pages", "v_pages")
    cache = decode._check_cache(q, k_pages, v_pages, names, value_head_dim, k_scale, v_scale)
    num_tokens = q.shape[0]
    num_pages, page_size = k_pages.shape[:2]
    block_tables = decode._check_block_tables(block_tables)
    batch, max_pages = block_tables.shape
    api._check_int_vector("query_start_loc", query_start_loc, batch + 1)
    api._check_int_vector("kv_lengths", kv_lengths, batch)
    _check_values(query_start_loc, kv_lengths, block_tables, num_tokens, page_size, num_pages)
    capacity = max_pages * page_size
    _check_max_query_len(max_query_len, query_start_loc)
    options = decode._Options.of(
        q,
        sinks,
        scale,
        logits_soft_cap,
        local_window_size,
        return_residuals,
        backend,
        block_sizes,
        interpret,
        cache=cache,
        fp8=kv_cache.is_fp8(k_pages.dtype),
        tiles=RaggedBlockSizes,
        no_mosaic=None,
    )
    math_kwargs = dict(options.math, max_query_len=max_query_len)
    prefill = _prefill_kernel(q, k_pages, v_pages, options, math_kwargs, requested=backend)
    # Safe starts under jit; the user's where they were checked above. The paths clip the
    # lengths themselves.
    starts = _safe_starts(query_start_loc, num_tokens)
    sinks = None if sinks is None else jnp.asarray(sinks, accumulation_dtype(q.dtype))
    args = [q, k_pages, v_pages, block_tables, starts, kv_lengths, sinks]
    args += [cache.k_scale, cache.v_scale]
    reference = functools.partial(
        _ragged_reference, **math_kwargs, value_head_dim=cache.value_head_dim
    )
    if options.backend == "xla":
        out, lse = reference(*args)
    else:
        block_sizes = options.kernel["block_sizes"]
        if block_sizes is None:
            block_sizes = _default_block_sizes(
                q, k_pages, v_pages, cache, batch, capacity, options.kernel, math_kwargs
            )
        kernel = functools.partial(
            _ragged_forward,
            **dict(options.kernel, **math_kwargs, block_sizes=block_sizes, prefill=prefill),
        )
        out, lse = with_reference_vjp(kernel, reference, *args)
    return (out, lse) if return_residuals else out


def _prefill_kernel(q, k_pages, v_pages, options, math_kwargs, *, requested):
    """The prefill launch's kernel: `_mosaic_prefill` on Hopper where the Mosaic kernel takes
    the call (backend None without block_sizes, or "mosaic"), else None (the Triton launch).
    backend="mosaic" on a call it does not take raises NotImplementedError naming what (also
    block_sizes that set the Triton prefill launch's tiles: the Mosaic kernel has its own); on
    a device other than Hopper `dispatch.kernel_backend` has raised already. interpret=True
    runs the Triton launches in the Pallas interpreter, as every backend does."""
    if options.backend == "xla" or options.kernel["interpret"] or requested == "triton":
        return None
    block_sizes = options.kernel["block_sizes"]
    if requested is None and block_sizes is not None:
        return None  # the user's tiles configure the Triton launches, as in flash_attention
    reason = mosaic.why_not_ragged_prefill(
        q.shape,
        k_pages.shape,
        None if v_pages is None else v_pages.shape[-1],
        q.dtype,
        cache_dtype=k_pages.dtype,
        window_left=math_kwargs["window_left"],
        soft_cap=math_kwargs["soft_cap"],
        device=device_lib.target_device(),
    )
    if reason is None and block_sizes is not None:
        reason = _prefill_tiles_set(block_sizes)
    if reason is None:
        return _mosaic_prefill
    if requested == "mosaic":
        raise NotImplementedError(
            f"backend='mosaic': the Mosaic GPU prefill does not take {reason}; use "
            "backend='triton' or None"
        )
    return None


def _prefill_tiles_set(block_sizes: RaggedBlockSizes) -> str | None:
    """The Triton prefill launch's fields of `block_sizes` that differ from their defaults
    (the Mosaic prefill would ignore them), or None."""
    default = RaggedBlockSizes()
    changed = [
        f"{field.name}={getattr(block_sizes, field.name)}"
        for field in dataclasses.fields(block_sizes)
        if field.name.endswith("_prefill")
        and getattr(block_sizes, field.name) != getattr(default, field.name)
    ]
    return f"block_sizes setting the Triton prefill's {', '.join(changed)}" if changed else None


def _mosaic_prefill(*args, num_sms: int, **kwargs):
    """The Mosaic GPU prefill launch (`mosaic.ragged.ragged_prefill`), as
    `triton.ragged.ragged_forward` calls its `prefill`."""
    return mosaic_ragged.ragged_prefill(*args, num_sms=num_sms, **kwargs)


def _default_block_sizes(
    q, k_pages, v_pages, cache, batch: int, capacity: int, kernel, math_kwargs
):
    """The kernel's tiles where the caller gave none (`ragged_block_sizes`); kernel and
    math_kwargs: the call's options of the kernel and of the math."""
    return ragged_block_sizes(
        q.shape,
        batch,
        k_pages.shape[2],
        capacity,
        q.dtype,
        interpret=kernel["interpret"],
        page_size=k_pages.shape[1],
        window_left=math_kwargs["window_left"],
        num_sms=kernel["num_sms"],
        fmt=CacheFormat(
            q.shape[-1],
            cache.value_head_dim or v_pages.shape[-1],
            shared=cache.shared,
            scaled=cache.k_scale is not None,
        ),
        cache_dtype=k_pages.dtype,
    )


# -- the reference (the "xla" backend, and the gradient of the kernel) ----------------------------

# The most float32 elements of one chunk's gathered keys and values in the reference.
_REFERENCE_CHUNK_ELEMENTS = 1 << 26


def ragged_reference(
    q,
    k_pages,
    v_pages,
    block_tables,
    starts,
    lengths,
    sinks=None,
    k_scale=None,
    v_scale=None,
    *,
    scale,
    soft_cap,
    window_left,
    max_query_len=None,
    value_head_dim=None,
):
    """(out [T, N, Hv], lse [N, T]) of `ragged_paged_attention` in plain jnp, on the safe
    starts the API makes ([B + 1] non-decreasing in [0, T]; lengths [B] are clipped here to
    [0, capacity]): each token row gathers its sequence's pages into a contiguous cache and
    attends over it (`reference_attention`, one token per batch entry), in chunks of rows
    that bound the gathered keys. Rows of a sequence of more than max_query_len new tokens
    see no key. float8 pages are dequantised first (in q's dtype); a shared latent cache's
    values (v_pages None, value_head_dim) are its keys' first columns."""
    k_pages = kv_cache.dequantized(k_pages, k_scale, q.dtype)
    if v_pages is None:
        v_pages = k_pages[..., :value_head_dim]
    else:
        v_pages = kv_cache.dequantized(v_pages, v_scale, q.dtype)
    num_tokens, num_heads, _ = q.shape
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    value_head_dim = v_pages.shape[-1]
    batch, max_pages = block_tables.shape
    capacity = max_pages * page_size
    lengths = jnp.clip(lengths, 0, capacity)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # Row r belongs to sequence b where starts[b] <= r < starts[b + 1]; rows before starts[0]
    # or from starts[B] on belong to none and see no key.
    seq = jnp.sum(starts[None, :] <= rows[:, None], axis=1).astype(jnp.int32) - 1
    owned = (seq >= 0) & (seq < batch)
    seq = jnp.clip(seq, 0, batch - 1)
    q_len = starts[seq + 1] - starts[seq]
    if max_query_len is not None:
        owned = owned & (q_len <= max_query_len)
    pos = jnp.where(owned, lengths[seq] - q_len + rows - starts[seq], -1)
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    per_row = capacity * num_kv_heads * (head_dim + value_head_dim)
    chunk = max(1, min(num_tokens, _REFERENCE_CHUNK_ELEMENTS // per_row))

    def attend(row):
        q_row, seq_row, pos_row = row
        keys = jnp.arange(capacity)
        visible = keys <= pos_row
        if window_left is not None:
            visible = visible & (keys >= pos_row - window_left)
        # Slots past the length may hold anything (NaN): zeroed, since 0 * NaN would reach
        # the output.
        stored = (keys < lengths[seq_row])[:, None, None]

        def gather(pages):
            cache = pages[tables[seq_row]].reshape(capacity, num_kv_heads, pages.shape[-1])
            return jnp.where(stored, cache, 0)

        spec = MaskSpec(q_len=1, kv_len=capacity, mask_shape=(1, 1, 1, capacity))
        out, lse, log_sum = reference_attention(
            q_row[None, None],
            gather(k_pages)[None],
            gather(v_pages)[None],
            None,
            MaskArrays(mask=visible[None, None, None].astype(jnp.int8)),
            spec=spec,
            scale=scale,
            soft_cap=soft_cap,
            with_log_sum=True,
        )
        return out[0, 0], lse[0, :, 0], log_sum[0, :, 0]

    out, lse, log_sum = jax.lax.map(attend, (q, seq, pos), batch_size=chunk)
    if sinks is not None:
        out, lse = with_sinks(out[None], lse.T[None], sinks, log_sum.T[None])
        return out[0], lse[0]
    return out, lse.T


# The paths are jit'd functions of their static options: eager calls (a Python serving loop)
# compile once.
_MATH = ("scale", "soft_cap", "window_left", "max_query_len")
_ragged_reference = jax.jit(ragged_reference, static_argnames=(*_MATH, "value_head_dim"))
_ragged_forward = jax.jit(
    ragged_forward,
    static_argnames=(*_MATH, "block_sizes", "interpret", "num_sms", "value_head_dim", "prefill"),
)


def _safe_starts(query_start_loc, num_tokens: int):
    """query_start_loc as int32 where it is concrete (checked); under jit made safe: clipped
    to [0, T] and made non-decreasing (its running maximum, one small XLA fusion: a
    triangular max up to 1024 entries, XLA's cumulative max, a reduce-window, beyond)."""
    starts = jnp.asarray(query_start_loc, jnp.int32)
    if api._concrete(query_start_loc) is not None:
        return starts
    starts = jnp.clip(starts, 0, num_tokens)
    n = starts.shape[0]
    if n > 1024:
        return jax.lax.cummax(starts, axis=0)
    before = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.max(jnp.where(before, starts[None, :], 0), axis=1)


# -- validation -----------------------------------------------------------------------------------


def _check_max_query_len(max_query_len, query_start_loc):
    if max_query_len is None:
        return
    if not isinstance(max_query_len, int) or isinstance(max_query_len, bool):
        raise TypeError(
            f"max_query_len must be a Python int or None, got {type(max_query_len).__name__}"
        )
    if max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len} must be >= 1")
    starts = api._concrete(query_start_loc)
    if starts is not None and len(starts) > 1 and (q_lens := np.diff(starts)).max() > max_query_len:
        b = int(np.argmax(q_lens))
        raise ValueError(
            f"max_query_len={max_query_len} must be at least every sequence's new tokens: "
            f"sequence {b} has query_start_loc[{b + 1}] - query_start_loc[{b}] = {int(q_lens[b])}"
        )


def _check_arrays(q, k_pages, v_pages):
    """Checks q and the pages (v_pages None: a shared latent cache, whose head dims
    `kv_cache.check_value_head_dim` checks; float8 pages: `decode._check_cache_dtypes`)."""
    arrays = {"q": (q, 3), "k_pages": (k_pages, 4)}
    if v_pages is not None:
        arrays["v_pages"] = (v_pages, 4)
    for name, (x, rank) in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank}, got {name}.shape={x.shape}")
    decode._check_cache_dtypes({name: x for name, (x, _) in arrays.items()}, "k_pages", "v_pages")
    if v_pages is not None and k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"k_pages.shape={k_pages.shape} and v_pages.shape={v_pages.shape} must agree in "
            "(P, page_size, K)"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if min(num_tokens, num_heads, head_dim, num_pages, page_size, num_kv_heads) < 1:
        raise ValueError(
            f"every dimension must be >= 1; got q.shape={q.shape}, k_pages.shape={k_pages.shape}"
        )
    api._check_heads(q, k_pages, ("q", "k_pages"), latent=v_pages is None)
    if v_pages is None:
        return q, k_pages, v_pages
    # The value head dim may differ from the query's.
    dim = v_pages.shape[-1]
    if dim % 8 or dim > api.MAX_HEAD_DIM or dim < 8:
        raise ValueError(
            f"head dim {dim} (v_pages.shape={v_pages.shape}) must be a multiple of 8 and at "
            f"most {api.MAX_HEAD_DIM}"
        )
    return q, k_pages, v_pages


def _check_values(query_start_loc, kv_lengths, block_tables, num_tokens, page_size, num_pages):
    """The rules on the integer arrays' values, where they are concrete (kv_lengths' and the
    table's are paged_attention's)."""
    starts = api._concrete(query_start_loc)
    if starts is not None:
        if starts[0] != 0:
            raise ValueError(f"query_start_loc[0]={int(starts[0])} must be 0")
        steps = np.diff(starts)
        if (steps < 0).any():
            b = int(np.argmax(steps < 0))
            raise ValueError(
                f"query_start_loc must be non-decreasing: query_start_loc[{b}]="
                f"{int(starts[b])} > query_start_loc[{b + 1}]={int(starts[b + 1])}"
            )
        if starts[-1] > num_tokens:
            raise ValueError(
                f"query_start_loc[-1]={int(starts[-1])} must be at most the tokens of q "
                f"(q.shape[0]={num_tokens})"
            )
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    api._check_lengths(
        "kv_lengths",
        kv_lengths,
        block_tables.shape[0],
        capacity,
        f"block_tables.shape[1] * page_size = {max_pages} * {page_size} = {capacity}",
    )
    lengths = api._concrete(kv_lengths)
    if starts is not None and lengths is not None and (short := lengths < np.diff(starts)).any():
        b = int(np.argmax(short))
        raise ValueError(
            f"kv_lengths[{b}]={int(lengths[b])} must be at least sequence {b}'s new tokens "
            f"(query_start_loc[{b + 1}] - query_start_loc[{b}] = {int(np.diff(starts)[b])}): "
            "they are the last keys of its cache"
        )
    decode._check_table_entries(block_tables, kv_lengths, page_size, num_pages)
