"""The public API: validation (before anything is traced), defaults, backend choice, dtypes and
shapes of the results."""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import SWEEP, has_gpu
from support.inputs import DTYPES, Problem, random_inputs
from support.tolerance import assert_bitwise_equal

import pallas_flash
from pallas_flash import api, tune_cache
from pallas_flash.device import Device
from pallas_flash.mosaic import backward_tiles as mosaic_backward_tiles
from pallas_flash.mosaic import tiles as mosaic_tiles

B, T, S, N, K, H = 2, 9, 11, 4, 2, 16


def arrays(q_shape=(B, T, N, H), k_shape=(B, S, K, H), v_shape=None, dtypes=(jnp.float32,) * 3):
    """Random numpy arrays of the given shapes and dtypes."""
    rng = np.random.default_rng(0)
    shapes = (q_shape, k_shape, k_shape if v_shape is None else v_shape)
    return tuple(
        rng.standard_normal(shape).astype(dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )


# (id, arrays() kwargs, flash_attention kwargs, exception, a regex the message must match)
INVALID_CALLS = [
    ("rank2", dict(q_shape=(T, N * H)), {}, ValueError, "rank 4.*query.shape=\\(9, 64\\)"),
    ("rank5", dict(q_shape=(1, B, T, N, H)), {}, ValueError, "rank.*query.shape"),
    ("mixed-rank", dict(k_shape=(S, K, H)), {}, ValueError, "rank.*key.shape=\\(11, 2, 16\\)"),
    ("batch", dict(k_shape=(B + 1, S, K, H)), {}, ValueError, "batch.*key.shape=\\(3,"),
    ("kv-length", dict(v_shape=(B, S + 1, K, H)), {}, ValueError, "value.shape=\\(2, 12,"),
    ("kv-heads", dict(v_shape=(B, S, K + 1, H)), {}, ValueError, "value.shape=\\(2, 11, 3,"),
    ("v-head-dim", dict(v_shape=(B, S, K, H + 4)), {}, ValueError, "value head_dim=20"),
    # Rank-3 inputs are quoted as passed, not with the batch axis added inside.
    (
        "unbatched-heads",
        dict(q_shape=(T, N, H), k_shape=(S, 3, H)),
        {},
        ValueError,
        r"num_heads=4 \(query.shape=\(9, 4, 16\)\).*num_kv_heads=3 \(key.shape=\(11, 3, 16\)\)",
    ),
    (
        "unbatched-kv-length",
        dict(q_shape=(T, N, H), k_shape=(S, K, H), v_shape=(S + 1, K, H)),
        {},
        ValueError,
        r"key.shape=\(11, 2, 16\) and value.shape=\(12, 2, 16\) must agree on \[S, K\]",
    ),
    (
        "unbatched-head-dim",
        dict(q_shape=(T, N, 20), k_shape=(S, K, 20)),
        {},
        ValueError,
        r"head_dim=20 \(value.shape=\(11, 2, 20\)\)",
    ),
    ("heads", dict(k_shape=(B, S, 3, H)), {}, ValueError, "num_heads=4.*num_kv_heads=3"),
    ("head-dim", dict(k_shape=(B, S, K, H + 8)), {}, ValueError, "head dims differ.*H=24"),
    (
        "head-dim-264",
        dict(q_shape=(B, T, N, 264), k_shape=(B, S, K, 264)),
        {},
        ValueError,
        "head_dim=264.*multiple of 8.*256",
    ),
    (
        "head-dim-20",
        dict(q_shape=(B, T, N, 20), k_shape=(B, S, K, 20)),
        {},
        ValueError,
        "head_dim=20.*multiple of 8",
    ),
    ("empty", dict(q_shape=(B, 0, N, H)), {}, ValueError, "dimension must be >= 1"),
    (
        "int-query",
        dict(dtypes=(jnp.int32, jnp.float32, jnp.float32)),
        {},
        TypeError,
        "query.dtype=int32",
    ),
    (
        "bool-value",
        dict(dtypes=(jnp.float32, jnp.float32, jnp.bool_)),
        {},
        TypeError,
        "value.dtype=bool",
    ),
    (
        "float64-key",
        dict(dtypes=(jnp.float32, np.float64, jnp.float32)),
        {},
        TypeError,
        "key.dtype=float64",
    ),
    (
        "mixed-dtypes",
        dict(dtypes=(jnp.float32, jnp.bfloat16, jnp.float32)),
        {},
        TypeError,
        "share a dtype.*key.dtype=bfloat16",
    ),
    ("bias-int", {}, dict(bias=np.ones((B, N, T, S), np.int32)), TypeError, "bias.dtype=int32"),
    (
        "mask-float",
        {},
        dict(mask=np.ones((B, N, T, S), np.float32)),
        ValueError,
        r"mask.dtype=float32.*mask.astype\(bool\)",
    ),
    ("backend", {}, dict(backend="cudnn"), ValueError, "backend='cudnn'"),
    ("xla-interpret", {}, dict(backend="xla", interpret=True), ValueError, "interpret=True"),
    (
        "xla-block-sizes",
        {},
        dict(backend="xla", block_sizes=pallas_flash.BlockSizes()),
        ValueError,
        "block_sizes",
    ),
    (
        "block-sizes-type",
        {},
        dict(block_sizes={"block_q": 16}, interpret=True),
        TypeError,
        "block_sizes must be a pallas_flash.BlockSizes",
    ),
    ("scale-negative", {}, dict(scale=-1.0), ValueError, "scale=-1.0"),
    ("scale-nan", {}, dict(scale=math.nan), ValueError, "scale=nan"),
    ("scale-str", {}, dict(scale="0.5"), TypeError, "scale='0.5'"),
    ("scale-array", {}, dict(scale=jnp.float32(0.5)), TypeError, "scale=Array"),
    ("is-causal", {}, dict(is_causal=1), TypeError, "is_causal=1"),
    ("return-residuals", {}, dict(return_residuals="yes"), TypeError, "return_residuals='yes'"),
    ("interpret", {}, dict(interpret=1), TypeError, "interpret=1"),
    (
        "deterministic-grads",
        {},
        dict(deterministic_grads=0),
        TypeError,
        "deterministic_grads=0 must be a bool",
    ),
]


@pytest.mark.parametrize(
    "array_kwargs, call_kwargs, error, message",
    [case[1:] for case in INVALID_CALLS],
    ids=[case[0] for case in INVALID_CALLS],
)
def test_invalid_call_raises_before_tracing(no_compute, array_kwargs, call_kwargs, error, message):
    q, k, v = arrays(**array_kwargs)
    with pytest.raises(error, match=message):
        pallas_flash.flash_attention(q, k, v, **call_kwargs)


def test_backward_errors_quote_the_shapes_passed(no_compute):
    """flash_attention_backward's residuals of rank-3 calls are checked and quoted as passed."""
    q, k, v = arrays((T, N, H), (S, K, H))
    out, lse = np.zeros((T, N, H), np.float32), np.zeros((N, T), np.float32)
    with pytest.raises(ValueError, match=r"lse.shape=\(4, 8\) must be \(4, 9\) for this query"):
        pallas_flash.flash_attention_backward(q, k, v, out, lse[:, :8], out)
    with pytest.raises(ValueError, match=r"d_out.shape=\(1, 9, 4, 16\) must be \(9, 4, 16\)"):
        pallas_flash.flash_attention_backward(q, k, v, out, lse, out[None])
    with pytest.raises(ValueError, match=r"log_sum.shape=\(2, 4, 9\) must be \(4, 9\)"):
        pallas_flash.flash_attention_backward(
            q, k, v, out, lse, out, log_sum=np.zeros((2, N, T), np.float32)
        )


@pytest.mark.parametrize(
    "head_dim, call_kwargs, error, message",
    [
        (
            128,
            dict(
                q_segment_ids=np.zeros((1, 128), np.int32),
                kv_segment_ids=np.zeros((1, 256), np.int32),
            ),
            ValueError,
            re.escape("kv_segment_ids.shape=(1, 256) must be (1, 128)"),
        ),
        (128, dict(scale=-0.1), ValueError, "scale=-0.1 must be a finite positive number"),
        (128, dict(dropout_rate=0.1), ValueError, "dropout_rate=0.1 needs dropout_rng"),
        (112, {}, NotImplementedError, r"backend='mosaic' does not support .*head_dim=112"),
    ],
    ids=["segment-ids", "scale", "dropout-rng", "head-dim"],
)
def test_mosaic_calls_are_checked_before_its_wrappers(
    no_compute, monkeypatch, head_dim, call_kwargs, error, message
):
    """The Mosaic wrappers take what api.py and dispatch.py checked: a call for an H200 with
    backend="mosaic" is refused there, before any kernel is traced."""
    monkeypatch.setattr(api.device_lib, "target_device", Device.h200)
    q = jnp.zeros((1, 128, 2, head_dim), jnp.bfloat16)
    with pytest.raises(error, match=message):
        jax.eval_shape(
            lambda q: pallas_flash.flash_attention(q, q, q, backend="mosaic", **call_kwargs), q
        )


def test_float64_needs_jax_enable_x64(no_compute):
    """Without x64 jax computes float64 arrays in float32: refused, naming the switch."""
    q, k, v = arrays(dtypes=(np.float64,) * 3)
    with pytest.raises(TypeError, match=r"query.dtype=float64 needs jax_enable_x64"):
        pallas_flash.flash_attention(q, k, v)
    with pytest.raises(TypeError, match=r"query.dtype=float64 needs jax_enable_x64"):
        pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=np.array([S, 3]))


