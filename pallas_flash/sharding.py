"""Attention over a device mesh.

Batch and head sharding: the kernels' passes (`_vjp._forward`, `_vjp._backward`) go through
`partitioned`, which tells jax's SPMD partitioner that every batch entry and every kv head (with
its query heads) is independent, so each device runs the kernels on its own shard and nothing is
gathered. With jit's automatic sharding that is a `jax.experimental.custom_partitioning` rule; with
explicit sharding (sharding in types) the shardings are known when tracing, and the call runs in a
`jax.shard_map` over them. The sequence and head-dim axes cannot be split by the kernels: a call
with q, k or v sharded over them raises ValueError (context parallelism is `ring_attention`).

On one device (`jax.device_count() == 1`) `partitioned` calls the kernels directly: the
single-device program is unchanged.

Context parallelism: `ring_attention` (inside `jax.shard_map`) splits the sequence over a mesh
axis; K/V blocks travel around the ring by `ppermute` while each device attends to the block it
holds, partial results merge through their lse, and a custom_vjp runs the backward around the
ring again. `ring_attention_sharded` wraps it in the shard_map for global arrays under jit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_flash import masks
from pallas_flash.masks import MaskArrays

# -- batch and head sharding ----------------------------------------------------------------------


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec_entries(spec, ndim: int):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _mesh_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The mesh axes that split the batch and the heads (query heads in contiguous blocks, each
    block's kv heads on the same device)."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]

    def spec(self, shape, kind: str):
        """The PartitionSpec of an operand of `kind` (see `_RULES`); "pair" operands (bias,
        mask: [B|1, N|1, T|1, S|1]) keep their broadcast dims whole."""
        batch, heads = _entry(self.batch), _entry(self.heads)
        if kind in ("q", "kv"):
            return P(batch, None, heads, None)
        if kind == "lse":
            return P(batch, heads, None)
        if kind in ("q_seg", "kv_seg"):
            return P(batch, None)
        return P(batch if shape[0] > 1 else None, heads if shape[1] > 1 else None, None, None)

    def reduced_axes(self, pair_shape) -> tuple[str, ...]:
        """Mesh axes over which a bias broadcast along B or N gets partial gradients."""
        return (self.batch if pair_shape[0] == 1 else ()) + (
            self.heads if pair_shape[1] == 1 else ()
        )


def plan(mesh, q_shape, k_shape, q_spec, k_spec, v_spec=None) -> _Plan:
    """The batch and head axes of a call whose q, k (and v) carry these PartitionSpecs.

    Raises ValueError when an operand is sharded over its sequence or head-dim axis (the kernels
    cannot split them), or when the heads are split over more shards than there are kv heads.
    """
    specs = {"query": _spec_entries(q_spec, 4), "key": _spec_entries(k_spec, 4)}
    if v_spec is not None:
        specs["value"] = _spec_entries(v_spec, 4)
    for name, spec in specs.items():
        for dim, what in ((1, "sequence"), (3, "head-dim")):
            if spec[dim] is not None:
                raise ValueError(
                    f"flash_attention: {name} is sharded over its {what} axis "
                    f"({name} sharding {P(*spec)}); the kernels split only the batch and head "
                    "axes. Replicate that axis (jax.lax.with_sharding_constraint or "
                    "jax.sharding.reshard), or use pallas_flash.ring_attention for a sharded "
                    "sequence"
                )
    q, k = specs["query"], specs["key"]
    batch = _axes(q[0]) or _axes(k[0])
    heads = _axes(q[2]) or _axes(k[2])
    for name, spec in specs.items():
        for dim, axes, what in ((0, batch, "batch"), (2, heads, "head")):
            if _axes(spec[dim]) not in ((), axes):
                raise ValueError(
                    f"flash_attention: {name}'s {what} axis is sharded over "
                    f"{_axes(spec[dim])} but query/key over {axes}: shard them alike"
                )
    shards = _mesh_size(mesh, heads)
    num_kv_heads = k_shape[2]
    if num_kv_heads % shards:
        raise ValueError(
            f"flash_attention: the heads are sharded over {heads} ({shards} shards), which does "
            f"not divide {num_kv_heads=} (key.shape={tuple(k_shape)}): each shard must hold whole "
            "kv heads with their query heads; shard the heads over at most num_kv_heads devices"
        )
    if q_shape[0] % _mesh_size(mesh, batch):
        raise ValueError(
            f"flash_attention: batch {q_shape[0]} (query.shape={tuple(q_shape)}) is not "
            f"divisible by its {_mesh_size(mesh, batch)} shards over {batch}"
        )
    return _Plan(batch, heads)


# Shardy factors of each operand kind: batch `b` and kv heads `k` (query heads `(k g)`, the
# query groups `g` of each kv head) are shared; sequences `t`, `s` and head dim `h` are shared too,
# so that a sharding of them reaches `plan`, which refuses it.
_RULES = {
    "q": "b t {n} h",
    "kv": "b s k h",
    "lse": "b {n} t",
    "q_seg": "b t",
    "kv_seg": "b s",
}


def leaf_kinds(values, kinds) -> tuple[str, ...]:
    """The kind of every array leaf of `values` (q, k, v, bias, MaskArrays, ...), in flattening
    order; `kinds` names each top-level value ("arrays" for a MaskArrays)."""
    flat = []
    for kind, x in zip(kinds, values, strict=True):
        if kind == "arrays":
            flat += [
                name
                for name, a in zip(("q_seg", "kv_seg", "pair"), x, strict=True)
                if a is not None
            ]
        elif x is not None:
            flat.append(kind)
    return tuple(flat)


def _sharding_rule(kinds_in, kinds_out, shapes_in, shapes_out):
    """The einsum-like Shardy rule of a pass and its factor sizes."""
    num_heads, num_kv_heads = shapes_in[0][2], shapes_in[1][2]
    group = num_heads // num_kv_heads
    heads_q = "(k g)" if group > 1 else "k"
    fresh = iter(f"x{i}" for i in range(1000))

    def render(kind, shape):
        if kind != "pair":
            return _RULES[kind].format(n=heads_q)
        return " ".join(
            [
                "b" if shape[0] > 1 else next(fresh),
                heads_q if shape[1] > 1 else next(fresh),
                "t" if shape[2] > 1 else next(fresh),
                "s" if shape[3] > 1 else next(fresh),
            ]
        )

    ins = ", ".join(render(k, s) for k, s in zip(kinds_in, shapes_in, strict=True))
    outs = ", ".join(render(k, s) for k, s in zip(kinds_out, shapes_out, strict=True))
    return f"{ins} -> {outs}", ({"g": group} if group > 1 else {})


def _specs(plan_: _Plan, kinds, shapes):
    return [plan_.spec(s, k) for k, s in zip(kinds, shapes, strict=True)]


def _local_config(config, arrays: MaskArrays):
    """The config of one shard: the dense mask's shape is the shard's."""
    if arrays.mask is None:
        return config
    return dataclasses.replace(
        config, spec=dataclasses.replace(config.spec, mask_shape=tuple(arrays.mask.shape))
    )


def _shard_fn(kernel, config, plan_: _Plan):
    """The function one shard runs: the kernels on local shapes. A bias broadcast over a sharded
    batch or head axis gets partial gradients on each shard: they are summed over the shards."""

    def run(*args):
        bias, arrays = args[3], args[4]
        results = kernel(*args, config=_local_config(config, arrays))
        if len(results) == 4 and bias is not None and (axes := plan_.reduced_axes(bias.shape)):
            results = (*results[:3], jax.lax.psum(results[3], axes))
        return results

    return run


@dataclasses.dataclass(frozen=True)
class _Folded:
    """`kernel` on operands with `lead` extra leading (vmapped) dims: they fold into the batch
    axis (a free reshape of each shard's contiguous block) and unfold from the results."""

    kernel: object
    lead: int

    def __call__(self, *args, config):
        lead_shape = args[0].shape[: self.lead]
        fold = lambda x: x.reshape((-1, *x.shape[self.lead + 1 :]))  # noqa: E731
        results = self.kernel(*jax.tree.map(fold, list(args)), config=config)
        return jax.tree.map(lambda x: x.reshape((*lead_shape, -1, *x.shape[1:])), results)


def _call(kernel, config, kinds_in, kinds_out, *args):
    del kinds_in, kinds_out
    return kernel(*args, config=config)


def _partition(kernel, config, kinds_in, kinds_out, mesh, arg_shapes, result_shape):
    lead = getattr(kernel, "lead", 0)
    q, k, v = arg_shapes[:3]
    specs = [_spec_entries(x.sharding.spec, 4 + lead) for x in (q, k, v)]
    plan_ = plan(mesh, q.shape[lead:], k.shape[lead:], *(s[lead:] for s in specs))
    # Vmapped dims shard like the batch (as q's are), anywhere.
    lead_entries = specs[0][:lead]
    leaves_in, tree_in = jax.tree.flatten(arg_shapes)
    leaves_out, tree_out = jax.tree.flatten(result_shape)

    def to_shardings(kinds, leaves):
        specs = _specs(plan_, kinds, [x.shape[lead:] for x in leaves])
        return [NamedSharding(mesh, P(*lead_entries, *s)) for s in specs]

    arg_shardings = to_shardings(kinds_in, leaves_in)
    out_shardings = to_shardings(kinds_out, leaves_out)
    return (
        mesh,
        _shard_fn(kernel, config, plan_),
        jax.tree.unflatten(tree_out, out_shardings),
        jax.tree.unflatten(tree_in, arg_shardings),
    )


def _rule(kernel, config, kinds_in, kinds_out, mesh, value_types, result_types):
    del config, mesh
    lead = getattr(kernel, "lead", 0)
    rule, sizes = _sharding_rule(
        kinds_in,
        kinds_out,
        [tuple(t.shape)[lead:] for t in value_types],
        [tuple(t.shape)[lead:] for t in result_types],
    )
    if lead:
        prefix = " ".join(f"v{i}" for i in range(lead)) + " "
        ins, outs = rule.split(" -> ")
        rule = " -> ".join(", ".join(prefix + x for x in side.split(", ")) for side in (ins, outs))
    return rule, sizes


_partitioned = custom_partitioning(_call, static_argnums=(0, 1, 2, 3))
_partitioned.def_partition(partition=_partition, sharding_rule=_rule)


def _explicit_mesh(x):
    """The mesh of `x`'s type when it has Explicit axes (sharding in types), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    return mesh


def partitioned(kernel, config, kinds, out_kinds, *args, lead: int = 0):
    """`kernel(*args, config=config)` (one pass of the kernels) split over the batch and head axes
    of a device mesh: each device runs it on its shard.

    kinds: the kind of each top-level argument ("q", "kv", "lse", "pair" for a bias (may be
    None), "arrays" for MaskArrays); out_kinds: the same for the results (dbias: "pair").
    lead: leading vmapped dims on every operand (the batching rule's own recursion).
    """
    if jax.device_count() == 1:
        return kernel(*args, config=config)
    kinds_in = leaf_kinds(args, kinds)
    mesh = next((m for m in map(_explicit_mesh, jax.tree.leaves(args[:3])) if m), None)
    if mesh is not None and not lead:
        return _shard_map_call(kernel, config, kinds, out_kinds, mesh, *args)
    inner = _Folded(kernel, lead) if lead else kernel
    call = jax.custom_batching.custom_vmap(
        lambda *a: _partitioned(inner, config, kinds_in, _out_leaf_kinds(out_kinds, args), *a)
    )

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *a):
        batched = jax.tree.leaves(list(in_batched))
        foldable = args[3] is None and args[4].mask is None
        foldable &= all(b for b, kind in zip(batched, kinds_in) if kind in ("q", "kv", "lse"))
        if foldable:
            # The vmapped axis becomes one more leading dim of the partitioned call; unbatched
            # segment ids are broadcast along it.
            a = jax.tree.map(
                lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape)),
                list(a),
                list(in_batched),
            )
            out = partitioned(kernel, config, kinds, out_kinds, *a, lead=lead + 1)
        else:
            # A bias or dense mask, or unbatched q/k/v: the kernels batch as pallas_calls do,
            # unpartitioned.
            axes = jax.tree.map(lambda b: 0 if b else None, list(in_batched))
            out = jax.vmap(lambda *x: inner(*x, config=config), in_axes=axes)(*a)
        return out, jax.tree.map(lambda _: True, out)

    return call(*args)


def _out_leaf_kinds(out_kinds, args):
    """Result leaf kinds: dbias ("pair") exists only with a bias."""
    bias = args[3]
    return tuple(k for k in out_kinds if k != "pair" or bias is not None)


def _shard_map_call(kernel, config, kinds, out_kinds, mesh, *args):
    q, k, v = args[:3]
    plan_ = plan(
        mesh,
        q.shape,
        k.shape,
        jax.typeof(q).sharding.spec,
        jax.typeof(k).sharding.spec,
        jax.typeof(v).sharding.spec,
    )
    original_bias = args[3]
    leaves, tree = jax.tree.flatten(args)
    in_specs = jax.tree.unflatten(
        tree, _specs(plan_, leaf_kinds(args, kinds), [x.shape for x in leaves])
    )
    shapes = {"q": q.shape, "kv": k.shape, "lse": (q.shape[0], q.shape[2], q.shape[1])}
    if args[3] is not None:
        shapes["pair"] = args[3].shape
    out_kinds = _out_leaf_kinds(out_kinds, args)
    out_specs = tuple(_specs(plan_, out_kinds, [shapes[k] for k in out_kinds]))
    if len(out_kinds) == 3:  # a backward without bias: dbias is None
        out_specs = (*out_specs, None)
    args = jax.tree.map(jax.sharding.reshard, list(args), list(in_specs))
    # The kernels' pallas_calls declare no varying-ness over manual axes.
    results = jax.shard_map(
        _shard_fn(kernel, config, plan_),
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        check_vma=False,
    )(*args)
    if len(out_specs) == 4:
        # Gradients take their primals' types (a replicated bias gets a replicated gradient).
        results = tuple(
            None if g is None else jax.sharding.reshard(g, jax.typeof(x).sharding.spec)
            for g, x in zip(results, (q, k, v, original_bias), strict=True)
        )
    return results


# -- context parallelism: ring attention ----------------------------------------------------------

LAYOUTS = ("contiguous", "zigzag")
_UNBOUNDED = 1 << 30


def zigzag_indices(seq_len: int, num_shards: int) -> np.ndarray:
    """The token order of the zig-zag layout: `x[:, zigzag_indices(T, P)]` sharded in P equal
    blocks gives device i the chunks i and 2P-1-i of 2P equal chunks, so that under a causal
    mask every device holds as many early as late queries. `seq_len` must be a multiple of 2P."""
    if seq_len % (2 * num_shards):
        raise ValueError(f"{seq_len=} must be a multiple of 2 * {num_shards=}")
    chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
    order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return chunks[order].reshape(-1)


def to_zigzag(x, num_shards: int, axis: int = 1):
    """`x` with its sequence `axis` put in zig-zag order (see `zigzag_indices`)."""
    return jnp.take(x, zigzag_indices(x.shape[axis], num_shards), axis=axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `to_zigzag`."""
    inverse = np.argsort(zigzag_indices(x.shape[axis], num_shards))
    return jnp.take(x, inverse, axis=axis)


def _chunk_starts(layout: str, shard: int, num_shards: int, length: int):
    """(start position, size) of the contiguous chunks a shard holds, in local order."""
    if layout == "contiguous":
        return ((shard * length, length),)
    half = length // 2
    return ((shard * half, half), ((2 * num_shards - 1 - shard) * half, half))


def _merge(acc, part):
    """Merge two partial attentions (out f32 [B, T, N, H], lse [B, N, T]) through their lse."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    m = jnp.maximum(l1, l2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(l1 - m_safe), jnp.exp(l2 - m_safe)
    total = w1 + w2
    empty = total == 0.0
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    scale1 = jnp.where(empty, 0.0, w1 / jnp.where(empty, 1.0, total))
    scale2 = jnp.where(empty, 0.0, w2 / jnp.where(empty, 1.0, total))

    def by_row(w):  # [B, N, T] -> [B, T, N, 1]
        return jnp.swapaxes(w, 1, 2)[..., None]

    f32 = jnp.float32
    return o1.astype(f32) * by_row(scale1) + o2.astype(f32) * by_row(scale2), lse


def _empty(q, dtype=jnp.float32):
    b, t, n, _ = q.shape
    return jnp.zeros(q.shape, dtype), jnp.full((b, n, t), -jnp.inf, jnp.float32)


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
    """(out f32, lse) of queries q on one key block under `_block_case`'s `case`."""
    if case is None:
        return _empty(q)
    q_skip, kv_skip, window = case
    if q_skip >= q.shape[1] or kv_skip >= k.shape[1]:
        return _empty(q)
    out, lse = attend(
        q[:, q_skip:],
        k[:, kv_skip:],
        v[:, kv_skip:],
        None if q_seg is None else q_seg[:, q_skip:],
        None if kv_seg is None else kv_seg[:, kv_skip:],
        window,
    )
    out = jnp.pad(out, ((0, 0), (q_skip, 0), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (q_skip, 0)), constant_values=-jnp.inf)
    return out, lse


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
    """(out, lse) of the local queries against one key block, chunk pairs merged; out in
    float32 when `f32` (the ring merges it), else as the kernels return it."""
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
    results = [_empty(qs[i], q.dtype) if r is None else r for i, r in enumerate(results)]
    if f32:
        results = [(o.astype(jnp.float32), lse) for o, lse in results]
    if parts == 1:
        return results[0]
    dtype = jnp.result_type(*(o.dtype for o, _ in results))
    return (
        jnp.concatenate([o.astype(dtype) for o, _ in results], axis=1),
        jnp.concatenate([lse for _, lse in results], axis=2),
    )


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
    layout: str = "contiguous",
    return_residuals: bool = False,
    backend: str | None = None,
    block_sizes=None,
    interpret: bool | None = None,
):
    """Context-parallel attention inside `jax.shard_map`: q, k and v are sharded over their
    sequence axis along the mesh axis `axis_name`, and the key/value blocks travel around the
    ring of its P devices (`jax.lax.ppermute`) while each device attends its queries to the
    block it holds. The partial results merge through their lse; gradients flow back through
    the same ring (the transposed permutes).

    Shapes are per device (B batch, T = T_global / P local queries, S = S_global / P local
    keys)::

        query: (B, T, N, H), key, value: (B, S, K, H); out: (B, T, N, H)

    Args:
      query, key, value: this device's blocks, in the order `layout` gives.
      axis_name: the mesh axis (of the enclosing shard_map) that shards the sequence.
      layout: "contiguous": device i holds positions [i T, (i + 1) T) of the queries (and
        [i S, (i + 1) S) of the keys); "zigzag": the sequences were put in zig-zag order
        (`to_zigzag`) before sharding, so device i holds chunks i and 2P-1-i of 2P (T == S,
        even): under a causal mask each device then does the same work at every ring step.
      query_seq_lengths, key_value_seq_lengths: int (B,), global lengths (the same on every
        device).
      q_segment_ids: int (B, T), kv_segment_ids: int (B, S): this device's blocks of the ids.
      scale, is_causal, local_window_size, logits_soft_cap, backend, block_sizes, interpret: as
        in `flash_attention`, with causality and windows on global positions. Ring steps whose
        block lies wholly outside the mask (the future under is_causal, beyond the window) run
        no kernel, and the ring stops after the last step any device needs.
      return_residuals: also return lse (B, N, T), float32.

    Returns:
      out (B, T, N, H) in query's dtype, or (out, lse). Rows that see no key output zeros with
      lse -inf.
    """
    from pallas_flash.api import _canonical_window, flash_attention

    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"ring_attention takes batched {name} [B, T|S, N|K, H]; got "
                f"{name}.shape={getattr(x, 'shape', None)}"
            )
    num_shards = jax.lax.axis_size(axis_name)
    if num_shards == 1:
        layout = "contiguous"  # the zig-zag order of one shard is the identity
    q_len, kv_len = query.shape[1], key.shape[1]
    if layout == "zigzag" and (q_len != kv_len or q_len % 2):
        raise ValueError(
            f"layout='zigzag' needs equal, even local lengths; got query.shape={query.shape}, "
            f"key.shape={key.shape}"
        )
    window = _canonical_window(local_window_size)
    lo = -window[0] if window is not None else -_UNBOUNDED
    hi = window[1] if window is not None else _UNBOUNDED
    if is_causal:
        hi = min(hi, 0)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    shard = jax.lax.axis_index(axis_name)
    batch = query.shape[0]
    segmented = (
        q_segment_ids is not None
        or query_seq_lengths is not None
        or key_value_seq_lengths is not None
    )
    q_seg = kv_seg = None
    if segmented:
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

    def attend(q, k, v, qs, ks, window_):
        # A window closed on the right at the diagonal is the causal mask (and, unbounded on the
        # left, nothing else): the kernels' causal paths, not their window paths, run it.
        causal = window_ is not None and window_[1] == 0
        if causal and window_[0] >= _UNBOUNDED:
            window_ = None
        return flash_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=causal,
            q_segment_ids=qs,
            kv_segment_ids=ks,
            local_window_size=window_,
            logits_soft_cap=logits_soft_cap,
            return_residuals=True,
            backend=backend,
            block_sizes=block_sizes,
            interpret=interpret,
        )

    ring = _Ring(
        axis_name=axis_name,
        num_shards=num_shards,
        layout=layout,
        attend=attend,
        steps=tuple(
            tuple(
                _step_cases(layout, i, (i - r) % num_shards, num_shards, q_len, kv_len, lo, hi)
                for i in range(num_shards)
            )
            for r in range(num_shards)
        ),
    )
    out, lse = _ring_attention(ring, query, key, value, q_seg, kv_seg)
    return (out, lse) if return_residuals else out


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
    """The static plan of one ring: `steps[r][i]` are shard i's cases (`_step_cases`) against
    the block it holds at step r, the block of shard i - r."""

    axis_name: str
    num_shards: int
    layout: str
    attend: object
    steps: tuple

    @functools.cached_property
    def last(self) -> int:
        """The last step any shard computes: the ring stops there."""
        return max((r for r in range(len(self.steps)) if self.busy(r)), default=0)

    def busy(self, r: int) -> bool:
        """Whether any shard computes at step r."""
        return any(c[2] is not None for cases in self.steps[r] for c in cases)

    def step(self, r: int, q, q_seg, k, v, kv_seg):
        """(out, lse) of this shard's queries against the block it holds at step r, or None
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
        shard = jax.lax.axis_index(self.axis_name)
        which = jnp.asarray([distinct.index(cases) for cases in step], jnp.int32)[shard]
        return jax.lax.switch(which, branches, q, q_seg, k, v, kv_seg)

    def send(self, x, shift: int = 1):
        """x from every shard to shard i + shift of the ring."""
        n = self.num_shards
        perm = [(i, (i + shift) % n) for i in range(n)]
        return jax.lax.ppermute(x, self.axis_name, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_seg, kv_seg):
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
    out, lse = acc if acc is not None else _empty(q)
    return out.astype(q.dtype), lse


def _ring_fwd_rule(ring, q, k, v, q_seg, kv_seg):
    out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd_rule(ring, residuals, cotangents):
    """The ring backward: K/V blocks travel the ring again with their dK/dV accumulators; at
    each step the block's gradients come from the vjp of the step (its forward recomputed) with
    the cotangents the lse merge gives it:

        w_r = exp(lse_r - lse),  d out_r = w_r dO,  d lse_r = w_r (dlse + rowsum(dO (out_r - out)))

    so no device holds more than one remote block at a time. After the last step each
    accumulator goes back to its owner in one permute."""
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    d_out = d_out.astype(jnp.float32)
    out32 = out.astype(jnp.float32)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    # The barrier keeps XLA from merging these permutes with the forward's, which would keep
    # every received block alive from the forward to the backward.
    block = jax.lax.optimization_barrier((k, v, kv_seg))
    for r in range(ring.last + 1):
        following = ring.send(block) if r < ring.last else None

        def step(q, k, v, r=r, kv_seg=block[2]):
            return ring.step(r, q, q_seg, k, v, kv_seg)

        if ring.busy(r):
            (out_r, lse_r), pullback = jax.vjp(step, q, *block[:2])
            live = jnp.isfinite(lse_r) & jnp.isfinite(lse)
            w = jnp.where(live, jnp.exp(jnp.where(live, lse_r - lse, 0.0)), 0.0)
            w_rows = jnp.swapaxes(w, 1, 2)[..., None]
            residual = jnp.einsum("btnh,btnh->bnt", d_out, out_r.astype(jnp.float32) - out32)
            d_lse_r = w * (d_lse + residual)
            dq_r, dk_r, dv_r = pullback(((w_rows * d_out).astype(out_r.dtype), d_lse_r))
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
    return_residuals: bool = False,
    **kwargs,
):
    """`ring_attention` for global arrays under jit: a `jax.shard_map` over `mesh` with the
    sequence split over `context_axis` (and optionally the batch over `batch_axis`, the heads
    over `head_axis`). Arguments as in `ring_attention` but global: query (B, T, N, H), segment
    ids (B, T) / (B, S), in `kwargs['layout']` order."""
    qkv = P(batch_axis, context_axis, head_axis, None)
    seg = P(batch_axis, context_axis)
    lengths = P(batch_axis)
    optional = {
        "q_segment_ids": (q_segment_ids, seg),
        "kv_segment_ids": (kv_segment_ids, seg),
        "query_seq_lengths": (query_seq_lengths, lengths),
        "key_value_seq_lengths": (key_value_seq_lengths, lengths),
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
        check_vma=False,
    )(*operands)
    return (out, lse) if return_residuals else out
