"""A ModelRunner wrapper the tests drive: steps wait at a gate and fail on command.

Tests act while a request is provably mid-decode, or make exactly one step fail, without
sleeping: the engine thread blocks inside a step (``ModelRunner.run``) until the test lets
it through. The gate reads one-character commands, in order:

    "."  let one step run                  "!"  make the next step raise
    "+"  open: run freely                  "-"  closed: every step waits for "." or "!"

In process the commands go through a queue (``QueueGate``); for a server subprocess they
go through a FIFO the test writes (``FifoGate``; end of file opens the gate for good).
``poison`` makes every step that feeds a prompt (or a prompt chunk) containing that token
id raise, so one request's prefill fails whatever else is in its step.
"""

from __future__ import annotations

import os
import queue
import select
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from service.engine.kv_pool import Slot
from service.engine.request import ModelVariant
from service.engine.runner import ModelRunner
from service.engine.stats import (
    KVStats,
    LoadStats,
    PrefixCacheStats,
    RequestStats,
    StepFailure,
    StepStats,
)
from service.engine.step_plan import RowWork, StepPlan, StepResult


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


class Gate:
    def __init__(self, is_open: bool = False) -> None:
        self.is_open = is_open
        self._pending: deque[str] = deque()

    def _read(self, block: bool) -> str:
        raise NotImplementedError

    def next(self) -> bool:
        """Wait until a forward pass may run; False if it must fail."""
        while True:
            if not self._pending:
                self._pending.extend(self._read(block=not self.is_open))
            while self._pending:
                command = self._pending.popleft()
                if command == "+":
                    self.is_open = True
                elif command == "-":
                    self.is_open = False
                elif command in ".!":
                    return command == "."
            if self.is_open:
                return True


class QueueGate(Gate):
    """Commands from the test thread through a queue (in-process tests)."""

    def __init__(self, is_open: bool = False) -> None:
        super().__init__(is_open)
        self.commands: queue.Queue[str] = queue.Queue()

    def send(self, commands: str) -> None:
        for c in commands:
            self.commands.put(c)

    def _read(self, block: bool) -> str:
        try:
            return self.commands.get(block=block)
        except queue.Empty:
            return ""


class FifoGate(Gate):
    """Commands from a FIFO (a server subprocess); opened at the first forward pass."""

    def __init__(self, path: str) -> None:
        super().__init__(False)
        self.path = path
        self._fd: int | None = None

    def _read(self, block: bool) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        if not block and not select.select([self._fd], [], [], 0)[0]:
            return ""
        data = os.read(self._fd, 4096)
        if not data:  # the test closed its end: run freely from now on
            self.is_open = True
            return "+"
        return data.decode("ascii")


class ControlledRunner:
    """The real runner behind a gate and a poison token; everything else passes through.

    Every step (``run``: one plan, however many passes the runner makes of it) waits at
    the gate.
    """

    def __init__(self, runner: ModelRunner, gate: Gate | None = None,
                 poison: int | None = None, keep_plans: bool = False,
                 pass_seconds: Callable[[Sequence[RowWork]], float] | None = None) -> None:
        """``keep_plans``: keep every step's plan (``plans``) for the test to inspect.
        ``pass_seconds``: what each pass took, from the rows it carried (a fake clock for
        what the scheduler learns from pass times), instead of this machine's figure."""
        self.runner = runner
        self.pass_seconds = pass_seconds
        self.gate = gate
        self.poison = poison
        self.forwards = 0
        self.plans: list[StepPlan] | None = [] if keep_plans else None  # in order
        self.vocab_size = runner.vocab_size
        self.graph_file = runner.graph_file
        self.provider = runner.provider
        self.device = runner.device
        self.mixes_chunks = runner.mixes_chunks
        self.samples_on_device = runner.samples_on_device
        self.float32_pass_tokens = runner.float32_pass_tokens
        self.graphs = runner.graphs
        self.adapters = runner.adapters
        self.control_vectors = runner.control_vectors
        self.resolve = runner.resolve
        self.release = runner.release

    def _pass(self, prompts: Sequence[np.ndarray] = ()) -> None:
        if self.gate is not None and not self.gate.next():
            raise InjectedFault("injected fault in a forward pass")
        if self.poison is not None and any((np.asarray(p) == self.poison).any()
                                           for p in prompts):
            raise InjectedFault(f"injected fault: prompt holds poison token {self.poison}")
        self.forwards += 1

    def run(self, plan: StepPlan) -> StepResult:
        self._pass([r.tokens for r in plan.rows if len(r.tokens) > 1 and not r.drafted])
        if self.plans is not None:
            self.plans.append(plan)
        result = self.runner.run(plan)
        if self.pass_seconds is not None:
            timed = self.pass_seconds
            result.passes = [replace(p, seconds=timed([plan.rows[i] for i in p.rows]))
                             for p in result.passes]
        return result

    @property
    def capacity(self) -> int:
        return self.runner.capacity

    @property
    def budget_tokens(self) -> int:
        return self.runner.budget_tokens

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    @property
    def rows_used(self) -> int:
        return self.runner.rows_used

    def cached_length(self, slot: Slot) -> int:
        return self.runner.cached_length(slot)

    def kv_resident_bytes(self) -> int:
        return self.runner.kv_resident_bytes()

    def reserve(self, rows: int, top: bool = False,
                prompts: Sequence[np.ndarray | None] | None = None,
                variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        return self.runner.reserve(rows, top, prompts, variants)

    def truncate(self, slot: Slot, length: int) -> None:
        self.runner.truncate(slot, length)

    def leave(self, slots: Sequence[Slot], keep: Sequence[int],
              variants: Sequence[ModelVariant] | None = None) -> list[Slot]:
        return self.runner.leave(slots, keep, variants)

    def join(self, groups: Sequence[Sequence[Slot]]) -> list[Slot]:
        return self.runner.join(groups)

    def kv_stats(self) -> KVStats:
        return self.runner.kv_stats()

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self.runner.prefix_stats()


class Recorder:
    """A StatsSink that keeps every stat the engine emits, for assertions."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.loads: list[LoadStats] = []
        self.requests: list[RequestStats] = []
        self.step_failures: list[StepFailure] = []

    def record_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def record_step_failure(self, kind: StepFailure) -> None:
        self.step_failures.append(kind)

    def record_load(self, stats: LoadStats) -> None:
        self.loads.append(stats)

    def record_queue(self, waiting: int) -> None:
        pass

    def record_request(self, stats: RequestStats) -> None:
        self.requests.append(stats)
