// experiments on the lanes kernel: which part bounds it
#include "service/ops/gguf_rowdot.cc"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
using namespace attnserve_gguf::rowdot;
namespace attnserve_gguf { namespace rowdot {
ATTNSERVE_BEGIN_AVX512_VNNI
template <int R, int V>
__attribute__((noinline)) void Exp(int blocks, const uint8_t* w, size_t group_bytes, const uint8_t* xq,
                   size_t xq_bytes, const Q8_0Term* terms, float* y, size_t y_stride) {
  const __m512i low4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i high4 = _mm512_add_epi32(low4, _mm512_set1_epi32(1));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x88));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  __m512i iacc[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm512_setzero_ps(); iacc[r] = _mm512_setzero_si512(); }
  __m512i lo[4], hi[4];
  __m512 scales = _mm512_set1_ps(1.0f);
  for (int b = 0; b < blocks; ++b, w += kQ4_0x8Bytes) {
    const uint8_t* w1 = w + group_bytes;
    if (V != 3 || b == 0) {
    const __m512i a0 = _mm512_loadu_si512(w + 16), a1 = _mm512_loadu_si512(w1 + 16);
    const __m512i b0 = _mm512_loadu_si512(w + 80), b1 = _mm512_loadu_si512(w1 + 80);
    const __m512i quads[4] = {_mm512_permutex2var_epi32(a0, low4, a1),
                              _mm512_permutex2var_epi32(a0, high4, a1),
                              _mm512_permutex2var_epi32(b0, low4, b1),
                              _mm512_permutex2var_epi32(b0, high4, b1)};
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_ternarylogic_epi32(quads[j], flip, nibble, 0x28);
      hi[j] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(quads[j], 4), flip, nibble, 0x28);
    }
    scales = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1)), 1));
    }
    for (int r = 0; r < R; ++r) {
      const Q8_0Term& term = terms[r * blocks + b];
      const uint8_t* x = xq + r * xq_bytes + b * kQ8_0Bytes + 2;
      if (V == 1) {  // ints only: no float epilogue, no start
        for (int j = 0; j < 4; ++j) {
          int32_t lc, hc; std::memcpy(&lc, x + 4 * j, 4); std::memcpy(&hc, x + 16 + 4 * j, 4);
          iacc[r] = _mm512_dpbusd_epi32(iacc[r], lo[j], _mm512_set1_epi32(lc));
          iacc[r] = _mm512_dpbusd_epi32(iacc[r], hi[j], _mm512_set1_epi32(hc));
        }
        continue;
      }
      if (V == 2) {  // no broadcasts: activation a register
        __m512i dot = _mm512_set1_epi32(term.offset);
        for (int j = 0; j < 4; ++j) {
          dot = _mm512_dpbusd_epi32(dot, lo[j], hi[3 - j]);
          dot = _mm512_dpbusd_epi32(dot, hi[j], lo[3 - j]);
        }
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)),
                                 _mm512_cvtepi32_ps(dot), acc[r]);
        continue;
      }
      if (V == 5) {  // embedded broadcasts by asm
        __m512i dot = _mm512_set1_epi32(term.offset);
#define DP(O, C) __asm__("vpdpbusd " #O "(%[x])%{1to16%}, %[c], %[d]" : [d] "+v"(dot) : [c] "v"(C), [x] "r"(x))
        DP(0, lo[0]); DP(16, hi[0]); DP(4, lo[1]); DP(20, hi[1]);
        DP(8, lo[2]); DP(24, hi[2]); DP(12, lo[3]); DP(28, hi[3]);
#undef DP
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)),
                                 _mm512_cvtepi32_ps(dot), acc[r]);
        continue;
      }
      if (V == 4) {  // two chains
        __m512i d0 = _mm512_set1_epi32(term.offset), d1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          int32_t lc, hc; std::memcpy(&lc, x + 4 * j, 4); std::memcpy(&hc, x + 16 + 4 * j, 4);
          d0 = _mm512_dpbusd_epi32(d0, lo[j], _mm512_set1_epi32(lc));
          d1 = _mm512_dpbusd_epi32(d1, hi[j], _mm512_set1_epi32(hc));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)),
                                 _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), acc[r]);
        continue;
      }
      __m512i dot = _mm512_set1_epi32(term.offset);
      for (int j = 0; j < 4; ++j) {
        int32_t lc, hc; std::memcpy(&lc, x + 4 * j, 4); std::memcpy(&hc, x + 16 + 4 * j, 4);
        dot = _mm512_dpbusd_epi32(dot, lo[j], _mm512_set1_epi32(lc));
        dot = _mm512_dpbusd_epi32(dot, hi[j], _mm512_set1_epi32(hc));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)),
                               _mm512_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, _mm512_add_ps(acc[r], _mm512_cvtepi32_ps(iacc[r])));
}
ATTNSERVE_END_AVX512_VNNI
}}
template <int R, int V> double Run(int k, int n, const std::vector<uint8_t>& w, const std::vector<uint8_t>& xq, const std::vector<Q8_0Term>& terms, std::vector<float>& y) {
  const int groups = n / 8, blocks = k / 32;
  const size_t gb = size_t(blocks) * 144;
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int iters = 3000;
    for (int it = 0; it < iters; ++it)
      for (int g = 0; g < groups; g += 2)
        Exp<R, V>(blocks, w.data() + g * gb, gb, xq.data(), size_t(blocks) * 34, terms.data(), y.data() + 8 * g, n);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  return double(k) * n * R / best / 1e9;
}
// The library's gemv (two groups a pass over W in cache) on the same W, 8 rows.
double Library(int k, int n, const std::vector<uint8_t>& w, const std::vector<uint8_t>& xq,
               const std::vector<Q8_0Term>& terms, std::vector<float>& y) {
  const int blocks = k / 32;
  const RepackedGemv gemv = RepackedFor(GGML_TYPE_Q4_0);
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int iters = 3000;
    for (int it = 0; it < iters; ++it)
      gemv(k, w.data(), n / 8, xq.data(), size_t(blocks) * 34, 8, terms.data(), y.data(), n, true);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  return double(k) * n * 8 / best / 1e9;
}
int main() {
  const int k = 2048, n = 64, m = 16, blocks = k / 32;
  std::vector<uint8_t> w(size_t(n / 8) * blocks * 144);
  std::mt19937 rng(1);
  for (auto& b : w) b = rng();
  std::vector<uint8_t> xq(size_t(m) * blocks * 34);
  for (auto& b : xq) b = rng() & 0x3F;
  std::vector<Q8_0Term> terms(size_t(m) * blocks, Q8_0Term{3, 1.0f});
  std::vector<float> y(size_t(m) * n);
  printf("library pair R8: %.1f\n", Library(k, n, w, xq, terms, y));
  printf("V0 base R8: %.1f\n", Run<8, 0>(k, n, w, xq, terms, y));
  printf("V1 ints only R8: %.1f\n", Run<8, 1>(k, n, w, xq, terms, y));
  printf("V2 no bcast R8: %.1f\n", Run<8, 2>(k, n, w, xq, terms, y));
  printf("V3 no unpack R8: %.1f\n", Run<8, 3>(k, n, w, xq, terms, y));
  printf("V4 two chains R8: %.1f\n", Run<8, 4>(k, n, w, xq, terms, y));
  printf("V5 asm bcast R8: %.1f\n", Run<8, 5>(k, n, w, xq, terms, y));
  printf("V5 asm bcast R16: %.1f\n", Run<16, 5>(k, n, w, xq, terms, y));
  printf("V0 base R12: %.1f\n", Run<12, 0>(k, n, w, xq, terms, y));
  printf("V0 base R16: %.1f\n", Run<16, 0>(k, n, w, xq, terms, y));
  printf("V3 no unpack R16: %.1f\n", Run<16, 3>(k, n, w, xq, terms, y));
}