def test_float64_on_a_gpu_runs_xla_or_names_the_paths_that_take_it(monkeypatch):
    """Chosen for an H200: backend=None runs float64 on "xla" (as on a CPU), the GPU kernels
    refuse it before tracing, naming the paths that take it."""
    monkeypatch.setattr(api.device_lib, "target_device", Device.h200)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in arrays())
        lengths = np.array([S, 3])
        for attention, kwargs in (
            (pallas_flash.flash_attention, dict(is_causal=True)),
            (pallas_flash.decode_attention, dict(key_value_seq_lengths=lengths)),
        ):
            want = attention(q, k, v, backend="xla", **kwargs)
            assert want.dtype == jnp.float64
            assert_bitwise_equal(attention(q, k, v, **kwargs), want)
        paths = r"float64 runs on backend='xla' .* or in the Pallas interpreter \(interpret=True\)"
        for backend in ("triton", "mosaic"):
            with pytest.raises(
                NotImplementedError, match=f"dtype float64 with backend='{backend}'"
            ):
                pallas_flash.flash_attention(q, k, v, backend=backend)
        with pytest.raises(NotImplementedError, match=f"backend='triton': {paths}"):
            pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths, backend="triton")
        with pytest.raises(ValueError, match=r"runs the 'xla' backend here \(float64 inputs\)"):
            pallas_flash.flash_attention(q, k, v, block_sizes=pallas_flash.BlockSizes())


