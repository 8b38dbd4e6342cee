"""The per-row fixed-point scales of the deterministic fused dQ (`BackwardTiles(fused_dq="fixed")`).

The dK/dV kernel multiplies query row i's dS by 2^e_i (exact in bfloat16) before dQ's wgmma and
adds the partials as int32, which give the same bits in any order; dQ = scale * 2^-e_i * the sum.
e_i comes from a bound on the row's partial sums over the keys it sees (`fixed_point_exponents`
says which). Two forms of one computation:

- `fixed_point_exponents` and its helpers, in jnp: where the attention kernels are interpreted
  (a CPU), and the reference.
- Two Triton-lowered Pallas kernels, which the backward takes (`fixed_point_scales`):
  `_key_norms_kernel`, per key and per block of KEY_BLOCK keys the maxima the bound needs, and
  `_row_scales_kernel`, per query row the maxima over the keys it sees (whole blocks by their
  maxima, boundary blocks key by key; with segment ids only the blocks of the segments' tile
  ranges, `masks.tile_ranges`) and the bound. XLA compiles the jnp form's dozen fusions
  again at every call site (~0.3 s a layer on the H200,
  docs/notes/compile.md, "The fixed-point scales"), where a kernel is lowered once and reused.

Both take the same steps in the same order, but sums (|.|_1, |.|_2) may add in another order:
their norms agree within rounding, their exponents but for a bound within rounding of a power of
two (either is a valid bound).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash import masks
from pallas_flash._numerics import LOG2E, slack
from pallas_flash._pallas_triton import CompilerParams, fold, load_rows, load_vector
from pallas_flash._vma import pallas_call
from pallas_flash.masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT, MaskSpec
from pallas_flash.mosaic.tiles import cdiv

# fused_dq "fixed": each row's dQ^T is summed as int32 in units of 2^-e of it, e chosen so that
# every partial sum stays under 2^FIXED_POINT_BITS in magnitude (`fixed_point_exponents`).
FIXED_POINT_BITS = 30
# |e| at most: 2^e |dS| stays far inside bfloat16's range, and 2^-e is a normal float32.
MAX_EXPONENT = 120

# Keys per program of the key-norm kernel, and per block maximum.
KEY_BLOCK = 64
# Query rows per program of the row-scale kernel.
ROW_BLOCK = 64
# Keys of a boundary block that the row-scale kernel masks at once (registers, below).
KEY_PIECE = 8
# Block maxima read at once by the row-scale kernel.
CHUNK = 128
# Keys per group of the keys kernel's in-block prefix maxima (`_prefix_maxima`).
PREFIX_GROUP = 8


# -- elementwise pieces, shared by both forms ----------------------------------------------------


def pow2(n):
    """2^n, float32, for int32 n in [-126, 127] (the normal range), exact: built from its bits."""
    return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def exponent(x):
    """For float32 x >= 0, finite: e with x < 2^e, from its bits (frexp's for a normal x; -126
    for 0 and subnormals, which the hardware may flush, so that no platform reads them apart)."""
    return ((lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF) - 126


def spacing(x):
    """For float32 x >= 0, finite: the gap from x to the next float32 up."""
    up = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) + 1, jnp.float32)
    return up - x


def largest_abs(x):
    """max |x| over the last axis, float32; inf for a row that holds NaN or inf."""
    x = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x), axis=-1)


def l2_norm(x, largest):
    """|x|_2 over the last axis, float32, from the row's `largest_abs`; inf where that is not
    finite (or the norm overflows). The row is scaled by 2^-e, e the max's binary exponent held
    within [-126, 126], before its squares are summed, so that none overflows (scaled entries
    stay below 4); the scale is a normal float, where 1 / max (which XLA multiplies by in place
    of dividing) is subnormal for a max from 2^126 on, and the hardware flushes subnormals to
    zero: the norm would read 0."""
    x = jnp.abs(x.astype(jnp.float32))
    finite = largest < jnp.inf
    e = jnp.clip(exponent(jnp.where(finite, largest, 0.0)), -126, 126)
    scaled = x * pow2(-e)[..., None]
    norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=-1)) * pow2(e)
    return jnp.where(finite, norm, jnp.inf)


def _exponents_from_norms(k_max, v_max, v_l2, d_out_l1, d_out_l2, delta, lse, kv_len: int):
    """The rows' e (int32) and whether their bound is finite (bool) from the maxima over the
    keys each row sees, its dO's norms, delta and lse (`fixed_point_exponents`)."""
    # How far the recomputed P may exceed the exact one (see `_numerics.slack`): twice the
    # lowering, and 8 ulps of lse in log2 units for the rounding of lse2 and the logits; at most
    # the number of keys, as the kernels clamp each P to 1 (where |lse| passes ~1.9e8 the factor
    # overflows float32: the row would read no finite bound).
    abs_lse = jnp.where(jnp.isfinite(lse), jnp.abs(lse), 0.0)
    log2_lse = jnp.minimum(abs_lse * LOG2E, jnp.finfo(jnp.float32).max)
    gain = jnp.exp2(2.0 * LOG2E * slack(abs_lse) + 8.0 * spacing(log2_lse))
    gain = jnp.minimum(gain, float(kv_len))
    # fmin: |dO|_1 may overflow where |dO|_2 does not, and inf * 0 (V of zeros) is NaN; a NaN or
    # inf in what the row sees still leaves both NaN or inf.
    ds_max = gain * (jnp.fmin(d_out_l1 * v_max, d_out_l2 * v_l2) + jnp.abs(delta))
    bound = ds_max * k_max
    finite = bound < jnp.inf  # False for NaN too
    bound_exp = exponent(jnp.where(finite, bound, 0.0))  # bound < 2^bound_exp
    ds_exp = exponent(jnp.where(finite, ds_max, 0.0))
    exponents = jnp.minimum(FIXED_POINT_BITS - bound_exp, MAX_EXPONENT - ds_exp)
    exponents = jnp.where(finite, jnp.clip(exponents, -MAX_EXPONENT, MAX_EXPONENT), 0)
    return exponents, finite


