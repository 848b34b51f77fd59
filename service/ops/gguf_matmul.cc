// GgufMatMul: an ONNX Runtime custom op computing Y = X·Wᵀ straight over a GGUF tensor's
// quantised bytes with ggml's CPU dot products (the kernels llama.cpp runs).
//
//   domain "attnserve.gguf", op "GgufMatMul"
//   inputs   X float32 [..., K]          activations
//            W uint8   [N, row_bytes]    the tensor's rows as stored in the file
//                                        (row_bytes = ggml_row_size(ggml_type, K))
//   output   Y float32 [..., N]
//   attrs    ggml_type  int: the GGUF tensor type id (ggml's enum ggml_type)
//            k          int: K, the number of weights in a row
//
// Every type whose ggml-cpu traits have a vec_dot, and a from_float for its vec_dot_type,
// is accepted (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types, ...); the list is
// read from ggml at run time, so a newer ggml brings its new types along. W is never
// expanded to floats: each row is dotted as stored. X is quantised once per call, row by
// row, into the vec_dot_type (Q8_0, Q8_1 or Q8_K for the quantised types; F16/BF16/F32 for
// the float ones), as ggml's mul_mat does on its vec_dot path (llama.cpp's repacked and
// llamafile-sgemm paths compute batches with other kernels).
//
// Threads: the N weight rows are split across ONNX Runtime's intra-op pool
// (KernelContext_ParallelFor); ggml's own threadpool is never started, so one pool spins.
// Built by service/ops/build.py against Debian's libonnxruntime-dev 1.21 headers (API 21,
// served by newer runtimes) and the ggml of the pinned llama-cpp-python sdist.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr const char* kDomain = "attnserve.gguf";
constexpr const char* kOpName = "GgufMatMul";
// Weight rows one task dots with every activation row while they sit in L1/L2: the
// matrix is streamed from memory once per call, whatever the batch (a decode step of 32
// rows must not read it 32 times). A whole number of 64-byte lines of Y (16 floats) a
// block, so that two threads do not write into one line of Y.
constexpr size_t kBlockBytes = 32 * 1024;
constexpr int64_t kYLine = 64 / sizeof(float);
constexpr int64_t kMaxBlockRows = 64;
// Fewer activation rows than this are quantised inline: a pool dispatch costs more.
constexpr int64_t kParallelQuantiseRows = 4;

// A bad input or attribute, raised inside the op and returned to ONNX Runtime as a status.
struct OpError : std::runtime_error {
  OrtErrorCode code;
  OpError(OrtErrorCode c, const std::string& what) : std::runtime_error(what), code(c) {}
};

// "GgufMatMul node 'name': " (unnamed nodes: "GgufMatMul: "), the prefix of every error.
std::string Where(const std::string& node) {
  return std::string(kOpName) + (node.empty() ? "" : " node '" + node + "'") + ": ";
}

std::string TypeName(int64_t type_id) {
  const char* name = nullptr;
  if (type_id >= 0 && type_id < GGML_TYPE_COUNT) {
    name = ggml_get_type_traits(static_cast<ggml_type>(type_id))->type_name;
  }
  return std::to_string(type_id) + " (" + (name ? name : "no such type in this ggml") + ")";
}

// The ggml-cpu functions for one weight type, or null where ggml cannot compute it.
struct CpuKernels {
  ggml_vec_dot_t vec_dot = nullptr;
  ggml_type act_type = GGML_TYPE_COUNT;
  ggml_from_float_t act_from_float = nullptr;
};

CpuKernels KernelsFor(int64_t type_id) {
  CpuKernels out;
  if (type_id < 0 || type_id >= GGML_TYPE_COUNT) return out;
  const auto type = static_cast<ggml_type>(type_id);
  // Removed ids (4, 5, 31-33, 36-38) have empty traits: a zero block size.
  if (ggml_get_type_traits(type)->blck_size <= 0) return out;
  const ggml_type_traits_cpu* cpu = ggml_get_type_traits_cpu(type);
  if (cpu == nullptr || cpu->vec_dot == nullptr) return out;
  const ggml_type_traits_cpu* act = ggml_get_type_traits_cpu(cpu->vec_dot_type);
  if (act == nullptr || act->from_float == nullptr) return out;
  out.vec_dot = cpu->vec_dot;
  out.act_type = cpu->vec_dot_type;
  out.act_from_float = act->from_float;
  return out;
}

std::string SupportedTypes() {
  std::string out;
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    if (KernelsFor(t).vec_dot == nullptr) continue;
    if (!out.empty()) out += ", ";
    out += ggml_type_name(static_cast<ggml_type>(t));
    out += "=" + std::to_string(t);
  }
  return out;
}

// What a node's attributes fix: the weight layout and the kernels that read it.
struct WeightFormat {
  ggml_type type;
  int64_t k;
  size_t row_bytes;      // bytes of one W row: ggml_row_size(type, k)
  ggml_type act_type;    // what X rows are quantised into
  size_t act_row_bytes;  // bytes of one quantised X row
  ggml_vec_dot_t vec_dot;
  ggml_from_float_t act_from_float;
};

