// Warp-collective loads of 8x8 16-bit matrices from shared memory into mma fragments (sm_75+).
//
// Lanes 8*i .. 8*i + 7 supply the row addresses (16 bytes each) of matrix i; afterwards register
// i of every lane holds its slice of matrix i: lane l gets row l / 4, elements 2*(l % 4) + {0,1}
// (PTX ISA, "Warp-level matrix load instruction: ldmatrix"). With .trans the matrix is delivered
// transposed: lane l gets column l / 4, rows 2*(l % 4) + {0,1} - the B operand of P x V when V
// is stored row-major (one key per row).
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits ldmatrix.sync.aligned.m8n8.x4.shared.b16. `smem_row_address` is a .shared address.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&fragment)[4], uint32_t smem_row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(smem_row_address));
}

// Emits ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&fragment)[4],
                                                  uint32_t smem_row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(smem_row_address));
}

}  // namespace tessera::detail::ptx
