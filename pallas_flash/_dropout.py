"""The dropout keep-mask: a stateless hash of (seed, batch, head, query row, key column).

One implementation for the kernels and the plain-jnp reference: `head_seeds` (outside the
kernels) turns the PRNG key into one 32-bit seed per (batch, head); `keep` (inside the kernels,
or in jnp on whole arrays) hashes that seed with a row and a column index. Only uint32
multiplies, xors and logical shifts, which Triton lowers; the mask depends on the global
indices only, so it is the same for every tiling, and the backward regenerates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# murmur3's 32-bit finaliser constants, and two odd multipliers that spread the row and column
# counters over all 32 bits before mixing.
_FMIX1 = np.uint32(0x85EBCA6B)
_FMIX2 = np.uint32(0xC2B2AE35)
_ROW = np.uint32(0x9E3779B1)
_COL = np.uint32(0x27D4EB2F)
_HEAD = np.uint32(0x165667B1)
# The keep test compares the hash's top 24 bits with the rate: u = (h >> 8) / 2**24.
_BITS = 24


def _fmix(h):
    h = h ^ lax.shift_right_logical(h, np.uint32(16))
    h = h * _FMIX1
    h = h ^ lax.shift_right_logical(h, np.uint32(13))
    h = h * _FMIX2
    return h ^ lax.shift_right_logical(h, np.uint32(16))


def _u32(x):
    return lax.convert_element_type(x, jnp.uint32)


def key_words(rng):
    """The uint32 words of a PRNG key: a typed key's data, or a raw uint32[2] key."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return jnp.ravel(rng).astype(jnp.uint32)


def head_seeds(rng, batch: int, num_heads: int, *, shared: bool = False):
    """int32 [batch, num_heads]: the seed of each (batch entry, query head) for `keep`; with
    `shared`, one seed for all of them (one keep-mask over [T, S], as Flax's broadcast_dropout)."""
    words = key_words(rng)
    h = _fmix(words[0] ^ _HEAD)  # a nonzero start: the all-zero key must mix too
    for i in range(1, words.shape[0]):
        h = _fmix(h ^ words[i])
    b = _u32(jnp.arange(batch, dtype=jnp.int32))[:, None]
    n = _u32(jnp.arange(num_heads, dtype=jnp.int32))[None, :]
    if shared:  # every (batch entry, head) hashes as (0, 0)
        b, n = jnp.zeros_like(b), jnp.zeros_like(n)
    h = _fmix(h ^ (b * _ROW))
    h = _fmix(h ^ (n * _HEAD))
    return jnp.broadcast_to(lax.bitcast_convert_type(h, jnp.int32), (batch, num_heads))


def threshold(rate: float) -> int:
    """The keep test's threshold: keep when the hash's top 24 bits are >= it."""
    return int(round(float(rate) * (1 << _BITS)))


def keep(seed, rows, cols, rate: float):
    """bool, broadcast of rows and cols: whether P[row, col] is kept. seed: an int32 scalar or an
    array broadcasting against rows and cols (`head_seeds`); rows, cols: int32 global query and
    key positions. The row is mixed first, so a tile pays one finaliser per row and one per
    element."""
    h = _fmix(_u32(seed) ^ (_u32(rows) * _ROW))
    h = _fmix(h ^ (_u32(cols) * _COL))
    u = lax.convert_element_type(lax.shift_right_logical(h, np.uint32(32 - _BITS)), jnp.int32)
    return u >= threshold(rate)


def kept_scale(keep_mask, rate: float):
    """float32 1 / (1 - rate) where kept, 0 where dropped."""
    return jnp.where(keep_mask, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def dense_keep(seeds, q_len: int, kv_len: int, rate: float):
    """bool [B, N, T, S]: the whole keep-mask of seeds [B, N] (for the reference and tests)."""
    rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    cols = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    return keep(seeds[:, :, None, None], rows, cols, rate)
