"""Who may attend whom: the one description of masking that every backend uses.

A `MaskSpec` holds the static part of the mask (sequence lengths of the call, causality). It answers
three questions, each for one consumer:

* `visible(q_idx, kv_idx)`: the element-wise predicate, evaluated by kernels on boundary tiles only
  and by the reference on the whole [T, S] grid;
* `kv_tile_range(q_start, block_q, block_kv)`: which KV tiles a query tile visits, and which of them
  are fully visible (no per-element masking needed) -- the forward and dQ kernels loop over these;
* `q_tile_range(kv_start, block_q, block_kv)`: the mirror image, for the dK/dV kernel.

Tile ranges are `(lo, full_lo, full_hi, hi)` with `lo <= full_lo <= full_hi <= hi`: tiles in
`[lo, full_lo)` and `[full_hi, hi)` are partially visible (masked element-wise), tiles in
`[full_lo, full_hi)` are fully visible, tiles outside `[lo, hi)` are never loaded. The functions
work on Python ints and on traced int32 scalars alike (program ids inside a kernel).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


def _cdiv(a, b):
    return (a + b - 1) // b


def _min(a, b):
    return jnp.minimum(a, b) if _traced(a, b) else min(a, b)


def _max(a, b):
    return jnp.maximum(a, b) if _traced(a, b) else max(a, b)


def _traced(*xs):
    return any(not isinstance(x, int) for x in xs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """Static description of the attention mask.

    Attributes:
      q_len: T, the number of queries.
      kv_len: S, the number of keys.
      is_causal: query i sees key j only when j <= i (top-left aligned, as in jax.nn).
    """

    q_len: int
    kv_len: int
    is_causal: bool = False

    def visible(self, q_idx, kv_idx):
        """Boolean visibility of (query, key) index pairs; broadcasts like its arguments."""
        ok = kv_idx < self.kv_len
        if self.is_causal:
            ok = ok & (kv_idx <= q_idx)
        return ok

    def dense(self):
        """The [T, S] visibility matrix, for the reference implementation."""
        q = np.arange(self.q_len)[:, None]
        k = np.arange(self.kv_len)[None, :]
        return jnp.asarray(self.visible(q, k))

    def kv_tile_range(self, q_start, block_q: int, block_kv: int):
        """KV tiles seen by queries [q_start, q_start + block_q): (lo, full_lo, full_hi, hi)."""
        hi = _cdiv(self.kv_len, block_kv)
        full_hi = self.kv_len // block_kv
        if self.is_causal:
            # The last query of the tile sees keys <= q_start + block_q - 1; the first query sees
            # keys <= q_start, so tiles ending at or before q_start + 1 are visible to every row.
            hi = _min(hi, _cdiv(q_start + block_q, block_kv))
            full_hi = _min(full_hi, (q_start + 1) // block_kv)
        return 0, 0, full_hi, hi

    def q_tile_range(self, kv_start, block_q: int, block_kv: int):
        """Query tiles that see keys [kv_start, kv_start + block_kv): (lo, full_lo, full_hi, hi).

        A ragged last query tile counts as full: its rows past T are zero-filled on load (zero
        query, zero output gradient, zero lse and delta), so they contribute nothing.
        """
        lo, full_lo, hi = 0, 0, _cdiv(self.q_len, block_q)
        if self.is_causal:
            # Query i sees some key of the tile if i >= kv_start, all of them if
            # i >= kv_start + block_kv - 1.
            lo = kv_start // block_q
            full_lo = _min(_cdiv(kv_start + block_kv - 1, block_q), hi)
        # A ragged last KV tile has keys past S: every query tile must mask it.
        full_hi = _where(kv_start + block_kv <= self.kv_len, hi, full_lo)
        return lo, full_lo, full_hi, hi


def _where(cond, a, b):
    if not _traced(cond, a, b):
        return a if cond else b
    # Arithmetic select: the Triton lowering cannot multiply or select i1 with i32 scalars.
    take_a = jnp.asarray(cond).astype(jnp.int32)
    return b + (a - b) * take_a
