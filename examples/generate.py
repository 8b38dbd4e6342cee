"""Greedy generation with the GPT of train_gpt.py: a KV cache, a jit-compiled decode step.

    python examples/generate.py                        # tiny random model; CPU (interpreter) or GPU
    python examples/generate.py --preset gpt3-1.3b --batch 8 --prompt 2048 --new 256 --cache 4096
    python examples/generate.py --mesh data=2,model=4  # sequences over `data`, heads over `model`
    # (on a CPU with 8 fake devices: XLA_FLAGS=--xla_force_host_platform_device_count=8)

The prompt is prefilled in one causal `flash_attention` call per layer, its keys and values
written into a [B, cache, K, H] cache per layer; each new token then runs one jit-compiled step
whose attention is `pallas_flash.decode_attention` over the cache's filled slots (or its
backend="xla" reference, with --attention xla). Weights are random (or --steps N trains them
first, with train_gpt.py's loss and learning rate): the point is the cache and the step, not the
text. Reports tokens/s and the attention's share of the step (the step timed again with the
attention replaced by a copy of the queries).

With --mesh the sequences are split over the `data` axis and the heads over `model` (tensor
parallelism for the attention: each device holds its heads' slice of every cache and reads only
that; the weights stay replicated): the same calls, with the caches constrained to that
sharding.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402  (the model and its presets)

import pallas_flash  # noqa: E402
from pallas_flash.device import gpu_compute_capability  # noqa: E402


def qkv(block: train_gpt.Block, x, positions):
    """The block's rotated queries [B, T, N, h] and keys, values [B, T, K, h] of x [B, T, D]."""
    b, t, _ = x.shape
    cfg, h = block.cfg, block.head_dim
    y = block.ln1(x)
    q = block.q(y).reshape(b, t, cfg.heads, h)
    k, v = jnp.split(block.kv(y).reshape(b, t, 2 * cfg.kv_heads, h), 2, -2)
    return train_gpt.rotary(q, positions), train_gpt.rotary(k, positions), v


def finish(block: train_gpt.Block, x, attn):
    """The block's output from its input x and its attention's output attn [B, T, N, h]."""
    x = x + block.out(attn.reshape(*x.shape[:2], -1))
    return x + block.down(jax.nn.gelu(block.up(block.ln2(x))))


def mesh_axes(text: str) -> dict[str, int]:
    """ "data=2,model=4" -> {"data": 2, "model": 4}; ValueError naming what is wrong."""
    axes = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if name not in ("data", "model") or name in axes or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh {text}: expected data=N and/or model=M (each once, >= 1), got {item!r}"
            )
        axes[name] = int(size)
    return axes


def parse_mesh(text: str):
    """ "data=2,model=4" -> a mesh of those axes over all devices (automatic sharding)."""
    axes = mesh_axes(text)
    devices = int(np.prod(list(axes.values())))
    if devices != jax.device_count():
        raise SystemExit(
            f"--mesh {text}: {devices} devices, found {jax.device_count()} (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices})"
        )
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def heads_sharded(mesh, x):
    """x [B, T, heads, h] with its sequences over `data` and its heads over `model` (as is
    without a mesh)."""
    if mesh is None:
        return x
    spec = P(
        "data" if "data" in mesh.shape else None, None, "model" if "model" in mesh.shape else None
    )
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def prefill(model: train_gpt.GPT, tokens, cache_len: int, interpret: bool, mesh=None):
    """Logits of the prompt's last token and the caches [(k, v)] per layer, filled up to T."""
    b, t = tokens.shape
    positions = jnp.arange(t)
    x = model.embed(tokens)
    caches = []
    for block in model.blocks:
        q, k, v = (heads_sharded(mesh, y) for y in qkv(block, x, positions))
        attn = pallas_flash.flash_attention(q, k, v, is_causal=True, interpret=interpret)
        pad = ((0, 0), (0, cache_len - t), (0, 0), (0, 0))
        caches.append((heads_sharded(mesh, jnp.pad(k, pad)), heads_sharded(mesh, jnp.pad(v, pad))))
        x = finish(block, x, attn)
    return model.embed.attend(model.ln(x[:, -1])).astype(jnp.float32), caches


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _prefill(state, prompt, graphdef, cache_len: int, interpret: bool, mesh=None):
    return prefill(nnx.merge(graphdef, state), prompt, cache_len, interpret, mesh)


