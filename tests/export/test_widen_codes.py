"""4-bit MatMulNBits weights widened to 8-bit codes (export/widen_codes.py): the same values.

The reference is numpy: each weight dequantised from the 4-bit node's own initializers,
(q − zero point)·scale per block of 32, then x·Wᵀ. Both the 4-bit graph and its widened
copy must compute that, for both integer zero-point forms a 4-bit node can have: none (the
implicit 8) and packed 4-bit (with a padded nibble when the blocks are odd in number); a
node with float zero points stays 4-bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.widen_codes import exact_int8_products, widen_4bit_codes

K, N, BLOCK = 96, 40, 32  # three blocks a row: the packed zero points end in a pad nibble
BLOCKS = K // BLOCK


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """(…, 2m) values 0..15 → (…, m) bytes, element 2i in the low nibble."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def four_bit_model(zero_points: str, rng: np.random.Generator
                   ) -> tuple[onnx.ModelProto, np.ndarray]:
    """One 4-bit MatMulNBits over random codes; and its weight (N, K) dequantised here."""
    codes = rng.integers(0, 16, (N, BLOCKS, BLOCK), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, BLOCKS)).astype(np.float32)
    inits = [numpy_helper.from_array(pack_nibbles(codes), "w_q4"),
             numpy_helper.from_array(scales.reshape(-1), "w_scales")]
    inputs = ["x", "w_q4", "w_scales"]
    if zero_points == "none":
        zp = np.full((N, BLOCKS), 8.0)
    elif zero_points == "packed":
        points = rng.integers(0, 16, (N, BLOCKS), dtype=np.uint8)
        padded = np.zeros((N, BLOCKS + 1), np.uint8)
        padded[:, :BLOCKS] = points
        inits.append(numpy_helper.from_array(pack_nibbles(padded).reshape(-1), "w_zp"))
        inputs.append("w_zp")
        zp = points.astype(np.float64)
    else:  # float zero points, as --quantize gguf's float-zp form writes them
        points_f = rng.uniform(0, 15, (N, BLOCKS)).astype(np.float32)
        inits.append(numpy_helper.from_array(points_f.reshape(-1), "w_zp"))
        inputs.append("w_zp")
        zp = points_f.astype(np.float64)
    weight = (codes - zp[..., None]) * scales[..., None]  # (N, blocks, 32)
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N,
                            bits=4, block_size=BLOCK, accuracy_level=0)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model, weight.reshape(N, K)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("zero_points", ["none", "packed"])
def test_widened_codes_compute_the_four_bit_weights(zero_points: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    model, weight = four_bit_model(zero_points, rng)
    widened, count = widen_4bit_codes(model, tmp_path)
    assert count == 1
    node = widened.graph.node[0]
    assert {a.name: a.i for a in node.attribute}["bits"] == 8
    codes8 = {t.name: numpy_helper.to_array(t) for t in widened.graph.initializer}[node.input[1]]
    assert codes8.shape == (N, BLOCKS, BLOCK) and codes8.max() <= 15  # one code a byte
    x = rng.standard_normal((5, K)).astype(np.float32)
    want = x.astype(np.float64) @ weight.T  # (5, N)
    for graph in (model, widened):
        np.testing.assert_allclose(run(graph, x), want, rtol=1e-5, atol=1e-5)
    # the 4-bit graph is left as it was
    assert {a.name: a.i for a in model.graph.node[0].attribute}["bits"] == 4


def test_float_zero_points_stay_four_bit(tmp_path: Path) -> None:
    """ONNX Runtime's 8-bit CPU kernel refuses float zero points: such a node is kept."""
    rng = np.random.default_rng(4)
    model, weight = four_bit_model("float", rng)
    widened, count = widen_4bit_codes(model, tmp_path)
    assert count == 0
    assert {a.name: a.i for a in widened.graph.node[0].attribute}["bits"] == 4
    x = rng.standard_normal((3, K)).astype(np.float32)
    np.testing.assert_allclose(run(widened, x), x.astype(np.float64) @ weight.T,
                               rtol=1e-5, atol=1e-5)


def test_a_graph_without_four_bit_nodes_is_left_alone(tmp_path: Path) -> None:
    model, _ = four_bit_model("none", np.random.default_rng(0))
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "bits":
            attribute.i = 8  # an 8-bit node (its codes are not, but nothing reads them here)
    widened, count = widen_4bit_codes(model, tmp_path)
    assert count == 0
    assert widened.graph.initializer[0].name == "w_q4"


@pytest.mark.parametrize(("flags", "exact"), [
    ("fpu sse2 avx2 fma", False),                 # AVX2 only: vpmaddubsw saturates
    ("fpu avx2 avx512f avx512bw", False),         # AVX-512 without its VNNI
    ("fpu avx2 avx512f avx512_vnni", True),
    ("fpu avx2 avx_vnni", True),                  # Alder Lake's AVX-VNNI
    (None, True),                                 # ARM's cpuinfo has "Features", not "flags"
])
def test_exact_int8_products_reads_the_vnni_flags(flags: str | None, exact: bool) -> None:
    cpuinfo = ("processor\t: 0\nmodel name\t: some cpu\n"
               + (f"flags\t\t: {flags}\n" if flags else "Features\t: fp asimd\n"))
    assert exact_int8_products(cpuinfo) is exact
