"""The Mosaic GPU backward's tiles (`BackwardTiles`), their defaults and budgets (shared memory,
registers), the dK/dV kernel's head splits, and the rules of what its kernels take (`why_not`):
what the dispatch checks before it chooses them (`mosaic.why_not_backward`). The forward's are
in `tiles.py`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flash.mosaic import tiles as forward_tiles
from pallas_flash.mosaic.fixed_point import FIXED_POINT_BITS
from pallas_flash.mosaic.tiles import SMEM_BYTES, cdiv, consumer_registers

# Head dims it takes, each as it is: the forward's. At H 192 and 256 one consumer's dK and dV
# accumulators, [64, H] f32 each, with S^T and dP^T would take 256 registers per thread or more
# (the most a thread can have is 255): there the dK/dV kernel splits its consumers by
# accumulator (`BackwardTiles.split_dkv`).
HEAD_DIMS = forward_tiles.HEAD_DIMS
# The producer warpgroup of both backward kernels (dK/dV and dQ): its loop holds a slot, a step,
# a head and a tile start, which 24 registers keep unspilled, and gives one or two consumers
# 240 each (`backward_consumer_registers`). Fewer than the forward's producer
# (`tiles.FORWARD_PRODUCER_REGISTERS`, 40): the backward's consumers spill at 232 (the fused
# dQ's dK/dV consumers, ptxas, H=128 causal "fixed": 812/912 bytes stored/loaded at 232
# registers, 752/800 at 240; its fwd+bwd kernel time 1-7% lower, causal 4-7%:
# docs/notes/backward.md, "Producer registers 24, consumers 240").
BACKWARD_PRODUCER_REGISTERS = 24
# Registers a consumer keeps beyond its f32 tiles (see `BackwardTiles.tile_registers`): the
# 16-bit copies of P and dS, lse, delta and indices; a rule of thumb, not measured.
REGISTER_HEADROOM = 40
FUSED_DQ_MODES = (None, "add", "fixed", "slab", "fixed_slab")


def backward_consumer_registers(num_consumers: int) -> int:
    """Registers per consumer thread of a backward kernel with num_consumers consumer
    warpgroups beside its producer's BACKWARD_PRODUCER_REGISTERS: 240 for one or two."""
    return consumer_registers(num_consumers, BACKWARD_PRODUCER_REGISTERS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardTiles:
    """Tiles of the Mosaic GPU backward.

    Attributes:
      block_q_dkv: query rows per streamed Q/dO tile of the dK/dV kernel (wgmma N of S^T).
      block_kv_dkv: keys per consumer warpgroup of the dK/dV kernel (wgmma M: a multiple of 64).
      block_q_dq: query rows per consumer warpgroup of the dQ kernel (wgmma M).
      block_kv_dq: keys per streamed K/V tile of the dQ kernel (wgmma N of S).
      num_stages: tiles in flight in each kernel's shared-memory ring (>= 2).
      num_consumers: consumer warpgroups per CTA of the dQ kernel (1 or 2), and of the dK/dV
        kernel unless split_dkv.
      split_dkv: the dK/dV kernel's CTA owns block_kv_dkv keys and runs two consumers on them,
        split by accumulator: one computes P^T and keeps dV, the other computes dP^T and dS^T
        (with P^T from the first, through shared memory) and keeps dK. Each holds one
        [block_kv_dkv, H] accumulator instead of two, which is what lets H 192 and 256 fit the
        registers; every product is still computed once.
      dkv_head_splits: CTAs that share the query heads of one KV head's group in the dK/dV
        kernel (a divisor of the group), each adding its share into f32 partial dK and dV that
        XLA sums in a fixed order (still deterministic); 1: one CTA sums the whole group; 0
        (auto, the default): `head_splits` picks it from the grid.
      fused_dq: None (the default): dQ has a kernel of its own, which computes S and dP again
        (seven matmuls per pair of tiles in all). "add": the dK/dV kernel also computes each
        step's dQ partial dS K over the CTA's keys (five in all; its consumers split the rows
        at H=128 and take turns otherwise, `fused_dq.DQSink`) and adds it into an f32 dQ in global
        memory by TMA reductions; the adds arrive in any order, so dQ is not bitwise
        deterministic. "fixed": the same adds in any order, but of integers: each query
        row's dS is scaled by a power of two 2^e (exactly, in 16 bits) before the dQ wgmma,
        its partial converted to int32 and added by TMA; integer adds are associative, so dQ
        is bitwise deterministic (at 0.91-0.97x the speed of "add" on the H200). e comes from
        a bound on the row's partial sums (`mosaic.fixed_point`), which two small kernels
        compute before it from the keys the row sees (by the mask's geometry and segment
        ids), in bfloat16 only.
        "slab": the same partials
        as "add" stored apart, one f32 [B, T, N, H] per kv tile, summed by XLA in a fixed
        order: deterministic, but S / cta_kv_rows times dQ's memory (for tests; jax's Mosaic
        GPU interpreter has no TMA reductions). "fixed_slab": "fixed"'s integer partials stored
        apart the same way (its integer sums are those of "fixed", bitwise). Not with
        split_dkv.
      grouped_launch: causal calls' grids launch a group of heads at a time, level by level,
        longest tiles first (`schedule.grouped_launch`); False: each head's tiles in turn.
      step_descriptors: the dK/dV consumers address their K and V blocks (and the fused dQ's
        K^T and dS^T tiles) through an index that is 0 but that the compiler cannot see
        through (`launch.opaque_zero` of the step), so that the wgmma descriptors of those
        operands are rebuilt every step from one base instead of computed once before the
        loop and held, two registers each, which the fused dQ's consumers spill; False: held.
        The dispatch takes it with the fused dQ at H=128
        (docs/notes/fused-dq.md, "Step descriptors").
      producer_cleans_k: where rows cannot see some keys (`MaskSpec.has_key_ranges`), the dQ
        kernel's producer warpgroup replaces NaN and inf in each K tile that a consumer masks by
        0 in shared memory, after it lands and before the consumers may read it, instead of a pass
        over K in XLA before the kernel (False, the default). Not with fused_dq, whose dK/dV
        consumers clean their own keys.
    All blocks are multiples of 64: wgmma works on 64-row slabs, and a product that contracts
    over a block (P^T dO, dS^T Q, dS K) reads whole column tiles of any swizzle (64 elements
    at most).
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_stages: int = 2
    num_consumers: int = 2
    split_dkv: bool = False
    dkv_head_splits: int = 0
    fused_dq: str | None = None
    grouped_launch: bool = True
    step_descriptors: bool = False
    producer_cleans_k: bool = False

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
        for name in ("split_dkv", "grouped_launch", "step_descriptors", "producer_cleans_k"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BackwardTiles.{name}={getattr(self, name)!r} must be a bool")
        splits = self.dkv_head_splits
        if not isinstance(splits, int) or isinstance(splits, bool) or splits < 0:
            raise ValueError(f"BackwardTiles.dkv_head_splits={splits!r} must be an int >= 0")
        if self.fused_dq not in FUSED_DQ_MODES:
            raise ValueError(
                f"BackwardTiles.fused_dq={self.fused_dq!r} must be one of {FUSED_DQ_MODES}"
            )
        if self.fused_dq is not None and self.split_dkv:
            raise ValueError("BackwardTiles.fused_dq needs split_dkv=False")
        if self.fused_dq is not None and self.producer_cleans_k:
            raise ValueError(
                "BackwardTiles.producer_cleans_k is the dQ kernel's: it needs fused_dq=None"
            )

    @property
    def dkv_consumers(self) -> int:
        """Consumer warpgroups per CTA of the dK/dV kernel."""
        return 2 if self.split_dkv else self.num_consumers

    @property
    def dkv_key_blocks(self) -> int:
        """Blocks of block_kv_dkv keys per CTA of the dK/dV kernel (one per consumer, or one
        shared by the split consumers): the consumers of its tile ranges."""
        return 1 if self.split_dkv else self.num_consumers

    @property
    def cta_kv_rows(self) -> int:
        """Keys per CTA of the dK/dV kernel."""
        return self.dkv_key_blocks * self.block_kv_dkv

    @property
    def cta_q_rows(self) -> int:
        """Query rows per CTA of the dQ kernel."""
        return self.num_consumers * self.block_q_dq

    @property
    def fixed_point_dq(self) -> bool:
        """The fused dQ sums integers (fused_dq "fixed" or "fixed_slab")."""
        return self.fused_dq in ("fixed", "fixed_slab")

    @property
    def slab_dq(self) -> bool:
        """The fused dQ's partials are stored apart, one per kv tile, for XLA to sum."""
        return self.fused_dq in ("slab", "fixed_slab")

    def tile_registers(self, head_dim: int, value_head_dim: int | None = None) -> dict[str, int]:
        """f32 registers per consumer thread that each kernel holds across a step: dK [.., H]
        and dV [.., Hv] with S^T and dP^T (split_dkv: the larger share of the dK consumer's dK
        with dP^T and P^T and the dV consumer's dV with P^T and P^T * dcap), or dQ with S and
        dP (a warpgroup spreads a tile over 128 threads). value_head_dim: Hv, None: H."""
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        if self.split_dkv:
            accumulators = max(head_dim, value_head_dim)
        else:
            accumulators = head_dim + value_head_dim
        # S^T and dP^T; with fused_dq, S^T beside dQ^T's partial of the step before ([H / 2 or
        # H, block_q_dkv], `fused_dq.DQSink`): the larger of the two.
        tiles = 2 * self.block_kv_dkv * self.block_q_dkv
        if self.fused_dq:
            rows = fused_dq_rows(self, head_dim)
            tiles = max(tiles, (self.block_kv_dkv + rows) * self.block_q_dkv)
        return {
            "dK/dV": (self.block_kv_dkv * accumulators + tiles) // 128,
            "dQ": self.block_q_dq * (head_dim + 2 * self.block_kv_dq) // 128,
        }

    def smem_bytes_dkv(
        self,
        head_dim: int,
        itemsize: int,
        *,
        value_head_dim: int | None = None,
        segments: bool = False,
        head_splits: int = 1,
        dropout: bool = False,
    ) -> int:
        """K [.., H], V [.., Hv] per consumer (split_dkv: one block of each, and the f32 P^T the
        consumers hand over), the Q [.., H] and dO [.., Hv] ring, the lse, bound and delta rows
        of the ring; with segment ids, each consumer's copy of its key ids and a ring of query
        ids (int32); with head_splits > 1, the f32 tiles that stage the partial dK and dV (one
        per consumer that stages both at H == Hv, one of each per consumer at Hv != H; split:
        the dK consumer's and the dV consumer's); with dropout, a ring of the query rows' two
        hashes and the CTA's key hashes (int32). value_head_dim: Hv, None: H."""
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        kv = self.cta_kv_rows * (head_dim + value_head_dim) * itemsize
        if self.split_dkv:
            kv += self.block_kv_dkv * self.block_q_dkv * 4
        if head_splits > 1:
            kv += self.block_kv_dkv * 4 * _partial_columns(self, head_dim, value_head_dim)
        # Per streamed query row: lse2, bound and delta (and "fixed"'s scale), f32.
        row_words = 4 if self.fixed_point_dq else 3
        ring = (
            self.num_stages
            * self.block_q_dkv
            * ((head_dim + value_head_dim) * itemsize + row_words * 4)
        )
        id_rows = self.dkv_consumers * self.block_kv_dkv + self.num_stages * self.block_q_dkv
        ids = id_rows * 4 if segments else 0
        hashes = self.num_stages * (2 * self.block_q_dkv + self.cta_kv_rows) * 4
        # fused_dq: each consumer stores dS^T (16-bit, read by K^T dS^T) and stages the f32
        # partials of the steps it computes, which TMA adds into dQ^T.
        rows = fused_dq_rows(self, head_dim)
        fused = self.block_q_dkv * (self.block_kv_dkv * itemsize + rows * 4)
        fused = self.dkv_consumers * fused if self.fused_dq else 0
        return kv + ring + ids + (hashes if dropout else 0) + fused

    def smem_bytes_dq(
        self,
        head_dim: int,
        itemsize: int,
        *,
        value_head_dim: int | None = None,
        segments: bool = False,
        dropout: bool = False,
    ) -> int:
        """Q [.., H], dO [.., Hv] and the lse, bound and delta rows per consumer, the K [.., H]
        and V [.., Hv] ring; with segment ids, the consumers' query ids and a ring of key ids
        (int32); with dropout, the consumers' rows' two hashes and a ring of key hashes
        (int32). value_head_dim: Hv, None: H."""
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        q = self.cta_q_rows * ((head_dim + value_head_dim) * itemsize + 3 * 4)
        ring = self.num_stages * self.block_kv_dq * (head_dim + value_head_dim) * itemsize
        ids = (self.cta_q_rows + self.num_stages * self.block_kv_dq) * 4 if segments else 0
        hashes = (2 * self.cta_q_rows + self.num_stages * self.block_kv_dq) * 4
        return q + ring + ids + (hashes if dropout else 0)


def _partial_columns(tiles: BackwardTiles, head_dim: int, value_head_dim: int) -> int:
    """Columns of the f32 tiles [block_kv_dkv, ..] that stage a dK/dV CTA's partial dK and dV
    (head splits), summed over its tiles: the split consumers stage one each (dV's at Hv, dK's
    at H); otherwise each consumer stages both, through one tile at H == Hv, else one of
    each."""
    if tiles.split_dkv:
        return head_dim + value_head_dim
    per_consumer = head_dim if head_dim == value_head_dim else head_dim + value_head_dim
    return tiles.num_consumers * per_consumer


def default_tiles(head_dim: int, value_head_dim: int | None = None) -> BackwardTiles:
    """Not tuned yet: 64-row slabs everywhere keep a consumer's registers at H=128 near
    dK + dV (128) + S^T, dP^T (64) + their 16-bit copies (32) per thread.

    H 192 and 256 split the dK/dV consumers by accumulator (`split_dkv`): dK and dV of 64 keys
    would take 192 or 256 registers per thread before S^T and dP^T, while one of them leaves
    the dK consumer at 160 or 192 with dP^T and P^T. 64 keys per CTA: a 128-key accumulator is
    again 192 or 256 registers. The dQ kernel at H=256 takes one consumer: two would need
    Q and dO of 128 rows (128 KiB) beside the K/V ring (128 KiB at two 64-key stages), over
    the shared memory; at H=192 two fit (96 + 96 KiB). Both kernels then stream 64-row tiles at
    two stages: 128-row streamed tiles overflow the dK consumer's registers, a third stage the
    shared memory.

    What should limit them (predicted from the budgets, not measured): a split CTA covers 64
    keys, half the default's 128, so every Q and dO tile is read from L2 twice as often per
    key; the dK consumer waits each step for P^T (the dV consumer's S^T and exp2) before it
    can compute dS^T, so the two overlap only as far as dP^T and dV cover it. The one-consumer
    dQ kernel at H=256 has no second warpgroup to run wgmma while it computes P and dS.

    H 80 and 96 take the tiles of 128 (not measured on their own): they hold fewer registers
    (dK/dV at H=96: 64 * (96 + 96 + 2 * 64) / 128 = 160 per thread, 144 at 80, 192 at 128) and
    less shared memory than 128 in both kernels, so what fits at 128 fits at them.

    A value head dim of its own (value_head_dim, None: head_dim) takes the tiles of the larger
    of the two: MLA's (192, 128) those of 192, whose dK/dV consumers could not hold dK and dV
    together either (192 + 128 columns with S^T and dP^T: 224 registers per thread)."""
    head_dim = max(head_dim, head_dim if value_head_dim is None else value_head_dim)
    if head_dim == 256:
        return BackwardTiles(split_dkv=True, num_consumers=1)
    if head_dim == 192:
        return BackwardTiles(split_dkv=True)
    return BackwardTiles()


def head_splits(
    tiles: BackwardTiles,
    q_shape,
    k_shape,
    itemsize: int,
    *,
    num_sms: int,
    causal: bool,
    value_head_dim: int | None = None,
    segments: bool = False,
    dropout: bool = False,
) -> int:
    """CTAs per KV head's group of query heads in the dK/dV kernel: tiles.dkv_head_splits, or
    with 0 (auto) 1 where the partials' f32 staging does not fit in shared memory (the split
    dK/dV consumers' defaults at H 192 and 256) or the grid needs no more CTAs; else the fewest
    (dividing the group) that reach the CTAs it needs, or the whole group.

    Each CTA loops over every query head of its group: with few KV heads (MQA) the grid is
    B * K * S / cta_kv_rows CTAs, under one wave at B * S = 16k. Causal CTAs range from every
    query tile to one, so the longest, about twice the mean, sets the time: a causal grid
    wants two CTAs per SM. A non-causal grid's CTAs are equal, so one wave of them is as good
    as more: it splits only below half a wave, up to one. Splitting adds CTAs without adding
    Q/dO traffic (each streams only its share of the heads); it costs writing and summing the
    f32 partials (measured in docs/notes/backward.md, "Head splits in the dK/dV kernel")."""
    if tiles.dkv_head_splits:
        return tiles.dkv_head_splits
    batch, _, num_heads, head_dim = q_shape
    _, kv_len, num_kv_heads, _ = k_shape
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    group = num_heads // num_kv_heads
    ctas = batch * num_kv_heads * cdiv(kv_len, tiles.cta_kv_rows)
    smem = tiles.smem_bytes_dkv(
        head_dim,
        itemsize,
        value_head_dim=value_head_dim,
        segments=segments,
        head_splits=2,
        dropout=dropout,
    )
    # The CTAs a grid wants, and from how many it is left unsplit.
    wanted, enough = (2 * num_sms, num_sms) if causal else (num_sms, cdiv(num_sms, 2))
    if smem > SMEM_BYTES or ctas >= enough:
        return 1
    return next(
        d for d in range(1, group + 1) if group % d == 0 and (ctas * d >= wanted or d == group)
    )


def unsupported_options(spec, *, soft_cap, has_bias: bool) -> str | None:
    """The options of a call (spec: a masks.MaskSpec) that this backward would drop, named as
    the API names them; None if there are none. It takes the forward's masks: causal, windows,
    segment ids and sequence lengths, and soft caps."""
    del soft_cap
    return forward_tiles.unsupported_options(spec, has_bias=has_bias)


def why_not(
    q_shape,
    k_shape,
    dtype,
    *,
    value_head_dim: int | None = None,
    is_causal: bool,
    window: tuple[int, int] | None = None,
    soft_cap: float | None = None,
    segments: bool = False,
    dropout: bool = False,
    tiles: BackwardTiles | None = None,
    cuda_runtime_version: int | None = None,
) -> str | None:
    """Why the Mosaic GPU backward cannot run on these shapes and options, or None when it can
    (the caller keeps the Triton backward). Any T and S; `value_head_dim`: Hv of v, out and
    d_out (None: q's H), one of HEAD_DIMS too; `window` and `soft_cap` as in `MaskSpec` and
    `KernelConfig`, `segments`: the call has segment ids (or sequence lengths), whose id
    buffers take shared memory, `dropout`: the call has dropout, whose hash buffers do too;
    `cuda_runtime_version`: the target's, None when not known."""
    if reason := forward_tiles.check_options(
        is_causal=is_causal,
        window=window,
        soft_cap=soft_cap,
        cuda_runtime_version=cuda_runtime_version,
    ):
        return reason
    if reason := forward_tiles.check_shapes(q_shape, k_shape, dtype):
        return reason
    _, q_len, _, head_dim = q_shape
    kv_len = k_shape[1]
    if head_dim not in HEAD_DIMS:
        return f"{head_dim=} is not one of {HEAD_DIMS}"
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    if value_head_dim not in HEAD_DIMS:
        return f"{value_head_dim=} is not one of {HEAD_DIMS}"
    if q_len == 0 or kv_len == 0:
        return f"{q_len=} and {kv_len=} must be positive"
    tiles = default_tiles(head_dim, value_head_dim) if tiles is None else tiles
    # Registers and shared memory at the head dims themselves: the kernels run them unpadded.
    dims = f"{head_dim=}" + ("" if value_head_dim == head_dim else f", {value_head_dim=}")
    # The rest of a consumer's registers hold the 16-bit copies of P and dS, lse, delta, indices.
    consumers = {"dK/dV": tiles.dkv_consumers, "dQ": tiles.num_consumers}
    for kernel, registers in tiles.tile_registers(head_dim, value_head_dim).items():
        budget = backward_consumer_registers(consumers[kernel]) - REGISTER_HEADROOM
        if registers > budget:
            return (
                f"{tiles} holds {registers} f32 registers per thread in {kernel} at {dims}, "
                f"over {budget}: it would spill"
            )
    if tiles.fused_dq and head_dim % 64:
        return (
            f"{tiles} computes dQ^T's partial in the dK/dV kernel, whose wgmma rows are the "
            f"{head_dim=} columns: fused_dq needs a multiple of 64"
        )
    if tiles.fused_dq and (dropout or value_head_dim != head_dim):
        return f"{tiles}: fused_dq is not tested with dropout or a value head dim of its own yet"
    if tiles.fixed_point_dq and jnp.dtype(dtype) != jnp.bfloat16:
        return (
            f"{tiles} scales dS in the input dtype until its dQ sums reach "
            f"2^{FIXED_POINT_BITS}: bfloat16 only, not {jnp.dtype(dtype).name} "
            "(float16's range ends at 2^16)"
        )
    group, splits = q_shape[2] // k_shape[2], tiles.dkv_head_splits
    if splits > 1 and group % splits:
        return (
            f"{tiles} splits each KV head's group of {group} query heads over "
            f"dkv_head_splits={splits} CTAs: it must divide the group"
        )
    itemsize = jnp.dtype(dtype).itemsize
    budget = dict(value_head_dim=value_head_dim, segments=segments, dropout=dropout)
    dkv_smem = tiles.smem_bytes_dkv(head_dim, itemsize, head_splits=max(1, splits), **budget)
    for kernel, smem in (
        ("dK/dV", dkv_smem),
        ("dQ", tiles.smem_bytes_dq(head_dim, itemsize, **budget)),
    ):
        if smem > SMEM_BYTES:
            return f"{tiles} needs {smem} bytes of shared memory in {kernel} at {dims}"
    return None


def fused_dq_rows(tiles: BackwardTiles, head_dim: int) -> int:
    """Rows of dQ^T's partial that each consumer of the fused dQ computes (tiles.fused_dq,
    `fused_dq.DQSink`): H / 2 in halves (two consumers and H / 2 a multiple of wgmma's 64),
    else H."""
    return head_dim // 2 if tiles.dkv_consumers == 2 and head_dim % 128 == 0 else head_dim
