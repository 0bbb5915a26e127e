// Host-side conversions between float and the 16-bit / 8-bit float formats (bit exact,
// round-to-nearest-even on the way down). Kernels use their own intrinsics; this is for the CPU
// backend, the reference and the tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tessera/types.hpp"

namespace tessera::detail {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero / subnormal: mant * 2^-24
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (au >= 0x477ff000u) return sign | 0x7c00u;            // overflow -> inf (>= 65520)
  if (au < 0x38800000u) {                                   // subnormal or zero in fp16
    const float a = bits_float(au);
    const float scaled = a * 16777216.0f;                  // a / 2^-24
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));  // RNE (default mode)
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t mant = au & 0x7fffffu;
  uint32_t exp = (au >> 23) - 112u;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// fp8 e4m3 (OCP "fn": no inf, NaN = 0x7f/0xff, max 448) and e5m2 (IEEE-like, max 57344).
inline float e4m3_to_float(uint8_t x) {
  const uint32_t sign = (x & 0x80u) << 24;
  const uint32_t exp = (x >> 3) & 0xfu;
  const uint32_t mant = x & 0x7u;
  if (exp == 15 && mant == 7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -9);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}
inline float e5m2_to_float(uint8_t x) { return fp16_to_float(static_cast<uint16_t>(x) << 8); }

// Saturating round-to-nearest-even conversions (what quantising a KV cache wants).
inline uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // saturate to max finite
  // Find the representable neighbours by brute force over the 127 magnitudes: exact and small.
  uint8_t best = 0;
  float best_err = a;
  for (uint8_t m = 1; m <= 0x7e; ++m) {
    const float v = e4m3_to_float(m);
    const float err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (m & 1) == 0 && (best & 1) == 1)) {
      best = m;
      best_err = err;
    }
  }
  return sign | best;
}
inline uint8_t float_to_e5m2(float f) {
  if (std::isnan(f)) return 0x7f;
  const float a = std::fabs(f);
  if (a >= 57344.0f) return (std::signbit(f) ? 0x80 : 0) | 0x7b;  // saturate to max finite
  const uint16_t h = float_to_fp16(f);
  uint16_t r = static_cast<uint16_t>(h >> 8);
  const uint16_t rest = h & 0xffu;
  if (rest > 0x80u || (rest == 0x80u && (r & 1u))) ++r;
  return static_cast<uint8_t>(r);
}

// Loads element `i` of a buffer of `dtype` as float (fp32, fp16, bf16, fp8).
inline float load_as_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat8E4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kFloat8E5M2: return e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
    default: return 0.0f;
  }
}
inline void store_from_float(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_fp16(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(base)[i] = float_to_e4m3(v); break;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(base)[i] = float_to_e5m2(v); break;
    default: break;
  }
}

}  // namespace tessera::detail