def decode_step(model: train_gpt.GPT, caches, token, length, attention, mesh=None):
    """One new token per sequence: (logits [B, vocab], caches with the token's keys written).

    token: [B] int; length: the cache's filled slots before this token (the token's position).
    attention(q, k_cache, v_cache, lengths) -> [B, 1, N, h]. mesh: the caches' (`heads_sharded`).
    """
    b = token.shape[0]
    x = model.embed(token[:, None])
    positions = length[None]
    lengths = jnp.full((b,), length + 1, jnp.int32)
    new_caches = []
    for block, (k_cache, v_cache) in zip(model.blocks, caches, strict=True):
        q, k, v = (heads_sharded(mesh, y) for y in qkv(block, x, positions))
        at = (0, length, 0, 0)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), at)
        k_cache, v_cache = heads_sharded(mesh, k_cache), heads_sharded(mesh, v_cache)
        new_caches.append((k_cache, v_cache))
        x = finish(block, x, attention(q, k_cache, v_cache, lengths))
    return model.embed.attend(model.ln(x[:, 0])).astype(jnp.float32), new_caches


def decode_attention_fn(name: str, interpret: bool):
    if name == "none":  # the step without attention: what the rest of the step costs
        return lambda q, k, v, lengths: q
    kwargs = dict(backend="xla") if name == "xla" else dict(interpret=interpret)
    return lambda q, k, v, lengths: pallas_flash.decode_attention(
        q, k, v, key_value_seq_lengths=lengths, **kwargs
    )


def generate(
    model, prompt, new_tokens: int, cache_len: int, attention: str, interpret: bool, mesh=None
):
    """Greedy generation: (tokens [B, new_tokens], seconds per decode step after the first (None
    below 3 new tokens), logits of every step [new_tokens, B, vocab]). mesh: see the module's
    doc (--mesh)."""
    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = jax.device_put(state, NamedSharding(mesh, P()))
        prompt = jax.device_put(
            prompt, NamedSharding(mesh, P("data" if "data" in mesh.shape else None))
        )

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, caches, token, length):
        fn = decode_attention_fn(attention, interpret)
        return decode_step(nnx.merge(graphdef, state), caches, token, length, fn, mesh)

    logits, caches = _prefill(state, prompt, graphdef, cache_len, interpret, mesh)
    length = prompt.shape[1]
    tokens, all_logits, times = [], [], []
    for i in range(new_tokens):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens.append(token)
        all_logits.append(logits)
        if i == new_tokens - 1:
            break
        start = time.perf_counter()
        logits, caches = step(state, caches, token, jnp.int32(length))
        logits.block_until_ready()
        if i > 0:  # the first step compiles
            times.append(time.perf_counter() - start)
        length += 1
    seconds = float(np.median(times)) if times else None  # None: no step after the first
    return jnp.stack(tokens, axis=1), seconds, jnp.stack(all_logits)


