"""A persistent KV pool: one buffer per layer for every slot, reserved once at start.

engine.onnx's GroupQueryAttention reads and writes a (B, nh, M, hs) cache in place. The
pool holds one (S, nh, M, hs) array per layer's keys and values for S slots; a request
takes a slot when it joins and gives it back when it leaves. A forward pass binds rows
[lo, lo + n) of every array as its (n, nh, M, hs) past and present: one slot's memory is
contiguous, so a run of slots is a plain view, bound by pointer with no copy.

A batch's rows must therefore sit in consecutive slots. When rows leave, ``compact``
moves the batch's highest rows into the holes below them: each leave moves at most one
row, and only its cached tokens. Rows that stay where they are are never touched.

The pool also keeps, per slot, the token ids whose keys and values it holds, so the
prefix cache can hash them without asking the batch.

Memory follows the tokens held, not the slots (vAttention, Prabhu et al. 2024: contiguous
virtual memory per request, physical pages mapped on demand). Each array lives on its own
anonymous mapping made with MAP_NORESERVE: reserving it costs address space only, and the
kernel's overcommit heuristic does not refuse a pool larger than RAM. A page becomes
resident when the kernel first writes a key or value into it, and the pool gives pages
back (madvise MADV_DONTNEED: the next touch maps a fresh zero page) wherever a slot stops
holding tokens: all of a slot when it is freed or moved away from, and every (layer, head)
stretch past the kept length when it is truncated. Without that, np.empty pages stayed
committed once written, and every slot ended up holding the memory of the longest
sequence it ever served (RSS 1.65 → 7.3 GB in a 150-second soak of short chats).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.engine.process_memory import resident_pages


class Slot:
    """A row's place in the pool. Shared by the batch and the pool: a move updates it.
    What the row's keys and values are computed under (its ModelVariant) is the row's
    (step_plan.RowWork), never the slot's."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Slot({self.index})"


def memory_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")
                     ) -> int | None:
    """Bytes this process may still use: MemAvailable from /proc/meminfo, lowered to the
    headroom of its container's memory limit (cgroup v2 memory.max − memory.current, or v1
    memory.limit_in_bytes − memory.usage_in_bytes) when one is set, since a container
    (docker compose, Kubernetes) sees the host's MemAvailable but is killed at its limit.
    None where neither can be read."""
    figures = [v for v in (_meminfo_available(proc), _cgroup_headroom(cgroup)) if v is not None]
    return min(figures) if figures else None


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path) -> int | None:
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            text = (root / limit_file).read_text().strip()
            limit = None if text == "max" else int(text)
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit is None or limit >= 1 << 60:  # no limit set (v1 writes a huge number)
            return None
        return max(0, limit - usage)
    return None


def ensure_memory(need: int, what: str, available: int | None = None) -> None:
    """Refuse, before allocating, a cache larger than the memory available (``available``,
    default ``memory_available()``): the pool's pages are committed as rows fill, so an oversized
    pool would start fine and meet the OOM killer under load."""
    available = memory_available() if available is None else available
    if available is not None and need > available:
        raise MemoryError(
            f"the KV cache needs {need / 2**30:.1f} GiB ({what}) but {available / 2**30:.1f} "
            f"GiB of memory is available: lower --max-total-tokens or --max-batch-size, or "
            f"set --kv-cache-memory-mb")


# Linux's MAP_NORESERVE (asm-generic and x86 alike); Python's mmap module does not name it.
# Elsewhere the flag is left out: macOS has no overcommit heuristic to get past.
LINUX = sys.platform.startswith("linux")
MAP_NORESERVE = 0x4000 if LINUX else 0
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mremap.restype = ctypes.c_void_p
# MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP (linux/mman.h; DONTUNMAP since 5.7)
_MREMAP_FLAGS = 1 | 2 | 4
_MAP_FAILED = ctypes.c_void_p(-1).value


def reserve(nbytes: int) -> mmap.mmap:
    """An anonymous, private, zero-filled mapping of ``nbytes`` with no pages committed."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if LINUX:
        # A transparent huge page would commit 2 MiB on a token's first write and keep it
        # until every token in it is released: with THP set to "always" the pool would
        # again grow by slots, not tokens.
        region.madvise(mmap.MADV_NOHUGEPAGE)
        # A forked child (a worker process) has no use for the cache; sharing its pages
        # copy-on-write would make the parent's next writes copy them.
        region.madvise(mmap.MADV_DONTFORK)
    return region


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the page-aligned mapping at ``address`` that are in RAM now (mincore(2)).

    A page that was read but never written since its release maps the kernel's shared
    zero page, which mincore counts and RSS does not; the engine reads only the tokens a
    slot holds, so in practice the figure is the memory the written tokens commit."""
    return int(np.count_nonzero(resident_pages(address, nbytes))) * PAGE


class PoolExhausted(RuntimeError):
    """No run of free slots is long enough; admission should have prevented this."""


