"""Build the GgufMatMul custom-op library (service/ops/gguf_matmul.cc) with ggml's CPU kernels.

Usage (from the repository root; `make gguf-ops` runs the first form):
    python -m service.ops.build                 # build unless built already; print the path
    python -m service.ops.build --print-path    # the built library (exit 1: not built)
    python -m service.ops.build --force         # build again even if built
    python -m service.ops.build --jobs 4        # compile jobs (default 2)
    python -m service.ops.build --portable      # for any x86-64-v3 CPU, not -march=native
                                                # (.cache/gguf-ops-portable; --out DIR)

Nothing is installed on the system. The inputs are fetched into the project's cache:

* ONNX Runtime's C/C++ headers: Debian 13 "trixie"'s ``libonnxruntime-dev`` (1.21, API
  version 21, which newer runtimes still serve), downloaded with apt-get into a private apt
  state (``.cache/ort-headers/apt``: its own sources list, lists, cache and an empty
  status file; the mirror is the one this machine's /etc/apt sources name, or
  ``$ATTNSERVE_DEBIAN_MIRROR``) and unpacked with dpkg-deb. The package holds headers only;
  the op never links libonnxruntime (the runtime hands it its API table).
* ggml: ``vendor/llama.cpp/ggml`` of the pinned llama-cpp-python sdist (``pip download``),
  the same tarball benchmarks/llamacpp_tools.py keeps in ``.cache/llamacpp-tools``.

ggml-base and ggml-cpu are built as shared libraries (CPU backend only, ``GGML_NATIVE``
less Intel AMX, no OpenMP: the op runs on ONNX Runtime's threads), then our library
against them. The three files land in ``.cache/gguf-ops/<key>/`` (RPATH ``$ORIGIN``), with
``build-info.json`` and ``build.log``; ``.cache/gguf-ops/current`` points at the latest
(older builds are removed).
The key covers the sdist, the headers' version, the op's sources, the flags and this CPU
(``-march=native``): with everything in place a run only hashes and returns (< 1 s).
Builds happen in a temporary directory renamed into place, under a lock.

Needs cmake, ninja (or make), a C++17 compiler, and for a first fetch apt-get, dpkg-deb
and pip; a missing one is named on one line and the exit status is 2.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
REPO_ROOT = SOURCE_DIR.parents[1]
CACHE_DIR = REPO_ROOT / ".cache" / "gguf-ops"
HEADERS_DIR = REPO_ROOT / ".cache" / "ort-headers"
# The tarball benchmarks/llamacpp_tools.py downloads too: fetched once for both.
SDIST_DIR = REPO_ROOT / ".cache" / "llamacpp-tools"
LIBRARY_NAME = "libattnserve_gguf_ops.so"
CURRENT_LINK = "current"
INFO_FILE = "build-info.json"
SOURCES = ("gguf_ops.h", "gguf_ops.cc", "gguf_matmul.cc", "gguf_gather.cc",
           "cached_attention.cc", "cached_attention_kernels.inc", "gguf_batched.h",
           "gguf_batched.cc", "gguf_batched_kernels.inc", "gguf_float.h", "gguf_float.cc",
           "gguf_repacked.h", "gguf_repacked.cc", "gguf_rowdot.h", "gguf_rowdot.cc",
           "gguf_epilogue.h", "gguf_epilogue.cc", "vec_exp.h", "CMakeLists.txt")

# Equal to benchmarks/llamacpp_env.py's pin (a test checks): the kernels the benchmark's
# llama.cpp runs are the kernels this op runs.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ORT_HEADERS_PACKAGE = "libonnxruntime-dev"
ORT_HEADERS_SUITE = "trixie"
ORT_HEADERS_UPSTREAM = "1.21."  # Debian versions 1.21.x+dfsg-N
ORT_API_VERSION = 21
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
MIRROR_ENV = "ATTNSERVE_DEBIAN_MIRROR"
APT_SOURCES = Path("/etc/apt")
DEFAULT_JOBS = 2

# What the op library must understand for the graphs this attnserve exports: 1 GgufMatMul
# and GgufGather over the file's rows at int8 activations, 2 and activations="float", 3 and
# layout="repacked_8x8", 4 and the CachedAttention op, 5 and GgufMatMul's epilogue="swiglu"
# with the Swiglu op, 6 and CachedAttention over a float16 cache.
# Compiled into the library
# (attnserve_gguf_ops_level, below), which service.ops does not load when it reports less,
# or nothing (built from older sources): ONNX Runtime hands an op only the attributes it
# asks for, so it would ignore the ones it does not know and compute a repacked or
# float-activation node wrongly (and an older library has no CachedAttention at all).
OPS_LEVEL = 6
# Explicit -mno-* options win over -march=native in GCC and clang: AMX kernels crashed
# ggml on AMX hosts (see benchmarks/llamacpp_env.py), and the op needs none.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    # ONNX Runtime's pool runs the op; llamafile's sgemm serves ggml's own mul_mat, which
    # the op does not call. The repack buffer type is how the export lays Q4_0 / IQ4_NL
    # out for ggml's gemv and gemm (gguf_repacked.h).
    "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=ON",
    "-DGGML_BACKEND_DL=OFF", "-DGGML_CCACHE=OFF", "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
    # What the library reports to service.ops before it is loaded (attnserve_gguf_ops_level).
    f"-DATTNSERVE_GGUF_OPS_LEVEL={OPS_LEVEL}",
)
# Bumped when the build's layout changes without any input above changing.
BUILD_FORMAT = 1

# `--portable` (the serving image, deploy/Dockerfile): for any x86-64-v3 CPU (Haswell, Zen 1
# and later), not this one. ggml-cpu gets AVX2, FMA, F16C and BMI2 explicitly (ggml's
# GGML_CPU_ALL_VARIANTS needs GGML_BACKEND_DL, whose CPU backends are dlopen'ed modules: the
# op links ggml-cpu and calls it directly); the op's own batched kernels choose AVX2 or
# AVX-512 VNNI at run time. The key has no CPU signature; build-info.json lists the
# /proc/cpuinfo flags the code needs, which service.ops.library_path() checks before the
# library is loaded (a CPU without them gets None and a log line, never SIGILL).
PORTABLE_CACHE_DIR = REPO_ROOT / ".cache" / "gguf-ops-portable"
PORTABLE_CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
PORTABLE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    *CMAKE_ARGS[CMAKE_ARGS.index("-DGGML_OPENMP=OFF"):],
)


def cmake_args(portable: bool = False) -> tuple[str, ...]:
    return PORTABLE_CMAKE_ARGS if portable else CMAKE_ARGS

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The build ran and failed (a compile error, a broken download)."""


