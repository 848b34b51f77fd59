// The float-activation path of GgufMatMul: see gguf_float.h.
//
// Three ways to a task's products, each reading a weight row from memory once a call:
//  * fused, below 4 activation rows (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): each group of weights
//    that shares a scale is decoded in registers and dotted with every activation row in
//    turn. With AVX2 + FMA (and Q8_0 on AVX-512) as float codes, the sum scaled per group,
//    y = Σ_g d_g·Σ q·x (+ m_g·Σ x for the types with mins, Σ x per group computed once a
//    call); with AVX-512 the others as weights (StepRows), two weight rows at a time, their
//    scales converted first, 4-bit codes picked from a table of the group's 16 weights,
//    Q6_K's 6-bit codes converted. No dequantised copy.
//  * a tile, from 4 rows, for every type ggml dequantises, and on CPUs without AVX2: the
//    task's rows dequantised once (our decoders, exactly ggml's values; on AVX-512 for
//    Q4_0, Q4_1, Q4_K and Q6_K StepRows' decoder, one rounding a weight; or ggml's
//    to_float) into thread-local scratch, then dot products of 4 activation rows x 4 (2)
//    weight rows in registers.
//  * packed panels, from 16-32 rows with AVX-512 (UsesOuter): the tile transposed into
//    panels of 16 rows K-major and multiplied as outer products (6 activation rows x 64
//    weight rows a step), as a float32 GEMM does: a prompt's rows.
// All give the float32 product of the values gguf.quants.dequantize returns, up to
// float32 summation order (the tests hold them to 2e-6 relative).

#include "gguf_float.h"
#include "gguf_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#define ATTNSERVE_GGUF_X86 1
// GCC 12 warns inside its own AVX-512 headers (the unused source of a zeroing convert is
// "uninitialized", GCC bug 105593) wherever they are inlined; the headers, not our code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attnserve_gguf {
namespace floatpath {
namespace {

// Activation rows a step of either kernel keeps in registers.
constexpr int kRowsX = 4;
// Activation rows from which a tile of dequantised rows beats decoding in registers: the
// fused kernels decode each group again for every kRowsX activation rows (measured,
// docs/kernels.md). On AVX-512 the types StepRows reads go on to kStepTo.
constexpr int64_t kTileFrom = 4;
// With AVX-512, from how many activation rows the tile is packed K-major for outer
// products: packing (a 16 x 16 transpose a 256 weights) is paid back from 16 rows where a
// row is short (K <= 2,048: SmolLM2's products), from 32 where it is long (64 packed rows
// of K = 4,096 are 1 MB); measured on 2 threads, docs/kernels.md.
bool UsesOuter(Level level, int64_t m, int64_t k) {
  return level == Level::kAvx512 && (m >= 32 || (m >= 16 && k <= 2048));
}
// Activation rows from which a task takes more than 16 weight rows (TaskRows).
constexpr int64_t kWideFrom = 16;
// Weights a group of the fused kernels: one scale (and min) for 32 weights.
constexpr int64_t kGroup = 32;

thread_local AlignedScratch tile;  // a task's dequantised rows
thread_local AlignedScratch step_scales;  // a task's rows' scales and offsets (StepScales)

// y[i, j] = x_i · w_j for MI activation rows (ldx apart) and RJ dequantised rows.
// Eight partial sums a pair, so that the compiler can keep them in vector lanes (a single
// float sum may not be reordered, and ran at 1.8 GFMA/s).
template <int MI, int RJ>
void TileGeneric(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y,
                 int64_t ldy) {
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) {
      const float* xi = x + i * ldx;
      const float* wj = w + j * ldw;
      float lanes[8] = {};
      int64_t p = 0;
      for (; p + 8 <= k; p += 8) {
        for (int l = 0; l < 8; ++l) lanes[l] += xi[p + l] * wj[p + l];
      }
      float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                  ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      for (; p < k; ++p) sum += xi[p] * wj[p];
      y[i * ldy + j] = sum;
    }
  }
}

#if defined(ATTNSERVE_GGUF_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float Sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// 16 signed or unsigned byte codes as two vectors of 8 floats.
template <bool kSigned>
inline void Floats16(__m128i b, __m256* c) {
  const __m128i high = _mm_unpackhi_epi64(b, b);
  if (kSigned) {
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high));
  } else {
    c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
  }
}

// One group of each type: its float codes c (kVectors of 8, natural order), scale d and,
// where the type has one, min m, so that weight j = d·c[j] + m (as ggml dequantises).
struct Q4_0 {  // 18 bytes: fp16 d, 16 bytes of nibbles (weights 0-15 low, 16-31 high)
  static constexpr int kVectors = 4;
  static constexpr bool kMin = false;
  static void Group(const uint8_t* row, int64_t g, __m256* c, float* d, float* /*m*/) {
    const uint8_t* b = row + g * 18;
    *d = Half(b);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    Floats16<true>(_mm_sub_epi8(_mm_and_si128(q, low), eight), c);
    Floats16<true>(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), eight), c + 2);
  }
};

struct Q4_1 {  // 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles
  static constexpr int kVectors = 4;
  static constexpr bool kMin = true;
  static void Group(const uint8_t* row, int64_t g, __m256* c, float* d, float* m) {
    const uint8_t* b = row + g * 20;
    *d = Half(b);
    *m = Half(b + 2);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_set1_epi8(0x0F);
    Floats16<false>(_mm_and_si128(q, low), c);
    Floats16<false>(_mm_and_si128(_mm_srli_epi16(q, 4), low), c + 2);
  }
};

