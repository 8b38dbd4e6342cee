"""FlashAttention forward for Hopper as a warp-specialised Pallas Mosaic GPU kernel.

FlashAttention-3 (Shah et al. 2024) structure on FlashAttention-2's algorithm (Dao 2023,
Algorithm 1): every CTA runs three warpgroups. The producer warpgroup streams K and V tiles
with TMA into a ring of `num_stages` shared-memory slots; two consumer warpgroups each own
`block_q` query rows, run Q.K^T and P.V on wgmma and the online softmax in registers. A
schedule barrier makes the two consumers take turns on the tensor cores ("ping-pong"), so
that one warpgroup's softmax overlaps the other's matrix multiplies.

Outputs match `pallas_flash.triton.forward` (out in the input dtype, lse natural-log float32
[B, N, T]) so that the Triton backward can use them as residuals.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.triton._common import LN2, LOG2E, MASK_VALUE

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
NUM_CONSUMERS = 2  # consumer warpgroups per CTA; the producer is warpgroup NUM_CONSUMERS
# Shared memory one CTA may use on sm_90 (227 KiB), less 4 KiB for what Mosaic GPU adds to the
# kernel's own buffers: its cross-warp reduction scratch (2 KiB by default) and the barriers.
SMEM_BYTES = (227 - 4) * 1024
# Registers per thread: 128 * (2 * 232 + 40) <= 65536, the register file of one SM. The
# producer only issues TMA copies; the consumers hold a [block_q, H] f32 accumulator and a
# [block_q, block_kv] tile of logits.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardTiles:
    """Tiles of the Mosaic GPU forward.

    Attributes:
      block_q: query rows per consumer warpgroup (a CTA covers NUM_CONSUMERS * block_q rows).
        wgmma works on 64-row slabs: a multiple of 64.
      block_kv: keys per KV tile (one wgmma N dim for Q.K^T, K dim for P.V): a multiple of 64.
      num_stages: KV tiles in flight in the shared-memory ring (>= 2 to overlap TMA and wgmma).
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 64:
                raise ValueError(f"ForwardTiles.{name}={value!r} must be a positive multiple of 64")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"ForwardTiles.num_stages={self.num_stages!r} must be an int >= 2")

    @property
    def cta_rows(self) -> int:
        return NUM_CONSUMERS * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory of one CTA: Q/out per consumer, the K and V rings, the lse rows."""
        q = self.cta_rows * head_dim * itemsize
        kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        return q + kv + self.cta_rows * 4


def default_tiles(head_dim: int) -> ForwardTiles:
    """Tiles per head dim, measured on the H200 (benchmarks/results/h200-mosaic-tiles.jsonl).
    H=256 halves block_kv: two stages of 128-key K and V tiles would need 256 KiB of shared
    memory. Two stages beat three or four at H=64 too (450 against 416 TFLOP/s at 16k).
    Measured but not yet checked numerically on the GPU: at H=64, 128 rows per consumer
    (block_q=128) beat 64 when causal (1k: 259 against 238 TFLOP/s) or with at most 1k keys
    (512: 299 against 276); see benchmarks/NOTES.md."""
    if head_dim <= 128:
        return ForwardTiles(block_q=64, block_kv=128, num_stages=2)
    return ForwardTiles(block_q=64, block_kv=64, num_stages=2)


# Per consumer thread, the f32 accumulator [block_q, H] and logits [block_q, block_kv] take
# block_q * (H + block_kv) / 128 registers; beyond this the 232-register budget spills.
MAX_TILE_REGISTERS = 192
# CUDA runtimes whose ptxas miscompiles the causal mask of this kernel's shape (jax's own
# Hopper attention refuses causal on them too: jax/experimental/pallas/ops/gpu/attention_mgpu.py).
_CAUSAL_MISCOMPILING_CUDA = range(12080, 12091)


def cuda_runtime_version() -> int | None:
    """The CUDA runtime version as an int (12080 = 12.8.0), or None without CUDA."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()


