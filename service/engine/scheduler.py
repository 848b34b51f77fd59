"""The engine loop: one background thread per process drives a single running batch.

Routes call ``submit`` on the event loop and read events from a per-request asyncio
queue. The loop thread admits waiting requests at every step (their prefill runs, then
they decode with the rest), retires finished and cancelled rows at once, and hands each
step's events back to the event loop with one ``call_soon_threadsafe``. Admission is
bounded: when ``max_queued_requests`` are already waiting, ``submit`` raises QueueFull.
A batch never holds more than ``max_batch_size`` rows, nor more than ``max_batch_tokens``
reserved (prompt plus max_new_tokens per row), so a running request is never evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from service.engine.batch import Batch, ModelRunner, SequenceState
from service.engine.request import ErrorEvent, Event, GenerationRequest
from service.engine.stats import LoadStats, NullStats, RequestStats, StatsSink, StepStats
from service.engine.text import TextCodec

log = logging.getLogger("attnserve.engine")


class QueueFull(Exception):
    """Too many requests are waiting; the caller answers 429."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_queued_requests: int


def _is_last(event: Event) -> bool:
    return isinstance(event, ErrorEvent) or event.finish is not None


class RequestHandle:
    """The event-loop side of one request: its events and its cancel switch.

    A stream reads events one by one (``events``). A plain request awaits ``all_events``:
    its events are gathered as they arrive and its coroutine wakes once, at the end,
    instead of once per token, which keeps the event loop's work per decode step small.
    """

    def __init__(self, request: GenerationRequest, scheduler: Scheduler) -> None:
        self.request = request
        self._scheduler = scheduler
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._gathered: list[Event] | None = None
        self._complete: asyncio.Future[list[Event]] | None = None

    def deliver(self, event: Event) -> None:
        """Called on the event loop for every event of this request, in order."""
        if self._complete is None or self._gathered is None:
            self.queue.put_nowait(event)
            return
        self._gathered.append(event)
        if _is_last(event) and not self._complete.done():
            self._complete.set_result(self._gathered)

    async def all_events(self) -> list[Event]:
        """Every event up to and including the last one (or an ErrorEvent)."""
        gathered: list[Event] = []
        while not self.queue.empty():  # events delivered before this call
            gathered.append(self.queue.get_nowait())
            if _is_last(gathered[-1]):
                return gathered
        self._complete = asyncio.get_running_loop().create_future()
        self._gathered = gathered
        return await self._complete

    def cancel(self) -> None:
        if not self.request.cancelled.is_set():
            self.request.cancelled.set()
            self._scheduler.wake()

    async def events(self) -> AsyncIterator[Event]:
        """Token events up to and including the last one (or an ErrorEvent)."""
        while True:
            event = await self.queue.get()
            yield event
            if _is_last(event):
                return


