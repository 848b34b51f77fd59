"""The engine loop: one background thread per process drives a single running batch.

Routes call ``submit`` on the event loop and read events from a per-request asyncio
queue. Each loop iteration is one step (service/engine/step.py) carrying everything there
is to do: the running rows' decode tokens, the prompts of the requests admitted at this
step, the next chunk of a prompt longer than ``prefill_chunk_tokens`` (one chunk a step,
so the running rows keep their pace), drafts to verify; the runner runs it in one call
and chooses the passes. Finished and cancelled rows retire at once, and each step's
events go back to the event loop with one ``call_soon_threadsafe``, once the step's stats
and the load after it are recorded (so a response is in /metrics before it completes).
Each time it runs out of work it gives the C heap's freed pages back to the OS
(service/contract/pages.py), so the server's memory after a busy period returns to what
it holds.

With ``max_batch_prefill_tokens``, newcomers that arrive while rows decode join a step
only up to that many prompt tokens (the first always goes; TGI's option of the name), so
a burst of prompts is spread over steps instead of holding the running rows for one long
pass.

Faults stay local: when a step with newcomers fails, the rest of it runs again without
them and each newcomer is prefilled alone, so only a request that fails alone gets an
error (424 over HTTP); a failed step without newcomers fails its rows, frees their cache,
and the loop goes on with the next requests. Admission is
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

from service.artifact.text import TextCodec
from service.contract.pages import release_freed_heap
from service.contract.peft_adapter import AdapterError
from service.engine.adapters import UnknownAdapter
from service.engine.batch import Batch
from service.engine.chunking import ChunkBudget
from service.engine.request import ErrorEvent, Event, GenerationRequest
from service.engine.runner import ModelRunner
from service.engine.sequence import SequenceState
from service.engine.speculative import Speculator
from service.engine.stats import (
    LoadStats,
    NullStats,
    RequestStats,
    StatsSink,
    StepFailure,
    StepStats,
)
from service.engine.step import Step, run_step, step_alone
from service.settings import default_of

log = logging.getLogger("attnserve.engine")
# How every failed step's log line begins (the tests fail on one they did not inject).
STEP_FAILED = "step failed"

Outcome = Literal["finished", "cancelled", "error"]


class QueueFull(Exception):
    """Too many requests are waiting; the caller answers 429."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(frozen=True, kw_only=True)
