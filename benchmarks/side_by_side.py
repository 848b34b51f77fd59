"""Side by side: our engine beside what users would pick instead (what `make bench` runs).

Usage (from the repository root, in the dev venv; ``python -m benchmarks --presets ...``,
options and no name, as results/ records it, is this benchmark too):
    python -m benchmarks side-by-side                     # small and base, full run (~12 min)
    python -m benchmarks side-by-side --presets small --quick      # smoke run, fewer tokens
    python -m benchmarks side-by-side --setup-optimum     # also build the Optimum side env
    python -m benchmarks side-by-side --presets gpt2 --setup-llamacpp  # vs CTranslate2, llama.cpp
    python -m benchmarks side-by-side --presets gpt2 --engines engine,llamacpp_f32 --batch-sizes 1
    python -m benchmarks side-by-side --presets smollm2-135m  # SmolLM2-135M shape vs CTranslate2
    python -m benchmarks side-by-side --presets smollm2-135m-instruct --work .cache/bench-work
                                 # the real SmolLM2 GGUF: llama.cpp on the same file, ours
    python -m benchmarks side-by-side --presets smollm2-135m-instruct --rounds 3
                                 # the same, every engine measured in three turns
    python -m benchmarks side-by-side --ckpt small=checkpoints/default --out results/bench/mine

Writes results.json, results.md and results.png under --out (default
results/bench/<date>/) and copies them to results/bench/latest.{json,md,png}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import date
from pathlib import Path

from benchmarks.lib.measure import add_threads_option

DEFAULT_OPTIMUM_VENV = Path(".cache/optimum-venv")
DEFAULT_LLAMACPP_VENV = Path(".cache/llamacpp-venv")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _mapping(items: list[str] | None, flag: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for item in items or []:
        preset, sep, path = item.partition("=")
        if not sep or not preset or not path:
            raise ValueError(f"{flag} expects PRESET=DIR, got {item!r}")
        out[preset] = Path(path)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks side-by-side",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", type=_names, default=["small", "base"],
                   help="comma-separated presets (default small,base); gpt2 is GPT-2 small "
                        "(124M, random weights) against CTranslate2 and llama.cpp; "
                        "smollm2-135m is SmolLM2-135M's Llama shape against CTranslate2; "
                        "smollm2-135m-instruct is the real SmolLM2-135M-Instruct GGUF against "
                        "llama.cpp on that very file (Q4_1, q8_0, f32), CTranslate2 and "
                        "transformers")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 new tokens, 1 repetition, small ceiling arrays")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default results/bench/<date>)")
    p.add_argument("--no-latest", action="store_true",
                   help="do not copy the results to results/bench/latest.*")
    add_threads_option(p)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    p.add_argument("--nocache-batch-sizes", type=_ints, default=None,
                   help="batch sizes for the no-cache loop (default 1; all with --quick)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32],
                   help="HTTP client concurrencies (1,8,32)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None, help="128 (16 with --quick)")
    p.add_argument("--long-new-tokens", type=int, default=None,
                   help="new tokens of the KV-vs-no-cache comparison: 512 (32 with --quick)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions per row (default 3/2/2 for batch 1/8/32; 1 quick)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every engine this many times, in turn (A B C, A B C, ...), "
                        "and report each row's median over the rounds and each ratio as the "
                        "median of its per-round ratios: drift of a shared machine then "
                        "moves both sides of a ratio alike (default 1)")
    p.add_argument("--engines", type=_names, default=None,
                   help="subset of torch_nocache,torch_kv,hf_generate,ort_plain,optimum,"
                        "engine,engine_int8,engine_int4,engine_gguf,http,ct2,ct2_int8,"
                        "llamacpp_f32,llamacpp_q8_0,llamacpp_q4_1 "
                        "(default: all but the peers for small/base; hf_generate, ct2, "
                        "ct2_int8, llamacpp_f32, llamacpp_q8_0, engine, engine_int8 for gpt2; "
                        "the same less llama.cpp for smollm2-135m; every peer and every "
                        "precision of ours for smollm2-135m-instruct)")
    p.add_argument("--ckpt", action="append", metavar="PRESET=DIR",
                   help="use this checkpoint for a preset instead of random init")
    p.add_argument("--artifact", action="append", metavar="PRESET=DIR",
                   help="use this fp32 artifact instead of exporting one")
    p.add_argument("--artifact-int8", action="append", metavar="PRESET=DIR",
                   help="use this int8 artifact instead of exporting one")
    p.add_argument("--artifact-int4", action="append", metavar="PRESET=DIR",
                   help="use this int4 artifact instead of exporting one")
    p.add_argument("--artifact-gguf", action="append", metavar="PRESET=DIR",
                   help="use this --quantize gguf artifact (the GGUF's own blocks)")
    p.add_argument("--work", type=Path, default=None,
                   help="work directory, kept and reused: conversions and exports already "
                        "in it are not made again (default: a temporary one)")
    p.add_argument("--optimum-venv", type=Path, default=DEFAULT_OPTIMUM_VENV,
                   help="overlay venv with optimum (default .cache/optimum-venv)")
    p.add_argument("--setup-optimum", action="store_true",
                   help="create the Optimum overlay venv if it is missing (pip, --no-deps)")
    p.add_argument("--llamacpp-venv", type=Path, default=DEFAULT_LLAMACPP_VENV,
                   help="overlay venv with llama-cpp-python (default .cache/llamacpp-venv)")
    p.add_argument("--setup-llamacpp", action="store_true",
                   help="build the llama.cpp overlay venv if it is missing (compiles "
                        "llama.cpp from source: ~20 min on 2 cores, once)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the temporary checkpoints and artifacts")
    return p


def _optimum(args: argparse.Namespace) -> tuple[Path | None, str]:
    from benchmarks.lib.optimum_env import ensure_overlay, has_optimum, overlay_python

    try:
        import optimum.onnxruntime  # noqa: F401

        return Path(sys.executable), ""
    except Exception:
        pass
    python = overlay_python(args.optimum_venv)
    if python.exists() and has_optimum(python):
        return python, ""
    if args.setup_optimum:
        try:
            return ensure_overlay(args.optimum_venv), ""
        except Exception as exc:
            return None, f"optimum could not be installed here: {exc}"
    return None, (f"optimum not installed (transformers 5 in .venv is too new for it); "
                  f"run with --setup-optimum to build {args.optimum_venv}")


def _llamacpp(args: argparse.Namespace) -> tuple[Path | None, str]:
    from benchmarks.llamacpp_env import ensure_overlay, has_llama_cpp, overlay_python

    if args.setup_llamacpp:  # builds once, and again when the build flags changed
        try:
            return ensure_overlay(args.llamacpp_venv), ""
        except Exception as exc:
            return None, f"llama-cpp-python could not be built here: {exc}"
    python = overlay_python(args.llamacpp_venv)
    if python.exists() and has_llama_cpp(python):
        return python, ""
    return None, (f"llama-cpp-python is not built; run with --setup-llamacpp to compile it "
                  f"into {args.llamacpp_venv}")


def handle(args: argparse.Namespace) -> int:
    from benchmarks.lib.harness import (
        DEFAULT_ENGINES,
        ENGINES,
        SMALL_ENGINES,
        BenchOptions,
        run_bench,
    )

    engines = args.engines
    wanted = set(engines) if engines else {
        e for p in args.presets for e in DEFAULT_ENGINES.get(p, SMALL_ENGINES)}
    unknown = sorted(set(engines or []) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if args.threads < 1 or args.prompt_tokens < 1 or args.rounds < 1:
        raise ValueError("--threads, --prompt-tokens and --rounds must be positive")
    quick = args.quick
    out = args.out or Path("results/bench") / date.today().isoformat()
    optimum_python, optimum_note = (None, "not requested")
    if "optimum" in wanted:
        optimum_python, optimum_note = _optimum(args)
    llamacpp_python, llamacpp_note = (None, "not requested")
    if any(e.startswith("llamacpp") for e in wanted):
        llamacpp_python, llamacpp_note = _llamacpp(args)
    reps = ({b: args.reps for b in args.batch_sizes} if args.reps else
            {b: 1 for b in args.batch_sizes} if quick else
            {b: 3 if b == 1 else 2 for b in args.batch_sizes})
    opts = BenchOptions(
        presets=args.presets, out_dir=out,
        latest_dir=None if args.no_latest else Path("results/bench"),
        quick=quick, threads=args.threads, batch_sizes=args.batch_sizes,
        nocache_batch_sizes=args.nocache_batch_sizes or (args.batch_sizes if quick else [1]),
        concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens or (16 if quick else 128),
        long_new_tokens=args.long_new_tokens or (32 if quick else 512),
        reps=reps, rounds=args.rounds, http_waves=1 if quick else 2, engines=engines,
        ckpts=_mapping(args.ckpt, "--ckpt"), artifacts=_mapping(args.artifact, "--artifact"),
        artifacts_int8=_mapping(args.artifact_int8, "--artifact-int8"),
        artifacts_int4=_mapping(args.artifact_int4, "--artifact-int4"),
        artifacts_gguf=_mapping(args.artifact_gguf, "--artifact-gguf"), work_dir=args.work,
        optimum_python=optimum_python, optimum_note=optimum_note,
        llamacpp_python=llamacpp_python, llamacpp_note=llamacpp_note, keep_work=args.keep_work,
        command="python -m benchmarks side-by-side " + shlex.join(sys.argv[1:]),
    )
    run = run_bench(opts)
    for preset, result in run["presets"].items():
        for t in result["targets"]:
            print(f"[{preset}] {t['status']}: {t['target']} — {t['detail']}")
    print(f"results: {out / 'results.md'} (json, png beside it); "
          f"took {run['total_s']:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return handle(args)
    except KeyboardInterrupt:
        print("benchmarks: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"benchmarks: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
