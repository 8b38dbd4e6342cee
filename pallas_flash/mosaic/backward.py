"""FlashAttention backward for Hopper as warp-specialised Pallas Mosaic GPU kernels.

FlashAttention-2's backward (Dao 2023, Algorithm 2) split as in FlashAttention-3 (Shah et al.
2024) but without atomics: delta = rowsum(dO * O) - dlse in XLA, then two kernels.

- dK/dV: a CTA owns `num_consumers * block_kv_dkv` keys of one KV head. Each consumer
  warpgroup keeps its `block_kv_dkv` rows of K and V in shared memory and its dK, dV in f32
  registers; the producer warpgroup streams Q, dO tiles (with their lse and delta rows) of every
  query head of the GQA group and every query tile that sees the CTA's keys through a TMA ring.
  The tiles are computed transposed (keys on rows: S^T = K Q^T), so that P^T and dS^T are
  register A operands of dV += P^T dO and dK += dS^T Q.
- dQ: a CTA owns `num_consumers * block_q_dq` query rows of one head. Each consumer keeps Q, dO
  in shared memory and dQ in f32 registers; the producer streams K, V tiles through a TMA ring.

Both write their gradients once, so the result is bitwise deterministic. The residuals are those
of `pallas_flash.mosaic.forward` (and of the Triton forward): out, and lse natural-log f32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash._numerics import LOG2E, lowered_reference
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import tiles as forward_tiles
from pallas_flash.mosaic.launch import pad_to, warp_specialised_kernel, zero_non_finite
from pallas_flash.mosaic.tiles import (
    CAUSAL_MISCOMPILING_CUDA,
    SMEM_BYTES,
    aligned_len,
    cdiv,
    kernel_head_dim,
)

# Head dims it takes (80 and 96 zero-padded to 128 by the wrapper, as in the forward). H=192 and
# 256 are left to the Triton backward: a consumer's dK and dV accumulators, [64, H] f32 each,
# with S^T and dP^T would take 256 registers per thread at H=192 (the most a thread can have),
# and the accumulators alone 256 at H=256.
HEAD_DIMS = (64, 80, 96, 128)
PRODUCER_REGISTERS = 40
REGISTER_FILE = 512  # registers per thread if the SM's 65536 were spread over 128 threads
# Registers a consumer keeps beyond its f32 tiles (see `BackwardTiles.tile_registers`). 40 is
# what the defaults at H=128 leave (232 - 192); not measured yet.
REGISTER_HEADROOM = 40


def consumer_registers(num_consumers: int) -> int:
    """Registers per consumer thread so that the consumers and the producer fit the register
    file: 2 consumers get 232 (as in the forward), 1 consumer 240 (setmaxnreg takes multiples
    of 8 up to 256)."""
    per_consumer = (REGISTER_FILE - PRODUCER_REGISTERS) // num_consumers
    return min(240, per_consumer // 8 * 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardTiles:
    """Tiles of the Mosaic GPU backward.

    Attributes:
      block_q_dkv: query rows per streamed Q/dO tile of the dK/dV kernel (wgmma N of S^T).
      block_kv_dkv: keys per consumer warpgroup of the dK/dV kernel (wgmma M: a multiple of 64).
      block_q_dq: query rows per consumer warpgroup of the dQ kernel (wgmma M).
      block_kv_dq: keys per streamed K/V tile of the dQ kernel (wgmma N of S).
      num_stages: tiles in flight in each kernel's shared-memory ring (>= 2).
      num_consumers: consumer warpgroups per CTA in both kernels (1 or 2).
    All blocks are multiples of 64: wgmma works on 64-row slabs and the 128-byte swizzle on
    64-column tiles.
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_stages: int = 2
    num_consumers: int = 2

    def __post_init__(self):
        for name in ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 64:
                raise ValueError(
                    f"BackwardTiles.{name}={value!r} must be a positive multiple of 64"
                )
            if value > 256:
                raise ValueError(f"BackwardTiles.{name}={value!r} exceeds the wgmma limit of 256")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"BackwardTiles.num_stages={self.num_stages!r} must be an int >= 2")
        if self.num_consumers not in (1, 2):
            raise ValueError(f"BackwardTiles.num_consumers={self.num_consumers!r} must be 1 or 2")

    @property
    def cta_kv_rows(self) -> int:
        """Keys per CTA of the dK/dV kernel."""
        return self.num_consumers * self.block_kv_dkv

    @property
    def cta_q_rows(self) -> int:
        """Query rows per CTA of the dQ kernel."""
        return self.num_consumers * self.block_q_dq

    def tile_registers(self, head_dim: int) -> dict[str, int]:
        """f32 registers per consumer thread that each kernel holds across a step: dK and dV
        with S^T and dP^T, or dQ with S and dP (a warpgroup spreads a tile over 128 threads)."""
        return {
            "dK/dV": 2 * self.block_kv_dkv * (head_dim + self.block_q_dkv) // 128,
            "dQ": self.block_q_dq * (head_dim + 2 * self.block_kv_dq) // 128,
        }

    def smem_bytes_dkv(self, head_dim: int, itemsize: int) -> int:
        """K, V per consumer, the Q and dO ring, the lse and delta rows of the ring."""
        kv = 2 * self.cta_kv_rows * head_dim * itemsize
        ring = 2 * self.num_stages * self.block_q_dkv * (head_dim * itemsize + 4)
        return kv + ring

    def smem_bytes_dq(self, head_dim: int, itemsize: int) -> int:
        """Q, dO and the lse and delta rows per consumer, the K and V ring."""
        q = 2 * self.cta_q_rows * (head_dim * itemsize + 4)
        ring = 2 * self.num_stages * self.block_kv_dq * head_dim * itemsize
        return q + ring


