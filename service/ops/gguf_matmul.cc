// GgufMatMul: an ONNX Runtime custom op computing Y = X·Wᵀ straight over a GGUF tensor's
// quantised bytes with ggml's CPU dot products (the kernels llama.cpp runs).
//
//   domain "attnserve.gguf", op "GgufMatMul"
//   inputs   X float32 [..., K]          activations
//            W uint8   [N, row_bytes]    the tensor's rows as stored in the file
//                                        (row_bytes = ggml_row_size(ggml_type, K))
//   output   Y float32 [..., N]
//   attrs    ggml_type    int: the GGUF tensor type id (ggml's enum ggml_type)
//            k            int: K, the number of weights in a row
//            activations  string, optional: "int8" (the default: X quantised as ggml's
//                         mul_mat quantises it) or "float" (X kept in float32, each
//                         weight row dequantised by ggml: the float32 model's arithmetic,
//                         gguf_float.h)
//            epilogue     string, optional: "" (the default) or "swiglu": W's rows are
//                         gate | up (N even) and Y [..., N / 2] = silu(gate) · up
//                         (gguf_epilogue.h)
//
// Every type whose ggml-cpu traits have a vec_dot, and a from_float for its vec_dot_type,
// is accepted (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types, ...); the list is
// read from ggml at run time, so a newer ggml brings its new types along. W is never
// expanded to floats: each row is dotted as stored. X is quantised once per call, row by
// row, into the vec_dot_type (Q8_0, Q8_1 or Q8_K for the quantised types; F16/BF16/F32 for
// the float ones), as ggml's mul_mat does on its vec_dot path.
//
// Batches: for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, from 2 or 3 rows
// (batched::MinBatch), each tile of weight rows is unpacked once and dotted with every row
// of X by our int8 kernels (gguf_batched.cc: AVX-512 VNNI or AVX2, chosen at run time); at
// M = 1, for every other type, and on CPUs without AVX2, one ggml vec_dot per pair of rows
// (for Q4_K and Q6_K on AVX-512 VNNI CPUs, our row dot in its place: gguf_rowdot.h).
// layout="repacked_8x8" (Q4_0, IQ4_NL in ggml's repack layout, gguf_repacked.h): ggml's
// gemv / gemm, our gemv for Q4_0 on AVX-512 VNNI CPUs, our batched kernels (ComputeRepacked).
// ATTNSERVE_GGUF_MATMUL_PATH (auto, vec_dot, avx2, avx512vnni) overrides the choice when a
// session is created (tests, benchmarks).
//
// "float": every type ggml can dequantise (a to_float), from M = 1; see gguf_float.h. The
// variable chooses its kernels too (ChooseFloatPath).
//
// Threads: the N weight rows are split across ONNX Runtime's intra-op pool
// (KernelContext_ParallelFor); ggml's own threadpool is never started, so one pool spins.
// Built by service/ops/build.py against Debian's libonnxruntime-dev 1.21 headers (API 21,
// served by newer runtimes) and the ggml of the pinned llama-cpp-python sdist; registered
// with GgufGather by gguf_ops.cc.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf_batched.h"
#include "gguf_epilogue.h"
#include "gguf_float.h"
#include "gguf_rowdot.h"
#include "gguf_ops.h"
#include "gguf_repacked.h"

