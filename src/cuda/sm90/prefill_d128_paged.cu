// sm90 prefill kernels for head_dim 128 over paged caches with pages shorter than a key tile:
// V tiles laid out page by page so one TMA box copies a page across both column blocks
// (prefill_traits.cuh, PrefillTraitsD128Paged). fp16/bf16 x soft-cap off/on, in their own
// translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

const PrefillKernel* prefill_kernel_d128_paged(DType dtype, bool soft_cap) {
  return select_prefill_kernel<PrefillTraitsD128Paged>(dtype, soft_cap);
}

}  // namespace tessera::detail::sm90
