"""The autotuner's search and its on-disk cache, with a fake GPU and a fake timer."""

import dataclasses
import json

import jax.numpy as jnp
import pytest
from support.mosaic_forward import long_only

from pallas_flash import dispatch, mosaic, tune, tune_cache
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskSpec
from pallas_flash.triton import BlockSizes, tiles
from pallas_flash.tune_cache import ShapeClass

KIND = "Fake GPU 9000"


def fake_measure(bs: BlockSizes, pass_: str):
    """Milliseconds from a made-up cost model: the forward likes 64x128 tiles, dK/dV likes 4
    warps, dQ likes 32-wide KV tiles; the 32x64 dK/dV candidate "fails" (returns None)."""
    if pass_ == "fwd":
        return abs(bs.block_q - 64) + abs(bs.block_kv - 128) + bs.num_stages
    if bs.block_q_dkv == 32 and bs.block_kv_dkv == 64:
        return None  # say, out of shared memory
    return 10 * abs(bs.num_warps_dkv - 4) + abs(bs.block_kv_dq - 32) + bs.num_stages_dq


def test_search_picks_the_fastest_candidate_of_each_kernel():
    start = tiles.heuristic_block_sizes(128, jnp.bfloat16)
    best, ms = tune.search(start, 128, fake_measure)
    expected_fwd = min(tune.FORWARD[128], key=lambda c: abs(c[0] - 64) + abs(c[1] - 128) + c[3])
    assert (best.block_q, best.block_kv, best.num_warps, best.num_stages) == expected_fwd
    assert (best.block_q_dkv, best.block_kv_dkv, best.num_warps_dkv) == (64, 64, 4)
    assert best.block_kv_dq == 32
    assert set(ms) == {"fwd", "fwd+bwd"}


def test_cache_round_trip_and_lookup(tune_cache_path):
    tuned = BlockSizes(block_q=64, block_kv=32, num_warps=2, num_stages=2)
    cls = ShapeClass.of(128, jnp.bfloat16, is_causal=True, q_len=8192, kv_len=8192, masked=False)
    tune_cache.save_tuned_block_sizes(KIND, {cls: tuned})
    assert json.loads(tune_cache_path.read_text())[KIND][cls.key()]["block_q"] == 64

    def lookup(interpret=False, is_causal=True, q_len=8000, kv_len=9000, device_kind=KIND):
        # The Triton tiles the dispatch gives a call on a GPU of that kind.
        call = Call(
            q_shape=(1, q_len, 2, 128),
            k_shape=(1, kv_len, 2, 128),
            dtype=jnp.bfloat16,
            spec=MaskSpec(q_len=q_len, kv_len=kv_len, is_causal=is_causal),
        )
        device = Device(kind=device_kind, compute_capability=(8, 0), num_sms=108)
        config = dispatch.choose(call, device, scale=0.1, backend="triton", interpret=interpret)
        return config.block_sizes

    assert lookup() == tuned
    causal = tiles.heuristic_block_sizes(128, jnp.bfloat16, ranged=True)
    assert lookup(is_causal=False) == tiles.heuristic_block_sizes(128, jnp.bfloat16)  # a class
    assert lookup(q_len=100, kv_len=100) == causal  # another sequence bucket
    assert lookup(device_kind="Other GPU") == causal  # another GPU
    assert lookup(interpret=True) != tuned  # the interpreter keeps its small tiles


def test_save_merges_with_existing_entries(tune_cache_path):
    a = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=False, masked=False, seq="short")
    b = dataclasses.replace(a, seq="long")
    tune_cache.save_tuned_block_sizes(KIND, {a: BlockSizes(block_q=16)})
    tune_cache.save_tuned_block_sizes(KIND, {b: BlockSizes(block_q=32)})
    assert tune_cache.tuned_block_sizes(KIND, a).block_q == 16
    assert tune_cache.tuned_block_sizes(KIND, b).block_q == 32


