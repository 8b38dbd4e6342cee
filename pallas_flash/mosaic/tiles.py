"""The Mosaic GPU forward's tiles, their defaults and budgets (shared memory, registers), and
the rules of what the kernels take (`why_not`): what the dispatch checks before it chooses them
(`mosaic.why_not_forward`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Head dims the forward (and the backward) take, each run as it is (within wgmma's N limit of
# 256): their shared memory tiles take the swizzle of `swizzle_bytes`.
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
# TMA and wgmma swizzles (bytes), widest first. wgmma takes one swizzle for both operands
# and contracts over whole column tiles (swizzle // itemsize elements, the row of an
# (8, columns) tile): a head dim runs natively at the widest that divides its row in bytes.
SWIZZLES = (128, 64, 32)
# Mosaic GPU tiles the sequence dim of every TMA window over [.., L, H] in GMEM by the 8-row
# swizzle tile and refuses a length that is not a multiple of it (TileTransform.
# transform_gmem_shape in jax/experimental/mosaic/gpu/launch_context.py): the wrapper pads T and
# S up to it (a copy of q, k, v, out). Any multiple of 8 runs in place: the last tiles' windows
# run past the arrays' ends, where TMA reads zeros and drops writes, and the kernels mask the
# keys past S.
ROW_ALIGN = 8
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
NUM_CONSUMERS = 2  # consumer warpgroups per CTA; the producer is warpgroup NUM_CONSUMERS
# Shared memory one CTA may use on sm_90 (227 KiB), less 4 KiB for what Mosaic GPU adds to the
# kernel's own buffers: its cross-warp reduction scratch (2 KiB by default) and the barriers.
SMEM_BYTES = (227 - 4) * 1024
# Registers per thread if the SM's 65536 were spread over one warpgroup's 128 threads: what the
# warpgroups of a CTA share out between them (setmaxnreg, in multiples of 8).
REGISTER_FILE = 512
# The forward's producer warpgroup: it only issues TMA copies (persistent, it also walks the
# work items). 40 registers leave its two consumers 232 each (128 * (2 * 232 + 40) <= 65536).
# The backward's producers run on 24 (`backward_tiles.BACKWARD_PRODUCER_REGISTERS`), measured
# there; the forward's split at 24 is not measured yet (docs/notes/forward.md, "Open").
FORWARD_PRODUCER_REGISTERS = 40


def consumer_registers(num_consumers: int, producer_registers: int) -> int:
    """Registers per consumer thread so that num_consumers consumer warpgroups and a producer of
    producer_registers fit the register file: setmaxnreg takes multiples of 8, and a kernel's
    consumers take at most 240."""
    per_consumer = (REGISTER_FILE - producer_registers) // num_consumers
    return min(240, per_consumer // 8 * 8)


# The forward's consumer warpgroups (NUM_CONSUMERS of them, each with a [block_q, Hv] f32
# accumulator and a [block_q, block_kv] tile of logits): 232 registers each.
FORWARD_CONSUMER_REGISTERS = consumer_registers(NUM_CONSUMERS, FORWARD_PRODUCER_REGISTERS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardTiles:
    """Tiles of the Mosaic GPU forward.

    Attributes:
      block_q: query rows per consumer warpgroup (a CTA covers NUM_CONSUMERS * block_q rows).
        wgmma works on 64-row slabs: a multiple of 64.
      block_kv: keys per KV tile (one wgmma N dim for Q.K^T, K dim for P.V): a multiple of 64.
      num_stages: KV tiles in flight in the shared-memory ring (>= 2 to overlap TMA and wgmma).
      persistent: launch one CTA per SM (or per item, when there are fewer) that walks its
        share of the (batch, head, query tile) work items in turn, instead of a CTA per item.
        The K/V ring then runs on from one item into the next and the next item's Q loads
        during this one (a second Q buffer), so that short rows (few KV steps per item) stop
        paying a CTA's launch, Q load and ring fill per item.
      causal_pairs: a persistent CTA of a causal call whose rows see keys 0..i (no window's
        left side, no segment ids, T <= S, an even number of CTA query tiles) takes a head's
        query tiles in pairs (Q - 1 - i, i) of equal work, the heads' pairs in turn, so that
        the CTAs of a round share K/V in L2 (`schedule._Work`); False, or where the rows differ
        otherwise: every head's longest query tiles first, the rounds in a snake. Measured on
        the H200 in kernel time, pairs against the snake: H=128 causal 1k-8k 2-16% faster,
        16k even; H=64 4k 5% and 8k 2% faster, 512 and 16k even.
      step_descriptors: each consumer addresses its Q through an index that is 0 but that the
        compiler cannot see through (`launch.opaque_zero` of the KV step), so that Q's wgmma
        descriptors are rebuilt every step instead of computed once per item and held, two
        registers each (8 of them at block_q=128, H=64, where the consumer spills 12 bytes
        held and none rebuilt, and runs 4-8% faster;
        docs/notes/forward.md, "Step descriptors at H=64"); False: held.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    persistent: bool = False
    causal_pairs: bool = True
    step_descriptors: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 64:
                raise ValueError(f"ForwardTiles.{name}={value!r} must be a positive multiple of 64")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"ForwardTiles.num_stages={self.num_stages!r} must be an int >= 2")
        for name in ("persistent", "causal_pairs", "step_descriptors"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ForwardTiles.{name}={getattr(self, name)!r} must be a bool")

    @property
    def cta_rows(self) -> int:
        return NUM_CONSUMERS * self.block_q

    @property
    def q_buffers(self) -> int:
        """Q buffers per consumer: a persistent CTA loads the next item's Q into the second."""
        return 2 if self.persistent else 1

    def smem_bytes(
        self,
        head_dim: int,
        itemsize: int,
        *,
        segments: bool = False,
        value_head_dim: int | None = None,
    ) -> int:
        """Shared memory of one CTA at the head dims of q/k and of v (value_head_dim; None:
        head_dim): Q per consumer (twice when persistent), which holds the output tile when the
        two head dims are equal, else an output tile per consumer; the K and V rings; the lse
        and log_sum rows and, with segment ids, the consumers' query ids (as Q) and a ring of KV
        ids (int32)."""
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        q = self.q_buffers * self.cta_rows * head_dim * itemsize
        out = 0 if value_head_dim == head_dim else self.cta_rows * value_head_dim * itemsize
        kv = self.num_stages * self.block_kv * (head_dim + value_head_dim) * itemsize
        ids = (self.q_buffers * self.cta_rows + self.num_stages * self.block_kv) * 4
        ids = ids if segments else 0
        return q + out + kv + 2 * self.cta_rows * 4 + ids


def swizzle_bytes(head_dim: int, itemsize: int) -> int:
    """The swizzle (bytes) of the kernels' shared-memory tiles of `head_dim` columns: the
    widest of SWIZZLES that divides a row, 128 at H 64/128/192/256, 64 at H=96 (three
    32-column tiles), 32 at H=80 (five 16-column tiles)."""
    row = head_dim * itemsize
    for swizzle in SWIZZLES:
        if row % swizzle == 0:
            return swizzle
    raise ValueError(f"{head_dim=} x {itemsize} bytes is not a multiple of {SWIZZLES[-1]} bytes")


def aligned_len(length: int) -> int:
    """The sequence length the kernels run a call of `length` at (ROW_ALIGN)."""
    return -(-length // ROW_ALIGN) * ROW_ALIGN


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Causal rows (keys) up to which persistent CTAs, in their snake order, measured faster than a
# CTA per item (kernel time on the H200,
# docs/notes/forward.md, "Persistent CTAs and causal pairs"): at H=64 up to
# the longest measured (512 +38%, 4k +10%, 8k +7%, 16k +2.5%); at H=128 up to 8k (MHA 1k +11%,
# 2k even, 4k +4%, 8k +2%, 16k -2%; GQA 2k +11%, 4k +10%, 8k +6%, 16k -0.5%).
PERSISTENT_CAUSAL_KEYS_H64 = 16384
PERSISTENT_CAUSAL_KEYS_H128 = 8192
# A causal window of at most half the keys leaves most rows seeing the same number of keys:
# persistent up to the longest measured, (8192, 0) at 16k keys (8192 keys left of the diagonal
# and its own; wall and kernel time, +2-9%).
PERSISTENT_WINDOW_KEYS = 8192 + 1
# Plain H=64 rows of 128-row consumers rebuild Q's descriptors each step from this many keys:
# 4-8% faster from 2k to 16k on the H200 (at 1k 1.04-1.05x cuDNN in the grid against 0.99x
# held a run earlier); at 512 keys (4 steps an item) 19% slower
# (docs/notes/forward.md, "Step descriptors at H=64").
STEP_DESCRIPTORS_MIN_KEYS = 1024


def default_tiles(
    head_dim: int,
    *,
    value_head_dim: int | None = None,
    q_len: int,
    kv_len: int,
    is_causal: bool,
    window=None,
    soft_cap=None,
    segments: bool = False,
    wide: bool = True,
) -> ForwardTiles:
    """Tiles per head dim and call, from tile probes on the H200
    (docs/notes/forward.md, "Mosaic forward: tiles"). Two stages: deeper rings cost shared
    memory without hiding more latency. H=256 halves block_kv: two stages of 128-key K and V
    tiles would need 256 KiB of shared memory.
    At H=64 a 64-row consumer's wgmma is short next to its softmax, so the MMA pipe idles: plain
    non-causal calls take 128 rows per consumer (they need T % 256 == 0), whose Q descriptors
    are rebuilt each step from STEP_DESCRIPTORS_MIN_KEYS (`ForwardTiles.step_descriptors`:
    held, they spill); causal calls, a window, soft cap or segment ids keep 64
    rows, whose registers leave room for the mask and for zeroing non-finite V on masked steps
    (at 128 rows that zeroing made the causal forward 1.32x slower, B=4, 4k, on the H200). 80
    and 96 take the tiles of 128, 192 those of 256 (64-key tiles).
    Persistent CTAs pay a CTA's start (launch, Q load, ring fill) once per SM instead of once
    per item, with 64-row items (finer items balance better): every call at H <= 128 but
    causal ones whose rows see more keys than the PERSISTENT_CAUSAL_KEYS_* bounds, which run
    faster with a CTA per item (their long query tiles first), unless a window of at most
    half the keys (and PERSISTENT_WINDOW_KEYS) evens the rows out. Soft caps and segment ids
    go as plain calls do (gpt-oss's window of 128 keys: 0.283 ms per item, 0.215
    persistent).
    At H=64, plain non-causal rows of 4k-8k keys whose T is not a multiple of 256 take 64 x 256
    tiles, a CTA per item: half the steps, each step's fixed cost spread over twice the keys
    (1-6% over 128 x 128 persistent with held descriptors; 4-5% behind it with rebuilt ones).
    Causal rows go in pairs (`ForwardTiles.causal_pairs`): their rounds share K/V in L2 (kernel
    time against the snake: H=128 1k 14% faster, 2k 16%, 4k 9%, 8k 5%, with GQA 2k-8k 2-6%;
    H=64 4k 5%, 8k 2%; even at 16k and at H=64 512).
    A value head dim of its own (value_head_dim, None: head_dim) takes the tiles of the larger
    of the two: MLA's (192, 128) those of 192. wide=False: 64-row consumers at H=64 too (for a
    grid too small to fill the GPU with 128)."""
    head_dim = max(head_dim, head_dim if value_head_dim is None else value_head_dim)
    masked = window is not None or soft_cap is not None or segments
    # Causal rows (top-left aligned) see at most min(T, S) keys, fewer under a window.
    row_keys = min(q_len, kv_len) if window is None else min(q_len, kv_len, window[0] + 1)
    short_window = (
        window is not None and window[0] + 1 <= PERSISTENT_WINDOW_KEYS and window[0] <= kv_len // 2
    )
    causal_keys = PERSISTENT_CAUSAL_KEYS_H64 if head_dim <= 64 else PERSISTENT_CAUSAL_KEYS_H128
    long_causal_rows = is_causal and not short_window and row_keys > causal_keys
    persistent = head_dim <= 128 and not long_causal_rows
    plain_h64 = head_dim == 64 and not masked and not is_causal
    if plain_h64 and wide and q_len % (NUM_CONSUMERS * 128) == 0:
        step_descriptors = kv_len >= STEP_DESCRIPTORS_MIN_KEYS
        return ForwardTiles(
            block_q=128,
            block_kv=128,
            num_stages=2,
            persistent=persistent,
            step_descriptors=step_descriptors,
        )
    if plain_h64 and 4096 <= kv_len < 16384:
        return ForwardTiles(block_q=64, block_kv=256, num_stages=2)
    if head_dim <= 128:
        return ForwardTiles(block_q=64, block_kv=128, num_stages=2, persistent=persistent)
    return ForwardTiles(block_q=64, block_kv=64, num_stages=2)


# -- the ragged prefill (`pallas_flash.mosaic.ragged`) ---------------------------------------------


def ragged_prefill_tiles(head_dim: int, value_head_dim: int | None = None) -> ForwardTiles:
    """The tiles of the ragged prefill: the forward's causal ones (64-row consumers, persistent;
    128-key tiles up to H=128, 64 above)."""
    widest = max(head_dim, head_dim if value_head_dim is None else value_head_dim)
    return ForwardTiles(block_q=64, block_kv=128 if widest <= 128 else 64, persistent=True)


def ragged_prefill_q_buffers(tiles: ForwardTiles, head_dim: int, value_head_dim: int, itemsize):
    """Q buffers per consumer of the ragged prefill: two (the next item's Q loads during this
    one) where they fit in shared memory, else one (H=256: it loads after this item's
    epilogue)."""
    smem = tiles.smem_bytes(head_dim, itemsize, value_head_dim=value_head_dim)
    return 2 if smem <= SMEM_BYTES else 1


def page_copies(page_size: int, block_kv: int) -> int | None:
    """TMA copies per K (or V) tile: block_kv / page_size where pages are shorter than a tile,
    1 where a tile is part of one page; None where neither divides the other (not run here)."""
    if page_size % 8:
        return None
    if block_kv % page_size == 0:
        return block_kv // page_size
    if page_size % block_kv == 0:
        return 1
    return None


# Per consumer thread, the f32 accumulator [block_q, Hv] and logits [block_q, block_kv] take
# block_q * (Hv + block_kv) / 128 registers; beyond this the 232-register budget spills.
MAX_TILE_REGISTERS = 192
# CUDA runtimes whose ptxas miscompiles the causal mask of this kernel's shape (jax's own
# Hopper attention refuses causal on them too: jax/experimental/pallas/ops/gpu/attention_mgpu.py).
CAUSAL_MISCOMPILING_CUDA = range(12080, 12091)


def unsupported_options(spec, *, soft_cap=None, has_bias: bool) -> str | None:
    """The options of a call (spec: a masks.MaskSpec) that this kernel would drop, named as the
    API names them; None if there are none. It takes windows, soft caps and segment ids
    (soft_cap is accepted for the backward module's signature)."""
    unsupported = [
        name
        for name, present in (("bias", has_bias), ("mask", spec.mask_shape is not None))
        if present
    ]
    return " and ".join(unsupported) or None


def check_options(
    *, is_causal: bool, window, soft_cap, cuda_runtime_version: int | None
) -> str | None:
    """The rules on the mask options that the Mosaic kernels share (windows and soft caps as in
    `MaskSpec`); None if they hold, else why not."""
    if window is not None and (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)
    ):
        return f"{window=} must be a (left, right) pair of ints >= 0"
    if soft_cap is not None and not (
        isinstance(soft_cap, (int, float))
        and not isinstance(soft_cap, bool)
        and 0 < soft_cap < float("inf")
    ):
        return f"{soft_cap=} must be a finite positive number"
    # A window's element-wise mask is the causal mask's comparison at other offsets: refused on
    # the same runtimes until it is shown to compile correctly there.
    if (is_causal or window is not None) and cuda_runtime_version in CAUSAL_MISCOMPILING_CUDA:
        what = "is_causal=True" if is_causal else f"{window=}"
        return (
            f"{what} on CUDA runtime {cuda_runtime_version} (ptxas 12.8.0-12.9.0 miscompiles its "
            "mask)"
        )
    return None


def check_shapes(q_shape, k_shape, dtype) -> str | None:
    """The rules the Mosaic kernels share: q [B, T, N, H] and k [B, S, K, H] with K dividing N,
    bfloat16 or float16; None if they hold, else why not."""
    if len(q_shape) != 4 or len(k_shape) != 4:
        return f"q {tuple(q_shape)} and k {tuple(k_shape)} must be [B, T, N, H] and [B, S, K, H]"
    batch, _, num_heads, head_dim = q_shape
    kv_batch, _, num_kv_heads, kv_head_dim = k_shape
    if (kv_batch, kv_head_dim) != (batch, head_dim):
        return f"k {tuple(k_shape)} does not match q {tuple(q_shape)} in batch or head dim"
    if num_heads % num_kv_heads:
        return f"{num_heads=} must be divisible by {num_kv_heads=}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
    return None


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
    tiles: ForwardTiles | None = None,
    cuda_runtime_version: int | None = None,
) -> str | None:
    """Why the kernel cannot run on these shapes and options, or None when it can (the caller
    falls back to Triton). `value_head_dim`: Hv of v [B, S, K, Hv] (None: q's H), one of
    HEAD_DIMS too; `window` and `soft_cap` as in `MaskSpec` and `KernelConfig`; `segments`: the
    call has segment ids (or sequence lengths), whose id buffers take shared memory;
    `cuda_runtime_version`: the target's (`Device.cuda_runtime_version`), None when not known."""
    if reason := check_options(
        is_causal=is_causal,
        window=window,
        soft_cap=soft_cap,
        cuda_runtime_version=cuda_runtime_version,
    ):
        return reason
    if reason := check_shapes(q_shape, k_shape, dtype):
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
    if tiles is None:
        tiles = default_tiles(
            head_dim,
            value_head_dim=value_head_dim,
            q_len=q_len,
            kv_len=kv_len,
            is_causal=is_causal,
            window=window,
            soft_cap=soft_cap,
            segments=segments,
        )
    dims = f"{head_dim=}" + ("" if value_head_dim == head_dim else f", {value_head_dim=}")
    if tiles.block_kv > 256:
        return f"block_kv={tiles.block_kv} exceeds the wgmma N limit of 256"
    # The accumulator is [block_q, Hv]: the value head dim counts here, not q's.
    registers = tiles.block_q * (value_head_dim + tiles.block_kv) // 128
    if registers > MAX_TILE_REGISTERS:
        return (
            f"{tiles} needs {registers} registers per thread for the accumulator and logits at "
            f"{dims}, over {MAX_TILE_REGISTERS} (it would spill)"
        )
    smem = tiles.smem_bytes(
        head_dim, jnp.dtype(dtype).itemsize, segments=segments, value_head_dim=value_head_dim
    )
    if smem > SMEM_BYTES:
        return f"{tiles} needs {smem} bytes of shared memory at {dims}, over {SMEM_BYTES}"
    return None
