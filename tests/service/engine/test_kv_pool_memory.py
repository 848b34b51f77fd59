"""The KV pool's physical memory follows the tokens it holds (service/engine/kv_pool.py).

Resident memory is read from /proc/self/smaps (the kernel's own account of the pool's
address range), independently of the pool's mincore-based ``resident_bytes``, and set
against the pages that the written tokens must occupy. Contents are checked against numpy
copies taken before each move, compaction and truncation.
"""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest

from service.engine.kv_pool import PAGE, KVPool, PoolShape, Slot

# 1 MiB per (slot, head) stretch: page-aligned, so the expected page counts are exact.
SHAPE = PoolShape(layers=4, heads=2, max_len=4096, head_dim=64, dtype=np.dtype(np.float32))
TOKEN = SHAPE.head_dim * SHAPE.dtype.itemsize  # bytes of one token of one head


def smaps_rss(pool: KVPool) -> int:
    """Rss of the pool's mappings per /proc/self/smaps (VMAs of adjacent mappings with the
    same flags may be merged: every VMA that overlaps the pool must lie inside it)."""
    ranges = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in pool.arrays)
    total, vma = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            vma = (lo, hi) if any(lo < r_hi and r_lo < hi for r_lo, r_hi in ranges) else None
            if vma is not None:
                inside = sum(min(hi, r_hi) - max(lo, r_lo) for r_lo, r_hi in ranges
                             if lo < r_hi and r_lo < hi)
                assert inside == hi - lo, f"VMA {lo:#x}-{hi:#x} is not all KV pool"
        elif vma is not None and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def pages(tokens: int) -> int:
    """Resident bytes of one slot holding ``tokens``: whole pages per (array, head)."""
    return SHAPE.layers * SHAPE.heads * (-(-tokens * TOKEN // PAGE)) * PAGE


def write(pool: KVPool, slot: Slot, tokens: int, seed: int) -> list[np.ndarray]:
    """Fill ``tokens`` columns of ``slot`` as the kernel would; the values, for reference."""
    rng = np.random.default_rng(seed)
    values = []
    for a in pool.arrays:
        v = rng.standard_normal((SHAPE.heads, tokens, SHAPE.head_dim)).astype(np.float32)
        a[slot.index, :, :tokens] = v  # (nh, n, hs)
        values.append(v)
    pool.tokens[slot.index, :tokens] = rng.integers(0, 1000, tokens)
    pool.lengths[slot.index] = tokens
    return values


def held(pool: KVPool, slot: Slot) -> list[np.ndarray]:
    n = int(pool.lengths[slot.index])
    return [a[slot.index, :, :n].copy() for a in pool.arrays]


def assert_same(got: list[np.ndarray], want: list[np.ndarray], tokens: int) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w[:, :tokens])


@pytest.fixture
def pool() -> KVPool:
    return KVPool(SHAPE, slots=8)


def test_a_fresh_pool_reserves_address_space_only(pool: KVPool) -> None:
    assert pool.bytes_allocated == 8 * SHAPE.slot_bytes
    assert smaps_rss(pool) == 0 and pool.resident_bytes == 0


def test_process_memory_memory_grows_with_tokens_and_falls_after_truncate_and_free(
        pool: KVPool) -> None:
    a, b = pool.allocate(2)
    write(pool, a, 1000, 0)
    assert smaps_rss(pool) == pool.resident_bytes == pages(1000)
    write(pool, b, 300, 1)
    assert smaps_rss(pool) == pool.resident_bytes == pages(1000) + pages(300)

    pool.truncate(a, 200)
    assert int(pool.lengths[a.index]) == 200
    assert smaps_rss(pool) == pool.resident_bytes == pages(200) + pages(300)
    pool.truncate(a, 200)  # same length: nothing more to give back
    assert smaps_rss(pool) == pages(200) + pages(300)

    pool.free([b])
    assert smaps_rss(pool) == pool.resident_bytes == pages(200)
    pool.free([a])
    assert smaps_rss(pool) == pool.resident_bytes == 0
    # Given back, not merely forgotten: the next touch of those pages reads zeros.
    assert not any(np.any(x[:2]) for x in pool.arrays)
    assert smaps_rss(pool) == 0


def test_truncate_keeps_the_kept_tokens_and_refuses_to_grow(pool: KVPool) -> None:
    (a,) = pool.allocate(1)
    want = write(pool, a, 777, 2)
    pool.truncate(a, 123)
    assert_same(held(pool, a), want, 123)
    pool.truncate(a, 0)
    assert smaps_rss(pool) == 0
    with pytest.raises(ValueError, match="cannot truncate"):
        pool.truncate(a, 1)
    pool.free([a])
    with pytest.raises(ValueError, match="not allocated"):
        pool.truncate(a, 0)


@pytest.mark.parametrize("remap", [True, False], ids=["pages remapped", "tokens copied"])
def test_move_and_compact_keep_contents_and_leave_nothing_behind(pool: KVPool,
                                                                 remap: bool) -> None:
    """Both ways a row moves: its pages remapped (mremap, where the kernel has it) or
    its tokens copied (elsewhere)."""
    pool._can_remap = remap and pool._can_remap
    slots = pool.allocate(5)
    lengths = [40, 900, 17, 2048, 333]
    want = [write(pool, s, n, 10 + i) for i, (s, n) in enumerate(zip(slots, lengths,
                                                                       strict=True))]
    expected = sum(pages(n) for n in lengths)
    assert smaps_rss(pool) == expected

    ids = [pool.tokens[s.index, :n].copy() for s, n in zip(slots, lengths, strict=True)]
    pool.move(slots[3], 7)  # 2048 tokens to the top: slot 3 keeps nothing
    assert slots[3].index == 7
    if remap and not pool._can_remap:
        pytest.skip("this kernel has no mremap(MREMAP_DONTUNMAP): rows are copied")
    assert smaps_rss(pool) == pool.resident_bytes == expected
    assert_same(held(pool, slots[3]), want[3], 2048)

    # Rows 0 and 2 leave; the rest of the batch closes up from its old start.
    pool.free([slots[0], slots[2]])
    kept = [slots[1], slots[3], slots[4]]
    lo = pool.compact(kept, start=0)
    assert lo == 0 and sorted(s.index for s in kept) == [0, 1, 2]
    assert smaps_rss(pool) == pool.resident_bytes == sum(pages(lengths[i]) for i in (1, 3, 4))
    for i in (1, 3, 4):
        assert_same(held(pool, slots[i]), want[i], lengths[i])
        np.testing.assert_array_equal(pool.tokens[slots[i].index, :lengths[i]], ids[i])

    pool.truncate(slots[3], 100)  # after the move, at its new place
    assert_same(held(pool, slots[3]), want[3], 100)
    assert smaps_rss(pool) == pool.resident_bytes == sum(pages(n) for n in (900, 100, 333))
    # The slots left behind read zeros: their pages went back to the kernel. (Reading them
    # maps the shared zero page: RSS stays, mincore would now count those pages.)
    free = [i for i in range(8) if i not in {s.index for s in kept}]
    assert not any(np.any(x[free]) for x in pool.arrays)
    assert smaps_rss(pool) == sum(pages(n) for n in (900, 100, 333))


def _ram_and_swap() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))


