"""A GGUF-op graph where the op library cannot load: the session layer serves a copy with
the blocks dequantised to float32 under ONNX Runtime's own MatMul / Gather
(service/ops/dequantised.py).

The references are test_gguf_matmul's: each type's random blocks with numpy's dequantised
weights (gguf's dequantiser or the test's own), X · Wᵀ in float64; the repacked layout is
written by ggml's own repack in the op library, so unpacking it is checked against ggml.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import service.ops
from service.contract.sessions import create_session
from service.ops.dequantised import dequantise, unpack_repacked
from tests.service.ops.test_gguf_matmul import TYPES, K, N, matmul_model, row_error
from tests.service.ops.test_gguf_repacked import REPACKED

# float32 accumulation over K = 512 against float64: 5.2e-7 at most, measured on these weights
FLOAT32 = 2e-6


def _gguf_dequantises(type_id: int) -> bool:
    """Whether the gguf package has a dequantiser for ``type_id`` (one zero block)."""
    try:
        kind = gguf.GGMLQuantizationType(type_id)
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
    except (ValueError, NotImplementedError):  # a type gguf does not know, or no dequantiser
        return False
    return True


# the types the gguf package dequantises (the others have no standard-op form: refused)
DEQUANTISABLE = [name for name, t in TYPES.items() if _gguf_dequantises(t.type_id)]


@pytest.fixture
def no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op library as on a host where it cannot load (not built, or for another CPU)."""
    monkeypatch.setattr(service.ops, "library_path", lambda cache=None: None)


@pytest.mark.parametrize("name", DEQUANTISABLE)
def test_products_equal_numpy(name: str, no_library: None,
                              caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(0)
    stored, dense = TYPES[name].make(rng, N, K)
    caplog.set_level(logging.WARNING, logger="service.contract.sessions")
    session = create_session(matmul_model(TYPES[name].type_id, K, w=stored))
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.name == "service.contract.sessions"]
    assert "dequantised to float32" in warning and "make gguf-ops" in warning
    for m in (1, 3, 17):
        x = rng.standard_normal((2, m, K)).astype(np.float32)  # leading dimensions kept
        (y,) = session.run(None, {"X": x})
        assert y.shape == (2, m, N) and y.dtype == np.float32
        assert row_error(y, x.astype(np.float64) @ dense.T) < FLOAT32, (name, m)


def test_the_swiglu_epilogue_is_spelled_out(no_library: None) -> None:
    """A GgufMatMul with ``epilogue="swiglu"`` becomes MatMul, Split, Sigmoid and two Muls:
    silu(gate) · up of numpy's float64 products, half as wide."""
    rng = np.random.default_rng(5)
    stored, dense = TYPES["Q4_0"].make(rng, 2 * 20, K)
    model = matmul_model(TYPES["Q4_0"].type_id, K, w=stored, epilogue="swiglu")
    session = create_session(model)
    x = rng.standard_normal((3, K)).astype(np.float32)
    (y,) = session.run(None, {"X": x})
    products = x.astype(np.float64) @ dense.T
    gate, up = products[:, :20], products[:, 20:]
    assert y.shape == (3, 20)
    assert row_error(y, gate / (1 + np.exp(-gate)) * up) < FLOAT32


def test_the_swiglu_op_is_spelled_out(no_library: None) -> None:
    """The adapter graphs' Swiglu op (gate | up → silu(gate) · up) becomes Split, Sigmoid and
    two Muls."""
    node = helper.make_node(service.ops.SWIGLU_OP, ["X"], ["Y"], name="act",
                            domain=service.ops.DOMAIN)
    graph = helper.make_graph([node], "swiglu",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(service.ops.DOMAIN, 1)])
    x = np.random.default_rng(6).standard_normal((2, 3, 16)).astype(np.float32)
    (y,) = create_session(model.SerializeToString()).run(None, {"X": x})
    gate, up = x[..., :8].astype(np.float64), x[..., 8:]
    assert y.shape == (2, 3, 8)
    np.testing.assert_allclose(y, gate / (1 + np.exp(-gate)) * up, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", REPACKED)
def test_the_repacked_layout_unpacks_to_the_files_rows(gguf_ops_library: Path,
                                                       name: str) -> None:
    """ggml's repack (in the op library) undone in numpy gives the file's rows back, byte
    for byte; a graph holding the layout then computes the file's weights."""
    rng = np.random.default_rng(1)
    stored, dense = TYPES[name].make(rng, 72, 576)  # 9 groups of 8 rows, 18 blocks a row
    layout, why = service.ops.repack(TYPES[name].type_id, 576, stored, gguf_ops_library)
    if layout is None:
        pytest.skip(f"{name}: {why}")  # ggml keeps the rows on a CPU without AVX2
    assert not np.array_equal(layout, stored)
    np.testing.assert_array_equal(unpack_repacked(layout, TYPES[name].type_id, 576), stored)
    weights = dequantise(layout, TYPES[name].type_id, 576, service.ops.REPACKED_LAYOUT)
    np.testing.assert_array_equal(weights, dense.astype(np.float32))


def test_a_tied_table_serves_the_gather_and_the_head(no_library: None) -> None:
    """One W read by GgufGather (the embedding) and GgufMatMul (the tied LM head): each
    gets ONNX Runtime's op over the dequantised table; ids counting from the end too."""
    rng = np.random.default_rng(2)
    stored, dense = TYPES["Q4_1"].make(rng, N, K)
    table = dense.astype(np.float32)
    attrs = {"ggml_type": TYPES["Q4_1"].type_id, "k": K}
    nodes = [helper.make_node(service.ops.GATHER_OP, ["ids", "W"], ["h"], name="embed",
                              domain=service.ops.DOMAIN, **attrs),
             helper.make_node(service.ops.MATMUL_OP, ["h", "W"], ["logits"], name="head",
                              domain=service.ops.DOMAIN, **attrs)]
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(stored, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(service.ops.DOMAIN, 1)])
    ids = np.array([[0, 5, N - 1, -1, -N]])
    h, logits = create_session(model.SerializeToString()).run(None, {"ids": ids})
    np.testing.assert_array_equal(h, table[ids])
    assert row_error(logits, table[ids].astype(np.float64) @ dense.T) < FLOAT32


def test_a_type_without_a_dequantiser_is_named(no_library: None) -> None:
    """A type the gguf package cannot dequantise: one line naming the node and the type."""
    missing = [name for name in TYPES if name not in DEQUANTISABLE]
    if not missing:
        pytest.skip("the gguf package dequantises every type the op computes")
    name = missing[0]
    stored, _ = TYPES[name].make(np.random.default_rng(3), N, K)
    with pytest.raises(ValueError, match=rf"node 'proj'.*type {TYPES[name].type_id}") as caught:
        create_session(matmul_model(TYPES[name].type_id, K, w=stored))
    assert "\n" not in str(caught.value) and "make gguf-ops" in str(caught.value)