struct Q8_0 {  // 34 bytes: fp16 d, 32 signed codes
  static constexpr int kVectors = 4;
  static constexpr bool kMin = false;
  static void Group(const uint8_t* row, int64_t g, __m256* c, float* d, float* /*m*/) {
    const uint8_t* b = row + g * 34;
    *d = Half(b);
    Floats16<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), c);
    Floats16<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), c + 2);
  }
};

// 144 bytes a super-block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles: group 2p the low nibbles of bytes 32p..32p+31, 2p+1 their high.
struct Q4_K {
  static constexpr int kVectors = 4;
  static constexpr bool kMin = true;
  // Group g's scale d·sc and min −dmin·m (ggml's get_scale_min_k4); its codes: Codes.
  static void Scales(const uint8_t* row, int64_t g, float* d, float* m) {
    const uint8_t* b = row + (g / 8) * 144;
    const int j = static_cast<int>(g % 8);
    const uint8_t* s = b + 4;
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    *d = Half(b) * static_cast<float>(sc);
    *m = -(Half(b + 2) * static_cast<float>(mn));
  }
  // Group g's 32 codes as bytes.
  static __m256i Codes(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g / 8) * 144;
    const int j = static_cast<int>(g % 8);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
    return _mm256_and_si256((j % 2) ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
  }
  static void Group(const uint8_t* row, int64_t g, __m256* c, float* d, float* m) {
    Scales(row, g, d, m);
    const __m256i codes = Codes(row, g);
    Floats16<false>(_mm256_castsi256_si128(codes), c);
    Floats16<false>(_mm256_extracti128_si256(codes, 1), c + 2);
  }
};

// 210 bytes a super-block of 256, groups of 16 (one int8 scale each): 128 bytes ql (low
// nibbles), 64 bytes qh (2 high bits), 16 scales, fp16 d. Weight 128h + 32v + l has the
// nibble of ql[64h + 32(v & 1) + l] (low for v < 2), bits 2v of qh[32h + l], minus 32.
struct Q6_K {
  static constexpr int kVectors = 2;
  static constexpr bool kMin = false;
  static void Group(const uint8_t* row, int64_t g, __m256* c, float* d, float* /*m*/) {
    const uint8_t* b = row + (g / 16) * 210;
    const int G = static_cast<int>(g % 16), h = G / 8, v = (G % 8) / 2, l0 = 16 * (G % 2);
    const __m128i ql =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * h + 32 * (v & 1) + l0));
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * h + l0));
    const __m128i low = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(3);
    const __m128i nib = _mm_and_si128(v >= 2 ? _mm_srli_epi16(ql, 4) : ql, low);
    const __m128i hi = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(2 * v)), two);
    const __m128i q = _mm_sub_epi8(_mm_or_si128(nib, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
    *d = Half(b + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[G]);
    Floats16<true>(q, c);
  }
};

// y[i] for MI activation rows against one weight row: per group, Σ codes·x in 8 lanes,
// scaled by the group's d into the row's total (and its min times the group's Σ x).
template <class T>
struct FusedAvx2 {
  template <int MI>
  static void Row(const uint8_t* row, int64_t k, const float* x, int64_t ldx,
                  const float* sums, int64_t lds, float* y, int64_t ldy) {
    constexpr int64_t kWeights = 8 * T::kVectors;  // a group
    __m256 total[MI];
    float mins[MI];
    for (int i = 0; i < MI; ++i) {
      total[i] = _mm256_setzero_ps();
      mins[i] = 0.0f;
    }
    const int64_t groups = k / kWeights;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 c[T::kVectors];
      float d, m = 0.0f;
      T::Group(row, g, c, &d, &m);
      const __m256 vd = _mm256_set1_ps(d);
      for (int i = 0; i < MI; ++i) {
        const float* xg = x + i * ldx + g * kWeights;
        __m256 s = _mm256_mul_ps(c[0], _mm256_loadu_ps(xg));
        for (int v = 1; v < T::kVectors; ++v) {
          s = _mm256_fmadd_ps(c[v], _mm256_loadu_ps(xg + 8 * v), s);
        }
        total[i] = _mm256_fmadd_ps(s, vd, total[i]);
        if (T::kMin) mins[i] += m * sums[i * lds + g];
      }
    }
    for (int i = 0; i < MI; ++i) y[i * ldy] = Sum8(total[i]) + mins[i];
  }
};

// Y[:, r0:r1] by one of the fused kernels (FusedAvx2<T> or FusedAvx512<T>).
template <class Fused>
void FusedRows(const uint8_t* w, size_t row_bytes, int64_t r0, int64_t r1, const Acts& a,
               float* y, int64_t ldy) {
  const int64_t lds = a.k / kGroup;
  for (int64_t i0 = 0; i0 < a.m; i0 += kRowsX) {
    const float* x = a.x + i0 * a.k;
    const float* sums = a.group_sums ? a.group_sums + i0 * lds : nullptr;
    float* yi = y + i0 * ldy;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + r * row_bytes;
      switch (std::min<int64_t>(kRowsX, a.m - i0)) {
        case 4: Fused::template Row<4>(row, a.k, x, a.k, sums, lds, yi + r, ldy); break;
        case 3: Fused::template Row<3>(row, a.k, x, a.k, sums, lds, yi + r, ldy); break;
        case 2: Fused::template Row<2>(row, a.k, x, a.k, sums, lds, yi + r, ldy); break;
        default: Fused::template Row<1>(row, a.k, x, a.k, sums, lds, yi + r, ldy); break;
      }
    }
  }
}

