"""Freed C heap pages go back to the OS when the engine idles, weights read once at load
leave memory (service/contract/pages.py), and written memory moves into 2 MiB pages
(service/engine/process_memory.py).

The reference is the kernel's own count: RssAnon in /proc/self/status, read in a child
process that fragments its heap with libc's malloc, the weights file's resident pages and
AnonHugePages in /proc/self/smaps; the engine's tokens after the drop and the move are the
plain ONNX Runtime loop's.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import service.engine.engine as engine_module
from service.artifact.loader import open_artifact
from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.contract import pages
from service.engine import process_memory as resident_module
from service.engine import scheduler as scheduler_module
from service.engine.engine import Engine, EngineConfig
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.request import (
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.engine.runner import PoolConfig
from service.engine.scheduler import Scheduler, SchedulerLimits
from service.providers import create_session
from service.settings import Settings

pytestmark = pytest.mark.skipif(not pages.can_release(),
                                reason="no malloc_trim (not glibc)")

FRAGMENT_AND_RELEASE = textwrap.dedent("""
    import ctypes, json
    from service.contract.pages import release_freed_heap

    def anon_mb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(3000)]  # under the mmap threshold: heap
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for i, b in enumerate(blocks):
        if i % 10:  # every tenth block stays: the heap's top cannot shrink by itself
            libc.free(b)
    freed = anon_mb()
    released = release_freed_heap()
    print(json.dumps({"freed": freed, "trimmed": anon_mb(), "released": released}))
