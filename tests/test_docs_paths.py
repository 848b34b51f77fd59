"""Every repository path the README and docs/ name exists: a file moved or renamed is a
failing test, not a stale document (markdown links, and paths under the project's top-level
folders written in the text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_LEVEL = ("service", "model", "export", "tests", "deploy", "benchmarks", "results", "docs",
             ".ci")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"(?<![\w/.])((?:" + "|".join(re.escape(t) for t in TOP_LEVEL)
                  + r")/[\w./\-]*\w)")
# A path made by a command (an output folder), a pattern, or a placeholder is not a claim
# that it exists.
OUTPUT_FLAG = re.compile(r"--(?:out|result-dir|work|json)\s+$")
# `git show REV:PATH` names a file of an old commit (a retired script), not of the tree.
GIT_REVISION = re.compile(r"\b[0-9a-f]{7,40}:$")


def named_paths(text: str) -> list[str]:
    """The repository paths ``text`` states: in its prose and commands (not those a
    command would create, not patterns such as ``results/x-*/`` or ``{a,b}``, not
    placeholders in capitals, not a past commit's file as ``git show REV:PATH`` names it)."""
    found = []
    for m in PATH.finditer(text):
        path, after = m.group(1), text[m.end():m.end() + 2]
        before = text[:m.start()]
        if any(c in after for c in "*{<") or OUTPUT_FLAG.search(before):
            continue
        if GIT_REVISION.search(before[-41:]):
            continue
        if any(part.isupper() for part in re.split(r"[/.]", path)):
            continue
        found.append(path)
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_named_path_exists(document: Path) -> None:
    text = document.read_text("utf-8")
    missing = [f"link {target}" for target in LINK.findall(text)
               if not re.match(r"[a-z]+:", target) and not (document.parent / target).exists()]
    missing += [path for path in named_paths(text) if not (REPO / path).exists()]
    assert not missing, f"{document.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_path_finder_finds_paths_and_skips_what_is_not_a_claim() -> None:
    text = ("see `service/engine/cuda.py` and [x](../results/a.md); run `--out results/mine`;"
            " files under `results/serve/2026-*/`, `results/bench/latest.{json,md}`, "
            "`model/architectures/NAME.py`, `git show 26b622d:benchmarks/retired.py`")
    assert named_paths(text) == ["service/engine/cuda.py"]
