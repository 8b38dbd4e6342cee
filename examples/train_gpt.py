"""Train a GPT-style decoder (flax.nnx) with a jit-compiled AdamW step on pallas_flash, cuDNN, XLA.

    python examples/train_gpt.py                      # tiny model, runs on a CPU in minutes
    python examples/train_gpt.py --preset gpt3-1.3b --seq 8192 --attention pallas_flash   # on a GPU
    python examples/train_gpt.py --mesh data=2,context=4   # data + context parallel (ring) on 8

With --mesh the batch is split over the `data` axis, the sequence over `context` and the
attention heads over `model`: with a context axis attention runs as `pallas_flash.ring_attention`
(zig-zag order, so the causal work is balanced: the tokens and their rotary positions are
permuted once at the input; the loss is per token, so nothing else changes); without one, as
`flash_attention` on each device's sequences and heads (the weights stay replicated: only the
attention is split over `model`). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8
gives 8 devices.

Pre-LayerNorm blocks, rotary position embeddings, optional GQA (--kv-heads), byte-level tokens. The
corpus is built locally from the Python standard library's source files (nothing is downloaded).
Logs loss, tokens/s, model TFLOP/s and MFU with the FlashAttention-2 paper's FLOP count:
6 * params * tokens + 12 * layers * hidden * seq * tokens (the attention matmuls, forward+backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flash
from pallas_flash.device import gpu_compute_capability

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM datasheet, dense bf16


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    vocab: int = 256
    seq: int = 128
    mlp_ratio: int = 4
    lr: float = 3e-3  # AdamW learning rate (--lr overrides)


PRESETS = {
    "tiny": GPTConfig(),
    "small": GPTConfig(layers=4, hidden=256, heads=4, kv_heads=4, seq=256),
    # GPT3-1.3B as in the FlashAttention-2 paper's end-to-end table: 24 layers, 16 heads of 128.
    # The GPT-3 paper's learning rate for that size: with 3e-3 the loss spikes within a few steps
    # and runs that differ only in bf16 rounding drift apart.
    "gpt3-1.3b": GPTConfig(layers=24, hidden=2048, heads=16, kv_heads=16, seq=2048, lr=2e-4),
}


def corpus_bytes(limit: int = 8 << 20) -> np.ndarray:
    """Bytes of the standard library's .py files, sorted by path so every run sees the same text."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
                if total >= limit:
                    return np.frombuffer(b"".join(chunks)[:limit], np.uint8)
    return np.frombuffer(b"".join(chunks), np.uint8)


def attention_fn(name: str, interpret: bool, mesh=None):
    """q [B,T,N,H], k/v [B,T,K,H] -> [B,T,N,H], causal. With a mesh of a `context` axis: ring
    attention over it, on sequences in zig-zag order; with a `model` axis the heads split over
    it."""
    axis = lambda a: a if mesh is not None and a in mesh.shape else None  # noqa: E731
    if mesh is not None and mesh.shape.get("context", 1) > 1:
        if name != "pallas_flash":
            raise SystemExit("--mesh with a context axis needs --attention pallas_flash")
        return functools.partial(
            pallas_flash.ring_attention_sharded,
            mesh=mesh,
            context_axis="context",
            batch_axis=axis("data"),
            head_axis=axis("model"),
            is_causal=True,
            layout="zigzag",
            interpret=interpret,
        )
    if name == "pallas_flash" and axis("model"):
        split = NamedSharding(mesh, P(axis("data"), None, "model"))

        def heads_split(q, k, v):
            q, k, v = (jax.lax.with_sharding_constraint(x, split) for x in (q, k, v))
            return pallas_flash.flash_attention(q, k, v, is_causal=True, interpret=interpret)

        return heads_split
    if name == "pallas_flash":
        return functools.partial(pallas_flash.flash_attention, is_causal=True, interpret=interpret)
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=name)