class Scheduler:
    def __init__(self, runner: ModelRunner, codec: TextCodec, limits: SchedulerLimits,
                 pad_token_id: int, stats: StatsSink | None = None) -> None:
        self.runner = runner
        self.codec = codec
        self.limits = limits
        self.pad_token_id = pad_token_id
        self.stats: StatsSink = stats or NullStats()
        self._cv = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._handles: dict[int, RequestHandle] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.running = 0  # rows in the batch, as of the last loop iteration

    # -- event-loop side -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    def submit(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests, all or none; raise QueueFull past max_queued_requests."""
        handles = [RequestHandle(r, self) for r in requests]
        with self._cv:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running")
            if len(self._waiting) + len(handles) > self.limits.max_queued_requests:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(max_queued_requests {self.limits.max_queued_requests})")
            for h in handles:
                self._handles[h.request.id] = h
            self._waiting.extend(handles)
            self._cv.notify()
        return handles

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the current step, fail whatever is left, join the thread (blocking)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def warmup(self, request: GenerationRequest) -> None:
        """Run one request to completion on the calling thread (before ``start``)."""
        batch = Batch.from_requests([request], self.codec, self.runner.vocab_size,
                                    self.pad_token_id)
        while True:
            events = batch.step(self.runner)
            if events[0].finish is not None:
                return

    # -- loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        batch: Batch | None = None
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and batch is None:
                    self._cv.wait()
                if self._stopping:
                    break
                admitted = self._admit(batch)
            try:
                if admitted:
                    batch = self._join(batch, admitted)
                    self._report_load(batch)
                if batch is not None:
                    batch = self._retire(batch)  # rows cancelled while the step ran
                if batch is not None:
                    batch = self._step(batch, "decode")
            except Exception as exc:  # a failed forward pass fails its rows, not the loop
                log.exception("engine step failed")
                self._fail(batch, admitted, f"generation failed: {exc}", "generation")
                batch = None
            self._report_load(batch)
        self._fail(batch, list(self._waiting), "the server is shutting down", "shutdown")
        self._waiting.clear()
        self._report_load(None)

    def _admit(self, batch: Batch | None) -> list[RequestHandle]:
        rows = len(batch) if batch is not None else 0
        reserved = batch.reserved_tokens if batch is not None else 0
        admitted: list[RequestHandle] = []
        while self._waiting:
            head = self._waiting[0]
            if head.request.cancelled.is_set():
                self._waiting.popleft()
                self._leave(head, "cancelled", None)
                continue
            need = head.request.reserved_tokens
            if rows + len(admitted) >= self.limits.max_batch_size:
                break
            if reserved + need > self.limits.max_batch_tokens:
                if rows == 0 and not admitted:  # could never fit, even alone
                    self._waiting.popleft()
                    self._send([(head, ErrorEvent(
                        f"request needs {need} tokens, more than max_batch_tokens "
                        f"{self.limits.max_batch_tokens}"))])
                    self._leave(head, "error", None)
                    continue
                break
            admitted.append(self._waiting.popleft())
            reserved += need
        return admitted

    def _join(self, batch: Batch | None, admitted: list[RequestHandle]) -> Batch | None:
        fresh = Batch.from_requests([h.request for h in admitted], self.codec,
                                    self.runner.vocab_size, self.pad_token_id)
        fresh_or_none = self._step(fresh, "prefill")
        if fresh_or_none is None:
            return batch
        if batch is None:
            return fresh_or_none
        return Batch.concatenate([batch, fresh_or_none], self.runner)

    def _step(self, batch: Batch, phase: str) -> Batch | None:
        start = time.perf_counter()
        events = batch.step(self.runner)
        duration = time.perf_counter() - start
        tokens = int(batch.attention_mask.sum()) if phase == "prefill" else len(batch)
        self.stats.record_step(StepStats("prefill" if phase == "prefill" else "decode",
                                         duration, len(batch), tokens))
        self._send([(self._handles[s.request.id], e)
                    for s, e in zip(batch.sequences, events, strict=True)])
        return self._retire(batch)

    def _retire(self, batch: Batch) -> Batch | None:
        """Drop finished and cancelled rows at once, freeing their slots."""
        keep = []
        for i, seq in enumerate(batch.sequences):
            if seq.finish is not None:
                self._leave(self._handles[seq.request.id], "finished", seq)
            elif seq.request.cancelled.is_set():
                self._leave(self._handles[seq.request.id], "cancelled", seq)
            else:
                keep.append(i)
        if not keep:
            return None
        batch.filter(keep, self.runner)
        return batch

    def _fail(self, batch: Batch | None, handles: Sequence[RequestHandle], message: str,
              kind: str) -> None:
        ids = [s.request.id for s in batch.sequences] if batch else []
        ids += [h.request.id for h in handles]
        doomed = list({i: self._handles[i] for i in ids if i in self._handles}.values())
        error = ErrorEvent(message, "shutdown" if kind == "shutdown" else "generation")
        self._send([(h, error) for h in doomed])
        seqs = {s.request.id: s for s in batch.sequences} if batch else {}
        for h in doomed:
            self._leave(h, "error", seqs.get(h.request.id))

    def _leave(self, handle: RequestHandle, outcome: str, seq: SequenceState | None) -> None:
        self._handles.pop(handle.request.id, None)
        req = handle.request
        started = seq is not None and seq.prefill_start > 0
        self.stats.record_request(RequestStats(
            outcome=outcome,  # type: ignore[arg-type]
            prompt_tokens=len(req.prompt_ids),
            generated_tokens=seq.generated if seq else 0,
            queue_time=(seq.prefill_start - req.arrival) if seq and started else None,
            time_to_first_token=(seq.first_token_time - req.arrival)
            if seq and seq.first_token_time is not None else None,
            inter_token_latencies=tuple(seq.inter_token_latencies) if seq else ()))

    def _report_load(self, batch: Batch | None) -> None:
        self.running = len(batch) if batch is not None else 0
        self.stats.record_load(LoadStats(
            running=self.running, waiting=len(self._waiting),
            kv_cache_tokens=batch.cached_tokens if batch is not None else 0))

    def _send(self, pairs: list[tuple[RequestHandle, Event]]) -> None:
        if not pairs or self._loop is None:
            return
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_dispatch, pairs)


def _dispatch(pairs: list[tuple[RequestHandle, Event]]) -> None:
    for handle, event in pairs:
        handle.deliver(event)

