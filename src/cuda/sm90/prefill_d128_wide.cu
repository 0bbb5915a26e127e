// sm90 prefill kernels for head_dim 128 with 176-key tiles (ragged K/V, no causal mask or
// window, no soft-cap; prefill_traits.cuh): fp16 and bf16. The soft-cap variants spill at this
// tile width (192 bytes: the tanh's temporaries on top of 88 score registers), so soft-cap keeps
// the 128-key kernel. Their own translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

const PrefillKernel* prefill_kernel_d128_wide(DType dtype) {
  return select_prefill_kernel_no_soft_cap<PrefillTraitsD128Wide>(dtype);
}

}  // namespace tessera::detail::sm90
