// sm90 prefill kernels for head_dim 128 over paged caches with pages shorter than a key tile:
// V tiles laid out page by page so one TMA box copies a page across both column blocks
// (prefill_traits.cuh, PrefillTraitsD128Paged). fp16/bf16 x soft-cap off/on, in their own
// translation unit so the build parallelises.
#include "cuda/sm90/prefill_kernel.cuh"

namespace tessera::detail::sm90 {

void add_prefill_rows_d128_paged(KernelRows& rows) {
  add_prefill_rows<PrefillTraitsD128Paged>(rows);
}

}  // namespace tessera::detail::sm90
