// GgufMatMul's epilogue="swiglu": a gated feed-forward layer's activation applied to the
// product of its joined gate | up rows, in the op, where the graph had a Split, a Sigmoid
// (QuickGelu once ONNX Runtime fuses it) and two Muls after it: on the served SmolLM2 file
// at batch 1 those three nodes took 6 % of a decode step's kernels, on the 1B preset at batch
// 32 2.5-2.8 ms of about 80 (docs/kernels.md).
#pragma once

#include <cstdint>

#include "gguf_ops.h"  // ONNX Runtime's C++ API as the library includes it

namespace attnserve_gguf {
namespace epilogue {

// out[r, j] = silu(y[r, j]) · y[r, half + j] = y / (1 + e^−y) · up, for rows [r0, r1) of
// y (rows, 2·half) into out (rows, half): AVX-512 or AVX2 where the CPU has it, else plain
// C++.
void Swiglu(const float* y, int64_t half, int64_t r0, int64_t r1, float* out);

// Swiglu over all m rows on ONNX Runtime's pool: tasks of whole rows, about 16 K outputs
// each (SmolLM2's decode step of 32 rows: 4 tasks; one row: one task, run inline).
void Run(Ort::KernelContext& ctx, const float* products, int64_t m, int64_t half, float* y);

}  // namespace epilogue
}  // namespace attnserve_gguf
