"""llama.cpp's batched runner (benchmarks/lib/runner_llamacpp.py) on the real SmolLM2 GGUF,
run by the benchmark's own worker in the llama.cpp side env: sequences decoded together
give what each gives alone, the greedy tokens follow transformers' on the same file, and
llama.cpp's own counters saw exactly the decode steps we asked for.

One thread: llama.cpp's OpenMP threads spin at every barrier, and on a busy machine two
of them crawl (see docs/benchmarks.md); this test is about tokens, not speed. Skipped
when the side env (`python -m benchmarks --setup-llamacpp`) or the GGUF
(`make default-model`) is absent; no timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib.harness import worker_env
from benchmarks.lib.prepare import REPO_ROOT

LLAMACPP_PYTHON = REPO_ROOT / ".cache" / "llamacpp-venv" / "bin" / "python"
PROMPT, NEW = 16, 12


def run_job(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    spec_path, out = tmp / f"{spec['job']}.spec.json", tmp / f"{spec['job']}.out.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    proc = subprocess.run([str(LLAMACPP_PYTHON), "-m", "benchmarks.lib.worker", str(spec_path),
                           str(out)], env=worker_env(1), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    payload: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {
        "error": proc.stderr[-2000:]}
    assert "error" not in payload, payload
    return payload["result"]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from model.default_model import default_gguf_path

    if not LLAMACPP_PYTHON.exists():
        pytest.skip("llama.cpp side env not built (python -m benchmarks --setup-llamacpp)")
    probe = subprocess.run([str(LLAMACPP_PYTHON), "-c", "import llama_cpp"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("llama_cpp does not import in the side env")
    path = default_gguf_path()
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {path}")
    return path


def test_batched_decode_matches_alone_transformers_and_its_own_counters(
        gguf_file: Path, smollm2_transformers: tuple[Any, Any], tmp_path: Path) -> None:
    import torch

    model, tokenizer = smollm2_transformers
    texts = ["The capital of France is a city that", "def fibonacci(n):\n    # return the",
             "Scaled dot-product attention divides the scores by"]
    prompts = [tokenizer(t + " and so on, and so forth, again and again")["input_ids"][:PROMPT]
               for t in texts]
    assert all(len(p) == PROMPT for p in prompts)
    spec = {"job": "measure", "engine": "llamacpp_q4_1", "threads": 1,
            "paths": {"gguf_q4_1": str(gguf_file)}, "prompts": prompts, "new_tokens": NEW,
            "warmup_tokens": 2, "reps": {"1": 1, "3": 1}, "batch_sizes": [1, 3],
            "n_ctx": PROMPT + NEW + 8}
    result = run_job(spec, tmp_path)
    alone, together = result["rows"]
    # Row 0 of the batch is the batch-1 prompt: the same greedy tokens, decoded alone or not.
    assert together["greedy_tokens"][0] == alone["greedy_tokens"][0]
    # llama.cpp's own counters: (NEW - 1) decode calls of 3 tokens after the prefill.
    assert together["own"]["decode_tokens"] == 3 * (NEW - 1)
    assert alone["own"]["decode_tokens"] == NEW - 1
    assert result["llamacpp"]["n_seq_max"] == 3 and result["llamacpp"]["kv_unified"] is False
    assert "prompt eval time" in result["llamacpp"]["perf_print_last"]

    # transformers on the same file (dequantised, float32): greedy reference. llama.cpp
    # multiplies Q4_1 weights with 8-bit-quantised activations, so it is scored
    # teacher-forced (fed the reference's tokens), as our quantised exports are.
    with torch.inference_mode():
        ids = torch.tensor(prompts)  # (3, PROMPT)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False)[:, PROMPT:].tolist()
    agreement = run_job({"job": "llamacpp_agreement", "threads": 1, "gguf": str(gguf_file),
                         "prompts": prompts, "expected": ref, "n_ctx": PROMPT + NEW + 8},
                        tmp_path)
    assert agreement["positions"] == 3 * NEW
    assert agreement["token_agreement"] >= 0.9, agreement
    assert [row[0] for row in together["greedy_tokens"]] == [row[0] for row in ref]
