"""pallas_flash.linen against Flax's own attention: drop-in function and module subclass.

Everything runs the Triton kernels in the Pallas interpreter (CPU), in float32, and is compared
with flax.linen's default `dot_product_attention` on the same variables. Each jitted call with
the kernels costs seconds to compile, so each test compiles one function that returns outputs
and gradients together.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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

import pallas_flash.linen as pfl
from pallas_flash import flax_common


def loss_and_grads(module, variables, x, weights, **call_kwargs):
    """Jitted (out, grads of sum(out * weights) w.r.t. params): a random cotangent."""

    @jax.jit
    def run(params, x, weights, call_kwargs):
        def loss(params):
            out = module.apply({"params": params}, x, **call_kwargs)
            return jnp.sum(out * weights), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return out, grads

    return run(variables["params"], x, weights, call_kwargs)


def flax_module(**kwargs):
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, **kwargs)


# -- the drop-in function in Flax's own module ----------------------------------------------------


@pytest.mark.parametrize("case", [pytest.param("causal_mask", marks=SWEEP_ONLY), "padding_mask"])
def test_dropin_function_in_flax_module(case):
    """A float Flax mask reaches the kernels' mask path (linen passes only named keywords)."""
    x = inputs()
    ref = flax_module()
    ours = flax_module(attention_fn=functools.partial(pfl.dot_product_attention, **KERNELS))
    variables = ref.init(jax.random.key(1), x)
    weights = inputs(2, (B, T, FEATURES))
    if case == "causal_mask":
        mask = nn.make_causal_mask(jnp.ones((B, T)))  # float32 [B, 1, T, T]
        rows = jnp.ones((B, T, 1))
    else:
        # Padded queries and keys: row b has 40 and 23 valid positions.
        valid = (jnp.arange(T)[None] < jnp.array([T, 23])[:, None]).astype(jnp.float32)
        mask = nn.make_attention_mask(valid, valid)  # float32 [B, 1, T, T]
        rows = valid[..., None]
    # Padded query rows see no key: Flax averages all values there, pallas_flash outputs 0.
    # Compare the rows that see keys; the cotangent is zero on the others.
    weights = weights * rows
    out, grads = loss_and_grads(ours, variables, x, weights, mask=mask)
    ref_out, ref_grads = loss_and_grads(ref, variables, x, weights, mask=mask)
    assert_close(out * rows, ref_out * rows)
    assert_close(grads, ref_grads)
    if case == "padding_mask":
        # Fully masked rows: zero attention output, so the out projection's (zero) bias.
        np.testing.assert_array_equal(out[1, 23:], 0.0)


# -- the module subclass --------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["is_causal", pytest.param("causal_segments", marks=SWEEP_ONLY)])
def test_module_matches_flax(case):
    """The subclass with is_causal (fast path) and segment ids equals Flax's module with masks."""
    x = inputs()
    ref = flax_module()
    ours = pfl.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True, **KERNELS)
    variables = ref.init(jax.random.key(1), x)
    shapes = jax.eval_shape(ours.init, jax.random.key(1), x)
    assert jax.tree.structure(shapes) == jax.tree.structure(variables)
    weights = inputs(2)
    mask = nn.make_causal_mask(jnp.ones((B, T)), dtype=jnp.bool_)
    kwargs = {}
    if case == "causal_segments":
        ids = segment_ids()
        mask = nn.combine_masks(mask, nn.make_attention_mask(ids, ids, jnp.equal))
        kwargs = {"q_segment_ids": ids}
    out, grads = loss_and_grads(ours, variables, x, weights, **kwargs)
    ref_out, ref_grads = loss_and_grads(ref, variables, x, weights, mask=mask)
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)


def test_decode_with_cache(monkeypatch):
    """Decoding token by token with the cache runs the decode kernel over the filled slots and
    equals Flax's own decode steps token for token and the full causal forward pass."""
    steps = 12
    x = inputs(shape=(B, steps, FEATURES))
    ours = pfl.MultiHeadDotProductAttention(num_heads=HEADS, decode=True, is_causal=True, **KERNELS)
    # Flax's module has the same variables; its init creates the [B, steps, N, H] cache.
    variables = flax_module(decode=True).init(jax.random.key(1), x)
    params, cache = variables["params"], variables["cache"]

    def make_step(module):
        @jax.jit
        def step(cache, token):
            out, updated = module.apply(
                {"params": params, "cache": cache}, token, mutable=["cache"]
            )
            return updated["cache"], out

        return step

    decode_calls = []
    original = flax_common.decode_attention

    def spy(*args, **kwargs):
        decode_calls.append(kwargs["key_value_seq_lengths"])
        return original(*args, **kwargs)

    monkeypatch.setattr(flax_common, "decode_attention", spy)
    outs, flax_cache = [], cache
    step, flax_step = make_step(ours), make_step(flax_module(decode=True))
    for i in range(steps):
        cache, out = step(cache, x[:, i : i + 1])
        flax_cache, flax_out = flax_step(flax_cache, x[:, i : i + 1])
        assert_close(out, flax_out)  # token for token, as Flax's own decode step
        outs.append(out)
    assert len(decode_calls) == 1  # traced once: every step ran the decode kernel
    full = flax_module().apply(
        {"params": params}, x, mask=nn.make_causal_mask(jnp.ones((B, steps)))
    )
    assert_close(jnp.concatenate(outs, axis=1), full)