def _scales(exponents, finite, lse, scale: float):
    """(2^e, scale * 2^-e) of each row: 0 for a row whose lse is -inf (no key), +inf (a sink
    took it) or NaN, as P = 0 there; NaN for a row without a finite bound (NaN or inf in what it
    sees, as the default backward's products would give)."""
    dq_unit = jnp.float32(scale) * pow2(-exponents)  # |exponents| <= MAX_EXPONENT: exact
    dq_unit = jnp.where(jnp.isfinite(lse), jnp.where(finite, dq_unit, jnp.nan), 0.0)
    return pow2(exponents), dq_unit


# -- the jnp form ----------------------------------------------------------------------------------


def window_max(x, width: int):
    """out[..., i] = max of x[..., i : i + width] (x >= 0, no NaN), along the last axis, for i
    up to its length - width: each window ends in the block (of `width`) after the one it
    starts in, or is one, so it is the max of its start's suffix in one block and its end's
    prefix in the next (van Herk, Gil and Werman), two `lax.cummax`: masked maxima over
    blocks would fuse into fewer reductions, but XLA's GPU autotuner takes 40 s per call site
    over them (docs/notes/compile.md, "Dead ends")."""
    length = x.shape[-1]
    blocks = cdiv(length, width)  # the last window's end, length - 1, is in the last block
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * width - length)])
    x = x.reshape(*x.shape[:-1], blocks, width)
    last = x.ndim - 1  # lax.cummax takes no negative axis
    prefix = lax.cummax(x, axis=last).reshape(*x.shape[:-2], -1)
    suffix = lax.cummax(x, axis=last, reverse=True).reshape(*x.shape[:-2], -1)
    count = length - width + 1
    return jnp.maximum(suffix[..., :count], prefix[..., width - 1 : width - 1 + count])


