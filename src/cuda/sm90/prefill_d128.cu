// sm90 prefill kernels for head_dim 128 (and every smaller multiple of 8 above the previous
// bucket, zero-padded by TMA): fp16/bf16 x soft-cap off/on. One translation unit per head_dim so
// the build parallelises; shapes are in prefill_traits.cuh.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

const PrefillKernel* prefill_kernel_d128(DType dtype, bool soft_cap) {
  return select_prefill_kernel<PrefillTraits<128>>(dtype, soft_cap);
}

}  // namespace tessera::detail::sm90
