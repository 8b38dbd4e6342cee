"""Batch and head sharding of the kernels' passes.

`_vjp._forward` and `_vjp._backward` (and decode's kernel, `decode._partitioned_kernel`) go
through `partitioned`, which tells jax's SPMD partitioner that every batch entry and every kv head
(with its query heads) is independent, so each device runs the kernels on its own shard and
nothing is gathered. With jit's automatic sharding that is a
`jax.experimental.custom_partitioning` rule, whose shard function XLA's partitioner asks for at
every call site: it embeds a `jax.export` of the pass lowered once per shard shape (`_exported`),
so a deep model lowers its kernels once, as on one device. With explicit sharding (sharding in
types) the shardings are known when tracing, and the call runs in a `jax.shard_map` over them
(traced once, like any jit'd function). The sequence and head-dim axes cannot be split by the
kernels (nor a paged cache's pool over its pages): a call with q, k or v sharded over them raises
ValueError (context parallelism is `pallas_flash.sharding.ring_attention`).

On one device (`jax.device_count() == 1`) `partitioned` calls the kernels directly: the
single-device program is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
    block's kv heads on the same device), and for decode a cache's sequence (`context`: each
    device holds a contiguous run of the cache's slots; the partial results merge across
    them)."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]
    context: tuple[str, ...] = ()

    def spec(self, shape, kind: str):
        """The PartitionSpec of an operand of `kind` (see `_RULES`); "pair" operands (bias,
        mask: [B|1, N|1, T|1, S|1]) keep their broadcast dims whole."""
        batch, heads = _entry(self.batch), _entry(self.heads)
        if kind in ("kv", "v"):
            return P(batch, _entry(self.context), heads, None)
        if kind in ("q", "o"):
            return P(batch, None, heads, None)
        if kind in ("pages", "vpages"):  # one pool for the whole batch: split over heads only
            return P(None, None, heads, None)
        if kind == "lse":
            return P(batch, heads, None)
        if kind == "lengths":
            return P(batch)
        if kind in ("q_seg", "kv_seg", "tables"):
            return P(batch, None)
        if kind in ("seeds", "sinks"):
            return P(batch, heads)
        if kind == "scale":  # a float8 cache's scales, one per KV head
            return P(heads)
        return P(batch if shape[0] > 1 else None, heads if shape[1] > 1 else None, None, None)

    def reduced_axes(self, pair_shape) -> tuple[str, ...]:
        """Mesh axes over which a bias broadcast along B or N gets partial gradients."""
        return (self.batch if pair_shape[0] == 1 else ()) + (
            self.heads if pair_shape[1] == 1 else ()
        )


# The public function a pass belongs to (for messages), and its key and value arguments' names.
_CALLERS = {"kv": "flash_attention", "lengths": "decode_attention", "pages": "paged_attention"}
_KEY_VALUE_NAMES = {
    "flash_attention": ("key", "value"),
    "decode_attention": ("key_cache", "value_cache"),
    "paged_attention": ("key_pages", "value_pages"),
}


def _caller(kinds) -> str:
    """The public function of a pass whose operands have these (leaf or top-level) kinds: a
    paged cache's pages make it paged_attention, lengths without pages decode_attention."""
    if "pages" in kinds:
        return _CALLERS["pages"]
    return _CALLERS["lengths"] if "lengths" in kinds else _CALLERS["kv"]


