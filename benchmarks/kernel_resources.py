"""What ptxas made of the Mosaic GPU kernels: registers, spills and SASS instruction counts.

    python benchmarks/kernel_resources.py OUT_DIR [CASE ...]     (on the GPU; default: all cases)

Each case compiles one call's forward and backward in a child process with Mosaic GPU's dump
switches on (MOSAIC_GPU_DUMP_PTXAS, MOSAIC_GPU_DUMP_SASS: jaxlib prints ptxas' verbose report and
nvdisasm's listing of each kernel to stdout). The parent keeps each child's raw output in
OUT_DIR/CASE.txt and writes one JSON row per kernel to OUT_DIR/resources.jsonl: the case, the
kernel, ptxas' register count, spill stores and loads (bytes), and counts of SASS opcodes (the
spill traffic LDL/STL, MUFU, HGMMA, integer and float ALU groups). The counts are static
(instructions in the binary, not executed): they compare two versions of a kernel, or a kernel
with an option and without it.
"""

import collections
import json
import os
import re
import subprocess
import sys

# (B, T, S, N, K, H, kwargs): the calls whose kernels are read (bf16).
CASES = {
    "h128": (4, 4096, 4096, 16, 16, 128, {}),
    "h128-causal": (4, 4096, 4096, 16, 16, 128, dict(is_causal=True)),
    "h128-dropout": (4, 4096, 4096, 16, 16, 128, dict(dropout_rate=0.1)),
    "h64": (4, 4096, 4096, 32, 32, 64, {}),
    "h64-causal": (4, 4096, 4096, 32, 32, 64, dict(is_causal=True)),
    "h64-dropout": (4, 4096, 4096, 32, 32, 64, dict(dropout_rate=0.1)),
    "h128-cap": (2, 8192, 8192, 16, 16, 128, dict(is_causal=True, logits_soft_cap=30.0)),
    "gemma2": (1, 8192, 8192, 16, 8, 256, dict(is_causal=True, logits_soft_cap=50.0)),
    # H=64 16k: the forward's 128-row consumers (they spilled with Q's descriptors held:
    # docs/notes/forward.md, "What limits the forward"), the backward's dQ in the dK/dV kernel
    # ("fixed").
    "h64-16k": (1, 16384, 16384, 32, 32, 64, {}),
    # kwargs "tiles": the Mosaic forward and the Mosaic backward with these BackwardTiles
    # fields, dQ in the dK/dV kernel (`BackwardTiles.fused_dq`) or descriptors rebuilt each
    # step (`BackwardTiles.step_descriptors`).
    "h128-add": (4, 4096, 4096, 16, 16, 128, dict(tiles=dict(fused_dq="add"))),
    "h128-causal-add": (
        4, 4096, 4096, 16, 16, 128, dict(is_causal=True, tiles=dict(fused_dq="add"))
    ),
    "h128-fixed": (4, 4096, 4096, 16, 16, 128, dict(tiles=dict(fused_dq="fixed"))),
    "h128-causal-fixed": (
        4, 4096, 4096, 16, 16, 128, dict(is_causal=True, tiles=dict(fused_dq="fixed"))
    ),
    "h64-fixed": (4, 4096, 4096, 32, 32, 64, dict(tiles=dict(fused_dq="fixed"))),
    "h128-step": (4, 4096, 4096, 16, 16, 128, dict(tiles=dict(step_descriptors=True))),
    "h128-causal-fixed-step": (
        4, 4096, 4096, 16, 16, 128,
        dict(is_causal=True, tiles=dict(fused_dq="fixed", step_descriptors=True)),
    ),
    "h128-fixed-step": (
        4, 4096, 4096, 16, 16, 128, dict(tiles=dict(fused_dq="fixed", step_descriptors=True))
    ),
    # The dQ kernel's producer cleaning masked K tiles at 24 registers (does it spill?).
    "h128-causal-clean": (
        4, 4096, 4096, 16, 16, 128, dict(is_causal=True, tiles=dict(producer_cleans_k=True))
    ),
    # kwargs "forward_tiles": the Mosaic forward alone with these ForwardTiles fields: H=64's
    # 128-row persistent consumers, Q's descriptors held or rebuilt each KV step.
    "h64-16k-fwd128": (
        1, 16384, 16384, 32, 32, 64,
        dict(forward_tiles=dict(block_q=128, block_kv=128, persistent=True)),
    ),
    "h64-16k-fwd128-step": (
        1, 16384, 16384, 32, 32, 64,
        dict(
            forward_tiles=dict(block_q=128, block_kv=128, persistent=True, step_descriptors=True)
        ),
    ),
    # kwargs "ragged": ragged_paged_attention's prefill launch (the Mosaic kernel on Hopper) for
    # B prompts of T new tokens over S keys (a cached prefix of S - T) in pages of this many
    # keys, shuffled; the Triton decode launch beside it.
    "ragged-page16": (4, 2048, 2048, 32, 8, 128, dict(ragged=16)),
    "ragged-page128": (4, 2048, 2048, 32, 8, 128, dict(ragged=128)),
    "ragged-prefix-page16": (1, 2048, 4096, 32, 8, 128, dict(ragged=16)),
}  # fmt: skip

