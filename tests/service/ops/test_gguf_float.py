"""GgufMatMul at float activations (``activations="float"``, service/ops/gguf_float.cc)
against numpy: X kept in float32, each weight row the values ``gguf.quants.dequantize``
gives, so Y is X · dequantize(W)ᵀ up to float32 summation order, for every type and on
every kernel path (ggml's to_float with plain products; our decoders with AVX2 or AVX-512
products; in registers below 4 activation rows, through a dequantised tile from 4, packed
for outer products from 128 with AVX-512).

The weights, the one-node model and the session are test_gguf_matmul's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tests.service.ops.test_gguf_matmul import (
    CODE_BYTES,
    PATH_ENV,
    TYPES,
    matmul_model,
    row_error,
    session,
)

N = 67  # odd, and not a whole number of the 16-row tiles a task takes
K = 512
# 1-3 decode the blocks in registers, 4 and up go through a tile (16 and up: wider tiles),
# 130 through packed panels of outer products where the CPU has AVX-512; 17, 64 and 130
# leave partial groups of activation rows (4 a step; 6 for the panels); 1 is a decode step.
BATCHES = (1, 2, 3, 4, 17, 64, 130)
# Measured at most 8.7e-7 (seeds 0-1, every type and path): float32 accumulation over
# K = 512. An int8-activation product is off by 1e-2 here (test_gguf_matmul's tolerances).
FLOAT32 = 2e-6


def _float_errors(library: Path, name: str, seed: int, k: int = K) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    stored, dense = TYPES[name].make(rng, N, k)
    sess = session(matmul_model(TYPES[name].type_id, k, activations="float"), library)
    errors = {}
    for m in BATCHES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        (y,) = sess.run(None, {"X": x, "W": stored})
        assert y.shape == (m, N) and y.dtype == np.float32
        errors[m] = row_error(y, x.astype(np.float64) @ dense.T)
    return errors


@pytest.mark.parametrize("name", list(TYPES))
def test_float_activations_match_numpy(gguf_ops_library: Path, name: str) -> None:
    errors = _float_errors(gguf_ops_library, name, seed=0)
    assert max(errors.values()) <= FLOAT32, errors


@pytest.mark.parametrize("path", ["vec_dot", "avx2", "avx512vnni"])
def test_each_float_path_matches_numpy(gguf_ops_library: Path, path: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The types our decoders cover and two that go through ggml's to_float, on each path
    this CPU runs (ATTNSERVE_GGUF_MATMUL_PATH; vec_dot: ggml's to_float and plain C++);
    K = 576 (SmolLM2's width, not a whole number of 256) for the 32-weight types."""
    monkeypatch.setenv(PATH_ENV, path)
    try:
        session(matmul_model(TYPES["Q4_0"].type_id, K, activations="float"), gguf_ops_library)
    except Exception as exc:
        if "this CPU runs only" in str(exc):
            pytest.skip(f"{path}: {exc}")
        raise
    for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "F16"):
        k = K if name.endswith("_K") else 576
        errors = _float_errors(gguf_ops_library, name, seed=1, k=k)
        assert max(errors.values()) <= FLOAT32, (name, errors)


# Rows of 35 groups for the 32-weight types: two whole runs of the 16 groups whose scales
# the AVX-512 kernel converts at once, and a partial third; 5 super-blocks (40 groups) for
# the K-quants, whose decode-step kernel takes two groups (Q4_K: a byte's two nibbles) a span.
LONG_ROWS = {"Q4_0": 35 * 32, "Q4_1": 35 * 32, "Q8_0": 35 * 32, "Q4_K": 5 * 256,
             "Q6_K": 5 * 256}


