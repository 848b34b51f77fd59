"""GgufMatMul (service/ops/gguf_matmul.cc) against numpy, for every weight type it accepts.

Weights are random: quantised with ``gguf.quants.quantize`` where the gguf package can, else
random blocks in ggml's layout (random codes, small random fp16 scales). The reference is
``X @ dequantize(W).T`` in float64 (``gguf.quants.dequantize``; for Q1_0 and Q2_0, which
gguf cannot dequantise, the few lines of ggml-quants.c written in numpy below). The op
quantises X to 8 bits (Q8_0/Q8_1/Q8_K) for the quantised types, to fp16/bf16 for those, so
the tolerance is on the error of a result row relative to its norm, per type (measured
maxima beside TYPES); against X quantised in numpy as ggml quantises it, every type must
agree to float32 accumulation (EXACT). M = 3, 17 and 64 take the batched kernels
(gguf_batched.cc) for the eight types in BATCHED, M = 1 ggml's vec_dot; the batched tests
below cover the thresholds and each instruction set.

The library is built by the session fixture (conftest.py; service/ops/build.py: cached, a
no-op when built; on a fresh clone it fetches ONNX Runtime's headers and the
llama-cpp-python sdist into .cache/ and compiles, 0.5-1.5 min on 2 cores). The tests skip
only where it cannot be built on this machine (a tool or a download missing), and fail when
the build fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from onnx import TensorProto, helper, numpy_helper

import service.ops
from service.ops import build

# A cold build is ~1.5 min on 2 idle cores: room for a loaded machine.
pytestmark = pytest.mark.timeout(1800)

N = 67  # odd: the last block of weight rows is partial
K = 512  # a multiple of every block size (32, 64, 128, 256)
BATCHES = (1, 3, 17, 64)
THREADS = 2


# ---------------------------------------------------------------------------------------------
# Weights: (W as stored (N, row_bytes) uint8, its dense float64 value (N, K)).

Weights = tuple[np.ndarray, np.ndarray]


def _fp16_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Small positive fp16 scales as bytes, shape + (2,)."""
    scales = (rng.uniform(0.5, 1.5, size=shape) * 2.0**-5).astype(np.float16)
    return scales.view(np.uint8).reshape((*shape, 2))


def _gguf_quantised(qtype: GGMLQuantizationType) -> Callable[[np.random.Generator, int, int],
                                                             Weights]:
    def make(rng: np.random.Generator, n: int, k: int) -> Weights:
        dense = rng.standard_normal((n, k)).astype(np.float32)
        stored = np.ascontiguousarray(quantize(dense, qtype)).view(np.uint8).reshape(n, -1)
        return stored, dequantize(stored, qtype).reshape(n, k).astype(np.float64)
    return make


