// The 16-bit element type of an sm80 kernel as a compile-time choice: which mma.sync variant
// multiplies it and how two floats are packed into it. fp16 and bf16 share every fragment
// layout, so kernels are written once against ElementOps<kDType>.
#pragma once

#include <cstdint>

#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/mma.cuh"
#include "tessera/types.hpp"

namespace tessera::detail::sm80 {

template <DType kDType>
struct ElementOps;

template <>
struct ElementOps<DType::kFloat16> {
  static constexpr const char* kName = "fp16";
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    ptx::mma_m16n8k16_f32_f16(d, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return ptx::pack_f16x2(lo, hi);
  }
};

template <>
struct ElementOps<DType::kBFloat16> {
  static constexpr const char* kName = "bf16";
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    ptx::mma_m16n8k16_f32_bf16(d, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return ptx::pack_bf16x2(lo, hi);
  }
};

}  // namespace tessera::detail::sm80
