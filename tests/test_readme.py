"""Every ```python block of README.md and docs/*.md runs as written: a file's blocks in order in one
namespace, as a reader pastes them into one session. A block right after a line
`<!-- not run: <why> -->` is only compiled; keep such blocks few, each with its reason.
Signatures and other text that is not a program are fenced as ```text."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from support.doc_blocks import python_blocks, run_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
# Files whose blocks shard over a mesh run in a child process with this many CPU devices.
DEVICES = {"docs/sharding.md": 8}

_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from support.doc_blocks import run_blocks
run_blocks(sys.argv[2])
print("ran", sys.argv[2], flush=True)
"""


@pytest.mark.parametrize("name", FILES)
def test_python_blocks_parse_and_every_not_run_mark_has_a_block(name):
    text = (ROOT / name).read_text()
    blocks = python_blocks(name)
    for line, code, _ in blocks:
        compile("\n" * (line - 1) + code, str(ROOT / name), "exec")  # a SyntaxError names the line
    marked = sum(reason is not None for _, _, reason in blocks)
    assert len(re.findall(r"<!-- not run", text)) == marked, (
        f"{name}: every `<!-- not run: <why> -->` mark must be the line right before a "
        "```python block"
    )


@pytest.mark.parametrize(
    "name", [name for name in FILES if any(r is None for _, _, r in python_blocks(name))]
)
def test_python_blocks_run_as_written(name):
    if any("flax" in code for _, code, _ in python_blocks(name)):
        pytest.importorskip("flax")
    devices = DEVICES.get(name)
    if devices is None:
        run_blocks(name)
        return
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", _CHILD, str(ROOT / "tests"), name],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert f"ran {name}" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]
