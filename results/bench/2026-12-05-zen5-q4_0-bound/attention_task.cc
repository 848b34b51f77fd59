// CachedAttention's AVX-512 inner loops alone: one decode task (4 query heads, n keys, hs 64)
#include "service/ops/cached_attention.cc"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <algorithm>
using namespace attnserve_gguf::attention;
int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atol(argv[1]) : 128, hs = 64, heads = 4;
  const int64_t regions = argc > 2 ? atol(argv[2]) : 1;
  const int mode = argc > 3 ? atoi(argv[3]) : 0;  // distinct (row, kv head) caches cycled
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(regions) * 200 * hs), v(size_t(regions) * 200 * hs), q(heads * hs), s(heads * n), out(heads * hs);
  for (auto& x : k) x = nd(rng) * 0.1f;
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  std::vector<double> t;
  for (int rep = 0; rep < 9; ++rep) {
    const int iters = 2000;
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      const int64_t r = it % regions;
      if (mode == 1 || mode == 2) {  // this task's V, at its start
        const char* vb = reinterpret_cast<const char*>(v.data() + r * 200 * hs);
        for (int64_t line = 0; line < n * hs * 4; line += 64) if (mode == 1) _mm_prefetch(vb + line, _MM_HINT_T0); else _mm_prefetch(vb + line, _MM_HINT_T1);
      }
      if (mode == 3 || mode == 4) {  // the next task's K and V
        const int64_t r2 = (it + 1) % regions;
        const char* kb = reinterpret_cast<const char*>(k.data() + r2 * 200 * hs);
        const char* vb = reinterpret_cast<const char*>(v.data() + r2 * 200 * hs);
        for (int64_t line = 0; line < n * hs * 4; line += 64) {
          if (mode == 3) { _mm_prefetch(kb + line, _MM_HINT_T0); _mm_prefetch(vb + line, _MM_HINT_T0); }
          else { _mm_prefetch(kb + line, _MM_HINT_T1); _mm_prefetch(vb + line, _MM_HINT_T1); }
        }
      }
      const int64_t r2 = (it + 1) % regions;
      const char* kb = reinterpret_cast<const char*>(k.data() + r2 * 200 * hs);
      const char* vb = reinterpret_cast<const char*>(v.data() + r2 * 200 * hs);
      const int64_t bytes = n * hs * 4;
      if (mode == 5) for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(kb + line, _MM_HINT_T0);
      if (mode == 6) for (int64_t line = 0; line < bytes / 2; line += 64) _mm_prefetch(kb + line, _MM_HINT_T0);
      avx512::Scores(q.data(), heads, k.data() + r * 200 * hs, n, hs, s.data());
      if (mode == 6) for (int64_t line = bytes / 2; line < bytes; line += 64) _mm_prefetch(kb + line, _MM_HINT_T0);
      for (int64_t h = 0; h < heads; ++h) avx512::Softmax(s.data() + h * n, n);
      if (mode == 5) for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(vb + line, _MM_HINT_T0);
      if (mode == 6) for (int64_t line = 0; line < bytes / 2; line += 64) _mm_prefetch(vb + line, _MM_HINT_T0);
      avx512::WeightedSum(s.data(), heads, v.data() + r * 200 * hs, n, hs, out.data(), hs);
      if (mode == 6) for (int64_t line = bytes / 2; line < bytes; line += 64) _mm_prefetch(vb + line, _MM_HINT_T0);
    }
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  printf("mode %d n=%ld regions=%ld: %.2f us a task (median), out0 %g\n", mode, (long)n, (long)regions, t[4] * 1e6, out[0]);
}
