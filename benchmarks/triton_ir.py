"""Read the code the GPU would run, on a CPU: pallas_flash's kernels as Triton IR, TTGIR and PTX.

    python benchmarks/triton_ir.py --head-dim 128 --seq 4096 --out /tmp/ttir \
        [--causal] [--triton-python /path/to/venv-with-triton/bin/python]
        [--fixed-point-scales [--window LEFT,RIGHT]] [--decode CALL_JSON [--block-sizes JSON]]

Step 1 (this process, jax): lowers forward and backward for an abstract H200 (with
--fixed-point-scales the Mosaic backward's two Triton-lowered scale kernels instead, with
--decode the decode kernel of one call: MLA's latent cache, float8 caches, speculative rows) and
writes each kernel's Triton IR (TTIR, as Pallas emits it) with its num_warps / num_stages.
Step 2 (optional, a Python that has the `triton` package, e.g. `pip install triton==3.6.0` in a
scratch venv; not a dependency of the project): runs Triton's TTIR passes (XLA runs the same ones on
Pallas' module), compiles for sm_90a, runs ptxas -v, and prints per kernel the register count, spill
bytes, shared memory and counts of the instructions that matter (wgmma, their waits, ex2, cp.async,
TMA). The Triton in XLA is not the pip one: treat the output as a close reading, not the binary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_flash._passes import KernelConfig
from pallas_flash._vjp import flash_attention_kernels
from pallas_flash.masks import MaskArrays, MaskSpec
from pallas_flash.mosaic import fixed_point
from pallas_flash.triton.tiles import heuristic_block_sizes

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")

COMPILE = textwrap.dedent(
    """
    import json, os, re, subprocess, sys, triton
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for kernel in json.load(sys.stdin):
        ctx = ir.context(); ir.load_dialects(ctx); CUDABackend(target).load_dialects(ctx)
        mod = ir.parse_mlir_module(kernel["ttir"], ctx)
        pm = ir.pass_manager(ctx)  # the TTIR stage: triton.compile skips it for an IR file
        passes.common.add_inliner(pm); passes.ttir.add_rewrite_tensor_pointer(pm)
        passes.common.add_canonicalizer(pm); passes.ttir.add_combine(pm)
        passes.ttir.add_reorder_broadcast(pm); passes.common.add_cse(pm)
        passes.common.add_symbol_dce(pm); passes.ttir.add_loop_unroll(pm)
        pm.run(mod, "make_ttir")
        base = kernel["ttir"][: -len(".ttir")]
        open(base + ".opt.ttir", "w").write(str(mod))
        k = triton.compile(base + ".opt.ttir", target=target, options=dict(
            num_warps=kernel["num_warps"], num_stages=kernel["num_stages"]))
        ptx = k.asm["ptx"]
        open(base + ".ttgir", "w").write(k.asm["ttgir"])
        open(base + ".ptx", "w").write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", base + ".ptx", "-o", base + ".cubin"],
                              capture_output=True, text=True).stderr
        regs = re.search(r"Used (\\d+) registers", info)
        spills = re.search(r"(\\d+) bytes spill stores", info)
        row = dict(kernel=kernel["name"], warps=kernel["num_warps"], stages=kernel["num_stages"],
                   regs=int(regs.group(1)) if regs else None,
                   spill_bytes=int(spills.group(1)) if spills else None,
                   smem_kib=k.metadata.shared // 1024)
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass",
                               base + ".cubin"], capture_output=True, text=True).stdout
        open(base + ".sass", "w").write(sass)
        ops = re.findall(
            r"^\\s+/\\*[0-9a-f]{4}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_]*)", sass, re.M
        )
        row["sass"] = len(ops)
        for op in ("IMAD", "LOP3", "SHF", "ISETP", "IADD3", "SEL", "FSEL", "MUFU", "FFMA", "PRMT"):
            row["sass_" + op.lower()] = sum(o == op for o in ops)
        for key, pat in [("wgmma", "wgmma.mma_async"), ("wgmma_wait", "wgmma.wait_group"),
                         ("mma_sync", "mma.sync"), ("ex2", "ex2.approx"),
                         ("cp_async", "cp.async.cg"), ("tma", "cp.async.bulk.tensor"),
                         ("ffma", "fma.rn.f32"), ("fmul", "mul.f32"), ("fadd", "add.f32")]:
            row[key] = ptx.count(pat)
        print(json.dumps(row), flush=True)
    """
)


def capture_ttir(
    head_dim: int,
    seq: int,
    causal: bool,
    dtype,
    out: pathlib.Path,
    block_sizes,
    bias_shape=None,
    dropout_rate: float = 0.0,
):
    """Writes <out>/<kernel>.ttir for the forward, dK/dV and dQ kernels (and dBias with a bias
    of `bias_shape`, batch 2; with dropout at `dropout_rate`); returns [{name, ttir, num_warps,
    num_stages}] per kernel."""

    heads = max(1, 2048 // head_dim)
    batch = 1 if bias_shape is None else 2
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)
    bias = None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape, dtype)
    kernel_config = KernelConfig(
        spec=MaskSpec(q_len=seq, kv_len=seq, is_causal=causal),
        scale=head_dim**-0.5,
        block_sizes=block_sizes,
        interpret=False,
        dropout_rate=dropout_rate,
    )
    seeds = jax.ShapeDtypeStruct((batch, heads), jnp.int32) if dropout_rate else None

    def fwd_bwd(q, k, v, bias, d_out, d_lse, seeds):
        arrays = MaskArrays(dropout_seeds=seeds)
        (o, lse_), vjp = jax.vjp(
            lambda q, k, v, b: flash_attention_kernels(q, k, v, b, arrays, kernel_config),
            q,
            k,
            v,
            bias,
        )
        return o, lse_, *vjp((d_out, d_lse))

    return lowered_kernels(fwd_bwd, (q, q, q, bias, q, lse, seeds), out)


def capture_fixed_point_ttir(head_dim: int, seq: int, causal: bool, window, out: pathlib.Path):
    """The Triton-lowered kernels of the Mosaic backward's fixed-point scales
    (`mosaic.fixed_point`: per-key norms, per-row scales) for B x T = 16k tokens, N = 2048 / H,
    bf16, causal or not, a window (left, right) or None; as capture_ttir."""
    heads, batch = max(1, 2048 // head_dim), max(1, 16384 // seq)
    spec = MaskSpec(q_len=seq, kv_len=seq, is_causal=causal, window=window)
    x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)

    def scales(k, v, d_out, delta, lse):
        return fixed_point.fixed_point_scales(
            k, v, d_out, delta, lse, spec=spec, scale=head_dim**-0.5, rows_out=seq
        )

    return lowered_kernels(scales, (x, x, x, rows, rows), out)


def capture_decode_ttir(case: dict, out: pathlib.Path, block_sizes: dict | None):
    """The decode kernel (`triton.decode.decode_forward`, without the merge) of one call:
    case holds B, T, N, K, H, S and optionally hv (a shared latent cache's value columns),
    page (a page size; contiguous without) and fp8 (a float8_e4m3fn cache with per-head
    scales); block_sizes: DecodeBlockSizes fields (None: the call's defaults). As
    capture_ttir."""
    from pallas_flash.triton import DecodeBlockSizes
    from pallas_flash.triton.cache import CacheFormat
    from pallas_flash.triton.decode import decode_block_sizes, decode_forward

    sds = jax.ShapeDtypeStruct
    b, t, n, k, h, s = (case[x] for x in ("B", "T", "N", "K", "H", "S"))
    hv, page = case.get("hv"), case.get("page")
    cache = jnp.float8_e4m3fn if case.get("fp8") else jnp.bfloat16
    q = sds((b, t, n, h), jnp.bfloat16)
    keys = sds((b, s, k, h) if page is None else (b * s // page, page, k, h), cache)
    tables = None if page is None else sds((b, s // page), jnp.int32)
    scales = [sds((k,), jnp.float32)] * 2 if case.get("fp8") else []
    if block_sizes is None:
        fmt = CacheFormat(h, hv or h, shared=hv is not None, scaled=bool(scales))
        bs = decode_block_sizes(
            q.shape,
            k,
            s,
            jnp.bfloat16,
            interpret=False,
            page_size=page,
            fmt=fmt,
            cache_dtype=cache,
        )
    else:
        bs = DecodeBlockSizes(**block_sizes)
    print(bs, flush=True)

    def forward(q, keys, values, lengths, tables, *scales):
        kwargs = dict(zip(("k_scale", "v_scale"), scales))
        return decode_forward(
            q,
            keys,
            values,
            lengths,
            tables,
            scale=h**-0.5,
            soft_cap=None,
            window_left=None,
            block_sizes=bs,
            interpret=False,
            value_head_dim=hv,
            **kwargs,
        )

    args = (q, keys, None if hv else keys, sds((b,), jnp.int32), tables, *scales)
    return [k for k in lowered_kernels(forward, args, out) if not k["name"].endswith("merge")]


def lowered_kernels(fn, args, out: pathlib.Path):
    """fn lowered for an abstract H200: writes <out>/<kernel>.ttir for each Triton kernel in it;
    returns [{name, ttir, num_warps, num_stages}] per kernel."""
    modules = {}
    stock = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = stock(*args, **kwargs)
        asm = result.module.operation.get_asm()
        modules[re.search(r"module @(\w+)", asm).group(1)] = asm
        return result

    triton_lowering.lower_jaxpr_to_triton_module = capture
    try:
        mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
        with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = stock
    text = re.sub(r'ir = "[^"]*"', "ir = ...", lowered.as_text())
    kernels = []
    for backend_config in re.findall(r"mhlo\.backend_config = \{([^}]*)\}", text):
        name = re.search(r'name = "(\w+)"', backend_config).group(1)
        params = dict(re.findall(r"(num_warps|num_stages) = (\d+) : i32", backend_config))
        path = out / f"{name}.ttir"
        path.write_text(modules[name])
        kernels.append(
            dict(
                name=name,
                ttir=str(path),
                num_warps=int(params["num_warps"]),
                num_stages=int(params["num_stages"]),
            )
        )
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default="/tmp/pallas_flash_ttir")
    parser.add_argument("--triton-python", help="a Python with the triton package, for step 2")
    parser.add_argument("--bias-shape", help="e.g. 1,16,4096,4096: add a bias (batch 2)")
    parser.add_argument("--dropout-rate", type=float, default=0.0)
    parser.add_argument(
        "--fixed-point-scales",
        action="store_true",
        help="the Mosaic backward's fixed-point scale kernels instead (B x T = 16k, bf16)",
    )
    parser.add_argument("--window", help="with --fixed-point-scales: LEFT,RIGHT")
    parser.add_argument(
        "--block-sizes",
        help="JSON of BlockSizes fields over the H200 defaults, e.g. '{\"block_kv\": 64}' "
        "(with --decode: DecodeBlockSizes fields, instead of the call's defaults)",
    )
    parser.add_argument(
        "--decode",
        help="the decode kernel instead, for a call given as JSON: B, T, N, K, H, S [, hv, "
        'page, fp8], e.g. MLA\'s \'{"B": 64, "T": 1, "N": 128, "K": 1, "H": '
        '576, "hv": 512, "S": 4096, "page": 64}\'',
    )
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(args.dtype)
    bias_shape = tuple(int(x) for x in args.bias_shape.split(",")) if args.bias_shape else None
    bs = heuristic_block_sizes(args.head_dim, dtype, masked=bias_shape is not None)
    if args.block_sizes and not args.decode:
        bs = dataclasses.replace(bs, **json.loads(args.block_sizes))
    if args.decode:
        block_sizes = json.loads(args.block_sizes) if args.block_sizes else None
        kernels = capture_decode_ttir(json.loads(args.decode), out, block_sizes)
    elif args.fixed_point_scales:
        window = tuple(int(x) for x in args.window.split(",")) if args.window else None
        kernels = capture_fixed_point_ttir(args.head_dim, args.seq, args.causal, window, out)
    else:
        print(bs, flush=True)
        kernels = capture_ttir(
            args.head_dim, args.seq, args.causal, dtype, out, bs, bias_shape, args.dropout_rate
        )
    for k in kernels:
        print(f"wrote {k['ttir']} (num_warps={k['num_warps']}, num_stages={k['num_stages']})")
    if args.triton_python:
        subprocess.run(
            [args.triton_python, "-c", COMPILE], input=json.dumps(kernels), text=True, check=True
        )


if __name__ == "__main__":
    sys.exit(main())
