// chunk-major passes: every 8 activation rows over a chunk of CB blocks of a task's rows before the next chunk
#include "service/ops/gguf_rowdot.cc"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <thread>
#include <atomic>
#include <barrier>
using namespace attnserve_gguf::rowdot;
namespace attnserve_gguf { namespace rowdot {
ATTNSERVE_BEGIN_AVX512_VNNI
template <int R>
void Chunk(int b0, int b1, int blocks, const uint8_t* w, size_t group_bytes, const uint8_t* xq,
           size_t xq_bytes, const Q8_0Term* terms, float* y, size_t y_stride, bool prefetch) {
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * y_stride);
  w += b0 * kQ4_0x8Bytes;
  for (int b = b0; b < b1; ++b, w += kQ4_0x8Bytes) {
    const uint8_t* w1 = w + group_bytes;
    if (prefetch) {
      for (size_t line = 0; line < kQ4_0x8Bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(w + 32 * kQ4_0x8Bytes + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + 32 * kQ4_0x8Bytes + line), _MM_HINT_T0);
      }
    }
    const __m512 scales = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1)), 1));
    {
      const Q4_0x8Codes codes0 = LoadCodes(w), codes1 = LoadCodes(w + group_bytes);
      for (int r = 0; r < R; ++r) {
        const Q8_0Term& term = terms[r * blocks + b];
        const Q8_0Eights eights = LoadEights(xq + r * xq_bytes + b * kQ8_0Bytes);
        const __m512i halves0 = RowSums<(R < 4)>(codes0, eights, term);
        const __m512i halves1 = RowSums<(R < 4)>(codes1, eights, term);
        const __m512i dot = _mm512_add_epi32(_mm512_permutex2var_epi32(halves0, first, halves1),
                                             _mm512_permutex2var_epi32(halves0, second, halves1));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)), _mm512_cvtepi32_ps(dot), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}
ATTNSERVE_END_AVX512_VNNI
}}
int main(int argc, char** argv) {
  const int k = 2048, n = argc > 1 ? atoi(argv[1]) : 65536, m = 32;
  const int mode = argc > 2 ? atoi(argv[2]) : 0;  // 0: the library's passes; 1: chunk-major passes
  const int cb = argc > 3 ? atoi(argv[3]) : 16;
  const int threads = 2, task_rows = 16, blocks = k / 32;
  const size_t row_bytes = blocks * 18, gb = blocks * 144;
  std::vector<uint8_t> w(size_t(n) * row_bytes);
  std::mt19937 rng(1);
  for (auto& b : w) b = rng();
  for (size_t g = 0; g < w.size() / 144; ++g) for (int i = 0; i < 8; ++i) { w[g*144+2*i] = 0; w[g*144+2*i+1] = 0x3C; }
  std::vector<uint8_t> xq(size_t(m) * blocks * 34);
  for (auto& b : xq) b = rng() & 0x3F;
  for (size_t b = 0; b < size_t(m) * blocks; ++b) { xq[b * 34] = 0; xq[b * 34 + 1] = 0x3C; }
  std::vector<Q8_0Term> terms(size_t(m) * blocks);
  for (int r = 0; r < m; ++r) Q8_0Terms(xq.data() + size_t(r) * blocks * 34, k, terms.data() + size_t(r) * blocks);
  float* y = static_cast<float*>(std::aligned_alloc(64, size_t(m) * n * 4));
  auto gemv = RepackedFor(GGML_TYPE_Q4_0);
  const int reps = 12;
  std::atomic<int> next{0};
  std::vector<double> times;
  std::barrier sync(threads, [&]() noexcept {});
  auto t0 = std::chrono::steady_clock::now();
  auto work = [&](int id) {
    for (int rep = 0; rep < reps; ++rep) {
      sync.arrive_and_wait();
      if (id == 0) { t0 = std::chrono::steady_clock::now(); next = 0; }
      sync.arrive_and_wait();
      for (;;) {
        int t = next.fetch_add(1);
        if (t * task_rows >= n) break;
        const int64_t r0 = int64_t(t) * task_rows;
        const uint8_t* wt = w.data() + r0 * row_bytes;
        if (mode == 0) {
          for (int i = 0; i < m; i += 8)
            gemv(k, wt, task_rows / 8, xq.data() + size_t(i) * blocks * 34, blocks * 34, 8,
                 terms.data() + size_t(i) * blocks, y + size_t(i) * n + r0, n, i > 0);
        } else {
          for (int c = 0; c < blocks; c += cb)
            for (int i = 0; i < m; i += 8) {
              Chunk<8>(c, std::min(c + cb, blocks), blocks, wt, gb, xq.data() + size_t(i) * blocks * 34, blocks * 34, terms.data() + size_t(i) * blocks, y + size_t(i) * n + r0, n, i == 0);
            }
        }
      }
      sync.arrive_and_wait();
      if (id == 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  };
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) ts.emplace_back(work, i);
  for (auto& th : ts) th.join();
  std::sort(times.begin(), times.end());
  double s = times[times.size() / 2];
  double check = 0; for (int i = 0; i < m; ++i) check += y[size_t(i) * n + 5];
  printf("n=%d mode=%d cb=%d: median %.2f ms (min %.2f), %.1f GMAC/s, check %g\n", n, mode, cb, s * 1e3, times[0]*1e3, double(k) * n * m / s / 1e9, check);
}
