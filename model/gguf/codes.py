"""A GGUF tensor's blocks as MatMulNBits codes, scales and minimums, without rounding.

Every type kept (``DIRECT``) stores, per block of 16 or 32 consecutive weights of one
output row, a small integer code q and float32 numbers that are exact products of the
file's fp16 scales and small integers, and ``gguf.quants.dequantize`` computes the value
with at most one rounding, which :meth:`Blocks.dequantize` repeats in the same float32
operations (so "the same weight" is an exact equality):

- Q8_0, Q4_0, Q5_0 (block 32): d·(q − zero); Q4_1, Q5_1 (32): d·q + m (5-bit codes held
  as 8-bit ones). llama.cpp writes Q5_0 / Q5_1 / Q8_0 in its K-quant mixes for tensors whose
  rows are not a multiple of 256 (SmolLM2-135M's 576).
- Q4_K (32 per sub-block, 8 to a super-block of 256): (d·sc)·q − dmin·m with 6-bit sc and m,
  so d·sc and dmin·m are exact in float32 (an fp16 times a 6-bit integer) and the value is
  Q4_1's form; Q5_K the same with 5-bit q, held as 8-bit codes.
- Q2_K (16 per sub-block): (d·(sc & 15))·q − dmin·(sc >> 4), 2-bit q: Q4_1's form again,
  as 4-bit codes at block 16.
- Q3_K (16): (d·(sc − 32))·q with q in −4..3 and Q6_K (16): (d·sc)·(q − 32) with an int8
  sc, 6-bit q: no rounding at all; the codes are shifted onto MatMulNBits' default zero
  point (q + 8 for 4 bits, q + 96 for 8), so neither needs a zero-point input.

Float types (F16, BF16) are not read here (see export/gguf/blocks.py's fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# The types kept: MatMulNBits (bits, block size) of each.
DIRECT: dict[Q, tuple[int, int]] = {
    Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q5_0: (8, 32), Q.Q5_1: (8, 32), Q.Q8_0: (8, 32),
    Q.Q2_K: (4, 16), Q.Q3_K: (4, 16), Q.Q4_K: (4, 32), Q.Q5_K: (8, 32), Q.Q6_K: (8, 16)}


@dataclass(frozen=True)
class Blocks:
    """A (N, K) weight as codes and per-block floats: value = scale·code + low (with
    minimums) or scale·(code − zero), zero being MatMulNBits' default (8 for 4-bit codes,
    128 for 8-bit ones)."""

    bits: int  # MatMulNBits' code width: 4 or 8
    codes: np.ndarray  # (N, K/block, block) uint8, element order
    scales: np.ndarray  # (N, K/block) float32
    mins: np.ndarray | None  # (N, K/block) float32, or None

    @property
    def block(self) -> int:
        return int(self.codes.shape[-1])

    @property
    def zero(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def format(self) -> tuple[int, int]:
        """What one MatMulNBits node can hold rows of: (bits, block size)."""
        return self.bits, self.block

    def dequantize(self) -> np.ndarray:
        """The float32 weight (N, K), as gguf computes it (the same operations in float32)."""
        n = self.codes.shape[0]
        q = self.codes.astype(np.float32)
        if self.mins is not None:
            return (self.scales[..., None] * q + self.mins[..., None]).reshape(n, -1)
        return (self.scales[..., None] * (q - np.float32(self.zero))).reshape(n, -1)

    def take(self, rows: np.ndarray) -> Blocks:
        """These rows, in this order."""
        return Blocks(self.bits, self.codes[rows], self.scales[rows],
                      None if self.mins is None else self.mins[rows])


def join(parts: list[Blocks]) -> Blocks:
    """Row-wise concatenation of blocks of one format (Q | K | V); rows without minimums
    take −zero·scale (exact: a power of 2 times a float32) beside rows with them."""
    if len({b.format for b in parts}) > 1:
        raise ValueError(f"cannot join blocks of formats {sorted({b.format for b in parts})}")

    def lows(b: Blocks) -> np.ndarray:
        return b.mins if b.mins is not None else np.float32(-b.zero) * b.scales

    mins = None
    if any(b.mins is not None for b in parts):
        mins = np.concatenate([lows(b) for b in parts])
    return Blocks(parts[0].bits, np.concatenate([b.codes for b in parts]),
                  np.concatenate([b.scales for b in parts]), mins)


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block, as float32 (exact). (N, blocks)"""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _times(d: np.ndarray, small: np.ndarray) -> np.ndarray:
    """Sub-block scales d·s, exact (fp16 × a ≤ 8-bit integer), as gguf multiplies them.
    d (N, nb), small (N, nb, subs) → (N, nb·subs)"""
    return (d[..., None] * small.astype(np.float32)).reshape(d.shape[0], -1)


