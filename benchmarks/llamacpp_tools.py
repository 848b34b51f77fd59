"""llama.cpp's own command-line tools, compiled once into a cached side directory.

Usage (from the repository root, in the dev venv):
    python -m benchmarks llamacpp-tools --build         # download, unpack, compile (~10-15 min)
    python -m benchmarks llamacpp-tools --print-paths   # where the tools are (exit 1: not built)

The benchmark's llama.cpp runs through the Python package (benchmarks/llamacpp_env.py);
comparing at real sizes also wants llama.cpp's own programs on the same file:
``llama-batched-bench`` (its throughput table), ``llama-server`` (its HTTP serving),
``llama-quantize`` (its Q4_0 / Q4_K_M), ``llama-perplexity`` and ``llama-tokenize``
(benchmarks/perplexity.py's ``--llama-perplexity``), ``llama-cvector-generator`` (control
vectors in llama.cpp's own GGUF format, the reference for ours), plus ``convert_hf_to_gguf.py``, the
Python converter that writes the f16 file they start from. All come from the very llama.cpp the
pinned llama-cpp-python sdist vendors (``vendor/llama.cpp``), so the package and the tools
agree on kernels and file format.

Layout under ``.cache/llamacpp-tools``: the sdist tarball, ``src/`` (its vendor/llama.cpp),
``build/`` (CMake + Ninja; binaries in ``build/bin``, ``build.log``, ``build-flags.txt``).
The CPU policy is the overlay's: ``GGML_NATIVE`` less Intel AMX (see llamacpp_env.py);
static libraries, no web UI download, no HTTPS. The flags, the sdist and the targets are
recorded in ``build-flags.txt``: a build made with another set is configured afresh, and a
call with everything in place only checks it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.llamacpp_env import BUILD_JOBS, LLAMA_CPP_PYTHON, NO_AMX

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = REPO_ROOT / ".cache" / "llamacpp-tools"
TOOLS = ("llama-batched-bench", "llama-server", "llama-quantize", "llama-perplexity",
         "llama-tokenize", "llama-cvector-generator")
CONVERTER = "convert_hf_to_gguf.py"
BUILD_FLAGS_FILE = "build-flags.txt"
# Static binaries (nothing to find at run time); the server without its web UI, which
# would otherwise be fetched from a Hugging Face bucket at build time, and without HTTPS.
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
              f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def sdist_stem() -> str:
    """``llama_cpp_python-0.3.36``: the sdist's file stem and its top-level folder."""
    name, _, version = LLAMA_CPP_PYTHON.partition("==")
    return f"{name.replace('-', '_')}-{version}"


