"""The Mosaic GPU backward's dK/dV kernel (`dkv_call`), with the fused dQ's partials where
`BackwardTiles.fused_dq` asks for them (`fused_dq.DQSink`).

A CTA owns `num_consumers * block_kv_dkv` keys of one KV head. Each consumer warpgroup keeps its
`block_kv_dkv` rows of K and V in shared memory and its dK, dV in f32 registers; the producer
warpgroup streams Q, dO tiles (with their lse and delta rows) of every query head of the GQA
group and every query tile that sees the CTA's keys through a TMA ring. The tiles are computed
transposed (keys on rows: S^T = K Q^T), so that P^T and dS^T are register A operands of
dV += P^T dO and dK += dS^T Q.

With `dkv_head_splits` > 1 a KV head's group of query heads is shared by that many CTAs (more
CTAs where few KV heads leave the grid under one wave: MQA), each writing f32 partial dK, dV
that XLA sums.

With `split_dkv` (H 192 and 256, where one warpgroup cannot hold both accumulators) a CTA owns
`block_kv_dkv` keys and its two consumers split the work by accumulator: one computes P^T and
keeps dV, the other computes dP^T and dS^T and keeps dK; P^T (times the soft cap's derivative)
passes between them through shared memory (`_PHandoff`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash._numerics import LOG2E
from pallas_flash.masks import MaskSpec
from pallas_flash.mosaic import launch
from pallas_flash.mosaic._kernel_common import (
    clip,
    per_col,
    per_row,
    recomputed_probs,
    step_tile,
    step_zero,
    tile_keep,
    tile_smem,
    times,
    wgmma_iota,
    wgmma_zeros,
)
from pallas_flash.mosaic.backward_tiles import (
    BACKWARD_PRODUCER_REGISTERS,
    BackwardTiles,
    backward_consumer_registers,
    fused_dq_rows,
)
from pallas_flash.mosaic.fused_dq import DQSink
from pallas_flash.mosaic.launch import (
    dropped_value,
    warp_specialised_kernel,
    warp_specialised_kernel_into,
    zero_non_finite,
)
from pallas_flash.mosaic.schedule import launch_group, launched_cta
from pallas_flash.mosaic.tiles import cdiv

# Vectors over the transposed tiles' columns (the query rows: lse, delta, query ids and hashes)
# and rows (the keys: their ids and hashes).
_COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


def _dkv_geometry(spec: MaskSpec, tiles: BackwardTiles) -> MaskSpec:
    """spec with S rounded up to whole dK/dV CTAs: each key is a row of dK and dV there, and the
    rows past S are computed and not kept, so no query tile needs a mask for them."""
    cta_rows = tiles.cta_kv_rows
    return dataclasses.replace(spec, kv_len=cdiv(spec.kv_len, cta_rows) * cta_rows)


def q_tile_ranges(spec: MaskSpec, tiles: BackwardTiles, cta_kv_start, kv_start):
    """((first, end), (lo, full_lo, full_hi, hi)) from the geometry: the query tiles (of
    block_q_dkv rows) that the dK/dV CTA whose keys start at cta_kv_start streams, and
    `MaskSpec.q_tile_range` of a consumer's keys from kv_start, clamped into them (a consumer
    whose keys no row sees gets an empty range inside the CTA's, and drains its steps)."""
    geometry = _dkv_geometry(spec, tiles)
    block_q = tiles.block_q_dkv
    first, _, _, end = geometry.q_tile_range(cta_kv_start, block_q, tiles.cta_kv_rows)
    ranges = geometry.q_tile_range(kv_start, block_q, tiles.block_kv_dkv)
    return (first, end), tuple(clip(x, first, end) for x in ranges)


def dkv_mask_sides(spec: MaskSpec, tiles: BackwardTiles) -> tuple[bool, bool]:
    """(before, after): whether a dK/dV consumer's range may hold masked query tiles before its
    whole ones (keys hidden from earlier rows: causal, or the window's right side) and after
    them (keys hidden from later rows: the window's left side). Row i sees key j >= 0 once
    i >= j - right, for every key the kernel runs (j < S rounded up to its CTAs) once right >=
    that - 1; and once left >= R - 1 for every row i < R, R = T rounded up to block_q_dkv. With
    segment ids any tile may need the mask."""
    if spec.has_segments:
        return True, True
    keys = _dkv_geometry(spec, tiles).kv_len
    rows = cdiv(spec.q_len, tiles.block_q_dkv) * tiles.block_q_dkv
    return spec.right < keys - 1, spec.left < rows - 1