def test_float64_split_kernels_compute_in_float64():
    """The Triton forward in float64 (interpreter, x64 on in this test only), one KV loop and
    split in two with its XLA merge and sinks: the float64 reference's values to float64's
    rounding (float32 accumulators would leave ~1e-7)."""
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.standard_normal(x.shape)) for x in arrays())
        sinks = jnp.asarray([0.3, -1.0, 2.0, 0.0])
        want = pallas_flash.flash_attention(
            q, k, v, sinks=sinks, return_residuals=True, backend="xla"
        )
        for splits in (1, 2):
            tiles = pallas_flash.BlockSizes(block_q=16, block_kv=16, kv_splits=splits)
            got = pallas_flash.flash_attention(
                q, k, v, sinks=sinks, return_residuals=True, interpret=True, block_sizes=tiles
            )
            for x, y in zip(got, want, strict=True):
                assert x.dtype == jnp.float64
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-13)
    assert not jax.config.jax_enable_x64


def test_non_array_input_raises(no_compute):
    q, k, v = arrays()
    with pytest.raises(TypeError, match="key must be an array, got list"):
        pallas_flash.flash_attention(q, k.tolist(), v)


def test_validation_also_guards_attention_reference(no_compute):
    q, k, v = arrays(k_shape=(B, S, 3, H), v_shape=(B, S, 3, H))
    with pytest.raises(ValueError, match="num_heads=4.*num_kv_heads=3"):
        pallas_flash.attention_reference(q, k, v)


@pytest.mark.skipif(has_gpu(), reason="checks the error raised without a GPU")
def test_triton_without_gpu_or_interpret_raises(no_compute):
    with pytest.raises(ValueError, match="backend='triton'.*interpret=True"):
        pallas_flash.flash_attention(*arrays(), backend="triton")


@pytest.mark.skipif(has_gpu(), reason="checks the error raised without a GPU")
def test_block_sizes_with_the_default_backend_on_cpu_raises(no_compute):
    """backend=None runs the xla backend without a GPU: tiles given for the kernels would be
    ignored, so they are refused."""
    with pytest.raises(
        ValueError, match="block_sizes.*backend=None runs the 'xla'.*interpret=True"
    ):
        pallas_flash.flash_attention(*arrays(), block_sizes=pallas_flash.BlockSizes())


def _export(fn, platforms, *args):
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    return jax.export.export(jax.jit(fn), platforms=platforms)(*shapes)


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
@pytest.mark.parametrize("platforms", [["cuda"], ["cpu", "cuda"]])
@pytest.mark.parametrize("what", ["forward", "grad"])
def test_export_for_a_gpu_from_a_cpu_host_refuses_the_reference(what, platforms):
    """backend=None traced without a GPU takes the xla backend: exporting that for CUDA would
    package the reference where a GPU host packages the kernels."""

    def forward(q, k, v):
        return pallas_flash.flash_attention(q, k, v, is_causal=True)

    fn = forward if what == "forward" else jax.grad(lambda *qkv: forward(*qkv).sum())
    with pytest.raises(NotImplementedError, match="without an NVIDIA GPU.*pallas_flash.target"):
        _export(fn, platforms, *arrays())


@pytest.mark.skipif(has_gpu(), reason="checks the export from a host without a GPU")
def test_export_for_cpu_or_of_the_explicit_xla_backend_works():
    q, k, v = arrays()

    def forward(q, k, v, **kwargs):
        return pallas_flash.flash_attention(q, k, v, is_causal=True, **kwargs)

    exported = _export(jax.grad(lambda *qkv: forward(*qkv).sum()), ["cpu"], q, k, v)
    assert_bitwise_equal(
        exported.call(q, k, v), jax.jit(jax.grad(lambda *qkv: forward(*qkv).sum()))(q, k, v)
    )
    _export(functools.partial(forward, backend="xla"), ["cuda"], q, k, v)


# -- BlockSizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("block_q", 48), ("block_kv", 8), ("block_q_dkv", 0), ("block_kv_dq", 24), ("block_q", 16.0)],
)
def test_block_sizes_tiles_must_be_powers_of_two_from_16(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}={value!r} must be a power of two"):
        pallas_flash.BlockSizes(**{field: value})


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("num_warps", 3, "power of two"),
        ("num_stages", 0, "positive int"),
        ("num_stages_dq", True, "positive int"),
    ],
)
def test_block_sizes_launch_parameters(field, value, rule):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}={value!r} must be a {rule}"):
        pallas_flash.BlockSizes(**{field: value})


def test_block_sizes_accepts_valid_tiles():
    sizes = pallas_flash.BlockSizes(block_q=16, block_kv=256, num_warps=8, num_stages=1)
    assert (sizes.block_q, sizes.block_kv, sizes.num_warps) == (16, 256, 8)


# -- semantics ------------------------------------------------------------------------------------


def interpret_call(q, k, v, **kwargs):
    fn = functools.partial(pallas_flash.flash_attention, interpret=True, **kwargs)
    return jax.jit(fn)(q, k, v)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_default_scale_is_inverse_sqrt_head_dim(backend):
    q, k, v = arrays()
    kwargs = dict(interpret=True) if backend == "triton" else {}
    run = functools.partial(pallas_flash.flash_attention, q, k, v, backend=backend, **kwargs)
    default = run()
    assert_bitwise_equal(default, run(scale=1.0 / math.sqrt(H)))
    assert not np.allclose(default, run(scale=1.0))


def test_attention_reference_is_the_xla_backend():
    q, k, v = arrays()
    for kwargs in (dict(is_causal=True, return_residuals=True), dict(scale=0.3)):
        assert_bitwise_equal(
            pallas_flash.attention_reference(q, k, v, **kwargs),
            pallas_flash.flash_attention(q, k, v, backend="xla", **kwargs),
        )


