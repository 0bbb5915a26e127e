// Baseline instantiation of the fast attention kernel: GCC vector extensions of 4 floats
// (SSE2 on x86-64, NEON elsewhere), for CPUs without AVX2/FMA.
#include <cstring>

#include "core/half.hpp"
#include "cpu/fast_attention_impl.hpp"

namespace tessera::detail {
namespace {

typedef float GenericVec __attribute__((vector_size(16)));
typedef int32_t GenericIntVec __attribute__((vector_size(16)));

struct GenericSimd {
  using Vec = GenericVec;
  static constexpr int kLanes = 4;
  // 12 accumulators + 3 operands + 1 broadcast: the 16 xmm registers of x86-64.
  static constexpr int kQkRowVecs = 3;
  static constexpr int kQkKeys = 4;
  static constexpr int kPvRows = 4;
  static constexpr int kPvDimVecs = 3;
  static constexpr int kConvertChunk = 8;  // fp16/bf16 elements per load_* / store_* call
  // With 4 lanes, padding rows costs little: the dot-product S only pays off for 1-2 rows.
  static constexpr int kDotRows = 2;
  static constexpr int kDotMaxRows = 2;

  static Vec zero() { return Vec{0.0f, 0.0f, 0.0f, 0.0f}; }
  static Vec set1(float x) { return Vec{x, x, x, x}; }
  static Vec load(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec sub(Vec a, Vec b) { return a - b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec div(Vec a, Vec b) { return a / b; }
  static Vec max(Vec a, Vec b) { return a > b ? a : b; }
  static Vec min(Vec a, Vec b) { return a < b ? a : b; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
  // See Avx512Simd::pow2_from_shifted.
  static Vec pow2_from_shifted(Vec shifted) {
    GenericIntVec bits;
    std::memcpy(&bits, &shifted, sizeof(bits));
    bits = (bits + (127 - 0x4B400000)) << 23;
    Vec result;
    std::memcpy(&result, &bits, sizeof(result));
    return result;
  }

  // Lane i of the result = sum of the lanes of acc[i].
  static Vec reduce_lanes(const Vec* acc) {
    Vec sums;
    for (int i = 0; i < kLanes; ++i) sums[i] = acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
    return sums;
  }

  // This translation unit has baseline flags, so the shared scalar conversions are safe here.
  static void load_fp16(const uint16_t* src, float* dst) {
    for (int i = 0; i < 8; ++i) dst[i] = fp16_to_float(src[i]);
  }
  static void load_bf16(const uint16_t* src, float* dst) {
    for (int i = 0; i < 8; ++i) dst[i] = bf16_to_float(src[i]);
  }
  static void store_fp16(const float* src, uint16_t* dst) {
    for (int i = 0; i < 8; ++i) dst[i] = float_to_fp16(src[i]);
  }
  static void store_bf16(const float* src, uint16_t* dst) {
    for (int i = 0; i < 8; ++i) dst[i] = float_to_bf16(src[i]);
  }
};

}  // namespace

FastKernelEntry fast_kernel_generic() {
  return {&FlashAttentionKernel<GenericSimd>::scratch_bytes,
          &FlashAttentionKernel<GenericSimd>::run_work_item};
}

}  // namespace tessera::detail
