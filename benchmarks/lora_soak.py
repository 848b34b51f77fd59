"""Soak with LoRA adapters: many streaming clients over mixed adapters and the base while
one adapter is loaded and unloaded at run time, every answer checked against a reference.

Usage (from the repository root, in the dev venv):
    python -m benchmarks lora-adapters --model artifacts/smollm2-135m-instruct-lora \\
        --out adapters/bench --count 5 --rank 16
    python -m benchmarks lora-soak --model artifacts/smollm2-135m-instruct-lora \\
        --adapters-dir adapters/bench --serve lora0,lora1,lora2,lora3 --churn lora4 \\
        --clients 16 --duration 300 --churn-interval 3 --out results/lora-soak.json \\
        -- --max-total-tokens 4096

It starts `attnserve serve` with ``--lora-modules`` for the --serve adapters (directories
under --adapters-dir), ``--runtime-lora --lora-dir ADAPTERS_DIR``, ``--max-loras`` one more
than --serve (the churned one fits) and ``--max-lora-rank`` the adapters' largest r.

1. References: for every prompt (--prompts of them) under the base, every --serve adapter
   and the --churn adapter (loaded for it), one greedy chat request at a time (temperature
   0, --max-tokens new tokens, logprobs with the top 2): the answer's tokens and, at each
   position, the margin between the two most likely tokens (nats). This is the warm-up. The
   result counts the adapter references unlike the base's (``references_unlike_base``):
   where a row served under the wrong adapter, or none, would show.
2. Soak: --clients clients stream requests for --duration seconds, each a random (prompt,
   adapter) pair, churned adapter included, while a churn task unloads and loads the churned
   adapter every --churn-interval seconds (POST /v1/unload_lora_adapter, then
   /v1/load_lora_adapter: a new adapter id each time, from the same files).
3. Every answer is compared token by token with its reference: equal, or a near tie (they
   part first where the reference's top-2 margin is below --tie-margin: batching changes the
   order of float sums, which can flip a near tie; counted, with the margins) — anything else
   is a wrong answer. A 404 for the churned adapter is expected when it was unloaded (or
   changing) while the request was sent or answered, and counted apart; any other 404, any
   5xx, any other failure counts as one.

RSS (VmRSS, RssAnon, RssFile of the server) once ready, after the references (the warm-up:
"before"), its peak during the soak (sampled every second) and after. Prints one JSON object;
--out writes it atomically. Exits 1 when any answer was wrong or any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.lib import serving
from benchmarks.lib.measure import shared_prefix
from benchmarks.serve import client as load
from benchmarks.soak import QUESTIONS, SYSTEM

DEFAULT_TIE_MARGIN = 0.05  # nats; float32 reorderings move logits by ~1e-4 (docs/engine.md)


@dataclass(frozen=True)
class Reference:
    """One greedy answer taken alone: token texts and the top-2 margin at each position."""

    tokens: list[str]
    margins: list[float | None]
    finish_reason: str


def top2_margin(entry: dict[str, Any]) -> float | None:
    """log p(top 1) − log p(top 2) of one chat logprobs ``content`` entry."""
    top = sorted((t["logprob"] for t in entry.get("top_logprobs") or []), reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def compare(reference: Reference, tokens: list[str], tie_margin: float
            ) -> tuple[str, int | None, float | None]:
    """("same" | "near_tie" | "wrong", the first position they part at, the reference's
    margin there): a near tie parts where that margin is below ``tie_margin``."""
    if tokens == reference.tokens:
        return "same", None, None
    first = shared_prefix(reference.tokens, tokens)
    margin = reference.margins[first] if first < len(reference.margins) else None
    if margin is not None and margin < tie_margin:
        return "near_tie", first, margin
    return "wrong", first, margin


@dataclass
class Tally:
    answers: int = 0
    same: int = 0
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    wrong: list[dict[str, Any]] = field(default_factory=list)
    expected_404: int = 0
    failures: list[str] = field(default_factory=list)  # unexpected 404s, transport errors ...
    http_5xx: int = 0
    completion_tokens: int = 0
    per_adapter: dict[str, int] = field(default_factory=dict)


@dataclass
class Churn:
    """The churned adapter's state as the churn task last left it; ``epoch`` counts changes
    (a request sent and answered within one epoch of "loaded" must not see a 404)."""

    name: str
    path: str
    loaded: bool = True
    epoch: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {
        "loads": 0, "unloads": 0, "load_refused": 0, "unload_busy": 0, "errors": 0})


def chat_body(question: str, adapter: str | None, base: str, max_tokens: int,
              stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": adapter or base, "max_tokens": max_tokens, "temperature": 0.0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "logprobs": True, "top_logprobs": 2}
    if stream:
        body["stream"] = True
    return body


async def reference(client: aiohttp.ClientSession, question: str, adapter: str | None,
                    base: str, max_tokens: int) -> Reference:
    out = await load.chat_request(client, chat_body(question, adapter, base, max_tokens, False),
                                  load.RequestOutput())
    if not out.success:
        raise RuntimeError(f"reference for {adapter or base!r} failed: {out.error}")
    return Reference([e["token"] for e in out.logprobs], [top2_margin(e) for e in out.logprobs],
                     out.finish_reason)


async def soak_client(client: aiohttp.ClientSession, base: str,
                      refs: dict[tuple[int, str | None], Reference], questions: list[str],
                      churn: Churn, max_tokens: int, tie_margin: float, seed: int,
                      deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    keys = sorted(refs, key=lambda k: (k[0], k[1] or ""))
    while time.monotonic() < deadline:
        q, adapter = rng.choice(keys)
        sent = (churn.loaded, churn.epoch)
        out = await load.send_one(client, load.chat_request,
                                  chat_body(questions[q], adapter, base, max_tokens, True))
        label = adapter or "(base)"
        if out.status == 404 and adapter == churn.name and not (
                sent[0] and sent == (churn.loaded, churn.epoch)):
            tally.expected_404 += 1
            continue
        if not out.success:
            tally.http_5xx += out.status >= 500
            tally.failures.append(f"{label}: {out.error}")
            continue
        tokens = [e["token"] for e in out.logprobs]
        tally.answers += 1
        tally.completion_tokens += len(tokens)
        tally.per_adapter[label] = tally.per_adapter.get(label, 0) + 1
        verdict, first, margin = compare(refs[q, adapter], tokens, tie_margin)
        if verdict == "same":
            tally.same += 1
            continue
        ref = refs[q, adapter]
        record = {"adapter": label, "prompt": q, "first_difference": first,
                  "reference_margin": margin, "reference": "".join(ref.tokens)[:120],
                  "got": "".join(tokens)[:120], "finish_reason": out.finish_reason}
        (tally.near_ties if verdict == "near_tie" else tally.wrong).append(record)


async def churn_task(client: aiohttp.ClientSession, churn: Churn, interval: float,
                     deadline: float) -> None:
    """Unload, then load again, the churned adapter every ``interval`` seconds."""
    while time.monotonic() + interval < deadline:
        await asyncio.sleep(interval)
        if churn.loaded:
            churn.loaded, churn.epoch = False, churn.epoch + 1  # before: requests may 404
            status = (await load.lora_adapter(client, churn.name)).status
            key = {200: "unloads", 409: "unload_busy"}.get(status, "errors")
        else:
            status = (await load.lora_adapter(client, churn.name, churn.path)).status
            key = {200: "loads", 400: "load_refused"}.get(status, "errors")
            if status == 200:
                churn.loaded, churn.epoch = True, churn.epoch + 1
        churn.counts[key] += 1


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    questions = QUESTIONS[:args.prompts]
    churn = Churn(args.churn, str((args.adapters_dir / args.churn).resolve()))
    async with load.session(url) as client:
        rss_ready, parts_ready = serving.memory(pid)["VmRSS"], serving.breakdown(pid)
        base = serving.served_model(url)
        if not (loaded := await load.lora_adapter(client, churn.name, churn.path)).success:
            raise RuntimeError(f"loading {churn.name} failed: {loaded.error}")
        t0 = time.monotonic()
        refs = {(q, adapter): await reference(client, text, adapter, base, args.max_tokens)
                for adapter in (None, *args.serve, churn.name)
                for q, text in enumerate(questions)}
        reference_s = time.monotonic() - t0
        rss_before, parts_before = serving.memory(pid)["VmRSS"], serving.breakdown(pid)
        tally = Tally()
        peak = {"rss": rss_before}

        async def sample() -> None:
            peak["rss"] = max(peak["rss"], serving.memory(pid)["VmRSS"])

        elapsed = await serving.for_duration(args.duration, sample, lambda end: [
            churn_task(client, churn, args.churn_interval, end),
            *(soak_client(client, base, refs, questions, churn, args.max_tokens,
                          args.tie_margin, seed, end, tally) for seed in range(args.clients))])
        rss_after, parts_after = serving.memory(pid)["VmRSS"], serving.breakdown(pid)
    margins = sorted(m for ref in refs.values() for m in ref.margins if m is not None)
    return {
        "model": base, "adapters": list(args.serve), "churned": churn.name,
        "clients": args.clients, "duration_s": round(elapsed, 1),
        "prompts": len(questions), "max_tokens": args.max_tokens,
        "references": len(refs), "reference_s": round(reference_s, 1),
        # adapter answers unlike the base's: what a row served under the wrong adapter
        # (or none) would be caught by
        "references_unlike_base": sum(ref.tokens != refs[q, None].tokens
                                      for (q, adapter), ref in refs.items() if adapter),
        "tie_margin": args.tie_margin,
        "reference_margins_below_tie": sum(m < args.tie_margin for m in margins),
        "reference_positions": len(margins),
        "rss_ready_mb": serving.mib(rss_ready), "rss_before_mb": serving.mib(rss_before),
        "rss_peak_mb": serving.mib(peak["rss"]), "rss_after_mb": serving.mib(rss_after),
        "ready": parts_ready, "before": parts_before, "after": parts_after,
        "churn": {"interval_s": args.churn_interval, **churn.counts},
        "tally": asdict(tally) | {"near_ties": tally.near_ties[:10], "wrong": tally.wrong[:10],
                                  "failures": tally.failures[:10],
                                  "near_tie_count": len(tally.near_ties),
                                  "wrong_count": len(tally.wrong),
                                  "failed": len(tally.failures)},
    }


def server_args(args: argparse.Namespace) -> list[str]:
    """`attnserve serve` options: the --serve adapters by name, run-time loading under
    --adapters-dir, a slot for each of them and the churned one, their largest rank."""
    names = [*args.serve, args.churn]
    return ["--lora-modules", *serving.lora_modules(args.adapters_dir, args.serve),
            "--max-loras", str(args.max_loras or len(names)),
            "--max-lora-rank", str(serving.max_rank(args.adapters_dir, names)),
            "--runtime-lora", "--lora-dir", str(args.adapters_dir), *args.server_args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora-soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="artifact to serve")
    serving.add_adapter_options(parser, "serve")  # the adapters served from the start
    parser.add_argument("--churn", default="lora4",
                        help="the adapter loaded and unloaded at run time (default lora4)")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="slots (default: the --serve adapters and the churned one)")
    serving.add_server_options(parser, port=8151)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--churn-interval", type=float, default=3.0)
    parser.add_argument("--prompts", type=int, default=8,
                        help=f"questions used (at most {len(QUESTIONS)}; default 8)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--tie-margin", type=float, default=DEFAULT_TIE_MARGIN,
                        help="a difference is a near tie where the reference's top-2 "
                             f"logprob margin is below this (nats; default {DEFAULT_TIE_MARGIN})")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.churn_interval <= 0:
        parser.error("--clients, --duration and --churn-interval must be positive")
    if not 1 <= args.prompts <= len(QUESTIONS) or args.max_tokens < 1:
        parser.error(f"--prompts must be in 1..{len(QUESTIONS)} and --max-tokens ≥ 1")
    if args.churn in args.serve:
        parser.error("--churn must not be one of --serve")
    with serving.started(args.model, args.port, server_args(args), "lora_soak") as server:
        try:
            result = asyncio.run(soak(server.url, server.pid, args))
        except (RuntimeError, *load.CLIENT_ERRORS) as exc:
            print(f"lora_soak: error: {exc}", file=sys.stderr)
            return 2
    serving.emit(result, args.out)
    tally = result["tally"]
    return 0 if not (tally["wrong_count"] or tally["failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
