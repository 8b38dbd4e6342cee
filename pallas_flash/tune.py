"""`python -m pallas_flash.tune`: autotune the kernels' tiles on this GPU and fill the on-disk
cache.

For each unmasked shape class (the --dtype, head dim, causal, sequence bucket; calls with a
bias, dense mask or narrow band take the shipped heuristics) it times a small search space
greedily -- the Triton kernels' BlockSizes: forward tiles on the forward pass, then the
dK/dV tiles and the dQ tiles on forward+backward; on Hopper then the Mosaic GPU kernels' tiles:
forward tiles, then backward tiles -- checks the winners against the reference, and stores them
under the GPU's kind (`jax.devices()[0].device_kind`) in the cache file
(`tune_cache.tune_cache_path()`). `flash_attention` uses a cache entry whenever its call falls in
that class (Mosaic tiles only where the kernel supports the call's shapes); without one it uses
the shipped heuristics and the Mosaic kernels' defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash import device as device_lib
from pallas_flash import dispatch, mosaic, triton, tune_cache
from pallas_flash._vjp import flash_attention_kernels
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.triton import BlockSizes
from pallas_flash.tune_cache import MosaicTiles, ShapeClass, TunedEntry

KERNEL_FIELDS = ("block_q", "block_kv", "num_warps", "num_stages")

# Candidates per padded head dim: (block_q, block_kv, num_warps, num_stages) of one kernel.
# The forward list also seeds nothing else: each kernel is searched with the others fixed.
FORWARD = {
    64: [
        (128, 64, 4, 3),
        (128, 128, 4, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 3),
    ],
    128: [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 64, 8, 4),
        # Two programs per SM (<= 128 registers at 8 warps, <= 113 KiB of shared memory, read
        # with benchmarks/triton_ir.py): one program's softmax can overlap the other's MMAs.
        (128, 32, 8, 3),
        (64, 64, 4, 2),
    ],
    256: [(64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1)],
}
DKV = {
    64: [(32, 128, 4, 3), (64, 64, 4, 3), (32, 128, 4, 5), (64, 128, 8, 3), (32, 64, 4, 3)],
    # (32, 128, 8, 3): 218 registers and no spills, where the default spills (255 + 80 bytes).
    128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3)],
    256: [(64, 64, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1), (32, 64, 4, 2)],
}
DQ = {
    64: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 2)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    256: [(64, 32, 4, 1), (128, 32, 8, 1), (64, 16, 4, 2), (64, 32, 4, 2)],
}
SEQ_OF_CLASS = {"short": 1024, "medium": 4096, "long": 16384}

# Hopper: candidates of the Mosaic GPU kernels' tiles per head dim, as ForwardTiles and
# BackwardTiles fields; None is the kernel's own default for the shapes (mosaic.default_tiles).
# Candidates a shape does not support (registers, shared memory, lengths) measure as None.
MOSAIC_FORWARD = {
    64: [
        None,
        dict(block_q=128, block_kv=128),
        dict(block_q=64, block_kv=128),
        dict(block_q=128, block_kv=64),
        dict(block_q=64, block_kv=256),
        dict(block_q=64, block_kv=128, num_stages=3),
        dict(block_q=128, block_kv=128, persistent=True),
        dict(block_q=64, block_kv=128, persistent=True),
    ],
    128: [
        None,
        dict(block_q=64, block_kv=64, num_stages=3),
        dict(block_q=128, block_kv=64),
        dict(block_q=64, block_kv=64, num_stages=4),
        dict(block_q=64, block_kv=128, persistent=True),
    ],
    256: [None, dict(block_q=64, block_kv=64, num_stages=3)],
}
MOSAIC_BACKWARD = {
    64: [
        None,
        dict(num_stages=3),
        dict(block_kv_dq=128),
        dict(block_q_dkv=128),
        dict(block_q_dq=128),
        dict(block_q_dkv=128, block_q_dq=128),
    ],
    128: [None, dict(num_stages=3), dict(block_kv_dq=128)],
}


def candidates(table, head_dim):
    return table[min(max(head_dim, 64), 256)]


def _greedy(start, phases, measure):
    """Greedy search: phase by phase, the fastest of the candidates built from the best so far.

    phases: (pass_, variants) pairs, variants(best) -> candidates; measure(candidate, pass_) ->
    milliseconds, or None when the candidate fails. Returns the best and {pass: best ms}.
    """
    best, best_ms = start, {}
    for pass_, variants in phases:
        winner, winner_ms = best, None
        for candidate in variants(best):
            ms = measure(candidate, pass_)
            if ms is not None and (winner_ms is None or ms < winner_ms):
                winner, winner_ms = candidate, ms
        best = winner
        if winner_ms is not None:
            best_ms[pass_] = winner_ms
    return best, best_ms


def search(start: BlockSizes, head_dim: int, measure) -> tuple[BlockSizes, dict]:
    """Greedy search: forward tiles on "fwd", then dK/dV and dQ tiles on "fwd+bwd".

    measure(block_sizes, pass_) -> milliseconds, or None when the candidate fails (too much
    shared memory, say). Returns the best BlockSizes and {pass: best ms}.
    """

    def variants(table, suffix):
        fields = [f + suffix for f in KERNEL_FIELDS]
        return lambda best: (
            dataclasses.replace(best, **dict(zip(fields, values)))
            for values in candidates(table, head_dim)
        )

    phases = [
        ("fwd", variants(FORWARD, "")),
        ("fwd+bwd", variants(DKV, "_dkv")),
        ("fwd+bwd", variants(DQ, "_dq")),
    ]
    return _greedy(start, phases, measure)


def search_mosaic(head_dim: int, measure) -> tuple[MosaicTiles, dict]:
    """Greedy search of the Mosaic kernels' tiles (Hopper): forward tiles on "fwd", then, at
    the head dims with backward candidates (MOSAIC_BACKWARD, each also with the fixed-point
    fused dQ), backward tiles on "fwd+bwd" with the best forward.

    measure(forward_tiles, backward_tiles, pass_) -> milliseconds, or None when the candidate
    fails or does not apply. Returns the best tiles (None fields: the kernel's defaults) and
    {pass: best ms}.
    """

    def variants(table, tile_type, field, twins=lambda tiles: ()):
        def of(best):
            for fields in table.get(head_dim, []):
                tiles = None if fields is None else tile_type(**fields)
                for each in (tiles, *twins(tiles)):
                    yield dataclasses.replace(best, **{field: each})

        return of

    def fixed_dq(tiles):
        """The backward's candidate with dQ summed as integers in its dK/dV kernel (the
        deterministic default's fused form where dispatch.fixed_dq_is_faster): tiles given
        in full replace the dispatch's choice, so each candidate is measured both ways."""
        if tiles is None:
            return ()
        return (dataclasses.replace(tiles, fused_dq="fixed", step_descriptors=head_dim > 64),)

    phases = [
        ("fwd", variants(MOSAIC_FORWARD, mosaic.ForwardTiles, "forward")),
        ("fwd+bwd", variants(MOSAIC_BACKWARD, mosaic.BackwardTiles, "backward", fixed_dq)),
    ]
    return _greedy(
        MosaicTiles(), phases, lambda tiles, pass_: measure(tiles.forward, tiles.backward, pass_)
    )


def _fa2_shape(shape_class: ShapeClass):
    """(batch, seq, heads) of the FA2 paper's grid point of the class."""
    seq = SEQ_OF_CLASS[shape_class.seq]
    return max(1, 16384 // seq), seq, max(1, 2048 // shape_class.head_dim)


def mosaic_kernels_fn(
    shape,
    dtype,
    *,
    is_causal,
    block_sizes,
    forward_tiles=None,
    backward_tiles=None,
    backend: str | None = None,
    backward: str | None = None,
    device: Device | None = None,
    num_kv_heads: int | None = None,
):
    """q, k, v -> (out, lse) of shape [B, T, N, H] (k and v [B, T, num_kv_heads, H], None: N)
    through the kernels that `dispatch.choose` picks for `backend` (None: what the default call
    runs; "mosaic": the Mosaic backward wherever it runs the call) on `device` (None:
    `device.target_device()`) when the autotune entry is (block_sizes, forward_tiles,
    backward_tiles) (None tiles: the kernels' defaults).
    backward="triton" then swaps in the Triton backward (for comparisons). None when that
    choice does not run the Mosaic forward with these tiles, or the Mosaic backward with the
    given backward tiles: the candidate does not apply."""
    device = device_lib.target_device() if device is None else device
    spec = MaskSpec(q_len=shape[1], kv_len=shape[1], is_causal=is_causal)
    k_shape = shape if num_kv_heads is None else (*shape[:2], num_kv_heads, shape[3])
    config = dispatch.choose(
        Call(q_shape=shape, k_shape=k_shape, dtype=dtype, spec=spec),
        device,
        scale=shape[-1] ** -0.5,
        backend=backend,
        tuned=TunedEntry(block_sizes, forward_tiles, backward_tiles),
    )
    if config is None or config.forward != "mosaic":
        return None
    if forward_tiles is not None and config.mosaic_forward_tiles != forward_tiles:
        return None
    if backward == "triton":
        config = dataclasses.replace(config, backward="triton", mosaic_backward_tiles=None)
    elif backward_tiles is not None and config.mosaic_backward_tiles != backward_tiles:
        return None
    return lambda q, k, v: flash_attention_kernels(q, k, v, None, MaskArrays(), config)


def _gpu_measure_mosaic(shape_class: ShapeClass, block_sizes: BlockSizes, log):
    """A measure function for search_mosaic, timing the kernels at the class's FA2 shape."""
    from pallas_flash import bench

    batch, seq, heads = _fa2_shape(shape_class)
    dtype = jnp.dtype(shape_class.dtype)
    shape = (batch, seq, heads, shape_class.head_dim)
    args = bench.make_inputs(batch, seq, seq, heads, heads, shape_class.head_dim, dtype)

    def measure(forward_tiles, backward_tiles, pass_):
        fn = mosaic_kernels_fn(
            shape,
            dtype,
            is_causal=shape_class.is_causal,
            block_sizes=block_sizes,
            forward_tiles=forward_tiles,
            backward_tiles=backward_tiles,
        )
        row = dict(
            shape_class=shape_class.key(),
            mosaic_forward=None if forward_tiles is None else dataclasses.asdict(forward_tiles),
            mosaic_backward=None if backward_tiles is None else dataclasses.asdict(backward_tiles),
            **{"pass": pass_},
        )
        if fn is None:
            row["ms"] = None
        else:
            try:
                timed = bench.timed_fn(lambda q, k, v: fn(q, k, v)[0], pass_)
                row["ms"] = bench.median_ms(timed, args, repeats=3)
            except Exception as e:  # noqa: BLE001 (a candidate that fails to compile)
                row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
        log(row)
        return row["ms"]

    return measure


def mosaic_max_error(
    tuned: MosaicTiles, shape_class: ShapeClass, block_sizes, *, device: Device | None = None
) -> float:
    """Largest |kernel - f32 reference| over out and the gradients at a 512-token shape the
    tiles support (inf when they do not support it), with both Mosaic kernels where they run
    the shape (as backend="mosaic" does), on `device` (None: `device.target_device()`)."""
    dtype = jnp.dtype(shape_class.dtype)
    shape = (2, 512, 4, shape_class.head_dim)
    kernels = mosaic_kernels_fn(
        shape,
        dtype,
        is_causal=shape_class.is_causal,
        block_sizes=block_sizes,
        forward_tiles=tuned.forward,
        backward_tiles=tuned.backward,
        backend="mosaic",
        device=device,
    )
    if kernels is None:
        return float("inf")
    return _max_error(
        lambda *a: kernels(*a)[0], shape, shape, dtype, is_causal=shape_class.is_causal
    )


def _gpu_measure(shape_class: ShapeClass, log):
    """A measure function timing pallas_flash at the FA2-paper shape of the class."""
    from pallas_flash import bench

    batch, seq, heads = _fa2_shape(shape_class)
    dtype = jnp.dtype(shape_class.dtype)

    def measure(bs, pass_):
        row = bench.run_point(
            "pallas_flash",
            batch,
            seq,
            seq,
            heads,
            heads,
            shape_class.head_dim,
            dtype,
            shape_class.is_causal,
            pass_,
            block_sizes=bs,
            repeats=3,
        )
        row.update(shape_class=shape_class.key(), block_sizes=dataclasses.asdict(bs))
        log(row)
        return row["ms"]

    return measure


def max_error(bs: BlockSizes, shape_class: ShapeClass) -> float:
    """Largest |kernel - f32 reference| over out and the gradients at a small odd shape."""
    h = shape_class.head_dim
    attention = functools.partial(
        pallas_flash.flash_attention, is_causal=shape_class.is_causal, block_sizes=bs
    )
    return _max_error(
        attention,
        (2, 200, 4, h),
        (2, 333, 2, h),
        jnp.dtype(shape_class.dtype),
        is_causal=shape_class.is_causal,
    )


def _max_error(attention, q_shape, kv_shape, dtype, *, is_causal: bool) -> float:
    """Largest |attention - f32 reference| over out, dq, dk and dv at random inputs."""
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], q_shape, dtype)
    k = jax.random.normal(keys[1], kv_shape, dtype)
    v = jax.random.normal(keys[2], kv_shape, dtype)
    do = jax.random.normal(keys[3], q_shape, jnp.float32)

    def grads(fn, cast, q, k, v, do):
        out, vjp = jax.vjp(lambda *a: fn(*(x.astype(cast) for x in a)), q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    # The inputs are arguments, not closed-over constants that XLA would fold at compile time.
    reference = functools.partial(pallas_flash.attention_reference, is_causal=is_causal)
    ours = jax.jit(functools.partial(grads, attention, dtype))(q, k, v, do)
    ref = jax.jit(functools.partial(grads, reference, jnp.float32))(q, k, v, do)
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(ours, ref)
    )


