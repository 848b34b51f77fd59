"""Orchestrate one benchmark run: prepare each preset, run every engine in its own worker
process, then write JSON, Markdown and PNG and print one PASS/MISS line per target.

An engine whose prerequisites are missing (no optimum, no CTranslate2, an export that
failed) is recorded as not measured with the reason, never silently dropped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.lib.engines import ENGINE_ARTIFACTS, LLAMACPP_FILES
from benchmarks.lib.measure import DEFAULT_THREADS, shared_prefix
from benchmarks.lib.prepare import REPO_ROOT, Prepared, export_copies, make_prompts
from benchmarks.lib.prepare import prepare_checkpoint as _prepare_checkpoint
from service.contract import io_spec as io

ENGINES = ("torch_nocache", "torch_kv", "hf_generate", "ort_plain", "optimum", "engine",
           "engine_int8", "engine_int4", "engine_gguf", "http", "ct2", "ct2_int8",
           "llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_1")
REAL = "smollm2-135m-instruct"  # the real model: llama.cpp runs its shipped GGUF file
# Peers that convert the transformers copy of an imported model (or, llama.cpp, its GGUF).
PEER_ENGINES = ("ct2", "ct2_int8", "llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_1")
# Which presets each peer runs on: our GGUF writer knows GPT-2's tensor layout only, and
# the real model's f32 / q8_0 files are made from its own GGUF.
PEER_PRESETS = {"ct2": ("gpt2", "smollm2-135m", REAL), "ct2_int8": ("gpt2", "smollm2-135m", REAL),
                "llamacpp_f32": ("gpt2", REAL), "llamacpp_q8_0": ("gpt2", REAL),
                "llamacpp_q4_1": (REAL,)}
# What each preset runs when --engines is not given.
DEFAULT_ENGINES = {
    "gpt2": ("hf_generate", "ct2", "ct2_int8", "llamacpp_f32", "llamacpp_q8_0", "engine",
             "engine_int8"),
    "smollm2-135m": ("hf_generate", "ct2", "ct2_int8", "engine", "engine_int8"),
    REAL: ("hf_generate", "ct2", "ct2_int8", "llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_1",
           "engine", "engine_int8", "engine_int4", "engine_gguf"),
}
GPT2_SMALL_SHAPE = {"n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "d_model": 768}
SMALL_ENGINES = tuple(e for e in ENGINES if e not in PEER_ENGINES)


@dataclass
class BenchOptions:
    presets: list[str]
    out_dir: Path
    latest_dir: Path | None
    quick: bool = False
    threads: int = DEFAULT_THREADS
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    nocache_batch_sizes: list[int] = field(default_factory=lambda: [1])
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_tokens: int = 64
    new_tokens: int = 128
    long_new_tokens: int = 512
    reps: dict[int, int] = field(default_factory=lambda: {1: 3, 8: 2, 32: 2})
    rounds: int = 1  # every engine measured this many times, in turn
    http_waves: int = 2
    engines: list[str] | None = None  # None: DEFAULT_ENGINES per preset
    ckpts: dict[str, Path] = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)
    artifacts_int8: dict[str, Path] = field(default_factory=dict)
    artifacts_int4: dict[str, Path] = field(default_factory=dict)
    artifacts_gguf: dict[str, Path] = field(default_factory=dict)
    work_dir: Path | None = None  # kept and reused (conversions, exports) when given
    optimum_python: Path | None = None
    optimum_note: str = ""
    llamacpp_python: Path | None = None
    llamacpp_note: str = ""
    keep_work: bool = False
    command: str = ""
    worker_timeout: float = 900.0


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    n = str(threads)
    env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                          if p))
    return env


def run_worker(spec: dict[str, Any], work: Path, opts: BenchOptions,
               python: Path | None = None) -> dict[str, Any]:
    """Run one job in a fresh process; return its payload ({"error": ...} on failure)."""
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{spec['job']}-{spec.get('engine', '')}-{time.monotonic_ns()}"
    spec_path, out_path = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    cmd = [str(python or sys.executable), "-m", "benchmarks.lib.worker", str(spec_path),
           str(out_path)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=worker_env(opts.threads), cwd=REPO_ROOT,
                              timeout=opts.worker_timeout, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.worker_timeout:.0f}s"}
    for line in proc.stderr.splitlines():
        if line.startswith(("torch_", "hf_", "ort_", "optimum", "engine", "ct2", "llamacpp")):
            log(f"  {line}")
    if not out_path.is_file():  # killed by a signal (a peer's native crash) or failed early
        last = proc.stderr.strip().splitlines()[-1:]
        reason = _exit_status(proc.returncode) + (f"; its last words: {last[0]}" if last else "")
        log(f"  {spec['job']} {spec.get('engine', '')} failed: worker died: {reason}")
        return {"error": f"worker died: {reason}"}
    payload: dict[str, Any] = json.loads(out_path.read_text(encoding="utf-8"))
    payload["wall_s"] = time.perf_counter() - t0
    if "error" in payload:
        log(f"  {spec['job']} {spec.get('engine', '')} failed: {payload['error']}")
    return payload


def _exit_status(code: int) -> str:
    """A worker's exit status as a person reads it: "SIGSEGV" rather than -11."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    mem_gb: float | None = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "onnxruntime", "transformers", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "absent"
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gb": mem_gb,
            "platform": platform.platform(), "versions": versions}


