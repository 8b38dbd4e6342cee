"""Attention on a device mesh: batch and head sharding without gathers (the kernels' partitioning
rule, vmap, explicit axes, the exported passes), decode split over heads or over the cache's
sequence. The ring (context parallelism) is tests/test_sharding_ring.py.

jax fixes its device count when it starts, so the multi-device tests of both files run in one
child pytest process on 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8,
PALLAS_FLASH_SHARDING_CHILD=1); in the main test process `test_on_8_cpu_devices` starts it. The
kernels run in the Pallas interpreter, where the partitioning is the point.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.sharding import (
    ALL_CASES,
    CHILD,
    INTERPRET,
    NUM_DEVICES,
    assert_close,
    hlo_collectives,
    qkv_inputs,
    weighted_loss,
)

import pallas_flash


def _export_keeps_exp2() -> bool:
    """Whether `jnp.exp2` through jax.export gives the direct call's bits on the CPU. jax 0.12.1
    lowers it to `stablehlo.exp2`, which XLA rounds otherwise than exp(x * ln 2), and jax.export
    writes the module for an older StableHLO, without exp2: as exp(x * ln 2)."""
    x = jnp.linspace(-30.0, 30.0, 4097, dtype=jnp.float32)
    direct = jax.jit(jnp.exp2)
    exported = jax.export.export(direct, platforms=["cpu"])(x)
    return np.array_equal(np.asarray(exported.call(x)), np.asarray(direct(x)))


def _check_exported_passes(q, k, v, d_out, config, platform, sinks=None):
    """The forward and backward shards (`_passes.forward`, `_passes.backward`) through
    `_partition._exported` give the direct calls' bits. Their operands are built in the order
    `_vjp._forward` and `_vjp._backward` pass them, the backward's from the forward's results.
    The interpreter's kernels are jax ops: where jax.export rewrites their exp2
    (`_export_keeps_exp2`), each output is within 4 float32 eps of its largest magnitude."""
    from pallas_flash import _partition, _passes
    from pallas_flash.masks import MaskArrays

    fwd_args = [q, k, v, None, MaskArrays(), sinks]
    out, lse, log_sum, row_max = _passes.forward(*fwd_args, config=config)
    d_lse = jnp.linspace(-1.0, 1.0, lse.size, dtype=lse.dtype).reshape(lse.shape)
    bwd_args = [*fwd_args, out, lse, log_sum, row_max, d_out, d_lse]
    bits = platform != "cpu" or _export_keeps_exp2()
    for kernel, args in ((_passes.forward, fwd_args), (_passes.backward, bwd_args)):
        leaves, tree = jax.tree.flatten(args)
        avals = tuple((tuple(x.shape), x.dtype) for x in leaves)
        exported = _partition._exported(kernel, config, tree, avals, platform)
        want = jax.jit(functools.partial(kernel, config=config))(*args)
        got = jax.jit(exported.call)(*leaves)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            if bits:
                np.testing.assert_array_equal(x, y)
            else:
                atol = 4 * np.finfo(np.float32).eps * np.abs(y).max()
                np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def test_exported_passes_give_the_direct_calls_bits_in_the_interpreter():
    """`_check_exported_passes` on the CPU, for the Triton kernels in the interpreter (GQA,
    causal, sinks): the exported backward takes the operands `_vjp._backward` passes."""
    from pallas_flash import dispatch
    from pallas_flash.call import Call
    from pallas_flash.masks import MaskSpec

    q, k, v, d_out = qkv_inputs(2, 20, 24, 4, 2)
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, 8, dtype=np.float32).reshape(2, 4))
    spec = MaskSpec(q_len=20, kv_len=24, is_causal=True)
    call = Call(q_shape=q.shape, k_shape=k.shape, dtype=q.dtype, spec=spec)
    config = dispatch.choose(call, None, scale=0.25, interpret=True)
    _check_exported_passes(q, k, v, d_out, config, "cpu", sinks)


@pytest.mark.gpu
def test_exported_passes_give_the_direct_calls_bits():
    """The passes as the partitioning rule embeds them on a mesh (`_partition._exported`, a
    jax.export per shard shape), run on one GPU: the forward's and the backward's outputs are
    the direct calls' bits (default kernels: Mosaic on Hopper, bf16, causal GQA at 2k)."""
    from pallas_flash import device, dispatch
    from pallas_flash.call import Call
    from pallas_flash.masks import MaskSpec

    q, k, v, d_out = (x.astype(jnp.bfloat16) for x in qkv_inputs(2, 2048, 2048, 8, 2, 128))
    spec = MaskSpec(q_len=2048, kv_len=2048, is_causal=True)
    call = Call(q_shape=q.shape, k_shape=k.shape, dtype=q.dtype, spec=spec)
    config = dispatch.choose(call, device.target_device(), scale=128**-0.5)
    _check_exported_passes(q, k, v, d_out, config, "cuda")


