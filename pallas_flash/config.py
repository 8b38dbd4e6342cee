"""Kernel tile configuration: `BlockSizes` and the defaults picked per head dim, dtype and GPU."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import warnings

import jax.numpy as jnp

from pallas_flash.device import (  # noqa: F401  re-exported: callers read config.gpu_*
    gpu_compute_capability,
    gpu_core_count,
    gpu_device_kind,
)
from pallas_flash.mosaic.backward import BackwardTiles
from pallas_flash.mosaic.forward import ForwardTiles


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
        combine their partial results by logsumexp (FA2's parallelism over the sequence, for
        grids too small to fill the GPU: few heads, short query blocks). 0 (the default) picks
        it from the grid size and the GPU's core count; 1 turns it off.
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
# 4096 on the H200 (benchmarks/NOTES.md, "Triton forward" and "Triton backward").
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
# H200: benchmarks/NOTES.md, "Masks").
_HOPPER_NARROW_FORWARD = {128: dict(block_q=64, block_kv=64, num_warps=4, num_stages=3)}
NARROW_BAND = 2048  # keys; a window at most this wide counts as narrow

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeClass:
    """What the best tiles depend on; the key of the autotune cache."""

    dtype: str
    head_dim: int  # padded to a power of two
    is_causal: bool
    masked: bool  # a bias or dense mask adds a tile per pipeline stage
    seq: str  # "short" (<= 1k), "medium" (<= 4k) or "long"
    narrow: bool = False  # each query sees a narrow band of keys (windows, packed documents)

    @classmethod
    def of(cls, head_dim, dtype, *, is_causal, q_len, kv_len, masked, narrow=False):
        longest = max(q_len, kv_len)
        seq = "short" if longest <= 1024 else "medium" if longest <= 4096 else "long"
        return cls(
            dtype=jnp.dtype(dtype).name,
            head_dim=padded_head_dim(head_dim),
            is_causal=bool(is_causal),
            masked=bool(masked),
            seq=seq,
            narrow=bool(narrow),
        )

    def key(self) -> str:
        return (
            f"{self.dtype}/h{self.head_dim}/{'causal' if self.is_causal else 'full'}/"
            f"{'masked' if self.masked else 'plain'}/{self.seq}{'/narrow' if self.narrow else ''}"
        )


def tune_cache_path() -> pathlib.Path:
    """Where `python -m pallas_flash.tune` writes: $PALLAS_FLASH_TUNE_CACHE, else
    ~/.cache/pallas_flash/tune.json."""
    env = os.environ.get("PALLAS_FLASH_TUNE_CACHE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "pallas_flash" / "tune.json"


# The key of a cache entry that holds the Mosaic GPU kernels' tiles (Hopper), beside the
# BlockSizes fields of the Triton kernels: {"forward": ForwardTiles fields, "backward":
# BackwardTiles fields}, either optional.
MOSAIC_KEY = "mosaic"


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiles of the Mosaic GPU kernels (Hopper); None: the kernel's defaults for the shapes."""

    forward: ForwardTiles | None = None
    backward: BackwardTiles | None = None


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One autotune cache entry: the Triton kernels' tiles and, on Hopper, the Mosaic ones
    (None: the Mosaic kernel's defaults)."""

    block_sizes: BlockSizes
    mosaic_forward: ForwardTiles | None = None
    mosaic_backward: BackwardTiles | None = None

    @property
    def mosaic(self) -> MosaicTiles:
        return MosaicTiles(self.mosaic_forward, self.mosaic_backward)

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self.block_sizes)
        mosaic = {
            name: dataclasses.asdict(tiles)
            for name, tiles in (
                ("forward", self.mosaic_forward),
                ("backward", self.mosaic_backward),
            )
            if tiles is not None
        }
        if mosaic:
            fields[MOSAIC_KEY] = mosaic
        return fields

    @classmethod
    def from_json(cls, fields: dict) -> TunedEntry:
        fields = dict(fields)
        mosaic = fields.pop(MOSAIC_KEY, {})
        if not isinstance(mosaic, dict) or set(mosaic) - {"forward", "backward"}:
            raise ValueError(f"{MOSAIC_KEY!r} must map 'forward'/'backward' to tiles: {mosaic}")
        forward, backward = mosaic.get("forward"), mosaic.get("backward")
        return cls(
            BlockSizes(**fields),
            None if forward is None else ForwardTiles(**forward),
            None if backward is None else BackwardTiles(**backward),
        )