def _engine_missing(engine: str, prep: Prepared, opts: BenchOptions) -> str | None:
    needs = {"ort_plain": "artifact", "http": "artifact", **ENGINE_ARTIFACTS}
    key = needs.get(engine)
    if key and key not in prep.paths:
        return f"no {key} (see notes)"
    if engine == "optimum" and opts.optimum_python is None:
        return opts.optimum_note or "optimum is not installed"
    if engine in PEER_ENGINES and prep.preset not in PEER_PRESETS[engine]:
        return f"{engine} runs on the {' and '.join(PEER_PRESETS[engine])} preset(s)"
    if engine.startswith("ct2") and importlib.util.find_spec("ctranslate2") is None:
        return "ctranslate2 is not installed"
    if engine.startswith("llamacpp") and opts.llamacpp_python is None:
        return opts.llamacpp_note or "llama-cpp-python side env is not built"
    return None


def engines_for(preset: str, opts: BenchOptions) -> list[str]:
    if opts.engines is not None:
        return list(opts.engines)
    return list(DEFAULT_ENGINES.get(preset, SMALL_ENGINES))


def _prepare_peer(engine: str, prep: Prepared, opts: BenchOptions, work: Path,
                  result: dict[str, Any]) -> str | None:
    """Convert the transformers copy for a peer engine (once); an error message or None."""
    jobs = work / "jobs"
    if engine.startswith("ct2"):
        from benchmarks.lib.runners_ct2 import COMPUTE_TYPES

        if (work / engine / "model.bin").is_file():  # converted in a reused --work directory
            prep.paths[engine] = str(work / engine)
            return None
        payload = run_worker({"job": "ct2_convert", "threads": opts.threads,
                              "hf": prep.paths["hf"], "out": str(work / engine),
                              "compute_type": COMPUTE_TYPES[engine]}, jobs, opts)
        if "error" in payload:
            return f"CTranslate2 conversion: {payload['error']}"
        prep.paths[engine] = str(work / engine)
        result.setdefault("conversions", {})[engine] = payload["result"]
        return None
    if engine == "llamacpp_q4_1":  # the shipped file itself
        return None if "gguf_q4_1" in prep.paths else "no Q4_1 GGUF for this preset"
    f32 = work / f"{prep.preset}-f32.gguf"
    if "gguf_f32" not in prep.paths and not f32.is_file():
        # The real model: its own GGUF dequantised; GPT-2: the transformers copy written.
        spec = ({"job": "gguf_dequantize", "src": prep.paths["gguf_q4_1"]}
                if "gguf_q4_1" in prep.paths else {"job": "gguf_export", "hf": prep.paths["hf"]})
        payload = run_worker({**spec, "threads": opts.threads, "out": str(f32)}, jobs, opts)
        if "error" in payload:
            return f"GGUF f32: {payload['error']}"
        result.setdefault("conversions", {})["gguf_f32"] = payload["result"]
    prep.paths["gguf_f32"] = str(f32)
    q8 = work / f"{prep.preset}-q8_0.gguf"
    if engine == "llamacpp_q8_0" and "gguf_q8_0" not in prep.paths and not q8.is_file():
        payload = run_worker({"job": "llamacpp_quantize", "threads": opts.threads,
                              "src": prep.paths["gguf_f32"], "out": str(q8),
                              "kind": "q8_0"}, jobs, opts, opts.llamacpp_python)
        if "error" in payload:
            return f"llama.cpp quantize: {payload['error']}"
        result.setdefault("conversions", {})["gguf_q8_0"] = payload["result"]
    if engine == "llamacpp_q8_0":
        prep.paths["gguf_q8_0"] = str(q8)
    return None


