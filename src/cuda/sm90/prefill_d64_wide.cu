// sm90 prefill kernels for head_dim 64 with 192-key tiles (ragged K/V, no causal mask or
// window, no soft-cap; prefill_traits.cuh): fp16 and bf16. Soft-cap keeps the 128-key kernel,
// as at d128 (select_kernel). Their own translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

void add_prefill_rows_d64_wide(KernelRows& rows) {
  rows.push_back(prefill_row<PrefillTraitsD64Wide, false>(kKernelWideTiles));
  // No soft-cap row: soft-cap plans take the 128-key rows.
}

}  // namespace tessera::detail::sm90
