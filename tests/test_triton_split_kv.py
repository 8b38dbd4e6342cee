"""Split-KV forward (BlockSizes.kv_splits): the KV loop of each query tile shared by several
programs and combined by logsumexp. Against the reference in interpret mode (and compiled, on a
GPU), and lowered for an abstract H200."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.backends import SWEEP_ONLY
from support.inputs import uniform_block_sizes

import pallas_flash
from pallas_flash.triton.forward import choose_kv_splits

TILES = uniform_block_sizes(16)


def inputs(b, t, s, n, k, h, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h))
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(is_causal=True),
        # Row 1 of batch 1 sees no key at all; other rows see keys in some chunks only.
        dict(key_value_seq_lengths=np.array([100, 0]), is_causal=True),
        dict(local_window_size=(20, 3)),
    ],
    ids=["full", "causal", "lengths", "window"],
)
@pytest.mark.parametrize("splits", [2, pytest.param(3, marks=SWEEP_ONLY), 7])
@pytest.mark.ci_slice(4)
def test_split_forward_matches_reference(splits, kwargs, mode):
    q, k, v = inputs(2, 33, 100, 4, 2, 32)
    kwargs = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in kwargs.items()}
    bs = dataclasses.replace(TILES, kv_splits=splits)

    @jax.jit
    def both(q, k, v):
        ours = pallas_flash.flash_attention(
            q,
            k,
            v,
            return_residuals=True,
            backend="triton",
            interpret=mode == "interpret",
            block_sizes=bs,
            **kwargs,
        )
        ref = pallas_flash.attention_reference(q, k, v, return_residuals=True, **kwargs)
        return ours, ref

    (out, lse), (ref_out, ref_lse) = both(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-5)
    assert np.all(np.isfinite(out))


def test_split_forward_gradients_match_unsplit():
    q, k, v = inputs(1, 20, 70, 2, 1, 16, seed=1)

    def grads(splits):
        bs = dataclasses.replace(TILES, kv_splits=splits)
        loss = lambda *a: jnp.sum(  # noqa: E731
            pallas_flash.flash_attention(*a, is_causal=True, interpret=True, block_sizes=bs) ** 2
        )
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for a, b in zip(grads(3), grads(1)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_choose_kv_splits():
    assert choose_kv_splits(1, 4, 100, interpret=False, num_sms=132) == 1  # off when asked
    assert (
        choose_kv_splits(5, 4, 3, interpret=False, num_sms=132) == 3
    )  # never more than the KV tiles
    assert (
        choose_kv_splits(0, 4, 100, interpret=True, num_sms=132) == 1
    )  # auto: off in the interpreter
    assert (
        choose_kv_splits(0, 10_000, 100, interpret=False, num_sms=132) == 1
    )  # a full grid needs none


def test_kv_splits_validation():
    with pytest.raises(ValueError, match="kv_splits=-1"):
        pallas_flash.BlockSizes(kv_splits=-1)


def test_split_forward_lowers_for_h200():
    from support.lowering import lower_for_h200

    from pallas_flash._passes import KernelConfig
    from pallas_flash._vjp import flash_attention_kernels
    from pallas_flash.masks import MaskArrays, MaskSpec
    from pallas_flash.triton.tiles import heuristic_block_sizes

    bs = dataclasses.replace(heuristic_block_sizes(128, jnp.bfloat16), kv_splits=4)
    config = KernelConfig(
        spec=MaskSpec(q_len=64, kv_len=4096, is_causal=True),
        scale=0.1,
        block_sizes=bs,
        interpret=False,
    )
    q = jax.ShapeDtypeStruct((2, 64, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 4096, 2, 128), jnp.bfloat16)
    text = lower_for_h200(
        lambda q, k, v: flash_attention_kernels(q, k, v, None, MaskArrays(), config), q, kv, kv
    ).as_text()
    assert "grid_z = 8 : i32" in text  # batch 2 x 4 splits


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.ci_slice(1)
def test_split_log_sum_and_row_max_match_unsplit(sinks):
    """The log of each row's softmax denominator (relative to its largest logit, sinks
    included) and that largest logit in the kernel's units, which the forward hands the
    backward: the split chunks' merge gives the unsplit kernel's (the row max exactly), also for
    chunks that see no key or rows that see keys in some chunks only; row max * unit + log_sum
    is lse."""
    from pallas_flash import masks
    from pallas_flash._passes import KernelConfig
    from pallas_flash.masks import MaskArrays, MaskSpec
    from pallas_flash.triton import flash_forward

    # 4 KV tiles in chunks of 2: the third split sees no key.
    q, k, v = inputs(2, 17, 64, 4, 2, 32, seed=3)
    q = q * 3.0  # peaked rows: the sink and the chunks' maxima differ by more than their sums
    lengths = jnp.asarray([64, 20], jnp.int32)
    spec = MaskSpec(q_len=17, kv_len=64, is_causal=True, has_segments=True)
    arrays = MaskArrays(
        q_segment_ids=jnp.zeros((2, 17), jnp.int32),
        kv_segment_ids=jnp.where(jnp.arange(64) < lengths[:, None], 0, masks.PAD_KV_SEGMENT),
    )
    sink_logits = jnp.asarray(np.linspace(-2.0, 4.0, 8).reshape(2, 4), jnp.float32)

    scale = 32**-0.5

    def rows(splits):
        config = KernelConfig(
            spec=spec,
            scale=scale,
            block_sizes=dataclasses.replace(TILES, kv_splits=splits),
            interpret=True,
        )
        sink_args = sink_logits if sinks else None
        _, lse, log_sum, row_max = flash_forward(
            q, k, v, None, arrays, sink_args, config=config, with_log_sum=True, with_row_max=True
        )
        return [np.asarray(x) for x in (lse, log_sum, row_max)]

    (lse, log_sum, row_max), split = rows(1), rows(3)
    assert np.all(log_sum >= 0) and np.any(log_sum > 0.5)
    np.testing.assert_allclose(split[1], log_sum, atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(split[2], row_max)
    np.testing.assert_allclose(row_max * scale + log_sum, lse, rtol=1e-6)
