"""The serving benchmark's console summary, Markdown table and PNG figure."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.serve.stats import LATENCY_METRICS

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def rate_of(run: dict[str, Any]) -> str:
    """The run's request rate as the command line and the file names write it."""
    rate = run["request_rate"]
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate_round(run: dict[str, Any]) -> str:
    """The rate, and the round when the run is one of several (--rounds)."""
    return f"{rate_of(run)}, round {run['round']}" if run.get("rounds", 1) > 1 else rate_of(run)


def summary(run: dict[str, Any]) -> str:
    """The block ``vllm bench serve`` prints, for one run."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", run["completed"])
    row("Failed requests:", run["failed"])
    if run.get("max_concurrency"):
        row("Maximum request concurrency:", run["max_concurrency"])
    row("Request rate configured (RPS):", rate_of(run))
    row("Benchmark duration (s):", run["duration"])
    row("Total input tokens:", run["total_input_tokens"])
    row("Total generated tokens:", run["total_output_tokens"])
    row("Request throughput (req/s):", run["request_throughput"])
    if run.get("request_goodput") is not None:
        row("Request goodput (req/s):", run["request_goodput"])
    row("Output token throughput (tok/s):", run["output_throughput"])
    row("Peak output token throughput (tok/s):", run["max_output_tokens_per_s"])
    row("Peak concurrent requests:", run["max_concurrent_requests"])
    row("Total token throughput (tok/s):", run["total_token_throughput"])
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^{n}}".format(s=TITLES[name], n=50, c="-"))
        label = name.upper()
        row(f"Mean {label} (ms):", run[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", run[f"median_{name}_ms"])
        for key in sorted(k for k in run if k.startswith("p") and k.endswith(f"_{name}_ms")):
            row(f"P{key[1:].split('_')[0]} {label} (ms):", run[key])
    joins = run.get("long_prompt_joins")
    if joins:
        lines.append("{s:{c}^{n}}".format(s="Long-prompt joins", n=50, c="-"))
        row("Joins answered / failed:", f"{joins['joins']} / {len(joins['failed'])}")
        row("Joining prompt tokens:", joins["prompt_len"])
        for key in sorted(k for k in joins if k.startswith("p") and k.endswith("_ms")):
            row(f"{key[:-3].replace('_itl_', ' ITL ')} (ms):", joins[key])
        ratio = next((v for k, v in joins.items() if k.endswith("_during_over_steady")), None)
        row("ITL during ÷ steady (top percentile):", ratio if ratio is not None else "–")
    adapters = run.get("adapters")
    if adapters:
        lines.append("{s:{c}^{n}}".format(s="LoRA adapters", n=50, c="-"))
        for entry in adapters["per_adapter"]:
            row(f"{entry['adapter'] or '(base)'}: done / failed, tok/s:",
                f"{entry['completed']} / {entry['failed']}, {entry['output_throughput']:.1f}")
    flood = run.get("attention_flood")
    if flood:
        lines.append("{s:{c}^{n}}".format(s="/attention flood", n=50, c="-"))
        row("Attention requests sent:", flood["sent"])
        row("Attention 200 / 429:", f"{flood['ok']} / {flood['rejected']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def static_summary(run: dict[str, Any]) -> str:
    """The continuous run beside the same requests as static batches (--static-baseline)."""
    static = run["static_baseline"]
    eos = "ignored" if static["ignore_eos"] else "a stop"
    each = " / ".join(f"{r['output_throughput']:.1f}" for r in static["runs"])
    return (f"rate {_rate_round(run)}: continuous {run['output_throughput']:.1f} output tok/s "
            f"({run['total_output_tokens']} tokens) vs static batches of {static['batch']} "
            f"{static['output_throughput']:.1f} tok/s (before / after: {each}; "
            f"{static['output_tokens']} tokens, end-of-sequence {eos}): "
            f"{static['continuous_vs_static']:.3f}×")


def static_rounds(runs: list[dict[str, Any]]) -> str:
    """Per rate, the median over rounds of continuous ÷ static (--rounds with
    --static-baseline): the figure to quote."""
    lines = []
    for rate in dict.fromkeys(r["request_rate"] for r in runs):
        ratios = [r["static_baseline"]["continuous_vs_static"] for r in runs
                  if r["request_rate"] == rate and r.get("static_baseline")]
        if ratios:
            each = ", ".join(f"{x:.3f}" for x in ratios)
            lines.append(f"rate {rate_of({'request_rate': rate})}: continuous ÷ static, median "
                         f"of {len(ratios)} rounds: {statistics.median(ratios):.3f}× "
                         f"(rounds: {each})")
    return "\n".join(lines)


def _host(runs: list[dict[str, Any]]) -> str:
    hosts = [r["host"] for r in runs if r.get("host")]
    if not hosts:
        return ""
    loads = [h[k] for h in hosts for k in ("loadavg_1m_before", "loadavg_1m_after")]
    cpu = [h["client_cpu_s"] for h in hosts if "client_cpu_s" in h]
    took = (f"; this client took {' / '.join(f'{c:.1f}' for c in cpu)} CPU s of it"
            if cpu else "")
    return (f"Client host: {hosts[0]['cpus']} CPUs, 1-minute load average "
            f"{min(loads):.1f}–{max(loads):.1f} during the runs{took}.")


def markdown(runs: list[dict[str, Any]], command: str) -> str:
    """One row per run: throughput, then mean / median / p99 (ms) of each latency."""
    head = ("| workload | rate (req/s) | max conc. | done / failed | duration (s) | req/s | "
            "goodput (req/s) | output tok/s | total tok/s | TTFT mean / med / p99 | "
            "TPOT mean / med / p99 | ITL mean / med / p99 | E2E mean / med / p99 |")
    lines = ["# Serving benchmark", "", f"Command: `{command}`", "",
             f"Model: {runs[0]['model_id']} via `{runs[0]['backend']}` at "
             f"{runs[0]['base_url']}; latencies in ms. {_host(runs)}", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        def trio(name: str, run: dict[str, Any] = run) -> str:
            return (f"{run[f'mean_{name}_ms']:.1f} / {run[f'median_{name}_ms']:.1f} / "
                    f"{run.get(f'p99_{name}_ms', float('nan')):.1f}")

        goodput = run["request_goodput"]
        lines.append(
            f"| {run['workload']} | {_rate_round(run)} | "
            f"{run.get('max_concurrency') or '–'} | "
            f"{run['completed']} / {run['failed']} | {run['duration']:.1f} | "
            f"{run['request_throughput']:.2f} | "
            f"{'–' if goodput is None else f'{goodput:.2f}'} | "
            f"{run['output_throughput']:.1f} | {run['total_token_throughput']:.1f} | "
            f"{trio('ttft')} | {trio('tpot')} | {trio('itl')} | {trio('e2el')} |")
    if runs[0].get("goodput"):
        slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in runs[0]["goodput"].items())
        lines += ["", f"Goodput SLOs: {slos}."]
    statics = [r for r in runs if r.get("static_baseline")]
    if statics:
        lines += ["", "Continuous batching over HTTP beside the same requests run in process "
                  "as static batches (`--static-baseline`: engine.onnx, no prefix cache, each "
                  "batch prefilled together and decoded until its last row ends):", ""]
        lines += [f"- {static_summary(run)}" for run in statics]
        if any(r.get("rounds", 1) > 1 for r in statics):
            lines += [""] + [f"**{line}**" for line in static_rounds(statics).splitlines()]
    floods = [r for r in runs if r.get("attention_flood")]
    for run in floods:
        f = run["attention_flood"]
        lines += ["", f"Rate {rate_of(run)}: /attention flood of {f['concurrency']} at once "
                  f"every {f['interval_s']:g} s during the run: {f['sent']} sent, {f['ok']} "
                  f"answered 200, {f['rejected']} answered 429, other {f['other'] or 'none'}."]
    return "\n".join(lines) + "\n"


def figure(runs: list[dict[str, Any]], path: Path) -> None:
    """ITL and TTFT distributions per run, and output tokens per second over each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for run in runs:
        label = f"{run['workload']} @ {_rate_round(run)}/s"
        itls = np.sort([g * 1000 for gaps in run["itls"] for g in gaps])
        ttfts = np.sort([t * 1000 for t, e in zip(run["ttfts"], run["errors"], strict=True)
                         if not e])
        for ax, ms in ((axes[0], itls), (axes[1], ttfts)):
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label)  # the CDF
        # each token's arrival, in seconds after the run began (stats.token_times)
        stamps = [t for start, ttft, gaps, err in zip(run["start_times"], run["ttfts"],
                                                      run["itls"], run["errors"], strict=True)
                  if not err for t in itertools.accumulate(gaps, initial=start + ttft)]
        if stamps:
            edges = np.arange(0, math.ceil(max(stamps)) + 1.0, 1.0)
            counts, _ = np.histogram(stamps, bins=edges)
            axes[2].step(edges[:-1], counts, where="post", label=label)
    axes[0].set(xscale="log", xlabel="inter-token latency (ms)", ylabel="fraction ≤ x",
                title="ITL distribution")
    axes[1].set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction ≤ x",
                title="TTFT distribution")
    axes[2].set(xlabel="seconds into the run", ylabel="output tokens / s",
                title="Output tokens per second")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"attnserve serving benchmark: {runs[0]['model_id']}")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
