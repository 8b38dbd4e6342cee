"""The Mosaic GPU backward's dQ kernel (`dq_call`), FA2 Algorithm 2's dQ as a kernel of its own
(no atomics: each CTA writes its rows of dQ once).

A CTA owns `num_consumers * block_q_dq` query rows of one head. Each consumer keeps Q, dO in
shared memory and dQ in f32 registers; the producer streams K, V tiles through a TMA ring (and
with `BackwardTiles.producer_cleans_k` zeroes NaN and inf in the K tiles a consumer masks,
`_load_clean_k`).
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
from pallas_flash.mosaic._kernel_common import (
    clip,
    per_col,
    per_row,
    recomputed_probs,
    tile_keep,
    tile_smem,
    wgmma_iota,
    wgmma_zeros,
)
from pallas_flash.mosaic.backward_tiles import (
    BACKWARD_PRODUCER_REGISTERS,
    BackwardTiles,
    backward_consumer_registers,
)
from pallas_flash.mosaic.launch import (
    warp_specialised_kernel,
    zero_non_finite,
)
from pallas_flash.mosaic.schedule import launch_group, launched_cta
from pallas_flash.mosaic.tiles import cdiv


def kv_tile_ranges(spec: MaskSpec, tiles: BackwardTiles, cta_q_start, q_start):
    """((first, end), (lo, full_lo, full_hi, hi)) from the geometry: the KV tiles (of
    block_kv_dq keys) that the dQ CTA whose rows start at cta_q_start streams, and
    `MaskSpec.kv_tile_range` of a consumer's rows from q_start, clamped into them."""
    block_kv = tiles.block_kv_dq
    first, _, _, end = spec.kv_tile_range(cta_q_start, tiles.cta_q_rows, block_kv)
    ranges = spec.kv_tile_range(q_start, tiles.block_q_dq, block_kv)
    return (first, end), tuple(clip(x, first, end) for x in ranges)


def dq_mask_sides(spec: MaskSpec, tiles: BackwardTiles) -> tuple[bool, bool]:
    """(before, after): whether a dQ consumer's range may hold masked KV tiles before its whole
    ones (the window's left side hides keys from some row i < R, R = T rounded up to the CTAs,
    unless left >= R - 1) and after them (causal or the window's right side, unless right >=
    S - 1; a ragged last KV tile, whose keys past S are masked). With segment ids any tile may
    need the mask."""
    if spec.has_segments:
        return True, True
    rows = cdiv(spec.q_len, tiles.cta_q_rows) * tiles.cta_q_rows
    ragged_kv = spec.kv_len % tiles.block_kv_dq != 0
    return spec.left < rows - 1, spec.right < spec.kv_len - 1 or ragged_kv


