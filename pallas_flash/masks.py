"""Who may attend whom: the one description of masking that every backend uses.

A key is visible to a query when every part of the mask allows it:

* geometry (static): keys past S are padding; `is_causal` (key j <= query i, top-left aligned);
  a local window (i - left <= j <= i + right);
* sequence lengths (arrays [B]): rows and keys past their batch entry's length see nothing;
* segment ids (arrays [B, T] and [B, S]): equal ids only (packed documents);
* a dense boolean mask, broadcastable to [B, N, T, S].

`MaskSpec` is the static part; `MaskArrays` holds the arrays. The module answers three questions:

* `visible(...)`: the element-wise predicate, evaluated by the kernels on boundary tiles only and
  the reference on the whole [T, S] grid;
* `MaskSpec.kv_tile_range` / `q_tile_range`: from geometry alone, which tiles a query tile (a
  KV tile) visits and which of them are fully visible; computed in the kernels from program ids;
* `tile_ranges(...)`: the same from the arrays, computed by XLA before the kernels, per batch entry
  (and head, for a per-head mask). The kernels intersect both.

A tile range is `(lo, full_lo, full_hi, hi)`, `lo <= full_lo <= full_hi <= hi`: tiles in
`[lo, full_lo)` and `[full_hi, hi)` are masked element-wise, tiles in `[full_lo, full_hi)` are
fully visible, tiles outside `[lo, hi)` are never loaded.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Segment ids the kernels give to rows and keys past their sequence length: never equal to each
# other, nor (by documented contract) to a user's segment id.
PAD_Q_SEGMENT = np.iinfo(np.int32).min
PAD_KV_SEGMENT = np.iinfo(np.int32).min + 1

_BIG = 1 << 30  # "unbounded" window side, far beyond any sequence length


def _traced(*xs):
    return any(not isinstance(x, (int, bool, np.integer)) for x in xs)


def _cdiv(a, b):
    return (a + b - 1) // b


def _min(a, b):
    return jnp.minimum(a, b) if _traced(a, b) else min(a, b)


def _max(a, b):
    return jnp.maximum(a, b) if _traced(a, b) else max(a, b)


def _clamp(x, lo, hi):
    return _min(_max(x, lo), hi)


def _where(cond, a, b):
    if not _traced(cond, a, b):
        return a if cond else b
    # Arithmetic select: the Triton lowering cannot multiply or select i1 with i32 scalars.
    take_a = jnp.asarray(cond).astype(jnp.int32)
    return b + (a - b) * take_a


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """Static description of the mask.

    Attributes:
      q_len, kv_len: T and S.
      is_causal: key j visible to query i only when j <= i.
      window: (left, right) or None: key j visible to query i only when i - left <= j <= i + right.
      has_segments: the call has segment ids and/or sequence lengths (arrays in MaskArrays).
      mask_shape: the shape of the dense boolean mask, 4-D with broadcast dims of size 1, or None.
    """

    q_len: int
    kv_len: int
    is_causal: bool = False
    window: tuple[int, int] | None = None
    has_segments: bool = False
    mask_shape: tuple[int, int, int, int] | None = None

    @property
    def left(self) -> int:
        return _BIG if self.window is None else self.window[0]

    @property
    def right(self) -> int:
        right = _BIG if self.window is None else self.window[1]
        return min(right, 0) if self.is_causal else right

    @property
    def has_arrays(self) -> bool:
        return self.has_segments or self.mask_shape is not None

    @property
    def has_key_ranges(self) -> bool:
        """Whether rows see ranges of keys that differ by row (causal, a window, segment ids or
        lengths): tiles at a range's edges are masked, and keys hidden from some rows may hold
        anything."""
        return self.is_causal or self.window is not None or self.has_segments

    def geometry(self, q_idx, kv_idx):
        """Visibility from padding, causality and window alone; broadcasts like its arguments."""
        ok = kv_idx < self.kv_len
        if self.right < _BIG:
            ok = ok & (kv_idx <= q_idx + self.right)
        if self.left < _BIG:
            ok = ok & (kv_idx >= q_idx - self.left)
        return ok

    def kv_tile_range(self, q_start, block_q: int, block_kv: int):
        """KV tiles seen by queries [q_start, q_start + block_q), from geometry."""
        q_last = q_start + block_q - 1
        lo = _max(q_start - self.left, 0) // block_kv if self.left < _BIG else 0
        hi = _cdiv(self.kv_len, block_kv)
        full_lo = lo
        full_hi = self.kv_len // block_kv
        if self.right < _BIG:
            # The last row sees keys <= q_last + right; the first row sees keys <= q_start + right.
            hi = _clamp(_cdiv(q_last + self.right + 1, block_kv), 0, hi)
            full_hi = _min(full_hi, _max(q_start + self.right + 1, 0) // block_kv)
        if self.left < _BIG:
            full_lo = _max(_cdiv(q_last - self.left, block_kv), 0)
        return _normalise(lo, full_lo, full_hi, hi)

    def q_tile_range(self, kv_start, block_q: int, block_kv: int):
        """Query tiles that see keys [kv_start, kv_start + block_kv), from geometry.

        A ragged last query tile counts as full: its rows past T are zero-filled on load (zero
        query, output gradient, lse and delta), so they contribute nothing.
        """
        kv_last = kv_start + block_kv - 1
        hi = _cdiv(self.q_len, block_q)
        lo = _max(kv_start - self.right, 0) // block_q if self.right < _BIG else 0
        full_lo = lo
        full_hi = hi
        if self.left < _BIG:
            hi = _clamp((kv_last + self.left) // block_q + 1, 0, hi)
            full_hi = _max(kv_start + self.left + 1, 0) // block_q
        if self.right < _BIG:
            full_lo = _max(_cdiv(kv_last - self.right, block_q), 0)
        # A ragged last KV tile has keys past S: every query tile must mask it.
        full_hi = _where(kv_start + block_kv <= self.kv_len, full_hi, 0)
        return _normalise(lo, full_lo, full_hi, hi)


def _normalise(lo, full_lo, full_hi, hi):
    hi = _max(hi, lo)
    full_lo = _clamp(full_lo, lo, hi)
    full_hi = _clamp(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def intersect(a, b):
    """The tile range of the tiles that both ranges visit (fully visible only where both are)."""
    if a is None:
        return b
    lo, full_lo = _max(a[0], b[0]), _max(a[1], b[1])
    full_hi, hi = _min(a[2], b[2]), _min(a[3], b[3])
    return _normalise(lo, full_lo, full_hi, hi)


class MaskArrays(NamedTuple):
    """The array parts of a mask (a pytree; absent parts are None).

    q_segment_ids [B, T], kv_segment_ids [B, S]: int32, with sequence lengths folded in (rows and
    keys past their length carry PAD_Q_SEGMENT / PAD_KV_SEGMENT). mask: int8 (0/1), 4-D with
    broadcast dims of size 1. dropout_seeds [B, N]: int32, the dropout hash's seed of each
    (batch entry, query head) (see `pallas_flash._dropout`), present when dropout is on.
    """

    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    mask: jax.Array | None = None
    dropout_seeds: jax.Array | None = None


def pair_segment_ids(q_segment_ids, kv_segment_ids, q_len: int, kv_len: int):
    """Both segment-id arrays or neither: with only query ids and T == S the keys use them too."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None
    if q_segment_ids is None:
        raise ValueError("kv_segment_ids needs q_segment_ids")
    if kv_segment_ids is None:
        if q_len != kv_len:
            raise ValueError(f"kv_segment_ids is required when T={q_len} != S={kv_len}")
        kv_segment_ids = q_segment_ids
    return q_segment_ids, kv_segment_ids


