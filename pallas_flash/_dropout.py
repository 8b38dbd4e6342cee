"""The dropout keep-mask: a stateless hash of (seed, batch, head, query row, key column).

One implementation for the kernels and the plain-jnp reference. `head_seeds` (outside the
kernels) turns the PRNG key into one 32-bit seed per (batch, head). `tables` (outside the kernels,
in XLA: a few operations per row and column) hashes each seed with every row and every column
index: a multiplier R (odd) and an addend D per query row, a key C per key column, each a full
32-bit finaliser of (seed, index). `keep` combines them per element with one multiply-add,

    x = R[row] * C[col] + D[row]  (mod 2**32),   kept iff x >= rate * 2**32,

which is one integer instruction and a compare per element in the kernels (the finalisers run
once per row and column, not per element). For one row, (R, D) is a random multiply-add hash
function applied to the columns' keys, whose top bits are (nearly) pairwise independent over
distinct keys (multiply-add-shift hashing, Dietzfelbinger 1996); two rows share the keys but draw
independent (R, D). The mask depends on the global indices only, so it is the same for every
tiling, and the backward regenerates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# murmur3's 32-bit finaliser constants, and odd multipliers that spread the row and column
# counters over all 32 bits before mixing (and tell the tables' hashes apart).
_FMIX1 = np.uint32(0x85EBCA6B)
_FMIX2 = np.uint32(0xC2B2AE35)
_ROW = np.uint32(0x9E3779B1)
_COL = np.uint32(0x27D4EB2F)
_HEAD = np.uint32(0x165667B1)
_ADD = np.uint32(0x61C88647)


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
    """int32 [batch, num_heads]: the seed of each (batch entry, query head) for `tables`; with
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


def threshold(rate: float) -> np.uint32:
    """The keep test's threshold: keep when the 32-bit x of `keep` is >= it."""
    return np.uint32(min(round(float(rate) * 2**32), 2**32 - 1))


def tables(seeds, q_len: int, kv_len: int):
    """int32 (row_mul [B, N, T], row_add [B, N, T], col [B, N, S]) of seeds [B, N]: the hashes
    `keep` combines (as uint32 bits). row_mul is odd, so that R * C spreads C over all 32 bits."""
    s = _u32(seeds)[..., None]
    rows = _u32(jnp.arange(q_len, dtype=jnp.int32)) * _ROW
    cols = _u32(jnp.arange(kv_len, dtype=jnp.int32)) * _COL
    row_mul = _fmix(s ^ rows) | np.uint32(1)
    row_add = _fmix(row_mul ^ _ADD)
    col = _fmix(_fmix(s ^ _COL) ^ cols)
    return tuple(lax.bitcast_convert_type(x, jnp.int32) for x in (row_mul, row_add, col))


def keep(row_mul, row_add, col, rate: float):
    """bool, broadcast of the arguments: whether P[row, col] is kept. row_mul, row_add: the
    rows' entries of `tables` (int32), col the columns', shaped to broadcast (a tile: [rows, 1]
    and [1, cols], or transposed)."""
    x = _u32(row_mul) * _u32(col) + _u32(row_add)
    return x >= threshold(rate)


def kept_scale(keep_mask, rate: float):
    """float32 1 / (1 - rate) where kept, 0 where dropped."""
    return jnp.where(keep_mask, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def dense_keep(seeds, q_len: int, kv_len: int, rate: float):
    """bool [B, N, T, S]: the whole keep-mask of seeds [B, N] (for the reference and tests)."""
    row_mul, row_add, col = tables(seeds, q_len, kv_len)
    return keep(row_mul[..., :, None], row_add[..., :, None], col[..., None, :], rate)