def dq_call(
    q, k, v, d_out, lse2, delta, ids, drop, *, spec: MaskSpec, scale: float, soft_cap, tiles
):
    """ids: None, or (q_segment_ids [B, T'], kv_segment_ids [B, S'], the dQ tile plan); drop:
    None, or (rate, the rows' hashes [B, N, 2, T''], the keys' [B, N, S'']), the dropout
    tables."""
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, value_head_dim = k.shape[2], v.shape[3]
    n_c, n_s, block_q = tiles.num_consumers, tiles.num_stages, tiles.block_q_dq
    has_ids = ids is not None
    has_drop = drop is not None
    num_q_tiles = cdiv(spec.q_len, tiles.cta_q_rows)
    group = num_heads // num_kv_heads
    # A CTA streams its KV head's K and V, which the group's query heads share.
    unit_bytes = spec.kv_len * (head_dim + value_head_dim) * q.dtype.itemsize // group
    kernel = functools.partial(
        _dq_kernel,
        spec=spec,
        qk_scale=scale * LOG2E,
        scale=scale,
        soft_cap=soft_cap,
        group=group,
        num_q_tiles=num_q_tiles,
        tiles=tiles,
        dropout_rate=drop[0] if has_drop else 0.0,
        launch_units=launch_group(
            batch * num_heads, unit_bytes, is_causal=spec.is_causal and tiles.grouped_launch
        ),
    )
    scratch = dict(
        q_smem=tile_smem((n_c, block_q, head_dim), q.dtype),
        do_smem=tile_smem((n_c, block_q, value_head_dim), q.dtype),
        lse_smem=plgpu.SMEM((n_c, 2, block_q), jnp.float32),  # lse2 and bound rows
        delta_smem=plgpu.SMEM((n_c, block_q), jnp.float32),
        k_smem=tile_smem((n_s, tiles.block_kv_dq, head_dim), q.dtype),
        v_smem=tile_smem((n_s, tiles.block_kv_dq, value_head_dim), q.dtype),
        # Four TMA copies arrive on it: Q, dO, lse rows, delta rows (and the rows' segment ids,
        # and dropout's hashes of the rows).
        q_loaded=plgpu.Barrier(num_arrivals=4 + has_ids + has_drop, num_barriers=n_c),
        # With segment ids a KV tile's ids ride in K's ring slot, and with dropout its keys'
        # hashes: a copy each.
        k_ready=plgpu.Barrier(num_arrivals=1 + has_ids + has_drop, num_barriers=n_s),
        v_ready=plgpu.Barrier(num_barriers=n_s),
        k_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
        v_free=plgpu.Barrier(num_arrivals=n_c, num_barriers=n_s),
    )
    if has_ids:
        scratch.update(
            q_ids_smem=plgpu.SMEM((n_c, block_q), jnp.int32),
            kv_ids_smem=plgpu.SMEM((n_s, tiles.block_kv_dq), jnp.int32),
        )
    if has_drop:
        scratch.update(
            drop_rows_smem=plgpu.SMEM((n_c, 2, block_q), jnp.int32),
            drop_col_smem=plgpu.SMEM((n_s, tiles.block_kv_dq), jnp.int32),
        )
    if tiles.producer_cleans_k and spec.has_key_ranges:
        # A K tile that the producer cleans lands on this barrier, not on k_ready, which the
        # producer arrives on in the copy's place once the tile is clean.
        scratch.update(k_landed=plgpu.Barrier(num_barriers=n_s))
    return warp_specialised_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch,
        grid=(batch, num_heads, num_q_tiles),
        grid_names=("batch", "head", "q_tile"),
        num_consumers=n_c,
    )(q, k, v, d_out, lse2, delta, *(ids or ()), *(drop[1:] if has_drop else ()))


def _masked_by_any(ranges, tile):
    """Whether KV tile `tile` is masked for some consumer, of ranges (every consumer's (lo,
    full_lo, full_hi, hi))."""
    masked = False
    for lo, full_lo, full_hi, hi in ranges:
        masked = masked | ((lo <= tile) & (tile < full_lo)) | ((full_hi <= tile) & (tile < hi))
    return masked


def _load_clean_k(k_tile, k_slot, k_ready, k_landed, *, masked):
    """The dQ kernel's producer (`BackwardTiles.producer_cleans_k`): K of a tile into k_slot,
    arriving on k_ready; where a consumer masks the tile (`masked`), NaN and inf in it become 0
    first (dQ += dS K multiplies a hidden key's zero dS by its K): the copy lands on k_landed,
    the producer cleans the slot and arrives on k_ready in the copy's place. The consumers wait
    on k_ready alone, whichever way the tile came."""

    @pl.when(masked)
    def _():
        plgpu.copy_gmem_to_smem(k_tile, k_slot, k_landed)
        plgpu.barrier_wait(k_landed)
        # In 64 x 64 pieces (Mosaic GPU's layouts take no smaller slice of a swizzled tile): 32
        # elements a thread, over the producer's 24 registers; ptxas may spill them here
        # (`benchmarks/kernel_resources.py` would say).
        zero_non_finite(k_slot)
        plgpu.barrier_arrive(k_ready)

    pl.when(jnp.logical_not(masked))(lambda: plgpu.copy_gmem_to_smem(k_tile, k_slot, k_ready))


