// The batched path of GgufMatMul (gguf_batched.cc): for M >= MinBatch(type) activation
// rows, a tile of weight rows is unpacked ONCE into uint8 codes with per-group float scales
// and mins, then dotted with every activation row by an int8 microkernel (several
// activation rows x several weight rows per inner step), instead of one ggml vec_dot per
// (row, row), each unpacking the blocks again. Q4_1 and Q5_1 have no ggml batched kernel
// on x86; ggml's engines for the others need a repacked copy of W, a GGML_LLAMAFILE build
// or ggml's graph (docs/kernels.md), and are not measured against this one yet.
//
// X is quantised by ggml's own from_float into the type's vec_dot_type (Q8_0, Q8_1, Q8_K),
// as on the vec_dot path, so the codes and scales are ggml's; only the float summation
// order differs (per lane group, where ggml sums per block / super-block).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ggml.h"

namespace attnserve_gguf {
namespace batched {


enum class Isa { kNone, kAvx2, kVnni };

// The best this CPU runs: VNNI (AVX-512 VNNI + VL + BW), AVX2 (+FMA, F16C), or none.
Isa DetectIsa();
const char* IsaName(Isa isa);

// Whether the batched path computes `type` with `isa` (k a multiple of the type's block).
bool Covers(ggml_type type, Isa isa);

// Activation rows from which the batched path beats ggml's vec_dot for `type` (measured,
// docs/kernels.md): 2 for Q4_0, Q4_1, Q5_0, Q5_1, whose vec_dot is slow; 3 for Q8_0 and
// the K-quants, where unpacking the tile costs about as much as a second vec_dot row.
int64_t MinBatch(ggml_type type);

// X quantised by ggml (M rows of the type's vec_dot_type), re-laid out for the kernels:
// K in "lane groups" of lane_k weights (32; 16 for Q6_K, its scales' granularity), padded
// with zeros to whole chunks of 8 groups (kp), and interleaved within a chunk so that one
// 256-bit integer dot accumulates group j in lane j (gguf_batched.cc; the AVX-512 VNNI
// kernels broadcast it to both halves of a 512-bit dot over a pair of weight rows).
struct Acts {
  int64_t m = 0;
  int64_t k = 0;
  int64_t kp = 0;            // K padded to whole chunks of 8 lane groups
  int64_t lane_k = 32;       // weights in a lane group
  int8_t* q = nullptr;       // (M, kp) codes, interleaved
  float* xs = nullptr;       // (M, kp / lane_k) each lane group's scale
  float* sx = nullptr;       // (M, kp / lane_k) its scaled sum (for the weights' mins)
  int32_t* negc = nullptr;   // (M, kp / lane_k) -offset · its sum (offset types)
};

// Bytes of the buffer Acts points into, for M rows of K of weight type `type`.
size_t ActsBytes(ggml_type type, int64_t m, int64_t k);
// Lay `m` rows out in `buffer` (64-byte aligned, ActsBytes long); rows filled by PrepareRow.
Acts ActsIn(ggml_type type, void* buffer, int64_t m, int64_t k);
// Row `i` of the kernel's X from row i of ggml's quantised X (`xq_row`, act_type layout).
void PrepareRow(Isa isa, ggml_type type, const uint8_t* xq_row, const Acts& acts, int64_t i);

// Y[:, r0:r1] for weight rows [r0, r1) of W (row_bytes apart): y is (M, ldy). `repacked`:
// W is Q4_0 in ggml's repack layout (gguf_repacked.h), r0 and r1 whole groups of 8 rows.
void DotRows(Isa isa, ggml_type type, const uint8_t* w, size_t row_bytes, int64_t r0,
             int64_t r1, const Acts& acts, float* y, int64_t ldy, bool repacked = false);

}  // namespace batched
}  // namespace attnserve_gguf
