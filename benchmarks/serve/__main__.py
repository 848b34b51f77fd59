"""Serving benchmark in the form of vLLM's ``vllm bench serve``: streamed requests arriving
as a Poisson process (or all at once), TTFT / TPOT / ITL / E2E, throughput and goodput.

Usage (from the repository root, in the dev venv):
    # against a running server (the artifact gives the tokenizer that sizes the prompts)
    python -m benchmarks serve --url http://127.0.0.1:8000 --model artifacts/default \\
        --workload random --input-len 128 --output-len 64 --num-prompts 100 \\
        --request-rate 2,8,inf --max-concurrency 32 --goodput ttft:500 tpot:50
    # or let it start `attnserve serve --model ARTIFACT` on a free port for the run
    python -m benchmarks serve --model artifacts/default --workload shared-prefix \\
        --num-prefixes 4 --prefix-len 192 --suffix-len 32 --output-len 32 \\
        --server-env ATTNSERVE_MAX_BATCH_SIZE=32
    # two-turn chats on the model's own template, one shared system prompt
    python -m benchmarks serve --model artifacts/default --workload chat --num-prefixes 1 \\
        --prefix-len 256 --suffix-len 24 --output-len 32 --max-concurrency 4
    # decode latency while /attention is flooded (20 at once, every second)
    python -m benchmarks serve --model artifacts/default --attention-flood 20
    # running streams' inter-token gaps while a maximum-length prompt joins, every 4 s
    python -m benchmarks serve --model artifacts/default --long-join-interval 4
    # continuous batching against the same requests as static batches of 32 (in process),
    # three rounds with the static reference measured around each: the median ratio counts
    python -m benchmarks serve --model artifacts/default --backend openai --ignore-eos \\
        --input-len 64 --output-len 128 --num-prompts 96 --max-concurrency 32 \\
        --static-baseline --rounds 3
    # LoRA adapters: request i names the i-th entry of --adapters, round-robin (an empty
    # entry: the base), as OpenAI's model or TGI's adapter_id; the server it starts serves
    # --lora-modules (benchmarks/lora_adapters.py writes random ones)
    python -m benchmarks serve --model artifacts/default --backend openai --ignore-eos \
        --lora-modules lora0=adapters/bench/lora0 lora1=adapters/bench/lora1 \
        --adapters lora0,lora1, --max-concurrency 16 --num-prompts 64

Writes, under --result-dir (default results/serve/<date>-<workload>), one JSON per request
rate with vLLM's field names (completed, duration, request_throughput, output_throughput,
total_token_throughput, request_goodput, mean_/median_/std_/pNN_ttft_ms, ..._tpot_ms,
..._itl_ms, ..._e2el_ms, the per-request arrays), plus report.md and report.png. With
--rounds N every rate is run N times (JSON names end in -roundK). With --adapters, each
JSON also holds ``adapters``: the spread and, per adapter, requests, completed, failed,
output tokens and output tok/s (over the run's duration).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.measure import DEFAULT_THREADS
from benchmarks.lib.serving import Server, load_env, served_model, server_info
from benchmarks.serve import client as load
from benchmarks.serve import report
from benchmarks.serve.static import StaticBaseline
from benchmarks.serve.stats import calculate_metrics, itl_during_windows, parse_goodput
from benchmarks.serve.workloads import (
    SampleRequest,
    chat_requests,
    random_requests,
    shared_prefix_requests,
    spread_adapters,
)
from model.data import write_text_atomic

WORKLOADS = ("random", "shared-prefix", "chat")


def _numbers(example: str, rule: str, ok: Callable[[float], bool]) -> Callable[[str], list[float]]:
    """An option's type: comma-separated numbers, at least one, each ``ok``."""
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {example}: {text!r}") from None
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"{rule}: {text!r}")
        return values
    return parse


_rates = _numbers("rates like 2,8,inf", "request rates must be positive", lambda r: r > 0)
_percentiles = _numbers("percentiles like 50,90,99", "percentiles must be in (0, 100)",
                        lambda v: 0 < v < 100)