# SASS opcode groups counted (by the opcode's first word, before any '.').
GROUPS = {
    "spill": ("LDL", "STL"),
    "mufu": ("MUFU",),
    "hgmma": ("HGMMA",),
    "int": ("IMAD", "IADD3", "ISETP", "LOP3", "SHF", "LEA", "IMNMX", "PRMT", "SEL"),
    "float": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "F2FP", "F2F", "I2F", "F2I"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "sync": ("BAR", "SYNCS", "WARPGROUP", "DEPBAR", "WARPSYNC"),
}


def _with_nvdisasm():
    """Point Mosaic GPU's tools at a CUDA root that has nvdisasm: jax's (pip's nvcc, if any:
    ptxas, no nvdisasm; on the device image it reads "None") with the system's nvdisasm linked
    beside its tools."""
    import shutil

    import jax.experimental.mosaic.gpu  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT)

    root = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "")
    nvdisasm = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    if os.path.exists(os.path.join(root, "bin", "nvdisasm")) or not os.path.exists(nvdisasm):
        return
    merged = f"/tmp/kernel_resources_cuda_{os.getpid()}"
    os.makedirs(os.path.join(merged, "bin"), exist_ok=True)
    if os.path.isdir(root):
        for entry in os.listdir(root):
            if entry != "bin":
                os.symlink(os.path.join(root, entry), os.path.join(merged, entry))
        for tool in os.listdir(os.path.join(root, "bin")) if os.path.isdir(root + "/bin") else ():
            os.symlink(os.path.join(root, "bin", tool), os.path.join(merged, "bin", tool))
    os.symlink(nvdisasm, os.path.join(merged, "bin", "nvdisasm"))
    os.environ["MOSAIC_GPU_CUDA_ROOT"] = merged