def tune_class(
    shape_class: ShapeClass, head_dim: int, tolerance: float, *, hopper, log, triton_tiles=True
):
    """The tuned entry of one shape class on this GPU, or None when the Triton winner's error
    exceeds `tolerance`. On Hopper the Mosaic tiles join the entry when their winner's error
    is within it (else the entry keeps the Mosaic kernels' defaults). triton_tiles=False
    keeps the Triton heuristics and searches the Mosaic tiles only (Hopper)."""
    best = triton.tiles.heuristic_block_sizes(head_dim, shape_class.dtype)
    if triton_tiles or not hopper:
        best, best_ms = search(best, shape_class.head_dim, _gpu_measure(shape_class, log))
        err = max_error(best, shape_class)
        log(
            dict(
                shape_class=shape_class.key(),
                best=dataclasses.asdict(best),
                ms=best_ms,
                max_err=err,
                kept=err <= tolerance,
            )
        )
        if err > tolerance:
            return None
    if not hopper:
        return TunedEntry(best)
    tuned, tuned_ms = search_mosaic(
        shape_class.head_dim, _gpu_measure_mosaic(shape_class, best, log)
    )
    entry = TunedEntry(best, tuned.forward, tuned.backward)
    err = mosaic_max_error(tuned, shape_class, best)
    log(
        dict(
            shape_class=shape_class.key(),
            best_mosaic=entry.to_json().get(tune_cache.MOSAIC_KEY, "defaults"),
            ms=tuned_ms,
            max_err=err,
            kept=err <= tolerance,
        )
    )
    return entry if err <= tolerance else TunedEntry(best)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument(
        "--seqs", nargs="+", default=["short", "medium", "long"], choices=list(SEQ_OF_CLASS)
    )
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--cache", help="cache file (default: tune_cache.tune_cache_path())")
    parser.add_argument("--log", help="JSONL file for every measurement")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="largest |error| against the f32 reference a winner may have",
    )
    parser.add_argument(
        "--mosaic-only",
        action="store_true",
        help="Hopper: search the Mosaic kernels' tiles only (the Triton tiles keep their "
        "heuristics)",
    )
    args = parser.parse_args(argv)

    device = Device.current()
    if device is None or device.compute_capability < (8, 0):
        raise SystemExit("pallas_flash.tune needs an NVIDIA GPU of compute capability >= 8.0")
    kind = device.kind
    # On Hopper the default call runs the Mosaic kernels: their tiles are searched too.
    hopper = device.is_hopper
    if args.mosaic_only and not hopper:
        parser.error(f"--mosaic-only searches the Mosaic kernels' tiles: {kind!r} is not Hopper")
    log_file = open(args.log, "a") if args.log else None

    def log(row):
        print(json.dumps(row), flush=True)
        if log_file:
            log_file.write(json.dumps(row) + "\n")

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    found = {}
    for h in args.head_dims:
        for seq in args.seqs:
            for causal in causals:
                shape_class = ShapeClass(
                    dtype=args.dtype,
                    head_dim=triton.padded_head_dim(h),
                    is_causal=causal,
                    masked=False,
                    seq=seq,
                )
                entry = tune_class(
                    shape_class,
                    h,
                    args.tolerance,
                    hopper=hopper,
                    log=log,
                    triton_tiles=not args.mosaic_only,
                )
                if entry is not None:
                    found[shape_class] = entry
    tune_cache.save_tuned(kind, found, args.cache)
    print(
        f"wrote {len(found)} entries for {kind!r} to {args.cache or tune_cache.tune_cache_path()}"
    )


if __name__ == "__main__":
    main()
