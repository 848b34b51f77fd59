"""ONNX Runtime's CUDA provider beside its CPU provider, on one artifact, in one process.

Usage (on a machine with onnxruntime-gpu and a CUDA GPU):
    python -m benchmarks.cuda_check --artifact artifacts/smollm2-135m-instruct \\
        [--threads 16] [--batches 1,32] [--prompt-len 64] [--new 128] [--reps 3] \\
        [--out FILE.json]

Three checks, each printed and written to the JSON:
1. **Logits, by names.** model.onnx run by a plain ONNX Runtime session on each provider
   (no engine code): the last position's logits of a chat prompt, max |CUDA - CPU|, and
   whether the arg-max agrees.
2. **Greedy answers through the engine.** ``Engine.from_artifact`` with ``--device cuda``
   and ``--device cpu`` (as the server builds it), four chat questions at once: each
   answer's text and the number of leading tokens the two providers share.
3. **Speed.** Tokens/s of the engine on each provider at each batch size (a
   ``--prompt-len`` prompt, ``--new`` greedy tokens, end-of-sequence not a stop, median of
   ``--reps`` after one warm-up); with ``--host-cache``, CUDA also with the whole past
   sent through the host at every step, the way it ran before the cache stayed on the
   device.

CUDA's float32 matrix products may round differently from the CPU's (TF32 where the
provider allows it), so answers may part after a near tie; the logits check says by how
much the two providers differ before any of that compounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 plus 30?",
]
FILLER = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "


def chat_prompts(artifact_dir: Path) -> tuple[list[list[int]], Any]:
    """The questions rendered by the artifact's own chat template, as token ids."""
    from service.artifact.loader import open_artifact
    from service.settings import Settings

    artifact = open_artifact(Settings.model_validate({"model": artifact_dir}))
    prompts = [artifact.codec.encode(artifact.chat_template.render(
        [{"role": "user", "content": q}]), add_special_tokens=False) for q in QUESTIONS]
    return prompts, artifact


