// Row dots of ours for Q4_K and Q6_K against Q8_K on AVX-512: see gguf_rowdot.h. The
// blocks as ggml stores them (ggml-common.h):
//   block_q4_K (144 bytes): d, dmin (fp16); scales[12]: 8 6-bit scales and 8 6-bit mins;
//     qs[128]: byte 32j + l holds weight 64j + l (low nibble) and 64j + 32 + l (high);
//     w = d·scale_s·q − dmin·min_s over sub-block s of 32 weights.
//   block_q6_K (210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8, d
//     (fp16); w = d·scale_s·(q − 32) over sub-block s of 16 weights.
//   block_q8_K (292 bytes): d (float), qs[256] int8, bsums[16]: the sums of each 16 codes.

#include "gguf_rowdot.h"
#include "gguf_ops.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define ATTNSERVE_ROWDOT_X86 1
#include <immintrin.h>
#endif

namespace attnserve_gguf {
namespace rowdot {

#if defined(ATTNSERVE_ROWDOT_X86)
ATTNSERVE_BEGIN_AVX512_VNNI
namespace {

constexpr int kSuperBlock = 256;  // weights a K-quant block
constexpr size_t kQ4KBytes = 144;
constexpr size_t kQ6KBytes = 210;
constexpr size_t kQ8KBytes = 292;
// Software prefetch this many blocks ahead of the one being dotted (into the next rows at a
// row's end: W's rows are contiguous). Without it the kernel waited on memory between
// blocks: one Q4_K product (4096 x 4096, one thread's CPU time) 1.3-1.7 ms without, 0.8-1.0
// with 32 blocks (4.6 KB) ahead; served, the 1B Q4_K_M preset's batch 1 went from 19-20 to
// 30 tok/s on the Xeon of docs/kernels.md (results/bench/2026-12-03-xeon-rowdot/).
constexpr int kPrefetchBlocks = 32;

// The cache lines of the block `ahead` blocks after `block` (`bytes` long each).
inline void PrefetchAhead(const uint8_t* block, size_t bytes) {
  const uint8_t* target = block + kPrefetchBlocks * bytes;
  for (size_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(target + line), _MM_HINT_T0);
  }
}

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// Q8_K's scale and codes.
inline float ActScale(const uint8_t* block) {
  float d;
  std::memcpy(&d, block, sizeof d);
  return d;
}
inline const int8_t* ActCodes(const uint8_t* block) {
  return reinterpret_cast<const int8_t*>(block + 4);
}
inline const int16_t* ActSums(const uint8_t* block) {
  return reinterpret_cast<const int16_t*>(block + 4 + kSuperBlock);
}

// 64 activation codes: y[a, a + 32) then y[b, b + 32).
inline __m512i Halves(const int8_t* y, int a, int b) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + a));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + b));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// A vpermw index: int16 lanes [0, 16) take lane a of the source, [16, 32) lane b; with
// `eighths`, lanes [8i, 8i + 8) take lane a + i (Q6_K's 16-weight sub-blocks).
inline __m512i LaneIndex(int a, int b, bool eighths) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) {
    idx[i] = static_cast<int16_t>(eighths ? a + i / 8 : (i < 16 ? a : b));
  }
  return _mm512_load_si512(idx);
}

inline float Sum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

inline float Sum16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // + the other 256-bit half
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));  // + the neighbouring 128 bits
  return Sum4(_mm512_castps512_ps128(v));
}