def test_dropout_runs_in_the_kernels():
    x = inputs()
    ours = pfl.MultiHeadDotProductAttention(
        num_heads=HEADS, dropout_rate=0.5, is_causal=True, **KERNELS
    )
    ref = flax_module(dropout_rate=0.5, attention_fn=reference_dropout_attention)
    variables = ref.init(jax.random.key(1), x, deterministic=True)
    rng = jax.random.key(7)
    # No FallbackWarning (pytest turns warnings into errors).
    dropped = ours.apply(variables, x, deterministic=False, dropout_rng=rng)
    assert_close(dropped, ref.apply(variables, x, deterministic=False, dropout_rng=rng))
    kept = ours.apply(variables, x, deterministic=True)
    assert_close(kept, ref.apply(variables, x, deterministic=True))
    assert np.abs(np.asarray(dropped - kept)).max() > 1e-2
    other = ours.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(8))
    assert np.abs(np.asarray(dropped - other)).max() > 1e-2


def test_sow_weights_takes_flax_path(fresh_warnings):
    x = inputs()
    ours = pfl.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True)
    variables = ours.init(jax.random.key(1), x)
    with pytest.warns(pfl.FallbackWarning, match="sow"):
        out, state = ours.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (B, HEADS, T, T)
    np.testing.assert_allclose(np.triu(np.asarray(weights), k=1), 0.0)
    ref = flax_module().apply(variables, x, mask=nn.make_causal_mask(jnp.ones((B, T))))
    assert_close(out, ref)


# -- the function on its own ----------------------------------------------------------------------


def test_function_gqa_bias_extra_batch_dims():
    """[2, 2, T, N, H] inputs, K = N / 2 kv heads, a bias and a bool mask with per-head masks."""
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (2, 2, 24, 4, 16))
    k = jax.random.normal(keys[1], (2, 2, 24, 2, 16))
    v = jax.random.normal(keys[2], (2, 2, 24, 2, 16))
    bias = jax.random.normal(keys[3], (1, 2, 4, 24, 24))
    mask = jax.random.bernoulli(keys[4], 0.7, (2, 1, 4, 24, 24)).at[..., 0].set(True)
    ct = jax.random.normal(keys[5], q.shape)

    def grads_of(fn):
        def loss(q, k, v, bias):
            return jnp.sum(fn(q, k, v, bias, mask) * ct)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)

    ours = grads_of(functools.partial(pfl.dot_product_attention, **KERNELS))

    def repeated_kv(q, k, v, bias, mask):  # GQA reference: kv head n // 2 for query head n
        return nn.dot_product_attention(
            q, jnp.repeat(k, 2, axis=-2), jnp.repeat(v, 2, axis=-2), bias, mask
        )

    assert_close(ours, grads_of(repeated_kv))


def test_function_unbatched_inputs():
    """Flax allows inputs without batch dims: [T, N, H]."""
    q, k, v = (jax.random.normal(jax.random.key(i), (20, 2, 8)) for i in range(3))
    out = jax.jit(functools.partial(pfl.dot_product_attention, is_causal=True, **KERNELS))(q, k, v)
    ref = nn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((20, 20), bool)))
    assert_close(out, ref)