def rotary(x, positions):
    """Rotary position embedding on the last axis of x [B, T, heads, H] (pairs (i, i + H/2))."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [T, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, attention, dtype, rngs: nnx.Rngs):
        h = cfg.hidden // cfg.heads
        self.cfg, self.attention, self.head_dim = cfg, attention, h
        self.ln1 = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)
        self.q = nnx.Linear(cfg.hidden, cfg.heads * h, use_bias=False, dtype=dtype, rngs=rngs)
        self.kv = nnx.Linear(
            cfg.hidden, 2 * cfg.kv_heads * h, use_bias=False, dtype=dtype, rngs=rngs
        )
        self.out = nnx.Linear(cfg.heads * h, cfg.hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions):
        b, t, _ = x.shape
        y = self.ln1(x)
        q = self.q(y).reshape(b, t, self.cfg.heads, self.head_dim)
        k, v = jnp.split(self.kv(y).reshape(b, t, 2 * self.cfg.kv_heads, self.head_dim), 2, -2)
        q, k = rotary(q, positions), rotary(k, positions)
        x = x + self.out(self.attention(q, k, v).reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, attention, dtype, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attention, dtype, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.hidden, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, positions=None):
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.embed.attend(self.ln(x)).astype(jnp.float32)  # tied embeddings


def mesh_axes(text: str) -> dict[str, int]:
    """ "data=2,context=4" -> {"data": 2, "context": 4}; ValueError naming what is wrong."""
    axes = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if name not in ("data", "context", "model") or name in axes or not size.isdigit():
            raise ValueError(
                f"--mesh {text}: expected data=N, context=N and/or model=N (each once), "
                f"got {item!r}"
            )
        if int(size) < 1:
            raise ValueError(f"--mesh {text}: {name}={size} must be at least 1")
        axes[name] = int(size)
    return axes


def parse_mesh(text: str):
    """ "data=2,context=4" -> a mesh of those axes over all devices (automatic sharding)."""
    axes = mesh_axes(text)
    sizes = tuple(axes.values())
    if math.prod(sizes) != jax.device_count():
        raise SystemExit(
            f"--mesh {text}: {math.prod(sizes)} devices, found {jax.device_count()} (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(sizes)})"
        )
    return jax.make_mesh(sizes, tuple(axes), axis_types=(AxisType.Auto,) * len(sizes))


def finite_or_none(x: float) -> float | None:
    """x, or None (JSON null) where it is NaN or infinite: the summary stays valid JSON."""
    return x if math.isfinite(x) else None


def count_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def model_flops_per_step(cfg: GPTConfig, params: int, batch: int) -> float:
    tokens = batch * cfg.seq
    return 6.0 * params * tokens + 12.0 * cfg.layers * cfg.hidden * cfg.seq * tokens


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--attention", choices=["pallas_flash", "cudnn", "xla"], default="pallas_flash"
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    parser.add_argument("--kv-heads", type=int, help="GQA: key/value heads (default: all)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="at least 1 (step 1 compiles: the times are of the later steps)",
    )
    parser.add_argument("--lr", type=float, help="learning rate (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument(
        "--matmul-tflops", type=float, help="measured matmul rate, for a second MFU column"
    )
    parser.add_argument(
        "--remat-attention",
        action="store_true",
        help="recompute the attention in the backward pass instead of saving what it saves "
        "(XLA attention saves the T x S probabilities of every layer: at seq 8k on one H200 it "
        "needs this to fit)",
    )
    parser.add_argument(
        "--mesh",
        help="device mesh as axis=size pairs, e.g. data=2,context=4: the batch over `data`, "
        "the sequence over `context` (ring attention), the attention heads over `model`; the "
        "sizes' product must be the device count",
    )
    parser.add_argument("--out", help="JSONL file for the per-step log")
    return parser


def checked_config(parser, args) -> tuple[GPTConfig, int]:
    """The preset with --seq and --kv-heads applied, and the mesh's context size; every
    argument's rule checked (parser.error) before jax sees an array."""
    cfg = PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, seq=args.seq or cfg.seq, kv_heads=args.kv_heads or cfg.kv_heads)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.batch < 1 or cfg.seq < 1:
        parser.error(f"--batch {args.batch} and --seq {cfg.seq} must be at least 1")
    if cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        parser.error(f"--kv-heads {cfg.kv_heads} must divide the {cfg.heads} heads")
    try:
        axes = mesh_axes(args.mesh) if args.mesh else {}
    except ValueError as e:
        parser.error(str(e))
    data_shards, context, model_shards = (axes.get(a, 1) for a in ("data", "context", "model"))
    if args.batch % data_shards:
        parser.error(f"--batch {args.batch} must be a multiple of the mesh's data={data_shards}")
    if context > 1 and args.attention != "pallas_flash":
        parser.error("--mesh with a context axis needs --attention pallas_flash")
    if context > 1 and cfg.seq % (2 * context):
        parser.error(f"--seq {cfg.seq} must be a multiple of 2 x context={context}")
    if cfg.kv_heads % model_shards:
        parser.error(f"--kv-heads {cfg.kv_heads} must divide over the mesh's model={model_shards}")
    return cfg, context


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    cfg, context = checked_config(parser, args)
    on_gpu = (gpu_compute_capability() or (0, 0)) >= (8, 0)
    if not on_gpu and args.attention == "cudnn":
        parser.error("--attention cudnn needs an NVIDIA GPU")
    interpret = not on_gpu  # on a CPU the Pallas kernels run in the interpreter
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    mesh = parse_mesh(args.mesh) if args.mesh else None
    data = corpus_bytes()
    attention = attention_fn(args.attention, interpret, mesh)
    if args.remat_attention:
        attention = jax.checkpoint(attention)
    model = GPT(cfg, attention, dtype, nnx.Rngs(args.seed))
    params = count_params(model)
    optimizer = nnx.Optimizer(
        model, optax.adamw(args.lr or cfg.lr, weight_decay=0.1), wrt=nnx.Param
    )
    replicated = NamedSharding(mesh, P()) if mesh is not None else None
    if mesh is not None:
        # Parameters and optimizer state replicated on the mesh from the start (and kept so by
        # train_step), so that every step takes the shardings the first compiled for.
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, replicated))

    # Zig-zag order for the ring: inputs, labels and rotary positions permuted alike.
    order = pallas_flash.zigzag_indices(cfg.seq, context) if context > 1 else None

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            positions = None
            if order is not None:
                inputs, labels, positions = inputs[:, order], labels[:, order], jnp.asarray(order)
            logits = model(inputs, positions)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        if replicated is not None:
            # Without this XLA leaves the weights that feed the head-split attention (and their
            # optimizer state) split over `model`, and step 2 compiles again for them.
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.lax.with_sharding_constraint(state, replicated))
        return loss

    rng = np.random.default_rng(args.seed)
    flops = model_flops_per_step(cfg, params, args.batch)
    where = jax.devices()[0].device_kind + (" (Pallas interpreter)" if interpret else "")
    print(
        f"GPT {args.preset}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads "
        f"({cfg.kv_heads} kv), seq {cfg.seq}, batch {args.batch}, {params / 1e6:.1f}M params; "
        f"attention={args.attention} on {where}",
        flush=True,
    )
    log = open(args.out, "a") if args.out else None
    step_times, first_step_s = [], None
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(data) - cfg.seq - 1, args.batch)
        tokens = jnp.asarray(np.stack([data[s : s + cfg.seq + 1] for s in starts]), jnp.int32)
        if mesh is not None:
            batch_axis = "data" if "data" in mesh.shape else None
            tokens = jax.device_put(tokens, NamedSharding(mesh, P(batch_axis)))
        start = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens))  # float() waits for the step
        elapsed = time.perf_counter() - start
        if step > 1:  # step 1 compiles
            step_times.append(elapsed)
        else:
            first_step_s = elapsed
        row = dict(
            step=step,
            loss=finite_or_none(round(loss, 5)),
            step_s=round(elapsed, 4),
            attention=args.attention,
            preset=args.preset,
            seq=cfg.seq,
        )
        if log:
            log.write(json.dumps(row, allow_nan=False) + "\n")
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            print(
                f"step {step:4d}/{args.steps}  loss {loss:.4f}  {elapsed * 1e3:8.1f} ms", flush=True
            )
    # Steps after the first (which compiles) give the times; with --steps 1 they are null.
    timed = bool(step_times)
    median = float(np.median(step_times)) if timed else None
    tflops = flops / median / 1e12 if timed else None
    devices = mesh.size if mesh is not None else 1
    summary = dict(
        attention=args.attention,
        preset=args.preset,
        seq=cfg.seq,
        batch=args.batch,
        remat_attention=args.remat_attention,
        mesh=args.mesh,
        devices=devices,
        first_step_s=round(first_step_s, 2),  # tracing, compiling and one step
        step_ms=round(median * 1e3, 2) if timed else None,
        tokens_per_s=round(args.batch * cfg.seq / median) if timed else None,
        model_tflops=round(tflops, 1) if timed else None,  # over all devices
        mfu_datasheet=round(tflops / devices / PEAK_BF16_TFLOPS, 4) if timed else None,
        final_loss=finite_or_none(round(loss, 4)),
    )
    if args.matmul_tflops:
        summary["mfu_matmul"] = round(tflops / devices / args.matmul_tflops, 4) if timed else None
    print("summary " + json.dumps(summary, allow_nan=False), flush=True)
    if log:
        log.write(json.dumps(dict(summary=summary), allow_nan=False) + "\n")
        log.close()
    return summary


if __name__ == "__main__":
    main()