def _artifacts_needed(engines: list[str]) -> set[str]:
    needed = {key for engine, key in ENGINE_ARTIFACTS.items() if engine in engines}
    return needed | ({"artifact"} if {"ort_plain", "engine_int8", "http"} & set(engines)
                     else set())


def run_preset(preset: str, opts: BenchOptions, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    engines = engines_for(preset, opts)
    log(f"preset {preset}: preparing weights and exports ({', '.join(engines)})")
    prep = _prepare_checkpoint(preset, work, opts.ckpts.get(preset))
    t_export = time.perf_counter()
    export_copies(prep, work, {"artifact": opts.artifacts.get(preset),
                               "artifact_int8": opts.artifacts_int8.get(preset),
                               "artifact_int4": opts.artifacts_int4.get(preset),
                               "artifact_gguf": opts.artifacts_gguf.get(preset)},
                  needed=_artifacts_needed(engines), log=lambda m: log(f"  export: {m}"))
    export_s = time.perf_counter() - t_export
    count = max(opts.batch_sizes)
    if "http" in engines:
        from benchmarks.lib.http_load import http_prompt_count

        count = max(count, http_prompt_count(opts.concurrency, opts.http_waves,
                                             http_ttft_reps(opts)))
    prompts = make_prompts(prep.ckpt / "tokenizer.json", count, opts.prompt_tokens)
    result: dict[str, Any] = {"params": prep.params, "weights": prep.weights,
                              "model": prep.model_config, "notes": prep.notes, "engines": {},
                              "kv_cache_bytes_per_token": kv_cache_comparison(
                                  preset, prep.model_config),
                              "timings_s": {"prepare": time.perf_counter() - t0,
                                            "export": export_s}}
    common = {"job": "measure", "threads": opts.threads, "paths": prep.paths,
              "prompts": prompts["ids"][:max(opts.batch_sizes)], "new_tokens": opts.new_tokens,
              "warmup_tokens": min(4, opts.new_tokens), "reps": opts.reps,
              "n_ctx": opts.prompt_tokens + opts.new_tokens + 8}
    ready: dict[str, tuple[dict[str, Any], Path | None]] = {}  # engine → (spec, python)
    for engine in (e for e in engines if e != "http"):
        t1 = time.perf_counter()
        missing = _engine_missing(engine, prep, opts)
        if missing:
            result["engines"][engine] = {"error": f"not measured: {missing}"}
            log(f"  {engine}: not measured ({missing})")
            continue
        python = None
        if engine == "optimum":
            python = opts.optimum_python
            exported = run_worker({"job": "optimum_export", "threads": opts.threads,
                                   "hf": prep.paths["hf"], "out": str(work / "optimum")},
                                  work / "jobs", opts, python)
            if "error" in exported:
                result["engines"][engine] = {"error": f"optimum export: {exported['error']}"}
                continue
            prep.paths["optimum"] = str(work / "optimum")
            result["optimum_export"] = exported["result"]
        if engine in PEER_ENGINES:
            failed = _prepare_peer(engine, prep, opts, work, result)
            if failed:
                result["engines"][engine] = {"error": failed}
                continue
            if engine.startswith("llamacpp"):
                python = opts.llamacpp_python
        batches = opts.nocache_batch_sizes if engine == "torch_nocache" else opts.batch_sizes
        ready[engine] = ({**common, "engine": engine, "batch_sizes": batches,
                          "paths": prep.paths}, python)
        result["timings_s"][engine] = time.perf_counter() - t1
    rounds: dict[str, list[dict[str, Any]]] = {engine: [] for engine in ready}
    for turn in range(opts.rounds):
        if opts.rounds > 1:
            log(f"  round {turn + 1} of {opts.rounds}")
        for engine, (spec, python) in ready.items():
            t1 = time.perf_counter()
            rounds[engine].append(run_worker(spec, work / "jobs", opts, python))
            result["timings_s"][engine] += time.perf_counter() - t1
    skipped = result["engines"]  # the engines that could not run, with why
    result["engines"] = {e: merge_rounds(rounds[e]) if e in rounds else skipped[e]
                         for e in engines if e in rounds or e in skipped}
    _greedy_consistency(result)
    if any(e in result["engines"] for e in LLAMACPP_FILES):
        _llamacpp_agreement(result, prep, prompts, opts, work)
    _long_and_agreement(result, prep, prompts, opts, work,
                        kv_compare=bool({"torch_kv", "torch_nocache"} & set(engines)))
    if "http" in engines:
        t1 = time.perf_counter()
        missing = _engine_missing("http", prep, opts)
        if missing:
            result["http"] = {"error": f"not measured: {missing}"}
        else:
            from benchmarks.lib.http_load import run_http

            try:
                result["http"] = run_http(Path(prep.paths["artifact"]), prompts["texts"],
                                          opts.threads, opts.new_tokens, opts.concurrency,
                                          opts.http_waves, http_ttft_reps(opts), work, log)
            except Exception as exc:  # recorded, the rest of the report still stands
                result["http"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"  http failed: {exc}")
        result["timings_s"]["http"] = time.perf_counter() - t1
    for res in result["engines"].values():
        for row in res.get("rows", []):
            row.pop("greedy_tokens", None)
    result["timings_s"]["total"] = time.perf_counter() - t0
    return result


ROUND_MEDIANS = ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "latency_p50_ms",
                 "latency_p99_ms")


