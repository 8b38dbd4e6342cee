"""Continuous batching with chunked prefill over one paged KV cache: a serving loop.

    python examples/serve.py --check   # tiny random GPT, 8 requests (CPU: the interpreter, ~10 s)
    python examples/serve.py --preset gpt3-1.3b --requests 128 --min-prompt 128 \\
        --max-prompt 2048 --min-new 32 --max-new 256 --max-batch 64 \\
        --max-tokens-per-step 2048 --buckets 64,512,2048                 # on a GPU

vLLM's scheduler reduced to its essentials, on the GPT of train_gpt.py (random weights). The
requests, of different prompt and output lengths, arrive together. Each engine step builds one
ragged batch under a token budget (--max-tokens-per-step): every running request that has its
first token brings its last one (a decode step), then requests still in their prompt bring the
next chunk of it (chunked prefill), then waiting requests are admitted, first come first served,
while a batch slot and the pages for their whole length are free (a request's pages are
reserved when it is admitted, so nothing is ever preempted). In each layer the step's keys and
values go into the page pool (`pallas_flash.write_to_pages`, one token per row) and ONE
`pallas_flash.ragged_paged_attention` call attends the whole mixed batch. The step samples
greedily at the last token of each sequence; finished requests leave and free their pages.

The step is one jit-compiled function of static shapes: the tokens padded to a bucket (--buckets;
by default powers of two up to the budget; padding rows attend nothing and write nothing),
--max-batch sequences, tables of a fixed width. Every bucket compiles before the clock starts;
the report counts the compiles (one per bucket when nothing recompiles while serving).

--check runs each request alone through the model's full causal forward (XLA attention, no
cache, float32 at full matmul precision) over its prompt and generated tokens, and exits 1
unless every generated token is that forward's greedy choice (within --check-tol of its top
logit; 0: exactly).

Prints one line "summary {json}": tokens/s, time to first token (from the burst's arrival:
queueing included), time per output token, steps, compiles, the check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (qkv and finish: a block's halves around its attention)
import train_gpt  # noqa: E402  (the model and its presets)

import pallas_flash  # noqa: E402
from pallas_flash.device import gpu_compute_capability  # noqa: E402


@dataclasses.dataclass
class Request:
    rid: int
    prompt: np.ndarray  # int32 tokens
    max_new: int
    slot: int = -1  # its row in the batch (and in the block tables) while running
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in its pages
    output: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # kept for --check
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def length(self) -> int:
        """Tokens it ever writes to the cache: its last generated token is never fed back."""
        return len(self.prompt) + self.max_new - 1

    def next_tokens(self) -> np.ndarray:
        """The tokens it brings to the next step, all of them (the scheduler may cut a chunk
        short): the rest of its prompt, or its last generated token."""
        if self.cached < len(self.prompt):
            return self.prompt[self.cached :]
        return np.asarray(self.output[-1:], np.int32)


def buckets_for(budget: int, smallest: int = 8) -> list[int]:
    """Padded token counts: powers of two from `smallest`, and the budget itself."""
    sizes, size = [], smallest
    while size < budget:
        sizes.append(size)
        size *= 2
    return [*sizes, budget]


class Engine:
    """A page pool per layer, a free-page allocator, a block table row per batch slot, and the
    jit-compiled step over one ragged batch."""

    def __init__(
        self,
        model: train_gpt.GPT,
        *,
        max_batch: int,
        page_size: int,
        num_pages: int,
        max_pages: int,
        budget: int,
        buckets: list[int],
        attention_kwargs: dict,
        keep_logits: bool = False,
    ):
        cfg = model.blocks[0].cfg
        head_dim = model.blocks[0].head_dim
        dtype = model.embed.dtype
        self.graphdef, self.state = nnx.split(model)
        shape = (num_pages, page_size, cfg.kv_heads, head_dim)
        self.pages = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in model.blocks]
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self.slots: list[Request | None] = [None] * max_batch
        # Entries past a sequence's pages are never read (its length bounds them); 0 is a page
        # of the pool, so no entry ever names one outside it.
        self.tables = np.zeros((max_batch, max_pages), np.int32)
        self.page_size, self.num_pages, self.budget = page_size, num_pages, budget
        self.buckets = sorted(buckets)
        if self.buckets[-1] < budget:
            raise ValueError(f"buckets {buckets} must reach the token budget {budget}")
        self.keep_logits = keep_logits
        self.traces = 0
        graphdef = self.graphdef

        def step(state, pages, tokens, positions, token_slots, counts, tables, starts, lengths):
            self.traces += 1  # once per compile: jit traces each new shape once
            model = nnx.merge(graphdef, state)
            x = model.embed(tokens[None])  # [1, T, D]: the step's tokens, concatenated
            token_tables = tables[token_slots]  # [T, max_pages]: each token's sequence's row
            new_pages = []
            for block, (k_pages, v_pages) in zip(model.blocks, pages, strict=True):
                q, k, v = generate.qkv(block, x, positions)  # rotary at each token's position
                # One "sequence" of one token per row: token t goes to positions[t] of its
                # sequence's table; padding rows (counts 0) write nothing.
                k_pages, v_pages = pallas_flash.write_to_pages(
                    k_pages, v_pages, token_tables, k[0, :, None], v[0, :, None], positions,
                    counts=counts,
                )  # fmt: skip
                attn = pallas_flash.ragged_paged_attention(
                    q[0], k_pages, v_pages, tables, starts, lengths, **attention_kwargs
                )
                x = generate.finish(block, x, attn[None])
                new_pages.append((k_pages, v_pages))
            last = jnp.clip(starts[1:] - 1, 0, tokens.shape[0] - 1)  # each sequence's last row
            logits = model.embed.attend(model.ln(x[0, last])).astype(jnp.float32)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, new_pages

        self._step = jax.jit(step, donate_argnums=(1,))

    # -- the scheduler ----------------------------------------------------------------------------

    def pages_for(self, request: Request) -> int:
        return -(-request.length // self.page_size)

    def schedule(self, waiting: list[Request]) -> tuple[list[tuple[Request, int]], bool]:
        """This step's (request, new tokens) in slot order, admitting from `waiting` (FIFO);
        and whether the head of the queue found a free slot but not enough free pages."""
        budget = self.budget
        running = sorted((r for r in self.slots if r is not None), key=lambda r: r.rid)
        decoding = [r for r in running if r.cached >= len(r.prompt)]
        prefilling = [r for r in running if r.cached < len(r.prompt)]
        chosen = {}
        for r in decoding + prefilling:  # decode steps first: each takes one token
            n = min(len(r.next_tokens()), budget)
            if n:
                chosen[r.rid], budget = n, budget - n
        waits_for_pages = False
        while waiting and budget and None in self.slots:
            r = waiting[0]
            if self.pages_for(r) > len(self.free):
                waits_for_pages = True
                break
            waiting.pop(0)
            r.slot = self.slots.index(None)
            self.slots[r.slot] = r
            r.pages = [self.free.pop() for _ in range(self.pages_for(r))]
            self.tables[r.slot] = 0
            self.tables[r.slot, : len(r.pages)] = r.pages
            n = min(len(r.prompt), budget)
            chosen[r.rid], budget = n, budget - n
        batch = [(r, chosen[r.rid]) for r in self.slots if r is not None and r.rid in chosen]
        return batch, waits_for_pages

    def retire(self, request: Request):
        self.free.extend(reversed(request.pages))
        self.slots[request.slot] = None
        self.tables[request.slot] = 0
        request.slot, request.pages = -1, []

    # -- one step ---------------------------------------------------------------------------------

    def inputs(self, batch: list[tuple[Request, int]], bucket: int) -> tuple:
        """The step's arrays, padded to `bucket` tokens (padding rows: token 0 at position 0 of
        slot 0, written nowhere, owned by no sequence)."""
        max_batch = len(self.slots)
        tokens = np.zeros(bucket, np.int32)
        positions = np.zeros(bucket, np.int32)
        token_slots = np.zeros(bucket, np.int32)
        counts = np.zeros(bucket, np.int32)
        q_lens = np.zeros(max_batch, np.int32)
        lengths = np.zeros(max_batch, np.int32)  # sequences with no new token: 0 keys, no work
        for r, n in batch:
            q_lens[r.slot] = n
            lengths[r.slot] = r.cached + n
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        for r, n in batch:
            rows = slice(starts[r.slot], starts[r.slot] + n)
            tokens[rows] = r.next_tokens()[:n]
            positions[rows] = np.arange(r.cached, r.cached + n)
            token_slots[rows] = r.slot
            counts[rows] = 1
        return tokens, positions, token_slots, counts, self.tables.copy(), starts, lengths

    def run_step(self, arrays: tuple):
        next_tokens, logits, self.pages = self._step(self.state, self.pages, *arrays)
        return next_tokens, logits

    def warm_up(self):
        """Compiles the step for every bucket on a batch of padding only (nothing written)."""
        for bucket in self.buckets:
            next_tokens, _ = self.run_step(self.inputs([], bucket))
            next_tokens.block_until_ready()

    def serve(self, requests: list[Request]) -> dict:
        """Runs the requests to completion (all arrive at once); returns the loop's counts."""
        for r in requests:
            if self.pages_for(r) > self.num_pages or self.pages_for(r) > self.tables.shape[1]:
                raise ValueError(
                    f"request {r.rid} needs {self.pages_for(r)} pages of {self.page_size} keys: "
                    f"more than the pool's {self.num_pages} or a table row's "
                    f"{self.tables.shape[1]}"
                )
        waiting = list(requests)
        stats = dict(steps=0, mixed_steps=0, waits_for_pages=0, peak_pages=0, tokens=0)
        chunked = set()  # requests whose prompt took more than one step
        start = time.perf_counter()
        while waiting or any(self.slots):
            batch, waits = self.schedule(waiting)
            stats["peak_pages"] = max(stats["peak_pages"], self.num_pages - len(self.free))
            total = sum(n for _, n in batch)
            bucket = next(b for b in self.buckets if b >= total)
            next_tokens, logits = self.run_step(self.inputs(batch, bucket))
            next_tokens = np.asarray(next_tokens)  # waits for the step
            if self.keep_logits:
                logits = np.asarray(logits)
            now = time.perf_counter() - start
            kinds = {r.cached >= len(r.prompt) for r, _ in batch}
            stats["steps"] += 1
            stats["mixed_steps"] += len(kinds) == 2
            stats["waits_for_pages"] += waits
            stats["tokens"] += total
            for r, n in batch:
                r.cached += n
                if r.cached < len(r.prompt):
                    chunked.add(r.rid)
                    continue  # a prefill chunk that leaves some prompt: nothing to sample yet
                r.output.append(int(next_tokens[r.slot]))
                if self.keep_logits:
                    r.logits.append(logits[r.slot])
                if r.first_token_s is None:
                    r.first_token_s = now
                if len(r.output) == r.max_new:
                    r.finish_s = now
                    self.retire(r)
        stats["seconds"] = time.perf_counter() - start
        stats["chunked_prompts"] = len(chunked)
        return stats


