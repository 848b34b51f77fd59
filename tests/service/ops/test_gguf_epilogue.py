"""GgufMatMul's ``epilogue="swiglu"`` (service/ops/gguf_epilogue.cc): the product over W's
gate | up rows, then silu(gate) · up, against numpy's silu of numpy's products, on every
path the product takes (int8 activations over the rows, the repack layout, float
activations); and the silu itself over gate values from −200 to 200 against float64.

The weights, the one-node model and the session are test_gguf_matmul's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import service.ops
from tests.service.ops.test_gguf_matmul import EXACT, TYPES, matmul_model, row_error, session

HALF = 40  # gate rows, and as many up rows: N = 80, whole groups of 8 for the repack layout
K = 512
BATCHES = (1, 3, 17, 64)
# silu(g)·u against numpy's on the same products: float32 exp (< 2e-7 relative), a
# division and two products; measured at most 6.5e-8 of a row's norm (against numpy's
# products, 1.1e-6: theirs, EXACT).
SILU = 2e-6


def silu(g: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # e^−g = inf below −709: g / inf, silu's limit −0
        return g / (1.0 + np.exp(-g))


def swiglu(products: np.ndarray) -> np.ndarray:
    """(M, 2·HALF) gate | up → (M, HALF), in float64."""
    gate, up = products[..., :HALF].astype(np.float64), products[..., HALF:].astype(np.float64)
    return silu(gate) * up


@pytest.mark.parametrize(("name", "extra"), [
    ("Q4_0", {}),
    ("Q4_0", {"layout": service.ops.REPACKED_LAYOUT}),
    ("Q4_K", {}),
    ("Q6_K", {}),
    ("Q8_0", {}),
    ("Q4_1", {"activations": "float"}),
])
def test_swiglu_of_the_products_matches_numpy(gguf_ops_library: Path, name: str,
                                              extra: dict[str, str]) -> None:
    """For each M (one row: the decode step; 64: a task of several rows), the op with the
    epilogue equals numpy's silu of the same op's products without it (the epilogue's own
    arithmetic), and numpy's silu of numpy's products (X quantised as the op quantises it;
    at float activations X as it is) within the products' own bound."""
    weight_type = TYPES[name]
    rng = np.random.default_rng(3)
    stored, dense = weight_type.make(rng, 2 * HALF, K)
    w = stored
    if extra.get("layout") == service.ops.REPACKED_LAYOUT:
        w, why = service.ops.repack(weight_type.type_id, K, stored, gguf_ops_library)
        if w is None:
            pytest.skip(f"no repack layout on this CPU: {why}")
    fused = session(matmul_model(weight_type.type_id, K, epilogue="swiglu", **extra),
                    gguf_ops_library)
    plain = session(matmul_model(weight_type.type_id, K, **extra), gguf_ops_library)
    for m in BATCHES:
        x = rng.standard_normal((m, K)).astype(np.float32)
        (y,) = fused.run(None, {"X": x, "W": w})
        (products,) = plain.run(None, {"X": x, "W": w})
        assert y.shape == (m, HALF)
        assert row_error(y, swiglu(products)) <= SILU, (name, m)
        numpy_products = (x.astype(np.float64) @ dense.T if extra.get("activations") == "float"
                          else weight_type.as_computed(x, stored, dense))
        assert row_error(y, swiglu(numpy_products)) <= 5 * EXACT, (name, m)


def test_silu_over_its_whole_range(gguf_ops_library: Path) -> None:
    """F32 weights at float activations compute X·Wᵀ exactly, so each gate value is set:
    gates from −200 to 200 (e^−g would overflow float32 below −88: the op takes e^−|g|),
    ±0, ±1e-30 and 88.5, each up 1, 2 or −3, in rows of a width the vectors do not divide
    (tails)."""
    half = 1000 + 5
    gates = np.concatenate([np.linspace(-200.0, 200.0, half - 5),
                            [0.0, -0.0, 1e-30, -1e-30, 88.5]]).astype(np.float32)
    ups = np.resize(np.array([1.0, 2.0, -3.0], np.float32), half)
    k = 32
    w = np.zeros((2 * half, k), np.float32)  # row j: gate j in column 0, up j in column 1
    w[:half, 0] = gates
    w[half:, 1] = ups
    x = np.zeros((2, k), np.float32)
    x[:, 0], x[:, 1] = 1.0, 1.0
    model = matmul_model(TYPES["F32"].type_id, k, epilogue="swiglu", activations="float")
    (y,) = session(model, gguf_ops_library).run(None, {"X": x, "W": w.view(np.uint8)})
    expected = silu(gates.astype(np.float64)) * ups
    # Below −87 the op's e^x is 0 (vec_exp.h), so silu is 0 where it is ~1e-36: the floor.
    np.testing.assert_allclose(y[0], expected, rtol=SILU, atol=1e-30)
    np.testing.assert_array_equal(y[0], y[1])


