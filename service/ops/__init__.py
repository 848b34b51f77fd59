"""Custom ONNX Runtime ops over GGUF bytes: ``GgufMatMul`` (service/ops/gguf_matmul.cc).

The op computes Y = X·Wᵀ with ggml's CPU dot products straight over a GGUF tensor's rows as
stored, so a graph can carry the file's quantised weights instead of float copies. It is a
native library built from source (``python -m service.ops.build`` / ``make gguf-ops``);
this module only finds it and registers it with a session's options:

    options = onnxruntime.SessionOptions()
    if not service.ops.register(options):
        ...  # not built: graphs using the op cannot be loaded

Where it is looked for, in order: ``$ATTNSERVE_GGUF_OPS`` (the .so itself, e.g. in an image
that ships it); the build for today's sources in ``.cache/gguf-ops/<key>/`` (a library built
from other sources is not used); where the sources are not at hand (an installed package),
``.cache/gguf-ops/current``. Nothing here imports onnxruntime or builds anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

ENV_VAR = "ATTNSERVE_GGUF_OPS"
DOMAIN = "attnserve.gguf"
MATMUL_OP = "GgufMatMul"


class _SessionOptions(Protocol):
    """What register() needs of onnxruntime.SessionOptions."""

    def register_custom_ops_library(self, library_path: str) -> None: ...


def library_path(cache: Path | None = None) -> Path | None:
    """The op library to load, or None when it is not built. FileNotFoundError when
    ``$ATTNSERVE_GGUF_OPS`` names a file that is not there (a typo must not pass silently).
    ``cache``: the build cache (default ``.cache/gguf-ops``)."""
    # Imported here, not above: `python -m service.ops.build` imports this package first,
    # and must not find its own module already imported.
    from service.ops import build

    cache = build.CACHE_DIR if cache is None else cache
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_VAR}={override}: no such file")
        return path
    if build.sources_present():
        return build.find_built(cache)
    current = cache / build.CURRENT_LINK / build.LIBRARY_NAME
    return current if current.is_file() else None


def register(options: _SessionOptions, cache: Path | None = None) -> bool:
    """Register the op library with ``options``; False (nothing registered) when not built."""
    path = library_path(cache)
    if path is None:
        return False
    options.register_custom_ops_library(str(path))
    return True