def _bits_of(packed: np.ndarray, shifts: range, mask: int) -> np.ndarray:
    """Fields of ``packed`` (..., L) at each shift: (..., len(shifts), L)."""
    shift = np.array(list(shifts), np.uint8)[:, None]
    return (packed[..., None, :] >> shift) & np.uint8(mask)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes → 8 six-bit scales and 8 minimums, (N, nb, 8) each.

    Bytes 0-3: scales 0-3 (low 6 bits) and the top bits of scales 4-7; 4-7: minimums 0-3
    and the top bits of minimums 4-7; 8-11: the low nibbles of scales 4-7 and minimums 4-7.
    """
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q5(raw: np.ndarray, minimum: bool) -> Blocks:
    """Q5_0 (22 bytes: d, 4 bytes of fifth bits, 16 of nibbles) and Q5_1 (24: d, m, then the
    same). Bit i of the little-endian 32-bit word is element i's fifth bit; nibbles as
    Q4_0's (elements 0-15 low, 16-31 high)."""
    at = 4 if minimum else 2
    high = _bits_of(raw[..., at:at + 4], range(8), 1).swapaxes(-1, -2)  # (N, nb, 4 bytes, 8)
    nibbles = raw[..., at + 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # (N, nb, 32)
    q = q | (high.reshape(q.shape) << np.uint8(4))  # 0..31
    if minimum:
        return Blocks(8, q, _half(raw, 0), _half(raw, 2))
    return Blocks(8, q + np.uint8(112), _half(raw, 0), None)  # q − 16 + 128


def _q4_k(raw: np.ndarray, five: bool) -> Blocks:
    """Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 of nibbles) and Q5_K (176: the same
    with 32 bytes of fifth bits before the nibbles). Nibble bytes go in chunks of 32:
    chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high ones."""
    n, nb = raw.shape[:2]
    sc, mn = _k_scale_min(raw[..., 4:16])
    nibbles = raw[..., 48:] if five else raw[..., 16:]  # (N, nb, 128)
    codes = _bits_of(nibbles.reshape(n, nb, 4, 32), range(0, 8, 4), 0x0F)  # (N, nb, 4, 2, 32)
    codes = codes.reshape(n, nb, 8, 32)
    if five:  # bit j of high byte i: element i of sub-block j
        codes = codes | (_bits_of(raw[..., 16:48], range(8), 1) << np.uint8(4))
    return Blocks(8 if five else 4, codes.reshape(n, nb * 8, 32), _times(_half(raw, 0), sc),
                  -_times(_half(raw, 2), mn))  # d·sc·q + (−dmin·m)


def _q6_k(raw: np.ndarray) -> Blocks:
    """Q6_K (210 bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d):
    each half of the super-block holds 128 weights, low nibbles of bytes 0-63 then their
    high nibbles, with the 2-bit pairs of bytes 0-31 at shifts 0, 2, 4, 6."""
    n, nb = raw.shape[:2]
    low = _bits_of(raw[..., :128].reshape(n, nb, 2, 64), range(0, 8, 4), 0x0F)
    high = _bits_of(raw[..., 128:192].reshape(n, nb, 2, 32), range(0, 8, 2), 0x03)
    q = low.reshape(n, nb, 8, 32) | (high.reshape(n, nb, 8, 32) << np.uint8(4))  # 0..63
    scales = _times(_half(raw, 208), raw[..., 192:208].view(np.int8))
    return Blocks(8, (q + np.uint8(96)).reshape(n, nb * 16, 16), scales, None)  # q − 32 + 128


def _q2_k(raw: np.ndarray) -> Blocks:
    """Q2_K (84 bytes: 16 scale bytes, low nibble the scale and high the minimum; 64 of 2-bit
    codes, bytes 0-31 and 32-63 each holding 4 sub-blocks at shifts 0, 2, 4, 6; d, dmin)."""
    n, nb = raw.shape[:2]
    q = _bits_of(raw[..., 16:80].reshape(n, nb, 2, 32), range(0, 8, 2), 0x03)
    sc = raw[..., :16]
    return Blocks(4, q.reshape(n, nb * 16, 16), _times(_half(raw, 80), sc & 0x0F),
                  -_times(_half(raw, 82), sc >> 4))


def _q3_k(raw: np.ndarray) -> Blocks:
    """Q3_K (110 bytes: 32 of high-bit masks, 64 of 2-bit codes laid out as Q2_K's, 12 of
    6-bit scales, d). q = low − 4 where the mask bit is 0, so −4..3."""
    n, nb = raw.shape[:2]
    low = _bits_of(raw[..., 32:96].reshape(n, nb, 2, 32), range(0, 8, 2), 0x03)
    mask = _bits_of(raw[..., :32], range(8), 1)  # (N, nb, 8, 32): bit j of byte i
    q = low.reshape(n, nb, 16, 16).astype(np.int8) - 4 * (1 - mask.reshape(n, nb, 16, 16))
    packed = raw[..., 96:108]
    sc = (_bits_of(packed[..., :8], range(0, 8, 4), 0x0F).reshape(n, nb, 16)
          | (_bits_of(packed[..., 8:], range(0, 8, 2), 0x03).reshape(n, nb, 16) << 4))
    scales = _times(_half(raw, 108), sc.astype(np.int8) - np.int8(32))
    return Blocks(4, (q + 8).astype(np.uint8).reshape(n, nb * 16, 16), scales, None)


def read_blocks(tensor: gguf.ReaderTensor) -> Blocks:
    """One tensor of a ``DIRECT`` type as blocks, rows in the file's order."""
    kind = tensor.tensor_type
    if kind not in DIRECT:
        raise ValueError(f"{tensor.name}: {kind.name} blocks are not kept (fallback type)")
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = np.asarray(tensor.data).reshape(rows, -1, size)  # (N, K/super-block, bytes)
    if kind == Q.Q8_0:
        return Blocks(8, raw[..., 2:] ^ np.uint8(0x80), _half(raw, 0), None)  # s + 128
    if kind in (Q.Q4_0, Q.Q4_1):
        nibbles = raw[..., 2:] if kind == Q.Q4_0 else raw[..., 4:]  # (N, K/32, 16)
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # elements 0-15, 16-31
        return Blocks(4, codes, _half(raw, 0), None if kind == Q.Q4_0 else _half(raw, 2))
    readers = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q6_K: _q6_k,
               Q.Q5_0: lambda r: _q5(r, False), Q.Q5_1: lambda r: _q5(r, True),
               Q.Q4_K: lambda r: _q4_k(r, False), Q.Q5_K: lambda r: _q4_k(r, True)}
    return readers[kind](raw)
