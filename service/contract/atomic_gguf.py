"""A GGUF file written whole or not at all: every one the project writes (export/gguf/'s
model and LoRA adapter, control_vector.py's vectors) goes through :func:`write_atomically`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFWriter


def write_atomically(writer_of: Callable[[Path], GGUFWriter], out: Path) -> Path:
    """Write the file ``writer_of(path)``'s GGUFWriter holds to a temporary sibling of
    ``out`` and rename it into place; nothing is left behind if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = writer_of(tmp)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.chmod(0o644)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
