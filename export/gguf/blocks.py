"""--quantize gguf: the GGUF file's own blocks as ``MatMulNBits``, never requantised.

A GGUF block is 16 or 32 consecutive input weights of one output row with one scale,
exactly ONNX Runtime's ``com.microsoft.MatMulNBits`` layout at that block size (B is
(N, K/block, bytes), one scale per block). So the blocks are repacked (model/gguf/codes.py
reads them), and ORT's dequantised weights are gguf's (``gguf.quants.dequantize``) bit for
bit:

- Q8_0: value d·s with s a signed byte → code s + 128 with the default zero point 128.
- Q4_0: value d·(q − 8) → the same codes with the default zero point 8. Q4_0 stores
  element j in the low nibble of byte j and element j + 16 in its high nibble;
  MatMulNBits wants elements 2i and 2i + 1 in byte i.
- Q5_0: value d·(q − 16), 5-bit q → 8-bit code q + 112 with the default zero point 128.
- Q3_K, Q6_K (block 16): (d·sc)·q, no rounding anywhere → codes shifted onto the default
  zero point (4- and 8-bit), the scale d·sc exact in float32.
- Q4_1, Q5_1: value d·q + m; Q4_K, Q5_K (block 32) and Q2_K (block 16) are the same form
  with scale d·sc and minimum −dmin·m, both exact in float32 (fp16 times a 6-bit integer),
  and 5-bit codes (Q5_1, Q5_K) held as 8-bit ones. MatMulNBits' (q − zp)·d can only hold
  it with a float zero point zp = −m/d, which rounds (≤ 2.4e-7 off on random Q4_1
  weights). Kept exact instead (``Q4_1_MODE = "exact"``; measured in docs/export.md):
  MatMulNBits with an integer zero point z per block (the code nearest −m/d) computes
  x·(d·(q − z)), and the remainders add (x summed per block) · (m + z·d)ᵀ, one small
  MatMul K/block wide; inputs shared by several projections are summed once (see
  :func:`centred` for why this is exact). ``"float-zp"`` is the other form, for 4-bit
  codes only (ORT's 8-bit CPU kernel refuses float zero points).

A weight's rows form one piece per run of one MatMulNBits format (bits, block size): Q4_K
rows beside Q4_1 rows are one, Q4_K | Q6_K (llama.cpp's Q4_K_M gives attn_v and ffn_down
Q6_K in some layers) two. Products that read the same input have their pieces of one format
in one MatMulNBits over the joined rows, then a Split (gate and up); a product of several
formats is the Concat of its pieces' outputs. Where the activations are (tokens, features)
matrices (the engine graphs), each remainder and its Add are one Gemm. Joining and Gemms
halve the small nodes the exact form adds (docs/export.md measures them).

``kernel="ggml"`` writes the products over the file's bytes instead: each run of rows of one
GGUF type is a uint8 (N, row_bytes) initializer, the tensor's rows exactly as stored (in the
import's row order), computed by ``GgufMatMul`` (service/ops: ggml's CPU kernels inside
ONNX Runtime, at int8 activations as llama.cpp runs them), and the embedding is
``GgufGather`` over the same bytes (a tied LM head: one tensor). Nothing is re-encoded, so
the weights are the file's size. At float activations (``level=0``: ``--activations
float``, and attention.onnx always) the op keeps X in float32 and dequantises each row as
ggml does (``activations="float"``): the float32 model's arithmetic over the same bytes.

fp16 → fp32 scales are exact, so the check that every block's dequantised value equals
the checkpoint's own weight is an exact equality: it refuses a GGUF file that changed
since the import. A weight with a tensor of another type (F16, BF16, F32) falls back to
our own quantiser (export/quantize/weights.py: int4 for types of at most 4.5 bits a
weight, int8 otherwise, so int8 for every type the import reads), per weight, recorded in
the manifest. The embedding Gather stays float32: exact for every type, and it reads one
row per token.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
from onnx import numpy_helper

from export.gguf.source import GGUFFile, Part, SourceRefused
from export.onnx.onnx_build import is_placeholder
from model.gguf.codes import DIRECT, Blocks, join, read_blocks
from service import ops
from service.contract.pages import release_range

ACCURACY_LEVEL = 4  # int8 activations, as --quantize int8/int4
# whose kernels compute the kept blocks: ONNX Runtime's MatMulNBits over the blocks repacked
# (float32 scales), or ggml's over the file's bytes (GgufMatMul, service/ops)
KERNELS = ("nbits", "ggml")
Q4_1_MODE = "exact"  # the export's; BlockWriter also writes "float-zp" (module docstring)
CHECK_ROWS = 4096  # rows of a weight dequantised at a time to check it (dequantises_to)
# initializers smaller than this stay in the graph (as onnx.save leaves them): shapes, which
# ONNX Runtime's shape inference reads from the graph itself
INLINE_BYTES = 1024
# the largest 0/1 matrix the block sums multiply by (BlockWriter.block_sums): about a core's
# L2; a larger one would be read from memory in every layer
SUMS_MATRIX_BYTES = 1 << 20


@dataclass(frozen=True)
class Piece:
    """Rows ``start``:``start`` + ``rows`` of one graph weight, all of one MatMulNBits
    format. Its blocks are read from the file each time :attr:`blocks` is asked for, so
    that a rewrite holds one product's blocks at a time, not the model's (a 1B model's
    codes unpacked are 1 GB)."""

    start: int
    rows: int
    # what one kernel call can take: (bits, block size) for MatMulNBits, (ggml type,) for
    # GgufMatMul (rows of one type: one row size)
    format: tuple[int, ...]
    whole: bool  # the weight's only piece
    parts: tuple[tuple[Part, gguf.ReaderTensor], ...]

    @property
    def blocks(self) -> Blocks:
        # the import's row order (llama's Q/K unpermuted)
        return join([read_blocks(tensor).take(part.rows) for part, tensor in self.parts])

    @property
    def stored(self) -> np.ndarray:
        """The rows as the file stores them, (rows, row_bytes) uint8, in the import's row
        order (a copy of these rows only: the file stays mapped)."""
        return np.concatenate([stored_rows(tensor)[part.rows] for part, tensor in self.parts])

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        return self.parts[0][1].tensor_type

    @property
    def k(self) -> int:
        return int(self.parts[0][1].shape[0])  # ne[0]: the file's row length

    def release_pages(self) -> None:
        """Drop the file's pages this piece's rows were read from (only where the file is
        mapped read-only): a rewrite reads each tensor once, and the memory map would
        otherwise hold the whole file resident by the last product (at 3B, 1.8 GB of the
        export's peak). A later read faults them back in from the page cache."""
        for _, tensor in self.parts:
            rows = stored_rows(tensor)
            if not rows.flags.writeable:
                release_range(rows.ctypes.data, rows.nbytes)

    def label(self, base: str) -> str:
        """``base`` (the weight's, its node's or its output's name) for this piece's rows."""
        return base if self.whole else f"{base}.rows{self.start}-{self.start + self.rows}"


def stored_rows(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's bytes as (rows, row_bytes) uint8, a view of the mapped file."""
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    return np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)


def repacks(kernel: str, served_level: int) -> bool:
    """Whether an artifact's products (its served graphs and attention.onnx, which read the
    same bytes) are written in ggml's repack layout where it has one: under ggml's kernels
    served at int8 activations, as llama.cpp lays Q4_0 / IQ4_NL out at load (its gemv reads
    8 rows in one stream; docs/kernels.md). At float activations the rows stay as stored,
    for the float path's own decoders."""
    return kernel == "ggml" and served_level != 0


def kernel_format(kind: gguf.GGMLQuantizationType, kernel: str) -> tuple[int, ...]:
    """What rows must share to be one call of ``kernel``'s product (see :attr:`Piece.format`)."""
    return DIRECT[kind] if kernel == "nbits" else (int(kind),)


def weight_pieces(src: GGUFFile, parts: list[Part], kernel: str = "nbits") -> list[Piece] | None:
    """The blocks of one graph weight, rows as the checkpoint has them, one piece per run of
    rows of one format (MatMulNBits: Q4_K beside Q4_0 rows one piece, Q4_K | Q6_K two;
    ggml: one a GGUF type); None: the weight falls back (a tensor of a type not kept).
    Reads no block (:attr:`Piece.blocks`)."""
    tensors = [src.tensors[p.tensor] for p in parts]
    if any(t.tensor_type not in DIRECT for t in tensors):
        return None
    runs: list[list[tuple[Part, gguf.ReaderTensor]]] = []
    for part, tensor in zip(parts, tensors, strict=True):
        if runs and (kernel_format(runs[-1][0][1].tensor_type, kernel)
                     == kernel_format(tensor.tensor_type, kernel)):
            runs[-1].append((part, tensor))
        else:
            runs.append([(part, tensor)])
    pieces, start = [], 0
    for run in runs:
        rows = sum(len(part.rows) for part, _ in run)
        pieces.append(Piece(start, rows, kernel_format(run[0][1].tensor_type, kernel),
                            len(runs) == 1, tuple(run)))
        start += rows
    return pieces


def fallback_bits(src: GGUFFile, parts: list[Part]) -> int:
    """Our quantiser's width for a weight not kept: 4 where every tensor's type has at most
    4.5 bits a weight (int4 then loses little more than the file did), 8 otherwise."""
    def per_weight(kind: gguf.GGMLQuantizationType) -> float:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return 8 * size / block

    low = all(per_weight(src.tensors[p.tensor].tensor_type) <= 4.5 for p in parts)
    return 4 if low else 8


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B: (N, K/block, block·bits/8), 4-bit elements 2i | 2i+1 << 4 in byte i."""
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def significant_bits(x: np.ndarray) -> np.ndarray:
    """Bits of each float32's significand, from the leading to the lowest set one (x normal
    or 0: every scale here is an fp16 times a small integer)."""
    m = (x.astype(np.float32).view(np.uint32) & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    return 24 - np.log2(m & (~m + np.uint32(1))).astype(np.int64)


def centred(blocks: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """d·q + m as d·(q − z) + (m + z·d) with z the code nearest −m/d, per block.

    The same value, and as exact where z is kept: every (q − z)·d is exact in float32
    (|q − z| fits in the bits d's significand leaves of 24) and so is m + z·d (its float64
    sum has no error, TwoSum, and survives float32), so the one rounding left, of the final
    sum, is gguf's own rounding of d·q + m. Elsewhere z = 0, and q·d must be exact (it is for
    every type read: codes of over 5 bits come with fp16 scales; checked, as the rest is).
    Centred codes matter once activations are int8
    (accuracy level 4): their rounding error is multiplied by q − z instead of q, and the
    float term m + z·d, which sees the exact activations, carries what is left.
    Returns z (N, K/block) uint8 and m + z·d (N, K/block) float32.
    """
    assert blocks.mins is not None
    d, m = blocks.scales.astype(np.float64), blocks.mins.astype(np.float64)
    top = (1 << blocks.bits) - 1
    z = np.where(d == 0, 0.0, np.clip(np.rint(-m / np.where(d == 0, 1.0, d)), 0, top))
    room = np.left_shift(1, 24 - significant_bits(blocks.scales))  # |k| < room: k·d exact
    exact = np.ones(d.shape, bool)
    if (room <= top).any():  # else no code (nor |q − z|) can reach room: all exact
        # each block's extreme codes, reduced as bytes (as int64 they were most of a 1B
        # model's rewrite time)
        high = blocks.codes.max(-1).astype(np.int64)
        low_code = blocks.codes.min(-1).astype(np.int64)
        if (high >= room).any():
            raise ValueError("codes times scales would round in float32: not an exact form")
        exact = np.maximum(z - low_code, high - z) < room  # max |q − z| a block
    zd = z * d  # exact in float64: ≤ 8 bits times ≤ 24
    low = m + zd
    back = low - m  # TwoSum: the error of m + zd, 0 when the sum is exact
    error = (m - (low - back)) + (zd - back)
    exact &= (error == 0) & (low.astype(np.float32).astype(np.float64) == low)
    return (np.where(exact, z, 0).astype(np.uint8),
            np.where(exact, low, m).astype(np.float32))


def pack_zero_points(z: np.ndarray, bits: int) -> np.ndarray:
    """Zero points (N, K/block) → MatMulNBits' bytes: one a block for 8-bit codes;
    (N·⌈K/2·block⌉,) for 4-bit ones, block 2i in the low nibble of byte i."""
    if bits == 8:
        return np.ascontiguousarray(z, np.uint8).reshape(-1)
    n, nb = z.shape
    padded = np.zeros((n, nb + nb % 2), np.uint8)
    padded[:, :nb] = z
    return np.ascontiguousarray(padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


class SideFile:
    """A graph's side file of weights, written as each new initializer is made: a rewrite
    then holds one product's blocks at a time instead of every one until the graph is saved
    (a 1B model's are 950 MB; two rewrites at once held both). The tensors point at it as
    ONNX's external data does (location, offset, length), and ``onnx.save`` appends the
    tensors still held in memory after them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close(), after the rewrite)

    def tensor(self, array: np.ndarray, name: str) -> onnx.TensorProto:
        """``array`` (C-contiguous, little-endian) written; its initializer pointing here."""
        offset = self.file.tell()
        self.file.write(array.data)  # C-contiguous (BlockWriter.const): its bytes in order
        tensor = onnx.TensorProto(name=name, dims=array.shape,
                                  data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                                  data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.path.name), ("offset", str(offset)),
                           ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=value)
        return tensor

    def close(self) -> None:
        self.file.close()


