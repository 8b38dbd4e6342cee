"""pallas_flash.nnx against Flax's own attention: drop-in function and module subclass.

Everything runs the Triton kernels in the Pallas interpreter (CPU), in float32, and is compared
with flax.nnx's default `dot_product_attention` on the same parameters. Each jitted call with
the kernels costs seconds to compile, so each test compiles one function that returns outputs
and gradients together.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from support.backends import SWEEP_ONLY
from support.flax_layers import (
    FEATURES,
    HEADS,
    KERNELS,
    B,
    T,
    assert_close,
    inputs,
    recording_deterministic_grads,
    reference_dropout_attention,
    segment_ids,
    sink_attention,
)

import pallas_flash.nnx as pfn
from pallas_flash import flax_common

KV_HEADS = 2


def same_params(ours, ref):
    """`ours` with `ref`'s parameters (both modules have the same parameter structure)."""
    nnx.update(ours, nnx.state(ref, nnx.Param))
    return ours


def out_and_grads(model, x, weights, **call_kwargs):
    """Jitted (out, grads of sum(out * weights) w.r.t. the parameters): a random cotangent."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params):
        def loss(params):
            out = nnx.merge(graphdef, params, rest)(x, **call_kwargs)
            return jnp.sum(out * weights), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return out, grads

    return run(params)


def flax_module(**kwargs):
    kwargs = {"decode": False, "rngs": nnx.Rngs(0), **kwargs}
    return nnx.MultiHeadAttention(HEADS, FEATURES, **kwargs)


# -- the drop-in function in Flax's own module ----------------------------------------------------


def test_dropin_function_in_flax_module():
    """is_causal and a float padding mask, as Flax's module passes them, through the kernels."""
    x = inputs()
    ref = flax_module()
    attention_fn = functools.partial(pfn.dot_product_attention, **KERNELS)
    ours = same_params(flax_module(attention_fn=attention_fn, rngs=nnx.Rngs(5)), ref)
    valid = (jnp.arange(T)[None] < jnp.array([T, 23])[:, None]).astype(jnp.float32)
    mask = nnx.make_attention_mask(valid, valid)  # float32 [B, 1, T, T]
    rows = valid[..., None]
    # Padded query rows see no key: Flax averages all values there, pallas_flash outputs 0.
    # Compare the rows that see keys; the cotangent is zero on the others.
    weights = inputs(2) * rows
    # input_positions (forwarded by the module when given) does not change plain attention.
    out, grads = out_and_grads(
        ours, x, weights, mask=mask, is_causal=True, input_positions=jnp.arange(T)
    )
    ref_out, ref_grads = out_and_grads(ref, x, weights, mask=mask, is_causal=True)
    assert_close(out * rows, ref_out * rows)
    assert_close(grads, ref_grads)
    np.testing.assert_array_equal(out[1, 23:], 0.0)  # zero attention output, zero out bias


# -- the module subclass --------------------------------------------------------------------------


def test_module_gqa_causal_segments_matches_flax():
    """num_kv_heads < num_heads, is_causal from the constructor, segment ids at call time."""
    x = inputs()
    ref = flax_module(num_kv_heads=KV_HEADS)
    ours = pfn.MultiHeadAttention(
        HEADS,
        FEATURES,
        num_kv_heads=KV_HEADS,
        is_causal=True,
        decode=False,
        rngs=nnx.Rngs(5),
        **KERNELS,
    )
    ours = same_params(ours, ref)
    assert ours.key.kernel.shape == (FEATURES, KV_HEADS, FEATURES // HEADS)
    ids = segment_ids()
    mask = nnx.make_attention_mask(ids, ids, jnp.equal)
    weights = inputs(2)
    out, grads = out_and_grads(ours, x, weights, q_segment_ids=ids)
    ref_out, ref_grads = out_and_grads(ref, x, weights, mask=mask, is_causal=True)
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)


