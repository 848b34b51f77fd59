// GgufGather: an ONNX Runtime custom op looking rows up in a GGUF tensor's quantised bytes
// (an embedding table; a tied LM head shares the same W with GgufMatMul).
//
//   domain "attnserve.gguf", op "GgufGather"
//   inputs   ids int64 [...]               row numbers; negative ones count from the end
//                                           (ONNX Gather's rule): valid ids are [-N, N)
//            W   uint8 [N, row_bytes]      the tensor's rows as stored in the file
//                                           (row_bytes = ggml_row_size(ggml_type, K))
//   output   Y float32 [..., K]            Y[i] = row ids[i] of W, dequantised
//   attrs    ggml_type  int: the GGUF tensor type id (ggml's enum ggml_type)
//            k          int: K, the number of weights in a row
//
// Rows are dequantised with ggml's own `ggml_get_type_traits(type)->to_float` (the function
// llama.cpp's get_rows runs), so they equal ggml's values exactly; F32 rows, which have no
// to_float, are copied. Every type with a to_float is accepted. An id out of [-N, N) fails
// the run with a message naming the node, the id and its position, before anything is
// written. Many ids are shared out over ONNX Runtime's intra-op pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_ops.h"

namespace attnserve_gguf {
namespace {

constexpr const char* kOpName = "GgufGather";
// Fewer rows than this are dequantised inline: a pool dispatch costs more.
constexpr int64_t kParallelRows = 16;

// to_float of a type, or null where ggml has none (F32, which is copied instead, is
// handled by the caller).
ggml_to_float_t ToFloat(int64_t type_id) {
  if (type_id < 0 || type_id >= GGML_TYPE_COUNT) return nullptr;
  const ggml_type_traits* traits = ggml_get_type_traits(static_cast<ggml_type>(type_id));
  if (traits->blck_size <= 0) return nullptr;  // removed ids
  return traits->to_float;
}

bool Accepted(int64_t type_id) { return type_id == GGML_TYPE_F32 || ToFloat(type_id); }

std::string SupportedTypes() {
  std::string out;
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    if (!Accepted(t)) continue;
    if (!out.empty()) out += ", ";
    out += ggml_type_name(static_cast<ggml_type>(t));
    out += "=" + std::to_string(t);
  }
  return out;
}

struct RowFormat {
  ggml_type type;
  int64_t k;
  size_t row_bytes;
  ggml_to_float_t to_float;  // null: F32, copied
};

RowFormat ResolveFormat(const std::string& node, int64_t type_id, int64_t k) {
  const std::string where = Where(kOpName, node);
  if (!Accepted(type_id)) {
    throw OpError(ORT_INVALID_ARGUMENT,
                  where + "ggml_type " + TypeName(type_id) +
                      " has no dequantisation (to_float) in this ggml; supported: " +
                      SupportedTypes());
  }
  const auto type = static_cast<ggml_type>(type_id);
  if (k <= 0) {
    throw OpError(ORT_INVALID_ARGUMENT,
                  where + "attribute k must be positive, got " + std::to_string(k));
  }
  const int64_t block = ggml_blck_size(type);
  if (k % block != 0) {
    throw OpError(ORT_INVALID_ARGUMENT, where + "k=" + std::to_string(k) +
                                            " is not a multiple of the block size " +
                                            std::to_string(block) + " of ggml_type " +
                                            TypeName(type_id));
  }
  return RowFormat{type, k, ggml_row_size(type, k), ToFloat(type_id)};
}

struct GatherJob {
  const RowFormat* format;
  const int64_t* ids;  // already checked, made non-negative
  const uint8_t* w;    // (N, row_bytes)
  float* y;            // (count, K)
  int64_t count;
  int64_t rows_per_task;
};

void GatherRows(void* data, size_t task) {
  const auto& job = *static_cast<const GatherJob*>(data);
  const RowFormat& f = *job.format;
  const int64_t i0 = static_cast<int64_t>(task) * job.rows_per_task;
  const int64_t i1 = std::min(job.count, i0 + job.rows_per_task);
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* row = job.w + job.ids[i] * f.row_bytes;
    float* out = job.y + i * f.k;
    if (f.to_float) {
      f.to_float(row, out, f.k);
    } else {
      std::memcpy(out, row, f.row_bytes);
    }
  }
}

