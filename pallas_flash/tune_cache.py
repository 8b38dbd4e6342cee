"""The autotune cache: `ShapeClass` (its key), `TunedEntry` (the Triton kernels' tiles and, on
Hopper, the Mosaic kernels' ones), the user's cache file and the shipped table (`tuned.json`).

The entries refer to both backends' tile classes as data; the kernels never read this module:
the dispatch looks a call's entry up and hands the tiles on. No device queries here: the caller
names the device kind.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import warnings

import jax.numpy as jnp

from pallas_flash.mosaic import BackwardTiles, ForwardTiles
from pallas_flash.triton import BlockSizes, padded_head_dim


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
