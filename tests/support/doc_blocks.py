"""The ```python blocks of README.md and docs/*.md: each block's line, code and not-run reason
(`python_blocks`), and a file's blocks run in order in one namespace (`run_blocks`, also run by
tests/test_readme.py's child process on a mesh of CPU devices)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\S*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")


def python_blocks(name: str) -> list[tuple[int, str, str | None]]:
    """(line of the block's first code line, code, the not-run reason or None) of each ```python
    block of the file."""
    text = (ROOT / name).read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.fullmatch(before.strip())
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append((line, match.group(2), reason.group(1) if reason else None))
    return blocks


def run_blocks(name: str) -> None:
    """Runs the file's blocks in order in one namespace; a failure names the file and its line."""
    namespace = {"__name__": "__main__"}
    for line, code, reason in python_blocks(name):
        if reason is None:
            # Padded so that a traceback's line numbers are the markdown file's.
            exec(compile("\n" * (line - 1) + code, str(ROOT / name), "exec"), namespace)
