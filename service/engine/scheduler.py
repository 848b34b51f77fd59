"""The engine loop: one background thread per process drives a single running batch.

Routes call ``submit`` on the event loop and read events from a per-request asyncio
queue. The loop thread admits waiting requests at every step (their prefill runs, then
they decode with the rest), retires finished and cancelled rows at once, and hands each
step's events back to the event loop with one ``call_soon_threadsafe``, once the step's
stats and the load after it are recorded (so a response is in /metrics before it
completes). Each time it runs out of work it gives the C heap's freed pages back to the OS
(service/engine/resident.py), so the server's memory after a busy period returns to what it
holds. A prompt longer
than ``prefill_chunk_tokens`` is prefilled one chunk per loop iteration, between decode
steps of the running rows, so they keep their pace.

Faults stay local: a failed prefill is retried request by request, and only the requests
that fail alone get an error (424 over HTTP); a failed decode step fails the rows of that
step, frees their cache, and the loop goes on with the next requests. Admission is
bounded: when ``max_queued_requests`` are already waiting, ``submit`` raises QueueFull.
A batch never holds more than ``max_batch_size`` rows (at most the runner's pool slots),
nor more than ``max_batch_tokens`` reserved (prompt plus max_new_tokens per row; at most
the KV pool's token budget), so a running request is never evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from service.engine.batch import Batch
from service.engine.chunking import ChunkBudget
from service.engine.request import ErrorEvent, Event, GenerationRequest, TokenEvent
from service.engine.resident import release_freed_heap
from service.engine.runner import ModelRunner
from service.engine.sequence import SequenceState
from service.engine.speculative import Speculator
from service.engine.stats import LoadStats, NullStats, RequestStats, StatsSink, StepStats
from service.engine.text import TextCodec

log = logging.getLogger("attnserve.engine")

Outcome = Literal["finished", "cancelled", "error"]


class QueueFull(Exception):
    """Too many requests are waiting; the caller answers 429."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_queued_requests: int
    prefill_chunk_tokens: int = 0  # 0: prompts are prefilled in one pass
    adaptive_chunks: bool = False  # chunks cost about a decode step (chunking.py)


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
                 stats: StatsSink | None = None, speculator: Speculator | None = None) -> None:
        self.runner = runner
        self.codec = codec
        self.speculator = speculator  # None: one token per row per decode step
        # A batch never outgrows the runner's pool, nor its KV budget in tokens.
        limits = replace(limits, max_batch_size=min(limits.max_batch_size, runner.capacity),
                         max_batch_tokens=min(limits.max_batch_tokens, runner.budget_tokens))
        self.limits = limits
        self.stats: StatsSink = stats or NullStats()
        self._cv = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._partial: Batch | None = None  # a long prompt part-way through its prefill
        self.chunks = ChunkBudget(limits.prefill_chunk_tokens, limits.adaptive_chunks,
                                  mixed=runner.mixes_chunks)
        self._handles: dict[int, RequestHandle] = {}
        self._outbox: list[tuple[RequestHandle, Event]] = []  # events _publish sends
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
            self.stats.record_queue(len(self._waiting))
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
        batch = Batch.from_requests([request], self.codec, self.runner.vocab_size)
        try:
            while True:
                events = batch.step(self.runner)
                if events[0].finish is not None:
                    return
        finally:
            batch.release(self.runner)

    # -- loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        batch: Batch | None = None
        self._publish(None)  # the pool's size is known from the start
        while True:
            with self._cv:
                while (not self._stopping and not self._waiting and batch is None
                       and self._partial is None):
                    self._cv.wait()
                if self._stopping:
                    break
                admitted = self._admit(batch)
            try:
                batch = self._iterate(batch, admitted)
            except Exception as exc:  # a bug outside a forward pass: fail what is in flight
                log.exception("engine loop failed; failing the requests in flight")
                for doomed in (batch, self._partial):
                    if doomed is not None:
                        with contextlib.suppress(Exception):
                            doomed.release(self.runner)
                self._fail(batch, admitted, f"generation failed: {exc}", "generation")
                if self._partial is not None:
                    self._fail(self._partial, [], f"generation failed: {exc}", "generation")
                batch, self._partial = None, None
            self._publish(batch)
            if batch is None and self._partial is None and not self._waiting:
                release_freed_heap()  # idle now: the busy period's heap holes go back
        self._fail(batch, list(self._waiting), "the server is shutting down", "shutdown")
        if self._partial is not None:
            self._fail(self._partial, [], "the server is shutting down", "shutdown")
            self._partial = None
        self._waiting.clear()
        self._publish(None)

    def _iterate(self, batch: Batch | None, admitted: list[RequestHandle]) -> Batch | None:
        """One loop iteration: newcomers join, a chunk of a long prompt, one decode step
        (the chunk rides in the decode step's pass where the runner mixes them)."""
        if batch is not None:
            batch = self._retire(batch)  # rows cancelled while the step ran
        if admitted and batch is not None and self._partial is None and self._mixes(batch) \
                and not any(h.request.prompt_logprobs for h in admitted):
            return self._decode_with_prompts(batch, admitted)
        if admitted:
            batch = self._join(batch, self._prefill(admitted))
            self._publish(batch)
        if self._partial is not None and self._drop_cancelled_partial():
            self._publish(batch)
        if self._partial is not None:
            if batch is not None and self._mixes(batch):
                return self._decode_with_chunk(batch)
            batch = self._join(batch, self._advance_partial(running=batch is not None))
            self._publish(batch)
        if batch is not None:
            batch = self._decode(batch)
        return batch

    def _mixes(self, batch: Batch) -> bool:
        """Whether the next chunk can share the batch's decode pass: the runner's graph
        takes both, and the step is not speculative (whose passes are per row)."""
        speculating = self.speculator is not None and self.speculator.applies(len(batch))
        return self.runner.mixes_chunks and not speculating

    def _decode_with_chunk(self, batch: Batch) -> Batch | None:
        """One decode step with the next chunk of the partly prefilled prompt in the same
        pass; that row joins the batch once its prompt is in and its first token sampled.
        If the pass fails, the rows of both fail, as any failed step's do."""
        partial = self._partial
        assert partial is not None
        size = min(self.chunks.next_chunk(True, partial.prompt_left), partial.prompt_left)
        start = time.perf_counter()
        try:
            events, first = batch.step_with_chunk(self.runner, partial, size)
        except Exception as exc:
            self._partial = None
            for failed in (batch, partial):
                failed.release(self.runner)
                self._fail_step(failed, exc)
            return None
        took = time.perf_counter() - start
        self.chunks.observe_mixed(size, took)
        self.stats.record_step(StepStats("decode", took, len(batch), len(batch)))
        self.stats.record_step(StepStats("prefill", took, len(first), size))
        self._deliver((batch, events), (partial, first))
        batch_left = self._retire(batch)
        if not first:
            return batch_left
        self._partial = None
        return self._join(batch_left, self._retire(partial))

    def _decode_with_prompts(self, batch: Batch, admitted: list[RequestHandle]
                             ) -> Batch | None:
        """One decode step with the newcomers' prompts in the same pass; they join the
        batch with their first tokens. If that pass fails, the newcomers go the separate
        way (a prefill of their own, each alone if need be, so a bad prompt fails alone)
        and the batch decodes on its own."""
        fresh = self._new_batch([h.request for h in admitted])
        prompt_tokens = fresh.prompt_left
        start = time.perf_counter()
        try:
            events, firsts = batch.step_with_prompts(self.runner, fresh)
        except Exception as exc:
            log.warning("decode step with %d newcomers' prompts failed (%s); prefilling them "
                        "on their own", len(admitted), exc)
            fresh.release(self.runner)
            joined = self._join(batch, self._prefill(admitted))
            self._publish(joined)
            return self._decode(joined) if joined is not None else None
        took = time.perf_counter() - start
        self.stats.record_step(StepStats("decode", took, len(batch), len(batch)))
        self.stats.record_step(StepStats("prefill", took, len(fresh), prompt_tokens))
        self._deliver((batch, events), (fresh, firsts))
        return self._join(self._retire(batch), self._retire(fresh))

    def _deliver(self, *batches: tuple[Batch, list[TokenEvent]]) -> None:
        """Send each batch's events, one per row in row order (a row may have none: a
        partial prefill's before its last chunk)."""
        self._send([(self._handles[s.request.id], e) for batch, events in batches
                    for s, e in zip(batch.sequences, events, strict=False)])

    def _drop_cancelled_partial(self) -> bool:
        """Drop the partly prefilled request if it was cancelled; whether it was."""
        partial = self._partial
        assert partial is not None
        seq = partial.sequences[0]
        if not seq.request.cancelled.is_set():
            return False
        self._partial = None
        partial.release(self.runner)
        self._leave(self._handles[seq.request.id], "cancelled", seq)
        return True

    def _chunked(self, request: GenerationRequest) -> bool:
        size = self.limits.prefill_chunk_tokens
        return size > 0 and len(request.prompt_ids) > size and not request.prompt_logprobs

    def _admit(self, batch: Batch | None) -> list[RequestHandle]:
        rows = (len(batch) if batch is not None else 0) + (self._partial is not None)
        reserved = batch.reserved_tokens if batch is not None else 0
        if self._partial is not None:
            reserved += self._partial.reserved_tokens
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
            if self._chunked(head.request):
                if self._partial is not None:
                    break  # one chunked prefill at a time, in arrival order
                self._waiting.popleft()
                self._start_partial(head)
                rows += 1
            else:
                admitted.append(self._waiting.popleft())
            reserved += need
        return admitted

    def _prefill(self, admitted: list[RequestHandle]) -> Batch | None:
        """Prefill the newcomers together; if that fails, each alone, so a request whose
        prefill fails is the only one that gets the error."""
        fresh = self._new_batch([h.request for h in admitted])
        try:
            return self._step(fresh, "prefill")
        except Exception as exc:
            fresh.release(self.runner)
            if len(admitted) == 1:
                self._fail_step(fresh, exc)
                return None
            log.warning("prefill of %d requests failed (%s); retrying one by one",
                        len(admitted), exc)
        survivors = []
        for handle in admitted:
            alone = self._new_batch([handle.request])
            try:
                done = self._step(alone, "prefill")
            except Exception as exc:
                alone.release(self.runner)
                self._fail_step(alone, exc)
                continue
            if done is not None:
                survivors.append(done)
        if not survivors:
            return None
        return Batch.concatenate(survivors, self.runner)

    def _start_partial(self, handle: RequestHandle) -> None:
        batch = self._new_batch([handle.request])
        try:
            batch.reserve(self.runner, top=True)
            batch.sequences[0].prefill_start = time.perf_counter()
            # A cached prefix goes in first: chunks start after it.
            batch.prompt_done = self.runner.reuse_prefix(batch.slots[0],
                                                         handle.request.prompt_ids)
        except Exception as exc:
            batch.release(self.runner)
            self._fail_step(batch, exc)
            return
        self._partial = batch

    def _advance_partial(self, running: bool) -> Batch | None:
        """One chunk of the partly prefilled request; the batch once its prompt is in.
        ``running``: rows are decoding, and wait for this chunk."""
        partial = self._partial
        assert partial is not None
        size = self.chunks.next_chunk(running, partial.prompt_left)
        try:
            if partial.prompt_left > size:
                started = time.perf_counter()
                partial.prefill_chunk(self.runner, size)
                took = time.perf_counter() - started
                self.chunks.observe_chunk(size, took)
                self.stats.record_step(StepStats("prefill", took, 0, size))  # no token
                return None
            self._partial = None
            return self._step(partial, "prefill")
        except Exception as exc:
            self._partial = None
            partial.release(self.runner)
            self._fail_step(partial, exc)
            return None

    def _join(self, batch: Batch | None, fresh: Batch | None) -> Batch | None:
        if fresh is None:
            return batch
        if batch is None:
            return fresh
        return Batch.concatenate([batch, fresh], self.runner)

    def _decode(self, batch: Batch) -> Batch | None:
        """One decode step; if it fails, its rows fail (424) and the engine goes on."""
        try:
            return self._step(batch, "decode")
        except Exception as exc:
            batch.release(self.runner)
            self._fail_step(batch, exc)
            return None

    def _new_batch(self, requests: list[GenerationRequest]) -> Batch:
        return Batch.from_requests(requests, self.codec, self.runner.vocab_size)

    def _step(self, batch: Batch, phase: str) -> Batch | None:
        start = time.perf_counter()
        # prompt tokens this pass feeds (after any chunks), or one token per row
        tokens = len(batch) if batch.is_prefilled else batch.prompt_left
        if (phase == "decode" and self.speculator is not None
                and self.speculator.applies(len(batch))):
            events = batch.speculate(self.runner, self.speculator)
            tokens = sum(len(e) for e in events)
        else:
            events = [[e] for e in batch.step(self.runner)]
        duration = time.perf_counter() - start
        if phase == "decode":
            self.chunks.observe_decode(duration)
        self.stats.record_step(StepStats("prefill" if phase == "prefill" else "decode",
                                         duration, len(batch), tokens))
        self._send([(self._handles[s.request.id], e)
                    for s, row in zip(batch.sequences, events, strict=True) for e in row])
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
            batch.release(self.runner)
            return None
        batch.filter(keep, self.runner)
        return batch

    def _fail_step(self, batch: Batch, exc: Exception) -> None:
        log.error("engine step failed for %d request(s): %s", len(batch), exc,
                  exc_info=exc)
        self._fail(batch, [], f"generation failed: {exc}", "generation")

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

    def _leave(self, handle: RequestHandle, outcome: Outcome, seq: SequenceState | None
               ) -> None:
        self._handles.pop(handle.request.id, None)
        req = handle.request
        if self.speculator is not None:
            self.speculator.release(req.id)
        started = seq is not None and seq.prefill_start > 0
        self.stats.record_request(RequestStats(
            outcome=outcome,
            prompt_tokens=len(req.prompt_ids),
            generated_tokens=seq.generated if seq else 0,
            queue_time=(seq.prefill_start - req.arrival) if seq and started else None,
            time_to_first_token=(seq.first_token_time - req.arrival)
            if seq and seq.first_token_time is not None else None,
            inter_token_latencies=tuple(seq.inter_token_latencies) if seq else ()))

    def _send(self, pairs: list[tuple[RequestHandle, Event]]) -> None:
        """Queue events for the event loop; :meth:`_publish` hands them over."""
        self._outbox.extend(pairs)

    def _publish(self, batch: Batch | None) -> None:
        """Record the engine's load, then hand the events queued since the last call to
        the event loop.

        Every event leaves the loop thread here, after the stats of the step that made it,
        the stats of the requests that step finished (recorded as their rows retired) and
        the load that followed: a client that scrapes /metrics right after its response
        finds that response in every counter, histogram and gauge."""
        self.running = len(batch) if batch is not None else 0
        self.stats.record_load(LoadStats(
            running=self.running, waiting=len(self._waiting), kv=self.runner.kv_stats(),
            prefix_cache=self.runner.prefix_stats(),
            prefilling=int(self._partial is not None),
            speculation=self.speculator.stats() if self.speculator is not None else None))
        pairs, self._outbox = self._outbox, []
        if not pairs or self._loop is None:
            return
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_dispatch, pairs)



def _dispatch(pairs: list[tuple[RequestHandle, Event]]) -> None:
    for handle, event in pairs:
        handle.deliver(event)