def logits_by_names(artifact_dir: Path, prompt: list[int], threads: int) -> dict[str, Any]:
    """model.onnx's last-position logits on each provider, by the contract's input names."""
    import onnxruntime as ort

    from service.contract import io_spec as io

    config = io.ArtifactConfig.load(artifact_dir)
    ids = np.asarray([prompt], np.int64)  # (1, T)
    feeds: dict[str, np.ndarray] = {
        io.INPUT_IDS: ids,
        io.ATTENTION_MASK: np.ones_like(ids),
        io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None],
    }
    empty = np.zeros((1, config.kv_heads, 0, config.head_dim), np.dtype(config.kv_dtype))
    for name in io.past_names(config.n_layers):
        feeds[name] = empty  # (1, nkv, 0, hs): no past
    last: dict[str, np.ndarray] = {}
    for provider in ("CUDAExecutionProvider", "CPUExecutionProvider"):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(artifact_dir / io.MODEL_FILE), options,
                                       providers=[provider])
        if session.get_providers()[0] != provider:
            raise SystemExit(f"cuda_check: ONNX Runtime did not start {provider} "
                             f"(got {session.get_providers()})")
        logits = session.run([io.LOGITS], feeds)[0]  # (1, T, V)
        last[provider] = logits[0, -1].astype(np.float64)
    cuda, cpu = last["CUDAExecutionProvider"], last["CPUExecutionProvider"]
    return {"max_abs_diff": float(np.abs(cuda - cpu).max()),
            "logit_scale": float(np.abs(cpu).max()),
            "argmax_cuda": int(cuda.argmax()), "argmax_cpu": int(cpu.argmax()),
            "argmax_agrees": bool(cuda.argmax() == cpu.argmax())}


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure_device(artifact_dir: Path, device: str, threads: int, prompts: list[list[int]],
                   eos_stop_new: int, batches: list[int], prompt: list[int], new: int,
                   reps: int, resident: bool = True) -> dict[str, Any]:
    """Greedy answers and tokens/s of the engine on one provider; ``resident=False``: under
    CUDA, the whole past through the host at every step (as before the cache stayed on
    the device)."""
    from benchmarks.runner_engine import EngineRunner
    from service.engine.portable import ModelGraphRunner

    runner = EngineRunner(artifact_dir, threads, name=f"engine-{device}",
                          max_len=len(prompt) + new + 8,
                          device="cuda" if device.startswith("cuda") else "cpu")
    if not resident:
        assert isinstance(runner.engine.runner, ModelGraphRunner)
        runner.engine.runner.resident = False
    try:
        provider = runner.engine.provider
        answers = runner.generate_until(prompts, [eos_stop_new] * len(prompts),
                                        stop_at_eos=True).tokens
        speed: dict[str, Any] = {}
        for batch in batches:
            rows = [list(prompt)] * batch
            runner.generate(rows, 8)  # warm-up: this batch size's shapes
            rates = []
            for _ in range(reps):
                result = runner.generate(rows, new)
                rates.append(batch * new / result.total_s)
            speed[str(batch)] = {"tok_s": statistics.median(rates), "rounds": rates}
            print(f"  {device:>4} batch {batch:>2}: {statistics.median(rates):8.1f} tok/s "
                  f"({', '.join(f'{r:.1f}' for r in rates)})", flush=True)
    finally:
        runner.close()
    return {"provider": provider, "graph_file": runner.engine.graph_file,
            "answers": answers, "speed": speed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise SystemExit("cuda_check: onnxruntime has no CUDAExecutionProvider here "
                         f"(available: {', '.join(ort.get_available_providers())})")
    prompts, artifact = chat_prompts(args.artifact)
    filler = artifact.codec.encode(FILLER * 64, add_special_tokens=False)
    if len(filler) < args.prompt_len:
        raise SystemExit(f"cuda_check: --prompt-len {args.prompt_len} is longer than the "
                         f"filler text ({len(filler)} tokens)")
    prompt = filler[:args.prompt_len]
    report: dict[str, Any] = {"artifact": str(args.artifact), "onnxruntime": ort.__version__,
                              "threads": args.threads, "prompt_len": args.prompt_len,
                              "new": args.new, "reps": args.reps}
    report["logits"] = logits = logits_by_names(args.artifact, prompts[0], args.threads)
    print(f"logits, model.onnx by names: max |cuda - cpu| {logits['max_abs_diff']:.3g} "
          f"(largest |logit| {logits['logit_scale']:.3g}), arg-max agrees: "
          f"{logits['argmax_agrees']}", flush=True)
    devices = {}
    for device in ("cuda", "cpu"):
        devices[device] = measure_device(args.artifact, device, args.threads, prompts,
                                         args.answer_tokens, args.batches, prompt, args.new,
                                         args.reps)
    if args.host_cache:
        devices["cuda-host-cache"] = measure_device(
            args.artifact, "cuda-host-cache", args.threads, prompts, args.answer_tokens,
            args.batches, prompt, args.new, args.reps, resident=False)
    report["devices"] = {d: {k: v for k, v in r.items() if k != "answers"}
                         for d, r in devices.items()}
    report["answers"] = []
    for i, question in enumerate(QUESTIONS):
        cuda, cpu = devices["cuda"]["answers"][i], devices["cpu"]["answers"][i]
        entry = {"question": question, "cuda": artifact.codec.decode(cuda),
                 "cpu": artifact.codec.decode(cpu), "tokens_cuda": len(cuda),
                 "tokens_cpu": len(cpu), "shared_prefix": shared_prefix(cuda, cpu)}
        report["answers"].append(entry)
        print(f"{question!r}: shared {entry['shared_prefix']}/{max(len(cuda), len(cpu))} "
              f"tokens\n  cuda: {entry['cuda']!r}\n  cpu:  {entry['cpu']!r}", flush=True)
    for batch in map(str, args.batches):
        speed = {d: r["speed"][batch]["tok_s"] for d, r in devices.items()}
        line = f"batch {batch}: cuda / cpu {speed['cuda'] / speed['cpu']:.2f}x"
        if "cuda-host-cache" in speed:
            line += (f", cache on the device / through the host "
                     f"{speed['cuda'] / speed['cuda-host-cache']:.2f}x")
        print(line, flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2, help="CPU provider threads")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=48,
                   help="most tokens of each greedy chat answer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--host-cache", action="store_true",
                   help="also time CUDA with the whole past through the host every step")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        sys.exit(f"cuda_check: --artifact {args.artifact} has no manifest.json")
    started = time.perf_counter()
    report = run(args)
    report["wall_s"] = time.perf_counter() - started
    if args.out:
        from model.data import write_text_atomic

        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
