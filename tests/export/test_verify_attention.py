"""export/verify/parity.py's attention.onnx check: its scale-aware bound still fails real bugs.

The tiny trained model's verified attention.onnx is broken in one place, in the graph, the
way a graph-builder bug would break it: the causal mask left out of the softmax, two heads
swapped, the scores scaled 1% off 1/√hs. The reference is the PyTorch model's own
attention intermediates, as in the export; each broken graph must fail verification.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from export.verify.parity import VerificationError, verify_attention
from model.checkpoint import load_checkpoint
from model.gpt import GPT
from tests.conftest import torch_threads

BREAKS = ("mask", "heads", "scale")


def first_softmax(model: onnx.ModelProto) -> onnx.NodeProto:
    """Layer 0's attention softmax (the first in graph order)."""
    return next(n for n in model.graph.node if n.op_type == "Softmax")


def broken(model: onnx.ModelProto, kind: str, heads: int) -> onnx.ModelProto:
    """``model`` with layer 0's softmax input changed as ``kind`` says."""
    graph = model.graph
    softmax = first_softmax(model)
    produced = {o: n for n in graph.node for o in n.output}
    scaled = softmax.input[0]
    if kind == "mask":  # the scores before the additive mask: the outputs still show -inf
        softmax.input[0] = produced[scaled].input[0]
        return model
    name = f"broken.{kind}"
    if kind == "heads":  # heads 0 and 1 swapped, (B, nh, T, S)
        order = np.array([1, 0, *range(2, heads)], np.int64)
        graph.initializer.append(numpy_helper.from_array(order, f"{name}.order"))
        node = helper.make_node("Gather", [scaled, f"{name}.order"], [name], axis=1)
    else:  # a 1% wrong temperature
        graph.initializer.append(numpy_helper.from_array(np.array(1.01, np.float32),
                                                         f"{name}.factor"))
        node = helper.make_node("Mul", [scaled, f"{name}.factor"], [name])
    at = list(graph.node).index(softmax)
    graph.node.insert(at, node)
    softmax.input[0] = name
    return model


@pytest.fixture(scope="module")
def tiny_gpt(tiny_checkpoint: Path) -> GPT:
    return load_checkpoint(tiny_checkpoint).model.eval()


def test_the_honest_graph_passes_within_its_bound(tiny_gpt: GPT, tiny_artifact: Path) -> None:
    with torch_threads(1):
        figures = verify_attention(tiny_gpt, tiny_artifact / "attention.onnx")
    assert 1e-5 <= figures["tolerance"] < 1e-3
    assert figures["weights_max_abs_diff"] <= figures["tolerance"]


@pytest.mark.parametrize("kind", BREAKS)
def test_a_broken_attention_graph_fails(tiny_gpt: GPT, tiny_artifact: Path, tmp_path: Path,
                                        kind: str) -> None:
    model = onnx.load(str(tiny_artifact / "attention.onnx"))  # weights loaded
    path = tmp_path / "attention.onnx"
    onnx.save_model(broken(model, kind, tiny_gpt.config.n_heads), str(path))
    with torch_threads(1), pytest.raises(VerificationError, match="attention weights differ"):
        verify_attention(tiny_gpt, path)