namespace attnserve_gguf {
namespace {

constexpr const char* kOpName = "GgufMatMul";
// Weight rows one task dots with every activation row while they sit in L1/L2: the
// matrix is streamed from memory once per call, whatever the batch (a decode step of 32
// rows must not read it 32 times). A whole number of 64-byte lines of Y (16 floats) a
// block, so that two threads do not write into one line of Y.
constexpr size_t kBlockBytes = 32 * 1024;
constexpr int64_t kYLine = 64 / sizeof(float);
constexpr int64_t kMaxBlockRows = 64;
// Weight rows a task takes on the vec_dot and repacked paths: about kBlockBytes of W, whole
// 64-byte lines of Y (so whole groups of a repacked W).
int64_t BlockRows(size_t row_bytes) {
  const int64_t fit = static_cast<int64_t>(kBlockBytes / row_bytes) / kYLine * kYLine;
  return std::clamp<int64_t>(fit, kYLine, kMaxBlockRows);
}
// Fewer activation rows than this are quantised inline: a pool dispatch costs more.
constexpr int64_t kParallelQuantiseRows = 4;
// Weight rows a task of the batched path unpacks and computes (whole 64-byte lines of Y,
// whole groups of a repacked W).
constexpr int64_t kBatchedRows = 16;
// A repacked W goes to a gemv / gemm where one call reads W once and is faster than our
// batched kernels: ggml's gemv at one activation row; its gemm at four (it takes rows 4 at a
// time and each row left over by another gemv, another pass over W) where ggml was built
// with AVX-512, for which its gemm has a path of its own. Every other M goes to our batched
// kernels, reading the layout in place. Q4_0 (docs/kernels.md): at 4096 x 4096, one
// thread, CPU ms, AVX-512 EPYC: 0.60 against 1.11 over the rows at M = 1, gemm 0.98 against
// 1.32 at 4, gemm + 2 gemv 2.28 against ours 1.66 at 6; at 16384 x 3072, 2 threads, cold,
// AVX2-only EPYC: gemv 3.60 against 4.23, gemm 13.72 against ours over the rows 10.43.
// Where the CPU has AVX-512 VNNI our Q4_0 gemv (gguf_rowdot.h) takes every M up to
// kOurGemvMaxRows (a decode step's batch, a mixed step's rows; ggml's gemm none), 8
// activation rows a pass over a task's rows of W, which stay in cache between passes. On
// the Xeon at 8192 x 8192 (one thread's CPU ms, cold): 2.1-3.0 against ggml's gemv's 5.2-5.9
// at M = 1, 2.5-3.7 against the batched kernels' 7.2-8.2 at 2-3, 3.2-3.6 against ggml's
// gemm's 5.9-6.3 at 4, 4.0-4.1 against gemm + ours 7.6-8.0 at 6, 5.4-5.5 against the
// batched kernels' 8.9-10.6 at 8. On a Zen 5 EPYC, the passes after the first over two
// groups of W at a time (gguf_rowdot.cc), against the batched kernels: 7.1-7.3 / 12.0-12.3
// at 32, 13.8-14.9 / 21.0-21.2 at 64, 28.2-29.6 / 38.3 at 128. Above 128 rows (a prefill
// chunk) X's codes outgrow a core's L2 and are read again for every task's rows of W: the
// batched kernels there, unmeasured against ours (docs/kernels.md).
constexpr int64_t kOurGemvRows = 8;      // activation rows a pass of our gemv
constexpr int64_t kOurGemvMaxRows = 128;  // activation rows a call of it takes at most
bool GemvOrGemmTakes(int64_t m, bool our_gemv) {
  static const bool gemm_avx512 = ggml_cpu_has_avx512() != 0;
  if (our_gemv) return m <= kOurGemvMaxRows;
  return m == 1 || (m == 4 && gemm_avx512);
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
  bool float_activations = false;  // X kept in float32, W dequantised (gguf_float.h)
  bool repacked = false;           // W in ggml's repack layout (gguf_repacked.h)
};

// The node's "layout" attribute: false for "rows" (or none: the file's rows), true for
// "repacked_8x8" (ggml's CPU repack layout, gguf_repacked.h), for the types it covers.
bool Repacked(const Ort::ConstKernelInfo& info, const std::string& node, int64_t type_id) {
  std::string value;
  try {
    value = info.GetAttribute<std::string>("layout");
  } catch (const Ort::Exception&) {
    return false;
  }
  if (value == "rows") return false;
  if (value != repacked::kLayout) {
    throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) + "attribute layout='" + value +
                                            "' is neither 'rows' nor '" + repacked::kLayout +
                                            "'");
  }
  const bool known = type_id >= 0 && type_id < GGML_TYPE_COUNT;
  if (!known || !repacked::Covers(static_cast<ggml_type>(type_id))) {
    throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) + "layout='" + repacked::kLayout +
                                            "' holds q4_0 or iq4_nl, not ggml_type " +
                                            TypeName(type_id));
  }
  return true;
}

