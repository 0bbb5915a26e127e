// float -> packed 16-bit conversions (sm_80+ for bf16x2). The packed register is what mma.sync
// takes as an A/B operand and what a 4-byte store writes: the first (lower-indexed) element in
// the low half.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits cvt.rn.f16x2.f32 d, hi, lo (PTX ISA, "Data Movement and Conversion Instructions: cvt"):
// the instruction puts its first source in the upper half, hence the operand order.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// Emits cvt.rn.bf16x2.f32 d, hi, lo (PTX ISA, "Data Movement and Conversion Instructions: cvt",
// sm_80+).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

}  // namespace tessera::detail::ptx