def default_tiles(head_dim: int) -> BackwardTiles:
    """Not tuned yet: 64-row slabs everywhere keep a consumer's registers at H=128 near
    dK + dV (128) + S^T, dP^T (64) + their 16-bit copies (32) per thread."""
    del head_dim
    return BackwardTiles()


def unsupported_options(spec, *, soft_cap, has_bias: bool) -> str | None:
    """The options of a call (spec: a masks.MaskSpec) that this backward, which takes only the
    causal flag, would drop, named as the API names them; None if there are none."""
    unsupported = [
        name
        for name, present in (
            ("bias", has_bias),
            ("mask", spec.mask_shape is not None),
            ("segment ids or sequence lengths", spec.has_segments),
            ("local_window_size", spec.window is not None),
            ("logits_soft_cap", soft_cap is not None),
        )
        if present
    ]
    return " and ".join(unsupported) or None


def why_not(
    q_shape,
    k_shape,
    dtype,
    *,
    is_causal: bool,
    tiles: BackwardTiles | None = None,
    cuda_runtime_version: int | None = None,
) -> str | None:
    """Why the Mosaic GPU backward cannot run on these shapes, or None when it can (the caller
    keeps the Triton backward). Any T and S; both causal settings have the same rules.
    `cuda_runtime_version`: the target's, None when not known."""
    if is_causal and cuda_runtime_version in CAUSAL_MISCOMPILING_CUDA:
        return (
            f"is_causal=True on CUDA runtime {cuda_runtime_version} (ptxas 12.8.0-12.9.0 "
            "miscompiles it)"
        )
    if reason := forward_tiles.check_shapes(q_shape, k_shape, dtype):
        return reason
    _, q_len, _, head_dim = q_shape
    kv_len = k_shape[1]
    if head_dim in (192, 256):
        return (
            f"{head_dim=}: a consumer's dK and dV accumulators with S^T and dP^T would need "
            "256 registers per thread or more; left to the Triton backward"
        )
    if head_dim not in HEAD_DIMS:
        return f"{head_dim=} is not one of {HEAD_DIMS}"
    if q_len == 0 or kv_len == 0:
        return f"{q_len=} and {kv_len=} must be positive"
    tiles = default_tiles(head_dim) if tiles is None else tiles
    head_dim = kernel_head_dim(head_dim)
    # The rest of a consumer's registers hold the 16-bit copies of P and dS, lse, delta, indices.
    budget = consumer_registers(tiles.num_consumers) - REGISTER_HEADROOM
    for kernel, registers in tiles.tile_registers(head_dim).items():
        if registers > budget:
            return (
                f"{tiles} holds {registers} f32 registers per thread in {kernel} at {head_dim=}, "
                f"over {budget}: it would spill"
            )
    itemsize = jnp.dtype(dtype).itemsize
    for kernel, smem in (
        ("dK/dV", tiles.smem_bytes_dkv(head_dim, itemsize)),
        ("dQ", tiles.smem_bytes_dq(head_dim, itemsize)),
    ):
        if smem > SMEM_BYTES:
            return f"{tiles} needs {smem} bytes of shared memory in {kernel} at {head_dim=}"
    return None


def flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    tiles: BackwardTiles | None = None,
    device: Device | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of attention on Hopper (sm_90a) through Pallas Mosaic GPU.

    Args:
      q, out, d_out: [B, T, N, H], bfloat16 or float16 (out and d_out in q's dtype); any T and
        S, H one of HEAD_DIMS.
      k, v: [B, S, K, H] in q's dtype; query head n reads kv head n // (N // K).
      lse: float32 [B, N, T], the natural-log log-sum-exp of scale * q.k saved by the forward.
      d_lse: float32 [B, N, T], the cotangent of lse, or None for zero.
      scale: the forward's positive multiplier of q.k.
      is_causal: query i sees keys j <= i, top-left aligned (every row sees key 0).
      tiles: BackwardTiles; None picks `default_tiles(H)`.
      device: the GPU it is compiled for (its CUDA runtime is checked); None: the visible
        GPU's record (`Device.current()`).

    Returns:
      dq [B, T, N, H] and dk, dv [B, S, K, H] in q's dtype; dk and dv are summed over the query
      heads of each kv head's group.

    Raises:
      ValueError: shapes, dtypes or tiles the kernels do not support (see `why_not`).
    """
    device = Device.current() if device is None else device
    if reason := why_not(
        q.shape,
        k.shape,
        q.dtype,
        is_causal=is_causal,
        tiles=tiles,
        cuda_runtime_version=None if device is None else device.cuda_runtime_version,
    ):
        raise ValueError(reason)
    for name, x in (("v", v), ("out", out), ("d_out", d_out)):
        like = k if name == "v" else q
        if x.shape != like.shape or x.dtype != q.dtype:
            raise ValueError(
                f"{name} {x.shape} {x.dtype} must have shape {like.shape} and q's dtype"
            )
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive")
    tiles = default_tiles(q.shape[-1]) if tiles is None else tiles
    (_, q_len, _, head_dim), kv_len = q.shape, k.shape[1]
    # delta folds the lse cotangent in: dS = P * (dP - rowsum(dO * O) + dlse).
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    # The kernels recompute P = exp2(S * scale * log2(e) - lse * log2(e)), clamped at 1; the
    # lowered reference keeps P of a row's dominant logit exact at any magnitude.
    lse2 = lowered_reference(lse.astype(jnp.float32) * LOG2E)
    # As in the forward: T and S padded to ROW_ALIGN, H to the kernel head dim (zero columns
    # add nothing to q.k, dO.v or the gradients' kept columns). The kernels read the true T and
    # S from q_len and kv_len; rows and keys past them are computed on zeros and not kept.
    q_to, kv_to = aligned_len(q_len), aligned_len(kv_len)
    h_to = kernel_head_dim(head_dim)
    q, d_out = pad_to(q, q_to, h_to), pad_to(d_out, q_to, h_to)
    k, v = pad_to(k, kv_to, h_to), pad_to(v, kv_to, h_to)
    # lse and delta keep T innermost: padded to whole query tiles of both kernels, so that no
    # tile's load runs into the next head's rows (see the forward's lse).
    rows = math.lcm(tiles.block_q_dkv, tiles.cta_q_rows)
    lse_to = cdiv(q_len, rows) * rows
    if lse_to != q_len:
        lse2, delta = (jnp.pad(x, ((0, 0), (0, 0), (0, lse_to - q_len))) for x in (lse2, delta))
    kwargs = dict(scale=float(scale), is_causal=is_causal, q_len=q_len, kv_len=kv_len, tiles=tiles)
    dk, dv = _dkv_call(q, k, v, d_out, lse2, delta, **kwargs)
    dq = _dq_call(q, k, v, d_out, lse2, delta, **kwargs)
    if (q_to, kv_to, h_to) != (q_len, kv_len, head_dim):
        dq = dq[:, :q_len, :, :head_dim]
        dk, dv = dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim]
    return dq, dk, dv


# A 128-byte swizzle over 64-element column tiles, as in the forward: what TMA and wgmma both
# read without bank conflicts, also through a transposed view.
_SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _tile_smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_SMEM_TRANSFORMS)


def _rows(x, shape):
    """Broadcast a per-row vector [rows] (layout WGMMA.reduce(1)) over the columns of `shape`."""
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    """Broadcast a per-column vector [cols] (layout WGMMA.reduce(0)) over the rows of `shape`."""
    return lax.broadcast_in_dim(x, shape, [1])


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _wgmma_zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


# -- dK / dV --------------------------------------------------------------------------------------


def _kv_tile_counts(q_start, rows: int, *, kv_len: int, block_kv: int, is_causal: bool):
    """(visible, unmasked): the KV tiles that query rows [q_start, q_start + rows) see at all,
    and how many leading ones they see whole (tiles in [unmasked, visible) straddle the causal
    diagonal). MaskSpec.kv_tile_range's hi and full_hi; its q_len plays no part in them."""
    spec = MaskSpec(q_len=rows, kv_len=kv_len, is_causal=is_causal)
    _, _, unmasked, visible = spec.kv_tile_range(q_start, rows, block_kv)
    return visible, unmasked


def _q_tile_range(kv_start, rows: int, *, q_len: int, block_q: int, is_causal: bool):
    """(first, whole): keys [kv_start, kv_start + rows) are seen by query tiles [first, Q) and
    by every row of tiles [whole, Q), Q = ceil(T / block_q); tiles in [first, whole) straddle
    the causal diagonal and need the mask. MaskSpec.q_tile_range's lo and full_lo (its kv_len
    plays no part in them), clamped to Q: keys past the last query (S > T) are seen by no
    tile."""
    num_tiles = jnp.int32(cdiv(q_len, block_q))
    spec = MaskSpec(q_len=q_len, kv_len=rows, is_causal=is_causal)
    lo, full_lo, _, _ = spec.q_tile_range(jnp.asarray(kv_start, jnp.int32), block_q, rows)
    return jnp.minimum(lo, num_tiles), jnp.minimum(full_lo, num_tiles)


def _dkv_call(
    q, k, v, d_out, lse2, delta, *, scale: float, is_causal: bool, q_len: int, kv_len: int, tiles
):
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    n_c, n_s, block_q = tiles.num_consumers, tiles.num_stages, tiles.block_q_dkv
    kernel = functools.partial(
        _dkv_kernel,
        qk_scale=scale * LOG2E,
        scale=scale,
        is_causal=is_causal,
        q_len=q_len,
        group=num_heads // num_kv_heads,
        tiles=tiles,
    )
    scratch = dict(
        k_smem=_tile_smem((n_c, tiles.block_kv_dkv, head_dim), q.dtype),
        v_smem=_tile_smem((n_c, tiles.block_kv_dkv, head_dim), q.dtype),
        q_smem=_tile_smem((n_s, block_q, head_dim), q.dtype),
        do_smem=_tile_smem((n_s, block_q, head_dim), q.dtype),
        lse_smem=plgpu.SMEM((n_s, block_q), jnp.float32),
        delta_smem=plgpu.SMEM((n_s, block_q), jnp.float32),
        # Two TMA copies arrive on each: K and V; Q and its lse rows; dO and its delta rows.
        kv_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=n_c),
        q_ready=plgpu.Barrier(num_arrivals=2, num_barriers=n_s),
        do_ready=plgpu.Barrier(num_arrivals=2, num_barriers=n_s),
        # A slot is free again once every consumer is done with it.
        q_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        do_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
    )
    kv_type = jax.ShapeDtypeStruct(k.shape, k.dtype)
    # The last grid axis is launched first: neighbouring CTAs are KV tiles of one head and read
    # the same Q/dO from L2. Causal: tile 0 sees the most query tiles and starts first.
    return warp_specialised_kernel(
        kernel,
        out_type=(kv_type, kv_type),
        scratch_types=scratch,
        grid=(batch, num_kv_heads, cdiv(kv_len, tiles.cta_kv_rows)),
        grid_names=("batch", "kv_head", "kv_tile"),
        num_consumers=n_c,
    )(q, k, v, d_out, lse2, delta)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_loaded,
    q_ready,
    do_ready,
    q_free,
    do_free,
    qk_scale: float,
    scale: float,
    is_causal: bool,
    q_len: int,
    group: int,
    tiles: BackwardTiles,
):
    """One CTA: num_consumers * block_kv_dkv keys of one KV head (FA2 Algorithm 2, outer loop).

    q_ref, do_ref: [B, T, N, H]; k/v/dk/dv_ref: [B, S, K, H]; lse2_ref (lse * log2(e)) and
    delta_ref: f32 [B, N, T]. The producer's step s loads query head kv_head * group +
    s // cta_tiles, query tile cta_first + s % cta_tiles into ring slot s % num_stages.
    """
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("kv_head")
    cta_kv_start = lax.axis_index("kv_tile") * tiles.cta_kv_rows
    block_q = tiles.block_q_dkv
    # The first consumer's keys start the CTA's, so it sees the most query tiles.
    cta_first, _ = _q_tile_range(
        cta_kv_start, tiles.cta_kv_rows, q_len=q_len, block_q=block_q, is_causal=is_causal
    )
    cta_tiles = cdiv(q_len, block_q) - cta_first
    wg = lax.axis_index("wg")
    ring = _QRing(q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, q_free, do_free)
    common = dict(
        batch=batch, kv_head=kv_head, cta_first=cta_first, cta_tiles=cta_tiles, group=group
    )

    @pl.when(wg < tiles.num_consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(tiles.num_consumers), action="increase")
        _consume_dkv(
            k_ref,
            v_ref,
            dk_ref,
            dv_ref,
            k_smem.at[wg],
            v_smem.at[wg],
            kv_loaded.at[wg],
            ring,
            kv_start=cta_kv_start + wg * tiles.block_kv_dkv,
            qk_scale=qk_scale,
            scale=scale,
            is_causal=is_causal,
            q_len=q_len,
            tiles=tiles,
            **common,
        )

    @pl.when(wg == tiles.num_consumers)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        _produce_dkv(q_ref, do_ref, lse2_ref, delta_ref, ring, tiles=tiles, **common)


