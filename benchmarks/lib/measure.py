"""The measurement loop every engine shares, the process memory figures, and how many
leading tokens two generations share.

A row is one engine at one batch size: a short warm-up generation on the same shapes,
then ``reps`` timed generations of exactly ``n_new`` tokens per row. Tokens/s counts
generated tokens only and is the median over the repetitions (one slow repetition on a
shared machine does not move it); the decode rate leaves the prefill out; every request of
a static batch finishes with the batch, so its latency is the batch's wall time. An engine
that keeps its own timings (llama.cpp's ``llama_perf_context``) reports them per
repetition in ``GenResult.own``; the row carries their medians beside the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Every benchmark's thread count unless told otherwise, for every engine alike: the figures
# under results/ were measured on 2-core machines.
DEFAULT_THREADS = 2


def add_threads_option(parser: argparse.ArgumentParser,
                       what: str = "threads for every engine") -> None:
    """The ``--threads`` option every benchmark takes, with the one default."""
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"{what} ({DEFAULT_THREADS})")


@dataclass
class GenResult:
    tokens: list[list[int]]  # (B, n_new) generated token ids
    ttft_s: float  # call start → first generated token of every row known
    total_s: float  # call start → last token
    latencies: list[float] | None = None  # per request, when requests can finish apart
    own: dict[str, float] | None = None  # the engine's own timings of this call, if it keeps any


class Runner(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], n_new: int) -> GenResult: ...


def proc_memory_bytes(pid: int | str = "self") -> dict[str, int]:
    """A process's memory lines of /proc/PID/status (Linux), in bytes: VmRSS resident,
    VmHWM its peak, RssAnon private, RssFile mapped file pages such as memory-mapped
    weights; empty once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    lines = (line.partition(":") for line in text.splitlines())
    return {key: int(value.split()[0]) * 1024 for key, _, value in lines
            if key.startswith(("Vm", "Rss"))}


def proc_memory_mb(pid: int | str = "self") -> dict[str, float]:
    """Current (VmRSS) and peak (VmHWM) resident set of a process, in MiB (Linux)."""
    memory = proc_memory_bytes(pid)
    return {key: memory[key] / 2**20 for key in ("VmRSS", "VmHWM") if key in memory}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) — with few samples p99 is simply the max."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def shared_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading tokens (ids or texts) two generations share."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def summarize(batch: int, n_new: int, results: list[GenResult]) -> dict[str, Any]:
    """Figures of one row from its timed repetitions (rates: medians over repetitions)."""
    rates = [batch * n_new / r.total_s for r in results]
    decode = [batch * (n_new - 1) / (r.total_s - r.ttft_s) for r in results
              if r.total_s > r.ttft_s and n_new > 1]
    lat = [x for r in results for x in (r.latencies or [r.total_s] * batch)]
    row: dict[str, Any] = {
        "batch": batch,
        "reps": len(results),
        "new_tokens": n_new,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_reps": rates,
        "decode_tokens_per_s": statistics.median(decode) if decode else None,
        "ttft_ms": statistics.median(r.ttft_s for r in results) * 1e3,
        "latency_p50_ms": percentile(lat, 50) * 1e3,
        "latency_p99_ms": percentile(lat, 99) * 1e3,
    }
    own = [r.own for r in results if r.own]
    if own:
        row["own"] = {key: statistics.median(o[key] for o in own) for key in own[0]}
    return row


def measure_runner(runner: Runner, prompts: list[list[int]], batch_sizes: list[int],
                   n_new: int, reps: dict[int, int], warmup_tokens: int,
                   log: Any = None) -> list[dict[str, Any]]:
    rows = []
    for b in batch_sizes:
        batch = prompts[:b]
        runner.generate(batch, warmup_tokens)
        results = [runner.generate(batch, n_new) for _ in range(reps.get(b, 1))]
        for r in results:
            if any(len(row) != n_new for row in r.tokens) or len(r.tokens) != b:
                raise RuntimeError(f"{runner.name} returned the wrong number of tokens")
        row = summarize(b, n_new, results)
        row["greedy_tokens"] = results[0].tokens
        rows.append(row)
        if log:
            log(f"{runner.name} batch {b}: {row['tokens_per_s']:.1f} tok/s, "
                f"TTFT {row['ttft_ms']:.1f} ms")
    return rows


def median_seconds(run: Callable[[], object], before: Callable[[], object] | None = None,
                   budget: float = 0.5, most: int = 50, least: int = 5,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median of ``run``'s times (``before`` runs untimed ahead of each) on ``clock``, after
    three untimed runs: the one-op benchmarks' loop (gguf-matmul-speed, attention-speed)."""
    for _ in range(3):
        run()
    times: list[float] = []
    spent = 0.0
    while len(times) < least or (spent < budget and len(times) < most):
        if before is not None:
            before()
        started = clock()
        run()
        times.append(clock() - started)
        spent += times[-1]
    return statistics.median(times)


class CacheFlush:
    """Reads a buffer larger than any last-level cache, evicting what the last run left
    (``median_seconds``' ``before``: a product's weights then come from memory)."""

    def __init__(self, megabytes: int = 256) -> None:
        import numpy as np

        self.buffer = np.ones(megabytes << 17, dtype=np.uint64)  # MB · 2^20 / 8
        self.reduce = np.add.reduce

    def __call__(self) -> None:
        self.reduce(self.buffer)
