"""Quantised artifacts with their float32 twin on and off, beside float32, in one process.

Usage:
    python -m benchmarks.float32_twin --fp32 artifacts/smollm2-135m-instruct \
        --quantized int4=.cache/bench-work/smollm2-135m-instruct/artifact_int4 \
        [--quantized gguf=DIR ...] [--batch 32] [--prompt-len 64] [--new 128] [--rounds 3] \
        [--threads 2] [--wide N] [--out FILE.json]
    python -m benchmarks.float32_twin --quantized int4=DIR --passes 2,4,8,16,32 [--rounds 4]

One static batch of ``--batch`` random prompts, ``--new`` greedy tokens each (end of
sequence not a stop), through the engine as ``benchmarks.runner_engine`` builds it (one
pass for the whole prompt batch, so the prefill is one pass of batch × prompt-len tokens).
Every round runs the float32 artifact, then each quantised one with the twin
(engine_float32.onnx for passes of at least ``--wide`` tokens) and without it, in turn on
the same engines, so the machine's drift falls on all alike; a 4-bit artifact with
engine_codes8.onnx also runs as served (twin and 8-bit codes on, each at the artifact's
threshold), and the other two variants with the codes off. Prints tokens/s and TTFT per
round, and each quantised variant's per-round ratio to float32 with its median.

``--passes`` times single prefill passes instead (where the threshold comes from): for
each number of 64-token prompts, one pass on the twin and one on the quantised graph, in
turn, ``--rounds`` times; prints the median of all but the first of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np


def named(value: str) -> tuple[str, Path]:
    name, _, path = value.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, Path(path)


def passes(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill passes of ``rows`` × prompt-len tokens, twin against quantised graph."""
    from service.contract import io_spec as io
    from service.engine.engine import EngineConfig, create_runner
    from service.engine.engine_graph_runner import EngineGraphRunner

    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"prompt_len": args.prompt_len, "threads": args.threads,
                              "passes": {}}
    for name, path in args.quantized:
        runner = create_runner(path, io.ArtifactConfig.load(path), EngineConfig(
            intra_op_threads=args.threads, max_batch_size=max(args.passes),
            max_total_tokens=args.prompt_len + 8, prefix_caching=False, float32_pass_tokens=1,
            codes8_pass_rows=0))
        if not isinstance(runner, EngineGraphRunner) or runner.float32_twin_tokens is None:
            raise SystemExit(f"float32_twin: {path} has no engine_float32.onnx "
                             "(export it again with --quantize int4|gguf --engine-graph --codes8)")
        for rows in args.passes:
            seconds: dict[str, list[float]] = {"twin": [], "quantised": []}
            for _ in range(args.rounds):
                for label, wide in (("twin", 1), ("quantised", 0)):
                    runner.float32_pass_tokens = wide
                    slots = runner.reserve(rows)
                    prompts = [rng.integers(10, runner.vocab_size, args.prompt_len)
                               for _ in range(rows)]
                    started = time.perf_counter()
                    runner.prefill(slots, prompts)
                    seconds[label].append(time.perf_counter() - started)
                    runner.leave(slots, [])
            twin, quantised = (statistics.median(seconds[k][1:] or seconds[k])
                               for k in ("twin", "quantised"))
            report["passes"].setdefault(name, {})[rows * args.prompt_len] = seconds
            print(f"{name} {rows * args.prompt_len:>5} tokens: twin {twin * 1000:7.0f} ms, "
                  f"quantised {quantised * 1000:7.0f} ms, twin ÷ quantised "
                  f"{twin / quantised:.2f}", flush=True)
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.runner_engine import EngineRunner
    from service.engine.engine_graph_runner import EngineGraphRunner

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10000, args.prompt_len).tolist() for _ in range(args.batch)]
    max_len = args.prompt_len + args.new + 8
    runners = {"fp32": EngineRunner(args.fp32, args.threads, max_len=max_len)}
    wide: dict[str, int] = {"fp32": 0}  # each artifact's threshold when the twin is on
    # label → (float32_pass_tokens, codes8_pass_rows) per artifact, in running order
    variants: dict[str, dict[str, tuple[int, int]]] = {"fp32": {"fp32": (0, 0)}}
    for name, path in args.quantized:
        runner = EngineRunner(path, args.threads, max_len=max_len)
        model = runner.engine.runner
        if not isinstance(model, EngineGraphRunner) or model.float32_twin_tokens is None:
            raise SystemExit(f"float32_twin: {path} has no engine_float32.onnx "
                             "(export it again with --quantize ... --engine-graph --float32-twin)")
        runners[name] = runner
        wide[name] = args.wide or model.float32_pass_tokens
        variants[name] = {f"{name} twin on": (wide[name], 0), f"{name} twin off": (0, 0)}
        if model.codes8_rows is not None:
            variants[name] = {f"{name} as served": (wide[name], model.codes8_pass_rows),
                              **variants[name]}
    rounds: dict[str, list[dict[str, float]]] = {}
    try:
        for _ in range(args.rounds):
            for name, runner in runners.items():
                for label, (tokens, many) in variants[name].items():
                    model = runner.engine.runner
                    assert isinstance(model, EngineGraphRunner)
                    model.float32_pass_tokens, model.codes8_pass_rows = tokens, many
                    result = runner.generate(prompts, args.new)
                    rounds.setdefault(label, []).append(
                        {"tok_s": args.batch * args.new / result.total_s,
                         "ttft_ms": result.ttft_s * 1000})
    finally:
        for runner in runners.values():
            runner.close()
    report: dict[str, Any] = {"batch": args.batch, "prompt_len": args.prompt_len,
                              "new": args.new, "threads": args.threads, "wide": wide,
                              "variants": variants, "rounds": rounds, "ratios_to_fp32": {}}
    for label, values in rounds.items():
        speeds = ", ".join(f"{v['tok_s']:.1f}" for v in values)
        ttfts = ", ".join(f"{v['ttft_ms']:.0f}" for v in values)
        print(f"{label:>18}: tok/s {speeds}; TTFT ms {ttfts}")
    for label, values in rounds.items():
        if label == "fp32":
            continue
        ratios = [v["tok_s"] / f["tok_s"] for v, f in zip(values, rounds["fp32"], strict=True)]
        report["ratios_to_fp32"][label] = ratios
        print(f"{label:>18} ÷ fp32: {', '.join(f'{r:.3f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.3f})")
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fp32", type=Path, help="the float32 artifact (not with --passes)")
    p.add_argument("--quantized", type=named, action="append", required=True,
                   metavar="NAME=DIR", help="a quantised artifact with engine_float32.onnx")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wide", type=int, help="--float32-pass-tokens when on (default: the "
                   "artifact's, 256 for int4/gguf, 1024 for int8)")
    p.add_argument("--passes", type=lambda s: [int(x) for x in s.split(",")],
                   help="time single prefill passes of these numbers of prompts instead")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.fp32 is None and not args.passes:
        raise SystemExit("float32_twin: --fp32 is required (unless --passes)")
    for path in [*([args.fp32] if args.fp32 else []), *(d for _, d in args.quantized)]:
        if not (path / "manifest.json").is_file():
            raise SystemExit(f"float32_twin: {path} is not an artifact (no manifest.json)")
    report = passes(args) if args.passes else run(args)
    if args.out:
        from model.data import write_text_atomic

        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
