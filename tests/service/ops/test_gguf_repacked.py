"""GgufMatMul over W in ggml's CPU repack layout (``layout="repacked_8x8"``,
service/ops/gguf_repacked.cc): the bytes written by ggml's own repack
(``service.ops.repack``), computed by ggml's gemv / gemm (Q4_0's gemv rows by ours on
AVX-512 VNNI, gguf_rowdot.cc) at int8 activations and through the inverse at float ones,
against numpy's X · dequantize(W)ᵀ; the layout itself against a numpy construction of
ggml's block_q4_0x8; and what is refused.

The weights, the one-node model and the session are test_gguf_matmul's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

import service.ops
from tests.service.ops.test_gguf_matmul import (
    CODE_BYTES,
    EXACT,
    PATH_ENV,
    TYPES,
    forced_session,
    matmul_model,
    row_error,
    session,
)

REPACKED = ("Q4_0", "IQ4_NL")
N = 72  # whole groups of 8 rows, not of the 16-row lines a task takes: a partial last task
K = 512
# Q4_0: 1 ggml's gemv, 4 its gemm where ggml has AVX-512, the others our batched kernels
# reading the layout in place (on AVX-512 VNNI every one of these our gemv); IQ4_NL (no
# batched kernels) and under vec_dot: gemm on four rows at a time, gemv on the rest (2, 3,
# 5, 17).
BATCHES = (1, 2, 3, 4, 5, 8, 17, 64)
FLOAT32 = 2e-6  # test_gguf_float's bound for float activations


def _repacked(library: Path, name: str, rng: np.random.Generator, n: int = N,
              k: int = K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    stored, dense = TYPES[name].make(rng, n, k)
    layout, why = service.ops.repack(TYPES[name].type_id, k, stored, library)
    if layout is None:
        pytest.skip(f"{name}: {why}")  # ggml keeps the rows on a CPU without AVX2
    return stored, layout, dense


@pytest.mark.parametrize("k", [K, 576])
@pytest.mark.parametrize("path", ["auto", "vec_dot"])
@pytest.mark.parametrize("name", REPACKED)
def test_int8_products_over_the_layout_match_numpy(gguf_ops_library: Path, name: str,
                                                   path: str, k: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Against X quantised to Q8_0 as the op quantises it: float32 accumulation only; and
    one thread equal to two bit for bit (a task computes whole groups). auto: Q4_0 by ggml's
    gemv at 1 row (its gemm at 4 where ggml has AVX-512), by our batched kernels reading
    the layout in place at the others; vec_dot (no batched kernels): ggml's at every M.
    K = 576 (SmolLM2's width): a last chunk of 2 blocks."""
    monkeypatch.setenv(PATH_ENV, path)
    rng = np.random.default_rng(0)
    stored, layout, dense = _repacked(gguf_ops_library, name, rng, k=k)
    model = matmul_model(TYPES[name].type_id, k, layout=service.ops.REPACKED_LAYOUT)
    two, one = session(model, gguf_ops_library), session(model, gguf_ops_library, threads=1)
    for m in BATCHES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        (y,) = two.run(None, {"X": x, "W": layout})
        assert y.shape == (m, N)
        assert row_error(y, TYPES[name].as_computed(x, stored, dense)) <= EXACT, m
        assert row_error(y, x.astype(np.float64) @ dense.T) <= TYPES[name].tolerance, m
        assert np.array_equal(y, one.run(None, {"X": x, "W": layout})[0]), m


@pytest.mark.parametrize("name", REPACKED)
def test_float_activations_over_the_layout_match_numpy(gguf_ops_library: Path,
                                                       name: str) -> None:
    """attention.onnx reads the served bytes at float activations: the same layout."""
    rng = np.random.default_rng(1)
    _, layout, dense = _repacked(gguf_ops_library, name, rng)
    sess = session(matmul_model(TYPES[name].type_id, K, activations="float",
                                layout=service.ops.REPACKED_LAYOUT), gguf_ops_library)
    for m in (1, 3, 4, 17):
        x = rng.standard_normal((m, K)).astype(np.float32)
        (y,) = sess.run(None, {"X": x, "W": layout})
        assert row_error(y, x.astype(np.float64) @ dense.T) <= FLOAT32, m