@pytest.mark.skipif(has_gpu(), reason="checks the backend chosen without a GPU")
def test_default_backend_on_cpu_is_xla(monkeypatch):
    q, k, v = arrays()
    expected = pallas_flash.attention_reference(q, k, v, is_causal=True)

    def must_not_run(*args, **kwargs):
        raise AssertionError("backend=None ran the Triton kernels on a CPU")

    monkeypatch.setattr(api, "flash_attention_kernels", must_not_run)
    assert_bitwise_equal(pallas_flash.flash_attention(q, k, v, is_causal=True), expected)


def test_interpret_without_backend_runs_the_kernels(monkeypatch):
    calls = []
    kernels = api.flash_attention_kernels

    def counting_kernels(*args):
        calls.append(args[-1])  # the KernelConfig
        return kernels(*args)

    monkeypatch.setattr(api, "flash_attention_kernels", counting_kernels)
    interpret_call(*arrays())
    assert len(calls) == 1 and calls[0].interpret


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("backend", ["triton", "xla"])
@pytest.mark.ci_slice(3)
def test_result_dtypes_and_shapes(dtype, backend):
    p = Problem(B, T, S, N, K, H, False, dtype)
    (q, k, v, _, _), _ = random_inputs(p)
    kwargs = dict(backend=backend, interpret=True) if backend == "triton" else dict(backend="xla")
    run = jax.jit(functools.partial(pallas_flash.flash_attention, return_residuals=True, **kwargs))
    out, lse = run(q, k, v)
    assert (out.dtype, out.shape) == (DTYPES[dtype], (B, T, N, H))
    assert (lse.dtype, lse.shape) == (jnp.float32, (B, N, T))
    out3, lse3 = run(q[0], k[0], v[0])
    assert (out3.dtype, out3.shape, lse3.shape) == (DTYPES[dtype], (T, N, H), (N, T))


