"""A side environment for llama.cpp (llama-cpp-python), compiled once from source.

llama-cpp-python ships as an sdist that builds llama.cpp with CMake (about 20 minutes on
two cores), so it is not a dependency of the project's .venv. The benchmark builds it once
into an overlay venv (default .cache/llamacpp-venv) in the same shape as the Optimum one:
a fresh venv whose site-packages hold only llama-cpp-python and diskcache, with a .pth
line that falls back to .venv for numpy, jinja2, gguf and the benchmark's own imports.
The llama.cpp worker runs in that interpreter; nothing else does.

It is built for this CPU (``GGML_NATIVE``) less Intel AMX: on a Sapphire Rapids class host
(AMX_INT8) ggml moves q8_0 / Q4_0 / Q4_1 weights into its AMX buffer type, and
``ggml_backend_amx_mul_mat`` then crashed the first decode here (SIGSEGV; llama.cpp issue
20824, machine-dependent and unfixed). Without AMX, llama.cpp runs its AVX-512 VNNI kernels
and its CPU repacking, as on any other x86 host. The flags are recorded beside the build
(``build-flags.txt``): a cached overlay built with other flags is rebuilt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.lib.overlay_venv import create_overlay, imports_ok, overlay_python

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OVERLAY_PACKAGES = (LLAMA_CPP_PYTHON, "diskcache")
BUILD_JOBS = "2"
# CPU only, tuned for this machine but without AMX (see above); no multimodal library,
# server, tools or tests. Explicit -mno-* options win over -march=native in GCC and clang.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF "
              "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF "
              f"-DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'")
BUILD_FLAGS_FILE = "build-flags.txt"


def has_llama_cpp(python: Path) -> bool:
    probe = "import llama_cpp; llama_cpp.llama_backend_init()"
    return imports_ok(python, probe)


def built_with(venv: Path) -> str | None:
    """The CMake arguments the overlay's llama.cpp was built with (None: not recorded)."""
    try:
        return (venv / BUILD_FLAGS_FILE).read_text(encoding="utf-8")
    except OSError:
        return None


def ensure_overlay(venv: Path) -> Path:
    """Create (once) the overlay venv and return its python; raise OSError on failure.

    The build log goes to VENV/build.log so a failed compile can be read afterwards.
    """
    python = overlay_python(venv)
    if python.exists() and has_llama_cpp(python) and built_with(venv) == CMAKE_ARGS:
        return python
    if not python.exists():
        create_overlay(venv)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=BUILD_JOBS, CMAKE_ARGS=CMAKE_ARGS)
    print(f"building {LLAMA_CPP_PYTHON} into {venv} (compiles llama.cpp: ~20 min on 2 cores)")
    with open(venv / "build.log", "w", encoding="utf-8") as build_log:
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "--no-deps", "--no-cache-dir",
             "--force-reinstall", "-v", *OVERLAY_PACKAGES],
            stdout=build_log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0 or not has_llama_cpp(python):
        raise OSError(f"could not build llama-cpp-python in {venv}; see {venv / 'build.log'}")
    (venv / BUILD_FLAGS_FILE).write_text(CMAKE_ARGS, encoding="utf-8")
    print(f"llama.cpp overlay ready in {venv}")
    return python


if __name__ == "__main__":  # python -m benchmarks llamacpp-env [VENV]
    print(ensure_overlay(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/llamacpp-venv")))