@pytest.mark.parametrize("k", [K, 576, 4096])
def test_our_q4_0_gemv_matches_numpy(gguf_ops_library: Path, k: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Our AVX-512 VNNI gemv over Q4_0's layout (gguf_rowdot.cc), forced by
    ATTNSERVE_GGUF_MATMUL_PATH=avx512vnni (skipped on a CPU without it): M = 1 to 8, each
    in one pass over W, 9, 17 and 128 (passes of 8 rows, a remainder; 128 its last) and 129
    (the batched kernels). Random blocks, and every code at its largest of either sign
    (0xFF: 7, 0x00: -8) against activations at ±127; against numpy
    with X quantised as the op does (EXACT) and against ggml's gemv / gemm alone (vec_dot),
    which sum the same integers (on the Xeon the gemv's float order too: equal there).
    K of 16 blocks, 18 and 128 (a long row); N of 9 groups (two a pass, and a task's
    last group alone)."""
    qtype = GGMLQuantizationType.Q4_0
    rng = np.random.default_rng(9)
    random_w, _ = TYPES["Q4_0"].make(rng, N, k)
    weights = [random_w]
    for code in (0xFF, 0x00):
        extreme = random_w.copy()
        extreme.reshape(N, -1, 18)[..., CODE_BYTES["Q4_0"]] = code
        weights.append(extreme)
    batches = [*range(1, 10), 17, 128, 129]
    xs = [rng.standard_normal((m, k)).astype(np.float32) for m in batches]
    xs.append(np.repeat(np.array([[1.0], [-1.0], [4.0]], np.float32), k, axis=1))
    model = matmul_model(TYPES["Q4_0"].type_id, k, layout=service.ops.REPACKED_LAYOUT)
    monkeypatch.setenv(PATH_ENV, "avx512vnni")
    ours = forced_session(model, gguf_ops_library, "avx512vnni")
    monkeypatch.setenv(PATH_ENV, "vec_dot")
    ggml = session(model, gguf_ops_library)
    for stored in weights:
        layout, why = service.ops.repack(TYPES["Q4_0"].type_id, k, stored, gguf_ops_library)
        assert layout is not None, why  # ggml repacks Q4_0 wherever there is AVX-512
        dense = dequantize(stored, qtype).astype(np.float64)
        for x in xs:
            (y,) = ours.run(None, {"X": x, "W": layout})
            expected = TYPES["Q4_0"].as_computed(x, stored, dense)
            assert row_error(y, expected) <= EXACT, (k, x.shape)
            (alone,) = ggml.run(None, {"X": x, "W": layout})
            assert row_error(y, alone.astype(np.float64)) <= EXACT, (k, x.shape)


def file_rows(layout: np.ndarray, ggml_type: int) -> np.ndarray:
    """The file's rows of W in ggml's repack layout (ggml's repack.cpp, make_block_q4_0x8 /
    make_block_iq4_nlx8): per block of 8 rows, their 8 fp16 scales, then 16 pieces of 8
    bytes, piece i = row i % 8's quant bytes 8·(i // 8) ... +8 (Q4_0's each nibble XOR 8);
    groups of 8 rows one after another. numpy, independent of the op's own inverse."""
    n, row_bytes = layout.shape
    blocks = row_bytes // 18
    groups = layout.reshape(n // 8, blocks, 144)
    scales = groups[..., :16].reshape(n // 8, blocks, 8, 2).transpose(0, 2, 1, 3)
    pieces = groups[..., 16:].reshape(n // 8, blocks, 2, 8, 8).transpose(0, 3, 1, 2, 4)
    if ggml_type == TYPES["Q4_0"].type_id:
        pieces = pieces ^ 0x88
    quants = pieces.reshape(n // 8, 8, blocks, 16)
    return np.concatenate([scales, quants], axis=-1).reshape(n, row_bytes)


@pytest.mark.parametrize("name", REPACKED)
def test_the_layout_is_ggmls_8x8(gguf_ops_library: Path, name: str) -> None:
    rng = np.random.default_rng(2)
    stored, layout, _ = _repacked(gguf_ops_library, name, rng, n=16)
    assert not np.array_equal(layout, stored)
    assert np.array_equal(file_rows(layout, TYPES[name].type_id), stored)


def test_what_has_no_layout_is_refused(gguf_ops_library: Path) -> None:
    rng = np.random.default_rng(3)
    q4_k, _ = TYPES["Q4_K"].make(rng, 16, K)
    assert service.ops.repack(TYPES["Q4_K"].type_id, K, q4_k, gguf_ops_library) == (
        None, "q4_K has no repacked layout here")
    q4_0, _ = TYPES["Q4_0"].make(rng, 20, K)
    layout, why = service.ops.repack(TYPES["Q4_0"].type_id, K, q4_0, gguf_ops_library)
    assert layout is None and "multiple of 8 rows, not 20" in why


@pytest.mark.parametrize(("type_id", "layout", "message"), [
    (12, service.ops.REPACKED_LAYOUT, "holds q4_0 or iq4_nl, not ggml_type 12 (q4_K)"),
    (2, "columns", "attribute layout='columns' is neither 'rows' nor 'repacked_8x8'"),
])
def test_a_bad_layout_fails_when_the_session_is_created(gguf_ops_library: Path, type_id: int,
                                                        layout: str, message: str) -> None:
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        session(matmul_model(type_id, K, layout=layout), gguf_ops_library)


def test_rows_not_in_whole_groups_are_refused(gguf_ops_library: Path) -> None:
    rng = np.random.default_rng(4)
    stored, _ = TYPES["Q4_0"].make(rng, 12, K)
    sess = session(matmul_model(2, K, layout=service.ops.REPACKED_LAYOUT), gguf_ops_library)
    with pytest.raises(Exception, match="W has 12 rows; layout='repacked_8x8' holds groups of 8"):
        sess.run(None, {"X": np.ones((1, K), np.float32), "W": stored})


def test_rows_is_the_default_layout(gguf_ops_library: Path) -> None:
    """layout="rows" is the attribute left out: the file's rows, as before it existed."""
    rng = np.random.default_rng(5)
    stored, _ = TYPES["Q4_0"].make(rng, N, K)
    x = rng.standard_normal((3, K)).astype(np.float32)
    (rows,) = session(matmul_model(2, K, layout="rows"), gguf_ops_library).run(
        None, {"X": x, "W": stored})
    (default,) = session(matmul_model(2, K), gguf_ops_library).run(None, {"X": x, "W": stored})
    assert np.array_equal(rows, default)
