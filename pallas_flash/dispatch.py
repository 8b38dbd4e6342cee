"""The one choice of kernels: which forward and backward run a call on a device, with which tiles.

`choose` reads the call (`Call`), the device it is compiled for (`Device`) and what the user
asked for, asks each backend package why it cannot run the call (`why_not_*`, a reason or None),
and returns the `KernelConfig` that `_vjp` runs (through `_passes`), or None for the plain-jnp
"xla" path. The public API, the tuner and the decode API all choose here.

With backend=None on a GPU of compute capability >= 8.0 ("xla" for float64 inputs, as on a CPU:
`kernel_backend`):

- Forward: the decode kernel (flash-decoding, `triton.few_tokens.few_token_forward`) for a
  few query tokens over a longer key sequence (`few_tokens_on_decode`), in the interpreter too;
  else the Mosaic GPU forward on Hopper when it runs the call, its grid fills the GPU (else
  Triton's split-KV forward does better), the user gave no `block_sizes`, and its lengths are
  whole tiles or both at least MOSAIC_RAGGED_MIN_LEN; else Triton.
- Backward (the one the flash forward would have had, under the decode kernel's too): the
  Mosaic GPU backward with the Mosaic forward for the calls it runs (dropout too), unless
  `block_sizes` configure the Triton backward or H=64 below 2048 keys (Triton measured faster
  there); else Triton.
- Tiles: Triton's from the user, else the autotune cache's entry for (device kind, shape
  class), else the shipped heuristics; Mosaic's from the cache's entry where the kernel takes
  them on the call's shapes, else its defaults (at H=64, 64-row forward tiles where the
  128-row defaults would leave the GPU half idle). The Mosaic backward's defaults compute dQ in
  the dK/dV kernel where that is faster: by integer adds (`BackwardTiles(fused_dq="fixed")`,
  bitwise deterministic, `fixed_dq_is_faster`), or with `deterministic_grads=False` by f32
  adds in any order (`fused_dq="add"`, `fused_dq_is_faster`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flash import mosaic, triton, tune_cache
from pallas_flash._passes import KernelConfig
from pallas_flash.call import Call
from pallas_flash.device import Device
from pallas_flash.triton import BlockSizes
from pallas_flash.tune_cache import MosaicTiles, ShapeClass, TunedEntry

BACKENDS = ("triton", "mosaic", "xla")

# Below this key length at H=64 the Triton backward is the faster one on the H200, from it the
# Mosaic one (1k keys is not measured; docs/notes/backward.md, "Mosaic or Triton at H=64").
MOSAIC_BACKWARD_MIN_KV_LEN = 2048

# Calls whose last query or key tile is ragged take the Mosaic kernels from this length of both
# sequences: below it the masked last tile is a large share of the work and Triton's smaller
# tiles win (ViT's 197 and 577 tokens at H=64: Triton 150 and 247 TFLOP/s, Mosaic 82 and 183);
# at 3000 tokens Mosaic is 1.6x Triton (docs/notes/shapes.md, "Any length and head dim").
MOSAIC_RAGGED_MIN_LEN = 1024

# With deterministic_grads=False, calls take the fused dQ from these lengths (of both T and S)
# per head dim, where it was measured faster than the two-kernel backward (fwd+bwd): at H=64
# from 2k tokens (1.15x plain, 1.06x causal at 2k; shorter calls keep the Triton backward); at
# H=128 with step descriptors plain 1.11-1.19x at 2k, causal 1.07-1.09x at 2k (since dK and dV
# start uninitialised and K is cleaned in the kernel; 1.00x before), 1.06-1.10x at 4k, 1.08x at
# 8k, 1.14x at 16k. docs/notes/fused-dq.md, "Measurements";
# docs/notes/fused-dq.md, "Hidden keys' K".
FUSED_DQ_MIN_LEN = {64: 2048, 128: 2048}
FUSED_DQ_CAUSAL_MIN_LEN = {64: 2048, 128: 2048}
# The same with a window, segment ids or sequence lengths, measured with a window of 1024 keys
# and with 4 packed documents: H=128 plain 1.05-1.16x from 4k; causal 1.01-1.09x at 16k
# (0.98-1.02x at 4k, before the change above); H=64 1.06-1.18x at 16k
# (docs/notes/fused-dq.md, "Masked calls on the fused dQ").
FUSED_DQ_MASKED_MIN_LEN = {64: 16384, 128: 4096}
FUSED_DQ_MASKED_CAUSAL_MIN_LEN = {64: 16384, 128: 16384}

# Bitwise deterministic calls take the fused dQ of integer adds (fused_dq="fixed") from these
# lengths (of both T and S) per head dim, where it measured faster than the two-kernel backward
# (fwd+bwd, bf16, T == S). H=64: 1.04-1.05x at 4k and 1.09x at 16k plain, 1.02-1.05x at 16k
# causal (0.97-0.99x at 4k), GQA 32/8 1.07-1.08x; H=128 with step descriptors: plain 1.08x at
# 4k, 1.09x at 8k, 1.08x at 16k (GQA 16/4 1.07-1.11x), causal 1.04-1.05x at 8k and
# 1.08-1.10x at 16k (1.01-1.02x at 4k, within two runs' spread: two kernels there).
# docs/notes/fused-dq.md, "Measurements".
FIXED_DQ_MIN_LEN = {64: 4096, 128: 4096}
FIXED_DQ_CAUSAL_MIN_LEN = {64: 16384, 128: 8192}
# Where another card measured otherwise, its own thresholds, by a word of its device kind. H100
# 80GB HBM3, H=128 with step descriptors, fwd+bwd over the two kernels: plain 1.04x at 2k and
# 1.08x at 4k, causal 0.89x at 2k and 1.01x at 4k (docs/notes/fused-dq.md, "Measurements");
# H=64 not measured there.
FIXED_DQ_MIN_LEN_BY_CARD = {"H100": {64: 4096, 128: 2048}}


# flash_attention's forward of at most this many query tokens (T) runs on the decode kernel,
# where it expresses the call's mask (`few_tokens_on_decode`). The flash forward's grid is
# (query tiles x B * N): a few tokens take one tile each of B * N programs that each loop over
# all S keys, and every query head of a GQA group reads its KV head again. The decode kernel
# packs a KV head's query heads times the tokens into one tile and splits the key loop over
# programs: on the H100 (N=32, K=8, H=128, bf16, T 1 and 4) decode_attention read K/V at
# 2.6-2.8 TB/s, the flash forward on the same arrays at 1.07-1.43 (issue 45). 16: the
# most new tokens the decode kernel is measured at (`bench --suite decode`: T 1, 4 and 16;
# 3.3-3.4 TB/s at T=16 on the H200); beyond, its packed rows (T times the group) outgrow one
# tile while the flash forward's query tiles fill (not measured).
DECODE_ROUTE_MAX_Q_LEN = 16
# ... over at least this many keys (in the interpreter too: 64 keys are one of the decode
# kernel's 64-key tiles, so the CPU tests run the route on small calls) ...
DECODE_ROUTE_MIN_KV_LEN = 64
# ... and, compiled, over at least this many keys per KV head in the whole batch (B * S), for
# one token / for more. Below them both forwards are a few microseconds and the flash forward's
# one tile per head is as fast or faster. H100, N=32, K=8, H=128, bf16, kernel time, decode
# kernel over the flash forward (docs/notes/decode.md, "flash_attention with a few tokens"):
# T=1 B=1 S=256 1.01x, S=1k 1.19x; B=8 S=64 1.07x, S=256 1.42x; T=4 B=1 S=1k 0.89x, S=4k
# 0.89x, S=128k 2.54x; B=8 S=256 0.92x, S=1k 1.35x, S=4k 1.68x.
DECODE_ROUTE_MIN_BATCH_KEYS = {1: 512, DECODE_ROUTE_MAX_Q_LEN: 8192}


# Float64 runs on the plain-jnp reference and in the Pallas interpreter only: the GPU kernels'
# tiles, shared-memory budgets and matrix-unit paths are those of 16- and 32-bit inputs.
FLOAT64_PATHS = (
    "float64 runs on backend='xla' (backend=None picks it) or in the Pallas interpreter "
    "(interpret=True); the Triton GPU kernels take float16, bfloat16 and float32, the Mosaic GPU "
    "kernels bfloat16 and float16"
)


def kernel_backend(
    backend: str | None, device: Device | None, interpret: bool | None, dtype
) -> str:
    """What `backend` runs on `device` (None: no NVIDIA GPU) for inputs of `dtype`: "xla",
    "triton", "mosaic", or "auto" (None on a capable GPU: `choose` picks the kernels per call).
    Raises ValueError for a backend the device cannot run, NotImplementedError for float64 on
    a GPU kernel (`FLOAT64_PATHS`).

    backend=None with float64 inputs runs "xla" on a GPU as elsewhere: float64 is for checking
    (`jax.test_util.check_grads`, oracles), where the exact reference is what is wanted, and
    the same call then runs on a laptop and on a GPU host."""
    if interpret:
        return "triton"
    triton_gap = triton.why_not_device(device)
    float64 = jnp.dtype(dtype) == jnp.float64
    if backend is None:
        return "auto" if triton_gap is None and not float64 else "xla"
    if float64 and backend in ("triton", "mosaic") and device is not None:
        raise NotImplementedError(f"dtype float64 with backend={backend!r}: {FLOAT64_PATHS}")
    if backend == "triton" and triton_gap:
        raise ValueError(
            f"backend='triton' {triton_gap}; pass interpret=True to run the kernels in the "
            "Pallas interpreter, or backend='xla'"
        )
    if backend == "mosaic" and (mosaic_gap := mosaic.why_not_device(device)):
        if triton_gap:
            raise ValueError(
                f"backend='mosaic' {mosaic_gap}; elsewhere pass backend='triton' with "
                "interpret=True to run the Triton kernels in the Pallas interpreter, or "
                "backend='xla'"
            )
        raise ValueError(
            f"backend='mosaic' {mosaic_gap}: its kernel uses sm_90a's wgmma and TMA; use "
            "backend='triton' or None"
        )
    return backend


def float8_cache_backend(backend: str, requested: str | None, device: Device | None) -> str:
    """`backend` (`kernel_backend`'s choice) for a decode call over a float8 cache: the Triton
    kernel converts float8 tiles with instructions of compute capability 8.9 and later, so on
    an older GPU a call that named no backend runs "xla", and one that named "triton" raises
    ValueError. The interpreter (device None) converts anywhere."""
    if backend == "xla" or device is None or device.compute_capability >= (8, 9):
        return backend
    if requested is None:
        return "xla"
    raise ValueError(
        f"backend={requested!r}: the kernel reads float8_e4m3fn caches on GPUs of compute "
        f"capability >= 8.9 (found {device.compute_capability}); use backend='xla' or None"
    )


def choose(
    call: Call,
    device: Device | None,
    *,
    scale: float,
    backend: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    tuned: TunedEntry | None = None,
) -> KernelConfig | None:
    """The kernels and tiles that run `call` on `device`, or None for the "xla" path.

    Args:
      call: the canonical call.
      device: the GPU it is compiled for (`device.target_device()`), None without one.
      scale: the logits' scale (carried into the config).
      backend, block_sizes, interpret: as the user passed them to `flash_attention`.
      tuned: an autotune entry to use instead of the cache's (the tuner's candidates).

    Raises:
      ValueError: a backend the device cannot run, or block_sizes where "xla" runs.
      NotImplementedError: backend="mosaic" for a call its forward does not run.
    """
    kind = kernel_backend(backend, device, interpret, call.dtype)
    # The Triton backward runs a value head dim Hv != H at max(H, Hv) (its wrapper zero-pads)
    # and the Triton forward shares its BlockSizes: Triton's tiles are that head dim's.
    one_head_dim = call.common_head_dim()
    if kind == "xla":
        if block_sizes is not None:
            found = "none" if device is None else device.compute_capability
            why = f"no NVIDIA GPU of compute capability >= 8.0; found {found}"
            if jnp.dtype(call.dtype) == jnp.float64 and triton.why_not_device(device) is None:
                why = "float64 inputs"
            raise ValueError(
                "block_sizes configures the Triton kernels, but backend=None runs the 'xla' "
                f"backend here ({why}): pass interpret=True to run the kernels in the Pallas "
                "interpreter, or block_sizes=None"
            )
        return None
    interpret = bool(interpret)
    user_block_sizes = block_sizes
    if block_sizes is None:
        block_sizes = _triton_block_sizes(one_head_dim, device, interpret, tuned)
    tiles = MosaicTiles()
    if kind in ("auto", "mosaic"):
        tiles = _mosaic_tiles(call, device, tuned)
    forward = _choose_forward(kind, call, device, tiles.forward, user_block_sizes)
    backward = _choose_backward(kind, forward, call, device, tiles.backward, user_block_sizes)
    # The decode kernel's forward returns what either backward reads: the backward stays the
    # one the flash forward would have had.
    if (
        backend is None
        and user_block_sizes is None
        and few_tokens_on_decode(call, interpret=interpret)
    ):
        forward = "decode"
    return KernelConfig(
        spec=call.spec,
        scale=scale,
        soft_cap=call.soft_cap,
        dropout_rate=call.dropout_rate,
        block_sizes=block_sizes,
        interpret=interpret,
        forward=forward,
        backward=backward,
        mosaic_forward_tiles=(
            (tiles.forward or mosaic.default_forward_tiles(call)) if forward == "mosaic" else None
        ),
        mosaic_backward_tiles=(
            _mosaic_backward_tiles(call, device, tiles.backward) if backward == "mosaic" else None
        ),
        device=None if interpret else device,
    )


def _tuned_entry(call: Call, device: Device, *, masked: bool) -> TunedEntry | None:
    """The autotune cache's entry (the user's file, else the shipped table) for the call's shape
    class on `device`'s kind; `masked`: the class of calls with a bias or dense mask tile."""
    shape_class = ShapeClass.of(
        call.head_dim,
        call.dtype,
        is_causal=call.spec.is_causal,
        q_len=call.q_len,
        kv_len=call.kv_len,
        masked=masked,
        narrow=triton.narrow_band(call.spec),
    )
    return tune_cache.tuned_entry(device.kind, shape_class)


