"""The kernels' two passes on one device's shard, in the one shape every backend's wrapper
takes: the arrays, the mask's arrays (and sinks), and the call's `KernelConfig`.

`_vjp` hands `forward` and `backward` to `_partition.partitioned`, which runs them on each
device's batch entries and heads; they call the wrappers that the config names
(`triton.flash_forward`, `mosaic.flash_forward`, `triton.few_tokens.few_token_forward`;
`triton.flash_backward`, `mosaic.flash_backward`) and nothing above them. What they add around
the wrappers: the Triton forward's row max where the Triton backward reads it
(`takes_row_max`), one head dim for the Triton backward, and a key-broadcast bias's gradient
in closed form.

`decode` is the decode kernel's pass, in the same way: `pallas_flash.decode` hands it to
`_partition.partitioned`, and it calls `triton.decode.decode_forward` (with the tiles of the
shard's shapes), or merges the parts of a cache split over its sequence (`over_context`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_flash import mosaic, triton
from pallas_flash._numerics import accumulation_dtype, merge_weights, sink_probability
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import BackwardTiles, ForwardTiles
from pallas_flash.triton import BlockSizes, DecodeBlockSizes
from pallas_flash.triton.cache import CacheFormat
from pallas_flash.triton.decode import decode_block_sizes, decode_forward
from pallas_flash.triton.few_tokens import few_token_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Everything static about one call: hashable, passed as a nondiff argument. Built by
    `pallas_flash.dispatch.choose`, the one place that decides which kernels run a call. Every
    backend's wrapper takes it whole (`_FORWARDS`, `_BACKWARDS`) and reads what it needs."""

    spec: MaskSpec
    scale: float
    soft_cap: float | None = None
    # > 0: dropout on P (seeds in MaskArrays.dropout_seeds), in every kernel.
    dropout_rate: float = 0.0
    block_sizes: BlockSizes
    interpret: bool
    # "triton"; "mosaic": the Mosaic GPU forward (Hopper; no bias or dense mask); or "decode":
    # the decode kernel (a few query tokens; geometry and sequence lengths only, 16-bit).
    forward: str = "triton"
    # "triton", or "mosaic": the Mosaic GPU backward (Hopper; the Mosaic forward's masks).
    backward: str = "triton"
    # The Mosaic kernels' tiles (None: their defaults for the shapes).
    mosaic_forward_tiles: ForwardTiles | None = None
    mosaic_backward_tiles: BackwardTiles | None = None
    # The GPU the kernels are compiled for (its SM count sizes persistent and split-KV grids);
    # None: the visible GPU's (the interpreter needs none).
    device: Device | None = None

    def __post_init__(self):
        if self.forward not in ("triton", "mosaic", "decode"):
            raise ValueError(
                f"KernelConfig.forward={self.forward!r} must be 'triton', 'mosaic' or 'decode'"
            )
        if self.backward not in ("triton", "mosaic"):
            raise ValueError(
                f"KernelConfig.backward={self.backward!r} must be 'triton' or 'mosaic'"
            )


# Every backend's passes take one argument shape: the arrays, the mask's arrays (and sinks), and
# the call's KernelConfig, from which each reads what it needs.
_FORWARDS = {
    "triton": triton.flash_forward,
    "mosaic": mosaic.flash_forward,
    "decode": few_token_forward,
}
_BACKWARDS = {"triton": triton.flash_backward, "mosaic": mosaic.flash_backward}


def forward(q, k, v, bias, arrays, sinks, *, config: KernelConfig):
    """One shard's (out, lse, log_sum, row_max): log_sum (each row's log softmax denominator
    relative to its max, from either forward) lets either backward recompute tied logits
    exactly at any magnitude; row_max (that max in the Triton forward's units,
    `triton.flash_forward`) lets the Triton backward recompute P free of lse's rounding, which
    float32 calls need (`takes_row_max`). Elsewhere lse stands in its place, never read
    (`backward`)."""
    if takes_row_max(q, config):
        return triton.flash_forward(
            q, k, v, bias, arrays, sinks, config=config, with_log_sum=True, with_row_max=True
        )
    run = _FORWARDS[config.forward]
    out, lse, log_sum = run(q, k, v, bias, arrays, sinks, config=config, with_log_sum=True)
    return out, lse, log_sum, lse


def takes_row_max(q, config: KernelConfig) -> bool:
    """Whether the Triton backward recomputes P from the Triton forward's row max: float32
    calls, whose P lse's rounding would move by ~3e-5 at logits in the hundreds. 16-bit calls
    round P to their dtype for the matmuls, far coarser, and keep one add per element fewer
    (`triton._common.recomputed_probs`)."""
    return config.forward == "triton" and config.backward == "triton" and q.dtype == jnp.float32