// The node's "activations" attribute: false for "int8" (or none), true for "float".
bool FloatActivations(const Ort::ConstKernelInfo& info, const std::string& node) {
  std::string value;
  try {
    value = info.GetAttribute<std::string>("activations");
  } catch (const Ort::Exception&) {
    return false;  // absent: ggml's quantised activations, as before the attribute existed
  }
  if (value == "int8") return false;
  if (value == "float") return true;
  throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) + "attribute activations='" + value +
                                          "' is neither 'int8' nor 'float'");
}

// The float path's format: every type ggml dequantises, K in whole blocks.
WeightFormat ResolveFloatFormat(const std::string& node, int64_t type_id, int64_t k) {
  const std::string where = Where(kOpName, node);
  const bool known = type_id >= 0 && type_id < GGML_TYPE_COUNT &&
                     ggml_get_type_traits(static_cast<ggml_type>(type_id))->blck_size > 0;
  if (!known || !floatpath::Covers(static_cast<ggml_type>(type_id))) {
    throw OpError(ORT_INVALID_ARGUMENT, where + "ggml_type " + TypeName(type_id) +
                                            " cannot be dequantised by this ggml "
                                            "(activations='float')");
  }
  const auto type = static_cast<ggml_type>(type_id);
  const int64_t block = ggml_blck_size(type);
  if (k <= 0 || k % block != 0) {
    throw OpError(ORT_INVALID_ARGUMENT, where + "k=" + std::to_string(k) +
                                            " is not a positive multiple of the block size " +
                                            std::to_string(block) + " of ggml_type " +
                                            TypeName(type_id));
  }
  return WeightFormat{type, k, ggml_row_size(type, k), GGML_TYPE_F32, 0, nullptr, nullptr,
                      true};
}