def plan(mesh, q_shape, k_shape, q_spec, k_spec, v_spec=None, *, caller="flash_attention") -> _Plan:
    """The batch and head axes of a call whose q, k (and v) carry these PartitionSpecs, and for
    "decode_attention" the axes its cache's sequence is split over (`_Plan.context`); k and v
    are a paged cache's pages where caller is "paged_attention".

    Raises ValueError when an operand is sharded over its sequence or head-dim axis (the kernels
    cannot split them, but for a decode cache's sequence; a paged cache's pages and page axes
    neither), or when the heads are split over more shards than there are kv heads.
    """
    paged = caller == _CALLERS["pages"]
    names = _KEY_VALUE_NAMES[caller]
    specs = {"query": _spec_entries(q_spec, 4), names[0]: _spec_entries(k_spec, 4)}
    if v_spec is not None:
        specs[names[1]] = _spec_entries(v_spec, 4)
    # decode_attention's cache may be split over its sequence (the partial results merge across
    # its shards); its queries may not.
    over_sequence = caller == _CALLERS["lengths"]
    for name, spec in specs.items():
        axes = ((1, "sequence"), (3, "head-dim"))
        if over_sequence and name != "query":
            axes = ((3, "head-dim"),)
        if paged and name != "query":
            axes = ((0, "pages"), (1, "page"), (3, "head-dim"))
        for dim, what in axes:
            if spec[dim] is not None:
                hint = {
                    _CALLERS["kv"]: "use pallas_flash.ring_attention for a sharded sequence",
                    _CALLERS["lengths"]: "split the cache's sequence, not the queries'",
                    _CALLERS["pages"]: "split a paged pool over its heads only",
                }[caller]
                raise ValueError(
                    f"{caller}: {name} is sharded over its {what} axis "
                    f"({name} sharding {P(*spec)}); the kernels split only the batch and head "
                    "axes. Replicate that axis (jax.lax.with_sharding_constraint or "
                    f"jax.sharding.reshard), or {hint}"
                )
    q, k = specs["query"], specs[names[0]]
    batch = _axes(q[0]) or (() if paged else _axes(k[0]))
    heads = _axes(q[2]) or _axes(k[2])
    context = _axes(k[1]) if over_sequence else ()
    for name, spec in specs.items():
        if name != "query" and _axes(spec[1]) != context:
            raise ValueError(
                f"{caller}: {name}'s sequence axis is sharded over {_axes(spec[1])} but "
                f"{names[0]}'s over {context}: shard them alike"
            )
    if set(context) & set(batch + heads):
        raise ValueError(
            f"{caller}: {names[0]}'s sequence axis is sharded over {context}, which also split "
            f"the batch or heads ({batch}, {heads}): use distinct mesh axes"
        )
    for name, spec in specs.items():
        checks = (
            ((2, heads, "head"),)
            if paged and name != "query"
            else ((0, batch, "batch"), (2, heads, "head"))
        )
        for dim, axes, what in checks:
            if _axes(spec[dim]) not in ((), axes):
                raise ValueError(
                    f"{caller}: {name}'s {what} axis is sharded over "
                    f"{_axes(spec[dim])} but query/{names[0]} over {axes}: shard them alike"
                )
    shards = _mesh_size(mesh, heads)
    num_kv_heads = k_shape[2]
    if num_kv_heads % shards:
        raise ValueError(
            f"{caller}: the heads are sharded over {heads} ({shards} shards), which does "
            f"not divide {num_kv_heads=} ({names[0]}.shape={tuple(k_shape)}): each shard must "
            "hold whole kv heads with their query heads; shard the heads over at most "
            "num_kv_heads devices"
        )
    if q_shape[0] % _mesh_size(mesh, batch):
        raise ValueError(
            f"{caller}: batch {q_shape[0]} (query.shape={tuple(q_shape)}) is not "
            f"divisible by its {_mesh_size(mesh, batch)} shards over {batch}"
        )
    return _Plan(batch, heads, context)


# Shardy factors of each operand kind: batch `b` and kv heads `k` (query heads `(k g)`, the
# query groups `g` of each kv head) are shared; sequences `t`, `s` and head dim `h` are shared too,
# so that a sharding of them reaches `plan`, which refuses it. Values and outputs ("v", "o") have
# their own head dim `e` (the value head dim may differ from q's and k's).
_RULES = {
    "q": "b t {n} h",
    "kv": "b s k h",
    "o": "b t {n} e",
    "v": "b s k e",
    "lse": "b {n} t",
    "q_seg": "b t",
    "kv_seg": "b s",
    # Decode: the sequences' lengths, a paged cache's block tables [B, max_pages] and its pages
    # [P, page_size, K, H] (values: Hv), a pool the whole batch shares.
    "lengths": "b",
    "tables": "b m",
    "pages": "p z k h",
    "vpages": "p z k e",
    "seeds": "b {n}",
    "sinks": "b {n}",
    # A float8 cache's scales [K], one per kv head.
    "scale": "k",
}


