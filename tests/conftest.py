"""Shared test helpers: a float64 numpy oracle (forward and analytic backward), the plain
attention baseline run in the input dtype, random inputs, the FlashAttention-style tolerance rule,
the `gpu` marker / execution `mode` plumbing, and the backend matrix (`backend_paths`): the
paths one behaviour must hold on.

Tolerance rule (FlashAttention's tests): the kernel's max abs error against the float64 oracle must
be at most twice the error of a plain XLA attention computed in the input dtype, plus a small floor
(FLOOR[dtype] times the largest magnitude of the output, or times 1 if that is smaller).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import math
import os
from unittest import mock

# jax's Mosaic GPU interpreter (mosaic_interpret.py) runs a kernel's warpgroups as threads whose
# barrier waits are host callbacks, and XLA's CPU client may run such a callback on a thread of
# its pool, where it blocks until another warpgroup arrives. With a pool as small as the host's
# cores (2 in CI), the callback that launched the warpgroups and one blocked wait fill it, and
# the warpgroup that would arrive cannot run: a deadlock that depends on the scheduling. XLA
# sizes the pool from NPROC when it is set before the CPU backend starts.
os.environ.setdefault("NPROC", "8")

# On a machine without an NVIDIA GPU most of the suite's time is XLA's CPU compiling the
# interpreted kernels and the oracles; LLVM at optimisation level 0 compiles them in about 60%
# of the time (and runs them a little slower). Set before the CPU backend starts; left alone
# where a GPU is (its XLA fusions are compiled with this flag too).
if not glob.glob("/dev/nvidia[0-9]*") and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import api, flax_common, masks
from pallas_flash import device as device_lib
from pallas_flash.device import Device, gpu_compute_capability

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

# Added to 2 x (plain attention error). Small against the errors a wrong kernel makes (see
# test_triton_forward.py::test_wrong_scale_fails_the_tolerance_rule), large against rounding noise.
FLOOR = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3, jnp.float16: 1e-3}


# -- gpu marker and execution modes ---------------------------------------------------------------


def has_gpu() -> bool:
    cc = gpu_compute_capability()
    return cc is not None and cc >= (8, 0)


def pytest_collection_modifyitems(config, items):
    _slice_for_ci(items)
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU of compute capability >= 8.0")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _slice_for_ci(items):
    """`@pytest.mark.ci_slice(n)` on a parametrized test: without PALLAS_FLASH_SWEEP, only its
    first n CPU cases (in parametrization order: put the ones that matter most first) run; the
    rest are the sweep's. Cases marked gpu are never sliced: they are the compiled checks."""
    if SWEEP:
        return
    seen = collections.Counter()
    for item in items:
        marker = item.get_closest_marker("ci_slice")
        if marker is None or item.get_closest_marker("gpu") is not None:
            continue
        if any(m.args and m.args[0] is True for m in item.iter_markers("skipif")):
            continue  # a case already left to the sweep (SWEEP_ONLY) is not counted
        key = (item.path, item.originalname)
        seen[key] += 1
        if seen[key] > marker.args[0]:
            item.add_marker(
                pytest.mark.skip(reason="beyond the CI slice: PALLAS_FLASH_SWEEP=1 runs it")
            )


# "interpret": the Triton kernels in the Pallas interpreter on CPU; "gpu": compiled for the GPU.
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


def kernel_kwargs(mode: str) -> dict:
    """Keyword arguments of `flash_attention` that run the Triton kernels in `mode` (the
    Triton paths of the backend matrix, BACKEND_PATHS)."""
    return BACKEND_PATHS["triton-interpret" if mode == "interpret" else "triton"].call_kwargs()


@pytest.fixture
def flash_kwargs(mode) -> dict:
    """The call kwargs of the `mode` fixture's run: `flash_attention(q, k, v, **flash_kwargs)`."""
    return kernel_kwargs(mode)


@pytest.fixture
def no_compute(monkeypatch):
    """Makes any attempt to run a backend fail the test: errors must come from validation."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("a backend was called: validation did not stop the call")

    monkeypatch.setattr(api, "flash_attention_kernels", must_not_run)
    monkeypatch.setattr(api, "flash_attention_kernels_with_log_sum", must_not_run)
    monkeypatch.setattr(api, "reference_attention_vjp", must_not_run)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which fallback warnings this process has given, for this test only."""
    monkeypatch.setattr(flax_common, "_warned", set())


