// One weight row against one activation row, ours where ggml's vec_dot was measured far
// from the memory bound: Q4_K and Q6_K against Q8_K on AVX-512 (BW + VNNI) CPUs, below the
// batched kernels' threshold (M = 1, 2). ggml's vec_dot for these types has AVX2 code
// only and prefetches nothing; on a 2-core Xeon the 1B Q4_K_M preset decoded at batch 1 at
// 19-20 tok/s over it (about 50 % of the read bandwidth's bound), 24-25 with rows
// prefetched ahead of it (GgufMatMul's DotBlock), 30 over these (78-82 %; docs/kernels.md,
// "Batch 1 on AVX-512"). They take 64 weights an instruction and prefetch 32 blocks ahead.
//
// Same signature and result as ggml's vec_dot for the type (ggml_vec_dot_t, nrc = 1): the
// integer sums of each sub-block are the same; the float summation order differs (16 lanes
// here, 8 in ggml's AVX2 code), so a result agrees with ggml's to float32 accumulation.
//
// And a gemv of ours over Q4_0 in ggml's repack layout (gguf_repacked.h: groups of 8 rows
// interleaved, nibbles XOR 0x88) on the same CPUs, in ggml_gemv_q4_0_8x8_q8_0's place: ggml's
// is 256-bit code that prefetches nothing, and the served 3B Q4_0 file decoded at batch 1 at
// 55-65 % of the bound over it, 1.00x llama.cpp; over ours at 99-103 %, 1.59-1.61x (the 1B
// file 97 %, 1.86x; docs/kernels.md, "Our gemv over Q4_0's layout on AVX-512 VNNI"). Same
// integer sums per block as ggml's; up to 8 activation rows in one pass over W, and over
// W in cache two groups at a time (the activation codes broadcast once for 16 weight rows).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ggml-cpu.h"
#include "ggml.h"

namespace attnserve_gguf {
namespace rowdot {

// Our row dot for `type` on this CPU, or nullptr where ggml's vec_dot stays.
ggml_vec_dot_t For(ggml_type type);

// What our gemv takes of each Q8_0 block of X beside its codes (Q8_0Terms): -8 · the sum of
// its codes (the file's codes q are w + 8) and its scale as a float.
struct Q8_0Term {
  int32_t offset;
  float scale;
};

// Y[i, 8g + r] = W's row 8g + r · X's row i, for `groups` groups of 8 rows in the repack
// layout at w and m ≤ 8 rows of X as Q8_0 (xq, xq_bytes apart), terms their Q8_0Terms (m,
// k / 32); Y's rows y_stride floats apart. w_cached: these rows of W were read by the
// call before (the second pass of 8 activation rows and on), so two groups are taken at a
// time; from memory one is (one stream the prefetcher keeps ahead of).
using RepackedGemv = void (*)(int k, const uint8_t* w, int64_t groups, const uint8_t* xq,
                              size_t xq_bytes, int64_t m, const Q8_0Term* terms, float* y,
                              size_t y_stride, bool w_cached);
// Our gemv for `type` in the repack layout on this CPU (Q4_0 on AVX-512 VNNI), or nullptr.
RepackedGemv RepackedFor(ggml_type type);
// Each block's Q8_0Term in a Q8_0 row of k values: (k / 32,); where RepackedFor gives a
// gemv (it needs the same CPU).
void Q8_0Terms(const uint8_t* xq, int k, Q8_0Term* terms);

}  // namespace rowdot
}  // namespace attnserve_gguf
