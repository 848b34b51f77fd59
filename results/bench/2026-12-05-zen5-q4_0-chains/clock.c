// Core clock against the TSC: a chain of dependent 1-cycle adds (N of them) timed by rdtsc
// and by clock_gettime: GHz = adds / seconds (each add one cycle).
#include <stdio.h>
#include <stdint.h>
#include <time.h>
#include <x86intrin.h>
int main(void) {
  const long n = 2000000000L;
  for (int rep = 0; rep < 3; ++rep) {
    struct timespec a, b;
    uint64_t x = 1;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i += 8) {
      __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                       "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
    printf("core clock %.2f GHz (%.3f s, x=%lu)\n", n / s / 1e9, s, (unsigned long)x);
  }
  return 0;
}
