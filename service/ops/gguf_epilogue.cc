// GgufMatMul's SwiGLU epilogue, and the same as an op of its own (Swiglu): see
// gguf_epilogue.h.

#include "gguf_epilogue.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_ops.h"

#include "vec_exp.h"

namespace attnserve_gguf {
namespace epilogue {
namespace {

// silu(g) = g · sigmoid(g) from t = e^−|g| (≤ 1, exact for either sign, never overflows):
// sigmoid(g) = 1 / (1 + t) for g ≥ 0, t / (1 + t) below.
inline float SiluScalar(float g) {
  const float t = std::exp(-std::fabs(g));
  return g * (g >= 0.0f ? 1.0f : t) / (1.0f + t);
}

// 1 / d for d in [1, 2]: the 14-bit estimate and one Newton step (relative error ~2^-28,
// below float32's rounding), 3 instructions where a division takes several cycles more.
__attribute__((target("avx2,fma,avx512f"))) inline __m512 Reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

__attribute__((target("avx2,fma,avx512f"))) void RowAvx512(const float* gate, const float* up,
                                                          int64_t half, float* out) {
  int64_t j = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; j + 16 <= half; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 t = ExpAvx512(_mm512_castsi512_ps(  // e^−|g|: the sign bit set
        _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
    const __m512 numerator = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), t, one);
    const __m512 silu =
        _mm512_mul_ps(_mm512_mul_ps(g, numerator), Reciprocal(_mm512_add_ps(one, t)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(silu, _mm512_loadu_ps(up + j)));
  }
  for (; j < half; ++j) out[j] = SiluScalar(gate[j]) * up[j];
}

__attribute__((target("avx2,fma"))) void RowAvx2(const float* gate, const float* up,
                                                 int64_t half, float* out) {
  int64_t j = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; j + 8 <= half; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 t = ExpAvx2(_mm256_or_ps(g, sign));  // e^−|g|
    const __m256 numerator =
        _mm256_blendv_ps(t, one, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 silu = _mm256_div_ps(_mm256_mul_ps(g, numerator), _mm256_add_ps(one, t));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
  }
  for (; j < half; ++j) out[j] = SiluScalar(gate[j]) * up[j];
}

void RowScalar(const float* gate, const float* up, int64_t half, float* out) {
  for (int64_t j = 0; j < half; ++j) out[j] = SiluScalar(gate[j]) * up[j];
}

using RowFn = void (*)(const float*, const float*, int64_t, float*);

RowFn RowHere() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return RowAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return RowAvx2;
  return RowScalar;
}

}  // namespace

void Swiglu(const float* y, int64_t half, int64_t r0, int64_t r1, float* out) {
  static const RowFn row = RowHere();
  for (int64_t r = r0; r < r1; ++r) {
    const float* gate = y + r * 2 * half;  // (rows, 2·half): gate | up
    row(gate, gate + half, half, out + r * half);
  }
}

namespace {

struct Job {
  const float* products;  // (m, 2·half): gate | up
  int64_t half;
  float* y;  // (m, half)
  int64_t m;
  int64_t rows_per_task;
};

int64_t RowsPerTask(int64_t m, int64_t half) {
  constexpr int64_t kOutputsPerTask = 16 * 1024;
  return std::clamp<int64_t>(kOutputsPerTask / std::max<int64_t>(half, 1), 1, m);
}

void SwigluBlock(void* data, size_t task) {
  const auto& job = *static_cast<const Job*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * job.rows_per_task;
  Swiglu(job.products, job.half, r0, std::min(job.m, r0 + job.rows_per_task), job.y);
}

}  // namespace

void Run(Ort::KernelContext& ctx, const float* products, int64_t m, int64_t half, float* y) {
  Job job{products, half, y, m, RowsPerTask(m, half)};
  const int64_t tasks = (m + job.rows_per_task - 1) / job.rows_per_task;
  if (tasks == 1) {
    SwigluBlock(&job, 0);
  } else {
    ctx.ParallelFor(SwigluBlock, static_cast<size_t>(tasks), 0, &job);
  }
}

}  // namespace epilogue

namespace {

constexpr const char* kSwigluOp = "Swiglu";

// Swiglu: X float32 [..., 2F] (gate | up) → Y [..., F] = silu(gate) · up, the arithmetic of
// GgufMatMul's epilogue, for the graphs that add to gate and up before the activation (the
// adapter graphs: LoRA updates), so that they compute what the fused graph computes.
struct SwigluKernel {
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) const {
    return Guarded(Ort::GetApi(), kSwigluOp, [&] { Compute(raw); });
  }

  void Compute(OrtKernelContext* raw) const {
    Ort::KernelContext ctx(raw);
    const Ort::ConstValue x = ctx.GetInput(0);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() % 2 != 0) {
      throw OpError(ORT_INVALID_ARGUMENT, Where(kSwigluOp, node) + "X has shape " +
                                              ShapeString(shape) +
                                              "; its last dimension must be gate | up, even");
    }
    std::vector<int64_t> y_shape(shape);
    y_shape.back() /= 2;
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    if (m == 0 || y_shape.back() == 0) return;
    epilogue::Run(ctx, x.GetTensorData<float>(), m, y_shape.back(),
                  y.GetTensorMutableData<float>());
  }
};

struct SwigluCustomOp : Ort::CustomOpBase<SwigluCustomOp, SwigluKernel, /*WithStatus=*/true> {
  const char* GetName() const { return kSwigluOp; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return Guarded(api, kSwigluOp, [&] {
      *kernel = new SwigluKernel{Ort::ConstKernelInfo(info).GetNodeName()};
    });
  }
};

}  // namespace

const OrtCustomOp* SwigluOp() {
  static SwigluCustomOp op;  // outlives every session: ORT keeps a pointer to it
  return &op;
}

}  // namespace attnserve_gguf
