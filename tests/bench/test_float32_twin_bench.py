"""benchmarks.float32_twin refuses what it cannot measure: one line, a non-zero exit.

The twin itself is tested against PyTorch in tests/service/engine/test_float32_twin.py;
the speed figures are in results/bench/ (no timing here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.float32_twin", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_directory_that_is_no_artifact_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    done = run_bench("--fp32", str(tiny_artifact), "--quantized", f"int4={tmp_path}")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"float32_twin: {tmp_path} is not an artifact (no manifest.json)"]


def test_a_quantised_artifact_without_a_twin_is_refused(tiny_artifact: Path) -> None:
    done = run_bench("--fp32", str(tiny_artifact), "--quantized", f"plain={tiny_artifact}",
                     "--rounds", "1", "--batch", "1", "--new", "2", "--prompt-len", "4")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"float32_twin: {tiny_artifact} has no engine_float32.onnx "
        "(export it again with --quantize ... --engine-graph --float32-twin)")
