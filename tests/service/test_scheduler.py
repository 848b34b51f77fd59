"""The engine loop without HTTP: joining mid-decode, admission limits, cancellation, seeds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.contract import io_spec as io
from service.engine.request import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.engine.scheduler import QueueFull, RequestHandle, Scheduler, SchedulerLimits
from service.engine.session import OnnxModel, create_session
from service.engine.stats import LoadStats, RequestStats, StepStats
from service.engine.text import TextCodec

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be", "What say you, my lord?"]


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.loads: list[LoadStats] = []
        self.requests: list[RequestStats] = []

    def record_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def record_load(self, stats: LoadStats) -> None:
        self.loads.append(stats)

    def record_request(self, stats: RequestStats) -> None:
        self.requests.append(stats)


class GatedModel:
    """The real model behind a gate (and an optional delay), to hold a step mid-flight."""

    def __init__(self, model: OnnxModel, delay: float = 0.0) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.gate = threading.Event()
        self.gate.set()
        self.delay = delay

    def forward(self, *args: Any) -> Any:
        self.gate.wait()
        time.sleep(self.delay)
        return self.model.forward(*args)

    def __getattr__(self, name: str) -> Any:  # kv_filter, kv_concat, kv_stats, ...
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def model(artifact: Path) -> OnnxModel:
    return OnnxModel(create_session(artifact / io.MODEL_FILE, "cpu", 1),
                     io.ArtifactConfig.load(artifact))


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


def make(runner: Any, codec: TextCodec, batch: int = 8, queued: int = 16,
         tokens: int = 4096) -> tuple[Scheduler, Recorder]:
    stats = Recorder()
    return Scheduler(runner, codec, SchedulerLimits(batch, tokens, queued), 0, stats), stats


def greedy(ids: list[int], n: int, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(**sampling), StoppingCriteria(n))


async def tokens_of(handle: RequestHandle) -> list[int]:
    out = []
    async for event in handle.events():
        assert isinstance(event, TokenEvent), event
        out.append(event.token.id)
    return out


def test_requests_join_a_running_batch_and_match_the_reference(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    scheduler, stats = make(GatedModel(model, delay=0.002), codec)

    async def main() -> list[list[int]]:
        scheduler.start(asyncio.get_running_loop())
        (first,) = scheduler.submit([greedy(encode(PROMPTS[0]), 40)])
        events = first.events()
        head = [(await anext(events)).token.id for _ in range(3)]  # type: ignore[union-attr]
        late = scheduler.submit([greedy(encode(p), 12) for p in PROMPTS[1:]])
        rest = [e.token.id async for e in events]  # type: ignore[union-attr]
        others = await asyncio.gather(*(tokens_of(h) for h in late))
        return [head + rest, *others]

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert results[0] == reference_greedy(encode(PROMPTS[0]), 40)
    for prompt, got in zip(PROMPTS[1:], results[1:], strict=True):
        assert got == reference_greedy(encode(prompt), 12)
    prefill_steps = [s for s in stats.steps if s.phase == "prefill"]
    assert len(prefill_steps) == 2 and prefill_steps[1].batch_size == 3  # joined as one wave
    assert max(s.batch_size for s in stats.steps if s.phase == "decode") == 4
    assert sorted(r.generated_tokens for r in stats.requests) == [12, 12, 12, 40]
    assert stats.loads[-1].running == stats.loads[-1].waiting == 0
    assert stats.loads[-1].kv_cache_tokens == 0


def test_queue_bound_rejects_and_batch_size_bound_holds(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    gated = GatedModel(model)
    scheduler, stats = make(gated, codec, batch=1, queued=1)
    ids = encode(PROMPTS[0])

    async def main() -> None:
        scheduler.start(asyncio.get_running_loop())
        gated.gate.clear()
        (running,) = scheduler.submit([greedy(ids, 5)])
        while scheduler.waiting:  # admitted: its prefill is held at the gate
            await asyncio.sleep(0.005)
        (queued,) = scheduler.submit([greedy(ids, 5)])
        with pytest.raises(QueueFull):
            scheduler.submit([greedy(ids, 5)])
        gated.gate.set()
        assert len(await tokens_of(running)) == 5
        assert len(await tokens_of(queued)) == 5

    try:
        asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert all(s.batch_size == 1 for s in stats.steps)


def test_cancel_frees_the_slot_at_once(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    scheduler, stats = make(GatedModel(model, delay=0.005), codec, batch=1)
    ids = encode(PROMPTS[1])

    async def main() -> list[int]:
        scheduler.start(asyncio.get_running_loop())
        (doomed,) = scheduler.submit([greedy(ids, 100)])
        events = doomed.events()
        for _ in range(3):
            await anext(events)
        (after,) = scheduler.submit([greedy(ids, 4)])  # waits: the batch holds one row
        doomed.cancel()
        return await tokens_of(after)

    try:
        assert len(asyncio.run(main())) == 4
    finally:
        scheduler.stop(5)
    cancelled = [r for r in stats.requests if r.outcome == "cancelled"]
    assert len(cancelled) == 1 and 3 <= cancelled[0].generated_tokens < 100
    assert stats.loads[-1].running == 0


def test_a_seeded_request_gives_the_same_text_alone_or_in_company(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    scheduler, _ = make(model, codec)
    seeded = {"do_sample": True, "seed": 1234, "temperature": 1.2, "top_k": 50}

    async def main() -> tuple[list[int], list[int]]:
        scheduler.start(asyncio.get_running_loop())
        (alone,) = scheduler.submit([greedy(encode(PROMPTS[0]), 25, **seeded)])
        alone_tokens = await tokens_of(alone)
        crowd = scheduler.submit(
            [greedy(encode(PROMPTS[1]), 30, do_sample=True, seed=7),
             greedy(encode(PROMPTS[0]), 25, **seeded), greedy(encode(PROMPTS[2]), 10)])
        together = await asyncio.gather(*(tokens_of(h) for h in crowd))
        return alone_tokens, together[1]

    try:
        alone, together = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert alone == together


def test_stop_fails_waiting_requests_with_a_shutdown_error(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    gated = GatedModel(model)
    scheduler, _ = make(gated, codec, batch=1)

    async def main() -> list[Any]:
        scheduler.start(asyncio.get_running_loop())
        gated.gate.clear()
        handles = scheduler.submit([greedy(encode(PROMPTS[0]), 50) for _ in range(2)])
        await asyncio.sleep(0.05)
        stopper = asyncio.ensure_future(asyncio.to_thread(scheduler.stop, 5))
        await asyncio.sleep(0.05)
        gated.gate.set()
        await stopper
        return [[e async for e in h.events()][-1] for h in handles]

    last = asyncio.run(main())
    assert all(isinstance(e, ErrorEvent) and e.kind == "shutdown" for e in last)


def test_all_events_gathers_what_events_streams_before_or_after_the_finish(
        model: OnnxModel, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    scheduler, _ = make(model, codec)
    ids = encode(PROMPTS[1])

    async def main() -> tuple[list[int], list[Any], list[Any]]:
        scheduler.start(asyncio.get_running_loop())
        streamed, waiting, late = scheduler.submit([greedy(ids, 16) for _ in range(3)])
        # `waiting` is awaited before its first token exists; `late` only after the finish.
        stream_ids, gathered = await asyncio.gather(tokens_of(streamed), waiting.all_events())
        await asyncio.sleep(0)
        already = await late.all_events()
        return stream_ids, gathered, already

    try:
        stream_ids, gathered, already = asyncio.run(main())
    finally:
        scheduler.stop(5)
    expected = reference_greedy(ids, 16)
    assert stream_ids == expected
    for events in (gathered, already):
        assert [e.token.id for e in events] == expected
        assert [e.finish is not None for e in events] == [False] * 15 + [True]
