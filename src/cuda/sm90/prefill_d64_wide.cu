// sm90 prefill kernels for head_dim 64 with 192-key tiles (ragged K/V, no causal mask or
// window, no soft-cap; prefill_traits.cuh): fp16 and bf16. Soft-cap keeps the 128-key kernel,
// as at d128 (find_prefill_kernel). Their own translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

const PrefillKernel* prefill_kernel_d64_wide(DType dtype) {
  return select_prefill_kernel_no_soft_cap<PrefillTraitsD64Wide>(dtype);
}

}  // namespace tessera::detail::sm90
