"""A Flax model switched to pallas_flash: the three lines are marked "# pallas_flash".

A small linen encoder-decoder-style block stack whose attention layers take `attention_fn`. The
same parameters give the same outputs with Flax's attention and with pallas_flash's (the kernels
run in the Pallas interpreter on a CPU, compiled on an NVIDIA GPU).
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_flash.device
import pallas_flash.linen  # pallas_flash (1/3)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--interpret",
    action="store_true",
    help="run the kernels in the Pallas interpreter (the default without a GPU)",
)
args = parser.parse_args()
on_gpu = (pallas_flash.device.gpu_compute_capability() or (0, 0)) >= (8, 0)
flash = functools.partial(  # pallas_flash (2/3)
    pallas_flash.linen.dot_product_attention, interpret=args.interpret or not on_gpu
)


class Block(nn.Module):
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x, mask):
        y = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=self.attention_fn)(
            nn.LayerNorm()(x), mask=mask
        )
        x = x + y
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


x = jax.random.normal(jax.random.key(0), (2, 64, 128))
mask = nn.make_causal_mask(jnp.ones((2, 64)))  # a Flax mask [B, 1, T, T] goes through the kernels
params = Block().init(jax.random.key(1), x, mask)
flax_out = Block().apply(params, x, mask)
flash_out = Block(attention_fn=flash).apply(params, x, mask)  # pallas_flash (3/3)
print(f"max |pallas_flash - flax| = {jnp.max(jnp.abs(flash_out - flax_out)):.2e}")
