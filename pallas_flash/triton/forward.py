"""FlashAttention-2 forward kernel (Dao 2023, Algorithm 1) and its pallas_call wrapper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_flash import _dropout, masks
from pallas_flash._numerics import accumulation_dtype, log_sum_with_sinks, sink_in_units
from pallas_flash._pallas_triton import CompilerParams, load_rows, load_vector
from pallas_flash._vma import pallas_call
from pallas_flash.device import gpu_core_count
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.reference import with_sinks
from pallas_flash.triton._common import (
    Operands,
    dot,
    dropout_rows,
    load_pair_tile,
    load_range,
    logit_unit,
    merge_splits,
    scores,
    softmax_init,
    softmax_step,
    softmax_store,
    tile_keep,
    visit_tiles,
)
from pallas_flash.triton.tiles import padded_head_dim


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
    spec: MaskSpec,
    scale: float,
    soft_cap,
    head_dim: int,
    value_head_dim: int,
    block_q: int,
    block_kv: int,
    has_bias: bool,
    kv_splits: int,
    dropout_rate: float = 0.0,
    has_sinks: bool = False,
    with_row_max: bool = False,
):
    """One query tile of one head: stream KV tiles with an online softmax (FA2 Algorithm 1).

    q_ref: [block_q, Hp], k_ref: [S, Hp], v_ref: [S, Hvp], o_ref: [block_q, Hvp] (the head dim
    and the value head dim, each padded: `padded_head_dim`); lse_ref, log_sum_ref: [block_q]
    (lse and log_sum as `softmax_store` writes them), and with with_row_max row_max_ref
    [block_q] (the row max in the units of `scores`, last); optional operands (see Operands): bias
    [block_q|1, S|1], q_seg [block_q], kv_seg [S], mask like bias, ranges.
    With kv_splits > 1 the third grid axis is batch * kv_splits and the program covers one
    contiguous chunk of the KV tiles; o_ref and the row refs then hold that chunk's partial
    result.
    With dropout_rate > 0 the dropout tables (`_dropout.tables`, whole) follow the optional
    operands, and with has_sinks the sink logits [B, N] (float32, natural log) come last.
    """
    row_max_ref = None
    if with_row_max:
        *refs, row_max_ref = refs
    *refs, o_ref, lse_ref, log_sum_ref = refs
    ops = Operands(refs, spec, has_bias=has_bias, has_dropout=dropout_rate > 0, has_sinks=has_sinks)
    tile = query_tile(pl.program_id(0), spec.q_len, block_q)
    head, batch = pl.program_id(1), pl.program_id(2) // kv_splits
    q_start = tile * block_q
    q_rows = spec.q_len - q_start  # rows of this tile that exist; past them, loads read zero
    ragged_q = spec.q_len % block_q != 0
    ragged_kv = spec.kv_len % block_kv != 0

    q = load_rows(q_ref, 0, block_q, q_rows, head_dim, ragged=ragged_q)
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    q_seg = None
    if ops.q_seg is not None:
        q_seg = load_vector(
            ops.q_seg, 0, block_q, q_rows, ragged=ragged_q, other=masks.PAD_Q_SEGMENT
        )[:, None]

    unit = logit_unit(scale, ops.bias is not None, soft_cap)
    drop_rows = None
    if ops.dropout is not None:  # the rows' hashes, once per program
        row_mul, row_add = dropout_rows(
            ops.dropout, batch, head, q_start, block_q, spec.q_len, ragged=ragged_q
        )
        drop_rows = (row_mul[:, None], row_add[:, None])

    def body(j, carry, *, masked: bool):
        kv_start = pl.multiple_of(j * block_kv, block_kv)
        k = load_rows(k_ref, kv_start, block_kv, spec.kv_len, head_dim, ragged=masked and ragged_kv)
        v = load_rows(
            v_ref, kv_start, block_kv, spec.kv_len, value_head_dim, ragged=masked and ragged_kv
        )
        # -- compute the logits (in the units of `scores`) --
        bias = tile_bias(ops, spec, q_rows, kv_start, block_q, block_kv)
        u, _ = scores(dot(q, k, trans_b=True), scale, bias, soft_cap)
        visible = None
        if masked:
            visible = tile_visible(ops, spec, q_idx, q_seg, q_rows, kv_start, block_q, block_kv)
        keep = None
        if drop_rows is not None:
            keep = tile_keep(
                ops.dropout,
                drop_rows,
                batch,
                head,
                kv_start,
                block_kv,
                spec.kv_len,
                dropout_rate,
                ragged=masked and ragged_kv,
            )
        return softmax_step(carry, u, v, unit, visible, keep)

    carry = softmax_init(block_q, o_ref.shape[-1], accumulation_dtype(q_ref.dtype))
    ranges = spec.kv_tile_range(q_start, block_q, block_kv)
    if ops.ranges is not None:
        ranges = masks.intersect(ranges, load_range(ops.ranges, batch, head, tile))
    if kv_splits > 1:
        chunk = pl.cdiv(pl.cdiv(spec.kv_len, block_kv), kv_splits)
        split = pl.program_id(2) % kv_splits
        ranges = masks.intersect(ranges, (split * chunk,) * 2 + ((split + 1) * chunk,) * 2)
    carry = visit_tiles(ranges, body, carry)
    out_scale = 1.0 / (1.0 - dropout_rate) if dropout_rate else 1.0
    sink = None if ops.sinks is None else ops.sinks[batch, head]
    softmax_store(
        carry,
        unit,
        o_ref,
        lse_ref,
        block_q,
        q_rows,
        value_head_dim,
        out_scale,
        sink,
        log_sum_ref,
        row_max_ref,
    )


def tile_bias(ops: Operands, spec: MaskSpec, q_rows, kv_start, block_q: int, block_kv: int):
    """The bias tile of a query tile (rows relative to the tile, q_rows of them real) and the keys
    [kv_start, kv_start + block_kv), or None without a bias."""
    if ops.bias is None:
        return None
    return load_pair_tile(ops.bias, 0, block_q, q_rows, kv_start, block_kv, spec.kv_len)


def tile_visible(
    ops: Operands,
    spec: MaskSpec,
    q_idx,
    q_seg,
    q_rows,
    kv_start,
    block_q: int,
    block_kv: int,
    *,
    seg_lead=(),
    mask_lead=(),
):
    """Visibility [block_q, block_kv] of a partially visible tile of a query tile: geometry,
    segment ids and dense mask. q_idx [block_q, 1] are absolute query positions, q_seg their
    segment ids (or None). seg_lead, mask_lead: leading indices of the kv segment-id and mask refs
    when their blocks keep batch/head dims (see load_rows)."""
    kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    kv_seg = mask = None
    if ops.kv_seg is not None:
        kv_seg = load_vector(
            ops.kv_seg,
            kv_start,
            block_kv,
            spec.kv_len,
            ragged=True,
            other=masks.PAD_KV_SEGMENT,
            lead=seg_lead,
        )[None, :]
    if ops.mask is not None:
        mask = load_pair_tile(
            ops.mask, 0, block_q, q_rows, kv_start, block_kv, spec.kv_len, lead=mask_lead
        )
    return masks.visible(spec, q_idx, kv_idx, q_seg, kv_seg, mask)


def query_tile(program, q_len: int, block_q: int):
    """The query tile of grid row `program`: last tile first. Under a causal mask the last tiles
    see the most keys; starting them first keeps the final wave of the grid short."""
    return pl.cdiv(q_len, block_q) - 1 - program


def tile_sizes(block_a: int, len_a: int, block_b: int, len_b: int) -> tuple[int, int]:
    """Shrinks tiles to the padded problem (a 16-row query tile for T=1, not 128)."""

    def fit(block, length):
        return min(block, max(16, 1 << (length - 1).bit_length()))

    return fit(block_a, len_a), fit(block_b, len_b)


def pair_spec(shape, block_q: int, q_tile, *, group: int = 1):
    """BlockSpec of a [Bx, Nx, Tx, Sx] per-(query, key) operand (bias, mask) for a grid over
    (query tiles, heads, batch): broadcast dims (size 1) always read block 0."""
    bx, nx, tx, sx = shape
    block = (None, None, block_q if tx > 1 else 1, sx)
    return pl.BlockSpec(
        block,
        lambda i, n, b: (b if bx > 1 else 0, n if nx > 1 else 0, q_tile(i) if tx > 1 else 0, 0),
    )


def mask_operands(spec: MaskSpec, arrays: MaskArrays, block_q: int, q_tile, ranges):
    """(operands, in_specs) of the optional mask operands for a grid over (query tiles, heads,
    batch), in Operands order (without bias)."""
    operands, in_specs = [], []
    if spec.has_segments:
        operands += [arrays.q_segment_ids, arrays.kv_segment_ids]
        in_specs += [
            pl.BlockSpec((None, block_q), lambda i, n, b: (b, q_tile(i))),
            pl.BlockSpec((None, spec.kv_len), lambda i, n, b: (b, 0)),
        ]
    if spec.mask_shape is not None:
        operands.append(arrays.mask)
        in_specs.append(pair_spec(arrays.mask.shape, block_q, q_tile))
    if ranges is not None:
        operands.append(ranges)
        in_specs.append(pl.BlockSpec(ranges.shape, lambda i, n, b: (0, 0, 0, 0)))
    return operands, in_specs


def with_dropout_tables(operands, in_specs, arrays: MaskArrays, dropout_rate: float, spec):
    """operands and in_specs, with the dropout tables of the seeds (`_dropout.tables`, whole:
    the kernels read their rows and columns at global indices) appended when dropout_rate > 0."""
    if not dropout_rate:
        return operands, in_specs
    tables = _dropout.tables(arrays.dropout_seeds, spec.q_len, spec.kv_len)
    specs = [pl.BlockSpec(x.shape, lambda *_: (0, 0, 0)) for x in tables]
    return [*operands, *tables], [*in_specs, *specs]


def flash_forward(
    q, k, v, bias, arrays: MaskArrays, sinks, *, config, with_log_sum=False, with_row_max=False
):
    """out [B, T, N, Hv] in q's dtype and lse [B, N, T] float32 (natural log); with_log_sum: also
    log_sum [B, N, T] float32, the log of each row's softmax denominator relative to its largest
    logit (`softmax_store`), which the backward needs beside lse at huge logits; with_row_max
    (and with_log_sum): also that largest logit [B, N, T] float32 in the kernel's units
    (`logit_unit`: natural = row_max * unit; with sinks the larger of it and the sink in those
    units, held at float32's largest; MIN_LOGIT for rows that see neither), from which
    the Triton backward recomputes P without lse's rounding (`flash_backward`'s row_max).

    q: [B, T, N, H]; k: [B, S, K, H], v: [B, S, K, Hv] with N % K == 0 (the value head dim is
    the kernel's own: V tiles, accumulator and output at Hv, padded on their own); bias None
    or [Bb, Nb, Tb, Sb] (each dim full or 1); arrays: the mask's arrays (masks.MaskArrays, with
    the dropout seeds, whose `_dropout.tables` the kernels read, when dropout_rate > 0); sinks:
    None or float32 [B, N], attention sinks (`softmax_store`), included in out and lse. Float64
    inputs (the interpreter's) take float64 in place of every float32 here.

    config: the call's `KernelConfig` as the dispatch built it (every backend's wrapper takes
    it); read here: spec, scale, soft_cap, dropout_rate, block_sizes, interpret, and the
    device's SM count, which the automatic split-KV rule fills (device None: the visible GPU's).
    """
    assert with_log_sum or not with_row_max, "the row max goes with log_sum"
    spec, scale, soft_cap = config.spec, config.scale, config.soft_cap
    block_sizes, interpret, dropout_rate = config.block_sizes, config.interpret, config.dropout_rate
    num_sms = gpu_core_count() if config.device is None else config.device.num_sms
    batch, q_len, num_heads, head_dim = q.shape
    _, kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    value_head_dim = v.shape[-1]
    hp, hvp = padded_head_dim(head_dim), padded_head_dim(value_head_dim)
    block_q, block_kv = tile_sizes(block_sizes.block_q, q_len, block_sizes.block_kv, kv_len)
    q_tile = functools.partial(query_tile, q_len=q_len, block_q=block_q)
    kernel = functools.partial(
        _forward_kernel,
        spec=spec,
        scale=scale,
        soft_cap=soft_cap,
        head_dim=head_dim,
        value_head_dim=value_head_dim,
        block_q=block_q,
        block_kv=block_kv,
        has_bias=bias is not None,
        dropout_rate=dropout_rate,
    )
    num_q_tiles, num_kv_tiles = pl.cdiv(q_len, block_q), pl.cdiv(kv_len, block_kv)
    splits = choose_kv_splits(
        block_sizes.kv_splits,
        num_q_tiles * num_heads * batch,
        num_kv_tiles,
        interpret,
        num_sms=num_sms,
    )
    # Split KV: the chunks' merge (in XLA) adds the sinks, the kernel does not.
    in_kernel_sinks = sinks is not None and splits == 1
    kernel = functools.partial(
        kernel, kv_splits=splits, has_sinks=in_kernel_sinks, with_row_max=with_row_max
    )
    q_spec = pl.BlockSpec((None, block_q, None, hp), lambda i, n, b: (b, q_tile(i), n, 0))
    kv_spec = pl.BlockSpec((None, kv_len, None, hp), lambda i, n, b: (b, 0, n // group, 0))
    v_spec = pl.BlockSpec((None, kv_len, None, hvp), lambda i, n, b: (b, 0, n // group, 0))
    o_spec = pl.BlockSpec((None, block_q, None, hvp), lambda i, n, b: (b, q_tile(i), n, 0))
    operands, in_specs = [q, k, v], [q_spec, kv_spec, v_spec]
    if bias is not None:
        operands.append(bias)
        in_specs.append(pair_spec(bias.shape, block_q, q_tile))
    ranges = masks.tile_ranges(spec, arrays, block_q, block_kv, over="q")
    extra, extra_specs = mask_operands(spec, arrays, block_q, q_tile, ranges)
    extra, extra_specs = with_dropout_tables(extra, extra_specs, arrays, dropout_rate, spec)
    if in_kernel_sinks:
        extra.append(sinks)
        extra_specs.append(pl.BlockSpec(sinks.shape, lambda *_: (0, 0)))
    in_specs = [_per_batch(s, splits) for s in in_specs + extra_specs]
    row_spec = pl.BlockSpec((None, None, block_q), lambda i, n, b: (b, n, q_tile(i)))
    acc = accumulation_dtype(q.dtype)  # float32, float64 for float64 inputs (the interpreter)
    row_shape = jax.ShapeDtypeStruct((batch * splits, num_heads, q_len), acc)
    num_rows = 2 + with_row_max  # lse, log_sum and the row max
    out, lse, log_sum, *row_max = pallas_call(
        kernel,
        grid=(num_q_tiles, num_heads, batch * splits),
        in_specs=in_specs,
        out_specs=[o_spec, *[row_spec] * num_rows],
        out_shape=[
            jax.ShapeDtypeStruct(
                (batch * splits, q_len, num_heads, value_head_dim),
                q.dtype if splits == 1 else acc,
            ),
            *[row_shape] * num_rows,
        ],
        compiler_params=CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name="pallas_flash_forward",
    )(*operands, *extra)
    row_max = row_max[0] if with_row_max else None
    if splits > 1:
        unit = logit_unit(scale, bias is not None, soft_cap)
        out, lse, log_sum, row_max = _combine_splits(
            out, lse, log_sum, row_max, splits, q.dtype, unit
        )
        if sinks is not None:
            out, lse, log_sum, row_max = _with_sinks_after_merge(
                out, lse, log_sum, row_max, sinks, unit
            )
    if not with_log_sum:
        return out, lse
    return (out, lse, log_sum, row_max) if with_row_max else (out, lse, log_sum)


def choose_kv_splits(
    requested: int, programs: int, num_kv_tiles: int, interpret: bool, *, num_sms: int
) -> int:
    """How many programs share one query tile's KV loop: `requested`, or with 0 (auto) enough to
    give the GPU (num_sms cores) about two programs per core -- only when the grid fills less
    than half of the cores and each program keeps at least four KV tiles, so that the combine
    pays off."""
    if requested:
        return max(1, min(requested, num_kv_tiles))
    if interpret:
        return 1
    cores = num_sms
    if 2 * programs > cores or num_kv_tiles < 8:
        return 1
    return max(1, min(pl.cdiv(2 * cores, programs), num_kv_tiles // 4, 16))


def _per_batch(spec: pl.BlockSpec, splits: int) -> pl.BlockSpec:
    """A BlockSpec of the (query tile, head, batch) grid, for the grid whose third axis is
    batch * splits: every split of a batch entry reads the same blocks."""
    if splits == 1:
        return spec
    index_map = spec.index_map
    return pl.BlockSpec(spec.block_shape, lambda i, n, z: index_map(i, n, z // splits))


def _combine_splits(out, lse, log_sum, row_max, splits: int, dtype, unit: float):
    """The result over all KV chunks from per-chunk results (`merge_splits`): (out, lse,
    log_sum, row_max), row_max None where the chunks' is."""
    weights, lse, log_sum, row_max = merge_splits(lse, log_sum, splits, row_max, unit)
    out = out.reshape(-1, splits, *out.shape[1:])  # [B, splits, T, N, H]
    weights = jnp.transpose(weights, (0, 1, 3, 2))[..., None]  # [B, splits, T, N, 1]
    combined = jnp.sum(weights * out, axis=1).astype(dtype)
    return combined, lse, log_sum, row_max


def _with_sinks_after_merge(out, lse, log_sum, row_max, sinks, unit: float):
    """The merged split-KV result with the sinks [B, N] added (the kernels leave them to the
    merge): log_sum and row_max then relative to the larger of the row max and the sink, as
    `softmax_store` has them (`_numerics.sink_against_keys`)."""
    maxima = None
    if row_max is not None:
        maxima = row_max * unit
        row_max = jnp.maximum(row_max, sink_in_units(sinks[..., None], unit))
    out, with_sink_lse = with_sinks(out, lse, sinks, log_sum)
    return out, with_sink_lse, log_sum_with_sinks(lse, log_sum, sinks, maxima), row_max
