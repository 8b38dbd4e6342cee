"""Context parallelism: attention over a sequence sharded across a mesh axis.

`ring_attention` (inside `jax.shard_map`) splits the sequence over a mesh axis; K/V blocks travel
around the ring by `ppermute` while each device attends to the block it holds, partial results
merge through their lse and log_sum (which also bounds the backward's recomputed P), and a
custom_vjp runs the backward around the ring again.
`ring_attention_sharded` wraps it in the shard_map for global arrays under jit; `to_zigzag` /
`from_zigzag` put a sequence in (and out of) the causally balanced zig-zag order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_flash import _vma, masks
from pallas_flash._numerics import merge_weights
from pallas_flash.api import (
    _canonical_arrays,
    _canonical_window,
    _check_lengths,
    _check_sinks,
    flash_attention,
    flash_attention_backward,
)
from pallas_flash.reference import with_sinks

LAYOUTS = ("contiguous", "zigzag")
_UNBOUNDED = 1 << 30


def zigzag_indices(seq_len: int, num_shards: int) -> np.ndarray:
    """The token order of the zig-zag layout: `x[:, zigzag_indices(T, P)]` sharded in P equal
    blocks gives device i the chunks i and 2P-1-i of 2P equal chunks, so that under a causal
    mask every device holds as many early as late queries. `seq_len` must be a multiple of 2P."""
    return _zigzag_indices(seq_len, num_shards, "seq_len")


def _zigzag_indices(seq_len: int, num_shards: int, what: str) -> np.ndarray:
    """`zigzag_indices`; what: how the messages name seq_len."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)):
        raise TypeError(f"num_shards={num_shards!r} must be an int")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    if seq_len % (2 * num_shards):
        raise ValueError(
            f"{what}={seq_len} must be a multiple of 2 * num_shards = {2 * num_shards} "
            f"(num_shards={num_shards}): the zig-zag order cuts it into {2 * num_shards} equal "
            "chunks"
        )
    chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
    order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return chunks[order].reshape(-1)