def backward(
    q, k, v, bias, arrays, sinks, out, lse, log_sum, row_max, d_out, d_lse, *, config: KernelConfig
):
    """One shard's (dq, dk, dv, dbias). sinks: those lse includes, or None. A bias broadcast
    over the keys gets its gradient in closed form, per row (`key_broadcast_bias_gradient`),
    and no dbias kernel runs."""
    head_dim, value_head_dim = q.shape[-1], v.shape[-1]
    # row_max: the Triton forward's where `takes_row_max`, else a stand-in, not read.
    rows = (lse, log_sum, row_max if takes_row_max(q, config) else None)
    closed_form = _bias_gradient_in_closed_form(bias, config)
    kernels = functools.partial(
        _BACKWARDS[config.backward], config=config, bias_gradient=not closed_form
    )
    # The Mosaic backward takes Hv != H as it is; the Triton backward takes one head dim.
    if head_dim == value_head_dim or config.backward == "mosaic":
        dq, dk, dv, dbias = kernels(q, k, v, bias, arrays, out, *rows, d_out, d_lse)
    else:
        padded = _common_head_dim(q, k, v, out, d_out)
        dq, dk, dv, dbias = kernels(
            *padded[:3], bias, arrays, *padded[3:4], *rows, padded[4], d_lse
        )
        dq, dk, dv = dq[..., :head_dim], dk[..., :head_dim], dv[..., :value_head_dim]
    if closed_form:
        dbias = key_broadcast_bias_gradient(bias, sinks, out, lse, log_sum, d_out, d_lse)
    return dq, dk, dv, dbias


def _common_head_dim(*xs):
    """xs zero-padded to their largest head dim: the Triton backward takes one head dim, and
    runs a value head dim Hv != H so (zero columns leave q.k and dO.V^T unchanged; the
    gradients' extra columns are cut off)."""
    h = max(x.shape[-1] for x in xs)
    return tuple(
        x if x.shape[-1] == h else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, h - x.shape[-1]),))
        for x in xs
    )


def _bias_gradient_in_closed_form(bias, config: KernelConfig) -> bool:
    """Whether the bias's gradient is `key_broadcast_bias_gradient`'s rather than the kernels'
    (a bias broadcast over the keys, no soft cap)."""
    return bias is not None and bias.shape[-1] == 1 and config.soft_cap is None


def key_broadcast_bias_gradient(bias, sinks, out, lse, log_sum, d_out, d_lse):
    """d bias of a bias [B|1, N|1, T|1, 1] broadcast over the keys (no soft cap): each row's
    sum over its keys of dS = P * (dP - delta), in closed form. With rowsum(P * dP) = dO . out
    and the keys' share of the row's softmax 1 - P_sink, that sum is P_sink (dO . out) +
    (1 - P_sink) d_lse: d_lse itself without sinks, 0 for rows that see no key. The kernels'
    sum of dS cancels to noise in 16-bit inputs (P rounded for P V in the forward, not in the
    backward); this is exact, and is what the XLA path's autodiff computes."""
    f32 = accumulation_dtype(lse.dtype)
    rows = jnp.where(jnp.isneginf(lse), 0.0, d_lse.astype(f32))  # [B, N, T]
    if sinks is not None:
        sinks = jnp.broadcast_to(jnp.asarray(sinks, f32), lse.shape[:-1])
        # A row that sees no key has P_sink = 1 and out = 0: its sum is 0. (lse == sink does
        # not tell it: a sink tied with a max beyond ~1e6 has lse == sink too.)
        p_sink = sink_probability(sinks, lse, log_sum)
        d_out_dot_out = jnp.einsum("btnh,btnh->bnt", d_out.astype(f32), out.astype(f32))
        rows = p_sink * d_out_dot_out + (1.0 - p_sink) * rows
    grad = rows[..., None]  # [B, N, T, 1]
    axes = tuple(i for i in range(3) if bias.shape[i] == 1 and grad.shape[i] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True).astype(bias.dtype)


