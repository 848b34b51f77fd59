"""The sized presets (benchmarks/sized_presets.py) made by llama.cpp's own tools: the tiny
shape converts with convert_hf_to_gguf.py and quantises with llama-quantize to the tensor
types a user of llama.cpp would get, and the manifest records each file as it is.

The tiny shape's rows are all multiples of 256, so Q4_K_M keeps its k-quants everywhere
(no Q5_0 / Q5_1 / Q8_0 fallback). Skipped when the tools
(`python -m benchmarks.llamacpp_tools --build`) or the SmolLM2 GGUF whose tokenizer the
presets use (`make default-model`) are absent. About half a minute.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from benchmarks import llamacpp_tools
from benchmarks.sized_presets import MANIFEST, SHAPES, file_record, make_sized

TINY = "llama-tiny"


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from model.default_model import default_gguf_path

    if not llamacpp_tools.is_built():
        pytest.skip("llama.cpp tools not built (python -m benchmarks.llamacpp_tools --build)")
    if not default_gguf_path().is_file():
        pytest.skip(f"SmolLM2 GGUF (the presets' tokenizer) not installed at "
                    f"{default_gguf_path()}")
    root = tmp_path_factory.mktemp("sized")
    return root, make_sized(TINY, root, threads=1, log=None)


def test_tiny_converts_and_quantises_to_llama_cpp_types(
        tiny: tuple[Path, dict[str, Any]]) -> None:
    root, manifest = tiny
    work = root / TINY
    f16 = tensor_types(work / manifest["files"]["f16"]["file"])
    shape = SHAPES[TINY]
    assert len(f16) == 2 + 9 * shape.num_hidden_layers  # embedding, final norm; tied: no output
    assert {t for n, t in f16.items() if n.endswith("norm.weight")} == {"F32"}
    assert {t for n, t in f16.items() if not n.endswith("norm.weight")} == {"F16"}

    # Tied embeddings: the embedding is also the output matrix, which llama-quantize keeps
    # at Q6_K in both mixes.
    q4_0 = tensor_types(work / manifest["files"]["Q4_0"]["file"])
    assert Counter(q4_0.values())["Q4_0"] == 7 * shape.num_hidden_layers, q4_0
    assert q4_0["token_embd.weight"] == "Q6_K"

    q4_k_m = tensor_types(work / manifest["files"]["Q4_K_M"]["file"])
    kinds = Counter(q4_k_m.values())
    assert kinds["Q4_K"] > 0 and kinds["Q6_K"] > 0, kinds
    assert not {"Q5_0", "Q5_1", "Q8_0", "F16"} & set(kinds), kinds  # no fallback rows
    assert q4_k_m["token_embd.weight"] == "Q6_K"
    # Q4_K_M's extra bits: some layers' attn_v and ffn_down at Q6_K.
    assert {t for n, t in q4_k_m.items() if n.endswith(("attn_v.weight", "ffn_down.weight"))
            } == {"Q4_K", "Q6_K"}

    import gguf

    reader = gguf.GGUFReader(work / manifest["files"]["Q4_K_M"]["file"])
    pre = reader.fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == "smollm"  # recognised by the converter


def test_manifest_records_the_files_and_a_second_call_reuses_them(
        tiny: tuple[Path, dict[str, Any]]) -> None:
    root, manifest = tiny
    work = root / TINY
    assert set(manifest["files"]) == {"f16", "Q4_0", "Q4_K_M"}
    for record in manifest["files"].values():
        assert file_record(work / record["file"]) == record
    assert manifest["model"]["params"] > 0 and manifest["recipe"]["preset"] == TINY
    assert json.loads((work / MANIFEST).read_text()) == manifest
    mtimes = {p.name: p.stat().st_mtime_ns for p in work.glob("*.gguf")}
    assert make_sized(TINY, root, threads=1, log=None) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("*.gguf")} == mtimes


def test_tool_path_names_the_build_command_when_not_built(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="llamacpp-tools --build"):
        llamacpp_tools.tool_path("llama-quantize", tmp_path)
    with pytest.raises(ValueError, match=r"unknown llama\.cpp tool"):
        llamacpp_tools.tool_path("llama-cli", tmp_path)
    assert llamacpp_tools.main(["--print-paths", "--root", str(tmp_path)]) == 1


def test_build_record_keeps_the_overlays_cpu_policy() -> None:
    from benchmarks.llamacpp_env import LLAMA_CPP_PYTHON, NO_AMX

    record = llamacpp_tools.build_record()
    assert LLAMA_CPP_PYTHON in record and "-DGGML_NATIVE=ON" in record
    assert f"-DCMAKE_C_FLAGS={NO_AMX}" in record and f"-DCMAKE_CXX_FLAGS={NO_AMX}" in record
    assert all(tool in record for tool in llamacpp_tools.TOOLS)