def to_zigzag(x, num_shards: int, axis: int = 1):
    """`x` with its sequence `axis` put in zig-zag order (see `zigzag_indices`)."""
    return _take(x, _zigzag_indices(x.shape[axis], num_shards, f"x.shape[{axis}]"), axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `to_zigzag`."""
    inverse = np.argsort(_zigzag_indices(x.shape[axis], num_shards, f"x.shape[{axis}]"))
    return _take(x, inverse, axis)


def _take(x, indices, axis: int):
    """`jnp.take(x, indices, axis=axis)`; an array whose type carries its sharding (a mesh of
    Explicit axes) keeps it, its entries moving between devices."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or sharding.mesh.empty or not sharding.mesh.explicit_axes:
        return jnp.take(x, indices, axis=axis)
    index = (slice(None),) * (axis % x.ndim) + (indices,)
    return jnp.asarray(x).at[index].get(out_sharding=sharding)


def _chunk_starts(layout: str, shard: int, num_shards: int, length: int):
    """(start position, size) of the contiguous chunks a shard holds, in local order."""
    if layout == "contiguous":
        return ((shard * length, length),)
    half = length // 2
    return ((shard * half, half), ((2 * num_shards - 1 - shard) * half, half))


def _merge(acc, part):
    """Merge two partial attentions (out f32 [B, T, N, H], lse [B, N, T], log_sum [B, N, T])
    as the split-KV forward merges its chunks: lse through their lse, out weighted by, and
    log_sum from, their denominators (`_numerics.merge_weights`)."""
    if acc is None:
        return part
    (o1, l1, g1), (o2, l2, g2) = acc, part
    m = jnp.maximum(l1, l2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(l1 - m_safe), jnp.exp(l2 - m_safe)
    total = w1 + w2
    empty = total == 0.0
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    (scale1, scale2), log_sum = merge_weights(jnp.stack([l1, l2]), jnp.stack([g1, g2]), axis=0)

    def by_row(w):  # [B, N, T] -> [B, T, N, 1]
        return jnp.swapaxes(w, 1, 2)[..., None]

    f32 = jnp.float32
    out = o1.astype(f32) * by_row(scale1) + o2.astype(f32) * by_row(scale2)
    return out, lse, log_sum


def _empty(q, value_head_dim: int, dtype=jnp.float32):
    """(out, lse, log_sum) of queries that see no key (out's head dim: the values')."""
    b, t, n, _ = q.shape
    rows = (b, n, t)
    return (
        jnp.zeros((b, t, n, value_head_dim), dtype),
        jnp.full(rows, -jnp.inf, jnp.float32),
        jnp.zeros(rows, jnp.float32),
    )


def _block_case(d: int, q_len: int, kv_len: int, lo: int, hi: int):
    """How queries [0, q_len) see keys [0, kv_len) of a block whose keys start `d` positions
    after its queries, when key - query (global positions) must lie in [lo, hi].

    Returns None (nothing visible) or (q_skip, kv_skip, window): drop the first q_skip queries
    and kv_skip keys, then the top-left window (left, right) (None: all visible) holds exactly.
    """
    a, b = lo - d, hi - d  # k_local - q_local must lie in [a, b]
    if b < -(q_len - 1) or a > kv_len - 1:
        return None
    if a <= -(q_len - 1) and b >= kv_len - 1:
        return 0, 0, None
    q_skip, kv_skip = max(-b, 0), max(a, 0)
    a, b = a - kv_skip + q_skip, b - kv_skip + q_skip
    left = min(-a, _UNBOUNDED) if a > -(q_len - q_skip) else _UNBOUNDED
    right = min(b, _UNBOUNDED) if b < kv_len - kv_skip - 1 else _UNBOUNDED
    return q_skip, kv_skip, (left, right)


def _block_attention(q, k, v, q_seg, kv_seg, case, attend):
    """(out, lse, log_sum) of queries q on one key block under `_block_case`'s `case`."""
    if case is None:
        return _empty(q, v.shape[-1])
    q_skip, kv_skip, window = case
    if q_skip >= q.shape[1] or kv_skip >= k.shape[1]:
        return _empty(q, v.shape[-1])
    out, lse, log_sum = attend(
        q[:, q_skip:],
        k[:, kv_skip:],
        v[:, kv_skip:],
        None if q_seg is None else q_seg[:, q_skip:],
        None if kv_seg is None else kv_seg[:, kv_skip:],
        window,
    )
    out = jnp.pad(out, ((0, 0), (q_skip, 0), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (q_skip, 0)), constant_values=-jnp.inf)
    log_sum = jnp.pad(log_sum, ((0, 0), (0, 0), (q_skip, 0)))
    return out, lse, log_sum


def _step_cases(layout, shard, source, num_shards, q_len, kv_len, lo, hi):
    """The static cases of one shard's queries against the key block of shard `source`: a list
    over (query chunk, key chunk) pairs, None where nothing is visible."""
    cases = []
    q_chunks = _chunk_starts(layout, shard, num_shards, q_len)
    kv_chunks = _chunk_starts(layout, source, num_shards, kv_len)
    for qi, (q_start, q_size) in enumerate(q_chunks):
        for ki, (kv_start, kv_size) in enumerate(kv_chunks):
            case = _block_case(kv_start - q_start, q_size, kv_size, lo, hi)
            cases.append((qi, ki, case))
    return tuple(cases)


def _step(q, k, v, q_seg, kv_seg, cases, attend, layout, f32=True):
    """(out, lse, log_sum) of the local queries against one key block, chunk pairs merged; out
    in float32 when `f32` (the ring merges it), else as the kernels return it."""
    parts = 1 if layout == "contiguous" else 2

    def split(x):
        return [x] * parts if x is None else jnp.split(x, parts, axis=1) if parts > 1 else [x]

    qs, q_segs, ks, vs, kv_segs = map(split, (q, q_seg, k, v, kv_seg))
    results = [None] * parts
    for qi, ki, case in cases:
        if case is None:
            continue
        part = _block_attention(qs[qi], ks[ki], vs[ki], q_segs[qi], kv_segs[ki], case, attend)
        results[qi] = _merge(results[qi], part)
    results = [
        _empty(qs[i], v.shape[-1], q.dtype) if r is None else r for i, r in enumerate(results)
    ]
    if f32:
        results = [(o.astype(jnp.float32), *rows) for o, *rows in results]
    if parts == 1:
        return results[0]
    dtype = jnp.result_type(*(o.dtype for o, *_ in results))
    return (
        jnp.concatenate([o.astype(dtype) for o, *_ in results], axis=1),
        jnp.concatenate([lse for _, lse, _ in results], axis=2),
        jnp.concatenate([log_sum for *_, log_sum in results], axis=2),
    )


def _pad_front(x, rows: int):
    """x in float32 with `rows` zero rows before its sequence axis (1)."""
    x = x.astype(jnp.float32)
    return jnp.pad(x, ((0, 0), (rows, 0), (0, 0), (0, 0))) if rows else x


def _step_backward(
    q, k, v, q_seg, kv_seg, out, lse, log_sum, d_out, d_lse, cases, attend_backward, layout
):
    """(dq, dk, dv) in float32: the share of the local queries' gradients that one key block
    holds, from the kernels' backward at the ring's merged (out, lse, log_sum), chunk pairs
    summed."""
    parts = 1 if layout == "contiguous" else 2

    def split(x, axis=1):
        return [x] * parts if x is None else jnp.split(x, parts, axis=axis) if parts > 1 else [x]

    qs, q_segs, outs, d_outs = map(split, (q, q_seg, out, d_out))
    lses, log_sums, d_lses = split(lse, 2), split(log_sum, 2), split(d_lse, 2)
    ks, vs, kv_segs = map(split, (k, v, kv_seg))
    dqs = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dks = [jnp.zeros(x.shape, jnp.float32) for x in ks]
    dvs = [jnp.zeros(x.shape, jnp.float32) for x in vs]
    for qi, ki, case in cases:
        if case is None:
            continue
        q_skip, kv_skip, window = case
        if q_skip >= qs[qi].shape[1] or kv_skip >= ks[ki].shape[1]:
            continue
        dq, dk, dv = attend_backward(
            qs[qi][:, q_skip:],
            ks[ki][:, kv_skip:],
            vs[ki][:, kv_skip:],
            None if q_segs[qi] is None else q_segs[qi][:, q_skip:],
            None if kv_segs[ki] is None else kv_segs[ki][:, kv_skip:],
            window,
            outs[qi][:, q_skip:],
            lses[qi][:, :, q_skip:],
            log_sums[qi][:, :, q_skip:],
            d_outs[qi][:, q_skip:],
            d_lses[qi][:, :, q_skip:],
        )
        dqs[qi] += _pad_front(dq, q_skip)
        dks[ki] += _pad_front(dk, kv_skip)
        dvs[ki] += _pad_front(dv, kv_skip)
    if parts == 1:
        return dqs[0], dks[0], dvs[0]
    return tuple(jnp.concatenate(x, axis=1) for x in (dqs, dks, dvs))


def _positions(layout, shard, num_shards: int, length: int):
    """Global positions of a shard's local tokens (`shard` may be traced)."""
    if layout == "contiguous":
        return shard * length + jnp.arange(length)
    half = length // 2
    return jnp.concatenate(
        [shard * half + jnp.arange(half), (2 * num_shards - 1 - shard) * half + jnp.arange(half)]
    )


def ring_attention(
    query,
    key,
    value,
    *,
    axis_name: str,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
    layout: str = "contiguous",
    return_residuals: bool = False,
    backend: str | None = None,
    block_sizes=None,
    interpret: bool | None = None,
):
    """Context-parallel attention inside `jax.shard_map`: q, k and v are sharded over their
    sequence axis along the mesh axis `axis_name`, and the key/value blocks travel around the
    ring of its P devices (`jax.lax.ppermute`) while each device attends its queries to the
    block it holds; the partial results merge through their softmax denominators, and the
    gradients flow back around the same ring (docs/sharding.md, "Long context: ring
    attention").

    Shapes are per device (B batch, T = T_global / P local queries, S = S_global / P local
    keys)::

        query: (B, T, N, H), key: (B, S, K, H), value: (B, S, K, Hv); out: (B, T, N, Hv)

    Args:
      query, key, value: this device's blocks, in the order `layout` gives.
      axis_name: the mesh axis (of the enclosing shard_map) that shards the sequence.
      layout: "contiguous": device i holds positions [i T, (i + 1) T) of the queries (and
        [i S, (i + 1) S) of the keys); "zigzag": the sequences were put in zig-zag order
        (`to_zigzag`) before sharding, so device i holds chunks i and 2P-1-i of 2P (T == S,
        even): under a causal mask each device then does the same work at every ring step.
      query_seq_lengths, key_value_seq_lengths: int (B,), global lengths (the same on every
        device), in [0, P T] and [0, P S] (checked when concrete, clamped when traced, as in
        `flash_attention`).
      q_segment_ids: int (B, T), kv_segment_ids: int (B, S): this device's blocks of the ids.
      scale, is_causal, local_window_size, logits_soft_cap, backend, block_sizes, interpret: as
        in `flash_attention`, with causality and windows on global positions.
      sinks: None, or float (N,): attention sinks as in `flash_attention` (this device's
        query heads'), applied to the ring's merged result; differentiable.
      return_residuals: also return lse (B, N, T), float32.

    Returns:
      out (B, T, N, Hv) in query's dtype, or (out, lse). Rows that see no key output zeros
      with lse -inf (with sinks: lse = the sink).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    _check_ring_arrays("ring_attention", query, key, value)
    _check_sinks(sinks, query.shape[2])
    num_shards = jax.lax.axis_size(axis_name)
    if num_shards == 1:
        layout = "contiguous"  # the zig-zag order of one shard is the identity
    q_len, kv_len = query.shape[1], key.shape[1]
    _check_ring_lengths(
        query, key, axis_name, num_shards, layout, query_seq_lengths, key_value_seq_lengths
    )
    lo, hi = _diagonal_bounds(local_window_size, is_causal)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q_seg, kv_seg = _ring_segment_ids(
        layout,
        jax.lax.axis_index(axis_name),
        num_shards,
        query.shape[0],
        q_len,
        kv_len,
        q_segment_ids,
        kv_segment_ids,
        query_seq_lengths,
        key_value_seq_lengths,
    )

    def block_options(qs, ks, window_):
        """flash_attention's options for one block's mask. A window closed on the right at the
        diagonal is the causal mask (and, unbounded on the left, nothing else): the kernels'
        causal paths, not their window paths, run it."""
        causal = window_ is not None and window_[1] == 0
        if causal and window_[0] >= _UNBOUNDED:
            window_ = None
        return dict(
            scale=scale,
            is_causal=causal,
            q_segment_ids=qs,
            kv_segment_ids=ks,
            local_window_size=window_,
            logits_soft_cap=logits_soft_cap,
            backend=backend,
            block_sizes=block_sizes,
            interpret=interpret,
        )

    def attend(q, k, v, qs, ks, window_):
        return flash_attention(
            q, k, v, return_residuals=True, return_log_sum=True, **block_options(qs, ks, window_)
        )

    def attend_backward(q, k, v, qs, ks, window_, out, lse, log_sum, d_out, d_lse):
        # log_sum, the merged softmax's, bounds the block's recomputed P at the whole row's
        # 1 / denominator: keys that tie at the row's max across blocks get their exact share.
        return flash_attention_backward(
            q, k, v, out, lse, d_out, d_lse, log_sum=log_sum, **block_options(qs, ks, window_)
        )

    ring = _Ring(
        axis_name=axis_name,
        num_shards=num_shards,
        layout=layout,
        attend=attend,
        attend_backward=attend_backward,
        steps=tuple(
            tuple(
                _step_cases(layout, i, (i - r) % num_shards, num_shards, q_len, kv_len, lo, hi)
                for i in range(num_shards)
            )
            for r in range(num_shards)
        ),
    )
    if num_shards == 1:
        # One device holds the whole sequence: the plain call, differentiated by its own
        # backward (the ring's would run the forward again).
        out, lse, log_sum = ring.step(0, query, q_seg, key, value, kv_seg) or _empty(
            query, value.shape[-1]
        )
        out = out.astype(query.dtype)
    else:
        out, lse, log_sum = _ring_attention(ring, query, key, value, q_seg, kv_seg)
    if sinks is not None:
        # log_sum makes the sink's share exact where lse rounds the keys' denominator away;
        # the result depends on it only through that rounding (its derivatives cancel).
        out, lse = with_sinks(out, lse, sinks, jax.lax.stop_gradient(log_sum))
    return (out, lse) if return_residuals else out


def _check_ring_lengths(
    query, key, axis_name, num_shards: int, layout: str, query_seq_lengths, key_value_seq_lengths
):
    """The global sequence lengths against the ring's P local blocks, and zig-zag's equal, even
    local lengths."""
    q_len, kv_len = query.shape[1], key.shape[1]
    for name, lengths, local, axis in (
        ("query_seq_lengths", query_seq_lengths, q_len, "query.shape[1]"),
        ("key_value_seq_lengths", key_value_seq_lengths, kv_len, "key.shape[1]"),
    ):
        total = local * num_shards
        _check_lengths(
            name,
            lengths,
            query.shape[0],
            total,
            f"{axis} * axis_size({axis_name!r}) = {local} * {num_shards} = {total}",
        )
    if layout == "zigzag" and (q_len != kv_len or q_len % 2):
        raise ValueError(
            f"layout='zigzag' needs equal, even local lengths; got query.shape={query.shape}, "
            f"key.shape={key.shape}"
        )


def _diagonal_bounds(local_window_size, is_causal: bool) -> tuple[int, int]:
    """(lo, hi): query i sees keys j with lo <= j - i <= hi (global positions); +-_UNBOUNDED
    where nothing bounds that side."""
    window = _canonical_window(local_window_size)
    lo = -window[0] if window is not None else -_UNBOUNDED
    hi = window[1] if window is not None else _UNBOUNDED
    if is_causal:
        hi = min(hi, 0)
    return lo, hi


def _ring_segment_ids(
    layout,
    shard,
    num_shards: int,
    batch: int,
    q_len: int,
    kv_len: int,
    q_segment_ids,
    kv_segment_ids,
    query_seq_lengths,
    key_value_seq_lengths,
):
    """(q_seg, kv_seg) int32 of this shard's blocks, or (None, None) without segment ids or
    lengths: the lengths (global) folded in as padding segments at the shard's global
    positions."""
    segmented = (
        q_segment_ids is not None
        or query_seq_lengths is not None
        or key_value_seq_lengths is not None
    )
    if not segmented:
        return None, None
    q_seg, kv_seg = masks.pair_segment_ids(q_segment_ids, kv_segment_ids, q_len, kv_len)
    if q_seg is None:
        q_seg = jnp.zeros((batch, q_len), jnp.int32)
        kv_seg = jnp.zeros((batch, kv_len), jnp.int32)
    q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
    positions = [_positions(layout, shard, num_shards, n) for n in (q_len, kv_len)]
    if query_seq_lengths is not None:
        rows = positions[0][None, :] < jnp.asarray(query_seq_lengths)[:, None]
        q_seg = jnp.where(rows, q_seg, masks.PAD_Q_SEGMENT)
    if key_value_seq_lengths is not None:
        keys = positions[1][None, :] < jnp.asarray(key_value_seq_lengths)[:, None]
        kv_seg = jnp.where(keys, kv_seg, masks.PAD_KV_SEGMENT)
    return q_seg, kv_seg


def _check_ring_arrays(fn: str, query, key, value):
    """The ranks, dtypes and shapes of a ring's arrays, checked as `flash_attention` checks
    them, before its steps cut blocks from them (whose shapes the user never passed)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{fn} takes batched {name} [B, T|S, N|K, H]; got "
                f"{name}.shape={getattr(x, 'shape', None)}"
            )
    _canonical_arrays(query, key, value)
    if query.dtype == jnp.float64:
        raise NotImplementedError(
            f"{fn} with dtype float64: the ring merges its blocks' results in float32; float64 "
            "runs in flash_attention on the whole sequence (backend='xla' or interpret=True)"
        )


def _check_global_sequences(query, key, num_shards: int, context_axis, kwargs):
    """The global sequences of `ring_attention_sharded` split into num_shards equal blocks
    (with layout="zigzag", 2 num_shards equal chunks of sequences of one length)."""
    chunks, rule = num_shards, f"mesh.shape[{context_axis!r}]={num_shards}"
    if kwargs.get("layout") == "zigzag" and num_shards > 1:
        if query.shape[1] != key.shape[1]:
            raise ValueError(
                "layout='zigzag' needs query.shape[1] == key.shape[1]; got "
                f"query.shape={query.shape}, key.shape={key.shape}"
            )
        chunks = 2 * num_shards
        rule = (
            f"2 * mesh.shape[{context_axis!r}] = {chunks} (layout='zigzag': two chunks per device)"
        )
    for name, x in (("query", query), ("key", key)):
        if x.shape[1] % chunks:
            raise ValueError(f"{name}.shape={x.shape}: its length must be a multiple of {rule}")


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
    """The static plan of one ring: `steps[r][i]` are shard i's cases (`_step_cases`) against
    the block it holds at step r, the block of shard i - r."""

    axis_name: str
    num_shards: int
    layout: str
    attend: object
    attend_backward: object
    steps: tuple

    @functools.cached_property
    def last(self) -> int:
        """The last step any shard computes: the ring stops there."""
        return max((r for r in range(len(self.steps)) if self.busy(r)), default=0)

    def busy(self, r: int) -> bool:
        """Whether any shard computes at step r."""
        return any(c[2] is not None for cases in self.steps[r] for c in cases)

    def step(self, r: int, q, q_seg, k, v, kv_seg):
        """(out, lse, log_sum) of this shard's queries against the block it holds at step r, or None
        when no shard computes at this step."""
        if not self.busy(r):
            return None
        step = self.steps[r]
        distinct = sorted(set(step), key=step.index)
        # One step of one block needs no merge: the kernels' output dtype stays.
        f32 = self.last > 0 or len(distinct) > 1

        def branch(cases, q, q_seg, k, v, kv_seg):
            return _step(q, k, v, q_seg, kv_seg, cases, self.attend, self.layout, f32)

        branches = [functools.partial(branch, cases) for cases in distinct]
        if len(branches) == 1:
            return branches[0](q, q_seg, k, v, kv_seg)
        return self.switch(step, distinct, branches, q, q_seg, k, v, kv_seg)

    def step_backward(self, r: int, q, q_seg, k, v, kv_seg, out, lse, log_sum, d_out, d_lse):
        """(dq, dk, dv) float32 of this shard's queries against the block it holds at step
        r, at the ring's merged (out, lse, log_sum) and the cotangents of out and lse."""
        step = self.steps[r]
        distinct = sorted(set(step), key=step.index)

        def branch(cases, *args):
            return _step_backward(*args, cases, self.attend_backward, self.layout)

        args = (q, k, v, q_seg, kv_seg, out, lse, log_sum, d_out, d_lse)
        branches = [functools.partial(branch, cases) for cases in distinct]
        if len(branches) == 1:
            return branches[0](*args)
        return self.switch(step, distinct, branches, *args)

    def switch(self, step, distinct, branches, *operands):
        """The branch of this shard's cases (`step[shard]`, one of `distinct`). Under
        check_vma the branches' results must have one type: each varies over the manual axes
        of the operands and of the shard's index (a branch that computes nothing returns
        zeros, which vary over none)."""
        shard = jax.lax.axis_index(self.axis_name)
        which = jnp.asarray([distinct.index(cases) for cases in step], jnp.int32)[shard]

        def typed(branch):
            return lambda *args: _vma.vary_like(branch(*args), which, *args)

        return jax.lax.switch(which, [typed(b) for b in branches], *operands)

    def send(self, x, shift: int = 1):
        """x from every shard to shard i + shift of the ring."""
        n = self.num_shards
        perm = [(i, (i + shift) % n) for i in range(n)]
        return jax.lax.ppermute(x, self.axis_name, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_seg, kv_seg):
    """(out, lse, log_sum); log_sum's cotangent is not taken (callers stop its gradient)."""
    return _ring_forward(ring, q, k, v, q_seg, kv_seg)


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg):
    acc = None
    block = (k, v, kv_seg)
    for r in range(ring.last + 1):
        # Send the block on before computing on it: the permute overlaps the step's kernels.
        following = ring.send(block) if r < ring.last else None
        part = ring.step(r, q, q_seg, *block)
        if part is not None:
            acc = _merge(acc, part)
        block = following
    out, lse, log_sum = acc if acc is not None else _empty(q, v.shape[-1])
    return out.astype(q.dtype), lse, log_sum


