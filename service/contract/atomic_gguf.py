"""A GGUF file written whole or not at all.

Every GGUF file the project writes (the model and LoRA adapter for llama.cpp in
export/gguf/, a control vector in control_vector.py) goes through :func:`write_atomically`:
a temporary sibling holds the writer's header, keys and tensors and is renamed into place
only once complete, so a failed or interrupted write leaves nothing behind.
"""

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
