"""Memory soak: many clients holding short chats with one server for a while; the server's
resident memory before and after, and every answer checked.

Usage (from the repository root, in the dev venv):
    # start `attnserve serve --model ARTIFACT` on --port for the run (stopped at the end)
    python -m benchmarks.soak --model artifacts/smollm2-135m-instruct --port 8150 \\
        --clients 16 --duration 150 --out results/soak.json -- --max-total-tokens 8192
    # or watch a server already running (its pid gives the RSS)
    python -m benchmarks.soak --url http://127.0.0.1:8000 --pid 1234 --duration 150

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
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.bound_port import serving
from benchmarks.measure import proc_memory_bytes
from model.data import write_text_atomic

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


def status(pid: int, field: str = "VmRSS") -> int:
    """Bytes of ``field`` of process ``pid`` (benchmarks/measure.py: proc_memory_bytes)."""
    memory = proc_memory_bytes(pid)
    if field not in memory:
        raise RuntimeError(f"no {field} for pid {pid}")
    return memory[field]


def vm_rss(pid: int) -> int:
    return status(pid)


def breakdown(pid: int) -> dict[str, float]:
    return {f"{k}_mb": round(status(pid, k) / 2**20, 1) for k in ("RssAnon", "RssFile")}


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def chat_client(client: httpx.AsyncClient, model: str, seed: int, deadline: float,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": rng.choice(QUESTIONS)}]
        for _ in range(rng.randint(1, 3)):
            if time.monotonic() >= deadline:
                return
            body = {"model": model, "messages": messages, "max_tokens": rng.randint(16, 96)}
            try:
                r = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                tally.failures.append(f"{type(e).__name__}: {e}")
                break
            if r.status_code != 200:
                tally.failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                break
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] or ""
            if not text.strip() or choice["finish_reason"] not in ("stop", "length"):
                tally.failures.append(f"bad answer {choice!r:.200}")
                break
            tally.answers += 1
            tally.completion_tokens += int(r.json()["usage"]["completion_tokens"])
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


async def sample(client: httpx.AsyncClient, pid: int, stop: asyncio.Event,
                 peaks: dict[str, float]) -> None:
    while not stop.is_set():
        peaks["rss"] = max(peaks["rss"], vm_rss(pid))
        try:
            text = (await client.get("/metrics")).text
            for key, name in (("tokens", "attnserve_kv_cache_tokens"),
                              ("resident", "attnserve_kv_cache_resident_bytes")):
                value = metric(text, name)
                if value is not None:
                    peaks[key] = max(peaks.get(key, 0.0), value)
        except httpx.HTTPError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def soak(url: str, pid: int, clients: int, duration: float) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        metrics = (await client.get("/metrics")).text
        before = vm_rss(pid)
        parts_before = breakdown(pid)
        tally = Tally()
        peaks: dict[str, float] = {"rss": float(before)}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(client, pid, stop, peaks))
        started = time.monotonic()
        deadline = started + duration
        await asyncio.gather(*(chat_client(client, model, seed, deadline, tally)
                               for seed in range(clients)))
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        await asyncio.sleep(1.0)  # the engine's last step and frees
        after = vm_rss(pid)
        parts_after = breakdown(pid)
        final = (await client.get("/metrics")).text
    return {"model": model, "clients": clients, "duration_s": round(elapsed, 1),
            "rss_before_mb": round(before / 2**20, 1), "rss_after_mb": round(after / 2**20, 1),
            "rss_peak_mb": round(peaks["rss"] / 2**20, 1),
            "before": parts_before, "after": parts_after,
            "kv_tokens_peak": peaks.get("tokens"),
            "kv_resident_peak_mb": round(peaks["resident"] / 2**20, 1)
            if "resident" in peaks else None,
            "kv_bytes_mb": round((metric(metrics, "attnserve_kv_cache_bytes") or 0) / 2**20, 1),
            "kv_resident_after_mb": round(v / 2**20, 1) if (
                v := metric(final, "attnserve_kv_cache_resident_bytes")) is not None else None,
            "tally": asdict(tally) | {"failures": tally.failures[:10],
                                      "failed": len(tally.failures)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak",
                                     description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="artifact to serve for the run")
    where.add_argument("--url", help="a running server (with --pid)")
    parser.add_argument("--pid", type=int, help="the running server's process id")
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="after --: more `attnserve serve` options")
    args = parser.parse_args(argv)
    if args.url is not None and args.pid is None:
        parser.error("--url needs --pid (the server's RSS is read from /proc)")
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients and --duration must be positive")
    url, pid = args.url, args.pid
    with contextlib.ExitStack() as stack:
        if args.model is not None:
            server = stack.enter_context(serving(args.model, args.port, args.server_args, "soak"))
            url, pid = f"http://127.0.0.1:{args.port}", server.pid
        result = asyncio.run(soak(url, pid, args.clients, args.duration))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        write_text_atomic(args.out, text + "\n")
    return 0 if not result["tally"]["failed"] else 1  # type: ignore[index]


if __name__ == "__main__":
    sys.exit(main())