struct GgufGatherKernel {
  std::string node;
  RowFormat format;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) const {
    return Guarded(Ort::GetApi(), kOpName, [&] { Compute(raw); });
  }

  void Compute(OrtKernelContext* raw) const {
    Ort::KernelContext ctx(raw);
    const std::string where = Where(kOpName, node);
    const Ort::ConstValue ids = ctx.GetInput(0);
    const Ort::ConstValue w = ctx.GetInput(1);
    const std::vector<int64_t> ids_shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> w_shape = w.GetTensorTypeAndShapeInfo().GetShape();
    const RowFormat& f = format;
    if (w_shape.size() != 2 || w_shape[1] != static_cast<int64_t>(f.row_bytes)) {
      throw OpError(ORT_INVALID_ARGUMENT,
                    where + "W has shape " + ShapeString(w_shape) + "; ggml_type " +
                        TypeName(f.type) + " with k=" + std::to_string(f.k) +
                        " stores rows of ggml_row_size = " + std::to_string(f.row_bytes) +
                        " bytes, so W must be [N, " + std::to_string(f.row_bytes) + "]");
    }
    const int64_t n = w_shape[0];
    int64_t count = 1;
    for (int64_t d : ids_shape) count *= d;
    const int64_t* id_data = ids.GetTensorData<int64_t>();
    // Every id checked before anything is computed: the error names the first bad one.
    std::vector<int64_t> rows(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = id_data[i];
      if (id < -n || id >= n) {
        std::vector<int64_t> index(ids_shape.size());
        int64_t rest = i;
        for (size_t d = ids_shape.size(); d-- > 0;) {
          index[d] = rest % ids_shape[d];
          rest /= ids_shape[d];
        }
        throw OpError(ORT_INVALID_ARGUMENT,
                      where + "id " + std::to_string(id) + " at ids" + ShapeString(index) +
                          " is out of range [-" + std::to_string(n) + ", " +
                          std::to_string(n) + ") for W of " + std::to_string(n) + " rows");
      }
      rows[static_cast<size_t>(i)] = id < 0 ? id + n : id;
    }
    std::vector<int64_t> y_shape(ids_shape);
    y_shape.push_back(f.k);  // (..., K)
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    if (count == 0) return;
    GatherJob job{&f, rows.data(), w.GetTensorData<uint8_t>(), y.GetTensorMutableData<float>(),
                  count, 1};
    if (count < kParallelRows) {
      job.rows_per_task = count;
      GatherRows(&job, 0);
      return;
    }
    job.rows_per_task = 4;
    ctx.ParallelFor(GatherRows, static_cast<size_t>((count + 3) / 4), 0, &job);
  }
};

struct GgufGatherOp : Ort::CustomOpBase<GgufGatherOp, GgufGatherKernel, /*WithStatus=*/true> {
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }

  // Attributes are checked here, when the session is created, not at the first run.
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return Guarded(api, kOpName, [&] {
      Ort::ConstKernelInfo kinfo(info);
      const std::string node = kinfo.GetNodeName();
      const int64_t type_id =
          IntAttribute(kinfo, kOpName, node, "ggml_type", "the GGUF tensor type id");
      const int64_t k =
          IntAttribute(kinfo, kOpName, node, "k", "the number of weights in a row");
      *kernel = new GgufGatherKernel{node, ResolveFormat(node, type_id, k)};
    });
  }

  // Y's shape for the graph: ids' shape with K appended.
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    OrtStatusPtr status = nullptr;
    OrtStatusPtr guard = Guarded(Ort::GetApi(), kOpName, [&] {
      Ort::ShapeInferContext::Shape y(ctx.GetInputShape(0));
      if (y.empty()) return;  // rank unknown (or scalar ids): nothing to say
      int64_t k = 0;
      try {
        k = ctx.GetAttrInt("k");
      } catch (const Ort::Exception&) {
        return;  // no k: CreateKernelV2 reports it, naming the node
      }
      y.emplace_back(k);
      std::vector<std::string> names;
      NameUnknownDims(y, names);
      status = ctx.SetOutputShape(0, y).release();
    });
    return guard ? guard : status;
  }
};

}  // namespace

const OrtCustomOp* GatherOp() {
  static GgufGatherOp op;  // outlives every session: ORT keeps a pointer to it
  return &op;
}

}  // namespace attnserve_gguf
