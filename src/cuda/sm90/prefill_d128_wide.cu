// sm90 prefill kernels for head_dim 128 with 176-key tiles (ragged K/V, no causal mask or
// window, no soft-cap; prefill_traits.cuh): fp16 and bf16. The soft-cap variants spill at this
// tile width (192 bytes: the tanh's temporaries on top of 88 score registers), so soft-cap keeps
// the 128-key kernel. Their own translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

void add_prefill_rows_d128_wide(KernelRows& rows) {
  rows.push_back(prefill_row<PrefillTraitsD128Wide, false>(kKernelWideTiles));
  // No soft-cap row: soft-cap plans take the 128-key rows.
}

}  // namespace tessera::detail::sm90
