"""What every Triton-lowered Pallas kernel of the library shares: masked loads of rows and
vectors, a loop over static or traced bounds, and compiler params whose lowering keeps quiet.
The Triton kernels (`pallas_flash.triton`) and the Mosaic backward's fixed-point scales
(`pallas_flash.mosaic.fixed_point`) take them from here."""

from __future__ import annotations

import dataclasses
import functools
import warnings

# Pallas' interpreter imports jax's Pallas fuser lazily, on its first kernel, and that import
# registers a config option that belongs to JAX's tracing context: a jit traced before the first
# interpreted kernel (a training step's first call) would then retrace and compile once more.
# Importing the fuser with the library keeps the tracing context the same from the start.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def load_rows(ref, start, block: int, length, head_dim: int, *, ragged: bool, head=None, lead=()):
    """Rows [start, start + block) of a [length, Hp] ref (or of head `head` of a
    [length, heads, Hp] ref); rows past `length` and columns past `head_dim` read as zero.
    `ragged=False` promises that the rows are in bounds, which saves the row mask. `lead`:
    indices of leading dims (a batch) to read at; one indexer, as the Triton lowering needs."""
    hp = ref.shape[-1]
    mask = None
    if head_dim != hp:
        mask = lax.broadcasted_iota(jnp.int32, (1, hp), 1) < head_dim
    if ragged:
        rows = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        row_mask = rows < length
        mask = row_mask if mask is None else row_mask & mask
    if head is None:
        tile = ref.at[(*lead, pl.ds(start, block), slice(None))]
    else:
        tile = ref.at[(*lead, pl.ds(start, block), head, slice(None))]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=mask, other=0.0)


def load_vector(ref, start, block: int, length, *, ragged: bool, head=None, other=0.0, lead=()):
    """Entries [start, start + block) of a [length] ref (or of row `head` of a [heads, length]
    ref), `other` past `length`; `lead` as in load_rows."""
    heads = () if head is None else (head,)
    tile = ref.at[(*lead, *heads, pl.ds(start, block))]
    if not ragged:
        return plgpu.load(tile)
    idx = start + lax.broadcasted_iota(jnp.int32, (block,), 0)
    return plgpu.load(tile, mask=idx < length, other=other)


def fold(lo, hi, body, carry):
    """lax.fori_loop that also accepts Python-int bounds and skips empty static ranges. The index
    is int32 also under jax_enable_x64, as the kernels' other indices are."""
    if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:
        return carry
    int32 = functools.partial(lax.convert_element_type, new_dtype=jnp.int32)
    return lax.fori_loop(int32(lo), int32(hi), body, carry)


def div(a, b):
    """a // b of non-negative integers (scalars or arrays) in int32: lax.div, since jnp's floor
    division lowers to a comparison Triton rejects; int32 also under jax_enable_x64, where a
    Python int is int64 and lax.div refuses the mix."""
    int32 = functools.partial(lax.convert_element_type, new_dtype=jnp.int32)
    return lax.div(int32(a), int32(b))


def cdiv(a, b):
    """ceil(a / b) of non-negative integers in int32, as `div`."""
    return div(a + b - 1, b)


def rem(a, b):
    """a % b of non-negative integers in int32, as `div`."""
    int32 = functools.partial(lax.convert_element_type, new_dtype=jnp.int32)
    return lax.rem(int32(a), int32(b))


# -- compiler params ------------------------------------------------------------------------------
# The Pallas Triton backend warns "deprecated" each time a kernel is lowered for a GPU. Our users
# did not choose that backend, so the library silences exactly that warning for its own kernels:
# the kernels carry a subclass of the Triton compiler params whose lowering rule wraps the stock
# rule in a warnings filter. Other Pallas Triton kernels keep their warning. jax has no public
# way to register that rule: it goes through Pallas' private registry (docs/design.md, "Private
# jax"), and a jax without that registry gets the stock params, warning included.


@dataclasses.dataclass(frozen=True)
class CompilerParams(plgpu.CompilerParams):
    """Triton compiler params for pallas_flash's own kernels."""


def _register_quiet_lowering() -> bool:
    """Registers CompilerParams' lowering rule: the stock Triton rule (registered by importing
    `jax.experimental.pallas.triton`) without its deprecation warning. False where Pallas has
    no such registry or no stock rule."""
    try:
        from jax._src.pallas import core as pallas_core

        stock_rule = pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu")
        register = pallas_core.register_lowering_rule
    except (ImportError, AttributeError):
        return False
    if stock_rule is None:
        return False

    def quiet_rule(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore",
                message="The Pallas Triton backend is deprecated",
                category=DeprecationWarning,
            )
            return stock_rule(*args, **kwargs)

    register(CompilerParams, quiet_rule, "gpu")
    return True


if not _register_quiet_lowering():
    CompilerParams = plgpu.CompilerParams  # a subclass without a rule could not lower
