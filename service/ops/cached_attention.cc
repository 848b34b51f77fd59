// CachedAttention: ONNX Runtime's GroupQueryAttention (com.microsoft, float32) over an in-place
// KV cache, with the same inputs, outputs, attributes and arithmetic, for the CPU engine graphs
// the export writes over the GGUF ops (export/gguf/blocks.py swaps the nodes).
//
// Why ours: at a decode step ONNX Runtime's CPU kernel runs one small GEMM a row and query head
// (B·N of them, each 1 × hs against L keys), reading each key/value head once per query head of
// its group. Measured on the 1B Q4_0 file at batch 32 it took 22 % of the step (docs/kernels.md)
// while streaming the cache at a fraction of the host's bandwidth. Here one task takes a row's
// key/value head and the query heads that share it, so the cache is read from memory once, with
// the scores, softmax and weighted sum in AVX-512 or AVX2 vectors.
//
// Inputs (GroupQueryAttention's): query (B, S, (N + 2·N_kv)·H) packed q | k | v (the separate
// key / value inputs must be empty); past_key, past_value (B, N_kv, L, H); seqlens_k (B,) int32,
// each row's total length − 1; total_sequence_length (1) int32; cos_cache, sin_cache (P, R/2)
// when do_rotary. Outputs: (B, S, N·H), present_key, present_value (B, N_kv, max(L, total), H):
// bound to the past buffers (one OrtValue both), the new keys and values are written in place;
// otherwise the past is copied over first.
//
// The cache: float32, or float16 (a second kernel of the same op, chosen by the past /
// present tensors' type: half the bytes a step streams and the pool holds, as llama.cpp's
// default f16 cache). Each new key and value is rounded to float16 once when written
// (ggml-cpu's conversion, to nearest even); the loops read it back exactly (F16C / AVX-512
// conversions) and compute in float32 as for a float32 cache.
//
// Positions follow ONNX Runtime's: S > 1 with total_sequence_length = S is a first prompt (every
// row from position 0, right-padded; a padding token rotates at position 1); otherwise each
// row's S new tokens follow its seqlens_k + 1 − S cached ones. Query s of a row attends to the
// keys before and at its position, the last local_window_size of them (its own included) where
// that is set.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf_ops.h"
#include "vec_exp.h"