def test_decode_with_cache_gqa(monkeypatch):
    """Decoding token by token with the (GQA) cache runs the decode kernel over the filled
    slots, and equals Flax's own decode steps token for token and the full causal pass."""
    steps = 12
    x = inputs(shape=(B, steps, FEATURES))
    ref = flax_module(num_kv_heads=KV_HEADS)
    ours = pfn.MultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=KV_HEADS, is_causal=True, rngs=nnx.Rngs(5), **KERNELS
    )
    ours = same_params(ours, ref)
    decode_calls = []
    original = flax_common.decode_attention

    def spy(*args, **kwargs):
        decode_calls.append(kwargs["key_value_seq_lengths"])
        return original(*args, **kwargs)

    monkeypatch.setattr(flax_common, "decode_attention", spy)
    ours.init_cache((B, steps, FEATURES))
    assert ours.cached_key.shape == (B, steps, KV_HEADS, FEATURES // HEADS)
    step = nnx.jit(lambda model, token: model(token, decode=True))
    outs = [step(ours, x[:, i : i + 1]) for i in range(steps)]
    assert len(decode_calls) == 1  # traced once: every step ran the decode kernel
    assert int(ours.cache_index[...]) == steps
    ref.init_cache((B, steps, FEATURES))
    flax_outs = [step(ref, x[:, i : i + 1]) for i in range(steps)]
    for ours_i, flax_i in zip(outs, flax_outs, strict=True):
        assert_close(ours_i, flax_i)
    assert_close(jnp.concatenate(outs, axis=1), ref(x, is_causal=True, decode=False))


def test_dropout_runs_in_the_kernels():
    x = inputs()
    ref = flax_module(dropout_rate=0.5, attention_fn=reference_dropout_attention)
    ours = same_params(
        pfn.MultiHeadAttention(
            HEADS,
            FEATURES,
            dropout_rate=0.5,
            is_causal=True,
            decode=False,
            rngs=nnx.Rngs(5),
            **KERNELS,
        ),
        ref,
    )
    # No FallbackWarning (pytest turns warnings into errors).
    dropped = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    assert_close(dropped, ref(x, deterministic=False, rngs=nnx.Rngs(dropout=7)))
    kept = ours(x, deterministic=True)
    assert_close(kept, ref(x, deterministic=True))
    assert np.abs(np.asarray(dropped - kept)).max() > 1e-2
    other = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=8))
    assert np.abs(np.asarray(dropped - other)).max() > 1e-2


def test_sow_weights_takes_flax_path(fresh_warnings):
    x = inputs()
    ours = pfn.MultiHeadAttention(HEADS, FEATURES, is_causal=True, decode=False, rngs=nnx.Rngs(0))
    forward = nnx.capture(lambda model, x: model(x, sow_weights=True), nnx.Intermediate)
    with pytest.warns(pfn.FallbackWarning, match="sow"):
        out, intermediates = forward(ours, x)
    (weights,) = intermediates["attention_weights"].get_value()
    assert weights.shape == (B, HEADS, T, T)
    np.testing.assert_allclose(np.triu(np.asarray(weights), k=1), 0.0)
    assert_close(out, flax_module()(x, is_causal=True))


# -- the function on its own ----------------------------------------------------------------------


@SWEEP_ONLY
def test_function_gqa_against_repeated_kv():
    """K = N / 2 kv heads, causal, with a per-head bool mask: equals Flax on repeated kv heads."""
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (2, 24, 4, 16))
    k = jax.random.normal(keys[1], (2, 24, 2, 16))
    v = jax.random.normal(keys[2], (2, 24, 2, 16))
    mask = jax.random.bernoulli(keys[3], 0.7, (2, 4, 24, 24)).at[..., 0].set(True)
    ct = jax.random.normal(keys[4], q.shape)

    def grads_of(fn):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, mask=mask, is_causal=True) * ct)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def repeated_kv(q, k, v, **kwargs):  # query head n reads kv head n // 2
        return nnx.dot_product_attention(
            q, jnp.repeat(k, 2, axis=-2), jnp.repeat(v, 2, axis=-2), **kwargs
        )

    assert_close(
        grads_of(functools.partial(pfn.dot_product_attention, **KERNELS)), grads_of(repeated_kv)
    )


