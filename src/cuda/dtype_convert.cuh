// Device-side conversions between float and Tessera's storage dtypes, with the very rounding rules
// of the host converters in core/half.hpp (round to nearest even; fp8 saturates to the largest
// finite value), so a CUDA op writes the same bits as its CPU twin. The attention kernels use
// their own packed fast paths (sm80/decode_dequant.cuh); these are for the elementwise ops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tessera/types.hpp"

namespace tessera::detail {

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ __forceinline__ float fp16_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}
__device__ __forceinline__ uint16_t float_to_fp16_bits(float value) {
  return __half_as_ushort(__float2half_rn(value));
}

// e4m3 ("fn": no infinity, 0x7f / 0xff are NaN, largest finite 448). Its bits shifted into an
// fp16 (sign to bit 15, exponent and mantissa to bits 13..7) are the value times 2^-8: e4m3's
// exponent bias is 7, fp16's is 15, and fp16 also covers e4m3's subnormals exactly.
__device__ __forceinline__ float e4m3_bits_to_float(uint8_t bits) {
  if ((bits & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | ((bits & 0x80u) << 24));
  const uint16_t half_bits = static_cast<uint16_t>(((bits & 0x80u) << 8) | ((bits & 0x7fu) << 7));
  return fp16_bits_to_float(half_bits) * 256.0f;
}
// e5m2 is the top byte of an fp16.
__device__ __forceinline__ float e5m2_bits_to_float(uint8_t bits) {
  return fp16_bits_to_float(static_cast<uint16_t>(bits) << 8);
}

// Round to nearest even e4m3 code, saturating at 448; NaN -> 0x7f (as float_to_e4m3).
__device__ __forceinline__ uint8_t float_to_e4m3_bits(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7f;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float magnitude = fabsf(value);
  if (magnitude >= 448.0f) return sign | 0x7e;
  constexpr float kSmallestNormal = 0.015625f;  // 2^-6
  constexpr float kSubnormalSteps = 512.0f;     // subnormal spacing is 2^-9
  if (magnitude < kSmallestNormal) {
    // Subnormal grid: codes 0..8, where 8 (= 2^-6) is exactly the smallest normal's code.
    return sign | static_cast<uint8_t>(__float2int_rn(magnitude * kSubnormalSteps));
  }
  const uint32_t magnitude_bits = __float_as_uint(magnitude);
  const uint32_t exponent = (magnitude_bits >> 23) - 127u + 7u;  // 1..15 here
  const uint32_t mantissa = magnitude_bits & 0x7fffffu;
  uint32_t code = (exponent << 3) | (mantissa >> 20);
  const uint32_t rest = mantissa & 0xfffffu;                         // the 20 dropped bits
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;  // carries into the exponent
  return sign | static_cast<uint8_t>(code);
}

// The host rule (float_to_e5m2): round to fp16 first, then fp16 to e5m2 to nearest even;
// saturating at 57344, NaN -> 0x7f.
__device__ __forceinline__ uint8_t float_to_e5m2_bits(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7f;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (fabsf(value) >= 57344.0f) return sign | 0x7b;
  const uint16_t half_bits = float_to_fp16_bits(value);
  uint32_t code = half_bits >> 8;
  const uint32_t rest = half_bits & 0xffu;
  if (rest > 0x80u || (rest == 0x80u && (code & 1u))) ++code;
  return static_cast<uint8_t>(code);
}

// Element `index` of a buffer of `dtype`, as float. `dtype` is uniform across a launch, so the
// switch costs a predictable branch, not divergence.
__device__ __forceinline__ float load_element_as_float(const void* base, DType dtype,
                                                       int64_t index) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat16: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat8E4M3: return e4m3_bits_to_float(static_cast<const uint8_t*>(base)[index]);
    case DType::kFloat8E5M2: return e5m2_bits_to_float(static_cast<const uint8_t*>(base)[index]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ void store_element_from_float(void* base, DType dtype, int64_t index,
                                                         float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[index] = value; break;
    case DType::kFloat16: static_cast<uint16_t*>(base)[index] = float_to_fp16_bits(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[index] = float_to_bf16_bits(value); break;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(base)[index] = float_to_e4m3_bits(value); break;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(base)[index] = float_to_e5m2_bits(value); break;
    default: break;
  }
}

// Copies one element between two buffers of the same dtype, bit for bit (NaN payloads too).
__device__ __forceinline__ void copy_element_bits(void* destination, int64_t destination_index,
                                                  const void* source, int64_t source_index,
                                                  DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<uint32_t*>(destination)[destination_index] =
          static_cast<const uint32_t*>(source)[source_index];
      break;
    case DType::kFloat16:
    case DType::kBFloat16:
      static_cast<uint16_t*>(destination)[destination_index] =
          static_cast<const uint16_t*>(source)[source_index];
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      static_cast<uint8_t*>(destination)[destination_index] =
          static_cast<const uint8_t*>(source)[source_index];
      break;
    default: break;
  }
}

}  // namespace tessera::detail