def build_record() -> str:
    """What a build is made of; a build recorded with anything else is redone."""
    return "\n".join([f"sdist: {LLAMA_CPP_PYTHON}", f"targets: {' '.join(TOOLS)}",
                      *CMAKE_ARGS]) + "\n"


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None,
               append: bool = True) -> None:
    """``cmd`` with its output in ``log`` (after a ``$ cmd`` line; appended, or a fresh
    file); an OSError naming the program (a Python module or script run by this
    interpreter: its name) where it fails."""
    with open(log, "a" if append else "w", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        program = cmd[0] if cmd[0] != sys.executable else next(
            (a for a in cmd[1:] if not a.startswith("-")), cmd[0])
        raise OSError(f"{Path(program).name} failed (exit {result.returncode}); see {log}")


def fetch_sdist(root: Path, log: Path) -> Path:
    """The pinned sdist tarball in ``root``, downloaded with pip unless already there."""
    tarball = root / f"{sdist_stem()}.tar.gz"
    if not tarball.is_file():
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", "--dest", str(root), LLAMA_CPP_PYTHON], log)
    if not tarball.is_file():
        raise OSError(f"pip download did not leave {tarball}; see {log}")
    return tarball


def unpack_vendor(tarball: Path, src: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist as ``src`` (unpacked again for another sdist)."""
    stamp = src / ".sdist"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == LLAMA_CPP_PYTHON:
        return src
    shutil.rmtree(src, ignore_errors=True)
    prefix = f"{sdist_stem()}/vendor/llama.cpp/"
    src.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and member.name != prefix:
                member.name = member.name[len(prefix):]
                members.append(member)
        tar.extractall(src, members=members, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise OSError(f"{tarball.name} holds no vendor/llama.cpp")
    stamp.write_text(LLAMA_CPP_PYTHON, encoding="utf-8")
    return src


def _ninja() -> str:
    """Ninja from PATH or from .venv/bin (``pip install ninja``)."""
    found = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if found is None:
        raise OSError("ninja not found: pip install ninja (or apt-get install ninja-build)")
    return found


def binary(name: str, root: Path = TOOLS_DIR) -> Path:
    return root / "build" / "bin" / name


def is_built(root: Path = TOOLS_DIR) -> bool:
    """Every tool present, built with today's record."""
    flags = root / "build" / BUILD_FLAGS_FILE
    return (flags.is_file() and flags.read_text(encoding="utf-8") == build_record()
            and all(binary(t, root).is_file() for t in TOOLS))


def ensure_tools(root: Path = TOOLS_DIR, log: object = print) -> dict[str, Path]:
    """Build (once) the tools and unpack the converter; their paths. Raise OSError."""
    if is_built(root):
        return tool_paths(root)
    root.mkdir(parents=True, exist_ok=True)
    build = root / "build"
    build_log = root / "build.log"
    build_log.write_text("", encoding="utf-8")
    if callable(log):
        log(f"building {', '.join(TOOLS)} from {LLAMA_CPP_PYTHON}'s vendor/llama.cpp into "
            f"{build} (10-15 min on 2 cores; log: {build_log})")
    src = unpack_vendor(fetch_sdist(root, build_log), root / "src")
    shutil.rmtree(build, ignore_errors=True)  # another flag set: configure from scratch
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=BUILD_JOBS)
    run_logged(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                f"-DCMAKE_MAKE_PROGRAM={_ninja()}", *CMAKE_ARGS], build_log, env=env)
    run_logged(["cmake", "--build", str(build), "--parallel", BUILD_JOBS, "--target", *TOOLS],
               build_log, env=env)
    missing = [t for t in TOOLS if not binary(t, root).is_file()]
    if missing:
        raise OSError(f"the build left no {', '.join(missing)}; see {build_log}")
    (build / BUILD_FLAGS_FILE).write_text(build_record(), encoding="utf-8")
    if callable(log):
        log(f"llama.cpp tools ready in {build / 'bin'}")
    return tool_paths(root)


def tool_paths(root: Path = TOOLS_DIR) -> dict[str, Path]:
    paths = {t: binary(t, root) for t in TOOLS}
    paths[CONVERTER] = root / "src" / CONVERTER
    return paths


def tool_path(name: str, root: Path = TOOLS_DIR) -> Path:
    """A built tool (one of ``TOOLS``, or ``convert_hf_to_gguf.py``); FileNotFoundError
    naming the build command when it is not built with today's flags."""
    if name not in (*TOOLS, CONVERTER):
        raise ValueError(f"unknown llama.cpp tool {name!r}; one of {', '.join(TOOLS)}, "
                         f"{CONVERTER}")
    if not is_built(root):
        raise FileNotFoundError(f"llama.cpp tools not built in {root} "
                                f"(python -m benchmarks llamacpp-tools --build)")
    return tool_paths(root)[name]


def converter_command(root: Path = TOOLS_DIR) -> tuple[list[str], dict[str, str]]:
    """(argv prefix, environment) running ``convert_hf_to_gguf.py`` in this interpreter
    (.venv: torch, transformers, safetensors, numpy) with the vendored gguf-py first,
    whatever gguf .venv itself holds."""
    script = tool_path(CONVERTER, root)
    gguf_py = str(script.parent / "gguf-py")
    pythonpath = os.pathsep.join(p for p in (gguf_py, os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, str(script)], dict(os.environ, PYTHONPATH=pythonpath)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks llamacpp-tools",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true",
                   help="build the tools unless already built with today's flags")
    p.add_argument("--print-paths", action="store_true", help="print NAME PATH per tool")
    p.add_argument("--root", type=Path, default=TOOLS_DIR, help=f"(default {TOOLS_DIR})")
    args = p.parse_args(argv)
    try:
        paths = ensure_tools(args.root) if args.build else None
    except OSError as exc:
        print(f"llamacpp_tools: error: {exc}", file=sys.stderr)
        return 2
    if args.print_paths or not args.build:
        if not is_built(args.root):
            print(f"llamacpp_tools: not built in {args.root} (run with --build)",
                  file=sys.stderr)
            return 1
        for name, path in (paths or tool_paths(args.root)).items():
            print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
