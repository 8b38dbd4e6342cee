"""CONTRIBUTING.md names what exists: every module, function, class and constant it quotes as
code (`dispatch.choose`, `MaskSpec.kv_tile_range`, `jax.nn.dot_product_attention`), every test
(`test_device_records`, `BACKEND_PATHS`) and every file (`tests/test_masks.py`). What its worked
examples create (the chunked mask, the cudnn backend) stays in code blocks and in spans that are
not bare names. A move or a rename that leaves the guide behind fails here, naming the line."""

from __future__ import annotations

import builtins
import functools
import importlib
import importlib.util
import pathlib
import re

import pytest

import pallas_flash

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "CONTRIBUTING.md"

SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# Bare names that are code objects by their spelling: tests, _private names, CONSTANTS and
# Classes (other lower-case names may be arguments, which nothing defines).
DEFINED = re.compile(r"test_\w+|_[A-Za-z]\w*|__\w+__|[A-Z][A-Z0-9_]+|[A-Z]+[a-z]\w*")
PATH = re.compile(r"[\w./-]+/|[\w./-]+\.(py|md|json|sh)")
FILE_SUFFIXES = (".py", ".md", ".json", ".sh")


def quoted(text: str) -> list[tuple[int, str]]:
    """(line number, span) of each inline code span outside fenced blocks."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            found.extend((number, m.group(1)) for m in SPAN.finditer(line))
    return found


@functools.cache
def package_names() -> dict[str, object]:
    """Every module of pallas_flash by its last name (`dispatch`, `mosaic.tiles` as `tiles`...)
    and every class, function and constant its modules define at top level, by name."""
    names = {}
    # Shallower modules first: `masks` is pallas_flash.masks, not pallas_flash.bench.masks.
    paths = (ROOT / "pallas_flash").rglob("*.py")
    for path in sorted(paths, key=lambda p: (len(p.parts), p)):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = importlib.import_module(".".join(parts))
        names.setdefault(parts[-1], module)
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) == module.__name__:
                names.setdefault(name, value)
    return names


def resolves(dotted: str) -> bool:
    """Whether `dotted` names something: its first name a module or top-level name of
    pallas_flash (or jax), the rest attributes or submodules."""
    first, *rest = dotted.split(".")
    if first == "jax":
        obj = importlib.import_module("jax")
    elif first == "pallas_flash":
        obj = pallas_flash
    elif first in package_names():
        obj = package_names()[first]
    else:
        return False
    for name in rest:
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        module = getattr(obj, "__name__", None)
        if not hasattr(obj, "__path__") or importlib.util.find_spec(f"{module}.{name}") is None:
            return False
        obj = importlib.import_module(f"{module}.{name}")
    return True


@functools.cache
def sources(suffix: str) -> str:
    """The text of the package's and the tests' .py files (tests/support/ too), or of the
    scripts (.sh, .ci/run)."""
    if suffix == ".py":
        files = [*(ROOT / "pallas_flash").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    else:
        files = [*ROOT.glob("benchmarks/*.sh"), ROOT / ".ci" / "run"]
    return "\n".join(path.read_text() for path in sorted(files) if path.exists())


def defined(name: str) -> bool:
    """A builtin, a name of the package, or a name defined in the tests or set in a script (the
    knobs of benchmarks/device_run.sh and .ci/run)."""
    python = rf"^\s*(def|class)\s+{name}\b|^{name}\s*[:=]"
    shell = rf"^\s*{name}=|\$\{{{name}\b"
    return (
        hasattr(builtins, name)
        or name in package_names()
        or re.search(python, sources(".py"), re.M) is not None
        or re.search(shell, sources(".sh"), re.M) is not None
    )


def exists(path: str) -> bool:
    """A path from the repository's root or the package's, or a file's name anywhere in it."""
    path = path.split("::")[0]
    if (ROOT / path).exists() or (ROOT / "pallas_flash" / path).exists():
        return True
    return "/" not in path.rstrip("/") and any(ROOT.rglob(path))


def problems(text: str) -> list[str]:
    found = []
    for number, span in quoted(text):
        if "::" in span:  # a test's node id: its file, then its name
            path, _, test = span.partition("::")
            if not (exists(path) and defined(test)):
                found.append(f"line {number}: `{span}` names no test")
        elif PATH.fullmatch(span) and (span.endswith("/") or span.endswith(FILE_SUFFIXES)):
            if not exists(span):
                found.append(f"line {number}: `{span}` is no file or directory")
        elif DOTTED.fullmatch(span):
            if not resolves(span) and span.split(".")[0] in {"jax", *package_names()}:
                found.append(f"line {number}: `{span}` does not resolve")
        elif DEFINED.fullmatch(span) and not defined(span):
            found.append(f"line {number}: `{span}` is defined nowhere")
    return found


def test_contributing_names_what_exists():
    assert problems(GUIDE.read_text()) == []


@pytest.mark.parametrize(
    "span",
    [
        "`dispatch.chose`",
        "`MaskSpec.kv_tile_rnage`",
        "`jax.nn.dot_product_attn`",
        "`test_no_such_test`",
        "`NO_SUCH_CONSTANT`",
        "`tests/test_no_such_file.py`",
        "`no_such_file.py`",
        "`tests/test_dispatch.py::test_no_such_test`",
    ],
)
def test_a_wrong_name_is_found(span):
    (problem,) = problems(f"see {span}\n")
    assert problem.startswith(f"line 1: {span} "), problem


def test_right_names_pass():
    text = (
        "`dispatch.choose`, `MaskSpec.kv_tile_range`, `mosaic.why_not_device`, "
        "`jax.nn.dot_product_attention`, `test_device_records`, `BACKEND_PATHS`, `Device`, "
        "`tests/test_masks.py`, `masks.py`, `triton/`, `pallas_flash/tuned.json`\n"
        "```python\nnot_checked.inside_fences\n```\n"
    )
    assert problems(text) == []
