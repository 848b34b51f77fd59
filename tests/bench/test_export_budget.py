"""benchmarks.export_budget on a tiny Q4_1 GGUF file: the import and the export run as
children of their own, and the table and the JSON carry each one's figures and the
artifact's size against the file's (no budget asserted: timings are the machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.gguf_files import Q, TokenizerSpec, write_gguf
from tests.hf_llama import CHATML, IM_END, IM_START, build_hf_model

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 128, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}  # heads of 32


def test_both_stages_are_measured_and_the_artifact_sized(tmp_path: Path) -> None:
    build_hf_model(tmp_path / "hf", "llama", seed=1, **TINY)
    spec = TokenizerSpec(pre="gpt-2", bos=IM_START, eos=IM_END, pad=IM_END,
                         chat_template=CHATML)
    gguf = write_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", (Q.Q4_1,), spec)
    out = tmp_path / "budget.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.export_budget", "--gguf", str(gguf),
         "--work", str(tmp_path / "work"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text("utf-8"))
    stages = {s["name"]: s for s in result["stages"]}
    assert list(stages) == ["import", "export"]
    for stage in stages.values():
        assert stage["returncode"] == 0
        assert stage["wall_s"] > 0 and stage["peak_rss_bytes"] > 10_000_000
    assert "--quantize" in stages["export"]["argv"] and "--engine-graph" in stages["export"]["argv"]
    assert {"weights.bin", "engine_mixed.onnx", "manifest.json"} <= set(result["files"])
    assert not [name for name in result["files"] if name.startswith("engine_float32")]
    assert result["artifact_bytes"] == sum(result["files"].values())
    assert result["gguf_bytes"] == gguf.stat().st_size
    assert result["artifact_to_gguf"] == pytest.approx(result["artifact_bytes"]
                                                       / result["gguf_bytes"])
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["import", "export"]
    assert any(line.startswith("artifact ") and " x the GGUF file " in line for line in lines)
    assert any(line.startswith("export budget: peak ") for line in lines)
