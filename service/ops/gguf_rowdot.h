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
#pragma once

#include "ggml-cpu.h"
#include "ggml.h"

namespace attnserve_gguf {
namespace rowdot {

// Our row dot for `type` on this CPU, or nullptr where ggml's vec_dot stays.
ggml_vec_dot_t For(ggml_type type);

}  // namespace rowdot
}  // namespace attnserve_gguf