def merge_rounds(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's result over its rounds: the first round's, with every timed figure the
    median over the rounds (``tokens_per_s_rounds`` keeps each round's, for ratios taken
    round by round) and the peak memory the highest. An error in any round is the result."""
    failed = next((p for p in payloads if "error" in p), None)
    if failed is not None:
        return {"error": failed["error"]}
    results = [p["result"] for p in payloads]
    merged = {**results[0], "memory": max((p.get("memory", {}) for p in payloads),
                                          key=lambda m: m.get("peak_mb") or 0.0)}
    if len(results) == 1:
        return merged
    rows = []
    for i, first in enumerate(results[0].get("rows", [])):
        same = [r["rows"][i] for r in results]
        row = {**first, "rounds": len(same),
               "tokens_per_s_rounds": [r.get("tokens_per_s") for r in same]}
        for key in ROUND_MEDIANS:
            values = [r[key] for r in same if r.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
        own = [r["own"]["decode_tokens_per_s"] for r in same
               if (r.get("own") or {}).get("decode_tokens_per_s") is not None]
        if own:
            row["own"] = {**first["own"], "decode_tokens_per_s": statistics.median(own)}
        rows.append(row)
    merged["rows"] = rows
    return merged


def http_ttft_reps(opts: BenchOptions) -> int:
    return 3 if opts.quick else 10


def kv_bytes_per_token(model: dict[str, Any], bytes_per_value: int = 4) -> int:
    """Bytes one token adds to the KV cache of a preset's shape (the service's formula)."""
    return io.kv_bytes_per_token(model["n_layers"], model.get("n_kv_heads") or model["n_heads"],
                                 model["d_model"] // model["n_heads"], bytes_per_value)


def kv_cache_comparison(preset: str, model: dict[str, Any]) -> dict[str, int]:
    """KV-cache bytes per token of this preset and, for an imported one, GPT-2 small's."""
    sizes = {preset: kv_bytes_per_token(model)}
    if preset != "gpt2" and preset in DEFAULT_ENGINES:
        sizes["gpt2"] = kv_bytes_per_token(GPT2_SMALL_SHAPE)
    return sizes


