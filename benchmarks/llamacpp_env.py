"""A side environment for llama.cpp (llama-cpp-python), compiled once from source.

llama-cpp-python ships as an sdist that builds llama.cpp with CMake (about 20 minutes on
two cores), so it is not a dependency of the project's .venv. The benchmark builds it once
into an overlay venv (default .cache/llamacpp-venv) in the same shape as the Optimum one:
a fresh venv whose site-packages hold only llama-cpp-python and diskcache, with a .pth
line that falls back to .venv for numpy, jinja2, gguf and the benchmark's own imports.
The llama.cpp worker runs in that interpreter; nothing else does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OVERLAY_PACKAGES = (LLAMA_CPP_PYTHON, "diskcache")
BUILD_JOBS = "2"


def overlay_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def has_llama_cpp(python: Path) -> bool:
    probe = "import llama_cpp; llama_cpp.llama_backend_init()"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_overlay(venv: Path, log: object = print) -> Path:
    """Create (once) the overlay venv and return its python; raise OSError on failure.

    The build log goes to VENV/build.log so a failed compile can be read afterwards.
    """
    python = overlay_python(venv)
    if python.exists() and has_llama_cpp(python):
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    purelib = Path(sysconfig.get_paths()["purelib"])  # this (.venv) interpreter's packages
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_attnserve_main_venv.pth").write_text(f"{purelib}\n", encoding="utf-8")
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=BUILD_JOBS,
               # CPU only, tuned for this machine; no multimodal library, server, tools or tests
               CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF "
                          "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
                          "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF")
    if callable(log):
        log(f"building {LLAMA_CPP_PYTHON} into {venv} (compiles llama.cpp: ~20 min on 2 cores)")
    with open(venv / "build.log", "w", encoding="utf-8") as build_log:
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-v",
             *OVERLAY_PACKAGES], stdout=build_log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0 or not has_llama_cpp(python):
        raise OSError(f"could not build llama-cpp-python in {venv}; see {venv / 'build.log'}")
    if callable(log):
        log(f"llama.cpp overlay ready in {venv}")
    return python


if __name__ == "__main__":  # python -m benchmarks.llamacpp_env [VENV]
    print(ensure_overlay(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/llamacpp-venv")))