@functools.cache
def _load_tune_cache(path: str) -> dict:
    """{gpu kind: {shape class key: TunedEntry}} from the cache file; {} if there is none.

    A file that cannot be read warns once and is ignored: tiles then come from the heuristics.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
        return {
            kind: {key: TunedEntry.from_json(fields) for key, fields in entries.items()}
            for kind, entries in raw.items()
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        warnings.warn(f"pallas_flash: ignoring the autotune cache {path}: {e}", stacklevel=3)
        return {}


# Autotuned entries shipped with the library (`python -m pallas_flash.tune` on the H200; same
# format as the cache file). The user's cache file takes precedence.
SHIPPED_TUNE_TABLE = pathlib.Path(__file__).with_name("tuned.json")


def tuned_entry(device_kind: str | None, shape_class: ShapeClass) -> TunedEntry | None:
    """The autotune entry for this GPU kind and shape class: the user's cache entry, else the
    shipped table's, else None."""
    if device_kind is None:
        return None
    key = shape_class.key()
    for path in (tune_cache_path(), SHIPPED_TUNE_TABLE):
        found = _load_tune_cache(str(path)).get(device_kind, {}).get(key)
        if found is not None:
            return found
    return None


def tuned_block_sizes(device_kind: str | None, shape_class: ShapeClass) -> BlockSizes | None:
    """The autotuned Triton tiles for this GPU kind and shape class, or None."""
    entry = tuned_entry(device_kind, shape_class)
    return None if entry is None else entry.block_sizes


def save_tuned(device_kind: str, found: dict[ShapeClass, TunedEntry], path=None):
    """Merges `found` into the autotune cache file (creating it) and reloads it."""
    path = pathlib.Path(path or tune_cache_path())
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raw = {}
    entries = raw.setdefault(device_kind, {})
    for shape_class, entry in found.items():
        entries[shape_class.key()] = entry.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    _load_tune_cache.cache_clear()


def save_tuned_block_sizes(device_kind: str, found: dict[ShapeClass, BlockSizes], path=None):
    """save_tuned for entries with Triton tiles only."""
    save_tuned(device_kind, {cls: TunedEntry(bs) for cls, bs in found.items()}, path)


def heuristic_block_sizes(
    head_dim: int, dtype, *, masked: bool = False, narrow: bool = False
) -> BlockSizes:
    """Shipped defaults: per padded head dim and dtype, tuned on the H200 (sm90); used on every
    GPU without an autotune cache entry.

    A bias or dense mask adds a [block_q, block_kv] tile to each pipeline stage; with it the
    defaults keep at most two stages so that the kernels fit in the H200's 227 KiB of shared
    memory (three stages of K, V and a bias tile at H=128 need 288 KiB). `narrow`: each query
    sees a narrow band of keys (see narrow_band); the forward then takes smaller tiles.
    """
    hp = padded_head_dim(head_dim)
    if jnp.dtype(dtype) == jnp.float32:
        return _HOPPER_F32[hp]
    bs = _HOPPER[hp]
    if narrow and hp in _HOPPER_NARROW_FORWARD:
        bs = dataclasses.replace(bs, **_HOPPER_NARROW_FORWARD[hp])
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
    has_bias: bool = False,
    has_mask: bool = False,
    is_causal: bool = False,
    q_len: int = 1,
    kv_len: int = 1,
    narrow: bool = False,
    device_kind: str | None = None,
) -> BlockSizes:
    """Tiles for a call: small ones in the interpreter; on a GPU the autotune cache's entry for
    (GPU kind, shape class) when there is one, else the shipped heuristics. `narrow`: see
    narrow_band."""
    if interpret:
        return _INTERPRET
    masked = has_bias or has_mask
    shape_class = ShapeClass.of(
        head_dim,
        dtype,
        is_causal=is_causal,
        q_len=q_len,
        kv_len=kv_len,
        masked=masked,
        narrow=narrow,
    )
    tuned = tuned_block_sizes(device_kind or gpu_device_kind(), shape_class)
    return tuned or heuristic_block_sizes(head_dim, dtype, masked=masked, narrow=narrow)


