// AVX-512 instantiation of the fast attention kernel (compiled with -mavx512f/bw/vl/dq -mfma
// -mf16c; only called when cpuid reports those features).
// GCC 12 reports its own _mm512_undefined_ps() (a deliberate self-initialisation inside
// _mm512_max_ps, _mm512_slli_epi32, ...) as maybe-uninitialized once inlined; the warning points
// into the intrinsics header, so it is silenced for this translation unit only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "cpu/fast_attention_impl.hpp"

namespace tessera::detail {
namespace {

struct Avx512Simd {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  // S block 32 rows x 8 keys and O block 8 rows x 32 dims: 16 accumulators each, leaving half
  // of the 32 zmm registers for operands; 16 independent FMA chains cover 2 pipes x 4 cycles.
  static constexpr int kQkRowVecs = 2;
  static constexpr int kQkKeys = 8;
  static constexpr int kPvRows = 8;
  static constexpr int kPvDimVecs = 2;
  static constexpr int kConvertChunk = 16;  // fp16/bf16 elements per load_* / store_* call
  // Up to 8 rows (decode with GQA groups <= 8) the dot-product S beats padding rows to 16:
  // blocks of 4 rows x 4 keys load 8 vectors per 16 FMAs.
  static constexpr int kDotRows = 4;
  static constexpr int kDotMaxRows = 8;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  // `shifted` = n + 1.5 * 2^23 for an integer n in [-127, 127]: its low bits hold n, and
  // (n + 127) << 23 is the float 2^n (0 for n = -127).
  static Vec pow2_from_shifted(Vec shifted) {
    const __m512i n_plus_bias =
        _mm512_add_epi32(_mm512_castps_si512(shifted), _mm512_set1_epi32(127 - 0x4B400000));
    return _mm512_castsi512_ps(_mm512_slli_epi32(n_plus_bias, 23));
  }

  // Lane i of the result = sum of the lanes of acc[i] (a transpose-and-add tree).
  static Vec reduce_lanes(const Vec* acc) {
    __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    for (int i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                               _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    }
    __m512 quads[4];  // per 128-bit lane: that lane's sums of 4 accumulators
    for (int i = 0; i < 4; ++i) {
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
    }
    // Add the four 128-bit lanes of each quad: halves first, then quarters.
    const __m512 halves01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                          _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
    const __m512 halves23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                          _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves01, halves23, 0x88),
                         _mm512_shuffle_f32x4(halves01, halves23, 0xdd));
  }

  static void load_fp16(const uint16_t* src, float* dst) {
    _mm512_storeu_ps(dst,
                     _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
  }
  static void load_bf16(const uint16_t* src, float* dst) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  static void store_fp16(const float* src, uint16_t* dst) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_bf16(const float* src, uint16_t* dst) {
    const __m512 x = _mm512_loadu_ps(src);
    const __m512i bits = _mm512_castps_si512(x);
    // Round to nearest even: add 0x7fff plus the lowest kept bit; NaNs stay (quiet) NaNs.
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i result = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(result));
  }
};

}  // namespace

FastKernelEntry fast_kernel_avx512() {
  return {&FlashAttentionKernel<Avx512Simd>::scratch_bytes,
          &FlashAttentionKernel<Avx512Simd>::run_work_item};
}

}  // namespace tessera::detail