def test_function_options_and_errors():
    q = jnp.ones((1, 8, 2, 8))
    xla = functools.partial(pfl.dot_product_attention, backend="xla")
    # Precision requests are met by the kernels (float32 accumulation, full-precision f32).
    for precision in (None, "highest", jax.lax.Precision.DEFAULT, ("bfloat16", "float32")):
        xla(q, q, q, precision=precision, force_fp32_for_softmax=True)
    with pytest.raises(NotImplementedError, match="precision"):
        xla(q, q, q, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    with pytest.raises(ValueError, match="not a valid Precision"):
        xla(q, q, q, precision="bogus")
    for name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
        with pytest.raises(NotImplementedError, match=name):
            xla(q, q, q, **{name: jnp.einsum})
    with pytest.raises(ValueError, match="dropout_rng is required"):
        xla(q, q, q, dropout_rate=0.1)
    with pytest.raises(ValueError, match="kv_segment_ids is required"):
        xla(q, q[:, :4], q[:, :4], q_segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"mask.shape=\(3, 2, 8, 8\) must be broadcastable to"):
        xla(q, q, q, mask=jnp.ones((3, 2, 8, 8)))
    # The shape as passed, not as padded or flattened: [batch..., heads, T, S] = (2, 3, 2, 8, 8).
    q23 = jnp.ones((2, 3, 8, 2, 8))
    with pytest.raises(
        ValueError, match=r"mask.shape=\(3, 2, 8, 9\) must be .* = \(2, 3, 2, 8, 8\)"
    ):
        xla(q23, q23, q23, mask=jnp.ones((3, 2, 8, 9)))
    # dtype: the computation dtype, as in Flax.
    assert xla(q, q, q, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    # deterministic_grads=False reaches the attention function; True (the default) is not
    # bound, so an attention_fn without the keyword still works.
    recording, seen = recording_deterministic_grads(xla)
    x = jnp.ones((1, 8, 16))
    for flag in (False, True):
        module = pfl.MultiHeadDotProductAttention(
            num_heads=2, attention_fn=recording, deterministic_grads=flag
        )
        module.init(jax.random.key(0), x)
    assert seen == [False, True]
    pfl.MultiHeadDotProductAttention(num_heads=2, attention_fn=nn.dot_product_attention).init(
        jax.random.key(0), x
    )
    # A custom attention_fn that cannot take the module's options is refused, not ignored.
    module = pfl.MultiHeadDotProductAttention(
        num_heads=2, is_causal=True, attention_fn=nn.dot_product_attention
    )
    with pytest.raises(TypeError, match="is_causal"):
        module.init(jax.random.key(0), jnp.ones((1, 8, 16)))


# -- training ------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding, one pre-norm causal attention block, logits."""

    vocab: int
    pallas: bool

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, FEATURES)(tokens)
        y = nn.LayerNorm()(x)
        if self.pallas:
            y = pfl.MultiHeadDotProductAttention(
                num_heads=HEADS, is_causal=True, name="attn", **KERNELS
            )(y)
        else:
            mask = nn.make_causal_mask(tokens)
            y = nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(y, mask=mask)
        return nn.Dense(self.vocab)(x + y)


def test_training_step_matches_flax():
    vocab, steps = 16, 4
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, vocab)
    inputs_, targets = tokens[:, :-1], tokens[:, 1:]
    tx = optax.adam(1e-2)

    def train(pallas):
        model = TinyLM(vocab, pallas)
        params = TinyLM(vocab, False).init(jax.random.key(1), inputs_)["params"]
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state):
            def loss_fn(params):
                logits = model.apply({"params": params}, inputs_)
                return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state)
            return optax.apply_updates(params, updates), opt_state, loss

        losses = []
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
        return losses

    ours, ref = train(True), train(False)
    assert ref[-1] < ref[0]  # the model learns, so equal losses mean equal training
    np.testing.assert_allclose(ours, ref, rtol=5e-5)


def test_attention_sinks_parameter():
    """attention_sinks=True adds a learned `sinks` [num_heads] parameter: the module equals
    Flax's with a sink-column softmax, the sinks get gradients, decode steps use them too."""
    steps = 12
    x = inputs(shape=(B, steps, FEATURES))
    ours = pfl.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True, attention_sinks=True)
    variables = ours.init(jax.random.key(1), x)
    assert variables["params"]["sinks"].shape == (HEADS,)
    sinks = jnp.linspace(-1.0, 2.0, HEADS)
    params = {**variables["params"], "sinks": sinks}
    others = {k: v for k, v in params.items() if k != "sinks"}
    ref = flax_module(attention_fn=sink_attention(sinks, is_causal=True))
    weights = inputs(seed=3, shape=(B, steps, FEATURES))
    out, grads = loss_and_grads(ours, {"params": params}, x, weights)
    assert_close(out, ref.apply({"params": others}, x))
    assert np.abs(np.asarray(grads["sinks"])).min() > 0
    decoder = pfl.MultiHeadDotProductAttention(
        num_heads=HEADS, decode=True, is_causal=True, attention_sinks=True
    )
    cache = decoder.init(jax.random.key(1), x)["cache"]

    @jax.jit
    def step(cache, token):
        y, updated = decoder.apply({"params": params, "cache": cache}, token, mutable=["cache"])
        return updated["cache"], y

    outs = []
    for i in range(steps):
        cache, y = step(cache, x[:, i : i + 1])
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=1), out)
