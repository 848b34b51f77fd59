"""--quantize int8 / int4 / int8-dynamic and --dtype float16 exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export.to_onnx import export_artifact
from model.checkpoint import load_checkpoint
from service.contract import io_spec
from service.contract.manifest import verify_manifest


def test_int8_export_reports_agreement_and_perplexity(tiny_checkpoint: Path,
                                                      tmp_path: Path) -> None:
    out = export_artifact(tiny_checkpoint, tmp_path / "int8", quantize="int8")
    manifest = verify_manifest(out)
    assert manifest.quantization == "int8"
    figures = manifest.verification["quantized"]
    assert figures["steps"] == 64 and figures["prompts"] == 8
    assert figures["token_agreement"] >= 0.97
    assert abs(figures["perplexity_relative_change"]) < 0.02
    assert figures["quantized_bytes"] < figures["fp32_bytes"]
    nodes = onnx.load(str(out / "model.onnx")).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert nbits and len(nbits) == figures["quantized_matmuls"]
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (8, 32, 4)
    assert not {"MatMulInteger", "DynamicQuantizeLinear"} & {n.op_type for n in nodes}


def test_int4_export_is_4_bit_asymmetric_smaller_and_close_to_fp32(
        tiny_checkpoint: Path, tiny_artifact: Path, tmp_path: Path) -> None:
    """4-bit MatMulNBits codes with a zero point per block of 32; the weights shrink below
    int8's and the held-out perplexity, computed here by export/verify/evaluate over the same
    windows for both artifacts, stays within 10% of float32's."""
    from export.verify.evaluate import artifact_backend, evaluate, load_text

    out = export_artifact(tiny_checkpoint, tmp_path / "int4", quantize="int4")
    manifest = verify_manifest(out)
    assert manifest.quantization == "int4"
    figures = manifest.verification["quantized"]
    assert (figures["bits"], figures["symmetric"], figures["block_size"]) == (4, False, 32)
    assert figures["token_agreement"] >= figures["agreement_target"] == 0.85
    nodes = onnx.load(str(out / "model.onnx")).graph.node
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert nbits and len(nbits) == figures["quantized_matmuls"]
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
    assert len(nbits[0].input) >= 4 and nbits[0].input[3]  # zero points: asymmetric
    # 4 bits + a float scale and a 4-bit zero point per 32 weights: 0.64 of a byte where
    # float32 takes 4 (8-bit codes would take 1.125), on every projection and the head
    linear = sum(m.weight.numel() * 4 for m in load_checkpoint(tiny_checkpoint).model.modules()
                 if isinstance(m, torch.nn.Linear))
    assert figures["quantized_bytes"] < figures["fp32_bytes"] - 0.75 * linear
    text, source = load_text("stdlib")
    fp32, int4 = (evaluate(artifact_backend(str(path)), text, source, max_tokens=1024)
                  for path in (tiny_artifact, out))
    print(f"perplexity fp32 {fp32['perplexity']:.4f}, int4 {int4['perplexity']:.4f}")
    assert fp32["tokens_scored"] == int4["tokens_scored"]
    assert int4["perplexity"] / fp32["perplexity"] - 1 < 0.10


def test_int8_dynamic_export_keeps_quantize_dynamic(tiny_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    out = export_artifact(tiny_checkpoint, tmp_path / "dyn", quantize="int8-dynamic")
    manifest = verify_manifest(out)
    assert manifest.quantization == "int8-dynamic"
    figures = manifest.verification["quantized"]
    assert figures["agreement_target"] == 0.95 and figures["token_agreement"] >= 0.9
    assert abs(figures["perplexity_relative_change"]) < 0.05
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    weights = {t.name for t in graph.initializer}
    # every weight MatMul quantised (attention's products stay float); the activations by a
    # scale per row, not per tensor
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and set(n.input) & weights]
    assert "DynamicQuantizeLinear" not in ops
    assert figures["rows_requantised"] >= 1
    assert ops.count("MatMulInteger") >= figures["rows_requantised"]


@torch.no_grad()
def test_float16_kv_cache_export(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = export_artifact(tiny_checkpoint, tmp_path / "fp16", dtype="float16")
    assert verify_manifest(out).kv_dtype == "float16"
    model = onnx.load(str(out / "model.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input,
                                                             *model.graph.output]}
    assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
    assert types["present.1.value"] == onnx.TensorProto.FLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT

    gpt = load_checkpoint(tiny_checkpoint).model
    cfg = gpt.config
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    seq = [5, 40, 77, 120, 9]
    past = {n: np.zeros((1, cfg.n_heads, 0, cfg.head_dim), np.float16)
            for n in io_spec.past_names(cfg.n_layers)}
    ids = np.array([seq], np.int64)
    for _ in range(20):
        logits, *present = sess.run(None, {
            "input_ids": ids, "attention_mask": np.ones((1, len(seq)), np.int64),
            "position_ids": np.arange(len(seq) - ids.shape[1], len(seq))[None], **past})
        assert present[0].dtype == np.float16
        ref = gpt(torch.tensor([seq])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits[0, -1], ref, atol=1e-2)
        seq.append(int(ref.argmax()))
        past = dict(zip(io_spec.past_names(cfg.n_layers), present, strict=True))
        ids = np.array([[seq[-1]]], np.int64)
