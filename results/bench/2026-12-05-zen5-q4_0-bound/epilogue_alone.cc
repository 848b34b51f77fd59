// The SwiGLU epilogue alone, one thread: epilogue_alone M HALF (from the repository root:
// g++ -O3 -march=native -std=c++17 -I. -Iservice/ops THIS -o /tmp/epilogue_alone)
#include "service/ops/gguf_epilogue.cc"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <algorithm>
int main(int argc, char** argv) {
  const int64_t m = atoi(argv[1]), half = atoi(argv[2]);
  std::vector<float> y(m * 2 * half), out(m * half);
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  for (auto& v : y) v = nd(rng) * 3;
  std::vector<double> t;
  for (int rep = 0; rep < 9; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 200; ++it) attnserve_gguf::epilogue::Swiglu(y.data(), half, 0, m, out.data());
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 200);
  }
  std::sort(t.begin(), t.end());
  printf("m=%ld half=%ld: %.1f us, %.3f ns an output, out0 %g\n", (long)m, (long)half, t[4] * 1e6, t[4] * 1e9 / (m * half), out[0]);
}
