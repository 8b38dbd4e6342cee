"""The KV cache formats of the decode calls (`decode_attention`, `paged_attention`,
`ragged_paged_attention`, `write_to_pages`) beyond keys and values of their own in the queries'
dtype: their validation, dequantisation (for the references) and quantisation (for writes).

- A shared latent cache (multi-head latent attention, MLA: DeepSeek-V2/V3, FlashMLA's
  `head_dim_v`): the value cache is None and the values are the first `value_head_dim` columns
  of the keys.
- float8_e4m3fn caches with float32 `k_scale` / `v_scale`, per tensor (shape ()) or per KV head
  (shape (K,)): the cache holds round(x / scale), the keys and values are its entries times
  the scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import api

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# e4m3's largest finite magnitude: quantised values saturate to it.
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
# A shared latent cache's widest values and their complement (MLA's 512 + 64).
MAX_VALUE_HEAD_DIM = 512
MAX_LATENT_EXTRA_DIM = 256


@dataclasses.dataclass(frozen=True)
class CacheArgs:
    """A call's checked cache format: value_head_dim (a shared latent cache's values, or None:
    a value cache of its own) and the scales as float32 (K,) arrays (None: not float8; for a
    shared cache v_scale is k_scale)."""

    value_head_dim: int | None
    k_scale: jax.Array | None
    v_scale: jax.Array | None

    @property
    def shared(self) -> bool:
        return self.value_head_dim is not None


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8_DTYPE


def check_value_head_dim(value_head_dim, key, value, k_name: str, v_name: str) -> int | None:
    """value_head_dim checked against the caches: required (an int, a multiple of 8 in
    [8, min(H, 512)], H - value_head_dim at most 256) where the value cache is None, refused
    where it is given. Returns it (None with a value cache)."""
    head_dim = key.shape[-1]
    if value is not None:
        if value_head_dim is not None:
            raise ValueError(
                f"value_head_dim={value_head_dim!r} is for a shared latent cache ({v_name}=None: "
                f"the values are the first value_head_dim columns of {k_name}); "
                f"{v_name}.shape={tuple(value.shape)} gives the values' own head dim"
            )
        return None
    if value_head_dim is None:
        raise ValueError(
            f"{v_name}=None (a shared latent cache: the values are the first columns of "
            f"{k_name}) needs value_head_dim, their count"
        )
    if isinstance(value_head_dim, bool) or not isinstance(value_head_dim, (int, np.integer)):
        raise TypeError(f"value_head_dim={value_head_dim!r} must be an int")
    hv = int(value_head_dim)
    if hv < 8 or hv % 8 or hv > min(head_dim, MAX_VALUE_HEAD_DIM):
        raise ValueError(
            f"value_head_dim={hv} must be a multiple of 8 in [8, min(H, {MAX_VALUE_HEAD_DIM})] "
            f"(H={head_dim}: {k_name}.shape={tuple(key.shape)})"
        )
    if head_dim - hv > MAX_LATENT_EXTRA_DIM or head_dim % 8:
        raise ValueError(
            f"{k_name}.shape={tuple(key.shape)}: a shared latent cache's H={head_dim} must be a "
            f"multiple of 8 and at most value_head_dim + {MAX_LATENT_EXTRA_DIM} "
            f"(value_head_dim={hv})"
        )
    return hv


def check_scales(k_scale, v_scale, key, num_kv_heads: int, k_name: str, shared: bool):
    """The scales checked against the cache dtype: both required for a float8 cache (only
    k_scale for a shared one), refused otherwise; shape () or (K,), a Python number or a
    floating array, finite and > 0 when concrete. Returns them as float32 (K,) arrays (v_scale
    the key scale for a shared cache), or (None, None)."""
    fp8 = is_fp8(key.dtype)
    given = [("k_scale", k_scale)] + ([] if shared else [("v_scale", v_scale)])
    if shared and v_scale is not None:
        raise ValueError(
            "v_scale is for a value cache of its own: a shared latent cache's values are its "
            "keys' first columns, scaled by k_scale"
        )
    if not fp8:
        for name, x in given:
            if x is not None:
                raise ValueError(
                    f"{name} is for float8_e4m3fn caches (the cache holds x / scale); "
                    f"{k_name}.dtype={key.dtype} holds the keys and values themselves"
                )
        return None, None
    missing = [name for name, x in given if x is None]
    if missing:
        raise ValueError(
            f"{k_name}.dtype=float8_e4m3fn needs {' and '.join(missing)}: the cache holds "
            "round(x / scale), and its entries times the scale are the keys and values "
            f"(a float32 scalar, or one per KV head: shape ({num_kv_heads},))"
        )
    scales = [_check_scale(name, x, num_kv_heads) for name, x in given]
    return scales[0], scales[0] if shared else scales[1]


def _check_scale(name, x, num_kv_heads: int):
    if isinstance(x, bool):
        raise TypeError(f"{name}={x!r} must be a float or a floating array")
    if isinstance(x, (int, float, np.integer, np.floating)):
        x = np.float32(x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a float or a floating array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype (float32)")
    if tuple(x.shape) not in ((), (num_kv_heads,)):
        raise ValueError(
            f"{name}.shape={tuple(x.shape)} must be () (per tensor) or ({num_kv_heads},) (per "
            "KV head)"
        )
    concrete = api._concrete(x)
    if concrete is not None:
        values = np.asarray(concrete, np.float64)
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(f"{name}={values.tolist()} must be finite and > 0")
    return jnp.broadcast_to(jnp.asarray(x, jnp.float32), (num_kv_heads,))


# -- the references' dequantisation, and write_to_pages' quantisation -----------------------------


def dequantized(x, scale, dtype):
    """A cache [..., K, D] as the keys or values it holds, in `dtype`: x itself without a scale,
    else x times its KV head's scale (float32 (K,)), rounded once to dtype."""
    if scale is None:
        return x
    wide = jnp.promote_types(dtype, jnp.float32)  # float64 stays float64
    return (x.astype(wide) * scale[:, None].astype(wide)).astype(dtype)


def quantized(x, scale, dtype):
    """x [B, T, K, D] for a cache of `dtype`: float8_e4m3fn with a scale (float32 (K,)): x / scale
    rounded to the nearest e4m3 value (ties to even), saturated to +-448 (e4m3's largest
    finite; NaN stays NaN); else x itself."""
    if scale is None:
        return x
    scaled = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(dtype)