def _adapter_spread(text: str) -> list[str | None]:
    """``a,b,c,d,`` → ['a', 'b', 'c', 'd', None]: an empty entry is the base model."""
    return [name.strip() or None for name in text.split(",")]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of a running server; without it, the benchmark "
                                 "starts `attnserve serve --model ARTIFACT` itself")
    p.add_argument("--model", type=Path,
                   help="artifact directory: its tokenizer sizes the prompts, and it is "
                        "served when --url is not given")
    p.add_argument("--tokenizer", type=Path,
                   help="tokenizer.json (default: the artifact's)")
    p.add_argument("--backend", choices=load.BACKENDS, default="tgi",
                   help="tgi: POST /generate_stream; openai: POST /v1/completions stream")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-prompts", type=_positive, default=100)
    p.add_argument("--input-len", type=_positive, default=128, help="random: prompt tokens")
    p.add_argument("--output-len", type=_positive, default=64, help="max_new_tokens")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --output-len tokens (vLLM's ignore_eos; --backend "
                        "openai): every request does the same work")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len·[1−r, 1+r] (default 0)")
    p.add_argument("--num-prefixes", type=_positive, default=4,
                   help="shared-prefix: prefixes; chat: system prompts")
    p.add_argument("--prefix-len", type=_positive, default=192, help="shared-prefix: tokens")
    p.add_argument("--suffix-len", type=_positive, default=32, help="shared-prefix: tokens")
    p.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="requests per second, comma-separated for a sweep; inf = all at "
                        "once (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=_positive, default=None,
                   help="cap on requests in flight (default none)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 99.0])
    p.add_argument("--num-warmups", type=int, default=2,
                   help="requests sent (and not measured) before each rate (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--attention-flood", type=int, default=0, metavar="N",
                   help="also send N /attention requests at once, every --attention-interval "
                        "seconds, while the load runs")
    p.add_argument("--attention-interval", type=float, default=1.0)
    p.add_argument("--attention-input-len", type=_positive, default=128)
    p.add_argument("--attention-include", default="weights",
                   help="comma-separated kinds each /attention request asks for "
                        "(q,k,v,scores,scaled_scores,weights; default weights)")
    p.add_argument("--attention-format", choices=("json", "npz", "png"), default="json")
    p.add_argument("--long-join-interval", type=float, default=0.0, metavar="S",
                   help="every S seconds during the run, send one prompt of "
                        "--long-join-len tokens (1 new token) and report the streams' ITL "
                        "while it is prefilled against the rest (default 0: off)")
    p.add_argument("--long-join-count", type=_positive, default=8,
                   help="at most this many joins, each a new prompt (default 8)")
    p.add_argument("--long-join-len", type=_positive, default=None,
                   help="tokens of that prompt (default: the server's max_input_tokens)")
    p.add_argument("--adapters", type=_adapter_spread, default=None, metavar="A,B,...",
                   help="LoRA adapters the requests name, round-robin in the order sent "
                        "(an empty entry: the base model; `a,b,c,d,` spreads over four "
                        "adapters and the base): OpenAI's model or TGI's adapter_id. The "
                        "warm-up sends at least one request per entry; the JSON counts "
                        "requests and tokens per adapter")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="adapters the server it starts serves (attnserve serve "
                        "--lora-modules; --max-loras and the rest by --server-env, e.g. "
                        "ATTNSERVE_MAX_LORAS=4)")
    p.add_argument("--static-baseline", action="store_true",
                   help="run the same requests in process as static batches of "
                        "--max-concurrency (engine.onnx, same threads) before and after the "
                        "HTTP runs and report continuous ÷ static output throughput; needs "
                        "--model")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="run every request rate this many times in turn; with "
                        "--static-baseline the reference is also measured between rounds "
                        "and the ratio reported is the median of the rounds' (default 1)")
    p.add_argument("--result-dir", type=Path, default=None,
                   help="where the JSON, report.md and report.png go "
                        "(default results/serve/<date>-<workload>)")
    p.add_argument("--label", default=None, help="prefix of the JSON file names")
    p.add_argument("--server-threads", type=_positive, default=DEFAULT_THREADS,
                   help="ATTNSERVE_INTRA_OP_THREADS of the server it starts "
                        f"(default {DEFAULT_THREADS})")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the server it starts (repeatable)")
    return p


