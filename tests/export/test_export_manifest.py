"""manifest.json: contents, the verification figures, and refusal of tampered artifacts."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.contract.graphs import GraphEntry, GraphTable
from service.contract.manifest import ManifestError, load_manifest, verify_manifest


@pytest.fixture()
def artifact_copy(tiny_artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_artifact, tmp_path / "artifact"))


def test_manifest_lists_every_file_with_its_hash(tiny_checkpoint: Path,
                                                 tiny_artifact: Path) -> None:
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    files = {p.name for p in tiny_artifact.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        data = (tiny_artifact / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    source = manifest["source_checkpoint"]["files"]
    weights = (tiny_checkpoint / "model.safetensors").read_bytes()
    assert source["model.safetensors"]["sha256"] == hashlib.sha256(weights).hexdigest()
    assert manifest["opset"] == 18 and manifest["kv_dtype"] == "float32"
    assert manifest["exporter"]["versions"]["torch"].startswith("2.")
    assert manifest["io"]["model"]["inputs"]["past_key_values.0.key"] == [
        "batch_size", "num_heads", "past_sequence_length", "head_dim"]


def test_manifest_records_passing_verification_figures(tiny_artifact: Path) -> None:
    v = json.loads((tiny_artifact / "manifest.json").read_text())["verification"]
    assert v["passed"] is True
    assert v["prefill"]["max_abs_diff"] <= 1e-4 and v["prefill"]["past_length"] == 0
    assert v["decode"]["steps"] == 64 and v["decode"]["greedy_tokens_identical"] is True
    assert v["decode"]["max_abs_diff"] <= 1e-4
    assert v["ragged_batch"]["max_abs_diff"] <= 1e-4
    assert v["attention"]["weights_max_abs_diff"] <= 1e-5
    assert v["attention"]["upper_triangle_max"] == 0.0


def test_manifest_holds_the_table_of_graphs(tiny_artifact: Path) -> None:
    """Export writes which graph runs which pass, and the engine reads it back; an
    artifact without --engine-graph has model.onnx alone."""
    table = GraphTable.of(load_manifest(tiny_artifact))
    assert table.graphs == (GraphEntry("model.onnx", "fallback"),)
    assert table.served(engine_graph=True, mixed_steps=True, on_cuda=False) == table.graphs


def test_verify_manifest_accepts_the_artifact(artifact_copy: Path) -> None:
    assert verify_manifest(artifact_copy).files["model.onnx"].size > 0


def test_tampered_file_is_refused(artifact_copy: Path) -> None:
    path = artifact_copy / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model\.onnx.*sha256"):
        verify_manifest(artifact_copy)


def test_truncated_file_is_refused(artifact_copy: Path) -> None:
    path = artifact_copy / "attention.onnx"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ManifestError, match=r"attention\.onnx.*bytes"):
        verify_manifest(artifact_copy)


def test_missing_file_and_missing_manifest_are_refused(artifact_copy: Path) -> None:
    (artifact_copy / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"tokenizer\.json.*missing"):
        verify_manifest(artifact_copy)
    (artifact_copy / "manifest.json").unlink()
    with pytest.raises(ManifestError, match=r"manifest\.json"):
        verify_manifest(artifact_copy)


def test_corrupt_manifest_is_refused(artifact_copy: Path) -> None:
    (artifact_copy / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="corrupt"):
        verify_manifest(artifact_copy)


def test_manifest_module_imports_without_torch() -> None:
    code = ("import sys; import service.contract.manifest, service.contract.io_spec; "
            "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