def make_arrays(
    batch,
    q_len,
    kv_len,
    *,
    q_segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    mask=None,
) -> MaskArrays:
    """Canonical MaskArrays from the user's arguments (validated by the API)."""
    q_seg = kv_seg = None
    if (
        q_segment_ids is not None
        or query_seq_lengths is not None
        or key_value_seq_lengths is not None
    ):
        q_seg = jnp.zeros((batch, q_len), jnp.int32)
        kv_seg = jnp.zeros((batch, kv_len), jnp.int32)
        if q_segment_ids is not None:
            q_seg, kv_seg = _int32_segment_ids(
                q_segment_ids, kv_seg if kv_segment_ids is None else kv_segment_ids
            )
        if query_seq_lengths is not None:
            rows = jnp.arange(q_len)[None, :] < jnp.asarray(query_seq_lengths)[:, None]
            q_seg = jnp.where(rows, q_seg, PAD_Q_SEGMENT)
        if key_value_seq_lengths is not None:
            keys = jnp.arange(kv_len)[None, :] < jnp.asarray(key_value_seq_lengths)[:, None]
            kv_seg = jnp.where(keys, kv_seg, PAD_KV_SEGMENT)
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.int8)
    return MaskArrays(q_seg, kv_seg, mask)


def _int32_segment_ids(q_ids, kv_ids):
    """Both id arrays as int32 with equality and order kept. Ids wider than int32 (int64, uint32)
    would wrap and merge documents: they are replaced by their rank among the batch entry's ids
    (one sort of T + S ids per entry)."""
    q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
    if q_ids.dtype == jnp.int32 and kv_ids.dtype == jnp.int32:
        return q_ids, kv_ids
    if jnp.iinfo(q_ids.dtype).bits < 32 and jnp.iinfo(kv_ids.dtype).bits < 32:
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    dtype = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
    q_ids, kv_ids = q_ids.astype(dtype), kv_ids.astype(dtype)
    ids = jnp.sort(jnp.concatenate([q_ids, kv_ids], axis=1), axis=1)
    rank = jax.vmap(lambda s, x: jnp.searchsorted(s, x, side="left"))
    return rank(ids, q_ids).astype(jnp.int32), rank(ids, kv_ids).astype(jnp.int32)