namespace attnserve_gguf {
namespace attention {
namespace {

constexpr const char* kOpName = "CachedAttention";
constexpr int64_t kMaxRegionsPerTask = 8;  // a decode task's (row, key/value head) regions
using Half = ggml_fp16_t;  // a float16 cache's element (IEEE binary16 bits)
enum Input { kQuery, kKey, kValue, kPastKey, kPastValue, kSeqlens, kTotal, kCos, kSin, kInputs };

}  // namespace

// ---- the inner loops, once per instruction set ------------------------------------------------

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
namespace {
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadCache(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadCache(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float Sum(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
// The 8 vectors' sums as one vector: pairs interleaved and added within 128-bit halves, then
// the halves of each added across.
inline Vec SumEach(const Vec* v) {
  Vec pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {  // [a0+a2, b0+b2, a1+a3, b1+b3] per half
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // [a, b, c, d] per half
    quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
inline float MaxOf(Vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
// e^x for x ≤ 0 (vec_exp.h).
inline Vec Exp(Vec x) { return ExpAvx2(x); }
#include "cached_attention_kernels.inc"
}  // namespace
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
namespace {
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadCache(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadCache(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float MaxOf(Vec v) { return _mm512_reduce_max_ps(v); }
// The 16 vectors' sums as one vector: as avx2::SumEach within 128-bit lanes, then the four
// lanes of each group of four added across in two steps.
inline Vec SumEach(const Vec* v) {
  Vec pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane L of quads[i]: the lane-L sums of v[4i..4i+3]
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // lanes 0+1 and 2+3 of quads[2i], then of quads[2i+1]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
inline Vec Exp(Vec x) { return ExpAvx512(x); }
#include "cached_attention_kernels.inc"
}  // namespace
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace {

// Plain C++ for a CPU without AVX2 or a head size no vector divides: the same three loops.
namespace scalar {
inline float ToFloat(float x) { return x; }
inline float ToFloat(Half x) { return ggml_fp16_to_fp32(x); }
template <typename Cache>
void Scores(const float* q, int64_t heads, const Cache* k, int64_t n, int64_t hs, float* s) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      float acc = 0.0f;
      for (int64_t d = 0; d < hs; ++d) acc += q[h * hs + d] * ToFloat(k[j * hs + d]);
      s[h * n + j] = acc;
    }
  }
}
void Softmax(float* s, int64_t n) {
  const float peak = *std::max_element(s, s + n);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - peak));
  for (int64_t j = 0; j < n; ++j) s[j] /= sum;
}
template <typename Cache>
void WeightedSum(const float* p, int64_t heads, const Cache* v, int64_t n, int64_t hs,
                 float* out, int64_t out_stride) {
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * out_stride;
    std::fill(o, o + hs, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < hs; ++d) o[d] += p[h * n + j] * ToFloat(v[j * hs + d]);
    }
  }
}
}  // namespace scalar

// The loops over a cache of `Cache` elements (float or Half).
template <typename Cache>
struct Kernels {
  void (*scores)(const float*, int64_t, const Cache*, int64_t, int64_t, float*);
  void (*softmax)(float*, int64_t);
  void (*weighted_sum)(const float*, int64_t, const Cache*, int64_t, int64_t, float*, int64_t);
};

// The widest vectors this CPU has that divide a head of `hs` floats.
template <typename Cache>
Kernels<Cache> KernelsFor(int64_t hs) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && hs % avx512::kLanes == 0) {
    return {avx512::Scores<Cache>, avx512::Softmax, avx512::WeightedSum<Cache>};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && hs % avx2::kLanes == 0) {
    return {avx2::Scores<Cache>, avx2::Softmax, avx2::WeightedSum<Cache>};
  }
  return {scalar::Scores<Cache>, scalar::Softmax, scalar::WeightedSum<Cache>};
}

struct Attributes {
  int64_t heads, kv_heads;
  float scale;    // 0: 1/√H
  int64_t window;  // local_window_size; ≤ 0: none
  bool rotary, interleaved;
};

// One call's tensors and sizes; tasks read it and write only their own rows.
template <typename Cache>
struct Problem {
  Attributes a;
  Kernels<Cache> kernels;
  const float* qkv;        // (B, S, (N + 2·N_kv)·H)
  Cache* keys;             // (B, N_kv, Lp, H)
  Cache* values;           // (B, N_kv, Lp, H)
  const int32_t* seqlens;  // (B,)
  const float* cos;        // (P, R/2), or null
  const float* sin;
  float* out;  // (B, S, N·H)
  int64_t batch, tokens, hs, cache_len, rot_half;
  bool first_prompt;
  float scale;
  int64_t heads_per_task, tokens_per_task, head_chunks, token_chunks;
  int64_t regions_per_task;  // a decode's tasks: this many rows' key/value heads in turn

