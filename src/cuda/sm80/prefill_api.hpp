// Host-side interface of the sm80 (FlashAttention-2 style) prefill kernels beyond their registry
// rows (cuda/kernel_registry.hpp): the default tile variant and the merge of split-KV partials,
// without CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"
#include "core/workspace_layout.hpp"
#include "cuda/prefill_args.hpp"
#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera::detail::sm80 {

// The launch arguments every prefill kernel family shares (cuda/prefill_args.hpp).
using detail::PrefillArgs;

using detail::prefill_head_dim_bucket;  // cuda/prefill_args.hpp

// The tile variant each head_dim runs by default (TESSERA_PREFILL_VARIANT overrides it; the
// rows of every variant are in the kernel registry): 128x128 tiles win at d64, 128x64 tiles with
// 8 warps at d256, and d128 keeps its 128x64 / 4-warp tile (side-by-side timing on the H200).
constexpr int default_prefill_variant(int head_dim_bucket) {
  return head_dim_bucket == 128 ? 0 : 1;
}
// The variant that serves a requested one: d128 has no variant 2 (its 2-stage shape was slower
// and spills), so 2 means 1 there.
constexpr int served_prefill_variant(int head_dim_bucket, int variant) {
  return head_dim_bucket == 128 && variant == 2 ? 1 : variant;
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