def test_return_residuals_false_returns_out_alone():
    q, k, v = arrays()
    out = interpret_call(q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    out_with_lse, _ = interpret_call(q, k, v, return_residuals=True)
    assert_bitwise_equal(out, out_with_lse)


def test_jit_traces_once_in_a_fresh_process():
    # In a fresh process the first interpreted kernel used to import jax's Pallas fuser, which
    # adds a config option to JAX's tracing context: every jit traced before it retraced once
    # (a training step compiled twice). A subprocess, because the test process has imported it.
    code = "\n".join(
        [
            "import jax, jax.numpy as jnp, pallas_flash",
            "traces = []",
            "@jax.jit",
            "def f(q):",
            "    traces.append(1)",
            "    return pallas_flash.flash_attention(q, q, q, interpret=True)",
            "q = jnp.ones((1, 16, 1, 16))",
            "f(q).block_until_ready(); f(q).block_until_ready()",
            "assert len(traces) == 1, f'traced {len(traces)} times'",
        ]
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


# -- the forward kernel: Mosaic GPU on Hopper where it applies, else Triton ----------------------

HOPPER_SHAPES = dict(q_shape=(2, 1024, 8, 128), k_shape=(2, 1024, 2, 128))


@pytest.fixture
def chosen_forward(kernel_configs, monkeypatch):
    """Chooses for a GPU of compute capability `cc` (default: an H200; None: no GPU) or for
    `device`, and records, instead of running anything, which forward each flash_attention call
    picks: call(cc=..., device=...) -> list."""
    return _chosen(kernel_configs, monkeypatch, lambda config: config.forward)


@pytest.fixture
def chosen_kernels(kernel_configs, monkeypatch):
    """As chosen_forward, recording (forward, backward) of each call."""
    return _chosen(kernel_configs, monkeypatch, lambda config: (config.forward, config.backward))


def _chosen(kernel_configs, monkeypatch, what):
    monkeypatch.setattr(api, "reference_attention_vjp", None)

    def call(*qkv, cc=(9, 0), device=None, **kwargs):
        if device is None and cc is not None:
            device = (
                Device.h200()
                if cc == (9, 0)
                else Device(kind=f"Fake sm{cc[0]}{cc[1]}", compute_capability=cc, num_sms=132)
            )
        monkeypatch.setattr(api.device_lib, "target_device", lambda: device)
        pallas_flash.flash_attention(*qkv, **kwargs)
        return what(kernel_configs.pop())

    return call


def hopper_arrays(q_shape=HOPPER_SHAPES["q_shape"], k_shape=HOPPER_SHAPES["k_shape"], dtype=None):
    dtype = jnp.bfloat16 if dtype is None else dtype
    return tuple(jnp.asarray(x, dtype) for x in arrays(q_shape, k_shape))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("backend", [None, "mosaic"])
def test_plain_calls_on_hopper_take_the_mosaic_forward(chosen_forward, is_causal, backend):
    assert chosen_forward(*hopper_arrays(), is_causal=is_causal, backend=backend) == "mosaic"


# (id, flash_attention kwargs or arrays, what the Mosaic forward lacks)
MOSAIC_GAPS = [
    ("bias", dict(bias=jnp.zeros((1, 8, 1024, 1024))), "bias"),
    ("mask", dict(mask=jnp.ones((1, 1, 1024, 1024), bool)), "mask"),
    ("float32", dict(dtype=jnp.float32), "dtype float32"),
    ("head-dim", dict(q_shape=(2, 1024, 8, 112), k_shape=(2, 1024, 2, 112)), "head_dim=112"),
]


def gap_call(call_kwargs):
    kwargs = dict(call_kwargs)
    shape_kwargs = {
        name: kwargs.pop(name) for name in ("q_shape", "k_shape", "dtype") if name in kwargs
    }
    return hopper_arrays(**shape_kwargs), kwargs


@pytest.mark.parametrize(
    "call_kwargs, lacks", [c[1:] for c in MOSAIC_GAPS], ids=[c[0] for c in MOSAIC_GAPS]
)
def test_auto_forward_falls_back_to_triton(chosen_forward, call_kwargs, lacks):
    qkv, kwargs = gap_call(call_kwargs)
    assert chosen_forward(*qkv, **kwargs) == "triton"


@pytest.mark.parametrize(
    "call_kwargs, lacks", [c[1:] for c in MOSAIC_GAPS], ids=[c[0] for c in MOSAIC_GAPS]
)
def test_mosaic_backend_names_what_it_does_not_support(chosen_forward, call_kwargs, lacks):
    qkv, kwargs = gap_call(call_kwargs)
    with pytest.raises(NotImplementedError, match=f"backend='mosaic' does not support.*{lacks}"):
        chosen_forward(*qkv, backend="mosaic", **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(q_segment_ids=jnp.zeros((2, 1024), jnp.int32)),
        dict(key_value_seq_lengths=jnp.array([5, 9])),
        dict(query_seq_lengths=jnp.array([5, 9])),
        dict(local_window_size=256),
        dict(logits_soft_cap=30.0),
    ],
    ids=["segments", "kv-lengths", "q-lengths", "window", "soft-cap"],
)
def test_masked_calls_on_hopper_take_the_mosaic_forward(chosen_forward, kwargs):
    assert chosen_forward(*hopper_arrays(), is_causal=True, **kwargs) == "mosaic"


def test_auto_forward_keeps_triton_when_it_should(chosen_forward):
    # Not Hopper: Ampere runs Triton, Blackwell too (the kernel is sm_90a code).
    for cc in ((8, 0), (10, 0)):
        assert chosen_forward(*hopper_arrays(), cc=cc) == "triton"
    # The user's Triton tiles: they configure the forward too, so they are not ignored.
    assert chosen_forward(*hopper_arrays(), block_sizes=pallas_flash.BlockSizes()) == "triton"
    # A grid of 4 CTAs over a 32k key loop: Triton's split-KV forward fills the GPU instead.
    qkv = hopper_arrays((1, 128, 4, 128), (1, 32768, 4, 128))
    assert chosen_forward(*qkv) == "triton"
    assert chosen_forward(*qkv, backend="mosaic") == "mosaic"  # asked for: honoured
    assert chosen_forward(*hopper_arrays(), backend="triton") == "triton"


@pytest.mark.parametrize("head_dim", [80, 192])
def test_other_head_dims_and_ragged_lengths_take_the_mosaic_forward(chosen_forward, head_dim):
    """Head dims 80/96 and 192 run the Mosaic forward, at whole tiles and at
    ragged last tiles from MOSAIC_RAGGED_MIN_LEN tokens; shorter ragged calls take Triton unless
    Mosaic is asked for."""
    for q_len, kv_len in ((2048, 2048), (3000, 3000)):
        qkv = hopper_arrays((2, q_len, 8, head_dim), (2, kv_len, 2, head_dim))
        assert chosen_forward(*qkv, is_causal=True) == "mosaic"
    for batch, q_len, kv_len in ((64, 197, 197), (4, 3000, 1000)):
        qkv = hopper_arrays((batch, q_len, 8, head_dim), (batch, kv_len, 2, head_dim))
        assert chosen_forward(*qkv) == "triton"
    assert chosen_forward(*qkv, backend="mosaic") == "mosaic"  # asked for: honoured


def test_h64_takes_the_mosaic_forward_at_short_and_odd_lengths(chosen_forward):
    """128 rows per consumer at 512 keys (faster than Triton there); 64 when T % 256 != 0."""
    for q_len, kv_len in ((1024, 512), (384, 1024)):
        qkv = hopper_arrays((4, q_len, 8, 64), (4, kv_len, 8, 64))
        assert chosen_forward(*qkv) == "mosaic"
        assert chosen_forward(*qkv, is_causal=True) == "mosaic"


def test_unbatched_inputs_take_the_mosaic_forward(chosen_forward):
    assert chosen_forward(*hopper_arrays((2048, 16, 128), (2048, 4, 128)), is_causal=True) == (
        "mosaic"
    )


def test_causal_on_miscompiling_cuda_stays_on_triton(chosen_forward):
    device = Device.h200(cuda_runtime_version=12085)
    assert chosen_forward(*hopper_arrays(), is_causal=True, device=device) == "triton"
    assert chosen_forward(*hopper_arrays(), is_causal=False, device=device) == "mosaic"
    with pytest.raises(NotImplementedError, match="is_causal=True on CUDA runtime 12085"):
        chosen_forward(*hopper_arrays(), is_causal=True, backend="mosaic", device=device)


def test_mosaic_backend_takes_block_sizes_for_the_backward_only(chosen_forward):
    backward_tiles = pallas_flash.BlockSizes(block_q_dkv=64, num_warps_dq=8)
    assert chosen_forward(*hopper_arrays(), backend="mosaic", block_sizes=backward_tiles) == (
        "mosaic"
    )
    forward_tiles = pallas_flash.BlockSizes(block_q=64, kv_splits=2)
    with pytest.raises(NotImplementedError, match="Triton forward's block_q=64, kv_splits=2"):
        chosen_forward(*hopper_arrays(), backend="mosaic", block_sizes=forward_tiles)


def test_mosaic_backend_needs_hopper(chosen_forward):
    with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU.*found \\(8, 0\\)"):
        chosen_forward(*hopper_arrays(), backend="mosaic", cc=(8, 0))
    with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU.*found none"):
        chosen_forward(*hopper_arrays(), backend="mosaic", cc=None)
    with pytest.raises(ValueError, match="backend='mosaic' has no interpreted mode"):
        chosen_forward(*hopper_arrays(), backend="mosaic", interpret=True)


def test_mosaic_backward_goes_with_the_mosaic_forward(chosen_kernels):
    for is_causal in (False, True):
        assert chosen_kernels(*hopper_arrays(), is_causal=is_causal) == ("mosaic", "mosaic")
    # Every mask of the Mosaic forward: windows, soft caps, segment ids and lengths.
    for kwargs in (
        dict(local_window_size=256),
        dict(is_causal=True, local_window_size=(256, 0)),
        dict(logits_soft_cap=30.0),
        dict(q_segment_ids=jnp.zeros((2, 1024), jnp.int32)),
        dict(key_value_seq_lengths=jnp.array([1000, 17]), query_seq_lengths=jnp.array([9, 1024])),
    ):
        assert chosen_kernels(*hopper_arrays(), **kwargs) == ("mosaic", "mosaic"), kwargs
    # H=64 below 2k keys: the Triton backward, measured faster there; asked for: Mosaic.
    short_h64 = hopper_arrays((4, 1024, 8, 64), (4, 1024, 8, 64))
    assert chosen_kernels(*short_h64) == ("mosaic", "triton")
    assert chosen_kernels(*short_h64, backend="mosaic") == ("mosaic", "mosaic")
    long_h64 = hopper_arrays((4, 2048, 8, 64), (4, 2048, 8, 64))
    assert chosen_kernels(*long_h64, is_causal=True) == ("mosaic", "mosaic")
    # H 192 and 256: the backward with its dK/dV consumers split by accumulator, masks too.
    for head_dim in (192, 256):
        wide = hopper_arrays((2, 1024, 8, head_dim), (2, 1024, 2, head_dim))
        for options in (dict(is_causal=True), dict(local_window_size=256, logits_soft_cap=30.0)):
            assert chosen_kernels(*wide, **options) == ("mosaic", "mosaic"), head_dim
            assert chosen_kernels(*wide, backend="mosaic", **options) == ("mosaic", "mosaic")


def test_triton_backward_serves_what_the_mosaic_backward_lacks(chosen_kernels):
    # The user's Triton tiles configure the backward; a Triton forward takes a Triton backward.
    tiles = pallas_flash.BlockSizes(block_q_dkv=64)
    assert chosen_kernels(*hopper_arrays(), backend="mosaic", block_sizes=tiles) == (
        "mosaic",
        "triton",
    )
    assert chosen_kernels(*hopper_arrays(), backend="triton") == ("triton", "triton")
    assert chosen_kernels(*hopper_arrays(), cc=(8, 0)) == ("triton", "triton")


@pytest.fixture
def tuned_cache(tune_cache_path):
    """A user's autotune cache file for the H200 (over the shipped table): save(shape kwargs of
    ShapeClass.of, entry)."""

    def save(entry, head_dim=128, dtype=jnp.bfloat16, **shape):
        cls = tune_cache.ShapeClass.of(head_dim, dtype, masked=False, **shape)
        tune_cache.save_tuned(Device.h200().kind, {cls: entry})

    return save


@pytest.fixture
def chosen_tiles(kernel_configs, monkeypatch):
    """As chosen_forward, recording the Mosaic tiles each call's KernelConfig carries."""
    return _chosen(
        kernel_configs,
        monkeypatch,
        lambda config: (config.mosaic_forward_tiles, config.mosaic_backward_tiles),
    )


def test_tuned_mosaic_tiles_reach_the_kernels(tuned_cache, chosen_tiles):
    forward = mosaic_tiles.ForwardTiles(block_q=64, block_kv=64, num_stages=3)
    backward = mosaic_backward_tiles.BackwardTiles(block_kv_dq=128)
    entry = tune_cache.TunedEntry(pallas_flash.BlockSizes(), forward, backward)
    tuned_cache(entry, is_causal=False, q_len=1024, kv_len=1024)
    assert chosen_tiles(*hopper_arrays()) == (forward, backward)
    assert chosen_tiles(*hopper_arrays(), backend="mosaic") == (forward, backward)
    # Another shape class (causal): the kernels' defaults; the Triton backend: no Mosaic tiles.
    defaults = mosaic_tiles.default_tiles(128, q_len=1024, kv_len=1024, is_causal=True)
    assert chosen_tiles(*hopper_arrays(), is_causal=True) == (
        defaults,
        mosaic_backward_tiles.BackwardTiles(),
    )
    assert chosen_tiles(*hopper_arrays(), backend="triton") == (None, None)
    h64 = hopper_arrays((4, 1024, 8, 64), (4, 1024, 8, 64))
    tuned_cache(entry, head_dim=64, is_causal=False, q_len=1024, kv_len=1024)
    assert chosen_tiles(*h64) == (forward, None)  # H=64 below 2k keys: the Triton backward


def test_tuned_mosaic_tiles_a_shape_does_not_take_fall_back_to_the_defaults(
    tuned_cache, kernel_configs, monkeypatch
):
    # 128-row consumers would leave a ragged last tile at T=384 (short ragged calls are faster
    # on Triton): the forward keeps its default tiles (and stays on Mosaic); 128-row
    # dQ consumers would spill at H=128: the backward keeps its own. The h256 class spans H=192
    # and 256: a ring of three 64-key stages fits shared memory at H=192 but not at 256, where
    # the forward keeps its default tiles; the backward (no tuned tiles) its defaults.
    chosen = _chosen(
        kernel_configs,
        monkeypatch,
        lambda c: (c.forward, c.backward, c.mosaic_forward_tiles, c.mosaic_backward_tiles),
    )
    forward = mosaic_tiles.ForwardTiles(block_q=128, block_kv=64)
    backward = mosaic_backward_tiles.BackwardTiles(block_q_dq=128)
    entry = tune_cache.TunedEntry(pallas_flash.BlockSizes(), forward, backward)
    tuned_cache(entry, is_causal=False, q_len=384, kv_len=384)
    qkv = hopper_arrays((8, 384, 8, 128), (8, 384, 8, 128))
    defaults = mosaic_tiles.default_tiles(128, q_len=384, kv_len=384, is_causal=False)
    assert defaults != forward
    assert chosen(*qkv) == ("mosaic", "mosaic", defaults, mosaic_backward_tiles.BackwardTiles())
    forward = mosaic_tiles.ForwardTiles(block_kv=64, num_stages=3)
    entry = tune_cache.TunedEntry(pallas_flash.BlockSizes(), forward, None)
    tuned_cache(entry, head_dim=256, is_causal=False, q_len=1024, kv_len=1024)
    defaults = mosaic_tiles.default_tiles(256, q_len=1024, kv_len=1024, is_causal=False)
    assert defaults != forward
    for head_dim, tiles in ((192, forward), (256, defaults)):
        qkv = hopper_arrays((8, 1024, 8, head_dim), (8, 1024, 8, head_dim))
        backward = mosaic_backward_tiles.default_tiles(head_dim)
        assert chosen(*qkv) == ("mosaic", "mosaic", tiles, backward)
        assert chosen(*qkv, backend="mosaic") == ("mosaic", "mosaic", tiles, backward)


# -- the backward at given residuals (the ring's building block) --------------------------------


def _backward_problem(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(x) for x in arrays((B, 13, N, H), (B, 21, K, H)))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((B, N, 13)), jnp.float32)
    return q, k, v, d_out, d_lse


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize(
    "options",
    [
        dict(is_causal=True),
        dict(local_window_size=(4, 2), key_value_seq_lengths=np.array([17, 21])),
        dict(logits_soft_cap=2.0, q_segment_ids=np.array([[0] * 6 + [1] * 7] * B)),
    ],
    ids=["causal", "window-lengths", "softcap-segments"],
)
@pytest.mark.ci_slice(1)
def test_backward_at_the_residuals_is_the_calls_vjp(backend, options):
    if backend == "xla" and not SWEEP:
        pytest.skip("the xla path's residual backward is the reference's vjp: PALLAS_FLASH_SWEEP")
    if "logits_soft_cap" in options and not SWEEP:
        pytest.skip("soft cap and segments: covered by window-lengths in CI; PALLAS_FLASH_SWEEP")
    """flash_attention_backward at the call's own (out, lse, log_sum) gives its pullback's
    gradients (the next test calls it without log_sum)."""
    q, k, v, d_out, d_lse = _backward_problem()
    if "q_segment_ids" in options:
        options = dict(options, kv_segment_ids=np.array([[0] * 9 + [1] * 12] * B))
    kw = dict(backend="triton", interpret=True) if backend == "interpret" else dict(backend="xla")
    (out, lse, log_sum), pullback = jax.vjp(
        lambda q, k, v: api.flash_attention(
            q, k, v, return_residuals=True, return_log_sum=True, **options, **kw
        ),
        q,
        k,
        v,
    )
    d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    want = pullback((d_out, d_lse, jnp.ones_like(log_sum)))  # log_sum carries no gradient
    got = api.flash_attention_backward(
        q, k, v, out, lse, d_out, d_lse, log_sum=log_sum, **options, **kw
    )
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "backend",
    [
        # The xla path's backward at given residuals is the reference's vjp (as above).
        pytest.param("xla", marks=pytest.mark.skipif(not SWEEP, reason="PALLAS_FLASH_SWEEP")),
        "interpret",
    ],
)
def test_backward_of_key_blocks_at_the_merged_residuals_sums_to_the_whole(backend):
    """The key blocks' backwards at the whole softmax's (out, lse) are its gradients' shares:
    dq sums over the blocks, dk/dv are the blocks' rows (what ring attention's backward uses)."""
    q, k, v, d_out, d_lse = _backward_problem(1)
    kw = dict(backend="triton", interpret=True) if backend == "interpret" else dict(backend="xla")
    (out, lse), pullback = jax.vjp(
        lambda q, k, v: api.flash_attention(q, k, v, return_residuals=True, backend="xla"), q, k, v
    )
    dq, dk, dv = pullback((d_out, d_lse))
    parts = [
        api.flash_attention_backward(q, k[:, sl], v[:, sl], out, lse, d_out, d_lse, **kw)
        for sl in (slice(0, 8), slice(8, None))
    ]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], dq, atol=2e-6)
    np.testing.assert_allclose(jnp.concatenate([parts[0][1], parts[1][1]], 1), dk, atol=2e-6)
    np.testing.assert_allclose(jnp.concatenate([parts[0][2], parts[1][2]], 1), dv, atol=2e-6)