def dkv_call(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    ids,
    drop,
    *,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    tiles,
    head_splits: int = 1,
):
    """ids: None, or (q_segment_ids [B, T'], kv_segment_ids [B, S'], the dK/dV tile plan);
    drop: None, or (rate, the rows' hashes [B, N, 2, T''], the keys' [B, N, S'' / block_kv_dkv,
    block_kv_dkv]), the dropout tables.
    dk [B, S', K, H], dv [B, S', K, Hv] in k's dtype, or with head_splits > 1 f32 partials
    [B, S', K * head_splits, H or Hv] (a KV head's splits side by side) for the caller to
    sum. With tiles.fused_dq also dQ^T unscaled, f32: [B, N, H, T''] over whole query tiles
    ("add"), or [S'' / cta_kv_rows, B, N, H, T''], one per kv tile, for the caller to sum
    ("slab"); int32 in each row's units of 2^-e with "fixed" and "fixed_slab" (lse2 then has
    a third row, 2^e)."""
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, value_head_dim = k.shape[2], v.shape[3]
    n_c, n_s, block_q = tiles.dkv_consumers, tiles.num_stages, tiles.block_q_dkv
    has_ids = ids is not None
    has_drop = drop is not None
    # Split consumers share one block of K and V: the dV consumer reads only K, the dK consumer
    # only V, each loads its own (one TMA copy on its kv_loaded barrier, and its key ids).
    kv_blocks, kv_copies = tiles.dkv_key_blocks, 1 if tiles.split_dkv else 2
    group = num_heads // num_kv_heads // head_splits
    # A CTA streams the Q and dO rows of its share of the KV head's query heads.
    unit_bytes = group * spec.q_len * (head_dim + value_head_dim) * q.dtype.itemsize
    kernel = functools.partial(
        _dkv_kernel,
        spec=spec,
        qk_scale=scale * LOG2E,
        scale=scale,
        soft_cap=soft_cap,
        group=group,
        head_splits=head_splits,
        tiles=tiles,
        dropout_rate=drop[0] if has_drop else 0.0,
        launch_units=launch_group(
            batch * num_kv_heads * head_splits,
            unit_bytes,
            is_causal=spec.is_causal and tiles.grouped_launch,
        ),
    )
    scratch = dict(
        k_smem=tile_smem((kv_blocks, tiles.block_kv_dkv, head_dim), q.dtype),
        v_smem=tile_smem((kv_blocks, tiles.block_kv_dkv, value_head_dim), q.dtype),
        q_smem=tile_smem((n_s, block_q, head_dim), q.dtype),
        do_smem=tile_smem((n_s, block_q, value_head_dim), q.dtype),
        # lse2 and bound rows (and with fused_dq "fixed" the rows' scales)
        lse_smem=plgpu.SMEM((n_s, lse2.shape[2], block_q), jnp.float32),
        delta_smem=plgpu.SMEM((n_s, block_q), jnp.float32),
        # Two TMA copies arrive on each: K and V (split: K or V); Q and its lse rows; dO and its
        # delta rows. With segment ids the keys' ids land with K and V, the rows' ids with Q;
        # with dropout the rows' hashes and the CTA's keys' hashes (of the step's head) with Q.
        kv_loaded=plgpu.Barrier(num_arrivals=kv_copies + has_ids, num_barriers=n_c),
        q_ready=plgpu.Barrier(num_arrivals=2 + has_ids + 2 * has_drop, num_barriers=n_s),
        do_ready=plgpu.Barrier(num_arrivals=2, num_barriers=n_s),
        # A slot is free again once every consumer is done with it.
        q_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        do_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
    )
    if has_ids:
        scratch.update(
            kv_ids_smem=plgpu.SMEM((n_c, tiles.block_kv_dkv), jnp.int32),
            q_ids_smem=plgpu.SMEM((n_s, block_q), jnp.int32),
        )
    if has_drop:
        scratch.update(
            drop_rows_smem=plgpu.SMEM((n_s, 2, block_q), jnp.int32),
            drop_col_smem=plgpu.SMEM((n_s, kv_blocks, tiles.block_kv_dkv), jnp.int32),
        )
    if tiles.split_dkv:
        # P^T * dcap in f32, as the one-consumer kernel computes dS^T from it. One buffer: the
        # dK consumer copies it into registers as soon as it lands, long before the dV consumer
        # has the next one (a second buffer would not fit beside the ring at H=256).
        scratch.update(
            p_smem=plgpu.SMEM((tiles.block_kv_dkv, block_q), jnp.float32),
            p_ready=plgpu.Barrier(num_arrivals=1),
            p_free=plgpu.Barrier(num_arrivals=1),
        )
    out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    if head_splits > 1:
        # Partials stay f32 until XLA has summed them, as one CTA's accumulators would. Split
        # consumers stage one each; others stage dK then dV through one tile at H == Hv.
        def staging(consumers, columns):
            return plgpu.SMEM((*consumers, tiles.block_kv_dkv, columns), jnp.float32)

        consumers = () if tiles.split_dkv else (n_c,)
        scratch.update(dk_partial_smem=staging(consumers, head_dim))
        if tiles.split_dkv or value_head_dim != head_dim:
            scratch.update(dv_partial_smem=staging(consumers, value_head_dim))
        out_type = tuple(
            jax.ShapeDtypeStruct((*k.shape[:2], num_kv_heads * head_splits, h), jnp.float32)
            for h in (head_dim, value_head_dim)
        )
    # The last grid axis is launched first: neighbouring CTAs are KV tiles of one head and read
    # the same Q/dO from L2. Causal: tile 0 sees the most query tiles and starts first, a group
    # of heads at a time (`schedule.grouped_launch`).
    grid = (batch, num_kv_heads * head_splits, cdiv(spec.kv_len, tiles.cta_kv_rows))
    grid_args = dict(grid=grid, grid_names=("batch", "kv_head", "kv_tile"), num_consumers=n_c)
    operands = (q, k, v, d_out, lse2, delta, *(ids or ()), *(drop[1:] if has_drop else ()))
    if not tiles.fused_dq:
        return warp_specialised_kernel(
            kernel, out_type=out_type, scratch_types=scratch, **grid_args
        )(*operands)
    # Each consumer stores its step's dS^T (read as B by K^T dS^T) and stages the f32 partials
    # of the steps it computes (`DQSink`).
    dq_dtype = jnp.int32 if tiles.fixed_point_dq else jnp.float32
    scratch.update(
        ds_smem=tile_smem((n_c, tiles.block_kv_dkv, block_q), q.dtype),
        dq_partial_smem=plgpu.SMEM((n_c, fused_dq_rows(tiles, head_dim), block_q), dq_dtype),
    )
    if n_c > 1:
        scratch.update(
            ds_ready=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_c),
            ds_read=plgpu.Barrier(num_arrivals=1, num_barriers=n_c),
        )
    # dQ^T starts at 0 (steps add into it) over whole query tiles.
    dq_shape = (batch, num_heads, head_dim, cdiv(q.shape[1], block_q) * block_q)
    if tiles.slab_dq:
        dq_shape = (grid[2], *dq_shape)
    # dK and dV (or their partials) are written whole, as without the fused dQ: they start
    # uninitialised (an allocation on the GPU, where zeros cost a pass over 2 x [B, S, K, H]).
    outputs = (launch.uninitialised(t.shape, t.dtype) for t in out_type)
    into = (*outputs, jnp.zeros(dq_shape, dq_dtype))
    return warp_specialised_kernel_into(kernel, into=into, scratch_types=scratch, **grid_args)(
        *operands
    )


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    *refs,
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
    kv_ids_smem=None,
    q_ids_smem=None,
    p_smem=None,
    p_ready=None,
    p_free=None,
    dk_partial_smem=None,
    dv_partial_smem=None,
    drop_rows_smem=None,
    drop_col_smem=None,
    ds_smem=None,
    dq_partial_smem=None,
    ds_ready=None,
    ds_read=None,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    group: int,
    head_splits: int,
    tiles: BackwardTiles,
    dropout_rate: float = 0.0,
    launch_units: int = 1,
):
    """One CTA: tiles.cta_kv_rows keys of one KV head (FA2 Algorithm 2, outer loop), over
    `group` of its query heads (all of them, or one of head_splits shares). The grid position
    (batch, kv_head, kv_tile) maps to the CTA's by `schedule.grouped_launch` over
    launch_units (batch, kv_head) pairs at a time.

    q_ref: [B, T', N, H], do_ref: [B, T', N, Hv]; k_ref, dk_ref: [B, S', K, H], v_ref,
    dv_ref: [B, S', K, Hv] (dk_ref and dv_ref with head_splits > 1 f32 partials
    [B, S', K * head_splits, ..]); lse2_ref: f32 [B, N, 2, T''], the rows' lse * log2(e) (+inf
    for rows without keys) and bound (`recomputed_probs`); delta_ref: f32 [B, N, T'']. With
    segment ids, refs starts with q_ids_ref [B, T'], kv_ids_ref [B, S'] and plan_ref [B,
    ceil(S / cta_kv_rows), dkv_key_blocks + 1, 4] (`schedule.tile_plan` over="kv"). With
    dropout_rate > 0 the dropout tables follow: drop_rows_ref [B, N, 2, T''] (the query rows'
    row_mul and row_add) and drop_col_ref [B, N, S'' / block_kv_dkv, block_kv_dkv] (the keys'
    col), each step's copied with its Q into the ring (the keys' of the step's head: the CTA's
    blocks). Grid axis "kv_head" c is KV head c // head_splits, query heads [c * group, (c + 1)
    * group), and row c of dk/dv_ref. The CTA
    streams query tiles [first, end): the producer's step s loads query head
    c * group + s // (end - first), query tile first + s % (end - first) into ring slot
    s % num_stages.
    With tiles.fused_dq, refs ends with dq_ref, f32 or int32 ("fixed") [B, N, H, T''] (dQ^T,
    or a slab of them per kv tile, `DQSink`), to which the consumers add each step's K^T
    dS^T in turn.
    """
    dq_ref = refs[-1] if tiles.fused_dq else None
    *id_refs, dk_ref, dv_ref = refs[:-1] if tiles.fused_dq else refs
    drop_col_ref = id_refs.pop() if dropout_rate else None
    drop_rows_ref = id_refs.pop() if dropout_rate else None
    q_ids_ref, kv_ids_ref, plan_ref = id_refs or (None, None, None)
    batch, cta_head, kv_tile = launched_cta(("batch", "kv_head", "kv_tile"), launch_units)
    kv_head = lax.div(cta_head, jnp.int32(head_splits)) if head_splits > 1 else cta_head
    cta_kv_start = kv_tile * tiles.cta_kv_rows
    wg = lax.axis_index("wg")
    # Split consumers both own the CTA's one block of keys.
    block = 0 if tiles.split_dkv else wg
    kv_start = cta_kv_start + block * tiles.block_kv_dkv

    def tile_ranges():
        """(first, end) of the CTA and (lo, full_lo, full_hi, hi) of consumer wg's keys."""
        if plan_ref is None:
            return q_tile_ranges(spec, tiles, cta_kv_start, kv_start)
        # Every thread of the CTA loads the same words: a broadcast from L2.
        cta = tuple(plan_ref[batch, kv_tile, tiles.dkv_key_blocks, i] for i in (0, 3))
        return cta, tuple(plan_ref[batch, kv_tile, block, i] for i in range(4))

    cta_range, _ = tile_ranges()
    ring = _QRing(
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        q_free,
        do_free,
        q_ids_smem,
        drop_rows_smem,
        drop_col_smem,
    )
    common = dict(batch=batch, cta_range=cta_range, group=group)

    n_c = tiles.dkv_consumers

    @pl.when(wg < n_c)
    def _consumer():
        plgpu.set_max_registers(backward_consumer_registers(n_c), action="increase")
        partials = None
        if dk_partial_smem is not None and tiles.split_dkv:
            partials = (dk_partial_smem, dv_partial_smem)
        elif dk_partial_smem is not None:
            dk_partial = dk_partial_smem.at[wg]
            partials = (
                dk_partial,
                dk_partial if dv_partial_smem is None else dv_partial_smem.at[wg],
            )
        dq_sink = None
        if tiles.fused_dq:
            dq_sink = DQSink(
                ds_smem,
                k_smem,
                dq_partial_smem.at[wg],
                dq_ref,
                batch=batch,
                first_head=cta_head * group,
                consumer=wg,
                cta_tiles=cta_range[1] - cta_range[0],
                first=cta_range[0],
                ds_ready=ds_ready,
                ds_read=ds_read,
                slab=kv_tile if tiles.slab_dq else None,
                step_descriptors=tiles.step_descriptors,
            )
        consume = functools.partial(
            _consume_dkv,
            k_ref,
            v_ref,
            kv_ids_ref,
            dk_ref,
            dv_ref,
            k_smem,
            v_smem,
            None if kv_ids_smem is None else kv_ids_smem.at[wg],
            partials,
            kv_loaded.at[wg],
            ring,
            kv_head=kv_head,
            out_head=cta_head,
            kv_start=kv_start,
            ranges=tile_ranges()[1],
            spec=spec,
            qk_scale=qk_scale,
            scale=scale,
            soft_cap=soft_cap,
            tiles=tiles,
            key_block=block,
            dropout_rate=dropout_rate,
            dq_sink=dq_sink,
            **common,
        )
        if not tiles.split_dkv:
            consume()
            return
        # The dK consumer stages dK through K's buffer, which the dV consumer loads.
        handoff = _PHandoff(p_smem, p_ready, p_free, k_loaded=kv_loaded.at[0])
        for role, index in (("dv", 0), ("dk", 1)):
            pl.when(wg == index)(functools.partial(consume, role=role, handoff=handoff))

    @pl.when(wg == n_c)
    def _producer():
        plgpu.set_max_registers(BACKWARD_PRODUCER_REGISTERS, action="decrease")
        _produce_dkv(
            q_ref,
            do_ref,
            lse2_ref,
            delta_ref,
            q_ids_ref,
            ring,
            first_head=cta_head * group,
            tiles=tiles,
            drop_refs=(drop_rows_ref, drop_col_ref) if dropout_rate else None,
            kv_tile=kv_tile,
            **common,
        )