def leaf_kinds(values, kinds) -> tuple[str, ...]:
    """The kind of every array leaf of `values` (q, k, v, bias, MaskArrays, ...), in flattening
    order; `kinds` names each top-level value ("arrays" for a MaskArrays)."""
    flat = []
    for kind, x in zip(kinds, values, strict=True):
        if kind == "arrays":
            flat += [
                name
                for name, a in zip(("q_seg", "kv_seg", "pair", "seeds"), x, strict=True)
                if a is not None
            ]
        elif x is not None:
            flat.append(kind)
    return tuple(flat)


def _sharding_rule(kinds_in, kinds_out, shapes_in, shapes_out):
    """The einsum-like Shardy rule of a pass and its factor sizes."""
    num_heads, num_kv_heads = shapes_in[0][2], shapes_in[1][2]
    group = num_heads // num_kv_heads
    # Shardy takes no compound factor of size 1: with one kv head (MQA, MLA's latent cache)
    # the query heads are the group alone.
    heads_q = "k" if group == 1 else "g" if num_kv_heads == 1 else "(k g)"
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
    return f"{ins} -> {outs}", ({"g": group} if "(k g)" in heads_q else {})


def _specs(plan_: _Plan, kinds, shapes):
    return [plan_.spec(s, k) for k, s in zip(kinds, shapes, strict=True)]


def _local_config(config, arrays: MaskArrays):
    """The config of one shard: the dense mask's shape is the shard's."""
    if arrays.mask is None:
        return config
    return dataclasses.replace(
        config, spec=dataclasses.replace(config.spec, mask_shape=tuple(arrays.mask.shape))
    )


def _shard_fn(kernel, config, plan_: _Plan, *, with_dbias: bool, platform: str | None = None):
    """The function one shard runs: the kernels on local shapes. with_dbias: the results are
    (dq, dk, dv, dbias) of a bias; one broadcast over a sharded batch or head axis gets partial
    gradients on each shard: they are summed over the shards. platform: where the kernels run
    through `_exported` (the partitioning rule's lowering), None to call them directly."""

    def call(args, local):
        if platform is None:
            return kernel(*args, config=local)
        leaves, tree = jax.tree.flatten(list(args))
        avals = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)
        # jax.export reads the mesh context (jax.set_mesh) into the module's device count, and
        # the jit settings that change a lowering: they key the module too.
        context = (
            jax.sharding.get_abstract_mesh(),
            jax.config.jax_enable_x64,
            jax.config.jax_default_matmul_precision,
        )
        try:
            exported = _exported(kernel, local, tree, avals, platform, context)
        except Exception as e:  # noqa: BLE001 -- the direct lowering: the same kernels
            # Only compile time is at stake: lower the kernels here, as every call site did
            # before, and say why.
            warnings.warn(
                f"pallas_flash: the partitioned kernels could not be exported once "
                f"({type(e).__name__}: {str(e)[:200]}); lowering them at every call site",
                RuntimeWarning,
                stacklevel=2,
            )
            return kernel(*args, config=local)
        return exported.call(*leaves)

    def run(*args):
        arrays = next((a for a in args if isinstance(a, MaskArrays)), None)
        local = config if arrays is None else _local_config(config, arrays)
        if plan_.context:
            # A cache split over its sequence: the kernel (which knows how) runs on this
            # device's slots and merges the parts over the context axes.
            over_context = getattr(kernel, "over_context", None)
            if over_context is None:  # a vmapped call's (`_Folded`)
                raise NotImplementedError(
                    "decode_attention under jax.vmap over a key_cache split over its sequence "
                    f"({plan_.context}): call it on the batched arrays instead"
                )
            return over_context(call, args, local, plan_.context)
        results = call(args, local)
        if with_dbias and (axes := plan_.reduced_axes(args[3].shape)):
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


