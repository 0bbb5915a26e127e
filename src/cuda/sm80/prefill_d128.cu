// sm80 prefill kernels for head_dim 128 (and every smaller multiple of 8 above the previous
// bucket, zero-padded): fp16/bf16 x soft-cap off/on. One translation unit per head_dim so the
// build parallelises; shapes are in prefill_traits.cuh.
#include "cuda/sm80/prefill_kernel.cuh"

namespace tessera::detail::sm80 {

// Tile variants 0..1 (prefill_traits.cuh), each with soft-cap off and on.
void add_prefill_rows_d128(KernelRows& rows) {
  add_prefill_rows<PrefillTraits<128>>(rows);
  add_prefill_rows<PrefillVariantTraits<128, 1>>(rows);
}

}  // namespace tessera::detail::sm80
