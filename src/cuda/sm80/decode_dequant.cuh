// Element types of the decode kernel as compile-time choices: how 8 consecutive K/V features are
// read from shared memory and widened to float, and how q / o elements convert.
//
// fp8 K/V is widened with integer bit moves rather than a conversion instruction (sm_80 has
// none for fp8): an e5m2 byte is the top byte of an fp16; an e4m3 byte with its exponent and
// mantissa moved down one bit below an fp16 sign is that fp16 times 2^-8 (e4m3's exponent bias is
// 7, fp16's 15), subnormals included. The constant 2^8 (kDequantFactor) is folded into the
// per-tensor k_scale / v_scale on the host, so dequantisation costs nothing per element beyond
// the widening every dtype needs. (The e4m3 NaN code 0x7f comes out as 480; a KV cache holds no
// NaN in practice, and fp16/bf16 caches pass NaN through unchanged.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tessera/types.hpp"

namespace tessera::detail::sm80 {

// Two fp16 in one 32-bit word -> two floats.
__device__ __forceinline__ void widen_f16x2(uint32_t packed, float* out) {
  const float2 values = __half22float2(*reinterpret_cast<const __half2*>(&packed));
  out[0] = values.x;
  out[1] = values.y;
}

// Two bf16 in one 32-bit word -> two floats: a bf16 is the top half of a float.
__device__ __forceinline__ void widen_bf16x2(uint32_t packed, float* out) {
  out[0] = __uint_as_float(packed << 16);
  out[1] = __uint_as_float(packed & 0xffff0000u);
}

template <DType kKVDType>
struct KVElement;

template <>
struct KVElement<DType::kFloat16> {
  static constexpr int kBytes = 2;
  static constexpr float kDequantFactor = 1.0f;
  // 8 features = 16 bytes: one 16-byte shared load.
  __device__ __forceinline__ static void load8(const uint8_t* shared, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(shared);
    widen_f16x2(raw.x, out + 0);
    widen_f16x2(raw.y, out + 2);
    widen_f16x2(raw.z, out + 4);
    widen_f16x2(raw.w, out + 6);
  }
};

template <>
struct KVElement<DType::kBFloat16> {
  static constexpr int kBytes = 2;
  static constexpr float kDequantFactor = 1.0f;
  __device__ __forceinline__ static void load8(const uint8_t* shared, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(shared);
    widen_bf16x2(raw.x, out + 0);
    widen_bf16x2(raw.y, out + 2);
    widen_bf16x2(raw.z, out + 4);
    widen_bf16x2(raw.w, out + 6);
  }
};

// Byte b of `word` moved to the top byte of 16-bit lane (b % 2) of the result, for b in
// {first, first + 1}: __byte_perm selector nibbles pick source bytes, 4 = a zero byte.
__device__ __forceinline__ uint32_t fp8_pair_to_high_bytes(uint32_t word, bool upper_pair) {
  return __byte_perm(word, 0u, upper_pair ? 0x3424u : 0x1404u);
}

template <>
struct KVElement<DType::kFloat8E5M2> {
  static constexpr int kBytes = 1;
  static constexpr float kDequantFactor = 1.0f;
  // 8 features = 8 bytes: one 8-byte shared load; each byte pair becomes an fp16 pair.
  __device__ __forceinline__ static void load8(const uint8_t* shared, float (&out)[8]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(shared);
    widen_f16x2(fp8_pair_to_high_bytes(raw.x, false), out + 0);
    widen_f16x2(fp8_pair_to_high_bytes(raw.x, true), out + 2);
    widen_f16x2(fp8_pair_to_high_bytes(raw.y, false), out + 4);
    widen_f16x2(fp8_pair_to_high_bytes(raw.y, true), out + 6);
  }
};

template <>
struct KVElement<DType::kFloat8E4M3> {
  static constexpr int kBytes = 1;
  static constexpr float kDequantFactor = 256.0f;  // 2^(15 - 7), see the file comment
  // fp16 pair with e4m3 bytes in the top bytes -> fp16 pair equal to the e4m3 values * 2^-8:
  // keep each sign bit, shift exponent + mantissa (bits 14..8 of each half) down by one.
  __device__ __forceinline__ static uint32_t rebias(uint32_t high_bytes) {
    return (high_bytes & 0x80008000u) | ((high_bytes & 0x7f007f00u) >> 1);
  }
  __device__ __forceinline__ static void load8(const uint8_t* shared, float (&out)[8]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(shared);
    widen_f16x2(rebias(fp8_pair_to_high_bytes(raw.x, false)), out + 0);
    widen_f16x2(rebias(fp8_pair_to_high_bytes(raw.x, true)), out + 2);
    widen_f16x2(rebias(fp8_pair_to_high_bytes(raw.y, false)), out + 4);
    widen_f16x2(rebias(fp8_pair_to_high_bytes(raw.y, true)), out + 6);
  }
};

// q / o element (fp16 or bf16) <-> float.
template <DType kQDType>
struct QElement;

template <>
struct QElement<DType::kFloat16> {
  __device__ __forceinline__ static float load(const uint16_t* pointer) {
    return __half2float(__ushort_as_half(*pointer));
  }
  __device__ __forceinline__ static void store(uint16_t* pointer, float value) {
    *pointer = __half_as_ushort(__float2half_rn(value));
  }
};

template <>
struct QElement<DType::kBFloat16> {
  __device__ __forceinline__ static float load(const uint16_t* pointer) {
    return __uint_as_float(static_cast<uint32_t>(*pointer) << 16);
  }
  __device__ __forceinline__ static void store(uint16_t* pointer, float value) {
    *pointer = __bfloat16_as_ushort(__float2bfloat16_rn(value));
  }
};

}  // namespace tessera::detail::sm80