class BlockWriter:
    """New nodes and initializers for one graph, with the per-input block sums shared.

    ``flat``: the graph's activations are (tokens, features) matrices, so a remainder and
    its Add can be one Gemm (whose inputs must be matrices). ``side``: the new initializers
    go there as they are made (else they are held in memory). ``kernel``: see
    :data:`KERNELS` (``ggml``: :meth:`stored_product` and :meth:`stored_gather`);
    ``repack``: products in ggml's repack layout where it has one (not the file's tensors
    in ``gathered``, whose rows a gather reads)."""

    def __init__(self, mode: str, level: int, flat: bool = False,
                 halves: bool | None = None, side: SideFile | None = None,
                 kernel: str = "nbits", repack: bool = False,
                 gathered: frozenset[str] = frozenset()) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {list(KERNELS)}")
        self.mode, self.level, self.flat, self.side = mode, level, flat, side
        self.kernel, self.repack, self.gathered = kernel, repack, gathered
        # 8-bit blocks as two 4-bit products (:meth:`_byte_halves`): by default where the
        # activations are float; attention.onnx of an int8-activation artifact runs at
        # float ones on the 8-bit codes the engine graphs hold (stored once, run rarely)
        self.halves = level == 0 if halves is None else halves
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.sums: dict[tuple[str, int], str] = {}  # (activation, block) → its block sums
        self.uncentred = 0  # blocks with minimums left at zero point 0
        self.by_content: dict[tuple[str, tuple[int, ...], bytes], str] = {}

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer: ``name``, or the name of an equal one already made (a tied
        embedding's blocks and the LM head's: one tensor, which ORT then loads once)."""
        if name in self.inits:
            return name
        array = np.require(array, requirements="C")  # (ascontiguousarray makes a scalar 1-D)
        key = (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).digest())
        if key not in self.by_content:
            self.inits[name] = (numpy_helper.from_array(array, name)
                                if self.side is None or array.nbytes < INLINE_BYTES
                                else self.side.tensor(array, name))
            self.by_content[key] = name
        return self.by_content[key]

    def node(self, op: str, inputs: list[str], output: str | list[str], name: str,
             **attrs: Any) -> str:
        domain = ("com.microsoft" if op == "MatMulNBits"
                  else ops.DOMAIN if op in (ops.MATMUL_OP, ops.GATHER_OP) else "")
        outputs = [output] if isinstance(output, str) else output
        self.nodes.append(onnx.helper.make_node(op, inputs, outputs, name=name,
                                                domain=domain, **attrs))
        return outputs[0]

    def block_sums(self, x: str, k: int, block: int) -> str:
        """x summed over each block of inputs, (..., K/block). One MatMul by a 0/1 (K,
        K/block) matrix while that matrix stays in a core's cache (one node, the fastest
        at SmolLM2's K of 576 and 1,536); past ``SUMS_MATRIX_BYTES`` a ReduceSum over x
        viewed as (rows, K/block, block), since every layer would stream the matrix from
        memory (8 MiB at a 1B model's K = 8,192: 2.4 of its 47 ms batch-1 step)."""
        if (x, block) in self.sums:
            return self.sums[x, block]
        sums = f"{x}.gguf_block_sums" + ("" if block == 32 else f"_{block}")
        self.sums[x, block] = sums
        if k * (k // block) * 4 <= SUMS_MATRIX_BYTES:
            ones = np.zeros((k, k // block), np.float32)  # (K, K/block)
            ones[np.arange(k), np.arange(k) // block] = 1.0
            return self.node("MatMul", [x, self.const(f"gguf.block_sums_{k}_{block}", ones)],
                             sums, sums)
        rows = self.const(f"gguf.block_shape_{k}_{block}",
                          np.array([-1, k // block, block], np.int64))
        split = self.node("Reshape", [x, rows], f"{sums}.blocks", f"{sums}.blocks")
        axis = self.const("gguf.last_axis", np.array([-1], np.int64))
        if self.flat:  # x is (T, K): the sums are (T, K/block) already
            return self.node("ReduceSum", [split, axis], sums, sums, keepdims=0)
        summed = self.node("ReduceSum", [split, axis], f"{sums}.rows", f"{sums}.rows",
                           keepdims=0)  # (rows, K/block)
        lead = self.node("Shape", [x], f"{sums}.lead", f"{sums}.lead", end=-1)
        shape = self.node("Concat", [lead, self.const(f"gguf.blocks_{k}_{block}", np.array(
            [k // block], np.int64))], f"{sums}.shape", f"{sums}.shape", axis=0)
        return self.node("Reshape", [summed, shape], sums, sums)  # (..., K/block)

    def matmul(self, x: str, out: str, blocks: Blocks, w: str, name: str) -> None:
        """out = x · Wᵀ for W (N, K) held by ``blocks``, as MatMulNBits (+ the minimums)."""
        n, nb = blocks.scales.shape
        k = nb * blocks.block
        if self.halves and blocks.bits == 8:
            self._byte_halves(x, out, blocks, w, name)
            return
        codes, scales = blocks.codes, blocks.scales
        extra: list[str] = []
        main = out
        if blocks.mins is not None and self.mode == "float-zp" and blocks.bits == 4:
            # (ORT's 8-bit CPU kernel refuses float zero points: 8-bit blocks stay exact)
            flat = scales == 0  # a constant block: value m = 1·m with code 1, zero point 0
            zp = np.where(flat, 0.0, -blocks.mins / np.where(flat, 1.0, scales))
            codes = np.where(flat[..., None], np.uint8(1), codes)
            scales = np.where(flat, blocks.mins, scales)
            extra = [self.const(f"{w}.gguf_zp", zp.astype(np.float32).reshape(-1))]
        elif blocks.mins is not None:
            zp, lows = centred(blocks)
            self.uncentred += int((zp == 0).sum())
            extra = [self.const(f"{w}.gguf_zp", pack_zero_points(zp, blocks.bits))]
            main = f"{out}.gguf_scaled"
        self.node("MatMulNBits", [x, self.const(f"{w}.gguf_q", pack(codes, blocks.bits)),
                                  self.const(f"{w}.gguf_scales", scales.reshape(-1)), *extra],
                  main, name, K=k, N=n, bits=blocks.bits, block_size=blocks.block,
                  accuracy_level=self.level)
        if main != out:  # exact minimums: x·(d·(q − z)) + Σ_block(x)·(m + z·d)ᵀ
            self._remainders(x, main, out, lows, blocks.block, w, name)

    def _remainders(self, x: str, main: str, out: str, lows: np.ndarray, block: int, w: str,
                    name: str) -> None:
        """out = main + (x summed per block) · lowsᵀ, lows (N, K/block) a constant a block."""
        k = lows.shape[1] * block
        sums = self.block_sums(x, k, block)  # (T, K/block)
        mins_t = self.const(f"{w}.gguf_mins", np.ascontiguousarray(lows.T))  # (K/block, N)
        if self.flat:
            self.node("Gemm", [sums, mins_t, main], out, f"{name}.gguf_mins")
        else:
            low = self.node("MatMul", [sums, mins_t], f"{out}.gguf_mins", f"{name}.gguf_mins")
            self.node("Add", [main, low], out, f"{name}.gguf_add")

    def _halves(self, blocks: Blocks, w: str) -> tuple[str, str, str, str]:
        """8-bit codes q as two 4-bit ones, q = 16·hi + lo: (hi codes, 16·scales, lo codes,
        scales), packed as MatMulNBits reads them."""
        return (self.const(f"{w}.gguf_q_high", pack(blocks.codes >> 4, 4)),
                self.const(f"{w}.gguf_scales_high",
                           (np.float32(16) * blocks.scales).reshape(-1)),
                self.const(f"{w}.gguf_q_low", pack(blocks.codes & 15, 4)),
                self.const(f"{w}.gguf_scales", blocks.scales.reshape(-1)))

    def _byte_halves(self, x: str, out: str, blocks: Blocks, w: str, name: str) -> None:
        """x · Wᵀ of 8-bit codes at float activations, as two 4-bit products: ONNX Runtime
        (1.32, x86) has no float-activation kernel for 8-bit codes and dequantises the whole
        weight on every call (106 ms for SmolLM2's 49,152 × 576 head, against 1.4 ms for a
        4-bit product). With q = 16·hi + lo, d·(q − 128) = 16d·(hi − 8) + d·lo, each exact
        in float32 (16d is d scaled by a power of 2; d·lo a scale of at most 19 significant
        bits times 4 bits); with minimums d·q + m = 16d·(hi − 8) + d·lo + (m + 128·d), the
        last added per block as the exact form's remainders are (rounded once, in float32)."""
        n, nb = blocks.scales.shape
        k = nb * blocks.block
        high_q, high_s, low_q, low_s = self._halves(blocks, w)
        zero = self.const(f"gguf.zero_points_4bit_{n}_{nb}",
                          pack_zero_points(np.zeros((n, nb), np.uint8), 4))
        attrs = {"K": k, "N": n, "bits": 4, "block_size": blocks.block,
                 "accuracy_level": self.level}
        high = self.node("MatMulNBits", [x, high_q, high_s], f"{out}.gguf_high",
                         f"{name}.gguf_high", **attrs)
        low = self.node("MatMulNBits", [x, low_q, low_s, zero], f"{out}.gguf_low",
                        f"{name}.gguf_low", **attrs)
        if blocks.mins is None:
            self.node("Add", [high, low], out, name)
            return
        both = self.node("Add", [high, low], f"{out}.gguf_scaled", f"{name}.gguf_halves")
        lows = (blocks.mins.astype(np.float64)
                + 128.0 * blocks.scales.astype(np.float64)).astype(np.float32)
        self._remainders(x, both, out, lows, blocks.block, w, name)

    def gather(self, ids: str, out: str, blocks: Blocks, w: str, name: str) -> None:
        """out = the rows ``ids`` of W (N, K) held by ``blocks``, dequantised in the graph
        with :meth:`Blocks.dequantize`'s float32 operations, so bit for bit gguf's rows.

        The codes and scales are stored as MatMulNBits reads them, so a tied LM head's
        blocks and the embedding's are the same bytes, stored once (weights.bin keys
        tensors by content); only the minimums (N·K/block floats) are the embedding's own.
        A token reads its own row's bytes: nothing is dequantised beyond the rows asked."""
        n, nb = blocks.scales.shape
        k, bits = nb * blocks.block, blocks.bits
        flat = self.node("Reshape", [ids, self.const("gguf.shape_rows", np.array([-1]))],
                         f"{name}.ids", f"{name}.gguf_ids")  # (M,)
        def unpacked(codes: str, tag: str) -> str:
            """The rows' 4-bit codes as floats: (M, nb, block/2) bytes → (M, nb, block),
            element 2i in the low nibble, 2i + 1 in the high one."""
            packed = self.node("Gather", [codes, flat], f"{name}.{tag}packed",
                               f"{name}.gguf_{tag}gather")
            nibble, four = np.array([15], np.uint8), np.array([4], np.uint8)
            low = self.node("BitwiseAnd", [packed, self.const("gguf.nibble", nibble)],
                            f"{name}.{tag}low", f"{name}.gguf_{tag}low")
            high = self.node("BitShift", [packed, self.const("gguf.four", four)],
                             f"{name}.{tag}high", f"{name}.gguf_{tag}high", direction="RIGHT")
            last = self.const("gguf.axis_last", np.array([-1]))
            pairs = self.node("Concat", [
                self.node("Unsqueeze", [low, last], f"{name}.{tag}low1",
                          f"{name}.gguf_{tag}low1"),
                self.node("Unsqueeze", [high, last], f"{name}.{tag}high1",
                          f"{name}.gguf_{tag}high1")],
                f"{name}.{tag}pairs", f"{name}.gguf_{tag}pairs", axis=-1)  # (M, nb, block/2, 2)
            codes = self.node("Reshape", [pairs, self.const(
                f"gguf.shape_codes_{nb}_{blocks.block}", np.array([-1, nb, blocks.block]))],
                f"{name}.{tag}codes", f"{name}.gguf_{tag}codes")
            return self.node("Cast", [codes], f"{name}.{tag}q", f"{name}.gguf_{tag}cast",
                             to=onnx.TensorProto.FLOAT)

        if bits == 8 and self.halves:  # the head's two 4-bit halves: q = 16·hi + lo
            high_q, _, low_q, _ = self._halves(blocks, w)
            high = self.node("Mul", [unpacked(high_q, "hi_"), self.const(
                "gguf.sixteen", np.array([16], np.float32))], f"{name}.hi16",
                f"{name}.gguf_hi16")
            q = self.node("Add", [high, unpacked(low_q, "lo_")], f"{name}.q",
                          f"{name}.gguf_q")  # (M, nb, block), exact small integers
        elif bits == 4:
            q = unpacked(self.const(f"{w}.gguf_q", pack(blocks.codes, bits)), "")
        else:
            packed = self.node("Gather", [self.const(f"{w}.gguf_q", pack(blocks.codes, bits)),
                                          flat], f"{name}.packed", f"{name}.gguf_gather")
            q = self.node("Cast", [packed], f"{name}.q", f"{name}.gguf_cast",
                          to=onnx.TensorProto.FLOAT)  # (M, nb, block)

        def per_block(array_name: str, array: np.ndarray, tag: str) -> str:
            """A per-block table (N·nb,) gathered for the tokens, (M, nb, 1)."""
            table = self.node("Reshape", [self.const(array_name, array.reshape(-1)),
                                          self.const(f"gguf.shape_table_{nb}",
                                                     np.array([n, nb]))],
                              f"{name}.{tag}_table", f"{name}.gguf_{tag}_table")
            rows = self.node("Gather", [table, flat], f"{name}.{tag}", f"{name}.gguf_{tag}")
            return self.node("Unsqueeze", [rows, self.const("gguf.axis_last", np.array([-1]))],
                             f"{name}.{tag}1", f"{name}.gguf_{tag}1")

        scale = per_block(f"{w}.gguf_scales", blocks.scales, "scale")
        if blocks.mins is not None:  # scale·q + min
            value = self.node("Add", [
                self.node("Mul", [scale, q], f"{name}.scaled", f"{name}.gguf_scaled"),
                per_block(f"{w}.gguf_row_mins", blocks.mins, "min")],
                f"{name}.value", f"{name}.gguf_value")
        else:  # scale·(q − zero)
            centred_q = self.node("Sub", [q, self.const(f"gguf.zero_{blocks.zero}",
                                                        np.array([blocks.zero], np.float32))],
                                  f"{name}.centred", f"{name}.gguf_centred")
            value = self.node("Mul", [scale, centred_q], f"{name}.value", f"{name}.gguf_value")
        shape = self.node("Concat", [
            self.node("Shape", [ids], f"{name}.ids_shape", f"{name}.gguf_ids_shape"),
            self.const(f"gguf.width_{k}", np.array([k]))], f"{name}.shape",
            f"{name}.gguf_shape", axis=0)
        self.node("Reshape", [value, shape], out, name)  # ids.shape + (K,)

    def stored_product(self, x: str, outs: list[str], pieces: list[Piece], w: str,
                       name: str) -> None:
        """outs[i] = x · W_iᵀ over the file's bytes of ``pieces`` (one GGUF type): one
        GgufMatMul over their rows joined, then a Split where there are several. At float
        activations (level 0) the op keeps x in float32 and dequantises the rows as ggml
        does (``activations="float"``): the float32 model's arithmetic over the same bytes.
        With :attr:`repack`, the same bytes re-laid out once by ggml's own repack where it
        has a layout for the type on this CPU (Q4_0, IQ4_NL with AVX2: llama.cpp's load-time
        repack, done here once; service/ops/gguf_repacked.h), unless a gather reads these
        rows too (:attr:`gathered`: a tied embedding, kept as stored so it stays one
        tensor)."""
        rows = (pieces[0].stored if len(pieces) == 1
                else np.concatenate([p.stored for p in pieces]))  # (N, row_bytes)
        kind, k = int(pieces[0].ggml_type), pieces[0].k
        layout = ops.ROWS_LAYOUT
        gathered = any(part.tensor in self.gathered for p in pieces for part, _ in p.parts)
        if self.repack and not gathered:
            repacked, _ = ops.repack(kind, k, rows)  # None: no layout here, rows kept
            if repacked is not None:
                rows, layout = repacked, ops.REPACKED_LAYOUT
        weight = self.const(f"{w}.gguf_rows", rows)
        whole = outs[0] if len(pieces) == 1 else f"{name}.gguf_joined"
        self.node(ops.MATMUL_OP, [x, weight], whole, name, ggml_type=kind, k=k,
                  activations="float" if self.level == 0 else "int8", layout=layout)
        if len(pieces) > 1:
            sizes = np.array([p.rows for p in pieces], np.int64)
            self.node("Split", [whole, self.const(f"{w}.gguf_split", sizes)], outs,
                      f"{name}.gguf_split", axis=-1)

    def stored_gather(self, ids: str, out: str, piece: Piece, w: str, name: str) -> None:
        """out = the rows ``ids`` of W, dequantised by ggml from the file's bytes (the LM
        head's own bytes where the embedding is tied: one tensor)."""
        self.node(ops.GATHER_OP, [ids, self.const(f"{w}.gguf_rows", piece.stored)], out, name,
                  ggml_type=int(piece.ggml_type), k=piece.k)

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
    """(initializer, stored transposed as (K, N)) of a MatMul, a bias-free Gemm(transB) or
    an embedding's Gather whose weight comes from the file; None for every other node."""
    if node.op_type == "Gather" and node.input[0] in inits:
        if any(a.name == "axis" and a.i != 0 for a in node.attribute):
            return None
        name, transposed = node.input[0], False
    elif node.op_type == "MatMul" and node.input[1] in inits:
        name, transposed = node.input[1], True
    elif node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in inits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs != {"transB": 1}:
            return None
        name, transposed = node.input[1], False
    else:
        return None
    return (name, transposed) if name in src.weights else None


def _weight_array(tensor: onnx.TensorProto, base: Path | None) -> np.ndarray:
    """An initializer's values; an external one mapped from its file, not read whole."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL or base is None:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(base / info["location"], dtype=dtype, mode="r",
                     offset=int(info.get("offset", 0)), shape=tuple(tensor.dims))


def dequantises_to(pieces: list[Piece], weight: np.ndarray, transposed: bool) -> bool:
    """Whether the pieces' blocks dequantise exactly to ``weight`` (N, K), or to its
    transpose stored (K, N): ``CHECK_ROWS`` rows at a time, so that a 49k-row LM head
    never exists in float32 beside its copies (the same values as dequantising whole:
    :meth:`Blocks.dequantize` is elementwise)."""
    view = weight.T if transposed else weight  # (N, K): a view, nothing copied
    columns = int(pieces[0].parts[0][1].shape[0])  # ne[0]: the file's row length
    if view.shape != (sum(p.rows for p in pieces), columns):
        return False
    for piece in pieces:
        b = piece.blocks
        for start in range(0, b.codes.shape[0], CHECK_ROWS):
            stop = min(b.codes.shape[0], start + CHECK_ROWS)
            rows = Blocks(b.bits, b.codes[start:stop], b.scales[start:stop],
                          None if b.mins is None else b.mins[start:stop])
            if not np.array_equal(rows.dequantize(),
                                  view[piece.start + start:piece.start + stop]):
                return False
    return True


def rewrite_graph(model: onnx.ModelProto, src: GGUFFile, level: int = ACCURACY_LEVEL,
                  flat: bool = False, base: Path | None = None, halves: bool | None = None,
                  side: SideFile | None = None, kernel: str = "nbits",
                  repack: bool = False) -> dict[str, Any]:
    """Replace, in place, every weight product whose tensors are of ``DIRECT`` types in
    ``src`` by MatMulNBits over the file's blocks (``kernel="ggml"``: GgufMatMul over the
    file's bytes; ``repack``: in ggml's repack layout where it has one, see
    :meth:`BlockWriter.stored_product`); return the figures (``fallback``: the
    nodes left for our quantiser, with the bits it should use). ``model`` holds its
    weights, or with ``base`` leaves them in that directory (external data), each read
    when its blocks are checked; ``flat``: its activations are (tokens, features) matrices,
    ``side``: where the new initializers are written (see :class:`BlockWriter`)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    kept: Counter[str] = Counter()
    fallback: dict[str, dict[str, Any]] = {}
    pieces_of: dict[str, tuple[str, list[Piece]]] = {}  # node → (weight, its pieces)
    gathers: list[str] = []  # embeddings read from the blocks (the rest stay float32)
    gathered: set[str] = set()  # the file's tensors they read
    for node in graph.node:
        found = _weight_of(node, inits, src)
        if found is None:
            continue
        name, transposed = found
        parts = src.weights[name]
        types = [src.tensors[p.tensor].tensor_type.name for p in parts]
        pieces = weight_pieces(src, parts, kernel)
        if node.op_type == "Gather" and (pieces is None or len(pieces) > 1):
            continue  # a float tensor, or rows of two formats: the float32 Gather is exact
        if pieces is None:
            fallback[node.name] = {"weight": name, "tensors": [p.tensor for p in parts],
                                   "types": types, "bits": fallback_bits(src, parts)}
            continue
        # A placeholder has no values to compare: the checkpoint's weight is the file's
        # blocks by construction (a model loaded with them left, model/gguf/reader.py).
        if not is_placeholder(inits[name]) and not dequantises_to(
                pieces, _weight_array(inits[name], base), transposed):
            raise SourceRefused(
                f"--quantize gguf: {src.path} changed since the import (or the checkpoint "
                f"was trained further): the blocks of {', '.join(p.tensor for p in parts)} "
                f"do not dequantise to the checkpoint's weight {name}")
        pieces_of[node.name] = (name, pieces)
        if node.op_type == "Gather":
            gathers.append(name)
            gathered.update(p.tensor for p in parts)
        else:
            kept.update(types)
    readers: dict[str, list[onnx.NodeProto]] = {}  # input → the products reading it
    for node in graph.node:
        if node.name in pieces_of and node.op_type != "Gather":
            readers.setdefault(node.input[0], []).append(node)
    writer = BlockWriter(Q4_1_MODE, level, flat, halves, side, kernel, repack,
                         frozenset(gathered))
    joined = split = 0
    embeddings: list[tuple[int, onnx.NodeProto]] = []  # (where in writer.nodes, Gather)
    for node in graph.node:
        if node.name not in pieces_of:
            writer.nodes.append(node)
        elif node.op_type == "Gather":
            embeddings.append((len(writer.nodes), node))
        elif node is readers[node.input[0]][0]:  # the others' outputs come from here too
            j, s = _write_products(writer, node.input[0], readers[node.input[0]], pieces_of)
            joined, split = joined + j, split + s
    # The embeddings last, in their places: a tied one's blocks keep the LM head's names.
    for at, node in reversed(embeddings):
        done, writer.nodes = writer.nodes, []
        weight, (piece,) = pieces_of[node.name]
        if kernel == "ggml":
            writer.stored_gather(node.input[1], node.output[0], piece, weight, node.name)
        else:
            writer.gather(node.input[1], node.output[0], piece.blocks, weight, node.name)
        piece.release_pages()
        writer.nodes = done[:at] + writer.nodes + done[at:]
    del graph.node[:]
    graph.node.extend(writer.nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    if missing := [t.name for t in keep if is_placeholder(t)]:
        raise SourceRefused(f"--quantize gguf: {', '.join(missing[:4])} of {src.path} could "
                            "not be kept as blocks and the checkpoint holds no float copy")
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for name in list(writer.inits):  # moved one by one: each copied, then let go
        tensor = writer.inits.pop(name)
        if name in used:
            graph.initializer.append(tensor)
        del tensor
    attention = _cached_attention(graph) if kernel == "ggml" else 0
    swiglu = _fused_swiglu(graph) if kernel == "ggml" and flat else 0
    domains = {n.domain for n in graph.node} & {"com.microsoft", ops.DOMAIN}
    for domain in sorted(domains - {o.domain for o in model.opset_import}):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    if kernel == "ggml":
        stored = [n for n in graph.node if n.domain == ops.DOMAIN]
        return {"method": "GGUF blocks as stored, ggml's kernels (GgufMatMul, service/ops)",
                "kernel": kernel, "source": str(src.path), "accuracy_level": level,
                "kept_tensors": dict(kept),
                "kept_matmuls": sum(n.op_type == ops.MATMUL_OP for n in stored),
                "activations": "float" if level == 0 else "int8",
                "repacked_matmuls": sum(
                    any(a.name == "layout" and a.s == ops.REPACKED_LAYOUT.encode()
                        for a in n.attribute) for n in stored),
                "joined_products": joined, "split_products": split, "kept_gathers": gathers,
                "cached_attention": attention, "swiglu_epilogues": swiglu,
                "fallback": fallback}
    return {"method": "GGUF blocks as MatMulNBits (export/gguf/blocks.py)", "kernel": kernel,
            "source": str(src.path), "accuracy_level": level,
            "block_sizes": sorted({a.i for n in nbits for a in n.attribute
                                   if a.name == "block_size"}),
            "q4_1": Q4_1_MODE, "uncentred_blocks": writer.uncentred, "kept_tensors": dict(kept),
            "kept_matmuls": len(nbits), "joined_products": joined, "split_products": split,
            "kept_gathers": gathers, "fallback": fallback}


def _fused_swiglu(graph: onnx.GraphProto) -> int:
    """Every gated feed-forward activation over a joined gate | up GgufMatMul (its Split
    into two equal halves, silu(gate) as Sigmoid and Mul, then the Mul by up) made the
    op's ``epilogue="swiglu"``, which writes silu(gate) · up itself: three small nodes
    fewer a layer (service/ops/gguf_epilogue.h). A pattern with anything between (an
    adapter's delta added to gate or up) is left as it is. Returns how many."""
    nodes = list(graph.node)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    pattern = _SwigluPattern({out: n for n in nodes for out in n.output}, readers,
                             {t.name: t for t in graph.initializer},
                             {o.name for o in graph.output})
    gone: set[int] = set()
    split_sizes: set[str] = set()  # the fused Splits' sizes: dropped where nothing reads them
    fused = 0
    for split in nodes:
        found = pattern.of_split(split)
        if found is None:
            continue
        fused += 1
        product, removed = found
        del product.output[:]
        product.output.append(removed[-1].output[0])
        product.attribute.append(onnx.helper.make_attribute("epilogue", ops.SWIGLU_EPILOGUE))
        gone.update(id(n) for n in removed)
        split_sizes.add(split.input[1])
    if fused:
        kept = [n for n in nodes if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(kept)
        used = {name for n in kept for name in n.input}
        inits = [t for t in graph.initializer if t.name in used or t.name not in split_sizes]
        del graph.initializer[:]
        graph.initializer.extend(inits)
    return fused


@dataclass
class _SwigluPattern:
    """A graph's producers, readers, initializers and outputs, to find SwiGLU after a
    joined gate | up product (:func:`_fused_swiglu`)."""

    by_output: dict[str, onnx.NodeProto]
    readers: dict[str, list[onnx.NodeProto]]
    consts: dict[str, onnx.TensorProto]
    outputs: set[str]

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        found = self.readers.get(name, [])
        return found[0] if len(found) == 1 and name not in self.outputs else None

    def of_split(self, split: onnx.NodeProto
                 ) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
        """(the GgufMatMul, [Split, Sigmoid, silu's Mul, the Mul by up]) where ``split``
        starts the pattern, else None."""
        if split.op_type != "Split" or len(split.output) != 2 or len(split.input) != 2:
            return None
        product = self.by_output.get(split.input[0])
        if (product is None or product.op_type != ops.MATMUL_OP or product.domain != ops.DOMAIN
                or self.only_reader(split.input[0]) is not split
                or split.input[1] not in self.consts
                or product.name != "+".join(split.output)):  # the names swiglu.py restores
            return None
        sizes = numpy_helper.to_array(self.consts[split.input[1]])
        if sizes.shape != (2,) or sizes[0] != sizes[1]:
            return None
        gate, up = split.output
        gate_readers = self.readers.get(gate, [])
        sigmoid = next((n for n in gate_readers if n.op_type == "Sigmoid"), None)
        act = next((n for n in gate_readers if n.op_type == "Mul"), None)
        if sigmoid is None or act is None or len(gate_readers) != 2 or gate in self.outputs:
            return None
        if (sorted(act.input) != sorted([gate, sigmoid.output[0]])
                or self.only_reader(sigmoid.output[0]) is not act):
            return None
        glu = self.only_reader(act.output[0])
        if glu is None or glu.op_type != "Mul" or self.only_reader(up) is not glu:
            return None
        if sorted(glu.input) != sorted([act.output[0], up]):
            return None
        return product, [split, sigmoid, act, glu]


def _cached_attention(graph: onnx.GraphProto) -> int:
    """Every GroupQueryAttention node of ``graph`` (float32: the CPU engine graphs) made the op
    library's CachedAttention, which takes the same inputs, outputs and attributes and computes
    the same (service/ops/cached_attention.cc; ONNX Runtime's CPU kernel runs a small GEMM a row
    and query head): graphs over the GGUF ops load that library anyway. Returns how many."""
    swapped = 0
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            node.op_type, node.domain = ops.ATTENTION_OP, ops.DOMAIN
            swapped += 1
    return swapped


def _write_products(writer: BlockWriter, x: str, products: list[onnx.NodeProto],
                    pieces_of: dict[str, tuple[str, list[Piece]]]) -> tuple[int, int]:
    """The products reading ``x``: one MatMulNBits per format over the rows of that format
    (gate | up, Q | K | V), a Split where it holds several pieces, and a Concat for a
    product whose rows are of several formats (Q4_K | Q6_K). Returns how many pieces were
    joined with others and how many products were split by format."""
    groups: dict[tuple[int, ...], list[tuple[onnx.NodeProto, Piece]]] = {}
    for node in products:
        for piece in pieces_of[node.name][1]:
            groups.setdefault(piece.format, []).append((node, piece))
    joined = 0
    for members in groups.values():
        weights = "+".join(p.label(pieces_of[n.name][0]) for n, p in members)
        nodes = "+".join(p.label(n.name) for n, p in members)
        outs = [p.label(n.output[0]) for n, p in members]
        if writer.kernel == "ggml":
            writer.stored_product(x, outs, [p for _, p in members], weights, nodes)
            joined += len(members) if len(members) > 1 else 0
        elif len(members) == 1:
            writer.matmul(x, outs[0], members[0][1].blocks, weights, nodes)
        else:
            writer.joined(x, outs, [p.blocks for _, p in members], weights, nodes)
            joined += len(members)
        for _, piece in members:
            piece.release_pages()
    split = 0
    for node in products:
        pieces = pieces_of[node.name][1]
        if len(pieces) > 1:  # Q | K | V of several formats: their outputs side by side
            writer.node("Concat", [p.label(node.output[0]) for p in pieces],
                        node.output[0], f"{node.name}.gguf_concat", axis=-1)
            split += 1
    return joined, split


def rewrite_file(path: Path, src: GGUFFile, level: int = ACCURACY_LEVEL, flat: bool = False,
                 halves: bool | None = None, side: SideFile | None = None,
                 kernel: str = "nbits", repack: bool = False
                 ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """``path`` rewritten by :func:`rewrite_graph`, its external weights left where they
    are (the model's tensors still point at them; each weight is read when it is checked),
    so that the float32 graph is never held whole; the new weights written to ``side`` as
    they are made, where given."""
    model = onnx.load(str(path), load_external_data=False)
    return model, rewrite_graph(model, src, level, flat, base=path.parent, halves=halves,
                                side=side, kernel=kernel, repack=repack)