@pytest.mark.gpu
def test_batch_and_head_sharding_on_gpus():
    """On a host with 2+ GPUs: q/k/v sharded over batch and heads run the compiled kernels per
    device with no collective, and match the unsharded call."""
    count = jax.device_count()
    if count < 2:
        pytest.skip("needs 2+ GPUs")
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, count // 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    q, k, v, d_out = (x.astype(jnp.bfloat16) for x in qkv_inputs(4, 2048, 2048, 16, 8, 128))
    spec = NamedSharding(mesh, P("data", None, "model", None))

    def run(q, k, v, d_out):
        out, pullback = jax.vjp(
            functools.partial(pallas_flash.flash_attention, is_causal=True), q, k, v
        )
        return out, *pullback(d_out)

    sharded = jax.jit(run, in_shardings=(spec,) * 4)
    assert not hlo_collectives(sharded.lower(q, k, v, d_out).compile().as_text())
    got = sharded(q, k, v, d_out)
    want = jax.jit(run, in_shardings=(NamedSharding(mesh, P()),) * 4)(q, k, v, d_out)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["heads", "sequence"])
def test_decode_sharding_on_gpus(split):
    """On a host with 2+ GPUs: decode over a cache sharded over batch and heads (or over batch
    and its sequence) runs the compiled kernel per device without gathering the cache, and
    matches the unsharded call."""
    count = jax.device_count()
    if count < 2:
        pytest.skip("needs 2+ GPUs")
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, count // 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in qkv_inputs(8, 1, 8192, 32, 8, 128))
    lengths = jnp.asarray([8192, 100, 5000, 1, 8000, 4096, 77, 2048], jnp.int32)
    if split == "heads":
        queries = cache = NamedSharding(mesh, P("data", None, "model", None))
    else:
        queries, cache = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", "model"))

    def call(q, k, v, lengths):
        return pallas_flash.decode_attention(q, k, v, key_value_seq_lengths=lengths)

    rows = NamedSharding(mesh, P("data"))
    sharded = jax.jit(call, in_shardings=(queries, cache, cache, rows))
    collectives = hlo_collectives(sharded.lower(q, k, v, lengths).compile().as_text())
    assert not [s for _, s in collectives if ",8192," in s or ",4096," in s], collectives
    got = sharded(q, k, v, lengths)
    want = jax.jit(call)(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


if not CHILD:

    def test_on_8_cpu_devices():
        """Runs the multi-device tests of this module and of test_sharding_ring.py in one
        child process with 8 CPU devices."""
        here = pathlib.Path(__file__).resolve()
        files = [str(here), str(here.with_name("test_sharding_ring.py"))]
        env = dict(
            os.environ,
            # Optimisation level 0 halves XLA's CPU compile time, which is most of these tests.
            XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES} "
            "--xla_backend_optimization_level=0",
            PALLAS_FLASH_SHARDING_CHILD="1",
            JAX_PLATFORMS="cpu",
        )
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
            cwd=here.parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