def _greedy_consistency(result: dict[str, Any]) -> None:
    """Share of rows whose greedy tokens equal PyTorch-with-cache's: same weights, same path.

    Also, per row set, the mean number of leading tokens equal to our fp32 engine's: the
    same-weights check for the peers, whose arithmetic differs in summation order only,
    so on random weights (near-uniform logits) they agree for a prefix, then may part.
    """
    ref = {r["batch"]: r["greedy_tokens"]
           for r in result["engines"].get("torch_kv", {}).get("rows", [])}
    ours = {r["batch"]: r["greedy_tokens"]
            for r in result["engines"].get("engine", {}).get("rows", [])}
    for res in result["engines"].values():
        for row in res.get("rows", []):
            mine, theirs = row.get("greedy_tokens"), ref.get(row["batch"])
            if mine is not None and theirs is not None:
                same = sum(a == b for a, b in zip(mine, theirs, strict=True))
                row["greedy_rows_equal_torch_kv"] = same / len(mine)
            base = ours.get(row["batch"])
            if mine is not None and base is not None:
                prefixes = [shared_prefix(m, e) for m, e in zip(mine, base, strict=True)]
                row["greedy_prefix_equal_engine"] = sum(prefixes) / len(prefixes)
                row["greedy_first_equal_engine"] = sum(p > 0 for p in prefixes) / len(prefixes)
                row["greedy_rows_equal_engine"] = sum(
                    p == len(m) for p, m in zip(prefixes, mine, strict=True)) / len(prefixes)


def _long_and_agreement(result: dict[str, Any], prep: Prepared, prompts: dict[str, Any],
                        opts: BenchOptions, work: Path, kv_compare: bool = True) -> None:
    t1 = time.perf_counter()
    if kv_compare:
        config = dict(prep.model_config)
        config["max_seq_len"] = max(config["max_seq_len"],
                                    opts.prompt_tokens + opts.long_new_tokens)
        payload = run_worker({"job": "kv_vs_nocache", "threads": opts.threads, "config": config,
                              "prompt": prompts["ids"][0], "new_tokens": opts.long_new_tokens},
                             work / "jobs", opts)
        result["kv_vs_nocache"] = payload.get("result", {"error": payload.get("error")})
        result["timings_s"]["kv_vs_nocache"] = time.perf_counter() - t1
    else:
        result["kv_vs_nocache"] = {"error": "not run: no PyTorch engine in this preset's list"}
    _int8_agreement(result, prep, prompts, opts, work)


def _int8_agreement(result: dict[str, Any], prep: Prepared, prompts: dict[str, Any],
                    opts: BenchOptions, work: Path) -> None:
    """Teacher-forced greedy agreement of each quantised artifact with the fp32 one
    (``quant_agreement``; ``int8_agreement`` is the int8 entry, what the targets read)."""
    missing = {"error": "needs both the fp32 and the int8 artifact"}
    if "artifact" not in prep.paths:
        result["int8_agreement"] = missing
        return
    for key in ("artifact_int8", "artifact_int4", "artifact_gguf"):
        if key not in prep.paths:
            continue
        payload = run_worker({"job": "agreement", "threads": opts.threads,
                              "fp32": prep.paths["artifact"], "int8": prep.paths[key],
                              "prompts": prompts["ids"][:8], "new_tokens": opts.new_tokens},
                             work / "jobs", opts)
        result.setdefault("quant_agreement", {})[key.removeprefix("artifact_")] = payload.get(
            "result", {"error": payload.get("error")})
    result["int8_agreement"] = result.get("quant_agreement", {}).get("int8", missing)


