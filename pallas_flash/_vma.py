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
            launch = pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **kwargs)
            return vary_like(unchecked(launch)(*operands), *operands)
        typed = typed_like(out_shape, *operands)
        return pl.pallas_call(kernel, out_shape=typed, interpret=interpret, **kwargs)(*operands)

    return call


def unchecked(fn):
    """fn on operands that vary over no axis, in a shard_map over no further axes with
    check_vma=False; its results vary over none (callers `vary_like` them).

    For Pallas' interpreter (`interpret=True`): it lowers the kernel's ops as jax ops on blocks
    of the operands next to the kernel's own constants, which vary over no axis, and under
    check_vma those ops refuse operands of unequal types (jax 0.11.2 and 0.12.0.1 alike:
    "Primitive add requires varying manual axes to match"). A kernel compiled for a GPU lowers
    no jax op and takes the typed launch; so do the Mosaic GPU kernels in jax's Mosaic GPU
    interpreter, which `plgpu.kernel` traces with check_vma off."""

    def run(*operands):
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
