"""examples/serve.py: continuous batching with chunked prefill over one paged cache gives every
request the greedy tokens it gets alone, compiles once per bucket, and reports valid JSON."""

import json

import pytest
from support.examples import load


def test_serve_help_runs_nothing(capsys):
    pytest.importorskip("flax")
    serve = load("serve")
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--help"])
    assert exit_info.value.code == 0
    assert "--max-tokens-per-step" in capsys.readouterr().out


def test_serve_gives_each_request_its_tokens_alone(capsys):
    """The CPU default (the kernel in the Pallas interpreter), with GQA and a pool too small
    for every admissible request (admission waits for pages): every generated token is the
    greedy choice of the request's full forward alone, the step compiled once per bucket, and
    the check fails when a token is wrong."""
    pytest.importorskip("flax")
    serve = load("serve")
    result = serve.main(["--check", "--kv-heads", "2", "--pages", "8"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("summary ")]
    summary = json.loads(line[-1].removeprefix("summary "))
    assert json.loads(json.dumps(summary, allow_nan=False)) == summary
    assert summary["attention"] == "triton (Pallas interpreter)" or summary["device"] != "cpu"
    check = summary["check"]
    assert check["ok"] and check["near_ties"] == 0 and check["max_logit_diff"] < 1e-4
    assert check["exact"] == check["tokens"] == summary["output_tokens"] > 0
    requests = result["results"]
    assert summary["output_tokens"] == sum(r.max_new for r in requests)
    # Compiled before serving, once per bucket; nothing compiled while serving.
    assert summary["compiles"] == len(summary["buckets"]) == 3
    # The scheduler did what the example shows: decode tokens and prefill chunks in one call,
    # prompts cut into chunks, admission held back by the pool, which was never overdrawn.
    assert summary["mixed_steps"] > 0 and summary["chunked_prompts"] > 0
    assert summary["waits_for_pages"] > 0 and summary["peak_pages"] <= summary["pages"] == 8
    assert summary["output_tokens_per_s"] > 0 and summary["tpot_ms_mean"] > 0
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_max"]
    assert summary["ttft_ms_mean"] <= summary["ttft_ms_max"]
    # A wrong token fails the check (teacher forcing judges it on its own prefix).
    wrong = requests[3]
    wrong.output[2] = (wrong.output[2] + 1) % result["cfg"].vocab
    failed = serve.check(result["model"], result["cfg"], requests, tol=0.0)
    assert not failed["ok"]
    assert failed["failures"][0]["request"] == 3 and failed["failures"][0]["token"] == 2


@pytest.mark.gpu
def test_serve_on_the_gpu_gives_each_request_its_tokens_alone():
    """Compiled: the Triton kernel in a float32 serving loop (full matmul precision) gives
    every request exactly the greedy tokens of its full forward alone."""
    pytest.importorskip("flax")
    serve = load("serve")
    result = serve.main(
        "--preset small --dtype float32 --kv-heads 2 --requests 48 --min-prompt 16 "
        "--max-prompt 400 --min-new 8 --max-new 48 --max-batch 16 --max-tokens-per-step 256 "
        "--buckets 16,64,256 --check".split()
    )
    assert result["attention"] == "triton" and result["compiles"] == 3
    check = result["check"]
    assert check["ok"] and check["exact"] == check["tokens"] == result["output_tokens"]
    assert check["max_logit_diff"] < 1e-3 and result["mixed_steps"] > 0
