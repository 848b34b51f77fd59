"""ONNX Runtime's CUDA provider beside its CPU provider, on one model, in one process.

Usage (on a machine with onnxruntime-gpu and a CUDA GPU):
    python -m benchmarks cuda-check --artifact artifacts/smollm2-135m-instruct \\
        [--half artifacts/smollm2-fp16] [--int4 artifacts/smollm2-int4] [--threads 16] \\
        [--batches 1,8,32,128] \\
        [--cpu-batches 1,32] [--prompt-len 64] [--new 128] [--reps 3] [--out FILE.json]

``--artifact`` is a float32 artifact (with --engine-graph); ``--half`` the same checkpoint
exported with ``--dtype float16 --engine-graph``, served on CUDA by engine.onnx with the KV
pool on the device (service/engine/cuda.py). Three checks, each printed and written to
the JSON:
1. **Logits, by names.** No engine code: model.onnx (float32) on each provider, and the
   float16 engine.onnx on CUDA, against float32 model.onnx on the CPU: the last
   position's logits of a chat prompt, max |difference|, and whether the arg-max agrees.
2. **Greedy answers through the engine.** ``Engine`` as the server builds it, four chat
   questions at once, on every configuration: each answer's text and the number of
   leading tokens it shares with the CPU's float32 answer.
3. **Speed.** Tokens/s of the engine per configuration and batch size (a
   ``--prompt-len`` prompt, ``--new`` greedy tokens, end-of-sequence not a stop, median of
   ``--reps`` after one warm-up). Configurations: ``cuda-fp32`` (model.onnx, its cache on
   the device between steps), ``cuda-fp16`` (engine.onnx, decode steps replayed as CUDA
   graphs), ``cuda-fp16-launch`` (the same with every kernel launched), ``cuda-int4`` (with
   ``--int4``: model.onnx's 4-bit MatMulNBits on CUDA), and ``cpu-fp32``
   (engine.onnx on ``--threads`` cores, at ``--cpu-batches``); with ``--host-cache``, also
   model.onnx with the whole past sent through the host at every step.

CUDA's float32 matrix products may round differently from the CPU's (TF32 where the
provider allows it), and the float16 graphs round every product, so answers may part
after a near tie; the logits check says by how much the providers differ before any of
that compounds.
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

from benchmarks.lib.measure import add_threads_option, shared_prefix

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
    return {"cpu_logits": cpu, "max_abs_diff": float(np.abs(cuda - cpu).max()),
            "logit_scale": float(np.abs(cpu).max()),
            "argmax_cuda": int(cuda.argmax()), "argmax_cpu": int(cpu.argmax()),
            "argmax_agrees": bool(cuda.argmax() == cpu.argmax())}


def half_logits_by_names(artifact_dir: Path, prompt: list[int]) -> np.ndarray:
    """The float16 engine.onnx's last-position logits on CUDA, by the engine spec's names."""
    import onnxruntime as ort

    from service.contract import engine_spec as es
    from service.contract import io_spec as io

    config = io.ArtifactConfig.load(artifact_dir)
    session = ort.InferenceSession(str(artifact_dir / es.ENGINE_FILE),
                                   providers=["CUDAExecutionProvider"])
    t = len(prompt)
    cache = np.zeros((1, config.kv_heads, t, config.head_dim), np.float16)  # (1, nkv, T, hs)
    feeds: dict[str, np.ndarray] = {
        io.INPUT_IDS: np.asarray([prompt], np.int64),
        io.POSITION_IDS: np.arange(t, dtype=np.int64)[None],
        es.SEQLENS_K: np.array([t - 1], np.int32),
        es.TOTAL_SEQUENCE_LENGTH: np.array([t], np.int32),
        es.LOGITS_INDEX: np.array([[t - 1]], np.int64),
        **{name: cache for name in io.past_names(config.n_layers)}}
    logits = session.run([io.LOGITS], feeds)[0]  # (1, 1, V)
    return logits[0, -1].astype(np.float64)


def measure_device(artifact_dir: Path, device: str, threads: int, prompts: list[list[int]],
                   eos_stop_new: int, batches: list[int], prompt: list[int], new: int,
                   reps: int, resident: bool = True, cuda_graphs: bool = True
                   ) -> dict[str, Any]:
    """Greedy answers and tokens/s of the engine in one configuration (``device`` names
    it: "cpu…" runs on the CPU); ``resident=False``: under CUDA, model.onnx's whole past
    through the host at every step (as before the cache stayed on the device);
    ``cuda_graphs=False``: every kernel of a float16 artifact's decode steps launched."""
    from benchmarks.lib.runner_engine import EngineRunner
    from service.engine.engine_graph_runner import EngineGraphRunner
    from service.engine.model_graph_runner import ModelGraphRunner

    runner = EngineRunner(artifact_dir, threads, name=f"engine-{device}",
                          max_len=len(prompt) + new + 8,
                          device="cuda" if device.startswith("cuda") else "cpu",
                          cuda_graphs=cuda_graphs, max_batch_size=max(batches))
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
        engine_runner = runner.engine.runner
        replays = (engine_runner.graph_replays if isinstance(engine_runner, EngineGraphRunner)
                   else 0)
    finally:
        runner.close()
    return {"provider": provider, "graph_file": runner.engine.graph_file,
            "graph_replays": replays, "answers": answers, "speed": speed}


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
    report: dict[str, Any] = {"artifact": str(args.artifact), "half": str(args.half),
                              "int4": str(args.int4),
                              "onnxruntime": ort.__version__, "threads": args.threads,
                              "prompt_len": args.prompt_len, "new": args.new,
                              "reps": args.reps}
    report["logits"] = logits = logits_by_names(args.artifact, prompts[0], args.threads)
    print(f"logits, model.onnx by names: max |cuda - cpu| {logits['max_abs_diff']:.3g} "
          f"(largest |logit| {logits['logit_scale']:.3g}), arg-max agrees: "
          f"{logits['argmax_agrees']}", flush=True)
    if args.half is not None:
        cpu = logits.pop("cpu_logits")
        half = half_logits_by_names(args.half, prompts[0])
        report["logits_half"] = {"max_abs_diff": float(np.abs(half - cpu).max()),
                                 "argmax_half": int(half.argmax()),
                                 "argmax_cpu": int(cpu.argmax()),
                                 "argmax_agrees": bool(half.argmax() == cpu.argmax())}
        print(f"logits, float16 engine.onnx on CUDA by names against float32 on the CPU: "
              f"max |diff| {report['logits_half']['max_abs_diff']:.3g}, arg-max agrees: "
              f"{report['logits_half']['argmax_agrees']}", flush=True)
    logits.pop("cpu_logits", None)
    configs: list[tuple[str, Path, dict[str, Any], list[int]]] = [
        ("cuda-fp32", args.artifact, {}, args.batches)]
    if args.half is not None:
        configs += [("cuda-fp16", args.half, {}, args.batches),
                    ("cuda-fp16-launch", args.half, {"cuda_graphs": False}, args.batches)]
    if args.int4 is not None:
        configs.append(("cuda-int4", args.int4, {}, args.batches))
    if args.host_cache:
        configs.append(("cuda-fp32-host-cache", args.artifact, {"resident": False},
                        args.batches))
    configs.append(("cpu-fp32", args.artifact, {}, args.cpu_batches))
    devices = {}
    for name, art, options, batches in configs:
        print(f"{name}:", flush=True)
        devices[name] = measure_device(art, name, args.threads, prompts, args.answer_tokens,
                                       batches, prompt, args.new, args.reps, **options)
    report["devices"] = {d: {k: v for k, v in r.items() if k != "answers"}
                         for d, r in devices.items()}
    report["answers"] = []
    reference = devices["cpu-fp32"]["answers"]
    for i, question in enumerate(QUESTIONS):
        entry: dict[str, Any] = {"question": question,
                                 "cpu-fp32": artifact.codec.decode(reference[i])}
        for name, result in devices.items():
            if name == "cpu-fp32":
                continue
            got = result["answers"][i]
            entry[name] = artifact.codec.decode(got)
            entry[f"{name}_shared"] = f"{shared_prefix(got, reference[i])}/" \
                                      f"{max(len(got), len(reference[i]))}"
        report["answers"].append(entry)
        print(json.dumps(entry, ensure_ascii=False), flush=True)
    print(f"\n{'tok/s':>22}" + "".join(f"{'b' + str(b):>10}" for b in args.batches))
    for name, result in devices.items():
        cells = [result["speed"].get(str(b), {}).get("tok_s") for b in args.batches]
        print(f"{name:>22}" + "".join(f"{c:10.1f}" if c else f"{'-':>10}" for c in cells))
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--half", type=Path,
                   help="the same checkpoint exported with --dtype float16 --engine-graph")
    p.add_argument("--int4", type=Path,
                   help="the same checkpoint exported with --quantize int4 (model.onnx's "
                        "4-bit MatMulNBits on CUDA)")
    add_threads_option(p, "CPU provider threads")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 32, 128])
    p.add_argument("--cpu-batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 32], help="the CPU's batch sizes (a subset: it is slow)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=48,
                   help="most tokens of each greedy chat answer")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--host-cache", action="store_true",
                   help="also time CUDA with the whole past through the host every step")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    for flag, path in (("--artifact", args.artifact), ("--half", args.half),
                       ("--int4", args.int4)):
        if path is not None and not (path / "manifest.json").is_file():
            sys.exit(f"cuda_check: {flag} {path} has no manifest.json")
    started = time.perf_counter()
    report = run(args)
    report["wall_s"] = time.perf_counter() - started
    if args.out:
        from model.data import write_text_atomic

        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
