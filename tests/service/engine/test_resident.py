"""Freed C heap pages go back to the OS when the engine idles, and weights read once at load
leave memory (service/engine/resident.py).

The reference is the kernel's own count: RssAnon in /proc/self/status, read in a child
process that fragments its heap with libc's malloc, and the weights file's resident pages in
/proc/self/smaps; the engine's tokens after the drop are the plain ONNX Runtime loop's.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import service.engine.engine as engine_module
from service.artifact.loader import open_artifact
from service.contract import io_spec as io
from service.engine import resident as resident_module
from service.engine import scheduler as scheduler_module
from service.engine.engine import Engine, EngineConfig
from service.engine.request import (
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.engine.runner import PoolConfig
from service.engine.scheduler import Scheduler, SchedulerLimits
from service.engine.session import create_session
from service.engine.static_cache import EngineGraphRunner
from service.engine.text import TextCodec
from service.settings import Settings

pytestmark = pytest.mark.skipif(not resident_module.can_release(),
                                reason="no malloc_trim (not glibc)")

FRAGMENT_AND_RELEASE = textwrap.dedent("""
    import ctypes, json
    from service.engine.resident import release_freed_heap

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
        before = sorted(resident_module.file_mappings(tmp_path), key=lambda m: m.written_bytes)
        assert before[0].resident_bytes == len(data) and before[1].resident_bytes > 0
        assert [m.written_bytes for m in before] == [0, mmap.PAGESIZE]

        assert resident_module.release_file_pages(tmp_path) == len(data)

        after = sorted(resident_module.file_mappings(path), key=lambda m: m.written_bytes)
        assert [m.resident_bytes for m in after] == [0, before[1].resident_bytes]
        assert shared[:] == data  # faulted back in from the file
        assert private[0] == (data[0] + 1) % 256 and private[1:] == data[1:]
    finally:
        shared.close()
        private.close()


def test_the_engine_releases_the_heap_each_time_it_runs_out_of_work(
        engine_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = EngineGraphRunner(create_session(engine_artifact / "engine.onnx", "cpu", 1),
                               io.ArtifactConfig.load(engine_artifact), PoolConfig(slots=4))
    codec = TextCodec.from_file(engine_artifact / io.TOKENIZER_FILE)
    rows_at_release: list[int] = []

    def release() -> bool:
        rows_at_release.append(runner.pool.used)
        return True

    monkeypatch.setattr(scheduler_module, "release_freed_heap", release)
    scheduler = Scheduler(runner, codec, SchedulerLimits(4, 4096, 8, 0, False))

    async def main() -> None:
        scheduler.start(asyncio.get_running_loop())
        for wave in ([5, 6, 7], [8, 9]):  # two busy periods, one after the other
            handles = scheduler.submit([GenerationRequest(
                [*codec.encode("ROMEO:"), t], SamplingParams(), StoppingCriteria(6))
                for t in wave])
            await asyncio.gather(*(h.all_events() for h in handles))
            for _ in range(200):  # the loop thread finishes its iteration after the events
                if len(rows_at_release) == 1 + (wave == [8, 9]):
                    break
                await asyncio.sleep(0.01)

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
    small may have none: ONNX Runtime maps large tensors only); its tokens after that stay
    the plain loop's."""
    resident: list[int] = []

    def measured_release(path: Path) -> int:
        resident.append(sum(m.resident_bytes for m in resident_module.file_mappings(path)))
        released = resident_module.release_file_pages(path)
        resident.append(sum(m.resident_bytes for m in resident_module.file_mappings(path)))
        return released

    monkeypatch.setattr(engine_module, "release_file_pages", measured_release)
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
    assert tokens == reference_greedy(prompt, 24)
