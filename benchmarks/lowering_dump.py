"""Lowered modules of representative calls, for an abstract H200: the proof that a refactor left
the kernels as they were (docs/notes/house.md, "Refactors that keep the kernels").

    python benchmarks/lowering_dump.py OUTDIR [CASE-SUBSTRING]

Per case it writes the StableHLO text (no locations; serialized kernel blobs replaced by
<blob>), every kernel module decoded (Triton IR and Mosaic GPU module text, no locations) and
the kernels the dispatch chose. Run it on the tree before and after a change and compare the
two folders with `diff -r`: empty means the same programs and kernels. Reads the kernel modules
through jax's private Triton lowering and Mosaic GPU serde pass (names checked by jax 0.11.2).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import sys
import warnings

import jax
import jax.experimental.mosaic.gpu.core as mosaic_gpu_core
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering
from jax.sharding import AbstractDevice, AbstractMesh
from jax.sharding import PartitionSpec as P

import pallas_flash

warnings.filterwarnings("ignore")

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
MESH = AbstractMesh((1,), ("x",), abstract_device=H200)

modules: list[str] = []


@contextlib.contextmanager
def capture():
    lower = triton_lowering.lower_jaxpr_to_triton_module
    serde = mosaic_gpu_core._run_serde_pass

    def triton_spy(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()
        modules.append("// triton\n" + result.module.operation.get_asm(enable_debug_info=False))
        return result

    def mosaic_spy(module, **kwargs):
        text = module.operation.get_asm(enable_debug_info=False)
        # jax 0.12.1 names each Mosaic GPU module's dumps with a process-wide counter.
        text = re.sub(r'(mosaic_gpu.dump_basename = "[^"]*?)_\d+"', r'\1_<n>"', text)
        modules.append("// mosaic\n" + text)
        return serde(module, **kwargs)

    triton_lowering.lower_jaxpr_to_triton_module = triton_spy
    mosaic_gpu_core._run_serde_pass = mosaic_spy
    try:
        yield
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = lower
        mosaic_gpu_core._run_serde_pass = serde


STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def strip(text: str) -> str:
    """Long string literals (serialized kernels) and kernel hashes replaced; no locations."""
    text = STRING.sub(lambda m: '"<blob>"' if len(m.group(0)) > 300 else m.group(0), text)
    text = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', 'kernel_hash = "<hash>"', text)
    assert "loc(" not in text, text[text.index("loc(") - 200 : text.index("loc(") + 200]
    return text


def arr(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def case(b, t, s, n, kk, h, hv=None, dtype=jnp.bfloat16, **options):
    hv = h if hv is None else hv
    q, k, v = arr((b, t, n, h), dtype), arr((b, s, kk, h), dtype), arr((b, s, kk, hv), dtype)
    return (q, k, v), options


def seg(b, t):
    return arr((b, t), jnp.int32)


CASES = {
    "plain_h128": case(2, 2048, 2048, 16, 16, 128),
    "causal_h64_gqa": case(2, 2048, 2048, 16, 4, 64, is_causal=True),
    "window_segments_softcap": case(
        2,
        2048,
        2048,
        16,
        16,
        128,
        local_window_size=(256, 128),
        logits_soft_cap=30.0,
        q_segment_ids=seg(2, 2048),
        kv_segment_ids=seg(2, 2048),
    ),
    "window_segments_causal": case(
        2,
        2048,
        2048,
        16,
        16,
        128,
        is_causal=True,
        local_window_size=(256, 0),
        q_segment_ids=seg(2, 2048),
        kv_segment_ids=seg(2, 2048),
    ),
    "lengths_ragged": case(
        2,
        1999,
        2001,
        16,
        16,
        128,
        query_seq_lengths=arr((2,), jnp.int32),
        key_value_seq_lengths=arr((2,), jnp.int32),
    ),
    "dropout": case(2, 2048, 2048, 16, 16, 128, dropout_rate=0.1, dropout_rng="key"),
    "dropout_triton": case(
        1, 256, 384, 4, 2, 64, dropout_rate=0.1, dropout_rng="key", backend="triton"
    ),
    "sinks": case(2, 2048, 2048, 16, 16, 128, is_causal=True, sinks=arr((16,), jnp.float32)),
    "bias_triton": case(1, 512, 512, 8, 8, 64, bias=arr((1, 8, 512, 512))),
    "bias_key_broadcast": case(1, 512, 512, 8, 8, 64, bias=arr((1, 8, 512, 1))),
    "mask_dense": case(1, 512, 512, 8, 8, 64, mask=arr((1, 1, 512, 512), jnp.bool_)),
    "hv_192_128": case(2, 2048, 2048, 16, 16, 192, 128, is_causal=True),
    "hv_192_128_triton": case(1, 256, 256, 4, 4, 192, 128, backend="triton"),
    "few_tokens": case(1, 4, 8192, 32, 8, 128),
    "few_tokens_lengths_sinks": case(
        2,
        4,
        8192,
        32,
        8,
        128,
        is_causal=True,
        key_value_seq_lengths=arr((2,), jnp.int32),
        sinks=arr((32,), jnp.float32),
    ),
    "nondeterministic_add": case(1, 4096, 4096, 16, 16, 128, deterministic_grads=False),
    "fixed_8k": case(1, 8192, 8192, 16, 16, 128),
    "f32_triton_row_max": case(1, 300, 333, 4, 2, 64, dtype=jnp.float32, backend="triton"),
    "split_kv_sinks": case(1, 128, 8192, 2, 2, 128, sinks=arr((2,), jnp.float32)),
    "mosaic_softcap": case(2, 2048, 2048, 16, 16, 128, logits_soft_cap=20.0, backend="mosaic"),
}


def materialise(x):
    return jax.random.key(0) if x == "key" else x


def run(name, qkv, options, out: pathlib.Path, *, shard_map=False):
    arrays = {k: v for k, v in options.items() if isinstance(v, jax.ShapeDtypeStruct)}
    static = {k: materialise(v) for k, v in options.items() if k not in arrays}
    static.setdefault("scale", 0.125)
    names = list(arrays)

    def attention(q, k, v, *extra):
        return pallas_flash.flash_attention(
            q, k, v, **dict(zip(names, extra)), **static, return_residuals=True
        )

    if shard_map:
        inner = attention
        attention = lambda *a: jax.shard_map(  # noqa: E731
            inner, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=True
        )(*a)

    def fwd(q, k, v, *extra):
        return attention(q, k, v, *extra)

    def fwd_bwd(q, k, v, *extra):
        (o, lse), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *extra), q, k, v)
        return o, lse, *vjp((o, lse))

    for kind, fn in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
        modules.clear()
        with jax.sharding.use_abstract_mesh(MESH), capture():
            lowered = jax.jit(fn).trace(*qkv, *arrays.values()).lower(lowering_platforms=("cuda",))
        text = strip(lowered.as_text())
        kernels = "\n\n".join(modules)
        (out / f"{name}.{kind}.hlo.txt").write_text(text)
        (out / f"{name}.{kind}.kernels.txt").write_text(kernels)
        print(name, kind, len(text), len(modules), flush=True)


def backward_api(out: pathlib.Path):
    """flash_attention_backward (log_sum None) on the Mosaic backward."""
    q, k, v = arr((2, 2048, 16, 128)), arr((2, 2048, 16, 128)), arr((2, 2048, 16, 128))
    lse = arr((2, 16, 2048), jnp.float32)

    def fn(q, k, v, o, lse, do, dlse):
        return pallas_flash.flash_attention_backward(
            q, k, v, o, lse, do, dlse, scale=0.125, is_causal=True
        )

    modules.clear()
    with jax.sharding.use_abstract_mesh(MESH), capture():
        lowered = jax.jit(fn).trace(q, k, v, q, lse, q, lse).lower(lowering_platforms=("cuda",))
    (out / "backward_api.hlo.txt").write_text(strip(lowered.as_text()))
    (out / "backward_api.kernels.txt").write_text("\n\n".join(modules))
    print("backward_api", len(modules), flush=True)


MORE = {
    "causal_h256": case(1, 2048, 2048, 8, 8, 256, is_causal=True),
    "causal_h256_mosaic_window": case(
        1, 1500, 1700, 8, 4, 256, is_causal=True, local_window_size=(300, 0), backend="mosaic"
    ),
    "h64_mosaic_masks": case(
        2,
        1000,
        1200,
        8,
        2,
        64,
        backend="mosaic",
        local_window_size=(200, 50),
        logits_soft_cap=25.0,
        q_segment_ids=seg(2, 1000),
        kv_segment_ids=seg(2, 1200),
    ),
    "h64_mosaic_dropout_segments": case(
        2,
        1024,
        1024,
        8,
        8,
        64,
        backend="mosaic",
        dropout_rate=0.2,
        dropout_rng="key",
        q_segment_ids=seg(2, 1024),
        kv_segment_ids=seg(2, 1024),
    ),
    "h128_mosaic_sinks_gqa": case(
        2,
        2048,
        2048,
        16,
        2,
        128,
        backend="mosaic",
        is_causal=True,
        sinks=arr((16,), jnp.float32),
        logits_soft_cap=30.0,
    ),
    "h128_mosaic_lengths": case(
        2,
        999,
        1501,
        8,
        8,
        128,
        backend="mosaic",
        query_seq_lengths=arr((2,), jnp.int32),
        key_value_seq_lengths=arr((2,), jnp.int32),
    ),
    "h256_triton_bias_dropout": case(
        1,
        200,
        300,
        4,
        2,
        256,
        backend="triton",
        bias=arr((1, 4, 200, 300)),
        dropout_rate=0.1,
        dropout_rng="key",
    ),
    "h64_triton_window_softcap_f16": case(
        2,
        333,
        444,
        8,
        2,
        64,
        dtype=jnp.float16,
        backend="triton",
        local_window_size=(64, 32),
        logits_soft_cap=10.0,
        is_causal=True,
    ),
    "h128_triton_sinks_segments": case(
        2,
        256,
        256,
        4,
        4,
        128,
        backend="triton",
        sinks=arr((4,), jnp.float32),
        q_segment_ids=seg(2, 256),
        kv_segment_ids=seg(2, 256),
    ),
    "few_tokens_window_softcap": case(
        2,
        3,
        4096,
        16,
        4,
        64,
        local_window_size=(1000, 0),
        logits_soft_cap=20.0,
        is_causal=True,
    ),
}


def lower(name, fn, args, out: pathlib.Path):
    modules.clear()
    with jax.sharding.use_abstract_mesh(MESH), capture():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    (out / f"{name}.hlo.txt").write_text(strip(lowered.as_text()))
    (out / f"{name}.kernels.txt").write_text("\n\n".join(modules))
    print(name, len(modules), flush=True)


def fwd_and_bwd(name, attention, args, out):
    """attention(*args) -> tuple of outputs; lowered alone and with the vjp of args[:3]."""
    lower(f"{name}.fwd", attention, args, out)

    def fwd_bwd(*a):
        outs, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *a[3:]), *a[:3])
        return outs, vjp(outs)

    lower(f"{name}.fwdbwd", fwd_bwd, args, out)


def decode_cases(out, only):
    lengths = arr((2,), jnp.int32)
    q, kc, vc = arr((2, 1, 32, 128)), arr((2, 4096, 8, 128)), arr((2, 4096, 8, 128))
    cases = {
        "decode_plain": (
            lambda q, k, v, lens: pallas_flash.decode_attention(
                q, k, v, key_value_seq_lengths=lens, return_residuals=True
            ),
            (q, kc, vc, lengths),
        ),
        "decode_window_softcap_sinks": (
            lambda q, k, v, lens, sinks: pallas_flash.decode_attention(
                q,
                k,
                v,
                key_value_seq_lengths=lens,
                local_window_size=(512, 0),
                logits_soft_cap=30.0,
                sinks=sinks,
                return_residuals=True,
                scale=0.1,
            ),
            (
                arr((2, 4, 32, 64)),
                arr((2, 2048, 4, 64)),
                arr((2, 2048, 4, 64)),
                lengths,
                arr((32,), jnp.float32),
            ),
        ),
        "paged": (
            lambda q, kp, vp, tables, lens: pallas_flash.paged_attention(
                q, kp, vp, tables, lens, return_residuals=True
            ),
            (
                arr((2, 1, 16, 128)),
                arr((64, 64, 4, 128)),
                arr((64, 64, 4, 128)),
                arr((2, 32), jnp.int32),
                lengths,
            ),
        ),
        "ragged": (
            lambda q, kp, vp, tables, starts, lens: pallas_flash.ragged_paged_attention(
                q, kp, vp, tables, starts, lens, max_query_len=64, return_residuals=True
            ),
            (
                arr((80, 16, 128)),
                arr((64, 64, 4, 128)),
                arr((64, 64, 4, 128)),
                arr((3, 32), jnp.int32),
                arr((4,), jnp.int32),
                arr((3,), jnp.int32),
            ),
        ),
    }
    for name, (fn, args) in cases.items():
        if only in name:
            fwd_and_bwd(name, fn, args, out)


def triton_backward_api(out):
    q = arr((2, 300, 8, 64))
    kv = arr((2, 400, 4, 64))
    lse = arr((2, 8, 300), jnp.float32)

    def fn(q, k, v, o, lse, do, dlse, ls):
        return pallas_flash.flash_attention_backward(
            q,
            k,
            v,
            o,
            lse,
            do,
            dlse,
            scale=0.125,
            is_causal=True,
            log_sum=ls,
            backend="triton",
            local_window_size=(100, 0),
        )

    lower("triton_backward_api", fn, (q, kv, kv, q, lse, q, lse, lse), out)


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    for name, (qkv, options) in {**CASES, **MORE}.items():
        if only in name:
            run(name, qkv, options, out)
    if only in "shard_map_plain":
        qkv, options = CASES["plain_h128"]
        run("shard_map_plain", qkv, options, out, shard_map=True)
    if only in "shard_map_few_tokens":
        qkv, options = CASES["few_tokens_lengths_sinks"]
        run("shard_map_few_tokens", qkv, options, out, shard_map=True)
    if only in "shard_map_mosaic_masks":
        qkv, options = MORE["h64_mosaic_masks"]
        run("shard_map_mosaic_masks", qkv, options, out, shard_map=True)
    if only in "backward_api":
        backward_api(out)
    if only in "triton_backward_api":
        triton_backward_api(out)
    decode_cases(out, only)


if __name__ == "__main__":
    main()
