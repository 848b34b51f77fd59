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
from pathlib import Path

from benchmarks.overlay_venv import create_overlay, imports_ok, overlay_python

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OVERLAY_PACKAGES = (LLAMA_CPP_PYTHON, "diskcache")
BUILD_JOBS = "2"


def has_llama_cpp(python: Path) -> bool:
    probe = "import llama_cpp; llama_cpp.llama_backend_init()"
    return imports_ok(python, probe)


def ensure_overlay(venv: Path, log: object = print) -> Path:
    """Create (once) the overlay venv and return its python; raise OSError on failure.

    The build log goes to VENV/build.log so a failed compile can be read afterwards.
    """
    python = overlay_python(venv)
    if python.exists() and has_llama_cpp(python):
        return python
    create_overlay(venv)
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
