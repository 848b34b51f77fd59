"""One benchmark job in a process of its own, so its memory figures are its own.

Usage (started by the harness, not by hand):
    python -m benchmarks.lib.worker SPEC.json RESULT.json

SPEC names a job (ceiling, measure, kv_vs_nocache, agreement, optimum_export, ct2_convert,
gguf_export, gguf_dequantize, llamacpp_quantize, llamacpp_agreement) and its inputs;
RESULT receives {"result": ..., "memory": {...}} or {"error": "..."}. Thread pools are
limited through the environment by the harness before this process starts
(OMP/MKL/OpenBLAS), and again here through each library's own switch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.lib.engines import ENGINE_ARTIFACTS, LLAMACPP_FILES
from benchmarks.lib.measure import measure_runner, proc_memory_mb

TORCH_ENGINES = ("torch_nocache", "torch_kv", "hf_generate", "optimum")


def _limit_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)


def _make_runner(spec: dict[str, Any]) -> Any:
    engine, paths, threads = spec["engine"], spec["paths"], spec["threads"]
    if engine in TORCH_ENGINES:
        _limit_torch_threads(threads)
    if engine == "torch_nocache":
        from benchmarks.lib.runners_torch import TorchNoCache

        return TorchNoCache(Path(paths["ckpt"]))
    if engine == "torch_kv":
        from benchmarks.lib.runners_torch import TorchKV

        return TorchKV(Path(paths["ckpt"]))
    if engine == "hf_generate":
        from benchmarks.lib.runners_torch import HFGenerate

        return HFGenerate(Path(paths["hf"]))
    if engine == "optimum":
        from benchmarks.lib.runners_torch import OptimumORT

        return OptimumORT(Path(paths["optimum"]), threads)
    if engine == "ort_plain":
        from benchmarks.lib.runners_ort import PlainORT

        return PlainORT(Path(paths["artifact"]), threads)
    if engine in ENGINE_ARTIFACTS:
        from benchmarks.lib.runner_engine import EngineRunner

        return EngineRunner(Path(paths[ENGINE_ARTIFACTS[engine]]), threads, name=engine,
                            max_len=spec.get("n_ctx"))
    if engine in ("ct2", "ct2_int8"):
        from benchmarks.lib.runners_ct2 import COMPUTE_TYPES, CT2Generator

        return CT2Generator(Path(paths[engine]), threads, COMPUTE_TYPES[engine], name=engine)
    if engine in LLAMACPP_FILES:
        from benchmarks.lib.runner_llamacpp import LlamaCppBatched

        return LlamaCppBatched(Path(paths[LLAMACPP_FILES[engine]]), threads, spec["n_ctx"],
                               name=engine)
    raise ValueError(f"unknown engine {engine!r}")


def _import_libraries(spec: dict[str, Any]) -> None:
    """Import the engine's libraries first, so 'after import' is the runtime's own floor."""
    engine = spec.get("engine", "")
    if engine in TORCH_ENGINES:
        import torch  # noqa: F401
    if engine in ("hf_generate", "optimum"):
        import transformers  # noqa: F401
    if engine in ("optimum", "ort_plain", *ENGINE_ARTIFACTS):
        import onnxruntime  # noqa: F401
    if engine in ("ct2", "ct2_int8"):
        import ctranslate2  # noqa: F401
    if engine.startswith("llamacpp"):
        import llama_cpp  # noqa: F401


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    job = spec["job"]
    memory: dict[str, Any] = {}
    if job == "ceiling":
        from benchmarks.lib.ceiling import measure_ceiling

        return {"result": measure_ceiling(spec["threads"], spec["quick"])}
    if job == "measure":
        _import_libraries(spec)
        memory["after_import_mb"] = proc_memory_mb().get("VmRSS")
        t0 = time.perf_counter()
        runner = _make_runner(spec)
        load_s = time.perf_counter() - t0
        memory["after_load_mb"] = proc_memory_mb().get("VmRSS")
        rows = measure_runner(runner, spec["prompts"], spec["batch_sizes"], spec["new_tokens"],
                              {int(k): v for k, v in spec["reps"].items()},
                              spec["warmup_tokens"], log=_log)
        memory["peak_mb"] = proc_memory_mb().get("VmHWM")
        result: dict[str, Any] = {"rows": rows, "load_s": load_s}
        if spec["engine"] in LLAMACPP_FILES:
            from benchmarks.lib.runner_llamacpp import LlamaCppBatched

            if isinstance(runner, LlamaCppBatched):  # its settings and last perf print
                result["llamacpp"] = {**runner.info, "perf_print_last": runner.perf_print}
        return {"result": result, "memory": memory}
    if job == "kv_vs_nocache":
        _limit_torch_threads(spec["threads"])
        from benchmarks.lib.runners_torch import kv_vs_nocache

        return {"result": kv_vs_nocache(spec["config"], spec["prompt"], spec["new_tokens"])}
    if job == "agreement":
        from benchmarks.lib.runners_ort import greedy_agreement

        return {"result": greedy_agreement(Path(spec["fp32"]), Path(spec["int8"]),
                                           spec["prompts"], spec["new_tokens"],
                                           spec["threads"])}
    if job == "optimum_export":
        _limit_torch_threads(spec["threads"])
        from benchmarks.lib.runners_torch import optimum_export

        return {"result": optimum_export(Path(spec["hf"]), Path(spec["out"]))}
    if job == "ct2_convert":
        _limit_torch_threads(spec["threads"])
        from benchmarks.lib.runners_ct2 import convert

        return {"result": convert(Path(spec["hf"]), Path(spec["out"]), spec["compute_type"])}
    if job == "gguf_export":
        from benchmarks.lib.gguf_export import write_gguf

        return {"result": write_gguf(Path(spec["hf"]), Path(spec["out"]))}
    if job == "gguf_dequantize":
        from benchmarks.lib.gguf_export import dequantize_gguf

        return {"result": dequantize_gguf(Path(spec["src"]), Path(spec["out"]))}
    if job == "llamacpp_agreement":
        from benchmarks.lib.runner_llamacpp import LlamaCppBatched

        runner = LlamaCppBatched(Path(spec["gguf"]), spec["threads"], spec["n_ctx"],
                                 name="agreement")
        return {"result": runner.teacher_forced(spec["prompts"], spec["expected"])}
    if job == "llamacpp_quantize":
        from benchmarks.lib.runner_llamacpp import quantize

        return {"result": quantize(Path(spec["src"]), Path(spec["out"]), spec["kind"],
                                   spec["threads"])}
    raise ValueError(f"unknown job {job!r}")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    try:
        payload = run_job(spec)
    except Exception as exc:  # reported to the harness, which marks the row as failed
        payload = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    tmp.replace(out_path)
    return 0 if "error" not in payload else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