# -- the check: each request alone, through the full forward ---------------------------------------


def check(model: train_gpt.GPT, cfg, requests: list[Request], tol: float) -> dict:
    """Each request alone through the model's full causal forward (float32, XLA attention, no
    cache, full matmul precision) over its prompt and its generated tokens but the last: the
    logits that predict each generated token. A token passes where it is that forward's greedy
    choice, or within `tol` of it (its logit at most tol below the top one). Teacher forcing
    judges every token on the engine's prefix: all pass iff the engine's tokens are what greedy
    decoding of the request alone gives (up to near ties within tol)."""
    oracle = train_gpt.GPT(cfg, train_gpt.attention_fn("xla", False), jnp.float32, nnx.Rngs(0))
    nnx.update(oracle, nnx.state(model))  # the same weights, computed in float32
    graphdef, state = nnx.split(oracle)
    width = max(r.length for r in requests)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
    tokens = exact = near = wrong = 0
    failures, max_diff, min_gap = [], 0.0, math.inf
    with jax.default_matmul_precision("highest"):
        for r in requests:
            seq = np.zeros(width, np.int32)  # padded at the end: causal, so moot
            fed = np.concatenate([r.prompt, np.asarray(r.output[:-1], np.int32)])
            seq[: len(fed)] = fed
            logits = np.asarray(forward(state, seq[None]))[len(r.prompt) - 1 : len(fed)]
            out = np.asarray(r.output)
            below = logits.max(axis=-1) - logits[np.arange(len(out)), out]
            tokens += len(out)
            exact += int((logits.argmax(axis=-1) == out).sum())
            near += int(((below <= tol) & (logits.argmax(axis=-1) != out)).sum())
            top2 = np.sort(logits, axis=-1)[:, -2:]
            min_gap = min(min_gap, float((top2[:, 1] - top2[:, 0]).min()))
            bad = np.flatnonzero(below > tol)
            wrong += bad.size
            if bad.size:
                first = int(bad[0])
                failures.append(dict(request=r.rid, token=first, below_top=float(below[first])))
            if r.logits:
                max_diff = max(max_diff, float(np.abs(np.stack(r.logits) - logits).max()))
    return dict(
        requests=len(requests),
        tokens=tokens,
        exact=exact,
        near_ties=near,
        wrong=wrong,
        failures=failures[:5],  # each failing request's first wrong token
        # Engine against oracle logits at the sampled rows; the oracle's closest top-2 call.
        max_logit_diff=round(max_diff, 6),
        min_top2_gap=round(min_gap, 6),
        ok=not failures,
    )