def _ring_fwd_rule(ring, q, k, v, q_seg, kv_seg):
    out, lse, log_sum = _ring_forward(ring, q, k, v, q_seg, kv_seg)
    return (out, lse, log_sum), (q, k, v, q_seg, kv_seg, out, lse, log_sum)


def _ring_bwd_rule(ring, residuals, cotangents):
    """The ring backward: K/V blocks travel the ring again with their dK/dV accumulators; at
    each step the kernels' backward runs on the block at the merged (out, lse), whose
    P = exp(logits - lse) is the block's share of the whole softmax, clamped at the merged
    log_sum's 1 / denominator: the forward is not run again, and no device holds more than one
    remote block at a time. After the last step each accumulator goes back to its owner in one
    permute."""
    q, k, v, q_seg, kv_seg, out, lse, log_sum = residuals
    d_out, d_lse, _ = cotangents
    d_out = d_out.astype(out.dtype)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    # The barrier keeps XLA from merging these permutes with the forward's, which would keep
    # every received block alive from the forward to the backward.
    block = jax.lax.optimization_barrier((k, v, kv_seg))
    for r in range(ring.last + 1):
        following = ring.send(block) if r < ring.last else None
        if ring.busy(r):
            k_r, v_r, kv_seg_r = block
            dq_r, dk_r, dv_r = ring.step_backward(
                r, q, q_seg, k_r, v_r, kv_seg_r, out, lse, log_sum, d_out, d_lse
            )
            dq, dk, dv = dq + dq_r, dk + dk_r, dv + dv_r
        if r < ring.last:
            dk, dv = ring.send((dk, dv))
        block = following
    if ring.last:
        dk, dv = ring.send((dk, dv), -ring.last)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring_attention.defvjp(_ring_fwd_rule, _ring_bwd_rule)