WeightFormat ResolveFormat(const std::string& node, int64_t type_id, int64_t k) {
  const std::string where = Where(kOpName, node);
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

// One ParallelFor task: quantise one activation row into the vec_dot_type.
struct QuantiseJob {
  const WeightFormat* format;
  const float* x;  // (M, K)
  uint8_t* xq;     // (M, act_row_bytes)
  // The batched path: the row re-laid out for its kernels too (isa kNone: not taken).
  batched::Isa isa = batched::Isa::kNone;
  const batched::Acts* acts = nullptr;
};

void QuantiseRow(void* data, size_t row) {
  const auto& job = *static_cast<const QuantiseJob*>(data);
  const WeightFormat& f = *job.format;
  uint8_t* xq = job.xq + row * f.act_row_bytes;
  f.act_from_float(job.x + row * f.k, xq, f.k);
  if (job.isa != batched::Isa::kNone) {
    batched::PrepareRow(job.isa, f.type, xq, *job.acts, static_cast<int64_t>(row));
  }
}

// How far ahead of ggml's vec_dot the rows are prefetched: measured on the Xeon of
// docs/kernels.md, one Q4_K / Q6_K product at M = 1 (4096 x 4096, one thread's CPU time)
// took 0.9-1.0 / 1.0-1.6 ms with 4 KB against 1.3-1.5 / 1.3-1.7 without (2 KB and 8 KB
// no better), and the 1B Q4_K_M preset decoded at 24-25 tok/s against 19-20.
constexpr size_t kPrefetchBytes = 4096;

// One ParallelFor task: a block of weight rows against every activation row.
struct DotJob {
  const WeightFormat* format;
  ggml_vec_dot_t dot;   // ggml's vec_dot for the type, or ours (PathChoice::row_dot)
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
  // ggml's vec_dot streams a row without prefetching: the first activation row asks for
  // the bytes kPrefetchBytes ahead of each row as it starts it (ours prefetch themselves).
  const bool prefetch = job.dot == f.vec_dot;
  const uint8_t* end = job.w + n1 * f.row_bytes;
  for (int64_t i = 0; i < job.m; ++i) {
    const uint8_t* a = job.acts + i * f.act_row_bytes;
    for (int64_t r = n0; r < n1; ++r) {
      const uint8_t* row = job.w + r * f.row_bytes;
      if (prefetch && i == 0) {
        const uint8_t* ahead = row + kPrefetchBytes;
        for (const uint8_t* p = ahead; p < ahead + f.row_bytes && p < end; p += 64) {
          __builtin_prefetch(p, 0, 3);
        }
      }
      job.dot(k, sums + (r - n0), 0, row, 0, a, 0, 1);
    }
    std::copy(sums, sums + (n1 - n0), job.y + i * job.n + n0);  // Y[i, n0:n1], one burst
  }
}

// One ParallelFor task of the float path: `rows` weight rows (floatpath::TaskRows), each
// read once, against every float activation row.
struct FloatJob {
  const WeightFormat* format;
  floatpath::Level level;
  const uint8_t* w;  // (N, row_bytes)
  const floatpath::Acts* acts;
  float* y;  // (M, N)
  int64_t n;
  int64_t rows;  // weight rows a task
};

void FloatBlock(void* data, size_t block) {
  const auto& job = *static_cast<const FloatJob*>(data);
  const WeightFormat& f = *job.format;
  const int64_t r0 = static_cast<int64_t>(block) * job.rows;
  const int64_t r1 = std::min(job.n, r0 + job.rows);
  if (!f.repacked) {
    floatpath::DotRows(f.type, job.level, job.w, f.row_bytes, r0, r1, *job.acts, job.y, job.n);
    return;
  }
  // The task's groups of 8 rows back in the file's layout first (a multiple of 8 rows:
  // TaskRows is a multiple of 16, N of 8), then the same products over them.
  thread_local AlignedScratch scratch;
  uint8_t* rows = scratch.Get(static_cast<size_t>(r1 - r0) * f.row_bytes);
  for (int64_t g = r0; g < r1; g += repacked::kGroupRows) {
    repacked::Unpack(f.type, f.k, job.w + g * f.row_bytes, rows + (g - r0) * f.row_bytes);
  }
  floatpath::DotRows(f.type, job.level, rows, f.row_bytes, 0, r1 - r0, *job.acts, job.y + r0,
                     job.n);
}

// One ParallelFor task over a repacked W: a run of whole groups of 8 rows against every
// activation row, by ggml's gemm (four rows of X at a time) and gemv (the rest), or by our
// gemv alone (up to kOurGemvRows rows a pass).
struct RepackedJob {
  const WeightFormat* format;
  repacked::Kernels kernels;
  rowdot::RepackedGemv our_gemv;  // or null: ggml's
  const uint8_t* w;     // (N, row_bytes), groups of 8 rows interleaved
  const uint8_t* xq;    // (M, act_row_bytes): the first m4 rows 4 at a time interleaved
  const rowdot::Q8_0Term* terms;  // (M - m4, K / 32): rowdot::Q8_0Terms of the rest, our gemv's
  float* y;             // (M, N)
  int64_t m;
  int64_t m4;  // rows of X the gemm takes (a multiple of 4)
  int64_t n;
  int64_t block_rows;
};

void RepackedBlock(void* data, size_t block) {
  const auto& job = *static_cast<const RepackedJob*>(data);
  const WeightFormat& f = *job.format;
  const int k = static_cast<int>(f.k);
  const int64_t r0 = static_cast<int64_t>(block) * job.block_rows;
  const int cols = static_cast<int>(std::min(job.n, r0 + job.block_rows) - r0);
  const uint8_t* w = job.w + r0 * f.row_bytes;  // a group's rows take their own bytes' room
  if (job.m4 > 0) {
    job.kernels.gemm(k, job.y + r0, static_cast<size_t>(job.n), w, job.xq,
                     static_cast<int>(job.m4), cols);
  }
  if (job.our_gemv != nullptr) {
    for (int64_t i = job.m4; i < job.m; i += kOurGemvRows) {
      job.our_gemv(k, w, cols / repacked::kGroupRows, job.xq + i * f.act_row_bytes,
                   f.act_row_bytes, std::min<int64_t>(kOurGemvRows, job.m - i),
                   job.terms + (i - job.m4) * (f.k / 32), job.y + i * job.n + r0,
                   static_cast<size_t>(job.n), /*w_cached=*/i > job.m4);
    }
    return;
  }
  for (int64_t i = job.m4; i < job.m; ++i) {
    job.kernels.gemv(k, job.y + i * job.n + r0, static_cast<size_t>(job.n), w,
                     job.xq + i * f.act_row_bytes, 1, cols);
  }
}

// One ParallelFor task of the batched path: kBatchedRows weight rows, unpacked once, against
// every activation row.
struct BatchedJob {
  const WeightFormat* format;
  batched::Isa isa;
  const uint8_t* w;  // (N, row_bytes); repacked: groups of 8 rows interleaved
  const batched::Acts* acts;
  float* y;  // (M, N)
  int64_t n;
};

void BatchedBlock(void* data, size_t block) {
  const auto& job = *static_cast<const BatchedJob*>(data);
  const WeightFormat& f = *job.format;
  const int64_t r0 = static_cast<int64_t>(block) * kBatchedRows;
  const int64_t r1 = std::min(job.n, r0 + kBatchedRows);
  batched::DotRows(job.isa, f.type, job.w, f.row_bytes, r0, r1, *job.acts, job.y, job.n,
                   f.repacked);
}

// The node's "epilogue" attribute: false for "" (or none), true for "swiglu".
bool SwigluEpilogue(const Ort::ConstKernelInfo& info, const std::string& node) {
  std::string value;
  try {
    value = info.GetAttribute<std::string>("epilogue");
  } catch (const Ort::Exception&) {
    return false;
  }
  if (value.empty()) return false;
  if (value == "swiglu") return true;
  throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) + "attribute epilogue='" + value +
                                          "' is neither '' nor 'swiglu'");
}

