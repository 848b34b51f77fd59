"""Build an output directory beside its target and rename it into place when complete.

Checkpoints, ONNX artifacts and Hugging Face copies are all written this way, so an
interrupted or failed run never leaves a directory that looks valid. Torch-free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target``; on success it replaces ``target``.

    mkdtemp creates the directory with mode 0700; the result is opened to 0755 so a
    non-root container user can read a directory built by root. An existing target is
    moved aside first and removed only after the new directory is in place.
    """
    out = Path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(tmp, out)
            return
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