def ring_attention_sharded(
    query,
    key,
    value,
    *,
    mesh,
    context_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    sinks=None,
    return_residuals: bool = False,
    **kwargs,
):
    """`ring_attention` for global arrays under jit: a `jax.shard_map` over `mesh` with the
    sequence split over `context_axis` (and optionally the batch over `batch_axis`, the heads
    over `head_axis`). Arguments as in `ring_attention` but global: query (B, T, N, H), segment
    ids (B, T) / (B, S), in `kwargs['layout']` order; sinks (N,)."""
    # The global arrays, before the shard_map splits them (the messages quote their shapes).
    _check_ring_arrays("ring_attention_sharded", query, key, value)
    _check_sinks(sinks, query.shape[2])
    _check_global_sequences(query, key, mesh.shape[context_axis], context_axis, kwargs)
    for name, lengths, limit, axis in (
        ("query_seq_lengths", query_seq_lengths, query.shape[1], "query.shape[1]"),
        ("key_value_seq_lengths", key_value_seq_lengths, key.shape[1], "key.shape[1]"),
    ):
        _check_lengths(name, lengths, query.shape[0], limit, f"{axis}={limit}")
    qkv = P(batch_axis, context_axis, head_axis, None)
    seg = P(batch_axis, context_axis)
    lengths = P(batch_axis)
    optional = {
        "q_segment_ids": (q_segment_ids, seg),
        "kv_segment_ids": (kv_segment_ids, seg),
        "query_seq_lengths": (query_seq_lengths, lengths),
        "key_value_seq_lengths": (key_value_seq_lengths, lengths),
        "sinks": (sinks, P(head_axis)),
    }
    present = {name: x for name, (x, _) in optional.items() if x is not None}
    specs = {name: optional[name][1] for name in present}

    def local(q, k, v, extra):
        return ring_attention(
            q, k, v, axis_name=context_axis, return_residuals=True, **extra, **kwargs
        )

    operands = (query, key, value, present)
    if mesh.explicit_axes:
        # Sharding in types: shard_map takes only inputs whose types carry its in_specs.
        operands = jax.tree.map(
            lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
            operands,
            (qkv, qkv, qkv, specs),
            is_leaf=lambda x: x is None,
        )
    out, lse = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, specs),
        out_specs=(qkv, P(batch_axis, head_axis, context_axis)),
    )(*operands)
    return (out, lse) if return_residuals else out
