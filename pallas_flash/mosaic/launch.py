"""What every Mosaic GPU kernel of this package shares at launch: the warp-specialised
`plgpu.kernel` call, the swizzled layout of its shared-memory tiles, the wrappers' zero-padding
to the lengths the kernels run, and the pass that zeroes NaN and inf in a tile of keys or values
that some rows must not see."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir

from pallas_flash import _vma
from pallas_flash.mosaic import _module_names
from pallas_flash.mosaic.tiles import swizzle_bytes

_module_names.install()


def pad_to(x, length: int):
    """x [B, L, heads, H] zero-padded to [B, length, heads, H] (x itself when it fits)."""
    if x.shape[1] == length:
        return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def smem_transforms(cols: int, dtype) -> tuple:
    """The transforms of a shared-memory tile [.., rows, cols] of 16-bit `dtype` that TMA writes
    and wgmma reads as they are: (8, swizzle // itemsize) tiles under the widest swizzle that
    divides a row (`swizzle_bytes`: 128 bytes, 64-element tiles, at 64/128/192/256 columns; 64
    at 96; 32 at 80). wgmma takes one swizzle for both operands: the two smem operands of a
    product must have equal column counts (Q.K^T, dO.V^T: both [.., H] or both [.., Hv]), and
    a product whose B operand is read transposed (P.V, dS.K, P^T.dO) contracts over its rows,
    whose count (a multiple of 64) is whole tiles of any of these swizzles."""
    swizzle = swizzle_bytes(cols, jnp.dtype(dtype).itemsize)
    tile = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, tile)), plgpu.SwizzleTransform(swizzle))


def pad_ids(ids, length: int, pad_id: int):
    if ids.shape[1] == length:
        return ids
    return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), constant_values=pad_id)


def warp_specialised_kernel(
    body, *, out_type, scratch_types, grid, grid_names, num_consumers, kernel_name=None
):
    """plgpu.kernel as this package's Mosaic kernels launch: num_consumers consumer warpgroups
    and one producer (axis "wg", the producer last), approximate exp2 and reciprocals. Inside
    `jax.shard_map` the outputs vary over the manual axes the operands vary over (`_vma`:
    plgpu.kernel itself types them as varying over none)."""

    def call(*operands):
        launch = plgpu.kernel(
            body,
            # A stable module name (see _module_names): the same kernel compiles once per process.
            kernel_name=kernel_name or _module_names.name(body),
            out_type=_vma.typed_like(out_type, *operands),
            scratch_types=scratch_types,
            grid=grid,
            grid_names=grid_names,
            num_threads=num_consumers + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )
        return _vma.vary_like(launch(*operands), *operands)

    return call


def warp_specialised_kernel_into(body, *, into, **launch):
    """warp_specialised_kernel whose outputs start as the arrays `into` and are updated in
    place, for kernels that add into their outputs (TMA reductions) rather than write them
    once: body takes the operands' refs, then into's refs, then the scratch (keywords).
    Returns into's final values. launch: warp_specialised_kernel's scratch_types, grid,
    grid_names and num_consumers. (`plgpu.kernel` takes no input/output aliases; its kernel
    may close over refs, here those of a `pl.run_state` over `into`.)"""

    def call(*operands):
        def stateful(refs):
            def with_refs(*operand_refs, **scratch):
                body(*operand_refs, *refs, **scratch)

            warp_specialised_kernel(
                with_refs, out_type=(), kernel_name=_module_names.name(body), **launch
            )(*operands)

        return _vma.vary_like(pl.run_state(stateful)(tuple(into)), *operands)

    return call


def uninitialised(shape, dtype):
    """An array that a kernel writes whole (an output of `warp_specialised_kernel_into` that
    it stores rather than adds into): an allocation on the GPU (`lax.empty`), where zeros would
    cost a pass over it. tests/support/mosaic_interpret.py fills it with NaN instead, so that the
    interpreted kernels fail their oracle tests if they leave any of it unwritten."""
    return lax.empty(shape, dtype)


def zero_non_finite(ref):
    """Replaces NaN and +-inf in a [rows, H] tile of shared memory (rows a multiple of 64, H of
    16) by 0, and fences the writes for the wgmma that reads the tile next.

    A key that a row cannot see gets P = 0 (or dS = 0) in its tile, but 0 * NaN on the tensor
    cores is NaN: the tile's other rows would see it. 64-row pieces of at most 64 columns keep
    the registers few, next to a consumer's accumulators or within a producer's budget; their
    width divides H, so that no piece straddles the column tiles of a narrower swizzle (32 at
    H=96, 16 at H=80)."""
    rows, cols = ref.shape
    width = math.gcd(cols, 64)
    for r in range(0, rows, 64):
        for c in range(0, cols, width):
            piece = ref.at[pl.ds(r, 64), pl.ds(c, width)]
            x = piece[...]
            piece[...] = jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros_like(x))
    plgpu.commit_smem()


def soft_cap_share(e):
    """1 / (e + 1) of an f32 tile e = exp(2x) >= 0, the r of the soft cap's tanh(x) = 1 - 2r, as
    rsqrt(e + 1)^2: one rsqrt where a quotient lowers to an IEEE division (a reciprocal, Newton
    steps and a slow-path check per element), at a relative error near float32's rounding.
    e = inf gives 0 (tanh 1), e = 0 gives 1 (tanh -1)."""
    r = lax.rsqrt(e + 1.0)
    return r * r


def truncate_to_int32(x):
    """int32 of an f32 tile x in the WGMMA layout, truncated toward zero: one cvt.rzi per
    element. Pallas' `astype` clamps to int32's range first, as XLA does (a NaN-propagating min
    and max and a select per element, read in the H200's SASS), which the conversion does by
    itself on the GPU (cvt.rzi: NaN to 0, out of range saturated; LLVM treats those inputs as
    poison, so callers must not use the value they give: the fused dQ's rows that they reach
    are NaN or 0 after the kernel). jax's Mosaic GPU interpreter runs no `inline_mgpu`:
    tests/support/mosaic_interpret.py puts `astype` in its place."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.int32, plgpu.Layout.WGMMA),
    )
    def convert(_, tile):
        return tile.astype(ir.IntegerType.get_signless(32), is_signed=True)

    return convert(x)


def dropped_value(hashes):
    """Zeros (f32, +-0) in the layout of `hashes`, an int32 vector of dropout hashes, for the
    dropped entries of `where(keep, p, dropped)` ahead of p's cast to 16 bits. Against a
    constant 0 LLVM moves the select past the cast and selects 16-bit halves, a select and a
    repack per element (read in the H200's SASS); against a value it cannot fold (a finite
    float times 0: 0 or -0, which P.V adds as 0) it stays one f32 select. Computed once per
    vector, not per element."""
    return hashes.astype(jnp.float32) * 0.0


def opaque_zero(step):
    """0 for a loop step in [-1, 2^31 - 1) (the fused dQ's step before the first is -1),
    which the compiler cannot prove: added to a buffer's index, it keeps the buffer's address,
    and the wgmma descriptors built from it, inside the step's loop (`step_descriptors` of the
    kernels' tiles), instead of computed once before the loop and held in registers. The step
    passes an optimization barrier (Mosaic GPU: an empty inline asm with side effects, its
    register tied to the step's) first: where the loop's bounds are constants (plain calls)
    LLVM bounds the step otherwise and folds the shift to 0 (ptxas' spills and instructions of
    the plain "fixed" backward kernel were the same with and without it)."""
    return lax.shift_right_logical(lax.optimization_barrier(step) + 1, jnp.int32(31))