def uniform_block_sizes(n: int) -> pallas_flash.BlockSizes:
    """Every tile of every Triton kernel n x n."""
    return pallas_flash.BlockSizes(
        block_q=n, block_kv=n, block_q_dkv=n, block_kv_dkv=n, block_q_dq=n, block_kv_dq=n
    )


# Block-size configurations used by the tests (None: the library's default for the mode).
BLOCK_SIZES = {
    "default": None,
    "all16": uniform_block_sizes(16),
    "q32kv16": pallas_flash.BlockSizes(
        block_q=32, block_kv=16, block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16
    ),
    "q16kv64": pallas_flash.BlockSizes(
        block_q=16, block_kv=64, block_q_dkv=64, block_kv_dkv=16, block_q_dq=16, block_kv_dq=64
    ),
}


# -- the backend matrix ---------------------------------------------------------------------------

# Set (to anything) to run the matrix's slow cases too (the interpreters at larger sizes); the
# property sweep reads it as its number of examples.
SWEEP = bool(os.environ.get("PALLAS_FLASH_SWEEP"))
# Cases that others cover in CI, run with PALLAS_FLASH_SWEEP (slow on the 2-core CI machine).
SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="covered in CI by others: PALLAS_FLASH_SWEEP=1")


def has_hopper() -> bool:
    return gpu_compute_capability() == (9, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class BackendPath:
    """One way a call runs, as a test sees it: `kwargs` select it in `flash_attention`,
    `flash_attention_backward` and `decode_attention`; `scope()` surrounds tracing and running
    (and the conversion of the results to numpy, which must happen inside it).

    tiles: the path takes `block_sizes` (the Triton kernels); mosaic: it runs the Mosaic GPU
    kernels, which take bfloat16/float16, H 64/80/96/128/192/256 and any lengths, and
    whose backward runs at every head dim with the forward's masks (else the Triton backward
    runs, which the Mosaic interpreter cannot: forward-only checks there).
    """

    name: str
    kwargs: dict
    tiles: bool = False
    mosaic: bool = False
    gpu: bool = False
    interpreted: bool = False
    refuses: str | None = None

    def call_kwargs(self, block_sizes=None) -> dict:
        """`kwargs`, plus `block_sizes` on the paths that take them."""
        kwargs = dict(self.kwargs)
        if block_sizes is not None and self.tiles:
            kwargs["block_sizes"] = block_sizes
        return kwargs

    @contextlib.contextmanager
    def scope(self):
        """Where the path's calls are traced and run. Where the path refuses an option of the
        check (`backend_paths(refuses=...)`), a NotImplementedError must name it."""
        try:
            with self._runner():
                yield
        except NotImplementedError as e:
            if self.refuses is not None and self.refuses not in str(e):
                raise AssertionError(
                    f"{self.name} raised NotImplementedError without naming {self.refuses!r}: {e}"
                ) from e
            raise

    def _runner(self):
        if self.name != "mosaic-interpret":
            return contextlib.nullcontext()
        from mosaic_interpret import interpret_mosaic

        # The dispatch chooses for an H200; jax's Mosaic GPU interpreter runs the kernels.
        runner = contextlib.ExitStack()
        runner.enter_context(mock.patch.object(device_lib, "target_device", Device.h200))
        runner.enter_context(interpret_mosaic())
        return runner

    def __str__(self):
        return self.name


# The one list of paths. A new backend (or interpreter) is one entry here; every test that takes
# `backend_paths()` then runs its checks on it.
BACKEND_PATHS = {
    path.name: path
    for path in (
        BackendPath("xla", {"backend": "xla"}),
        BackendPath(
            "triton-interpret",
            {"backend": "triton", "interpret": True},
            tiles=True,
            interpreted=True,
        ),
        BackendPath("mosaic-interpret", {"backend": "mosaic"}, mosaic=True, interpreted=True),
        BackendPath("triton", {"backend": "triton"}, tiles=True, gpu=True),
        # What a user gets: on Hopper the Mosaic kernels where they take the call, else Triton.
        BackendPath("default", {}, gpu=True),
        BackendPath("mosaic", {"backend": "mosaic"}, mosaic=True, gpu=True),
    )
}


def backend_paths(
    *,
    cpu: bool = True,
    gpu: bool = True,
    mosaic: bool = False,
    refuses: dict[str, str] | None = None,
    skip: dict[str, str] | None = None,
    sweep: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> list:
    """The paths of BACKEND_PATHS as pytest params (ids: their names), for
    `@pytest.mark.parametrize("path", backend_paths(...))`.

    cpu / gpu: the paths that run on CPU (backend="xla" and the interpreters) / the compiled
    ones (marked `gpu`; the Mosaic ones also need Hopper). mosaic: include the Mosaic paths
    (the check's shapes and dtypes must be theirs; see BackendPath). refuses: {path: option}
    where the path does not take an option of the check: the API must raise
    NotImplementedError naming it (a strict xfail; `BackendPath.scope` checks the name).
    skip: {path: why} where the check cannot run on that path. sweep: paths run only with
    PALLAS_FLASH_SWEEP set (slow on CPU). exclude: paths the check is not about.
    """
    refuses, skip = refuses or {}, skip or {}
    unknown = (set(refuses) | set(skip) | set(sweep) | set(exclude)) - set(BACKEND_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}: not in {sorted(BACKEND_PATHS)}")
    params = []
    for name, path in BACKEND_PATHS.items():
        if (path.gpu and not gpu) or (not path.gpu and not cpu) or name in exclude:
            continue
        if path.mosaic and not mosaic:
            continue
        marks = []
        if path.gpu:
            marks.append(pytest.mark.gpu)
            if path.mosaic:
                marks.append(
                    pytest.mark.skipif(not has_hopper(), reason="the Mosaic kernels need sm_90")
                )
        if name in skip:
            marks.append(pytest.mark.skip(reason=f"{name}: {skip[name]}"))
        if name in sweep:
            marks.append(
                pytest.mark.skipif(not SWEEP, reason=f"{name} is slow on CPU: PALLAS_FLASH_SWEEP=1")
            )
        if name in refuses:
            marks.append(
                pytest.mark.xfail(
                    raises=NotImplementedError,
                    strict=True,
                    reason=f"{name} refuses {refuses[name]} (NotImplementedError)",
                )
            )
            path = dataclasses.replace(path, refuses=refuses[name])
        params.append(pytest.param(path, id=name, marks=marks))
    return params


# -- problems and random inputs -------------------------------------------------------------------


def case_id(value) -> str:
    """A parametrized case's id: kernel tiles (`pallas_flash.BlockSizes`, the Mosaic
    `ForwardTiles` and `BackwardTiles`) by the fields that differ from their defaults, so that
    a field added to them does not rename every case; anything else by str."""
    from pallas_flash.mosaic import BackwardTiles, ForwardTiles

    if not isinstance(value, (pallas_flash.BlockSizes, ForwardTiles, BackwardTiles)):
        return str(value)
    changed = [
        f"{field.name}={getattr(value, field.name)!r}"
        for field in dataclasses.fields(value)
        if field.default is dataclasses.MISSING or getattr(value, field.name) != field.default
    ]
    return f"{type(value).__name__}({', '.join(changed)})"


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes and options of one attention call: q [B, T, N, H], k and v [B, S, K, H]."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_causal: bool
    dtype: str = "f32"
    blocks: str = "default"

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def floor(self) -> float:
        return FLOOR[self.jnp_dtype]

    @property
    def block_sizes(self):
        return BLOCK_SIZES[self.blocks]

    def __str__(self):
        mask = "causal" if self.is_causal else "full"
        return (
            f"B{self.batch}-T{self.q_len}-S{self.kv_len}-N{self.num_heads}-K{self.num_kv_heads}"
            f"-H{self.head_dim}-{mask}-{self.dtype}-{self.blocks}"
        )


# Larger problems, compiled for the GPU only (the interpreter would take minutes).
GPU_PROBLEMS = [
    Problem(2, 1000, 1000, 8, 2, 128, True, "bf16"),
    Problem(2, 1000, 1000, 8, 2, 128, False, "bf16"),
    Problem(1, 1000, 1000, 4, 4, 256, True, "bf16"),
    Problem(1, 1000, 777, 4, 1, 256, False, "f16"),
    Problem(1, 777, 1000, 4, 2, 80, True, "f32"),
    Problem(2, 1000, 1000, 16, 2, 64, True, "f16"),
    Problem(1, 300, 300, 2, 2, 256, True, "f32"),
]


def random_array(rng, shape, dtype):
    """Standard normal values rounded to `dtype`: (jax array, the same values as float64)."""
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def random_inputs(p: Problem, seed: int = 0):
    """q, k, v and cotangents d_out (input dtype), d_lse (float32) for `p`.

    Returns (jax arrays, float64 copies) as two tuples (q, k, v, d_out, d_lse).
    """
    rng = np.random.default_rng(seed)
    q_shape = (p.batch, p.q_len, p.num_heads, p.head_dim)
    kv_shape = (p.batch, p.kv_len, p.num_kv_heads, p.head_dim)
    lse_shape = (p.batch, p.num_heads, p.q_len)
    pairs = [
        random_array(rng, q_shape, p.jnp_dtype),
        random_array(rng, kv_shape, p.jnp_dtype),
        random_array(rng, kv_shape, p.jnp_dtype),
        random_array(rng, q_shape, p.jnp_dtype),
        random_array(rng, lse_shape, jnp.float32),
    ]
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


# -- segment ids ----------------------------------------------------------------------------------

SEGMENT_KINDS = ("one-document", "packed", "lengths", "packed-lengths", "unsorted", "gap")


def segment_arrays(kind: str, batch: int, q_len: int, kv_len: int, seed: int = 0):
    """MaskArrays with segment ids [B, T] and [B, S], lengths folded in (`masks.make_arrays`).

    kind: "one-document" (all ids 0: the geometry alone); "packed" (sorted ids 0-3, the same
    for queries and keys when T == S); "lengths" (query and key lengths: padding rows that see
    no key, the last batch entry with no key at all); "packed-lengths" (both); "unsorted"
    (random ids 0-2: many masked tiles); "gap" (query rows of ids 0 then 2, keys of ids 0, 1,
    2: the consumers of a CTA may visit tiles far apart, leaving a gap both drain).
    """
    rng = np.random.default_rng(seed)
    kwargs = {}
    if kind in ("packed", "packed-lengths"):
        q_ids = np.sort(rng.integers(0, 4, size=(batch, q_len)), axis=1)
        kv_ids = q_ids if q_len == kv_len else np.sort(rng.integers(0, 4, size=(batch, kv_len)))
        kwargs.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    elif kind == "unsorted":
        kwargs.update(
            q_segment_ids=rng.integers(0, 3, size=(batch, q_len)),
            kv_segment_ids=rng.integers(0, 3, size=(batch, kv_len)),
        )
    elif kind == "gap":
        q_ids = np.where(np.arange(q_len) % 128 < 64, 0, 2)
        kv_ids = np.where(np.arange(kv_len) < kv_len // 8, 0, 1)
        kv_ids = np.where(np.arange(kv_len) >= kv_len - kv_len // 8, 2, kv_ids)
        kwargs.update(
            q_segment_ids=np.broadcast_to(q_ids, (batch, q_len)),
            kv_segment_ids=np.broadcast_to(kv_ids, (batch, kv_len)),
        )
    elif kind not in ("one-document", "lengths"):
        raise ValueError(f"{kind=} is not one of {SEGMENT_KINDS}")
    if kind in ("lengths", "packed-lengths"):
        kwargs.update(
            query_seq_lengths=np.concatenate(
                [rng.integers(1, q_len + 1, size=batch - 1), [q_len // 3]]
            ),
            key_value_seq_lengths=np.concatenate(
                [rng.integers(1, kv_len + 1, size=batch - 1), [0]]
            ),
        )
    if not kwargs:
        kwargs["q_segment_ids"] = np.zeros((batch, q_len), np.int32)
    return masks.make_arrays(batch, q_len, kv_len, **kwargs)


# -- float64 oracle -------------------------------------------------------------------------------


def _visible(q_len, kv_len, is_causal):
    visible = np.ones((q_len, kv_len), bool)
    if is_causal:
        visible &= np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
    return visible


# The oracle runs on the GPU where there is one (float64 matmuls there take milliseconds, on
# one CPU core per test process seconds: the GPU suite's bottleneck), else in numpy.
# PALLAS_FLASH_ORACLE=numpy or =jax chooses.
@functools.cache
def oracle_on_device() -> bool:
    return os.environ.get("PALLAS_FLASH_ORACLE", "jax" if has_gpu() else "numpy") == "jax"


def attention_oracle_f64(
    q,
    k,
    v,
    d_out=None,
    d_lse=None,
    *,
    scale,
    visible,
    bias=None,
    soft_cap=None,
    keep=None,
    rate=0.0,
    sinks=None,
):
    """The float64 oracle of every test: out [B, T, N, H], lse [B, N, T] and, with cotangents
    d_out [B, T, N, H] and d_lse [B, N, T], dq, dk, dv and dlogits [B, N, T, S] (the caller sums
    it to a bias's shape), as numpy arrays. Rows that see no key: out 0, lse -inf, zero gradient.

    With sinks [N] (attention sinks, -inf: none) each row's softmax denominator also holds
    exp(sink): P shrinks by it, lse includes it (a row that sees no key has lse = its sink and
    out 0), and dsinks [N] = sum over batch and rows of P_sink (d_lse - rowsum(dO O)). A row
    that sees no key (masked, or -inf bias) counts P_sink = 1 also at a sink of -inf: its lse
    is the sink (the library's convention, `test_sinks.py`).

    logits = soft_cap(scale q.k + bias), softmax over the `visible` keys ([T, S] or broadcastable
    to [B, N, T, S]). Backward: dP = dO V^T, dS = P (dP - rowsum(dO O) + dlse) (1 - tanh^2 under
    the soft cap), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, the last two summed over the
    query heads of each kv head's group.

    With dropout's keep-mask `keep` ([B, N, T, S], bool) and `rate`: P.V takes P * Z, Z = keep /
    (1 - rate), and so do dV and dP (dS = P (Z dP - rowsum(dO O) + dlse)); lse is the
    un-dropped softmax's.
    """
    arrays = [q, k, v, d_out, d_lse, visible, bias, keep, sinks]
    arrays = [None if x is None else np.asarray(x) for x in arrays]
    arrays = [x if x is None or x.dtype == bool else x.astype(np.float64) for x in arrays]
    if not oracle_on_device():
        with np.errstate(divide="ignore"):  # log(0) of the empty rows, replaced by -inf
            return _oracle(np, *arrays, scale=scale, soft_cap=soft_cap, rate=rate)
    with jax.enable_x64(True):
        result = _oracle(
            jnp,
            *(None if x is None else jnp.asarray(x) for x in arrays),
            scale=scale,
            soft_cap=soft_cap,
            rate=rate,
        )
        return {name: np.asarray(x) for name, x in result.items()}


def _oracle(
    xp, q, k, v, d_out, d_lse, visible, bias, keep=None, sinks=None, *, scale, soft_cap, rate=0.0
):
    """attention_oracle_f64 in the array module xp (numpy, or jax.numpy under float64)."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    k_n, v_n = (xp.repeat(x, num_heads // num_kv_heads, axis=2) for x in (k, v))
    logits = scale * xp.einsum("btnh,bsnh->bnts", q, k_n, optimize=True)
    if bias is not None:
        logits = logits + bias
    d_cap = 1.0
    if soft_cap is not None:
        tanh = xp.tanh(logits / soft_cap)
        logits, d_cap = soft_cap * tanh, 1.0 - tanh * tanh
    row_max = xp.max(xp.where(visible, logits, -xp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks[None, :, None, None]  # [1, N, 1, 1]
        row_max = xp.maximum(row_max, sink)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    unnormalised = xp.where(visible, xp.exp(logits - row_max), 0.0)
    row_sum = unnormalised.sum(axis=-1, keepdims=True)
    if sinks is not None:
        sink_term = xp.exp(sink - row_max)
        row_sum = row_sum + sink_term
    empty = row_sum == 0.0
    row_sum = xp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum
    lse = xp.where(empty, -xp.inf, row_max + xp.log(row_sum))[..., 0]
    # Dropout's P * Z (Z = keep / (1 - rate)) where P.V and its derivatives use P.
    dropped = probs if keep is None else xp.where(keep, probs * (1.0 / (1.0 - rate)), 0.0)
    out = xp.einsum("bnts,bsnh->btnh", dropped, v_n, optimize=True)
    result = {"out": out, "lse": lse}
    if d_out is None:
        return result
    d_probs = xp.einsum("btnh,bsnh->bnts", d_out, v_n, optimize=True)
    if keep is not None:
        d_probs = xp.where(keep, d_probs * (1.0 / (1.0 - rate)), 0.0)
    delta = xp.einsum("btnh,btnh->bnt", d_out, out, optimize=True)
    d_logits = probs * (d_probs - delta[..., None] + d_lse[..., None]) * d_cap

    def group_sum(x):
        b, s, n, h = x.shape
        return x.reshape(b, s, num_kv_heads, n // num_kv_heads, h).sum(axis=3)

    result["dq"] = scale * xp.einsum("bnts,bsnh->btnh", d_logits, k_n, optimize=True)
    result["dk"] = group_sum(scale * xp.einsum("bnts,btnh->bsnh", d_logits, q, optimize=True))
    result["dv"] = group_sum(xp.einsum("bnts,btnh->bsnh", dropped, d_out, optimize=True))
    result["dlogits"] = d_logits
    if sinks is not None:
        no_key = ~xp.any(visible & (logits > -xp.inf), axis=-1)  # masked, or -inf bias
        p_sink = xp.where(no_key, 1.0, (sink_term / row_sum)[..., 0])  # [B, N, T]
        result["dsinks"] = (p_sink * (d_lse - delta)).sum(axis=(0, 2))
    return result


def attention_f64(q, k, v, *, scale, is_causal):
    """Float64 attention: out [B, T, N, H], lse [B, N, T] (natural log)."""
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    r = attention_oracle_f64(q, k, v, scale=scale, visible=visible)
    return r["out"], r["lse"]


def attention_grads_f64(q, k, v, d_out, d_lse, *, scale, is_causal):
    """Float64 (dq, dk, dv) for cotangents d_out [B, T, N, H] and d_lse [B, N, T]."""
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    r = attention_oracle_f64(q, k, v, d_out, d_lse, scale=scale, visible=visible)
    return r["dq"], r["dk"], r["dv"]


# -- plain attention in the input dtype (the baseline of the tolerance rule) ----------------------


def attention_in_dtype(q, k, v, *, scale, is_causal):
    """softmax(scale q k^T) v with every step in the input dtype: (out, lse as float32)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    visible = _visible(q.shape[1], k.shape[1], is_causal)
    logits = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v), lse.astype(jnp.float32)


def masked_in_dtype(q, k, v, *, scale, visible, soft_cap=None, keep=None, rate=0.0):
    """Plain attention with every step in the input dtype over a visibility broadcastable to
    [B, N, T, S] and an optional soft cap: the tolerance baseline of values and gradients. Rows
    that see no key: out 0, lse -inf, gradients 0 (no NaN through their empty softmax). keep:
    None, or a dropout keep-mask broadcastable to [B, N, T, S] at `rate` (P * keep / (1 - rate)
    multiplies V; lse stays the softmax's)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(scale, q.dtype)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)
    probs = unnormalised / row_sum
    if keep is not None:
        probs = probs * jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(q.dtype)
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(row_sum))[..., 0]
    return jnp.einsum("bnts,bsnh->btnh", probs, v), lse.astype(jnp.float32)


# -- running an attention function: outputs and gradients together -------------------------------


def to64(x):
    """x as a float64 numpy array (through float32, which holds every bf16 and f16 value)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def rounded(rng, shape, dtype, scale=1.0):
    """Normal values times `scale` rounded to `dtype`: (jax array, the same values in float64)."""
    x = jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return x, to64(x)


def sum_to_shape(x, shape):
    """Sums a [B, N, T, S] array over the dims a bias of `shape` was broadcast along."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(d for d in range(4) if shape4[d] == 1 and x.shape[d] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


MASK_ARGUMENTS = ("mask", "q_lens", "kv_lens", "q_seg", "kv_seg")
MASKED_OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def masked_outputs_and_grads(attention, xs, **kwargs) -> dict:
    """out, lse, dq, dk, dv, dbias of one jitted call of `attention` (flash_attention or
    attention_reference) and its VJP. xs: q, k, v, bias, d_out, d_lse and the mask arguments
    (MASK_ARGUMENTS: dense mask, lengths, segment ids; None where absent), and optionally sinks
    (then dsinks too); kwargs: the rest."""

    def f(q, k, v, bias, sinks, d_out, d_lse, extra):
        def call(q, k, v, bias, sinks):
            return attention(
                q,
                k,
                v,
                bias,
                extra["mask"],
                query_seq_lengths=extra["q_lens"],
                key_value_seq_lengths=extra["kv_lens"],
                q_segment_ids=extra["q_seg"],
                kv_segment_ids=extra["kv_seg"],
                sinks=sinks,
                return_residuals=True,
                **kwargs,
            )

        (out, lse), vjp = jax.vjp(call, q, k, v, bias, sinks)
        *grads, dsinks = vjp((d_out, d_lse))
        results = dict(zip(MASKED_OUTPUT_NAMES, (out, lse, *grads), strict=True))
        return results if sinks is None else results | {"dsinks": dsinks}

    extra = {name: xs[name] for name in MASK_ARGUMENTS}
    args = [xs[name] for name in ("q", "k", "v", "bias")]
    return jax.jit(f)(*args, xs.get("sinks"), xs["d_out"], xs["d_lse"], extra)


def outputs_and_grads(attn, q, k, v, d_out, d_lse):
    """(out, lse, dq, dk, dv) of `attn(q, k, v) -> (out, lse)` for the given cotangents."""
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return (out, lse, *vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype))))


def vmapped_outputs_and_grads(attn, args, num_slices: int):
    """`outputs_and_grads` under jax.vmap over `num_slices` slices of the batch of `args`
    (q, k, v, d_out, d_lse), with the results put back as one batch (to compare with the
    oracle of the whole batch)."""
    split = [x.reshape(num_slices, -1, *x.shape[1:]) for x in args]
    mapped = jax.jit(jax.vmap(functools.partial(outputs_and_grads, attn)))(*split)
    return [x.reshape(-1, *x.shape[2:]) for x in mapped]


def flash_fn(p: Problem, mode: str, **overrides):
    """q, k, v -> (out, lse) through `pallas_flash.flash_attention` for problem `p`."""
    kwargs = dict(
        is_causal=p.is_causal,
        return_residuals=True,
        block_sizes=p.block_sizes,
        **kernel_kwargs(mode),
    )
    kwargs.update(overrides)
    return functools.partial(pallas_flash.flash_attention, **kwargs)


def plain_fn(p: Problem):
    return functools.partial(attention_in_dtype, scale=p.scale, is_causal=p.is_causal)


def oracle_outputs_and_grads(p: Problem, q, k, v, d_out, d_lse):
    """(out, lse, dq, dk, dv) in float64 for problem `p` (arguments as float64 arrays)."""
    out, lse = attention_f64(q, k, v, scale=p.scale, is_causal=p.is_causal)
    grads = attention_grads_f64(q, k, v, d_out, d_lse, scale=p.scale, is_causal=p.is_causal)
    return (out, lse, *grads)


OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv")


# -- the tolerance rule ---------------------------------------------------------------------------


def max_abs_error(x, oracle) -> float:
    x = to64(x)
    assert x.shape == oracle.shape, (x.shape, oracle.shape)
    finite = np.isfinite(oracle)
    # Where the oracle is infinite (lse of an empty row) the result must match exactly.
    assert np.array_equal(x[~finite], oracle[~finite])
    return float(np.max(np.abs(x[finite] - oracle[finite]), initial=0.0))


def tolerance_violations(results, baselines, oracles, *, floor, names=OUTPUT_NAMES):
    """The messages of the outputs whose error exceeds 2 x the baseline error + floor, the floor
    taken relative to the output's magnitude (at least 1)."""
    violations = []
    for name, result, baseline, oracle in zip(names, results, baselines, oracles, strict=True):
        err = max_abs_error(result, oracle)
        base_err = max_abs_error(baseline, oracle)
        finite = oracle[np.isfinite(oracle)]
        abs_floor = floor * max(1.0, float(np.max(np.abs(finite), initial=0.0)))
        if not err <= 2 * base_err + abs_floor:
            violations.append(
                f"{name}: error {err:.3g} > 2 x plain-attention error {base_err:.3g} "
                f"+ floor {abs_floor:.3g}"
            )
    return violations


def assert_within_tolerance(results, baselines, oracles, *, floor, names=OUTPUT_NAMES):
    violations = tolerance_violations(results, baselines, oracles, floor=floor, names=names)
    assert not violations, "; ".join(violations)


def assert_bitwise_equal(a, b):
    """Equal pytrees of arrays, bit for bit (so -0.0 != 0.0 and NaN payloads count)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        if x.tobytes() != y.tobytes():
            np.testing.assert_array_equal(x, y)  # a readable diff where the values differ
            raise AssertionError("arrays are equal as numbers but differ in their bits")
