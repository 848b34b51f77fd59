"""CachedAttention (service/ops/cached_attention.cc) against ONNX Runtime's GroupQueryAttention.

The op takes GroupQueryAttention's inputs and attributes and must compute what it computes, so
the reference is ONNX Runtime's own CPU kernel (com.microsoft, float32) in a one-node graph fed
the same tensors: decode rows of different lengths, a first prompt with padded rows, a later
prompt chunk, a sliding window, rotary halves or pairs or none, grouped and plain heads, head
sizes every vector path takes, and the cache updated in place through one bound OrtValue as the
engine binds it. Compared: every real token's output and every written cache position (a
padding token's output is unspecified in both). Also a numpy computation of one decode row, so
the reference's conventions are checked too. A float16 cache (the op's second kernel) is held
to the same reference fed that cache's values as float32: its new keys and values are the
reference's rounded to float16, its outputs those of attention over them. The library is
conftest.py's fixture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

import service.ops
from benchmarks.attention_speed import attention_model, rotary_tables
from service.contract.sessions import create_session

THREADS = 2


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_size: int
    cache: int  # positions in the past / present buffers
    seqlens: tuple[int, ...]  # each row's total length − 1
    tokens: int  # S
    total: int  # total_sequence_length
    rotary: str = "half"  # "half", "pairs" (interleaved) or "none"
    window: int = -1
    scale: float = 0.0

    @property
    def first_prompt(self) -> bool:
        return self.tokens == self.total


CASES = {
    "decode": Case(8, 2, 64, 40, (5, 0, 17, 39), 1, 40),
    "decode-smollm2-heads": Case(9, 3, 64, 48, (30, 2, 47), 1, 48),
    "decode-one-row": Case(9, 3, 64, 300, (257,), 1, 300),
    "decode-plain-heads-no-rotary": Case(4, 4, 32, 24, (3, 11), 1, 24, rotary="none"),
    "decode-pairs-scale": Case(4, 2, 16, 20, (9, 19, 0), 1, 20, rotary="pairs", scale=0.3),
    "decode-head-8": Case(6, 2, 8, 16, (4, 15), 1, 16, rotary="none"),  # (rotary: 16s)
    "decode-window": Case(8, 2, 64, 40, (5, 30, 39), 1, 40, window=8),
    # 17 rows x 3 key/value heads: runs of 3 regions a task, each prefetching the next; the
    # last run of 3 too, the rows' lengths from 1 to the whole cache
    "decode-many-rows": Case(9, 3, 64, 48, (0, 47, 3, 20, 9, 33, 1, 46, 12, 5, 29, 40, 7, 18,
                                            2, 38, 26), 1, 48),
    "decode-many-rows-window": Case(8, 2, 32, 40, tuple(range(0, 40, 2)), 1, 40, window=6),
    "first-prompt-padded": Case(8, 2, 64, 40, (20, 6, 0), 21, 21),
    "later-chunk": Case(9, 3, 64, 64, (44,), 19, 64),
    "later-chunk-window": Case(4, 1, 32, 64, (50,), 33, 64, window=5),
}


def model(op: str, domain: str, case: Case, cache: str = "float32") -> bytes:
    return attention_model(op, domain, case.heads, case.kv_heads, case.rotary, case.window,
                           case.scale, cache)


def ours(case: Case, cache: str = "float32") -> bytes:
    return model(service.ops.ATTENTION_OP, service.ops.DOMAIN, case, cache)


def theirs(case: Case) -> bytes:
    return model("GroupQueryAttention", "com.microsoft", case)


def session(model: bytes, library: Path | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if library is not None:
        options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = THREADS
    options.log_severity_level = 4
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def feeds(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, hs = len(case.seqlens), case.head_size
    width = (case.heads + 2 * case.kv_heads) * hs
    past = rng.standard_normal((2, b, case.kv_heads, case.cache, hs)).astype(np.float32)
    out = {
        "query": rng.standard_normal((b, case.tokens, width)).astype(np.float32),
        "past_key": past[0],
        "past_value": past[1],
        "seqlens_k": np.array(case.seqlens, np.int32),
        "total_sequence_length": np.array([case.total], np.int32),
    }
    if case.rotary != "none":
        out["cos_cache"], out["sin_cache"] = rotary_tables(case.cache + 1, hs)
    return out


def real(case: Case) -> list[tuple[int, range, range]]:
    """Per row: (row, its real tokens among the S fed, the cache positions now written)."""
    rows = []
    for b, seqlen in enumerate(case.seqlens):
        total = seqlen + 1
        if case.first_prompt:
            rows.append((b, range(min(total, case.tokens)), range(total)))
        else:
            rows.append((b, range(case.tokens), range(total)))
    return rows


def assert_same(case: Case, ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    (y, keys, values), (y_ref, keys_ref, values_ref) = ours, reference
    assert y.shape == y_ref.shape and keys.shape == keys_ref.shape
    for b, tokens, positions in real(case):
        np.testing.assert_allclose(y[b, tokens.start:tokens.stop],
                                   y_ref[b, tokens.start:tokens.stop], rtol=0, atol=2e-5,
                                   err_msg=f"row {b} output")
        for mine, theirs, what in ((keys, keys_ref, "keys"), (values, values_ref, "values")):
            np.testing.assert_allclose(mine[b, :, positions.start:positions.stop],
                                       theirs[b, :, positions.start:positions.stop],
                                       rtol=0, atol=2e-6, err_msg=f"row {b} {what}")


def run_in_place(sess: ort.InferenceSession, inputs: dict[str, np.ndarray]
                 ) -> list[np.ndarray]:
    """[output, keys, values]: ``sess`` run with past and present bound to one OrtValue each
    (copies of the inputs' caches), as the engine binds its KV pool."""
    binding = sess.io_binding()
    # the caches the bound OrtValues view, returned themselves: an OrtValue's .numpy() is a
    # view into memory that goes with the OrtValue
    arrays = {name: inputs[name].copy() for name in ("past_key", "past_value")}
    caches = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    for name, value in inputs.items():
        if name not in caches:
            binding.bind_cpu_input(name, value)
    binding.bind_output("output")  # first: copy_outputs_to_cpu()[0]
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        binding.bind_ortvalue_input(past, caches[past])
        binding.bind_ortvalue_output(present, caches[past])
    sess.run_with_iobinding(binding)
    return [binding.copy_outputs_to_cpu()[0], arrays["past_key"], arrays["past_value"]]


@pytest.mark.parametrize("name", list(CASES))
def test_equals_group_query_attention(gguf_ops_library: Path, name: str) -> None:
    case = CASES[name]
    inputs = feeds(case)
    computed = session(ours(case), gguf_ops_library).run(None, inputs)
    assert_same(case, computed, session(theirs(case), None).run(None, inputs))


def test_cache_updated_in_place(gguf_ops_library: Path) -> None:
    """past and present bound to one OrtValue each, as the engine binds its KV pool: the new
    keys and values land in that buffer, the outputs equal the reference's, and the cache
    positions the step does not write keep their values."""
    case = CASES["decode-smollm2-heads"]
    inputs = feeds(case, seed=1)
    reference = session(theirs(case), None).run(None, inputs)
    y, keys, values = run_in_place(session(ours(case), gguf_ops_library), inputs)
    assert_same(case, [y, keys, values], reference)
    for b, _, positions in real(case):  # beyond the row's length: the past, untouched
        np.testing.assert_array_equal(keys[b, :, positions.stop:],
                                      inputs["past_key"][b, :, positions.stop:])


ONE_ROW = Case(4, 2, 16, 12, (7,), 1, 12)  # one decode row at position 7


def numpy_row(inputs: dict[str, np.ndarray], dtype: type[np.floating[Any]],
              cache: type[np.floating[Any]] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ONE_ROW's attention in numpy: the new key rotated by halves at the row's position
    (computed in ``dtype``), it and the new value put in the cache (rounded to ``cache``
    first, where given), then softmax(q·kᵀ/√H)·v over the row's keys in float64. Returns
    (the expected output (N, H), the keys and values (N_kv, pos + 1, H) it attended to)."""
    case = ONE_ROW
    hs, pos = case.head_size, case.seqlens[0]
    qkv = inputs["query"][0, 0].astype(dtype).reshape(-1, hs)  # (N + 2·N_kv, H)
    cos, sin = (inputs[n][pos].astype(dtype) for n in ("cos_cache", "sin_cache"))

    def rotate(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def stored(x: np.ndarray) -> np.ndarray:
        return x if cache is None else x.astype(cache)

    q, k_new, v_new = np.split(qkv, [case.heads, case.heads + case.kv_heads])
    k_cache = inputs["past_key"][0].astype(np.float64)
    v_cache = inputs["past_value"][0].astype(np.float64)
    k_cache[:, pos], v_cache[:, pos] = stored(rotate(k_new)), stored(v_new)
    group = case.heads // case.kv_heads
    expected = []
    for h in range(case.heads):
        g = h // group
        scores = k_cache[g, :pos + 1] @ rotate(q[h]).astype(np.float64) / np.sqrt(hs)
        p = np.exp(scores - scores.max())
        expected.append((p / p.sum()) @ v_cache[g, :pos + 1])
    return np.stack(expected), k_cache[:, :pos + 1], v_cache[:, :pos + 1]


def test_one_decode_row_against_numpy(gguf_ops_library: Path) -> None:
    """Rotary by halves at the row's position, then softmax(q·kᵀ/√H)·v over its keys, in
    float64: the convention both kernels follow."""
    inputs = feeds(ONE_ROW, seed=2)
    y, keys, _ = session(ours(ONE_ROW), gguf_ops_library).run(None, inputs)
    expected, k_cache, _ = numpy_row(inputs, np.float64)
    np.testing.assert_allclose(keys[0, :, :k_cache.shape[1]], k_cache, atol=1e-6)
    np.testing.assert_allclose(y[0, 0].reshape(expected.shape), expected, atol=1e-5)


# a float16 cache through both vector paths: AVX-512 (H 64, 32) and AVX2 (H 8)
HALF_CASES = ["decode", "decode-many-rows", "decode-plain-heads-no-rotary", "decode-head-8",
              "first-prompt-padded", "later-chunk-window"]


def half_feeds(case: Case, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the float16 cache's feeds, the same values with a float32 cache for the reference)."""
    inputs = feeds(case, seed)
    half = {**inputs, **{n: inputs[n].astype(np.float16) for n in ("past_key", "past_value")}}
    exact = {**inputs, **{n: half[n].astype(np.float32) for n in ("past_key", "past_value")}}
    return half, exact


def assert_half_cache(case: Case, ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    """New values: the reference's rounded to float16, exactly; new keys (rotated in float32
    by either, so an ulp apart at most before rounding): within one float16 ulp; outputs:
    the reference's up to what rounding the new keys and values moves them (< 1e-3 of
    values of order 1: far below any wrong position or head)."""
    (y, keys, values), (y_ref, keys_ref, values_ref) = ours, reference
    assert keys.dtype == values.dtype == np.float16 and y.dtype == np.float32
    for b, tokens, positions in real(case):
        written = slice(positions.start, positions.stop)
        np.testing.assert_array_equal(values[b, :, written],
                                      values_ref[b, :, written].astype(np.float16),
                                      err_msg=f"row {b} values")
        np.testing.assert_allclose(keys[b, :, written].astype(np.float32),
                                   keys_ref[b, :, written], rtol=2.0**-10, atol=2.0**-24,
                                   err_msg=f"row {b} keys")
        np.testing.assert_allclose(y[b, tokens.start:tokens.stop],
                                   y_ref[b, tokens.start:tokens.stop], rtol=0, atol=2e-3,
                                   err_msg=f"row {b} output")


@pytest.mark.parametrize("name", HALF_CASES)
def test_float16_cache_equals_group_query_attention(gguf_ops_library: Path, name: str) -> None:
    case = CASES[name]
    half, exact = half_feeds(case, seed=4)
    computed = session(ours(case, "float16"), gguf_ops_library).run(None, half)
    assert_half_cache(case, computed, session(theirs(case), None).run(None, exact))


def test_float16_cache_updated_in_place(gguf_ops_library: Path) -> None:
    """A float16 cache bound as the engine binds its pool: the new rows land in it, rounded;
    the positions the step does not write keep their bits."""
    case = CASES["decode-many-rows"]
    half, exact = half_feeds(case, seed=5)
    reference = session(theirs(case), None).run(None, exact)
    y, keys, values = run_in_place(session(ours(case, "float16"), gguf_ops_library), half)
    assert_half_cache(case, [y, keys, values], reference)
    for b, _, positions in real(case):
        np.testing.assert_array_equal(values[b, :, positions.stop:],
                                      half["past_value"][b, :, positions.stop:])


def test_one_decode_row_over_a_float16_cache_against_numpy(gguf_ops_library: Path) -> None:
    """The float16 cache's arithmetic: the new key rotated in float32 and rounded to float16,
    the new value rounded, then softmax(q·kᵀ/√H)·v over the cache's float16 values in
    float64."""
    half, _ = half_feeds(ONE_ROW, seed=6)
    y, keys, values = session(ours(ONE_ROW, "float16"), gguf_ops_library).run(None, half)
    expected, k_cache, v_cache = numpy_row(half, np.float32, np.float16)
    written = k_cache.shape[1]
    np.testing.assert_allclose(keys[0, :, :written], k_cache, rtol=2.0**-10)
    np.testing.assert_array_equal(values[0, :, :written], v_cache)
    np.testing.assert_allclose(y[0, 0].reshape(expected.shape), expected, atol=2e-4)


def test_bad_inputs_are_named(gguf_ops_library: Path) -> None:
    case = CASES["decode"]
    sess = session(ours(case), gguf_ops_library)
    inputs = feeds(case)
    too_long = {**inputs, "seqlens_k": np.array([5, 0, 17, 40], np.int32)}
    with pytest.raises(Exception, match=r"CachedAttention node 'attn': row 3: seqlens_k 40 "
                                        r"with 1 new tokens does not fit a cache of 40"):
        sess.run(None, too_long)
    short = {**inputs, "cos_cache": inputs["cos_cache"][:30], "sin_cache": inputs["sin_cache"][:30]}
    with pytest.raises(Exception, match=r"row 3 reaches position 39; cos_cache holds 30"):
        sess.run(None, short)
    wrong = {**inputs, "query": inputs["query"][..., :-1]}
    with pytest.raises(Exception, match=r"CachedAttention node 'attn': query has shape "
                                        r"\[4, 1, 767\]"):
        sess.run(None, wrong)


def test_served_as_group_query_attention_without_the_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the op library cannot load, the session layer's dequantised copy
    (service/ops/dequantised.py) runs the node as the GroupQueryAttention it stands for."""
    monkeypatch.setattr(service.ops, "library_path", lambda cache=None: None)
    case = CASES["later-chunk"]
    inputs = feeds(case, seed=3)
    served = create_session(ours(case), threads=THREADS).run(None, inputs)
    for got, want in zip(served, session(theirs(case), None).run(None, inputs), strict=True):
        np.testing.assert_array_equal(got, want)


def test_float16_cache_served_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the library, a float16 cache's node runs as GroupQueryAttention between Casts:
    the past read as float32, the presents written back in float16 under their own names."""
    monkeypatch.setattr(service.ops, "library_path", lambda cache=None: None)
    case = CASES["decode-many-rows"]
    half, exact = half_feeds(case, seed=7)
    served = create_session(ours(case, "float16"), threads=THREADS).run(None, half)
    y_ref, keys_ref, values_ref = session(theirs(case), None).run(None, exact)
    np.testing.assert_array_equal(served[0], y_ref)
    np.testing.assert_array_equal(served[1], keys_ref.astype(np.float16))
    np.testing.assert_array_equal(served[2], values_ref.astype(np.float16))