def test_the_swiglu_op_is_the_epilogue_bit_for_bit(gguf_ops_library: Path) -> None:
    """Swiglu over a product's gate | up (what the adapter graphs run, adapters added
    between) equals the product with the epilogue bit for bit, at one row and at 40 (several
    tasks), and X of an odd width is refused."""
    rng = np.random.default_rng(6)
    stored, _ = TYPES["Q4_K"].make(rng, 2 * HALF, K)
    fused = session(matmul_model(TYPES["Q4_K"].type_id, K, epilogue="swiglu"), gguf_ops_library)
    plain = session(matmul_model(TYPES["Q4_K"].type_id, K), gguf_ops_library)
    node = helper.make_node(service.ops.SWIGLU_OP, ["X"], ["Y"], name="act",
                            domain=service.ops.DOMAIN)
    graph = helper.make_graph([node], "swiglu",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    op = session(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(service.ops.DOMAIN, 1)]
    ).SerializeToString(), gguf_ops_library)
    for m in (1, 40):
        x = rng.standard_normal((m, K)).astype(np.float32)
        (products,) = plain.run(None, {"X": x, "W": stored})
        (y,) = op.run(None, {"X": products})
        np.testing.assert_array_equal(y, fused.run(None, {"X": x, "W": stored})[0])
        assert row_error(y, swiglu(products)) <= SILU
    with pytest.raises(Exception, match=r"Swiglu node 'act': X has shape \[2, 5\]; its last "
                                        r"dimension must be gate \| up, even"):
        op.run(None, {"X": np.ones((2, 5), np.float32)})


def test_leading_dimensions(gguf_ops_library: Path) -> None:
    """X (2, 3, K) gives Y (2, 3, HALF), each row as alone."""
    rng = np.random.default_rng(1)
    stored, _ = TYPES["Q4_0"].make(rng, 2 * HALF, K)
    sess = session(matmul_model(TYPES["Q4_0"].type_id, K, epilogue="swiglu"), gguf_ops_library)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    (y,) = sess.run(None, {"X": x, "W": stored})
    (flat,) = sess.run(None, {"X": x.reshape(6, K), "W": stored})
    assert y.shape == (2, 3, HALF)
    np.testing.assert_array_equal(y.reshape(6, HALF), flat)


def test_an_odd_number_of_rows_is_refused(gguf_ops_library: Path) -> None:
    rng = np.random.default_rng(2)
    stored, _ = TYPES["Q4_0"].make(rng, 2 * HALF + 1, K)
    sess = session(matmul_model(TYPES["Q4_0"].type_id, K, epilogue="swiglu"), gguf_ops_library)
    with pytest.raises(Exception, match=r"GgufMatMul node 'proj': W has 81 rows; "
                                        r"epilogue='swiglu' takes gate \| up rows, an even number"):
        sess.run(None, {"X": np.ones((1, K), np.float32), "W": stored})


def test_an_unknown_epilogue_is_refused(gguf_ops_library: Path) -> None:
    with pytest.raises(Exception, match="attribute epilogue='gelu' is neither '' nor 'swiglu'"):
        session(matmul_model(TYPES["Q4_0"].type_id, K, epilogue="gelu"), gguf_ops_library)


def test_float_epilogue_matches_its_absence_on_rows_alone(gguf_ops_library: Path) -> None:
    """An empty epilogue is none: the same Y as a node without the attribute, bit for bit."""
    rng = np.random.default_rng(4)
    stored, _ = TYPES["Q4_K"].make(rng, 2 * HALF, K)
    x = rng.standard_normal((5, K)).astype(np.float32)
    (y,) = session(matmul_model(TYPES["Q4_K"].type_id, K, epilogue=""),
                   gguf_ops_library).run(None, {"X": x, "W": stored})
    (plain,) = session(matmul_model(TYPES["Q4_K"].type_id, K),
                       gguf_ops_library).run(None, {"X": x, "W": stored})
    np.testing.assert_array_equal(y, plain)