@dataclasses.dataclass(frozen=True)
class _QRing:
    """The Q/dO shared-memory ring of the dK/dV kernel: step s lives in slot s % num_stages.
    q_ready completes when Q and its lse rows have landed, do_ready when dO and its delta rows
    have; q_free and do_free when every consumer is done reading them."""

    q_smem: object
    do_smem: object
    lse_smem: object
    delta_smem: object
    q_ready: object
    do_ready: object
    q_free: object
    do_free: object

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.q_smem.shape[0]))


def _step_rows(step, *, kv_head, cta_first, cta_tiles, group: int, block_q: int):
    """(query head, first query row) of producer step `step`."""
    head = kv_head * group + lax.div(step, cta_tiles)
    q_start = (cta_first + lax.rem(step, cta_tiles)) * block_q
    return head, q_start


def _produce_dkv(
    q_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    ring: _QRing,
    *,
    batch,
    kv_head,
    cta_first,
    cta_tiles,
    group: int,
    tiles: BackwardTiles,
):
    """Producer warpgroup: TMA Q, lse, dO, delta of every (head, query tile) step, in order."""
    block_q, num_stages = tiles.block_q_dkv, tiles.num_stages

    @pl.loop(0, group * cta_tiles)
    def _step(step):
        slot = ring.slot(step)
        head, q_start = _step_rows(
            step,
            kv_head=kv_head,
            cta_first=cta_first,
            cta_tiles=cta_tiles,
            group=group,
            block_q=block_q,
        )
        rows = (batch, pl.ds(q_start, block_q), head)
        vector = (batch, head, pl.ds(q_start, block_q))
        # The first num_stages steps fill empty slots; later ones wait for the consumers. Q and
        # dO are freed separately and dO first: its last readers (dV, dP^T) finish before Q's
        # (dK), so dO and delta are waited for and loaded first, Q and lse after.
        pl.when(step >= num_stages)(lambda: plgpu.barrier_wait(ring.do_free.at[slot]))
        plgpu.copy_gmem_to_smem(do_ref.at[rows], ring.do_smem.at[slot], ring.do_ready.at[slot])
        plgpu.copy_gmem_to_smem(
            delta_ref.at[vector], ring.delta_smem.at[slot], ring.do_ready.at[slot]
        )
        pl.when(step >= num_stages)(lambda: plgpu.barrier_wait(ring.q_free.at[slot]))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], ring.q_smem.at[slot], ring.q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse2_ref.at[vector], ring.lse_smem.at[slot], ring.q_ready.at[slot])