def _started_server_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment the server this benchmark starts gets beyond its own."""
    env = {}
    if args.lora_modules:
        env["ATTNSERVE_LORA_MODULES"] = " ".join(args.lora_modules)
    return {**env, **_server_env(args.server_env)}


def _server_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--server-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _tokenizer_path(args: argparse.Namespace) -> Path:
    path = args.tokenizer or (args.model / "tokenizer.json" if args.model else None)
    if path is None:
        raise ValueError("give --model ARTIFACT (or --tokenizer tokenizer.json) so prompts "
                         "can be sized in the served model's tokens")
    if not path.is_file():
        raise ValueError(f"no tokenizer at {path}")
    return path


def build_requests(args: argparse.Namespace, tokenizer: Path) -> list[SampleRequest]:
    from service.artifact.text import TextCodec

    codec = TextCodec.from_file(tokenizer)
    if args.workload == "random":
        return random_requests(codec, args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.seed)
    if args.workload == "chat":
        return chat_requests(codec, _chat_renderer(args, tokenizer, codec), args.num_prompts,
                             args.num_prefixes, args.prefix_len, args.suffix_len,
                             args.output_len, args.seed)
    return shared_prefix_requests(codec, args.num_prompts, args.num_prefixes,
                                  args.prefix_len, args.suffix_len, args.output_len, args.seed)


def _chat_renderer(args: argparse.Namespace, tokenizer: Path, codec: Any
                   ) -> Callable[[list[dict[str, str]]], str]:
    """The served artifact's chat template, as the chat route renders it."""
    from service.contract import io_spec as io
    from service.contract.chat_template import ChatTemplate

    directory = args.model or tokenizer.parent
    config = io.ArtifactConfig.load(directory)
    specials = {name: codec.token_text(token_id) for name, token_id in (
        ("bos_token", config.bos_token_id), ("eos_token", config.eos_token_id),
        ("pad_token", config.pad_token_id)) if token_id is not None}
    template = ChatTemplate.load(directory, specials)
    return lambda messages: template.render(messages)


def _random_prompts(tokenizer: Path, n_tokens: int, seeds: Iterable[int]) -> list[str]:
    """One random prompt of ``n_tokens`` tokens per seed (the workload's random prompts)."""
    from service.artifact.text import TextCodec

    codec = TextCodec.from_file(tokenizer)
    return [random_requests(codec, 1, n_tokens, 1, 0.0, seed)[0].prompt for seed in seeds]


def _long_prompts(args: argparse.Namespace, info: dict[str, Any]) -> list[str]:
    """--long-join-count distinct prompts of --long-join-len tokens (else as long as the
    server takes), made before the run so that making them times nothing."""
    n = args.long_join_len or info.get("limits", {}).get("max_input_tokens")
    if not n:
        raise ValueError("the server's /info has no max_input_tokens: give --long-join-len")
    seeds = range(args.seed + 1000, args.seed + 1000 + args.long_join_count)
    return _random_prompts(_tokenizer_path(args), int(n), seeds)


