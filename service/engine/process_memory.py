"""How the server's weights sit in its memory: 2 MiB pages.

(What it gives back, its C heap's freed pages when idle and the weight pages read once at
load, is service/contract/pages.py's: after a 90-second soak of 16 chat clients on the real
SmolLM2, ``malloc_trim(0)`` gave back 84 MB of the server's 157 MB growth.)

A decode step streams every weight, and the weights ONNX Runtime packed at load sit in
4 KiB pages, so one step walks ~130,000 of them through the TLB. ``MADV_COLLAPSE`` (Linux
6.1+) moves a mapping's pages into 2 MiB pages at once, whatever the system's
transparent-huge-page mode (docs/engine.md measures it). Only 2 MiB ranges already nearly
all in RAM are collapsed, so memory that is reserved but not yet used is not made resident
(and the KV pool, advised against huge pages, is never touched).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np

from service.contract.pages import MADVISE as _MADVISE
from service.contract.pages import Mapping, libc_function, regions

MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1+; Python 3.11 lacks the name
HUGE_PAGE = 2 << 20
COLLAPSE_MIN_RESIDENT = 0.9  # share of a 2 MiB range in RAM: never fill a sparse one


_MINCORE = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
                          ctypes.c_int)


def anonymous_mappings(smaps: Path = Path("/proc/self/smaps")) -> list[Mapping]:
    """This process's private anonymous memory: malloc's own mappings and its heap."""
    return [r.mapping for r in regions(smaps)
            if r.inode == "0" and r.permissions == "rw-p" and r.name in ("", "[heap]")]


def resident_pages(address: int, nbytes: int) -> np.ndarray:
    """(⌈nbytes / page⌉,) bool: which pages of the page-aligned [address, address + nbytes)
    are in RAM (mincore(2)); OSError where mincore fails or is missing."""
    vec = np.zeros(-(-nbytes // mmap.PAGESIZE), np.uint8)  # bit 0: resident
    if _MINCORE is None:
        raise OSError("mincore is not available")
    if _MINCORE(address, nbytes, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return (vec & 1).astype(bool)


def collapse_to_huge_pages(min_resident: float = COLLAPSE_MIN_RESIDENT) -> int:
    """Move every 2 MiB range of this process's anonymous memory that is at least
    ``min_resident`` in RAM into a huge page; the bytes moved (0 where the kernel cannot:
    before Linux 6.1, or a mapping advised against huge pages like the KV pool's).

    Ranges are judged one by one, not by mapping: the kernel merges neighbouring
    allocations into one mapping, so weights and a reserved buffer may share one."""
    if _MADVISE is None:
        return 0
    moved = 0
    pages_per_range = HUGE_PAGE // mmap.PAGESIZE
    for mapping in anonymous_mappings():
        start = -(-mapping.start // HUGE_PAGE) * HUGE_PAGE
        end = mapping.end // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        try:
            resident = resident_pages(start, end - start).reshape(-1, pages_per_range)
        except OSError:
            continue
        full = resident.mean(axis=1) >= min_resident  # (ranges,)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], full.astype(np.int8), [0]])))
        for first, stop in zip(edges[0::2], edges[1::2], strict=True):  # runs of full ranges
            at, size = start + int(first) * HUGE_PAGE, int(stop - first) * HUGE_PAGE
            if _MADVISE(at, size, MADV_COLLAPSE) == 0:
                moved += size
    return moved
