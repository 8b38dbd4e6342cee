"""Problems and their random inputs: the dtypes and Triton tile sizes the tests use, `Problem`
(the shapes and options of one call), random arrays with their float64 copies, segment ids, and
the ids of parametrized cases."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash import masks
from support.oracle import to64
from support.tolerance import FLOOR

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def uniform_block_sizes(n: int) -> pallas_flash.BlockSizes:
    """Every tile of every Triton kernel n x n."""
    return pallas_flash.BlockSizes(
        block_q=n, block_kv=n, block_q_dkv=n, block_kv_dkv=n, block_q_dq=n, block_kv_dq=n
    )


# Block-size configurations used by the tests (None: the library's default for the mode).
BLOCK_SIZES = {
    "default": None,
    "all16": uniform_block_sizes(16),
    "q32kv16": pallas_flash.BlockSizes(
        block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16
    ),
    "q16kv64": pallas_flash.BlockSizes(
        block_q=16, block_kv=64, block_q_dkv=64, block_kv_dkv=16, block_q_dq=16, block_kv_dq=64
    ),
}


# Small tiles (the mask tests' and the property sweep's), so that test sizes run several tiles;
# unequal query and key tiles too (the tile ranges of windows and masks are computed per tile on
# each side).
BLOCKS = {
    "16": uniform_block_sizes(16),
    "32": uniform_block_sizes(32),
    "q32kv16": BLOCK_SIZES["q32kv16"],
    "q16kv64": BLOCK_SIZES["q16kv64"],
}


def case_id(value) -> str:
    """A parametrized case's id: kernel tiles (`pallas_flash.BlockSizes`, the Mosaic
    `ForwardTiles` and `BackwardTiles`) by the fields that differ from their defaults, so that
    a field added to them does not rename every case; anything else by str."""
    from pallas_flash.mosaic import BackwardTiles, ForwardTiles

    if not isinstance(value, (pallas_flash.BlockSizes, ForwardTiles, BackwardTiles)):
        return str(value)
    changed = [
        f"{field.name}={getattr(value, field.name)!r}"
        for field in dataclasses.fields(value)
        if field.default is dataclasses.MISSING or getattr(value, field.name) != field.default
    ]
    return f"{type(value).__name__}({', '.join(changed)})"


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes and options of one attention call: q [B, T, N, H], k and v [B, S, K, H]."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_causal: bool
    dtype: str = "f32"
    blocks: str = "default"

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def floor(self) -> float:
        return FLOOR[self.jnp_dtype]

    @property
    def block_sizes(self):
        return BLOCK_SIZES[self.blocks]

    def __str__(self):
        mask = "causal" if self.is_causal else "full"
        return (
            f"B{self.batch}-T{self.q_len}-S{self.kv_len}-N{self.num_heads}-K{self.num_kv_heads}"
            f"-H{self.head_dim}-{mask}-{self.dtype}-{self.blocks}"
        )


# Larger problems, compiled for the GPU only (the interpreter would take minutes).
GPU_PROBLEMS = [
    Problem(2, 1000, 1000, 8, 2, 128, True, "bf16"),
    Problem(2, 1000, 1000, 8, 2, 128, False, "bf16"),
    Problem(1, 1000, 1000, 4, 4, 256, True, "bf16"),
    Problem(1, 1000, 777, 4, 1, 256, False, "f16"),
    Problem(1, 777, 1000, 4, 2, 80, True, "f32"),
    Problem(2, 1000, 1000, 16, 2, 64, True, "f16"),
    Problem(1, 300, 300, 2, 2, 256, True, "f32"),
]


def random_array(rng, shape, dtype):
    """Standard normal values rounded to `dtype`: (jax array, the same values as float64)."""
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def random_inputs(p: Problem, seed: int = 0):
    """q, k, v and cotangents d_out (input dtype), d_lse (float32) for `p`.

    Returns (jax arrays, float64 copies) as two tuples (q, k, v, d_out, d_lse).
    """
    rng = np.random.default_rng(seed)
    q_shape = (p.batch, p.q_len, p.num_heads, p.head_dim)
    kv_shape = (p.batch, p.kv_len, p.num_kv_heads, p.head_dim)
    lse_shape = (p.batch, p.num_heads, p.q_len)
    pairs = [
        random_array(rng, q_shape, p.jnp_dtype),
        random_array(rng, kv_shape, p.jnp_dtype),
        random_array(rng, kv_shape, p.jnp_dtype),
        random_array(rng, q_shape, p.jnp_dtype),
        random_array(rng, lse_shape, jnp.float32),
    ]
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


def normal(rng, shape, dtype=jnp.float32):
    """Standard normal values rounded to `dtype`, as a jax array."""
    return jnp.asarray(rng.standard_normal(shape), dtype)


def rounded(rng, shape, dtype, scale=1.0):
    """Normal values times `scale` rounded to `dtype`: (jax array, the same values in float64)."""
    x = jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return x, to64(x)


# -- segment ids ----------------------------------------------------------------------------------

SEGMENT_KINDS = ("one-document", "packed", "lengths", "packed-lengths", "unsorted", "gap")


def segment_arrays(kind: str, batch: int, q_len: int, kv_len: int, seed: int = 0):
    """MaskArrays with segment ids [B, T] and [B, S], lengths folded in (`masks.make_arrays`).

    kind: "one-document" (all ids 0: the geometry alone); "packed" (sorted ids 0-3, the same
    for queries and keys when T == S); "lengths" (query and key lengths: padding rows that see
    no key, the last batch entry with no key at all); "packed-lengths" (both); "unsorted"
    (random ids 0-2: many masked tiles); "gap" (query rows of ids 0 then 2, keys of ids 0, 1,
    2: the consumers of a CTA may visit tiles far apart, leaving a gap both drain).
    """
    rng = np.random.default_rng(seed)
    kwargs = {}
    if kind in ("packed", "packed-lengths"):
        q_ids = np.sort(rng.integers(0, 4, size=(batch, q_len)), axis=1)
        kv_ids = q_ids if q_len == kv_len else np.sort(rng.integers(0, 4, size=(batch, kv_len)))
        kwargs.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    elif kind == "unsorted":
        kwargs.update(
            q_segment_ids=rng.integers(0, 3, size=(batch, q_len)),
            kv_segment_ids=rng.integers(0, 3, size=(batch, kv_len)),
        )
    elif kind == "gap":
        q_ids = np.where(np.arange(q_len) % 128 < 64, 0, 2)
        kv_ids = np.where(np.arange(kv_len) < kv_len // 8, 0, 1)
        kv_ids = np.where(np.arange(kv_len) >= kv_len - kv_len // 8, 2, kv_ids)
        kwargs.update(
            q_segment_ids=np.broadcast_to(q_ids, (batch, q_len)),
            kv_segment_ids=np.broadcast_to(kv_ids, (batch, kv_len)),
        )
    elif kind not in ("one-document", "lengths"):
        raise ValueError(f"{kind=} is not one of {SEGMENT_KINDS}")
    if kind in ("lengths", "packed-lengths"):
        kwargs.update(
            query_seq_lengths=np.concatenate(
                [rng.integers(1, q_len + 1, size=batch - 1), [q_len // 3]]
            ),
            key_value_seq_lengths=np.concatenate(
                [rng.integers(1, kv_len + 1, size=batch - 1), [0]]
            ),
        )
    if not kwargs:
        kwargs["q_segment_ids"] = np.zeros((batch, q_len), np.int32)
    return masks.make_arrays(batch, q_len, kv_len, **kwargs)


def abstract_inputs(p: Problem):
    """q, k, v, d_out, d_lse as ShapeDtypeStructs."""
    q = jax.ShapeDtypeStruct((p.batch, p.q_len, p.num_heads, p.head_dim), p.jnp_dtype)
    kv = jax.ShapeDtypeStruct((p.batch, p.kv_len, p.num_kv_heads, p.head_dim), p.jnp_dtype)
    lse = jax.ShapeDtypeStruct((p.batch, p.num_heads, p.q_len), jnp.float32)
    return q, kv, kv, q, lse