// A row dequantised into floats (out, K of them): d·c + m, rounded as ggml's to_float
// rounds it (a product, then a sum), so the values are gguf.quants.dequantize's.
template <class T>
void Dequantise(const uint8_t* row, int64_t k, float* out) {
  constexpr int64_t kWeights = 8 * T::kVectors;
  for (int64_t g = 0; g < k / kWeights; ++g) {
    __m256 c[T::kVectors];
    float d, m = 0.0f;
    T::Group(row, g, c, &d, &m);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int v = 0; v < T::kVectors; ++v) {
      const __m256 w = _mm256_mul_ps(c[v], vd);
      _mm256_storeu_ps(out + g * kWeights + 8 * v, T::kMin ? _mm256_add_ps(w, vm) : w);
    }
  }
}

// y[i, j] = x_i · w_j for MI activation rows and RJ dequantised rows, 8 lanes of K a step.
template <int MI, int RJ>
void TileAvx2(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y,
              int64_t ldy) {
  __m256 acc[MI][RJ];
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) {
    __m256 wv[RJ];
    for (int j = 0; j < RJ; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MI; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < RJ; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) {
      float sum = Sum8(acc[i][j]);
      for (int64_t q = p; q < k; ++q) sum += x[i * ldx + q] * w[j * ldw + q];
      y[i * ldy + j] = sum;
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
// TileAvx2 on 16 lanes and AVX-512's 32 registers: 4 x 4 accumulators.
template <int MI, int RJ>
void TileAvx512(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y,
                int64_t ldy) {
  __m512 acc[MI][RJ];
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t p = 0;
  for (; p + 16 <= k; p += 16) {
    __m512 wv[RJ];
    for (int j = 0; j < RJ; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MI; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < RJ; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t q = p; q < k; ++q) sum += x[i * ldx + q] * w[j * ldw + q];
      y[i * ldy + j] = sum;
    }
  }
}
// 16 byte codes as 16 floats.
template <bool kSigned>
inline __m512 Floats16x(__m128i b) {
  return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// A Q8_0 group on 16 lanes: 2 vectors of 16 floats, the same codes and scale as the AVX2
// decoder's Group (Q4_0, Q4_1, Q4_K and Q6_K have StepRows, below).
template <class T>
void Group512(const uint8_t* row, int64_t g, __m512* c, float* d, float* m);

template <>
void Group512<Q8_0>(const uint8_t* row, int64_t g, __m512* c, float* d, float* /*m*/) {
  const uint8_t* b = row + g * 34;
  *d = Half(b);
  c[0] = Floats16x<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
  c[1] = Floats16x<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
}

// y[i] for MI activation rows against one weight row, 16 lanes: FusedAvx2's sums with half
// the instructions a group.
template <class T>
struct FusedAvx512 {
  template <int MI>
  static void Row(const uint8_t* row, int64_t k, const float* x, int64_t ldx,
                  const float* sums, int64_t lds, float* y, int64_t ldy) {
    constexpr int64_t kWeights = 32;
    __m512 total[MI];
    float mins[MI];
    for (int i = 0; i < MI; ++i) {
      total[i] = _mm512_setzero_ps();
      mins[i] = 0.0f;
    }
    for (int64_t g = 0; g < k / kWeights; ++g) {
      __m512 c[2];
      float d, m = 0.0f;
      Group512<T>(row, g, c, &d, &m);
      const __m512 vd = _mm512_set1_ps(d);
      for (int i = 0; i < MI; ++i) {
        const float* xg = x + i * ldx + g * kWeights;
        const __m512 s = _mm512_fmadd_ps(c[1], _mm512_loadu_ps(xg + 16),
                                         _mm512_mul_ps(c[0], _mm512_loadu_ps(xg)));
        total[i] = _mm512_fmadd_ps(s, vd, total[i]);
        if (T::kMin) mins[i] += m * sums[i * lds + g];
      }
    }
    for (int i = 0; i < MI; ++i) y[i * ldy] = _mm512_reduce_add_ps(total[i]) + mins[i];
  }
};

// How a decode step's kernel on AVX-512 (StepRows) reads a type: kSpans spans of 32
// weights a step; a scale and an offset for every kScaleWeights weights (StepScales), so
// that weight = scale·code + offset; Weights(): the step's spans as floats, w[2s] and
// w[2s + 1] span s's weights 0-15 and 16-31.
//
// The 4-bit types through a table: a group's 16 possible weights are one FMA over 0…15,
// and each code picks its weight with vpermps, which reads only the low 4 bits of an
// index (no masking, no int-to-float conversion, no min term). Q4_0 and Q4_1: a block of
// 32 weights, an fp16 scale first (Q4_1: its min in the next 2 bytes), then 16 bytes of
// nibbles (byte l: weight l low, weight l + 16 high).
template <class T> struct StepDecode {
  static constexpr int kBytes = std::is_same_v<T, Q4_1> ? 20 : 18, kCodes = kBytes - 16;
  static constexpr int kSpans = 1, kScaleWeights = 32;
  static void Weights(const uint8_t* row, int64_t g, const float* scales, const float* offsets,
                      __m512* w) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kBytes + kCodes)));
    const __m512 table = Table(scales[g], offsets[g]);
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
  static __m512 Table(float scale, float offset) {
    const __m512 codes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_fmadd_ps(codes, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  }
};
// Q4_K: groups 2p and 2p + 1 of a super-block are the low and high nibbles of the same 32
// bytes (at 16 + 32p), widened once for both.
template <> struct StepDecode<Q4_K> {
  static constexpr int kSpans = 2, kScaleWeights = 32;
  static void Weights(const uint8_t* row, int64_t g, const float* scales, const float* offsets,
                      __m512* w) {
    const uint8_t* q = row + (g / 8) * 144 + 16 + 16 * (g % 8);  // g even
    const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i high =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    const __m512 even = StepDecode<Q4_1>::Table(scales[g], offsets[g]);
    const __m512 odd = StepDecode<Q4_1>::Table(scales[g + 1], offsets[g + 1]);
    w[0] = _mm512_permutexvar_ps(low, even);
    w[1] = _mm512_permutexvar_ps(high, even);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(low, 4), odd);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(high, 4), odd);
  }
};
// Q6_K (6-bit codes: no 16-entry table): span g = 32h + 8v of its super-block's 256 (h < 2,
// v < 4, Q6_K's comment above) is 32 bytes of ql and the 2 bits 2v of 32 bytes of qh, put
// together 32 codes at once on bytes, then widened and converted; a scale per 16 weights,
// offset −32·scale.
template <> struct StepDecode<Q6_K> {
  static constexpr int kSpans = 1, kScaleWeights = 16;
  static void Weights(const uint8_t* row, int64_t g, const float* scales, const float* offsets,
                      __m512* w) {
    const uint8_t* b = row + (g / 8) * 210;
    const int h = static_cast<int>(g % 8) / 4, v = static_cast<int>(g % 4);
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (v & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i nibbles = _mm256_and_si256(v >= 2 ? _mm256_srli_epi16(ql, 4) : ql,
                                             _mm256_set1_epi8(0x0F));
    const __m256i top = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * v)), _mm256_set1_epi8(3)), 4);
    const __m256i codes = _mm256_or_si256(nibbles, top);
    for (int half = 0; half < 2; ++half) {
      const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          half ? _mm256_extracti128_si256(codes, 1) : _mm256_castsi256_si128(codes)));
      w[half] = _mm512_fmadd_ps(c, _mm512_set1_ps(scales[2 * g + half]),
                                _mm512_set1_ps(offsets[2 * g + half]));
    }
  }
};