class BuildUnavailable(BuildError):
    """The build cannot run here: a tool is missing or an input cannot be fetched."""


def _stderr(message: str) -> None:
    print(f"gguf-ops: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The key: everything the library is made of, cheap to compute (no subprocess, no network).

def cpu_signature() -> str:
    """This CPU's feature flags (``-march=native`` builds for them) and architecture."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                flags = " ".join(sorted(value.split()))
                break
    return f"{platform.machine()} {flags}"


def build_key(portable: bool = False) -> str:
    """``0.3.36-ort1.21-<sha256 prefix>``: the directory today's build lives in
    (``0.3.36-ort1.21-portable-<prefix>`` for ``portable``: no CPU signature in the key)."""
    digest = hashlib.sha256()
    target = f"{platform.machine()} portable" if portable else cpu_signature()
    for part in (LLAMA_CPP_PYTHON, ORT_HEADERS_PACKAGE, ORT_HEADERS_SUITE, ORT_HEADERS_UPSTREAM,
                 str(ORT_API_VERSION), *cmake_args(portable), str(BUILD_FORMAT), target):
        digest.update(part.encode() + b"\0")
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes() + b"\0")
    version = LLAMA_CPP_PYTHON.partition("==")[2]
    return (f"{version}-ort{ORT_HEADERS_UPSTREAM.rstrip('.')}-{'portable-' if portable else ''}"
            f"{digest.hexdigest()[:12]}")


def sources_present() -> bool:
    return all((SOURCE_DIR / name).is_file() for name in SOURCES)


def find_built(cache: Path = CACHE_DIR, portable: bool = False) -> Path | None:
    """Today's library (built with today's key), or None."""
    if not sources_present():
        return None
    directory = cache / build_key(portable)
    library = directory / LIBRARY_NAME
    return library if library.is_file() and (directory / INFO_FILE).is_file() else None


# ---------------------------------------------------------------------------------------------
# Inputs: the headers (a Debian package, unpacked) and ggml (from the sdist).

def _require(tool: str, package: str, why: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise BuildUnavailable(f"{tool} not found ({why}): install the Debian package {package} "
                               f"(`make gguf-ops` does, as root)")
    return found


def _run(cmd: list[str], log_file: Path, cwd: Path | None = None,
         env: dict[str, str] | None = None, unavailable: bool = False) -> None:
    """``cmd`` with its output appended to ``log_file``; BuildError (or BuildUnavailable
    for a fetch) with the log's tail on failure."""
    with open(log_file, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if result.returncode != 0:
        tail = log_file.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        error = BuildUnavailable if unavailable else BuildError
        raise error(f"{Path(cmd[0]).name} {cmd[1] if len(cmd) > 1 else ''} failed "
                    f"(exit {result.returncode}); log {log_file}:\n" + "\n".join(tail))


def _apt_source_entries(root: Path = APT_SOURCES) -> Iterator[tuple[str, list[str], list[str]]]:
    """(URI, suites, components) of every enabled ``deb`` source, one-line and deb822."""
    one_line = [root / "sources.list", *sorted((root / "sources.list.d").glob("*.list"))]
    for path in one_line:
        with contextlib.suppress(OSError):
            for line in path.read_text(encoding="utf-8").splitlines():
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb":
                    yield words[1], [words[2]], words[3:]
    for path in sorted((root / "sources.list.d").glob("*.sources")):
        with contextlib.suppress(OSError):
            for stanza in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
                if ("deb" in fields.get("types", "").split()
                        and fields.get("enabled", "yes").lower() != "no"):
                    for uri in fields.get("uris", "").split():
                        yield uri, fields.get("suites", "").split(), \
                            fields.get("components", "").split()


def debian_mirror(root: Path = APT_SOURCES) -> str:
    """The Debian archive this machine's apt uses (not its security or update suites)."""
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override.rstrip("/")
    for uri, suites, components in _apt_source_entries(root):
        if ("main" in components and uri.rstrip("/").endswith("/debian")
                and any("-" not in suite for suite in suites)):
            return uri.rstrip("/")
    raise BuildUnavailable(f"no Debian archive among the apt sources in {root} (a Debian "
                           f"system's main suite); set {MIRROR_ENV} to a Debian mirror URL")


def _header_dirs(root: Path = HEADERS_DIR) -> list[Path]:
    pattern = f"{ORT_HEADERS_PACKAGE}_{ORT_HEADERS_UPSTREAM}*/usr/include/onnxruntime"
    return sorted(p for p in root.glob(pattern) if (p / "onnxruntime_cxx_api.h").is_file())


def _api_version(include: Path) -> int:
    text = (include / "onnxruntime_c_api.h").read_text(encoding="utf-8", errors="replace")
    found = re.search(r"#define ORT_API_VERSION (\d+)", text)
    return int(found.group(1)) if found else -1


def ensure_ort_headers(root: Path = HEADERS_DIR, log: Log = _stderr) -> Path:
    """``usr/include/onnxruntime`` of Debian trixie's libonnxruntime-dev, fetched once."""
    cached = _header_dirs(root)
    if cached:
        return cached[-1]
    apt_get = _require("apt-get", "apt", f"fetches {ORT_HEADERS_PACKAGE}")
    dpkg_deb = _require("dpkg-deb", "dpkg", f"unpacks {ORT_HEADERS_PACKAGE}")
    if not DEBIAN_KEYRING.is_file():
        raise BuildUnavailable(f"{DEBIAN_KEYRING} missing: install the Debian package "
                               f"debian-archive-keyring")
    mirror = debian_mirror()
    log(f"fetching {ORT_HEADERS_PACKAGE} from {mirror} {ORT_HEADERS_SUITE} into {root}")
    apt = root / "apt"
    for sub in ("lists/partial", "cache/archives/partial"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "sources.list").write_text(
        f"deb [signed-by={DEBIAN_KEYRING}] {mirror} {ORT_HEADERS_SUITE} main\n", encoding="utf-8")
    (apt / "status").write_text("", encoding="utf-8")  # nothing is installed in this state
    options = [f"-oDir::Etc::sourcelist={apt / 'sources.list'}", "-oDir::Etc::sourceparts=-",
               f"-oDir::State::Lists={apt / 'lists'}", f"-oDir::Cache={apt / 'cache'}",
               f"-oDir::State::status={apt / 'status'}", "-oAcquire::Languages=none"]
    if os.geteuid() == 0:  # apt's _apt user cannot write into the project's cache
        options.append("-oAPT::Sandbox::User=root")
    log_file = root / "fetch.log"
    _run([apt_get, "-q", *options, "update"], log_file, unavailable=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _run([apt_get, "-q", *options, "download", ORT_HEADERS_PACKAGE], log_file,
             cwd=Path(tmp), unavailable=True)
        (deb,) = Path(tmp).glob(f"{ORT_HEADERS_PACKAGE}_*.deb")
        version = deb.name.split("_")[1]
        if not version.startswith(ORT_HEADERS_UPSTREAM):
            raise BuildError(f"{ORT_HEADERS_SUITE} now has {ORT_HEADERS_PACKAGE} {version}, "
                             f"not {ORT_HEADERS_UPSTREAM}x: update ORT_HEADERS_* in {__file__}")
        unpacked = Path(tmp) / "unpacked"
        _run([dpkg_deb, "-x", str(deb), str(unpacked)], log_file)
        include = unpacked / "usr" / "include" / "onnxruntime"
        if _api_version(include) != ORT_API_VERSION:
            raise BuildError(f"{deb.name} declares ORT_API_VERSION {_api_version(include)}, "
                             f"expected {ORT_API_VERSION}")
        shutil.move(str(deb), root / deb.name)
        target = root / deb.name.removesuffix(".deb")
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)
    return _header_dirs(root)[-1]


def sdist_stem() -> str:
    """``llama_cpp_python-0.3.36``: the sdist's file stem and its top-level folder."""
    name, _, version = LLAMA_CPP_PYTHON.partition("==")
    return f"{name.replace('-', '_')}-{version}"


def ensure_sdist(root: Path = SDIST_DIR, log: Log = _stderr) -> Path:
    """The pinned llama-cpp-python sdist, downloaded with pip unless already there."""
    tarball = root / f"{sdist_stem()}.tar.gz"
    if tarball.is_file():
        return tarball
    root.mkdir(parents=True, exist_ok=True)
    log(f"downloading the {LLAMA_CPP_PYTHON} sdist (~77 MB) into {root}")
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--dest", str(root), LLAMA_CPP_PYTHON], root / "pip-download.log", unavailable=True)
    if not tarball.is_file():
        raise BuildUnavailable(f"pip download left no {tarball}")
    return tarball


def extract_ggml(tarball: Path, dest: Path) -> Path:
    """``vendor/llama.cpp/ggml`` of the sdist as ``dest/ggml`` (25 MB of the 176 MB tree)."""
    prefix = f"{sdist_stem()}/vendor/llama.cpp/ggml/"
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix):
                member.name = "ggml/" + member.name[len(prefix):]
                members.append(member)
        # Debian bookworm's Python 3.11.2 (the image's builder stage) predates the filters
        # (3.11.4); the members are the pinned sdist's, renamed under ggml/ above.
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    ggml = dest / "ggml"
    if not (ggml / "include" / "ggml-cpu.h").is_file():
        raise BuildError(f"{tarball.name} holds no vendor/llama.cpp/ggml")
    return ggml


