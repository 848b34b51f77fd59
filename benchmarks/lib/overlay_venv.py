"""Overlay venvs for benchmark peers whose packages cannot live in the project's .venv.

An overlay is a fresh venv whose own site-packages hold only the peer's packages, with a
.pth line that falls back to .venv for everything else (torch, onnxruntime, numpy), so
nothing heavy is installed twice. optimum_env.py and llamacpp_env.py each fill one.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def overlay_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def imports_ok(python: Path, probe: str) -> bool:
    """Whether ``probe`` (Python source) runs without error under ``python``."""
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def create_overlay(venv: Path) -> Path:
    """Create the venv with its fall-back .pth line; return its python."""
    python = overlay_python(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    purelib = Path(sysconfig.get_paths()["purelib"])  # this (.venv) interpreter's packages
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_attnserve_main_venv.pth").write_text(f"{purelib}\n", encoding="utf-8")
    return python