// Each row's scales and offsets (StepDecode) as floats: (rows, stride) each, stride >= the
// row's count of them. Q4_0 and Q4_1: the fp16 scales (and Q4_1's mins; Q4_0's offset is
// −8·d, so d·c − 8·d = d·(c − 8) exactly) gathered and converted 16 groups a vector, not
// one scalar conversion a group.
template <class T>
void StepScales(const uint8_t* row, size_t row_bytes, int64_t rows, int64_t groups,
                int64_t stride, float* scales, float* offsets) {
  constexpr int kBytes = StepDecode<T>::kBytes;
  const __m512i at = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(kBytes));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int run = static_cast<int>(std::min<int64_t>(16, groups - g0));
      const __mmask16 live = static_cast<__mmask16>((1u << run) - 1);
      // fp16 d in the low half of each dword, Q4_1's m in the high half
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                     row + r * row_bytes + g0 * kBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      _mm512_store_ps(scales + r * stride + g0, d);
      if constexpr (std::is_same_v<T, Q4_1>) {
        const __m512i m = _mm512_srli_epi32(dm, 16);
        _mm512_store_ps(offsets + r * stride + g0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m)));
      } else {
        _mm512_store_ps(offsets + r * stride + g0, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)));
      }
    }
  }
}

// per_block(block, its scales, its offsets) for each K-quant super-block of `rows` rows:
// kScales of each (of `count` a row) a super-block of kBytes.
template <int kBytes, int kScales, class PerBlock>
void EachSuperBlock(const uint8_t* row, size_t row_bytes, int64_t rows, int64_t count,
                    int64_t stride, float* scales, float* offsets, PerBlock&& per_block) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t s = 0; s < count / kScales; ++s) {
      per_block(row + r * row_bytes + s * kBytes, scales + r * stride + kScales * s,
                offsets + r * stride + kScales * s);
    }
  }
}

// Q4_K: a super-block's 8 scales d·sc and offsets −dmin·m from its packed 6-bit scales and
// mins (ggml's get_scale_min_k4, as KQuantScalesAndMins unpacks them).
template <>
void StepScales<Q4_K>(const uint8_t* row, size_t row_bytes, int64_t rows, int64_t groups,
                      int64_t stride, float* scales, float* offsets) {
  EachSuperBlock<144, 8>(row, row_bytes, rows, groups, stride, scales, offsets,
                         [](const uint8_t* b, float* sc, float* of) {
    uint32_t unpacked[4];  // the 8 scales, then the 8 mins, a byte each
    KQuantScalesAndMins(b + 4, unpacked);
    const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unpacked))));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unpacked + 2))));
    _mm256_store_ps(sc, _mm256_mul_ps(_mm256_set1_ps(Half(b)), codes));
    _mm256_store_ps(of, _mm256_mul_ps(_mm256_set1_ps(-Half(b + 2)), mins));
  });
}

// Q6_K: a super-block's 16 scales d·sc (int8 sc) and offsets −32·d·sc (exact).
template <>
void StepScales<Q6_K>(const uint8_t* row, size_t row_bytes, int64_t rows, int64_t groups,
                      int64_t stride, float* scales, float* offsets) {
  EachSuperBlock<210, 16>(row, row_bytes, rows, groups, stride, scales, offsets,
                          [](const uint8_t* b, float* sc, float* of) {
    const __m512 d = _mm512_mul_ps(
        _mm512_set1_ps(Half(b + 208)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
    _mm512_store_ps(sc, d);
    _mm512_store_ps(of, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)));
  });
}

