"""The engine loop without HTTP: joining mid-decode, admission limits, cancellation, seeds,
faults and chunked prefill.

Forward passes wait at a gate the test opens step by step (tests/service/fault_runner.py),
so "while a request is still decoding" is a fact the test arranged, not a timing bet.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.engine.engine_graph_runner import EngineGraphRunner
from service.engine.model_graph_runner import ModelGraphRunner
from service.engine.request import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.engine.runner import ModelRunner, PoolConfig
from service.engine.scheduler import QueueFull, RequestHandle, Scheduler, SchedulerLimits
from service.engine.speculative import Proposal, SpeculativeConfig, Speculator
from service.engine.stats import LoadStats, RequestStats
from service.engine.step_plan import RowWork
from service.providers import create_session
from tests.service.fault_runner import ControlledRunner, QueueGate, Recorder

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be", "What say you, my lord?"]


def gated(runner: ModelRunner, poison: int | None = None) -> tuple[ControlledRunner, QueueGate]:
    gate = QueueGate()
    return ControlledRunner(runner, gate, poison), gate


@pytest.fixture
def model(artifact: Path) -> ModelGraphRunner:
    """model.onnx through a fresh KV pool of 8 slots."""
    return ModelGraphRunner(create_session(artifact / io.MODEL_FILE, "cpu", 1),
                            io.ArtifactConfig.load(artifact), PoolConfig(slots=8))


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


@pytest.fixture
def engine(engine_artifact: Path) -> EngineGraphRunner:
    return EngineGraphRunner(create_session(engine_artifact / "engine.onnx", "cpu", 1),
                            io.ArtifactConfig.load(engine_artifact), PoolConfig(slots=8))


@pytest.fixture
def mixed(engine_artifact: Path, mixed_engine_path: Path) -> EngineGraphRunner:
    """engine_mixed.onnx: a prompt chunk rides in the decode step's pass."""
    return EngineGraphRunner(create_session(mixed_engine_path, "cpu", 1),
                             io.ArtifactConfig.load(engine_artifact), PoolConfig(slots=8))


def make(runner: ModelRunner, codec: TextCodec, batch: int = 8, queued: int = 16,
         tokens: int = 4096, chunk: int = 0, adaptive: bool = False, prefill_budget: int = 0
         ) -> tuple[Scheduler, Recorder]:
    stats = Recorder()
    return Scheduler(runner, codec, SchedulerLimits(
        max_batch_size=batch, max_batch_tokens=tokens, max_queued_requests=queued,
        prefill_chunk_tokens=chunk, adaptive_prefill_chunks=adaptive,
        max_batch_prefill_tokens=prefill_budget), stats), stats


def greedy(ids: list[int], n: int, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(**sampling), StoppingCriteria(n))


async def tokens_of(handle: RequestHandle) -> list[int]:
    out = []
    async for event in handle.events():
        assert isinstance(event, TokenEvent), event
        out.append(event.token.id)
    return out


def join_three(runner: ModelRunner, codec: TextCodec, encode: Callable[[str], list[int]],
               reference_greedy: Callable[[list[int], int], list[int]],
               prefill_budget: int = 0) -> Recorder:
    """Three requests, submitted at once, join one that has decoded two steps; every
    request must get the plain loop's greedy tokens. The engine's step stats, for the
    caller to check."""
    scheduler, stats = make(runner, codec, prefill_budget=prefill_budget)
    assert isinstance(runner, ControlledRunner) and isinstance(runner.gate, QueueGate)
    gate = runner.gate

    async def main() -> list[list[int]]:
        scheduler.start(asyncio.get_running_loop())
        (first,) = scheduler.submit([greedy(encode(PROMPTS[0]), 40)])
        gate.send("...")  # prefill and two decode steps; the third waits at the gate
        events = first.events()
        head = [(await anext(events)).token.id for _ in range(3)]  # type: ignore[union-attr]
        late = scheduler.submit([greedy(encode(p), 12) for p in PROMPTS[1:]])
        gate.send("+")
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
    return stats