def test_a_pool_larger_than_ram_and_swap_can_be_created() -> None:
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("vm.overcommit_memory = 2 (strict accounting ignores MAP_NORESERVE)")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    total = _ram_and_swap()
    # Two arrays, each alone larger than RAM + swap: plain malloc'd memory of that size is
    # refused by the kernel's overcommit heuristic.
    max_len = 1 << 16
    slots = int(total * 1.25) // (2 * max_len * 64 * 4) + 1
    shape = PoolShape(layers=2, heads=2, max_len=max_len, head_dim=64,
                      dtype=np.dtype(np.float32))
    if limit != resource.RLIM_INFINITY and limit < 3 * slots * shape.slot_bytes:
        pytest.skip(f"address space limited to {limit} bytes (ulimit -v)")
    big = KVPool(shape, slots)
    assert big.arrays[0].nbytes > total and big.bytes_allocated > 2 * total
    (last,) = big.allocate(1, top=True)
    assert last.index == slots - 1
    for a in big.arrays:
        a[last.index, :, :1024] = 1.5
    big.lengths[last.index] = 1024
    assert big.resident_bytes == 2 * 2 * 1024 * 64 * 4  # 1024 tokens: 64 pages a stretch
    assert all(float(a[last.index, :, :1024].sum()) == 1.5 * 2 * 1024 * 64 for a in big.arrays)
    big.free([last])
    assert big.resident_bytes == 0
