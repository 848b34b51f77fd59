"""The load generator: arrivals on a schedule, streamed requests, per-token timestamps.

Arrival times follow vLLM's ``bench serve``: gaps drawn from a gamma distribution of shape
``burstiness`` and mean 1/rate (burstiness 1 is a Poisson process), rescaled so that n
requests span n/rate seconds; rate ``inf`` sends them all at once. ``max_concurrency``
caps the requests in flight; an arrival beyond the cap waits for a slot, and its latency
is counted from when it is sent. Its requests stream, so time to first token and each
inter-token gap are measured where a client sees them: when the SSE line arrives.

The client is aiohttp, as vLLM's is: it shares the machine with the server it measures,
and per streamed line it spends a fraction of httpx's CPU time (docs/benchmarks.md), time
the server's ONNX Runtime threads would otherwise lose. Each run records the client's own
CPU seconds.

Every benchmark sends its requests through these functions (one ``RequestOutput`` each,
driven by ``run_load`` or ``send_all``), keeping only what it asks and checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np

from benchmarks.serve.workloads import SampleRequest

BACKENDS = ("tgi", "openai")


@dataclass
class RequestOutput:
    """One request as the client saw it (vLLM's RequestFuncOutput, and from ``status`` on
    what the other benchmarks check)."""

    success: bool = False
    prompt_len: int = 0  # the server's count when it reports one
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first token
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    latency: float = 0.0  # send to last token
    start_time: float = 0.0  # send time, seconds after the run began
    generated_text: str = ""
    error: str = ""
    status: int = 0  # the HTTP status; 0 where none came
    headers: Mapping[str, str] = field(default_factory=dict)
    finish_reason: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat logprobs.content
    body: Any = None  # a non-streamed answer: its JSON, else its text


def arrival_offsets(n: int, rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Send times in seconds after the start for ``n`` requests at ``rate`` per second."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return [float(t) for t in times * (n / rate) / times[-1]]


class _Timer:
    """Token arrival times of one stream."""

    def __init__(self, out: RequestOutput) -> None:
        self.out = out
        self.sent = time.perf_counter()
        self.last = self.sent

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.out.ttft == 0.0:
            self.out.ttft = now - self.sent
        else:
            self.out.itl.append(now - self.last)
        self.last = now

    def finish(self) -> None:
        self.out.latency = self.last - self.sent


# What a failed request or connection raises (a timeout is asyncio's TimeoutError), and
# with a malformed answer, what a request function may.
CLIENT_ERRORS = (aiohttp.ClientError, TimeoutError)
REQUEST_ERRORS = (*CLIENT_ERRORS, json.JSONDecodeError, KeyError, ValueError)


def session(url: str, timeout: float = 600.0, limit: int = 0,
            force_close: bool = False) -> aiohttp.ClientSession:
    """A client of ``url``: ``timeout`` seconds a request, ``limit`` connections (0: as many
    as are in flight, where aiohttp's default caps them at 100)."""
    return aiohttp.ClientSession(
        base_url=url, timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=limit, force_close=force_close))


async def _sse(response: aiohttp.ClientResponse) -> Any:
    """The stream's JSON events (``[DONE]`` is none)."""
    async for raw in response.content:  # one line at a time
        line = raw.decode("utf-8")
        if line.startswith("data:") and (data := line[len("data:"):].strip()) != "[DONE]":
            yield json.loads(data)


async def _answered(response: aiohttp.ClientResponse, out: RequestOutput) -> bool:
    """Whether the server answered 200; the status and headers kept, else the error body."""
    out.status, out.headers = response.status, response.headers
    if response.status != 200:
        body = (await response.read()).decode("utf-8", "replace")
        out.error = f"HTTP {response.status}: {body[:300]}"
    return response.status == 200


async def post(client: aiohttp.ClientSession, path: str, body: dict[str, Any],
               out: RequestOutput | None = None) -> RequestOutput:
    """POST ``path``, not streamed: the answer (JSON, else text) in ``out.body``, its status,
    headers and latency; success is a 200."""
    out = RequestOutput() if out is None else out
    timer = _Timer(out)
    async with client.post(path, json=body) as r:
        if not await _answered(r, out):
            return out
        out.body = await (r.json() if r.content_type == "application/json" else r.text())
    timer.chunk()
    timer.finish()
    out.success = True
    return out


def _tgi_body(req: SampleRequest) -> dict[str, Any]:
    """Greedy, with the details; a LoRA adapter as TGI's ``parameters.adapter_id``."""
    parameters: dict[str, Any] = {
        "max_new_tokens": req.expected_output_len, "do_sample": False, "details": True}
    if req.adapter is not None:
        parameters["adapter_id"] = req.adapter
    return {"inputs": req.prompt, "parameters": parameters}