async def run_rate(args: argparse.Namespace, url: str, requests: list[SampleRequest],
                   rate: float, attention_text: str | None) -> dict[str, Any]:
    limit = args.max_concurrency or len(requests)
    model, info = served_model(url), server_info(url)
    # Another server than ours (no /info: llama-server) gets a connection a request: after
    # a streamed answer llama-server's keep-alive connection fails the next request on it
    # ("Can not write request body"); ours keeps connections alive, as vLLM's bench does.
    async with load.session(url, args.request_timeout, limit + 4,
                            force_close=not info) as client:
        send = load.request_func(args.backend, model, ignore_eos=args.ignore_eos)
        for req in requests[:_warmups(args)]:
            warm = await send(client, req, load.RequestOutput())
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        offsets = load.arrival_offsets(len(requests), rate, args.burstiness,
                                       np.random.default_rng(args.seed))
        flood = load.FloodStats()
        stop = asyncio.Event()
        flooding = None
        if attention_text is not None and args.attention_flood > 0:
            flood_client = load.session(url, args.request_timeout, args.attention_flood)
            body = {"inputs": attention_text, "format": args.attention_format,
                    "include": [k.strip() for k in args.attention_include.split(",")]}
            flooding = asyncio.create_task(load.attention_flood(
                flood_client, body, args.attention_flood, args.attention_interval, stop,
                flood))
        joins = load.JoinStats()
        joining = None
        long_prompts = _long_prompts(args, info) if args.long_join_interval > 0 else []
        t_start = time.perf_counter()
        if long_prompts:
            joining = asyncio.create_task(load.long_prompt_joins(
                client, long_prompts, args.long_join_interval, t_start, stop, joins))
        started = datetime.now().astimezone().isoformat(timespec="seconds")
        load_before = os.getloadavg()[0]
        cpu_before = time.process_time()
        try:
            outputs, duration = await load.run_load(client, send, requests, offsets,
                                                    args.max_concurrency, start=t_start)
        finally:
            stop.set()
            client_cpu = time.process_time() - cpu_before
            if flooding is not None:
                await flooding
                await flood_client.close()
            if joining is not None:
                await joining
    goodput = parse_goodput(args.goodput)
    run: dict[str, Any] = {
        "date": started, "backend": args.backend, "base_url": url, "model_id": model,
        "tokenizer_id": str(_tokenizer_path(args)), "workload": args.workload,
        "num_prompts": len(requests), "request_rate": rate, "burstiness": args.burstiness,
        "ignore_eos": args.ignore_eos,
        "max_concurrency": args.max_concurrency, "goodput": goodput or None,
        "workload_params": _workload_params(args), "server_info": info,
        # Timings mean little on a busy machine: say how busy it was, and how much of it
        # this client took (it shares the machine with the server it measures).
        "host": {"cpus": os.cpu_count(), "loadavg_1m_before": load_before,
                 "loadavg_1m_after": os.getloadavg()[0], "client_cpu_s": client_cpu},
    }
    run.update(calculate_metrics(outputs, duration, args.metric_percentiles, goodput))
    if args.adapters:
        run["adapters"] = adapter_counts(args.adapters, requests, outputs, duration)
    if joining is not None:
        run["long_prompt_joins"] = {
            "interval_s": args.long_join_interval, "windows": joins.windows,
            "failed": joins.failed, "prompt_len": args.long_join_len or info.get(
                "limits", {}).get("max_input_tokens"),
            **itl_during_windows(outputs, joins.windows, args.metric_percentiles)}
    if flooding is not None:
        run["attention_flood"] = {
            "concurrency": args.attention_flood, "interval_s": args.attention_interval,
            "input_len": args.attention_input_len, "include": args.attention_include,
            "format": args.attention_format,
            "sent": flood.sent, "ok": flood.ok,
            "rejected": flood.rejected, "other": flood.other,
            "median_ok_latency_ms": (float(np.median(flood.ok_latencies)) * 1000
                                     if flood.ok_latencies else None)}
    return run


def _warmups(args: argparse.Namespace) -> int:
    """Warm-up requests: --num-warmups, and with --adapters at least one per entry (each
    adapter placed in its slot before the clock starts)."""
    return max(args.num_warmups, len(args.adapters or ()))


def adapter_counts(spread: list[str | None], requests: list[SampleRequest],
                   outputs: list[load.RequestOutput], duration: float) -> dict[str, Any]:
    """Per adapter of the spread (None: the base): requests sent, completed, failed,
    output tokens and their rate over the run."""
    rows: dict[str | None, dict[str, Any]] = {
        name: {"adapter": name, "requests": 0, "completed": 0, "failed": 0,
               "output_tokens": 0} for name in spread}
    for req, out in zip(requests, outputs, strict=True):
        row = rows[req.adapter]
        row["requests"] += 1
        row["completed" if out.success else "failed"] += 1
        row["output_tokens"] += out.output_tokens if out.success else 0
    for row in rows.values():
        row["output_throughput"] = row["output_tokens"] / duration
    return {"spread": spread, "per_adapter": list(rows.values())}


