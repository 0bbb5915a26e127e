// sm80 decode kernels for head_dim 128 (and every smaller multiple of 8 above the previous bucket,
// zero-padded): q fp16/bf16 x K/V (same dtype, fp8 e4m3, fp8 e5m2) x 1/2/4 query rows per row
// slot. One translation unit per head_dim so the build parallelises; shapes are in
// decode_traits.cuh.
#include "cuda/sm80/decode_kernel.cuh"
#include "cuda/sm80/decode_mma.cuh"

namespace tessera::detail::sm80 {

const DecodeKernel* decode_kernel_d128(DType q_dtype, DType kv_dtype, int rows_per_thread) {
  return select_decode_kernel<128>(q_dtype, kv_dtype, rows_per_thread);
}

const DecodeKernel* decode_mma_kernel_d128(DType q_dtype, DType kv_dtype, bool full_rows,
                                           int variant) {
  return select_decode_mma_kernel<128>(q_dtype, kv_dtype, full_rows, variant);
}

}  // namespace tessera::detail::sm80
