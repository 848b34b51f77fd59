"""--dtype float16: the engine graphs wholly in float16 (export/onnx/float16.py), against
PyTorch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from export.to_onnx import export_artifact
from export.verify.parity import clear_mismatches, logits_tolerance, top2_margin
from model.checkpoint import load_checkpoint
from service.contract import engine_spec as es
from service.contract import io_spec as io


@pytest.fixture(scope="module")
def half_llama(llama_artifacts: Any, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, Path]:
    """(checkpoint, float16 artifact) of the random-weight Llama (rotary, grouped KV)."""
    build = llama_artifacts("llama")
    out = export_artifact(build.checkpoint, tmp_path_factory.mktemp("half") / "artifact",
                          dtype="float16", engine_graph=True)
    return build.checkpoint, out


def _types(values: Any) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in values}


def test_engine_graphs_are_float16_but_for_the_logits(half_llama: tuple[Path, Path]) -> None:
    _, art = half_llama
    n = io.ArtifactConfig.load(art).n_layers
    for name in (es.ENGINE_FILE, es.ENGINE_MIXED_FILE):
        graph = onnx.load(str(art / name))
        inputs, outputs = _types(graph.graph.input), _types(graph.graph.output)
        assert {inputs[p] for p in io.past_names(n)} == {TensorProto.FLOAT16}
        assert {outputs[p] for p in io.present_names(n)} == {TensorProto.FLOAT16}
        assert outputs[io.LOGITS] == TensorProto.FLOAT
        assert outputs[es.GREEDY_IDS] == TensorProto.INT64
        floats = {t.data_type for t in graph.graph.initializer
                  if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)}
        assert floats == {TensorProto.FLOAT16}, f"{name} keeps float32 weights"
    model = onnx.load(str(art / io.MODEL_FILE), load_external_data=False)  # cache float16
    assert {_types(model.graph.input)[p] for p in io.past_names(n)} == {TensorProto.FLOAT16}
    manifest = json.loads((art / io.MANIFEST_FILE).read_text("utf-8"))
    assert manifest["kv_dtype"] == "float16"
    engine = manifest["verification"]["engine"]
    assert engine["greedy_ids_equal_argmax"] and engine["in_place"] and engine["greedy_equal"]


@torch.no_grad()
def test_float16_engine_graph_agrees_with_pytorch_by_names(half_llama: tuple[Path, Path]
                                                           ) -> None:
    """A prompt and teacher-forced decode steps through engine.onnx run by its names (no
    project code), against the float32 PyTorch model: within the float16 bound, the same
    greedy choice wherever PyTorch's is clear, and greedy_ids the argmax of the logits."""
    ckpt, art = half_llama
    gpt = load_checkpoint(ckpt).model.eval()
    cfg = gpt.config
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, 20).tolist()  # 12 prompt + 8 decode
    reference = gpt(torch.tensor([tokens])).logits[0].float().numpy()  # (20, V)
    session = ort.InferenceSession(str(art / es.ENGINE_FILE), providers=["CPUExecutionProvider"])
    m = 32
    cache = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, cfg.kv_heads, m, cfg.head_dim),
                                                       np.float16))
             for _ in range(2 * cfg.n_layers)]
    got, greedy = [], []
    fed = [(tokens[:12], 0)] + [([t], 12 + i) for i, t in enumerate(tokens[12:19])]
    for ids, start in fed:
        t = len(ids)
        binding = session.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, np.array([ids], np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.arange(start, start + t)[None])
        binding.bind_cpu_input(es.SEQLENS_K, np.array([start + t - 1], np.int32))
        binding.bind_cpu_input(es.TOTAL_SEQUENCE_LENGTH, np.array([start + t], np.int32))
        binding.bind_cpu_input(es.LOGITS_INDEX, np.arange(t)[None])
        binding.bind_output(io.LOGITS, "cpu")  # outputs come back in binding order
        binding.bind_output(es.GREEDY_IDS, "cpu")
        for name, value in zip(io.past_names(cfg.n_layers), cache, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(io.present_names(cfg.n_layers), cache, strict=True):
            binding.bind_ortvalue_output(name, value)  # written in place
        session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        got.append(outs[0].numpy()[0])  # (t, V)
        greedy.append(outs[1].numpy()[0])  # (t,)
    logits = np.concatenate(got)  # (19, V)
    ref = reference[:19]
    tolerance = logits_tolerance(cfg, float(np.abs(ref).max()), "float16", half=True)
    assert np.abs(logits - ref).max() <= tolerance
    assert tolerance < 0.1 * np.abs(ref).max()  # the bound still means something
    differ = np.flatnonzero(logits.argmax(-1) != ref.argmax(-1))
    assert not clear_mismatches([top2_margin(ref[i]) for i in differ], tolerance)
    assert (np.concatenate(greedy) == logits.argmax(-1)).all()


def test_float16_refuses_quantisation(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float32"):
        export_artifact(tiny_checkpoint, tmp_path / "a", dtype="float16", quantize="int4",
                        engine_graph=True)
    assert not (tmp_path / "a").exists()
