"""Citations of the measurement notes resolve: every `docs/notes/FILE.md, "Heading"` in the
repository's .py, .md and .sh files names a note that exists and one of its headings, and every
note is listed in the notes' index.

The citation format is one path and at most one heading, on one line:

    docs/notes/backward.md, "What limits the backward"

Read from the sources as text; nothing is imported.
"""

from __future__ import annotations

import pathlib
import re

import pytest

THIS_FILE = pathlib.Path(__file__).resolve()
ROOT = THIS_FILE.parent.parent
NOTES = ROOT / "docs" / "notes"
SUFFIXES = {".py", ".md", ".sh"}
# Directories that hold no sources of the project (virtual environments, build output, scratch).
SKIPPED_DIRS = {"__pycache__", "build", "dist", "scratch", "node_modules"}

CITATION = re.compile(r"docs/notes/([A-Za-z0-9_.-]+\.md)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([A-Za-z0-9_.-]+\.md)\)")


def source_files() -> list[pathlib.Path]:
    """The repository's .py, .md and .sh files (but this one, whose examples are not
    citations), hidden and generated directories left out."""
    found = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        if path.suffix in SUFFIXES and path.is_file() and path != THIS_FILE:
            found.append(path)
    return found


def headings(text: str) -> list[str]:
    """A markdown file's heading texts, in order, those in fenced code blocks left out."""
    found, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append(m.group(1))
    return found


def citations(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, note file, heading or None) of each citation in a text. A heading opened
    after the path (`, "`) but not closed on the same line comes back as the rest of the line
    with its quote, which no heading matches: citations do not break across lines."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            rest = line[m.end() :]
            heading = None
            if rest.startswith(', "'):
                closed = rest.find('"', 3)
                heading = rest[3:closed] if closed >= 0 else rest[2:]
            found.append((number, m.group(1), heading))
    return found


def broken_citations(text: str, notes: dict[str, list[str]]) -> list[str]:
    """What is wrong with each citation in a text: a missing note or heading."""
    problems = []
    for number, name, heading in citations(text):
        if name not in notes:
            problems.append(f"line {number}: no note {name}")
        elif heading is not None and heading not in notes[name]:
            problems.append(f'line {number}: {name} has no heading "{heading}"')
    return problems


def note_headings() -> dict[str, list[str]]:
    return {path.name: headings(path.read_text()) for path in sorted(NOTES.glob("*.md"))}


def test_the_notes_exist():
    notes = note_headings()
    assert "README.md" in notes and len(notes) > 5, sorted(notes)
    assert all(notes.values()), [name for name, found in notes.items() if not found]


def test_every_citation_names_a_note_and_one_of_its_headings():
    notes = note_headings()
    problems = []
    for path in source_files():
        for problem in broken_citations(path.read_text(errors="replace"), notes):
            problems.append(f"{path.relative_to(ROOT)}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_citations_are_found():
    """The code cites the notes (so the check above reads something), and a citation of a
    missing heading or note, or one broken across lines, is reported."""
    cited = [
        path
        for path in source_files()
        if path.suffix == ".py" and CITATION.search(path.read_text(errors="replace"))
    ]
    assert len(cited) >= 10, cited
    notes = {"a.md": ["Top", "Some heading"]}
    text = (
        'x  # docs/notes/a.md, "Some heading"; docs/notes/a.md\n'
        'y  # docs/notes/a.md, "Gone"\n'
        "z  # docs/notes/b.md\n"
        'w  # docs/notes/a.md, "Some\n'
        '#  heading"\n'
    )
    assert broken_citations(text, notes) == [
        'line 2: a.md has no heading "Gone"',
        "line 3: no note b.md",
        'line 4: a.md has no heading ""Some"',
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in NOTES.glob("*.md")))
def test_headings_are_unique_within_a_note(name):
    found = headings((NOTES / name).read_text())
    assert len(found) == len(set(found)), sorted(h for h in found if found.count(h) > 1)


def test_headings_in_code_blocks_are_not_headings():
    text = "# Title\n```bash\n# a shell comment\n```\n## Section\n"
    assert headings(text) == ["Title", "Section"]


def test_the_index_lists_every_note_and_its_links_resolve():
    index = (NOTES / "README.md").read_text()
    listed = set(LINK.findall(index))
    notes = {p.name for p in NOTES.glob("*.md")} - {"README.md"}
    assert listed == notes, (sorted(notes - listed), sorted(listed - notes))
    for path in NOTES.glob("*.md"):
        missing = [m for m in LINK.findall(path.read_text()) if not (NOTES / m).exists()]
        assert not missing, (path.name, missing)


def test_nothing_cites_the_retired_notebook():
    """The lab notebook the notes replaced is gone: no source points at it."""
    retired = "benchmarks/" + "NOTES" + ".md"
    stale = [
        str(path.relative_to(ROOT))
        for path in source_files()
        if retired in path.read_text(errors="replace")
    ]
    assert not stale, stale
