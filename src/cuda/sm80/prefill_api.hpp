// Host-side interface of the sm80 (FlashAttention-2 style) prefill kernels: what the launcher in
// cuda/attention.cu and the planner knobs in cuda/device.cu need, without CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/problem.hpp"
#include "core/workspace_layout.hpp"
#include "cuda/prefill_args.hpp"
#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera::detail::sm80 {

// The launch arguments every prefill kernel family shares (cuda/prefill_args.hpp).
using detail::PrefillArgs;

// One compiled prefill kernel (head_dim bucket x dtype x soft-cap) and its launch shape.
struct PrefillKernel {
  const char* name;
  int head_dim;  // instantiated head_dim (64, 128, 256); smaller multiples of 8 are padded
  int block_m;   // packed query rows (tokens x group heads) per CTA tile
  int block_n;   // keys per K/V tile
  int num_threads;
  int stages;
  size_t smem_bytes;
  // Launches one CTA per worker on `stream` (a cudaStream_t). Throws tessera::Error(kRuntime)
  // naming the kernel and launch shape when the launch fails.
  void (*launch)(const PrefillArgs& args, void* stream);
  // Resident CTAs per SM on `device` (0 when the kernel cannot run there).
  int (*max_ctas_per_sm)(int device);
};

using detail::prefill_head_dim_bucket;  // cuda/prefill_args.hpp

// Tile-shape variant of the prefill kernels (0 = default; 1, 2 = tuning candidates, see
// PrefillVariantTraits in prefill_traits.cuh), from the environment variable
// TESSERA_PREFILL_VARIANT, read once per process. Unknown values select 0. The planner
// (cuda_plan_config) and the launcher both go through find_prefill_kernel, so they always agree
// on the variant and on its BLOCK_M.
// Unset: -1, meaning each head_dim's measured default (kDefaultPrefillVariant).
inline int prefill_variant() {
  static const int variant = [] {
    const char* env = std::getenv("TESSERA_PREFILL_VARIANT");
    if (env == nullptr || *env == '\0') return -1;
    const int value = std::atoi(env);
    return value >= 0 && value <= 2 ? value : 0;
  }();
  return variant;
}

// The variant each head_dim runs by default, from the side-by-side timing on the H200
// (docs/PERF.md, "v2"): 128x128 tiles win at d64 (+7%), 128x64 tiles with 8 warps at d256
// (+3%), and d128 keeps its original 128x64 / 4-warp tile.
template <int kHeadDim>
inline constexpr int kDefaultPrefillVariant = kHeadDim == 128 ? 0 : 1;

// Per-bucket tables, one per translation unit (prefill_d64.cu, prefill_d128.cu, prefill_d256.cu).
// `dtype` is the q/k/v dtype (fp16 or bf16); nullptr for any other dtype.
const PrefillKernel* prefill_kernel_d64(DType dtype, bool soft_cap);
const PrefillKernel* prefill_kernel_d128(DType dtype, bool soft_cap);
const PrefillKernel* prefill_kernel_d256(DType dtype, bool soft_cap);

// The kernel serving (head_dim, dtype, soft-cap), nullptr when none does.
inline const PrefillKernel* find_prefill_kernel(int head_dim, DType dtype, bool soft_cap) {
  switch (prefill_head_dim_bucket(head_dim)) {
    case 64: return prefill_kernel_d64(dtype, soft_cap);
    case 128: return prefill_kernel_d128(dtype, soft_cap);
    case 256: return prefill_kernel_d256(dtype, soft_cap);
    default: return nullptr;
  }
}

// Merge of split-KV partials (merge_partials.cu): for every MergeItem, combines the float
// partial (o, lse) rows of its splits into o (q dtype, at the problem's strides) and lse.
struct MergeArgs {
  AttentionProblem problem;           // device pointers; o / lse are written
  const MergeItem* merges = nullptr;  // uploaded plan.merges
  // With header: min(header->num_merges, max_merges) items are merged (the count of the plan
  // uploaded last; graph replays); without (null): max_merges items.
  const PlanHeader* header = nullptr;
  int32_t max_merges = 0;  // merge slots: sizes the grid
  const float* partial_o = nullptr;
  const float* partial_lse = nullptr;
};
void launch_merge_partials(const MergeArgs& args, int num_sms, void* stream);

}  // namespace tessera::detail::sm80
