// RoPE pieces shared by the standalone RoPE kernel (rope.cu) and the fused RoPE of the paged-KV
// append (append_kv.cu).
//
// Numerics are those of the CPU backend (src/cpu/rope.cpp), itself following FlashInfer: the
// frequencies are computed once on the host in double and rounded to float; the angle of pair i
// at position p is float(p) * frequency_i rounded to float; sin/cos of that float angle are
// evaluated in double (a fast approximate sincos loses accuracy badly at the large angles of long
// contexts; see rope_cos_sin); the rotation is done in float with explicit round-to-nearest
// multiplies and adds, so no multiply-add contraction makes it differ from the host's.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <numbers>

#include "tessera/ops.hpp"

namespace tessera::detail {

// rotary_dim <= 256 (validated by the core, check_rope_options), so at most 128 pairs.
inline constexpr int32_t kMaxRopePairs = 128;

// Per-pair frequencies (radians per position), passed by value in the kernel parameters.
struct RopeFrequencies {
  int32_t rotary_dim = 0;
  bool interleave = false;
  float frequency[kMaxRopePairs] = {};
};

// Meta's Llama 3.1 apply_scaling (also FlashInfer's): wavelengths shorter than
// original_max / high_freq_factor are kept, longer than original_max / low_freq_factor are
// divided by `factor`, and the band in between is interpolated smoothly in 1 / wavelength.
inline double llama31_rescaled_frequency(double inverse_frequency, const RopeOptions& options) {
  const double original_max = options.llama31_original_max_position;
  const double low_freq_wavelen = original_max / options.llama31_low_freq_factor;
  const double high_freq_wavelen = original_max / options.llama31_high_freq_factor;
  const double wavelen = 2.0 * std::numbers::pi / inverse_frequency;
  if (wavelen < high_freq_wavelen) return inverse_frequency;
  if (wavelen > low_freq_wavelen) return inverse_frequency / options.llama31_factor;
  const double band = options.llama31_high_freq_factor - options.llama31_low_freq_factor;
  const double smooth =
      band > 0.0 ? (original_max / wavelen - options.llama31_low_freq_factor) / band : 1.0;
  return (1.0 - smooth) * inverse_frequency / options.llama31_factor + smooth * inverse_frequency;
}

// theta^(-2i / rotary_dim), Llama 3.1-rescaled when asked, divided by rope_scale.
inline RopeFrequencies make_rope_frequencies(int32_t rotary_dim, const RopeOptions& options) {
  RopeFrequencies table;
  table.rotary_dim = rotary_dim;
  table.interleave = options.interleave;
  for (int32_t i = 0; i < rotary_dim / 2; ++i) {
    double inverse_frequency =
        std::pow(static_cast<double>(options.rope_theta),
                 -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
    if (options.llama31) inverse_frequency = llama31_rescaled_frequency(inverse_frequency, options);
    table.frequency[i] =
        static_cast<float>(inverse_frequency / static_cast<double>(options.rope_scale));
  }
  return table;
}

#if defined(__CUDACC__)
// cos and sin of float(position) * frequency, evaluated in double and rounded to float.
// sincospi(angle / pi) rather than sincos(angle): sincos's Payne-Hanek reduction for large
// arguments is an out-of-line call that makes ptxas spill around it, while sincospi reduces
// exactly in-line. Dividing by pi in double moves the angle by at most ~2^-52 of itself
// (3e-10 at a 10^6 radian angle), far below a float ulp of the result.
__device__ __forceinline__ void rope_cos_sin(int32_t position, float frequency, float* cos_value,
                                             float* sin_value) {
  const float angle = __fmul_rn(static_cast<float>(position), frequency);
  double sine, cosine;
  sincospi(static_cast<double>(angle) * std::numbers::inv_pi, &sine, &cosine);
  *cos_value = static_cast<float>(cosine);
  *sin_value = static_cast<float>(sine);
}

// (x, y) -> (x cos - y sin, y cos + x sin), each product and sum rounded separately.
__device__ __forceinline__ void rope_rotate_pair(float* x, float* y, float cos_value,
                                                 float sin_value) {
  const float x_in = *x, y_in = *y;
  *x = __fsub_rn(__fmul_rn(x_in, cos_value), __fmul_rn(y_in, sin_value));
  *y = __fadd_rn(__fmul_rn(y_in, cos_value), __fmul_rn(x_in, sin_value));
}

// Feature indices of pair i: NeoX pairs (i, i + rotary_dim / 2), GPT-J pairs (2i, 2i + 1).
__device__ __forceinline__ void rope_pair_features(int32_t pair, int32_t rotary_dim,
                                                   bool interleave, int32_t* first,
                                                   int32_t* second) {
  *first = interleave ? 2 * pair : pair;
  *second = interleave ? 2 * pair + 1 : pair + rotary_dim / 2;
}
#endif

}  // namespace tessera::detail
