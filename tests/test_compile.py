"""Compile time of models that repeat a layer: each distinct kernel is lowered once.

A model written as a Python loop over its layers calls flash_attention once per layer. If every
call site lowered its own kernels, lowering and compile time would grow with the depth (about 5 s
per layer on the H200 with the Mosaic kernels, whose modules then also differ by a per-module name
and so miss the GPU's kernel cache). These tests lower 1- and 6-layer models for an abstract H200
(and through the public API in the interpreter) and check that the deeper one carries each kernel
exactly once.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from support.lowering import H200, lower_for_h200

import pallas_flash
from pallas_flash import _partition, _passes
from pallas_flash._passes import KernelConfig
from pallas_flash._vjp import flash_attention_kernels
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import BackwardTiles
from pallas_flash.triton.tiles import heuristic_block_sizes

B, T, N, H = 1, 256, 2, 64


def layered_grad(attention, layers):
    """grad of a loss over `layers` calls of attention(q, k, v, ids), each on its own inputs."""

    def loss(qkvs, ids):
        return sum(attention(q, k, v, ids).astype(jnp.float32).sum() for q, k, v in qkvs)

    return jax.grad(loss)


def kernel_attention(config: KernelConfig):
    def attention(q, k, v, ids):
        arrays = MaskArrays(ids, ids) if config.spec.has_segments else MaskArrays()
        return flash_attention_kernels(q, k, v, None, arrays, config)[0]

    return attention


def config(forward, backward, **spec):
    return KernelConfig(
        spec=MaskSpec(q_len=T, kv_len=T, **spec),
        scale=H**-0.5,
        block_sizes=heuristic_block_sizes(H, jnp.bfloat16),
        interpret=False,
        forward=forward,
        backward=backward,
    )


def custom_calls(layers, attention) -> Counter:
    """(target, kernel hash or Triton kernel name) -> count in the lowered module."""
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
        text = lower_for_h200(layered_grad(attention, layers), [(x, x, x)] * layers, ids).as_text()
    text = re.sub(r'(ir|module) = "[^"]*"', r"\1 = ...", text)  # the serialised kernels
    calls = Counter()
    for line in text.splitlines():  # one custom call per line; hashes may hold any character
        if call := re.search(r"custom_call @([\w$.]+)\(", line):
            key = re.search(r'kernel_hash = "[^"]*"|name = "\w+"', line)
            calls[call.group(1), key.group(0) if key else ""] += 1
    return calls


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(config("mosaic", "mosaic", is_causal=True), id="mosaic-causal"),
        pytest.param(config("triton", "triton", is_causal=True), id="triton-causal"),
        pytest.param(
            config("mosaic", "triton", is_causal=True, window=(64, 0), has_segments=True),
            id="mosaic-fwd-masked",
        ),
    ],
)
@pytest.mark.ci_slice(2)
def test_repeated_layers_lower_each_kernel_once(kernels):
    one, six = (
        custom_calls(1, kernel_attention(kernels)),
        custom_calls(6, kernel_attention(kernels)),
    )
    assert one and all(key for _, key in one), f"the pattern no longer matches the lowering: {one}"
    # Two lowerings of a kernel give the same module (see the test below): the 6-layer module
    # carries the 1-layer module's kernels, each once.
    assert six == one


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(config("mosaic", "mosaic", is_causal=True), id="mosaic-causal"),
        pytest.param(config("mosaic", "mosaic"), id="mosaic"),
    ],
)
@pytest.mark.ci_slice(1)
def test_a_kernel_lowered_twice_is_the_same_module(kernels):
    """jax's SPMD partitioner lowers a custom_partitioning rule's function at every call site
    (batch/head sharding under jit's automatic sharding): each lowering of a Mosaic kernel must
    give the same module, so that the GPU compiles it once (Mosaic numbers unnamed modules)."""
    attention = kernel_attention(kernels)
    first = custom_calls(1, attention)
    again = custom_calls(1, lambda q, k, v, ids: attention(q, k, v, ids) * 2)
    hashes = [key for (target, key) in first if target.startswith("mosaic")]
    assert len(hashes) == 3, first  # forward, dK/dV and dQ
    assert first == again


def test_repeated_layers_through_the_api_share_their_kernel_functions():
    """Through flash_attention (interpreted Triton kernels, masks built per call): one private
    function per pass, called once per layer."""

    def attention(q, k, v, ids):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=True, q_segment_ids=ids, interpret=True
        )

    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    text = jax.jit(layered_grad(attention, 6)).trace([(x, x, x)] * 6, ids).lower().as_text()
    defined = Counter(re.findall(r"func\.func private @(_forward|_backward)\w*\(", text))
    called = Counter(re.findall(r"call @(_forward|_backward)\w*\(", text))
    assert defined == {"_forward": 1, "_backward": 1}
    assert called == {"_forward": 6, "_backward": 6}


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(config("mosaic", "mosaic", is_causal=True), id="mosaic-causal"),
        pytest.param(
            dataclasses.replace(
                config("mosaic", "mosaic", is_causal=True),
                mosaic_backward_tiles=BackwardTiles(fused_dq="fixed"),
            ),
            id="mosaic-fixed-dq",
        ),
        pytest.param(config("triton", "triton", is_causal=True), id="triton-causal"),
    ],
)
def test_partitioned_passes_export_for_the_gpu(kernels):
    """Under jit's automatic sharding each device's pass goes through jax.export once per shard
    shape (`_partition._exported`), so every custom call the GPU kernels make must pass export's
    checks: Mosaic GPU's and lax.empty's are stable targets, Triton's is allowed by name. The
    forward and backward of one shard, exported for CUDA (lowered for an abstract H200), carry
    their kernels; a second request returns the first module."""
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
    passes = {
        _passes.forward: [x, x, x, None, MaskArrays(), None],
        _passes.backward: [x, x, x, None, MaskArrays(), None, x, rows, rows, rows, x, rows],
    }
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    for kernel, args in passes.items():
        leaves, tree = jax.tree.flatten(args)
        avals = tuple((tuple(a.shape), a.dtype) for a in leaves)
        with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
            exported = _partition._exported(kernel, kernels, tree, avals, "cuda")
            assert _partition._exported(kernel, kernels, tree, avals, "cuda") is exported
        targets = Counter(re.findall(r"custom_call @([\w$.]+)\(", exported.mlir_module()))
        if kernels.forward == "mosaic":
            want = 1 if kernel is _passes.forward else 2  # dK/dV and dQ, or the fused one
            if kernel is _passes.backward and kernels.mosaic_backward_tiles:
                want = 1
            assert targets["mosaic_gpu_v2"] == want, targets
        else:
            assert targets["__gpu$xla.gpu.triton"] >= 1, targets