  int64_t Width() const { return (a.heads + 2 * a.kv_heads) * hs; }
  int64_t Group() const { return a.heads / a.kv_heads; }
  // cached tokens before this call's S in row b
  int64_t Past(int64_t b) const { return first_prompt ? 0 : seqlens[b] + 1 - tokens; }
  int64_t Position(int64_t b, int64_t s) const {
    if (first_prompt) return s <= seqlens[b] ? s : 1;
    return Past(b) + s;
  }
  Cache* KeyRows(int64_t b, int64_t g) const {
    return keys + (b * a.kv_heads + g) * cache_len * hs;
  }
  Cache* ValueRows(int64_t b, int64_t g) const {
    return values + (b * a.kv_heads + g) * cache_len * hs;
  }
  // y = rotate(x) · mul (x and y of H floats), at `position` of the cos / sin tables.
  void Rotate(const float* x, int64_t position, float mul, float* y) const {
    int64_t d = 0;
    if (cos != nullptr) {
      const float* c = cos + position * rot_half;
      const float* s = sin + position * rot_half;
      for (int64_t i = 0; i < rot_half; ++i) {
        const int64_t i1 = a.interleaved ? 2 * i : i, i2 = a.interleaved ? 2 * i + 1 : i + rot_half;
        const float x1 = x[i1], x2 = x[i2];
        y[i1] = (x1 * c[i] - x2 * s[i]) * mul;
        y[i2] = (x2 * c[i] + x1 * s[i]) * mul;
      }
      d = 2 * rot_half;
    }
    for (; d < hs; ++d) y[d] = x[d] * mul;
  }
};

// Task i of the first pass: row b's new keys (rotated) and values of key/value head g into
// the cache, so every query head of the second pass sees them.
template <typename Cache>
void WriteKeysValues(void* data, size_t i) {
  const Problem<Cache>& p = *static_cast<const Problem<Cache>*>(data);
  const int64_t b = static_cast<int64_t>(i) / p.a.kv_heads;
  const int64_t g = static_cast<int64_t>(i) % p.a.kv_heads;
  const int64_t past = p.Past(b);
  thread_local AlignedScratch rotated_scratch;
  float* rotated = rotated_scratch.As<float>(static_cast<size_t>(p.hs));  // (H,)
  for (int64_t s = 0; s < p.tokens; ++s) {
    const float* token = p.qkv + (b * p.tokens + s) * p.Width();
    const float* value = token + (p.a.heads + p.a.kv_heads + g) * p.hs;
    Cache* key_row = p.KeyRows(b, g) + (past + s) * p.hs;
    Cache* value_row = p.ValueRows(b, g) + (past + s) * p.hs;
    if constexpr (std::is_same_v<Cache, float>) {
      p.Rotate(token + (p.a.heads + g) * p.hs, p.Position(b, s), 1.0f, key_row);
      std::memcpy(value_row, value, p.hs * sizeof(float));
    } else {  // rounded to float16 once
      p.Rotate(token + (p.a.heads + g) * p.hs, p.Position(b, s), 1.0f, rotated);
      ggml_cpu_fp32_to_fp16(rotated, key_row, p.hs);
      ggml_cpu_fp32_to_fp16(value, value_row, p.hs);
    }
  }
}

// Keys [first, first + n) that token s of row b attends to (its own included).
struct KeyRange {
  int64_t first, n;
};
template <typename Cache>
KeyRange KeysOf(const Problem<Cache>& p, int64_t b, int64_t s) {
  const int64_t seen = p.Past(b) + s + 1;  // keys at and before this token
  const int64_t first = p.a.window > 0 && seen > p.a.window ? seen - p.a.window : 0;
  return {first, seen - first};
}

// Half `half` (0, 1) of `bytes` from `base` towards L1, ahead of the task's next region.
void PrefetchHalf(const void* base, int64_t bytes, int half) {
  const char* start = reinterpret_cast<const char*>(base);
  const int64_t middle = bytes / 2 / 64 * 64;  // whole lines
  const int64_t from = half == 0 ? 0 : middle, to = half == 0 ? middle : bytes;
  for (int64_t line = from; line < to; line += 64) _mm_prefetch(start + line, _MM_HINT_T0);
}

// For row b and key/value head g, `heads` query heads from h0 over tokens [s0, s1): scores
// against the cached keys, softmax, the weighted sum of the values. `next` (or null): the
// keys and values the task reads next (`next_bytes` each), fetched in halves around the
// phases, so that its memory reads overlap this region's arithmetic.
template <typename Cache>
void AttendRegion(const Problem<Cache>& p, int64_t b, int64_t g, int64_t h0, int64_t heads,
                  int64_t s0, int64_t s1, const Cache* next_keys, const Cache* next_values,
                  int64_t next_bytes) {
  const Cache* keys = p.KeyRows(b, g);
  const Cache* values = p.ValueRows(b, g);
  thread_local AlignedScratch q_scratch, score_scratch;
  float* q = q_scratch.As<float>(static_cast<size_t>(heads * p.hs));  // (heads, H)
  float* scores = score_scratch.As<float>(static_cast<size_t>(heads * (p.Past(b) + s1)));
  for (int64_t s = s0; s < s1; ++s) {
    const auto [first, n] = KeysOf(p, b, s);
    const float* token = p.qkv + (b * p.tokens + s) * p.Width();
    const int64_t position = p.Position(b, s);
    for (int64_t h = 0; h < heads; ++h) {
      p.Rotate(token + (h0 + h) * p.hs, position, p.scale, q + h * p.hs);
    }
    if (next_keys != nullptr) PrefetchHalf(next_keys, next_bytes, 0);
    p.kernels.scores(q, heads, keys + first * p.hs, n, p.hs, scores);  // (heads, n)
    if (next_keys != nullptr) PrefetchHalf(next_keys, next_bytes, 1);
    for (int64_t h = 0; h < heads; ++h) p.kernels.softmax(scores + h * n, n);
    if (next_values != nullptr) PrefetchHalf(next_values, next_bytes, 0);
    p.kernels.weighted_sum(scores, heads, values + first * p.hs, n, p.hs,
                           p.out + ((b * p.tokens + s) * p.a.heads + h0) * p.hs, p.hs);
    if (next_values != nullptr) PrefetchHalf(next_values, next_bytes, 1);
  }
}

// Task i of the second pass: a decode's run of regions_per_task (row, key/value head)
// regions, each prefetching the next; otherwise one region's `heads_per_task` query heads
// over `tokens_per_task` tokens.
//
// Why runs: a decode region's keys and values (64 KB at 128 positions of a 64-wide head)
// come from memory, and a task read them at 15 GB/s, a third of what one core streams,
// while its arithmetic over them in cache takes about a quarter of its time. On a Zen 5
// EPYC (one thread, 4 query heads, 128 positions): 4.1-4.6 us a region from memory, 1.15 in
// cache, 3.1-3.7 prefetching the next region's rows in halves around the phases
// (attention-task.txt in results/bench/2026-12-05-zen5-q4_0-bound/; served, the 1B Q4_0
// step's attention at batch 32 8.3 ms against 9.6).
template <typename Cache>
void Attend(void* data, size_t i) {
  const Problem<Cache>& p = *static_cast<const Problem<Cache>*>(data);
  if (p.regions_per_task > 0) {
    const int64_t regions = p.batch * p.a.kv_heads;
    const int64_t r0 = static_cast<int64_t>(i) * p.regions_per_task;
    const int64_t r1 = std::min(regions, r0 + p.regions_per_task);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / p.a.kv_heads, g = r % p.a.kv_heads;
      const Cache* next_keys = nullptr;
      const Cache* next_values = nullptr;
      int64_t next_bytes = 0;
      if (r + 1 < r1) {
        const int64_t nb = (r + 1) / p.a.kv_heads, ng = (r + 1) % p.a.kv_heads;
        const auto [first, n] = KeysOf(p, nb, 0);
        next_keys = p.KeyRows(nb, ng) + first * p.hs;
        next_values = p.ValueRows(nb, ng) + first * p.hs;
        next_bytes = n * p.hs * static_cast<int64_t>(sizeof(Cache));
      }
      AttendRegion(p, b, g, g * p.Group(), p.Group(), 0, p.tokens, next_keys, next_values,
                   next_bytes);
    }
    return;
  }
  int64_t t = static_cast<int64_t>(i);
  const int64_t tc = t % p.token_chunks;
  t /= p.token_chunks;
  const int64_t hc = t % p.head_chunks;
  t /= p.head_chunks;
  const int64_t g = t % p.a.kv_heads, b = t / p.a.kv_heads;
  const int64_t h0 = g * p.Group() + hc * p.heads_per_task;
  const int64_t heads = std::min(p.heads_per_task, (g + 1) * p.Group() - h0);
  const int64_t s0 = tc * p.tokens_per_task, s1 = std::min(p.tokens, s0 + p.tokens_per_task);
  AttendRegion<Cache>(p, b, g, h0, heads, s0, s1, nullptr, nullptr, 0);
}

int64_t OptionalInt(const Ort::ConstKernelInfo& info, const char* name, int64_t fallback) {
  try {
    return info.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

float OptionalFloat(const Ort::ConstKernelInfo& info, const char* name, float fallback) {
  try {
    return info.GetAttribute<float>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

std::vector<int64_t> ShapeOf(const Ort::ConstValue& v) {
  return v.GetTensorTypeAndShapeInfo().GetShape();
}

bool Present(const Ort::ConstValue& v) {
  return static_cast<const OrtValue*>(v) != nullptr &&
         v.GetTensorTypeAndShapeInfo().GetElementCount() > 0;
}

template <typename Cache>
struct CachedAttentionKernel {
  std::string node;
  Attributes a;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) const {
    return Guarded(Ort::GetApi(), kOpName, [&] { Compute(raw); });
  }

  void Compute(OrtKernelContext* raw) const {
    Ort::KernelContext ctx(raw);
    const std::string where = Where(kOpName, node);
    auto fail = [&](const std::string& what) { throw OpError(ORT_INVALID_ARGUMENT, where + what); };
    const Ort::ConstValue query = ctx.GetInput(kQuery);
    if (Present(ctx.GetInput(kKey)) || Present(ctx.GetInput(kValue))) {
      fail("takes q | k | v packed in the query input; key and value must be empty");
    }
    const Ort::ConstValue past_key = ctx.GetInput(kPastKey), past_value = ctx.GetInput(kPastValue);
    if (static_cast<const OrtValue*>(past_key) == nullptr ||
        static_cast<const OrtValue*>(past_value) == nullptr) {
      fail("needs past_key and past_value (the cache it updates)");
    }
    const std::vector<int64_t> q_shape = ShapeOf(query), k_shape = ShapeOf(past_key);
    const int64_t heads_total = a.heads + 2 * a.kv_heads;
    if (q_shape.size() != 3 || q_shape[2] % heads_total != 0) {
      fail("query has shape " + ShapeString(q_shape) + "; it must be (B, S, (" +
           std::to_string(a.heads) + " + 2·" + std::to_string(a.kv_heads) + ")·head_size)");
    }
    Problem<Cache> p{};
    p.a = a;
    p.batch = q_shape[0];
    p.tokens = q_shape[1];
    p.hs = q_shape[2] / heads_total;
    if (k_shape.size() != 4 || k_shape[0] != p.batch || k_shape[1] != a.kv_heads ||
        k_shape[3] != p.hs || ShapeOf(past_value) != k_shape) {
      fail("past_key / past_value have shapes " + ShapeString(k_shape) + " / " +
           ShapeString(ShapeOf(past_value)) + "; both must be (" + std::to_string(p.batch) +
           ", " + std::to_string(a.kv_heads) + ", L, " + std::to_string(p.hs) + ")");
    }
    const Ort::ConstValue seqlens = ctx.GetInput(kSeqlens), total_value = ctx.GetInput(kTotal);
    if (ShapeOf(seqlens) != std::vector<int64_t>{p.batch} ||
        total_value.GetTensorTypeAndShapeInfo().GetElementCount() != 1) {
      fail("seqlens_k has shape " + ShapeString(ShapeOf(seqlens)) + " (must be (B,)) and "
           "total_sequence_length must hold one value");
    }
    const int64_t total = total_value.GetTensorData<int32_t>()[0];
    p.seqlens = seqlens.GetTensorData<int32_t>();
    p.first_prompt = p.tokens == total;  // S = 1 with a total of 1 is one too: past 0 either way
    const int64_t past_len = k_shape[2];
    p.cache_len = std::max(past_len, total);
    if (a.rotary) {
      const Ort::ConstValue cos = ctx.GetInput(kCos), sin = ctx.GetInput(kSin);
      if (!Present(cos) || !Present(sin) || ShapeOf(cos) != ShapeOf(sin) ||
          ShapeOf(cos).size() != 2 || 2 * ShapeOf(cos)[1] > p.hs) {
        fail("do_rotary=1 needs cos_cache and sin_cache of one shape (positions, ≤ head_size/2)");
      }
      p.cos = cos.GetTensorData<float>();
      p.sin = sin.GetTensorData<float>();
      p.rot_half = ShapeOf(cos)[1];
      const int64_t positions = ShapeOf(cos)[0];
      for (int64_t b = 0; b < p.batch && p.tokens > 0; ++b) {
        // the row's last position: its last token's, or in a padded first prompt its last
        // real token's (a padding token's is 1)
        const int64_t last = std::max(p.Position(b, p.tokens - 1),
                                      p.first_prompt ? std::min<int64_t>(p.seqlens[b], p.tokens - 1)
                                                     : 0);
        if (last >= positions) {
          fail("row " + std::to_string(b) + " reaches position " + std::to_string(last) +
               "; cos_cache holds " + std::to_string(positions));
        }
      }
    }
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t past = p.Past(b);
      if (past < 0 || past + p.tokens > p.cache_len || p.seqlens[b] < 0) {
        fail("row " + std::to_string(b) + ": seqlens_k " + std::to_string(p.seqlens[b]) +
             " with " + std::to_string(p.tokens) + " new tokens does not fit a cache of " +
             std::to_string(p.cache_len) + " positions");
      }
    }
    p.qkv = query.GetTensorData<float>();
    p.out = ctx.GetOutput(0, {p.batch, p.tokens, a.heads * p.hs})
                .template GetTensorMutableData<float>();
    const std::vector<int64_t> present_shape{p.batch, a.kv_heads, p.cache_len, p.hs};
    p.keys = static_cast<Cache*>(ctx.GetOutput(1, present_shape).GetTensorMutableRawData());
    p.values = static_cast<Cache*>(ctx.GetOutput(2, present_shape).GetTensorMutableRawData());
    CopyPast(static_cast<const Cache*>(past_key.GetTensorRawData()), p.keys, p, past_len);
    CopyPast(static_cast<const Cache*>(past_value.GetTensorRawData()), p.values, p, past_len);
    if (p.batch == 0 || p.tokens == 0) return;

    p.kernels = KernelsFor<Cache>(p.hs);
    p.scale = a.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(p.hs)) : a.scale;
    // Tasks: a row's key/value head, its query heads together where there are enough rows to
    // keep every thread busy (decode at batch 1: one head a task), and 16 tokens of a prompt.
    p.tokens_per_task = 16;
    p.token_chunks = (p.tokens + p.tokens_per_task - 1) / p.tokens_per_task;
    const bool split_heads = p.batch * a.kv_heads * p.token_chunks < 8;
    p.heads_per_task = split_heads ? 1 : p.Group();
    p.head_chunks = p.Group() / p.heads_per_task;
    // A decode step (up to 16 tokens a row, whole groups a task) with regions to spare: runs
    // of them, at least 16 tasks (2-8 regions each) so that a thread slowed by other load
    // takes fewer.
    const int64_t regions = p.batch * a.kv_heads;
    p.regions_per_task = p.token_chunks == 1 && p.head_chunks == 1 && regions >= 32
                             ? std::min<int64_t>(kMaxRegionsPerTask, regions / 16)
                             : 0;
    ctx.ParallelFor(WriteKeysValues<Cache>, static_cast<size_t>(regions), 0, &p);
    const int64_t tasks = p.regions_per_task > 0
                              ? (regions + p.regions_per_task - 1) / p.regions_per_task
                              : regions * p.head_chunks * p.token_chunks;
    ctx.ParallelFor(Attend<Cache>, static_cast<size_t>(tasks), 0, &p);
  }

  // present ← past where they are separate buffers (bound to one OrtValue, nothing to do).
  static void CopyPast(const Cache* past, Cache* present, const Problem<Cache>& p,
                       int64_t past_len) {
    if (past == present || past_len == 0) return;
    const int64_t heads = p.batch * p.a.kv_heads;
    for (int64_t r = 0; r < heads; ++r) {
      std::memcpy(present + r * p.cache_len * p.hs, past + r * past_len * p.hs,
                  static_cast<size_t>(past_len * p.hs) * sizeof(Cache));
      std::memset(present + (r * p.cache_len + past_len) * p.hs, 0,
                  static_cast<size_t>((p.cache_len - past_len) * p.hs) * sizeof(Cache));
    }
  }
};

// The op over a cache of `Cache` elements: registered once for float32 caches and once for
// float16 ones (one schema, two kernels: ONNX Runtime picks by the past / present types).
template <typename Cache>
struct CachedAttentionOp : Ort::CustomOpBase<CachedAttentionOp<Cache>,
                                             CachedAttentionKernel<Cache>, /*WithStatus=*/true> {
  static constexpr ONNXTensorElementDataType kCacheType =
      std::is_same_v<Cache, float> ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == kSeqlens || index == kTotal) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    return index == kPastKey || index == kPastValue ? kCacheType
                                                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == kKey || index == kValue || index == kCos || index == kSin
               ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
               : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : kCacheType;
  }

