// ggml's CPU repack layout for GgufMatMul (see gguf_repacked.h): the export's one-time
// repack through ggml's public backend API, its check, and the inverse the float path reads.
//
// Also exported as a C function for the export (service/ops/__init__.py, ctypes):
//   int attnserve_gguf_repack(int type, int64_t k, int64_t n, const void* rows, void* out,
//                             char* error, size_t error_size)   → 0, or 1 with `error` set.

#include "gguf_repacked.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

// ggml-cpu's repack kernels (ggml/src/ggml-cpu/repack.h, a private header: exported C
// symbols of libggml-cpu, declared here with the header's signatures).
extern "C" {
void ggml_gemv_q4_0_8x8_q8_0(int n, float* s, size_t bs, const void* vx, const void* vy, int nr,
                             int nc);
void ggml_gemm_q4_0_8x8_q8_0(int n, float* s, size_t bs, const void* vx, const void* vy, int nr,
                             int nc);
void ggml_gemv_iq4_nl_8x8_q8_0(int n, float* s, size_t bs, const void* vx, const void* vy,
                               int nr, int nc);
void ggml_gemm_iq4_nl_8x8_q8_0(int n, float* s, size_t bs, const void* vx, const void* vy,
                               int nr, int nc);
void ggml_quantize_mat_q8_0_4x8(const float* x, void* vy, int64_t k);
}

namespace attnserve_gguf {
namespace repacked {
namespace {

// block_q4_0x8 / block_iq4_nlx8: the 8 rows' fp16 scales, then their 16-byte quants in
// 8-byte pieces, row by row: piece i holds row i % 8's bytes 8·(i / 8) ... +8.
constexpr size_t kScaleBytes = 2;
constexpr size_t kQuantBytes = 16;
constexpr size_t kPiece = 8;
constexpr size_t kFileBlock = kScaleBytes + kQuantBytes;  // block_q4_0, block_iq4_nl
// Q4_0's codes are stored offset by 8 in the layout (each nibble XOR 8: signed nibbles for
// the int8 products); IQ4_NL's are indices into its table, stored as they are.
uint64_t NibbleMask(ggml_type type) {
  return type == GGML_TYPE_Q4_0 ? 0x8888888888888888ULL : 0;
}

void DropDebug(ggml_log_level level, const char* text, void* /*user*/) {
  if (level != GGML_LOG_LEVEL_DEBUG) std::fputs(text, stderr);  // ggml's own default
}

std::mutex repack_mutex;  // ggml's log callback is process-wide

}  // namespace

bool Covers(ggml_type type) { return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_IQ4_NL; }

Kernels KernelsFor(ggml_type type) {
  const ggml_from_float_t q8_0 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float;
  if (type == GGML_TYPE_Q4_0) {
    return {ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0, ggml_quantize_mat_q8_0_4x8, q8_0,
            GGML_TYPE_Q8_0};
  }
  return {ggml_gemv_iq4_nl_8x8_q8_0, ggml_gemm_iq4_nl_8x8_q8_0, ggml_quantize_mat_q8_0_4x8, q8_0,
          GGML_TYPE_Q8_0};
}

void Unpack(ggml_type type, int64_t k, const uint8_t* group, uint8_t* rows) {
  const int64_t blocks = k / ggml_blck_size(type);
  const size_t row_bytes = ggml_row_size(type, k);
  const uint64_t mask = NibbleMask(type);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* in = group + b * kGroupRows * kFileBlock;  // one block of 8 rows
    const uint8_t* quants = in + kGroupRows * kScaleBytes;
    for (int64_t r = 0; r < kGroupRows; ++r) {
      uint8_t* out = rows + r * row_bytes + b * kFileBlock;
      std::memcpy(out, in + r * kScaleBytes, kScaleBytes);
      for (size_t half = 0; half < kQuantBytes / kPiece; ++half) {
        uint64_t piece;
        std::memcpy(&piece, quants + (half * kGroupRows + r) * kPiece, kPiece);
        piece ^= mask;
        std::memcpy(out + kScaleBytes + half * kPiece, &piece, kPiece);
      }
    }
  }
}

std::string Repack(ggml_type type, int64_t k, int64_t n, const uint8_t* rows, uint8_t* out) {
  if (!Covers(type)) return std::string(ggml_type_name(type)) + " has no repacked layout here";
  if (k <= 0 || k % ggml_blck_size(type) != 0 || n <= 0 || n % kGroupRows != 0) {
    return "the layout needs whole blocks and a multiple of 8 rows, not " + std::to_string(n) +
           " x " + std::to_string(k);
  }
  std::lock_guard<std::mutex> lock(repack_mutex);
  ggml_cpu_init();
  ggml_backend_reg_t reg = ggml_backend_cpu_reg();
  auto extra_types = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
      ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
  ggml_backend_buffer_type_t repack = nullptr;
  if (extra_types != nullptr) {
    for (ggml_backend_buffer_type_t* t = extra_types(ggml_backend_reg_dev_get(reg, 0));
         t != nullptr && *t != nullptr; ++t) {
      if (std::strcmp(ggml_backend_buft_name(*t), "CPU_REPACK") == 0) repack = *t;
    }
  }
  if (repack == nullptr) return "this ggml was built without its CPU repack buffer type";

  const ggml_init_params params = {ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
  std::unique_ptr<ggml_context, decltype(&ggml_free)> ctx(ggml_init(params), ggml_free);
  ggml_tensor* tensor = ggml_new_tensor_2d(ctx.get(), type, k, n);
  ggml_log_callback saved_log = nullptr;
  void* saved_user = nullptr;
  ggml_log_get(&saved_log, &saved_user);
  ggml_log_set(DropDebug, nullptr);  // "repack: repack tensor ... with q4_0_8x8", per tensor
  std::unique_ptr<ggml_backend_buffer, decltype(&ggml_backend_buffer_free)> buffer(
      ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), repack), ggml_backend_buffer_free);
  // The buffer type sets `extra` to the layout it chose for this tensor on this CPU; none:
  // ggml computes this type from the file's rows here (no AVX2).
  const bool chosen = buffer != nullptr && tensor->extra != nullptr;
  const size_t bytes = ggml_nbytes(tensor);
  if (chosen) ggml_backend_tensor_set(tensor, rows, 0, bytes);
  ggml_log_set(saved_log, saved_user);
  if (!chosen) return std::string("ggml keeps ") + ggml_type_name(type) + " in rows on this CPU";
  std::memcpy(out, tensor->data, bytes);

