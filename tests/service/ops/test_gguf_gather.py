"""GgufGather (service/ops/gguf_gather.cc) against numpy, for every weight type it accepts.

The op looks rows of a GGUF tensor up by id and dequantises them with ggml's ``to_float``;
the reference is ``gguf.quants.dequantize`` (for Q1_0 / Q2_0 the numpy lines in
test_gguf_matmul.py). Both compute the same float32 products, so the rows must be EQUAL, bit
for bit (measured: every type exact at seeds 0-4). The weights are test_gguf_matmul.py's;
the library is conftest.py's fixture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

import service.ops
from tests.service.ops.test_gguf_matmul import TYPES, K, N, one_node_model, session

pytestmark = pytest.mark.timeout(1800)


def gather_model(type_id: int | None, k: int | None, w: np.ndarray | None = None) -> bytes:
    """ids (any shape) → GgufGather → Y (see test_gguf_matmul's ``one_node_model``)."""
    return one_node_model(service.ops.GATHER_OP, "ids", TensorProto.INT64, "embed", type_id,
                          k, w)


@pytest.mark.parametrize("name", list(TYPES))
def test_rows_equal_numpy_dequantize(gguf_ops_library: Path, name: str) -> None:
    """[B, T] ids, negative ones counting from the end (ONNX Gather): few ids (computed
    inline) and many (shared over the pool), each row exactly gguf's dequantised row."""
    rng = np.random.default_rng(0)
    stored, dense = TYPES[name].make(rng, N, K)
    expected = dense.astype(np.float32)
    assert np.array_equal(expected.astype(np.float64), dense)  # dequantize is float32
    sess = session(gather_model(TYPES[name].type_id, K), gguf_ops_library)
    for shape in ((2, 3), (4, 33)):
        ids = rng.integers(-N, N, size=shape)
        ids.flat[:2] = (N - 1, -N)  # both ends
        (y,) = sess.run(None, {"ids": ids, "W": stored})
        assert y.shape == (*shape, K) and y.dtype == np.float32
        np.testing.assert_array_equal(y, expected[ids], err_msg=name)


def test_shapes_and_an_initializer_weight(gguf_ops_library: Path) -> None:
    """W in the graph, as an export places a tied embedding; scalar, 1-D and empty ids."""
    stored, dense = TYPES["Q4_1"].make(np.random.default_rng(1), N, K)
    sess = session(gather_model(TYPES["Q4_1"].type_id, K, w=stored), gguf_ops_library)
    expected = dense.astype(np.float32)
    (scalar,) = sess.run(None, {"ids": np.array(5, np.int64)})
    np.testing.assert_array_equal(scalar, expected[5])
    (flat,) = sess.run(None, {"ids": np.array([0, 66, -1], np.int64)})
    np.testing.assert_array_equal(flat, expected[[0, 66, 66]])
    (empty,) = sess.run(None, {"ids": np.zeros((2, 0), np.int64)})
    assert empty.shape == (2, 0, K)


@pytest.mark.parametrize("bad", [N, -N - 1, 2**40])
def test_ids_out_of_range(gguf_ops_library: Path, bad: int) -> None:
    stored, _ = TYPES["Q8_0"].make(np.random.default_rng(2), N, K)
    sess = session(gather_model(8, K), gguf_ops_library)
    ids = np.zeros((2, 3), np.int64)
    ids[1, 2] = bad
    with pytest.raises(Exception, match=rf"GgufGather node 'embed': id {bad} at ids\[1, 2\] "
                                        rf"is out of range \[-{N}, {N}\)"):
        sess.run(None, {"ids": ids, "W": stored})


def test_wrong_row_bytes(gguf_ops_library: Path) -> None:
    stored, _ = TYPES["Q4_0"].make(np.random.default_rng(3), N, K)  # rows of 288 bytes
    sess = session(gather_model(2, K), gguf_ops_library)
    ids = np.zeros((1, 1), np.int64)
    with pytest.raises(Exception, match=r"GgufGather node 'embed': W has shape \[67, 290\].*"
                                        r"ggml_row_size = 288 bytes"):
        sess.run(None, {"ids": ids, "W": np.pad(stored, ((0, 0), (0, 2)))})
    with pytest.raises(Exception, match=rf"W has shape \[{stored.size}\]"):
        sess.run(None, {"ids": ids, "W": stored.reshape(-1)})


@pytest.mark.parametrize(("type_id", "k", "message"), [
    (2, 100, r"k=100 is not a multiple of the block size 32 of ggml_type 2 \(q4_0\)"),
    (2, 0, r"attribute k must be positive, got 0"),
    (15, K, r"ggml_type 15 \(q8_K\) has no dequantisation"),
    (-1, K, r"ggml_type -1 \(no such type in this ggml\)"),
    (None, K, r"GgufGather node 'embed': needs an int attribute 'ggml_type'"),
    (2, None, r"needs an int attribute 'k'"),
])
def test_bad_attributes_fail_when_the_session_is_created(
        gguf_ops_library: Path, type_id: int | None, k: int | None, message: str) -> None:
    with pytest.raises(Exception, match=message):
        session(gather_model(type_id, k), gguf_ops_library)


def test_the_op_accepts_exactly_the_tested_types(gguf_ops_library: Path) -> None:
    """Types with a to_float (and F32, copied) are accepted: GgufMatMul's types."""
    accepted = set()
    for type_id in range(64):
        try:
            session(gather_model(type_id, K), gguf_ops_library)
        except Exception as exc:
            assert "has no dequantisation" in str(exc), exc
        else:
            accepted.add(type_id)
    assert accepted == {t.type_id for t in TYPES.values()}