def compile_case(name):
    """Child: compile the case's forward and backward (the dumps go to stdout)."""
    import functools

    import jax
    import jax.numpy as jnp

    import pallas_flash
    from pallas_flash.bench import make_inputs, timed_fn

    _with_nvdisasm()

    b, t, s, n, k, h, kwargs = CASES[name]
    if "ragged" in kwargs:
        page = kwargs["ragged"]
        pages = b * (-(-s // page))
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b * t, n, h), jnp.bfloat16)
        kp, vp = (jax.random.normal(x, (pages, page, k, h), jnp.bfloat16) for x in keys[1:])
        tables = jax.random.permutation(keys[0], pages).reshape(b, -1).astype(jnp.int32)
        starts = jnp.arange(b + 1, dtype=jnp.int32) * t
        lengths = jnp.full((b,), s, jnp.int32)
        call = jax.jit(pallas_flash.ragged_paged_attention)
        call.lower(q, kp, vp, tables, starts, lengths).compile()
        return
    if kwargs.get("dropout_rate"):
        kwargs = dict(kwargs, dropout_rng=jax.random.key(0))
    q, kk, v, do = make_inputs(b, t, s, n, k, h, jnp.bfloat16)
    if "forward_tiles" in kwargs:
        from experiment_families.common import mosaic_forward_call

        from pallas_flash.mosaic import ForwardTiles

        tiles = ForwardTiles(**kwargs["forward_tiles"])
        fn = functools.partial(mosaic_forward_call, scale=h**-0.5, is_causal=False, tiles=tiles)
        timed_fn(lambda q, k, v: fn(q, k, v)[0], "fwd").lower(q, kk, v, do).compile()
        return
    if "tiles" in kwargs:
        from experiment_families.mosaic_backward import mosaic_attention

        from pallas_flash.mosaic import BackwardTiles

        tiles = BackwardTiles(**kwargs["tiles"])
        fn = mosaic_attention(tiles, scale=h**-0.5, is_causal=kwargs.get("is_causal", False))
    else:
        fn = functools.partial(pallas_flash.flash_attention, **kwargs)
    timed_fn(fn, "fwd+bwd").lower(q, kk, v, do).compile()


def parse(text):
    """Rows of one child's output: per kernel, ptxas' numbers and the SASS opcode counts."""
    kernels = collections.OrderedDict()
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {"kernel": m.group(1)})
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
        m = re.search(r"stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = re.match(r"\.text\.(\S+):$", line)
        if m:
            current = kernels.setdefault(m.group(1), {"kernel": m.group(1)})
            current.setdefault("sass", collections.Counter())
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and current is not None and "sass" in current:
            current["sass"][m.group(1)] += 1
    rows = []
    for row in kernels.values():
        sass = row.pop("sass", collections.Counter())
        row["instructions"] = sum(sass.values())
        for group, ops in GROUPS.items():
            row[group] = sum(sass[op] for op in ops)
        row["top"] = dict(sass.most_common(12))
        rows.append(row)
    return rows


def compile_in_children(out_dir, jobs, out):
    """Runs each job (log name, command, row fields) in a child process, side by side, with
    Mosaic GPU's dump switches on; writes one JSON row per kernel of each child's output to out
    (the fields, then `parse`'s), its raw output to OUT_DIR/LOG.txt."""
    # The children share one GPU: none may take most of its memory up front (four or more
    # with jax's preallocation ran out of it in session26-call4).
    env = dict(
        os.environ,
        MOSAIC_GPU_DUMP_PTXAS="1",
        MOSAIC_GPU_DUMP_SASS="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    children = []
    for log_name, cmd, fields in jobs:
        log = open(os.path.join(out_dir, f"{log_name}.txt"), "w")
        child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        children.append((log_name, child, log, fields))
    for log_name, child, log, fields in children:
        rc = child.wait()
        log.close()
        with open(log.name) as f:
            rows = parse(f.read())
        if rc or not rows:
            print(f"{log_name}: rc {rc}, {len(rows)} kernels (see {log.name})", flush=True)
        for row in rows:
            row = dict(fields, **row)
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
            out.write(json.dumps(row) + "\n")


def main():
    if sys.argv[1] == "--child":
        compile_case(sys.argv[2])
        return
    out_dir, *names = sys.argv[1:]
    os.makedirs(out_dir, exist_ok=True)
    jobs = [
        (name, [sys.executable, __file__, "--child", name], dict(case=name))
        for name in names or list(CASES)
    ]
    with open(os.path.join(out_dir, "resources.jsonl"), "w") as out:
        compile_in_children(out_dir, jobs, out)


if __name__ == "__main__":
    main()