  // The layout ggml chose must be the one this op computes (an ARM build picks others).
  const size_t group_bytes = kGroupRows * ggml_row_size(type, k);
  std::unique_ptr<uint8_t[]> back(new uint8_t[group_bytes]);
  for (int64_t g = 0; g < n / kGroupRows; ++g) {
    Unpack(type, k, out + g * group_bytes, back.get());
    if (std::memcmp(back.get(), rows + g * group_bytes, group_bytes) != 0) {
      return std::string("ggml's repack of ") + ggml_type_name(type) +
             " on this CPU is not the 8x8 layout this op computes";
    }
  }
  return "";
}

}  // namespace repacked
}  // namespace attnserve_gguf

extern "C" __attribute__((visibility("default"))) int attnserve_gguf_repack(
    int type, int64_t k, int64_t n, const void* rows, void* out, char* error,
    size_t error_size) {
  std::string why;
  try {
    why = (type < 0 || type >= GGML_TYPE_COUNT)
              ? "no such ggml type " + std::to_string(type)
              : attnserve_gguf::repacked::Repack(static_cast<ggml_type>(type), k, n,
                                                 static_cast<const uint8_t*>(rows),
                                                 static_cast<uint8_t*>(out));
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty()) return 0;
  if (error != nullptr && error_size > 0) {
    std::strncpy(error, why.c_str(), error_size - 1);
    error[error_size - 1] = '\0';
  }
  return 1;
}
