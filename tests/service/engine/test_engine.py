"""The Engine as the server builds it: from an artifact and an EngineConfig, in one call.

Parity: the Engine over engine.onnx and over model.onnx (through the KV pool) gives the
plain ONNX Runtime loop's greedy tokens (service/contract/reference.py: model.onnx by its
names, batch 1, no engine code) for a ragged batch that others join while it decodes and
that rows leave at different steps. Construction: the runtime's load, the KV budget in
tokens and its admission, and the settings that refuse to start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import service.engine.engine as engine_module
from service.artifact.loader import Artifact, open_artifact
from service.engine.engine import Engine, EngineConfig, pool_config
from service.engine.request import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    StoppingCriteria,
    TokenEvent,
)
from service.engine.runner import ModelRunner
from service.engine.scheduler import RequestHandle
from service.settings import Settings
from tests.service.fault_runner import ControlledRunner, QueueGate, Recorder

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further", "To be",
           "What say you, my good lord? I pray", "O", "Now is the winter"]


def opened(path: Path, **settings: Any) -> Artifact:
    return open_artifact(Settings.model_validate({"model": path, **settings}))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[QueueGate]:
    """Every engine built in the test runs its forward passes behind this gate."""
    gate = QueueGate()
    create = engine_module.create_runner

    def gated(*args: Any, **kwargs: Any) -> ModelRunner:
        return ControlledRunner(create(*args, **kwargs), gate)

    monkeypatch.setattr(engine_module, "create_runner", gated)
    yield gate
    gate.send("+")


def greedy(ids: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(ids, SamplingParams(), StoppingCriteria(n))


async def tokens_of(handle: RequestHandle) -> list[int]:
    out = []
    async for event in handle.events():
        assert isinstance(event, TokenEvent), event
        out.append(event.token.id)
    return out


@pytest.mark.parametrize("graph", ["engine.onnx", "model.onnx"])
def test_engine_equals_the_plain_loop_with_joins_and_leaves_mid_flight(
        graph: str, engine_artifact: Path, gate: QueueGate,
        encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    config = EngineConfig(intra_op_threads=1, max_batch_size=8, engine_graph=graph == "engine.onnx",
                          prefill_chunk_tokens=0)
    gate.send("+")  # the warm-up runs freely
    engine = Engine.from_artifact(opened(engine_artifact), config, Recorder())
    assert engine.graph_file == graph
    gate.send("-")
    first = [greedy(encode(PROMPTS[0]), 30), greedy(encode(PROMPTS[1]), 9)]  # ragged
    later = [greedy(encode(p), n) for p, n in zip(PROMPTS[2:], [14, 25, 3, 18], strict=True)]

    async def main() -> list[list[int]]:
        engine.start(asyncio.get_running_loop())
        handles = engine.submit(first)
        gate.send("....")  # prefill and three decode steps; the fourth waits at the gate
        streams = [h.events() for h in handles]
        heads: list[list[int]] = [[], []]
        for _ in range(4):
            for head, events in zip(heads, streams, strict=True):
                event = await anext(events)
                assert isinstance(event, TokenEvent)
                head.append(event.token.id)
        joined = engine.submit(later[:2])  # join while both rows are mid-decode
        gate.send(".....")
        third = engine.submit(later[2:])  # and again, a few steps on
        gate.send("+")
        rests = [[e.token.id async for e in events] for events in streams]  # type: ignore[union-attr]
        others = await asyncio.gather(*(tokens_of(h) for h in [*joined, *third]))
        return [h + r for h, r in zip(heads, rests, strict=True)] + list(others)

    try:
        got = asyncio.run(main())
    finally:
        engine.stop(5)
    for request, tokens in zip([*first, *later], got, strict=True):
        assert tokens == reference_greedy(request.prompt_ids, request.stopping.max_new_tokens)
    assert engine.kv_stats().slots_used == 0 and engine.kv_stats().tokens == 0


def test_load_engine_builds_the_engine_from_the_settings(engine_artifact: Path) -> None:
    from service.http.metrics import Metrics
    from service.http.routes import health
    from service.http.runtime import Runtime, load_engine
    from service.http.validation import Validator

    settings = Settings.model_validate({"model": engine_artifact, "intra_op_threads": 1,
                                        "max_batch_size": 4, "max_total_tokens": 64,
                                        "kv_cache_memory_mb": 1.0, "prefix_caching": False})
    artifact = open_artifact(settings)
    runtime = Runtime(settings, artifact, Metrics(), Validator(
        artifact.codec, artifact.limits, artifact.config.eos_token_id, 16))
    load_engine(runtime)
    engine = runtime.engine
    assert engine is not None
    assert runtime.decode_graph == "engine.onnx" and runtime.provider == engine.provider
    config = artifact.config
    budget = 2**20 // config.kv_bytes_per_token()  # tokens of 1 MiB
    kv = engine.kv_stats()
    assert kv.slots == 4 and kv.capacity_tokens == min(budget, 4 * 64)
    assert engine.scheduler.limits.max_batch_tokens == kv.capacity_tokens
    info = asyncio.run(health.info(runtime))["limits"]  # what /info says: the applied limits
    assert (info["max_batch_size"], info["max_batch_tokens"]) == (4, min(budget, 4 * 64))
    assert engine.prefix_stats() is None
    engine.stop(1)


def test_admission_counts_reserved_tokens_against_the_kv_budget(
        engine_artifact: Path, encode: Callable[[str], list[int]],
        reference_greedy: Callable[[list[int], int], list[int]]) -> None:
    """A budget of 100 tokens holds one 60-token request at a time: the second waits for
    the first to leave (never more rows than fit), one that could never fit is refused."""
    artifact = opened(engine_artifact)
    token_bytes = artifact.config.kv_bytes_per_token()
    config = EngineConfig(intra_op_threads=1, max_batch_size=8, max_total_tokens=64,
                          kv_cache_memory_mb=100 * token_bytes / 2**20, prefix_caching=False)
    stats = Recorder()
    engine = Engine.from_artifact(artifact, config, stats)
    assert engine.kv_stats().capacity_tokens == 100
    ids = encode(PROMPTS[1])
    n = 60 - len(ids)

    async def main() -> tuple[list[list[int]], Any]:
        engine.start(asyncio.get_running_loop())
        handles = engine.submit([greedy(ids, n), greedy(ids, n)])
        done = await asyncio.gather(*(tokens_of(h) for h in handles))
        (huge,) = engine.submit([greedy(ids, 100)])
        return list(done), [e async for e in huge.events()][-1]

    try:
        (a, b), refused = asyncio.run(main())
    finally:
        engine.stop(5)
    assert a == b == reference_greedy(ids, n)
    assert max(s.batch_size for s in stats.steps) == 1  # never two 60-token rows at once
    assert max(load.kv.tokens for load in stats.loads) <= 100
    assert isinstance(refused, ErrorEvent) and "max_batch_tokens" in refused.message


def test_a_budget_below_one_request_refuses_to_start(artifact: Path) -> None:
    config = opened(artifact).config
    engine = EngineConfig(max_total_tokens=64, kv_cache_memory_mb=config.kv_bytes_per_token()
                          * 10 / 2**20)
    with pytest.raises(ValueError, match="a long request could never run"):
        pool_config(engine, config, config.kv_bytes_per_token())
    pool = pool_config(EngineConfig(max_batch_size=3, max_batch_tokens=500, max_total_tokens=64),
                       config, config.kv_bytes_per_token())
    assert (pool.slots, pool.max_len, pool.budget_tokens) == (3, 64, 500)
