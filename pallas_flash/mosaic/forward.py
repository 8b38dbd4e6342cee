"""FlashAttention forward for Hopper as a warp-specialised Pallas Mosaic GPU kernel.

FlashAttention-3 (Shah et al. 2024) structure on FlashAttention-2's algorithm (Dao 2023,
Algorithm 1): every CTA runs three warpgroups. The producer warpgroup streams K and V tiles
with TMA into a ring of `num_stages` shared-memory slots; two consumer warpgroups each own
`block_q` query rows, run Q.K^T and P.V on wgmma and the online softmax in registers. A
schedule barrier makes the two consumers take turns on the tensor cores ("ping-pong"), so
that one warpgroup's softmax overlaps the other's matrix multiplies.

Any T and S: the last query and KV tiles may run past the arrays' ends, where TMA reads zeros
and drops writes; keys past S are masked on the last KV tile only, so whole tiles keep the fast
path (see ROW_ALIGN for the lengths the wrapper pads and why). Every head dim of HEAD_DIMS runs as
it is: a head dim's shared-memory tiles take the widest swizzle that divides their rows
(`swizzle_bytes`: 80 and 96 run on 32- and 64-byte swizzles, not padded to 128). The value head
dim is the kernel's own: V tiles, the accumulator and the output are [.., Hv] (multi-head latent
attention's Hv = 128 next to H = 192 costs P.V and output traffic at 128 columns, not 192), each
head dim with its own swizzle.

Outputs match `pallas_flash.triton.forward` (out in the input dtype, lse natural-log float32
[B, N, T]) so that either backward (Triton or Mosaic) can use them as residuals.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import _dropout, masks
from pallas_flash._numerics import LN2, LOG2E, MIN_LOGIT, sink_against_keys
from pallas_flash.device import DEFAULT_NUM_SMS, Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic._kernel_common import per_row, times
from pallas_flash.mosaic.launch import (
    dropped_value,
    opaque_zero,
    pad_ids,
    pad_to,
    smem_transforms,
    soft_cap_share,
    warp_specialised_kernel,
    zero_non_finite,
)
from pallas_flash.mosaic.schedule import (
    _Work,
    consumer_tile_range,
    cta_tile_range,
    mask_sides,
    paired_causal_rows,
    segment_tile_plan,
)
from pallas_flash.mosaic.tiles import (
    FORWARD_CONSUMER_REGISTERS,
    FORWARD_PRODUCER_REGISTERS,
    NUM_CONSUMERS,
    ForwardTiles,
    aligned_len,
    cdiv,
    default_tiles,
)


def flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: None,
    arrays: MaskArrays,
    sinks: jax.Array | None,
    *,
    config,
    with_log_sum: bool = False,
) -> tuple[jax.Array, ...]:
    """Attention forward on Hopper (sm_90a) through Pallas Mosaic GPU, for a call the dispatch
    gave this kernel (`mosaic.why_not_forward`: nothing here checks it again).

    Args:
      q: [B, T, N, H] queries, bfloat16 or float16; any T >= 1, H one of HEAD_DIMS.
      k: [B, S, K, H] keys, v: [B, S, K, Hv] values, the dtype of q, any S >= 1, Hv one of
        HEAD_DIMS too (Hv != H as multi-head latent attention's (192, 128) runs natively);
        N % K == 0 and query head n reads kv head n // (N // K) (e.g. N=8, K=2: heads 0-3 read
        kv head 0, heads 4-7 kv head 1). T or S not a multiple of 8 costs a padded copy of
        q, k, v and out (ROW_ALIGN); head dims run as they are.
      bias: None (the Mosaic kernels take no bias; the argument keeps the backends' one shape).
      arrays: the mask's arrays (`masks.MaskArrays`): with spec.has_segments, q_segment_ids
        int32 [B, T] and kv_segment_ids int32 [B, S], sequence lengths folded in as
        `pallas_flash.masks.make_arrays` builds them (rows and keys past their length carry
        PAD_Q_SEGMENT / PAD_KV_SEGMENT, which equal nothing): query i of batch entry b sees
        key j only when their ids are equal; KV tiles that no row of a consumer's block shares
        an id with are neither loaded for it nor multiplied. With dropout, dropout_seeds int32
        [B, N]: the keep-mask of `pallas_flash._dropout` (the Triton kernels' and the
        reference's) on P before P.V; lse stays the un-dropped softmax's.
      sinks: None, or float32 [B, N]: attention sinks, one more natural-log logit per row of
        head n of batch entry b in the softmax's denominator, with no value.
      config: the call's `KernelConfig`, as every backend's wrapper takes it. Read here:
        spec (T and S; is_causal, top-left aligned as in jax.nn.dot_product_attention, also
        when T != S; a window (left, right): query i sees keys i - left <= j <= i + right, KV
        tiles outside a row block's window neither loaded nor multiplied; has_segments),
        scale (positive: without a soft cap the kernel takes the row max before scaling),
        soft_cap (c: logits <- c * tanh(logits / c), applied to scale * q.k before masking),
        dropout_rate, mosaic_forward_tiles (`ForwardTiles`; None: `default_tiles` for the
        shapes and options), device (the GPU it is compiled for: its SM count sizes a
        persistent grid; None: the visible GPU's record, `Device.current()`).
      with_log_sum: also return log_sum.

    Returns:
      out [B, T, N, Hv] in the dtype of q, and lse float32 [B, N, T]: the natural-log
      log-sum-exp of the (soft-capped) logits over the visible keys (and the sink). A row that
      sees no key (a window past the last key, possible when T > S; a padding row; a segment
      with no key) has out 0 and lse -inf, or lse = its sink. With with_log_sum, third,
      log_sum float32 [B, N, T]: the log of each row's softmax denominator relative to the
      larger of its largest logit and its sink (lse = that + log_sum; 0 for rows that see no
      key), as the Triton forward's: beyond |lse| ~ 1e7 a float32 lse cannot hold it next to
      the max, and a backward needs it to recompute the P of keys that tie at the max (1 / n).
    """
    assert bias is None, "the dispatch sends calls with a bias to Triton"
    spec, tiles = config.spec, config.mosaic_forward_tiles
    device = Device.current() if config.device is None else config.device
    soft_cap = None if config.soft_cap is None else float(config.soft_cap)
    q_len, kv_len = q.shape[1], k.shape[1]
    if tiles is None:
        tiles = default_tiles(
            q.shape[-1],
            value_head_dim=v.shape[-1],
            q_len=q_len,
            kv_len=kv_len,
            is_causal=spec.is_causal,
            window=spec.window,
            soft_cap=soft_cap,
            segments=spec.has_segments,
        )
    # The kernel reads T and S from spec: rows past T are computed on zeros and not kept, keys
    # past S are masked. The arrays may be longer (padded here to ROW_ALIGN).
    q_to, kv_to = aligned_len(q_len), aligned_len(kv_len)
    q, k, v = pad_to(q, q_to), pad_to(k, kv_to), pad_to(v, kv_to)
    segments = None
    if spec.has_segments:
        q_ids = pad_ids(arrays.q_segment_ids, q_to, masks.PAD_Q_SEGMENT)
        kv_ids = pad_ids(arrays.kv_segment_ids, kv_to, masks.PAD_KV_SEGMENT)
        segments = (q_ids, kv_ids, segment_tile_plan(spec, MaskArrays(q_ids, kv_ids), tiles))
    drop = None
    if config.dropout_rate:
        row_mul, row_add, col = _dropout.tables(arrays.dropout_seeds, q_len, kv_len)
        # [B, N, 2, T'] (one TMA copy per consumer's rows) and [B, N, S']; the padding rows and
        # keys are masked or dropped with the rows past T.
        rows = jnp.stack([row_mul, row_add], axis=2)
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, q_to - q_len)))
        col = jnp.pad(col, ((0, 0), (0, 0), (0, kv_to - kv_len)))
        drop = (float(config.dropout_rate), rows, col)
    out, lse, *log_sum = _forward_call(
        q,
        k,
        v,
        segments,
        sinks,
        drop,
        with_log_sum=with_log_sum,
        spec=spec,
        scale=float(config.scale),
        soft_cap=soft_cap,
        tiles=tiles,
        num_sms=DEFAULT_NUM_SMS if device is None else device.num_sms,
    )
    if out.shape[1] != q_len:
        out = out[:, :q_len]
    if lse.shape[2] != q_len:
        lse, log_sum = lse[:, :, :q_len], [x[:, :, :q_len] for x in log_sum]
    return out, lse, *log_sum


def ring_scratch(
    dtype,
    tiles: ForwardTiles,
    head_dim: int,
    value_head_dim: int,
    *,
    q_buffers: int,
    q_arrivals: int = 1,
    k_arrivals: int = 1,
    v_arrivals: int = 1,
    lse_rows: int = 1,
) -> dict:
    """The shared memory and barriers of the forward's warpgroups (`_consume`, `_produce`), as
    the kernel's scratch_types: q_buffers Q buffers [block_q, H] (a consumer's buffer b at b *
    NUM_CONSUMERS + consumer), the K and V rings, lse_rows rows [block_q] a consumer, and
    where Hv != H an output tile a consumer; each *_ready barrier completes after its
    *_arrivals copies (one arrival a copy, with its bytes)."""

    # Each head dim's tiles take its own swizzle (`smem_transforms`): Q.K^T reads Q and K, both
    # [.., H]; P.V reads only V from shared memory (P is in registers).
    def ring(rows, cols):
        return plgpu.SMEM(
            (tiles.num_stages, rows, cols), dtype, transforms=smem_transforms(cols, dtype)
        )

    scratch = dict(
        q_smem=plgpu.SMEM(
            (q_buffers, tiles.block_q, head_dim),
            dtype,
            transforms=smem_transforms(head_dim, dtype),
        ),
        k_smem=ring(tiles.block_kv, head_dim),
        v_smem=ring(tiles.block_kv, value_head_dim),
        # lse (and log_sum) rows of each consumer, one TMA copy each.
        lse_smem=plgpu.SMEM((NUM_CONSUMERS, lse_rows, tiles.block_q), jnp.float32),
        q_ready=plgpu.Barrier(num_arrivals=q_arrivals, num_barriers=q_buffers),
        k_ready=plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=tiles.num_stages),
        v_ready=plgpu.Barrier(num_arrivals=v_arrivals, num_barriers=tiles.num_stages),
        # A slot is free again once both consumers are done with it.
        k_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=tiles.num_stages),
        v_free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=tiles.num_stages),
        schedule=plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
    )
    if value_head_dim != head_dim:
        # Q's swizzled [block_q, H] buffer cannot be viewed as a [block_q, Hv] tile: the output
        # gets a buffer of its own per consumer (a persistent CTA's epilogue waits until the
        # copy has read it, before the next item's epilogue writes it).
        scratch.update(
            o_smem=plgpu.SMEM(
                (NUM_CONSUMERS, tiles.block_q, value_head_dim),
                dtype,
                transforms=smem_transforms(value_head_dim, dtype),
            )
        )
    return scratch


def _forward_call(
    q,
    k,
    v,
    segments,
    sinks,
    drop,
    *,
    with_log_sum: bool,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    tiles: ForwardTiles,
    num_sms: int,
):
    """segments: None or (q_segment_ids [B, T], kv_segment_ids [B, S], segment_tile_plan);
    sinks: None or float32 [B, N]; drop: None or (rate, rows [B, N, 2, T'], col [B, N, S']), the
    dropout tables; num_sms: the GPU's SM count, the most CTAs a persistent grid launches.
    Returns (out, lse), with with_log_sum (out, lse, log_sum)."""
    batch, padded_q_len, num_heads, head_dim = q.shape
    num_kv_heads, value_head_dim = k.shape[2], v.shape[3]
    has_ids = segments is not None
    has_drop = drop is not None
    num_q_tiles = cdiv(spec.q_len, tiles.cta_rows)
    kernel = functools.partial(
        _forward_kernel,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        group=num_heads // num_kv_heads,
        work=_Work(
            batch,
            num_heads,
            num_q_tiles,
            reverse=spec.is_causal,
            paired=paired_causal_rows(spec, tiles, has_segments=has_ids),
        ),
        tiles=tiles,
        has_sinks=sinks is not None,
        dropout_rate=drop[0] if has_drop else 0.0,
        with_log_sum=with_log_sum,
    )

    q_buffers = tiles.q_buffers * NUM_CONSUMERS  # indexed buffer * NUM_CONSUMERS + consumer
    # With segment ids, a consumer's query ids land with its Q, and a KV tile's ids ride in K's
    # ring slot: each such barrier then counts two copies (one arrival per copy, with its
    # bytes), and the phase completes once both have landed. Dropout's row hashes land with Q
    # and a KV tile's column hashes ride in K's slot too.
    scratch = ring_scratch(
        q.dtype,
        tiles,
        head_dim,
        value_head_dim,
        q_buffers=q_buffers,
        q_arrivals=1 + has_ids + has_drop,
        k_arrivals=1 + has_ids + has_drop,
        lse_rows=1 + with_log_sum,
    )
    if has_ids:
        scratch.update(
            q_ids_smem=plgpu.SMEM((q_buffers, tiles.block_q), jnp.int32),
            kv_ids_smem=plgpu.SMEM((tiles.num_stages, tiles.block_kv), jnp.int32),
        )
    if has_drop:
        scratch.update(
            drop_rows_smem=plgpu.SMEM((q_buffers, 2, tiles.block_q), jnp.int32),
            drop_col_smem=plgpu.SMEM((tiles.num_stages, tiles.block_kv), jnp.int32),
        )
    # lse [B, N, T] keeps T innermost, where Mosaic GPU may view the array as one run of
    # B * N * T values: a last tile's rows past T would then land on the next head's first
    # rows instead of past the end. Whole tiles per row keep every store in its own row.
    row_type = jax.ShapeDtypeStruct((batch, num_heads, num_q_tiles * tiles.cta_rows), jnp.float32)
    out_type = (
        jax.ShapeDtypeStruct((batch, padded_q_len, num_heads, value_head_dim), q.dtype),
        row_type,
        *([row_type] if with_log_sum else []),
    )
    if tiles.persistent:
        grid = (min(batch * num_heads * num_q_tiles, num_sms),)
        grid_names = ("cta",)
    else:
        # The last grid axis is CUDA's x, launched first: neighbouring CTAs are query tiles of
        # one head and read the same K/V from L2.
        grid = (batch, num_heads, num_q_tiles)
        grid_names = ("batch", "head", "q_tile")
    return warp_specialised_kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_consumers=NUM_CONSUMERS,
    )(
        q,
        k,
        v,
        *(segments or ()),
        *(drop[1:] if has_drop else ()),
        *([] if sinks is None else [sinks]),
    )


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
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
    o_smem=None,
    q_ids_smem=None,
    kv_ids_smem=None,
    drop_rows_smem=None,
    drop_col_smem=None,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    group: int,
    work: _Work,
    tiles: ForwardTiles,
    has_sinks: bool = False,
    dropout_rate: float = 0.0,
    with_log_sum: bool = False,
):
    """One CTA: its work items (`_Work`) in turn, each NUM_CONSUMERS * block_q query rows of
    one head against that head's keys; one item unless tiles.persistent.

    q_ref: [B, T', N, H], k_ref: [B, S', K, H], v_ref: [B, S', K, Hv] and out_ref [B, T', N, Hv]
    in GMEM; lse_ref [B, N, T'] (and with with_log_sum log_sum_ref [B, N, T'], the last ref),
    T' >= T and S' >= S (spec's) multiples of ROW_ALIGN. With segment ids, refs starts with
    q_ids_ref [B, T'], kv_ids_ref [B, S'] and plan_ref [B, ceil(T / cta_rows), NUM_CONSUMERS + 1,
    4] (`segment_tile_plan`), read with scalar loads; with has_sinks, sinks_ref [B, N] float32
    follows them (one scalar load per item); with dropout_rate > 0, the dropout tables
    drop_rows_ref [B, N, 2, T'] and drop_col_ref [B, N, S'] come before sinks_ref, copied with Q
    (drop_rows_smem, like q_smem) and with K (drop_col_smem, like kv_ids_smem).
    q_smem [q_buffers * NUM_CONSUMERS, block_q, H] holds each consumer's Q, later its output
    tile (buffer b of consumer wg at b * NUM_CONSUMERS + wg; item n uses buffer n % q_buffers)
    when Hv == H, else o_smem [NUM_CONSUMERS, block_q, Hv] holds the output tiles;
    k_smem [num_stages, block_kv, H], v_smem [num_stages, block_kv, Hv] are the ring
    (kv_ids_smem [num_stages, block_kv] rides in K's slots, q_ids_smem like q_smem with Q); the
    barriers are named after what their completion means.
    """
    *id_refs, out_ref, lse_ref = refs[:-1] if with_log_sum else refs
    row_refs = (lse_ref, refs[-1]) if with_log_sum else (lse_ref,)
    sinks_ref = id_refs.pop() if has_sinks else None
    drop_col_ref = id_refs.pop() if dropout_rate else None
    drop_rows_ref = id_refs.pop() if dropout_rate else None
    q_ids_ref, kv_ids_ref, plan_ref = id_refs or (None, None, None)
    persistent = tiles.persistent
    num_items = work.count(persistent)
    wg = lax.axis_index("wg")

    def item(n):
        """(batch, head, q_tile, (cta_lo, cta_hi)) of this CTA's n-th work item."""
        batch, head, q_tile = work.item(n, persistent)
        if plan_ref is None:
            cta_range = cta_tile_range(spec, q_tile * tiles.cta_rows, tiles)
        else:
            # Every thread of the CTA loads the same words: a broadcast from L2.
            cta_range = tuple(plan_ref[batch, q_tile, NUM_CONSUMERS, i] for i in (0, 3))
        return batch, head, q_tile, cta_range

    def ring(cta_range, steps_before):
        return _Ring(
            k_smem=k_smem,
            v_smem=v_smem,
            k_ready=k_ready,
            v_ready=v_ready,
            k_free=k_free,
            v_free=v_free,
            num_stages=tiles.num_stages,
            first_tile=cta_range[0],
            steps_before=steps_before,
            kv_ids_smem=kv_ids_smem,
            drop_col_smem=drop_col_smem,
        )

    def over_items(body):
        """Runs body(n, steps_before) -> steps_before + the item's KV steps over the items:
        the ring's slots and barrier phases run on from one item into the next."""
        if not persistent:
            body(0, 0)
        else:
            lax.fori_loop(0, num_items, body, jnp.int32(0))

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(FORWARD_CONSUMER_REGISTERS, action="increase")

        def buffer(n):
            index = lax.rem(n, tiles.q_buffers) if persistent else 0
            return index * NUM_CONSUMERS + wg

        def rows(n):
            # item(n), not work.item(n): with segment ids that also loads the item's plan,
            # unused here. Without those loads jax 0.11.2's Mosaic GPU interpreter hangs on
            # persistent CTAs with segment ids on one core every time (with them, sometimes on two:
            # tests/test_mosaic_forward_masks.py, PERSISTENT_INTERPRET_CASES); the barrier
            # protocol is the same either way.
            batch, head, q_tile, _ = item(n)
            return batch, head, q_tile * tiles.cta_rows + wg * tiles.block_q

        def load_q(n):
            batch, head, q_start = rows(n)
            b = buffer(n)
            plgpu.copy_gmem_to_smem(
                q_ref.at[batch, pl.ds(q_start, tiles.block_q), head], q_smem.at[b], q_ready.at[b]
            )
            if q_ids_smem is not None:
                ids = q_ids_ref.at[batch, pl.ds(q_start, tiles.block_q)]
                plgpu.copy_gmem_to_smem(ids, q_ids_smem.at[b], q_ready.at[b])
            if drop_rows_smem is not None:
                hashes = drop_rows_ref.at[batch, head, :, pl.ds(q_start, tiles.block_q)]
                plgpu.copy_gmem_to_smem(hashes, drop_rows_smem.at[b], q_ready.at[b])

        load_q(0)

        def consume_item(n, steps_before):
            batch, head, q_tile, cta_range = item(n)
            q_start = q_tile * tiles.cta_rows + wg * tiles.block_q
            if persistent:
                # The other buffer's output left in the last item's epilogue (it waited for
                # the copy to read it): load the next item's Q there while this one runs.
                pl.when(n + 1 < num_items)(lambda: load_q(n + 1))
            if plan_ref is None:
                ranges = consumer_tile_range(spec, q_start, cta_range, tiles)
            else:
                ranges = tuple(plan_ref[batch, q_tile, wg, i] for i in range(4))
            b = buffer(n)

            def q_at(tile):
                return q_smem.at[b + opaque_zero(tile) if tiles.step_descriptors else b]

            _consume(
                out_ref,
                row_refs,
                q_at,
                q_smem.at[b] if o_smem is None else o_smem.at[wg],
                lse_smem.at[wg],
                q_ready.at[b],
                schedule,
                ring(cta_range, steps_before),
                wg=wg,
                batch=batch,
                head=head,
                q_start=q_start,
                cta_range=cta_range,
                ranges=ranges,
                q_ids_smem=None if q_ids_smem is None else q_ids_smem.at[b],
                drop_rows_smem=None if drop_rows_smem is None else drop_rows_smem.at[b],
                dropout_rate=dropout_rate,
                sink=None if sinks_ref is None else sinks_ref[batch, head],
                spec=spec,
                scale=scale,
                soft_cap=soft_cap,
                tiles=tiles,
            )
            return steps_before + cta_range[1] - cta_range[0]

        over_items(consume_item)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(FORWARD_PRODUCER_REGISTERS, action="decrease")

        def produce_item(n, steps_before):
            batch, head, _, cta_range = item(n)
            kv_head = lax.div(head, jnp.int32(group))
            _produce(
                k_ref,
                v_ref,
                kv_ids_ref,
                ring(cta_range, steps_before),
                batch=batch,
                kv_head=kv_head,
                head=head,
                drop_col_ref=drop_col_ref,
                cta_hi=cta_range[1],
                tiles=tiles,
            )
            return steps_before + cta_range[1] - cta_range[0]

        over_items(produce_item)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Ring:
    """The K/V shared-memory ring as one work item sees it: the CTA's s-th KV step overall
    (s = steps_before + tile - first_tile for this item's tile) lives in slot
    s % num_stages. *_ready complete when TMA has landed a tile, *_free when both consumers
    are done reading it. kv_ids_smem (segment ids only) shares K's slots and barriers."""

    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    num_stages: int
    first_tile: object  # the item's first KV tile (an int32 scalar or a Python int)
    steps_before: object = 0  # KV steps of the CTA's earlier items (persistent CTAs)
    kv_ids_smem: object = None
    drop_col_smem: object = None  # dropout's column hashes, in K's slots as kv_ids_smem

    def step(self, tile):
        return jnp.asarray(self.steps_before + tile - self.first_tile, jnp.int32)

    def slot(self, tile):
        return lax.rem(self.step(tile), jnp.int32(self.num_stages))


def _produce(
    k_ref,
    v_ref,
    kv_ids_ref,
    ring: _Ring,
    *,
    batch,
    kv_head,
    cta_hi,
    tiles: ForwardTiles,
    head=None,
    drop_col_ref=None,
    copy=None,
    ahead=None,
):
    """Producer warpgroup: TMA every KV tile of the item, [first_tile, cta_hi), into the ring,
    in order (with its KV segment ids next to K when kv_ids_ref is not None).

    copy: None (K/V [B, S', K, H] in GMEM, tile `tile` at rows tile * block_kv of batch entry
    `batch`), or copy(gmem_ref, smem, ready, tile, slot), which starts the copies of KV tile
    `tile` of gmem_ref into smem.at[slot], arriving on ready.at[slot] (the ragged prefill's
    pages; the barriers count its copies).

    ahead: None, or (persistent tiles only) ahead(tile) -> a pytree of scalars that copy takes
    last, copy(gmem_ref, smem, ready, tile, slot, ahead(tile)): loaded one step before the
    step that copies the tile (the ragged prefill's page ids: a load from GMEM, whose latency
    then overlaps the step before instead of delaying its copies)."""

    def contiguous_copy(gmem_ref, smem, ready, tile, slot):
        # The last tile's window may run past S: TMA fills those rows with zeros, which the
        # kernel relies on for V (a masked key's p is 0, and 0 * NaN would not be).
        rows = (batch, pl.ds(tile * tiles.block_kv, tiles.block_kv), kv_head)
        plgpu.copy_gmem_to_smem(
            gmem_ref.at[rows], smem.at[slot], ready.at[slot], oob_mode=plgpu.OOBFillMode.ZEROS
        )

    copy = contiguous_copy if copy is None else copy

    def copy_k(tile, slot, *extra):
        copy(k_ref, ring.k_smem, ring.k_ready, tile, slot, *extra)
        if kv_ids_ref is not None:
            ids = kv_ids_ref.at[batch, pl.ds(tile * tiles.block_kv, tiles.block_kv)]
            plgpu.copy_gmem_to_smem(ids, ring.kv_ids_smem.at[slot], ring.k_ready.at[slot])
        if drop_col_ref is not None:  # the query head's column hashes (not the kv head's)
            cols = drop_col_ref.at[batch, head, pl.ds(tile * tiles.block_kv, tiles.block_kv)]
            plgpu.copy_gmem_to_smem(cols, ring.drop_col_smem.at[slot], ring.k_ready.at[slot])

    first = ring.first_tile
    if ahead is not None:
        # As the persistent loop below, each step also loading what the next step's copies
        # take.
        def step_ahead(tile, loaded):
            next_loaded = ahead(tile + 1)
            step, slot = ring.step(tile), ring.slot(tile)
            refill = step >= tiles.num_stages
            pl.when(refill)(lambda: plgpu.barrier_wait(ring.k_free.at[slot]))
            copy_k(tile, slot, loaded)
            pl.when(refill)(lambda: plgpu.barrier_wait(ring.v_free.at[slot]))
            copy(v_ref, ring.v_smem, ring.v_ready, tile, slot, loaded)
            return next_loaded

        lax.fori_loop(first, cta_hi, step_ahead, ahead(first))
        return
    if tiles.persistent:
        # The ring runs on across items: a step waits for its slot unless it is one of the
        # CTA's first num_stages steps, whose slots start empty.
        @pl.loop(first, cta_hi)
        def _step(tile):
            step, slot = ring.step(tile), ring.slot(tile)
            refill = step >= tiles.num_stages
            pl.when(refill)(lambda: plgpu.barrier_wait(ring.k_free.at[slot]))
            copy_k(tile, slot)
            pl.when(refill)(lambda: plgpu.barrier_wait(ring.v_free.at[slot]))
            copy(v_ref, ring.v_smem, ring.v_ready, tile, slot)

        return

    # Fill the empty ring; a CTA may see fewer tiles than there are slots (short S, causal
    # CTAs near the top, narrow windows), or none: copies nobody waits for would still be in
    # flight at exit.
    def fill(n):
        @pl.when(first + n < cta_hi)
        def _copy():
            copy_k(first + n, n)
            copy(v_ref, ring.v_smem, ring.v_ready, first + n, n)

    num_fills = min(tiles.num_stages, cdiv(k_ref.shape[1], tiles.block_kv))
    if k_ref.shape[1] % tiles.block_kv == 0:
        for n in range(num_fills):
            fill(n)
    else:
        # A loop: unrolled, the ragged last tile's window would have a static start (without a
        # left window the first tile is the int 0) that runs past the array's end, which the
        # ref indexer refuses at trace time (NDIndexer's bound check).
        pl.loop(0, num_fills)(fill)

    @pl.loop(first + tiles.num_stages, cta_hi)
    def _refill(tile):
        slot = ring.slot(tile)
        # K and V are freed separately: Q.K^T of a tile is done long before its P.V.
        plgpu.barrier_wait(ring.k_free.at[slot])
        copy_k(tile, slot)
        plgpu.barrier_wait(ring.v_free.at[slot])
        copy(v_ref, ring.v_smem, ring.v_ready, tile, slot)


def _schedule_sync(schedule):
    """Both consumers meet here; see `_consume` for the turn-taking this produces."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def _loop(lo, hi, body, carry):
    """fori_loop over [lo, hi), elided when the bounds are Python ints and the range is empty."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def _capped_logits(qk, *, scale: float, soft_cap: float):
    """soft_cap * tanh(scale * qk / soft_cap) in log2 units (times log2(e)).

    tanh(x) = 1 - 2r, r = 1 / (exp(2x) + 1) on exp2 and `soft_cap_share`: the hardware tanh
    that approx_math would pick has a relative error near 2^-11, which the cap multiplies into
    an absolute logit error of soft_cap * 2^-11 (0.015 at soft_cap = 30); this form's error is
    near float32 rounding. exp2 overflowing to inf gives tanh = 1, underflowing to 0 gives -1.
    """
    cap2 = soft_cap * LOG2E
    r = soft_cap_share(jnp.exp2(qk * (2.0 * LOG2E * scale / soft_cap)))
    return cap2 - (2.0 * cap2) * r


def _consume(
    out_ref,
    row_refs,
    q_at,
    o_smem,
    lse_smem,
    q_ready,
    schedule,
    ring: _Ring,
    *,
    wg,
    batch,
    head,
    q_start,
    cta_range,
    ranges,
    q_ids_smem,
    q_offset=None,
    store_out=None,
    sink=None,
    drop_rows_smem=None,
    dropout_rate: float = 0.0,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    tiles: ForwardTiles,
):
    """Consumer warpgroup: block_q query rows of a work item through its KV tiles (FA2
    Algorithm 1). Their Q (and query ids) are on their way to q_smem = q_at(0), signalled by
    q_ready; q_at(tile) is the same buffer as KV tile `tile`'s Q.K^T reads it (through an
    opaque zero with tiles.step_descriptors). o_smem [block_q, Hv] takes the output tile
    (q_smem itself when Hv == H: Q is dead by then).
    row_refs: (lse_ref,) or (lse_ref, log_sum_ref) in GMEM; lse_smem [len(row_refs), block_q]
    stages their rows.

    Ping-pong: each CTA step has two schedule syncs, one after issuing Q.K^T and one split
    around the end of the softmax. Consumer 1 syncs once before its first step and consumer 0
    once after its last, so consumer 1 runs half a step behind: its Q.K^T and P.V are issued
    while consumer 0 computes its softmax, and the other way round (FA3, section 3.1).

    Ranges: the consumer walks every CTA step of cta_range; it computes the tiles of
    its own range `ranges` = (lo, full_lo, full_hi, hi), masking element-wise those outside
    [full_lo, full_hi), and "drains" the CTA steps before lo and from hi on (see drain_step).

    q_offset: None, or an int32 scalar added to the rows' positions in the mask (row r of the
    block sits at q_start + q_offset + r; the ragged prefill's rows, whose rows in its outputs
    are not their positions). lse (and, without store_out, the output) is stored at q_start.

    store_out: None (the output tile goes to out_ref's rows q_start.. of batch entry `batch`,
    head `head`), or store_out(o_smem), which starts the copies of the output tile (the
    ragged prefill's rows of its sequence only).

    q_ids_smem: None, or the SMEM [block_q] ref of the rows' segment ids: copied with Q, then
    kept in registers as a row vector; a masked step compares it with the KV tile's ids, read
    from the ring slot before K's slot is released.

    sink: None, or the float32 scalar natural-log logit of the rows' attention sink, added to
    their denominators in the epilogue.

    drop_rows_smem: None, or the SMEM [2, block_q] ref of the rows' dropout hashes (row_mul,
    row_add of `_dropout.tables`), copied with Q; a step then reads the KV tile's column hashes
    from the ring slot (before K's slot is released) and zeroes the dropped P before P.V.
    """
    block_q, block_kv = tiles.block_q, tiles.block_kv
    q_smem = q_at(0)
    value_head_dim, dtype = o_smem.shape[-1], q_smem.dtype
    q_rows = (batch, pl.ds(q_start, block_q), head)
    lo, full_lo, full_hi, hi = ranges
    qk_scale = scale * LOG2E
    # With segment ids any tile may need the element-wise mask, and any consumer may start
    # after the CTA's first tile or end before its last.
    mask_left, mask_right = (True, True) if q_ids_smem is not None else mask_sides(spec, tiles)
    geometry_left, geometry_right = mask_sides(spec, tiles)
    # A ragged last KV tile holds keys past S: it lies past full_hi and is masked there.
    ragged_kv = spec.kv_len % block_kv != 0
    mask_right = mask_right or ragged_kv
    # Keys a row cannot see, inside a tile it partly sees, may hold NaN or inf in V (padding,
    # another document, a later token): p = 0 there, but 0 * NaN in P.V is NaN. Keys past S
    # need nothing: the wrapper pads with zeros and TMA reads zeros past the array's end.
    sanitise_v = geometry_left or geometry_right or q_ids_smem is not None
    # s: the logits in units where exp2((s - m) * unit2) is exp(logit - max logit): q.k itself,
    # or the capped logits, already in log2 units (tanh does not commute with a scaled max);
    # `unit` converts s to a natural-log logit.
    unit2, unit = (qk_scale, scale) if soft_cap is None else (1.0, LN2)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # The rows' segment ids [block_q] (row layout): loaded below once q_ready completes, before
    # the loops trace visible_in, which reads them.
    q_seg = None

    def visible_in(tile, slot):
        q_pos = q_start + plgpu.broadcasted_iota(
            jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA
        )
        if q_offset is not None:
            q_pos = q_pos + q_offset
        kv_pos = tile * block_kv + plgpu.broadcasted_iota(
            jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA
        )
        conditions = []
        if ragged_kv:
            conditions.append(kv_pos < spec.kv_len)
        if geometry_right:
            conditions.append(kv_pos <= q_pos + spec.right)
        if geometry_left:
            conditions.append(kv_pos >= q_pos - spec.left)
        if q_seg is not None:
            # Column vector of the tile's ids in the layout that broadcasts over WGMMA rows.
            kv_seg = plgpu.load(ring.kv_ids_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            shape = (block_q, block_kv)
            conditions.append(per_row(q_seg, shape) == lax.broadcast_in_dim(kv_seg, shape, [1]))
        return functools.reduce(lambda a, b: a & b, conditions) if conditions else None

    def kv_step(tile, carry, *, masked: bool):
        acc, m_i, l_i = carry
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.k_ready.at[slot])

        # -- compute qk --
        def qk_into(acc_ref):
            plgpu.wgmma(acc_ref, q_at(tile), ring.k_smem.at[slot].T)
            _schedule_sync(schedule)  # the other consumer may now issue its matmuls
            return acc_ref[...]  # waits for the wgmma

        qk = pl.run_scoped(qk_into, plgpu.ACC((block_q, block_kv), jnp.float32))
        # The KV ids share K's slot: read them before releasing it.
        visible = visible_in(tile, slot) if masked else None
        keep = None
        if drop_rows is not None:
            col = plgpu.load(ring.drop_col_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            shape = (block_q, block_kv)
            keep = _dropout.keep(
                per_row(drop_rows[0], shape),
                per_row(drop_rows[1], shape),
                lax.broadcast_in_dim(col, shape, [1]),
                dropout_rate,
            )
        plgpu.barrier_arrive(ring.k_free.at[slot])

        # -- online softmax in base 2; log2(e) is folded into unit2 --
        s = qk if soft_cap is None else _capped_logits(qk, scale=scale, soft_cap=soft_cap)
        if visible is not None:
            # A select, not a multiply: hidden logits may be NaN (NaN or inf in K there). -inf
            # gives p == 0 exactly, also in a row that has seen no key yet (m_i is finite).
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        # Subtract before scaling: the row's largest logit gives exp2(0) == 1 at any magnitude.
        # A fused s * unit2 - m * unit2 subtracts an unrounded product from a rounded one, an
        # error of up to half an ulp of m * unit2 in the exponent: exp2 overflows or vanishes
        # once |logit| passes ~1e9.
        p = jnp.exp2(times(s - per_row(m_new, s.shape), unit2))
        alpha = jnp.exp2(times(m_i - m_new, unit2))
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * per_row(alpha, acc.shape)
        if keep is not None:  # l_i keeps the dropped p: lse is the un-dropped softmax's
            p = jnp.where(keep, p, per_row(drop_zero, p.shape))
        p_in = p.astype(dtype)  # wgmma takes A from registers in the input dtype
        plgpu.barrier_arrive(schedule)  # softmax done: the other consumer may take the MMAs
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_wait(schedule)  # ... and has issued them
        if masked and sanitise_v:
            # Here, between the schedule syncs, consumer 0's P.V of this slot happens before
            # consumer 1's (the schedule barrier orders them), so the two never touch it at once.
            zero_non_finite(ring.v_smem.at[slot])

        # -- accumulate p.v, unnormalised (normalised once in the epilogue: FA2 change 1) --
        def pv_into(acc_ref):
            plgpu.wgmma(acc_ref, p_in, ring.v_smem.at[slot])

        acc = pl.run_state(pv_into)(plgpu.ACC.init(acc))  # returns after the wgmma completes
        plgpu.barrier_arrive(ring.v_free.at[slot])
        return acc, m_new, l_i

    def drain_step(tile, carry):
        # A CTA step outside this consumer's range: the other consumer computes it. This one
        # mirrors kv_step's barrier traffic without the matmuls: it releases the slots (their
        # free barriers count both consumers), keeps its two schedule syncs so that the
        # ping-pong stays paired, and waits for both ready barriers, because Mosaic GPU tracks
        # each barrier's phase per thread and flips it on every wait: a skipped wait would
        # leave this consumer a phase behind on its next real step.
        slot = ring.slot(tile)
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_arrive(ring.k_free.at[slot])
        _schedule_sync(schedule)
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        plgpu.barrier_wait(schedule)
        plgpu.barrier_arrive(ring.v_free.at[slot])
        return carry

    acc = plgpu.layout_cast(jnp.zeros((block_q, value_head_dim), jnp.float32), plgpu.Layout.WGMMA)
    # m_i starts at MIN_LOGIT, finite: (-inf - m_i) is -inf, never -inf - -inf; once a row
    # sees a key, alpha scales the empty start (acc = 0, l_i = 0) away.
    m_i = plgpu.layout_cast(jnp.full((block_q,), MIN_LOGIT, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
    carry = (acc, m_i, l_i)
    masked_step = functools.partial(kv_step, masked=True)
    plgpu.barrier_wait(q_ready)
    if q_ids_smem is not None:
        q_seg = plgpu.load(q_ids_smem, layout=row_layout)
    drop_rows = drop_zero = None
    if drop_rows_smem is not None:
        drop_rows = tuple(plgpu.load(drop_rows_smem.at[i], layout=row_layout) for i in range(2))
        drop_zero = dropped_value(drop_rows[0])
    pl.when(wg == 1)(functools.partial(_schedule_sync, schedule))
    # Without a left (right) side and segment ids the loops before full_lo (after full_hi) are
    # empty: not emitted.
    if mask_left:
        _loop(cta_range[0], lo, drain_step, None)
        carry = _loop(lo, full_lo, masked_step, carry)
    carry = _loop(full_lo, full_hi, functools.partial(kv_step, masked=False), carry)
    if mask_right:
        carry = _loop(full_hi, hi, masked_step, carry)
        _loop(hi, cta_range[1], drain_step, None)
    pl.when(wg == 0)(functools.partial(_schedule_sync, schedule))
    acc, m_i, l_i = carry

    # -- epilogue: out = acc / l, lse back to natural log; rows that saw no key: 0 and -inf --
    keys_share = None
    top = m_i * unit  # the natural-log logit that lse adds log_sum to
    if sink is not None:
        # The sink's e^{sink} joins l, both relative to the larger of the row max and the sink
        # (`_numerics.sink_against_keys`: a sink of -inf leaves the row as it is, one beyond
        # float32 in the units of s is held there, and a row that saw no key gets lse = sink).
        m_i, keys_share, l_i, top = sink_against_keys(m_i, l_i, sink, unit, unit2)
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    # One reciprocal per row instead of a divide per element.
    row_scale = 1.0 / l_safe if keys_share is None else keys_share / l_safe
    if dropout_rate:
        row_scale = row_scale * (1.0 / (1.0 - dropout_rate))
    out = acc * per_row(row_scale, acc.shape)
    # Where o_smem is q_smem, Q is dead: its last reader, the final Q.K^T, is done.
    o_smem[...] = out.astype(dtype)
    # log_sum (log l, relative to the row max or the sink) also for a backward that recomputes
    # P: beyond |lse| ~ 1e7 lse rounds it away, and keys that tie at the max have P = 1 / l.
    log_sum = jnp.log(l_safe)
    lse_smem.at[0][...] = jnp.where(empty, -jnp.inf, top + log_sum)
    if len(row_refs) > 1:
        lse_smem.at[1][...] = log_sum
    plgpu.commit_smem()
    if store_out is None:
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[q_rows])
    else:
        store_out(o_smem)
    for i, row_ref in enumerate(row_refs):
        plgpu.copy_smem_to_gmem(lse_smem.at[i], row_ref.at[batch, head, pl.ds(q_start, block_q)])
    if tiles.persistent:
        # The next item writes lse_smem, and at its start loads the item after it's Q into
        # q_smem: only once the copies have read them. The writes to GMEM are waited for once,
        # at the CTA's end.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