def test_backward_at_residuals_checks_their_shapes(no_compute):
    q, k, v, d_out, _ = _backward_problem()
    lse = jnp.zeros((B, N, 13), jnp.float32)
    with pytest.raises(ValueError, match=r"lse.shape=\(2, 13, 4\) must be \(2, 4, 13\)"):
        api.flash_attention_backward(q, k, v, d_out, lse.transpose(0, 2, 1), d_out, backend="xla")
    with pytest.raises(ValueError, match="d_out.shape"):
        api.flash_attention_backward(q, k, v, d_out, lse, d_out[:, 1:], backend="xla")


def test_backward_at_residuals_checks_log_sum(no_compute):
    q, k, v, d_out, _ = _backward_problem()
    lse = jnp.zeros((B, N, 13), jnp.float32)
    call = functools.partial(api.flash_attention_backward, q, k, v, d_out, lse, d_out)
    with pytest.raises(ValueError, match=r"log_sum.shape=\(2, 13, 4\) must be \(2, 4, 13\)"):
        call(log_sum=lse.transpose(0, 2, 1), backend="xla")
    with pytest.raises(TypeError, match="log_sum.dtype=bfloat16 must be float32"):
        call(log_sum=lse.astype(jnp.bfloat16), backend="triton", interpret=True)
    with pytest.raises(TypeError, match="log_sum must be a float32 array of shape"):
        call(log_sum=0.0, backend="xla")
    with pytest.raises(ValueError, match=r"log_sum.shape=\(2, 4, 13\) must be \(4, 13\)"):
        api.flash_attention_backward(
            q[0], k[0], v[0], d_out[0], lse[0], d_out[0], log_sum=lse, backend="xla"
        )
    with pytest.raises(ValueError, match="return_log_sum=True .* needs return_residuals=True"):
        pallas_flash.flash_attention(q, k, v, return_log_sum=True)
    with pytest.raises(TypeError, match="return_log_sum='yes' must be a bool"):
        pallas_flash.flash_attention(q, k, v, return_residuals=True, return_log_sum="yes")