def seen_maxima(x, spec: MaskSpec, axis: int):
    """Per query row i < T, the max of x (>= 0, no NaN; its keys along `axis`, S of them) over
    the keys the row sees by spec's geometry, i - left <= j <= i + right and j < S (causal:
    right 0): T values along `axis`, or 1 (the max of all) where every row sees every key. A
    row that sees no key gets 0."""
    q_len, kv_len = spec.q_len, spec.kv_len
    if spec.window is None and not spec.is_causal:
        return jnp.max(x, axis=axis, keepdims=True)
    x = jnp.moveaxis(x, axis, -1)
    # Bounds that no row reaches past change nothing: keys j >= 0 and j <= S - 1.
    right = min(spec.right, kv_len - 1)
    if spec.window is None:  # keys 0 ... min(i + right, S - 1): a prefix
        seen = lax.cummax(x, axis=x.ndim - 1)[..., right:]
        shortfall = q_len - seen.shape[-1]
        if shortfall > 0:  # rows past the last key see all of them
            seen = jnp.pad(seen, [(0, 0)] * (x.ndim - 1) + [(0, shortfall)], mode="edge")
        return jnp.moveaxis(seen[..., :q_len], -1, axis)
    # Keys i - left ... i + right: window i of x shifted right by `left` (zeros before key 0),
    # and zeros past key S - 1 (rows whose window starts there see none).
    left = min(spec.left, q_len - 1)
    width = left + right + 1
    x = x[..., : min(kv_len, q_len + right)]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(left, q_len + right - x.shape[-1])])
    return jnp.moveaxis(window_max(x, width), -1, axis)


def seen_maxima_of_segments(x, spec: MaskSpec, segment_ids):
    """seen_maxima of x [3, B, S, K] (along its keys' axis 2) for a call with segment ids
    (q ids [B, T], kv ids [B, S]; sequence lengths folded in as padding ids): each row's max
    over the keys that its geometry and its segment let it see, [3, B, T, K]. Through a dense
    [B, T, S] mask: the size of the calls it runs on (where the kernels are interpreted)."""
    visible = masks.dense(spec, masks.MaskArrays(*segment_ids))[:, 0]  # [B, T, S]
    x = x[:, :, None, : spec.kv_len]
    return jnp.max(jnp.where(visible[None, ..., None], x, 0.0), axis=3)


