"""benchmarks.cuda_check where it cannot run: one line and a non-zero exit, no JSON.

What it measures needs a CUDA GPU (results/cuda/ holds the one run); CI has none, so only
its refusals are tested here. The device-resident decode it times is tested on CPU in
tests/service/engine/test_engine_graph_runner.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[2]


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.cuda_check", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_an_artifact_without_a_manifest_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = run_check("--artifact", str(tmp_path), "--out", str(out))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"cuda_check: --artifact {tmp_path} has no manifest.json"]
    assert not out.exists()


def test_without_cuda_it_says_so_in_one_line(tiny_artifact: Path, tmp_path: Path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine's onnxruntime has CUDA: the refusal cannot be shown")
    out = tmp_path / "check.json"
    done = run_check("--artifact", str(tiny_artifact), "--out", str(out))
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("cuda_check: onnxruntime has no CUDAExecutionProvider here")
    assert "CPUExecutionProvider" in line
    assert not out.exists()