# ---------------------------------------------------------------------------------------------
# The build.

@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One build at a time per cache (two pytest sessions may start together)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _point_current(cache: Path, key: str) -> None:
    link = cache / CURRENT_LINK
    tmp = cache / f".{CURRENT_LINK}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(key)
    os.replace(tmp, link)


def _prune(cache: Path, keep: str) -> None:
    """Builds of older sources and flags (each a few MB) go once a new one is in place; a
    process still running one keeps its mapped files."""
    for old in cache.iterdir():
        if old.name != keep and old.is_dir() and not old.is_symlink() \
                and (old / INFO_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)


def _generator() -> list[str]:
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if ninja:
        return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    if shutil.which("make"):
        return ["-G", "Unix Makefiles"]
    raise BuildUnavailable("neither ninja nor make found (compiles the op): install the Debian "
                           "package ninja-build (`make gguf-ops` does, as root)")


def ensure_built(cache: Path = CACHE_DIR, jobs: int = DEFAULT_JOBS, force: bool = False,
                 log: Log = _stderr, portable: bool = False) -> Path:
    """The op library for today's key, built first if need be. BuildUnavailable when a tool
    or an input is missing here; BuildError when the build itself fails. ``portable``: the
    x86-64-v3 build (PORTABLE_CMAKE_ARGS), kept in a cache of its own (the default one's
    older builds are pruned)."""
    if not sources_present():
        raise BuildUnavailable(f"the op's sources ({', '.join(SOURCES)}) are not in {SOURCE_DIR}")
    if not force and (built := find_built(cache, portable)):
        return built
    with _locked(cache):
        if not force and (built := find_built(cache, portable)):
            return built  # another process built it while we waited
        return _build(cache, jobs, log, portable)


