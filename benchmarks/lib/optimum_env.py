"""A side environment for Optimum, whose releases pin transformers < 4.58.

The project's .venv may hold a transformers that optimum-onnx cannot import. Rather than
pin it, the benchmark runs its Optimum worker in an overlay venv: a fresh venv
whose own site-packages hold only optimum, optimum-onnx and the older transformers /
huggingface_hub / tokenizers they need, with a .pth line that falls back to .venv for
everything else (torch, onnxruntime, numpy), so torch is never reinstalled.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.lib.overlay_venv import create_overlay, imports_ok, overlay_python

OVERLAY_PACKAGES = (
    "optimum==2.3.0",
    "optimum-onnx==0.1.0",
    "transformers>=4.57,<4.58",
    "huggingface_hub>=0.34,<1.0",
    "tokenizers>=0.22,<0.23",
    "requests", "charset-normalizer", "urllib3", "idna", "certifi",
)


def has_optimum(python: Path) -> bool:
    probe = "from optimum.onnxruntime import ORTModelForCausalLM"
    return imports_ok(python, probe)


def ensure_overlay(venv: Path) -> Path:
    """Create (once) the overlay venv and return its python; raise OSError on failure."""
    python = overlay_python(venv)
    if python.exists() and has_optimum(python):
        return python
    create_overlay(venv)
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *OVERLAY_PACKAGES],
        capture_output=True, text=True)
    if result.returncode != 0 or not has_optimum(python):
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["import failed"]
        raise OSError(f"could not set up Optimum in {venv}: {tail[0]}")
    print(f"optimum overlay ready in {venv}")
    return python
