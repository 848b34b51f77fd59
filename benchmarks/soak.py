"""Memory soak: many clients holding short chats with one server for a while; the server's
resident memory before and after, and every answer checked.

Usage (from the repository root, in the dev venv):
    # start `attnserve serve --model ARTIFACT` on --port for the run (stopped at the end)
    python -m benchmarks soak --model artifacts/smollm2-135m-instruct --port 8150 \\
        --clients 16 --duration 150 --out results/soak.json -- --max-total-tokens 8192
    # or watch a server already running (its pid gives the RSS)
    python -m benchmarks soak --url http://127.0.0.1:8000 --pid 1234 --duration 150

Each client loops: a chat of one to three turns (a system prompt, a short question, the
model's answer appended and a follow-up asked), each turn a /v1/chat/completions call of
16-96 new tokens. An answer passes when its text is non-empty and it finished (``stop`` or
``length``). The server's VmRSS (/proc/PID/status) is read once it is ready (before), every
second during the run (peak), and after the last answer (after); the KV tokens held are
sampled from /metrics alongside (``attnserve_kv_cache_tokens``), so the result can be set
against weights + 2 x (tokens held x bytes per token) + 300 MB. Prints one JSON object and
writes it to --out when given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.lib import serving
from benchmarks.serve import client as load

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.",
    "How many legs does a spider have?", "What does CPU stand for?",
    "Give me a synonym for happy.", "What is 12 times 7?",
    "Why is the sky blue?", "Write a haiku about rain.",
    "What is photosynthesis?", "Suggest a name for a cat.",
    "How do I boil an egg?", "What is the largest planet?",
    "Translate 'thank you' into Spanish.", "What is a prime number?",
    "List two uses of a paperclip.", "Who wrote Romeo and Juliet?",
]
FOLLOW_UPS = ["Can you say more?", "Why?", "Give an example.", "Summarise that in one line."]


@dataclass
class Tally:
    answers: int = 0
    failures: list[str] = field(default_factory=list)
    completion_tokens: int = 0


async def chat_client(client: aiohttp.ClientSession, model: str, seed: int, deadline: float,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": rng.choice(QUESTIONS)}]
        for _ in range(rng.randint(1, 3)):
            if time.monotonic() >= deadline:
                return
            body = {"model": model, "messages": messages, "max_tokens": rng.randint(16, 96)}
            out = await load.send_one(client, load.chat_request, body)
            if not out.success:
                tally.failures.append(out.error)
                break
            if not out.generated_text.strip() or out.finish_reason not in ("stop", "length"):
                tally.failures.append(f"bad answer {out.body['choices'][0]!r:.200}")
                break
            tally.answers += 1
            tally.completion_tokens += out.output_tokens
            messages += [{"role": "assistant", "content": out.generated_text},
                         {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


async def sample(url: str, pid: int, peaks: dict[str, float]) -> None:
    """One second's sample: the server's RSS, and the KV tokens and bytes it holds."""
    peaks["rss"] = max(peaks["rss"], serving.memory(pid)["VmRSS"])
    try:
        text, _ = await asyncio.to_thread(serving.http_get, f"{url}/metrics")  # off the loop
        for key, name in (("tokens", "attnserve_kv_cache_tokens"),
                          ("resident", "attnserve_kv_cache_resident_bytes")):
            value = serving.metric(text, name)
            if value is not None:
                peaks[key] = max(peaks.get(key, 0.0), value)
    except OSError:
        pass


async def soak(url: str, pid: int, clients: int, duration: float) -> dict[str, object]:
    model = serving.served_model(url)
    async with load.session(url) as client:
        metrics = serving.http_get(f"{url}/metrics")[0]
        before = serving.memory(pid)["VmRSS"]
        parts_before = serving.breakdown(pid)
        tally = Tally()
        peaks: dict[str, float] = {"rss": float(before)}
        elapsed = await serving.for_duration(
            duration, lambda: sample(url, pid, peaks),
            lambda end: [chat_client(client, model, seed, end, tally) for seed in range(clients)])
        after = serving.memory(pid)["VmRSS"]
        parts_after = serving.breakdown(pid)
        final = serving.http_get(f"{url}/metrics")[0]
    return {"model": model, "clients": clients, "duration_s": round(elapsed, 1),
            "rss_before_mb": serving.mib(before), "rss_after_mb": serving.mib(after),
            "rss_peak_mb": serving.mib(peaks["rss"]),
            "before": parts_before, "after": parts_after,
            "kv_tokens_peak": peaks.get("tokens"),
            "kv_resident_peak_mb": serving.mib(peaks["resident"]) if "resident" in peaks else None,
            "kv_bytes_mb": serving.mib(serving.metric(metrics, "attnserve_kv_cache_bytes") or 0),
            "kv_resident_after_mb": None if (v := serving.metric(
                final, "attnserve_kv_cache_resident_bytes")) is None else serving.mib(v),
            "tally": asdict(tally) | {"failures": tally.failures[:10],
                                      "failed": len(tally.failures)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak",
                                     description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="artifact to serve for the run")
    where.add_argument("--url", help="a running server (with --pid)")
    parser.add_argument("--pid", type=int, help="the running server's process id")
    serving.add_server_options(parser, port=8150)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=150.0)
    args = parser.parse_args(argv)
    if args.url is not None and args.pid is None:
        parser.error("--url needs --pid (the server's RSS is read from /proc)")
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients and --duration must be positive")
    url, pid = args.url, args.pid
    with contextlib.ExitStack() as stack:
        if args.model is not None:
            server = stack.enter_context(
                serving.started(args.model, args.port, args.server_args, "soak"))
            url, pid = server.url, server.pid
        result = asyncio.run(soak(url, pid, args.clients, args.duration))
    serving.emit(result, args.out)
    return 0 if not result["tally"]["failed"] else 1  # type: ignore[index]


if __name__ == "__main__":
    sys.exit(main())