// A decode step's Q4_0, Q4_1, Q4_K or Q6_K products on AVX-512: y for MI <= 4 activation
// rows against RJ weight rows, decoded by StepDecode<T> with the scales of StepScales. A
// weight here is a float lane (an int8 product takes a byte), so decoding, not bandwidth,
// bounds these products (SmolLM2's layers are Q4_1), and a span is decoded in few vector
// operations, the scales broadcast from memory (loads, not shuffles), two weight rows
// sharing each activation load. Measured (docs/kernels.md, "Float activations"): Q4_0 and
// Q4_1 1.3-1.5x faster a product than FusedAvx512, which converted each group's fp16
// scalars and summed its mins; Q4_K 1.4-2.3x at 1-3 rows (FusedAvx512), Q6_K 2.0-2.5x
// (FusedAvx2's 8 lanes); Q8_0 (no table: 256 codes) stays on FusedAvx512, this shape
// measured slower for it.
template <class T, int MI, int RJ>
void StepRows(const uint8_t* row, size_t row_bytes, int64_t k, const float* x, int64_t ldx,
              const float* scales, const float* offsets, int64_t stride, float* y,
              int64_t ldy) {
  constexpr int kSpans = StepDecode<T>::kSpans;
  __m512 total[MI][RJ][2];  // two sums a pair: two FMAs a span in flight
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) total[i][j][0] = total[i][j][1] = _mm512_setzero_ps();
  }
  for (int64_t g0 = 0; g0 < k / kGroup; g0 += kSpans) {
    __m512 w[RJ][2 * kSpans];
    for (int j = 0; j < RJ; ++j) {
      StepDecode<T>::Weights(row + j * row_bytes, g0, scales + j * stride,
                             offsets + j * stride, w[j]);
    }
    for (int s = 0; s < kSpans; ++s) {
      for (int i = 0; i < MI; ++i) {
        const float* xs = x + i * ldx + (g0 + s) * kGroup;
        const __m512 x0 = _mm512_loadu_ps(xs), x1 = _mm512_loadu_ps(xs + 16);
        for (int j = 0; j < RJ; ++j) {
          total[i][j][0] = _mm512_fmadd_ps(w[j][2 * s], x0, total[i][j][0]);
          total[i][j][1] = _mm512_fmadd_ps(w[j][2 * s + 1], x1, total[i][j][1]);
        }
      }
    }
  }
  for (int i = 0; i < MI; ++i) {
    for (int j = 0; j < RJ; ++j) {
      y[i * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(total[i][j][0], total[i][j][1]));
    }
  }
}