def _build(cache: Path, jobs: int, log: Log, portable: bool = False) -> Path:
    key = build_key(portable)
    cmake = _require("cmake", "cmake", "configures the op")
    generator = _generator()
    if not (shutil.which("c++") or shutil.which("g++")):
        raise BuildUnavailable("no C++ compiler (c++ or g++) found: install the Debian package "
                               "g++ (`make gguf-ops` does, as root)")
    include = ensure_ort_headers(log=log)
    tarball = ensure_sdist(log=log)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    log_file = cache / "build.log"  # the latest build's, kept when it fails (we hold the lock)
    log_file.write_text("", encoding="utf-8")
    try:
        log(f"building {LIBRARY_NAME} with ggml from {tarball.name} into {cache / key} "
            f"(0.5-1.5 min on 2 cores; log {log_file})")
        ggml = extract_ggml(tarball, work / "src")
        build = work / "build"
        env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        _run([cmake, "-S", str(SOURCE_DIR), "-B", str(build), *generator,
              f"-DGGML_SOURCE_DIR={ggml}", f"-DORT_INCLUDE_DIR={include}",
              *cmake_args(portable)],
             log_file, env=env)
        _run([cmake, "--build", str(build), "--parallel", str(jobs),
              "--target", "attnserve_gguf_ops"], log_file, env=env)
        stage = work / "install"
        stage.mkdir()
        listed = (build / "install-files.txt").read_text(encoding="utf-8").split()
        for path in map(Path, listed):
            shutil.copy2(path, stage / path.name)  # follows the SONAME symlinks
        sizes = {p.name: p.stat().st_size for p in sorted(stage.iterdir())}
        seconds = round(time.monotonic() - started, 1)
        info = {"key": key, "llama_cpp_python": LLAMA_CPP_PYTHON,
                "ort_headers": str(include.parents[2].name), "ort_api_version": ORT_API_VERSION,
                "cmake_args": list(cmake_args(portable)), "jobs": jobs, "build_seconds": seconds,
                "files": sizes}
        if portable:  # checked by service.ops.library_path() before the library is loaded
            info.update(machine=platform.machine(), required_cpu_flags=list(PORTABLE_CPU_FLAGS))
        (stage / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        shutil.copy2(log_file, stage / "build.log")
        target = cache / key
        shutil.rmtree(target, ignore_errors=True)  # this key's previous build (--force)
        stage.rename(target)
        _point_current(cache, key)
        _prune(cache, keep=key)
        log(f"built in {seconds} s: "
            + ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in sizes.items()))
        return target / LIBRARY_NAME
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.ops.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-path", action="store_true",
                   help="print the built library's path; exit 1 when it is not built")
    p.add_argument("--force", action="store_true", help="build even if built already")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS,
                   help=f"parallel compile jobs (default {DEFAULT_JOBS})")
    p.add_argument("--portable", action="store_true",
                   help="build for any x86-64-v3 CPU (AVX2, FMA, F16C, BMI2), not this one's "
                        "-march=native: what the serving image ships (default cache "
                        f"{PORTABLE_CACHE_DIR.relative_to(REPO_ROOT)})")
    p.add_argument("--out", type=Path, default=None,
                   help="the build cache to use: DIR/<key>/ and DIR/current (default "
                        f"{CACHE_DIR.relative_to(REPO_ROOT)}, or the portable one)")
    args = p.parse_args(argv)
    cache = args.out or (PORTABLE_CACHE_DIR if args.portable else CACHE_DIR)
    if args.print_path:
        built = find_built(cache, args.portable)
        if built is None:
            _stderr("not built (run: python -m service.ops.build)")
            return 1
        print(built)
        return 0
    try:
        print(ensure_built(cache, jobs=args.jobs, force=args.force, portable=args.portable))
    except BuildUnavailable as exc:
        _stderr(f"cannot build here: {exc}")
        return 2
    except BuildError as exc:
        _stderr(f"build failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
