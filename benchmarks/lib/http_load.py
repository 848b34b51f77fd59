"""The HTTP service end to end: a real `attnserve serve` process and concurrent clients.

Throughput counts the tokens the server says it generated (x-generated-tokens, or
details.generated_tokens): over HTTP there is no "ignore end-of-sequence" switch, so a
request may stop early and the report shows the mean generated per request. TTFT over
HTTP is the wall time of a max_new_tokens=1 request alone on the server: tokenize,
prefill, first token, response.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import percentile
from benchmarks.lib.serving import Server, load_env
from benchmarks.serve import client as load
from benchmarks.serve.workloads import SampleRequest


def _load(url: str, texts: list[str], concurrency: int, n_requests: int,
          n_new: int) -> dict[str, Any]:
    requests = [SampleRequest(texts[i % len(texts)], 0, n_new) for i in range(n_requests)]
    outputs, wall = load.send_all(url, load.generate_request, requests, concurrency,
                                  warm_up=SampleRequest(texts[0], 0, 4))
    load.check(outputs)
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "new_tokens": n_new,
        "tokens_per_s": sum(o.output_tokens for o in outputs) / wall,
        "mean_generated_tokens": statistics.mean(o.output_tokens for o in outputs),
        "latency_p50_ms": percentile([o.latency for o in outputs], 50) * 1e3,
        "latency_p99_ms": percentile([o.latency for o in outputs], 99) * 1e3,
        "prompt_tokens_seen": sorted({o.prompt_len for o in outputs if o.prompt_len}),
    }


def http_ttft_ms(url: str, texts: list[str]) -> float:
    """Median over texts[1:] (texts[0] warms up), one at a time; each prompt is new to the
    prefix cache."""
    outputs, _ = load.send_all(url, load.generate_request,
                               [SampleRequest(text, 0, 1) for text in texts[1:]], 1,
                               warm_up=SampleRequest(texts[0], 0, 1), timeout=60.0)
    return statistics.median(o.latency for o in load.check(outputs)) * 1e3


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
            _load(server.url, [next(fresh) for _ in range(c)], c, c, min(4, n_new))
            row = _load(server.url, [next(fresh) for _ in range(n)], c, n, n_new)
            out["rows"].append(row)
            log(f"http c={c}: {row['tokens_per_s']:.1f} tok/s")
        out["peak_rss_mb"] = server.peak_rss_mb()
        return out