def tuned_mosaic_tiles(
    head_dim: int,
    dtype,
    *,
    is_causal: bool,
    q_len: int,
    kv_len: int,
    narrow: bool = False,
    device_kind: str | None = None,
) -> MosaicTiles:
    """The Mosaic kernels' tiles of the autotune cache's entry for a call (Mosaic calls carry
    no bias or dense mask: the unmasked shape class); all None without one."""
    shape_class = ShapeClass.of(
        head_dim,
        dtype,
        is_causal=is_causal,
        q_len=q_len,
        kv_len=kv_len,
        masked=False,
        narrow=narrow,
    )
    entry = tuned_entry(device_kind or gpu_device_kind(), shape_class)
    return MosaicTiles() if entry is None else entry.mosaic


def narrow_band(spec) -> bool:
    """Whether each query of `spec` (a masks.MaskSpec) sees only a narrow band of keys: packed
    documents (segment ids), or a local window at most NARROW_BAND keys wide after the causal
    cut (the spec's left and right reach)."""
    if spec.has_segments:
        return True
    return spec.window is not None and spec.left + spec.right + 1 <= NARROW_BAND


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBlockSizes:
    """Tiles and launch parameters of the decode kernel (`decode_attention`, `paged_attention`).

    Attributes:
      block_m: the most packed query rows (a KV head's group of query heads times the new
        tokens) one program holds; more rows take more programs, each reading the group's K/V.
      block_kv: keys per step of a program's loop; independent of a paged cache's page size.
      num_warps, num_stages: Triton launch parameters.
      kv_splits: programs that share one sequence's keys, combined by logsumexp; 0 (the
        default) picks it from the grid size and the GPU's core count; 1 turns it off.
    """

    block_m: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_kv"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value < 16:
                raise ValueError(f"DecodeBlockSizes.{name}={value!r} must be a power of two >= 16")
        if not _is_power_of_two(self.num_warps):
            raise ValueError(
                f"DecodeBlockSizes.num_warps={self.num_warps!r} must be a power of two"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"DecodeBlockSizes.num_stages={self.num_stages!r} must be an int >= 1")
        if not isinstance(self.kv_splits, int) or isinstance(self.kv_splits, bool):
            raise ValueError(f"DecodeBlockSizes.kv_splits={self.kv_splits!r} must be an int >= 0")
        if self.kv_splits < 0:
            raise ValueError(f"DecodeBlockSizes.kv_splits={self.kv_splits!r} must be an int >= 0")


# Small key tiles keep the interpreter fast and give several tiles at test sizes; three splits
# run the merge of partial results there, where the GPU's rule would not split such short
# caches.
_DECODE_INTERPRET = DecodeBlockSizes(block_m=16, block_kv=16, num_stages=1, kv_splits=3)


def default_decode_block_sizes(
    head_dim: int, dtype, *, interpret: bool, page_size: int | None = None
) -> DecodeBlockSizes:
    """Decode tiles for a call: small ones in the interpreter, else the shipped defaults, from
    a sweep on the H200 (64-key tiles, 4 warps, 2 stages: 3.7-3.9 TB/s at B=8, 32k keys,
    H=128, bf16, contiguous and in pages of 16; 32- and 128-key tiles within 5%). Pages of a
    multiple of 128 keys take 128-key tiles, each one contiguous block of a page (3.9 TB/s
    against 3.5 with 64-key tiles). float32 and H=256 halve the key tile to keep the stages in
    shared memory."""
    if interpret:
        return _DECODE_INTERPRET
    wide = padded_head_dim(head_dim) > 128 or jnp.dtype(dtype) == jnp.float32
    if wide:
        return DecodeBlockSizes(block_kv=32)
    if page_size is not None and page_size % 128 == 0:
        return DecodeBlockSizes(block_kv=128)
    return DecodeBlockSizes(block_kv=64)
