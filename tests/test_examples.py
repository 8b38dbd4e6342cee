"""The examples run, and the GPT example trains to the same losses on pallas_flash as on XLA."""

import json
import os
import subprocess
import sys

import pytest
from support.backends import SWEEP
from support.examples import EXAMPLES, load


def summaries(text: str) -> list[dict]:
    """The examples' `summary {...}` lines, parsed as strict JSON (NaN and Infinity refused)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [
        json.loads(line.removeprefix("summary "), parse_constant=refuse)
        for line in text.splitlines()
        if line.startswith("summary ")
    ]


def test_train_gpt_losses_match_xla(capsys, tmp_path):
    pytest.importorskip("flax")
    train_gpt = load("train_gpt")
    common = ["--batch", "2", "--seq", "64", "--kv-heads", "2"]
    ours = train_gpt.main(["--attention", "pallas_flash", "--steps", "3", *common])
    xla = train_gpt.main(["--attention", "xla", "--steps", "3", *common])
    assert ours["final_loss"] == pytest.approx(xla["final_loss"], rel=1e-4)
    assert ours["final_loss"] < 5.5  # below ln(256) = 5.55: it learned something in 3 steps
    # One step (the one that compiles) has no times, and still its summary; in the per-step log
    # too. Every summary is JSON.
    log = tmp_path / "log.jsonl"
    one = train_gpt.main(["--attention", "xla", "--steps", "1", "--out", str(log), *common])
    assert one["step_ms"] is one["tokens_per_s"] is one["model_tflops"] is None
    assert one["final_loss"] > 0 and one["first_step_s"] > 0
    assert summaries(capsys.readouterr().out) == [ours, xla, one]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, None] and rows[1]["summary"] == one


@pytest.mark.parametrize(
    "example, args, message",
    [
        ("train_gpt", ["--mesh", "data=2", "--batch", "3"], "--batch 3 must be a multiple of"),
        ("train_gpt", ["--mesh", "context=4", "--seq", "12"], "--seq 12 must be a multiple of"),
        ("train_gpt", ["--mesh", "model=4", "--kv-heads", "2"], "--kv-heads 2 must divide over"),
        ("train_gpt", ["--mesh", "data=2,pipe=2"], "got 'pipe=2'"),
        ("train_gpt", ["--steps", "0"], "--steps 0 must be at least 1"),
        ("generate", ["--mesh", "data=2", "--batch", "3"], "--batch 3 must be a multiple of"),
        ("generate", ["--new", "0"], "--new 0 must be at least 1"),
        ("generate", ["--cache", "8"], "--cache 8 is smaller than --prompt + --new"),
    ],
)
def test_examples_check_their_arguments_before_jax(example, args, message, capsys):
    """An argparse error (exit status 2) naming the rule, before any array is made: on this one
    device a mesh would fail on its device count first."""
    pytest.importorskip("flax")
    with pytest.raises(SystemExit) as exit:
        load(example).main(args)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("example", ["quickstart", "flax_switch", "train_gpt", "generate"])
def test_examples_help_runs_nothing(example, monkeypatch, capsys):
    if example != "quickstart":
        pytest.importorskip("flax")
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--help"])
    with pytest.raises(SystemExit) as exit:
        module = load(example)  # quickstart and flax_switch parse their arguments as they load
        module.main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
    assert "summary" not in out and "max |" not in out


@pytest.mark.skipif(not SWEEP, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")
def test_train_gpt_remat_attention_gives_the_same_losses():
    pytest.importorskip("flax")
    train_gpt = load("train_gpt")
    common = ["--attention", "xla", "--steps", "2", "--batch", "2", "--seq", "32"]
    plain = train_gpt.main(common)
    remat = train_gpt.main([*common, "--remat-attention"])
    assert remat["remat_attention"] and not plain["remat_attention"]
    assert remat["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)


def test_flax_switch_matches_flax(monkeypatch):
    pytest.importorskip("flax")
    monkeypatch.setattr(sys, "argv", ["flax_switch.py"])
    example = load("flax_switch")
    assert float(abs(example.flash_out - example.flax_out).max()) < 1e-4
    assert example.flash_out.shape == example.x.shape


def test_quickstart_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--interpret"])
    example = load("quickstart")
    assert float(abs(example.out - example.expected).max()) < 1e-4
    assert "max |out - jax.nn|" in capsys.readouterr().out


@pytest.mark.skipif(not SWEEP, reason="decode is covered by test_decode: PALLAS_FLASH_SWEEP=1")
def test_generate_matches_the_full_forward():
    """Greedy generation with the KV cache and the decode kernel (interpreter): every step's
    logits equal those of the full causal forward over the prompt and the tokens so far."""
    pytest.importorskip("flax")
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    generate = load("generate")
    train_gpt = sys.modules["train_gpt"]
    result = generate.main(["--batch", "2", "--prompt", "20", "--new", "3", "--kv-heads", "2"])
    assert result["tokens"].shape == (2, 3) and result["tokens_per_s"] > 0
    assert 0.0 <= result["attention_share"] <= 1.0
    cfg = dataclasses.replace(train_gpt.PRESETS["tiny"], kv_heads=2)
    # The same weights (same seed) with XLA attention over the whole sequence.
    model = train_gpt.GPT(cfg, train_gpt.attention_fn("xla", False), jnp.float32, nnx.Rngs(0))
    seq = jnp.concatenate([result["prompt"], jnp.asarray(result["tokens"][:, :-1])], axis=1)
    full = nnx.jit(lambda model, seq: model(seq))(model, seq)
    prompt_len = result["prompt"].shape[1]
    for i in range(3):
        np.testing.assert_allclose(result["logits"][i], full[:, prompt_len - 1 + i], atol=1e-4)


@pytest.mark.skipif(not SWEEP, reason="trains in the interpreter (~20 s): PALLAS_FLASH_SWEEP=1")
def test_generate_after_brief_training():
    """--steps trains before generating (the loss falls), and the trained model's decode steps
    still equal its full forward."""
    pytest.importorskip("flax")
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    generate = load("generate")
    result = generate.main(["--batch", "2", "--prompt", "20", "--new", "3", "--steps", "3"])
    first, last = result["train_loss"]
    assert result["train_steps"] == 3 and last < first
    seq = jnp.concatenate([result["prompt"], jnp.asarray(result["tokens"][:, :-1])], axis=1)
    full = nnx.jit(lambda model, seq: model(seq))(result["model"], seq)
    prompt_len = result["prompt"].shape[1]
    for i in range(3):
        np.testing.assert_allclose(result["logits"][i], full[:, prompt_len - 1 + i], atol=1e-4)


# The examples on a mesh of fake CPU devices run in a child process (jax fixes its device count
# when it starts); on 4 devices one child runs both checks, each reporting on its own.
_ON_A_MESH = """
import logging, re, sys, traceback
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
import generate, train_gpt
from flax import nnx