@pytest.mark.parametrize("name", list(LONG_ROWS))
def test_decode_steps_over_long_rows(gguf_ops_library: Path, name: str) -> None:
    """A decode step's rows (M = 1-3 in registers; with AVX-512 M = 5 and 8 too, in passes
    of 4 rows, Q8_0 aside) and M = 9 (through the dequantised tile) over long rows, on random
    blocks and with every code at its largest (Q6_K's top two bits come from a separate
    byte); N = 67 ends in a single weight row after pairs. Against numpy in float64, on the
    auto path."""
    rng = np.random.default_rng(4)
    k = LONG_ROWS[name]
    qtype = GGMLQuantizationType(TYPES[name].type_id)
    random_w, _ = TYPES[name].make(rng, N, k)
    largest = random_w.copy()
    largest.reshape(N, -1, GGML_QUANT_SIZES[qtype][1])[..., CODE_BYTES[name]] = 0xFF
    sess = session(matmul_model(TYPES[name].type_id, k, activations="float"), gguf_ops_library)
    for stored in (random_w, largest):
        dense = dequantize(stored, qtype).astype(np.float64)
        for m in (1, 2, 3, 5, 8, 9):
            x = rng.standard_normal((m, k)).astype(np.float32)
            (y,) = sess.run(None, {"X": x, "W": stored})
            assert row_error(y, x.astype(np.float64) @ dense.T) <= FLOAT32, (name, m)


def test_float_activations_are_the_float32_product_not_an_int8_one(
        gguf_ops_library: Path) -> None:
    """The point of the attribute: with it the product is float32's; without it, X is
    rounded to 8 bits (ggml's Q8_1 for Q4_1), a thousand times further off."""
    rng = np.random.default_rng(2)
    stored, dense = TYPES["Q4_1"].make(rng, N, K)
    x = rng.standard_normal((3, K)).astype(np.float32)
    reference = x.astype(np.float64) @ dense.T
    (floats,) = session(matmul_model(3, K, activations="float"),
                        gguf_ops_library).run(None, {"X": x, "W": stored})
    (int8,) = session(matmul_model(3, K, activations="int8"),
                      gguf_ops_library).run(None, {"X": x, "W": stored})
    (default,) = session(matmul_model(3, K), gguf_ops_library).run(None, {"X": x, "W": stored})
    assert row_error(floats, reference) <= FLOAT32
    assert row_error(int8, reference) > 1000 * row_error(floats, reference)
    assert np.array_equal(default, int8)  # no attribute: int8, as before it existed


def test_float_weights_of_any_width_and_threads_change_nothing(gguf_ops_library: Path) -> None:
    """F32 and F16 rows of K = 37 (no whole vector of lanes: the kernels' tails), and one
    thread equal to two bit for bit (a task computes whole rows)."""
    rng = np.random.default_rng(3)
    for name in ("F32", "F16"):
        stored, dense = TYPES[name].make(rng, N, 37)
        x = rng.standard_normal((5, 37)).astype(np.float32)
        model = matmul_model(TYPES[name].type_id, 37, activations="float")
        (one,) = session(model, gguf_ops_library, threads=1).run(None, {"X": x, "W": stored})
        (two,) = session(model, gguf_ops_library, threads=2).run(None, {"X": x, "W": stored})
        assert row_error(one, x.astype(np.float64) @ dense.T) <= FLOAT32
        assert np.array_equal(one, two)


def test_the_float_path_accepts_exactly_the_tested_types(gguf_ops_library: Path) -> None:
    """Every type ggml dequantises (a to_float), as tested above, and no other."""
    accepted = set()
    for type_id in range(64):
        try:
            session(matmul_model(type_id, K, activations="float"), gguf_ops_library)
        except Exception as exc:
            assert "cannot be dequantised by this ggml" in str(exc), exc
        else:
            accepted.add(type_id)
    assert accepted == {t.type_id for t in TYPES.values()}


@pytest.mark.parametrize(("type_id", "k", "activations", "message"), [
    (2, K, "half", "attribute activations='half' is neither 'int8' nor 'float'"),
    (12, 96, "float", "k=96 is not a positive multiple of the block size 256"),
    (9, K, "float", "ggml_type 9 (q8_1) cannot be dequantised"),
])
def test_bad_float_attributes_fail_when_the_session_is_created(
        gguf_ops_library: Path, type_id: int, k: int, activations: str, message: str) -> None:
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        session(matmul_model(type_id, k, activations=activations), gguf_ops_library)
