"""The decoder graph as ONNX Runtime runs it: the key cache is read in place, never copied.

QKᵀ must reach ONNX Runtime as MatMul(Q, Transpose(K)) so that its optimiser folds the
transpose into FusedMatMul(transB=1). A graph that transposes (or scales) the whole key
cache at every decode step costs a full copy of the cache per layer per token.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

from service.contract import io_spec as io


def _optimized_graph(artifact: Path, tmp_path: Path) -> onnx.GraphProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(artifact / io.MODEL_FILE), options,
                         providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph


def test_no_node_transposes_the_key_cache(tiny_artifact: Path, tmp_path: Path) -> None:
    graph = _optimized_graph(tiny_artifact, tmp_path)
    config = io.ArtifactConfig.load(tiny_artifact)
    key_caches = {io.present_key_name(i) for i in range(config.n_layers)}
    # The tensors holding the concatenated keys are exactly the graph outputs present.{i}.key
    # (or the values they are copied from by an Identity node).
    producers = {out: node for node in graph.node for out in node.output}
    for name in list(key_caches):
        node = producers.get(name)
        if node is not None and node.op_type == "Identity":
            key_caches.add(node.input[0])
    readers = [node for node in graph.node if set(node.input) & key_caches]
    assert readers, "no node reads the key cache"
    assert not [n.op_type for n in readers if n.op_type == "Transpose"]
    fused = [n for n in readers if n.op_type == "FusedMatMul"]
    assert len(fused) == config.n_layers
    assert all(any(a.name == "transB" and a.i == 1 for a in n.attribute) for n in fused)