def _triton_block_sizes(
    call: Call, device: Device | None, interpret: bool, tuned: TunedEntry | None
) -> BlockSizes:
    """The Triton tiles of a call the user gave none for: the interpreter's; else the autotune
    entry's (`tuned`, else the cache's); else the backend's heuristics. `device` is None only in
    the interpreter."""
    if not interpret:
        entry = _tuned_entry(call, device, masked=call.masked) if tuned is None else tuned
        if entry is not None:
            return entry.block_sizes
    return triton.block_sizes(call, interpret=interpret)


def _mosaic_tiles(call: Call, device: Device, tuned: TunedEntry | None) -> MosaicTiles:
    """The autotune entry's Mosaic tiles for this call, each kept only where its kernel runs the
    call with it (a shape class spans many lengths); None: the kernel's defaults."""
    if tuned is None:
        # Mosaic calls carry no bias or dense mask: the unmasked shape class.
        entry = _tuned_entry(call.common_head_dim(), device, masked=False)
        found = MosaicTiles() if entry is None else entry.mosaic
        # The tuner times the default backward, bitwise deterministic: a call that allows dQ
        # summed in any order keeps the dispatch's own backward tiles (f32 adds where faster).
        if not call.deterministic_grads:
            found = MosaicTiles(found.forward, None)
    else:
        found = tuned.mosaic
    forward, backward = found.forward, found.backward
    # Tiles that would leave a short call a ragged last tile would send it to Triton: the
    # defaults may not.
    if forward is not None and (
        mosaic.why_not_forward(call, device, forward) or _short_and_ragged(call, forward)
    ):
        forward = None
    if backward is not None and mosaic.why_not_backward(call, device, backward):
        backward = None
    if forward is None:
        forward = _narrow_forward_tiles(call, device)
    return MosaicTiles(forward, backward)