def _consume_dkv(
    k_ref,
    v_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    kv_loaded,
    ring: _QRing,
    *,
    batch,
    kv_head,
    kv_start,
    cta_first,
    cta_tiles,
    group: int,
    qk_scale: float,
    scale: float,
    is_causal: bool,
    q_len: int,
    tiles: BackwardTiles,
):
    """Consumer warpgroup: dK, dV of block_kv_dkv keys over every query head of the group and
    every query tile that sees them. A consumer whose keys start later than the CTA's (causal)
    skips the leading tiles of each head: it waits for them and frees them unread, which keeps
    its barrier phases in step with the ring and counts its arrival on their free barriers."""
    block_q, block_kv = tiles.block_q_dkv, tiles.block_kv_dkv
    head_dim, dtype = k_smem.shape[-1], k_smem.dtype
    num_q_tiles = cdiv(q_len, block_q)
    # A ragged last query tile holds rows past T (zeros, or whatever lies past the array's
    # end): masked, so that they add nothing to dK and dV. Keys past S need no mask: each key
    # is a row of dK and dV here, and those rows are not kept.
    ragged_q = q_len % block_q != 0
    full_end = q_len // block_q  # tiles [full_end, num_q_tiles) hold rows past T
    kv_rows = (batch, pl.ds(kv_start, block_kv), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, kv_loaded)
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, kv_loaded)
    first, whole = _q_tile_range(
        kv_start, block_kv, q_len=q_len, block_q=block_q, is_causal=is_causal
    )
    tile_shape = (block_kv, block_q)

    def q_step(i, carry, *, base, masked: bool):
        dk, dv = carry
        slot = ring.slot(base + i - cta_first)
        plgpu.barrier_wait(ring.q_ready.at[slot])

        # -- S^T = K Q^T [block_kv, block_q]: keys on rows, so P^T and dS^T are A operands --
        def st_into(acc_ref):
            plgpu.wgmma(acc_ref, k_smem, ring.q_smem.at[slot].T)
            return acc_ref[...]

        s_t = pl.run_scoped(st_into, plgpu.ACC(tile_shape, jnp.float32))
        lse2 = plgpu.load(ring.lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        # lse is finite (every row sees key 0), so masked entries are exactly 0, never NaN.
        # P <= 1: lse is rounded, and a few ulps of a logit beyond 2^31 would overflow exp2.
        p_t = jnp.exp2(jnp.minimum(s_t * qk_scale - _cols(lse2, tile_shape), 0.0))
        if masked:
            q_pos = i * block_q + _iota(tile_shape, 1)
            conditions = []
            if is_causal:
                conditions.append(q_pos >= kv_start + _iota(tile_shape, 0))
            if ragged_q:
                conditions.append(q_pos < q_len)
            # dV += P^T dO and dK += (P^T * (dP^T - delta)) Q: P^T = 0 keeps a hidden row out of
            # both as long as its Q, dO and delta are finite (TMA reads zeros past T).
            p_t = jnp.where(functools.reduce(jnp.logical_and, conditions), p_t, 0.0)

        # -- dV += P^T dO and dP^T = V dO^T, issued together: one wgmma wait for both --
        plgpu.barrier_wait(ring.do_ready.at[slot])
        p_in = p_t.astype(dtype)

        def dv_dpt_into(refs):
            dv_ref, dpt_ref = refs
            plgpu.wgmma(dv_ref, p_in, ring.do_smem.at[slot])
            plgpu.wgmma(dpt_ref, v_smem, ring.do_smem.at[slot].T)

        dv, dp_t = pl.run_state(dv_dpt_into)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(_wgmma_zeros(tile_shape)))
        )
        delta = plgpu.load(ring.delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        plgpu.barrier_arrive(ring.do_free.at[slot])

        # -- dS^T = P^T * (dP^T - delta); dK += dS^T Q (scaled once in the epilogue) --
        ds_in = (p_t * (dp_t - _cols(delta, tile_shape))).astype(dtype)

        def dk_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, ring.q_smem.at[slot])

        dk = pl.run_state(dk_into)(plgpu.ACC.init(dk))
        plgpu.barrier_arrive(ring.q_free.at[slot])
        return dk, dv

    def skip_step(i, _, *, base):
        slot = ring.slot(base + i - cta_first)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        plgpu.barrier_wait(ring.do_ready.at[slot])
        plgpu.barrier_arrive(ring.do_free.at[slot])
        plgpu.barrier_arrive(ring.q_free.at[slot])

    def head_loop(h, carry):
        base = h * cta_tiles  # the producer's step of this head's tile cta_first
        masked_step = functools.partial(q_step, base=base, masked=True)
        # In the producer's order: skipped tiles, the diagonal's masked ones, whole ones, and
        # the ragged last tile (masked; it may also be on the diagonal, or the only tile).
        whole_end = jnp.maximum(first, jnp.minimum(whole, full_end)) if ragged_q else whole
        if is_causal:
            lax.fori_loop(cta_first, first, functools.partial(skip_step, base=base), None)
            carry = lax.fori_loop(first, whole_end, masked_step, carry)
        if not ragged_q:
            return lax.fori_loop(
                whole_end, num_q_tiles, functools.partial(q_step, base=base, masked=False), carry
            )
        carry = lax.fori_loop(
            whole_end, full_end, functools.partial(q_step, base=base, masked=False), carry
        )
        return lax.fori_loop(jnp.maximum(whole_end, full_end), num_q_tiles, masked_step, carry)

    zeros = _wgmma_zeros((block_kv, head_dim))
    plgpu.barrier_wait(kv_loaded)
    dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))

    # -- epilogue: K and V are dead (their last readers, this consumer's wgmmas, are done) --
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[kv_rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[kv_rows])
    plgpu.wait_smem_to_gmem(0)