def visible(spec: MaskSpec, q_idx, kv_idx, q_seg=None, kv_seg=None, mask=None):
    """Element-wise visibility; q_seg/kv_seg/mask are tiles broadcastable like q_idx/kv_idx."""
    ok = spec.geometry(q_idx, kv_idx)
    if q_seg is not None:
        ok = ok & (q_seg == kv_seg)
    if mask is not None:
        ok = ok & (mask != 0)
    return ok


def dense(spec: MaskSpec, arrays: MaskArrays):
    """Visibility as a [B|1, N|1, T, S] boolean array, for the reference implementation."""
    q = jnp.arange(spec.q_len)[:, None]
    k = jnp.arange(spec.kv_len)[None, :]
    ok = spec.geometry(q, k)[None, None]
    if arrays.q_segment_ids is not None:
        same = arrays.q_segment_ids[:, :, None] == arrays.kv_segment_ids[:, None, :]
        ok = ok & same[:, None]
    if arrays.mask is not None:
        ok = ok & (arrays.mask != 0)
    return ok


# -- tile ranges from the arrays (XLA, before the kernels) ----------------------------------------


def _tile_minmax(ids, block, num_tiles, pad):
    """Per-tile (min, max) of ids [B, L] over entries that are not padding; empty tiles give
    (int max, int min) so that they intersect nothing."""
    b, length = ids.shape
    big, small = np.iinfo(np.int32).max, np.iinfo(np.int32).min
    valid = ids != pad
    ids_lo = jnp.where(valid, ids, big)
    ids_hi = jnp.where(valid, ids, small)
    extra = num_tiles * block - length
    ids_lo = jnp.pad(ids_lo, ((0, 0), (0, extra)), constant_values=big)
    ids_hi = jnp.pad(ids_hi, ((0, 0), (0, extra)), constant_values=small)
    full = jnp.pad(valid, ((0, 0), (0, extra)), constant_values=False)
    lo = ids_lo.reshape(b, num_tiles, block).min(-1)
    hi = ids_hi.reshape(b, num_tiles, block).max(-1)
    all_valid = full.reshape(b, num_tiles, block).all(-1)
    return lo, hi, all_valid


