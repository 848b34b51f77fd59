"""Serving with LoRA adapters against serving without: the same load on three servers, in
turn, round after round, and the ratio of output tokens/s that the adapter target is about.

Usage (from the repository root, in the dev venv):
    python -m benchmarks lora-adapters --model artifacts/smollm2-135m-instruct-lora \\
        --out adapters/bench --count 4 --rank 16
    python -m benchmarks lora-serve --model artifacts/smollm2-135m-instruct-lora \\
        --adapters-dir adapters/bench --adapters lora0,lora1,lora2,lora3 --rounds 3 \\
        --out results/serve/2026-11-29-lora

Each round runs `python -m benchmarks serve` three times, each starting its own server
(2 ONNX Runtime threads unless --server-threads), on one workload (random prompts of
--input-len tokens, exactly --output-len greedy tokens each: --ignore-eos over the OpenAI
API, --num-prompts requests, at most --concurrency in flight):

- ``base-server``: a server started without adapters, every request to the base;
- ``spread``: a server serving the adapters (``--lora-modules``, ``--max-loras`` their
  count, ``--max-lora-rank`` their largest r), requests round-robin over the adapters and
  the base (``--adapters a,b,c,d,``);
- ``lora-server-base``: that server again, every request to the base (what serving
  adapters costs rows that use none).

The target: spread ≥ --target (0.8) × base-server, as the median over rounds of each
round's ratio (a shared machine drifts; a ratio within one round cancels what both runs
share). Each run's JSON and report stay under --out/<run>-r<k>/; --out/summary.json holds
every round's figures and the medians, and the last line says PASS or MISS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import DEFAULT_THREADS
from benchmarks.lib.serving import (
    add_adapter_options,
    lora_modules,
    max_rank,
    output_throughput,
)
from benchmarks.serve.__main__ import main as serve_main
from model.data import write_text_atomic

RUNS = ("base-server", "spread", "lora-server-base")


def serve_argv(args: argparse.Namespace, run: str, out: Path) -> list[str]:
    """`python -m benchmarks serve` arguments of one run."""
    argv = ["--model", str(args.model), "--backend", "openai", "--ignore-eos",
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--server-threads", str(args.server_threads), "--result-dir", str(out),
            "--server-env", f"ATTNSERVE_MAX_TOTAL_TOKENS={args.max_total_tokens}"]
    if run == "base-server":
        return argv
    rank = max_rank(args.adapters_dir, args.adapters)
    argv += ["--server-env", f"ATTNSERVE_MAX_LORAS={len(args.adapters)}",
             "--server-env", f"ATTNSERVE_MAX_LORA_RANK={rank}",
             "--lora-modules", *lora_modules(args.adapters_dir, args.adapters)]
    spread = [*args.adapters, ""] if run == "spread" else [""]
    return [*argv, "--adapters", ",".join(spread)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora-serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True,
                        help="artifact with the adapter graphs (engine_mixed_lora.onnx)")
    add_adapter_options(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-total-tokens", type=int, default=4096,
                        help="the servers' max_total_tokens (default 4096, as `make run`)")
    parser.add_argument("--server-threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.rounds < 1 or not args.adapters:
        parser.error("--rounds must be ≥ 1 and --adapters name at least one")
    rounds: list[dict[str, Any]] = []
    for k in range(1, args.rounds + 1):
        figures = {}
        for run in RUNS:
            out = args.out / f"{run}-r{k}"
            print(f"round {k}: {run}", file=sys.stderr)
            code = serve_main(serve_argv(args, run, out))
            if code != 0:
                print(f"benchmarks.lora_serve: {run} (round {k}) failed ({code})",
                      file=sys.stderr)
                return code
            figures[run] = output_throughput(out)
        figures["spread_over_base_server"] = figures["spread"] / figures["base-server"]
        figures["lora_base_over_base_server"] = (figures["lora-server-base"]
                                                 / figures["base-server"])
        rounds.append(figures)
        print(f"round {k}: output tok/s " + ", ".join(f"{r} {figures[r]:.1f}" for r in RUNS)
              + f"; spread ÷ base-server {figures['spread_over_base_server']:.3f}")
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    summary = {"model": str(args.model), "adapters": args.adapters,
               "workload": {"concurrency": args.concurrency, "num_prompts": args.num_prompts,
                            "input_len": args.input_len, "output_len": args.output_len},
               "server_threads": args.server_threads, "target": args.target,
               "rounds": rounds, "medians": medians,
               "command": "python -m benchmarks lora-serve " + " ".join(sys.argv[1:])}
    write_text_atomic(args.out / "summary.json", json.dumps(summary, indent=2) + "\n")
    ratio = medians["spread_over_base_server"]
    print(f"lora-server-base ÷ base-server (median): {medians['lora_base_over_base_server']:.3f}")
    print(f"{'PASS' if ratio >= args.target else 'MISS'}: {args.concurrency} rows over "
          f"{len(args.adapters)} adapters and the base ÷ base-only server = {ratio:.3f} "
          f"(median of {args.rounds} rounds; target ≥ {args.target})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