def _narrow_forward_tiles(call: Call, device: Device) -> mosaic.ForwardTiles | None:
    """The default forward's 64-row tiles where its 128-row ones (plain H=64) would leave the
    GPU half idle and the 64-row grid fills it: twice the CTAs keep the call, forward and
    backward, on the Mosaic kernels (B=1, N=4, 4k keys: 64 CTAs of 256 rows, 128 of 128).
    Measured: fwd+bwd 1.14-1.47x Triton's; the forward alone at B=1, N=8, 2k 10% behind
    Triton's split-KV, 14% ahead at N=4, 4k. None: the defaults as they are."""
    tiles = mosaic.default_forward_tiles(call)
    if tiles.block_q == 64 or _mosaic_fills_gpu(call, device, tiles):
        return None
    narrow = mosaic.default_forward_tiles(call, wide=False)
    return narrow if _mosaic_fills_gpu(call, device, narrow) else None


def few_tokens_on_decode(call: Call, *, interpret: bool = False) -> bool:
    """Whether the default call's forward runs on the decode kernel: at most
    DECODE_ROUTE_MAX_Q_LEN query tokens over at least DECODE_ROUTE_MIN_KV_LEN keys (compiled:
    and DECODE_ROUTE_MIN_BATCH_KEYS keys per KV head over the batch), in bfloat16 or float16,
    with a mask the decode kernel expresses exactly (`triton.why_not_few_token_forward`:
    geometry, lengths, soft cap, sinks). Float32 calls keep the Triton forward, whose row max
    lets the Triton backward recompute P free of lse's rounding (`_passes.takes_row_max`); the
    decode kernel keeps no row max."""
    if not (
        call.q_len <= DECODE_ROUTE_MAX_Q_LEN
        and call.kv_len >= DECODE_ROUTE_MIN_KV_LEN
        and call.dtype.itemsize == 2
        and triton.why_not_few_token_forward(call) is None
    ):
        return False
    if interpret:
        return True
    least = DECODE_ROUTE_MIN_BATCH_KEYS[1 if call.q_len == 1 else DECODE_ROUTE_MAX_Q_LEN]
    return call.q_shape[0] * call.kv_len >= least