async def generate_request(client: aiohttp.ClientSession, req: SampleRequest,
                           out: RequestOutput) -> RequestOutput:
    """POST /generate, not streamed: the tokens the server says it generated (it may stop
    early) and its prompt's, where it says."""
    if (await post(client, "/generate", _tgi_body(req), out)).success:
        out.output_tokens = int(out.headers.get("x-generated-tokens")
                                or out.body["details"]["generated_tokens"])
        out.prompt_len = int(out.headers.get("x-prompt-tokens", out.prompt_len))
    return out


async def tgi_request(client: aiohttp.ClientSession, req: SampleRequest,
                      out: RequestOutput) -> RequestOutput:
    """POST /generate_stream: one SSE event per token; the last carries the details."""
    timer = _Timer(out)
    async with client.post("/generate_stream", json=_tgi_body(req)) as r:
        if not await _answered(r, out):
            return out
        async for event in _sse(r):
            if "error" in event:
                out.error = f"{event.get('error_type')}: {event['error']}"
                return out
            timer.chunk()
            out.output_tokens += 1
            if event.get("details"):
                out.prompt_len = int(event["details"].get("input_length", out.prompt_len))
                out.generated_text = event.get("generated_text") or ""
    timer.finish()
    out.success = out.output_tokens > 0
    return out


async def _openai_stream(client: aiohttp.ClientSession, path: str, body: dict[str, Any],
                         out: RequestOutput) -> bool:
    """An OpenAI stream read into ``out``: each text (a completion's, a chat's delta) timed,
    logprobs entries, finish reason, usage; False where it failed."""
    timer = _Timer(out)
    texts: list[str] = []
    async with client.post(path, json=body) as r:
        if not await _answered(r, out):
            return False
        async for event in _sse(r):
            if "error" in event:
                out.error = str(event["error"])
                return False
            for choice in event.get("choices") or []:
                if text := choice.get("text") or (choice.get("delta") or {}).get("content"):
                    timer.chunk()
                    texts.append(text)
                out.logprobs += (choice.get("logprobs") or {}).get("content") or []
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if event.get("usage"):
                out.prompt_len = int(event["usage"]["prompt_tokens"])
                out.output_tokens = int(event["usage"]["completion_tokens"])
    timer.finish()
    out.generated_text = "".join(texts)
    return True


