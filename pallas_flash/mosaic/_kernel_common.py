"""What the Mosaic GPU kernels share inside their bodies: 16-bit tiles in shared memory, per-row
and per-column vectors broadcast in wgmma's layout, and the backward's pieces (the recomputed
probabilities, the dropout mask, the dK/dV kernel's steps) that its dK/dV kernel, its fused dQ
and its dQ kernel share."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import _dropout
from pallas_flash._numerics import LOG2E
from pallas_flash.mosaic.launch import opaque_zero, smem_transforms, soft_cap_share


def tile_smem(shape, dtype):
    """A 16-bit tile [.., rows, cols] in shared memory under its column count's swizzle, as in
    the forward (`smem_transforms`): what TMA and wgmma both read without bank conflicts, also
    through a transposed view. Every wgmma of both backward kernels reads its two shared-memory
    operands at one column count: S^T = K Q^T and S = Q K^T at H, dP^T = V dO^T and
    dP = dO V^T at Hv; dV += P^T dO, dK += dS^T Q and dQ += dS K read one (B, transposed)."""
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(shape[-1], dtype))


def per_row(x, shape):
    """Broadcast a per-row vector [rows] (layout WGMMA.reduce(1)) over the columns of `shape`."""
    return lax.broadcast_in_dim(x, shape, [0])


def per_col(x, shape):
    """Broadcast a per-column vector [cols] (layout WGMMA.reduce(0)) over the rows of `shape`."""
    return lax.broadcast_in_dim(x, shape, [1])


def wgmma_iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def wgmma_zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def times(x, factor: float):
    """x * factor, without the multiply when factor is 1."""
    return x if factor == 1.0 else x * factor


def clip(x, lo, hi):
    """x clamped into [lo, hi]: in Python where all three are ints, else traced."""
    if all(isinstance(v, int) for v in (x, lo, hi)):
        return min(max(x, lo), hi)
    return jnp.minimum(jnp.maximum(x, lo), hi)


# -- the backward's kernels ------------------------------------------------------------------------


def recomputed_probs(s, lse2, bound, broadcast, *, qk_scale: float, scale: float, soft_cap):
    """(P, P * dcap) of an f32 tile of logits s = q.k from lse2 = lse * log2(e) (lowered) and
    bound = -log2 of the softmax denominator relative to the max (0: unknown) per query:
    P = exp2(min(logit * log2(e) - lse2, bound)), dcap the soft cap's derivative 1 - tanh^2
    (P itself without a cap).

    P <= 1 / l: lse is rounded, and a few ulps of a logit beyond 2^31 would overflow exp2; the
    lowered lse2 puts a row's largest logits on the clamp, so keys that tie at the max get
    exactly 1 / l however their logits round. lse2 is +inf for rows that see no key and rows
    past T: P = 0 there. The capped logits are the forward's (`forward._capped_logits`):
    tanh(x) = 1 - 2r with r = 1 / (exp(2x) + 1) (`launch.soft_cap_share`), whose 1 - tanh^2 =
    4r(1 - r) stays exact as tanh nears +-1 (where 1 - tanh * tanh would cancel), and is 0, not
    NaN, where exp2 overflows (r = 0) or underflows (r = 1).
    """
    lse2, bound = broadcast(lse2, s.shape), broadcast(bound, s.shape)
    if soft_cap is None:
        p = jnp.exp2(jnp.minimum(s * qk_scale - lse2, bound))
        return p, p
    cap2 = soft_cap * LOG2E
    r = soft_cap_share(jnp.exp2(s * (2.0 * LOG2E * scale / soft_cap)))
    p = jnp.exp2(jnp.minimum(cap2 - (2.0 * cap2) * r - lse2, bound))
    return p, p * (4.0 * r * (1.0 - r))


def tile_keep(q_hashes, kv_hashes, shape, *, rate: float, q_axis: int):
    """bool tile of `shape`: `_dropout.keep` of its (query row, key) pairs, the forward's
    keep-mask. q_hashes: (row_mul, row_add) of the tile's query rows, kv_hashes: the keys'
    col hashes, each a vector in the layout that broadcasts along the tile; q_axis: the tile
    axis of the query rows (0 in dQ, 1 in the transposed tiles of dK/dV)."""
    on_q, on_kv = (per_row, per_col) if q_axis == 0 else (per_col, per_row)
    row_mul, row_add = q_hashes
    return _dropout.keep(on_q(row_mul, shape), on_q(row_add, shape), on_kv(kv_hashes, shape), rate)


def step_zero(step, step_descriptors: bool):
    """0 for CTA step `step` (>= -1), computed once per step: with step_descriptors through
    `launch.opaque_zero`, so that the tiles a step's wgmmas address at block + it (K, V, the
    fused dQ's K^T and dS^T) have their descriptors rebuilt each step."""
    return opaque_zero(step) if step_descriptors else 0


def step_tile(step, first, cta_tiles):
    """The query tile of a dK/dV CTA's step: the CTA streams tiles [first, first + cta_tiles)
    of each head in turn."""
    return first + lax.rem(step, cta_tiles)