  // Attributes are checked when the session is created. GroupQueryAttention's that change
  // the arithmetic and that no graph of ours sets are refused rather than ignored.
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return Guarded(api, kOpName, [&] {
      Ort::ConstKernelInfo kinfo(info);
      const std::string node = kinfo.GetNodeName();
      Attributes a{};
      a.heads = IntAttribute(kinfo, kOpName, node, "num_heads", "query heads");
      a.kv_heads = IntAttribute(kinfo, kOpName, node, "kv_num_heads", "key/value heads");
      if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0) {
        throw OpError(ORT_INVALID_ARGUMENT,
                      Where(kOpName, node) + "num_heads=" + std::to_string(a.heads) +
                          " must be a positive multiple of kv_num_heads=" +
                          std::to_string(a.kv_heads));
      }
      a.scale = OptionalFloat(kinfo, "scale", 0.0f);
      a.window = OptionalInt(kinfo, "local_window_size", -1);
      a.rotary = OptionalInt(kinfo, "do_rotary", 0) == 1;
      a.interleaved = OptionalInt(kinfo, "rotary_interleaved", 0) == 1;
      if (OptionalFloat(kinfo, "softcap", 0.0f) != 0.0f ||
          OptionalInt(kinfo, "smooth_softmax", 0) != 0) {
        throw OpError(ORT_INVALID_ARGUMENT, Where(kOpName, node) +
                                                "softcap and smooth_softmax are not supported");
      }
      *kernel = new CachedAttentionKernel<Cache>{node, a};
    });
  }
};

}  // namespace
}  // namespace attention

const OrtCustomOp* AttentionOp() {
  // outlive every session: ORT keeps pointers to them
  static attention::CachedAttentionOp<float> op;
  return &op;
}

const OrtCustomOp* AttentionHalfCacheOp() {
  static attention::CachedAttentionOp<attention::Half> op;
  return &op;
}

}  // namespace attnserve_gguf