@dataclass(frozen=True)
class PoolShape:
    layers: int  # 2 * n_layers arrays: key and value per layer
    heads: int
    max_len: int
    head_dim: int
    dtype: np.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes one cached token takes over all layers' keys and values."""
        return self.layers * self.heads * self.head_dim * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        return self.token_bytes * self.max_len


class KVPool:
    """S slots of (nh, M, hs) per array; lengths and token ids per slot."""

    def __init__(self, shape: PoolShape, slots: int) -> None:
        if slots < 1:
            raise ValueError("the KV pool needs at least one slot")
        self.shape = shape
        self.slots = slots
        # One reserved mapping per array: pages are committed as the kernel writes them
        # and given back by _release. The arrays are views of the mappings (never copied).
        nbytes = slots * self.row_bytes
        self._regions = [reserve(nbytes) for _ in range(shape.layers)]
        self.arrays = [np.frombuffer(r, shape.dtype, slots * shape.heads * shape.max_len
                                     * shape.head_dim).reshape(
            slots, shape.heads, shape.max_len, shape.head_dim)
            for r in self._regions]  # each (S, nh, M, hs)
        self._addresses = [a.ctypes.data for a in self.arrays]  # fixed: mappings never move
        self.lengths = np.zeros(slots, np.int64)  # (S,) tokens cached per slot
        self.tokens = np.zeros((slots, shape.max_len), np.int64)  # (S, M) their ids
        self._owner: list[Slot | None] = [None] * slots
        self.moves = 0  # rows moved by compaction since start (a stat)
        self._can_remap = LINUX  # until the kernel says otherwise

    # -- occupancy -------------------------------------------------------------------

    @property
    def bytes_allocated(self) -> int:
        """Virtual size of the pool: address space reserved, not memory committed."""
        return self.slots * self.row_bytes * len(self.arrays)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool in RAM now (resident pages, by mincore): what the tokens held
        cost. A system call per array, a page table walk each: read it per scrape, not
        per step (about a millisecond per GiB reserved)."""
        return sum(resident_bytes(a.ctypes.data, a.nbytes) for a in self.arrays)

    @property
    def capacity_tokens(self) -> int:
        return self.slots * self.shape.max_len

    @property
    def used(self) -> int:
        return sum(o is not None for o in self._owner)

    @property
    def tokens_held(self) -> int:
        return int(self.lengths.sum())

    @property
    def row_bytes(self) -> int:
        return self.shape.heads * self.shape.max_len * self.shape.head_dim * \
            self.shape.dtype.itemsize

    def pointers(self, lo: int) -> list[int]:
        """Address of slot ``lo`` in every array: the start of a bound (n, nh, M, hs) view."""
        offset = lo * self.row_bytes
        return [address + offset for address in self._addresses]

    # -- allocation ------------------------------------------------------------------

    def allocate(self, n: int, top: bool = False) -> list[Slot]:
        """``n`` consecutive free slots: the lowest run, or the highest one with ``top``.

        Enough free slots do not always make a run: a long prompt part-way through its
        chunks sits at the top of the pool, away from the batch, and rows leave from
        anywhere. Then the run with the fewest rows in it is cleared (the lowest, or the
        highest with ``top``): each row there moves to a free slot outside it (``move``:
        its pages remapped, not copied). Only fewer free slots than ``n`` is refused."""
        if not 0 < n <= self.slots - self.used:
            raise PoolExhausted(f"the KV pool has no {n} free slots ({self.used} of "
                                f"{self.slots} in use)")
        starts = range(self.slots - n, -1, -1) if top else range(self.slots - n + 1)
        lo = min(starts, key=lambda lo: sum(o is not None for o in self._owner[lo:lo + n]))
        for i in range(lo, lo + n):
            owner = self._owner[i]
            if owner is not None:
                self.move(owner, self._free_outside(lo, lo + n))
        slots = [Slot(lo + i) for i in range(n)]
        for s in slots:
            self._owner[s.index] = s
            self.lengths[s.index] = 0
        return slots

    def free(self, slots: Sequence[Slot]) -> None:
        """Give ``slots`` back, and their memory with them."""
        for s in slots:
            if self._owner[s.index] is s:
                self._owner[s.index] = None
                self.lengths[s.index] = 0
                self._release(s.index, 0)

    def truncate(self, slot: Slot, length: int) -> None:
        """Keep the first ``length`` tokens of ``slot`` (speculative decoding rolls back
        rejected tokens; a prefill's right padding leaves keys past a row's length) and
        give back every whole page past them. ``length`` may equal the current length:
        that only releases what the kernel wrote beyond it."""
        held = int(self.lengths[slot.index])
        if self._owner[slot.index] is not slot:
            raise ValueError(f"{slot} is not allocated")
        if not 0 <= length <= held:
            raise ValueError(f"cannot truncate {slot} of {held} tokens to {length}")
        self.lengths[slot.index] = length
        self._release(slot.index, length)

    def _release(self, index: int, keep: int) -> None:
        """Give back the pages of slot ``index`` past its first ``keep`` tokens in every
        array: one madvise per (array, head) stretch, or one per array for the whole slot.
        Pages shared with a kept token or a neighbouring slot stay."""
        shape = self.shape
        token = shape.head_dim * shape.dtype.itemsize  # bytes of one token of one head
        stretch = shape.max_len * token  # one (slot, head): (M, hs)
        start = index * self.row_bytes
        spans = [(start, start + self.row_bytes)] if keep == 0 else [
            (start + h * stretch + keep * token, start + (h + 1) * stretch)
            for h in range(shape.heads)]
        pages = [(-(-lo // PAGE) * PAGE, hi // PAGE * PAGE) for lo, hi in spans]
        pages = [(lo, hi - lo) for lo, hi in pages if hi > lo]
        for region in self._regions:
            for offset, length in pages:
                region.madvise(mmap.MADV_DONTNEED, offset, length)

    def move(self, slot: Slot, dst: int) -> None:
        """Move one row's cached tokens to the free slot ``dst``; the slot left behind
        keeps no memory. The pages themselves move where the kernel can (``_remap``):
        a 1,000-token row of a 30-layer model is 46 MB to copy (about 30 ms, most of it
        faulting in the destination's fresh pages) but some page-table entries to remap;
        elsewhere only its ``length`` columns are copied."""
        src = slot.index
        if self._owner[dst] is not None:
            raise ValueError(f"slot {dst} is taken")
        n = int(self.lengths[src])
        if not self._remap(src, dst):
            self._copy_row(src, dst, n)
            self._release(src, 0)
        self.tokens[dst, :n] = self.tokens[src, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0
        self._owner[src], self._owner[dst] = None, slot
        slot.index = dst
        self.moves += 1

    def _copy_row(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` cached tokens of slot ``src`` to slot ``dst``."""
        for a in self.arrays:
            a[dst, :, :n] = a[src, :, :n]  # (nh, n, hs)

    def _remap(self, src: int, dst: int) -> bool:
        """Move slot ``src``'s pages to slot ``dst`` in every array with mremap(2)
        (MREMAP_DONTUNMAP: the source range stays mapped, empty, as a freed slot is);
        False, having changed nothing, where that is not possible (not Linux ≥ 5.7, or
        slots that do not start on page boundaries)."""
        if not self._can_remap or self.row_bytes % PAGE:
            return False
        for done, a in enumerate(self.arrays):
            base = a.ctypes.data
            got = _libc.mremap(ctypes.c_void_p(base + src * self.row_bytes),
                               ctypes.c_size_t(self.row_bytes), ctypes.c_size_t(self.row_bytes),
                               ctypes.c_int(_MREMAP_FLAGS),
                               ctypes.c_void_p(base + dst * self.row_bytes))
            if got == _MAP_FAILED:
                if done == 0:  # nothing moved yet: copy instead, from now on
                    self._can_remap = False
                    return False
                raise OSError(ctypes.get_errno(), "mremap failed half way through a move")
        return True

    def compact(self, slots: Sequence[Slot], start: int | None = None) -> int:
        """Make ``slots`` (one batch) consecutive from ``start`` (default: their lowest
        index); the first slot of the run. Rows inside the run stay; each row outside moves
        into a hole. A batch that lost rows passes its old start, so it never drifts up.
        """
        if not slots:
            return 0
        lo = min(s.index for s in slots) if start is None else min(
            start, min(s.index for s in slots))
        hi = lo + len(slots)
        if hi > self.slots:
            lo, hi = self.slots - len(slots), self.slots
        outside = sorted((s for s in slots if not lo <= s.index < hi),
                         key=lambda s: -s.index)
        mine = {id(s) for s in slots}
        for dst in range(lo, hi):
            if not outside:
                break
            owner = self._owner[dst]
            if owner is not None and id(owner) in mine:
                continue
            if owner is not None:  # another batch's row sits in the way: move it out first
                self.move(owner, self._free_outside(lo, hi))
            self.move(outside.pop(0), dst)
        return lo

    def _free_outside(self, lo: int, hi: int) -> int:
        for i in range(self.slots - 1, -1, -1):
            if not lo <= i < hi and self._owner[i] is None:
                return i
        raise PoolExhausted("no free slot to move a row out of the way")

    def span(self, slots: Sequence[Slot]) -> tuple[int, bool]:
        """(lowest index, whether the slots fill [lowest, lowest + n) exactly)."""
        idx = [s.index for s in slots]
        lo = min(idx)
        return lo, max(idx) - lo + 1 == len(idx)

    def assign(self, slots: Sequence[Slot], indices: Sequence[int]) -> None:
        """Give empty ``slots`` the (free or their own) ``indices``, in that order."""
        for s in slots:
            if self.lengths[s.index]:
                raise ValueError("only empty slots can be reassigned")
            self._owner[s.index] = None
        for s, i in zip(slots, indices, strict=True):
            if self._owner[i] is not None:
                raise ValueError(f"slot {i} is taken")
            s.index = i
            self._owner[i] = s