def _choose_forward(kind, call: Call, device: Device, tiles, user_block_sizes) -> str:
    """The forward kernel of a Pallas call: "mosaic" or "triton"."""
    if kind == "triton":
        return "triton"
    gap = mosaic.why_not_forward(call, device, tiles)
    if kind == "mosaic":
        if gap is None and user_block_sizes is not None:
            gap = _forward_block_sizes_gap(user_block_sizes)
        if gap is not None:
            raise NotImplementedError(
                f"backend='mosaic' does not support this call ({gap}); backend='triton' or None "
                "runs it"
            )
        return "mosaic"
    if (
        gap is None
        and mosaic.why_not_device(device) is None
        and user_block_sizes is None
        and _mosaic_fills_gpu(call, device, tiles)
        and not _short_and_ragged(call, tiles)
    ):
        return "mosaic"
    return "triton"


def _choose_backward(kind, forward, call: Call, device: Device, tiles, user_block_sizes) -> str:
    """The backward kernel of a Pallas call: "mosaic" or "triton". The Mosaic backward goes
    with the Mosaic forward (it is Hopper code) for the calls it runs, unless the user's
    block_sizes configure the Triton backward."""
    if forward != "mosaic" or user_block_sizes is not None:
        return "triton"
    if mosaic.why_not_backward(call, device, tiles):
        return "triton"
    short = max(call.head_dim, call.v_head_dim) == 64 and call.kv_len < MOSAIC_BACKWARD_MIN_KV_LEN
    if short and kind != "mosaic":
        return "triton"
    return "mosaic"


