"""The HTTP service end to end: a real `attnserve serve` process and concurrent clients.

Throughput counts the tokens the server says it generated (x-generated-tokens, or
details.generated_tokens): over HTTP there is no "ignore end-of-sequence" switch, so a
request may stop early and the report shows the mean generated per request. TTFT over
HTTP is the wall time of a max_new_tokens=1 request alone on the server: tokenize,
prefill, first token, response.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import percentile
from benchmarks.lib.serving import Server, load_env


def _body(text: str, n_new: int) -> dict[str, Any]:
    return {"inputs": text, "parameters": {"max_new_tokens": n_new, "do_sample": False,
                                           "details": True}}


def _generated(response: Any) -> int:
    header = response.headers.get("x-generated-tokens")
    if header is not None:
        return int(header)
    return int(response.json()["details"]["generated_tokens"])


async def _load(url: str, texts: list[str], concurrency: int, n_requests: int,
                n_new: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    generated: list[int] = []
    prompt_tokens: set[int] = set()
    gate = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        async def one(i: int) -> None:
            async with gate:
                t0 = time.perf_counter()
                r = await client.post("/generate", json=_body(texts[i % len(texts)], n_new))
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                generated.append(_generated(r))
                if "x-prompt-tokens" in r.headers:
                    prompt_tokens.add(int(r.headers["x-prompt-tokens"]))

        await client.post("/generate", json=_body(texts[0], 4))  # connection warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n_requests)))
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "new_tokens": n_new,
        "tokens_per_s": sum(generated) / wall,
        "mean_generated_tokens": statistics.mean(generated),
        "latency_p50_ms": percentile(latencies, 50) * 1e3,
        "latency_p99_ms": percentile(latencies, 99) * 1e3,
        "prompt_tokens_seen": sorted(prompt_tokens),
    }


def http_ttft_ms(url: str, texts: list[str]) -> float:
    """Median over texts[1:] (texts[0] warms up); each prompt is new to the prefix cache."""
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=60.0) as client:
        client.post("/generate", json=_body(texts[0], 1))
        for text in texts[1:]:
            t0 = time.perf_counter()
            client.post("/generate", json=_body(text, 1)).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def http_requests(concurrency: int, waves: int) -> int:
    """Requests measured at a concurrency: ``waves`` full waves (at least 3 at c = 1)."""
    return concurrency * waves if concurrency > 1 else max(waves, 3)


def http_prompt_count(concurrencies: list[int], waves: int, ttft_reps: int) -> int:
    """Distinct prompts run_http needs: the TTFT ones, then a warm-up wave and the measured
    requests of every concurrency."""
    return 1 + ttft_reps + sum(c + http_requests(c, waves) for c in concurrencies)


def run_http(artifact: Path, texts: list[str], threads: int, n_new: int,
             concurrencies: list[int], waves: int, ttft_reps: int, work: Path,
             log: Any) -> dict[str, Any]:
    with Server(artifact, load_env(threads, dict(os.environ)), work / "server.log") as server:
        out: dict[str, Any] = {"rows": []}
        out["ttft_ms"] = http_ttft_ms(server.url, texts[:1 + ttft_reps])
        log(f"http TTFT {out['ttft_ms']:.1f} ms")
        fresh = iter(texts[1 + ttft_reps:])
        for c in concurrencies:
            n = http_requests(c, waves)
            # One unmeasured wave at this concurrency, as every engine row is warmed at its
            # batch size: the first batch of a size touches fresh pool pages and buffers.
            # Every request has a prompt of its own, so prefix caching (on, as served) finds
            # nothing to reuse and the row measures batching, as the engine rows do.
            asyncio.run(_load(server.url, [next(fresh) for _ in range(c)], c, c,
                              min(4, n_new)))
            row = asyncio.run(_load(server.url, [next(fresh) for _ in range(n)], c, n, n_new))
            out["rows"].append(row)
            log(f"http c={c}: {row['tokens_per_s']:.1f} tok/s")
        out["peak_rss_mb"] = server.peak_rss_mb()
        return out