// Which path a node takes: ATTNSERVE_GGUF_MATMUL_PATH = auto (default: the batched kernels
// for the types they cover from batched::MinBatch(type) rows, with the best instruction set
// here), vec_dot (ggml's vec_dot always), avx2 or avx512vnni (the batched kernels with that
// instruction set at every M: for tests and benchmarks).
struct PathChoice {
  batched::Isa isa = batched::Isa::kNone;  // kNone: vec_dot only
  int64_t min_batch = 1;
  // Below min_batch: our row dot in place of ggml's vec_dot where it has one (auto only;
  // gguf_rowdot.h), else null.
  ggml_vec_dot_t row_dot = nullptr;
  // A repacked W's gemv rows: ours (auto and avx512vnni; gguf_rowdot.h), else null: ggml's.
  rowdot::RepackedGemv repacked_gemv = nullptr;
  floatpath::Level float_level = floatpath::Level::kGeneric;  // activations="float"
};

PathChoice ChoosePath(const std::string& node, ggml_type type) {
  const char* env = std::getenv("ATTNSERVE_GGUF_MATMUL_PATH");
  const std::string path = env && *env ? env : "auto";
  const batched::Isa here = batched::DetectIsa();
  PathChoice choice;
  if (path == "auto") {
    choice.isa = batched::Covers(type, here) ? here : batched::Isa::kNone;
    choice.min_batch = batched::MinBatch(type);
    choice.row_dot = rowdot::For(type);
    choice.repacked_gemv = rowdot::RepackedFor(type);
  } else if (path == "avx2" || path == "avx512vnni") {
    const batched::Isa want = path == "avx2" ? batched::Isa::kAvx2 : batched::Isa::kVnni;
    if (here == batched::Isa::kNone || (want == batched::Isa::kVnni && here != want)) {
      throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) +
                                              "ATTNSERVE_GGUF_MATMUL_PATH=" + path +
                                              ": this CPU runs only " + batched::IsaName(here));
    }
    choice.isa = batched::Covers(type, want) ? want : batched::Isa::kNone;
    choice.min_batch = 1;
    if (want == batched::Isa::kVnni) choice.repacked_gemv = rowdot::RepackedFor(type);
  } else if (path != "vec_dot") {
    throw OpError(ORT_INVALID_ARGUMENT,
                  Where(kOpName, node) + "ATTNSERVE_GGUF_MATMUL_PATH=" + path +
                      " is none of auto, vec_dot, avx2, avx512vnni");
  }
  return choice;
}