def _random_blocks(block: int, block_bytes: int, halves: tuple[int, ...] = (),
                   fix: Callable[[np.random.Generator, np.ndarray], None] | None = None,
                   reference: Callable[[np.ndarray, int], np.ndarray] | None = None,
                   qtype: GGMLQuantizationType | None = None,
                   ) -> Callable[[np.random.Generator, int, int], Weights]:
    """Random blocks: random bytes, then the fp16 fields at ``halves`` (byte offsets in a
    block) set to small scales, then ``fix`` for layouts with other scale encodings."""
    def make(rng: np.random.Generator, n: int, k: int) -> Weights:
        raw = rng.integers(0, 256, size=(n, k // block, block_bytes), dtype=np.uint8)
        for offset in halves:
            raw[..., offset:offset + 2] = _fp16_bytes(rng, raw.shape[:2])
        if fix is not None:
            fix(rng, raw)
        stored = raw.reshape(n, -1)
        if reference is not None:
            dense = reference(stored, k)
        else:
            assert qtype is not None
            dense = dequantize(stored, qtype).reshape(n, k)
        return stored, dense.astype(np.float64)
    return make


def _iq1_m_scale(rng: np.random.Generator, raw: np.ndarray) -> None:
    """IQ1_M has no d field: its fp16 scale is spread over the top nibbles of the four
    uint16 block scales (bytes 48..55)."""
    scales = raw[..., 48:56].copy().view(np.uint16)  # (n, blocks, 4)
    d = _fp16_bytes(rng, raw.shape[:2]).view(np.uint16)[..., 0]  # (n, blocks)
    shifts = np.array([12, 8, 4, 0], dtype=np.uint16)
    nibbles = ((d[..., None] >> (12 - shifts)) & 0xF).astype(np.uint16)  # d's nibble i
    scales = (scales & 0x0FFF) | (nibbles << 12)
    raw[..., 48:56] = scales.view(np.uint8)


def _nvfp4_scales(rng: np.random.Generator, raw: np.ndarray) -> None:
    """NVFP4's four UE4M3 sub-block scales (bytes 0..3): moderate values, no NaN code."""
    raw[..., 0:4] = rng.integers(0x30, 0x41, size=(*raw.shape[:2], 4), dtype=np.uint8)


def _q1_0_reference(stored: np.ndarray, k: int) -> np.ndarray:
    """ggml-quants.c dequantize_row_q1_0: bit j of a 128-weight block is +d (1) or -d (0)."""
    blocks = stored.reshape(stored.shape[0], k // 128, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float64)  # (n, b, 1)
    bits = np.unpackbits(blocks[..., 2:], axis=-1, bitorder="little")  # (n, b, 128)
    return np.where(bits == 1, d, -d).reshape(stored.shape[0], k)


def _q2_0_reference(stored: np.ndarray, k: int) -> np.ndarray:
    """ggml-quants.c dequantize_row_q2_0: 2-bit codes 0..3 of a 64-weight block are
    (q - 1)·d, four to a byte from the low bits up."""
    blocks = stored.reshape(stored.shape[0], k // 64, 18)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float64)  # (n, b, 1)
    codes = blocks[..., 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)  # (n, b, 16, 4)
    q = (codes & 3).reshape(*blocks.shape[:2], 64).astype(np.float64)
    return ((q - 1.0) * d).reshape(stored.shape[0], k)


Q = GGMLQuantizationType


def _blocks(qtype: GGMLQuantizationType, halves: tuple[int, ...] = (),
            fix: Callable[[np.random.Generator, np.ndarray], None] | None = None,
            ) -> Callable[[np.random.Generator, int, int], Weights]:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return _random_blocks(block, block_bytes, halves, fix, qtype=qtype)


# ---------------------------------------------------------------------------------------------
# X as the op sees it: each row quantised into the weight type's vec_dot_type the way
# ggml's quantize_row_* do, then expanded again (float64). Against these the op is exact
# up to float32 accumulation.

def _q8_0_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 / Q8_1 codes of X (M, K): (q (M, B, 32), d (M, B, 1) float32, its fp16)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    peak = np.abs(blocks).max(axis=-1, keepdims=True)
    d = peak / np.float32(127)
    # 127 / peak, not 1 / d, as ggml's x86 quantize_row_q8_0 / _q8_1: the two differ in the
    # last bit for some peaks, and then a code at a near tie rounds the other way.
    inverse = np.divide(np.float32(127), peak, out=np.zeros_like(peak), where=peak > 0)
    q = np.rint(blocks * inverse)
    return q, d, d.astype(np.float16).astype(np.float64)


def _as_q8_0(x: np.ndarray) -> np.ndarray:
    q, _, d16 = _q8_0_rows(x)
    return (q * d16).reshape(x.shape)


def _as_q8_k(x: np.ndarray) -> np.ndarray:
    """Q8_K: per 256, the scale maps the value of largest magnitude to -127 (float d)."""
    blocks = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    inverse = np.float32(-127) / peak
    q = np.clip(np.rint(inverse * blocks), -128, 127)
    return (q.astype(np.float64) / inverse).reshape(x.shape)


def _as_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the top 16 bits, as ggml_compute_fp32_to_bf16."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return rounded.view(np.float32).astype(np.float64)


def _q8_1_product(x: np.ndarray, stored: np.ndarray, dense: np.ndarray,
                  block_bytes: int) -> np.ndarray:
    """Q4_1 / Q5_1 against Q8_1 activations: per 32-block d_x·Σ q_x·(w − m_w) plus m_w·s_x,
    where s_x = fp16(d_x·Σ q_x) with the float d_x (quantize_row_q8_1), not fp16(d_x)·Σ q_x."""
    q, d, d16 = _q8_0_rows(x)  # (M, B, 32), (M, B, 1)
    mins = stored.reshape(stored.shape[0], -1, block_bytes)[..., 2:4].copy()
    m_w = mins.view(np.float16)[..., 0].astype(np.float64)  # (N, B)
    s_x = (d[..., 0] * q.sum(axis=-1)).astype(np.float16).astype(np.float64)  # (M, B)
    centred = dense - np.repeat(m_w, 32, axis=1)  # (N, K)
    return (q * d16).reshape(x.shape) @ centred.T + s_x @ m_w.T


@dataclass(frozen=True)
class WeightType:
    type_id: int
    make: Callable[[np.random.Generator, int, int], Weights]
    activations: str  # ggml's vec_dot_type for this weight type
    tolerance: float  # max ‖Y_i − R_i‖ / ‖R_i‖ over rows i, R = X @ dequantize(W).T

    def as_computed(self, x: np.ndarray, stored: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """X·Wᵀ with X quantised as the op quantises it (float64)."""
        if self.activations == "Q8_1":
            return _q8_1_product(x, stored, dense, stored.shape[1] // (x.shape[1] // 32))
        expand = {"F32": lambda a: a.astype(np.float64),
                  "F16": lambda a: a.astype(np.float16).astype(np.float64),
                  "BF16": _as_bf16, "Q8_0": _as_q8_0, "Q8_K": _as_q8_k}[self.activations]
        return expand(x) @ dense.T


# The measured maximum of the row error against float X (seeds 0-4, M = 1, 3, 17, 64) is in
# each comment; the tolerances are about twice that. Activations rounded to 8 bits (Q8_0 /
# Q8_1 per 32 weights, Q8_K per 256) dominate the error of every quantised type; Q4_K and
# Q5_K measure higher here because random blocks give their rows a large common mean (the
# min term), which the 8-bit rounding of X scales too. Against X quantised as the op does
# (as_computed), every type measured within 5.2e-7 (float32 accumulation): EXACT below.
# (Q4_1 / Q5_1 need their Q8_1 sum term modelled for that; without it, 2e-3.)
EXACT = 2e-6
TYPES: dict[str, WeightType] = {
    "F32": WeightType(0, _gguf_quantised(Q.F32), "F32", 1e-6),         # 1.2e-7
    "F16": WeightType(1, _gguf_quantised(Q.F16), "F16", 1e-3),         # 3.1e-4
    "BF16": WeightType(30, _gguf_quantised(Q.BF16), "BF16", 5e-3),     # 2.4e-3
    "Q4_0": WeightType(2, _gguf_quantised(Q.Q4_0), "Q8_0", 1.5e-2),    # 7.6e-3
    "Q4_1": WeightType(3, _gguf_quantised(Q.Q4_1), "Q8_1", 1.5e-2),    # 8.1e-3
    "Q5_0": WeightType(6, _gguf_quantised(Q.Q5_0), "Q8_0", 1.5e-2),    # 7.5e-3
    "Q5_1": WeightType(7, _gguf_quantised(Q.Q5_1), "Q8_1", 1.5e-2),    # 7.8e-3
    "Q8_0": WeightType(8, _gguf_quantised(Q.Q8_0), "Q8_0", 1.5e-2),    # 7.7e-3
    "MXFP4": WeightType(39, _gguf_quantised(Q.MXFP4), "Q8_0", 1.5e-2),  # 7.6e-3
    "TQ1_0": WeightType(34, _gguf_quantised(Q.TQ1_0), "Q8_K", 2.5e-2),  # 1.3e-2
    "TQ2_0": WeightType(35, _gguf_quantised(Q.TQ2_0), "Q8_K", 2.5e-2),  # 1.3e-2
    "Q2_K": WeightType(10, _blocks(Q.Q2_K, (80, 82)), "Q8_K", 3e-2),    # 1.5e-2
    "Q3_K": WeightType(11, _blocks(Q.Q3_K, (108,)), "Q8_K", 2.5e-2),    # 1.1e-2
    "Q4_K": WeightType(12, _blocks(Q.Q4_K, (0, 2)), "Q8_K", 6e-2),      # 3.2e-2
    "Q5_K": WeightType(13, _blocks(Q.Q5_K, (0, 2)), "Q8_K", 6e-2),      # 3.1e-2
    "Q6_K": WeightType(14, _blocks(Q.Q6_K, (208,)), "Q8_K", 2.5e-2),    # 1.1e-2
    "IQ2_XXS": WeightType(16, _blocks(Q.IQ2_XXS, (0,)), "Q8_K", 2.5e-2),  # 1.1e-2
    "IQ2_XS": WeightType(17, _blocks(Q.IQ2_XS, (0,)), "Q8_K", 3e-2),      # 1.4e-2
    "IQ2_S": WeightType(22, _blocks(Q.IQ2_S, (0,)), "Q8_K", 2.5e-2),      # 1.1e-2
    "IQ3_XXS": WeightType(18, _blocks(Q.IQ3_XXS, (0,)), "Q8_K", 2.5e-2),  # 1.1e-2
    "IQ3_S": WeightType(21, _blocks(Q.IQ3_S, (0,)), "Q8_K", 2.5e-2),      # 1.1e-2
    "IQ1_S": WeightType(19, _blocks(Q.IQ1_S, (0,)), "Q8_K", 2.5e-2),      # 1.2e-2
    "IQ1_M": WeightType(29, _blocks(Q.IQ1_M, (), _iq1_m_scale), "Q8_K", 3e-2),  # 1.5e-2
    "IQ4_NL": WeightType(20, _blocks(Q.IQ4_NL, (0,)), "Q8_0", 1.5e-2),    # 8.0e-3
    "IQ4_XS": WeightType(23, _blocks(Q.IQ4_XS, (0,)), "Q8_K", 2.5e-2),    # 1.2e-2
    "NVFP4": WeightType(40, _blocks(Q.NVFP4, (), _nvfp4_scales), "Q8_0", 1.5e-2),  # 7.7e-3
    "Q1_0": WeightType(41, _random_blocks(128, 18, (0,), reference=_q1_0_reference), "Q8_0",
                       1.5e-2),  # 7.9e-3
    "Q2_0": WeightType(42, _random_blocks(64, 18, (0,), reference=_q2_0_reference), "Q8_0",
                       2e-2),  # 1.0e-2
}


# ---------------------------------------------------------------------------------------------
# The one-node model.

def one_node_model(op: str, first: str, first_type: int, name: str, type_id: int | None,
                   k: int | None, w: np.ndarray | None = None, **extra: str) -> bytes:
    """``first`` (any shape, of ``first_type``) and W → ``op`` → Y; W an input, or an
    initializer when given. An attribute given as None is left out; ``extra``: more."""
    attrs: dict[str, int | str] = {key: value for key, value in (("ggml_type", type_id),
                                                                  ("k", k)) if value is not None}
    attrs.update(extra)
    node = helper.make_node(op, [first, "W"], ["Y"], domain=service.ops.DOMAIN, name=name,
                            **attrs)
    inputs = [helper.make_tensor_value_info(first, first_type, None)]
    initializers = []
    if w is None:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.UINT8, None))
    else:
        initializers.append(numpy_helper.from_array(w, "W"))
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(service.ops.DOMAIN, 1)])
    return model.SerializeToString()


def matmul_model(type_id: int | None, k: int | None, w: np.ndarray | None = None,
                 **extra: str) -> bytes:
    """X (any shape) → GgufMatMul → Y (see :func:`one_node_model`)."""
    return one_node_model(service.ops.MATMUL_OP, "X", TensorProto.FLOAT, "proj", type_id, k, w,
                          **extra)


def session(model: bytes, library: Path, threads: int = THREADS) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = threads
    options.log_severity_level = 4  # the tests read the errors from the exceptions
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def row_error(y: np.ndarray, reference: np.ndarray) -> float:
    """max over rows of ‖y_i − r_i‖ / ‖r_i‖."""
    y2, r2 = y.reshape(-1, y.shape[-1]), reference.reshape(-1, reference.shape[-1])
    return float(np.max(np.linalg.norm(y2 - r2, axis=1) / np.linalg.norm(r2, axis=1)))


def run_type(library: Path, weight_type: WeightType,
             seed: int) -> dict[int, tuple[float, float]]:
    """Per batch size of ``BATCHES`` (one session, W a graph input): the row error against
    float X and against X quantised as the op quantises it."""
    rng = np.random.default_rng(seed)
    stored, dense = weight_type.make(rng, N, K)
    sess = session(matmul_model(weight_type.type_id, K), library)
    errors = {}
    for m in BATCHES:
        x = rng.standard_normal((m, K)).astype(np.float32)
        (y,) = sess.run(None, {"X": x, "W": stored})
        assert y.shape == (m, N) and y.dtype == np.float32
        errors[m] = (row_error(y, x.astype(np.float64) @ dense.T),
                     row_error(y, weight_type.as_computed(x, stored, dense)))
    return errors


# ---------------------------------------------------------------------------------------------
# Results.

@pytest.mark.parametrize("name", list(TYPES))
def test_matches_numpy(gguf_ops_library: Path, name: str) -> None:
    errors = run_type(gguf_ops_library, TYPES[name], seed=0)
    assert max(e for e, _ in errors.values()) <= TYPES[name].tolerance, errors
    assert max(e for _, e in errors.values()) <= EXACT, errors


def test_the_op_accepts_exactly_the_tested_types(gguf_ops_library: Path) -> None:
    """What ggml-cpu computes (vec_dot and from_float present) is what the op accepts; a
    newer ggml with a new type fails here until the type is tested above."""
    accepted = set()
    for type_id in range(64):
        try:
            session(matmul_model(type_id, K), gguf_ops_library)
        except Exception as exc:
            assert "has no CPU dot product" in str(exc), exc
        else:
            accepted.add(type_id)
    assert accepted == {t.type_id for t in TYPES.values()}


# The types GgufMatMul's batched kernels cover (service/ops/gguf_batched.cc) and the batch
# from which it takes them (batched::MinBatch); below it, and for every other type, each
# row is one ggml vec_dot per weight row.
BATCHED = {"Q4_0": 2, "Q4_1": 2, "Q5_0": 2, "Q5_1": 2, "Q8_0": 3, "Q4_K": 3, "Q5_K": 3,
           "Q6_K": 3}
PATH_ENV = "ATTNSERVE_GGUF_MATMUL_PATH"


def test_batched_rows_equal_rows_alone_and_threads_change_nothing(
        gguf_ops_library: Path) -> None:
    """One thread equals two, bit for bit, on either path. A row's result is bitwise the same
    in any batch the batched kernels compute (17 rows or 3); against the row alone (vec_dot,
    another float summation order) it agrees to float32 accumulation (measured 4.8e-7)."""
    rng = np.random.default_rng(1)
    for name in ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0", "F16"):
        stored, _ = TYPES[name].make(rng, N, K)
        model = matmul_model(TYPES[name].type_id, K)
        two, one = session(model, gguf_ops_library), session(model, gguf_ops_library, threads=1)
        x = rng.standard_normal((17, K)).astype(np.float32)
        (batched,) = two.run(None, {"X": x, "W": stored})
        (three,) = two.run(None, {"X": x[5:8], "W": stored})
        alone = np.concatenate([two.run(None, {"X": x[i:i + 1], "W": stored})[0]
                                for i in range(17)])
        (single_thread,) = one.run(None, {"X": x, "W": stored})
        np.testing.assert_array_equal(batched, single_thread, err_msg=name)
        np.testing.assert_array_equal(batched[5:8], three, err_msg=name)
        if name in BATCHED:
            assert row_error(batched, alone.astype(np.float64)) <= EXACT, name
        else:
            np.testing.assert_array_equal(batched, alone, err_msg=name)


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_path_at_its_threshold(gguf_ops_library: Path, name: str) -> None:
    """Just below the batch from which the batched kernels run (vec_dot), at it and above,
    against numpy, N odd (a partial tile of weight rows)."""
    weight_type = TYPES[name]
    rng = np.random.default_rng(5)
    stored, dense = weight_type.make(rng, N, K)
    sess = session(matmul_model(weight_type.type_id, K), gguf_ops_library)
    for m in (BATCHED[name] - 1, BATCHED[name], BATCHED[name] + 1, 8):
        x = rng.standard_normal((m, K)).astype(np.float32)
        (y,) = sess.run(None, {"X": x, "W": stored})
        assert row_error(y, x.astype(np.float64) @ dense.T) <= weight_type.tolerance, (name, m)
        assert row_error(y, weight_type.as_computed(x, stored, dense)) <= EXACT, (name, m)


def forced_session(model: bytes, library: Path, path: str) -> ort.InferenceSession:
    """A session on the kernel path ATTNSERVE_GGUF_MATMUL_PATH forces; the test skips where
    this CPU lacks its instruction set."""
    try:
        return session(model, library)
    except Exception as exc:
        if "this CPU runs only" in str(exc):
            pytest.skip(f"{path}: {exc}")
        raise


@pytest.mark.parametrize("path", ["avx2", "avx512vnni", "vec_dot"])
def test_each_path_matches_numpy(gguf_ops_library: Path, path: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batched type on each instruction set this CPU runs (ATTNSERVE_GGUF_MATMUL_PATH
    forces one, at every M), and on ggml's vec_dot alone; K = 576 (SmolLM2's width: not a
    whole number of the kernels' 256-weight chunks) for the 32-weight types; M = 5, 6, 7 leave
    each remainder of the VNNI kernels' four activation rows a step."""
    monkeypatch.setenv(PATH_ENV, path)
    for name in BATCHED:
        weight_type = TYPES[name]
        k = K if name.endswith("_K") else 576
        rng = np.random.default_rng(6)
        stored, dense = weight_type.make(rng, N, k)
        sess = forced_session(matmul_model(weight_type.type_id, k), gguf_ops_library, path)
        for m in (1, 5, 6, 7):
            x = rng.standard_normal((m, k)).astype(np.float32)
            (y,) = sess.run(None, {"X": x, "W": stored})
            assert row_error(y, x.astype(np.float64) @ dense.T) <= weight_type.tolerance, name
            assert row_error(y, weight_type.as_computed(x, stored, dense)) <= EXACT, (name, m)


# The bytes of each batched type's block that hold its codes (ggml's block layouts): set
# to 0xFF, every code is the type's largest (15, 31 with Q5's fifth bit, 63 for Q6_K).
CODE_BYTES = {"Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q5_0": slice(2, 22),
              "Q5_1": slice(4, 24), "Q8_0": slice(2, 34), "Q4_K": slice(16, 144),
              "Q5_K": slice(16, 176), "Q6_K": slice(0, 192)}


@pytest.mark.parametrize("path", ["avx2", "avx512vnni"])
def test_largest_codes_against_largest_activations(gguf_ops_library: Path, path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2 adds several maddubs results in int16 before widening them (gguf_batched_kernels.inc,
    SumsPerWidening): exact only while the sums cannot pass 2^15. Every code at its largest
    against activations quantised to ±127 (constant rows of either sign) is the extreme."""
    monkeypatch.setenv(PATH_ENV, path)
    for name, code_bytes in CODE_BYTES.items():
        weight_type = TYPES[name]
        qtype = GGMLQuantizationType(weight_type.type_id)
        stored, _ = weight_type.make(np.random.default_rng(7), N, K)
        blocks = stored.reshape(N, -1, GGML_QUANT_SIZES[qtype][1])  # a view of stored
        blocks[..., code_bytes] = 0xFF
        dense = dequantize(stored, qtype).astype(np.float64)
        sess = forced_session(matmul_model(weight_type.type_id, K), gguf_ops_library, path)
        x = np.repeat(np.array([[1.0], [-1.0], [3.0], [-0.5], [2.0]], np.float32), K, axis=1)
        (y,) = sess.run(None, {"X": x, "W": stored})
        assert row_error(y, weight_type.as_computed(x, stored, dense)) <= EXACT, name


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_row_dot_below_the_batched_threshold(gguf_ops_library: Path, name: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K and Q6_K at 1 and 2 rows on the auto path: our row dot (gguf_rowdot.cc) on an
    AVX-512 VNNI CPU, ggml's vec_dot elsewhere. Against numpy on random blocks and with every
    code at its largest against activations at ±127 (maddubs' int16 pair sums), K of one
    super-block and of sixteen; and against ggml's vec_dot alone (ATTNSERVE_GGUF_MATMUL_PATH
    =vec_dot), which sums the same integers in another float order (on other CPUs both are
    ggml's: the numpy checks still hold)."""
    weight_type = TYPES[name]
    qtype = GGMLQuantizationType(weight_type.type_id)
    rng = np.random.default_rng(8)
    for k in (256, 4096):
        random_w, _ = weight_type.make(rng, N, k)
        largest = random_w.copy()
        blocks = largest.reshape(N, -1, GGML_QUANT_SIZES[qtype][1])
        blocks[..., CODE_BYTES[name]] = 0xFF
        xs = [rng.standard_normal((m, k)).astype(np.float32) for m in (1, 2)]
        xs.append(np.repeat(np.array([[1.0], [-1.0]], np.float32), k, axis=1))
        for stored in (random_w, largest):
            dense = dequantize(stored, qtype).astype(np.float64)
            results = {}
            for path in ("auto", "vec_dot"):
                monkeypatch.setenv(PATH_ENV, path)
                sess = session(matmul_model(weight_type.type_id, k), gguf_ops_library)
                results[path] = [sess.run(None, {"X": x, "W": stored})[0] for x in xs]
            for x, auto, ggml in zip(xs, results["auto"], results["vec_dot"], strict=True):
                expected = weight_type.as_computed(x, stored, dense)
                assert row_error(auto, expected) <= EXACT, (name, k, x.shape)
                assert row_error(auto, ggml.astype(np.float64)) <= EXACT, (name, k, x.shape)


def test_an_unknown_path_is_refused(gguf_ops_library: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATH_ENV, "fastest")
    with pytest.raises(Exception, match=r"ATTNSERVE_GGUF_MATMUL_PATH=fastest is none of auto, "
                                        r"vec_dot, avx2, avx512vnni"):
        session(matmul_model(2, K), gguf_ops_library)


def test_leading_dimensions_and_an_initializer_weight(gguf_ops_library: Path) -> None:
    """X [B, T, K] → Y [B, T, N] with W stored in the graph, as an export would place it."""
    rng = np.random.default_rng(2)
    stored, dense = TYPES["Q4_K"].make(rng, N, K)
    sess = session(matmul_model(TYPES["Q4_K"].type_id, K, w=stored), gguf_ops_library)
    x = rng.standard_normal((2, 5, K)).astype(np.float32)
    (y,) = sess.run(None, {"X": x})
    assert y.shape == (2, 5, N)
    assert row_error(y, x.astype(np.float64) @ dense.T) <= TYPES["Q4_K"].tolerance
    (empty,) = sess.run(None, {"X": np.zeros((0, 3, K), np.float32)})
    assert empty.shape == (0, 3, N)


# ---------------------------------------------------------------------------------------------
# Bad inputs: ORT errors naming the problem.

def test_wrong_row_bytes(gguf_ops_library: Path) -> None:
    stored, _ = TYPES["Q4_0"].make(np.random.default_rng(3), N, K)  # rows of 288 bytes
    sess = session(matmul_model(2, K), gguf_ops_library)
    x = np.ones((1, K), np.float32)
    with pytest.raises(Exception, match=r"GgufMatMul node 'proj': W has shape \[67, 290\].*"
                                        r"ggml_row_size = 288 bytes"):
        sess.run(None, {"X": x, "W": np.pad(stored, ((0, 0), (0, 2)))})
    with pytest.raises(Exception, match=rf"W has shape \[{stored.size}\]"):
        sess.run(None, {"X": x, "W": stored.reshape(-1)})


def test_x_of_another_width(gguf_ops_library: Path) -> None:
    stored, _ = TYPES["Q8_0"].make(np.random.default_rng(4), N, K)
    sess = session(matmul_model(8, K), gguf_ops_library)
    with pytest.raises(Exception, match=r"X has shape \[2, 256\]; its last dimension must be "
                                        r"k=512"):
        sess.run(None, {"X": np.ones((2, 256), np.float32), "W": stored})


@pytest.mark.parametrize(("type_id", "k", "message"), [
    (2, 100, r"k=100 is not a multiple of the block size 32 of ggml_type 2 \(q4_0\)"),
    (12, 288, r"k=288 is not a multiple of the block size 256 of ggml_type 12 \(q4_K\)"),
    (2, 0, r"attribute k must be positive, got 0"),
    (15, K, r"ggml_type 15 \(q8_K\) has no CPU dot product"),
    (4, K, r"ggml_type 4 \(DEPRECATED\) has no CPU dot product"),  # a removed id
    (-1, K, r"ggml_type -1 \(no such type in this ggml\)"),
    (None, K, r"needs an int attribute 'ggml_type'"),
    (2, None, r"needs an int attribute 'k'"),
])
def test_bad_attributes_fail_when_the_session_is_created(
        gguf_ops_library: Path, type_id: int | None, k: int | None, message: str) -> None:
    """Attributes are fixed by the graph, so they are checked once, at session creation."""
    with pytest.raises(Exception, match=message):
        session(matmul_model(type_id, k), gguf_ops_library)


# ---------------------------------------------------------------------------------------------
# The loader and the build cache.

def test_register_and_library_path(gguf_ops_library: Path,
                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(service.ops.ENV_VAR, raising=False)
    assert service.ops.library_path() == gguf_ops_library
    options = ort.SessionOptions()
    assert service.ops.register(options)
    assert service.ops.library_path(cache=tmp_path) is None  # nothing built there
    assert not service.ops.register(ort.SessionOptions(), cache=tmp_path)
    monkeypatch.setenv(service.ops.ENV_VAR, str(gguf_ops_library))
    assert service.ops.library_path(cache=tmp_path) == gguf_ops_library
    monkeypatch.setenv(service.ops.ENV_VAR, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match=r"missing\.so"):
        service.ops.library_path()


def test_the_library_reports_the_level_of_its_sources(gguf_ops_library: Path) -> None:
    assert f"-DATTNSERVE_GGUF_OPS_LEVEL={build.OPS_LEVEL}" in build.cmake_args()
    assert f"-DATTNSERVE_GGUF_OPS_LEVEL={build.OPS_LEVEL}" in build.cmake_args(True)
    assert service.ops.library_level(gguf_ops_library) == build.OPS_LEVEL
    # a library without the function (built before it existed): level 0
    assert service.ops.library_level(gguf_ops_library.parent / "libggml-base.so.0") == 0


def test_a_library_of_older_sources_is_not_loaded(gguf_ops_library: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An op library below the graphs' level would ignore attributes it does not know (a
    repacked layout, float activations) and compute those nodes wrongly: never loaded, one
    log line (a GGUF graph then runs dequantised: test_dequantised.py)."""
    monkeypatch.setattr(service.ops, "_warned", set())
    monkeypatch.setattr(build, "OPS_LEVEL", build.OPS_LEVEL + 1)
    monkeypatch.setenv(service.ops.ENV_VAR, str(gguf_ops_library))
    caplog.set_level("WARNING", logger="service.ops")
    assert service.ops.library_path() is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "service.ops"]
    assert str(gguf_ops_library) in warning and "built from older sources" in warning
    assert "make gguf-ops" in warning


def test_a_built_library_is_reused(gguf_ops_library: Path) -> None:
    before = gguf_ops_library.stat().st_mtime_ns
    assert build.ensure_built() == gguf_ops_library
    assert gguf_ops_library.stat().st_mtime_ns == before  # found by its key, not rebuilt
    installed = sorted(p.name for p in gguf_ops_library.parent.iterdir())
    assert installed == ["build-info.json", "build.log", build.LIBRARY_NAME,
                         "libggml-base.so.0", "libggml-cpu.so.0"]
    assert (build.CACHE_DIR / build.CURRENT_LINK).resolve() == gguf_ops_library.parent


def test_the_pin_is_the_benchmarks_pin() -> None:
    from benchmarks.llamacpp_env import LLAMA_CPP_PYTHON

    assert build.LLAMA_CPP_PYTHON == LLAMA_CPP_PYTHON


def test_debian_mirror_from_apt_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.MIRROR_ENV, raising=False)
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "other.list").write_text("deb https://apt.invalid/repo stable main\n")
    (parts / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    assert build.debian_mirror(tmp_path) == "http://mirror.invalid/debian"
    (parts / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.invalid/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://old.invalid/debian bookworm main contrib\n")
    assert build.debian_mirror(tmp_path) == "http://old.invalid/debian"
    (tmp_path / "sources.list").unlink()
    with pytest.raises(build.BuildUnavailable, match=build.MIRROR_ENV):
        build.debian_mirror(tmp_path)
    monkeypatch.setenv(build.MIRROR_ENV, "http://set.invalid/debian/")
    assert build.debian_mirror(tmp_path) == "http://set.invalid/debian"

