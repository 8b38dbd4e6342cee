"""Kernel tile configuration: `BlockSizes` and the defaults picked per head dim, dtype and GPU."""

from __future__ import annotations

import dataclasses

import jax
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

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("block_"):
                if not _is_power_of_two(value) or value < 16:
                    raise ValueError(
                        f"BlockSizes.{field.name}={value!r} must be a power of two >= 16"
                    )
            elif field.name.startswith("num_warps"):
                if not _is_power_of_two(value):
                    raise ValueError(f"BlockSizes.{field.name}={value!r} must be a power of two")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int")


# Defaults for sm90 (H100/H200), bf16/fp16, by padded head dim: the best of the sweep in
# benchmarks/sweep.py at seq 4096 on the H200 (benchmarks/NOTES.md, results/h200-sweep-*.jsonl).
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

# Small tiles keep the interpreter fast and exercise multi-tile loops at test sizes.
_INTERPRET = BlockSizes(
    block_q=32, block_kv=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
)


def padded_head_dim(head_dim: int) -> int:
    """The power of two >= head_dim (and >= 16) that the kernels' tiles use."""
    return max(16, 1 << (head_dim - 1).bit_length())


# float32 tiles take twice the shared memory of bf16 ones: smaller tiles, two stages.
_HOPPER_F32 = {
    hp: BlockSizes(
        block_q=64,
        block_kv=64 if hp <= 128 else 32,
        num_warps=4,
        num_stages=2,
        block_q_dkv=32,
        block_kv_dkv=64 if hp <= 128 else 32,
        num_warps_dkv=4,
        num_stages_dkv=2,
        block_q_dq=64,
        block_kv_dq=32,
        num_warps_dq=4,
        num_stages_dq=2,
    )
    for hp in (16, 32, 64, 128, 256)
}


def default_block_sizes(
    head_dim: int, dtype, *, interpret: bool, has_bias: bool = False, has_mask: bool = False
) -> BlockSizes:
    """Tiles for a call: per padded head dim and dtype on GPUs, small ones in the interpreter.

    A bias or dense mask adds a [block_q, block_kv] tile to each pipeline stage; with it the
    defaults keep at most two stages so that the kernels fit in the H200's 227 KiB of shared
    memory (three stages of K, V and a bias tile at H=128 need 288 KiB).
    """
    if interpret:
        return _INTERPRET
    hp = padded_head_dim(head_dim)
    if jnp.dtype(dtype) == jnp.float32:
        return _HOPPER_F32[hp]
    bs = _HOPPER[hp]
    if has_bias or has_mask:
        bs = dataclasses.replace(
            bs,
            num_stages=min(bs.num_stages, 2),
            num_stages_dkv=min(bs.num_stages_dkv, 2),
            num_stages_dq=min(bs.num_stages_dq, 2),
        )
    return bs


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first visible NVIDIA GPU, or None without one."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    if cc is None:
        return None
    major, minor = str(cc).split(".")
    return int(major), int(minor)