def test_unreadable_cache_warns_and_falls_back(tune_cache_path):
    tune_cache_path.write_text("{not json")
    cls = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=False, masked=False, seq="short")
    with pytest.warns(UserWarning, match="ignoring the autotune cache"):
        assert tune_cache.tuned_block_sizes(KIND, cls) is None


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


def test_mosaic_only_refuses_a_gpu_without_the_mosaic_kernels(monkeypatch, capsys):
    """--mosaic-only on an A100 would search nothing it names: refused, naming the card."""
    monkeypatch.setattr(tune.Device, "current", lambda: Device.of_kind("NVIDIA A100-SXM4-80GB"))
    with pytest.raises(SystemExit):
        tune.main(["--mosaic-only", "--head-dims", "64"])
    assert "'NVIDIA A100-SXM4-80GB' is not Hopper" in capsys.readouterr().err


def test_narrow_band():
    def narrow(is_causal, window, has_segments=False):
        spec = MaskSpec(
            q_len=8192, kv_len=8192, is_causal=is_causal, window=window, has_segments=has_segments
        )
        return tiles.narrow_band(spec)

    assert narrow(True, (1024, 0)) and narrow(False, (1000, 1000))
    assert narrow(True, (2047, 5000))  # the causal cut leaves 2048 keys
    assert not narrow(False, (2047, 5000)) and not narrow(True, (4096, 0))
    assert not narrow(True, None) and narrow(False, None, has_segments=True)


def test_narrow_band_takes_small_forward_tiles():
    def chosen(narrow, dtype=jnp.bfloat16, head_dim=128):
        bs = tiles.default_block_sizes(head_dim, dtype, interpret=False, narrow=narrow)
        return bs.block_q, bs.block_kv, bs.num_warps, bs.block_q_dkv, bs.block_kv_dkv

    assert chosen(False) == (128, 128, 8, 64, 128)
    assert chosen(True) == (64, 64, 4, 64, 128)  # the backward's tiles stay
    assert chosen(True, jnp.float32) == chosen(False, jnp.float32)
    key = ShapeClass.of(
        128, jnp.bfloat16, is_causal=True, q_len=1, kv_len=1, masked=False, narrow=True
    ).key()
    assert key == "bfloat16/h128/causal/plain/short/narrow"


def test_key_ranges_take_the_ranged_dkv_tiles_at_h128():
    """Calls whose rows see ranges of keys take 32-row dK/dV steps at H=128 (64 spill there),
    dense calls 64; other head dims and float32 keep theirs."""
    from pallas_flash.masks import MaskSpec

    def dkv_rows(head_dim=128, dtype=jnp.bfloat16, **spec):
        ranged = MaskSpec(q_len=64, kv_len=64, **spec).has_key_ranges
        return tiles.heuristic_block_sizes(head_dim, dtype, ranged=ranged).block_q_dkv

    assert dkv_rows() == 64
    for spec in (dict(is_causal=True), dict(window=(8, 8)), dict(has_segments=True)):
        assert dkv_rows(**spec) == 32, spec
    assert dkv_rows(64, is_causal=True) == dkv_rows(64)
    assert dkv_rows(dtype=jnp.float32, is_causal=True) == dkv_rows(dtype=jnp.float32)


def test_api_passes_narrow_band_to_the_tile_choice(monkeypatch):
    import pallas_flash

    seen, choose = [], tiles.default_block_sizes

    def spy(*args, **kwargs):
        seen.append(kwargs["narrow"])
        return choose(*args, **kwargs)

    monkeypatch.setattr(tiles, "default_block_sizes", spy)
    q = jnp.ones((1, 64, 1, 16))
    seg = jnp.zeros((1, 64), jnp.int32)
    for kwargs in (dict(is_causal=True), dict(local_window_size=(16, 0)), dict(q_segment_ids=seg)):
        pallas_flash.flash_attention(q, q, q, backend="triton", interpret=True, **kwargs)
    assert seen == [False, True, True]


