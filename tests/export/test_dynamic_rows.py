"""export/quantize/dynamic_rows.py: quantize_dynamic's graph with one activation scale per row,
against a numpy computation of the same arithmetic, at both opset forms of ReduceMax."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.quantize.dynamic_rows import per_row_activations


def quantized_matmul(tmp_path: Path, opset: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """quantize_dynamic's output for one MatMul (B, T, 64) x (64, 32), and its weights, as
    export/quantize/weights.py calls it (7-bit weights: exact products on every x86 host)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weights = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 32])],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    src, dst = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(model, str(src))
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=True)
    return onnx.load(str(dst)), weights


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The product with each row of x quantised as DynamicQuantizeLinear quantises a whole
    tensor (range holding 0, 255 steps, zero point rounded, codes saturated), the row's
    codes less its zero point times the int8 weights in int64, scaled back (numpy)."""
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    codes = init["w_quantized"].astype(np.int64) - init["w_zero_point"].astype(np.int64)
    lo = np.minimum(x.min(-1, keepdims=True), 0)  # (B, T, 1)
    hi = np.maximum(x.max(-1, keepdims=True), 0)
    scale = np.maximum(hi - lo, np.finfo(np.float32).tiny) / np.float32(255)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    rows = np.clip(np.round(x / scale) + zero, 0, 255).astype(np.int64) - zero.astype(np.int64)
    return (rows @ codes).astype(np.float32) * (scale * init["w_scale"])  # (B, T, 32)


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   ort.GraphOptimizationLevel.ORT_ENABLE_ALL])
@pytest.mark.parametrize("opset", [17, 18])
def test_each_row_is_quantised_on_its_own(tmp_path: Path, opset: int,
                                          level: ort.GraphOptimizationLevel) -> None:
    """Unoptimised and as the service loads it (ORT's fusions on)."""
    model, weights = quantized_matmul(tmp_path, opset)
    assert [n.op_type for n in model.graph.node].count("DynamicQuantizeLinear") == 1
    assert per_row_activations(model) == 1
    assert "DynamicQuantizeLinear" not in {n.op_type for n in model.graph.node}
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    x[0, 1] *= 50.0  # one loud row: it must not coarsen the others' codes
    x[1, 2] = 0.0  # a silent row: its product is 0
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    want = reference(model, x)
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    assert not got[1, 2].any()
    # each row alone gives what it gave in the batch, and stays near the float product
    for b in range(2):
        for t in range(3):
            alone = session.run(None, {"x": x[b:b + 1, t:t + 1]})[0]
            assert np.array_equal(alone[0, 0], got[b, t])
    exact = x @ weights
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


def test_a_graph_without_dynamic_quantisation_is_left_alone(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "no_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    before = model.SerializeToString()
    assert per_row_activations(model) == 0
    assert model.SerializeToString() == before
