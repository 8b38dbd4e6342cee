"""pallas_flash in ten lines: causal GQA attention, its gradient, and a check against jax.nn.

Runs anywhere: on an NVIDIA GPU (sm80+) through the Triton kernels, elsewhere through the Pallas
interpreter (slow, small sizes) -- pass --interpret to force it.
"""

import argparse

import jax
import jax.numpy as jnp

import pallas_flash
import pallas_flash.device

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--interpret",
    action="store_true",
    help="run the kernels in the Pallas interpreter (the default without a GPU)",
)
args = parser.parse_args()
on_gpu = (pallas_flash.device.gpu_compute_capability() or (0, 0)) >= (8, 0)
interpret = args.interpret or not on_gpu

B, T, N, K, H = 2, 256, 8, 2, 64  # 8 query heads share 2 key/value heads (GQA)
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
v = jax.random.normal(kv, (B, T, K, H), jnp.float32)


@jax.jit
def loss(q, k, v):
    out = pallas_flash.flash_attention(q, k, v, is_causal=True, interpret=interpret)
    return jnp.mean(out**2)


value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
out = pallas_flash.flash_attention(q, k, v, is_causal=True, interpret=interpret)
expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
print(f"ran on {'the Pallas interpreter' if interpret else jax.devices()[0].device_kind}")
print(f"loss {value:.6f}; max |out - jax.nn| = {jnp.max(jnp.abs(out - expected)):.2e}")
print("grad shapes:", [g.shape for g in grads])