def test_shipped_h200_table_is_used_below_the_user_cache(tune_cache_path):
    shipped = json.loads(tune_cache.SHIPPED_TUNE_TABLE.read_text())["NVIDIA H200"]
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
    assert tune_cache.tuned_block_sizes("NVIDIA H200", cls) == BlockSizes(**fields)
    assert tune_cache.tuned_block_sizes(KIND, cls) is None  # other GPUs: heuristics
    mine = BlockSizes(block_q=16)
    tune_cache.save_tuned_block_sizes("NVIDIA H200", {cls: mine})
    assert tune_cache.tuned_block_sizes("NVIDIA H200", cls) == mine


def test_shipped_h100_table_sets_the_h64_backward_tiles(tune_cache_path):
    """The H100's shipped entry (docs/notes/tuning.md, "H100"): a plain H=64 call of 2k tokens
    runs the two-kernel Mosaic backward in 128-row tiles; the causal class and H=128 keep the
    defaults, and so does deterministic_grads=False (its f32-add fused dQ)."""
    card = "NVIDIA H100 80GB HBM3"
    device = Device.of_kind(card, num_sms=132)

    def tiles(head_dim, *, causal=False, **kwargs):
        shape = (8, 2048, 2048 // head_dim, head_dim)
        call = Call(
            q_shape=shape,
            k_shape=shape,
            dtype=jnp.dtype(jnp.bfloat16),
            spec=MaskSpec(q_len=2048, kv_len=2048, is_causal=causal),
            **kwargs,
        )
        return dispatch.choose(call, device, scale=0.1).mosaic_backward_tiles

    assert tiles(64) == mosaic.BackwardTiles(block_q_dkv=128, block_q_dq=128)
    default = mosaic.BackwardTiles()
    assert (tiles(64, causal=True).block_q_dkv, tiles(128).block_q_dkv) == (
        default.block_q_dkv,
        default.block_q_dkv,
    )
    assert tiles(64, deterministic_grads=False).fused_dq == "add"


# -- the Mosaic GPU kernels' tiles (Hopper) --------------------------------------------------------


def fake_mosaic_measure(forward, backward, pass_):
    """A made-up cost model: the forward likes 3 stages of 64-key tiles, the backward 128-key dQ
    tiles; the one-consumer backward "fails"."""
    if pass_ == "fwd":
        return (
            5.0 if forward is None else abs(forward.block_kv - 64) + abs(forward.num_stages - 3) + 1
        )
    if backward is not None and backward.num_consumers == 1:
        return None
    return 9.0 if backward is None else abs(backward.block_kv_dq - 128) + backward.num_stages


def test_search_mosaic_picks_forward_then_backward_tiles(monkeypatch):
    monkeypatch.setitem(
        tune.MOSAIC_BACKWARD, 128, [*tune.MOSAIC_BACKWARD[128], dict(num_consumers=1)]
    )
    best, ms = tune.search_mosaic(128, fake_mosaic_measure)
    assert best.forward == mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    assert best.backward == mosaic.BackwardTiles(block_kv_dq=128)
    assert ms == {"fwd": 1, "fwd+bwd": 2}
    # H=256 has no Mosaic backward candidates (its defaults are the only tiles that fit): only
    # the forward is searched.
    best, ms = tune.search_mosaic(256, fake_mosaic_measure)
    assert best.backward is None and set(ms) == {"fwd"}


def test_search_mosaic_measures_each_backward_candidate_with_the_fixed_dq():
    """Tiles given in full replace the dispatch's fused-dQ choice: each backward candidate is
    measured as given and with dQ summed as integers in the dK/dV kernel (descriptors rebuilt
    each step above H=64), and the faster twin wins."""
    seen = []

    def fixed_wins(forward, backward, pass_):
        if pass_ == "fwd+bwd":
            seen.append(backward)
        if backward is None:
            return 3.0
        return 1.0 if backward.fused_dq == "fixed" and backward.num_stages == 3 else 2.0

    best, _ = tune.search_mosaic(128, fixed_wins)
    assert best.backward == mosaic.BackwardTiles(
        num_stages=3, fused_dq="fixed", step_descriptors=True
    )
    given = [f for f in tune.MOSAIC_BACKWARD[128] if f is not None]
    assert len(seen) == 1 + 2 * len(given)
    for fields in given:
        assert mosaic.BackwardTiles(**fields) in seen
        assert mosaic.BackwardTiles(**fields, fused_dq="fixed", step_descriptors=True) in seen
    seen.clear()
    tune.search_mosaic(64, fixed_wins)
    assert all(t is None or not t.step_descriptors for t in seen)


def test_search_mosaic_keeps_the_defaults_when_they_win():
    def defaults_win(forward, backward, pass_):
        return 1.0 if (forward, backward) == (None, None) else 2.0

    best, _ = tune.search_mosaic(64, defaults_win)
    assert (best.forward, best.backward) == (None, None)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seq", list(tune.SEQ_OF_CLASS))
def test_mosaic_candidates_are_tiles_the_grid_shapes_take(head_dim, seq):
    """Every candidate builds; at each class's FA2 shape the defaults and most candidates are
    supported (a candidate no shape takes would only waste tuning time)."""
    cls = ShapeClass(dtype="bfloat16", head_dim=head_dim, is_causal=True, masked=False, seq=seq)
    batch, length, heads = tune._fa2_shape(cls)
    shape = (batch, length, heads, head_dim)
    forward = [
        None if f is None else mosaic.ForwardTiles(**f) for f in tune.MOSAIC_FORWARD[head_dim]
    ]
    taken = [
        mosaic.tiles.why_not(shape, shape, jnp.bfloat16, is_causal=True, tiles=t) is None
        for t in forward
    ]
    assert taken[0] and sum(taken) >= len(taken) - 1, list(zip(forward, taken))
    for fields in tune.MOSAIC_BACKWARD.get(head_dim, []):
        tiles = None if fields is None else mosaic.BackwardTiles(**fields)
        why_not = mosaic.backward_tiles.why_not
        assert why_not(shape, shape, jnp.bfloat16, is_causal=True, tiles=tiles) is None


def test_cache_round_trip_with_mosaic_tiles(tune_cache_path):
    cls = ShapeClass(dtype="bfloat16", head_dim=128, is_causal=True, masked=False, seq="long")
    entry = tune_cache.TunedEntry(
        BlockSizes(block_q=64),
        mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=3),
        mosaic.BackwardTiles(block_kv_dq=128),
    )
    tune_cache.save_tuned(KIND, {cls: entry})
    raw = json.loads(tune_cache_path.read_text())[KIND][cls.key()]
    assert raw["block_q"] == 64 and raw["mosaic"]["forward"]["num_stages"] == 3
    assert tune_cache.tuned_entry(KIND, cls) == entry
    assert tune_cache.tuned_block_sizes(KIND, cls) == BlockSizes(block_q=64)
    # Entries of the earlier format (Triton tiles only) still load, with the Mosaic defaults.
    other = dataclasses.replace(cls, seq="short")
    tune_cache.save_tuned_block_sizes(KIND, {other: BlockSizes(block_q=32)})
    assert tune_cache.tuned_entry(KIND, other) == tune_cache.TunedEntry(BlockSizes(block_q=32))