def _mosaic_backward_tiles(call: Call, device: Device, tiles) -> mosaic.BackwardTiles:
    """The Mosaic backward's tiles: the given ones (the user's or the tuned), else its defaults,
    with dQ fused into the dK/dV kernel where that is faster: by integer adds (deterministic),
    or where deterministic_grads=False allows it by f32 adds."""
    if tiles is not None:
        return tiles
    tiles = mosaic.default_backward_tiles(call)
    if call.deterministic_grads:
        mode = "fixed" if fixed_dq_is_faster(call, device) else None
    else:
        mode = "add" if fused_dq_is_faster(call) else None
    if mode is None:
        return tiles
    # A grid that the two-kernel backward spreads by head splits (MQA) stays with it: the
    # fused dQ's staging leaves no shared memory for the splits' (not measured side by side).
    splits = mosaic.backward_tiles.head_splits(
        tiles,
        call.q_shape,
        call.k_shape,
        call.dtype.itemsize,
        num_sms=device.num_sms,
        causal=call.spec.is_causal,
        segments=call.spec.has_segments,
    )
    # At H=128 the fused dQ's consumers rebuild their operands' descriptors each step instead
    # of spilling them: fwd+bwd 3-25% faster, plain or causal, 4k to 16k ("fixed" plain 124/104
    # spill bytes to none). At H=64 nothing spills (ptxas: 0 bytes) and causal calls measured
    # even (docs/notes/fused-dq.md, "Step descriptors").
    step_descriptors = call.head_dim > 64
    fused = dataclasses.replace(tiles, fused_dq=mode, step_descriptors=step_descriptors)
    if splits > 1 or mosaic.why_not_backward(call, device, fused):
        return tiles
    return fused


def _measured_as(call: Call) -> str | None:
    """Which of the fused dQ's measurements cover a call: "plain" (plain or causal
    self-attention, MHA or GQA), "masked" (the same with a window or segment ids, measured
    with a window of 1024 keys and 4 packed documents; sequence lengths, which the kernels
    take as segment ids, with them), or None (a soft cap, a value head dim of its own or a
    dense mask: not measured)."""
    spec = call.spec
    if call.soft_cap is not None or call.value_head_dim is not None or spec.mask_shape is not None:
        return None
    return "masked" if spec.window is not None or spec.has_segments else "plain"