def generate_alike():
    common = ["--batch", "2", "--prompt", "20", "--new", "2", "--kv-heads", "2"]
    sharded = generate.main([*common, "--mesh", "data=2,model=2"])
    plain = generate.main(common)
    np.testing.assert_allclose(sharded["logits"], plain["logits"], atol=1e-4)
    np.testing.assert_array_equal(sharded["tokens"], plain["tokens"])
    # The decode step on the mesh: the caches stay in their sharding, never gathered.
    mesh = generate.parse_mesh("data=2,model=2")
    graphdef, state = nnx.split(sharded["model"])
    prompt = jax.device_put(sharded["prompt"], jax.NamedSharding(mesh, jax.P("data")))
    _, caches = generate._prefill(state, prompt, graphdef, 22, True, mesh)
    attention = generate.decode_attention_fn("pallas_flash", True)
    step = jax.jit(
        lambda state, caches, token, length: generate.decode_step(
            nnx.merge(graphdef, state), caches, token, length, attention, mesh
        )
    )
    hlo = step.lower(state, caches, prompt[:, 0], np.int32(20)).compile().as_text()
    gathered = re.findall(r"= (\\S+) all-gather", hlo)
    assert not [g for g in gathered if re.match(r"f32\\[\\d+,22,", g)], gathered
    print("generated alike", flush=True)

def train_step_compiles(mesh):
    # How often jax compiles train_step: with the weights' shardings changed by step 1, step 2
    # compiles again.
    compiles = []
    class Compiles(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling jit(train_step)"):
                compiles.append(record.getMessage())
    logging.getLogger("jax").addHandler(Compiles())
    jax.config.update("jax_log_compiles", True)
    train_gpt.main(["--mesh", mesh, "--steps", "2", "--batch", "2", "--seq", "16"])
    print("compiles of train_step:", len(compiles), flush=True)

for check in sys.argv[2:]:
    try:
        generate_alike() if check == "generate" else train_step_compiles(check)
    except Exception:
        traceback.print_exc()
"""


def run_on_devices(devices: int, *checks: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    return subprocess.run(
        [sys.executable, "-c", _ON_A_MESH, str(EXAMPLES), *checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_examples_on_a_mesh_of_4():
    """One child process on 4 CPU devices (the checks share its start-up), each reporting alone:

    - generate.py --mesh data=2,model=2: the same tokens and logits as on one device, and the
      decode step keeps each cache split over sequences and heads (no gather of a cache). Two
      new tokens: one decode step, none timed, so the summaries' times are null.
    - train_gpt.py --mesh data=2,model=2: the step returns the weights and optimizer state in
      the shardings it takes them in, so that step 2 runs what step 1 compiled."""
    pytest.importorskip("flax")
    result = run_on_devices(4, "generate", "data=2,model=2")
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert "generated alike" in result.stdout, output
    sharded, plain = [s for s in summaries(result.stdout) if "new" in s]
    assert sharded["mesh"] == "data=2,model=2" and plain["mesh"] is None
    assert sharded["step_ms"] is sharded["tokens_per_s"] is sharded["attention_share"] is None
    assert "compiles of train_step: 1\n" in result.stdout, output
    [trained] = [s for s in summaries(result.stdout) if "devices" in s]
    assert trained["mesh"] == "data=2,model=2" and trained["step_ms"] > 0


@pytest.mark.skipif(not SWEEP, reason="~15 s of CPU: PALLAS_FLASH_SWEEP=1")
def test_train_gpt_with_ring_attention_compiles_its_step_once():
    """As on data=2,model=2 (above), with the ring's head split: data=2,context=2,model=2."""
    pytest.importorskip("flax")
    result = run_on_devices(8, "data=2,context=2,model=2")
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert "compiles of train_step: 1\n" in result.stdout, output