def unsupported_options(spec, *, soft_cap, has_bias: bool) -> str | None:
    """The options of a call (spec: a masks.MaskSpec) that this kernel, which takes only q, k, v,
    scale and is_causal, would drop, named as the API names them; None if there are none."""
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


def supports(
    q_shape, k_shape, dtype, *, is_causal: bool, tiles: ForwardTiles | None = None
) -> str | None:
    """None if the kernel runs on these shapes, else why not (the caller falls back to Triton)."""
    if is_causal and (version := cuda_runtime_version()) in _CAUSAL_MISCOMPILING_CUDA:
        return f"is_causal=True on CUDA runtime {version} (ptxas 12.8.0-12.9.0 miscompiles it)"
    if len(q_shape) != 4 or len(k_shape) != 4:
        return f"q {tuple(q_shape)} and k {tuple(k_shape)} must be [B, T, N, H] and [B, S, K, H]"
    batch, q_len, num_heads, head_dim = q_shape
    kv_batch, kv_len, num_kv_heads, kv_head_dim = k_shape
    if (kv_batch, kv_head_dim) != (batch, head_dim):
        return f"k {tuple(k_shape)} does not match q {tuple(q_shape)} in batch or head dim"
    if num_heads % num_kv_heads:
        return f"{num_heads=} must be divisible by {num_kv_heads=}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
    if head_dim not in HEAD_DIMS:
        return f"{head_dim=} is not one of {HEAD_DIMS}"
    tiles = default_tiles(head_dim) if tiles is None else tiles
    if q_len == 0 or q_len % tiles.cta_rows:
        return f"{q_len=} not a positive multiple of {tiles.cta_rows} (2 x block_q)"
    if kv_len == 0 or kv_len % tiles.block_kv:
        return f"{kv_len=} not a positive multiple of block_kv={tiles.block_kv}"
    if tiles.block_kv > 256:
        return f"block_kv={tiles.block_kv} exceeds the wgmma N limit of 256"
    registers = tiles.block_q * (head_dim + tiles.block_kv) // 128
    if registers > MAX_TILE_REGISTERS:
        return (
            f"{tiles} needs {registers} registers per thread for the accumulator and logits at "
            f"{head_dim=}, over {MAX_TILE_REGISTERS} (it would spill)"
        )
    smem = tiles.smem_bytes(head_dim, jnp.dtype(dtype).itemsize)
    if smem > SMEM_BYTES:
        return f"{tiles} needs {smem} bytes of shared memory at {head_dim=}, over {SMEM_BYTES}"
    return None


def flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    tiles: ForwardTiles | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention forward on Hopper (sm_90a) through Pallas Mosaic GPU.

    Args:
      q: [B, T, N, H] queries, bfloat16 or float16.
      k, v: [B, S, K, H] keys and values, the dtype of q; N % K == 0 and query head n reads kv
        head n // (N // K) (e.g. N=8, K=2: heads 0-3 read kv head 0, heads 4-7 kv head 1).
      scale: positive multiplier of q.k (the kernel takes the row max before scaling).
      is_causal: query i sees keys j <= i, top-left aligned as in jax.nn.dot_product_attention,
        also when T != S::

          T=4, S=6   keys ->
          q0         x . . . . .
          q1         x x . . . .
          q2         x x x . . .
          q3         x x x x . .

        Every row sees key 0, so no row is empty.
      tiles: ForwardTiles; None picks `default_tiles(H)`.

    Returns:
      out [B, T, N, H] in the dtype of q, and lse float32 [B, N, T]: the natural-log
      log-sum-exp of scale * q.k over the visible keys.

    Raises:
      ValueError: shapes, dtypes or tiles the kernel does not support (see `supports`).
    """
    if reason := supports(q.shape, k.shape, q.dtype, is_causal=is_causal, tiles=tiles):
        raise ValueError(reason)
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must share shape and q's dtype"
        )
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive: the row max is taken before scaling")
    tiles = default_tiles(q.shape[-1]) if tiles is None else tiles
    return _forward_call(q, k, v, scale=float(scale), is_causal=is_causal, tiles=tiles)


def _forward_call(q, k, v, *, scale: float, is_causal: bool, tiles: ForwardTiles):
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    kernel = functools.partial(
        _forward_kernel,
        qk_scale=scale * LOG2E,
        is_causal=is_causal,
        kv_len=kv_len,
        group=num_heads // num_kv_heads,
        num_q_tiles=q_len // tiles.cta_rows,
        tiles=tiles,
    )
    # A 128-byte swizzle over 64-element column tiles (one 128-byte row of 16-bit values) is
    # what TMA and wgmma both read without bank conflicts; it needs H and block_kv % 64 == 0.
    smem_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def ring(rows):
        return plgpu.SMEM((tiles.num_stages, rows, head_dim), q.dtype, transforms=smem_transforms)

    scratch = dict(
        q_smem=plgpu.SMEM(
            (NUM_CONSUMERS, tiles.block_q, head_dim), q.dtype, transforms=smem_transforms
        ),
        k_smem=ring(tiles.block_kv),
        v_smem=ring(tiles.block_kv),
        lse_smem=plgpu.SMEM((NUM_CONSUMERS, tiles.block_q), jnp.float32),
        q_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        k_ready=plgpu.Barrier(num_barriers=tiles.num_stages),
        v_ready=plgpu.Barrier(num_barriers=tiles.num_stages),
        # A slot is free again once both consumers are done with it.
        k_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=tiles.num_stages),
        v_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=tiles.num_stages),
        schedule=plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
    )
    out_type = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32),
    )
    # The last grid axis is CUDA's x, launched first: neighbouring CTAs are query tiles of one
    # head and read the same K/V from L2.
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(batch, num_heads, q_len // tiles.cta_rows),
        grid_names=("batch", "head", "q_tile"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)


def _kv_tile_counts(q_start, rows: int, *, kv_len: int, block_kv: int, is_causal: bool):
    """(visible, unmasked): the KV tiles that query rows [q_start, q_start + rows) see at all,
    and how many leading ones they see whole. Tiles past `visible` lie above the causal
    diagonal and are never loaded; tiles in [unmasked, visible) straddle it and need the mask."""
    num_tiles = kv_len // block_kv
    if not is_causal:
        return num_tiles, num_tiles
    block = jnp.int32(block_kv)
    last_key = jnp.minimum(q_start + rows, jnp.int32(kv_len))  # one past the last visible key
    visible = lax.div(last_key + block - 1, block)
    # Tile j is whole for every row iff its last key (j + 1) * block_kv - 1 <= q_start.
    unmasked = jnp.minimum(lax.div(q_start + 1, block), jnp.int32(num_tiles))
    return visible, unmasked


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    *,
    q_smem,
    k_smem,
    v_smem,
    lse_smem,
    q_ready,
    k_ready,
    v_ready,
    k_free,
    v_free,
    schedule,
    qk_scale: float,
    is_causal: bool,
    kv_len: int,
    group: int,
    num_q_tiles: int,
    tiles: ForwardTiles,
):
    """One CTA: NUM_CONSUMERS * block_q query rows of one head against that head's keys.

    q_ref, out_ref: [B, T, N, H] and k_ref, v_ref: [B, S, K, H] in GMEM; lse_ref [B, N, T].
    q_smem [NUM_CONSUMERS, block_q, H] holds each consumer's Q, later its output tile;
    k_smem, v_smem [num_stages, block_kv, H] are the ring; the barriers are named after what
    their completion means.
    """
    batch, head = lax.axis_index("batch"), lax.axis_index("head")
    q_tile = lax.axis_index("q_tile")
    if is_causal:
        # A causal CTA's work grows with its query tile: launch the longest (last) tiles first
        # so that the short ones fill in at the end of the last wave.
        q_tile = num_q_tiles - 1 - q_tile
    cta_q_start = q_tile * tiles.cta_rows
    # The last consumer's rows end the CTA's rows, so it sees the most tiles: the producer's count.
    cta_tiles, _ = _kv_tile_counts(
        cta_q_start, tiles.cta_rows, kv_len=kv_len, block_kv=tiles.block_kv, is_causal=is_causal
    )
    wg = lax.axis_index("wg")
    ring = _Ring(k_smem, v_smem, k_ready, v_ready, k_free, v_free, tiles.num_stages)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        _consume(
            q_ref,
            out_ref,
            lse_ref,
            q_smem.at[wg],
            lse_smem.at[wg],
            q_ready.at[wg],
            schedule,
            ring,
            wg=wg,
            batch=batch,
            head=head,
            q_start=cta_q_start + wg * tiles.block_q,
            cta_tiles=cta_tiles,
            qk_scale=qk_scale,
            is_causal=is_causal,
            kv_len=kv_len,
            tiles=tiles,
        )

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))
        _produce(k_ref, v_ref, ring, batch=batch, kv_head=kv_head, cta_tiles=cta_tiles, tiles=tiles)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The K/V shared-memory ring: tile j lives in slot j % num_stages. *_ready complete when
    TMA has landed a tile, *_free when both consumers are done reading it."""

    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    num_stages: int

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.num_stages))