// The float path's kernels under the same variable: auto (the widest here), vec_dot
// (ggml's to_float and plain C++ products), avx2, avx512vnni (our decoders with AVX2 or
// AVX-512 products).
PathChoice ChooseFloatPath(const std::string& node) {
  const char* env = std::getenv("ATTNSERVE_GGUF_MATMUL_PATH");
  const std::string path = env && *env ? env : "auto";
  const floatpath::Level here = floatpath::DetectLevel();
  PathChoice choice;
  if (path == "auto") {
    choice.float_level = here;
  } else if (path == "vec_dot") {
    choice.float_level = floatpath::Level::kGeneric;
  } else if (path == "avx2" || path == "avx512vnni") {
    const floatpath::Level want =
        path == "avx2" ? floatpath::Level::kAvx2 : floatpath::Level::kAvx512;
    if (static_cast<int>(here) < static_cast<int>(want)) {
      throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) +
                                              "ATTNSERVE_GGUF_MATMUL_PATH=" + path +
                                              ": this CPU runs only " +
                                              floatpath::LevelName(here));
    }
    choice.float_level = want;
  } else {
    throw OpError(ORT_INVALID_ARGUMENT,
                  Where(kOpName, node) + "ATTNSERVE_GGUF_MATMUL_PATH=" + path +
                      " is none of auto, vec_dot, avx2, avx512vnni");
  }
  return choice;
}