@pytest.mark.parametrize(
    "mosaic_fields",
    [dict(sideways={}), dict(forward=dict(block_q=96)), dict(backward=dict(num_consumers=3))],
)
def test_bad_mosaic_tiles_in_the_cache_warn_and_fall_back(tune_cache_path, mosaic_fields):
    cls = ShapeClass(dtype="bfloat16", head_dim=128, is_causal=True, masked=False, seq="long")
    tune_cache_path.write_text(json.dumps({KIND: {cls.key(): {"mosaic": mosaic_fields}}}))
    with pytest.warns(UserWarning, match="ignoring the autotune cache"):
        assert tune_cache.tuned_entry(KIND, cls) is None


def test_tune_class_adds_mosaic_tiles_on_hopper_within_tolerance(monkeypatch):
    cls = ShapeClass(dtype="bfloat16", head_dim=128, is_causal=False, masked=False, seq="long")
    monkeypatch.setattr(tune, "_gpu_measure", lambda shape_class, log: fake_measure)
    monkeypatch.setattr(tune, "_gpu_measure_mosaic", lambda *a: fake_mosaic_measure)
    monkeypatch.setattr(tune, "max_error", lambda bs, shape_class: 0.01)
    errors = {}
    monkeypatch.setattr(tune, "mosaic_max_error", lambda tuned, c, bs: errors["mosaic"])
    log = []
    errors["mosaic"] = 0.01
    entry = tune.tune_class(cls, 128, 0.1, hopper=True, log=log.append)
    assert entry.mosaic_forward == mosaic.ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    assert entry.mosaic_backward == mosaic.BackwardTiles(block_kv_dq=128)
    errors["mosaic"] = 0.5  # the Mosaic winner is off: the entry keeps the kernels' defaults
    entry = tune.tune_class(cls, 128, 0.1, hopper=True, log=log.append)
    assert (entry.mosaic_forward, entry.mosaic_backward) == (None, None)
    assert entry.block_sizes.block_kv == 128  # the Triton search still counts
    entry = tune.tune_class(cls, 128, 0.1, hopper=False, log=log.append)
    assert (entry.mosaic_forward, entry.mosaic_backward) == (None, None)
    assert all("shape_class" in row for row in log)


