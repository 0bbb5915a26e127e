// Warp-level tensor-core multiply-accumulate (sm_80+).
//
// One wrapper per instruction: D (16x8 f32) += A (16x16, row-major) x B (16x8, "col" = K-major).
// Fragment ownership (PTX ISA, section "Matrix Fragments for mma.m16n8k16 with floating point
// type"), with group = lane / 4 and quad_lane = lane % 4:
//   a[0]: row group,     k 2*quad_lane + {0,1}     a[1]: row group + 8, same k
//   a[2]: row group,     k 2*quad_lane + 8 + {0,1} a[3]: row group + 8, same k
//   b0:   k 2*quad_lane + {0,1}, n group            b1: k 2*quad_lane + 8 + {0,1}, n group
//   d[0..1]: row group, n 2*quad_lane + {0,1}       d[2..3]: row group + 8, same n
// Each 32-bit register packs two 16-bit values, the lower-indexed element in the low half.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
// (PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions: mma").
__device__ __forceinline__ void mma_m16n8k16_f32_f16(float (&d)[4], const uint32_t (&a)[4],
                                                     uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Emits mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions: mma").
__device__ __forceinline__ void mma_m16n8k16_f32_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                      uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace tessera::detail::ptx