# -- decode ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The static arguments of `triton.decode.decode_forward` for one decode call (built by
    `pallas_flash.decode`); block_sizes None: the defaults for the shapes each device runs
    (`decode_block_sizes`: on a mesh, its shard's)."""

    scale: float
    soft_cap: float | None
    window_left: int | None
    block_sizes: DecodeBlockSizes | None
    interpret: bool
    num_sms: int
    with_log_sum: bool
    # The output's dtype (None: the queries'): float32 for partial results merged again.
    out_dtype: str | None = None
    # A shared latent cache's value columns (its value operand is its key operand, unread).
    value_head_dim: int | None = None


class _DecodeShard:
    """The decode kernel as one device runs it: `pallas_flash.decode` hands `decode` to
    `_partition.partitioned`, whose shard function calls it (and its `over_context` for a cache
    split over its sequence)."""

    def __call__(
        self,
        q,
        k,
        v,
        lengths,
        block_tables=None,
        k_scale=None,
        v_scale=None,
        ahead=None,
        *,
        config: DecodeConfig,
    ):
        """The kernel on one device's operands (all of them on one device); ahead: as
        `decode_forward`'s (`over_context`)."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        if config.value_head_dim is not None:
            v = None  # the keys' first columns
        if config.block_sizes is None:
            paged = block_tables is not None
            page_size = k.shape[1] if paged else None
            fmt = CacheFormat(
                q.shape[-1],
                config.value_head_dim or v.shape[-1],
                shared=v is None,
                scaled=k_scale is not None,
            )
            fields["block_sizes"] = decode_block_sizes(
                q.shape,
                k.shape[2],
                block_tables.shape[1] * page_size if paged else k.shape[1],
                q.dtype,
                interpret=config.interpret,
                page_size=page_size,
                window_left=config.window_left,
                num_sms=config.num_sms,
                fmt=fmt,
                cache_dtype=k.dtype,
            )
        return _decode_forward(
            q, k, v, lengths, block_tables, ahead=ahead, k_scale=k_scale, v_scale=v_scale, **fields
        )

    @staticmethod
    def over_context(call, args, config: DecodeConfig, axes):
        """(out, lse[, log_sum]) of a contiguous cache split over its sequence on the mesh axes
        `axes`, in one device's view: this device holds cache slots [i S', (i + 1) S') (i its
        index along `axes`) and runs the kernel (`call(args, config)`) over the keys it holds
        of each sequence, lengths clipped to them, the new tokens placed `ahead` of those keys
        where the sequence goes on past them (so that each token sees the held keys at or
        before it, and within its window); the parts merge by their denominators
        (`_numerics.merge_weights`: gathered lse and log_sum, [B, N, T] each, and a sum
        of the weighted outputs)."""
        q, k, v, lengths, _, k_scale, v_scale = args
        slots, index = k.shape[1], jax.lax.axis_index(axes)
        # Lengths past the whole cache's capacity clip to it, as on one device.
        lengths = jnp.clip(lengths, 0, slots * jax.lax.psum(1, axes))
        behind = lengths - index * slots  # each sequence's keys from this device's first slot
        held, ahead = jnp.clip(behind, 0, slots), jnp.maximum(behind - slots, 0)
        acc = accumulation_dtype(q.dtype)  # float32, float64 for float64 inputs
        full = dataclasses.replace(config, with_log_sum=True, out_dtype=jnp.dtype(acc).name)
        out, lse, log_sum = call((q, k, v, held, None, k_scale, v_scale, ahead), full)
        parts_lse, parts_log_sum = (_gathered(x, axes, index) for x in (lse, log_sum))
        weights, merged_log_sum = merge_weights(parts_lse, parts_log_sum, axis=0)
        weight = jnp.take(weights, index, axis=0)  # [B, N, T]
        out = out.astype(acc) * jnp.swapaxes(weight, 1, 2)[..., None]
        out = jax.lax.psum(out, axes).astype(q.dtype)
        seen = jnp.isfinite(parts_lse)
        maxima = jnp.where(seen, parts_lse - parts_log_sum, -jnp.inf)
        top = jnp.max(maxima, axis=0)
        lse = jnp.where(jnp.any(seen, axis=0), top + merged_log_sum, -jnp.inf)
        return (out, lse, merged_log_sum) if config.with_log_sum else (out, lse)


def _gathered(x, axes, index):
    """Every device's x along `axes`, stacked ([P, *x.shape]), typed as the same on each of
    them (`jax.lax.all_gather`'s result is typed as varying under check_vma): each device's x
    in its row of zeros, summed over the devices (adding zeros is exact)."""
    rows = jnp.arange(jax.lax.psum(1, axes)).reshape(-1, *(1,) * x.ndim) == index
    return jax.lax.psum(jnp.where(rows, x[None], jnp.zeros((), x.dtype)), axes)


decode = _DecodeShard()


# One jit'd function of its static options: eager calls (a Python generation loop) compile the
# kernel once, not at every call.
_decode_forward = jax.jit(
    decode_forward,
    static_argnames=(
        "scale",
        "soft_cap",
        "window_left",
        "block_sizes",
        "interpret",
        "num_sms",
        "with_log_sum",
        "out_dtype",
        "value_head_dim",
    ),
)