def test_requests_join_a_running_batch_and_match_the_reference(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    runner, _ = gated(model)
    stats = join_three(runner, codec, encode, reference_greedy)
    prefill_steps = [s for s in stats.steps if s.phase == "prefill"]
    assert len(prefill_steps) == 2 and prefill_steps[1].batch_size == 3  # joined as one wave
    assert max(s.batch_size for s in stats.steps if s.phase == "decode") == 4
    assert sorted(r.generated_tokens for r in stats.requests) == [12, 12, 12, 40]
    assert stats.loads[-1].running == stats.loads[-1].waiting == 0
    assert stats.loads[-1].kv.tokens == 0


@pytest.mark.parametrize("bounded", [False, True])
def test_a_prefill_budget_spreads_a_burst_of_newcomers_over_steps(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]], bounded: bool) -> None:
    """Three newcomers arrive at once beside a decoding row. With max_batch_prefill_tokens
    the size of the longest prompt, no step beside that row prefills more prompt tokens
    than that (the first newcomer always goes), so they join over several steps; with 0
    all three join in one. Every request gets the plain loop's tokens either way."""
    runner = ControlledRunner(model, QueueGate(), keep_plans=True)
    late = [encode(p) for p in PROMPTS[1:]]
    budget = max(len(p) for p in late) if bounded else 0
    assert sum(len(p) for p in late) > budget  # the burst does not fit one step's budget
    join_three(runner, codec, encode, reference_greedy, prefill_budget=budget)
    assert runner.plans is not None
    joined = [[len(r.tokens) for r in plan.rows if len(r.tokens) > 1] for plan in runner.plans
              if any(len(r.tokens) == 1 for r in plan.rows)
              and any(len(r.tokens) > 1 for r in plan.rows)]  # prompts beside the row
    assert sorted(n for step in joined for n in step) == sorted(len(p) for p in late)
    if bounded:
        assert len(joined) >= 2
        assert all(len(step) == 1 or sum(step) <= budget for step in joined), joined
    else:
        assert len(joined) == 1