WeightFormat ResolveFormat(const std::string& node, int64_t type_id, int64_t k) {
  const std::string where = Where(node);
  const CpuKernels kernels = KernelsFor(type_id);
  if (kernels.vec_dot == nullptr) {
    throw OpError(ORT_INVALID_ARGUMENT,
                  where + "ggml_type " + TypeName(type_id) +
                      " has no CPU dot product in this ggml; supported: " + SupportedTypes());
  }
  const auto type = static_cast<ggml_type>(type_id);
  if (k <= 0) {
    throw OpError(ORT_INVALID_ARGUMENT, where + "attribute k must be positive, got " +
                                            std::to_string(k));
  }
  // ggml_row_size is only defined on whole blocks; the activation type's block must
  // divide K too (it always divides the weight block for the types ggml ships).
  const int64_t block = ggml_blck_size(type);
  const int64_t act_block = ggml_blck_size(kernels.act_type);
  if (k % block != 0 || k % act_block != 0) {
    throw OpError(ORT_INVALID_ARGUMENT,
                  where + "k=" + std::to_string(k) + " is not a multiple of the block size " +
                      std::to_string(std::max(block, act_block)) + " of ggml_type " +
                      TypeName(type_id) + " (activations as " +
                      ggml_type_name(kernels.act_type) + ")");
  }
  return WeightFormat{type,
                      k,
                      ggml_row_size(type, k),
                      kernels.act_type,
                      ggml_row_size(kernels.act_type, k),
                      kernels.vec_dot,
                      kernels.act_from_float};
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// One ParallelFor task: quantise one activation row into the vec_dot_type.
struct QuantiseJob {
  const WeightFormat* format;
  const float* x;  // (M, K)
  uint8_t* xq;     // (M, act_row_bytes)
};

void QuantiseRow(void* data, size_t row) {
  const auto& job = *static_cast<const QuantiseJob*>(data);
  const WeightFormat& f = *job.format;
  f.act_from_float(job.x + row * f.k, job.xq + row * f.act_row_bytes, f.k);
}

// One ParallelFor task: a block of weight rows against every activation row.
struct DotJob {
  const WeightFormat* format;
  const uint8_t* w;     // (N, row_bytes)
  const uint8_t* acts;  // (M, act_row_bytes)
  float* y;             // (M, N)
  int64_t m;
  int64_t n;
  int64_t block_rows;
};

void DotBlock(void* data, size_t block) {
  const auto& job = *static_cast<const DotJob*>(data);
  const WeightFormat& f = *job.format;
  const int k = static_cast<int>(f.k);
  const int64_t n0 = static_cast<int64_t>(block) * job.block_rows;
  const int64_t n1 = std::min(job.n, n0 + job.block_rows);
  // Activation rows inner: the block's weight rows are read from memory once and then
  // dotted from cache with every row of X. nrc=1: the two-row kernels exist on ARM only.
  float sums[kMaxBlockRows];
  for (int64_t i = 0; i < job.m; ++i) {
    const uint8_t* a = job.acts + i * f.act_row_bytes;
    for (int64_t r = n0; r < n1; ++r) {
      f.vec_dot(k, sums + (r - n0), 0, job.w + r * f.row_bytes, 0, a, 0, 1);
    }
    std::copy(sums, sums + (n1 - n0), job.y + i * job.n + n0);  // Y[i, n0:n1], one burst
  }
}

// Run `body`, turning any exception into an OrtStatus: nothing may unwind into ORT.
template <typename Body>
OrtStatusPtr Guarded(const OrtApi& api, Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const OpError& e) {
    return api.CreateStatus(e.code, e.what());
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, e.what());
  } catch (...) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, "GgufMatMul: unknown exception");
  }
}