// A task's rows of W (r0 to r1) asked for from memory all at once, before its scales are
// gathered: the gathers touch every line of the rows, a gather's lines at a time, too few in
// flight to keep the memory busy where W does not fit the last-level cache. On a Zen 5 EPYC
// (32 MB L3) the default model's batch 1 went from 100-122 to 159-187 tok/s with it; on
// the Xeon of docs/kernels.md (260 MB L3) the file stays in cache (results/bench/
// 2026-12-04-zen5/). Prefetching the next task's rows too measured no better.
inline void PrefetchTask(const uint8_t* w, size_t row_bytes, int64_t r0, int64_t r1) {
  const uint8_t* const end = w + r1 * row_bytes;
  for (const uint8_t* p = w + r0 * row_bytes; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

// On AVX-512 StepRows takes M below kStepTo in passes of kStepRowsX activation rows (each
// pass decodes the weights again), the tile path from kStepTo. SmolLM2's default on a Zen 5
// EPYC (sized-speed, three alternations; results/bench/2026-12-04-zen5/): batch 4 304.7-353.5
// tok/s against the tile path's 243.3-278.3, batch 8 399.1-480.7 against 355.7-420.9; up
// to 15 rows, batch 16 measured slower than the tile (481.2-519.9 against 515.7-528.2).
constexpr int64_t kStepRowsX = 4;
constexpr int64_t kStepTo = 9;
// Y[:, r0:r1] by StepRows, two weight rows a step, their scales converted first.
template <class T>
void StepFusedRows(const uint8_t* w, size_t row_bytes, int64_t r0, int64_t r1, const Acts& a,
                   float* y, int64_t ldy) {
  const int64_t groups = a.k / StepDecode<T>::kScaleWeights, stride = (groups + 15) / 16 * 16;
  const int64_t rows = r1 - r0;
  float* const scales = step_scales.As<float>(static_cast<size_t>(2 * rows * stride));
  float* const offsets = scales + rows * stride;
  PrefetchTask(w, row_bytes, r0, r1);
  StepScales<T>(w + r0 * row_bytes, row_bytes, rows, groups, stride, scales, offsets);
  for (int64_t i0 = 0; i0 < a.m; i0 += kStepRowsX) {
    const int64_t mi = std::min<int64_t>(kStepRowsX, a.m - i0);
    const float* x = a.x + i0 * a.k;
    int64_t r = 0;
    auto step = [&](auto rj) {  // rows r, r + 1, … r + RJ - 1
      constexpr int RJ = decltype(rj)::value;
      const uint8_t* row = w + (r0 + r) * row_bytes;
      const float* sc = scales + r * stride;
      const float* of = offsets + r * stride;
      float* yr = y + i0 * ldy + r0 + r;
      switch (mi) {
        case 4: StepRows<T, 4, RJ>(row, row_bytes, a.k, x, a.k, sc, of, stride, yr, ldy); break;
        case 3: StepRows<T, 3, RJ>(row, row_bytes, a.k, x, a.k, sc, of, stride, yr, ldy); break;
        case 2: StepRows<T, 2, RJ>(row, row_bytes, a.k, x, a.k, sc, of, stride, yr, ldy); break;
        default: StepRows<T, 1, RJ>(row, row_bytes, a.k, x, a.k, sc, of, stride, yr, ldy);
      }
      r += RJ;
    };
    while (r + 2 <= rows) step(std::integral_constant<int, 2>());
    if (r < rows) step(std::integral_constant<int, 1>());
  }
}

// A tile's row as floats from StepDecode (its scales from StepScales): on AVX-512 several
// times faster than Dequantise's 8 lanes and scalar scales. Weights are scale·code + offset
// rounded once (ggml rounds Q4_0's, Q4_1's and Q4_K's product, then the sum; Q6_K's are
// its values exactly), within the summation-order tolerance every path is held to.
template <class T>
void StepDequantise(const uint8_t* row, int64_t k, const float* scales, const float* offsets,
                    float* out) {
  constexpr int kSpans = StepDecode<T>::kSpans;
  for (int64_t g0 = 0; g0 < k / kGroup; g0 += kSpans) {
    __m512 w[2 * kSpans];
    StepDecode<T>::Weights(row, g0, scales, offsets, w);
    for (int v = 0; v < 2 * kSpans; ++v) _mm512_storeu_ps(out + g0 * kGroup + 16 * v, w[v]);
  }
}

// out[16·j + l] = src[l][p0 + j] for j, l < 16: sixteen rows' 16 floats transposed (the
// usual unpack / 128-bit shuffle network), so packing a panel costs no scalar stores.
void Transpose16(const float* const* src, int64_t p0, float* out) {
  __m512 r[16], t[16];
  for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_ps(src[l] + p0);
  for (int l = 0; l < 16; l += 2) {
    t[l] = _mm512_unpacklo_ps(r[l], r[l + 1]);
    t[l + 1] = _mm512_unpackhi_ps(r[l], r[l + 1]);
  }
  for (int l = 0; l < 16; l += 4) {
    for (int h = 0; h < 2; ++h) {
      r[l + 2 * h] = _mm512_castpd_ps(
          _mm512_unpacklo_pd(_mm512_castps_pd(t[l + h]), _mm512_castps_pd(t[l + h + 2])));
      r[l + 2 * h + 1] = _mm512_castpd_ps(
          _mm512_unpackhi_pd(_mm512_castps_pd(t[l + h]), _mm512_castps_pd(t[l + h + 2])));
    }
  }
  for (int half = 0; half < 16; half += 8) {
    for (int l = 0; l < 4; ++l) {
      t[half + l] = _mm512_shuffle_f32x4(r[half + l], r[half + l + 4], 0x88);
      t[half + l + 4] = _mm512_shuffle_f32x4(r[half + l], r[half + l + 4], 0xdd);
    }
  }
  for (int l = 0; l < 8; ++l) {
    _mm512_store_ps(out + 16 * l, _mm512_shuffle_f32x4(t[l], t[l + 8], 0x88));
    _mm512_store_ps(out + 16 * (l + 8), _mm512_shuffle_f32x4(t[l], t[l + 8], 0xdd));
  }
}

// The wide path's kernel (a prompt's rows): Y[i, 16c + l] for MI activation rows and NP
// panels of 16 dequantised rows packed K-major (panel[p·16 + l] = row l's weight p), each
// activation broadcast against 16 rows at once: the products land in Y's rows as they are,
// no sums across lanes. `cols` of the NP·16 columns are real (the rest padding).
template <int MI, int NP>
void OuterAvx512(const float* x, int64_t ldx, const float* panels, int64_t k, float* y,
                 int64_t ldy, int cols) {
  __m512 acc[MI][NP];
  for (int i = 0; i < MI; ++i) {
    for (int c = 0; c < NP; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512 wv[NP];
    for (int c = 0; c < NP; ++c) wv[c] = _mm512_loadu_ps(panels + c * k * 16 + p * 16);
    for (int i = 0; i < MI; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + p]);
      for (int c = 0; c < NP; ++c) acc[i][c] = _mm512_fmadd_ps(xb, wv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MI; ++i) {
    for (int c = 0; c < NP; ++c) {
      const int n = std::min(16, cols - 16 * c);
      if (n >= 16) {
        _mm512_storeu_ps(y + i * ldy + 16 * c, acc[i][c]);
      } else if (n > 0) {
        _mm512_mask_storeu_ps(y + i * ldy + 16 * c, static_cast<__mmask16>((1u << n) - 1),
                              acc[i][c]);
      }
    }
  }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif

using FusedFn = void (*)(const uint8_t*, size_t, int64_t, int64_t, const Acts&, float*, int64_t);

// The fused kernel for `type`, or null (the tile path).
FusedFn Fused(ggml_type type, Level level) {
#if defined(ATTNSERVE_GGUF_X86)
  if (level == Level::kAvx512) {
    switch (type) {
      case GGML_TYPE_Q4_0: return StepFusedRows<Q4_0>;
      case GGML_TYPE_Q4_1: return StepFusedRows<Q4_1>;
      case GGML_TYPE_Q8_0: return FusedRows<FusedAvx512<Q8_0>>;
      case GGML_TYPE_Q4_K: return StepFusedRows<Q4_K>;
      case GGML_TYPE_Q6_K: return StepFusedRows<Q6_K>;
      default: break;
    }
  }
  if (level != Level::kGeneric) {
    switch (type) {
      case GGML_TYPE_Q4_0: return FusedRows<FusedAvx2<Q4_0>>;
      case GGML_TYPE_Q4_1: return FusedRows<FusedAvx2<Q4_1>>;
      case GGML_TYPE_Q8_0: return FusedRows<FusedAvx2<Q8_0>>;
      case GGML_TYPE_Q4_K: return FusedRows<FusedAvx2<Q4_K>>;
      case GGML_TYPE_Q6_K: return FusedRows<FusedAvx2<Q6_K>>;
      default: break;
    }
  }
#endif
  (void)type;
  (void)level;
  return nullptr;
}

using DequantiseFn = void (*)(const uint8_t*, int64_t, float*);

// Our decoder for `type` (the fused kernels' groups, stored), or null (ggml's to_float).
DequantiseFn Decoder(ggml_type type, Level level) {
#if defined(ATTNSERVE_GGUF_X86)
  if (level != Level::kGeneric) {
    switch (type) {
      case GGML_TYPE_Q4_0: return Dequantise<Q4_0>;
      case GGML_TYPE_Q4_1: return Dequantise<Q4_1>;
      case GGML_TYPE_Q8_0: return Dequantise<Q8_0>;
      case GGML_TYPE_Q4_K: return Dequantise<Q4_K>;
      case GGML_TYPE_Q6_K: return Dequantise<Q6_K>;
      default: break;
    }
  }
#endif
  (void)type;
  (void)level;
  return nullptr;
}

// The tile's decoder on AVX-512 (StepDecode's types): the task's rows' scales first
// (`scales`, as StepScales), then each row (`row`, as StepDequantise); else all null.
struct StepDecoder {
  using ScalesFn = void (*)(const uint8_t*, size_t, int64_t, int64_t, int64_t, float*, float*);
  using RowFn = void (*)(const uint8_t*, int64_t, const float*, const float*, float*);
  ScalesFn scales = nullptr;
  RowFn row = nullptr;
  int64_t scale_weights = 0;  // weights a scale
};

StepDecoder StepDecoderFor(ggml_type type, Level level) {
#if defined(ATTNSERVE_GGUF_X86)
  if (level == Level::kAvx512) {
    switch (type) {
      case GGML_TYPE_Q4_0: return {StepScales<Q4_0>, StepDequantise<Q4_0>, 32};
      case GGML_TYPE_Q4_1: return {StepScales<Q4_1>, StepDequantise<Q4_1>, 32};
      case GGML_TYPE_Q4_K: return {StepScales<Q4_K>, StepDequantise<Q4_K>, 32};
      case GGML_TYPE_Q6_K: return {StepScales<Q6_K>, StepDequantise<Q6_K>, 16};
      default: break;
    }
  }
#endif
  (void)type;
  (void)level;
  return {};
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

// The widest tile kernel here for an mi x rj corner (mi <= kRowsX, rj <= kTileRows).
template <int MI>
TileFn TileFor(int rj, Level level) {
#if defined(ATTNSERVE_GGUF_X86)
  if (level == Level::kAvx512) {
    switch (rj) {
      case 4: return TileAvx512<MI, 4>;
      case 3: return TileAvx512<MI, 3>;
      case 2: return TileAvx512<MI, 2>;
      default: return TileAvx512<MI, 1>;
    }
  }
  if (level == Level::kAvx2) {  // 16 registers: two weight rows a step
    return rj >= 2 ? TileAvx2<MI, 2> : TileAvx2<MI, 1>;
  }
#endif
  return rj >= 2 ? TileGeneric<MI, 2> : TileGeneric<MI, 1>;
}

// Weight rows a step of the tile kernel: 4 with AVX-512, else 2.
int TileStep(Level level) { return level == Level::kAvx512 ? 4 : 2; }

TileFn TileKernel(int mi, int rj, Level level) {
  switch (mi) {
    case 4: return TileFor<4>(rj, level);
    case 3: return TileFor<3>(rj, level);
    case 2: return TileFor<2>(rj, level);
    default: return TileFor<1>(rj, level);
  }
}

#if defined(ATTNSERVE_GGUF_X86)
using OuterFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int);
constexpr int kOuterRowsX = 6;    // 6 x 4 accumulators, 4 weight vectors: 29 of 32 registers
constexpr int kOuterPanels = 4;

template <int MI>
OuterFn OuterFor(int np) {
  switch (np) {
    case 4: return OuterAvx512<MI, 4>;
    case 3: return OuterAvx512<MI, 3>;
    case 2: return OuterAvx512<MI, 2>;
    default: return OuterAvx512<MI, 1>;
  }
}

OuterFn OuterKernel(int mi, int np) {
  switch (mi) {
    case 6: return OuterFor<6>(np);
    case 5: return OuterFor<5>(np);
    case 4: return OuterFor<4>(np);
    case 3: return OuterFor<3>(np);
    case 2: return OuterFor<2>(np);
    default: return OuterFor<1>(np);
  }
}

// Panels of 16 rows packed K-major, one per pool thread; it only grows.
thread_local AlignedScratch packed;

// Y[:, r0:r0+rows] from `dense` (rows, K) on the wide path: packed, then outer products.
// Scratch for the 16 dequantised rows of a panel and a row of zeros (its padding).
thread_local AlignedScratch panel_rows;

// `dequantise(r, out)`: weight row r of the task in floats, written at `out` (K of them) or
// where it already is; the pointer to them.
template <class RowFn>
void OuterRows(RowFn&& dequantise, int64_t rows, const Acts& a, float* y, int64_t ldy) {
  const int64_t k = a.k, panels = (rows + 15) / 16;
  float* const panel0 = packed.As<float>(static_cast<size_t>(panels * k * 16));  // (panels, K, 16)
  float* const scratch = panel_rows.As<float>(static_cast<size_t>(17 * k));      // (17, K)
  std::fill(scratch + 16 * k, scratch + 17 * k, 0.0f);
  for (int64_t c = 0; c < panels; ++c) {
    const float* src[16];
    for (int64_t l = 0; l < 16; ++l) {
      src[l] = 16 * c + l < rows ? dequantise(16 * c + l, scratch + l * k) : scratch + 16 * k;
    }
    float* panel = panel0 + c * k * 16;
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) Transpose16(src, p, panel + p * 16);
    for (; p < k; ++p) {
      for (int l = 0; l < 16; ++l) panel[p * 16 + l] = src[l][p];
    }
  }
  for (int64_t i0 = 0; i0 < a.m; i0 += kOuterRowsX) {
    const int mi = static_cast<int>(std::min<int64_t>(kOuterRowsX, a.m - i0));
    for (int64_t c0 = 0; c0 < panels; c0 += kOuterPanels) {
      const int np = static_cast<int>(std::min<int64_t>(kOuterPanels, panels - c0));
      const int cols = static_cast<int>(std::min<int64_t>(16 * np, rows - 16 * c0));
      OuterKernel(mi, np)(a.x + i0 * k, k, panel0 + c0 * k * 16, k,
                          y + i0 * ldy + 16 * c0, ldy, cols);
    }
  }
}
#endif

void TileRows(ggml_type type, Level level, const uint8_t* w, size_t row_bytes, int64_t r0,
              int64_t r1, const Acts& a, float* y, int64_t ldy) {
  const int64_t rows = r1 - r0, k = a.k;
  const StepDecoder decoder = StepDecoderFor(type, level);
  const DequantiseFn ours = Decoder(type, level);
  const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
  int64_t stride = 0;  // the task's rows' scales and offsets, for `decoder`
  float* scales = nullptr;
  if (decoder.row != nullptr) {
    PrefetchTask(w, row_bytes, r0, r1);
    const int64_t groups = k / decoder.scale_weights;
    stride = (groups + 15) / 16 * 16;
    scales = step_scales.As<float>(static_cast<size_t>(2 * rows * stride));
    decoder.scales(w + r0 * row_bytes, row_bytes, rows, groups, stride, scales,
                scales + rows * stride);
  }
  // Row r of the task in floats, at `out` (F32 rows: read where they are).
  auto dequantise = [&](int64_t r, float* out) -> const float* {
    const uint8_t* row = w + (r0 + r) * row_bytes;
    if (type == GGML_TYPE_F32) return reinterpret_cast<const float*>(row);
    if (decoder.row != nullptr) {
      decoder.row(row, k, scales + r * stride, scales + (rows + r) * stride, out);
    } else if (ours) {
      ours(row, k, out);
    } else {
      to_float(row, out, k);
    }
    return out;
  };
#if defined(ATTNSERVE_GGUF_X86)
  if (UsesOuter(level, a.m, k)) {
    OuterRows(dequantise, rows, a, y + r0, ldy);
    return;
  }
#endif
  // Each row dequantised once, then read from cache by every activation row.
  // (rows, K), rows whole lines apart where K allows
  float* const buffer = type == GGML_TYPE_F32 ? nullptr : tile.As<float>(static_cast<size_t>(rows * k));
  const float* dense = type == GGML_TYPE_F32 ? reinterpret_cast<const float*>(w + r0 * row_bytes)
                                             : buffer;
  if (type != GGML_TYPE_F32) {
    for (int64_t r = 0; r < rows; ++r) dequantise(r, buffer + r * k);
  }
  const int step = TileStep(level);
  for (int64_t i0 = 0; i0 < a.m; i0 += kRowsX) {
    const int mi = static_cast<int>(std::min<int64_t>(kRowsX, a.m - i0));
    for (int64_t j0 = 0; j0 < rows; j0 += step) {
      const int rj = static_cast<int>(std::min<int64_t>(step, rows - j0));
      TileKernel(mi, rj, level)(a.x + i0 * k, k, dense + j0 * k, k, k, y + i0 * ldy + r0 + j0, ldy);
    }
  }
}

}  // namespace

int64_t TaskRows(Level level, int64_t m, int64_t k) {
  // A prompt's rows: a tile of about kTileBytes, 64-128 rows on the outer-product path
  // (4 panels a step); with 16-row tiles a 2,048-token pass of SmolLM2's gate|up read X
  // from memory 192 times, more time than its products.
  constexpr int64_t kTileBytes = 256 * 1024;
  if (m < kWideFrom) return 16;
  const int64_t fit = kTileBytes / (static_cast<int64_t>(sizeof(float)) * k) / 16 * 16;
  const int64_t least = UsesOuter(level, m, k) ? 64 : 16;
  return std::clamp<int64_t>(fit, least, 128);
}

bool Covers(ggml_type type) {
  return type == GGML_TYPE_F32 || ggml_get_type_traits(type)->to_float != nullptr;
}

Level DetectLevel() {
#if defined(ATTNSERVE_GGUF_X86)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
      !__builtin_cpu_supports("f16c")) {
    return Level::kGeneric;
  }
  return __builtin_cpu_supports("avx512f") ? Level::kAvx512 : Level::kAvx2;
#else
  return Level::kGeneric;
#endif
}

const char* LevelName(Level level) {
  switch (level) {
    case Level::kAvx512: return "avx512";
    case Level::kAvx2: return "avx2";
    default: return "generic";
  }
}

bool NeedsGroupSums(ggml_type type, Level level, int64_t m) {
  // (StepRows folds Q4_1's and Q4_K's mins into its weights)
  return m < kTileFrom && Fused(type, level) != nullptr && level != Level::kAvx512 &&
         (type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q4_K);
}

void GroupSums(const float* x, int64_t m, int64_t k, float* sums) {
  const int64_t groups = k / kGroup;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + i * k + g * kGroup;
      float s = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) s += xg[j];
      sums[i * groups + g] = s;
    }
  }
}

void DotRows(ggml_type type, Level level, const uint8_t* w, size_t row_bytes, int64_t r0,
             int64_t r1, const Acts& acts, float* y, int64_t ldy) {
  const FusedFn fused = Fused(type, level);
  // The types StepDecode reads are StepFusedRows' on AVX-512, which goes on to kStepTo.
  const bool stepped = StepDecoderFor(type, level).row != nullptr;
  if (fused != nullptr && (acts.m < kTileFrom || (stepped && acts.m < kStepTo))) {
    fused(w, row_bytes, r0, r1, acts, y, ldy);
  } else {
    TileRows(type, level, w, row_bytes, r0, r1, acts, y, ldy);
  }
}

}  // namespace floatpath
}  // namespace attnserve_gguf
