"""Shared by the Triton kernels: constants, masked tile loads and stores, quiet compiler params."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 logsumexp back to natural log

# Masked logits. Finite, so that max/subtract never meet -inf - -inf; the kernels also zero the
# probabilities of masked entries explicitly, so a row that has seen no key yet keeps l == 0.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b.T) on the matrix units with f32 accumulation; f32 inputs stay f32 (IEEE)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def load_rows(ref, start, block: int, length, head_dim: int, *, ragged: bool, head=None):
    """Rows [start, start + block) of a [length, Hp] ref (or of head `head` of a
    [length, heads, Hp] ref); rows past `length` and columns past `head_dim` read as zero.
    `ragged=False` promises that the rows are in bounds, which saves the row mask."""
    hp = ref.shape[-1]
    mask = None
    if head_dim != hp:
        mask = lax.broadcasted_iota(jnp.int32, (1, hp), 1) < head_dim
    if ragged:
        rows = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        row_mask = rows < length
        mask = row_mask if mask is None else row_mask & mask
    if head is None:
        tile = ref.at[pl.ds(start, block), :]
    else:
        tile = ref.at[pl.ds(start, block), head, :]
    if mask is None:
        return plgpu.load(tile)
    return plgpu.load(tile, mask=mask, other=0.0)


def load_vector(ref, start, block: int, length, *, ragged: bool, head=None):
    """Entries [start, start + block) of a [length] ref (or of row `head` of a [heads, length]
    ref), zero past `length`."""
    tile = ref.at[pl.ds(start, block)] if head is None else ref.at[head, pl.ds(start, block)]
    if not ragged:
        return plgpu.load(tile)
    idx = start + lax.broadcasted_iota(jnp.int32, (block,), 0)
    return plgpu.load(tile, mask=idx < length, other=0.0)


def store_rows(ref, value, start, block: int, length: int, head_dim: int):
    """Stores a [block, Hp] tile at rows [start, start + block) of a [length, Hp] ref, masked."""
    hp = ref.shape[-1]
    rows = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    mask = rows < length
    if head_dim != hp:
        mask = mask & (lax.broadcasted_iota(jnp.int32, (1, hp), 1) < head_dim)
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def fold(lo, hi, body, carry):
    """lax.fori_loop that also accepts Python-int bounds and skips empty static ranges."""
    if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


# -- compiler params ------------------------------------------------------------------------------
# The Pallas Triton backend warns "deprecated" each time a kernel is lowered for a GPU. Our users
# did not choose that backend, so the library silences exactly that warning for its own kernels:
# the kernels carry a subclass of the Triton compiler params whose lowering rule wraps the stock
# rule in a warnings filter. Other Pallas Triton kernels keep their warning.


@dataclasses.dataclass(frozen=True)
class CompilerParams(plgpu.CompilerParams):
    """Triton compiler params for pallas_flash's own kernels."""


def _register_quiet_lowering():
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import pallas_call_registration  # noqa: F401  registers the rule

    stock_rule = pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu")

    def quiet_rule(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore",
                message="The Pallas Triton backend is deprecated",
                category=DeprecationWarning,
            )
            return stock_rule(*args, **kwargs)

    pallas_core.register_lowering_rule(CompilerParams, quiet_rule, "gpu")


_register_quiet_lowering()