def _workload_params(args: argparse.Namespace) -> dict[str, Any]:
    if args.workload == "random":
        return {"input_len": args.input_len, "output_len": args.output_len,
                "range_ratio": args.range_ratio}
    return {"num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len, "output_len": args.output_len}


def _json_name(args: argparse.Namespace, run: dict[str, Any]) -> str:
    label = f"{args.label}-" if args.label else ""
    round_part = f"-round{run['round']}" if run["rounds"] > 1 else ""
    return (f"{label}{args.backend}-{args.workload}-rate{report.rate_of(run)}"
            f"{round_part}.json")


def _static_baseline(args: argparse.Namespace, requests: list[SampleRequest]
                     ) -> StaticBaseline:
    """The same requests as static batches of --max-concurrency, in this process."""
    batch = args.max_concurrency or len(requests)
    between = " and between rounds" if args.rounds > 1 else ""
    print(f"static baseline: {len(requests)} requests in batches of {batch}, in process, "
          f"before and after the HTTP runs{between}", file=sys.stderr)
    return StaticBaseline(args.model, requests, batch, args.server_threads, args.ignore_eos)


def _serve_runs(args: argparse.Namespace, requests: list[SampleRequest],
                attention_text: str | None, out: Path, command: str,
                between_rounds: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """One run per request rate and round against the server (started here without --url);
    ``between_rounds`` runs after every round but the last, the server idle."""
    runs = []
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            log_path = Path(tempfile.mkdtemp(prefix="attnserve-bench-")) / "server.log"
            print(f"starting attnserve serve --model {args.model} (log: {log_path})",
                  file=sys.stderr)
            url = stack.enter_context(Server(args.model, load_env(
                args.server_threads, {**os.environ, **_started_server_env(args)}), log_path)).url
        for round_number in range(1, args.rounds + 1):
            if round_number > 1 and between_rounds is not None:
                between_rounds()
            for rate in args.request_rate:
                run = asyncio.run(run_rate(args, url.rstrip("/"), requests, rate,
                                           attention_text))
                run.update(command=command, round=round_number, rounds=args.rounds)
                if args.url is None:
                    run["server_env"] = _started_server_env(args)
                    run["server_threads"] = args.server_threads
                write_text_atomic(out / _json_name(args, run), json.dumps(run))
                print(report.summary(run))
                runs.append(run)
    return runs


def handle(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    goodput = parse_goodput(args.goodput)  # refuse a bad SLO before any work
    if args.burstiness <= 0 or not 0 <= args.range_ratio < 1 or args.num_warmups < 0:
        raise ValueError("--burstiness must be > 0, --range-ratio in [0, 1), "
                         "--num-warmups ≥ 0")
    if args.url is None and args.model is None:
        raise ValueError("give --url of a running server or --model ARTIFACT to serve")
    if args.long_join_interval < 0:
        raise ValueError("--long-join-interval must be ≥ 0")
    if args.attention_flood < 0 or args.attention_interval <= 0:
        raise ValueError("--attention-flood must be ≥ 0 and --attention-interval > 0")
    if args.ignore_eos and args.backend != "openai":
        raise ValueError("--ignore-eos needs --backend openai (TGI's API has no such "
                         "parameter)")
    if args.static_baseline and args.model is None:
        raise ValueError("--static-baseline runs the artifact in process: give --model")
    if args.static_baseline and args.adapters and any(args.adapters):
        raise ValueError("--static-baseline runs the base model alone: leave out --adapters")
    if args.adapters and args.num_prompts < len(args.adapters):
        raise ValueError("--num-prompts must be at least the entries of --adapters")
    if args.lora_modules and args.url is not None:
        raise ValueError("--lora-modules is for the server this benchmark starts: with "
                         "--url, start the server with them")
    tokenizer = _tokenizer_path(args)
    requests = spread_adapters(build_requests(args, tokenizer), args.adapters or [])
    attention_text = (_random_prompts(tokenizer, args.attention_input_len, [args.seed + 1])[0]
                      if args.attention_flood else None)
    out = args.result_dir or Path("results/serve") / f"{date.today()}-{args.workload}"
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks serve " + shlex.join(
        sys.argv[1:] if argv is None else argv)

    static = _static_baseline(args, requests) if args.static_baseline else None
    try:
        if static is not None:
            static.measure()  # before the server starts; again after it stops
        runs = _serve_runs(args, requests, attention_text, out, command,
                           static.measure if static is not None else None)
        if static is not None:
            static.measure()
            for run in runs:
                run["static_baseline"] = static.result(run["output_throughput"],
                                                       run["round"] - 1)
                write_text_atomic(out / _json_name(args, run), json.dumps(run))
                print(report.static_summary(run))
            if args.rounds > 1:
                print(report.static_rounds(runs))
    finally:
        if static is not None:
            static.close()
    (out / "report.md").write_text(report.markdown(runs, command), encoding="utf-8")
    report.figure(runs, out / "report.png")
    if goodput:
        print(f"goodput SLOs: {goodput}")
    print(f"results: {out}/ (JSON per rate, report.md, report.png)")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return handle(args, argv)
    except KeyboardInterrupt:
        print("benchmarks.serve: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, *load.CLIENT_ERRORS) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"benchmarks.serve: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