class SchedulerLimits:
    """The settings the scheduler reads, by their Settings names and defaults, given by
    name only (the engine builds it with ``of_settings``); their meaning is in
    service/settings.py."""

    max_batch_size: int = default_of("max_batch_size")
    max_batch_tokens: int = default_of("max_batch_tokens")
    max_queued_requests: int = default_of("max_queued_requests")
    prefill_chunk_tokens: int = default_of("prefill_chunk_tokens")  # 0: one pass
    adaptive_prefill_chunks: bool = default_of("adaptive_prefill_chunks")  # chunking.py
    max_batch_prefill_tokens: int = default_of("max_batch_prefill_tokens")  # 0: no bound


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
        self.holds_adapter = False  # admitted: its adapter's slot counts it as running
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
        self.chunks = ChunkBudget(max_tokens=limits.prefill_chunk_tokens,
                                  adaptive=limits.adaptive_prefill_chunks,
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
        """Queue requests, all or none; raise QueueFull past max_queued_requests, and
        UnknownAdapter for a LoRA adapter the engine does not serve, UnknownControlVector
        for a control vector."""
        handles = [RequestHandle(r, self) for r in requests]
        with self._cv:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running")
            if len(self._waiting) + len(handles) > self.limits.max_queued_requests:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(max_queued_requests {self.limits.max_queued_requests})")
            self.runner.resolve(requests)
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
            while step_alone(self.runner, batch)[0][-1].finish is None:
                pass
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
                self._step_failed("loop", "outside a forward pass (%s); failing the "
                                  "requests in flight", exc, exc_info=exc)
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
        """One loop iteration: one step carrying everything there is to do (the running
        rows' decode, the newcomers' prompts, the next chunk of a long prompt)."""
        if batch is not None:
            batch = self._retire(batch)  # rows cancelled while the step ran
        if self._partial is not None and self._drop_cancelled_partial():
            self._publish(batch)
        fresh = self._new_batch([h.request for h in admitted]) if admitted else None
        if batch is None and fresh is None and self._partial is None:
            return None
        return self._step(batch, fresh, self._partial)

    def _step(self, batch: Batch | None, fresh: Batch | None, partial: Batch | None
              ) -> Batch | None:
        """One step (service/engine/step.py); the running batch after it, the rows that
        came in joined, those that finished gone.

        If the runner fails, newcomers are not failed with the step: the rest of the step
        runs again without them and each is prefilled alone, so only a prompt that fails
        alone gets the error. A step without newcomers fails its rows (424 over HTTP),
        frees their cache, and the loop goes on."""
        chunk = 0
        if partial is not None:
            running = batch is not None
            chunk = min(self.chunks.next_chunk(running, partial.prompt_left),
                        partial.prompt_left)
        prompt_tokens = fresh.prompt_left if fresh is not None else 0
        runner = self.runner
        try:  # the step's rows: the running rows', the newcomers', the long prompt's chunk
            step = run_step(runner, Step().add(runner, batch, speculator=self.speculator)
                            .add(runner, fresh).add(runner, partial, chunk), self.speculator)
        except Exception as exc:
            return self._after_failure(batch, fresh, partial, exc)
        self._record(step, batch, fresh, partial, prompt_tokens, chunk)
        joins = partial is not None and partial.is_prefilled  # its prompt is in
        if joins:
            self._partial = None
        self._send([(self._handles[r.sequence.request.id], e) for r in step.rows
                    for e in r.events])
        done = [self._retire(b) for b in (batch, fresh) if b is not None]
        if joins and partial is not None:
            done.append(self._retire(partial))
        kept = [b for b in done if b is not None]
        return Batch.concatenate(kept, self.runner) if kept else None

    def _after_failure(self, batch: Batch | None, fresh: Batch | None,
                       partial: Batch | None, exc: Exception) -> Batch | None:
        if fresh is None or (batch is None and partial is None and len(fresh) == 1):
            for failed in (batch, fresh, partial):
                if failed is not None:
                    failed.release(self.runner)
                    self._fail_step(failed, exc)
            if partial is not None:
                self._partial = None
            return None
        self._step_failed("retried", "with %d newcomers' prompts (%s); prefilling them one "
                          "by one", len(fresh), exc)
        fresh.release(self.runner)
        rest = self._step(batch, None, partial) if batch or partial else None
        self._publish(rest)
        for seq in fresh.sequences:
            kept = [b for b in (rest, self._step(None, self._new_batch([seq.request]), None))
                    if b is not None]
            rest = Batch.concatenate(kept, self.runner) if kept else None
            self._publish(rest)
        return rest

    def _record(self, step: Step, running: Batch | None, fresh: Batch | None,
                partial: Batch | None, prompt_tokens: int, chunk: int) -> None:
        """The step's stats: a decode step for the ``running`` rows, a prefill for the
        ``fresh`` ones and for the ``partial`` one's chunk (with no token until the prompt
        is in), each timed by the passes that carried its rows; and what the chunk budget
        learns from them."""
        result = step.result
        assert result is not None
        if running is not None:
            rows = step.rows_of(running)
            seconds = result.seconds_of(rows)
            if all(set(p.rows) <= set(rows) for p in result.passes
                   if set(p.rows) & set(rows)):  # no other rows rode with them
                self.chunks.observe_decode(seconds)
            self.stats.record_step(StepStats("decode", seconds, len(running),
                                             sum(len(step.rows[j].events) for j in rows)))
        if fresh is not None:
            self.stats.record_step(StepStats("prefill", result.seconds_of(step.rows_of(fresh)),
                                             len(fresh), prompt_tokens))
        if partial is not None:
            (row,) = step.rows_of(partial)
            carried = result.pass_of(row)
            if running is not None and set(carried.rows) & set(step.rows_of(running)):
                self.chunks.observe_mixed(chunk, carried.seconds)
            else:
                self.chunks.observe_chunk(chunk, carried.seconds)
            self.stats.record_step(StepStats("prefill", carried.seconds,
                                             len(step.rows[row].events), chunk))

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
        prompt_tokens = 0  # the admitted newcomers' prompts, prefilled at this step
        prefill_cap = self.limits.max_batch_prefill_tokens if rows else 0  # idle: no cap
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
                if not self._hold_adapter(head):
                    break
                self._waiting.popleft()
                self._start_partial(head)
                rows += 1
            else:
                prompt = len(head.request.prompt_ids)
                if prefill_cap and admitted and prompt_tokens + prompt > prefill_cap:
                    break  # it and the rest join at the next steps
                if not self._hold_adapter(head):
                    break
                admitted.append(self._waiting.popleft())
                prompt_tokens += prompt
            reserved += need
        return admitted

    def _hold_adapter(self, handle: RequestHandle) -> bool:
        """Whether the request (the queue's head) has its adapter in a slot now (placed
        there if need be); False: every slot is in use by running rows and it waits, or
        its adapter's files, read again after an eviction, fail (the request fails)."""
        ref = handle.request.adapter
        if ref is None or handle.holds_adapter:
            return True
        assert self.runner.adapters is not None
        try:
            handle.holds_adapter = self.runner.adapters.acquire(ref)
        except (AdapterError, UnknownAdapter) as exc:
            self._waiting.popleft()
            self._send([(handle, ErrorEvent(f"adapter {ref.name!r} could not be loaded: "
                                            f"{exc}"))])
            self._leave(handle, "error", None)
            return False
        return handle.holds_adapter

    def _start_partial(self, handle: RequestHandle) -> None:
        batch = self._new_batch([handle.request])
        try:
            batch.reserve(self.runner, top=True)  # a cached prefix is in: chunks follow it
            batch.sequences[0].prefill_start = time.perf_counter()
        except Exception as exc:
            batch.release(self.runner)
            self._fail_step(batch, exc)
            return
        self._partial = batch

    def _new_batch(self, requests: list[GenerationRequest]) -> Batch:
        return Batch.from_requests(requests, self.codec, self.runner.vocab_size)

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
        self._step_failed("failed", "for %d request(s): %s", len(batch), exc, exc_info=exc)
        self._fail(batch, [], f"generation failed: {exc}", "generation")

    def _step_failed(self, kind: StepFailure, message: str, *args: object,
                     exc_info: BaseException | None = None) -> None:
        """Report a step that raised: a line in the log (an error, or a warning where the
        step's newcomers are tried again alone) and ``attnserve_step_failures_total``.
        A retried step still answers everyone, so the count is how an operator sees it."""
        level = logging.WARNING if kind == "retried" else logging.ERROR
        log.log(level, f"{STEP_FAILED} {message}", *args, exc_info=exc_info,
                extra={"step_failure": kind})
        self.stats.record_step_failure(kind)

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
        if handle.holds_adapter:
            assert self.runner.adapters is not None and req.adapter is not None
            self.runner.adapters.release(req.adapter)  # its slot, for admission
            handle.holds_adapter = False
        self.runner.release(req)
        started = seq is not None and seq.prefill_start > 0
        self.stats.record_request(RequestStats(
            outcome=outcome,
            prompt_tokens=len(req.prompt_ids),
            generated_tokens=seq.generated if seq else 0,
            queue_time=(seq.prefill_start - req.arrival) if seq and started else None,
            time_to_first_token=(seq.first_token_time - req.arrival)
            if seq and seq.first_token_time is not None else None,
            inter_token_latencies=tuple(seq.inter_token_latencies) if seq else (),
            adapter=req.adapter.name if req.adapter is not None else None,
            control_vector=req.steering.name if req.steering is not None else None))

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