def test_newcomers_ride_in_the_decode_step_of_a_mixed_engine(
        mixed: EngineGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """With engine_mixed.onnx, requests joining a running batch are prefilled in its
    decode step's pass (no pass of their own) and every request gets the plain loop's
    tokens."""
    runner, _ = gated(mixed)
    stats = join_three(runner, codec, encode, reference_greedy)
    phases = [(s.phase, s.batch_size) for s in stats.steps]
    joined = phases.index(("prefill", 3))
    assert phases[joined - 1] == ("decode", 1) and phases[joined + 1] == ("decode", 4)
    # one pass for the first prompt, then one per decode step: the newcomers rode along
    assert runner.forwards == 1 + sum(p == "decode" for p, _ in phases)
    assert mixed.pool.used == 0


def test_queue_bound_rejects_and_batch_size_bound_holds(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    runner, gate = gated(model)
    scheduler, stats = make(runner, codec, batch=1, queued=1)
    ids = encode(PROMPTS[0])

    async def main() -> None:
        scheduler.start(asyncio.get_running_loop())
        (running,) = scheduler.submit([greedy(ids, 5)])
        gate.send(".")  # its prefill; its first decode step waits at the gate
        events = running.events()
        await anext(events)
        (queued,) = scheduler.submit([greedy(ids, 5)])
        with pytest.raises(QueueFull):
            scheduler.submit([greedy(ids, 5)])
        gate.send("+")
        assert len([e async for e in events]) == 4
        assert len(await tokens_of(queued)) == 5

    try:
        asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert all(s.batch_size == 1 for s in stats.steps)


def test_cancel_frees_the_slot_at_once(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    runner, gate = gated(model)
    scheduler, stats = make(runner, codec, batch=1)
    ids = encode(PROMPTS[1])

    async def main() -> list[int]:
        scheduler.start(asyncio.get_running_loop())
        (doomed,) = scheduler.submit([greedy(ids, 100)])
        gate.send("...")
        events = doomed.events()
        for _ in range(3):
            await anext(events)
        (after,) = scheduler.submit([greedy(ids, 4)])  # waits: the batch holds one row
        doomed.cancel()
        gate.send("+")
        return await tokens_of(after)

    try:
        assert asyncio.run(main()) == reference_greedy(ids, 4)
    finally:
        scheduler.stop(5)
    cancelled = [r for r in stats.requests if r.outcome == "cancelled"]
    # It leaves before or right after the step held at the gate, whichever the loop reaches.
    assert len(cancelled) == 1 and cancelled[0].generated_tokens in (3, 4)
    assert stats.loads[-1].running == 0


def test_a_seeded_request_gives_the_same_text_alone_or_in_company(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
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
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    runner, gate = gated(model)
    scheduler, _ = make(runner, codec, batch=1)

    async def main() -> list[Any]:
        scheduler.start(asyncio.get_running_loop())
        handles = scheduler.submit([greedy(encode(PROMPTS[0]), 50) for _ in range(2)])
        gate.send(".")
        await anext(handles[0].events())  # first row decoding, second waiting
        scheduler.stop(timeout=0)  # asks the loop to stop after the step held at the gate
        gate.send("+")
        await asyncio.to_thread(scheduler.stop, 5)
        return [[e async for e in h.events()][-1] for h in handles]

    last = asyncio.run(main())
    assert all(isinstance(e, ErrorEvent) and e.kind == "shutdown" for e in last)


@pytest.mark.step_failures
def test_a_failed_decode_step_fails_its_rows_and_the_engine_recovers(
        engine: EngineGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    runner, gate = gated(engine)
    scheduler, stats = make(runner, codec)

    async def main() -> tuple[list[Any], list[int]]:
        scheduler.start(asyncio.get_running_loop())
        doomed = scheduler.submit([greedy(encode(p), 20) for p in PROMPTS[:2]])
        gate.send(".")  # one prefill for both
        streams = [h.events() for h in doomed]
        for events in streams:
            await anext(events)
        gate.send("!+")  # their first decode step raises
        last = [[e async for e in events][-1] for events in streams]
        (after,) = scheduler.submit([greedy(encode(PROMPTS[2]), 15)])
        return last, await tokens_of(after)

    try:
        last, after = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert all(isinstance(e, ErrorEvent) and e.kind == "generation"
               and "injected fault" in e.message for e in last)
    assert after == reference_greedy(encode(PROMPTS[2]), 15)
    assert sorted(r.outcome for r in stats.requests) == ["error", "error", "finished"]
    assert stats.step_failures == ["failed"]
    assert engine.pool.used == 0 and stats.loads[-1].kv.slots_used == 0  # slots came back


@pytest.mark.step_failures
@pytest.mark.parametrize("kind", ["engine", "mixed"])
def test_a_failed_prefill_fails_that_request_alone(
        kind: str, request: pytest.FixtureRequest, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """A poisoned newcomer joining with a healthy one: its wave's prefill fails (with
    engine_mixed.onnx, the decode step carrying both prompts fails first and they are
    prefilled apart), each is retried alone, and only the bad one gets the error."""
    engine: EngineGraphRunner = request.getfixturevalue(kind)
    poison = encode("Z")[0]
    runner, gate = gated(engine, poison=poison)
    scheduler, stats = make(runner, codec)
    bad = encode("Zounds, " + PROMPTS[0])
    assert poison in bad and all(poison not in encode(p) for p in PROMPTS)

    async def main() -> tuple[list[int], Any, list[int], list[int]]:
        scheduler.start(asyncio.get_running_loop())
        (running,) = scheduler.submit([greedy(encode(PROMPTS[1]), 30)])
        gate.send(".")
        events = running.events()
        head = [(await anext(events)).token.id]  # type: ignore[union-attr]
        # Both join in one wave while the running row's next step waits at the gate.
        poisoned, fine = scheduler.submit([greedy(bad, 10), greedy(encode(PROMPTS[3]), 10)])
        gate.send("+")
        rest = [e.token.id async for e in events]  # type: ignore[union-attr]
        failed = [e async for e in poisoned.events()]
        return head + rest, failed[-1], await tokens_of(fine), [len(failed)]

    try:
        running, failed, fine, n_failed = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert isinstance(failed, ErrorEvent) and "poison" in failed.message and n_failed == [1]
    assert running == reference_greedy(encode(PROMPTS[1]), 30)
    assert fine == reference_greedy(encode(PROMPTS[3]), 10)
    waves = [s.batch_size for s in stats.steps if s.phase == "prefill"]
    assert waves == [1, 1]  # the running row, then the healthy newcomer retried alone
    assert stats.step_failures == ["retried", "failed"]  # the wave, then the bad one alone
    assert engine.pool.used == 0


@pytest.mark.parametrize("kind", ["engine", "mixed"])
def test_chunked_prefill_interleaves_with_decode_steps(
        kind: str, request: pytest.FixtureRequest, codec: TextCodec,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """A long prompt joins a decoding row in chunks of 8: each chunk a pass of its own
    (one-group engine.onnx) or, with engine_mixed.onnx, riding in the row's decode step,
    the last one too; both requests get the plain loop's tokens."""
    runner, gate = gated(request.getfixturevalue(kind))
    scheduler, stats = make(runner, codec, chunk=8)
    long = encode(" ".join(PROMPTS))
    assert len(long) > 3 * 8

    async def main() -> tuple[list[int], list[int]]:
        scheduler.start(asyncio.get_running_loop())
        (running,) = scheduler.submit([greedy(encode(PROMPTS[0]), 40)])
        gate.send(".")
        events = running.events()
        head = [(await anext(events)).token.id]  # type: ignore[union-attr]
        (joiner,) = scheduler.submit([greedy(long, 10)])
        gate.send("+")
        rest = [e.token.id async for e in events]  # type: ignore[union-attr]
        return head + rest, await tokens_of(joiner)

    try:
        running, joined = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert running == reference_greedy(encode(PROMPTS[0]), 40)
    assert joined == reference_greedy(long, 10)
    if kind == "mixed":
        _assert_chunks_rode(long, stats, runner)
    else:
        _assert_chunks_were_passes(long, stats)


def _assert_chunks_were_passes(long: list[int], stats: Recorder) -> None:
    """Chunks of 8 tokens, one per loop iteration, each followed by a decode step of the
    running row; the last part of the prompt came with its first token."""
    chunks = (len(long) - 1) // 8
    phases = [(s.phase, s.batch_size, s.tokens) for s in stats.steps]
    first = phases.index(("prefill", 0, 8), 1)
    expected = [("prefill", 0, 8), ("decode", 1, 1)] * chunks
    assert phases[first:first + 2 * chunks] == expected
    assert phases[first + 2 * chunks] == ("prefill", 1, len(long) - 8 * chunks)
    assert phases[first + 2 * chunks + 1] == ("decode", 2, 2)


def _assert_chunks_rode(long: list[int], stats: Recorder, runner: ControlledRunner) -> None:
    """Every chunk, the last one too, in a decode step's pass: no pass of its own."""
    chunks = -(-len(long) // 8)  # the last, shorter one brings the first token
    phases = [(s.phase, s.batch_size, s.tokens) for s in stats.steps]
    start = phases.index(("prefill", 0, 8)) - 1  # each mixed step: decode, then its chunk
    riding = [("decode", 1, 1), ("prefill", 0, 8)] * (chunks - 1)
    last = [("decode", 1, 1), ("prefill", 1, len(long) - 8 * (chunks - 1))]  # + 1st token
    assert phases[start:start + 2 * chunks] == riding + last
    assert phases[start + 2 * chunks] == ("decode", 2, 2)
    # one pass per decode step (the chunks rode along) plus the running row's prefill
    assert runner.forwards == sum(p == "decode" for p, _, _ in phases) + 1


# The adaptive budget's inputs, set by the test: a decode step takes DECODE_S and a
# prompt token in a pass of its own TOKEN_S (powers of two: the arithmetic is exact).
TOKEN_S = 2.0 ** -11
DECODE_S = 20 * TOKEN_S


def fake_pass_seconds(rows: Sequence[RowWork]) -> float:
    """A pass of one-token rows costs DECODE_S; a pass feeding prompt tokens TOKEN_S each."""
    tokens = sum(len(r.tokens) for r in rows)
    return DECODE_S if tokens == len(rows) else TOKEN_S * tokens


def test_adaptive_chunks_prefill_alone_in_one_pass_and_beside_rows_in_step_sized_chunks(
        engine: EngineGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """Idle engine: the long prompt goes in one pass. Beside a running row: chunks as
    long as one decode step (DECODE_S / TOKEN_S = 20 tokens, within [16, 32]), from the
    pass times the test's clock gives; the tokens equal the plain loop's either way."""
    gate = QueueGate()
    runner = ControlledRunner(engine, gate, pass_seconds=fake_pass_seconds)
    scheduler, stats = make(runner, codec, chunk=32, adaptive=True)
    long = encode(" ".join(PROMPTS * 2))
    assert 16 + 32 < len(long) <= 128 - 5

    async def main() -> tuple[list[int], list[int], list[int]]:
        scheduler.start(asyncio.get_running_loop())
        gate.send("+")
        alone = await tokens_of(scheduler.submit([greedy(long, 3)])[0])
        gate.send("-")
        (running,) = scheduler.submit([greedy(encode(PROMPTS[0]), 60)])
        gate.send(".")
        events = running.events()
        head = [(await anext(events)).token.id]  # type: ignore[union-attr]
        (joiner,) = scheduler.submit([greedy(long, 5)])
        gate.send("+")
        rest = [e.token.id async for e in events]  # type: ignore[union-attr]
        return alone, head + rest, await tokens_of(joiner)

    try:
        alone, running, joined = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert alone == reference_greedy(long, 3)
    assert joined == reference_greedy(long, 5)
    assert running == reference_greedy(encode(PROMPTS[0]), 60)
    phases = [(s.phase, s.batch_size, s.tokens) for s in stats.steps]
    assert phases[0] == ("prefill", 1, len(long))  # alone: one pass, no chunks
    later = phases[phases.index(("prefill", 1, len(encode(PROMPTS[0])))):]
    chunks = [t for p, b, t in later if p == "prefill"][1:]  # the joiner's, the last whole
    assert chunks[:-1] == [20] * (len(chunks) - 1) and len(chunks) >= 3
    assert 0 < chunks[-1] <= 20 and sum(chunks) == len(long)


def test_all_events_gathers_what_events_streams_before_or_after_the_finish(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
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



class DeliveryWatch(Recorder):
    """A Recorder that notes, for the one request in flight, whether its last event had
    already reached the event loop when its stats, and the idle load after it, were recorded.

    Each record waits up to ``grace`` seconds for that event: the event loop gets every
    chance to win, so a scheduler that sends before it records is caught every time, not
    only on a busy machine. One that records first pays the wait and is never caught."""

    def __init__(self, grace: float = 0.5) -> None:
        super().__init__()
        self.grace = grace
        self.last_delivered = threading.Event()
        self.watching = False
        self.stats_after_response: list[bool] = []
        self.idle_load_after_response: list[bool] = []

    def watch(self, handle: RequestHandle) -> None:
        """Flag the handle's last event when the event loop delivers it."""
        self.last_delivered.clear()
        self.watching = True
        deliver = handle.deliver

        def watched(event: Any) -> None:
            deliver(event)
            if isinstance(event, ErrorEvent) or event.finish is not None:
                self.last_delivered.set()

        handle.deliver = watched  # type: ignore[method-assign]

    def record_request(self, stats: RequestStats) -> None:
        super().record_request(stats)
        self.stats_after_response.append(self.last_delivered.wait(self.grace))

    def record_load(self, stats: LoadStats) -> None:
        super().record_load(stats)
        if self.watching and stats.running == 0:
            self.idle_load_after_response.append(self.last_delivered.wait(self.grace))
            self.watching = False


def test_a_request_is_in_the_stats_before_its_last_event_is_sent(
        model: ModelGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]]) -> None:
    """A finished request's stats (TTFT, queue time, inter-token latencies) and the idle
    load after it are recorded before its last event leaves the engine thread, so a
    /metrics scrape that follows a response counts that response: for a request that
    decodes, one that ends at its first token, and one refused for its size."""
    stats = DeliveryWatch()
    scheduler = Scheduler(model, codec, SchedulerLimits(
        max_batch_size=8, max_batch_tokens=64, max_queued_requests=16,
        prefill_chunk_tokens=0, adaptive_prefill_chunks=False), stats)
    ids = encode(PROMPTS[0])
    too_long = list(range(1, 60))

    async def main() -> list[list[Any]]:
        scheduler.start(asyncio.get_running_loop())
        got = []
        for request in (greedy(ids, 5), greedy(ids, 1), greedy(too_long, 8)):
            (handle,) = scheduler.submit([request])
            stats.watch(handle)
            got.append(await handle.all_events())
        return got

    try:
        decoded, first_only, refused = asyncio.run(main())
    finally:
        scheduler.stop(5)
    assert [len(decoded), len(first_only)] == [5, 1]
    assert isinstance(refused[-1], ErrorEvent) and "max_batch_tokens" in refused[-1].message
    assert [s.outcome for s in stats.requests] == ["finished", "finished", "error"]
    assert stats.stats_after_response == [False, False, False]
    assert stats.idle_load_after_response == [False, False, False]


class ReferenceDrafts:
    """A draft model that proposes the plain loop's own continuation of one prompt (so
    every draft is kept) and nothing for the others: which steps verify drafts is then set
    by the test, not by what this host's arithmetic makes a prompt lookup find."""

    def __init__(self, prompt: list[int], continuation: list[int], k: int) -> None:
        self.prompt, self.continuation, self.k = prompt, continuation, k

    def propose(self, key: int, history: Sequence[int], params: SamplingParams,
                seed: int | None) -> Proposal:
        del key, params, seed
        done = len(history) - len(self.prompt)
        mine = list(history[:len(self.prompt)]) == self.prompt and done >= 0
        drafts = self.continuation[done:done + self.k] if mine else []
        return Proposal(np.asarray(drafts, np.int64), None)

    def release(self, key: int) -> None:
        pass


def test_verified_drafts_and_a_riding_chunk_share_steps(
        mixed: EngineGraphRunner, codec: TextCodec, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """With speculation and engine_mixed.onnx, one step carries a row verifying its drafts,
    a row decoding one token with a long prompt's chunk riding in its pass, and that chunk:
    every request still gets the plain loop's tokens, and no step fails. The plan's shape
    is the test's: fixed chunks, drafts from a reference drafter for one row only."""
    runner = ControlledRunner(mixed, QueueGate(is_open=True), keep_plans=True)
    repetitive = encode("To be, or not to be. To be, or not")
    free = encode(PROMPTS[0])
    long = encode(" ".join(PROMPTS * 2))
    chunk = len(repetitive) + 1  # the two short prompts go in whole, the long one in chunks
    assert len(long) > 3 * chunk
    config = SpeculativeConfig(method="draft", speculative_adaptive=False,
                               speculative_max_batch_rows=8)
    drafter = ReferenceDrafts(repetitive, reference_greedy(repetitive, 24),
                              config.num_speculative_tokens)
    speculator = Speculator(config, drafter)
    stats = Recorder()
    scheduler = Scheduler(runner, codec, SchedulerLimits(
        max_batch_size=8, max_batch_tokens=4096, max_queued_requests=16,
        prefill_chunk_tokens=chunk, adaptive_prefill_chunks=False), stats,
                          speculator)
    requests = [greedy(repetitive, 24), greedy(free, 24), greedy(long, 8)]

    async def main() -> list[list[int]]:
        scheduler.start(asyncio.get_running_loop())
        return list(await asyncio.gather(*(tokens_of(h) for h in scheduler.submit(requests))))

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop(5)
    for r, got in zip(requests, results, strict=True):
        assert got == reference_greedy(r.prompt_ids, r.stopping.max_new_tokens)
    assert runner.plans is not None
    shared = [p for p in runner.plans if any(r.drafted for r in p.rows)
              and any(len(r.tokens) > 1 and not r.drafted for r in p.rows)]  # and a chunk
    assert shared and any(len(r.tokens) == 1 for p in shared for r in p.rows)
    assert speculator.counters.accepted_tokens > 0
    assert stats.step_failures == []
    assert mixed.pool.used == 0
