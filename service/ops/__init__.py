"""Custom ONNX Runtime ops over GGUF bytes: ``GgufMatMul`` (service/ops/gguf_matmul.cc) and
``GgufGather`` (service/ops/gguf_gather.cc, an embedding lookup dequantising rows), and the
graphs' attention beside them: ``CachedAttention`` (service/ops/cached_attention.cc, ONNX
Runtime's GroupQueryAttention contract on a kernel that reads each row's cache once).

The op computes Y = X·Wᵀ with ggml's CPU dot products straight over a GGUF tensor's rows as
stored, so a graph can carry the file's quantised weights instead of float copies. It is a
native library built from source (``python -m service.ops.build`` / ``make gguf-ops``);
this module only finds it and registers it with a session's options:

    options = onnxruntime.SessionOptions()
    if not service.ops.register(options):
        ...  # not loadable here: the graph's blocks are dequantised (dequantised.py)

Where it is looked for, in order: ``$ATTNSERVE_GGUF_OPS`` (the .so itself, e.g. in an image
that ships it); the build for today's sources in ``.cache/gguf-ops/<key>/`` (a library built
from other sources is not used); where the sources are not at hand (an installed package),
``.cache/gguf-ops/current``. A library built from older sources than these (its
``attnserve_gguf_ops_level()`` below ``build.OPS_LEVEL``) is never used. Nothing here imports
onnxruntime or builds anything.

A portable build (``python -m service.ops.build --portable``, the one the serving image
ships) lists in its ``build-info.json`` the CPU flags its code needs (AVX2, FMA, F16C, ...):
where /proc/cpuinfo lacks one, ``library_path()`` returns None and logs why, so that the
library is never loaded on a CPU it would crash with an illegal instruction.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

ENV_VAR = "ATTNSERVE_GGUF_OPS"
DOMAIN = "attnserve.gguf"
MATMUL_OP = "GgufMatMul"
GATHER_OP = "GgufGather"
# GroupQueryAttention's contract with our CPU kernel (service/ops/cached_attention.cc)
ATTENTION_OP = "CachedAttention"
# GgufMatMul's ``layout`` attribute: W as the file's rows, or as ggml's CPU repack lays
# Q4_0 / IQ4_NL out (8 rows interleaved, the same bytes; service/ops/gguf_repacked.h)
ROWS_LAYOUT = "rows"
REPACKED_LAYOUT = "repacked_8x8"
# GgufMatMul's ``epilogue`` attribute: silu(gate) · up of its gate | up rows' products, the
# output half as wide (service/ops/gguf_epilogue.h)
SWIGLU_EPILOGUE = "swiglu"
# The same activation as an op of its own, X (..., 2F) gate | up → (..., F), for the graphs
# that add to gate and up before it (the adapter graphs; service/ops/swiglu.py)
SWIGLU_OP = "Swiglu"


class _SessionOptions(Protocol):
    """What register() needs of onnxruntime.SessionOptions."""

    def register_custom_ops_library(self, library_path: str) -> None: ...


CPUINFO = Path("/proc/cpuinfo")
_warned: set[str] = set()


def cpu_flags(cpuinfo: Path | None = None) -> set[str] | None:
    """This CPU's feature flags (the first ``flags`` line of /proc/cpuinfo); None when
    unreadable."""
    try:
        with open(CPUINFO if cpuinfo is None else cpuinfo, encoding="utf-8") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def cpu_mismatch(library: Path, cpuinfo: Path | None = None) -> str | None:
    """Why this CPU cannot run ``library`` (the required_cpu_flags or machine its
    build-info.json names, beside it), or None when it can or nothing is required (a
    ``-march=native`` build: its cache key holds this CPU's flags)."""
    try:
        info = json.loads((library.parent / "build-info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    required = info.get("required_cpu_flags") or []
    machine = info.get("machine")
    if machine and machine != platform.machine():
        return f"built for {machine}, this machine is {platform.machine()}"
    if not required:
        return None
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return (f"{CPUINFO if cpuinfo is None else cpuinfo} is unreadable: cannot check that "
                f"this CPU has {' '.join(required)}")
    missing = [flag for flag in required if flag not in flags]
    return f"this CPU lacks {' '.join(missing)}" if missing else None


def library_level(library: Path) -> int:
    """The OPS_LEVEL ``library`` was built with; 0 for a build older than the level (no
    ``attnserve_gguf_ops_level``). Loads it into the process (as a session would)."""
    return _library_level(str(library), library.stat().st_mtime_ns)


@functools.cache
def _library_level(library: str, _mtime_ns: int) -> int:
    import ctypes

    function = getattr(ctypes.CDLL(library), "attnserve_gguf_ops_level", None)
    if function is None:
        return 0
    function.restype = ctypes.c_int
    return int(function())


def _usable(library: Path) -> Path | None:
    from service.ops import build  # its OPS_LEVEL: what today's graphs need (build.py)

    reason = cpu_mismatch(library)
    if reason is None:
        try:
            level = library_level(library)
        except OSError as exc:  # e.g. a ggml library beside it missing
            level, reason = -1, f"it cannot be loaded: {exc}"
        if level >= build.OPS_LEVEL:
            return library
        reason = reason or (
            f"built from older sources (op level {level}, this attnserve's graphs need "
            f"{build.OPS_LEVEL}: it would ignore attributes it does not know); rebuild it "
            "with `make gguf-ops` (python -m service.ops.build)")
    if str(library) not in _warned:
        _warned.add(str(library))
        log.warning("GGUF op library %s not loaded: %s; GGUF-kernel graphs run here with "
                    "their blocks dequantised to float32", library, reason)
    return None


def library_path(cache: Path | None = None) -> Path | None:
    """The op library to load, or None when it is not built, or built for CPU features
    this CPU lacks (logged once). FileNotFoundError when ``$ATTNSERVE_GGUF_OPS`` names a
    file that is not there (a typo must not pass silently). ``cache``: the build cache
    (default ``.cache/gguf-ops``)."""
    # Imported here, not above: `python -m service.ops.build` imports this package first,
    # and must not find its own module already imported.
    from service.ops import build

    cache = build.CACHE_DIR if cache is None else cache
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_VAR}={override}: no such file")
        return _usable(path)
    if build.sources_present():
        built = build.find_built(cache)
        return None if built is None else _usable(built)
    current = cache / build.CURRENT_LINK / build.LIBRARY_NAME
    return _usable(current) if current.is_file() else None


def kernel_in_use(kernel: str) -> str:
    """Whose kernels compute a graph the graph table says runs on ``kernel`` here: a GGUF
    graph ("ggml") runs "dequantised" (float32 on ONNX Runtime's own kernels) where the op
    library cannot load."""
    return "dequantised" if kernel == "ggml" and library_path() is None else kernel


def attention_in_use(graph: Path) -> str | None:
    """Whose kernel runs a served graph's attention: the op library's ``CachedAttention``
    where the graph holds it (``--kernel ggml`` exports since op level 4) and the library
    loads, else ONNX Runtime's ``GroupQueryAttention`` (the dequantised copy turns our node
    back into it); None for a graph with neither (model.onnx)."""
    held = _attention_held(str(graph), graph.stat().st_mtime_ns)
    return "GroupQueryAttention" if held == ATTENTION_OP and library_path() is None else held


@functools.cache
def _attention_held(graph: str, _mtime_ns: int) -> str | None:
    """The attention op a graph file holds, read from its bytes once (as
    :func:`service.contract.sessions.uses_gguf_ops` reads the domain): /info asks each call."""
    data = Path(graph).read_bytes()
    for op in (ATTENTION_OP, "GroupQueryAttention"):
        if op.encode() in data:
            return op
    return None


def repack(ggml_type: int, k: int, rows: np.ndarray,
           library: Path | None = None) -> tuple[np.ndarray | None, str]:
    """``rows`` ((N, row_bytes) uint8, as the file stores them) in :data:`REPACKED_LAYOUT`,
    by ggml's own repack in the op library (``library``, default :func:`library_path`),
    checked by unpacking it back: (the new bytes, ""), or (None, why not: a type without the
    layout, N not a multiple of 8, this CPU's ggml keeping the rows, no library)."""
    import ctypes

    import numpy as np

    path = library_path() if library is None else library
    if path is None:
        return None, "the GGUF op library is not built"
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    out = np.empty_like(rows)
    error = ctypes.create_string_buffer(512)
    function = _repack_function(str(path))
    if function(ggml_type, k, rows.shape[0], rows.ctypes.data, out.ctypes.data, error,
                len(error)):
        return None, error.value.decode("utf-8", "replace")
    return out, ""


@functools.cache
def _repack_function(library: str) -> Any:
    """The library's ``attnserve_gguf_repack`` (service/ops/gguf_repacked.cc), loaded once."""
    import ctypes

    function = ctypes.CDLL(library).attnserve_gguf_repack
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    return function


def register(options: _SessionOptions, cache: Path | None = None) -> bool:
    """Register the op library with ``options``; False (nothing registered) when not built,
    or built for CPU flags this CPU lacks (library_path)."""
    path = library_path(cache)
    if path is None:
        return False
    options.register_custom_ops_library(str(path))
    return True
