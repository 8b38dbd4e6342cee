"""Varying manual axes: inside `jax.shard_map` with check_vma=True (its default) each value's
type names the manual mesh axes over which it varies (`jax.typeof(x).manual_axis_type.varying`),
and jax checks them. A kernel's outputs vary over every axis its operands vary over: `pallas_call`
types them so, and `mosaic.launch` gives its kernels' outputs the same type (`vary_like`). Values
made apart from the operands (zeros, the branches of a `lax.switch`) take it with `vary_like`.
Outside a shard_map, or with check_vma=False, nothing varies and these change nothing."""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import ManualAxisType
from jax.sharding import PartitionSpec as P


def varying_axes(*operands) -> frozenset:
    """The manual mesh axes over which any array of `operands` (pytrees) varies."""
    axes = frozenset()
    for x in jax.tree.leaves(operands):
        axes |= jax.typeof(x).manual_axis_type.varying
    return axes


def vary_like(tree, *operands):
    """The arrays of `tree`, each cast (`jax.lax.pcast`) to vary over every axis that an array
    of `operands` varies over: a value the same on every device of an axis is also one that
    may vary over it."""
    axes = varying_axes(*operands)

    def cast(x):
        missing = axes - jax.typeof(x).manual_axis_type.varying
        if not missing:
            return x
        return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")

    return jax.tree.map(cast, tree)


def typed_like(out_shape, *operands):
    """`out_shape` (a pytree of jax.ShapeDtypeStruct) varying over the axes of `operands`."""
    mat = ManualAxisType(varying=varying_axes(*operands))
    return jax.tree.map(lambda s: s.update(manual_axis_type=mat), out_shape)


def pallas_call(kernel, *, out_shape, interpret=False, **kwargs):
    """`pl.pallas_call` whose outputs vary over the manual axes its operands vary over (a
    pallas_call under check_vma must be told)."""

    def call(*operands):
        if interpret and varying_axes(*operands):
            # Typed as varying over no axis, as `unchecked` runs it.
            launch = pl.pallas_call(
                kernel, out_shape=typed_like(out_shape), interpret=interpret, **kwargs
            )
            return vary_like(unchecked(launch)(*operands), *operands)
        typed = typed_like(out_shape, *operands)
        return pl.pallas_call(kernel, out_shape=typed, interpret=interpret, **kwargs)(*operands)

    return call


def unchecked(fn):
    """fn on the operands as on values that vary over no axis; its results vary over none
    (callers `vary_like` them).

    For Pallas' interpreter (`interpret=True`): it lowers the kernel's ops as jax ops on blocks
    of the operands next to the kernel's own constants, which vary over no axis, and under
    check_vma those ops refuse operands of unequal types ("Primitive add requires varying manual
    axes to match"). A kernel compiled for a GPU lowers no jax op and takes the typed launch; so
    do the Mosaic GPU kernels in jax's Mosaic GPU interpreter, which `plgpu.kernel` traces with
    check_vma off.

    Where every mesh axis is manual, fn is lowered apart (`_exported`): jax (from 0.12.1)
    refuses a nested shard_map that goes manual over no further axis. Otherwise fn runs in a
    nested shard_map over the axes not manual yet, with check_vma=False."""

    def run(*operands):
        if jax.sharding.get_abstract_mesh().are_all_axes_manual:
            return _exported(fn)(*operands)

        def body(*operands):
            # Under check_vma=False an op's result varies over no axis: a full slice (exact for
            # any dtype) gives the operands that type.
            return fn(*jax.tree.map(lambda x: lax.slice(x, (0,) * x.ndim, x.shape), operands))

        return jax.shard_map(
            body,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=P(),
            out_specs=P(),
            axis_names=frozenset(),
            check_vma=False,
        )(*operands)

    return run


def _exported(fn):
    """fn lowered apart (`jax.export`) for operands of these shapes and dtypes that vary over no
    axis, and called on the operands: jax's call of an exported module takes operands of any
    type, and its results vary over no axis. Each device runs fn on its own operands, with no
    collective (fn may sit in a branch that only some devices take). Under jax.vmap, the
    vmapped fn is lowered apart (an exported call has no batching rule of its own). The bits
    are the direct call's where jax.export keeps its ops (jax 0.11.2, 0.12.0.1); jax 0.12.1
    writes `lax.exp2` for an older StableHLO, as exp(x * ln 2), as it does in the partitioned
    passes (`_partition._exported`)."""

    @jax.custom_batching.custom_vmap
    def call(*operands):
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands]
        return jax.export.export(jax.jit(fn))(*shapes).call(*operands)

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *operands):
        del axis_size
        axes = tuple(0 if batched else None for batched in in_batched)
        results = _exported(jax.vmap(fn, in_axes=axes))(*operands)
        return results, jax.tree.map(lambda _: True, results)

    return call