""")


def test_release_gives_the_holes_of_a_fragmented_heap_back_to_the_os() -> None:
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", FRAGMENT_AND_RELEASE], cwd=root, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    figures = json.loads(out)
    # 2,700 of 3,000 64 KiB blocks freed (~169 MiB): still resident until the trim
    assert figures["released"] is True
    assert figures["freed"] - figures["trimmed"] > 120, figures


def test_dropped_file_pages_leave_memory_and_read_back_the_same(tmp_path: Path) -> None:
    """A read mapping's pages go; a private mapping with a written page keeps every page
    (the written one exists nowhere else)."""
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    with path.open("rb") as f:
        shared = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert shared[:] == data and private[:] == data  # every page read: resident
        private[0] = (data[0] + 1) % 256
        before = sorted(pages.file_mappings(tmp_path), key=lambda m: m.written_bytes)
        assert before[0].resident_bytes == len(data) and before[1].resident_bytes > 0
        assert [m.written_bytes for m in before] == [0, mmap.PAGESIZE]

        assert pages.release_file_pages(tmp_path) == len(data)

        after = sorted(pages.file_mappings(path), key=lambda m: m.written_bytes)
        assert [m.resident_bytes for m in after] == [0, before[1].resident_bytes]
        assert shared[:] == data  # faulted back in from the file
        assert private[0] == (data[0] + 1) % 256 and private[1:] == data[1:]
    finally:
        shared.close()
        private.close()


COLLAPSE_DENSE_AND_SPARSE = textwrap.dedent("""
    import ctypes, json, mmap
    import numpy as np
    from service.engine import process_memory as resident

    def region(*arrays):
        \"\"\"(AnonHugePages, Rss) in KiB of the mappings under the arrays' bytes (the
        kernel merges neighbouring allocations into one mapping, or splits one).\"\"\"
        low = min(a.ctypes.data for a in arrays)
        high = max(a.ctypes.data + a.nbytes for a in arrays)
        inside, sizes = False, {"AnonHugePages:": 0, "Rss:": 0}
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < high and low < end
            elif inside and head in sizes:
                sizes[head] += int(line.split()[1])
        return sizes["AnonHugePages:"], sizes["Rss:"]

    # Can this kernel collapse at all? Probe on an aligned, written mapping of our own.
    probe = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe.write(b"x" * (8 << 20))
    base = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    aligned = -(-base // (2 << 20)) * (2 << 20)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(aligned, 2 << 20, resident.MADV_COLLAPSE) != 0:
        print(json.dumps({"unsupported": ctypes.get_errno()}))
        raise SystemExit
    def malloc_floats(count):  # as ONNX Runtime allocates: glibc malloc, no advice
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        address = libc.malloc(count * 4)
        return np.ctypeslib.as_array((ctypes.c_float * count).from_address(address))

    dense = malloc_floats(16 << 20)  # 64 MiB, every page written
    dense[:] = np.arange(16 << 20, dtype=np.float32)
    sparse = malloc_floats(16 << 20)  # 64 MiB reserved (calloc-like), 1 page in 64 written
    sparse[:: (mmap.PAGESIZE // 4) * 64] = 1.0
    before = region(dense, sparse)
    moved = resident.collapse_to_huge_pages()
    print(json.dumps({"before": before, "moved": moved,
                      "after": region(dense, sparse),
                      "dense_intact": bool((dense == np.arange(16 << 20, dtype=np.float32)).all()),
                      "sparse_written": float(sparse[:: (mmap.PAGESIZE // 4) * 64].sum())}))
""")


def test_written_memory_moves_into_huge_pages_and_reserved_memory_stays_unbacked() -> None:
    """A 64 MiB malloc'd buffer with every page written ends in 2 MiB pages with its values
    intact; the 64 MiB buffer beside it (the kernel merges both into one mapping) with one
    page in 64 written is left alone: collapsing would make all of it resident. The
    kernel's AnonHugePages and Rss are the reference."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", COLLAPSE_DENSE_AND_SPARSE], cwd=root,
                         check=True, capture_output=True, text=True, timeout=120).stdout
    figures = json.loads(out)
    if "unsupported" in figures:
        pytest.skip(f"this kernel cannot MADV_COLLAPSE (errno {figures['unsupported']})")
    mib = 1024  # KiB
    (huge_before, rss_before), (huge_after, rss_after) = figures["before"], figures["after"]
    assert huge_after - huge_before >= 62 * mib, figures  # the written buffer's 2 MiB ranges
    assert rss_after - rss_before < 4 * mib, figures  # and nothing filled in
    assert figures["dense_intact"] is True
    assert figures["sparse_written"] == (16 << 20) / ((mmap.PAGESIZE // 4) * 64)
    assert figures["moved"] >= 62 << 20


def test_the_engine_releases_the_heap_each_time_it_runs_out_of_work(
        engine_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = EngineGraphRunner(create_session(engine_artifact / "engine.onnx", "cpu", 1),
                               io.ArtifactConfig.load(engine_artifact), PoolConfig(slots=4))
    codec = TextCodec.from_file(engine_artifact / io.TOKENIZER_FILE)
    rows_at_release: list[int] = []
    released = threading.Semaphore(0)

    def release() -> bool:
        rows_at_release.append(runner.pool.used)
        released.release()
        return True

    monkeypatch.setattr(scheduler_module, "release_freed_heap", release)
    scheduler = Scheduler(runner, codec, SchedulerLimits(
        max_batch_size=4, max_batch_tokens=4096, max_queued_requests=8,
        prefill_chunk_tokens=0, adaptive_prefill_chunks=False))

    async def main() -> None:
        scheduler.start(asyncio.get_running_loop())
        for wave in ([5, 6, 7], [8, 9]):  # two busy periods, one after the other
            handles = scheduler.submit([GenerationRequest(
                [*codec.encode("ROMEO:"), t], SamplingParams(), StoppingCriteria(6))
                for t in wave])
            await asyncio.gather(*(h.all_events() for h in handles))
            # The loop thread finishes its iteration after the events: the next wave must
            # not arrive before that busy period's release, or it would be one period.
            assert await asyncio.to_thread(released.acquire, timeout=60), \
                f"no release after the busy period of {wave}"

    try:
        asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert rows_at_release == [0, 0]  # once per busy period, with no row held


def test_weights_read_once_at_load_leave_memory_and_the_engine_still_matches_the_reference(
        engine_artifact: Path, monkeypatch: pytest.MonkeyPatch,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """The engine drops its weights' resident pages once loaded and warmed up (a model this
    small may have none: ONNX Runtime maps large tensors only), then moves its written
    memory into huge pages; its tokens after that stay the plain loop's."""
    resident: list[int] = []
    collapsed: list[int] = []

    def measured_collapse() -> int:
        collapsed.append(resident_module.collapse_to_huge_pages())
        return collapsed[-1]

    def measured_release(path: Path) -> int:
        resident.append(sum(m.resident_bytes for m in pages.file_mappings(path)))
        released = pages.release_file_pages(path)
        resident.append(sum(m.resident_bytes for m in pages.file_mappings(path)))
        return released

    monkeypatch.setattr(engine_module, "release_file_pages", measured_release)
    monkeypatch.setattr(engine_module, "collapse_to_huge_pages", measured_collapse)
    artifact = open_artifact(Settings.model_validate({"model": engine_artifact}))
    engine = Engine.from_artifact(artifact, EngineConfig(intra_op_threads=1, max_batch_size=2))
    prompt = encode("First Citizen:\nBefore we proceed")

    async def main() -> list[int]:
        engine.start(asyncio.get_running_loop())
        (handle,) = engine.submit([GenerationRequest(prompt, SamplingParams(),
                                                     StoppingCriteria(24))])
        return [e.token.id for e in await handle.all_events() if isinstance(e, TokenEvent)]

    try:
        tokens = asyncio.run(main())
    finally:
        engine.stop(5)
    assert len(resident) == 2 and resident[1] == 0
    assert len(collapsed) == 1  # once, after the release (whatever this kernel could move)
    assert tokens == reference_greedy(prompt, 24)
