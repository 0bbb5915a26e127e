// AVX2 + FMA + F16C instantiation of the fast attention kernel (compiled with -mavx2 -mfma
// -mf16c; only called when cpuid reports those features).
#include <immintrin.h>

#include "cpu/fast_attention_impl.hpp"

namespace tessera::detail {
namespace {

struct Avx2Simd {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  // 12 accumulators + 3 operands + 1 broadcast fill the 16 ymm registers exactly.
  static constexpr int kQkRowVecs = 3;
  static constexpr int kQkKeys = 4;
  static constexpr int kPvRows = 4;
  static constexpr int kPvDimVecs = 3;
  static constexpr int kConvertChunk = 8;  // fp16/bf16 elements per load_* / store_* call
  // Up to 4 rows the dot-product S (blocks of 2 rows x 4 keys) beats padding rows to 8.
  static constexpr int kDotRows = 2;
  static constexpr int kDotMaxRows = 4;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  // See Avx512Simd::pow2_from_shifted.
  static Vec pow2_from_shifted(Vec shifted) {
    const __m256i n_plus_bias =
        _mm256_add_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(127 - 0x4B400000));
    return _mm256_castsi256_ps(_mm256_slli_epi32(n_plus_bias, 23));
  }

  // Lane i of the result = sum of the lanes of acc[i] (a transpose-and-add tree).
  static Vec reduce_lanes(const Vec* acc) {
    __m256 pairs[4];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    for (int i = 0; i < 4; ++i) {
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                               _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    __m256 quads[2];  // per 128-bit lane: that lane's sums of 4 accumulators
    for (int i = 0; i < 2; ++i) {
      quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }

  static void load_fp16(const uint16_t* src, float* dst) {
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  }
  static void load_bf16(const uint16_t* src, float* dst) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  static void store_fp16(const float* src, uint16_t* dst) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_bf16(const float* src, uint16_t* dst) {
    const __m256 x = _mm256_loadu_ps(src);
    const __m256i bits = _mm256_castps_si256(x);
    // Round to nearest even: add 0x7fff plus the lowest kept bit; NaNs stay (quiet) NaNs.
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i result = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Values fit in 16 bits, so unsigned saturation is a plain narrowing; packus works within
    // 128-bit lanes, the permute gathers the two useful quarters.
    const __m256i packed = _mm256_packus_epi32(result, result);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(ordered));
  }
};

}  // namespace

FastKernelEntry fast_kernel_avx2() {
  return {&FlashAttentionKernel<Avx2Simd>::scratch_bytes,
          &FlashAttentionKernel<Avx2Simd>::run_work_item};
}

}  // namespace tessera::detail