@functools.lru_cache(maxsize=256)
def _exported(kernel, config, tree, avals, platform: str, context=()):
    """`kernel` on one shard's operands of these shapes, lowered once (`jax.export`).

    XLA's SPMD partitioner asks for the partitioned computation at every call site of the
    kernels (every layer of a model), and jax lowers what the rule returns each time: for the
    Mosaic kernels ~0.35 s of Python each, per layer. A layer's call of the same kernels on the
    same shapes takes the module lowered first (its kernels then compile once too, as on one
    device)."""

    def shard(*leaves):
        args = jax.tree.unflatten(tree, leaves)
        return kernel(*args, config=config)

    shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
    return jax.export.export(
        jax.jit(shard),
        platforms=[platform],
        # The Triton kernels' custom call is not among export's stable targets: the module
        # never leaves this process, so its stability across jax versions does not matter.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)],
    )(*shapes)


_TRITON_TARGET = "__gpu$xla.gpu.triton"


def _export_platform(config, mesh) -> str | None:
    """The platform jax.export lowers the kernels of `config` for on the mesh's devices, or None
    where they hold host callbacks, which export cannot serialise (jax's Mosaic GPU interpreter,
    a CPU test path): those lower at every call site."""
    kernels = (getattr(config, "forward", None), getattr(config, "backward", None))
    if config.interpret and "mosaic" in kernels:
        return None
    platform = mesh.devices.flat[0].platform
    return {"gpu": "cuda"}.get(platform, platform)


def _partition(kernel, config, kinds_in, kinds_out, mesh, arg_shapes, result_shape):
    lead = getattr(kernel, "lead", 0)
    q, k, v = arg_shapes[:3]
    specs = [_spec_entries(x.sharding.spec, 4 + lead) for x in (q, k, v)]
    plan_ = plan(
        mesh,
        q.shape[lead:],
        k.shape[lead:],
        *(s[lead:] for s in specs),
        caller=_caller(kinds_in),
    )
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
        _shard_fn(
            kernel,
            config,
            plan_,
            with_dbias="pair" in kinds_out,
            platform=_export_platform(config, mesh),
        ),
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


def _all_manual() -> bool:
    """Whether this is traced inside a shard_map that is manual over every mesh axis."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.are_all_axes_manual


def _explicit_mesh(x):
    """The mesh of `x`'s type when it has Explicit axes (sharding in types), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    return mesh


def whole_sequences(reference):
    """reference(q, k, v, *rest, **options) (plain jnp over a contiguous cache: decode's "xla"
    path and its kernel's gradient) on k and v made whole over their sequence axis where their
    type splits it (Explicit mesh axes): jnp contracts over the keys, and sharding in types
    leaves no contraction over a split axis to the compiler. Auto meshes and unsharded caches
    are left as they are."""

    def whole(x):
        mesh = _explicit_mesh(x)
        spec = _spec_entries(jax.typeof(x).sharding.spec, x.ndim) if mesh else ()
        if not spec or spec[1] is None:
            return x
        return jax.sharding.reshard(x, NamedSharding(mesh, P(spec[0], None, *spec[2:])))

    @functools.wraps(reference)
    def run(q, k, v, *rest, **options):
        return reference(q, whole(k), whole(v), *rest, **options)

    return run


def with_sharding_of(g, x):
    """g (a gradient computed outside the kernels) in the sharding type of its primal x, under
    sharding in types, where XLA's propagation may have given it another."""
    mesh = _explicit_mesh(x) or _explicit_mesh(g)
    if mesh is None:
        return g
    return jax.sharding.reshard(g, NamedSharding(mesh, jax.typeof(x).sharding.spec))