// Q4_K · Q8_K over n weights. Per super-block: two 64-byte loads of qs; their low and high
// nibbles are sub-blocks (0 | 2), (1 | 3), (4 | 6), (5 | 7), each against the two matching
// 32-code halves of y; maddubs gives int16 pair sums, dpwssd multiplies them by the
// sub-block's scale (vpermw spreads the 8 scales over the lanes) and sums into int32.
void DotQ4K(int n, float* s, size_t, const void* vx, size_t, const void* vy, size_t, int) {
  const auto* x = static_cast<const uint8_t*>(vx);
  const auto* y = static_cast<const uint8_t*>(vy);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i lo0 = LaneIndex(0, 2, false), hi0 = LaneIndex(1, 3, false);
  const __m512i lo1 = LaneIndex(4, 6, false), hi1 = LaneIndex(5, 7, false);
  __m512 acc = _mm512_setzero_ps();
  __m128 acc_min = _mm_setzero_ps();
  for (int b = 0; b < n / kSuperBlock; ++b, x += kQ4KBytes, y += kQ8KBytes) {
    PrefetchAhead(x, kQ4KBytes);
    const float yd = ActScale(y);
    const int8_t* q8 = ActCodes(y);
    uint32_t t[4];  // the 8 scales then the 8 mins as bytes
    KQuantScalesAndMins(x + 4, t);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
    const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(bytes));  // lanes 0-7
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(bytes, 8));         // (8,) int16

    const __m512i w0 = _mm512_loadu_si512(x + 16);  // sub-blocks 0-3
    const __m512i w1 = _mm512_loadu_si512(x + 80);  // 4-7
    const __m512i p0 = _mm512_maddubs_epi16(_mm512_and_si512(w0, nibble), Halves(q8, 0, 64));
    const __m512i p1 = _mm512_maddubs_epi16(
        _mm512_and_si512(_mm512_srli_epi16(w0, 4), nibble), Halves(q8, 32, 96));
    const __m512i p2 = _mm512_maddubs_epi16(_mm512_and_si512(w1, nibble), Halves(q8, 128, 192));
    const __m512i p3 = _mm512_maddubs_epi16(
        _mm512_and_si512(_mm512_srli_epi16(w1, 4), nibble), Halves(q8, 160, 224));
    __m512i even = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p0,
                                       _mm512_permutexvar_epi16(lo0, scales));
    __m512i odd = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p1,
                                      _mm512_permutexvar_epi16(hi0, scales));
    even = _mm512_dpwssd_epi32(even, p2, _mm512_permutexvar_epi16(lo1, scales));
    odd = _mm512_dpwssd_epi32(odd, p3, _mm512_permutexvar_epi16(hi1, scales));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(yd * Half(x)),
                          _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), acc);
    // The mins against the sums of each 32 codes (bsums in pairs).
    const int16_t* sums = ActSums(y);
    const __m128i pairs =
        _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sums)),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums + 8)));
    acc_min = _mm_fmadd_ps(_mm_set1_ps(yd * Half(x + 2)),
                           _mm_cvtepi32_ps(_mm_madd_epi16(mins, pairs)), acc_min);
  }
  *s = Sum16(acc) - Sum4(acc_min);
}

// Q6_K · Q8_K over n weights. Per half super-block (128 weights): ql's 64 bytes give the low
// 4 bits of weights [0, 64) (low nibbles) and [64, 128) (high), qh's 32 bytes, twice, the 2
// high bits (shifted by 0 | 2 and 4 | 6 per 256-bit half); the codes u = q + 32 (0-63)
// against 64 contiguous activation codes each. The −32 is taken once per super-block from
// y's 16-code sums, which have Q6_K's sub-block size.
void DotQ6K(int n, float* s, size_t, const void* vx, size_t, const void* vy, size_t, int) {
  const auto* x = static_cast<const uint8_t*>(vx);
  const auto* y = static_cast<const uint8_t*>(vy);
  const __m512i nibble = _mm512_set1_epi8(0x0F), two_bits = _mm512_set1_epi8(0x03);
  const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  const __m512i lo[2] = {LaneIndex(0, 0, true), LaneIndex(8, 0, true)};
  const __m512i hi[2] = {LaneIndex(4, 0, true), LaneIndex(12, 0, true)};
  __m512 acc = _mm512_setzero_ps();
  for (int b = 0; b < n / kSuperBlock; ++b, x += kQ6KBytes, y += kQ8KBytes) {
    PrefetchAhead(x, kQ6KBytes);
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 192));
    const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);  // (16,) int16
    const __m512i scales = _mm512_castsi256_si512(scales16);
    const int8_t* q8 = ActCodes(y);
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i low4 = _mm512_loadu_si512(ql + 64 * h);
      const __m512i high2 = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
      const __m512i u_lo = _mm512_or_si512(
          _mm512_and_si512(low4, nibble),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high2, shift_lo), two_bits), 4));
      const __m512i u_hi = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(low4, 4), nibble),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high2, shift_hi), two_bits), 4));
      const __m512i y_lo = _mm512_loadu_si512(q8 + 128 * h);
      const __m512i y_hi = _mm512_loadu_si512(q8 + 128 * h + 64);
      sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u_lo, y_lo),
                                _mm512_permutexvar_epi16(lo[h], scales));
      sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u_hi, y_hi),
                                _mm512_permutexvar_epi16(hi[h], scales));
    }
    // Σ scale_s · 32 · (sum of sub-block s's codes), taken off in int32.
    const __m256i offset = _mm256_madd_epi16(
        scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ActSums(y))));
    sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_slli_epi32(offset, 5)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(ActScale(y) * Half(x + 208)), _mm512_cvtepi32_ps(sum),
                          acc);
  }
  *s = Sum16(acc);
}

