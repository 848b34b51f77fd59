// Weights in ggml's CPU "repack" layout (gguf_repacked.cc): groups of 8 rows interleaved
// 8 bytes at a time (ggml's block_q4_0x8, block_iq4_nlx8), the layout llama.cpp's CPU
// backend loads Q4_0 and IQ4_NL into on x86 with AVX2, so that its gemv / gemm read 8 rows
// in one stream. Same bytes and size as the file's rows; written once by the export with
// ggml's own repack (Repack, the CPU_REPACK buffer type), computed by ggml's own
// ggml_gemv_* / ggml_gemm_* (layout="repacked_8x8" on a GgufMatMul node; Q4_0's gemv rows by
// ours on AVX-512 VNNI CPUs, gguf_rowdot.h).
//
// Why: at one activation row ggml's per-row Q4_0 vec_dot streams the weights at about 80 %
// of what the gemv over this layout reaches (docs/kernels.md, measured); for Q4_K the two
// are within a few percent and our batched kernels beat ggml's gemm at 8 rows and more, so
// Q4_K stays in the file's rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ggml.h"

namespace attnserve_gguf {
namespace repacked {

constexpr const char* kLayout = "repacked_8x8";  // the attribute value
constexpr int64_t kGroupRows = 8;                // rows interleaved in one group

// Whether this op computes `type` from the layout (Q4_0, IQ4_NL).
bool Covers(ggml_type type);

// ggml's kernels for a covered type: X rows quantised plainly for gemv, four at a time
// interleaved (quantize_mat) for gemm.
struct Kernels {
  void (*gemv)(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
  void (*gemm)(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
  void (*quantize_mat4)(const float* x, void* vy, int64_t k);  // 4 rows of X, interleaved
  ggml_from_float_t from_float;                                // one row of X
  ggml_type act_type;                                          // Q8_0
};
Kernels KernelsFor(ggml_type type);  // type must be covered

// n rows of k weights (n a multiple of 8), as the file stores them, into `out` in the
// layout, by ggml's own repack; then checked by unpacking every group back. Returns "" or
// why not (type not covered, n not a multiple of 8, ggml declining or laying it out
// otherwise on this CPU).
std::string Repack(ggml_type type, int64_t k, int64_t n, const uint8_t* rows, uint8_t* out);

// One group of 8 rows in the layout back into the file's rows (8, row_bytes): what the
// float-activation path dequantises.
void Unpack(ggml_type type, int64_t k, const uint8_t* group, uint8_t* rows);

}  // namespace repacked
}  // namespace attnserve_gguf
