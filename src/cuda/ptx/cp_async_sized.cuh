// cp.async variants beyond cp_async.cuh's all-or-nothing 16-byte copy: a 16-byte copy with a
// partial source size, and the 8- and 4-byte forms for rows that are not 16-byte aligned.
// The decode kernel needs them for head_dim padding of fp8 rows (a row of 8 * odd bytes ends in
// a half-valid 16-byte chunk) and for K/V views whose strides are not multiples of 16 bytes.
// Each wrapper emits one instruction; commit/wait are in cp_async.cuh.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits cp.async.cg.shared.global [dst], [src], 16, src_size
// (PTX ISA, "Data Movement and Conversion Instructions: cp.async"): copies src_size (0..16)
// bytes and zero-fills the rest of the 16 destination bytes; src_size 0 reads nothing.
// dst and src must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16_partial(uint32_t smem_address, const void* src,
                                                    uint32_t src_size) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address),
               "l"(__cvta_generic_to_global(src)), "r"(src_size)
               : "memory");
}

// Emits cp.async.ca.shared.global [dst], [src], 8, src_size (same section): the 8-byte form,
// which only exists with the .ca (L1-allocating) qualifier. src_size is 0 or 8.
__device__ __forceinline__ void cp_async_8_partial(uint32_t smem_address, const void* src,
                                                   uint32_t src_size) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_address),
               "l"(__cvta_generic_to_global(src)), "r"(src_size)
               : "memory");
}

// Emits cp.async.ca.shared.global [dst], [src], 4, src_size (same section). src_size 0 or 4.
__device__ __forceinline__ void cp_async_4_partial(uint32_t smem_address, const void* src,
                                                   uint32_t src_size) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address),
               "l"(__cvta_generic_to_global(src)), "r"(src_size)
               : "memory");
}

}  // namespace tessera::detail::ptx
