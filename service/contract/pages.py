"""This process's mappings of files, and dropping the pages it only read from them: what
the service does once its sessions are loaded (service/engine/engine.py) and the export
once a check's session has packed its weights (export/from_blocks.py). Also the C heap's free
pages given back (glibc's ``malloc_trim``), by the server when idle and by the export
between stages (export/memory.py).

ONNX Runtime memory-maps a graph's external weights and packs each product's into a buffer
of its own; the pages the packing read stay resident in the mapping, beside the packed
copy (a 3B model's judge held both: 5.8 GB). Dropping them (``MADV_DONTNEED``, only in
mappings where no page was written, so nothing is lost: a read faults the page back in
from the file or the page cache) leaves the packed copy alone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\S+)\s*(.*)$")


def libc_function(name: str, argtypes: list[type], restype: type) -> Callable[..., int] | None:
    try:
        process = ctypes.CDLL(None, use_errno=True)  # the symbols loaded: libc among them
    except OSError:
        return None
    function = getattr(process, name, None)
    if function is None:
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


MADVISE = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                        ctypes.c_int)
_MALLOC_TRIM = libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)  # glibc only


def can_release() -> bool:
    """Whether this process's C library can give freed heap pages back."""
    return _MALLOC_TRIM is not None


def release_freed_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; True when any were."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


@dataclass(frozen=True)
class Mapping:
    """One mapping in this process, with its resident and written sizes."""

    start: int
    end: int
    resident_bytes: int
    written_bytes: int  # private pages written (copied on write, or anonymous memory)


@dataclass(frozen=True)
class Region:
    mapping: Mapping
    permissions: str  # e.g. rw-p
    inode: str  # "0": not a file
    name: str  # the file, [heap], [stack]..., or "" for anonymous memory


def regions(smaps: Path) -> list[Region]:
    """Every mapping in ``smaps`` (none where /proc is not there)."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return []
    headers: list[tuple[tuple[str, ...], dict[str, int]]] = []  # (fields, sizes in bytes)
    for line in lines:
        match = _HEADER.match(line)
        if match:
            headers.append((match.groups(), {"Rss:": 0, "Anonymous:": 0}))
        elif headers and line.startswith(("Rss:", "Anonymous:")):
            key, kib = line.split()[:2]
            headers[-1][1][key] = int(kib) * 1024
    return [Region(Mapping(int(start, 16), int(end, 16), sizes["Rss:"], sizes["Anonymous:"]),
                    permissions, inode, name)
            for (start, end, permissions, inode, name), sizes in headers]


def file_mappings(path: Path, smaps: Path = Path("/proc/self/smaps")) -> list[Mapping]:
    """This process's mappings of the file ``path`` or of files under the directory
    ``path`` (none where /proc is not there)."""
    target = os.path.realpath(path)
    inside = target.rstrip(os.sep) + os.sep
    return [r.mapping for r in regions(smaps)
            if r.name == target or r.name.startswith(inside)]


def release_range(start: int, length: int) -> int:
    """Drop the resident pages lying wholly inside ``[start, start + length)`` of a
    read-only file mapping (a page shared with bytes around it stays); the bytes dropped.
    Cheaper than :func:`release_file_pages` (no walk of /proc) where the caller knows the
    range, e.g. one tensor of a memory-mapped GGUF file. Never for memory anyone wrote:
    MADV_DONTNEED would lose a written private page."""
    if MADVISE is None or length <= 0:
        return 0
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or MADVISE(first, last - first, mmap.MADV_DONTNEED) != 0:
        return 0
    return last - first


def release_file_pages(path: Path) -> int:
    """Drop this process's resident pages of the file ``path`` (or of the files under the
    directory ``path``) in every mapping where none was written; the bytes that were
    resident in the mappings dropped. Later reads fault pages back in."""
    if MADVISE is None:
        return 0
    released = 0
    for mapping in file_mappings(path):
        if mapping.written_bytes or not mapping.resident_bytes:
            continue  # a written private page exists only here: never drop it
        if MADVISE(mapping.start, mapping.end - mapping.start, mmap.MADV_DONTNEED) == 0:
            released += mapping.resident_bytes
    return released
