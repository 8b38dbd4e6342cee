"""The Triton kernels' tiles: `BlockSizes` and `DecodeBlockSizes`, the shipped tables and the
heuristics that pick them per head dim and dtype. No autotune cache here (`tune_cache` holds it,
and the dispatch joins the two) and no device queries."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _is_power_of_two(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiles and launch parameters of the three Triton kernels.

    Names follow jax's Pallas ops: `block_q_dkv` is the query tile of the dK/dV kernel, and so on.
    Every tile is a power of two of at least 16 (the Triton lowering and the matrix units need it).

    Attributes:
      block_q, block_kv, num_warps, num_stages: forward kernel (grid over query tiles).
      block_q_dkv, block_kv_dkv, num_warps_dkv, num_stages_dkv: dK/dV kernel (grid over KV tiles).
      block_q_dq, block_kv_dq, num_warps_dq, num_stages_dq: dQ kernel (grid over query tiles).
      kv_splits: forward only: split each query tile's KV loop over this many programs and
        combine their partial results by their logsumexp and softmax denominators (FA2's
        parallelism over the sequence, for grids too small to fill the GPU: few heads, short
        query blocks). 0 (the default) picks it from the grid size and the GPU's core count;
        1 turns it off.
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_q_dkv: int = 32
    block_kv_dkv: int = 128
    num_warps_dkv: int = 4
    num_stages_dkv: int = 3
    block_q_dq: int = 128
    block_kv_dq: int = 32
    num_warps_dq: int = 4
    num_stages_dq: int = 3
    kv_splits: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("block_"):
                if not _is_power_of_two(value) or value < 16:
                    raise ValueError(
                        f"BlockSizes.{field.name}={value!r} must be a power of two >= 16"
                    )
            elif field.name == "kv_splits":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"BlockSizes.kv_splits={value!r} must be an int >= 0")
            elif field.name.startswith("num_warps"):
                if not _is_power_of_two(value):
                    raise ValueError(f"BlockSizes.{field.name}={value!r} must be a power of two")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int")


# Defaults for sm90 (H100/H200), bf16/fp16, by padded head dim: the best of a tile sweep at seq
# 4096 on the H200 (docs/notes/tuning.md, "Tiles and the tuner").
_HOPPER = {
    64: BlockSizes(
        block_q=64,
        block_kv=64,
        num_warps=4,
        num_stages=3,
        block_q_dkv=32,
        block_kv_dkv=128,
        num_warps_dkv=4,
        num_stages_dkv=3,
        block_q_dq=128,
        block_kv_dq=64,
        num_warps_dq=8,
        num_stages_dq=3,
    ),
    128: BlockSizes(
        block_q=128,
        block_kv=128,
        num_warps=8,
        num_stages=3,
        block_q_dkv=64,
        block_kv_dkv=128,
        num_warps_dkv=8,
        num_stages_dkv=3,
        block_q_dq=128,
        block_kv_dq=64,
        num_warps_dq=8,
        num_stages_dq=3,
    ),
    256: BlockSizes(
        block_q=128,
        block_kv=64,
        num_warps=8,
        num_stages=2,
        block_q_dkv=64,
        block_kv_dkv=64,
        num_warps_dkv=8,
        num_stages_dkv=2,
        block_q_dq=64,
        block_kv_dq=32,
        num_warps_dq=4,
        num_stages_dq=1,
    ),
}
_HOPPER[16] = _HOPPER[32] = _HOPPER[64]

# Forward tiles when each query sees a narrow band of keys (a local window of a few tiles, packed
# documents): at H=128, 64 x 64 tiles waste less on the band's two ragged edges (measured on the
# H200: docs/notes/masks.md, "Triton tiles for narrow bands").
_HOPPER_NARROW_FORWARD = {128: dict(block_q=64, block_kv=64, num_warps=4, num_stages=3)}
NARROW_BAND = 2048  # keys; a window at most this wide counts as narrow

# dK/dV tiles when rows see a range of keys (causal, a window, lengths or segments): at H=128 the
# masked steps' code spills with 64 query rows per step; 32 rows took 9-15% off the fwd+bwd
# of such calls on the H200, but cost dense calls 5-7%
# (docs/notes/backward.md, "Triton backward").
_HOPPER_RANGED_DKV = {128: dict(block_q_dkv=32)}

# Small tiles keep the interpreter fast and exercise multi-tile loops at test sizes.
_INTERPRET = BlockSizes(
    block_q=32, block_kv=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
)


def padded_head_dim(head_dim: int) -> int:
    """The power of two >= head_dim (and >= 16) that the kernels' tiles use."""
    return max(16, 1 << (head_dim - 1).bit_length())


