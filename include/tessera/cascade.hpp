// Multi-level cascade attention over one paged KV cache (FlashInfer's
// MultiLevelCascadeAttentionWrapper; vLLM's cascade attention for a long shared prefix).
//
// Semantics. Every level covers the same total_q query rows of q, in the same order, and groups
// them into its own "requests" with its own CSR: level l has qo_indptr_l [B_l + 1] (ending at
// total_q) and a page table (page_indptr_l, page_indices_l, last_page_len_l) into the one
// k_cache / v_cache. Query row r attends, in one softmax, to the keys of the group that holds r
// at every level:
//  * at levels 0 .. L-2 (the shared prefixes) to every key of its group: those keys precede all
//    of the group's queries, so no mask applies there (FlashInfer applies causal to the last
//    level only as well);
//  * at the last level L-1 (each request's own keys) as in paged prefill with `options`: the
//    causal mask is aligned bottom-right against that level's keys.
// The result equals one paged prefill over each request's concatenated keys (level 0 first) when
// the groups nest and, with causal, every last-level request holds at least q_len - 1 keys. It
// is computed as one attention per level, each written with its lse into the workspace, and an
// exact merge of the level states (merge_state), so a prefix shared by a whole group is read
// once for the group instead of once per request. Sliding windows are rejected (a window over
// the concatenated keys is not a per-level mask). Soft-cap, sm_scale, fp8 k_scale / v_scale and
// GQA apply at every level; attention sinks (RunOptions::sinks) join the softmax once (folded
// into the last level's state). Custom and tree masks (RunOptions::custom_mask / tree_mask)
// are rejected, naming the field: they index a request's own keys, which the levels split. The
// non-finite definition of attention.hpp holds per row: a
// row that sees no key at any level gives o = 0 and lse = -inf (the sink's z with a sink).
//
// A level whose requests all hold exactly one query row (decode steps) runs the decode kernels;
// any other level runs paged prefill. The choice is made once, in plan_cascade.
//
// CUDA graphs: a captured run_cascade replays the plan it was captured with (the level runs
// upload their own work lists inside the capture); plan and capture again when the batch
// changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera {

// Host lengths of one level, for planning.
struct CascadeLevelLengths {
  std::span<const int32_t> qo_indptr;      // [B_l + 1], ends at total_q
  std::span<const int32_t> page_indptr;    // [B_l + 1]
  std::span<const int32_t> last_page_len;  // [B_l]
};

// Index tensors of one level on the plan's device, for running (the values planned; the
// qo_indptr of a level planned as decode is not read).
struct CascadeLevel {
  TensorView qo_indptr;
  TensorView page_indptr;
  TensorView page_indices;
  TensorView last_page_len;
};

struct CascadePlan {
  // One plan per level: paged prefill (or decode, see above). Levels 0 .. L-2 are planned
  // without a mask; the last with the caller's options.
  std::vector<Plan> levels;
  // Workspace layout: level l's own workspace at level_offsets[l]; its (o, lse) state at
  // state_offsets[l] (o sized for 4-byte elements, then lse float32 [total_q, num_qo_heads]);
  // with more than two levels, two float32 merge accumulators at accumulator_offset.
  std::vector<size_t> level_offsets;
  std::vector<size_t> state_offsets;
  size_t accumulator_offset = 0;
  size_t workspace_bytes = 0;
  int64_t total_q = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  Device device{};
  AttentionOptions options{};

  int num_levels() const { return static_cast<int>(levels.size()); }
  // Each level's op and partition (`tessera plan --explain` per level).
  std::string explain() const;
};

// Plans every level (host lengths in; pure and deterministic). 1 <= levels.size() <= 16.
CascadePlan plan_cascade(std::span<const CascadeLevelLengths> levels, int page_size,
                         int num_qo_heads, int num_kv_heads, int head_dim,
                         const AttentionOptions& options, Device device = {});

// Uploads every level's work lists into its part of `workspace` (see upload_plan); CPU: no-op.
void upload_cascade(CascadePlan& plan, Workspace workspace, void* stream = nullptr);

// Runs the cascade: q, o [total_q, num_qo_heads, head_dim] (o in q's dtype), lse optional
// float32 [total_q, num_qo_heads]. k_cache / v_cache as in PagedKVCache with `layout`; `levels`
// holds one CascadeLevel per planned level. Every argument is validated before o or lse is
// written (the levels' states live in the workspace). Never allocates; never synchronises the
// host on the GPU.
void run_cascade(const CascadePlan& plan, const TensorView& q, const TensorView& k_cache,
                 const TensorView& v_cache, KVLayout layout, std::span<const CascadeLevel> levels,
                 const TensorView& o, const TensorView& lse, Workspace workspace,
                 void* stream = nullptr, const RunOptions& run_options = {});

}  // namespace tessera
