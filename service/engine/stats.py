"""Stats the engine emits; service/metrics.py records them (the engine knows no Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class StepStats:
    """One forward pass of the engine loop."""

    phase: Literal["prefill", "decode"]
    duration: float  # seconds, including sampling and detokenization
    batch_size: int  # sequences in the pass
    tokens: int  # prompt tokens prefilled, or tokens generated


@dataclass(frozen=True)
class LoadStats:
    """The engine's occupancy after a loop iteration."""

    running: int
    waiting: int
    kv_cache_tokens: int


@dataclass(frozen=True)
class RequestStats:
    """One request that left the engine (finished, cancelled or failed)."""

    outcome: Literal["finished", "cancelled", "error"]
    prompt_tokens: int
    generated_tokens: int
    queue_time: float | None  # None if it never left the queue
    time_to_first_token: float | None
    inter_token_latencies: tuple[float, ...]


class StatsSink(Protocol):
    def record_step(self, stats: StepStats) -> None: ...

    def record_load(self, stats: LoadStats) -> None: ...

    def record_request(self, stats: RequestStats) -> None: ...


class NullStats:
    def record_step(self, stats: StepStats) -> None:
        pass

    def record_load(self, stats: LoadStats) -> None:
        pass

    def record_request(self, stats: RequestStats) -> None:
        pass
