// Shared-memory addressing: the 32-bit .shared address that ldmatrix / cp.async take, and the XOR
// swizzle that makes both of them bank-conflict free on row-major tiles of 16-bit elements.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits cvta.to.shared (through the __cvta_generic_to_shared builtin): generic pointer ->
// .shared window offset (PTX ISA, "Data Movement and Conversion Instructions: cvta").
__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// A tile row of kChunksPerRow 16-byte chunks (8 halves each), rows stored back to back.
// Shared memory has 32 banks of 4 bytes, i.e. 8 slots of 16 bytes per 128-byte line. ldmatrix
// reads 8 rows x 16 bytes per phase and cp.async writes 8 chunks x 16 bytes per phase; without a
// swizzle the same chunk of 8 consecutive rows sits in one 16-byte slot (rows are a multiple of
// 128 bytes long) - an 8-way conflict. XOR-ing the chunk index with (row % 8) spreads those 8
// rows over the 8 slots, while the 8 chunks of one row stay a permutation of the 8 slots. This
// is the CUTLASS Swizzle<3,4,3> layout that FlashAttention-2 uses for Q/K/V.
template <int kChunksPerRow>
__device__ __forceinline__ uint32_t swizzled_chunk_offset(int row, int chunk) {
  static_assert(kChunksPerRow % 8 == 0, "the swizzle needs rows of at least 128 bytes");
  return static_cast<uint32_t>(row * kChunksPerRow * 16 + ((chunk ^ (row & 7)) << 4));
}

}  // namespace tessera::detail::ptx
