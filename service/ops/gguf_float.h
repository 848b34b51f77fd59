// The float-activation path of GgufMatMul (gguf_float.cc): Y = X·Wᵀ with X kept in float32
// and each weight row dequantised by ggml's own to_float (the values gguf.quants.dequantize
// and transformers' GGUF loader give), so a graph over the file's bytes computes what the
// float32 model computes, up to summation order. ggml has no float-activation kernel for
// its quantised types (its mul_mat always quantises X into the vec_dot_type), and ONNX
// Runtime's MatMulNBits at accuracy level 0 dequantises 8-bit codes whole on every call
// (docs/export.md, "Accuracy level"); so the product of the dequantised tile is ours.
//
// Per task, each weight row is read from memory once per call, whatever M, and dotted with
// every row of X: decoded in registers for the common types, else dequantised into a
// scratch tile (gguf_float.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ggml.h"

namespace attnserve_gguf {
namespace floatpath {

// Whether ggml can dequantise `type` (a to_float, or F32 rows read as they are).
bool Covers(ggml_type type);

// The kernels a call runs: plain C++ over ggml's to_float (generic), our decoders and AVX2
// + FMA products (avx2), the same with AVX-512 products over the dequantised tiles (avx512).
enum class Level { kGeneric, kAvx2, kAvx512 };
Level DetectLevel();  // the widest this CPU runs
const char* LevelName(Level level);

// The activations of one call: X (M, K) float32 and, for the types whose weights have a
// min per group of 32 decoded in registers (NeedsGroupSums: the type, and M small enough),
// each group's Σ x (M, K / 32), else null.
struct Acts {
  const float* x = nullptr;
  int64_t m = 0;
  int64_t k = 0;
  const float* group_sums = nullptr;
};
bool NeedsGroupSums(ggml_type type, Level level, int64_t m);
void GroupSums(const float* x, int64_t m, int64_t k, float* sums);  // sums (M, K / 32)

// Weight rows a task should take (a multiple of 16: whole 64-byte lines of Y) for M rows
// of K: 16 for a decode step, more for a prompt's rows, since every task streams all of X
// through the cache once.
int64_t TaskRows(Level level, int64_t m, int64_t k);

// Y[:, r0:r1] = X · dequantise(W[r0:r1])ᵀ: w the rows as stored (row_bytes apart), y is
// (M, ldy).
void DotRows(ggml_type type, Level level, const uint8_t* w, size_t row_bytes, int64_t r0,
             int64_t r1, const Acts& acts, float* y, int64_t ldy);

}  // namespace floatpath
}  // namespace attnserve_gguf