@dataclasses.dataclass(frozen=True)
class _KVRing:
    """The K/V shared-memory ring of the dQ kernel: KV tile `first + s` lives in slot
    s % num_stages. *_ready complete when TMA has landed a tile (K's with its segment ids and
    dropout's key hashes), *_free when every consumer is done reading it."""

    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    first: object  # the CTA's first KV tile
    kv_ids_smem: object = None
    drop_col_smem: object = None

    def slot(self, tile):
        return lax.rem(tile - self.first, jnp.int32(self.k_smem.shape[0]))


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    *refs,
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
    q_ids_smem=None,
    kv_ids_smem=None,
    drop_rows_smem=None,
    drop_col_smem=None,
    k_landed=None,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    group: int,
    num_q_tiles: int,
    tiles: BackwardTiles,
    dropout_rate: float = 0.0,
    launch_units: int = 1,
):
    """One CTA: num_consumers * block_q_dq query rows of one head against its keys (FA2
    Algorithm 2's dQ, as its own kernel: no atomics). The grid position (batch, head,
    q_tile) maps to the CTA's by `schedule.grouped_launch` over launch_units (batch, head)
    pairs at a time. The CTA streams KV tiles [first, end),
    tile first + s into ring slot s % num_stages. With segment ids, refs starts with q_ids_ref
    [B, T'], kv_ids_ref [B, S'] and plan_ref [B, ceil(T / cta_q_rows), num_consumers + 1, 4]
    (`schedule.tile_plan` over="q"). With dropout_rate > 0 the dropout tables follow:
    drop_rows_ref [B, N, 2, T''] (each consumer's rows' copied with its Q) and drop_col_ref
    [B, N, S''] (a KV tile's copied with its K)."""
    *id_refs, dq_ref = refs
    drop_col_ref = id_refs.pop() if dropout_rate else None
    drop_rows_ref = id_refs.pop() if dropout_rate else None
    q_ids_ref, kv_ids_ref, plan_ref = id_refs or (None, None, None)
    batch, head, q_tile = launched_cta(("batch", "head", "q_tile"), launch_units)
    if spec.is_causal:
        # The last query tiles see the most keys: launch them first (as in the forward).
        q_tile = num_q_tiles - 1 - q_tile
    cta_q_start = q_tile * tiles.cta_q_rows
    block_kv = tiles.block_kv_dq
    wg = lax.axis_index("wg")
    q_start = cta_q_start + wg * tiles.block_q_dq

    def tile_ranges(consumer=wg):
        """(first, end) of the CTA and (lo, full_lo, full_hi, hi) of a consumer (wg's)."""
        if plan_ref is None:
            consumer_start = cta_q_start + consumer * tiles.block_q_dq
            return kv_tile_ranges(spec, tiles, cta_q_start, consumer_start)
        # Every thread of the CTA loads the same words: a broadcast from L2.
        cta = tuple(plan_ref[batch, q_tile, tiles.num_consumers, i] for i in (0, 3))
        return cta, tuple(plan_ref[batch, q_tile, consumer, i] for i in range(4))

    cta_range, _ = tile_ranges()
    first, end = cta_range
    ring = _KVRing(
        k_smem, v_smem, k_ready, v_ready, k_free, v_free, first, kv_ids_smem, drop_col_smem
    )

    @pl.when(wg < tiles.num_consumers)
    def _consumer():
        plgpu.set_max_registers(backward_consumer_registers(tiles.num_consumers), action="increase")
        q_rows = (batch, pl.ds(q_start, tiles.block_q_dq), head)
        vector = (batch, head, pl.ds(q_start, tiles.block_q_dq))
        q_smem_c, do_smem_c = q_smem.at[wg], do_smem.at[wg]
        lse_smem_c, delta_smem_c = lse_smem.at[wg], delta_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem_c, q_loaded.at[wg])
        lse_rows = lse2_ref.at[batch, head, :, pl.ds(q_start, tiles.block_q_dq)]
        plgpu.copy_gmem_to_smem(lse_rows, lse_smem_c, q_loaded.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem_c, q_loaded.at[wg])
        q_ids_smem_c = None
        if q_ids_ref is not None:
            q_ids_smem_c = q_ids_smem.at[wg]
            ids = q_ids_ref.at[batch, pl.ds(q_start, tiles.block_q_dq)]
            plgpu.copy_gmem_to_smem(ids, q_ids_smem_c, q_loaded.at[wg])
        drop_rows_smem_c = None
        if drop_rows_ref is not None:
            drop_rows_smem_c = drop_rows_smem.at[wg]
            hashes = drop_rows_ref.at[batch, head, :, pl.ds(q_start, tiles.block_q_dq)]
            plgpu.copy_gmem_to_smem(hashes, drop_rows_smem_c, q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])
        dq = _consume_dq(
            q_smem_c,
            do_smem_c,
            lse_smem_c,
            delta_smem_c,
            q_ids_smem_c,
            ring,
            q_start=q_start,
            cta_range=cta_range,
            ranges=tile_ranges()[1],
            spec=spec,
            qk_scale=qk_scale,
            scale=scale,
            soft_cap=soft_cap,
            tiles=tiles,
            drop_rows_smem=drop_rows_smem_c,
            dropout_rate=dropout_rate,
        )
        # -- epilogue: Q is dead (its last reader, the final S = Q K^T, is done) --
        q_smem_c[...] = (dq * scale).astype(q_smem_c.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem_c, dq_ref.at[q_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == tiles.num_consumers)
    def _producer():
        plgpu.set_max_registers(BACKWARD_PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))
        consumer_ranges = None
        if k_landed is not None:
            consumer_ranges = [tile_ranges(c)[1] for c in range(tiles.num_consumers)]

        @pl.loop(first, end)
        def _step(tile):
            slot = ring.slot(tile)
            refill = tile - first >= tiles.num_stages
            rows = (batch, pl.ds(tile * block_kv, block_kv), kv_head)
            # K and V are freed separately and V first: dP = dO V^T is done before dQ += dS K,
            # so V is waited for and loaded first, K after.
            pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])
            pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            # The tile's key ids and hashes first: a K tile that the producer cleans holds it
            # up until it has landed.
            if kv_ids_ref is not None:
                ids = kv_ids_ref.at[batch, pl.ds(tile * block_kv, block_kv)]
                plgpu.copy_gmem_to_smem(ids, kv_ids_smem.at[slot], k_ready.at[slot])
            if drop_col_ref is not None:  # the query head's key hashes
                hashes = drop_col_ref.at[batch, head, pl.ds(tile * block_kv, block_kv)]
                plgpu.copy_gmem_to_smem(hashes, drop_col_smem.at[slot], k_ready.at[slot])
            if consumer_ranges is None:
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            else:
                _load_clean_k(
                    k_ref.at[rows],
                    k_smem.at[slot],
                    k_ready.at[slot],
                    k_landed.at[slot],
                    masked=_masked_by_any(consumer_ranges, tile),
                )