def _llamacpp_agreement(result: dict[str, Any], prep: Prepared, prompts: dict[str, Any],
                        opts: BenchOptions, work: Path) -> None:
    """Each llama.cpp file scored like our quantised artifacts: fed our fp32 engine's greedy
    tokens (teacher-forced), how often its own argmax picks the same next token."""
    rows = result["engines"].get("engine", {}).get("rows", [])
    ref = min((r for r in rows if r.get("greedy_tokens")), key=lambda r: abs(r["batch"] - 8),
              default=None)
    for engine, key in LLAMACPP_FILES.items():
        res = result["engines"].get(engine, {})
        if "rows" not in res or key not in prep.paths:
            continue
        if ref is None:
            result.setdefault("llamacpp_agreement", {})[engine] = {
                "error": "needs our fp32 engine's greedy tokens"}
            continue
        n = len(ref["greedy_tokens"])
        payload = run_worker({"job": "llamacpp_agreement", "threads": opts.threads,
                              "gguf": prep.paths[key], "prompts": prompts["ids"][:n],
                              "expected": ref["greedy_tokens"],
                              "n_ctx": opts.prompt_tokens + opts.new_tokens + 8},
                             work / "jobs", opts, opts.llamacpp_python)
        result.setdefault("llamacpp_agreement", {})[engine] = payload.get(
            "result", {"error": payload.get("error")})


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    from benchmarks.lib.report import chart, evaluate_targets, markdown

    started = time.perf_counter()
    keep = opts.keep_work or opts.work_dir is not None
    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="attnserve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"), "command": opts.command,
        "machine": machine_info(), "presets": {},
        "settings": {"threads": opts.threads, "quick": opts.quick,
                     "batch_sizes": opts.batch_sizes, "concurrency": opts.concurrency,
                     "prompt_tokens": opts.prompt_tokens, "new_tokens": opts.new_tokens,
                     "long_new_tokens": opts.long_new_tokens,
                     "reps": {str(k): v for k, v in opts.reps.items()},
                     "rounds": opts.rounds,
                     "engines": opts.engines or {p: engines_for(p, opts) for p in opts.presets},
                     "optimum": opts.optimum_note or "available",
                     "llamacpp": opts.llamacpp_note or "available"},
    }
    try:
        log("machine ceiling: GEMM and memory bandwidth")
        ceiling = run_worker({"job": "ceiling", "threads": opts.threads, "quick": opts.quick},
                             work / "jobs", opts)
        run["ceiling"] = ceiling.get("result", {})
        for preset in opts.presets:
            run["presets"][preset] = run_preset(preset, opts, work / preset)
            run["presets"][preset]["targets"] = evaluate_targets(run["presets"][preset],
                                                                 run["ceiling"], preset)
    finally:
        if keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    run["total_s"] = time.perf_counter() - started
    out = opts.out_dir
    files = {"results.json": json.dumps(run, indent=2).encode(),
             "results.md": markdown(run).encode()}
    for name, data in files.items():
        _write_atomic(out / name, data)
    png_tmp = out / f".results.png.tmp-{os.getpid()}.png"
    chart(run, png_tmp)
    os.replace(png_tmp, out / "results.png")
    if opts.latest_dir is not None:
        for ext in ("json", "md", "png"):
            _write_atomic(opts.latest_dir / f"latest.{ext}", (out / f"results.{ext}").read_bytes())
    return run
