"""release_range: the pages inside a range of a read-only file mapping leave memory and
read back the same; the pages it only partly covers stay."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from service.contract.pages import file_mappings, release_range

PAGE = mmap.PAGESIZE


def resident(path: Path) -> int:
    return sum(m.resident_bytes for m in file_mappings(path))


def test_pages_inside_the_range_go_and_read_back_the_same(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = np.memmap(path, mode="r")  # as the gguf package maps a file
    assert int(mapped.astype(np.int64).sum()) == int(data.astype(np.int64).sum())
    assert resident(path) == data.nbytes  # every page read
    # from the middle of page 3 to the middle of page 40: pages 4..39 lie wholly inside
    start, stop = 3 * PAGE + 100, 40 * PAGE + 7
    view = mapped[start:stop]

    dropped = release_range(view.ctypes.data, view.nbytes)

    assert dropped == 36 * PAGE
    assert resident(path) == data.nbytes - 36 * PAGE
    assert np.array_equal(mapped, data)  # faulted back in from the file
    assert resident(path) == data.nbytes


def test_a_range_within_one_page_drops_nothing(tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    np.arange(4 * PAGE, dtype=np.uint8).tofile(path)
    mapped = np.memmap(path, mode="r")
    assert int(mapped[::PAGE].sum()) >= 0  # each page touched
    view = mapped[PAGE + 10:2 * PAGE - 10]
    assert release_range(view.ctypes.data, view.nbytes) == 0
    assert resident(path) == 4 * PAGE
    assert release_range(view.ctypes.data, 0) == 0
