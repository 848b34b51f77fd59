// What the GGUF custom ops share (service/ops/gguf_*.cc): the domain, errors returned to ONNX
// Runtime as statuses, attribute reading, type names. Each op's own file says what it computes;
// gguf_ops.cc registers them all.
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml.h"

namespace attnserve_gguf {

constexpr const char* kDomain = "attnserve.gguf";

// A Q4_K / Q5_K block's 12 bytes of packed 6-bit scales and mins as 16 bytes: the 8
// scales, then the 8 mins (ggml's unpacking of the block's utmp words). Scalar: the kernels
// of every instruction set call it.
inline void KQuantScalesAndMins(const uint8_t* packed, uint32_t out[4]) {
  std::memcpy(out, packed, 12);
  out[3] = ((out[2] >> 4) & 0x0f0f0f0f) | (((out[1] >> 6) & 0x03030303) << 4);
  const uint32_t mins_lo = out[1] & 0x3f3f3f3f;
  out[1] = (out[2] & 0x0f0f0f0f) | (((out[0] >> 6) & 0x03030303) << 4);
  out[2] = mins_lo;
  out[0] &= 0x3f3f3f3f;
}

// The AVX-512 VNNI kernels' target (gguf_batched.cc, gguf_rowdot.cc), pushed before them and
// popped after, with GCC or clang. GCC 12's AVX-512 headers fill a lane with
// _mm*_undefined_*() and warn about it (GCC bug 105593, fixed in 13): nothing of ours is
// uninitialised, so those two warnings are off inside.
#if defined(__clang__)
#define ATTNSERVE_BEGIN_AVX512_VNNI                                                          \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,avx512f,avx512vl,"  \
          "avx512bw,avx512vnni\"))), apply_to = function)")
#define ATTNSERVE_END_AVX512_VNNI _Pragma("clang attribute pop")
#else
#define ATTNSERVE_BEGIN_AVX512_VNNI                                        \
  _Pragma("GCC push_options")                                              \
  _Pragma("GCC target(\"avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni\")") \
  _Pragma("GCC diagnostic push")                                           \
  _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")                   \
  _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define ATTNSERVE_END_AVX512_VNNI _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#endif

// A bad input or attribute, raised inside an op and returned to ONNX Runtime as a status.
struct OpError : std::runtime_error {
  OrtErrorCode code;
  OpError(OrtErrorCode c, const std::string& what) : std::runtime_error(what), code(c) {}
};

// "<Op> node 'name': " (unnamed nodes: "<Op>: "), the prefix of every error.
inline std::string Where(const char* op, const std::string& node) {
  return std::string(op) + (node.empty() ? "" : " node '" + node + "'") + ": ";
}

// "12 (q4_K)", or "99 (no such type in this ggml)".
inline std::string TypeName(int64_t type_id) {
  const char* name = nullptr;
  if (type_id >= 0 && type_id < GGML_TYPE_COUNT) {
    name = ggml_get_type_traits(static_cast<ggml_type>(type_id))->type_name;
  }
  return std::to_string(type_id) + " (" + (name ? name : "no such type in this ggml") + ")";
}

inline std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A 64-byte aligned buffer that only grows, uninitialised: one per pool thread (kept
// thread_local by its users), so a task allocates nothing once warm, and a vector load of a
// row never straddles two cache lines (unaligned, the float tile kernels ran at half speed).
struct AlignedScratch {
  uint8_t* data = nullptr;
  size_t size = 0;
  AlignedScratch() = default;
  AlignedScratch(const AlignedScratch&) = delete;
  AlignedScratch& operator=(const AlignedScratch&) = delete;
  ~AlignedScratch() { std::free(data); }
  uint8_t* Get(size_t bytes) {
    if (bytes > size) {
      std::free(data);
      size = (bytes + 63) / 64 * 64;
      data = static_cast<uint8_t*>(std::aligned_alloc(64, size));
      if (data == nullptr) {
        size = 0;
        throw std::bad_alloc();
      }
    }
    return data;
  }
  template <class T>
  T* As(size_t count) {
    return reinterpret_cast<T*>(Get(count * sizeof(T)));
  }
};

// Run `body`, turning any exception into an OrtStatus: nothing may unwind into ORT.
// ONNX Runtime hands an op's shape inference a dimension with neither value nor name as the
// integer -1 and writes it back as the value -1, which ONNX's inference of later nodes takes
// as known (Slice asserts on it, Reshape refuses it). Each such dimension of an output gets a
// name of its own instead; ``names`` holds the strings until the shape is set.
inline void NameUnknownDims(Ort::ShapeInferContext::Shape& shape,
                            std::vector<std::string>& names) {
  static std::atomic<uint64_t> next{0};
  names.reserve(shape.size());  // no reallocation: the shape points into these strings
  for (auto& dim : shape) {
    if (dim.IsInt() && dim.AsInt() < 0) {
      names.push_back("gguf_dim_" + std::to_string(next++));
      dim = Ort::ShapeInferContext::SymbolicInteger(names.back().c_str());
    }
  }
}

template <typename Body>
OrtStatusPtr Guarded(const OrtApi& api, const char* op, Body&& body) noexcept {
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
    const std::string what = std::string(op) + ": unknown exception";
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, what.c_str());
  }
}

// A required int attribute, or an OpError naming the node and what the attribute means.
inline int64_t IntAttribute(const Ort::ConstKernelInfo& info, const char* op,
                            const std::string& node, const char* name, const char* meaning) {
  try {
    return info.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception& e) {
    throw OpError(ORT_INVALID_ARGUMENT, Where(op, node) + "needs an int attribute '" + name +
                                            "' (" + meaning + "): " + e.what());
  }
}

// The ops, each defined in its own file; static objects that outlive every session.
const OrtCustomOp* MatMulOp();
const OrtCustomOp* GatherOp();
const OrtCustomOp* AttentionOp();           // cached_attention.cc: a float32 cache
const OrtCustomOp* AttentionHalfCacheOp();  // ... and a float16 one
const OrtCustomOp* SwigluOp();     // gguf_epilogue.cc

}  // namespace attnserve_gguf