# float32 tiles take twice the shared memory of bf16 ones: smaller tiles, two stages; at H=256 the
# backward kernels take one stage (with two, the dK/dV or dQ kernel asked the H200 for 232 KiB,
# over its 227, once masked tiles zero a copy of K and V).
_HOPPER_F32 = {
    hp: BlockSizes(
        block_q=64,
        block_kv=64 if hp <= 128 else 32,
        num_warps=4,
        num_stages=2,
        block_q_dkv=32,
        block_kv_dkv=64 if hp <= 128 else 32,
        num_warps_dkv=4,
        num_stages_dkv=2 if hp <= 128 else 1,
        block_q_dq=64,
        block_kv_dq=32,
        num_warps_dq=4,
        num_stages_dq=2 if hp <= 128 else 1,
    )
    for hp in (16, 32, 64, 128, 256)
}


def heuristic_block_sizes(
    head_dim: int, dtype, *, masked: bool = False, narrow: bool = False, ranged: bool = False
) -> BlockSizes:
    """Shipped defaults: per padded head dim and dtype, tuned on the H200 (sm90); used on every
    GPU without an autotune cache entry.

    A bias or dense mask adds a [block_q, block_kv] tile to each pipeline stage; with it the
    defaults keep at most two stages so that the kernels fit in the H200's 227 KiB of shared
    memory (three stages of K, V and a bias tile at H=128 need 288 KiB). `narrow`: each query
    sees a narrow band of keys (see narrow_band); the forward then takes smaller tiles.
    `ranged`: rows see a range of keys (`MaskSpec.has_key_ranges`); the dK/dV kernel then
    takes its own.
    """
    hp = padded_head_dim(head_dim)
    if jnp.dtype(dtype) == jnp.float32:
        return _HOPPER_F32[hp]
    bs = _HOPPER[hp]
    if narrow and hp in _HOPPER_NARROW_FORWARD:
        bs = dataclasses.replace(bs, **_HOPPER_NARROW_FORWARD[hp])
    if ranged and hp in _HOPPER_RANGED_DKV:
        bs = dataclasses.replace(bs, **_HOPPER_RANGED_DKV[hp])
    if masked:
        bs = dataclasses.replace(
            bs,
            num_stages=min(bs.num_stages, 2),
            num_stages_dkv=min(bs.num_stages_dkv, 2),
            num_stages_dq=min(bs.num_stages_dq, 2),
        )
    return bs


def default_block_sizes(
    head_dim: int,
    dtype,
    *,
    interpret: bool,
    masked: bool = False,
    narrow: bool = False,
    ranged: bool = False,
) -> BlockSizes:
    """Tiles for a call without an autotune entry: small ones in the interpreter, else the
    shipped heuristics (`masked`, `narrow`, `ranged`: see heuristic_block_sizes)."""
    if interpret:
        return _INTERPRET
    return heuristic_block_sizes(head_dim, dtype, masked=masked, narrow=narrow, ranged=ranged)


