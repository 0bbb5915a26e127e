// Butterfly shuffles inside the quad of 4 lanes that share one row of an mma accumulator
// (lanes 4*g .. 4*g + 3 hold row g; see mma.cuh). Two xor steps (1, 2) give every lane of the
// quad the row's max or sum.
#pragma once

#include <cstdint>

#include "cuda/ptx/math.cuh"

namespace tessera::detail::ptx {

// Emits shfl.sync.bfly.b32 d, a, lane_mask, 0x1f, 0xffffffff
// (PTX ISA, "Parallel Synchronization and Communication Instructions: shfl.sync").
// All 32 lanes must execute it (full member mask).
template <int kLaneMask>
__device__ __forceinline__ float shfl_xor(float value) {
  uint32_t out;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;\n"
               : "=r"(out)
               : "r"(__float_as_uint(value)), "n"(kLaneMask));
  return __uint_as_float(out);
}

// Max over the 4 lanes of a quad, NaN if any lane's value is NaN (row maxima: ptx::max_nan).
__device__ __forceinline__ float quad_max(float value) {
  value = max_nan(value, shfl_xor<1>(value));
  return max_nan(value, shfl_xor<2>(value));
}

__device__ __forceinline__ float quad_sum(float value) {
  value += shfl_xor<1>(value);
  return value + shfl_xor<2>(value);
}

}  // namespace tessera::detail::ptx
