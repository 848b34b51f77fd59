"""`python -m benchmarks`: the one front door lists every benchmark in the folder and runs
the one named as `python -m benchmarks.NAME` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=BENCHMARKS.parent,
                          capture_output=True, text=True, timeout=120)


def entries_in_the_folder() -> set[str]:
    """What a user can run, found without the front door: modules and packages beside it."""
    modules = {p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("__")}
    packages = {p.parent.name for p in BENCHMARKS.glob("*/__main__.py")}
    return modules | packages


def test_help_lists_every_benchmark_in_the_folder_and_nothing_else() -> None:
    done = run("benchmarks", "--help")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines()
              if line.startswith("  ") and not line.startswith("   ")}
    expected = {name.replace("_", "-") for name in entries_in_the_folder()}
    assert "side-by-side" in expected and "serve" in expected and "soak" in expected
    assert listed == expected
    assert run("benchmarks").stdout == done.stdout  # no name: the same list


def test_every_entry_runs_as_a_script_and_helpers_live_in_lib() -> None:
    """A module beside the front door is one a user runs; what only benchmarks import is in
    benchmarks/lib/ (so the list above is of benchmarks, not helpers)."""
    for name in entries_in_the_folder():
        path = BENCHMARKS / name / "__main__.py" if (BENCHMARKS / name).is_dir() else (
            BENCHMARKS / f"{name}.py")
        text = path.read_text("utf-8")
        assert 'if __name__ == "__main__":' in text, f"{path} is not a script: move it to lib/"
        assert text.startswith('"""'), f"{path} has no docstring for the list"


def test_an_unknown_name_is_one_line_and_a_failure() -> None:
    done = run("benchmarks", "no-such-benchmark", "--quick")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "benchmarks: no benchmark 'no-such-benchmark' (`python -m benchmarks --help` lists them)"]


def test_a_name_runs_the_module_as_python_m_would() -> None:
    for name, module in (("soak", "benchmarks.soak"), ("lora-soak", "benchmarks.lora_soak"),
                         ("serve", "benchmarks.serve")):
        through_door = run("benchmarks", name, "--help")
        direct = run(module, "--help")
        assert through_door.returncode == direct.returncode == 0, through_door.stderr
        assert through_door.stdout == direct.stdout


def test_options_without_a_name_are_the_side_by_side_benchmark() -> None:
    """`python -m benchmarks --presets ...`, as results/ records the side-by-side runs."""
    done = run("benchmarks", "--no-such-option")
    assert done.returncode == 2
    assert "python -m benchmarks side-by-side: error: unrecognized arguments" in done.stderr