def train_briefly(model, cfg, data, steps: int, batch: int, seed: int):
    """`steps` AdamW steps of next-byte prediction on the corpus (train_gpt.py's loss and
    learning rate), so that greedy generation follows something; returns the losses."""
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=0.1), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            labels = tokens[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed + 1)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - cfg.seq - 1, batch)
        tokens = jnp.asarray(np.stack([data[s : s + cfg.seq + 1] for s in starts]), jnp.int32)
        losses.append(float(train_step(model, optimizer, tokens)))
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(train_gpt.PRESETS), default="tiny")
    parser.add_argument("--kv-heads", type=int, help="GQA: key/value heads (default: all)")
    parser.add_argument("--attention", choices=["pallas_flash", "xla"], default="pallas_flash")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument(
        "--new", type=int, default=16, help="tokens to generate (the times need at least 3)"
    )
    parser.add_argument("--cache", type=int, help="cache capacity (default: prompt + new)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=0, help="train this many steps first (default: random weights)"
    )
    parser.add_argument(
        "--mesh",
        help="device mesh as axis=size pairs over all devices, e.g. data=2,model=4: the "
        "sequences over `data`, the attention heads (and each cache's) over `model`",
    )
    args = parser.parse_args(argv)
    cfg = train_gpt.PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, kv_heads=args.kv_heads or cfg.kv_heads)
    # The arguments' rules, checked before jax sees an array.
    for name in ("batch", "prompt", "new"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be at least 1")
    if args.steps < 0:
        parser.error(f"--steps {args.steps} must be at least 0")
    if cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        parser.error(f"--kv-heads {cfg.kv_heads} must divide the {cfg.heads} heads")
    cache_len = args.cache or args.prompt + args.new
    if cache_len < args.prompt + args.new:
        parser.error(
            f"--cache {cache_len} is smaller than --prompt + --new ({args.prompt + args.new})"
        )
    try:
        axes = mesh_axes(args.mesh) if args.mesh else {}
    except ValueError as e:
        parser.error(str(e))
    if args.batch % axes.get("data", 1):
        parser.error(f"--batch {args.batch} must be a multiple of the mesh's data={axes['data']}")
    if cfg.kv_heads % axes.get("model", 1):
        parser.error(f"--kv-heads {cfg.kv_heads} must divide over the mesh's model={axes['model']}")

    mesh = parse_mesh(args.mesh) if args.mesh else None
    on_gpu = (gpu_compute_capability() or (0, 0)) >= (8, 0)
    interpret = not on_gpu  # on a CPU the Pallas kernels run in the interpreter
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    train_attention = train_gpt.attention_fn("pallas_flash", interpret)
    model = train_gpt.GPT(cfg, train_attention, dtype, nnx.Rngs(args.seed))
    data = train_gpt.corpus_bytes(1 << 20)
    losses = train_briefly(model, cfg, data, args.steps, args.batch, args.seed)
    starts = np.random.default_rng(args.seed).integers(0, len(data) - args.prompt, args.batch)
    prompt = jnp.asarray(np.stack([data[s : s + args.prompt] for s in starts]), jnp.int32)

    tokens, step_s, logits = generate(
        model, prompt, args.new, cache_len, args.attention, interpret, mesh
    )
    _, bare_s, _ = generate(model, prompt, min(args.new, 4), cache_len, "none", interpret, mesh)
    where = jax.devices()[0].device_kind + (" (Pallas interpreter)" if interpret else "")
    summary = dict(
        attention=args.attention,
        preset=args.preset,
        batch=args.batch,
        prompt=args.prompt,
        new=args.new,
        cache=cache_len,
        # The step's times, from the decode steps after the first (which compiles): null
        # below 3 new tokens.
        step_ms=round(step_s * 1e3, 3) if step_s is not None else None,
        tokens_per_s=round(args.batch / step_s, 1) if step_s is not None else None,
        attention_share=(
            round(max(0.0, 1.0 - bare_s / step_s), 3)
            if step_s is not None and bare_s is not None
            else None
        ),
        train_steps=args.steps,
        mesh=args.mesh,
        train_loss=[train_gpt.finite_or_none(round(x, 4)) for x in losses[:1] + losses[-1:]],
    )
    print(
        f"GPT {args.preset} ({cfg.layers} layers, {cfg.heads} heads, {cfg.kv_heads} kv) on "
        f"{where}: {args.new} tokens x {args.batch} sequences",
        flush=True,
    )
    print("summary " + json.dumps(summary, allow_nan=False), flush=True)
    return dict(
        summary, tokens=np.asarray(tokens), logits=np.asarray(logits), prompt=prompt, model=model
    )


if __name__ == "__main__":
    main()
