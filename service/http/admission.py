"""Bounded admission for a side route (``/attention``): a few run, a few wait, the rest 429.

One full-size /attention request is tens of MB of matrices and seconds of CPU. Without a
bound, a handful at once take every core and the decode loop's token streams stall; with
one, the route degrades into fast 429s (TGI's ``overloaded``) and decoding keeps its share
of the CPU. Admission is decided on arrival, never by timing: a request is admitted when
fewer than ``max_running + max_waiting`` are inside; it then waits for one of the
``max_running`` slots in arrival order (asyncio.Semaphore is FIFO).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass


class Overloaded(Exception):
    """Refused on arrival: the route's running and waiting slots are all taken (→ 429)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # the rejection-metric label


@dataclass(frozen=True)
class AdmissionStats:
    """What the gate holds after each change; service/http/metrics.py exports it."""

    route: str
    running: int
    waiting: int


class AdmissionGate:
    def __init__(self, route: str, max_running: int, max_waiting: int, reason: str,
                 on_change: Callable[[AdmissionStats], None] | None = None) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be ≥ 1 and max_waiting ≥ 0")
        self.route = route
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.reason = reason
        self._on_change = on_change
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold a running slot for the body of the ``async with``, or raise Overloaded."""
        if self.running + self.waiting >= self.max_running + self.max_waiting:
            raise Overloaded(
                f"{self.route} is at capacity ({self.running} running, {self.waiting} "
                f"waiting; at most {self.max_running} + {self.max_waiting}): retry later",
                self.reason)
        self.waiting += 1
        self._emit()
        try:
            await self._slots.acquire()  # cancelled if the client goes away while waiting
        except BaseException:
            self.waiting -= 1
            self._emit()
            raise
        self.waiting -= 1
        self.running += 1
        self._emit()
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
            self._emit()

    def _emit(self) -> None:
        if self._on_change is not None:
            self._on_change(AdmissionStats(self.route, self.running, self.waiting))