def fixed_point_exponents(
    k, v, d_out, delta, lse, *, spec: MaskSpec, num_heads: int, segment_ids=None
):
    """Per query row, the e of the 2^e that fused_dq "fixed" scales the row's dS by, int32
    [B, N, T], and whether the row's bound (below) is finite, bool [B, N, T]; in jnp.

    k [B, S', K, H], v [B, S', K, Hv], d_out [B, T', N, Hv] (padded or not: spec's T and S are
    read), delta f32 [B, N, T], rowsum(dO * O) - dlse, lse f32 [B, N, T] the forward's;
    segment_ids: None, or (q ids [B, T], kv ids [B, S]) for a call with segment ids or lengths
    (a row sees only the keys of its segment).

    Row i's partial of dQ (unscaled) over any set J of the keys it sees is sum_{j in J} dS_ij
    K_j, dS_ij = P_ij dcap_ij (dP_ij - delta_i), dP_ij = dO_i . V_j, dcap in [0, 1] and sum_j
    P_ij <= g_i, the factor by which the backward's recomputed P may exceed the exact one (1 but
    for rounding where |lse| <= SLACK_FROM; the lowered reference's `slack` and a few ulps of
    lse beyond; never more than S, as each P is clamped to 1). |dP_ij| <= min(|dO_i|_1
    |V_j|_max, |dO_i|_2 |V_j|_2), so each entry of the partial is at most B_i = g_i
    (min(|dO_i|_1 max_j |V_j|_max, |dO_i|_2 max_j |V_j|_2) + |delta_i|) max_j |K_j|_max, the
    maxima over the keys j that the row sees (`seen_maxima`: all of them, j <= i causal, i -
    left <= j <= i + right in a window, those of its segment), in any order of the sums. e =
    FIXED_POINT_BITS - (floor(log2 B_i) + 1) keeps every partial and every partial sum of the
    row under 2^FIXED_POINT_BITS < 2^31 in units of 2^-e (with room for the rounding of dS to 16
    bits), so int32 adds of them neither overflow nor depend on their order; the sum's
    resolution is 2^-FIXED_POINT_BITS of B_i (B_i is loose by the cancellation in the row's
    sums, 2^8-2^14 on random data: the error grows with the number of key tiles,
    docs/notes/fused-dq.md, "How the fused forms work"). e also keeps 2^e |dS_ij| under
    2^MAX_EXPONENT. Keys a row
    cannot see are not in its maxima: huge values past its diagonal or outside its window cost
    it no precision. NaN or inf in K, V or dO_i that the row sees (or in delta_i, or B_i past
    float32) leaves it without a finite bound: e = 0 and finite_bound False (the caller makes
    such a row NaN, as the products of float64 attention's gradient would; the two-kernel
    backward, which zeroes non-finite K of masked calls before its dQ kernel, may give a finite
    dQ for a row that sees an infinite key whose logit is -inf)."""
    assert spec.has_segments == (segment_ids is not None), spec
    q_len, kv_len = spec.q_len, spec.kv_len
    # A loss like out.mean() makes d_out a constant (a broadcast), and XLA would fold the norms
    # below on the host at compile time: 4-8 s per call site at [1, 8192, 16, 128] on the H200
    # (its evaluator's reduce), minutes for a model of 24 layers. The barrier keeps them on the
    # GPU, where they take microseconds.
    k, v, d_out, delta, lse = lax.optimization_barrier((k, v, d_out, delta, lse))

    # [3, B, S, K]: each key's max |K|, max |V| and |V|_2.
    v_largest = largest_abs(v[:, :kv_len])
    kv = jnp.stack([largest_abs(k[:, :kv_len]), v_largest, l2_norm(v[:, :kv_len], v_largest)])
    if segment_ids is None:
        kv = seen_maxima(kv, spec, axis=2)
    else:
        kv = seen_maxima_of_segments(kv, spec, segment_ids)
    # [3, B, K, T or 1] -> each query head's kv head: [B, N, T or 1]
    k_max, v_max, v_l2 = jnp.repeat(jnp.swapaxes(kv, 2, 3), num_heads // k.shape[2], axis=2)
    d_out = d_out[:, :q_len].astype(jnp.float32)
    d_out_l1 = jnp.transpose(jnp.sum(jnp.abs(d_out), axis=-1), (0, 2, 1))  # [B, N, T]
    d_out_l2 = jnp.transpose(l2_norm(d_out, largest_abs(d_out)), (0, 2, 1))
    exponents, finite = _exponents_from_norms(
        k_max, v_max, v_l2, d_out_l1, d_out_l2, delta, lse, kv_len
    )
    return exponents.astype(jnp.int32), finite


# -- the kernels -----------------------------------------------------------------------------------


def _key_norms_kernel(
    k_ref, v_ref, *out_refs, kv_len: int, head_dim: int, value_head_dim: int, diagonal: bool
):
    """One KV head's keys [s * KEY_BLOCK, +KEY_BLOCK): each key's max |K|, max |V| and |V|_2
    (zero past S), and the block's max of each; with `diagonal`, also each key's max of each
    over the block's keys up to it (what the diagonal block's row i sees, `_diagonal_call`)."""
    key_refs, block_refs, prefix_refs = out_refs[:3], out_refs[3:6], out_refs[6:]
    rows = kv_len - pl.program_id(0) * KEY_BLOCK
    k = load_rows(k_ref, 0, KEY_BLOCK, rows, head_dim, ragged=kv_len % KEY_BLOCK != 0)
    v = load_rows(v_ref, 0, KEY_BLOCK, rows, value_head_dim, ragged=kv_len % KEY_BLOCK != 0)
    v_max = largest_abs(v)
    norms = (largest_abs(k), v_max, l2_norm(v, v_max))
    for ref, block_ref, norm in zip(key_refs, block_refs, norms, strict=True):
        ref[...] = norm
        block_ref[...] = jnp.max(norm, keepdims=True)
    if diagonal:
        for ref, norm in zip(prefix_refs, norms, strict=True):
            ref[...] = _prefix_maxima(norm)


def _prefix_maxima(x):
    """out[i] = max(x[:i + 1]) of x [KEY_BLOCK] (>= 0), in groups of PREFIX_GROUP: within each
    group by a masked [groups, PREFIX_GROUP, PREFIX_GROUP] max, across groups by the maxima of
    the groups before: tiles of 512 values where one [KEY_BLOCK, KEY_BLOCK] mask of the block
    took the keys kernel from 56 to 182 registers (ptxas, H=128)."""
    groups = KEY_BLOCK // PREFIX_GROUP
    x = x.reshape(groups, PREFIX_GROUP)
    shape = (groups, PREFIX_GROUP, PREFIX_GROUP)
    upto = lax.broadcasted_iota(jnp.int32, shape, 2) <= lax.broadcasted_iota(jnp.int32, shape, 1)
    within = jnp.max(jnp.where(upto, x[:, None, :], 0.0), axis=2)
    group_max = jnp.max(x, axis=1)
    before = lax.broadcasted_iota(jnp.int32, (groups, groups), 1) < lax.broadcasted_iota(
        jnp.int32, (groups, groups), 0
    )
    earlier = jnp.max(jnp.where(before, group_max[None, :], 0.0), axis=1)
    return jnp.maximum(within, earlier[:, None]).reshape(KEY_BLOCK)


def _seen_maxima_kernel(key_refs, block_refs, spec: MaskSpec, q_start, ids=None, diagonal=None):
    """Rows [q_start, +ROW_BLOCK)'s maxima over the keys each sees of the three per-key norms:
    blocks that every row sees whole by their maxima, boundary blocks key by key. ids: None,
    or (the rows' segment ids [ROW_BLOCK], the kv ids' ref [S], the row block's range of key
    blocks from the segments, `masks.tile_ranges`): a row sees the keys of its segment, blocks
    whole only where the segments make them so too. diagonal: None, or (`_diagonal_call`'s
    calls) the refs of the three norms' maxima over each key's block up to the key, [ROW_BLOCK]
    at the row block's keys: its one boundary block is its diagonal, where row i sees the keys
    of the block up to key i."""
    lo, full_lo, full_hi, hi = spec.kv_tile_range(q_start, ROW_BLOCK, KEY_BLOCK)
    if ids is not None:
        lo, full_lo, full_hi, hi = masks.intersect(ids[2], (lo, full_lo, full_hi, hi))
    rows = q_start + lax.broadcasted_iota(jnp.int32, (ROW_BLOCK, 1), 0)

    def boundary(j, maxima):
        # KEY_PIECE keys at a time: [ROW_BLOCK, KEY_BLOCK] tiles of the mask and the three
        # norms took the kernel to 255 registers, two programs per SM (96 causal, 119 with a
        # window in pieces of 8; ptxas on Triton 3.6's compile of the kernel, read on a CPU
        # with benchmarks/triton_ir.py's steps).
        def piece(p, maxima):
            start = j * KEY_BLOCK + p * KEY_PIECE
            keys = start + lax.broadcasted_iota(jnp.int32, (1, KEY_PIECE), 1)
            q_seg = kv_seg = None
            if ids is not None:
                q_ids, kv_ids_ref, _ = ids
                kv_ids = load_vector(
                    kv_ids_ref,
                    start,
                    KEY_PIECE,
                    spec.kv_len,
                    ragged=spec.kv_len % KEY_BLOCK != 0,  # a piece may lie past S
                    other=PAD_KV_SEGMENT,
                )
                q_seg, kv_seg = q_ids[:, None], kv_ids[None, :]
            sees = masks.visible(spec, rows, keys, q_seg, kv_seg)
            return tuple(
                jnp.maximum(m, jnp.max(jnp.where(sees, ref[pl.ds(start, KEY_PIECE)], 0.0), 1))
                for m, ref in zip(maxima, key_refs, strict=True)
            )

        return fold(0, KEY_BLOCK // KEY_PIECE, piece, maxima)

    def whole(c, maxima):
        idx = c * CHUNK + lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
        inside = (idx >= full_lo) & (idx < full_hi)
        return tuple(
            jnp.maximum(m, jnp.max(jnp.where(inside, ref[pl.ds(c * CHUNK, CHUNK)], 0.0)))
            for m, ref in zip(maxima, block_refs, strict=True)
        )

    if diagonal is not None:
        # One vector load a norm where the boundary block key by key took 8 dependent rounds
        # of loads and masked [ROW_BLOCK, KEY_PIECE] maxima (the causal rows kernel read
        # 93-105 us against the plain one's 35 on the H100).
        maxima = tuple(ref[...] for ref in diagonal)
    else:
        zeros = tuple(jnp.zeros((ROW_BLOCK,), jnp.float32) for _ in key_refs)
        maxima = fold(lo, full_lo, boundary, zeros)
        maxima = fold(full_hi, hi, boundary, maxima)
    # The chunks of block maxima that hold whole blocks; none where there are none (full_lo may
    # then lie past the last block: a window that starts past the last key).
    first, last = full_lo // CHUNK, cdiv(full_hi, CHUNK)
    if isinstance(full_lo, int) and isinstance(full_hi, int):
        last = last if full_hi > full_lo else first
    else:
        last = jnp.where(full_hi > full_lo, last, first)
    return fold(first, last, whole, maxima)


def _row_scales_kernel(
    d_out_ref,
    delta_ref,
    lse_ref,
    *refs,
    spec: MaskSpec,
    value_head_dim: int,
    scale: float,
    rows_out: int,
    segments: bool,
):
    """Query rows [t * ROW_BLOCK, +ROW_BLOCK) of one head: their 2^e and dQ unit (0 past T)."""
    key_refs, block_refs, refs = refs[:3], refs[3:6], refs[6:]
    diagonal = None
    if _diagonal_call(spec, segments, rows_out):
        diagonal, refs = refs[:3], refs[3:]
    ids_refs, (scales_ref, unit_ref) = (refs[:3], refs[3:]) if segments else ((), refs)
    q_start = pl.program_id(0) * ROW_BLOCK
    rows = spec.q_len - q_start
    # The grid's rows (rows_out) may pass T by whole blocks: mask every row past T.
    ragged = spec.q_len < rows_out
    d_out = load_rows(d_out_ref, 0, ROW_BLOCK, rows, value_head_dim, ragged=ragged)
    d_out = d_out.astype(jnp.float32)  # |.|_1 summed in float32, as the jnp form does
    # dO's norms before the key loops: its [ROW_BLOCK, Hv] tile is dead by then, not held in
    # registers beside their [ROW_BLOCK, KEY_BLOCK] tiles.
    d_out_l1 = jnp.sum(jnp.abs(d_out), axis=-1)
    d_out_l2 = l2_norm(d_out, largest_abs(d_out))
    delta = load_vector(delta_ref, 0, ROW_BLOCK, rows, ragged=ragged)
    lse = load_vector(lse_ref, 0, ROW_BLOCK, rows, ragged=ragged)
    ids = None
    if segments:
        q_ids_ref, kv_ids_ref, ranges_ref = ids_refs
        q_ids = load_vector(q_ids_ref, 0, ROW_BLOCK, rows, ragged=ragged, other=PAD_Q_SEGMENT)
        # Row blocks past T (rows_out) take the last one's range: their rows are not kept.
        tile = jnp.minimum(pl.program_id(0), ranges_ref.shape[2] - 1)
        batch = pl.program_id(2) if ranges_ref.shape[0] > 1 else 0
        ranges = tuple(ranges_ref[batch, 0, tile, c] for c in range(4))
        ids = (q_ids, kv_ids_ref, ranges)
    k_max, v_max, v_l2 = _seen_maxima_kernel(key_refs, block_refs, spec, q_start, ids, diagonal)
    exponents, finite = _exponents_from_norms(
        k_max, v_max, v_l2, d_out_l1, d_out_l2, delta, lse, spec.kv_len
    )
    row_scales, dq_unit = _scales(exponents, finite, lse, scale)
    inside = q_start + lax.broadcasted_iota(jnp.int32, (ROW_BLOCK,), 0) < spec.q_len
    scales_ref[...] = jnp.where(inside, row_scales, 0.0)
    unit_ref[...] = jnp.where(inside, dq_unit, 0.0)


def _diagonal_call(spec: MaskSpec, segments: bool, rows_out: int) -> bool:
    """Whether every row block's one boundary block of keys is its diagonal block, where row i
    sees the keys of the block up to i: causal (top-left) rows of T <= S keys, no window or
    segment ids (ROW_BLOCK == KEY_BLOCK, so row block t's diagonal is key block t), and no row
    block past the keys' blocks (rows_out within them)."""
    return (
        spec.is_causal
        and spec.window is None
        and not segments
        and spec.q_len <= spec.kv_len
        and ROW_BLOCK == KEY_BLOCK
        and rows_out <= cdiv(spec.kv_len, KEY_BLOCK) * KEY_BLOCK
    )


def _kernel_scales(
    k, v, d_out, delta, lse, segment_ids, spec: MaskSpec, scale, rows_out, interpret
):
    """`fixed_point_scales` by the two kernels."""
    assert rows_out % ROW_BLOCK == 0 and rows_out >= spec.q_len, (rows_out, spec.q_len)
    batch, _, num_kv_heads, head_dim = k.shape
    num_heads, value_head_dim = d_out.shape[2], d_out.shape[3]
    group = num_heads // num_kv_heads
    # Triton's tiles are powers of two: the head dims' columns past H read as zero.
    hp, hvp = (1 << (dim - 1).bit_length() for dim in (head_dim, value_head_dim))
    warps = 4 if max(hp, hvp) <= 128 else 8
    params = CompilerParams(num_warps=warps, num_stages=1)
    key_blocks = cdiv(spec.kv_len, KEY_BLOCK)
    keys_out, blocks_out = key_blocks * KEY_BLOCK, cdiv(key_blocks, CHUNK) * CHUNK
    per_key = jax.ShapeDtypeStruct((batch, num_kv_heads, keys_out), jnp.float32)
    per_block = jax.ShapeDtypeStruct((batch, num_kv_heads, blocks_out), jnp.float32)
    diagonal = _diagonal_call(spec, segment_ids is not None, rows_out)
    key_spec = pl.BlockSpec((None, None, KEY_BLOCK), lambda s, h, b: (b, h, s))
    (*key_norms,) = pallas_call(
        functools.partial(
            _key_norms_kernel,
            kv_len=spec.kv_len,
            head_dim=head_dim,
            value_head_dim=value_head_dim,
            diagonal=diagonal,
        ),
        grid=(key_blocks, num_kv_heads, batch),
        in_specs=[
            pl.BlockSpec((None, KEY_BLOCK, None, hp), lambda s, h, b: (b, s, h, 0)),
            pl.BlockSpec((None, KEY_BLOCK, None, hvp), lambda s, h, b: (b, s, h, 0)),
        ],
        out_specs=[key_spec] * 3
        + [pl.BlockSpec((None, None, 1), lambda s, h, b: (b, h, s))] * 3
        + [key_spec] * (3 * diagonal),
        out_shape=[per_key] * 3 + [per_block] * 3 + [per_key] * (3 * diagonal),
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_fixed_point_keys",
    )(k, v)
    row_spec = pl.BlockSpec((None, None, ROW_BLOCK), lambda t, n, b: (b, n, t))
    rows = jax.ShapeDtypeStruct((batch, num_heads, rows_out), jnp.float32)
    # Row block t's diagonal is key block t (ROW_BLOCK == KEY_BLOCK): its keys' maxima up to
    # each of them, at the row block's rows.
    diagonal_spec = pl.BlockSpec((None, None, ROW_BLOCK), lambda t, n, b: (b, n // group, t))
    segment_operands = ()
    if segment_ids is not None:
        # Per row block, the key blocks its segments reach ([B, 1, row blocks, 4]): the others
        # are skipped, whole ones read by their maxima.
        ranges = masks.tile_ranges(
            spec, masks.MaskArrays(*segment_ids), ROW_BLOCK, KEY_BLOCK, over="q"
        )
        segment_operands = (*segment_ids, ranges)
    return pallas_call(
        functools.partial(
            _row_scales_kernel,
            spec=spec,
            value_head_dim=value_head_dim,
            scale=scale,
            rows_out=rows_out,
            segments=segment_ids is not None,
        ),
        grid=(cdiv(rows_out, ROW_BLOCK), num_heads, batch),
        in_specs=[
            pl.BlockSpec((None, ROW_BLOCK, None, hvp), lambda t, n, b: (b, t, n, 0)),
            row_spec,
            row_spec,
            *[pl.BlockSpec((None, None, keys_out), lambda t, n, b: (b, n // group, 0))] * 3,
            *[pl.BlockSpec((None, None, blocks_out), lambda t, n, b: (b, n // group, 0))] * 3,
            *[diagonal_spec] * (3 * diagonal),
            *(
                []
                if segment_ids is None
                else [
                    pl.BlockSpec((None, ROW_BLOCK), lambda t, n, b: (b, t)),
                    pl.BlockSpec((None, spec.kv_len), lambda t, n, b: (b, 0)),
                    pl.BlockSpec(ranges.shape, lambda t, n, b: (0, 0, 0, 0)),
                ]
            ),
        ],
        out_specs=[row_spec, row_spec],
        out_shape=[rows, rows],
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_fixed_point_rows",
    )(d_out, delta, lse, *key_norms, *segment_operands)


def fixed_point_scales(
    k,
    v,
    d_out,
    delta,
    lse,
    *,
    spec: MaskSpec,
    scale: float,
    rows_out: int,
    segment_ids=None,
    kernels: bool = True,
    interpret: bool = False,
):
    """(row_scales, dq_unit), float32 [B, N, rows_out] (rows_out >= T; 0 past T): 2^e_i, which
    the dK/dV kernel multiplies row i's dS by, and scale * 2^-e_i, which turns its int32 sum
    into dQ (0 for a row whose lse is not finite, NaN for one without a finite bound), from
    `fixed_point_exponents`' bound. Arguments as there. kernels: the Pallas kernels
    (`interpret`: in Pallas' interpreter), or the jnp form (where the attention kernels run in
    jax's Mosaic GPU interpreter, which would take the kernels too, and has no Triton)."""
    scale = float(scale)
    if spec.has_segments != (segment_ids is not None):
        raise ValueError(f"segment_ids must be given exactly when {spec} has segments")
    if kernels:
        arrays = (k, v, d_out, delta, lse, segment_ids)
        return _kernel_scales(*arrays, spec, scale, rows_out, interpret)
    exponents, finite = fixed_point_exponents(
        k, v, d_out, delta, lse, spec=spec, num_heads=d_out.shape[2], segment_ids=segment_ids
    )
    row_scales, dq_unit = _scales(exponents, finite, lse, scale)
    pad = ((0, 0), (0, 0), (0, rows_out - spec.q_len))
    return jnp.pad(row_scales, pad), jnp.pad(dq_unit, pad)