def test_function_errors():
    q = jnp.ones((1, 8, 2, 8))
    xla = functools.partial(pfn.dot_product_attention, backend="xla")
    with pytest.raises(NotImplementedError, match="precision"):
        xla(q, q, q, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    with pytest.raises(ValueError, match="dropout_rate"):
        xla(q, q, q, dropout_rate=1.5, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dropout_rng is required"):
        xla(q, q, q, dropout_rate=0.1)
    assert xla(q, q, q, precision="highest", dtype=jnp.bfloat16).dtype == jnp.bfloat16
    # deterministic_grads=False reaches the attention function; True (the default) is not
    # bound, so an attention_fn without the keyword still works.
    recording, seen = recording_deterministic_grads(xla)
    x = jnp.ones((1, 8, 16))
    for flag in (False, True):
        pfn.MultiHeadAttention(
            2, 16, attention_fn=recording, deterministic_grads=flag, decode=False, rngs=nnx.Rngs(0)
        )(x)
    assert seen == [False, True]
    # A custom attention_fn that cannot take the module's options is refused, not ignored.
    module = pfn.MultiHeadAttention(
        2, 16, attention_fn=nnx.dot_product_attention, decode=False, rngs=nnx.Rngs(0)
    )
    with pytest.raises(TypeError, match="q_segment_ids"):
        module(jnp.ones((1, 8, 16)), q_segment_ids=jnp.zeros((1, 8), jnp.int32))


# -- training ------------------------------------------------------------------------------------


class TinyLM(nnx.Module):
    """Embedding, one pre-norm causal GQA attention block, logits."""

    def __init__(self, vocab, pallas, rngs):
        self.embed = nnx.Embed(vocab, FEATURES, rngs=rngs)
        self.norm = nnx.LayerNorm(FEATURES, rngs=rngs)
        cls, extra = (pfn.MultiHeadAttention, KERNELS) if pallas else (nnx.MultiHeadAttention, {})
        self.attn = cls(HEADS, FEATURES, num_kv_heads=KV_HEADS, decode=False, rngs=rngs, **extra)
        self.head = nnx.Linear(FEATURES, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.attn(self.norm(x), is_causal=True))


def test_training_step_matches_flax():
    vocab, steps = 16, 4
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, vocab)
    inputs_, targets = tokens[:, :-1], tokens[:, 1:]

    def train(pallas):
        model = TinyLM(vocab, pallas, nnx.Rngs(1))  # same seed: same initial parameters
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            def loss_fn(model):
                logits = model(inputs_)
                return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        return [float(step(model, optimizer)) for _ in range(steps)]

    ours, ref = train(True), train(False)
    assert ref[-1] < ref[0]  # the model learns, so equal losses mean equal training
    np.testing.assert_allclose(ours, ref, rtol=5e-5)


def test_attention_sinks_parameter():
    """attention_sinks=True adds a learned `sinks` [num_heads] parameter: the module equals
    Flax's with a sink-column softmax, the sinks get gradients, decode steps use them too,
    and they combine with the kernels' dropout."""
    x = inputs(shape=(B, 12, FEATURES))
    ours = pfn.MultiHeadAttention(
        HEADS, FEATURES, is_causal=True, attention_sinks=True, decode=False, rngs=nnx.Rngs(0)
    )
    assert ours.sinks[...].shape == (HEADS,) and not ours.sinks[...].any()
    ours.sinks[...] = jnp.linspace(-1.0, 2.0, HEADS)
    ref = same_params(
        flax_module(attention_fn=sink_attention(ours.sinks[...], is_causal=True)),
        nnx.merge(*nnx.split(ours)),
    )
    weights = inputs(seed=3, shape=(B, 12, FEATURES))
    out, grads = out_and_grads(ours, x, weights)
    assert_close(out, ref(x))
    assert np.abs(np.asarray(grads["sinks"][...])).min() > 0
    ours.init_cache((B, 12, FEATURES))
    step = nnx.jit(lambda model, token: model(token, decode=True))
    steps = [step(ours, x[:, i : i + 1]) for i in range(12)]
    assert_close(jnp.concatenate(steps, axis=1), out)
    dropping = pfn.MultiHeadAttention(
        HEADS, FEATURES, attention_sinks=True, dropout_rate=0.5, decode=False, rngs=nnx.Rngs(0)
    )
    dropping.sinks[...] = ours.sinks[...]
    dropped = dropping(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
    assert np.isfinite(np.asarray(dropped)).all()
    assert np.abs(np.asarray(dropped - dropping(x, deterministic=True))).max() > 1e-2