def _produce(k_ref, v_ref, ring: _Ring, *, batch, kv_head, cta_tiles, tiles: ForwardTiles):
    """Producer warpgroup: TMA every KV tile the CTA sees into the ring, in order."""

    def copy(gmem_ref, smem, ready, step, slot):
        rows = (batch, pl.ds(step * tiles.block_kv, tiles.block_kv), kv_head)
        plgpu.copy_gmem_to_smem(gmem_ref.at[rows], smem.at[slot], ready.at[slot])

    # Fill the empty ring; a CTA may see fewer tiles than there are slots (short S, causal
    # CTAs near the top): copies nobody waits for would still be in flight at exit.
    for step in range(min(tiles.num_stages, k_ref.shape[1] // tiles.block_kv)):

        @pl.when(step < cta_tiles)
        def _fill():
            copy(k_ref, ring.k_smem, ring.k_ready, step, step)  # noqa: B023 (called at once)
            copy(v_ref, ring.v_smem, ring.v_ready, step, step)  # noqa: B023

    @pl.loop(tiles.num_stages, cta_tiles)
    def _refill(step):
        slot = ring.slot(step)
        # K and V are freed separately: Q.K^T of a tile is done long before its P.V.
        plgpu.barrier_wait(ring.k_free.at[slot])
        copy(k_ref, ring.k_smem, ring.k_ready, step, slot)
        plgpu.barrier_wait(ring.v_free.at[slot])
        copy(v_ref, ring.v_smem, ring.v_ready, step, slot)


def _schedule_sync(schedule):
    """Both consumers meet here; see `_consume` for the turn-taking this produces."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def _rows(x, shape):
    """Broadcast a per-row vector [rows] (WGMMA row layout) over the columns of `shape`."""
    return lax.broadcast_in_dim(x, shape, [0])


def _consume(
    q_ref,
    out_ref,
    lse_ref,
    q_smem,
    lse_smem,
    q_ready,
    schedule,
    ring: _Ring,
    *,
    wg,
    batch,
    head,
    q_start,
    cta_tiles,
    qk_scale: float,
    is_causal: bool,
    kv_len: int,
    tiles: ForwardTiles,
):
    """Consumer warpgroup: block_q query rows through every visible KV tile (FA2 Algorithm 1).

    Ping-pong: each KV step has two schedule syncs, one after issuing Q.K^T and one split
    around the end of the softmax. Consumer 1 syncs once before its first step and consumer 0
    once after its last, so consumer 1 runs half a step behind: its Q.K^T and P.V are issued
    while consumer 0 computes its softmax, and the other way round (FA3, section 3.1).
    """
    block_q, block_kv = tiles.block_q, tiles.block_kv
    head_dim, dtype = q_smem.shape[-1], q_smem.dtype
    q_rows = (batch, pl.ds(q_start, block_q), head)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem, q_ready)
    num_tiles, num_unmasked = _kv_tile_counts(
        q_start, block_q, kv_len=kv_len, block_kv=block_kv, is_causal=is_causal
    )

    def kv_step(step, carry, *, masked: bool):
        acc, m_i, l_i = carry
        slot = ring.slot(step)
        plgpu.barrier_wait(ring.k_ready.at[slot])

        # -- compute qk --
        def qk_into(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, ring.k_smem.at[slot].T)
            _schedule_sync(schedule)  # the other consumer may now issue its matmuls
            return acc_ref[...]  # waits for the wgmma

        qk = pl.run_scoped(qk_into, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(ring.k_free.at[slot])
        if masked:
            q_idx = plgpu.broadcasted_iota(
                jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA
            )
            kv_idx = plgpu.broadcasted_iota(
                jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA
            )
            visible = q_start + q_idx >= step * block_kv + kv_idx
            qk = jnp.where(visible, qk, MASK_VALUE)

        # -- online softmax in base 2; log2(e) * scale is folded into qk_scale --
        # Scaling the row max instead of every logit is exact for qk_scale > 0, and leaves one
        # fused multiply-add per logit.
        m_new = jnp.maximum(m_i, jnp.max(qk, axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(qk * qk_scale - _rows(m_new, qk.shape))
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * _rows(alpha, acc.shape)
        p_in = p.astype(dtype)  # wgmma takes A from registers in the input dtype
        plgpu.barrier_arrive(schedule)  # softmax done: the other consumer may take the MMAs
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_wait(schedule)  # ... and has issued them

        # -- accumulate p.v, unnormalised (normalised once in the epilogue: FA2 change 1) --
        def pv_into(acc_ref):
            plgpu.wgmma(acc_ref, p_in, ring.v_smem.at[slot])

        acc = pl.run_state(pv_into)(plgpu.ACC.init(acc))  # returns after the wgmma completes
        plgpu.barrier_arrive(ring.v_free.at[slot])
        return acc, m_new, l_i

    def drain_step(step, _):
        # A consumer that sees fewer tiles than the CTA (consumer 0 on the causal diagonal)
        # still releases the slots of the rest, whose free barriers count both consumers, and
        # keeps its two schedule syncs per step so that the ping-pong stays paired.
        slot = ring.slot(step)
        plgpu.barrier_arrive(ring.k_free.at[slot])
        plgpu.barrier_arrive(ring.v_free.at[slot])
        _schedule_sync(schedule)
        _schedule_sync(schedule)

    acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # m_i starts at MASK_VALUE, finite: every row sees key 0 in tile 0, so m_i is a real
    # logit after the first step and alpha = exp2(MASK_VALUE - m) = 0 scales the empty start.
    m_i = plgpu.layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
    carry = (acc, m_i, l_i)
    plgpu.barrier_wait(q_ready)
    pl.when(wg == 1)(functools.partial(_schedule_sync, schedule))
    carry = lax.fori_loop(0, num_unmasked, functools.partial(kv_step, masked=False), carry)
    if is_causal:
        carry = lax.fori_loop(
            num_unmasked, num_tiles, functools.partial(kv_step, masked=True), carry
        )
        lax.fori_loop(num_tiles, cta_tiles, drain_step, None)
    pl.when(wg == 0)(functools.partial(_schedule_sync, schedule))
    acc, m_i, l_i = carry

    # -- epilogue: out = acc / l, lse back to natural log --
    # One reciprocal per row instead of a divide per element; l_i >= 1 (the row max term).
    out = acc * _rows(1.0 / l_i, acc.shape)
    q_smem[...] = out.astype(dtype)  # Q is dead: its last reader, the final Q.K^T, is done
    lse_smem[...] = m_i * LN2 + jnp.log(l_i)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[q_rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, block_q)])
    plgpu.wait_smem_to_gmem(0)
