"""The autotuner's search and its on-disk cache, with a fake GPU and a fake timer."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from pallas_flash import config, tune
from pallas_flash.config import BlockSizes, ShapeClass
from pallas_flash.masks import MaskSpec

KIND = "Fake GPU 9000"


@pytest.fixture
def cache_path(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("PALLAS_FLASH_TUNE_CACHE", str(path))
    config._load_tune_cache.cache_clear()
    yield path
    config._load_tune_cache.cache_clear()


def fake_measure(bs: BlockSizes, pass_: str):
    """Milliseconds from a made-up cost model: the forward likes 64x128 tiles, dK/dV likes 4
    warps, dQ likes 32-wide KV tiles; the 32x64 dK/dV candidate "fails" (returns None)."""
    if pass_ == "fwd":
        return abs(bs.block_q - 64) + abs(bs.block_kv - 128) + bs.num_stages
    if bs.block_q_dkv == 32 and bs.block_kv_dkv == 64:
        return None  # say, out of shared memory
    return 10 * abs(bs.num_warps_dkv - 4) + abs(bs.block_kv_dq - 32) + bs.num_stages_dq


def test_search_picks_the_fastest_candidate_of_each_kernel():
    start = config.heuristic_block_sizes(128, jnp.bfloat16)
    best, ms = tune.search(start, 128, fake_measure)
    expected_fwd = min(tune.FORWARD[128], key=lambda c: abs(c[0] - 64) + abs(c[1] - 128) + c[3])
    assert (best.block_q, best.block_kv, best.num_warps, best.num_stages) == expected_fwd
    assert (best.block_q_dkv, best.block_kv_dkv, best.num_warps_dkv) == (64, 64, 4)
    assert best.block_kv_dq == 32
    assert set(ms) == {"fwd", "fwd+bwd"}


def test_cache_round_trip_and_lookup(cache_path):
    tuned = BlockSizes(block_q=64, block_kv=32, num_warps=2, num_stages=2)
    cls = ShapeClass.of(128, jnp.bfloat16, is_causal=True, q_len=8192, kv_len=8192, masked=False)
    config.save_tuned_block_sizes(KIND, {cls: tuned})
    assert json.loads(cache_path.read_text())[KIND][cls.key()]["block_q"] == 64

    def lookup(**kw):
        args = dict(interpret=False, is_causal=True, q_len=8000, kv_len=9000, device_kind=KIND)
        return config.default_block_sizes(128, jnp.bfloat16, **(args | kw))

    assert lookup() == tuned
    heuristic = config.heuristic_block_sizes(128, jnp.bfloat16)
    assert lookup(is_causal=False) == heuristic  # another class
    assert lookup(q_len=100, kv_len=100) == heuristic  # another sequence bucket
    assert lookup(device_kind="Other GPU") == heuristic  # another GPU
    assert lookup(interpret=True) != tuned  # the interpreter keeps its small tiles


def test_save_merges_with_existing_entries(cache_path):
    a = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=False, masked=False, seq="short")
    b = dataclasses.replace(a, seq="long")
    config.save_tuned_block_sizes(KIND, {a: BlockSizes(block_q=16)})
    config.save_tuned_block_sizes(KIND, {b: BlockSizes(block_q=32)})
    assert config.tuned_block_sizes(KIND, a).block_q == 16
    assert config.tuned_block_sizes(KIND, b).block_q == 32


def test_unreadable_cache_warns_and_falls_back(cache_path):
    cache_path.write_text("{not json")
    cls = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=False, masked=False, seq="short")
    with pytest.warns(UserWarning, match="ignoring the autotune cache"):
        assert config.tuned_block_sizes(KIND, cls) is None


def test_shape_class_buckets():
    def seq(n):
        return ShapeClass.of(80, jnp.float16, is_causal=False, q_len=n, kv_len=1, masked=True).seq

    assert [seq(n) for n in (1, 1024, 1025, 4096, 4097)] == [
        "short",
        "short",
        "medium",
        "medium",
        "long",
    ]
    cls = ShapeClass.of(80, jnp.float16, is_causal=False, q_len=1, kv_len=1, masked=True)
    assert cls.key() == "float16/h128/full/masked/short"


def test_tune_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        tune.main(["--head-dims", "64"])


def test_narrow_band():
    def narrow(is_causal, window, has_segments=False):
        spec = MaskSpec(
            q_len=8192, kv_len=8192, is_causal=is_causal, window=window, has_segments=has_segments
        )
        return config.narrow_band(spec)

    assert narrow(True, (1024, 0)) and narrow(False, (1000, 1000))
    assert narrow(True, (2047, 5000))  # the causal cut leaves 2048 keys
    assert not narrow(False, (2047, 5000)) and not narrow(True, (4096, 0))
    assert not narrow(True, None) and narrow(False, None, has_segments=True)


def test_narrow_band_takes_small_forward_tiles(cache_path):
    def tiles(narrow, dtype=jnp.bfloat16, head_dim=128):
        bs = config.default_block_sizes(
            head_dim, dtype, interpret=False, narrow=narrow, q_len=16384, kv_len=16384
        )
        return bs.block_q, bs.block_kv, bs.num_warps, bs.block_q_dkv, bs.block_kv_dkv

    assert tiles(False) == (128, 128, 8, 64, 128)
    assert tiles(True) == (64, 64, 4, 64, 128)  # the backward's tiles stay
    assert tiles(True, jnp.float32) == tiles(False, jnp.float32)
    key = ShapeClass.of(
        128, jnp.bfloat16, is_causal=True, q_len=1, kv_len=1, masked=False, narrow=True
    ).key()
    assert key == "bfloat16/h128/causal/plain/short/narrow"


def test_api_passes_narrow_band_to_the_tile_choice(monkeypatch):
    import pallas_flash

    seen, choose = [], config.default_block_sizes

    def spy(*args, **kwargs):
        seen.append(kwargs["narrow"])
        return choose(*args, **kwargs)

    monkeypatch.setattr(config, "default_block_sizes", spy)
    q = jnp.ones((1, 64, 1, 16))
    seg = jnp.zeros((1, 64), jnp.int32)
    for kwargs in (dict(is_causal=True), dict(local_window_size=(16, 0)), dict(q_segment_ids=seg)):
        pallas_flash.flash_attention(q, q, q, backend="triton", interpret=True, **kwargs)
    assert seen == [False, True, True]


def test_shipped_h200_table_is_used_below_the_user_cache(cache_path):
    shipped = json.loads(config.SHIPPED_TUNE_TABLE.read_text())["NVIDIA H200"]
    assert shipped  # the table ships with entries, each a valid BlockSizes
    key, fields = sorted(shipped.items())[0]
    dtype, head, causal, masked, seq = key.split("/")[:5]
    cls = ShapeClass(
        dtype=dtype,
        head_dim=int(head[1:]),
        is_causal=causal == "causal",
        masked=masked == "masked",
        seq=seq,
    )
    assert config.tuned_block_sizes("NVIDIA H200", cls) == BlockSizes(**fields)
    assert config.tuned_block_sizes(KIND, cls) is None  # other GPUs: heuristics
    mine = BlockSizes(block_q=16)
    config.save_tuned_block_sizes("NVIDIA H200", {cls: mine})
    assert config.tuned_block_sizes("NVIDIA H200", cls) == mine
