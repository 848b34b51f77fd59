"""Decode and prefill speed on one GGUF file, beside llama.cpp's own `llama-batched-bench`,
in one run.

Usage (from the repository root, in the dev venv; the tools from
`python -m benchmarks llamacpp-tools --build`, the artifact exported from that file with
`attnserve export --quantize gguf --engine-graph`):
    python -m benchmarks sized-speed --gguf .cache/bench-work/sized/llama-1b/llama-1b-Q4_K_M.gguf \\
        --artifact /tmp/w/artifact [--batches 1,8,32] [--prompt 64] [--new 128] [--rounds 3]
    python -m benchmarks sized-speed --gguf FILE.gguf --artifact ART_GGML --baseline ART_NBITS

Each round runs both engines in turn at every batch size, so a busy machine slows both
alike: ours through the engine itself (`benchmarks/lib/runner_engine.py`: one static batch of
random prompts, greedy, end-of-sequence no stop), llama.cpp's `llama-batched-bench -npp
PROMPT -ntg NEW -npl B -t THREADS` (its S_TG column: B·NEW tokens over the generation
time; its S_PP column: B·PROMPT prompt tokens over their processing time). Decode tok/s of
ours: B·(NEW − 1) tokens after every row's first, over the time after it; prefill tok/s:
B·PROMPT over the time to every row's first token. Prints the median of the rounds per
engine and batch size and their ratio, decode and prefill; ``--json`` also writes every
round. Timings depend on the machine and what else runs on it, so compare engines only
within one run.

``--baseline`` adds a second artifact of ours from the same file to every round (e.g. the
file exported with ``--kernel nbits`` beside ``--kernel ggml``), printed with its ratio to
``--artifact``. First the machine's read bandwidth is measured (``--threads`` threads summing
1 GiB) and the batch-1 decode bound it sets for the file: bandwidth ÷ the bytes a token reads
(the file's tensors, less token_embd where the file has its own output.weight: only one
embedding row is read a token); each engine's batch-1 decode is printed as a share of it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import add_threads_option
from model.data import write_text_atomic

ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)\|\s*$")


@dataclass(frozen=True)
class Speeds:
    prefill: float  # prompt tokens a second
    decode: float  # generated tokens a second


def batched_bench_speeds(output: str) -> dict[int, Speeds]:
    """llama-batched-bench's table → {B: (S_PP, S_TG) t/s} (columns PP, TG, B, N_KV,
    T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s)."""
    found: dict[int, Speeds] = {}
    for line in output.splitlines():
        match = ROW.match(line.strip())
        if match is None:
            continue
        cells = [c.strip() for c in match[4].split("|")]
        if len(cells) >= 5:
            found[int(match[3])] = Speeds(prefill=float(cells[2]), decode=float(cells[4]))
    return found


def llamacpp_speeds(tool: Path, gguf: Path, batch: int, prompt: int, new: int,
                    threads: int) -> Speeds:
    argv = [str(tool), "-m", str(gguf), "-c", str(batch * (prompt + new) + 64),
            "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new),
            "-npl", str(batch), "-t", str(threads), "-tb", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    table = batched_bench_speeds(done.stdout)
    if done.returncode != 0 or batch not in table:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"sized_speed: llama-batched-bench failed ({done.returncode}): "
                         + " / ".join(tail))
    return table[batch]


def bytes_a_token(gguf_path: Path) -> int:
    """Bytes of the file a decode step reads for one token: every tensor, less token_embd
    where the file has its own output.weight (then one embedding row is read a token)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf_path).tensors}
    untied = "output.weight" in tensors
    return sum(n for name, n in tensors.items() if not (untied and name == "token_embd.weight"))


