"""Prefix-aware routing against round robin: prefix-cache hit rate and median TTFT.

Usage (from the repository root; three replicas behind the `scale` profile's proxy):
    docker-compose --profile scale up -d --scale attnserve=3
    python -m benchmarks router-prefix --router http://127.0.0.1:8080 \\
        --replicas http://127.0.0.1:8000 http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --out results/bench/mine/router_prefix.json

Every request is a streamed OpenAI completion whose prompt is one of 8 long shared prefixes
followed by a question of its own. Rounds alternate between the two arms on the same
replicas: **router**, every request sent to the proxy (a consistent hash of the adapter and
the prompt's first bytes picks the replica); **round robin**, the client itself cycles over
the replicas' own ports (no proxy hop). The hit rate is the replicas' own counters, summed:
the delta of attnserve_prefix_cache_hits_total over attnserve_prefix_cache_queries_total
(prompt tokens) across the round. A round starts from the caches the previous round (of the
other arm) left. Load is bounded: ``--clients`` in flight, ``--repeats`` requests a prefix a
round, ``--rounds`` rounds an arm, and no round starts after ``--time-limit`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.lib.serving import http_get, metric, served_model
from benchmarks.serve import client as load
from benchmarks.serve.workloads import SampleRequest

# Common English words: prefixes of these tokenize to about 1.3 tokens a word.
WORDS = ("time person year way day thing man world life hand part child eye woman place "
         "work week case point government company number group problem fact river stone "
         "market garden window letter paper music table money story water country city "
         "system program question night family member house office school student game "
         "morning evening light green silver harbor engine bridge forest mountain island "
         "winter summer autumn spring valley ocean signal camera planet journey lantern")


def shared_prefixes(n: int, words: int, seed: int) -> list[str]:
    """``n`` distinct prefixes of ``words`` words; distinct from their first word on, so
    a hash of the first bytes tells them apart."""
    rng = random.Random(seed)
    vocabulary = WORDS.split()
    return [f"Document {i}: " + " ".join(rng.choice(vocabulary) for _ in range(words)) + "\n\n"
            for i in range(n)]


def cache_counters(url: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens from one replica's /metrics."""
    text = http_get(f"{url}/metrics")[0]
    hits, queries = (metric(text, f"attnserve_prefix_cache_{name}_total")
                     for name in ("hits", "queries"))
    if hits is None or queries is None:
        raise RuntimeError(f"{url}/metrics has no prefix-cache counters")
    return hits, queries


@dataclass
class Round:
    arm: str
    index: int
    ttft_s: list[float] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    per_replica: list[int] = field(default_factory=list)  # requests each replica's cache saw
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


async def send_round(targets: list[str], model: str, prompts: list[str], clients: int,
                     max_tokens: int, timeout: float) -> tuple[list[float], float]:
    """Every prompt as a streamed completion (the serving benchmark's client, ``clients`` in
    flight), each to the next of ``targets`` in turn: (TTFT of each, wall seconds); raises
    if any failed, so a failed request never counts as a fast one."""
    requests = [SampleRequest(prompt, 0, max_tokens) for prompt in prompts]
    complete = load.request_func("openai", model)
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(load.session(t, timeout)) for t in targets]
        turn = itertools.cycle(sessions)

        async def to_next(_: aiohttp.ClientSession, req: SampleRequest,
                          out: load.RequestOutput) -> load.RequestOutput:
            return await complete(next(turn), req, out)

        outputs, wall = await load.run_load(sessions[0], to_next, requests,
                                            [0.0] * len(requests), clients)
    return [o.ttft for o in load.check(outputs)], wall


def run_round(arm: str, index: int, targets: list[str], replicas: list[str], model: str,
              prompts: list[str], clients: int, max_tokens: int, timeout: float) -> Round:
    """One round of ``send_round``; the replicas' cache counters read before and after."""
    before = [cache_counters(r) for r in replicas]
    try:
        ttfts, wall = asyncio.run(send_round(targets, model, prompts, clients, max_tokens,
                                             timeout))
    except RuntimeError as exc:
        raise RuntimeError(f"{arm} round {index}: {exc}") from None
    after = [cache_counters(r) for r in replicas]
    return Round(arm, index, ttfts,
                 hits=sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
                 queries=sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
                 per_replica=[round(a[1] - b[1]) for a, b in zip(after, before, strict=True)],
                 wall_s=wall)


def workload(prefixes: list[str], repeats: int, rng: random.Random) -> list[str]:
    """Each prefix ``repeats`` times with a question of its own, shuffled."""
    prompts = [f"{p}Question {rng.randrange(10**6)}: what is word {k + 1} above?\nAnswer:"
               for p in prefixes for k in range(repeats)]
    rng.shuffle(prompts)
    return prompts


def summary(rounds: list[Round]) -> dict[str, dict[str, float]]:
    """Per arm: pooled median TTFT (ms) and the hit rate over all its rounds."""
    out = {}
    for arm in ("router", "round_robin"):
        mine = [r for r in rounds if r.arm == arm]
        ttfts = [t for r in mine for t in r.ttft_s]
        queries = sum(r.queries for r in mine)
        out[arm] = {"rounds": len(mine), "requests": len(ttfts),
                    "median_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
                    "hit_rate": sum(r.hits for r in mine) / queries if queries else 0.0}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="the proxy's URL")
    parser.add_argument("--replicas", nargs="+", required=True, help="each replica's own URL")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=4, help="requests a prefix a round")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="rounds an arm")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a request")
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="no round starts after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the rounds and summary as JSON")
    args = parser.parse_args(argv)
    if min(args.prefixes, args.prefix_words, args.repeats, args.clients, args.rounds) < 1:
        parser.error("--prefixes, --prefix-words, --repeats, --clients, --rounds must be >= 1")
    rng = random.Random(args.seed)
    prefixes = shared_prefixes(args.prefixes, args.prefix_words, args.seed)
    arms = {"router": [args.router], "round_robin": list(args.replicas)}
    model = served_model(args.replicas[0])
    rounds: list[Round] = []
    started = time.monotonic()
    print(f"{'round':>5} {'arm':<12} {'median TTFT ms':>14} {'hit rate':>8} "
          f"{'wall s':>7}  prompt tokens per replica")
    for index in range(args.rounds):
        for arm, targets in arms.items():
            if time.monotonic() - started > args.time_limit:
                break
            r = run_round(arm, index, targets, args.replicas, model,
                          workload(prefixes, args.repeats, rng), args.clients,
                          args.max_tokens, args.timeout)
            rounds.append(r)
            print(f"{index:>5} {arm:<12} {1000 * statistics.median(r.ttft_s):>14.0f} "
                  f"{r.hit_rate:>8.3f} {r.wall_s:>7.1f}  {r.per_replica}", flush=True)
    result = summary(rounds)
    for arm, s in result.items():
        print(f"{arm:<12} {s['rounds']} rounds, {s['requests']} requests: median TTFT "
              f"{s['median_ttft_ms']:.0f} ms, prefix-cache hit rate {s['hit_rate']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "summary": result,
                                        "rounds": [asdict(r) | {"hit_rate": r.hit_rate}
                                                   for r in rounds]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
