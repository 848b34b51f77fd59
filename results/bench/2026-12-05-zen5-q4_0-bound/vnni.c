// vpdpbusd zmm throughput: 12 independent accumulators, N instructions, in seconds and in
// multiply-adds a second (64 each); with the core clock, MACs a cycle.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(void) {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const long iters = 200000000L;
  for (int rep = 0; rep < 3; ++rep) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
      __asm__ volatile("" : "+v"(a));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    long sum = 0;
    for (int j = 0; j < 12; ++j) sum += _mm512_reduce_add_epi32(acc[j]);
    printf("vpdpbusd zmm: %.1f G/s = %.0f GMAC/s (%.3f s, %ld)\n", iters * 12 / s / 1e9,
           iters * 12 * 64 / s / 1e9, s, sum);
  }
  return 0;
}
