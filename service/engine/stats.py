"""Stats the engine emits; service/http/metrics.py records them (the engine knows no Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args


@dataclass(frozen=True)
class StepStats:
    """One forward pass of the engine loop."""

    phase: Literal["prefill", "decode"]
    duration: float  # seconds, including sampling and detokenization
    batch_size: int  # sequences that got a token from the pass (0: a prompt chunk)
    tokens: int  # prompt tokens prefilled, or tokens generated


@dataclass(frozen=True)
class KVStats:
    """What the KV pool holds (every runner's: engine.onnx's and model.onnx's alike);
    ``slots`` and ``capacity_tokens`` (its budget in tokens) are fixed for a pool."""

    slots: int
    slots_used: int
    tokens: int  # tokens whose keys/values are cached, over all rows
    capacity_tokens: int
    bytes_allocated: int
    rows_moved: int = 0  # rows copied by compaction since start (pool only)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Automatic prefix caching, cumulative since start (counters) and now (gauges)."""

    queries: int  # prompt tokens looked up
    hits: int  # prompt tokens whose keys/values were reused
    blocks: int
    capacity_blocks: int
    block_size: int
    bytes_allocated: int
    evictions: int


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding, cumulative since start (vLLM's spec_decode counters)."""

    drafts: int  # verification passes that carried drafted tokens
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # drafts kept at position 0, 1, ...
    paused_steps: int = 0  # row steps decoded plainly because speculation did not pay


@dataclass(frozen=True)
class LoadStats:
    """The engine's occupancy after a loop iteration."""

    running: int
    waiting: int
    kv: KVStats
    prefix_cache: PrefixCacheStats | None = None
    prefilling: int = 0  # requests part-way through a chunked prefill
    speculation: SpeculationStats | None = None


@dataclass(frozen=True)
class RequestStats:
    """One request that left the engine (finished, cancelled or failed)."""

    outcome: Literal["finished", "cancelled", "error"]
    prompt_tokens: int
    generated_tokens: int
    queue_time: float | None  # None if it never left the queue
    time_to_first_token: float | None
    inter_token_latencies: tuple[float, ...]
    adapter: str | None = None  # the LoRA adapter it ran under (None: the base)
    control_vector: str | None = None  # the control vector it steered with (None: none)


# Why a step raised and what the scheduler did: "retried" (its newcomers were prefilled
# again one by one: every request still answered unless it failed alone), "failed" (its
# rows got an error), "loop" (outside a forward pass: every request in flight failed).
StepFailure = Literal["retried", "failed", "loop"]
STEP_FAILURES: tuple[StepFailure, ...] = get_args(StepFailure)


class StatsSink(Protocol):
    def record_step(self, stats: StepStats) -> None: ...

    def record_step_failure(self, kind: StepFailure) -> None: ...

    def record_load(self, stats: LoadStats) -> None: ...

    def record_queue(self, waiting: int) -> None:
        """Requests waiting, reported by ``submit`` as they arrive (the loop may be busy)."""
        ...

    def record_request(self, stats: RequestStats) -> None: ...


class NullStats:
    def record_step(self, stats: StepStats) -> None:
        pass

    def record_step_failure(self, kind: StepFailure) -> None:
        pass

    def record_load(self, stats: LoadStats) -> None:
        pass

    def record_queue(self, waiting: int) -> None:
        pass

    def record_request(self, stats: RequestStats) -> None:
        pass