def ours_speeds(runner: Any, vocab: int, batch: int, prompt: int, new: int,
                seed: int) -> Speeds:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, vocab, (batch, prompt)).tolist()
    result = runner.generate(prompts, new)
    return Speeds(prefill=batch * prompt / result.ttft_s,
                  decode=batch * (new - 1) / (result.total_s - result.ttft_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks sized-speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    add_threads_option(p)
    p.add_argument("--baseline", type=Path,
                   help="another artifact of ours from the same file, run in every round")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from benchmarks.lib.runner_engine import EngineRunner
    from benchmarks.llamacpp_tools import tool_path
    from service.contract import io_spec as io

    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: expected comma-separated integers")
    artifacts = {"ours": args.artifact,
                 **({"baseline": args.baseline} if args.baseline is not None else {})}
    for path in (args.gguf, *(a / io.MANIFEST_FILE for a in artifacts.values())):
        if not path.is_file():
            print(f"sized_speed: {path} is not a file", file=sys.stderr)
            return 2
    try:
        tool = tool_path("llama-batched-bench")
    except FileNotFoundError as exc:
        print(f"sized_speed: {exc}", file=sys.stderr)
        return 2
    from benchmarks.lib.ceiling import read_bandwidth

    bandwidth = read_bandwidth(args.threads)
    per_token = bytes_a_token(args.gguf)
    bound = bandwidth / per_token
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); the file reads "
          f"{per_token / 1e6:.1f} MB a token: batch-1 decode bound {bound:.1f} tok/s", flush=True)
    vocab = io.ArtifactConfig.load(args.artifact).vocab_size
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for batch in batches:
            row: dict[str, Any] = {"round": r, "batch": batch}
            for name, artifact in artifacts.items():
                # one engine (and its spinning thread pool) at a time on the cores
                runner = EngineRunner(artifact, args.threads, max_len=args.prompt + args.new + 8)
                try:
                    ours_speeds(runner, vocab, 1, 8, 4, seed=0)  # warm-up: first runs
                    got = ours_speeds(runner, vocab, batch, args.prompt, args.new, seed=r)
                finally:
                    runner.close()
                row[name], row[f"{name}_prefill"] = got.decode, got.prefill
            theirs = llamacpp_speeds(tool, args.gguf, batch, args.prompt, args.new,
                                     args.threads)
            row["llamacpp"], row["llamacpp_prefill"] = theirs.decode, theirs.prefill
            rounds.append(row)
            print(f"round {r} batch {batch:3d}: decode " + ", ".join(
                f"{k} {row[k]:8.1f}" for k in (*artifacts, "llamacpp")) + " tok/s; prefill "
                + ", ".join(f"{k} {row[k + '_prefill']:8.1f}" for k in (*artifacts, "llamacpp")),
                flush=True)
    summary: dict[str, dict[int, dict[str, float]]] = {"decode": {}, "prefill": {}}
    for phase, suffix in (("decode", ""), ("prefill", "_prefill")):
        print(f"\n{phase} tok/s, prompt {args.prompt} -> {args.new}, {args.threads} threads, "
              f"median of {args.rounds} rounds ({args.gguf.name})")
        for batch in batches:
            med = {k: statistics.median(r[k + suffix] for r in rounds if r["batch"] == batch)
                   for k in (*artifacts, "llamacpp")}
            summary[phase][batch] = {**med, "ratio": med["ours"] / med["llamacpp"]}
            line = (f"batch {batch:3d}: ours {med['ours']:8.1f}  llama.cpp "
                    f"{med['llamacpp']:8.1f}  ratio {med['ours'] / med['llamacpp']:.2f}")
            if "baseline" in med:
                summary[phase][batch]["baseline_ratio"] = med["ours"] / med["baseline"]
                line += (f"  baseline {med['baseline']:8.1f}  ours/baseline "
                         f"{med['ours'] / med['baseline']:.2f}")
            if phase == "decode" and batch == 1:
                line += "  of the bound: " + ", ".join(
                    f"{k} {med[k] / bound:.0%}" for k in (*artifacts, "llamacpp"))
            print(line)
    if args.json is not None:
        figures = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                   "summary": summary, "read_bandwidth": bandwidth,
                   "bytes_a_token": per_token, "decode_bound": bound}
        write_text_atomic(args.json, json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