struct GgufMatMulKernel {
  std::string node;
  WeightFormat format;
  PathChoice path;
  bool swiglu = false;  // epilogue="swiglu" (gguf_epilogue.h)

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) const {
    return Guarded(Ort::GetApi(), kOpName, [&] { Compute(raw); });
  }

  void ComputeRepacked(Ort::KernelContext& ctx, const float* x, int64_t m, const uint8_t* w,
                       int64_t n, float* y) const;

  void Compute(OrtKernelContext* raw) const {
    Ort::KernelContext ctx(raw);
    const std::string where = Where(kOpName, node);
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
    if (f.repacked && n % repacked::kGroupRows != 0) {
      throw OpError(ORT_INVALID_ARGUMENT, where + "W has " + std::to_string(n) +
                                              " rows; layout='" + repacked::kLayout +
                                              "' holds groups of 8");
    }
    if (swiglu && n % 2 != 0) {
      throw OpError(ORT_INVALID_ARGUMENT, where + "W has " + std::to_string(n) +
                                              " rows; epilogue='swiglu' takes gate | up "
                                              "rows, an even number");
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < x_shape.size(); ++i) m *= x_shape[i];
    std::vector<int64_t> y_shape(x_shape);
    y_shape.back() = swiglu ? n / 2 : n;  // (..., N), or (..., N / 2) after the epilogue
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    if (m == 0 || n == 0) return;
    const float* x_data = x.GetTensorData<float>();   // (M, K)
    const uint8_t* w_data = w.GetTensorData<uint8_t>();
    if (!swiglu) {
      Products(ctx, x_data, m, w_data, n, y.GetTensorMutableData<float>());
      return;
    }
    thread_local AlignedScratch scratch;  // (M, N): gate | up, kept from call to call
    float* products = scratch.As<float>(static_cast<size_t>(m * n));
    Products(ctx, x_data, m, w_data, n, products);
    epilogue::Run(ctx, products, m, n / 2, y.GetTensorMutableData<float>());
  }

  // Y (M, N) = X · Wᵀ by the path this node's format and M take.
  void Products(Ort::KernelContext& ctx, const float* x_data, int64_t m, const uint8_t* w_data,
                int64_t n, float* y_data) const {
    const std::string where = Where(kOpName, node);
    const WeightFormat& f = format;
    if (f.float_activations) {
      std::vector<float> sums;  // (M, K / 32) where the type's groups have mins
      floatpath::Acts acts{x_data, m, f.k, nullptr};
      if (floatpath::NeedsGroupSums(f.type, path.float_level, m)) {
        sums.resize(static_cast<size_t>(m * (f.k / 32)));
        floatpath::GroupSums(x_data, m, f.k, sums.data());
        acts.group_sums = sums.data();
      }
      const int64_t rows = floatpath::TaskRows(path.float_level, m, f.k);
      FloatJob job{&f, path.float_level, w_data, &acts, y_data, n, rows};
      ctx.ParallelFor(FloatBlock, static_cast<size_t>((n + rows - 1) / rows), 0, &job);
      return;
    }
    // X in the vec_dot_type, once per call; F32 weights dot float rows as they are.
    const bool use_batched = path.isa != batched::Isa::kNone && m >= path.min_batch;
    // A repacked W: ggml's gemv / gemm or our gemv where they are faster, else ours.
    if (f.repacked && (!use_batched || GemvOrGemmTakes(m, path.repacked_gemv != nullptr))) {
      ComputeRepacked(ctx, x_data, m, w_data, n, y_data);
      return;
    }
    std::unique_ptr<uint8_t, FreeDeleter> quantised, batched_buffer;
    batched::Acts acts;
    const uint8_t* xq = reinterpret_cast<const uint8_t*>(x_data);
    if (f.act_type != GGML_TYPE_F32) {
      const size_t bytes = static_cast<size_t>(m) * f.act_row_bytes;  // (M, act_row_bytes)
      quantised.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
      if (!quantised) throw OpError(ORT_FAIL, where + "out of memory for the quantised X");
      QuantiseJob qjob{&f, x_data, quantised.get()};
      if (use_batched) {
        const size_t acts_bytes = batched::ActsBytes(f.type, m, f.k);  // a multiple of 64
        batched_buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, acts_bytes)));
        if (!batched_buffer) throw OpError(ORT_FAIL, where + "out of memory for X's codes");
        acts = batched::ActsIn(f.type, batched_buffer.get(), m, f.k);
        qjob.isa = path.isa;
        qjob.acts = &acts;
      }
      if (m < kParallelQuantiseRows) {
        for (int64_t i = 0; i < m; ++i) QuantiseRow(&qjob, static_cast<size_t>(i));
      } else {
        ctx.ParallelFor(QuantiseRow, static_cast<size_t>(m), 0, &qjob);
      }
      xq = quantised.get();
    }

    if (use_batched) {
      BatchedJob job{&f, path.isa, w_data, &acts, y_data, n};
      const size_t tiles = static_cast<size_t>((n + kBatchedRows - 1) / kBatchedRows);
      ctx.ParallelFor(BatchedBlock, tiles, 0, &job);
      return;
    }
    const int64_t block_rows = BlockRows(f.row_bytes);
    DotJob job{&f, path.row_dot != nullptr ? path.row_dot : f.vec_dot, w_data, xq, y_data,
               m, n, block_rows};
    const size_t blocks = static_cast<size_t>((n + block_rows - 1) / block_rows);
    // num_batch 0: one task per block, handed out dynamically, so a thread slowed by
    // other load takes fewer blocks.
    ctx.ParallelFor(DotBlock, blocks, 0, &job);
  }
};

