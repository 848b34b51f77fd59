"""A side environment for Optimum, whose releases pin transformers < 4.58.

The project's .venv has transformers 5, which optimum-onnx cannot import. Rather than
downgrade it, the benchmark runs its Optimum worker in an overlay venv: a fresh venv
whose own site-packages hold only optimum, optimum-onnx and the older transformers /
huggingface_hub / tokenizers they need, with a .pth line that falls back to .venv for
everything else (torch, onnxruntime, numpy), so torch is never reinstalled.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

OVERLAY_PACKAGES = (
    "optimum==2.3.0",
    "optimum-onnx==0.1.0",
    "transformers>=4.57,<4.58",
    "huggingface_hub>=0.34,<1.0",
    "tokenizers>=0.22,<0.23",
    "requests", "charset-normalizer", "urllib3", "idna", "certifi",
)


def overlay_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def has_optimum(python: Path) -> bool:
    probe = "from optimum.onnxruntime import ORTModelForCausalLM"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_overlay(venv: Path, log: object = print) -> Path:
    """Create (once) the overlay venv and return its python; raise OSError on failure."""
    python = overlay_python(venv)
    if python.exists() and has_optimum(python):
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    purelib = Path(sysconfig.get_paths()["purelib"])  # this (.venv) interpreter's packages
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_attnserve_main_venv.pth").write_text(f"{purelib}\n", encoding="utf-8")
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *OVERLAY_PACKAGES],
        capture_output=True, text=True)
    if result.returncode != 0 or not has_optimum(python):
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["import failed"]
        raise OSError(f"could not set up Optimum in {venv}: {tail[0]}")
    if callable(log):
        log(f"optimum overlay ready in {venv}")
    return python
