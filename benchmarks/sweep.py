"""Tile sweep on the GPU: checks each BlockSizes candidate against the reference and times it.

Forward candidates are timed on the forward pass; backward candidates (dK/dV, then dQ, greedily)
on forward+backward with the best forward tiles. Prints the best per (head dim, causal) and writes
every measurement as JSONL. Usage: python benchmarks/sweep.py --out sweep.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import make_inputs, run_point
from pallas_flash.config import default_block_sizes

FWD = {  # (block_q, block_kv, num_warps, num_stages)
    64: [
        (128, 64, 4, 3),
        (128, 128, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 4),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 128, 8, 4),
    ],
    128: [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 4),
    ],
    256: [
        (64, 32, 4, 2),
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (128, 64, 8, 2),
        (128, 32, 8, 2),
        (64, 32, 4, 1),
        (32, 64, 4, 2),
        (128, 64, 8, 1),
    ],
}
DKV = {  # (block_q_dkv, block_kv_dkv, num_warps_dkv, num_stages_dkv)
    64: [
        (32, 128, 4, 3),
        (64, 128, 8, 3),
        (64, 64, 4, 3),
        (32, 64, 4, 3),
        (64, 128, 4, 2),
        (32, 128, 4, 5),
        (128, 128, 8, 2),
    ],
    128: [
        (64, 128, 8, 2),
        (32, 128, 4, 3),
        (64, 64, 4, 3),
        (32, 64, 4, 3),
        (64, 128, 8, 3),
        (64, 64, 8, 2),
        (128, 128, 8, 2),
    ],
    256: [
        (32, 64, 4, 1),
        (32, 64, 4, 2),
        (64, 64, 8, 1),
        (32, 32, 4, 2),
        (16, 64, 4, 2),
        (64, 64, 8, 2),
    ],
}
DQ = {  # (block_q_dq, block_kv_dq, num_warps_dq, num_stages_dq)
    64: [
        (128, 32, 4, 3),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (128, 64, 4, 2),
        (128, 128, 8, 2),
    ],
    128: [
        (128, 64, 8, 2),
        (128, 32, 4, 3),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
    ],
    256: [
        (64, 32, 4, 1),
        (64, 32, 4, 2),
        (64, 64, 8, 1),
        (32, 32, 4, 2),
        (64, 16, 4, 2),
        (128, 32, 8, 1),
    ],
}


def max_error(bs, h, causal):
    """Largest |kernel - reference| over out, dq, dk, dv at a small odd shape (bf16 inputs)."""
    q, k, v, do = make_inputs(2, 200, 333, 4, 2, h, jnp.bfloat16, seed=1)

    def grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    ours = jax.jit(
        lambda: grads(
            lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=causal, block_sizes=bs)
        )
    )()
    ref = jax.jit(
        lambda: grads(
            lambda q, k, v: pallas_flash.attention_reference(
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                is_causal=causal,
            )
        )
    )()
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for a, b in zip(ours, ref))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--out", default="sweep.jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    f = open(args.out, "a")
    best_all = {}
    for h in args.head_dims:
        n = 2048 // h
        b = max(1, 16384 // args.seq)
        for causal in (False, True):
            base = default_block_sizes(h, jnp.bfloat16, interpret=False)

            def measure(bs, pass_, label):
                row = run_point(
                    "pallas_flash",
                    b,
                    args.seq,
                    args.seq,
                    n,
                    n,
                    h,
                    jnp.bfloat16,
                    causal,
                    pass_,
                    block_sizes=bs,
                    repeats=args.repeats,
                )
                row.update(config=label, block_sizes=dataclasses.asdict(bs))
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(
                    f"H={h} causal={int(causal)} {pass_:7s} {label:24s} "
                    f"{row['tflops']} TFLOP/s {row.get('error', '')}",
                    flush=True,
                )
                return -1.0 if row["tflops"] is None else row["tflops"]

            def search(start, candidates, fields, pass_, tag):
                best, best_t = start, -1.0
                for values in candidates[h]:
                    bs = dataclasses.replace(start, **dict(zip(fields, values)))
                    t = measure(bs, pass_, f"{tag} " + "x".join(map(str, values)))
                    if t > best_t:
                        best, best_t = bs, t
                return best, best_t

            fwd_fields = ("block_q", "block_kv", "num_warps", "num_stages")
            best, fwd_t = search(base, FWD, fwd_fields, "fwd", "fwd")
            best, _ = search(best, DKV, tuple(f + "_dkv" for f in fwd_fields), "fwd+bwd", "dkv")
            best, bwd_t = search(best, DQ, tuple(f + "_dq" for f in fwd_fields), "fwd+bwd", "dq")
            cudnn = [
                run_point(
                    "cudnn",
                    b,
                    args.seq,
                    args.seq,
                    n,
                    n,
                    h,
                    jnp.bfloat16,
                    causal,
                    p,
                    repeats=args.repeats,
                )["tflops"]
                for p in ("fwd", "fwd+bwd")
            ]
            err = max_error(best, h, causal)
            best_all[(h, causal)] = (fwd_t, bwd_t, cudnn, err, best)
            f.write(
                json.dumps(
                    dict(
                        best=dataclasses.asdict(best),
                        H=h,
                        causal=causal,
                        fwd=fwd_t,
                        fwd_bwd=bwd_t,
                        cudnn=cudnn,
                        max_err=err,
                    )
                )
                + "\n"
            )
    f.close()
    print("\nbest per (head dim, causal): fwd, fwd+bwd TFLOP/s; cuDNN fwd, fwd+bwd; max err; tiles")
    for key, (fwd_t, bwd_t, cudnn, err, bs) in best_all.items():
        print(key, fwd_t, bwd_t, cudnn, f"{err:.3g}", bs)


if __name__ == "__main__":
    main()