@dataclasses.dataclass(frozen=True)
class _QRing:
    """The Q/dO shared-memory ring of the dK/dV kernel: step s lives in slot s % num_stages.
    q_ready completes when Q and its lse rows (and query ids, and dropout's hashes of the rows
    and of the CTA's keys) have landed, do_ready when dO and its delta rows have; q_free and
    do_free when every consumer is done reading them."""

    q_smem: object
    do_smem: object
    lse_smem: object
    delta_smem: object
    q_ready: object
    do_ready: object
    q_free: object
    do_free: object
    q_ids_smem: object = None
    drop_rows_smem: object = None  # [num_stages, 2, block_q_dkv]: row_mul, row_add
    drop_col_smem: object = None  # [num_stages, dkv_key_blocks, block_kv_dkv]

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.q_smem.shape[0]))


@dataclasses.dataclass(frozen=True)
class _PHandoff:
    """P^T * dcap from the dV consumer to the dK consumer of a split dK/dV CTA (split_dkv), one
    computed step at a time: p_ready completes when a step's tile is in p_smem, p_free when the
    dK consumer has copied it out (once more before its first step, so that the dV consumer
    waits for p_free before every write). k_loaded: the dV consumer's barrier on which K
    lands."""

    p_smem: object
    p_ready: object
    p_free: object
    k_loaded: object


