"""staged_directory: all-or-nothing output directories that a non-root reader can open."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from model.staging import staged_directory


def test_success_replaces_target_and_is_world_readable(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with staged_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or .old leftovers


def test_failure_leaves_existing_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(target) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failure_creates_nothing_when_target_is_new(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), staged_directory(tmp_path / "fresh"):
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
