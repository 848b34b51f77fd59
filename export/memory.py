"""Handing memory freed between export stages back to the system.

glibc keeps freed blocks of its heaps for reuse instead of returning them, so after a
stage that made and freed many mid-sized buffers (PyTorch's forward passes, ONNX Runtime
sessions) the process stays as large as that stage's peak: after the PyTorch parity
checks of SmolLM2-135M, 430 MB of a 1.36 GB process were such free blocks. ``malloc_trim``
returns them. Elsewhere (macOS, musl) this only collects garbage.
"""

from __future__ import annotations

import gc

from service.contract.pages import release_freed_heap


def release() -> None:
    """Collect garbage, then give the allocator's free pages back (glibc)."""
    gc.collect()
    release_freed_heap()
