#include <gguf_float.cc>
#include <chrono>
#include <cstdio>
#include <vector>
using namespace attnserve_gguf::floatpath;
int main(int argc, char** argv) {
  const bool q8 = getenv("Q8"); const int64_t n = atoi(argv[1]), k = atoi(argv[2]), groups = k / 32, bb = q8 ? 34 : 20, rb = groups * bb;
  std::vector<uint8_t> w(n * rb);
  for (size_t i = 0; i < w.size(); ++i) w[i] = (uint8_t)(i * 2654435761u >> 13);
  for (int64_t r = 0; r < n; ++r) for (int64_t g = 0; g < groups; ++g) {
    uint8_t* b = &w[r * rb + g * bb]; b[0] = 0x00; b[1] = 0x2C; if (!q8) { b[2] = 0x00; b[3] = 0xAC; } }
  std::vector<float> sums(groups), y(n); float* xa = (float*)aligned_alloc(64, k*4); struct { float* p; float* data(){return p;} float& operator[](size_t i){return p[i];} } x{xa};
  for (int64_t i = 0; i < k; ++i) x[i] = 0.01f * (i % 17) - 0.05f;
  GroupSums(x.data(), 1, k, sums.data());
  Acts a{x.data(), 1, k, sums.data()};
  Level level = Level::kAvx512;
  auto fn = Fused(getenv("Q8") ? GGML_TYPE_Q8_0 : GGML_TYPE_Q4_1, level);
  int reps = 100; double s = 1e9;
  for (int rep = 0; rep < 50; ++rep) for (int64_t r0 = 0; r0 < n; r0 += 16) fn(w.data(), rb, r0, r0 + 16, a, y.data(), n);
  for (int block = 0; block < 30; ++block) {
    auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < reps; ++rep) for (int64_t r0 = 0; r0 < n; r0 += 16) fn(w.data(), rb, r0, r0 + 16, a, y.data(), n);
    auto t1 = std::chrono::steady_clock::now();
    s = std::min(s, std::chrono::duration<double>(t1 - t0).count());
  }
  printf("%.1f us a product, %.2f ns a group-row (y0 %g)\n", s / reps * 1e6, s / reps / (n * groups) * 1e9, y[0]);
}
