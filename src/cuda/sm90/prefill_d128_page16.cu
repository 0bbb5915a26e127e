// sm90 prefill kernels for head_dim 128 over paged caches of 16-key pages: K and V tiles laid out
// page by page, one TMA box per page each, Q K^T per page with Q in registers (prefill_traits.cuh,
// PrefillTraitsD128Page16). fp16/bf16 x soft-cap off/on, in their own translation unit so the
// build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

const PrefillKernel* prefill_kernel_d128_page16(DType dtype, bool soft_cap) {
  return select_prefill_kernel<PrefillTraitsD128Page16>(dtype, soft_cap);
}

}  // namespace tessera::detail::sm90