def make_requests(args, vocab: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    data = train_gpt.corpus_bytes(1 << 16).astype(np.int32) % vocab
    requests = []
    for rid in range(args.requests):
        n = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        at = int(rng.integers(0, len(data) - n))
        new = int(rng.integers(args.min_new, args.max_new + 1))
        requests.append(Request(rid, np.asarray(data[at : at + n], np.int32), new))
    return requests


def percentile_ms(values, q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 3)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=list(train_gpt.PRESETS), default="tiny")
    parser.add_argument("--kv-heads", type=int, help="GQA: key/value heads (default: all)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=5)
    parser.add_argument("--max-prompt", type=int, default=40)
    parser.add_argument("--min-new", type=int, default=4, help="generated tokens, at least 1")
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=4, help="sequences in a step, at most")
    parser.add_argument(
        "--max-tokens-per-step", type=int, default=32, help="the step's token budget"
    )
    parser.add_argument(
        "--buckets",
        help="the step's padded token counts, comma-separated, the largest at least the "
        "budget: one compile each (default: powers of two from 8, and the budget)",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--pages",
        type=int,
        help="the pool's pages (default: enough for --max-batch of the longest requests)",
    )
    parser.add_argument(
        "--attention",
        choices=["pallas_flash", "xla"],
        default="pallas_flash",
        help="pallas_flash: ragged_paged_attention's Triton kernel (on a CPU in the Pallas "
        "interpreter); xla: its reference in plain jnp (backend='xla')",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="default: bfloat16 on a GPU, float32 elsewhere; float32 runs every matmul at full "
        "precision (no TF32)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with each request alone")
    parser.add_argument(
        "--check-tol",
        type=float,
        default=0.0,
        help="a generated token passes within this of the check's top logit (default 0: exact)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_new <= args.max_new:
        parser.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-new <= --max-new")
    if min(args.requests, args.max_batch, args.max_tokens_per_step, args.page_size) < 1:
        parser.error("--requests, --max-batch, --max-tokens-per-step, --page-size must be >= 1")

    try:
        buckets = [int(x) for x in args.buckets.split(",")] if args.buckets else None
    except ValueError:
        parser.error(f"--buckets {args.buckets}: expected comma-separated integers")
    buckets = buckets or buckets_for(args.max_tokens_per_step)
    if min(buckets) < 1 or max(buckets) < args.max_tokens_per_step:
        parser.error(f"--buckets {args.buckets}: each >= 1, the largest >= --max-tokens-per-step")

    cfg = train_gpt.PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, kv_heads=args.kv_heads or cfg.kv_heads)
    on_gpu = (gpu_compute_capability() or (0, 0)) >= (8, 0)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    if args.attention == "xla":
        attention_kwargs, path = dict(backend="xla"), "xla"
    elif on_gpu:
        attention_kwargs, path = {}, "triton"
    else:  # on a CPU the kernel runs in the Pallas interpreter
        attention_kwargs, path = dict(interpret=True), "triton (Pallas interpreter)"

    model = train_gpt.GPT(cfg, train_gpt.attention_fn("xla", False), dtype, nnx.Rngs(args.seed))
    requests = make_requests(args, cfg.vocab)
    max_pages = -(-(args.max_prompt + args.max_new - 1) // args.page_size)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        page_size=args.page_size,
        num_pages=args.pages or args.max_batch * max_pages,
        max_pages=max_pages,
        budget=args.max_tokens_per_step,
        buckets=buckets,
        attention_kwargs=attention_kwargs,
        keep_logits=args.check,
    )
    precision = "highest" if dtype == jnp.float32 else None
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        start = time.perf_counter()
        engine.warm_up()
        compile_s = time.perf_counter() - start
        stats = engine.serve(requests)
    compiles = engine.traces

    ttft = [r.first_token_s for r in requests]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in requests if r.max_new > 1]
    outputs = sum(len(r.output) for r in requests)
    where = jax.devices()[0].device_kind
    summary = dict(
        preset=args.preset,
        layers=cfg.layers,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        dtype=str(dtype),
        attention=path,
        device=where,
        requests=len(requests),
        prompt_tokens=int(sum(len(r.prompt) for r in requests)),
        output_tokens=outputs,
        max_batch=args.max_batch,
        max_tokens_per_step=args.max_tokens_per_step,
        page_size=args.page_size,
        pages=engine.num_pages,
        peak_pages=stats["peak_pages"],
        waits_for_pages=stats["waits_for_pages"],
        buckets=engine.buckets,
        steps=stats["steps"],
        mixed_steps=stats["mixed_steps"],
        chunked_prompts=stats["chunked_prompts"],
        compiles=compiles,
        compile_s=round(compile_s, 3),
        seconds=round(stats["seconds"], 4),
        output_tokens_per_s=round(outputs / stats["seconds"], 1),
        tokens_per_s=round(stats["tokens"] / stats["seconds"], 1),  # prompt and decode tokens
        ttft_ms_mean=round(float(np.mean(ttft)) * 1e3, 3),
        ttft_ms_p50=percentile_ms(ttft, 50),
        ttft_ms_max=percentile_ms(ttft, 100),
        tpot_ms_mean=round(float(np.mean(tpot)) * 1e3, 3) if tpot else None,
        check=check(model, cfg, requests, args.check_tol) if args.check else None,
    )
    print(
        f"GPT {args.preset} ({cfg.layers} layers, {cfg.heads} heads, {cfg.kv_heads} kv, {dtype}) "
        f"on {where}, attention {path}: {len(requests)} requests, {summary['steps']} steps",
        flush=True,
    )
    print("summary " + json.dumps(summary, allow_nan=False), flush=True)
    if args.check and not summary["check"]["ok"]:
        print(f"check failed: {summary['check']['failures']}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    return dict(summary, results=requests, model=model, cfg=cfg)


if __name__ == "__main__":
    main()
