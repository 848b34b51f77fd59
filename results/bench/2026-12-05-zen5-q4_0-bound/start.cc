// the library's pair kernel (R = 8, W in L2) against variants of its start vector
#include "service/ops/gguf_rowdot.cc"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <algorithm>
using namespace attnserve_gguf::rowdot;
namespace attnserve_gguf { namespace rowdot {
ATTNSERVE_BEGIN_AVX512_VNNI
template <int V>
inline __m512i Sums(const Q4_0x8Codes& c, const Q8_0Eights& x, const Q8_0Term& term) {
  const __m512i start = V == 0 ? _mm512_maskz_set1_epi32(0x5555, term.offset)
                               : _mm512_set1_epi32(term.offset / 2);  // both lanes: −4·Σy each
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
      start, c.lo0, x.e[0]), c.lo1, x.e[1]), c.hi0, x.e[2]), c.hi1, x.e[3]);
}
template <int R, int V>
__attribute__((noinline)) void PairV(int blocks, const uint8_t* w, size_t group_bytes, const uint8_t* xq,
           size_t xq_bytes, const Q8_0Term* terms, float* y, size_t y_stride) {
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b, w += kQ4_0x8Bytes) {
    const Q4_0x8Codes codes0 = LoadCodes(w), codes1 = LoadCodes(w + group_bytes);
    const __m512 scales = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + group_bytes)), 1));
    for (int r = 0; r < R; ++r) {
      const Q8_0Term& term = terms[r * blocks + b];
      const Q8_0Eights eights = LoadEights(xq + r * xq_bytes + b * kQ8_0Bytes);
      const __m512i h0 = Sums<V>(codes0, eights, term), h1 = Sums<V>(codes1, eights, term);
      const __m512i dot = _mm512_add_epi32(_mm512_permutex2var_epi32(h0, first, h1),
                                           _mm512_permutex2var_epi32(h0, second, h1));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)), _mm512_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}
ATTNSERVE_END_AVX512_VNNI
}}
template <int V> double Run(int k, int n, const std::vector<uint8_t>& w, const std::vector<uint8_t>& xq, const std::vector<Q8_0Term>& terms, std::vector<float>& y) {
  const int groups = n / 8, blocks = k / 32;
  const size_t gb = size_t(blocks) * 144;
  std::vector<double> t;
  for (int rep = 0; rep < 9; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int iters = 3000;
    for (int it = 0; it < iters; ++it)
      for (int g = 0; g < groups; g += 2)
        PairV<8, V>(blocks, w.data() + g * gb, gb, xq.data(), size_t(blocks) * 34, terms.data(), y.data() + 8 * g, n);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return double(k) * n * 8 / t[t.size() / 2] / 1e9;
}
int main() {
  const int k = 2048, n = 64, m = 8, blocks = k / 32;
  std::vector<uint8_t> w(size_t(n / 8) * blocks * 144);
  std::mt19937 rng(1);
  for (auto& b : w) b = rng();
  for (size_t g = 0; g < w.size() / 144; ++g) for (int i = 0; i < 8; ++i) { w[g*144+2*i] = 0; w[g*144+2*i+1] = 0x3C; }
  std::vector<uint8_t> xq(size_t(m) * blocks * 34);
  for (auto& b : xq) b = rng();
  for (size_t b = 0; b < size_t(m) * blocks; ++b) { xq[b * 34] = 0; xq[b * 34 + 1] = 0x3C; }
  std::vector<Q8_0Term> terms(size_t(m) * blocks);
  for (int r = 0; r < m; ++r) Q8_0Terms(xq.data() + size_t(r) * blocks * 34, k, terms.data() + size_t(r) * blocks);
  std::vector<float> y0(size_t(m) * n), y1(size_t(m) * n);
  for (int round = 0; round < 3; ++round) {
    printf("masked start (library): %.1f GMAC/s\n", Run<0>(k, n, w, xq, terms, y0));
    printf("halved start in both lanes: %.1f GMAC/s\n", Run<1>(k, n, w, xq, terms, y1));
  }
  printf("equal: %d\n", y0 == y1);
}
