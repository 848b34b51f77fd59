// The batched path of GgufMatMul: see gguf_batched.h. The kernels (gguf_batched_kernels.inc)
// are compiled twice, for AVX2 (+FMA, F16C) and for AVX-512 VNNI (+VL, BW), each in its own
// namespace under a target region, so the library needs nothing beyond x86-64 and chooses
// at run time (__builtin_cpu_supports); elsewhere GgufMatMul keeps ggml's vec_dot.
//
// Layout the kernels share, per weight row unpacked (Unpacked): uint8 codes u (K), per
// 32-weight group a float scale ws (8 lanes for Q6_K's 16-weight sub-blocks) and a float
// min mw, so that w = ws·(u − offset) + mw exactly (offset a per-type constant: 8 for
// Q4_0, 16 Q5_0, 128 Q8_0, 32 Q6_K, 0 for the types with mins). Per activation row, from
// ggml's own Q8_0/Q8_1/Q8_K blocks: int8 codes q, the group scale xs, the group's scaled
// sum sx (Q8_1's s; d·bsums for Q8_K) and −offset·(sum of each 4 codes), the start of the
// integer dot so that it is the signed Σ (u − offset)·q exactly.

#include "gguf_batched.h"
#include "gguf_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#define ATTNSERVE_GGUF_X86 1
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace attnserve_gguf {
namespace batched {
namespace {

enum class Kind { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K };
enum class ActKind { kQ8_0, kQ8_1, kQ8_K };

bool KindOf(ggml_type type, Kind* kind) {
  switch (type) {
    case GGML_TYPE_Q4_0: *kind = Kind::kQ4_0; return true;
    case GGML_TYPE_Q4_1: *kind = Kind::kQ4_1; return true;
    case GGML_TYPE_Q5_0: *kind = Kind::kQ5_0; return true;
    case GGML_TYPE_Q5_1: *kind = Kind::kQ5_1; return true;
    case GGML_TYPE_Q8_0: *kind = Kind::kQ8_0; return true;
    case GGML_TYPE_Q4_K: *kind = Kind::kQ4_K; return true;
    case GGML_TYPE_Q5_K: *kind = Kind::kQ5_K; return true;
    case GGML_TYPE_Q6_K: *kind = Kind::kQ6_K; return true;
    default: return false;
  }
}

int Offset(Kind kind) {
  switch (kind) {
    case Kind::kQ4_0: return 8;
    case Kind::kQ5_0: return 16;
    case Kind::kQ8_0: return 128;
    case Kind::kQ6_K: return 32;
    default: return 0;
  }
}

bool HasMin(Kind kind) {
  return kind == Kind::kQ4_1 || kind == Kind::kQ5_1 || kind == Kind::kQ4_K ||
         kind == Kind::kQ5_K;
}

ActKind ActsOf(Kind kind) {
  switch (kind) {
    case Kind::kQ4_0:
    case Kind::kQ5_0:
    case Kind::kQ8_0: return ActKind::kQ8_0;
    case Kind::kQ4_1:
    case Kind::kQ5_1: return ActKind::kQ8_1;
    default: return ActKind::kQ8_K;
  }
}

int LaneK(ggml_type type) { return type == GGML_TYPE_Q6_K ? 16 : 32; }
int64_t PaddedK(ggml_type type, int64_t k) {
  const int64_t chunk = 8 * LaneK(type);
  return (k + chunk - 1) / chunk * chunk;
}
size_t Up64(size_t n) { return (n + 63) / 64 * 64; }

// Weight rows unpacked by one task (thread-local scratch), the layout of Acts.
struct Unpacked {
  uint8_t* u = nullptr;        // (rows, kp) codes, interleaved
  float* ws = nullptr;         // (rows, kp / lane_k) scales
  float* mw = nullptr;         // (rows, kp / lane_k) mins
};


}  // namespace

#if defined(ATTNSERVE_GGUF_X86)
// --- AVX2 (+FMA, F16C): maddubs; Q8_0 excluded (codes up to 255 would saturate) ---------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
namespace {
constexpr bool kVnni = false;
constexpr int kMX = 2;  // 16 vector registers: 2 x 2 float, int16 and int32 accumulators (3 x 2 where
                        // the int32 ones are not kept: AllRowsOf)
constexpr int kRW = 2;
constexpr int kPairsRW = 1;  // unused: rows are not paired here
#include "gguf_batched_kernels.inc"
}  // namespace
void PrepareRow(Kind kind, const uint8_t* xq, const Acts& a, int64_t i, int8_t* scratch) {
  PrepareRowImpl(kind, xq, a, i, scratch);
}
void DotRows(Kind kind, const uint8_t* w, size_t row_bytes, int64_t r0, int64_t r1,
             const Acts& a, float* y, int64_t ldy, Unpacked& scratch, bool repacked) {
  DotRowsImpl(kind, w, row_bytes, r0, r1, a, y, ldy, scratch, repacked);
}
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// --- AVX-512 VNNI (+VL, BW) on 256-bit vectors: dpbusd, 32 vector registers ---------------
ATTNSERVE_BEGIN_AVX512_VNNI
namespace vnni {
namespace {
constexpr bool kVnni = true;
constexpr int kMX = 4;       // activation rows a step
constexpr int kRW = 3;       // unused: rows are paired here
constexpr int kPairsRW = 2;  // pairs of weight rows a step (MicroPairs): 4 x 2 float and 4 x 2
                             // integer 512-bit accumulators of 32 registers (3 pairs spilled)
#include "gguf_batched_kernels.inc"
}  // namespace
void PrepareRow(Kind kind, const uint8_t* xq, const Acts& a, int64_t i, int8_t* scratch) {
  PrepareRowImpl(kind, xq, a, i, scratch);
}
void DotRows(Kind kind, const uint8_t* w, size_t row_bytes, int64_t r0, int64_t r1,
             const Acts& a, float* y, int64_t ldy, Unpacked& scratch, bool repacked) {
  DotRowsImpl(kind, w, row_bytes, r0, r1, a, y, ldy, scratch, repacked);
}
}  // namespace vnni
ATTNSERVE_END_AVX512_VNNI

#endif  // ATTNSERVE_GGUF_X86

Isa DetectIsa() {
#if !defined(ATTNSERVE_GGUF_X86)
  return Isa::kNone;  // other architectures keep ggml's vec_dot
#else
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma")) {
    return Isa::kVnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;  // F16C comes with every AVX2 CPU
  }
  return Isa::kNone;
#endif
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kVnni: return "avx512vnni";
    case Isa::kAvx2: return "avx2";
    default: return "none";
  }
}