def test_tune_class_mosaic_only_keeps_the_triton_heuristics(monkeypatch):
    """--mosaic-only: no Triton candidate is measured; the entry holds the Triton heuristics
    and the Mosaic winner (off Hopper the Triton search runs as before)."""
    cls = ShapeClass(dtype="bfloat16", head_dim=128, is_causal=False, masked=False, seq="long")
    triton_calls = []

    def counting_measure(bs, pass_):
        triton_calls.append(bs)
        return fake_measure(bs, pass_)

    monkeypatch.setattr(tune, "_gpu_measure", lambda shape_class, log: counting_measure)
    monkeypatch.setattr(tune, "_gpu_measure_mosaic", lambda *a: fake_mosaic_measure)
    monkeypatch.setattr(tune, "max_error", lambda bs, shape_class: 0.01)
    monkeypatch.setattr(tune, "mosaic_max_error", lambda tuned, c, bs: 0.01)
    entry = tune.tune_class(cls, 128, 0.1, hopper=True, log=[].append, triton_tiles=False)
    assert triton_calls == []
    assert entry.block_sizes == tiles.heuristic_block_sizes(128, "bfloat16")
    assert entry.mosaic_backward == mosaic.BackwardTiles(block_kv_dq=128)
    tune.tune_class(cls, 128, 0.1, hopper=False, log=[].append, triton_tiles=False)
    assert triton_calls


@long_only
def test_mosaic_max_error_runs_the_tuned_kernels_interpreted():
    """The tuner's check of a Mosaic winner: the forward with the tuned tiles and the Mosaic
    backward, in the Mosaic interpreter, against the f32 reference; tiles the check shape does
    not take give inf (so the winner is dropped)."""
    from support.mosaic_interpret import interpret_mosaic

    cls = ShapeClass(dtype="bfloat16", head_dim=64, is_causal=True, masked=False, seq="short")
    tuned = tune_cache.MosaicTiles(forward=mosaic.ForwardTiles(block_q=128, block_kv=64))
    h200 = Device.h200()
    with interpret_mosaic():
        err = tune.mosaic_max_error(tuned, cls, BlockSizes(), device=h200)
    assert 0 < err < 0.05
    too_big = tune_cache.MosaicTiles(forward=mosaic.ForwardTiles(block_q=256, block_kv=128))
    assert tune.mosaic_max_error(too_big, cls, BlockSizes(), device=h200) == float("inf")