async def openai_request(client: aiohttp.ClientSession, req: SampleRequest, out: RequestOutput,
                         model: str, ignore_eos: bool = False) -> RequestOutput:
    """POST /v1/completions with stream and usage: chunks timed, usage counts the tokens.
    ``ignore_eos`` is vLLM's extension (exactly max_tokens tokens), as `vllm bench serve
    --ignore-eos` sends it. A request naming a LoRA adapter sends it as ``model``."""
    body: dict[str, Any] = {
        "model": req.adapter or model, "prompt": req.prompt, "max_tokens": req.expected_output_len,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    out.success = (await _openai_stream(client, "/v1/completions", body, out)
                   and out.output_tokens > 0 and out.ttft > 0)
    return out


async def chat_request(client: aiohttp.ClientSession, body: dict[str, Any],
                       out: RequestOutput) -> RequestOutput:
    """POST /v1/chat/completions with the benchmark's own ``body``, streamed where it asks:
    the answer's text, finish reason, logprobs entries, tokens (usage, where sent)."""
    if body.get("stream"):
        out.success = await _openai_stream(client, "/v1/chat/completions", body, out)
        if not out.success and out.status == 200:
            out.error = f"error event in the stream: {out.error}"
        return out
    if (await post(client, "/v1/chat/completions", body, out)).success:
        choice = out.body["choices"][0]
        out.generated_text = choice["message"].get("content") or ""
        out.finish_reason = choice.get("finish_reason") or ""
        out.logprobs = (choice.get("logprobs") or {}).get("content") or []
        out.output_tokens = int(out.body["usage"]["completion_tokens"])
    return out


T = TypeVar("T")
Send = Callable[[aiohttp.ClientSession, T, RequestOutput], Awaitable[RequestOutput]]
RequestFunc = Send[SampleRequest]


def request_func(backend: str, model: str | None, ignore_eos: bool = False) -> RequestFunc:
    """``ignore_eos`` reaches the openai backend only (TGI's API has no such field; the
    command line refuses the pair)."""
    if backend == "tgi":
        return tgi_request
    if backend == "openai":
        if not model:
            raise ValueError("the openai backend needs the served model name")
        return functools.partial(openai_request, model=model, ignore_eos=ignore_eos)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


async def lora_adapter(client: aiohttp.ClientSession, name: str, path: str | None = None
                       ) -> RequestOutput:
    """vLLM's POST /v1/load_lora_adapter (``path`` given), else /v1/unload_lora_adapter."""
    if path is None:
        return await post(client, "/v1/unload_lora_adapter", {"lora_name": name})
    return await post(client, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


async def send_one(client: aiohttp.ClientSession, send: Send[T], what: T,
                   out: RequestOutput | None = None) -> RequestOutput:
    """One request by ``send``; whatever failed it is counted in ``out.error``, never raised
    (a load keeps going)."""
    out = RequestOutput() if out is None else out
    try:
        return await send(client, what, out)
    except REQUEST_ERRORS as exc:  # the answer may have been read before its body failed
        out.success, out.error = False, f"{type(exc).__name__}: {exc}"
        return out


async def run_load(client: aiohttp.ClientSession, send: RequestFunc,
                   requests: list[SampleRequest], offsets: list[float],
                   max_concurrency: int | None, start: float | None = None
                   ) -> tuple[list[RequestOutput], float]:
    """Send every request at its offset after ``start`` (a perf_counter reading, default
    now); (outputs in request order, wall seconds)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter() if start is None else start

    async def one(req: SampleRequest) -> RequestOutput:
        if slots is not None:
            await slots.acquire()
        out = RequestOutput(prompt_len=req.prompt_len,
                            start_time=time.perf_counter() - start)
        try:
            return await send_one(client, send, req, out)
        finally:
            if slots is not None:
                slots.release()

    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)  # the arrival schedule itself, not synchronisation
        tasks.append(asyncio.create_task(one(req)))
    outputs = list(await asyncio.gather(*tasks))
    return outputs, time.perf_counter() - start


def send_all(url: str, send: RequestFunc, requests: Sequence[SampleRequest], clients: int,
             warm_up: SampleRequest | None = None, timeout: float = 600.0
             ) -> tuple[list[RequestOutput], float]:
    """From sync code: every request at once, ``clients`` in flight, on a session of their
    own (``warm_up`` first, unmeasured); (outputs in request order, wall seconds)."""
    async def run() -> tuple[list[RequestOutput], float]:
        async with session(url, timeout) as client:
            if warm_up is not None:
                await send_one(client, send, warm_up)
            return await run_load(client, send, list(requests), [0.0] * len(requests), clients)

    return asyncio.run(run())


def check(outputs: Sequence[RequestOutput]) -> Sequence[RequestOutput]:
    """``outputs`` when every request succeeded, else a RuntimeError naming the first
    failures: a failed request must never count as a fast one."""
    if errors := [o.error for o in outputs if not o.success]:
        raise RuntimeError(f"{len(errors)} of {len(outputs)} requests failed: {errors[:3]}")
    return outputs


@dataclass
class FloodStats:
    sent: int = 0
    ok: int = 0
    rejected: int = 0  # 429
    other: dict[str, int] = field(default_factory=dict)
    ok_latencies: list[float] = field(default_factory=list)


async def attention_flood(client: aiohttp.ClientSession, body: dict[str, Any], concurrency: int,
                          interval: float, stop: asyncio.Event, stats: FloodStats) -> None:
    """A wave of ``concurrency`` simultaneous /attention requests every ``interval``
    seconds (or when the last wave is answered, if later) until ``stop`` is set."""

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            # Streamed and dropped: a full-size answer is tens of MB, and holding it would
            # cost this process time it owes to timing the token streams.
            async with client.post("/attention", json=body) as r:
                async for _ in r.content.iter_chunked(1 << 16):
                    pass
                code = str(r.status)
        except CLIENT_ERRORS as exc:
            code = type(exc).__name__
        stats.sent += 1
        if code == "200":
            stats.ok += 1
            stats.ok_latencies.append(time.perf_counter() - t0)
        elif code == "429":
            stats.rejected += 1
        else:
            stats.other[code] = stats.other.get(code, 0) + 1

    while not stop.is_set():
        wave = asyncio.gather(*(one() for _ in range(concurrency)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        await wave


@dataclass
class JoinStats:
    """Long-prompt joins: (sent, answered) seconds after the run began, and failures."""

    windows: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


async def long_prompt_joins(client: aiohttp.ClientSession, prompts: list[str], interval: float,
                            start: float, stop: asyncio.Event, stats: JoinStats) -> None:
    """One maximum-length prompt (one new token) every ``interval`` seconds, one at a time,
    until ``stop`` or the prompts run out: the running streams' gaps while it is prefilled
    show what a join costs them. Each prompt is new, so no prefix cache shortens its
    prefill. The first is sent after one interval, so the load has started."""
    for prompt in prompts:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        if stop.is_set():
            return
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 1, "do_sample": False}}
        sent = time.perf_counter() - start
        try:
            out = await post(client, "/generate", body)
        except CLIENT_ERRORS as exc:
            out = RequestOutput(error=f"{type(exc).__name__}: {exc}")
        if out.success:
            stats.windows.append((sent, time.perf_counter() - start))
        else:
            stats.failed.append(out.error)