def fused_dq_is_faster(call: Call) -> bool:
    """Whether the Mosaic backward with dQ in its dK/dV kernel (not bitwise deterministic) beat
    the two-kernel one on the H200 for calls like this (`FUSED_DQ_MIN_LEN`,
    `FUSED_DQ_CAUSAL_MIN_LEN`; with a window or segments `FUSED_DQ_MASKED_MIN_LEN`,
    `FUSED_DQ_MASKED_CAUSAL_MIN_LEN`); measured on plain, causal, windowed and packed
    self-attention of 2k to 16k tokens only (docs/notes/fused-dq.md, "Measurements";
    docs/notes/fused-dq.md, "Masked calls on the fused dQ")."""
    measured = _measured_as(call)
    if measured == "masked":
        return _long_enough(call, FUSED_DQ_MASKED_CAUSAL_MIN_LEN, FUSED_DQ_MASKED_MIN_LEN)
    return measured == "plain" and _long_enough(call, FUSED_DQ_CAUSAL_MIN_LEN, FUSED_DQ_MIN_LEN)


def _long_enough(call: Call, causal_min_len: dict, min_len: dict) -> bool:
    """Whether both of a call's lengths reach the least measured faster for its head dim
    (causal_min_len for causal calls, min_len otherwise)."""
    least = (causal_min_len if call.spec.is_causal else min_len).get(call.head_dim)
    return least is not None and min(call.q_len, call.kv_len) >= least


def fixed_dq_is_faster(call: Call, device: Device | None = None) -> bool:
    """Whether the Mosaic backward with dQ summed as integers in its dK/dV kernel
    (fused_dq="fixed", bitwise deterministic) beat the two-kernel one on `device`'s card (the
    H200's thresholds unless `FIXED_DQ_MIN_LEN_BY_CARD` has the card's) for calls like this
    (`FIXED_DQ_MIN_LEN`, `FIXED_DQ_CAUSAL_MIN_LEN`); measured on plain and causal
    self-attention of 2k to 16k tokens in bf16 only. It needs bfloat16, a head dim that is a
    multiple of 64, no dropout and no value head dim of its own (`mosaic.backward_tiles.why_not`).
    Calls with a window or segments run it but measured slower (0.80-0.98x with a window of
    1024 keys, 0.80-1.08x with 4 packed documents: its per-row scales cost as much as in a
    plain call, for less work), so they keep two kernels."""
    min_len = FIXED_DQ_MIN_LEN
    for card, lengths in FIXED_DQ_MIN_LEN_BY_CARD.items():
        if device is not None and card in device.kind:
            min_len = lengths
    return _measured_as(call) == "plain" and _long_enough(call, FIXED_DQ_CAUSAL_MIN_LEN, min_len)


def _mosaic_fills_gpu(call: Call, device: Device, tiles) -> bool:
    """Whether the Mosaic forward's grid (one CTA per 128 or 256 query rows and head) fills the
    GPU; when it does not, Triton's split-KV forward spreads the key loop over more programs.
    tiles: the forward's tiles, None for its defaults."""
    batch, q_len, num_heads, _ = call.q_shape
    tiles = tiles or mosaic.default_forward_tiles(call)
    ctas = batch * num_heads * -(-q_len // tiles.cta_rows)
    kv_tiles = -(-call.kv_len // tiles.block_kv)
    splits = triton.choose_kv_splits(0, ctas, kv_tiles, interpret=False, num_sms=device.num_sms)
    return splits == 1


def _short_and_ragged(call: Call, tiles) -> bool:
    """Whether the call's last query or key tile is ragged (T or S not a multiple of the
    forward's tiles) while T or S is below MOSAIC_RAGGED_MIN_LEN."""
    tiles = tiles or mosaic.default_forward_tiles(call)
    ragged = call.q_len % tiles.cta_rows or call.kv_len % tiles.block_kv
    return bool(ragged) and min(call.q_len, call.kv_len) < MOSAIC_RAGGED_MIN_LEN


def _forward_block_sizes_gap(block_sizes: BlockSizes) -> str | None:
    """The Triton forward's fields of `block_sizes` that differ from their defaults: the Mosaic
    forward has its own tiles, so these would be ignored."""
    default = BlockSizes()
    changed = [
        f"{name}={getattr(block_sizes, name)}"
        for name in ("block_q", "block_kv", "num_warps", "num_stages", "kv_splits")
        if getattr(block_sizes, name) != getattr(default, name)
    ]
    if changed:
        return f"block_sizes sets the Triton forward's {', '.join(changed)}"
    return None
