"""Decode attention over a KV cache, contiguous or paged: validation, backend choice, the
kernel's split over a device mesh (`_partition`), the reference, and the helper that writes new
keys into pages. No kernels here."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import _partition, _passes, api, dispatch, kv_cache
from pallas_flash import device as device_lib
from pallas_flash._vjp import with_reference_vjp
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.reference import reference_attention, with_sinks
from pallas_flash.triton import DecodeBlockSizes

_SHAPES_DOC = """The T new tokens of each sequence are the last T of its keys: with L = its length
    (the new tokens included), new token t sits at position L - T + t and sees keys
    j <= L - T + t (causal among the new tokens, aligned to the end of the cache). With
    T = 3 and L = 6 ("x" = visible; cache slots past L are never read)::

        key:        0 1 2 3 4 5 | 6 7 ...
        token 0:    x x x x . . | . .
        token 1:    x x x x x . | . .
        token 2:    x x x x x x | . .
"""


def _refuse_dropout(dropout_rate):
    if dropout_rate:
        raise NotImplementedError(
            f"dropout_rate={dropout_rate!r}: decode_attention and paged_attention have no "
            "attention dropout; flash_attention runs it"
        )


def decode_attention(
    query,
    key_cache,
    value_cache,
    *,
    key_value_seq_lengths,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    sinks=None,
    return_residuals: bool = False,
    backend: str | None = None,
    block_sizes: DecodeBlockSizes | None = None,
    interpret: bool | None = None,
    dropout_rate: float = 0.0,
    value_head_dim: int | None = None,
    k_scale=None,
    v_scale=None,
):
    """Attention of a few new tokens per sequence over a KV cache (flash-decoding).

    Shapes (B sequences, T new tokens, S cache capacity, N query heads, K key/value heads,
    H head dim)::

        query:       (B, T, N, H)
        key_cache:   (B, S, K, H)
        value_cache: (B, S, K, H)
        out:         (B, T, N, Hv) in query's dtype (Hv = H, or value_head_dim)

    {shapes}
    N must be a multiple of K: query head n reads key/value head n // (N // K). Each sequence
    reads only its first L keys; cache slots past L may hold anything (docs/decoding.md).

    Args:
      query, key_cache, value_cache: the arrays above; float16, bfloat16 or float32, all the
        same (float64 as in `flash_attention`: backend="xla" or interpret=True), or the caches
        float8_e4m3fn (with k_scale and v_scale); H a multiple of 8 up to 256. The new tokens'
        keys and values must already be in the cache (at positions L - T .. L - 1).
        value_cache None: a shared latent cache (below).
      key_value_seq_lengths: int array (B,): L of each sequence, 0 <= L <= S (checked when
        concrete; under jit, clipped to [0, S]). Tokens at positions < 0 (L < T) see no key.
      scale: multiplies the logits q.k; defaults to 1 / sqrt(H).
      logits_soft_cap: c > 0: logits <- c * tanh(logits / c).
      local_window_size: w or (left, right): token i sees keys j >= i - left (right is moot
        under the causal rule).
      sinks: None, or float (N,): attention sinks as in `flash_attention`, one learned logit
        per query head in each row's softmax denominator (it attends to no value).
      return_residuals: also return lse, float32 (B, N, T), natural log.
      backend: "triton" (the Pallas kernel, NVIDIA GPUs of compute capability >= 8.0), "xla"
        (the reference in plain jnp: materialises (B, N, T, S) logits) or None (Triton on such
        a GPU or with interpret=True, else "xla").
      block_sizes: the kernel's tiles (`DecodeBlockSizes`); None picks them.
      interpret: run the kernel in the Pallas interpreter (any platform, slow): for tests.
      dropout_rate: only 0: decoding has no attention dropout (NotImplementedError otherwise;
        `flash_attention` has it).
      value_head_dim: with value_cache None, Hv: the values are the first Hv columns of
        key_cache (multi-head latent attention's one latent cache, FlashMLA's head_dim_v: H =
        576 = 512 + 64 rope columns, Hv = 512, K = 1); the kernel reads each cached row once
        for both. Hv a multiple of 8 up to min(H, 512), H up to Hv + 256. Refused (ValueError)
        with a value_cache.
      k_scale, v_scale: for float8_e4m3fn caches (required there, refused otherwise): float32
        scales per tensor (shape ()) or per KV head (shape (K,)); the keys are key_cache times
        k_scale, the values value_cache times v_scale (a shared latent cache takes k_scale
        only). The kernel converts float8 tiles in registers (to float16 under bfloat16
        queries, whose rows it scales by powers of two, exactly; else to the query's dtype)
        and applies the scales to the logits and the output (`write_to_pages` quantises).
        Checked finite and > 0 when concrete.

    Returns:
      out, or (out, lse) when return_residuals. A token that sees no key (L = 0) outputs
      zeros with lse = -inf. Differentiable in query, the caches and the scales: the kernel
      has no backward of its own, and gradients come from the reference (backend="xla").

    On a device mesh (batch, heads, or the cache's sequence): docs/decoding.md, "On several
    GPUs".
    """
    _refuse_dropout(dropout_rate)
    names = ("key_cache", "value_cache")
    query, key_cache, value_cache = _check_arrays(query, key_cache, value_cache, names)
    cache = _check_cache(query, key_cache, value_cache, names, value_head_dim, k_scale, v_scale)
    batch, capacity = query.shape[0], key_cache.shape[1]
    lengths = _check_lengths(
        "key_value_seq_lengths",
        key_value_seq_lengths,
        batch,
        capacity,
        f"key_cache.shape[1]={capacity}",
    )
    options = _Options.of(
        query,
        sinks,
        scale,
        logits_soft_cap,
        local_window_size,
        return_residuals,
        backend,
        block_sizes,
        interpret,
        cache=cache,
        fp8=kv_cache.is_fp8(key_cache.dtype),
    )
    out, lse = _attend(options, sinks, cache, query, key_cache, value_cache, lengths, None)
    return (out, lse) if return_residuals else out


def paged_attention(
    query,
    key_pages,
    value_pages,
    block_tables,
    lengths,
    *,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    sinks=None,
    return_residuals: bool = False,
    backend: str | None = None,
    block_sizes: DecodeBlockSizes | None = None,
    interpret: bool | None = None,
    dropout_rate: float = 0.0,
    value_head_dim: int | None = None,
    k_scale=None,
    v_scale=None,
):
    """`decode_attention` over a paged KV cache (vLLM's layout).

    Shapes (P pages of `page_size` keys in one pool shared by all sequences, max_pages the
    table's width)::

        query:        (B, T, N, H)
        key_pages:    (P, page_size, K, H)
        value_pages:  (P, page_size, K, H)
        block_tables: (B, max_pages) int: sequence b's key j is in page
                      block_tables[b, j // page_size], row j % page_size
        lengths:      (B,) int: L of each sequence, 0 <= L <= max_pages * page_size
        out:          (B, T, N, Hv)

    {shapes}
    Pages can be in any order and shared between sequences; a sequence's last page may be
    partly filled; any page size >= 1 works. Only the table entries of a sequence's first
    ceil(L / page_size) pages are read (checked to lie in [0, P) when concrete; under jit,
    clipped to it): the rest may hold anything. Write new keys and values with
    `write_to_pages`.

    Args and returns as `decode_attention` (lengths is its key_value_seq_lengths; value_pages
    None with value_head_dim: a shared latent pool, as MLA's; float8_e4m3fn pages with k_scale
    and v_scale). On a device mesh the pool splits over its KV heads only (docs/decoding.md,
    "On several GPUs").
    """
    _refuse_dropout(dropout_rate)
    names = ("key_pages", "value_pages")
    query, key_pages, value_pages = _check_arrays(query, key_pages, value_pages, names)
    cache = _check_cache(query, key_pages, value_pages, names, value_head_dim, k_scale, v_scale)
    batch = query.shape[0]
    num_pages, page_size = key_pages.shape[:2]
    block_tables = _check_block_tables(block_tables, batch)
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    lengths = _check_lengths(
        "lengths",
        lengths,
        batch,
        capacity,
        f"block_tables.shape[1] * page_size = {max_pages} * {page_size} = {capacity}",
    )
    _check_table_entries(block_tables, lengths, page_size, num_pages)
    options = _Options.of(
        query,
        sinks,
        scale,
        logits_soft_cap,
        local_window_size,
        return_residuals,
        backend,
        block_sizes,
        interpret,
        cache=cache,
        fp8=kv_cache.is_fp8(key_pages.dtype),
    )
    out, lse = _attend(options, sinks, cache, query, key_pages, value_pages, lengths, block_tables)
    return (out, lse) if return_residuals else out


decode_attention.__doc__ = decode_attention.__doc__.format(shapes=_SHAPES_DOC)
paged_attention.__doc__ = paged_attention.__doc__.format(shapes=_SHAPES_DOC)


def write_to_pages(
    key_pages,
    value_pages,
    block_tables,
    key,
    value,
    positions,
    *,
    counts=None,
    k_scale=None,
    v_scale=None,
):
    """Writes new keys and values into a paged cache (prefill, or each decode step's tokens).

    Token t of sequence b goes to position positions[b] + t of that sequence: page
    block_tables[b, (positions[b] + t) // page_size], row (positions[b] + t) % page_size.

    Args:
      key_pages, value_pages: (P, page_size, K, H), as `paged_attention` takes them;
        value_pages None (and value None) for a shared latent cache (`paged_attention`'s
        value_head_dim: the values are the keys' first columns).
      block_tables: (B, max_pages) int.
      key, value: (B, T, K, H) in the pages' dtype; for float8_e4m3fn pages, float16,
        bfloat16 or float32, quantised with the scales.
      positions: int (B,): where each sequence's first new token goes (its length so far),
        0 <= positions[b] and positions[b] + counts[b] <= max_pages * page_size.
      counts: int (B,) or None: only the first counts[b] tokens of sequence b are written
        (ragged prompts padded to T), 0 <= counts[b] <= T; None writes all T.
      k_scale, v_scale: for float8_e4m3fn pages (required there, refused otherwise): float32
        of shape () or (K,), as `paged_attention` takes them (a shared latent cache takes
        k_scale only). The pages get x / scale rounded to the nearest e4m3 value (ties to
        even) and saturated to +-448, e4m3's largest finite value (NaN stays NaN): a value
        beyond 448 times its scale is clipped, not turned into NaN.

    Returns:
      (key_pages, value_pages) updated (value_pages None for a shared latent cache). Under jit
      with the pages donated (`jax.jit(..., donate_argnums=...)`) XLA updates them in place.

    Raises:
      ValueError: where positions, counts or the table entries of the pages written are
        concrete (not traced) and a token cannot be placed: a negative position, a count
        outside [0, T], a token past its sequence's max_pages * page_size slots, or a table
        entry outside [0, P). Under jit (traced values) such a token is dropped: it is
        written nowhere, so no other sequence's pages (nor other slots of its own) change.
    """
    shared = value_pages is None
    if shared and value is not None:
        raise ValueError(
            "value_pages=None (a shared latent cache) takes value=None: the values are the "
            "keys' first columns"
        )
    pools = [("key_pages", key_pages)] + ([] if shared else [("value_pages", value_pages)])
    for name, x in pools:
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be (P, page_size, K, H), got {api._shape_of(x)}")
    if not shared and key_pages.shape != value_pages.shape:
        raise ValueError(
            f"key_pages.shape={key_pages.shape} and value_pages.shape={value_pages.shape} "
            "must be equal"
        )
    num_pages, page_size, num_kv_heads, head_dim = key_pages.shape
    news = [("key", key, key_pages)] + ([] if shared else [("value", value, value_pages)])
    for name, x, pages in news:
        if getattr(x, "ndim", None) != 4 or x.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be (B, T, {num_kv_heads}, {head_dim}) to match the pages, "
                f"got {api._shape_of(x)}"
            )
        if kv_cache.is_fp8(pages.dtype):
            if not any(x.dtype == d for d in api._FLOAT_DTYPES):
                raise TypeError(
                    f"{name}.dtype={x.dtype} must be float16, bfloat16 or float32: it is "
                    f"quantised into the {pages.dtype} pages"
                )
        elif x.dtype != pages.dtype:
            raise TypeError(f"{name}.dtype={x.dtype} must be the pages' dtype {pages.dtype}")
    if not shared and key.shape != value.shape:
        raise ValueError(f"key.shape={key.shape} and value.shape={value.shape} must be equal")
    k_scale, v_scale = kv_cache.check_scales(
        k_scale, v_scale, key_pages, num_kv_heads, "key_pages", shared=shared
    )
    batch, q_len = key.shape[:2]
    block_tables = _check_block_tables(block_tables, batch)
    positions = _check_int_vector("positions", positions, batch)
    if counts is not None:
        counts = _check_int_vector("counts", counts, batch)
    _check_placements(block_tables, positions, counts, q_len, page_size, num_pages)
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    pos = positions[:, None] + t  # [B, T]
    valid = (pos >= 0) & (pos < block_tables.shape[1] * page_size)
    if counts is not None:
        valid = valid & (t < counts[:, None])
    page_idx = jnp.clip(pos // page_size, 0, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables, page_idx, axis=1)
    # Tokens not placed go to an index past the pool, which mode="drop" discards. A table entry
    # outside the pool is not placed either: a negative one would index from the pool's end.
    valid = valid & (page >= 0) & (page < num_pages)
    page = jnp.where(valid, page, num_pages)
    row = pos % page_size
    key = kv_cache.quantized(key, k_scale, key_pages.dtype)
    key_pages = key_pages.at[page, row].set(key, mode="drop")
    if shared:
        return key_pages, None
    value = kv_cache.quantized(value, v_scale, value_pages.dtype)
    value_pages = value_pages.at[page, row].set(value, mode="drop")
    return key_pages, value_pages


def _attend(options, sinks, cache: kv_cache.CacheArgs, q, k, v, lengths, block_tables):
    """(out, lse) of one decode call: the reference on the "xla" backend, else the kernel
    differentiated through the reference; then the sinks. With sinks both also return the keys'
    log_sum, from which a sink's share is exact where lse rounds it away. A shared latent
    cache (v None) is passed as its own value cache (one array twice: no copy), which the
    kernel does not read and the reference slices. A contiguous cache's reference runs on
    whole sequences (`_partition.whole_sequences`)."""
    with_log_sum = sinks is not None
    args = (q, k, k if v is None else v, lengths, block_tables, cache.k_scale, cache.v_scale)
    reference = functools.partial(
        _reference if block_tables is not None else _partition.whole_sequences(_reference),
        **options.math,
        value_head_dim=cache.value_head_dim,
        with_log_sum=with_log_sum,
    )
    if options.backend == "xla":
        out, lse, *log_sum = reference(*args)
    else:
        config = _passes.DecodeConfig(**options.kernel, with_log_sum=with_log_sum)
        kernel = functools.partial(_partitioned_kernel, config=config)
        out, lse, *log_sum = with_reference_vjp(kernel, reference, *args)
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks, *log_sum)
    return out, lse


def _partitioned_kernel(*args, config: _passes.DecodeConfig):
    """The kernel on (q, k, v, lengths, block_tables, k_scale, v_scale) (a contiguous cache's
    block_tables None, an unscaled cache's scales None), split over a device mesh's batch and
    head axes as `flash_attention`'s passes are (`_partition.partitioned`): each device reads
    its own sequences' and heads' caches, with no collective. A paged cache's pool is shared by
    the batch: it is split over heads only. A contiguous cache may also be split over its
    sequence (`_passes.decode.over_context`). The scales split with the KV heads. One way down:
    `_partition` runs `_passes.decode` on each shard, which calls the kernel's wrapper."""
    paged = args[4] is not None
    shared = config.value_head_dim is not None  # v is k: sharded as k
    kv, v_kind = ("pages", "vpages") if paged else ("kv", "v")
    kinds = ("q", kv, kv if shared else v_kind, "lengths", "tables", "scale", "scale")
    out_kinds = ("o", "lse", "lse") if config.with_log_sum else ("o", "lse")
    return tuple(_partition.partitioned(_passes.decode, config, kinds, out_kinds, *args))


# -- the reference (the "xla" backend, and the gradient of the kernel) ----------------------------


def decode_reference(q, k, v, lengths, *, scale, soft_cap, window_left, with_log_sum=False):
    """(out, lse) of `decode_attention` by plain jnp over the whole cache; with_log_sum: and
    log_sum (`reference_attention`'s)."""
    batch, q_len = q.shape[:2]
    capacity = k.shape[1]
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, capacity)
    keys = jnp.arange(capacity)[None, None, :]
    q_pos = lengths[:, None, None] - q_len + jnp.arange(q_len)[None, :, None]  # [B, T, 1]
    visible = keys <= q_pos
    if window_left is not None:
        visible = visible & (keys >= q_pos - window_left)
    # Slots past a sequence's length may hold anything (NaN): 0 * NaN would reach the output.
    stored = (jnp.arange(capacity)[None, :] < lengths[:, None])[:, :, None, None]
    k, v = jnp.where(stored, k, 0), jnp.where(stored, v, 0)
    spec = MaskSpec(q_len=q_len, kv_len=capacity, mask_shape=(batch, 1, q_len, capacity))
    arrays = MaskArrays(mask=visible[:, None].astype(jnp.int8))
    return reference_attention(
        q,
        k,
        v,
        None,
        arrays,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        with_log_sum=with_log_sum,
    )


def paged_reference(
    q, k_pages, v_pages, lengths, block_tables, *, scale, soft_cap, window_left, with_log_sum=False
):
    """(out, lse[, log_sum]) of `paged_attention` by gathering each sequence's pages into a
    contiguous cache and running `decode_reference`."""
    batch, max_pages = block_tables.shape
    num_pages, page_size = k_pages.shape[:2]
    tables = jnp.clip(block_tables, 0, num_pages - 1)

    def gather(pages):
        return pages[tables].reshape(batch, max_pages * page_size, *pages.shape[2:])

    return decode_reference(
        q,
        gather(k_pages),
        gather(v_pages),
        lengths,
        scale=scale,
        soft_cap=soft_cap,
        window_left=window_left,
        with_log_sum=with_log_sum,
    )


def reference(
    q,
    k,
    v,
    lengths,
    block_tables,
    k_scale,
    v_scale,
    *,
    scale,
    soft_cap,
    window_left,
    value_head_dim=None,
    with_log_sum=False,
):
    """(out, lse[, log_sum]) of a decode call on its kernel's operands (`_partitioned_kernel`'s:
    block_tables None for a contiguous cache, scales None unless float8), by dequantising the
    cache first (`kv_cache.dequantized`: in the queries' dtype), taking a shared latent cache's
    values from its keys (value_head_dim), and `decode_reference` or `paged_reference`."""
    k = kv_cache.dequantized(k, k_scale, q.dtype)
    if value_head_dim is None:
        v = kv_cache.dequantized(v, v_scale, q.dtype)
    else:
        v = k[..., :value_head_dim]
    math_kwargs = dict(
        scale=scale, soft_cap=soft_cap, window_left=window_left, with_log_sum=with_log_sum
    )
    if block_tables is None:
        return decode_reference(q, k, v, lengths, **math_kwargs)
    return paged_reference(q, k, v, lengths, block_tables, **math_kwargs)


# One jit'd function of its static options (as the kernel's, `_passes._decode_forward`): eager
# calls (a Python generation loop) compile it once, not at every call.
_MATH = ("scale", "soft_cap", "window_left")
_reference = jax.jit(reference, static_argnames=(*_MATH, "value_head_dim", "with_log_sum"))


# -- validation -----------------------------------------------------------------------------------


class _Options:
    """The checked options of a decode or ragged call: `backend` ("xla" or "triton"), `math`
    for the reference, `kernel` for the Triton kernel."""

    def __init__(self, backend, math_kwargs, kernel_kwargs):
        self.backend, self.math, self.kernel = backend, math_kwargs, kernel_kwargs

    @classmethod
    def of(
        cls,
        query,
        sinks,
        scale,
        soft_cap,
        window,
        return_residuals,
        backend,
        block_sizes,
        interpret,
        *,
        cache: kv_cache.CacheArgs,
        fp8: bool,
        tiles=DecodeBlockSizes,
        no_mosaic="decode has no Mosaic GPU kernel (it is bound by memory bandwidth, which "
        "the Triton kernel reaches)",
    ):
        """Checks the options that decode, paged and ragged attention share. tiles: the
        block_sizes class the call takes; no_mosaic: why backend='mosaic' is refused (None:
        taken, the backend is then "mosaic" where the device runs it)."""
        api._check_sinks(sinks, query.shape[-2])
        api._check_options(scale, False, return_residuals, backend, None, interpret)
        if block_sizes is not None and not isinstance(block_sizes, tiles):
            raise TypeError(
                f"block_sizes must be a pallas_flash.{tiles.__name__} or None, "
                f"got {type(block_sizes).__name__}"
            )
        if backend == "mosaic" and no_mosaic is not None:
            raise NotImplementedError(
                f"backend='mosaic': {no_mosaic}; use backend='triton' or None"
            )
        device = None if interpret or backend == "xla" else device_lib.target_device()
        requested = backend
        backend = dispatch.kernel_backend(backend, device, interpret, query.dtype)
        backend = "triton" if backend == "auto" else backend
        if fp8:
            backend = dispatch.float8_cache_backend(backend, requested, device)
        if block_sizes is not None and backend == "xla":
            raise ValueError("block_sizes configures the Triton kernel: it needs backend='triton'")
        head_dim = query.shape[-1]
        window = api._canonical_window(window)
        math_kwargs = dict(
            scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
            soft_cap=api._canonical_soft_cap(soft_cap),
            window_left=None if window is None else window[0],
        )
        interpret = bool(interpret)
        # The split count fills the SMs of the GPU the call is traced for; the tiles (None) are
        # chosen for the shapes each device runs (`_passes.decode`).
        num_sms = device.num_sms if device is not None else device_lib.DEFAULT_NUM_SMS
        kernel_kwargs = dict(
            math_kwargs,
            block_sizes=block_sizes,
            interpret=interpret,
            num_sms=num_sms,
            value_head_dim=cache.value_head_dim,
        )
        return cls(backend, math_kwargs, kernel_kwargs)


def _check_arrays(query, key, value, names):
    """Checks the query and the cache (contiguous [B, S, K, H] or pages [P, ps, K, H]; value
    None: a shared latent cache, whose head dims `_check_cache` checks)."""
    k_name, v_name = names
    arrays = {"query": query, k_name: key}
    if value is not None:
        arrays[v_name] = value
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4, got {name}.shape={x.shape}")
    _check_cache_dtypes(arrays, k_name, v_name)
    if value is not None and key.shape != value.shape:
        raise ValueError(
            f"{k_name}.shape={key.shape} and {v_name}.shape={value.shape} must be equal"
        )
    b, t, n, h = query.shape
    kb, s, kh, _ = key.shape
    if k_name == "key_cache" and kb != b:
        raise ValueError(
            f"batch sizes differ: query.shape={query.shape}, {k_name}.shape={key.shape}"
        )
    if min(b, t, n, h, kb, s, kh) < 1:
        raise ValueError(
            f"every dimension must be >= 1; got query.shape={query.shape}, "
            f"{k_name}.shape={key.shape}"
        )
    api._check_heads(query, key, ("query", k_name), latent=value is None)
    return query, key, value


def _check_cache_dtypes(arrays: dict, k_name: str, v_name: str):
    """The dtype rule (`api._check_dtypes`; arrays: {name: array}, the queries first), or
    caches of float8_e4m3fn (both of them) under queries of a float dtype."""
    (q_name, *names), (query, *caches) = list(arrays), list(arrays.values())
    for name, x in zip(names, caches, strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 1:
            if not kv_cache.is_fp8(x.dtype):
                raise TypeError(
                    f"{name}.dtype={x.dtype} must be float16, bfloat16, float32 or float64, or "
                    "float8_e4m3fn (with scales)"
                )
    fp8 = [kv_cache.is_fp8(x.dtype) for x in caches]
    if not any(fp8):
        api._check_dtypes(arrays)
        return
    api._check_dtypes({q_name: query})
    if not all(fp8):
        got = ", ".join(f"{name}.dtype={x.dtype}" for name, x in arrays.items())
        raise TypeError(
            f"{q_name}, {k_name} and {v_name} must share a dtype, or the caches both be "
            f"float8_e4m3fn; got {got}"
        )


def _check_cache(query, key, value, names, value_head_dim, k_scale, v_scale):
    """The cache's format (`kv_cache`): a shared latent cache's value_head_dim, a float8
    cache's scales."""
    k_name, v_name = names
    hv = kv_cache.check_value_head_dim(value_head_dim, key, value, k_name, v_name)
    k_scale, v_scale = kv_cache.check_scales(
        k_scale, v_scale, key, key.shape[2], k_name, shared=hv is not None
    )
    return kv_cache.CacheArgs(hv, k_scale, v_scale)


def _check_int_vector(name, x, batch):
    api._check_int_vector(name, x, batch)
    return jnp.asarray(x, jnp.int32)


def _check_lengths(name, lengths, batch, capacity, capacity_text):
    api._check_lengths(name, lengths, batch, capacity, capacity_text)
    return jnp.asarray(lengths, jnp.int32)


def _check_block_tables(block_tables, batch=None):
    """block_tables: an integer array (batch, max_pages), max_pages >= 1; batch None: any
    batch >= 1 (ragged attention takes its batch from the table)."""
    if not api._is_int_array(block_tables):
        got = getattr(block_tables, "dtype", type(block_tables).__name__)
        raise TypeError(f"block_tables must be an integer array, got {got}")
    shape = tuple(block_tables.shape)
    if len(shape) != 2 or min(shape) < 1 or batch not in (None, shape[0]):
        rows = "B" if batch is None else batch
        raise ValueError(f"block_tables.shape={shape} must be ({rows}, max_pages), both >= 1")
    return jnp.asarray(block_tables, jnp.int32)


def _check_table_entries(block_tables, lengths, page_size, num_pages):
    """The table entries a sequence reads must name pages of the pool (when concrete)."""
    tables, lens = api._concrete(block_tables), api._concrete(lengths)
    if tables is None or lens is None:
        return
    _check_pages(tables, 0, -(-lens // page_size), num_pages, lambda b: f"has {lens[b]} keys")


def _check_pages(tables, first, end, num_pages, what):
    """Raises ValueError where a table entry in columns [first[b], end[b]) of row b (numpy)
    names no page of the pool; what(b): what sequence b does with those pages."""
    columns = np.arange(tables.shape[1])[None, :]
    first, end = (np.broadcast_to(x, tables.shape[:1])[:, None] for x in (first, end))
    used = (columns >= first) & (columns < end)
    bad = used & ((tables < 0) | (tables >= num_pages))
    if bad.any():
        b, p = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {p}]={int(tables[b, p])} must lie in [0, num_pages={num_pages}) "
            f"(sequence {b} {what(b)})"
        )


def _check_placements(block_tables, positions, counts, q_len, page_size, num_pages):
    """write_to_pages' concrete positions and counts (int32 (B,), checked) and table entries:
    each token written must have a slot of its sequence and a page of the pool. Traced ones
    are left to the write, which drops what it cannot place."""
    pos = api._concrete(positions)
    num = None if counts is None else api._concrete(counts)
    if num is not None and ((num < 0) | (num > q_len)).any():
        raise ValueError(f"counts={num.tolist()} must lie in [0, T={q_len}] (key.shape[1])")
    if pos is None:
        return
    if (pos < 0).any():
        raise ValueError(f"positions={pos.tolist()} must be >= 0")
    if counts is None:
        num, num_name = np.full(pos.shape, q_len), "T"
    elif num is None:
        return
    else:
        num_name = "counts[{b}]"
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    end = pos + num
    if (end > capacity).any():
        b = int(np.argmax(end > capacity))
        raise ValueError(
            f"positions[{b}] + {num_name.format(b=b)} = {pos[b]} + {num[b]} = {end[b]} must "
            f"be <= block_tables.shape[1] * page_size = {max_pages} * {page_size} = {capacity} "
            f"(the slots of sequence {b})"
        )
    tables = api._concrete(block_tables)
    if tables is None:
        return
    first = np.where(num > 0, pos // page_size, 0)
    last = np.where(num > 0, -(-end // page_size), 0)
    _check_pages(
        tables, first, last, num_pages, lambda b: f"writes positions {pos[b]}..{end[b] - 1}"
    )