bool Covers(ggml_type type, Isa isa) {
  Kind kind;
  if (isa == Isa::kNone || !KindOf(type, &kind)) return false;
  return !(isa == Isa::kAvx2 && kind == Kind::kQ8_0);
}

int64_t MinBatch(ggml_type type) {
  switch (type) {
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: return 2;
    default: return 3;
  }
}

size_t ActsBytes(ggml_type type, int64_t m, int64_t k) {
  const int64_t kp = PaddedK(type, k);
  const size_t lanes = static_cast<size_t>(m * (kp / LaneK(type)));
  return Up64(static_cast<size_t>(m * kp)) + 3 * Up64(lanes * 4);  // q, xs, sx, negc
}

Acts ActsIn(ggml_type type, void* buffer, int64_t m, int64_t k) {
  Acts a;
  a.m = m;
  a.k = k;
  a.kp = PaddedK(type, k);
  a.lane_k = LaneK(type);
  const size_t lanes = static_cast<size_t>(m * (a.kp / a.lane_k));
  auto* base = static_cast<uint8_t*>(buffer);
  a.q = reinterpret_cast<int8_t*>(base);
  base += Up64(static_cast<size_t>(m * a.kp));
  a.xs = reinterpret_cast<float*>(base);
  base += Up64(lanes * 4);
  a.sx = reinterpret_cast<float*>(base);
  base += Up64(lanes * 4);
  a.negc = reinterpret_cast<int32_t*>(base);
  return a;
}

void PrepareRow(Isa isa, ggml_type type, const uint8_t* xq_row, const Acts& acts, int64_t i) {
  Kind kind;
  if (!KindOf(type, &kind)) std::abort();  // Covers() was checked
#if defined(ATTNSERVE_GGUF_X86)
  thread_local AlignedScratch scratch;
  auto* q = reinterpret_cast<int8_t*>(scratch.Get(static_cast<size_t>(acts.k)));
  if (isa == Isa::kVnni) {
    vnni::PrepareRow(kind, xq_row, acts, i, q);
  } else {
    avx2::PrepareRow(kind, xq_row, acts, i, q);
  }
#else
  (void)isa, (void)xq_row, (void)acts, (void)i;
  std::abort();  // DetectIsa() is kNone here: never called
#endif
}

void DotRows(Isa isa, ggml_type type, const uint8_t* w, size_t row_bytes, int64_t r0,
             int64_t r1, const Acts& acts, float* y, int64_t ldy, bool repacked) {
  Kind kind;
  if (!KindOf(type, &kind) || (repacked && (kind != Kind::kQ4_0 || r0 % 8 != 0))) std::abort();
#if defined(ATTNSERVE_GGUF_X86)
  thread_local AlignedScratch scratch;
  // Whole pairs of rows (the VNNI kernels' layout).
  const size_t rows = static_cast<size_t>(r1 - r0 + 1) / 2 * 2, kp = static_cast<size_t>(acts.kp);
  const size_t lanes = kp / static_cast<size_t>(acts.lane_k);
  const size_t u_bytes = rows * kp, s_bytes = Up64(rows * lanes * 4);
  uint8_t* base = scratch.Get(u_bytes + 2 * s_bytes);
  Unpacked unpacked;
  unpacked.u = base;
  unpacked.ws = reinterpret_cast<float*>(base + u_bytes);
  unpacked.mw = reinterpret_cast<float*>(base + u_bytes + s_bytes);
  if (isa == Isa::kVnni) {
    vnni::DotRows(kind, w, row_bytes, r0, r1, acts, y, ldy, unpacked, repacked);
  } else {
    avx2::DotRows(kind, w, row_bytes, r0, r1, acts, y, ldy, unpacked, repacked);
  }
#else
  (void)isa, (void)w, (void)row_bytes, (void)r0, (void)r1, (void)acts, (void)y, (void)ldy;
  (void)repacked;
  std::abort();  // DetectIsa() is kNone here: never called
#endif
}

}  // namespace batched
}  // namespace attnserve_gguf