def _produce_dkv(
    q_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    q_ids_ref,
    ring: _QRing,
    *,
    batch,
    first_head,
    cta_range,
    group: int,
    tiles: BackwardTiles,
    drop_refs=None,
    kv_tile=None,
):
    """Producer warpgroup: TMA Q, lse, dO, delta (and the rows' segment ids; with drop_refs,
    the dropout tables' hashes of the rows and of the CTA kv_tile's keys) of every (head,
    query tile) step, in order, over query heads [first_head, first_head + group) (`step_tile`)."""
    block_q, num_stages = tiles.block_q_dkv, tiles.num_stages
    first, end = cta_range
    cta_tiles = end - first

    @pl.loop(0, group * cta_tiles)
    def _step(step):
        slot = ring.slot(step)
        head = first_head + lax.div(step, cta_tiles)
        q_start = step_tile(step, first, cta_tiles) * block_q
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
        lse_rows = lse2_ref.at[batch, head, :, pl.ds(q_start, block_q)]
        plgpu.copy_gmem_to_smem(lse_rows, ring.lse_smem.at[slot], ring.q_ready.at[slot])
        if q_ids_ref is not None:
            ids = q_ids_ref.at[batch, pl.ds(q_start, block_q)]
            plgpu.copy_gmem_to_smem(ids, ring.q_ids_smem.at[slot], ring.q_ready.at[slot])
        if drop_refs is not None:
            rows_ref, col_ref = drop_refs
            key_blocks = tiles.dkv_key_blocks
            hashes = rows_ref.at[batch, head, :, pl.ds(q_start, block_q)]
            plgpu.copy_gmem_to_smem(hashes, ring.drop_rows_smem.at[slot], ring.q_ready.at[slot])
            hashes = col_ref.at[batch, head, pl.ds(kv_tile * key_blocks, key_blocks)]
            plgpu.copy_gmem_to_smem(hashes, ring.drop_col_smem.at[slot], ring.q_ready.at[slot])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _KeySteps:
    """A dK/dV consumer's steps over the query tiles, fixed when its loops are traced: the
    bodies of its loops (`dkdv_step`, `dv_step` and `dk_step` by role, `drain_step`) and what
    they compute from the Q/dO ring's slot of a step.

    k_blocks, v_blocks: the CTA's K and V [key blocks, block_kv_dkv, ..], this consumer's at
    key_block (k_smem, v_smem), whose keys start at kv_start; kv_seg: their segment ids
    [block_kv_dkv] (row layout), None without; first: the CTA's first query tile. handoff
    (split_dkv) carries P^T * dcap from the dV consumer to the dK consumer; dq_sink (role
    "dkdv" only): each computed step also puts dS K, dQ's partial, there."""

    ring: _QRing
    k_blocks: object
    v_blocks: object
    k_smem: object
    v_smem: object
    key_block: object
    kv_start: object
    kv_seg: object
    first: object
    spec: MaskSpec
    tiles: BackwardTiles
    qk_scale: float
    scale: float
    soft_cap: object
    dropout_rate: float
    handoff: _PHandoff | None
    dq_sink: DQSink | None

    @property
    def tile_shape(self) -> tuple[int, int]:
        """S^T and the tiles like it: [block_kv_dkv, block_q_dkv], keys on rows."""
        return (self.tiles.block_kv_dkv, self.tiles.block_q_dkv)

    def kv_at(self, zero):
        """(K, V) of this consumer's keys as a step's wgmmas read them, at key_block + zero
        (`step_zero`)."""
        if not self.tiles.step_descriptors:
            return self.k_smem, self.v_smem
        return self.k_blocks.at[self.key_block + zero], self.v_blocks.at[self.key_block + zero]

    def visible_in(self, i, slot):
        """The mask of query tile i (in ring slot `slot`) over this consumer's keys.

        Keys are rows here, query rows are columns. Rows past T have P = 0, but dS^T = P^T *
        (dP^T - delta) is NaN there when V is at a key that only they see (a hidden key between
        T and the last query tile's end, causal): they are masked in a ragged last tile (with
        segment ids their padding ids do it)."""
        spec, block_q, tile_shape = self.spec, self.tiles.block_q_dkv, self.tile_shape
        q_pos = i * block_q + wgmma_iota(tile_shape, 1)
        kv_pos = self.kv_start + wgmma_iota(tile_shape, 0)
        if self.kv_seg is None:
            visible = masks.visible(spec, q_pos, kv_pos)
            if spec.q_len % block_q:
                visible = visible & (q_pos < spec.q_len)
            return visible
        # The query tile's ids ride in Q's slot: read before the slot is released.
        q_seg = plgpu.load(self.ring.q_ids_smem.at[slot], layout=_COL_LAYOUT)
        return masks.visible(
            spec, q_pos, kv_pos, per_col(q_seg, tile_shape), per_row(self.kv_seg, tile_shape)
        )

    def keep_t(self, slot):
        """(keep^T, the keys' hashes) of the step in ring slot `slot`. The step's hashes share
        Q's slot: read before it is released (probs_t and dk_update each read them: the mask
        is not held across the wgmma between them)."""
        ring = self.ring
        q_hashes = [plgpu.load(ring.drop_rows_smem.at[slot, j], layout=_COL_LAYOUT) for j in (0, 1)]
        kv_hashes = plgpu.load(ring.drop_col_smem.at[slot, self.key_block], layout=_ROW_LAYOUT)
        keep = tile_keep(q_hashes, kv_hashes, self.tile_shape, rate=self.dropout_rate, q_axis=1)
        return keep, kv_hashes

    def probs_t(self, i, slot, step, zero, *, masked: bool):
        """(P^T, P^T * dcap) of query tile i, whose Q and lse are in ring slot `slot`.

        With dropout P^T * keep^T: dV takes it, scaled by 1 / (1 - rate) once in the epilogue;
        dS^T computes the mask again (`ds_of`).

        step: the CTA step, zero its `step_zero`; with dq_sink, S^T's wait also takes this
        consumer's dQ partial of the step before (`DQSink.with_st`)."""
        ring, tile_shape, soft_cap = self.ring, self.tile_shape, self.soft_cap

        # -- S^T = K Q^T [block_kv, block_q]: keys on rows, so P^T and dS^T are A operands --
        def st_issue(acc_ref):
            plgpu.wgmma(acc_ref, self.kv_at(zero)[0], ring.q_smem.at[slot].T)

        def st_into(acc_ref):
            st_issue(acc_ref)
            return acc_ref[...]

        if self.dq_sink is not None:
            s_t = self.dq_sink.with_st(st_issue, tile_shape, step, zero)
        else:
            s_t = pl.run_scoped(st_into, plgpu.ACC(tile_shape, jnp.float32))
        lse2, bound = (plgpu.load(ring.lse_smem.at[slot, j], layout=_COL_LAYOUT) for j in (0, 1))
        # pd_t = P^T * dcap replaces P^T in f32 once p_in is taken: a soft cap costs no tile.
        p_t, pd_t = recomputed_probs(
            s_t, lse2, bound, per_col, qk_scale=self.qk_scale, scale=self.scale, soft_cap=soft_cap
        )
        if masked:
            # A select, not a product: NaN in K at a hidden key is in S^T.
            visible = self.visible_in(i, slot)
            p_t = jnp.where(visible, p_t, 0.0)
            pd_t = p_t if soft_cap is None else jnp.where(visible, pd_t, 0.0)
        if self.dropout_rate:
            keep, kv_hashes = self.keep_t(slot)
            p_t = jnp.where(keep, p_t, per_row(dropped_value(kv_hashes), tile_shape))
        return p_t, pd_t

    def ds_of(self, pd_t, dp_t, delta, slot):
        """dS^T = P^T * dcap * (Z^T * dP^T - delta), Z = keep / (1 - rate) with dropout: there
        it is returned over 1 / (1 - rate), P^T * dcap * (keep^T * dP^T - delta * (1 - rate)),
        and dK's epilogue multiplies it back (`_consume_dkv`'s dk_scale)."""
        if not self.dropout_rate:
            return pd_t * (dp_t - per_col(delta, self.tile_shape))
        keep, _ = self.keep_t(slot)
        delta = per_col(delta * (1.0 - self.dropout_rate), self.tile_shape)
        return pd_t * (jnp.where(keep, dp_t, 0.0) - delta)

    def dk_update(self, dk, pd_t, dp_t, delta, slot, step, *, masked: bool):
        """dK += dS^T Q of the step in ring slot `slot` (scaled once in the epilogue), with
        dS^T = P^T * dcap * (dP^T - delta); frees Q's slot. With dq_sink, dS^T goes there
        first."""
        ring, dq_sink = self.ring, self.dq_sink
        dtype = self.k_smem.dtype
        ds_t = self.ds_of(pd_t, dp_t, delta, slot)
        if masked:
            # NaN in V at a hidden key is in dP^T, and 0 * NaN is NaN. probs_t zeroed pd_t
            # wherever the mask hides a pair, so the select reads pd_t instead of the mask:
            # the mask held across the dV and dP^T wgmma (or its positions recomputed) spilled
            # registers at H=128 (a visible pair whose P underflows to 0 gets dS^T = 0, as it
            # would from finite inputs).
            ds_t = jnp.where(pd_t == 0.0, 0.0, ds_t)
        ds_in = ds_t.astype(dtype)
        if dq_sink is not None:
            ds_dq = ds_in
            if self.tiles.fixed_point_dq:
                # Each query row's (column's) 2^e, exact in 16 bits (`fixed_point`'s scales).
                row_scale = plgpu.load(ring.lse_smem.at[slot, 2], layout=_COL_LAYOUT)
                ds_dq = ds_in * per_col(row_scale.astype(dtype), self.tile_shape)
            # Stored before dK's wgmma: the other consumer may read it too.
            dq_sink.put(ds_dq, step)

        def dk_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, ring.q_smem.at[slot])

        dk = pl.run_state(dk_into)(plgpu.ACC.init(dk))
        plgpu.barrier_arrive(ring.q_free.at[slot])
        return dk

    def dkdv_step(self, i, carry, *, base, masked: bool):
        """Query tile i, at CTA step base + i - first, of a consumer that keeps dK and dV."""
        ring = self.ring
        dk, dv = carry
        step = base + i - self.first
        slot = ring.slot(step)
        zero = step_zero(step, self.tiles.step_descriptors)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        p_t, pd_t = self.probs_t(i, slot, step, zero, masked=masked)

        # -- dV += P^T dO and dP^T = V dO^T, issued together: one wgmma wait for both --
        plgpu.barrier_wait(ring.do_ready.at[slot])
        p_in = p_t.astype(self.k_smem.dtype)

        def dv_dpt_into(refs):
            dv_ref, dpt_ref = refs
            plgpu.wgmma(dv_ref, p_in, ring.do_smem.at[slot])
            plgpu.wgmma(dpt_ref, self.kv_at(zero)[1], ring.do_smem.at[slot].T)

        dv, dp_t = pl.run_state(dv_dpt_into)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(wgmma_zeros(self.tile_shape)))
        )
        delta = plgpu.load(ring.delta_smem.at[slot], layout=_COL_LAYOUT)
        plgpu.barrier_arrive(ring.do_free.at[slot])
        return self.dk_update(dk, pd_t, dp_t, delta, slot, step, masked=masked), dv

    def dv_step(self, i, carry, *, base, masked: bool):
        """Query tile i of the split dV consumer: P^T, handed over to the dK consumer."""
        ring, handoff = self.ring, self.handoff
        (dv,) = carry
        step = base + i - self.first
        slot = ring.slot(step)
        zero = step_zero(step, self.tiles.step_descriptors)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        p_t, pd_t = self.probs_t(i, slot, step, zero, masked=masked)
        # Q's (and the query ids' and hashes') last reader in this consumer was S^T (and the
        # masks): free them for the producer before dV's wgmma.
        plgpu.barrier_arrive(ring.q_free.at[slot])
        # The buffer holds the previous step's tile until the dK consumer has copied it out.
        plgpu.barrier_wait(handoff.p_free)
        handoff.p_smem[...] = pd_t
        plgpu.barrier_arrive(handoff.p_ready)
        plgpu.barrier_wait(ring.do_ready.at[slot])
        p_in = p_t.astype(self.k_smem.dtype)

        def dv_into(acc_ref):
            plgpu.wgmma(acc_ref, p_in, ring.do_smem.at[slot])

        dv = pl.run_state(dv_into)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(ring.do_free.at[slot])
        return (dv,)

    def dk_step(self, i, carry, *, base, masked: bool):
        """Query tile i of the split dK consumer: dP^T, and P^T from the dV consumer."""
        ring, handoff = self.ring, self.handoff
        (dk,) = carry
        step = base + i - self.first
        slot = ring.slot(step)
        zero = step_zero(step, self.tiles.step_descriptors)
        plgpu.barrier_wait(ring.do_ready.at[slot])

        # -- dP^T = V dO^T; it runs beside the dV consumer's S^T --
        def dpt_into(acc_ref):
            plgpu.wgmma(acc_ref, self.kv_at(zero)[1], ring.do_smem.at[slot].T)
            return acc_ref[...]

        dp_t = pl.run_scoped(dpt_into, plgpu.ACC(self.tile_shape, jnp.float32))
        delta = plgpu.load(ring.delta_smem.at[slot], layout=_COL_LAYOUT)
        plgpu.barrier_arrive(ring.do_free.at[slot])
        plgpu.barrier_wait(handoff.p_ready)
        pd_t = plgpu.load(handoff.p_smem, layout=plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(handoff.p_free)
        # Q (and the query ids the mask reads) after the handoff: the dV consumer's S^T needed
        # it first.
        plgpu.barrier_wait(ring.q_ready.at[slot])
        return (self.dk_update(dk, pd_t, dp_t, delta, slot, step, masked=masked),)

    def drain_step(self, i, carry, *, base):
        """A CTA step outside this consumer's range: waited for (each barrier's phase is
        tracked per thread and flips on every wait) and freed unread, so that the ring moves on
        for the other consumer. With dq_sink its dS^T is 0, and this consumer's partial of the
        step before (if it has one) is computed on its own."""
        ring = self.ring
        step = base + i - self.first
        slot = ring.slot(step)
        plgpu.barrier_wait(ring.q_ready.at[slot])
        plgpu.barrier_wait(ring.do_ready.at[slot])
        plgpu.barrier_arrive(ring.do_free.at[slot])
        plgpu.barrier_arrive(ring.q_free.at[slot])
        if self.dq_sink is not None:
            self.dq_sink.drained(step)
            self.dq_sink.put(None, step)
        return carry


def _walk_heads(q_step, drain_step, carry, *, group: int, cta_range, cta_tiles, ranges, sides):
    """A dK/dV consumer's loops: over the `group` query heads, each head's CTA steps in the
    producer's order (cta_range = (first, end), cta_tiles of them), q_step(i, carry, base=,
    masked=) on the tiles of its own range (lo, full_lo, full_hi, hi), masked outside
    [full_lo, full_hi), and drain_step on the others. sides: `dkv_mask_sides`; without a side
    its loops are empty: not emitted."""
    first, end = cta_range
    lo, full_lo, full_hi, hi = ranges
    before, after = sides

    def head_loop(h, carry):
        base = h * cta_tiles  # the producer's step of this head's tile `first`
        masked_step = functools.partial(q_step, base=base, masked=True)
        drain = functools.partial(drain_step, base=base)
        if before:
            lax.fori_loop(first, lo, drain, None)
            carry = lax.fori_loop(lo, full_lo, masked_step, carry)
        carry = lax.fori_loop(
            full_lo, full_hi, functools.partial(q_step, base=base, masked=False), carry
        )
        if after:
            carry = lax.fori_loop(full_hi, hi, masked_step, carry)
            lax.fori_loop(hi, end, drain, None)
        return carry

    return lax.fori_loop(0, group, head_loop, carry)


def _consume_dkv(
    k_ref,
    v_ref,
    kv_ids_ref,
    dk_ref,
    dv_ref,
    k_blocks,
    v_blocks,
    kv_ids_smem,
    partials,
    kv_loaded,
    ring: _QRing,
    *,
    batch,
    kv_head,
    out_head,
    kv_start,
    cta_range,
    ranges,
    group: int,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    tiles: BackwardTiles,
    role: str = "dkdv",
    handoff: _PHandoff | None = None,
    key_block=0,
    dropout_rate: float = 0.0,
    dq_sink: DQSink | None = None,
):
    """Consumer warpgroup: dK, dV of block_kv_dkv keys over every query head of the group and
    every query tile that sees them. Per head it walks every CTA step of cta_range = (first,
    end): it computes the tiles of its own range (lo, full_lo, full_hi, hi), masking element-wise
    those outside [full_lo, full_hi), and drains the others (`_walk_heads`, the steps'
    bodies in `_KeySteps`).

    role (split_dkv): "dv" computes P^T (and P^T * dcap), hands P^T * dcap over and keeps dV;
    "dk" takes it, computes dP^T and dS^T and keeps dK. Both own the CTA's keys: one range, so
    they compute and drain the same steps.

    K and V come from KV head kv_head; dK and dV go to head out_head of dk_ref and dv_ref, as
    f32 partials through partials = (dK's staging tile, dV's) when it is given (head
    splits), else through the dead K and V buffers.

    key_block: the consumer's block of the CTA's keys: its K and V in k_blocks and v_blocks
    [key blocks, block_kv_dkv, ..], its slice of the ring's key hashes.
    dropout_rate > 0: dV = (P^T * Z^T) dO, dS^T = P^T * dcap * (Z^T * dP^T - delta) with
    Z = keep / (1 - rate) (see `_KeySteps.probs_t`).
    dq_sink (role "dkdv" only): each computed step also puts dS K, dQ's partial, there."""
    block_kv = tiles.block_kv_dkv
    k_smem, v_smem = k_blocks.at[key_block], v_blocks.at[key_block]
    head_dim, value_head_dim, dtype = k_smem.shape[-1], v_smem.shape[-1], k_smem.dtype
    first, end = cta_range
    cta_tiles = end - first
    kv_rows = (batch, pl.ds(kv_start, block_kv), kv_head)
    out_rows = (batch, pl.ds(kv_start, block_kv), out_head)
    if role != "dk":
        plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, kv_loaded)
    if role != "dv":
        plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, kv_loaded)
    if kv_ids_ref is not None:
        ids = kv_ids_ref.at[batch, pl.ds(kv_start, block_kv)]
        plgpu.copy_gmem_to_smem(ids, kv_ids_smem, kv_loaded)
    keep_scale = 1.0 / (1.0 - dropout_rate) if dropout_rate else 1.0
    # dK's factor, applied once in the epilogue: the softmax scale, and with dropout the keep
    # scale that `_KeySteps.ds_of` leaves out of dS^T (one multiply per element fewer).
    dk_scale = scale * keep_scale
    dk_zeros, dv_zeros = (
        wgmma_zeros((block_kv, head_dim)),
        wgmma_zeros((block_kv, value_head_dim)),
    )
    plgpu.barrier_wait(kv_loaded)
    if dq_sink is not None and spec.has_key_ranges:
        # dQ's partials multiply a hidden key's zero dS by its K (see
        # `backward.flash_backward`): this consumer's keys are cleaned once, before its
        # partner's first partial reads them (after this consumer's first dS^T, `DQSink`).
        zero_non_finite(k_smem)
    # The keys' segment ids [block_kv] (row layout), which the steps' masks read.
    kv_seg = None
    if kv_ids_smem is not None:
        kv_seg = plgpu.load(kv_ids_smem, layout=_ROW_LAYOUT)
    steps = _KeySteps(
        ring=ring,
        k_blocks=k_blocks,
        v_blocks=v_blocks,
        k_smem=k_smem,
        v_smem=v_smem,
        key_block=key_block,
        kv_start=kv_start,
        kv_seg=kv_seg,
        first=first,
        spec=spec,
        tiles=tiles,
        qk_scale=qk_scale,
        scale=scale,
        soft_cap=soft_cap,
        dropout_rate=dropout_rate,
        handoff=handoff,
        dq_sink=dq_sink,
    )
    q_step = {"dkdv": steps.dkdv_step, "dv": steps.dv_step, "dk": steps.dk_step}[role]
    walk_heads = functools.partial(
        _walk_heads,
        q_step,
        steps.drain_step,
        group=group,
        cta_range=cta_range,
        cta_tiles=cta_tiles,
        ranges=ranges,
        sides=dkv_mask_sides(spec, tiles),
    )
    # Each split consumer stages its result through a dead buffer of its accumulator's width.
    # At H == Hv that is the buffer it loaded and read itself (dV through K's, dK through V's):
    # no wait on the other consumer. At H != Hv the widths cross (dV through V's, dK through
    # K's), so each waits until the other consumer's last read of that buffer is done.
    crossed = partials is None and value_head_dim != head_dim
    if role == "dv":
        (dv,) = walk_heads((dv_zeros,))
        if crossed:
            # The dK consumer has copied out the last P^T: after its last dP^T, V's last
            # reader (and after V landed: it arrives on p_free first once V has).
            plgpu.barrier_wait(handoff.p_free)
        staging = partials[1] if partials is not None else (v_smem if crossed else k_smem)
        _store_rows(staging, times(dv, keep_scale), dv_ref.at[out_rows])
        return
    if role == "dk":
        # The buffer starts empty: the dV consumer's first wait on p_free passes.
        plgpu.barrier_arrive(handoff.p_free)
        (dk,) = walk_heads((dk_zeros,))
        if crossed:
            # K's last reader, the dV consumer's last S^T, came before the last P^T this
            # consumer took; wait for K to have landed too, for a CTA whose keys no row sees
            # (no P^T at all).
            plgpu.barrier_wait(handoff.k_loaded)
        staging = partials[0] if partials is not None else (k_smem if crossed else v_smem)
        _store_rows(staging, dk * dk_scale, dk_ref.at[out_rows])
        return
    if dq_sink is not None:
        dq_sink.start()
    dk, dv = walk_heads((dk_zeros, dv_zeros))
    if dq_sink is not None:
        dq_sink.finish(group * cta_tiles)
    if partials is not None:
        # -- epilogue: the f32 partials one after the other through the staging tiles --
        _store_rows(partials[0], dk * dk_scale, dk_ref.at[out_rows])
        _store_rows(partials[1], times(dv, keep_scale), dv_ref.at[out_rows])
        return

    # -- epilogue: K and V are dead (their last readers, this consumer's wgmmas, are done) --
    k_smem[...] = (dk * dk_scale).astype(dtype)
    v_smem[...] = times(dv, keep_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_rows])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_rows])
    plgpu.wait_smem_to_gmem(0)


def _store_rows(smem, value, gmem):
    """value in smem's dtype through smem (dead by now, or a staging tile) to gmem by TMA."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)
