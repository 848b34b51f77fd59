"""K-quant blocks (Q2_K-Q6_K), and the Q5_0 / Q5_1 that llama.cpp's K-quant mixes use for
rows not a multiple of 256, kept exactly by --quantize gguf (model/gguf/codes.py).

gguf-py has no quantiser for the K-quants, so each tensor is random block bytes (every
byte pattern is a valid block) with chosen fp16 (super-)block scales, or gguf's quantiser's
blocks of random weights (Q5_0 / Q5_1), written to a GGUF file with GGUFWriter and read
back with GGUFReader; the reference is gguf's own
``gguf.quants.dequantize`` of the same bytes. Each tensor's MatMulNBits graph, run by
ONNX Runtime at float activations on an identity input, must return those values exactly;
at int8 activations (what is served) it must stay close to the float product. The whole
export of K-quant models is tested in tests/export/test_gguf_blocks.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.gguf_files import K_SCALE_OFFSETS, Q, random_k_blocks

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")

TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1)
MINIMUMS = {Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q5_1}  # value d·q + m: the exact form's remainder
SCALE_OFFSETS = {**K_SCALE_OFFSETS, Q.Q5_0: (0,), Q.Q5_1: (0, 2)}  # bytes of d (and dmin/m)
ROWS, COLS = 24, 512  # two super-blocks a row
# Super-block scales at the edges of fp16: zero, negative, the smallest subnormal, the
# smallest normal, the largest.
EDGE_SCALES = (0.0, -0.75, 2.0 ** -24, 2.0 ** -14, 65504.0)
KINDS = ("random", "centred", "edges")


def random_blocks(qtype: Q, kind: str, rng: np.random.Generator) -> np.ndarray:
    """(ROWS, bytes) of ``qtype``: ``random`` bytes with sane scales, blocks ``centred`` on
    zero as real weights' are (gguf's quantiser's, for Q5_0 / Q5_1), or random bytes whose
    scales take each of EDGE_SCALES in turn (``edges``)."""
    if kind == "centred" and qtype in K_SCALE_OFFSETS:
        return random_k_blocks((ROWS, COLS), qtype, rng)
    if kind == "centred":
        weights = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        return gguf.quants.quantize(weights, qtype)
    if qtype in K_SCALE_OFFSETS:
        raw = random_k_blocks((ROWS, COLS), qtype, rng, centred=False)
    else:
        raw = rng.integers(0, 256, (ROWS, COLS // 32 * gguf.GGML_QUANT_SIZES[qtype][1]),
                           dtype=np.uint8)
    blocks = raw.reshape(ROWS, -1, gguf.GGML_QUANT_SIZES[qtype][1])  # a view
    for i, off in enumerate(SCALE_OFFSETS[qtype]):
        if kind == "edges":
            values = np.resize(np.array(EDGE_SCALES, np.float16), blocks.shape[:2])
            values = np.roll(values, i, axis=-1)  # dmin other than d
        elif qtype in K_SCALE_OFFSETS:
            continue  # random_k_blocks' own
        else:
            values = rng.uniform(-0.01, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., off:off + 2] = values[..., None].view(np.uint8)
    return raw


@pytest.fixture(scope="module")
def tensors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, gguf.ReaderTensor]:
    """Per type, each kind of :func:`random_blocks`, read back from one GGUF file."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("kquants") / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for qtype in TYPES:
        for kind in KINDS:
            writer.add_tensor(f"{qtype.name}.{kind}", random_blocks(qtype, kind, rng),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def reference(tensor: gguf.ReaderTensor) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # (N, K)


def session(model_nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], k: int,
            n: int) -> ort.InferenceSession:
    graph = helper.make_graph(model_nodes, "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def written(tensor: gguf.ReaderTensor, mode: str = "exact", level: int = 0,
            flat: bool = False, halves: bool = False) -> tuple[ort.InferenceSession, int]:
    """The tensor's product as export/gguf/blocks.py writes it, and its MatMulNBits count:
    by default as the int8-activation graphs hold it (8-bit blocks one product), run here
    at ``level``; ``halves``: 8-bit blocks as two 4-bit products (--activations float)."""
    from export.gguf.blocks import BlockWriter, read_blocks

    writer = BlockWriter(mode, level, flat, halves)
    writer.matmul("x", "y", read_blocks(tensor), "w", "w")
    n, k = reference(tensor).shape
    nbits = sum(node.op_type == "MatMulNBits" for node in writer.nodes)
    return session(writer.nodes, list(writer.inits.values()), k, n), nbits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_dequantise_to_ggufs_values(qtype: Q, kind: str,
                                           tensors: dict[str, gguf.ReaderTensor]) -> None:
    """Codes, scales and minimums in the float32 operations gguf uses give its values."""
    from model.gguf.codes import DIRECT, read_blocks

    tensor = tensors[f"{qtype.name}.{kind}"]
    blocks = read_blocks(tensor)
    assert blocks.format == DIRECT[qtype]
    assert (blocks.mins is not None) == (qtype in MINIMUMS)
    ref = reference(tensor)
    assert np.array_equal(blocks.dequantize(), ref, equal_nan=True)
    assert np.isfinite(ref).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmulnbits_returns_ggufs_values(qtype: Q, kind: str,
                                          tensors: dict[str, gguf.ReaderTensor]) -> None:
    """ONNX Runtime's dequantised weight (level 0, an identity input) is gguf's, bit for
    bit, one MatMulNBits, the remainder as MatMul + Add or as one Gemm (engine graphs); the
    float-zp form leaves the blocks it does not apply to (no minimums, 8-bit codes) exact."""
    tensor = tensors[f"{qtype.name}.{kind}"]
    ref = reference(tensor)
    eye = np.eye(ref.shape[1], dtype=np.float32)
    for flat in (False, True):
        sess, nbits = written(tensor, flat=flat)
        ours = sess.run(None, {"x": eye})[0].T  # (N, K)
        assert nbits == 1
        assert np.array_equal(ours, ref), float(np.abs(ours - ref).max())
    if qtype not in (Q.Q2_K, Q.Q4_K):  # no float zero points: exact in either mode
        sess, _ = written(tensor, mode="float-zp")
        assert np.array_equal(sess.run(None, {"x": eye})[0].T, ref)
    if qtype in (Q.Q5_K, Q.Q6_K):  # 8-bit codes as two 4-bit halves: exact without
        sess, nbits = written(tensor, halves=True)  # minimums, one rounding with them
        ours = sess.run(None, {"x": eye})[0].T
        assert nbits == 2
        if qtype in MINIMUMS:
            np.testing.assert_allclose(ours, ref, rtol=0,
                                       atol=2 * np.abs(ref).max() * 2.0 ** -24)
        else:
            assert np.array_equal(ours, ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_activations_stay_close(qtype: Q, tensors: dict[str, gguf.ReaderTensor]) -> None:
    """At accuracy level 4 (int8 activations, block 16 included), the product stays within
    the activations' rounding of the float one: no code or zero point overflows."""
    tensor = tensors[f"{qtype.name}.centred"]
    ref = reference(tensor).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((8, ref.shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ ref.T  # (8, N)
    sess, _ = written(tensor, level=4)
    got = sess.run(None, {"x": x})[0]
    rel = float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))
    print(f"{qtype.name}: relative RMS error at level 4 {rel:.2e}")
    assert rel < 0.02


def test_centred_keeps_a_zero_point_only_where_exact() -> None:
    """z is the code nearest −m/d where (q − z)·d and m + z·d are exact in float32; 0 where
    a scale's significand leaves no room for q − z, or where m + z·d would round in float64
    already (its float64 sum looking exact); refused where even q·d would round."""
    from export.gguf.blocks import centred
    from model.gguf.codes import Blocks

    codes = np.stack([np.tile(np.arange(16), 2), np.tile(np.arange(4), 8),
                      np.tile(np.arange(16), 2)]).astype(np.uint8)[None]  # (1, 3, 32)
    # an fp16 scale; 22 significant bits (room for codes below 4: q ≤ 3 but not q − 7);
    # a tiny one beside a large minimum
    scales = np.array([[0.5, 1 + 2.0 ** -21, 2.0 ** -40]], np.float32)
    mins = np.array([[-3.5, -7.0, -(2.0 ** 20)]], np.float32)  # −m/d: 7, 7, clipped to 15
    z, low = centred(Blocks(4, codes, scales, mins))
    assert z.tolist() == [[7, 0, 0]]
    assert low.tolist() == [[0.0, -7.0, -(2.0 ** 20)]]
    with pytest.raises(ValueError, match="round"):  # block 1's codes up to 15 now
        centred(Blocks(4, codes[:, [0, 0, 0]], scales, mins))


def test_kept_types_are_the_advised_ones() -> None:
    """gguf_advice names every kept type (the K-quants and Q5_x too), not the float ones."""
    from export.quantize.weights import gguf_advice

    record = {"imported_from": {"format": "gguf", "tensor_types": {
        "Q2_K": 1, "Q3_K": 1, "Q4_K": 1, "Q5_K": 1, "Q6_K": 1, "Q5_1": 1, "F16": 1, "F32": 1}}}
    note = gguf_advice(record, "int4")
    assert note is not None and "Q2_K/Q3_K/Q4_K/Q5_1/Q5_K/Q6_K blocks" in note