// Q4_0 in ggml's repack layout against Q8_0 (34 bytes: fp16 d, 32 codes), R activation
// rows in one pass over W. A block_q4_0x8 (144 bytes) holds the 8 rows' fp16 scales, then
// their 16 quant bytes in 8-byte pieces: bytes [16, 80) each row's bytes 0-7 in turn, [80,
// 144) its bytes 8-15, every byte XOR 0x88. Undone, the nibbles are the file's codes q
// (0-15; low: weights 0-15 of the block, high: 16-31), so vpdpbusd takes them as the
// unsigned side against the activation codes broadcast 8 at a time, 4 instructions a block
// of 8 rows; w = q - 8 is Σ q·y - 8·Σ y, the second term from `terms` (Q8_0Terms), which
// starts each block's chain of instructions (and gives the block's scale as a float).
constexpr size_t kQ4_0x8Bytes = 144;
constexpr size_t kQ8_0Bytes = 34;
constexpr int kQ4_0Block = 32;
// Blocks of 8 rows prefetched ahead (4.6 KB): one product at M = 1 (8192 x 8192, one
// thread's CPU time, the Xeon) 1.7-1.9 ms against 3.2-3.6 without, 2.2 at 16, 1.8-2.1 at 64.
constexpr int kRepackedPrefetchBlocks = 32;

inline __m512i Eight(const uint8_t* codes) {  // 8 activation codes in every 64-bit lane
  int64_t v;
  std::memcpy(&v, codes, sizeof v);
  return _mm512_set1_epi64(v);
}

// A block of 8 rows' codes, the layout's XOR undone: low and high nibbles of the rows' bytes
// 0-7 (lo0, hi0) and 8-15 (lo1, hi1), each 64-bit lane one row's.
struct Q4_0x8Codes {
  __m512i lo0, lo1, hi0, hi1;
};

inline Q4_0x8Codes LoadCodes(const uint8_t* block) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x88));
  const uint8_t* ahead = block + kRepackedPrefetchBlocks * kQ4_0x8Bytes;
  for (size_t line = 0; line < kQ4_0x8Bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
  const __m512i q0 = _mm512_xor_si512(_mm512_loadu_si512(block + 16), flip);  // bytes 0-7
  const __m512i q1 = _mm512_xor_si512(_mm512_loadu_si512(block + 80), flip);  // 8-15
  return {_mm512_and_si512(q0, nibble), _mm512_and_si512(q1, nibble),
          _mm512_and_si512(_mm512_srli_epi16(q0, 4), nibble),
          _mm512_and_si512(_mm512_srli_epi16(q1, 4), nibble)};
}

// An activation block's 32 codes, 8 at a time in every 64-bit lane.
struct Q8_0Eights {
  __m512i e[4];
};

inline Q8_0Eights LoadEights(const uint8_t* x) {
  return {{Eight(x + 2), Eight(x + 10), Eight(x + 18), Eight(x + 26)}};
}

// (16,) int32: Σ (q - 8)·y of row i over the block's 32 weights in lanes 2i and 2i + 1
// (its weights 0-3, 8-11, 16-19, 24-27 and the others), the -8 · Σ y of `term` in lane 2i,
// where the vpdpbusd start: no zeroing or subtraction. For many activation rows one chain
// of four (no addition: other rows' chains fill the latency); for few, two chains of two.
template <bool kTwoChains>
inline __m512i RowSums(const Q4_0x8Codes& c, const Q8_0Eights& x, const Q8_0Term& term) {
  const __m512i start = _mm512_maskz_set1_epi32(0x5555, term.offset);
  if constexpr (kTwoChains) {
    const __m512i low = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, c.lo0, x.e[0]), c.lo1,
                                            x.e[1]);
    const __m512i high = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), c.hi0, x.e[2]), c.hi1, x.e[3]);
    return _mm512_add_epi32(low, high);
  }
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
      start, c.lo0, x.e[0]), c.lo1, x.e[1]), c.hi0, x.e[2]), c.hi1, x.e[3]);
}

// One group of 8 rows, R activation rows.
template <int R>
void GemvQ4_0Group(int blocks, const uint8_t* w, const uint8_t* xq, size_t xq_bytes,
                   const Q8_0Term* terms, float* y, size_t y_stride) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b, w += kQ4_0x8Bytes) {
    const Q4_0x8Codes codes = LoadCodes(w);
    const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int r = 0; r < R; ++r) {
      const Q8_0Term& term = terms[r * blocks + b];
      const __m512i halves =
          RowSums<(R < 4)>(codes, LoadEights(xq + r * xq_bytes + b * kQ8_0Bytes), term);
      const __m256i dot = _mm512_cvtepi64_epi32(  // (8,) int32: Σ (q - 8)·y, one a row
          _mm512_add_epi32(halves, _mm512_srli_epi64(halves, 32)));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(term.scale)),
                               _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * y_stride, acc[r]);
}

