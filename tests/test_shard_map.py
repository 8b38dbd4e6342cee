"""Every entry point inside `jax.shard_map` as users write it: with jax's default check_vma=True
(each value typed with the manual mesh axes it varies over) and with check_vma=False, on meshes
of Auto and of Explicit axes (`jax.make_mesh`'s default); values and gradients as the unsharded
call's. Also the Explicit-mesh helpers: the zig-zag permutation and decode over a cache split over
its sequence.

The multi-device tests run in one child pytest process on 4 CPU devices, started by
`test_on_4_cpu_devices` (jax fixes its device count when it starts); one device suffices for the
Mosaic interpreter, the lowering for an abstract H200 and the GPU tests (marked gpu), which run
here.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support.backends import BACKEND_PATHS, SWEEP_ONLY

import pallas_flash
from pallas_flash import sharding

CHILD = os.environ.get("PALLAS_FLASH_SHARD_MAP_CHILD") == "1"
NUM_DEVICES = 4
# The one-device tests run in this process only (the child runs the multi-device ones).
PARENT_ONLY = pytest.mark.skipif(CHILD, reason="runs in the parent process")
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
# check_vma as a user passes it: jax's default (the argument left out), or False.
CHECK_VMA = {"default": {}, "unchecked": {"check_vma": False}}


def _mesh(num, axis_type, names=("x",), shape=None):
    shape = shape or (num,)
    return jax.make_mesh(
        shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names), devices=jax.devices()[:num]
    )


def _in_shard_map(fn, mesh, in_specs, out_specs, check_vma="default"):
    """jit of fn in a jax.shard_map as a user writes it; its operands placed as in_specs say
    (on an Explicit mesh, shard_map takes only operands whose types carry its in_specs)."""
    mapped = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **CHECK_VMA[check_vma])
    )

    def run(*args):
        placed = jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
            args,
            in_specs,
            is_leaf=lambda x: x is None,
        )
        return mapped(*placed)

    return run


def _random(seed, *shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _assert_close(got, want, atol=2e-5, rtol=2e-5):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
        finite = np.isfinite(y)
        np.testing.assert_allclose(x[finite], y[finite], atol=atol, rtol=rtol)


def _value_and_grads(attn, argnums):
    """(out, grads of sum(sin(out)) w.r.t. args[argnums]) of attn(*args)."""

    def run(*args):
        out, pullback = jax.vjp(
            lambda *d: attn(*_put(args, argnums, d)), *(args[i] for i in argnums)
        )
        # The gradients of sum(sin(out)): weights of each entry's own (the same sharded or
        # not), typed as out is (inside shard_map: varying over its manual axes).
        return out, pullback(jnp.cos(out))

    return run


def _layout_order(layout: str, num_shards: int, permute):
    """x -> permute(x, num_shards) for the zig-zag layout (to_zigzag, from_zigzag); else x."""
    if layout == "zigzag":
        return functools.partial(permute, num_shards=num_shards)
    return lambda x: x


def _put(args, argnums, values):
    args = list(args)
    for i, x in zip(argnums, values, strict=True):
        args[i] = x
    return args


# -- one device: the Mosaic interpreter, the compiled kernels' types --------------------------


def _one_device_mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


@SWEEP_ONLY
@PARENT_ONLY
def test_mosaic_interpreter_in_shard_map():
    """The Mosaic kernels (jax's Mosaic GPU interpreter; forward and backward, bf16, causal)
    inside shard_map with check_vma on a 1-device mesh (its operands typed as varying over the
    axis): their outputs take that type, and the values and gradients are the unsharded
    call's. (jax's interpreter keeps one device's state per process: more devices than one
    fail there with or without check_vma.)"""
    path = BACKEND_PATHS["mosaic-interpret"]
    q, k, v = (_random(i, 2, 64, 2, 64, dtype=jnp.bfloat16) for i in range(3))
    attn = functools.partial(pallas_flash.flash_attention, is_causal=True, **path.kwargs)
    run = _value_and_grads(attn, (0, 1, 2))
    mesh = _one_device_mesh()
    with path.scope():
        got = _in_shard_map(run, mesh, (P("x"),) * 3, P("x"))(q, k, v)
        got = jax.tree.map(lambda x: np.asarray(x, np.float32), got)
        want = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.jit(run)(q, k, v))
    _assert_close(got, want, atol=0)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


# (q's shape, kv heads, flash_attention's options, the kernels the lowered module must hold):
# the dispatch's choice for an H200 (Mosaic; Mosaic with dQ fused into the dK/dV kernel by
# integer adds, whose per-row scales are Triton kernels), the Triton kernels, decode's.
LOWERED_CALLS = {
    "mosaic": ((2, 256, 4, 64), 2, dict(is_causal=True), ("mosaic_gpu",)),
    "mosaic-fused-dq": ((1, 4096, 8, 64), 8, {}, ("mosaic_gpu", "triton")),
    "triton": ((2, 256, 4, 64), 2, dict(is_causal=True, backend="triton"), ("triton",)),
    "decode": ((2, 256, 4, 64), 2, None, ("triton",)),
}


@PARENT_ONLY
@pytest.mark.parametrize("call", LOWERED_CALLS)
def test_compiled_kernels_lower_inside_shard_map(call):
    """The kernels compiled for an H200 lower inside shard_map with check_vma, forward and
    backward: every launch types its outputs as varying over the axes its operands vary over
    (else jax refuses the pallas_call, or the custom_vjp's gradients). Lowered on CPU for an
    abstract H200, as test_lowering does."""
    shape, num_kv_heads, options, kernels = LOWERED_CALLS[call]
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H200)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((*shape[:2], num_kv_heads, shape[3]), jnp.bfloat16)
    if options is None:

        def fn(q, k, v):
            lengths = jnp.asarray([200, 7], jnp.int32)
            return pallas_flash.decode_attention(q[:, :2], k, v, key_value_seq_lengths=lengths)

    else:
        fn = _value_and_grads(functools.partial(pallas_flash.flash_attention, **options), (0, 1, 2))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(mapped).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in kernels:
        assert kernel in text, kernel


# -- the GPU: the compiled kernels inside shard_map --------------------------------------------


def _gpu_problem(t=1024, s=1024):
    q = _random(0, 2, t, 8, 128, dtype=jnp.bfloat16)
    k, v = (_random(i, 2, s, 2, 128, dtype=jnp.bfloat16) for i in (1, 2))
    return q, k, v


@pytest.mark.gpu
@PARENT_ONLY
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
def test_flash_attention_in_shard_map_on_the_gpu(backend):
    """The compiled kernels (the default: Mosaic on Hopper; Triton) inside shard_map with
    jax's defaults, on a 1-device mesh: the plain call's values and gradients, bit for bit."""
    attn = functools.partial(pallas_flash.flash_attention, is_causal=True, backend=backend)
    run = _value_and_grads(attn, (0, 1, 2))
    q, k, v = _gpu_problem()
    got = _in_shard_map(run, _one_device_mesh(), (P("x"),) * 3, P("x"))(q, k, v)
    _assert_close(got, jax.jit(run)(q, k, v), atol=0)


@pytest.mark.gpu
@PARENT_ONLY
def test_decode_in_shard_map_on_the_gpu():
    """The compiled decode kernel inside shard_map with jax's defaults: the plain call's
    values, bit for bit, and its gradients (the reference's, XLA's fusions of bf16 may round
    apart)."""
    q, k, v = _gpu_problem(t=4, s=4096)
    lengths = jnp.asarray([4096, 1000], jnp.int32)

    def run(q, k, v, lengths):
        def attn(q, k, v):
            return pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths)

        return _value_and_grads(attn, (0, 1, 2))(q, k, v)

    (out, grads) = _in_shard_map(run, _one_device_mesh(), (P("x"),) * 4, P("x"))(q, k, v, lengths)
    want_out, want_grads = jax.jit(run)(q, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    _assert_close(grads, want_grads, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@PARENT_ONLY
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_in_shard_map_on_the_gpus(layout):
    """ring_attention (the compiled kernels inside) over every GPU, inside shard_map with jax's
    defaults, causal, bf16: the plain call's values and gradients within bf16's rounding of
    the ring's merge (1 GPU: the plain call itself)."""
    count = jax.device_count()
    q, k, v = _gpu_problem(t=1024 * count, s=1024 * count)
    mesh = jax.make_mesh((count,), ("x",), axis_types=(AxisType.Auto,))
    order = _layout_order(layout, count, sharding.to_zigzag)
    unorder = _layout_order(layout, count, sharding.from_zigzag)
    ring = functools.partial(sharding.ring_attention, axis_name="x", is_causal=True, layout=layout)
    spec = P(None, "x")
    out, grads = _in_shard_map(_value_and_grads(ring, (0, 1, 2)), mesh, (spec,) * 3, spec)(
        *map(order, (q, k, v))
    )
    got = [unorder(x) for x in (out, *grads)]
    plain = functools.partial(pallas_flash.flash_attention, is_causal=True)
    want_out, want_grads = jax.jit(_value_and_grads(plain, (0, 1, 2)))(q, k, v)
    for x, y in zip(got, (want_out, *want_grads), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max()


# -- several devices (the child process) --------------------------------------------------------

if not CHILD:

    def test_on_4_cpu_devices():
        """Runs this module's multi-device tests in a child process with 4 CPU devices."""
        root = pathlib.Path(__file__).resolve().parents[1]
        env = dict(
            os.environ,
            XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES} "
            "--xla_backend_optimization_level=0",
            PALLAS_FLASH_SHARD_MAP_CHILD="1",
            JAX_PLATFORMS="cpu",
        )
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


if CHILD:
    assert jax.device_count() == NUM_DEVICES
    PATHS = {name: BACKEND_PATHS[name].kwargs for name in ("xla", "triton-interpret")}
    # Each check runs in a few (path, mesh, check_vma) settings that between them take every
    # value of each: "explicit-default" is what jax.make_mesh and jax.shard_map give a user.
    # (Inside a shard_map the mesh's axis types differ only in how the operands come in.)
    EXPLICIT_DEFAULT = ("explicit", "default")
    AUTO_UNCHECKED = ("auto", "unchecked")
    AUTO_DEFAULT = ("auto", "default")

    def _settings(*settings):
        return [
            pytest.param(path, axis_type, check_vma, id=f"{path}-{axis_type}-{check_vma}")
            for path, (axis_type, check_vma) in settings
        ]

    _REFERENCES = {}

    def _reference(key, fn, *args):
        """jit(fn)(*args) (an unsharded call on the "xla" path), computed once per key."""
        if key not in _REFERENCES:
            _REFERENCES[key] = jax.jit(fn)(*args)
        return _REFERENCES[key]

    def _problem(num_tokens=32, seed=0):
        """GQA q [2, T, 4, 32], k and v [2, S, 2, 32] (S = 32), float32."""
        q = _random(seed, 2, num_tokens, 4, 32)
        k, v = (_random(seed + i, 2, 32, 2, 32) for i in (1, 2))
        return q, k, v

    @pytest.mark.parametrize(
        "path, axis_type, check_vma",
        _settings(
            ("xla", EXPLICIT_DEFAULT),
            ("xla", AUTO_UNCHECKED),
            ("triton-interpret", EXPLICIT_DEFAULT),
            ("triton-interpret", AUTO_UNCHECKED),
        ),
    )
    def test_flash_attention_in_shard_map(path, axis_type, check_vma):
        """flash_attention inside shard_map over the batch (GQA, causal, packed documents):
        values and gradients as the unsharded call's."""
        q, k, v = _problem()
        ids = jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 3, (2, 32))), jnp.int32)

        def attn(**kwargs):
            call = functools.partial(pallas_flash.flash_attention, is_causal=True, **kwargs)
            return _value_and_grads(
                lambda q, k, v, ids: call(q, k, v, q_segment_ids=ids), (0, 1, 2)
            )

        mesh = _mesh(2, axis_type)
        got = _in_shard_map(attn(**PATHS[path]), mesh, (P("x"),) * 4, P("x"), check_vma)(
            q, k, v, ids
        )
        _assert_close(got, _reference("flash", attn(backend="xla"), q, k, v, ids))

    def test_vmapped_call_in_shard_map():
        """flash_attention under jax.vmap inside shard_map (jax's defaults, the kernels in the
        interpreter), over q and k with v shared by every mapped call: values and gradients
        as the unsharded call's."""
        q, k, v = _problem()
        q, k = (jnp.stack([x, x[::-1]]) for x in (q, k))

        def attn(**kwargs):
            call = functools.partial(pallas_flash.flash_attention, is_causal=True, **kwargs)
            return jax.vmap(_value_and_grads(call, (0, 1, 2)), in_axes=(0, 0, None))

        mapped = P(None, "x")
        got = _in_shard_map(
            attn(**PATHS["triton-interpret"]),
            _mesh(2, "explicit"),
            (mapped, mapped, P("x")),
            mapped,
        )(q, k, v)
        _assert_close(got, _reference("vmapped", attn(backend="xla"), q, k, v))

    @pytest.mark.parametrize(
        "path, axis_type, check_vma",
        _settings(("triton-interpret", EXPLICIT_DEFAULT)),
    )
    def test_replicated_operands_get_their_gradients_summed(path, axis_type, check_vma):
        """A bias and sinks the same on every device (replicated in_specs), next to q, k and
        v split over the batch, under jax's default check_vma: the kernels' outputs vary over
        the axis, and the gradients of the replicated operands are summed over it (the
        transpose of their cast to varying), as the unsharded call's. (With check_vma=False
        jax does not sum them: the user's in_specs promise what jax cannot check.)"""
        q, k, v = _problem()
        bias, sinks = _random(4, 1, 1, 32, 32), _random(5, 4)

        def attn(**kwargs):
            call = functools.partial(pallas_flash.flash_attention, is_causal=True, **kwargs)
            return _value_and_grads(
                lambda q, k, v, bias, sinks: call(q, k, v, bias, sinks=sinks), (0, 1, 2, 3, 4)
            )

        specs = (P("x"),) * 3 + (P(), P())
        out_specs = (P("x"), (P("x"),) * 3 + (P(), P()))
        args = (q, k, v, bias, sinks)
        mesh = _mesh(2, axis_type)
        got = _in_shard_map(attn(**PATHS[path]), mesh, specs, out_specs, check_vma)(*args)
        _assert_close(got, _reference("replicated", attn(backend="xla"), *args))

    def _decode(**kwargs):
        def decode(q, k, v, lengths):
            return pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths, **kwargs)

        return _value_and_grads(decode, (0, 1, 2))

    @pytest.mark.parametrize(
        "path, axis_type, check_vma",
        _settings(("xla", AUTO_UNCHECKED), ("triton-interpret", EXPLICIT_DEFAULT)),
    )
    def test_decode_and_paged_attention_in_shard_map(path, axis_type, check_vma):
        """decode_attention with the batch split (its lengths with it) and paged_attention
        with the heads split (a pool of pages over its heads; the block tables and lengths the
        same on every device): values and gradients as the unsharded calls'."""
        q, k, v = _problem(num_tokens=2)
        lengths = jnp.asarray([32, 9], jnp.int32)
        tables = jnp.asarray([[4, 1, 3, 7], [0, 5, 2, 6]], jnp.int32)
        # The pool's page tables[b][j] holds keys [8 j, 8 j + 8) of sequence b.
        pages = [x.reshape(8, 8, 2, 32)[np.argsort(tables.reshape(-1))] for x in (k, v)]

        def paged(**kwargs):
            return _value_and_grads(
                functools.partial(pallas_flash.paged_attention, **kwargs), (0, 1, 2)
            )

        mesh = _mesh(2, axis_type)
        got = _in_shard_map(_decode(**PATHS[path]), mesh, (P("x"),) * 4, P("x"), check_vma)(
            q, k, v, lengths
        )
        want = _reference("decode", _decode(backend="xla"), q, k, v, lengths)
        _assert_close(got, want)
        heads = P(None, None, "x")
        args = (q, *pages, tables, lengths)
        got = _in_shard_map(
            paged(**PATHS[path]), mesh, (heads,) * 3 + (P(), P()), heads, check_vma
        )(*args)
        _assert_close(got, _reference("paged", paged(backend="xla"), *args))
        _assert_close(got[0], want[0])  # the same keys as the contiguous cache's

    # (num_shards, layout, options) of a ring of 8 positions per device.
    RING_CASES = {
        "causal-contiguous": (2, "contiguous", dict(is_causal=True)),
        "window-segments-lengths": (
            2,
            "contiguous",
            dict(local_window_size=(5, 3), segments=True, lengths=True),
        ),
        "causal-window-contiguous-sinks": (
            4,
            "contiguous",
            dict(local_window_size=(6, 0), sinks=True),
        ),
        "causal-zigzag": (2, "zigzag", dict(is_causal=True)),
    }

    def _ring_case(num_shards, layout, options, path):
        """(ring fn, unsharded fn, args, specs, out_specs): global arrays, the ring's operands
        in the layout's order; the gradients w.r.t. q, k, v (and sinks)."""
        options = dict(options)
        segments, lengths = options.pop("segments", False), options.pop("lengths", False)
        with_sinks = options.pop("sinks", False)
        q_len = 8 * num_shards
        q = _random(0, 2, q_len, 4, 32)
        k, v = _random(1, 2, q_len, 2, 32), _random(2, 2, q_len, 2, 32)
        rng = np.random.default_rng(3)
        ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, q_len)), axis=1), jnp.int32)
        seq_lengths = jnp.asarray([q_len - 3, q_len // 2 + 1], jnp.int32)
        sinks = jnp.asarray([0.5, -jnp.inf, 2.0, -1.0], jnp.float32)

        def extra(ids, seq_lengths, sinks):
            return dict(
                q_segment_ids=ids if segments else None,
                query_seq_lengths=seq_lengths if lengths else None,
                key_value_seq_lengths=seq_lengths if lengths else None,
                sinks=sinks if with_sinks else None,
            )

        argnums = (0, 1, 2, 5) if with_sinks else (0, 1, 2)
        ring = _value_and_grads(
            lambda q, k, v, ids, seq_lengths, sinks: sharding.ring_attention(
                q,
                k,
                v,
                axis_name="x",
                layout=layout,
                **extra(ids, seq_lengths, sinks),
                **options,
                **PATHS[path],
            ),
            argnums,
        )
        unsharded = _value_and_grads(
            lambda q, k, v, ids, seq_lengths, sinks: pallas_flash.flash_attention(
                q, k, v, backend="xla", **extra(ids, seq_lengths, sinks), **options
            ),
            argnums,
        )
        seq = P(None, "x")
        specs = (seq, seq, seq, seq, P(), P())
        out_specs = (seq, (seq,) * 3 + ((P(),) if with_sinks else ()))
        return ring, unsharded, (q, k, v, ids, seq_lengths, sinks), specs, out_specs

    @pytest.mark.parametrize(
        "case, path, axis_type, check_vma",
        [
            pytest.param(case, *setting.values, id=f"{case}-{setting.id}")
            for case, settings in (
                (
                    "causal-contiguous",
                    _settings(
                        ("xla", EXPLICIT_DEFAULT), ("xla", AUTO_DEFAULT), ("xla", AUTO_UNCHECKED)
                    ),
                ),
                ("window-segments-lengths", _settings(("xla", EXPLICIT_DEFAULT))),
                ("causal-window-contiguous-sinks", _settings(("xla", AUTO_DEFAULT))),
                ("causal-zigzag", _settings(("triton-interpret", EXPLICIT_DEFAULT))),
            )
            for setting in settings
        ],
    )
    def test_ring_attention_in_shard_map(case, path, axis_type, check_vma):
        """ring_attention in a user's shard_map: a causal contiguous ring (its steps'
        lax.switch of a block and of no block), a window over a ring with packed documents
        and lengths, a causal window with sinks the same on every device (under
        check_vma their gradient sums over the ring), the kernels (interpreter) inside a
        causal zig-zag ring: values and gradients as the unsharded call's."""
        num_shards, layout, _ = RING_CASES[case]
        ring, unsharded, args, specs, out_specs = _ring_case(*RING_CASES[case], path)
        order = _layout_order(layout, num_shards, sharding.to_zigzag)
        placed = (*map(order, args[:4]), *args[4:])
        mesh = _mesh(num_shards, axis_type)
        out, grads = _in_shard_map(ring, mesh, specs, out_specs, check_vma)(*placed)
        unorder = _layout_order(layout, num_shards, sharding.from_zigzag)
        got = (unorder(out), (*map(unorder, grads[:3]), *grads[3:]))
        _assert_close(got, _reference(("ring", case), unsharded, *args), atol=1e-4)

    # -- Explicit meshes outside shard_map ------------------------------------------------------

    def test_zigzag_keeps_an_explicit_sharding():
        """to_zigzag / from_zigzag of an array whose type splits its sequence (an Explicit
        mesh): the permutation, its inverse, and the array's sharding kept (eager and jit)."""
        mesh = _mesh(4, "explicit", ("data", "context"), (2, 2))
        x = jnp.arange(2 * 16 * 3, dtype=jnp.float32).reshape(2, 16, 3)
        placed = jax.device_put(x, NamedSharding(mesh, P("data", "context")))
        order = sharding.zigzag_indices(16, 2)
        for fn in (lambda f: f, jax.jit):
            z = fn(functools.partial(sharding.to_zigzag, num_shards=2))(placed)
            assert jax.typeof(z).sharding.spec == P("data", "context", None)
            np.testing.assert_array_equal(np.asarray(z), np.asarray(x)[:, order])
            back = fn(functools.partial(sharding.from_zigzag, num_shards=2))(z)
            assert jax.typeof(back).sharding.spec == P("data", "context", None)
            np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
        rows = jnp.moveaxis(x, 1, 2)  # an lse's layout: the sequence last
        placed = jax.device_put(rows, NamedSharding(mesh, P("data", None, "context")))
        z = sharding.to_zigzag(placed, 2, axis=2)
        np.testing.assert_array_equal(np.asarray(z), np.asarray(rows)[..., order])

    def test_ring_attention_sharded_on_an_explicit_mesh():
        """The documented zig-zag workflow on an Explicit mesh: to_zigzag, ring_attention_sharded
        (its shard_map with jax's defaults), from_zigzag; values and gradients as the unsharded
        call's."""
        mesh = _mesh(4, "explicit", ("data", "context"), (2, 2))
        q, k, v = _problem()

        def ring(q, k, v):
            zig = functools.partial(sharding.to_zigzag, num_shards=2)
            out = sharding.ring_attention_sharded(
                *map(zig, (q, k, v)),
                mesh=mesh,
                context_axis="context",
                batch_axis="data",
                is_causal=True,
                layout="zigzag",
                backend="xla",
            )
            return sharding.from_zigzag(out, 2)

        seq = NamedSharding(mesh, P("data", "context"))
        placed = [jax.device_put(x, seq) for x in (q, k, v)]
        got = jax.jit(_value_and_grads(ring, (0, 1, 2)))(*placed)
        plain = functools.partial(pallas_flash.flash_attention, is_causal=True, backend="xla")
        want = _reference("flash-causal", _value_and_grads(plain, (0, 1, 2)), q, k, v)
        _assert_close(got, want, atol=1e-4)

    @pytest.mark.parametrize("path", PATHS)
    def test_decode_over_a_sequence_split_cache_on_an_explicit_mesh(path):
        """decode_attention under jit (no shard_map) with its cache split over its sequence
        and batch on a mesh of Explicit axes: on the default CPU path ("xla", whose jnp
        contracts over the split keys) and the kernel's (whose gradient is the reference's),
        values and gradients as the unsharded call's."""
        q, k, v = _problem(num_tokens=2)
        lengths = jnp.asarray([32, 9], jnp.int32)
        mesh = _mesh(4, "explicit", ("data", "context"), (2, 2))
        specs = (P("data"), P("data", "context"), P("data", "context"), P("data"))
        args = (q, k, v, lengths)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        got = jax.jit(_decode(**PATHS[path]))(*placed)
        _assert_close(got, _reference("decode", _decode(backend="xla"), *args))