def _tile_classes(spec: MaskSpec, arrays: MaskArrays, block_q: int, block_kv: int):
    """(visit, full): boolean [Br, Nr, nq, nk] tile classes from the arrays (not the geometry)."""
    nq, nk = _cdiv(spec.q_len, block_q), _cdiv(spec.kv_len, block_kv)
    visit = full = jnp.ones((1, 1, nq, nk), bool)
    if arrays.q_segment_ids is not None:
        q_lo, q_hi, q_all = _tile_minmax(arrays.q_segment_ids, block_q, nq, PAD_Q_SEGMENT)
        k_lo, k_hi, k_all = _tile_minmax(arrays.kv_segment_ids, block_kv, nk, PAD_KV_SEGMENT)
        q_lo, q_hi, q_all = q_lo[:, :, None], q_hi[:, :, None], q_all[:, :, None]
        k_lo, k_hi, k_all = k_lo[:, None, :], k_hi[:, None, :], k_all[:, None, :]
        # Conservative for unsorted ids: visit when the id intervals overlap.
        visit = visit & ((q_lo <= k_hi) & (k_lo <= q_hi))[:, None]
        single = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & q_all
        # Keys past S in a ragged tile are padding here; the geometry masks that tile anyway.
        full = full & (single & _ragged_kv_ok(k_all, spec, block_kv))[:, None]
    if arrays.mask is not None:
        m = arrays.mask != 0
        bm, nm = m.shape[:2]
        m = jnp.broadcast_to(m, (bm, nm, spec.q_len, spec.kv_len))
        pad = ((0, 0), (0, 0), (0, nq * block_q - spec.q_len), (0, nk * block_kv - spec.kv_len))
        tiles_any = jnp.pad(m, pad, constant_values=False)
        tiles_all = jnp.pad(m, pad, constant_values=True)
        shape = (bm, nm, nq, block_q, nk, block_kv)
        visit = visit & tiles_any.reshape(shape).any(axis=(3, 5))
        full = full & tiles_all.reshape(shape).all(axis=(3, 5))
    return visit, full & visit


def _ragged_kv_ok(k_all, spec, block_kv):
    # In the last, ragged KV tile the padding keys past S made all_valid False; they are masked
    # by geometry, so they should not stop the tile from being "full" here.
    nk = k_all.shape[-1]
    if spec.kv_len % block_kv == 0:
        return k_all
    last = jnp.arange(nk) == nk - 1
    return k_all | last[None, None, :]


def _ranges(visit, full):
    """(lo, full_lo, full_hi, hi) along the last axis of [.., n] class arrays -> int32 [.., 4]."""
    n = visit.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.min(jnp.where(visit, idx, n), axis=-1)
    hi = jnp.max(jnp.where(visit, idx + 1, 0), axis=-1)
    hi = jnp.maximum(hi, lo)
    # The first run of fully visible tiles; other full tiles are masked (correct, a little slower).
    full_lo = jnp.min(jnp.where(full, idx, n), axis=-1)
    after = jnp.where(~full & (idx > full_lo[..., None]), idx, n)
    full_hi = jnp.min(after, axis=-1)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def tile_ranges(spec: MaskSpec, arrays: MaskArrays, block_q: int, block_kv: int, *, over: str):
    """Tile ranges from the arrays, int32 [Br, Nr, tiles, 4], or None when there are no arrays.

    over="q": per query tile, ranges of KV tiles (forward, dQ); over="kv": per KV tile, ranges of
    query tiles (dK/dV). Br is 1 or B and Nr 1 or N, as the arrays broadcast.
    """
    if not spec.has_arrays:
        return None
    visit, full = _tile_classes(spec, arrays, block_q, block_kv)
    if over == "kv":
        visit, full = jnp.swapaxes(visit, -1, -2), jnp.swapaxes(full, -1, -2)
    return _ranges(visit, full)
