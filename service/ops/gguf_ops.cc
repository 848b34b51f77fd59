// RegisterCustomOps: the entry point ONNX Runtime calls when a session loads this library.
// It registers every op of the domain "attnserve.gguf": GgufMatMul (gguf_matmul.cc),
// GgufGather (gguf_gather.cc), CachedAttention (cached_attention.cc; float32 and float16
// caches) and Swiglu
// (gguf_epilogue.cc).
// attnserve_gguf_ops_level: what the library understands, read by service.ops before it loads
// it (an older build ignores the attributes it does not know, or lacks an op).

#include <mutex>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "gguf_ops.h"

namespace {

std::mutex g_register_mutex;
// Domains handed to sessions. ORT does not own them and may read them for as long as a
// session lives, so they are never released (one small object per registration).
std::vector<OrtCustomOpDomain*> g_domains;

}  // namespace

// OPS_LEVEL of the sources this library was built from (build.py passes it).
extern "C" __attribute__((visibility("default"))) int attnserve_gguf_ops_level() {
  return ATTNSERVE_GGUF_OPS_LEVEL;
}

// Called by SessionOptions.register_custom_ops_library (Python) or RegisterCustomOpsLibrary.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // A runtime older than these headers: report it through the oldest API there is.
    const OrtApi* oldest = api_base->GetApi(1);
    const std::string msg = std::string("the attnserve.gguf ops (GgufMatMul, GgufGather) need "
                                        "ONNX Runtime API version ") +
                            std::to_string(ORT_API_VERSION) + " (1." +
                            std::to_string(ORT_API_VERSION) + ") or newer; this runtime is " +
                            api_base->GetVersionString();
    return oldest ? oldest->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  return attnserve_gguf::Guarded(*api, "RegisterCustomOps", [&] {
    static std::once_flag cpu_init;
    // fp16 tables and CPU feature detection that the dot products rely on.
    std::call_once(cpu_init, [] { ggml_cpu_init(); });
    std::lock_guard<std::mutex> lock(g_register_mutex);
    Ort::CustomOpDomain domain(attnserve_gguf::kDomain);
    domain.Add(attnserve_gguf::MatMulOp());
    domain.Add(attnserve_gguf::GatherOp());
    domain.Add(attnserve_gguf::AttentionOp());
    domain.Add(attnserve_gguf::AttentionHalfCacheOp());
    domain.Add(attnserve_gguf::SwigluOp());
    Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
    g_domains.push_back(domain.release());
  });
}
