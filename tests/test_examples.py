"""The examples run, and the GPT example trains to the same losses on pallas_flash as on XLA."""

import importlib.util
import pathlib
import sys

import pytest
from conftest import SWEEP

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_train_gpt_losses_match_xla(tmp_path):
    pytest.importorskip("flax")
    train_gpt = load("train_gpt")
    common = ["--steps", "3", "--batch", "2", "--seq", "64", "--kv-heads", "2"]
    ours = train_gpt.main(["--attention", "pallas_flash", *common])
    xla = train_gpt.main(["--attention", "xla", *common])
    assert ours["final_loss"] == pytest.approx(xla["final_loss"], rel=1e-4)
    assert ours["final_loss"] < 5.5  # below ln(256) = 5.55: it learned something in 3 steps


@pytest.mark.skipif(not SWEEP, reason="slow on CPU: set PALLAS_FLASH_SWEEP to run")
def test_train_gpt_remat_attention_gives_the_same_losses():
    pytest.importorskip("flax")
    train_gpt = load("train_gpt")
    common = ["--attention", "xla", "--steps", "2", "--batch", "2", "--seq", "32"]
    plain = train_gpt.main(common)
    remat = train_gpt.main([*common, "--remat-attention"])
    assert remat["remat_attention"] and not plain["remat_attention"]
    assert remat["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)


def test_flax_switch_matches_flax():
    pytest.importorskip("flax")
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


# Run in a child process with 4 CPU devices (jax fixes its device count when it starts).
_GENERATE_ON_A_MESH = """
import re, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
import generate
from flax import nnx
common = ["--batch", "2", "--prompt", "20", "--new", "3", "--kv-heads", "2"]
sharded = generate.main([*common, "--mesh", "data=2,model=2"])
plain = generate.main(common)
np.testing.assert_allclose(sharded["logits"], plain["logits"], atol=1e-4)
np.testing.assert_array_equal(sharded["tokens"], plain["tokens"])
# The decode step on the mesh: the caches stay in their sharding, never gathered.
mesh = generate.parse_mesh("data=2,model=2")
graphdef, state = nnx.split(sharded["model"])
prompt = jax.device_put(sharded["prompt"], jax.NamedSharding(mesh, jax.P("data")))
_, caches = generate._prefill(state, prompt, graphdef, 23, True, mesh)
attention = generate.decode_attention_fn("pallas_flash", True)
step = jax.jit(
    lambda state, caches, token, length: generate.decode_step(
        nnx.merge(graphdef, state), caches, token, length, attention, mesh
    )
)
hlo = step.lower(state, caches, prompt[:, 0], np.int32(20)).compile().as_text()
gathered = re.findall(r"= (\\S+) all-gather", hlo)
cache = r"f32\\[\\d+,23,"
assert not [g for g in gathered if re.match(cache, g)], gathered
print("generated alike", flush=True)
"""


def test_generate_on_a_mesh():
    """--mesh data=2,model=2 on 4 CPU devices: the same tokens and logits as on one device, and
    the decode step keeps each cache split over sequences and heads (no gather of a cache)."""
    pytest.importorskip("flax")
    import os
    import subprocess

    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
    )
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE_ON_A_MESH, str(EXAMPLES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "generated alike" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]