# -- dQ -------------------------------------------------------------------------------------------


def _dq_call(
    q, k, v, d_out, lse2, delta, *, scale: float, is_causal: bool, q_len: int, kv_len: int, tiles
):
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    n_c, n_s, block_q = tiles.num_consumers, tiles.num_stages, tiles.block_q_dq
    kernel = functools.partial(
        _dq_kernel,
        qk_scale=scale * LOG2E,
        scale=scale,
        is_causal=is_causal,
        kv_len=kv_len,
        group=num_heads // num_kv_heads,
        num_q_tiles=cdiv(q_len, tiles.cta_q_rows),
        tiles=tiles,
    )
    scratch = dict(
        q_smem=_tile_smem((n_c, block_q, head_dim), q.dtype),
        do_smem=_tile_smem((n_c, block_q, head_dim), q.dtype),
        lse_smem=plgpu.SMEM((n_c, block_q), jnp.float32),
        delta_smem=plgpu.SMEM((n_c, block_q), jnp.float32),
        k_smem=_tile_smem((n_s, tiles.block_kv_dq, head_dim), q.dtype),
        v_smem=_tile_smem((n_s, tiles.block_kv_dq, head_dim), q.dtype),
        # Four TMA copies arrive on it: Q, dO, lse rows, delta rows.
        q_loaded=plgpu.Barrier(num_arrivals=4, num_barriers=n_c),
        k_ready=plgpu.Barrier(num_barriers=n_s),
        v_ready=plgpu.Barrier(num_barriers=n_s),
        k_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        v_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        # Causal: K of a diagonal tile lands here; the producer cleans it, then arrives k_ready.
        k_landed=plgpu.Barrier(num_barriers=n_s),
    )
    return warp_specialised_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch,
        grid=(batch, num_heads, cdiv(q_len, tiles.cta_q_rows)),
        grid_names=("batch", "head", "q_tile"),
        num_consumers=n_c,
    )(q, k, v, d_out, lse2, delta)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    dq_ref,
    *,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_loaded,
    k_ready,
    v_ready,
    k_free,
    v_free,
    k_landed,
    qk_scale: float,
    scale: float,
    is_causal: bool,
    kv_len: int,
    group: int,
    num_q_tiles: int,
    tiles: BackwardTiles,
):
    """One CTA: num_consumers * block_q_dq query rows of one head against its keys (FA2
    Algorithm 2's dQ, as its own kernel: no atomics). The producer's step j loads KV tile j into
    ring slot j % num_stages."""
    batch, head = lax.axis_index("batch"), lax.axis_index("head")
    q_tile = lax.axis_index("q_tile")
    if is_causal:
        # The last query tiles see the most keys: launch them first (as in the forward).
        q_tile = num_q_tiles - 1 - q_tile
    cta_q_start = q_tile * tiles.cta_q_rows
    block_kv = tiles.block_kv_dq
    cta_tiles, cta_whole = _kv_tile_counts(
        cta_q_start, tiles.cta_q_rows, kv_len=kv_len, block_kv=block_kv, is_causal=is_causal
    )
    wg = lax.axis_index("wg")

    @pl.when(wg < tiles.num_consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(tiles.num_consumers), action="increase")
        q_start = cta_q_start + wg * tiles.block_q_dq
        q_rows = (batch, pl.ds(q_start, tiles.block_q_dq), head)
        vector = (batch, head, pl.ds(q_start, tiles.block_q_dq))
        q_smem_c, do_smem_c = q_smem.at[wg], do_smem.at[wg]
        lse_smem_c, delta_smem_c = lse_smem.at[wg], delta_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(lse2_ref.at[vector], lse_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem_c, q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])
        dq = _consume_dq(
            q_smem_c,
            do_smem_c,
            lse_smem_c,
            delta_smem_c,
            (k_smem, v_smem, k_ready, v_ready, k_free, v_free),
            q_start=q_start,
            cta_tiles=cta_tiles,
            qk_scale=qk_scale,
            is_causal=is_causal,
            kv_len=kv_len,
            tiles=tiles,
        )
        # -- epilogue: Q is dead (its last reader, the final S = Q K^T, is done) --
        q_smem_c[...] = (dq * scale).astype(q_smem_c.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem_c, dq_ref.at[q_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == tiles.num_consumers)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        @pl.loop(0, cta_tiles)
        def _step(step):
            slot = lax.rem(step, jnp.int32(tiles.num_stages))
            rows = (batch, pl.ds(step * block_kv, block_kv), kv_head)
            # K and V are freed separately and V first: dP = dO V^T is done before dQ += dS K,
            # so V is waited for and loaded first, K after.
            pl.when(step >= tiles.num_stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])
            pl.when(step >= tiles.num_stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            if not is_causal:
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
                return
            # Keys on the CTA's diagonal are hidden from some of its rows: dS = 0 there, but NaN
            # or inf in K would reach those rows through 0 * NaN in dQ += dS K. The producer
            # zeroes them once for both consumers (which read the slot concurrently) before
            # signalling the slot ready; tiles every row sees whole load as they are.
            whole = step < cta_whole
            pl.when(whole)(
                lambda: plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            )

            @pl.when(jnp.logical_not(whole))
            def _diagonal():
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_landed.at[slot])
                plgpu.barrier_wait(k_landed.at[slot])
                zero_non_finite(k_smem.at[slot])
                plgpu.barrier_arrive(k_ready.at[slot])