void GgufMatMulKernel::ComputeRepacked(Ort::KernelContext& ctx, const float* x, int64_t m,
                                       const uint8_t* w, int64_t n, float* y) const {
  const WeightFormat& f = format;
  const repacked::Kernels kernels = repacked::KernelsFor(f.type);
  // X once per call: rows 4 at a time interleaved for ggml's gemm (as ggml's mul_mat on this
  // layout quantises them), the last M % 4 plainly for its gemv; every row plainly for ours.
  const int64_t m4 = path.repacked_gemv ? 0 : m >= 4 ? m - m % 4 : 0;
  const size_t bytes = static_cast<size_t>(m) * f.act_row_bytes;  // (M, act_row_bytes)
  std::unique_ptr<uint8_t, FreeDeleter> quantised(
      static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (!quantised) throw OpError(ORT_FAIL, Where(kOpName, node) + "out of memory for X");
  uint8_t* xq = quantised.get();
  for (int64_t i = 0; i < m4; i += 4) {
    kernels.quantize_mat4(x + i * f.k, xq + i * f.act_row_bytes, f.k);
  }
  // (M - m4, K / 32): what our gemv takes beside the codes
  std::vector<rowdot::Q8_0Term> terms(
      path.repacked_gemv ? static_cast<size_t>((m - m4) * (f.k / 32)) : 0);
  for (int64_t i = m4; i < m; ++i) {
    kernels.from_float(x + i * f.k, xq + i * f.act_row_bytes, f.k);
    if (path.repacked_gemv) {
      rowdot::Q8_0Terms(xq + i * f.act_row_bytes, static_cast<int>(f.k),
                        terms.data() + (i - m4) * (f.k / 32));
    }
  }
  const int64_t block_rows = BlockRows(f.row_bytes);
  RepackedJob job{&f, kernels, path.repacked_gemv, w, xq, terms.data(), y, m, m4, n, block_rows};
  const size_t tasks = static_cast<size_t>((n + block_rows - 1) / block_rows);
  ctx.ParallelFor(RepackedBlock, tasks, 0, &job);
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
    return Guarded(api, kOpName, [&] {
      Ort::ConstKernelInfo kinfo(info);
      const std::string node = kinfo.GetNodeName();
      const int64_t type_id =
          IntAttribute(kinfo, kOpName, node, "ggml_type", "the GGUF tensor type id");
      const int64_t k =
          IntAttribute(kinfo, kOpName, node, "k", "the number of weights in a row");
      const bool repacked = Repacked(kinfo, node, type_id);
      const bool swiglu = SwigluEpilogue(kinfo, node);
      if (FloatActivations(kinfo, node)) {
        WeightFormat format = ResolveFloatFormat(node, type_id, k);
        format.repacked = repacked;
        *kernel = new GgufMatMulKernel{node, format, ChooseFloatPath(node), swiglu};
        return;
      }
      WeightFormat format = ResolveFormat(node, type_id, k);
      if (repacked) {  // ggml's gemv / gemm, X as Q8_0 as they take it
        format.repacked = true;
        format.act_type = repacked::KernelsFor(format.type).act_type;
        format.act_row_bytes = ggml_row_size(format.act_type, k);
      }
      *kernel = new GgufMatMulKernel{node, format, ChoosePath(node, format.type), swiglu};
    });
  }

  // Y's shape for the graph: X's with the last dimension replaced by W's first (half of it
  // after the SwiGLU epilogue). Mismatches are left to Compute, which names them with the
  // node.
  static OrtStatusPtr InferOutputShape(Ort::ShapeInferContext& ctx) {
    OrtStatusPtr status = nullptr;
    OrtStatusPtr guard = Guarded(Ort::GetApi(), kOpName, [&] {
      const Ort::ShapeInferContext::Shape& x = ctx.GetInputShape(0);
      const Ort::ShapeInferContext::Shape& w = ctx.GetInputShape(1);
      if (x.empty() || w.size() != 2) return;  // rank unknown: nothing to say
      std::string epilogue;
      try {
        epilogue = ctx.GetAttrString("epilogue");
      } catch (const Ort::Exception&) {
      }
      Ort::ShapeInferContext::Shape y(x);
      y.back() = w[0];
      if (epilogue == "swiglu") {
        if (!w[0].IsInt()) return;  // N unknown: Y's last dimension too
        y.back() = Ort::ShapeInferContext::Shape::value_type(w[0].AsInt() / 2);
      }
      std::vector<std::string> names;
      NameUnknownDims(y, names);
      status = ctx.SetOutputShape(0, y).release();
    });
    return guard ? guard : status;
  }
};

}  // namespace

const OrtCustomOp* MatMulOp() {
  static GgufMatMulOp op;  // outlives every session: ORT keeps a pointer to it
  return &op;
}

}  // namespace attnserve_gguf
