"""--quantize gguf: the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks as ``MatMulNBits``.

A GGUF block is 32 consecutive input weights of one output row with one fp16 scale,
exactly ONNX Runtime's ``com.microsoft.MatMulNBits`` layout at block size 32 (B is
(N, K/32, bytes), one scale per block). So the blocks are repacked, never requantised,
and ORT's dequantised weights are gguf's (``gguf.quants.dequantize``) bit for bit:

- Q8_0: value d·s with s a signed byte → code s + 128 with the default zero point 128.
- Q4_0: value d·(q − 8) → the same codes with the default zero point 8. Q4_0 stores
  element j in the low nibble of byte j and element j + 16 in its high nibble;
  MatMulNBits wants elements 2i and 2i + 1 in byte i.
- Q4_1: value d·q + m. MatMulNBits' (q − zp)·d can only hold it with a float zero point
  zp = −m/d, which rounds (≤ 2.4e-7 off on random weights). Kept exact instead
  (``Q4_1_MODE = "exact"``, the default; measured in docs/export.md): MatMulNBits with an
  integer zero point z per block (the code nearest −m/d) computes x·(d·(q − z)), and the
  remainders add (x summed per block of 32) · (m + z·d)ᵀ, one small MatMul K/32 wide;
  inputs shared by several projections are summed once (see :func:`centred` for why this
  is exact). ``"float-zp"`` is the other form.

Products that read the same input with the same bit width (gate and up) become one
MatMulNBits over their joined rows, then a Split; where the activations are (tokens,
features) matrices (the engine graphs), each remainder and its Add are one Gemm. Both cut
the small nodes the exact form adds, 420 to 210 on SmolLM2, where the engine at batch 1
(2 threads, prompt 64 → 128 tokens, alternating processes) went from 84.7 / 81.5 / 85.0 to
88.0 / 86.5 / 84.1 tok/s (docs/export.md).

fp16 → fp32 scales are exact, so the check that every block's dequantised value equals
the checkpoint's own weight is an exact equality: it refuses a GGUF file that changed
since the import. A weight whose tensors are of another type (K-quants, Q5_x, F16...) or
mix 4- and 8-bit types falls back to our own quantiser (export/quantize.py: int4 for
types of at most 4.5 bits a weight, int8 otherwise), per weight, recorded in the
manifest. The embedding Gather stays float32: exact for every type, and it reads one row
per token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
from onnx import numpy_helper

from export.gguf_source import GGUFFile, Part, SourceRefused

Q = gguf.GGMLQuantizationType
BLOCK = 32
ACCURACY_LEVEL = 4  # int8 activations, as --quantize int8/int4
Q4_1_MODES = ("exact", "float-zp")
Q4_1_MODE = "exact"
DIRECT = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
# Types of at most 4.5 bits a weight fall back to our int4, all others to int8.
FALLBACK_INT4 = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K})


@dataclass(frozen=True)
class Blocks:
    """A (N, K) weight as codes and per-block floats: value = scale·code + low (4-bit with
    minimums) or scale·(code − zero) (zero 8 for 4-bit, 128 for 8-bit)."""

    bits: int
    codes: np.ndarray  # (N, K/32, 32) uint8, element order
    scales: np.ndarray  # (N, K/32) float32
    mins: np.ndarray | None  # (N, K/32) float32, or None

    def dequantize(self) -> np.ndarray:
        """The float32 weight (N, K), as gguf computes it (the same operations in float32)."""
        n = self.codes.shape[0]
        q = self.codes.astype(np.float32)
        if self.mins is not None:
            return (self.scales[..., None] * q + self.mins[..., None]).reshape(n, -1)
        zero = np.float32(8 if self.bits == 4 else 128)
        return (self.scales[..., None] * (q - zero)).reshape(n, -1)


def read_blocks(tensor: gguf.ReaderTensor) -> Blocks:
    """One Q4_0 / Q4_1 / Q8_0 tensor's blocks, rows in the file's order."""
    kind = tensor.tensor_type
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = np.asarray(tensor.data).reshape(rows, -1, size)  # (N, K/32, bytes)

    def half(at: int) -> np.ndarray:
        return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if kind == Q.Q8_0:
        return Blocks(8, raw[..., 2:] ^ np.uint8(0x80), half(0), None)  # s + 128
    nibbles = raw[..., 2:] if kind == Q.Q4_0 else raw[..., 4:]  # (N, K/32, 16)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # elements 0-15, 16-31
    if kind == Q.Q4_0:
        return Blocks(4, codes, half(0), None)
    if kind == Q.Q4_1:
        return Blocks(4, codes, half(0), half(2))
    raise ValueError(f"{tensor.name}: {kind.name} blocks are not kept (fallback type)")


def join(parts: list[Blocks]) -> Blocks:
    """Row-wise concatenation (Q | K | V); Q4_0 rows take minimums −8·d beside Q4_1 rows."""
    def lows(b: Blocks) -> np.ndarray:
        return b.mins if b.mins is not None else np.float32(-8) * b.scales  # exact: ×2³

    mins = None
    if any(b.mins is not None for b in parts):
        mins = np.concatenate([lows(b) for b in parts])
    return Blocks(parts[0].bits, np.concatenate([b.codes for b in parts]),
                  np.concatenate([b.scales for b in parts]), mins)


def weight_blocks(src: GGUFFile, parts: list[Part]) -> Blocks | None:
    """The blocks of one graph weight, rows as the checkpoint has them; None: fallback."""
    tensors = [src.tensors[p.tensor] for p in parts]
    if any(t.tensor_type not in DIRECT for t in tensors):
        return None
    if len({DIRECT[t.tensor_type] for t in tensors}) > 1:
        return None  # 4- and 8-bit rows in one MatMul
    out = []
    for part, tensor in zip(parts, tensors, strict=True):
        b = read_blocks(tensor)
        rows = part.rows  # the import's row order (e.g. llama's Q/K unpermuted)
        out.append(Blocks(b.bits, b.codes[rows], b.scales[rows],
                          None if b.mins is None else b.mins[rows]))
    return join(out)


def fallback_bits(src: GGUFFile, parts: list[Part]) -> int:
    types = {src.tensors[p.tensor].tensor_type for p in parts}
    return 4 if types <= FALLBACK_INT4 else 8


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B: (N, K/32, 32·bits/8), 4-bit elements 2i | 2i+1 << 4 in byte i."""
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def centred(scales: np.ndarray, mins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1's d·q + m as d·(q − z) + (m + z·d) with z the code nearest −m/d, per block.

    The same value, and as exact: (q − z)·d is exact in float32 (a 4-bit integer times an
    fp16 scale), and z is kept only where m + z·d is too, so the one rounding left, of the
    final sum, is gguf's own rounding of d·q + m. Centred codes matter once activations are
    int8 (accuracy level 4): their rounding error is multiplied by q − z instead of q
    (up to 15), and the float term m + z·d, which sees the exact activations, carries what
    is left. Returns z (N, K/32) uint8 and m + z·d (N, K/32) float32.
    """
    d, m = scales.astype(np.float64), mins.astype(np.float64)
    z = np.where(d == 0, 0.0, np.clip(np.rint(-m / np.where(d == 0, 1.0, d)), 0, 15))
    low = m + z * d  # exact in float64: fp16 operands
    exact = low.astype(np.float32).astype(np.float64) == low
    return (np.where(exact, z, 0).astype(np.uint8),
            np.where(exact, low, m).astype(np.float32))


def pack_zero_points(z: np.ndarray) -> np.ndarray:
    """4-bit zero points (N, K/32) → MatMulNBits' (N·⌈K/64⌉,) bytes, block 2i in the low
    nibble of byte i."""
    n, nb = z.shape
    padded = np.zeros((n, nb + nb % 2), np.uint8)
    padded[:, :nb] = z
    return np.ascontiguousarray(padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


class BlockWriter:
    """New nodes and initializers for one graph, with the per-input block sums shared.

    ``flat``: the graph's activations are (tokens, features) matrices, so a remainder and
    its Add can be one Gemm (whose inputs must be matrices)."""

    def __init__(self, mode: str, level: int, flat: bool = False) -> None:
        self.mode, self.level, self.flat = mode, level, flat
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.sums: dict[str, str] = {}  # activation → its per-block sums
        self.uncentred = 0  # exact Q4_1 blocks left at zero point 0

    def const(self, name: str, array: np.ndarray) -> str:
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(np.ascontiguousarray(array), name)
        return name

    def node(self, op: str, inputs: list[str], output: str | list[str], name: str,
             **attrs: Any) -> str:
        domain = "com.microsoft" if op == "MatMulNBits" else ""
        outputs = [output] if isinstance(output, str) else output
        self.nodes.append(onnx.helper.make_node(op, inputs, outputs, name=name,
                                                domain=domain, **attrs))
        return outputs[0]

    def block_sums(self, x: str, k: int) -> str:
        """x summed over each block of 32 inputs, (..., K/32): one MatMul by a 0/1 matrix."""
        if x not in self.sums:
            ones = np.zeros((k, k // BLOCK), np.float32)  # (K, K/32)
            ones[np.arange(k), np.arange(k) // BLOCK] = 1.0
            self.sums[x] = self.node("MatMul", [x, self.const(f"gguf.block_sum_{k}", ones)],
                                     f"{x}.gguf_block_sums", f"{x}.gguf_block_sums")
        return self.sums[x]

    def matmul(self, x: str, out: str, blocks: Blocks, w: str, name: str) -> None:
        """out = x · Wᵀ for W (N, K) held by ``blocks``, as MatMulNBits (+ the minimums)."""
        n, nb = blocks.scales.shape
        k = nb * BLOCK
        codes, scales = blocks.codes, blocks.scales
        extra: list[str] = []
        main = out
        if blocks.mins is not None and self.mode == "float-zp":
            flat = scales == 0  # a constant block: value m = 1·m with code 1, zero point 0
            zp = np.where(flat, 0.0, -blocks.mins / np.where(flat, 1.0, scales))
            codes = np.where(flat[..., None], np.uint8(1), codes)
            scales = np.where(flat, blocks.mins, scales)
            extra = [self.const(f"{w}.gguf_zp", zp.astype(np.float32).reshape(-1))]
        elif blocks.mins is not None:
            zp, lows = centred(blocks.scales, blocks.mins)
            self.uncentred += int((zp == 0).sum())
            extra = [self.const(f"{w}.gguf_zp", pack_zero_points(zp))]
            main = f"{out}.gguf_scaled"
        self.node("MatMulNBits", [x, self.const(f"{w}.gguf_q", pack(codes, blocks.bits)),
                                  self.const(f"{w}.gguf_scales", scales.reshape(-1)), *extra],
                  main, name, K=k, N=n, bits=blocks.bits, block_size=BLOCK,
                  accuracy_level=self.level)
        if main != out:  # exact Q4_1: x·(d·(q − z)) + Σ_block(x)·(m + z·d)ᵀ
            sums = self.block_sums(x, k)  # (T, K/32)
            mins_t = self.const(f"{w}.gguf_mins", np.ascontiguousarray(lows.T))  # (K/32, N)
            if self.flat:
                self.node("Gemm", [sums, mins_t, main], out, f"{name}.gguf_mins")
            else:
                low = self.node("MatMul", [sums, mins_t], f"{out}.gguf_mins",
                                f"{name}.gguf_mins")
                self.node("Add", [main, low], out, f"{name}.gguf_add")

    def joined(self, x: str, outs: list[str], parts: list[Blocks], w: str, name: str) -> None:
        """outs[i] = x · W_iᵀ for products sharing x: one product over the joined rows, then
        a Split (the rows of one node stream through the kernel once)."""
        whole = f"{name}.gguf_joined"
        self.matmul(x, whole, join(parts), w, name)
        rows = np.array([b.scales.shape[0] for b in parts], np.int64)
        self.node("Split", [whole, self.const(f"{w}.gguf_split", rows)], outs,
                  f"{name}.gguf_split", axis=-1)


def _weight_of(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
               src: GGUFFile) -> tuple[str, bool] | None:
    """(initializer, stored transposed as (K, N)) of a MatMul or a bias-free Gemm(transB)
    whose weight comes from the file; None for every other node."""
    if node.op_type == "MatMul" and node.input[1] in inits:
        name, transposed = node.input[1], True
    elif node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in inits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs != {"transB": 1}:
            return None
        name, transposed = node.input[1], False
    else:
        return None
    return (name, transposed) if name in src.weights else None


def rewrite_graph(model: onnx.ModelProto, src: GGUFFile, mode: str = Q4_1_MODE,
                  level: int = ACCURACY_LEVEL, flat: bool = False) -> dict[str, Any]:
    """Replace, in place, every weight product whose tensors are Q4_0/Q4_1/Q8_0 in ``src``
    by MatMulNBits over the file's blocks; return the figures (``fallback``: the nodes left
    for our quantiser, with the bits it should use). ``model`` holds its weights; ``flat``:
    its activations are (tokens, features) matrices (see :class:`BlockWriter`)."""
    if mode not in Q4_1_MODES:
        raise ValueError(f"unknown Q4_1 mode {mode!r}; choose one of {list(Q4_1_MODES)}")
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    writer = BlockWriter(mode, level, flat)
    kept: Counter[str] = Counter()
    fallback: dict[str, dict[str, Any]] = {}
    blocks_of: dict[str, tuple[str, Blocks]] = {}  # node → (weight, its blocks)
    for node in graph.node:
        found = _weight_of(node, inits, src)
        if found is None:
            continue
        name, transposed = found
        parts = src.weights[name]
        types = [src.tensors[p.tensor].tensor_type.name for p in parts]
        blocks = weight_blocks(src, parts)
        if blocks is None:
            fallback[node.name] = {"weight": name, "types": types,
                                   "bits": fallback_bits(src, parts)}
            continue
        weight = numpy_helper.to_array(inits[name])
        if not np.array_equal(blocks.dequantize(), weight.T if transposed else weight):
            raise SourceRefused(
                f"--quantize gguf: {src.path} changed since the import (or the checkpoint "
                f"was trained further): the blocks of {', '.join(p.tensor for p in parts)} "
                f"do not dequantise to the checkpoint's weight {name}")
        blocks_of[node.name] = (name, blocks)
        kept.update(types)
    sharing: dict[tuple[str, int], list[onnx.NodeProto]] = {}  # (input, bits) → products
    for node in graph.node:
        if node.name in blocks_of:
            sharing.setdefault((node.input[0], blocks_of[node.name][1].bits), []).append(node)
    for node in graph.node:
        if node.name not in blocks_of:
            writer.nodes.append(node)
            continue
        name, blocks = blocks_of[node.name]
        group = sharing[node.input[0], blocks.bits]
        if len(group) == 1:
            writer.matmul(node.input[0], node.output[0], blocks, name, node.name)
        elif node is group[0]:  # the others' outputs come from here, earlier than before
            writer.joined(node.input[0], [n.output[0] for n in group],
                          [blocks_of[n.name][1] for n in group],
                          "+".join(blocks_of[n.name][0] for n in group),
                          "+".join(n.name for n in group))
    del graph.node[:]
    graph.node.extend(writer.nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep + [t for t in writer.inits.values() if t.name in used])
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return {"method": "GGUF blocks as MatMulNBits (export/gguf_blocks.py)",
            "source": str(src.path), "block_size": BLOCK, "accuracy_level": level,
            "q4_1": mode, "q4_1_uncentred_blocks": writer.uncentred, "kept_tensors": dict(kept),
            "kept_matmuls": sum(n.op_type == "MatMulNBits" for n in graph.node),
            "joined_products": sum(len(g) for g in sharing.values() if len(g) > 1),
            "fallback": fallback}


def rewrite_file(path: Path, src: GGUFFile, mode: str = Q4_1_MODE,
                 level: int = ACCURACY_LEVEL,
                 flat: bool = False) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """``path`` (its external weights loaded) rewritten by :func:`rewrite_graph`."""
    model = onnx.load(str(path))
    return model, rewrite_graph(model, src, mode, level, flat)