// Two groups (16 rows, w and w + group_bytes), R activation rows: each row's broadcast codes
// serve both groups, and one 512-bit pair of permutes, conversion and fma finishes a block
// of both where a group alone takes two of each.
template <int R>
void GemvQ4_0Pair(int blocks, const uint8_t* w, size_t group_bytes, const uint8_t* xq,
                  size_t xq_bytes, const Q8_0Term* terms, float* y, size_t y_stride) {
  // `first` gathers the rows' lanes 2i of group 0 into lanes 0-7 and of group 1 into 8-15;
  // `second` their lanes 2i + 1.
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                          28, 30);
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
      const __m512i halves0 = RowSums<(R < 4)>(codes0, eights, term);
      const __m512i halves1 = RowSums<(R < 4)>(codes1, eights, term);
      const __m512i dot = _mm512_add_epi32(  // (16,) int32: Σ (q - 8)·y, one a row
          _mm512_permutex2var_epi32(halves0, first, halves1),
          _mm512_permutex2var_epi32(halves0, second, halves1));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(term.scale)),
                               _mm512_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, acc[r]);
}

// Over W from memory one group at a time: two streams (the pair) measured slower there, at
// M = 1 one product (8192 x 8192, Zen 5) 8-10 %, the served 1B Q4_0 file at batch 8 7-12 %.
// Over W in cache the pair is faster: M = 32 as four passes 7.1-7.3 ms against 9.9-10.1.
template <int R>
void GemvQ4_0x8(int k, const uint8_t* w, int64_t groups, const uint8_t* xq, size_t xq_bytes,
                const Q8_0Term* terms, float* y, size_t y_stride, bool w_cached) {
  const int blocks = k / kQ4_0Block;
  const size_t group_bytes = static_cast<size_t>(blocks) * kQ4_0x8Bytes;
  int64_t g = 0;
  for (; w_cached && g + 2 <= groups; g += 2) {
    GemvQ4_0Pair<R>(blocks, w + g * group_bytes, group_bytes, xq, xq_bytes, terms, y + 8 * g,
                    y_stride);
  }
  for (; g < groups; ++g) {
    GemvQ4_0Group<R>(blocks, w + g * group_bytes, xq, xq_bytes, terms, y + 8 * g, y_stride);
  }
}

void GemvQ4_0(int k, const uint8_t* w, int64_t groups, const uint8_t* xq, size_t xq_bytes,
              int64_t m, const Q8_0Term* terms, float* y, size_t y_stride, bool w_cached) {
  switch (m) {
    case 1: return GemvQ4_0x8<1>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 2: return GemvQ4_0x8<2>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 3: return GemvQ4_0x8<3>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 4: return GemvQ4_0x8<4>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 5: return GemvQ4_0x8<5>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 6: return GemvQ4_0x8<6>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    case 7: return GemvQ4_0x8<7>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
    default: return GemvQ4_0x8<8>(k, w, groups, xq, xq_bytes, terms, y, y_stride, w_cached);
  }
}

}  // namespace

// The codes' sum from one 256-bit load (biased to unsigned for vpsadbw) and the scale by
// F16C: called once a row and product, where our gemv runs (AVX-512 VNNI).
void Q8_0Terms(const uint8_t* xq, int k, Q8_0Term* terms) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int b = 0; b < k / kQ4_0Block; ++b, xq += kQ8_0Bytes) {
    const __m256i codes = _mm256_xor_si256(  // c + 128, unsigned
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 2)), bias);
    const __m256i sums = _mm256_sad_epu8(codes, _mm256_setzero_si256());  // (4,) int64
    const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(sums),
                                       _mm256_extracti128_si256(sums, 1));
    const int32_t sum = static_cast<int32_t>(_mm_cvtsi128_si64(half) +
                                             _mm_extract_epi64(half, 1)) - 32 * 128;
    terms[b] = {-8 * sum, Half(xq)};
  }
}
ATTNSERVE_END_AVX512_VNNI

namespace {
bool Avx512VnniHere() {
  static const bool here =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return here;
}
}  // namespace

RepackedGemv RepackedFor(ggml_type type) {
  return Avx512VnniHere() && type == GGML_TYPE_Q4_0 ? GemvQ4_0 : nullptr;
}

ggml_vec_dot_t For(ggml_type type) {
  if (!Avx512VnniHere()) return nullptr;
  switch (type) {
    case GGML_TYPE_Q4_K: return DotQ4K;
    case GGML_TYPE_Q6_K: return DotQ6K;
    default: return nullptr;
  }
}

#else  // not x86: ggml's vec_dot everywhere

ggml_vec_dot_t For(ggml_type) { return nullptr; }
RepackedGemv RepackedFor(ggml_type) { return nullptr; }
void Q8_0Terms(const uint8_t*, int, Q8_0Term*) {}  // never called: no gemv of ours here

#endif


}  // namespace rowdot
}  // namespace attnserve_gguf
