"""The serving benchmark's statistics and arrival schedule against numpy on synthetic timings.

benchmarks/serve/stats.py is written with the standard library only; numpy (the library
vLLM's ``bench serve`` computes with) is the independent reference here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.serve.client import RequestOutput, arrival_offsets
from benchmarks.serve.stats import (
    calculate_metrics,
    itl_during_windows,
    parse_goodput,
    peak_output_rate,
)

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def synthetic(seed: int = 0, n: int = 40) -> list[RequestOutput]:
    """Requests with random TTFT, gaps and lengths; a few failed, one of a single token."""
    rng = np.random.default_rng(seed)
    outs = []
    for i in range(n):
        start = float(rng.uniform(0, 5))
        if i % 13 == 5:
            outs.append(RequestOutput(success=False, prompt_len=50, start_time=start,
                                      error="HTTP 429: overloaded"))
            continue
        n_out = 1 if i == 7 else int(rng.integers(2, 30))
        ttft = float(rng.lognormal(-3, 0.5))
        gaps = [float(g) for g in rng.lognormal(-4, 0.7, size=n_out - 1)]
        outs.append(RequestOutput(success=True, prompt_len=int(rng.integers(20, 200)),
                                  output_tokens=n_out, ttft=ttft, itl=gaps,
                                  latency=ttft + sum(gaps), start_time=start,
                                  generated_text="x" * n_out))
    return outs


def test_metrics_equal_numpy_on_synthetic_timings() -> None:
    outs = synthetic()
    done = [o for o in outs if o.success]
    duration = 7.25
    got = calculate_metrics(outs, duration, PERCENTILES)

    ttft = np.array([o.ttft for o in done]) * 1000
    e2el = np.array([o.latency for o in done]) * 1000
    itl = np.concatenate([o.itl for o in done]) * 1000
    tpot = np.array([(o.latency - o.ttft) / (o.output_tokens - 1)
                     for o in done if o.output_tokens > 1]) * 1000
    assert len(tpot) == len(done) - 1  # the one-token request has no TPOT
    for name, ref in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert got[f"mean_{name}_ms"] == pytest.approx(np.mean(ref), rel=1e-12)
        assert got[f"median_{name}_ms"] == pytest.approx(np.median(ref), rel=1e-12)
        assert got[f"std_{name}_ms"] == pytest.approx(np.std(ref), rel=1e-9)
        for q in PERCENTILES:
            key = f"p{q:g}_{name}_ms"
            assert got[key] == pytest.approx(np.percentile(ref, q), rel=1e-12), key
    assert "p99.9_itl_ms" in got and "p99_itl_ms" in got

    failed = sum(not o.success for o in outs)
    assert (got["completed"], got["failed"]) == (len(done), failed) and failed == 3
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_len for o in done)
    assert got["total_output_tokens"] == out_tokens
    assert got["total_input_tokens"] == in_tokens
    assert got["request_throughput"] == pytest.approx(len(done) / duration)
    assert got["output_throughput"] == pytest.approx(out_tokens / duration)
    assert got["total_token_throughput"] == pytest.approx((in_tokens + out_tokens) / duration)
    assert got["request_goodput"] is None
    assert got["output_lens"] == [o.output_tokens if o.success else 0 for o in outs]
    assert got["errors"][5] == "HTTP 429: overloaded"


def test_goodput_counts_requests_within_every_slo() -> None:
    outs = synthetic(seed=3)
    done = [o for o in outs if o.success]
    ttft = np.array([o.ttft for o in done]) * 1000
    e2el = np.array([o.latency for o in done]) * 1000
    tpot = np.array([(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1
                     else 0.0 for o in done]) * 1000
    slo_ttft, slo_tpot = float(np.median(ttft)), float(np.percentile(tpot, 75))
    good = int(np.sum((ttft <= slo_ttft) & (tpot <= slo_tpot)))
    assert 0 < good < len(done)  # the SLOs split the requests, so the test can fail
    got = calculate_metrics(outs, 2.0, goodput={"ttft": slo_ttft, "tpot": slo_tpot})
    assert got["request_goodput"] == pytest.approx(good / 2.0)
    slo_e2el = float(np.percentile(e2el, 30))
    only_e2el = calculate_metrics(outs, 2.0, goodput={"e2el": slo_e2el})
    assert only_e2el["request_goodput"] == pytest.approx(np.sum(e2el <= slo_e2el) / 2.0)


def test_peak_tokens_per_second_and_concurrency_by_brute_force() -> None:
    done = [o for o in synthetic(seed=5) if o.success]
    peak_tokens, peak_requests = peak_output_rate(done)
    t0 = min(o.start_time for o in done)
    stamps = np.concatenate([o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
                             for o in done]) - t0
    assert peak_tokens == np.max(np.bincount(stamps.astype(int)))
    # Concurrency at every start instant, intervals half-open.
    at = [sum(o.start_time <= s.start_time < o.start_time + o.latency for o in done)
          for s in done]
    assert peak_requests == max(at)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in ("itl:5", "ttft", "ttft:fast", "ttft:0", "ttft:-3", "tpot:inf"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def test_poisson_arrivals() -> None:
    rng = np.random.default_rng(0)
    offsets = np.array(arrival_offsets(4000, 20.0, 1.0, rng))
    assert np.all(np.diff(offsets) >= 0)
    assert offsets[-1] == pytest.approx(4000 / 20.0)  # n requests span n / rate
    gaps = np.diff(offsets)
    # Exponential gaps: mean 1/rate and coefficient of variation 1 (sampling error ~2%).
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, np.random.default_rng(0)))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.2)  # CV = 1/sqrt(shape)
    assert arrival_offsets(5, math.inf, 1.0, rng) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, rng)


def test_itl_split_by_join_windows_equals_numpy() -> None:
    """Each gap goes to 'during' exactly when its (previous, next) arrival interval overlaps
    a window, computed here with numpy arrays of absolute arrival times."""
    outs = synthetic(seed=3)
    windows = [(0.8, 1.1), (2.5, 2.55), (4.0, 4.6)]
    got = itl_during_windows(outs, windows, PERCENTILES)
    during, steady = [], []
    for o in outs:
        if not o.success:
            continue
        arrivals = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        prev, nxt = arrivals[:-1], arrivals[1:]
        hit = np.zeros(len(prev), dtype=bool)
        for lo, hi in windows:
            hit |= (nxt > lo) & (prev < hi)
        during.append((nxt - prev)[hit])
        steady.append((nxt - prev)[~hit])
    d, s = np.concatenate(during) * 1000, np.concatenate(steady) * 1000
    assert got["joins"] == 3
    assert (got["gaps_during"], got["gaps_steady"]) == (len(d), len(s))
    assert 0 < len(d) < len(s)
    for q in PERCENTILES:
        assert got[f"p{q:g}_itl_during_ms"] == pytest.approx(np.percentile(d, q), rel=1e-9)
        assert got[f"p{q:g}_itl_steady_ms"] == pytest.approx(np.percentile(s, q), rel=1e-9)
    assert got["p99.9_itl_during_over_steady"] == pytest.approx(
        np.percentile(d, 99.9) / np.percentile(s, 99.9), rel=1e-9)
