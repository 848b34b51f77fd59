"""benchmarks/perplexity.py: one GGUF file scored by our artifacts, transformers and
llama.cpp over the same token ids and windows.

The file is a small random Llama written Q4_1 (tests/gguf_files.py); the references are
transformers' own GGUF loader (which must give our fp32 artifact's perplexity to 4
significant digits: both compute the file's dequantised weights in float32) and, where the
benchmark's llama.cpp side environment is built, llama.cpp itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.perplexity import DEFAULT_LLAMACPP_PYTHON, main
from export.to_onnx import export_artifact
from model.gguf_import import import_gguf_checkpoint
from tests.export.test_gguf_blocks import CASES, write_file
from tests.hf_gpt2 import sample_texts

pytest.importorskip("transformers")


def test_fp32_equals_transformers_and_kept_blocks_stay_close(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_file(tmp_path, CASES["q4_1"])
    ckpt = import_gguf_checkpoint(path, tmp_path / "ckpt")
    fp32 = export_artifact(ckpt, tmp_path / "art-fp32", verify=False)
    kept = export_artifact(ckpt, tmp_path / "art-gguf", quantize="gguf", verify=False)
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(sample_texts()), "utf-8")
    llamacpp = DEFAULT_LLAMACPP_PYTHON.is_file()
    out = tmp_path / "ppl.json"
    assert main(["--gguf", str(path), "--artifact", f"fp32={fp32}", "--artifact",
                 f"gguf={kept}", "--data", str(text), "--max-tokens", "600", "--window",
                 "128", "--stride", "48", "--threads", "1", "--json", str(out),
                 *([] if llamacpp else ["--no-llamacpp"])]) == 0
    print(capsys.readouterr().out)
    rows = {r["name"]: r for r in json.loads(out.read_text("utf-8"))["rows"]}
    ref = rows["fp32"]["perplexity"]
    assert rows["transformers"]["perplexity"] == pytest.approx(ref, rel=1e-4)
    assert rows["gguf"]["perplexity"] == pytest.approx(ref, rel=0.02)
    if not llamacpp:
        pytest.skip(f"llama.cpp side environment not built ({DEFAULT_LLAMACPP_PYTHON}): "
                    "python -m benchmarks.llamacpp_env")
    assert rows["llama.cpp"]["perplexity"] == pytest.approx(ref, rel=0.02)