def partitioned(kernel, config, kinds, out_kinds, *args, lead: int = 0):
    """`kernel(*args, config=config)` (one pass of the kernels) split over the batch and head axes
    of a device mesh: each device runs it on its shard.

    kinds: the kind of each top-level argument ("q", "kv", "v" and "o" for values and outputs
    [.., Hv], "lse", "pair" for a bias (may be None), "arrays" for MaskArrays, "sinks" for
    [B, N] sink logits (may be None); decode's "lengths" [B], a paged cache's "pages" and
    "vpages" [P, page_size, K, H | Hv] and "tables" [B, max_pages] (None for a contiguous
    cache), a float8 cache's "scale" [K] (may be None)); out_kinds: the same for the results
    (dbias: "pair").
    lead: leading vmapped dims on every operand (the batching rule's own recursion).
    """
    if jax.device_count() == 1 or _all_manual():
        # One device, or inside a shard_map over every mesh axis (ring attention's steps):
        # nothing to partition, and a custom_partitioning call would be partitioned (lowered
        # again) at every call site.
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
        # A bias or dense mask has its own broadcast batch axis, and a paged cache's pool has
        # none: those calls do not fold.
        foldable = all(
            (kind != "pair" or x is None) and (kind != "arrays" or x.mask is None)
            for kind, x in zip(kinds, args)
        )
        foldable &= "pages" not in kinds and "scale" not in kinds_in
        foldable &= all(b for b, kind in zip(batched, kinds_in) if kind in ("q", "kv", "v"))
        if foldable:
            # The vmapped axis becomes one more leading dim of the partitioned call; unbatched
            # segment ids, lengths, block tables and cotangents (jax hands a zero d_lse over
            # unbatched) are broadcast along it.
            a = jax.tree.map(
                lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape)),
                list(a),
                list(in_batched),
            )
            out = partitioned(kernel, config, kinds, out_kinds, *a, lead=lead + 1)
        else:
            # A bias or dense mask, a paged cache, float8 scales, or unbatched q/k/v: the
            # kernels batch as pallas_calls do, unpartitioned.
            axes = jax.tree.map(lambda b: 0 if b else None, list(in_batched))
            out = jax.vmap(lambda *x: inner(*x, config=config), in_axes=axes)(*a)
        return out, jax.tree.map(lambda _: True, out)

    return call(*args)


def _out_leaf_kinds(out_kinds, args):
    """Result leaf kinds: dbias ("pair", the backward's, whose bias is args[3]) exists only with
    a bias."""
    if "pair" not in out_kinds:
        return tuple(out_kinds)
    return tuple(k for k in out_kinds if k != "pair" or args[3] is not None)


def _shard_map_call(kernel, config, kinds, out_kinds, mesh, *args):
    q, k, v = args[:3]
    plan_ = plan(
        mesh,
        q.shape,
        k.shape,
        jax.typeof(q).sharding.spec,
        jax.typeof(k).sharding.spec,
        jax.typeof(v).sharding.spec,
        caller=_caller(kinds),
    )
    backward = "pair" in out_kinds  # (dq, dk, dv, dbias) of a bias args[3]
    original_bias = args[3] if backward else None
    leaves, tree = jax.tree.flatten(args)
    in_specs = jax.tree.unflatten(
        tree, _specs(plan_, leaf_kinds(args, kinds), [x.shape for x in leaves])
    )
    shapes = {
        "q": q.shape,
        "kv": k.shape,
        "o": (*q.shape[:3], v.shape[3]),
        "v": v.shape,
        "lse": (q.shape[0], q.shape[2], q.shape[1]),
    }
    if original_bias is not None:
        shapes["pair"] = original_bias.shape
    out_kinds = _out_leaf_kinds(out_kinds, args)
    out_specs = tuple(_specs(plan_, out_kinds, [shapes[k] for k in out_kinds]))
    if backward and original_bias is None:  # dbias is None
        out_specs = (*out_specs, None)
    # Shardings, not bare specs: these need no mesh context (`jax.set_mesh`), which a caller
    # whose arrays carry an explicit mesh in their types may not have entered.
    args = jax.tree.map(
        lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec)),
        list(args),
        list(in_specs),
    )
    results = jax.shard_map(
        _shard_fn(kernel, config, plan_, with_dbias="pair" in out_kinds),
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
    )(*args)
    if backward:
        # Gradients take their primals' types (a replicated bias gets a replicated gradient).
        results = tuple(
            None
            if g is None
            else jax.sharding.reshard(g, NamedSharding(mesh, jax.typeof(x).sharding.spec))
            for g, x in zip(results, (q, k, v, original_bias), strict=True)
        )
    return results
