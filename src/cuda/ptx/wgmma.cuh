// Warpgroup matrix multiply-accumulate (sm_90a): shared-memory matrix descriptors and the
// fence / commit / wait protocol around the asynchronous wgmma.mma_async instructions
// (wgmma_ops.cuh, generated). PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
// Instructions".
//
// Register fragments of m64nNk16 (PTX ISA figures "WGMMA .m64nNk16 register fragment layout"),
// for thread t of the warpgroup, warp w = t / 32, lane l = t % 32, row r = 16 w + l / 4:
//   accumulator D (f32, N/2 values): d[4j + 0, 1] = D[r][8j + 2 (l % 4) + {0, 1}],
//                                    d[4j + 2, 3] = D[r + 8][same columns]
//   A from registers (4 x 32-bit, two 16-bit values each, lower column in the low half):
//     a[0] = A[r][2 (l % 4) + {0, 1}],     a[1] = A[r + 8][2 (l % 4) + {0, 1}],
//     a[2] = A[r][8 + 2 (l % 4) + {0, 1}], a[3] = A[r + 8][8 + 2 (l % 4) + {0, 1}]
// So the f32 accumulator of S = Q K^T, columns 16k .. 16k + 15, packed pairwise to 16 bits, is
// exactly the A fragment of k-step k of P V (the FlashAttention-3 "RS" trick: P never leaves
// registers).
//
// Shared-memory operands use the 128-byte swizzle (what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): a tile is stored as column blocks of 64 16-bit elements
// (128 bytes per row); inside a block, 16-byte chunk c of row r sits at chunk c ^ (r % 8), and
// 8 rows make one 1024-byte swizzle atom. Descriptors for such tiles (tile base 1024-aligned):
//   K-major (Q as A, K as B: the reduction dim is the contiguous one):
//     SBO = 1024 (next 8 rows), LBO unused (1); the k-step of 16 elements inside a block is a
//     +32-byte start address (the hardware applies the swizzle to the full address), and the
//     next column block is +rows*128 bytes.
//   MN-major (V as B of P V: rows are keys = the reduction dim, columns = head_dim contiguous):
//     LBO = rows*128 (next 64 columns of N), SBO = 1024 (next 8 keys of K); a k-step of 16 keys
//     is +2048 bytes.
#pragma once

#include <cstdint>

#include "cuda/ptx/wgmma_ops.cuh"

namespace tessera::detail::ptx {

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (each encoded as (x & 0x3FFFF) >> 4), base offset 0 (1024-aligned atoms), and the
// swizzle mode in bits 62-63 (1 = 128-byte swizzle).
__device__ __forceinline__ uint64_t wgmma_descriptor_sw128(uint32_t smem_address,
                                                           uint32_t leading_byte_offset,
                                                           uint32_t stride_byte_offset) {
  const auto encode = [](uint32_t x) { return static_cast<uint64_t>((x & 0x3FFFF) >> 4); };
  return encode(smem_address) | (encode(leading_byte_offset) << 16) |
         (encode(stride_byte_offset) << 32) | (uint64_t{1} << 62);
}

// Descriptor of the same tile `bytes` further on: the start address is the low field (address
// >> 4, 14 bits), so an offset inside the 256 KiB shared window is an add to the low 32-bit word
// alone (no carry out of the field for addresses below 2^18); a 64-bit add would cost two
// instructions (IADD3 + IMAD.X) per descriptor.
__device__ __forceinline__ uint64_t wgmma_descriptor_advance(uint64_t descriptor, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

// No instruction: hides a descriptor's value from the optimiser, so descriptors derived from
// it are recomputed (one add each) where they are used instead of being hoisted out of the
// main loop and kept live in registers (kHeadSteps x stages of them).
__device__ __forceinline__ uint64_t wgmma_opaque(uint64_t descriptor) {
  asm volatile("" : "+l"(descriptor));
  return descriptor;
}

// Emits wgmma.fence.sync.aligned: orders this warpgroup's earlier register and shared-memory
// accesses before the wgmma.mma_async instructions that follow (needed before the first wgmma
// and whenever registers a wgmma reads, its accumulators or A fragment, were just written).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// Emits wgmma.commit_group.sync.aligned: closes the issued wgmma.mma_async into one group.
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Emits wgmma.wait_group.sync.aligned N: waits until at most N of this warpgroup's groups are
// pending. Afterwards the accumulators of the completed groups may be read.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(kPending >= 0 && kPending <= 7, "wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// No instruction: tells the compiler that `value` may change here, so no read of an
// accumulator is moved above the wgmma_wait_group that makes it valid, and no write below the
// wgmma that reads it (CUTLASS's warpgroup_fence_operand).
__device__ __forceinline__ void wgmma_fence_operand(float& value) {
  asm volatile("" : "+f"(value)::"memory");
}
__device__ __forceinline__ void wgmma_fence_operand(uint32_t& value) {
  asm volatile("" : "+r"(value)::"memory");
}
template <class T, int kCount>
__device__ __forceinline__ void wgmma_fence_operands(T (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) wgmma_fence_operand(values[i]);
}

}  // namespace tessera::detail::ptx