struct GgufMatMulKernel {
  std::string node;
  WeightFormat format;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) const {
    return Guarded(Ort::GetApi(), [&] { Compute(raw); });
  }

  void Compute(OrtKernelContext* raw) const {
    Ort::KernelContext ctx(raw);
    const std::string where = Where(node);
    const Ort::ConstValue x = ctx.GetInput(0);
    const Ort::ConstValue w = ctx.GetInput(1);
    const std::vector<int64_t> x_shape = x.GetTensorTypeAndShapeInfo().GetShape();  // (.., K)
    const std::vector<int64_t> w_shape = w.GetTensorTypeAndShapeInfo().GetShape();  // (N, rb)
    const WeightFormat& f = format;

    if (x_shape.empty() || x_shape.back() != f.k) {
      throw OpError(ORT_INVALID_ARGUMENT, where + "X has shape " + ShapeString(x_shape) +
                                              "; its last dimension must be k=" +
                                              std::to_string(f.k));
    }
    if (w_shape.size() != 2 || w_shape[1] != static_cast<int64_t>(f.row_bytes)) {
      throw OpError(ORT_INVALID_ARGUMENT,
                    where + "W has shape " + ShapeString(w_shape) + "; ggml_type " +
                        TypeName(f.type) + " with k=" + std::to_string(f.k) +
                        " stores rows of ggml_row_size = " + std::to_string(f.row_bytes) +
                        " bytes, so W must be [N, " + std::to_string(f.row_bytes) + "]");
    }
    const int64_t n = w_shape[0];
    int64_t m = 1;
    for (size_t i = 0; i + 1 < x_shape.size(); ++i) m *= x_shape[i];
    std::vector<int64_t> y_shape(x_shape);
    y_shape.back() = n;  // (..., N)
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    if (m == 0 || n == 0) return;
    float* y_data = y.GetTensorMutableData<float>();  // (M, N)
    const float* x_data = x.GetTensorData<float>();   // (M, K)
    const uint8_t* w_data = w.GetTensorData<uint8_t>();

    // X in the vec_dot_type, once per call; F32 weights dot float rows as they are.
    std::unique_ptr<uint8_t, FreeDeleter> quantised;
    const uint8_t* acts = reinterpret_cast<const uint8_t*>(x_data);
    if (f.act_type != GGML_TYPE_F32) {
      const size_t bytes = static_cast<size_t>(m) * f.act_row_bytes;  // (M, act_row_bytes)
      quantised.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
      if (!quantised) throw OpError(ORT_FAIL, where + "out of memory for the quantised X");
      QuantiseJob qjob{&f, x_data, quantised.get()};
      if (m < kParallelQuantiseRows) {
        for (int64_t i = 0; i < m; ++i) QuantiseRow(&qjob, static_cast<size_t>(i));
      } else {
        ctx.ParallelFor(QuantiseRow, static_cast<size_t>(m), 0, &qjob);
      }
      acts = quantised.get();
    }

    const int64_t fit = static_cast<int64_t>(kBlockBytes / f.row_bytes) / kYLine * kYLine;
    const int64_t block_rows = std::clamp<int64_t>(fit, kYLine, kMaxBlockRows);
    DotJob job{&f, w_data, acts, y_data, m, n, block_rows};
    const size_t blocks = static_cast<size_t>((n + block_rows - 1) / block_rows);
    // num_batch 0: one task per block, handed out dynamically, so a thread slowed by
    // other load takes fewer blocks.
    ctx.ParallelFor(DotBlock, blocks, 0, &job);
  }
};

int64_t IntAttribute(const Ort::ConstKernelInfo& info, const std::string& node, const char* name,
                     const char* meaning) {
  try {
    return info.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception& e) {
    throw OpError(ORT_INVALID_ARGUMENT, Where(node) + "needs an int attribute '" + name +
                                            "' (" + meaning + "): " + e.what());
  }
}

struct GgufMatMulOp : Ort::CustomOpBase<GgufMatMulOp, GgufMatMulKernel, /*WithStatus=*/true> {
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }

  // Attributes are checked here, when the session is created, not at the first run.
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return Guarded(api, [&] {
      Ort::ConstKernelInfo kinfo(info);
      const std::string node = kinfo.GetNodeName();
      const int64_t type_id = IntAttribute(kinfo, node, "ggml_type", "the GGUF tensor type id");
      const int64_t k = IntAttribute(kinfo, node, "k", "the number of weights in a row");
      *kernel = new GgufMatMulKernel{node, ResolveFormat(node, type_id, k)};
    });
  }

  // Y's shape for the graph: X's with the last dimension replaced by W's first. Mismatches
  // are left to Compute, which names them with the node.
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    OrtStatusPtr status = nullptr;
    OrtStatusPtr guard = Guarded(Ort::GetApi(), [&] {
      const Ort::ShapeInferContext::Shape& x = ctx.GetInputShape(0);
      const Ort::ShapeInferContext::Shape& w = ctx.GetInputShape(1);
      if (x.empty() || w.size() != 2) return;  // rank unknown: nothing to say
      Ort::ShapeInferContext::Shape y(x);
      y.back() = w[0];
      status = ctx.SetOutputShape(0, y).release();
    });
    return guard ? guard : status;
  }
};

std::mutex g_register_mutex;
// Domains handed to sessions. ORT does not own them and may read them for as long as a
// session lives, so they are never released (one small object per registration).
std::vector<OrtCustomOpDomain*> g_domains;

}  // namespace

// Called by SessionOptions.register_custom_ops_library (Python) or RegisterCustomOpsLibrary.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // A runtime older than these headers: report it through the oldest API there is.
    const OrtApi* oldest = api_base->GetApi(1);
    const std::string msg = std::string("GgufMatMul needs ONNX Runtime API version ") +
                            std::to_string(ORT_API_VERSION) + " (1." +
                            std::to_string(ORT_API_VERSION) + ") or newer; this runtime is " +
                            api_base->GetVersionString();
    return oldest ? oldest->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  return Guarded(*api, [&] {
    static std::once_flag cpu_init;
    // fp16 tables and CPU feature detection that the dot products rely on.
    std::call_once(cpu_init, [] { ggml_cpu_init(); });
    static GgufMatMulOp op;  // outlives every session: ORT keeps a pointer to it
    std::lock_guard<std::mutex> lock(g_register_mutex);
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(&op);
    Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
    g_domains.push_back(domain.release());
  });
}
