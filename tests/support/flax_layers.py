"""What the Flax layer tests (test_linen.py, test_nnx.py) share: sizes, inputs and the
comparison with Flax's own attention. Imports no Flax (the tests skip without it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash

KERNELS = {"backend": "triton", "interpret": True}
B, T, FEATURES, HEADS = 2, 40, 32, 4  # T spans two 32-wide interpreter tiles
TOL = 2e-5


def assert_close(actual, expected, tol=TOL):
    """Max abs difference over a pytree, relative to the largest magnitude (at least 1)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        scale = max(1.0, float(np.abs(e).max()))
        np.testing.assert_array_less(np.abs(a - e).max(), tol * scale)


def inputs(seed=0, shape=(B, T, FEATURES)):
    return jax.random.normal(jax.random.key(seed), shape)


def segment_ids():
    """Two packed documents in row 0, three in row 1."""
    return jnp.array([[0] * 25 + [1] * 15, [0] * 10 + [1] * 20 + [2] * 10], jnp.int32)


def sink_attention(sinks, is_causal):
    """An attention_fn for Flax's own modules: softmax over the keys and one sink logit per head
    (sinks [N]), materialised in float32 jnp: the reference of the modules' attention_sinks."""

    def attention(query, key, value, bias=None, mask=None, **_):
        logits = jnp.einsum("...tnh,...snh->...nts", query, key) / np.sqrt(query.shape[-1])
        q_len, kv_len = logits.shape[-2:]
        visible = jnp.ones((q_len, kv_len), bool)
        if is_causal:
            visible = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        if mask is not None:
            visible = visible & mask
        logits = jnp.where(visible, logits, -jnp.inf)
        sink = jnp.broadcast_to(sinks[:, None, None], (*logits.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("...nts,...snh->...tnh", probs, value)

    return attention


def reference_dropout_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    broadcast_dropout=True,
    **kwargs,
):
    """Flax's attention_fn on pallas_flash's "xla" reference with its dropout: the mask the
    kernels must apply (Flax's own dropout draws another one)."""
    active = dropout_rate > 0 and not deterministic
    return pallas_flash.flash_attention(
        query,
        key,
        value,
        is_causal=True,
        dropout_rate=dropout_rate if active else 0.0,
        dropout_rng=dropout_rng if active else None,
        dropout_broadcast=broadcast_dropout,
        backend="xla",
    )


def recording_deterministic_grads(attention_fn):
    """(fn, seen): fn calls attention_fn without deterministic_grads and appends the value it
    was given (True when not bound) to seen: whether a module passes the option on."""
    seen = []

    def recording(*args, deterministic_grads=True, **kwargs):
        seen.append(deterministic_grads)
        return attention_fn(*args, **kwargs)

    return recording, seen
