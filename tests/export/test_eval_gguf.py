"""benchmarks/perplexity.py: one GGUF file scored by our artifacts, transformers and
llama.cpp over the same token ids and windows.

The file is a small random Llama written Q4_1 (tests/gguf_files.py); the references are
transformers' own GGUF loader (which must give our fp32 artifact's perplexity to 4
significant digits: both compute the file's dequantised weights in float32) and, where the
benchmark's llama.cpp side environment is built, llama.cpp itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.perplexity import DEFAULT_LLAMACPP_PYTHON, main
from export.to_onnx import export_artifact
from model.gguf.to_checkpoint import import_gguf_checkpoint
from tests.export.test_gguf_blocks import CASES, write_file
from tests.hf_gpt2 import sample_texts

pytest.importorskip("transformers")


@dataclass(frozen=True)
class Scored:
    gguf: Path
    args: list[str]  # the benchmark's arguments for both artifacts and the text


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> Scored:
    root = tmp_path_factory.mktemp("ppl")
    path = write_file(root, CASES["q4_1"])
    ckpt = import_gguf_checkpoint(path, root / "ckpt")
    fp32 = export_artifact(ckpt, root / "art-fp32", verify=False)
    kept = export_artifact(ckpt, root / "art-gguf", quantize="gguf", verify=False)
    text = root / "text.txt"
    text.write_text("\n\n".join(sample_texts()), "utf-8")
    return Scored(path, ["--gguf", str(path), "--artifact", f"fp32={fp32}", "--artifact",
                         f"gguf={kept}", "--data", str(text), "--max-tokens", "600",
                         "--window", "128", "--stride", "48", "--threads", "1"])


def rows(scored: Scored, out: Path, *extra: str) -> dict[str, dict[str, float]]:
    assert main([*scored.args, "--json", str(out), *extra]) == 0
    return {r["name"]: r for r in json.loads(out.read_text("utf-8"))["rows"]}


def test_fp32_equals_transformers_and_kept_blocks_stay_close(scored: Scored,
                                                             tmp_path: Path) -> None:
    r = rows(scored, tmp_path / "ppl.json", "--no-llamacpp")
    ref = r["fp32"]["perplexity"]
    print({name: row["perplexity"] for name, row in r.items()})
    assert r["transformers"]["perplexity"] == pytest.approx(ref, rel=1e-4)
    assert r["gguf"]["perplexity"] == pytest.approx(ref, rel=0.02)


def test_llamacpp_on_the_same_file_stays_close(scored: Scored, tmp_path: Path) -> None:
    if not DEFAULT_LLAMACPP_PYTHON.is_file():
        pytest.skip(f"llama.cpp side environment not built ({DEFAULT_LLAMACPP_PYTHON}): "
                    "python -m benchmarks.llamacpp_env")
    r = rows(scored, tmp_path / "ppl.json", "--no-transformers")
    print({name: row["perplexity"] for name, row in r.items()})
    assert r["llama.cpp"]["perplexity"] == pytest.approx(r["fp32"]["perplexity"], rel=0.02)