def _consume_dq(
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    q_ids_smem,
    ring: _KVRing,
    *,
    q_start,
    cta_range,
    ranges,
    spec: MaskSpec,
    qk_scale: float,
    scale: float,
    soft_cap,
    tiles: BackwardTiles,
    drop_rows_smem=None,
    dropout_rate: float = 0.0,
):
    """Consumer warpgroup: dQ / scale of block_q_dq query rows. It walks every CTA step of
    cta_range = (first, end): it computes the tiles of its own range (lo, full_lo, full_hi, hi),
    masking element-wise those outside [full_lo, full_hi), and drains the others (waits for
    them and frees them unread, so that the other consumer's tiles can land in their slots).

    drop_rows_smem: None, or the SMEM [2, block_q_dq] of the rows' dropout hashes (loaded);
    with dropout_rate > 0, dS = P * dcap * (Z * dP - delta), Z from the rows' and the KV
    tile's hashes."""
    block_q, block_kv = tiles.block_q_dq, tiles.block_kv_dq
    head_dim, dtype = q_smem.shape[-1], q_smem.dtype
    tile_shape = (block_q, block_kv)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    lse2, bound = (plgpu.load(lse_smem.at[j], layout=row_layout) for j in (0, 1))
    delta = plgpu.load(delta_smem, layout=row_layout)
    q_seg = None if q_ids_smem is None else plgpu.load(q_ids_smem, layout=row_layout)
    drop_rows = None
    if drop_rows_smem is not None:
        drop_rows = [plgpu.load(drop_rows_smem.at[j], layout=row_layout) for j in (0, 1)]
    first, end = cta_range
    lo, full_lo, full_hi, hi = ranges
    before, after = dq_mask_sides(spec, tiles)

    def visible_in(tile, slot):
        q_pos = q_start + wgmma_iota(tile_shape, 0)
        kv_pos = tile * block_kv + wgmma_iota(tile_shape, 1)
        if q_seg is None:
            return masks.visible(spec, q_pos, kv_pos)
        # The KV tile's ids ride in K's slot, released after dQ += dS K.
        kv_seg = plgpu.load(ring.kv_ids_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        return masks.visible(
            spec, q_pos, kv_pos, per_row(q_seg, tile_shape), per_col(kv_seg, tile_shape)
        )

    def kv_step(tile, dq, *, masked: bool):
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_wait(ring.v_ready.at[slot])

        # -- S = Q K^T and dP = dO V^T, issued together: one wgmma wait for both --
        def s_dp_into(s_ref, dp_ref):
            plgpu.wgmma(s_ref, q_smem, ring.k_smem.at[slot].T)
            plgpu.wgmma(dp_ref, do_smem, ring.v_smem.at[slot].T)
            return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(
            s_dp_into,
            plgpu.ACC(tile_shape, jnp.float32),
            plgpu.ACC(tile_shape, jnp.float32),
        )
        plgpu.barrier_arrive(ring.v_free.at[slot])
        # dS = P * dcap * (dP - delta): only P * dcap is needed here.
        _, pd = recomputed_probs(
            s, lse2, bound, per_row, qk_scale=qk_scale, scale=scale, soft_cap=soft_cap
        )
        delta_t = per_row(delta, tile_shape)
        if drop_rows is None:
            ds = pd * (dp - delta_t)
        else:
            # O = (P * Z) V: dS = P * dcap * (Z * dP - delta). The KV tile's hashes ride in K's
            # slot, released after dQ += dS K.
            kv_hashes = plgpu.load(ring.drop_col_smem.at[slot], layout=col_layout)
            keep = tile_keep(drop_rows, kv_hashes, tile_shape, rate=dropout_rate, q_axis=0)
            ds = pd * jnp.where(keep, dp * (1.0 / (1.0 - dropout_rate)) - delta_t, -delta_t)
        if masked:
            # Select dS, not P: NaN in V at a key a row cannot see is in dP, and 0 * NaN is NaN.
            ds = jnp.where(visible_in(tile, slot), ds, 0.0)
        ds_in = ds.astype(dtype)

        # -- dQ += dS K --
        def dq_into(acc_ref):
            plgpu.wgmma(acc_ref, ds_in, ring.k_smem.at[slot])

        dq = pl.run_state(dq_into)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(ring.k_free.at[slot])
        return dq

    def drain_step(tile, carry):
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_arrive(ring.v_free.at[slot])
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_arrive(ring.k_free.at[slot])
        return carry

    masked_step = functools.partial(kv_step, masked=True)
    dq = wgmma_zeros((block_q, head_dim))
    # In the producer's order. Without a side its loops are empty: not emitted.
    if before:
        lax.fori_loop(first, lo, drain_step, None)
        dq = lax.fori_loop(lo, full_lo, masked_step, dq)
    dq = lax.fori_loop(full_lo, full_hi, functools.partial(kv_step, masked=False), dq)
    if after:
        dq = lax.fori_loop(full_hi, hi, masked_step, dq)
        lax.fori_loop(hi, end, drain_step, None)
    return dq