def _consume_dq(
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_ring,
    *,
    q_start,
    cta_tiles,
    qk_scale: float,
    is_causal: bool,
    kv_len: int,
    tiles: BackwardTiles,
):
    """Consumer warpgroup: dQ / scale of block_q_dq query rows over every KV tile they see.
    A consumer that sees fewer tiles than the CTA (the first one on the causal diagonal) waits
    for the rest and frees them unread, so the other consumer's tiles can land in their slots."""
    k_smem, v_smem, k_ready, v_ready, k_free, v_free = kv_ring
    block_q, block_kv, num_stages = tiles.block_q_dq, tiles.block_kv_dq, tiles.num_stages
    head_dim, dtype = q_smem.shape[-1], q_smem.dtype
    tile_shape = (block_q, block_kv)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lse2 = plgpu.load(lse_smem, layout=row_layout)
    delta = plgpu.load(delta_smem, layout=row_layout)
    num_tiles, num_unmasked = _kv_tile_counts(
        q_start, block_q, kv_len=kv_len, block_kv=block_kv, is_causal=is_causal
    )
    # A ragged last KV tile holds keys past S (zeros, or whatever lies past the array's end):
    # it lies past num_unmasked and is masked there. Rows past T need no mask (not kept).
    ragged_kv = kv_len % block_kv != 0

    def kv_step(step, dq, *, masked: bool):
        slot = lax.rem(step, jnp.int32(num_stages))
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])

        # -- S = Q K^T and dP = dO V^T, issued together: one wgmma wait for both --
        def s_dp_into(s_ref, dp_ref):
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
            plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].T)
            return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(
            s_dp_into,
            plgpu.ACC(tile_shape, jnp.float32),
            plgpu.ACC(tile_shape, jnp.float32),
        )
        plgpu.barrier_arrive(v_free.at[slot])
        p = jnp.exp2(jnp.minimum(s * qk_scale - _rows(lse2, tile_shape), 0.0))  # as in dK/dV
        ds = p * (dp - _rows(delta, tile_shape))
        if masked:
            # Select dS, not P: NaN in V at a key a row cannot see is in dP, and 0 * NaN is NaN.
            kv_pos = step * block_kv + _iota(tile_shape, 1)
            conditions = []
            if is_causal:
                conditions.append(q_start + _iota(tile_shape, 0) >= kv_pos)
            if ragged_kv:
                conditions.append(kv_pos < kv_len)
            ds = jnp.where(functools.reduce(jnp.logical_and, conditions), ds, 0.0)
        ds_in = ds.astype(dtype)

        # -- dQ += dS K --
        def dq_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, k_smem.at[slot])

        dq = pl.run_state(dq_into)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(k_free.at[slot])
        return dq

    def skip_step(step, _):
        slot = lax.rem(step, jnp.int32(num_stages))
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])

    dq = _wgmma_zeros((block_q, head_dim))
    dq = lax.fori_loop(0, num_unmasked, functools.partial(kv_step, masked=False), dq)
    if is_causal or ragged_kv:
        dq = lax.fori_loop(num_unmasked, num_tiles, functools.partial(kv_step, masked=True), dq)
    if is_causal:
        lax.fori_loop(num_tiles, cta_tiles, skip_step, None)
    return dq
