// sm80 decode kernels for head_dim 256 (and every smaller multiple of 8 above the previous bucket,
// zero-padded): q fp16/bf16 x K/V (same dtype, fp8 e4m3, fp8 e5m2) x 1/2/4 query rows per row
// slot. One translation unit per head_dim so the build parallelises; shapes are in
// decode_traits.cuh.
#include "cuda/sm80/decode_cuda_core.cuh"
#include "cuda/sm80/decode_mma.cuh"

namespace tessera::detail::sm80 {

// Tensor-core rows first: select_kernel prefers them where they serve.
void add_decode_rows_d256(KernelRows& rows) {
  add_decode_mma_rows<256>(rows);
  add_decode_rows<256>(rows);
}

}  // namespace tessera::detail::sm80