def _log_sum_f64(q, k, scale, visible, sinks):
    """float64 log of each row's softmax denominator relative to the larger of its max logit
    and its sink [B, N, T]; 0 where the row sees no key."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = np.where(visible, np.einsum("btnh,bsnh->bnts", q, k) * scale, -np.inf)
    top = np.maximum(logits.max(-1), sinks[None, :, None])
    total = np.exp(logits - top[..., None]).sum(-1) + np.exp(sinks[None, :, None] - top)
    return np.where(visible.any(-1), np.log(total), 0.0)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_return_log_sum_is_the_log_denominator_relative_to_the_max(backend):
    """(out, lse, log_sum) with sinks, lengths (rows that see no key: log_sum 0) and, on the
    kernels, a split KV loop (keys 0-15 and 16-20: its chunks' log_sum merged): log_sum as
    float64's, out and lse as without return_log_sum; unbatched too."""
    q, k, v, _, _ = _backward_problem()
    sinks = np.asarray([-1.0, 0.5, 2.0, 40.0], np.float32)  # the last above every logit
    q_lengths, kv_lengths = np.asarray([13, 7]), np.asarray([21, 18])
    kw = dict(backend="xla")
    if backend == "interpret":
        tiles = pallas_flash.BlockSizes(block_q=16, block_kv=16, kv_splits=2)
        kw = dict(backend="triton", interpret=True, block_sizes=tiles)
    options = dict(
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        sinks=jnp.asarray(sinks),
        **kw,
    )
    attention = functools.partial(api.flash_attention, return_residuals=True, **options)

    def with_and_without_log_sum(q, k, v):
        return attention(q, k, v, return_log_sum=True), attention(q, k, v)

    (out, lse, log_sum), plain = jax.jit(with_and_without_log_sum)(q, k, v)
    rows, keys = np.arange(13)[None, :, None], np.arange(21)[None, None, :]
    visible = (rows < q_lengths[:, None, None]) & (keys < kv_lengths[:, None, None])
    visible = visible[:, None]  # [B, 1, T, S]
    want = _log_sum_f64(q, k, 1 / math.sqrt(H), visible, sinks)
    np.testing.assert_allclose(np.asarray(log_sum), want, atol=2e-6, rtol=2e-6)
    assert log_sum.dtype == jnp.float32
    assert_bitwise_equal((out, lse), plain)
    if backend == "xla":
        attention = functools.partial(
            api.flash_attention, return_residuals=True, return_log_sum=True, sinks=sinks
        )
        unbatched, batched = jax.jit(
            lambda q, k, v: (attention(q[0], k[0], v[0]), attention(q, k, v))
        )(q, k, v)
        assert_bitwise_equal(unbatched, tuple(x[0] for x in batched))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(is_causal=True), dict(local_window_size=(300, 0))])
def test_backward_at_the_residuals_runs_the_calls_kernels_on_gpu(options):
    """Compiled (the Mosaic backward on Hopper, for the causal call and the window): the
    same kernels as the call's own backward. XLA may sum delta = rowsum(dO * out) in another
    order in another program, so a few elements may differ in their last bf16 bit."""
    rng = np.random.default_rng(0)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal((2, 1024, 8, 128)), jnp.bfloat16) for _ in range(4)
    )
    (out, lse), pullback = jax.vjp(
        lambda q, k, v: api.flash_attention(q, k, v, return_residuals=True, **options), q, k, v
    )
    d_lse = jnp.zeros_like(lse)
    want = jax.jit(pullback)((d_out, d_lse))
    got = jax.jit(functools.partial(api.flash_attention_backward, **options))(
        q, k, v, out, lse, d_out, d_lse
    )
    for x, y in zip(got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert (x == y).mean() > 0.99
        np.testing.assert_allclose(x, y, rtol=2**-7, atol=2**-7 * np.abs(y).max())
