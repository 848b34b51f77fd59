"""The serving benchmark's figures, defined as vLLM's ``bench serve`` defines them.

Per completed request: TTFT (send → first token), TPOT ((E2E − TTFT) / (output tokens − 1),
requests of one token excluded), every inter-token gap (ITL) and E2E latency. Throughputs
divide by the run's wall time; goodput counts the requests that met every SLO given
(a one-token request's TPOT counts as 0). Percentiles interpolate linearly between order
statistics (numpy's default, which vLLM uses); std is the population standard deviation.
Written with the standard library only, so the tests can check it against numpy.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.serve.client import RequestOutput

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput expects NAME:MS with NAME in {', '.join(SLO_METRICS)}; "
                             f"got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of ms")
        slos[name] = ms
    return slos


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's method="linear")."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe(name: str, seconds: Sequence[float], percentiles: Sequence[float]
             ) -> dict[str, float]:
    """mean/median/std/pNN of one latency metric, in ms, under vLLM's key names."""
    ms = [s * 1000 for s in seconds]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def tpot(out: RequestOutput) -> float | None:
    if out.output_tokens <= 1:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def token_times(out: RequestOutput) -> list[float]:
    """When each token of a stream arrived, in seconds after the run began."""
    return list(itertools.accumulate(out.itl, initial=out.start_time + out.ttft))


def peak_output_rate(done: Sequence[RequestOutput]) -> tuple[float, int]:
    """(most tokens received in one wall-clock second, most requests in flight at once)."""
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    buckets = Counter(int(t - t0) for o in done for t in token_times(o))
    # Sweep over half-open [start, end): a departure before an arrival at the same instant.
    events = sorted([(o.start_time, 1) for o in done]
                    + [(o.start_time + o.latency, -1) for o in done])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return float(max(buckets.values())), peak


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float,
                      percentiles: Sequence[float] = (50, 90, 99),
                      goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's summary under vLLM's JSON field names (plus the per-request arrays)."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    done = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(output_lens)
    tpots = [t for o in done if (t := tpot(o)) is not None]
    good = 0
    if goodput:
        for o in done:
            values = {"ttft": o.ttft, "tpot": tpot(o) or 0.0, "e2el": o.latency}
            good += all(values[k] * 1000 <= slo for k, slo in goodput.items())
    peak_tokens, peak_requests = peak_output_rate(done)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    series = {"ttft": [o.ttft for o in done], "tpot": tpots,
              "itl": [g for o in done for g in o.itl], "e2el": [o.latency for o in done]}
    for name in LATENCY_METRICS:
        result.update(describe(name, series[name], percentiles))
    result.update({
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    })
    return result


def itl_during_windows(outputs: Sequence[RequestOutput], windows: Sequence[tuple[float, float]],
                       percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    """Inter-token gaps of the streams split by whether they overlap a window (a long
    prompt being prefilled) or not: the running rows' ITL while a prompt joins vs steady."""
    during: list[float] = []
    steady: list[float] = []
    for out in outputs:
        if not out.success:
            continue
        times = token_times(out)
        for a, b in itertools.pairwise(times):
            overlaps = any(b > lo and a < hi for lo, hi in windows)
            (during if overlaps else steady).append(b - a)
    result: dict[str, Any] = {"joins": len(windows), "gaps_during": len(during),
                              "gaps_steady": len(steady)}
    result.update({k.replace("_itl_", "_itl_during_"): v
                   for k, v in describe("itl", during, percentiles).items()})
    result.update({k.replace("_itl_", "_itl_steady_"): v
                   for k, v in describe("itl", steady, percentiles).items()})
    top = max(percentiles)
    steady_top = result[f"p{top:g}_itl_steady_ms"]
    result[f"p{top:g}_itl_during_over_steady"] = (
        result[f"p{top:g}_itl_during_ms"] / steady_top if during and steady_top else None)
    return result