if CHILD:
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == NUM_DEVICES

    def auto_mesh(shape, names):
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))

    # A dense mask per head, broadcast over the batch: [1, N, T, S].
    HEAD_MASK = np.random.default_rng(3).random((1, 8, 24, 24)) < 0.8
    # Attention sinks [N]: the kernels take them per (batch entry, head), sharded as those are.
    SINKS = np.linspace(-1.0, 2.0, 8, dtype=np.float32)

    def _masked_call(q, k, v, bias, q_seg, **kwargs):
        return pallas_flash.flash_attention(
            q,
            k,
            v,
            bias,
            jnp.asarray(HEAD_MASK),
            is_causal=True,
            q_segment_ids=q_seg,
            sinks=jnp.asarray(SINKS),
            return_residuals=True,
            **kwargs,
        )

    def _batch_head_problem():
        """GQA (8 query heads on 4 kv heads), causal, packed documents, a bias broadcast over
        the heads [B, 1, T, S], a dense mask broadcast over the batch [1, N, T, S] and
        attention sinks."""
        q, k, v, d_out = qkv_inputs(4, 24, 24, 8, 4)
        rng = np.random.default_rng(1)
        bias = jnp.asarray(rng.standard_normal((4, 1, 24, 24)), jnp.float32)
        q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (4, 24)), axis=1), jnp.int32)
        return (q, k, v, bias, q_seg), d_out

    def _value_and_grads(args, d_out, **kwargs):
        loss = weighted_loss(functools.partial(_masked_call, **kwargs), d_out)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    def test_unpartitioned_kernels_gather_their_operands():
        """Why the partitioning rule exists: the kernels' pass without it, jit'd with q/k/v
        sharded over batch and heads, makes XLA gather q, k and v onto every device."""
        from pallas_flash import _passes

        (q, k, v, _, _), _ = _batch_head_problem()
        mesh = auto_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))
        config = _passes.KernelConfig(
            spec=pallas_flash.masks.MaskSpec(q_len=24, kv_len=24, is_causal=True),
            scale=0.25,
            block_sizes=pallas_flash.BlockSizes(block_q=16, block_kv=16),
            interpret=True,
        )
        unpartitioned = functools.partial(_passes.forward, config=config)
        arrays = pallas_flash.masks.MaskArrays()
        hlo = (
            jax.jit(lambda q, k, v: unpartitioned(q, k, v, None, arrays, None))
            .lower(*(jax.device_put(x, qkv) for x in (q, k, v)))
            .compile()
            .as_text()
        )
        gathered = {
            shape.split("{")[0] for kind, shape in hlo_collectives(hlo) if kind == "all-gather"
        }
        # k and v gathered whole onto every device (q too, after the kernel pads its rows).
        assert "f32[4,24,4,16]" in gathered, gathered

    @pytest.mark.parametrize(
        "spec",
        [P("data", None, "model", None)]
        + ([P(None, None, "model", None), P("data")] if ALL_CASES else []),
    )
    def test_batch_and_head_sharding_runs_locally(spec):
        """jit with q/k/v (and segment ids, bias) sharded over batch and/or heads: the compiled
        forward and backward hold no collective on q/k/v/out or their gradients (the one
        all-reduce sums the bias's partial gradients over the head shards it is broadcast
        across), the results keep the inputs' sharding, and match the unsharded call."""
        args, d_out = _batch_head_problem()
        mesh = auto_mesh((2, 4), ("data", "model"))
        batch = spec[0] if len(spec) else None
        shardings = (
            NamedSharding(mesh, spec),
            NamedSharding(mesh, spec),
            NamedSharding(mesh, spec),
            NamedSharding(mesh, P(batch)),
            NamedSharding(mesh, P(batch)),
        )
        fn = _value_and_grads(args, d_out, **INTERPRET)
        sharded = jax.jit(fn, in_shardings=shardings)
        hlo = sharded.lower(*args).compile().as_text()
        collectives = hlo_collectives(hlo)
        # All-reduces of the loss's scalar sums, and of the bias gradient [B/2, 1, T, S] when the
        # heads are sharded (XLA may combine them into one tuple all-reduce).
        assert all(kind == "all-reduce" for kind, _ in collectives), collectives
        shapes = re.findall(r"f32\[([0-9,]*)\]", " ".join(s for _, s in collectives))
        bias_shard = f"{4 // (2 if batch else 1)},1,24,24"
        assert set(shapes) <= {"", bias_shard}, collectives
        assert (bias_shard in shapes) == (spec[2:3] == ("model",)), collectives
        value, grads = sharded(*args)
        assert grads[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
        want = jax.jit(_value_and_grads(args, d_out, backend="xla"))(*args)
        assert_close((value, grads), want, atol=1e-4)

    def test_value_head_dim_sharding_runs_locally():
        """A value head dim of its own (v [B, S, K, 8] next to q, k [.., 16]) sharded over
        batch and heads: forward and backward hold no collective but the loss's scalar sums,
        and match the unsharded call (the partitioning rule gives v and out their own head
        factor)."""
        q, k, v, _ = qkv_inputs(4, 24, 24, 8, 4)
        v = v[..., :8]
        d_out = jnp.asarray(np.random.default_rng(2).standard_normal((4, 24, 8, 8)), jnp.float32)
        mesh = auto_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))

        def fn(**kwargs):
            attn = functools.partial(
                pallas_flash.flash_attention, is_causal=True, return_residuals=True, **kwargs
            )
            return jax.value_and_grad(weighted_loss(attn, d_out), argnums=(0, 1, 2))

        sharded = jax.jit(fn(**INTERPRET), in_shardings=(qkv,) * 3)
        collectives = hlo_collectives(sharded.lower(q, k, v).compile().as_text())
        assert all(kind == "all-reduce" for kind, _ in collectives), collectives
        assert not re.findall(r"f32\[[0-9]", " ".join(s for _, s in collectives)), collectives
        value, grads = sharded(q, k, v)
        assert grads[2].shape == v.shape and grads[2].sharding.is_equivalent_to(qkv, 4)
        assert_close((value, grads), jax.jit(fn(backend="xla"))(q, k, v), atol=1e-4)

    def test_dropout_mask_is_global_under_sharding():
        """Batch and head sharding: every shard reads its own (batch, head) seeds, so the
        sharded kernels apply the unsharded call's keep-mask (values and gradients)."""
        (q, k, v, _, _), d_out = _batch_head_problem()
        mesh = auto_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))
        rng = jax.random.key(5)

        def value_and_grads(**kwargs):
            def loss(q, k, v):
                out = pallas_flash.flash_attention(
                    q, k, v, is_causal=True, dropout_rate=0.3, dropout_rng=rng, **kwargs
                )
                return jnp.sum(out * d_out)

            return jax.value_and_grad(loss, argnums=(0, 1, 2))

        got = jax.jit(value_and_grads(**INTERPRET), in_shardings=(qkv,) * 3)(q, k, v)
        want = jax.jit(value_and_grads(backend="xla"))(q, k, v)
        assert_close(got, want, atol=1e-4)

    def test_vmapped_call_stays_partitioned():
        """Under jax.vmap (the mapped axis leading, sharded operands inside) the kernels still
        run per shard: the mapped axis folds into the batch. Forward and backward."""
        rng = np.random.default_rng(4)
        q, k, v, d_out = qkv_inputs(4, 16, 16, 8, 4)
        q, k, v, d_out = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v, d_out))
        q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 16)), axis=1), jnp.int32)

        def loss(q, k, v, **kwargs):
            attn = functools.partial(
                pallas_flash.flash_attention,
                is_causal=True,
                q_segment_ids=q_seg,
                sinks=jnp.asarray(SINKS),
                **kwargs,
            )
            return jnp.sum(jax.vmap(attn)(q, k, v) * d_out)

        mesh = auto_mesh((2, 4), ("data", "model"))
        spec = NamedSharding(mesh, P(None, "data", None, "model"))
        fn = jax.value_and_grad(functools.partial(loss, **INTERPRET), argnums=(0, 1, 2))
        sharded = jax.jit(fn, in_shardings=(spec,) * 3)
        collectives = hlo_collectives(sharded.lower(q, k, v).compile().as_text())
        assert all(kind == "all-reduce" and s.startswith("f32[]") for kind, s in collectives)
        want = jax.jit(jax.value_and_grad(functools.partial(loss, backend="xla"), (0, 1, 2)))
        assert_close(sharded(q, k, v), want(q, k, v), atol=1e-4)

    def test_vmapped_backward_with_a_shared_cotangent_stays_partitioned():
        """jax.vmap over flash_attention_backward with one d_lse for every mapped call (unbatched,
        as jax hands a zero cotangent over): it is broadcast along the mapped axis and the
        kernels still run per shard, with no collective."""
        q, k, v, d_out = qkv_inputs(4, 16, 16, 8, 4)
        q, k, v, d_out = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v, d_out))
        call = functools.partial(
            pallas_flash.flash_attention, is_causal=True, return_residuals=True, backend="xla"
        )
        out, lse = jax.vmap(call)(q, k, v)
        d_lse = jnp.linspace(-1.0, 1.0, 2 * 8 * 16, dtype=jnp.float32).reshape(2, 8, 16)

        def grads(q, k, v, out, lse, d_out, **kwargs):
            backward = functools.partial(
                pallas_flash.flash_attention_backward, is_causal=True, **kwargs
            )
            return jax.vmap(backward, in_axes=(0,) * 6 + (None,))(q, k, v, out, lse, d_out, d_lse)

        mesh = auto_mesh((2, 4), ("data", "model"))
        spec = NamedSharding(mesh, P(None, "data", None, "model"))
        rows = NamedSharding(mesh, P(None, "data", "model"))
        sharded = jax.jit(
            functools.partial(grads, **INTERPRET), in_shardings=(spec,) * 4 + (rows, spec)
        )
        args = (q, k, v, out, lse, d_out)
        assert hlo_collectives(sharded.lower(*args).compile().as_text()) == []
        want = jax.jit(functools.partial(grads, backend="xla"))(*args)
        assert_close(sharded(*args), want, atol=1e-4)

    def test_key_broadcast_bias_gradient_under_sharding():
        """A bias broadcast over the keys and the batch [1, N, T, 1] (its gradient in closed
        form, per shard, no dbias kernel) with sinks, batch and heads sharded: the shards'
        gradients sum over the batch shards, as the unsharded call's."""
        q, k, v, d_out = qkv_inputs(4, 24, 24, 8, 4)
        bias = jnp.asarray(np.random.default_rng(5).standard_normal((1, 8, 24, 1)), jnp.float32)

        def value_and_grads(**kwargs):
            def attn(q, k, v, bias):
                return pallas_flash.flash_attention(
                    q,
                    k,
                    v,
                    bias,
                    is_causal=True,
                    sinks=jnp.asarray(SINKS),
                    return_residuals=True,
                    **kwargs,
                )

            return jax.value_and_grad(weighted_loss(attn, d_out), argnums=(0, 1, 2, 3))

        mesh = auto_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))
        shardings = (qkv, qkv, qkv, NamedSharding(mesh, P(None, "model")))
        sharded = jax.jit(value_and_grads(**INTERPRET), in_shardings=shardings)
        collectives = hlo_collectives(sharded.lower(q, k, v, bias).compile().as_text())
        assert all(kind == "all-reduce" for kind, _ in collectives), collectives
        want = jax.jit(value_and_grads(backend="xla"))(q, k, v, bias)
        assert_close(sharded(q, k, v, bias), want, atol=1e-4)

    def test_explicit_sharding_runs_locally():
        """Sharding in types (jax.make_mesh's default Explicit axes): the same, traced into a
        shard_map over the types' shardings."""
        args, d_out = _batch_head_problem()
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        fn = _value_and_grads(args, d_out, **INTERPRET)
        with jax.set_mesh(mesh):
            qkv = P("data", None, "model", None)
            batch = (qkv, qkv, qkv, P("data"), P("data"))
            placed = [jax.device_put(x, s) for x, s in zip(args, batch)]
            sharded = jax.jit(fn)
            hlo = sharded.lower(*placed).compile().as_text()
            value, grads = sharded(*placed)
        collectives = hlo_collectives(hlo)
        assert all(kind == "all-reduce" for kind, _ in collectives), collectives
        shapes = re.findall(r"f32\[([0-9,]*)\]", " ".join(s for _, s in collectives))
        assert set(shapes) <= {"", "2,1,24,24"}, collectives
        assert jax.typeof(grads[0]).sharding.spec == qkv
        want = jax.jit(_value_and_grads(args, d_out, backend="xla"))(*args)
        assert_close((value, grads), want, atol=1e-4)

    def test_explicit_sharding_needs_no_mesh_context():
        """Arrays placed on a mesh of Explicit axes, called without `jax.set_mesh` (plain jnp
        needs none): the same local run, gradients in their primals' shardings."""
        args, d_out = _batch_head_problem()
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))
        batch = (qkv, qkv, qkv, NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")))
        placed = [jax.device_put(x, s) for x, s in zip(args, batch)]
        value, grads = jax.jit(_value_and_grads(args, d_out, **INTERPRET))(*placed)
        assert jax.typeof(grads[0]).sharding.spec == qkv.spec
        want = jax.jit(_value_and_grads(args, d_out, backend="xla"))(*args)
        assert_close((value, grads), want, atol=1e-4)

    def test_repeated_layers_lower_their_kernels_once():
        """Under automatic sharding XLA's partitioner asks for every layer's partitioned kernels,
        and jax lowers each answer anew (for the Mosaic kernels ~1 s of Python a layer on the
        H200): `_partition._exported` lowers a pass once per shard shape and the later layers
        embed that module. Three layers: the forward and the backward exported once each, then
        reused twice each; the values as the reference's."""
        from pallas_flash import _partition

        q, k, v, _ = qkv_inputs(4, 20, 20, 4, 4)
        spec = NamedSharding(auto_mesh((2, 4), ("data", "model")), P("data", None, "model", None))

        def loss(q, k, v, **kwargs):
            x = q
            for _ in range(3):
                x = pallas_flash.flash_attention(x, k, v, is_causal=True, **kwargs)
            return jnp.sum(x * x)

        _partition._exported.cache_clear()
        grad = jax.value_and_grad(functools.partial(loss, **INTERPRET), (0, 1, 2))
        got = jax.jit(grad, in_shardings=(spec,) * 3)(q, k, v)
        info = _partition._exported.cache_info()
        assert (info.misses, info.hits) == (2, 4), info
        want = jax.value_and_grad(functools.partial(loss, backend="xla"), (0, 1, 2))(q, k, v)
        assert_close(got, want, atol=1e-4)

    def test_sequence_sharding_is_refused():
        """q sharded over its sequence axis: a ValueError naming the axis (at compile time
        under automatic sharding, at trace time under explicit sharding), never a gather."""
        q, k, v, _ = qkv_inputs(2, 16, 16, 4, 4)
        call = functools.partial(pallas_flash.flash_attention, **INTERPRET)
        mesh = auto_mesh((2, 4), ("data", "model"))
        seq = NamedSharding(mesh, P(None, "model"))
        with pytest.raises(Exception, match="sharded over its sequence axis"):
            jax.jit(call, in_shardings=(seq, seq, seq)).lower(q, k, v).compile()
        with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
            placed = [jax.device_put(x, P(None, "model")) for x in (q, k, v)]
            with pytest.raises(ValueError, match="sharded over its sequence axis"):
                jax.jit(call)(*placed)

    def test_heads_split_finer_than_kv_heads_is_refused():
        """MQA (1 kv head) with the query heads over 4 devices: a ValueError, not a gather."""
        q, k, v, _ = qkv_inputs(2, 16, 16, 4, 1)
        with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
            placed = [jax.device_put(q, P(None, None, "model")), k, v]
            call = functools.partial(pallas_flash.flash_attention, **INTERPRET)
            with pytest.raises(ValueError, match="num_kv_heads=1"):
                jax.jit(call)(*placed)

    def test_unsharded_call_lowers_without_partitioning():
        """On one device of a multi-device host the program holds no partitioning call."""
        q, k, v, _ = qkv_inputs(2, 16, 16, 4, 4)
        text = jax.jit(functools.partial(pallas_flash.flash_attention, **INTERPRET))
        assert "CustomSPMDPartitioning" not in text.lower(q, k, v).as_text()

    def test_partitioned_passes_lower_directly_where_export_fails(monkeypatch):
        """Should jax.export refuse a pass, the rule lowers it at the call site as before (the
        same results) and warns: only compile time is at stake."""
        from pallas_flash import _partition

        def refuse(*args, **kwargs):
            raise NotImplementedError("no export here")

        monkeypatch.setattr(_partition, "_exported", refuse)
        call = functools.partial(pallas_flash.flash_attention, is_causal=True, **INTERPRET)
        q, k, v, _ = qkv_inputs(4, 16, 16, 4, 4, seed=8)
        spec = NamedSharding(auto_mesh((2, 4), ("data", "model")), P("data", None, "model"))
        with pytest.warns(RuntimeWarning, match="no export here"):
            got = jax.jit(call, in_shardings=(spec,) * 3)(q, k, v)
        assert_close(got, call(q, k, v), atol=1e-5)

    def test_exported_passes_follow_the_mesh_context():
        """jax.export reads the mesh of `jax.set_mesh` into its module's device count: a pass
        exported under an 8-device context is not reused on a 2-device mesh whose shards have
        the same shapes (that call would not compile)."""
        call = functools.partial(pallas_flash.flash_attention, is_causal=True, **INTERPRET)
        q, k, v, _ = qkv_inputs(4, 16, 16, 8, 8, seed=6)
        mesh = auto_mesh((2, 4), ("data", "model"))
        spec = NamedSharding(mesh, P("data", None, "model", None))
        with jax.set_mesh(mesh):
            got = jax.jit(call, in_shardings=(spec,) * 3)(q, k, v)
        assert_close(got, call(q, k, v), atol=1e-5)
        q, k, v, _ = qkv_inputs(4, 16, 16, 2, 2, seed=7)  # the same [2, 16, 2, 16] shards
        pair = jax.make_mesh((2,), ("data",), (AxisType.Auto,), devices=jax.devices()[:2])
        spec = NamedSharding(pair, P("data"))
        got = jax.jit(call, in_shardings=(spec,) * 3)(q, k, v)
        assert_close(got, call(q, k, v), atol=1e-5)

    # -- decode and paged attention ------------------------------------------------------------

    def _decode_problem():
        """4 sequences of ragged lengths, 2 new tokens each, GQA 8 over 4 heads, a cache of 40
        (with NaN past each length, which no row may read), as a contiguous cache and as a pool
        of pages of 8 in shuffled order; sinks."""
        rng = np.random.default_rng(5)
        q, k, v, _ = qkv_inputs(4, 2, 40, 8, 4, seed=5)
        lengths = jnp.asarray([40, 9, 23, 2], jnp.int32)
        past = jnp.arange(40)[None, :, None, None] >= lengths[:, None, None, None]
        k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
        order = rng.permutation(4 * 5)
        tables = jnp.asarray(order.reshape(4, 5), jnp.int32)
        pages = np.zeros((20, 8, 4, 16), np.float32)
        for x, name in ((k, "k"), (v, "v")):
            pool = pages.copy()
            pool[order] = np.asarray(x).reshape(4, 5, 8, 4, 16).reshape(20, 8, 4, 16)
            if name == "k":
                k_pages = jnp.asarray(pool)
            else:
                v_pages = jnp.asarray(pool)
        return q, k, v, lengths, k_pages, v_pages, tables

    def _decode_calls(**kwargs):
        sinks = jnp.asarray(SINKS)
        contiguous = functools.partial(
            pallas_flash.decode_attention, sinks=sinks, return_residuals=True, **kwargs
        )
        paged = functools.partial(
            pallas_flash.paged_attention, sinks=sinks, return_residuals=True, **kwargs
        )
        return (
            lambda q, k, v, lengths: contiguous(q, k, v, key_value_seq_lengths=lengths),
            paged,
        )

    @pytest.mark.parametrize("heads_only", [False, True])
    def test_decode_sharding_runs_locally(heads_only):
        """decode_attention and paged_attention under jit with the queries and the cache sharded
        over batch and heads (a paged pool over heads only; its tables and the lengths over the
        batch), or over heads only (tensor parallel): each device reads its own sequences'
        and heads' keys, with no collective (the cache is never gathered), and the results
        keep their sharding and match the unsharded reference."""
        q, k, v, lengths, k_pages, v_pages, tables = _decode_problem()
        mesh = auto_mesh((2, 4), ("data", "model"))
        batch = None if heads_only else "data"
        heads = NamedSharding(mesh, P(batch, None, "model", None))
        pool = NamedSharding(mesh, P(None, None, "model", None))
        rows = NamedSharding(mesh, P(batch))
        contiguous, paged = _decode_calls(**INTERPRET)
        ref_contiguous, ref_paged = _decode_calls(backend="xla")
        cases = (
            (contiguous, ref_contiguous, (q, k, v, lengths), (heads, heads, heads, rows)),
            (
                paged,
                ref_paged,
                (q, k_pages, v_pages, tables, lengths),
                (heads, pool, pool, NamedSharding(mesh, P(batch, None)), rows),
            ),
        )
        for call, reference, args, shardings in cases:
            sharded = jax.jit(call, in_shardings=shardings)
            assert not hlo_collectives(sharded.lower(*args).compile().as_text())
            out, lse = sharded(*args)
            assert out.sharding.is_equivalent_to(heads, out.ndim), out.sharding
            assert_close((out, lse), jax.jit(reference)(*args), atol=1e-5)

    def test_few_token_flash_attention_sharding_runs_locally():
        """flash_attention of 3 tokens over 100 keys (bfloat16: the default dispatch runs its
        forward on the decode kernel, `dispatch.few_tokens_on_decode`, in the interpreter too)
        sharded over batch and heads, with key lengths and sinks: forward and backward hold no
        collective but the loss's scalar sums, and match the unsharded reference."""
        q, k, v, d_out = (x.astype(jnp.bfloat16) for x in qkv_inputs(4, 3, 100, 8, 4))
        lengths = jnp.asarray([100, 0, 37, 3], jnp.int32)
        mesh = auto_mesh((2, 4), ("data", "model"))
        qkv = NamedSharding(mesh, P("data", None, "model", None))

        def fn(**kwargs):
            attn = functools.partial(
                pallas_flash.flash_attention,
                key_value_seq_lengths=lengths,
                sinks=jnp.asarray(SINKS),
                return_residuals=True,
                **kwargs,
            )
            return jax.value_and_grad(weighted_loss(attn, d_out), argnums=(0, 1, 2))

        routed = fn(interpret=True)
        assert "pallas_flash_decode" in str(jax.make_jaxpr(routed)(q, k, v))
        sharded = jax.jit(routed, in_shardings=(qkv,) * 3)
        collectives = hlo_collectives(sharded.lower(q, k, v).compile().as_text())
        assert all(kind == "all-reduce" for kind, _ in collectives), collectives
        assert not re.findall(r"\[[0-9]", " ".join(s for _, s in collectives)), collectives
        value, grads = sharded(q, k, v)
        assert grads[0].sharding.is_equivalent_to(qkv, 4)
        assert_close((value, grads), jax.jit(fn(backend="xla"))(q, k, v), atol=6e-2)

    def test_vmapped_decode_stays_partitioned():
        """decode_attention under jax.vmap with lengths shared by the mapped calls: the mapped
        axis folds into the batch (the lengths broadcast along it), and nothing is gathered."""
        q, k, v, lengths, *_ = _decode_problem()
        q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v))
        lengths = jnp.minimum(lengths[:2], lengths[2:])  # within both mapped calls' keys
        contiguous, _ = _decode_calls(**INTERPRET)
        ref_contiguous, _ = _decode_calls(backend="xla")
        mesh = auto_mesh((2, 4), ("data", "model"))
        spec = NamedSharding(mesh, P(None, "data", None, "model", None))
        mapped = jax.vmap(contiguous, in_axes=(0, 0, 0, None))
        sharded = jax.jit(mapped, in_shardings=(spec, spec, spec, None))
        assert not hlo_collectives(sharded.lower(q, k, v, lengths).compile().as_text())
        want = jax.vmap(ref_contiguous, in_axes=(0, 0, 0, None))(q, k, v, lengths)
        assert_close(sharded(q, k, v, lengths), want, atol=1e-5)

    def test_float8_and_latent_decode_sharding_runs_locally():
        """paged_attention over float8_e4m3fn pages with per-head scales sharded over the heads
        (each device's scales with its KV heads), and decode_attention over a shared latent
        cache (values its keys' first 8 columns; one KV head, whose query heads Shardy sees as
        one factor) sharded over the batch: no collective, the reference's results."""
        q, k, v, lengths, k_pages, v_pages, tables = _decode_problem()
        scales = jnp.asarray([0.05, 0.1, 0.2, 0.4], jnp.float32)
        k8 = (k_pages / scales[:, None]).astype(jnp.float8_e4m3fn)
        v8 = (v_pages / scales[::-1, None]).astype(jnp.float8_e4m3fn)
        mesh = auto_mesh((2, 4), ("data", "model"))
        heads = NamedSharding(mesh, P("data", None, "model", None))
        pool = NamedSharding(mesh, P(None, None, "model", None))
        per_head = NamedSharding(mesh, P("model"))

        def paged(q, k, v, tables, lengths, k_scale, v_scale, **kw):
            return pallas_flash.paged_attention(
                q, k, v, tables, lengths, k_scale=k_scale, v_scale=v_scale, **kw
            )

        args = (q, k8, v8, tables, lengths, scales, scales[::-1])
        shardings = (heads, pool, pool, NamedSharding(mesh, P("data", None)))
        shardings += (NamedSharding(mesh, P("data")), per_head, per_head)
        sharded = jax.jit(functools.partial(paged, **INTERPRET), in_shardings=shardings)
        assert not hlo_collectives(sharded.lower(*args).compile().as_text())
        want = jax.jit(functools.partial(paged, backend="xla"))(*args)
        assert_close(sharded(*args), want, atol=1e-5)

        def latent(q, cache, lengths, **kw):
            return pallas_flash.decode_attention(
                q, cache, None, key_value_seq_lengths=lengths, value_head_dim=8, **kw
            )

        cache = jnp.nan_to_num(k[:, :, :1])  # [4, 40, 1, 16]
        batch = NamedSharding(mesh, P("data"))
        sharded = jax.jit(functools.partial(latent, **INTERPRET), in_shardings=(batch,) * 3)
        assert not hlo_collectives(sharded.lower(q, cache, lengths).compile().as_text())
        want = jax.jit(functools.partial(latent, backend="xla"))(q, cache, lengths)
        assert_close(sharded(q, cache, lengths), want, atol=1e-5)

    def test_decode_on_explicit_axes():
        """The same calls on arrays placed on a mesh of Explicit axes (sharding in types)."""
        q, k, v, lengths, k_pages, v_pages, tables = _decode_problem()
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        heads = NamedSharding(mesh, P("data", None, "model", None))
        rows = NamedSharding(mesh, P("data"))
        pool = NamedSharding(mesh, P(None, None, "model", None))
        contiguous, paged = _decode_calls(**INTERPRET)
        ref_contiguous, ref_paged = _decode_calls(backend="xla")
        placed = [jax.device_put(x, s) for x, s in zip((q, k, v, lengths), (heads,) * 3 + (rows,))]
        got = jax.jit(contiguous)(*placed)
        assert got[0].sharding.is_equivalent_to(heads, 4), got[0].sharding
        assert_close(got, jax.jit(ref_contiguous)(q, k, v, lengths), atol=1e-5)
        args = (q, k_pages, v_pages, tables, lengths)
        table_rows = NamedSharding(mesh, P("data", None))
        placed = [jax.device_put(x, s) for x, s in zip(args, (heads, pool, pool, table_rows, rows))]
        assert_close(jax.jit(paged)(*placed), jax.jit(ref_paged)(*args), atol=1e-5)

    @pytest.mark.parametrize(
        "explicit, window, dtype",
        [
            (False, None, jnp.float32),
            (True, None, jnp.float32),
            (False, 7, jnp.float32),
            (False, None, jnp.bfloat16),
        ],
        ids=["auto", "explicit", "window", "bf16"],
    )
    def test_decode_over_a_cache_split_over_its_sequence(explicit, window, dtype):
        """A contiguous cache split over its sequence (4 devices, 10 slots each) and its batch,
        two new tokens: each device reads the slots it holds of each sequence, the tokens
        placed ahead of them where the sequence goes on (sequences of 40, 45 (past the
        capacity: clipped to 40, as on one device), 23 and 0 keys: some devices hold none of
        one, 23 ends inside a slice; a window of 7 leaves the early slices unseen), and the
        parts merge by their denominators (float32 partial outputs) with only the rows' lse
        and log_sum gathered and the outputs summed: the cache is never gathered. Values as
        the unsharded reference's, sinks included."""
        q, k, v, lengths, *_ = _decode_problem()
        lengths = lengths.at[1].set(45).at[3].set(0)
        k, v = k.at[1].set(k[0]), v.at[1].set(v[0])  # sequence 1's keys all finite
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        atol = 1e-5 if dtype == jnp.float32 else 2e-2
        contiguous, _ = _decode_calls(local_window_size=window, **INTERPRET)
        ref_contiguous, _ = _decode_calls(local_window_size=window, backend="xla")
        axis_type = AxisType.Explicit if explicit else AxisType.Auto
        mesh = jax.make_mesh((2, 4), ("data", "context"), (axis_type,) * 2)
        shardings = [
            NamedSharding(mesh, P("data")),
            NamedSharding(mesh, P("data", "context")),
            NamedSharding(mesh, P("data", "context")),
            NamedSharding(mesh, P("data")),
        ]
        want = jax.jit(ref_contiguous)(q, k, v, lengths)
        if explicit:
            placed = [jax.device_put(x, s) for x, s in zip((q, k, v, lengths), shardings)]
            assert_close(jax.jit(contiguous)(*placed), want, atol=atol)
            return
        sharded = jax.jit(contiguous, in_shardings=shardings)
        collectives = hlo_collectives(sharded.lower(q, k, v, lengths).compile().as_text())
        assert all(not re.search(r"\[\d+,\d+,4,16\]|,40,", s) for _, s in collectives), collectives
        assert {kind for kind, _ in collectives} <= {"all-gather", "all-reduce"}, collectives
        assert_close(sharded(q, k, v, lengths), want, atol=atol)

    def test_decode_over_a_sequence_split_where_new_tokens_straddle_two_devices():
        """Four new tokens of sequences whose last keys cross a slice boundary (lengths 12 and
        21 over slices of 10: tokens at 8-11 and 17-20), so that two devices each hold some of
        the tokens' own keys: every token sees exactly the keys at or before it."""
        q, k, v, _ = qkv_inputs(2, 4, 40, 8, 4, seed=9)
        lengths = jnp.asarray([12, 21], jnp.int32)
        contiguous, _ = _decode_calls(**INTERPRET)
        ref_contiguous, _ = _decode_calls(backend="xla")
        mesh = auto_mesh((4, 2), ("context", "model"))
        shardings = [
            NamedSharding(mesh, P(None, None, "model")),
            NamedSharding(mesh, P(None, "context", "model")),
            NamedSharding(mesh, P(None, "context", "model")),
            NamedSharding(mesh, P()),
        ]
        got = jax.jit(contiguous, in_shardings=shardings)(q, k, v, lengths)
        assert_close(got, jax.jit(ref_contiguous)(q, k, v, lengths), atol=1e-5)

    def test_paged_pool_sharded_over_its_pages_is_refused():
        """The pool is shared by every sequence: sharding it over its pages axis raises a
        ValueError naming that axis, never a gather."""
        q, _, _, lengths, k_pages, v_pages, tables = _decode_problem()
        _, paged = _decode_calls(**INTERPRET)
        mesh = auto_mesh((2, 4), ("data", "model"))
        by_pages = NamedSharding(mesh, P("data", None, "model", None))
        shardings = (
            NamedSharding(mesh, P("data", None, "model", None)),
            by_pages,
            by_pages,
            NamedSharding(mesh, P("data", None)),
            NamedSharding(mesh, P("data")),
        )
        with pytest.raises(Exception, match="key_pages is sharded over its pages axis"):
            jax.jit(paged, in_shardings=shardings).lower(
                q, k_pages, v_pages, tables, lengths
            ).compile()
