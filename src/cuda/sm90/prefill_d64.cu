// sm90 prefill kernels for head_dim 64 (and every smaller multiple of 8 above the previous
// bucket, zero-padded by TMA): fp16/bf16 x soft-cap off/on. One translation unit per head_dim so
// the build parallelises; shapes are in prefill_traits.cuh.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

void add_prefill_rows_d64(KernelRows& rows) {
  add_prefill_rows<PrefillTraits<64>>(rows);
}

}  // namespace tessera::detail::sm90