def narrow_band(spec) -> bool:
    """Whether each query of `spec` (a masks.MaskSpec) sees only a narrow band of keys: packed
    documents (segment ids), or a local window at most NARROW_BAND keys wide after the causal
    cut (the spec's left and right reach)."""
    if spec.has_segments:
        return True
    return spec.window is not None and spec.left + spec.right + 1 <= NARROW_BAND


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBlockSizes:
    """Tiles, launch parameters and split-KV choices of the decode kernel (`decode_attention`,
    `paged_attention`).

    Attributes:
      block_m: the most packed query rows (a KV head's group of query heads times the new
        tokens) one program holds; more rows take more programs, each reading the group's K/V.
      block_kv: keys per step of a program's loop; independent of a paged cache's page size.
      num_warps, num_stages: Triton launch parameters.
      kv_splits: programs per sequence (on average, with schedule="balanced") that share the
        keys, combined by logsumexp; 0 (the default) picks it by `split_rule`; 1 turns
        splitting off.
      split_rule: with kv_splits=0, "slots" (the default: about two waves of the GPU's CTA
        slots), "cores" (about eight programs per SM), "full-waves" (the cores rule lowered
        to a full last wave) or "occupancy" (`waves`, `min_split_keys`); each rule in full:
        docs/decoding.md, "The kernel".
      schedule: how split programs share the keys. "balanced": the key tiles of the whole batch
        are cut into equal runs, a sequence taking as many runs as its length needs, so a batch
        of ragged lengths keeps every program equally busy (XLA plans the runs once per call;
        each program reads its own); "sequence": each sequence's tiles are cut into kv_splits
        runs, whatever its length.
      merge: where split results are combined: "kernel" (one small Pallas kernel; the
        default, None), or "xla" (jnp reductions, three kernels; schedule="sequence" only).
      waves: with kv_splits=0, the programs fill at least this many waves of the GPU's CTA
        slots (SMs times `ctas_per_sm`), the last one at least 90% full.
      min_split_keys: with kv_splits=0, the fewest keys a split keeps (fewer splits otherwise).
      ctas_per_sm: programs one SM holds at once; 0 estimates it from the tiles (registers and
        shared memory, `decode_ctas_per_sm`).
    """

    block_m: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 0
    split_rule: str = "slots"
    schedule: str = "sequence"
    merge: str | None = None
    waves: int = 1
    min_split_keys: int = 256
    ctas_per_sm: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_kv"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value < 16:
                raise ValueError(f"DecodeBlockSizes.{name}={value!r} must be a power of two >= 16")
        if not _is_power_of_two(self.num_warps):
            raise ValueError(
                f"DecodeBlockSizes.num_warps={self.num_warps!r} must be a power of two"
            )
        for name, least in (
            ("num_stages", 1),
            ("kv_splits", 0),
            ("waves", 1),
            ("min_split_keys", 1),
            ("ctas_per_sm", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"DecodeBlockSizes.{name}={value!r} must be an int >= {least}")
        if self.split_rule not in ("slots", "cores", "full-waves", "occupancy"):
            raise ValueError(
                f"DecodeBlockSizes.split_rule={self.split_rule!r} must be 'slots', 'cores', "
                "'full-waves' or 'occupancy'"
            )
        if self.schedule not in ("balanced", "sequence"):
            raise ValueError(
                f"DecodeBlockSizes.schedule={self.schedule!r} must be 'balanced' or 'sequence'"
            )
        if self.merge not in (None, "kernel", "xla"):
            raise ValueError(
                f"DecodeBlockSizes.merge={self.merge!r} must be None, 'kernel' or 'xla'"
            )
        if self.merge == "xla" and self.schedule != "sequence":
            raise ValueError(
                "DecodeBlockSizes.merge='xla' needs schedule='sequence' (a balanced schedule's "
                "runs are merged by the kernel)"
            )


def decode_merge(block_sizes: DecodeBlockSizes) -> str:
    """Where a split call's partial results are combined ("kernel" or "xla")."""
    return block_sizes.merge or "kernel"


def decode_ctas_per_sm(
    block_sizes: DecodeBlockSizes,
    block_m: int,
    hp: int,
    itemsize: int,
    *,
    read_columns: int | None = None,
    query_columns: int | None = None,
    value_hp: int | None = None,
    cache_itemsize: int | None = None,
) -> int:
    """Decode programs one Hopper SM holds at once (64K registers, 227 KiB of shared memory,
    2048 threads), estimated from the tiles; `block_m` is the tile's rows after the clamp to
    the packed rows. The estimate follows ptxas' reading of the Triton kernel for sm_90a
    (benchmarks/triton_ir.py; H=128 bf16: 16-row tiles of 64 keys, 4 warps, 2 stages use ~128
    registers and 38 KiB: 4 per SM; 64-row tiles, 176 registers and 80 KiB: 2): a thread holds
    its share of the f32 accumulator and of two score tiles, and under mma.sync (fewer than 64
    rows) its fragments of a K and a V tile; shared memory holds num_stages - 1 K/V tile pairs
    under mma.sync, num_stages pairs and the query tile under wgmma (64 or more rows).

    Other cache formats (`triton.cache.CacheFormat`): read_columns, the padded columns of a
    key row and its value row (a shared latent cache's key row only; default 2 hp);
    query_columns, the query tile's (default hp); value_hp, the accumulator's (default hp);
    cache_itemsize, the bytes of a cached element (float8: 1; converting its tiles to 16 bits
    holds both in registers under mma.sync, 140 registers and 54 KiB at H=128 with 64-key
    tiles in 4 stages: 3 per SM, as ptxas reads them for 10 float8 tile choices; under wgmma
    the converted tiles go back to shared memory for the matrix units)."""
    if block_sizes.ctas_per_sm:
        return block_sizes.ctas_per_sm
    threads = 32 * block_sizes.num_warps
    bkv, stages = block_sizes.block_kv, block_sizes.num_stages
    wgmma = block_m >= 64 and block_sizes.num_warps % 4 == 0
    columns = 2 * hp if read_columns is None else read_columns
    query_columns = hp if query_columns is None else query_columns
    cache_itemsize = itemsize if cache_itemsize is None else cache_itemsize
    kv_pair = bkv * columns * cache_itemsize
    converted = cache_itemsize != itemsize
    words = block_m * (hp if value_hp is None else value_hp) + 2 * block_m * bkv
    if wgmma:
        smem = block_m * query_columns * itemsize + kv_pair * stages
        smem += bkv * columns * itemsize if converted else 0
    else:
        words += bkv * columns * itemsize // 4
        words += kv_pair // 4 if converted else 0
        smem = kv_pair * max(stages - 1, 0.5)
    regs = min(255, 32 + -(-words // threads))
    regs = -(-regs // 8) * 8
    by_regs = 65536 // (regs * threads)
    by_smem = (227 * 1024) // (smem + 7 * 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


# Small key tiles keep the interpreter fast and give several tiles at test sizes; three splits
# run the merge of partial results there, where the GPU's rule would not split such short
# caches.
_DECODE_INTERPRET = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, kv_splits=3)


def default_decode_block_sizes(
    head_dim: int,
    dtype,
    *,
    interpret: bool,
    page_size: int | None = None,
    rows: int = 1,
    fmt=None,
    cache_dtype=None,
) -> DecodeBlockSizes:
    """Decode tiles for a call: small ones in the interpreter, else the shipped defaults, from
    sweeps on the H200 (docs/notes/decode.md, "The defaults"). 64-key tiles, 4 warps, 2
    stages (3.7-3.9
    TB/s at B=8, 32k keys, H=128, bf16, contiguous and in pages of 16; 32- and 128-key tiles
    within 5%). Pages of a multiple of 128 keys take 128-key tiles, each one contiguous block
    of a page (3.9 TB/s against 3.5 with 64-key tiles). `rows` (the new tokens times the group
    of query heads a KV head serves) of 64 or more fill 64-row wgmma tiles, whose programs
    stream better from 32-key tiles in 4 stages (the same shared memory as 64-key tiles in 2;
    T=16 over 4 heads per KV head: 3.76 TB/s of kernel time against 3.46); 128 or more rows
    fill 128-row tiles of 64 keys, half the programs reading each K/V tile again (T=16 over 8
    or 16 heads per KV head, compute-bound: 1.41-1.45x faster than 64-row tiles). float32
    and H=256 halve the key tile to keep the stages in shared memory. `decode_block_sizes`
    refines these for a call's whole shape (its split count).

    fmt: the cache's `triton.cache.CacheFormat` (None: keys and values of their own). A shared
    latent cache with values wider than 256 columns (MLA's 512 + 64) takes, from 64 packed rows
    (MLA's 128 heads), 64-row tiles in 8 warps (two warpgroups share the 64 x 512 float32
    accumulator: 128 registers a thread) over 64-key tiles in 2 stages (216 KiB of shared
    memory in bfloat16, a few spills: 1.32-1.45x faster than 32-key tiles on the H100,
    docs/notes/decode.md, "MLA, float8 caches and speculative tokens"); a float8 latent cache
    keeps 32-key tiles there (64-key tiles ask for more shared memory than an SM has). Fewer
    rows (16 or 32 heads a device under tensor parallelism: memory-bound) take 64-key tiles in
    2 stages, in 4 warps up to 16 rows and 8 above (32-key tiles measured 0.64-0.86x of them).

    cache_dtype float8 keeps the tiles of the queries' dtype and doubles their stages, to 4 at
    most and 3 for 128-key tiles (pages of 128): the same bytes in flight from tiles of half the
    bytes (H100: 0.84-0.92 of the read ceiling where the batch fills the GPU; 128-key tiles in 3
    stages read 0.88 over pages of 128 against 0.85 in 4, docs/notes/decode.md)."""
    if interpret:
        return _DECODE_INTERPRET
    float8 = cache_dtype is not None and jnp.dtype(cache_dtype).itemsize == 1
    tiles = _decode_tiles(head_dim, dtype, page_size, rows, fmt, float8=float8)
    if float8:
        most = 3 if tiles.block_kv >= 128 else 4
        tiles = dataclasses.replace(tiles, num_stages=min(most, 2 * tiles.num_stages))
    return tiles


def _decode_tiles(
    head_dim: int, dtype, page_size, rows: int, fmt, *, float8: bool
) -> DecodeBlockSizes:
    if fmt is not None and fmt.shared and padded_head_dim(fmt.value_head_dim) > 256:
        if rows >= 64:
            block_kv = 32 if float8 else 64
            return DecodeBlockSizes(block_m=64, block_kv=block_kv, num_warps=8, num_stages=2)
        return DecodeBlockSizes(block_kv=64, num_warps=4 if rows <= 16 else 8, num_stages=2)
    wide = padded_head_dim(head_dim) > 128 or jnp.dtype(dtype) == jnp.float32
    if wide:
        return DecodeBlockSizes(block_kv=32)
    if page_size is not None and page_size % 128 == 0:
        return DecodeBlockSizes(block_kv=128)
    if rows >= 128:
        return DecodeBlockSizes(block_m=128)
    if rows >= 64:
        return DecodeBlockSizes(block_kv=32, num_stages=4)
    return DecodeBlockSizes(block_kv=64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedBlockSizes:
    """Tiles of the ragged paged attention kernel (`ragged_paged_attention`): two launches, one
    per kind of sequence, each with its own tiles.

    A sequence's packed rows are its new tokens times the query heads of a KV head (the
    decode kernel's rows). Sequences of at most `block_m` packed rows (decode steps, a few
    speculative tokens) take one `block_m`-row tile each, in the decode launch; longer ones
    (prefill chunks) are cut into `block_m_prefill`-row tiles, in the prefill launch.

    Attributes:
      block_m, block_kv, num_warps, num_stages: the decode launch's rows (and the most packed
        rows a decode sequence has), key tile and Triton launch parameters.
      kv_splits: programs that share each decode tile's keys, merged by their softmax
        denominators; 0 (the default) fills the GPU's CTA slots as the decode kernel's
        "slots" rule does; 1 turns splitting off.
      block_m_prefill, block_kv_prefill, num_warps_prefill, num_stages_prefill,
        kv_splits_prefill: the same for the prefill launch.
    """

    block_m: int = 16
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 0
    block_m_prefill: int = 128
    block_kv_prefill: int = 64
    num_warps_prefill: int = 8
    num_stages_prefill: int = 3
    kv_splits_prefill: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            name = f"RaggedBlockSizes.{field.name}={value!r}"
            if field.name.startswith("block_"):
                if not _is_power_of_two(value) or value < 16:
                    raise ValueError(f"{name} must be a power of two >= 16")
            elif field.name.startswith("num_warps"):
                if not _is_power_of_two(value):
                    raise ValueError(f"{name} must be a power of two")
            else:
                least = 0 if field.name.startswith("kv_splits") else 1
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ValueError(f"{name} must be an int >= {least}")


# Small tiles in the interpreter: several key tiles and prefill tiles at test sizes, and the
# decode launch split in three, so that its merge runs.
_RAGGED_INTERPRET = RaggedBlockSizes(
    block_m=16,
    block_kv=16,
    num_stages=1,
    kv_splits=3,
    block_m_prefill=32,
    block_kv_prefill=16,
    num_warps_prefill=4,
    num_stages_prefill=1,
    kv_splits_prefill=1,
)


def default_ragged_block_sizes(
    head_dim: int,
    dtype,
    *,
    group: int,
    interpret: bool,
    page_size: int | None = None,
    fmt=None,
    cache_dtype=None,
) -> RaggedBlockSizes:
    """The ragged kernel's tiles for a call: small ones in the interpreter; else the decode
    launch takes the decode kernel's tiles for one new token (`default_decode_block_sizes`)
    with rows for a KV head's `group` of query heads (at least 16), and the prefill launch the
    forward kernel's tiles (`heuristic_block_sizes`: its query tile as rows, which hold a tile
    of tokens times the group). A shared latent cache with values wider than 256 columns
    (`default_decode_block_sizes`, fmt) takes the decode kernel's tiles for its group in the
    decode launch (of the group's rows, at most 64), and 64-row tiles in 8 warps in the prefill
    launch (a 128-row tile's 512-column float32 accumulator would not fit the registers) of 64
    keys as `paged_attention`'s from 64 rows (32 over a float8 cache): a decode step of MLA's
    128 heads is two prefill tiles."""
    if interpret:
        return _RAGGED_INTERPRET
    decode = default_decode_block_sizes(
        head_dim,
        dtype,
        interpret=False,
        page_size=page_size,
        rows=group,
        fmt=fmt,
        cache_dtype=cache_dtype,
    )
    if fmt is not None and fmt.shared and padded_head_dim(fmt.value_head_dim) > 256:
        float8 = cache_dtype is not None and jnp.dtype(cache_dtype).itemsize == 1
        return RaggedBlockSizes(
            block_m=min(64, max(16, 1 << (group - 1).bit_length())),
            block_kv=decode.block_kv,
            num_warps=decode.num_warps,
            num_stages=decode.num_stages,
            block_m_prefill=64,
            block_kv_prefill=32 if float8 else 64,
            num_warps_prefill=8,
            num_stages_prefill=2,
        )
    forward = heuristic_block_sizes(head_dim, dtype)
    return RaggedBlockSizes(
        block_m=max(16, 1 << (group - 1).bit_length()),
        block_kv=decode.block_kv,
        num_warps=decode.num_warps,
        num_stages=decode.num_stages,
        block_m_prefill=forward.block_q,
        block_kv_prefill=forward.block_kv,
        num_warps_prefill=forward.num_warps,
        num_stages_prefill=forward.num_stages,
    )
