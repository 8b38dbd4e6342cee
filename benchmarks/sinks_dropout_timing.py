"""Quick timing of the sinks and dropout overheads on the H200 (about 90 s).

    python benchmarks/sinks_dropout_timing.py OUT.jsonl   (HS="64 128": head dims)

B=4, T=S=4096, N=16, bf16, H in (64, 128), causal and not, fwd and fwd+bwd. Cases: "plain"
(backend=None: the Mosaic kernels on Hopper), "sinks" (the same with sinks [N], whose gradient
is taken too in fwd+bwd), "triton", "triton_sinks", "dropout" (rate 0.1, backend=None: the
Mosaic kernels on Hopper) and "triton_dropout". Prints one JSON row per point and,
at the end, the ratios the goals name: sinks / plain and triton_sinks / triton (goal <= 1.03),
dropout / plain and triton_dropout / triton (goal <= 1.15).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.bench import attention_flops, make_inputs, median_ms

B, T, N = 4, 4096, 16


def timed(fn, pass_, with_sinks):
    """jit of (q, k, v, do, sinks) -> forward, or forward and backward (dsinks included)."""
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v, do, s: fn(q, k, v, s))

    def fwd_bwd(q, k, v, do, s):
        if with_sinks:
            _, vjp = jax.vjp(fn, q, k, v, s)
        else:
            _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, s), q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd)


def main():
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    rng = jax.random.key(7)
    drop = dict(dropout_rate=0.1, dropout_rng=rng)
    cases = {
        "plain": ({}, False),
        "sinks": ({}, True),
        "triton": (dict(backend="triton"), False),
        "triton_sinks": (dict(backend="triton"), True),
        "dropout": (drop, False),
        "triton_dropout": (dict(backend="triton", **drop), False),
    }
    ms_of = {}
    for h in [int(x) for x in __import__("os").environ.get("HS", "64 128").split()]:
        q, k, v, do = make_inputs(B, T, T, N, N, h, jnp.bfloat16)
        sinks = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
        for causal in (False, True):
            for pass_ in ("fwd", "fwd+bwd"):
                for name, (kw, with_sinks) in cases.items():

                    def fn(q, k, v, s, kw=kw, with_sinks=with_sinks):
                        return pallas_flash.flash_attention(
                            q, k, v, is_causal=causal, sinks=s if with_sinks else None, **kw
                        )

                    try:
                        ms = median_ms(
                            timed(fn, pass_, with_sinks), (q, k, v, do, sinks), repeats=3
                        )
                        tf = attention_flops(B, T, T, N, h, causal, pass_) / ms / 1e9
                        err = None
                    except Exception as e:  # noqa: BLE001
                        ms = tf = None
                        err = repr(e)[:300]
                    ms_of[(h, causal, pass_, name)] = ms
                    row = dict(
                        case=name, H=h, causal=causal, pass_=pass_, ms=ms, tflops=tf, error=err
                    )
                    print(json.dumps(row), flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
    print(
        "ratios (H, causal, pass): sinks/plain triton_sinks/triton dropout/plain "
        "triton_dropout/triton"
    )
    for h, causal, pass_, name in ms_of:
        if name != "plain":
            continue
        get = functools.partial(lambda *key: ms_of.get(key), h, causal, pass_)

        def ratio(a, b):
            return None if not (get(a) and get(b)) else round(get(a) / get(b), 3)

        print(
            h, causal, pass_, ratio("sinks", "plain"), ratio("triton_sinks", "triton"),
            ratio("dropout", "plain"), ratio("triton_dropout", "triton"),
        )  # fmt: skip


if __name__ == "__main__":
    main()
