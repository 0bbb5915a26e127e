// The planner: request lengths in, a balanced work list out. A pure, deterministic host function
// (no device access), unit-tested on the CPU.
//
// Work is cut into (request, kv head, q tile) items; a q tile holds up to
// config.q_tile_rows / group_size query tokens, each with all group_size query heads of its kv
// head (GQA packing: one read of a K/V tile serves the whole group). Items are costed by the
// number of visible (query row, key) pairs plus a per-key memory term and a fixed overhead, long
// key ranges are split (split-KV) so that no item costs more than a fair share of the total, and
// items go longest-first onto the least-loaded worker (LPT scheduling). Prefill plans whose K/V
// exceed an L2 section (settings().plan_section_bytes, TESSERA_PLAN_L2_MB, default 16 MiB) are
// scheduled section by section (request groups x kv-head chunks), so that the workers read the
// same K/V from L2 at the same time (planner_schedule.cpp, step 4; TESSERA_PLAN_L2_MB=0: plain
// LPT, for timing).
//
// Files: planner.cpp (cost model, capacity_bound, make_plan: tiles, split-KV search, work list),
// planner_schedule.cpp (piece order, LPT, L2 sections), planner_explain.cpp (Plan::explain),
// planner_internal.hpp (what they share).
#pragma once

#include <vector>

#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

struct PlanShape {
  AttentionOp op = AttentionOp::kRaggedPrefill;
  Device device{};
  std::vector<int32_t> q_lens;
  std::vector<int32_t> kv_lens;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  AttentionOptions options{};
  // Fixed workspace capacity and deterministic mode (see PlanCapacity). make_plan applies
  // capacity.deterministic and, for a fixed capacity without merge or partial room, turns
  // split-KV off; it throws tessera::Error(kInvalidArgument) when the plan does not fit.
  PlanCapacity capacity{};
};

// Cost-model weights, in units of one (query row, key) pair.
inline constexpr double kCostPerKeyRead = 16.0;   // loading one K/V row (memory term)
inline constexpr double kCostPerItem = 2048.0;    // launch/prologue/epilogue of one work item
// Split points of a key range are multiples of this many keys (kernel tile friendly).
inline constexpr int32_t kSplitAlignment = 64;

MaskSpec mask_of(const AttentionOptions& options);

// Upper bound on the lists of any plan with at most max_batch requests, max_total_q query tokens
// and max_kv_len keys per request under `config` (PlanCapacity::fixed() unless max_batch <= 0).
PlanCapacity capacity_bound(int32_t max_batch, int64_t max_total_q, int32_t max_kv_len,
                            int32_t num_qo_heads, int32_t num_kv_heads, const PlanConfig& config);

// Builds the plan; the caller has validated the shape. `config.q_tile_rows` must be >= the GQA
// group size (checked; throws tessera::Error otherwise).
Plan make_plan(const PlanShape& shape, const PlanConfig& config);

// Visible (row, key) pairs of rows [q_start, q_start + q_len) of a request (q_len_total rows,
// kv_len keys) inside keys [kv_start, kv_end): the sum over the rows of their visible keys
// there, in O(1) mask evaluations rather than one per row.
int64_t visible_pairs(const MaskSpec& mask, int32_t q_start, int32_t q_len, int32_t q_len_total,
                      int32_t kv_len, int32_t kv_start, int32_t kv_end);

// Cost of one work item under the model above.
double work_item_cost(const WorkItem& item, const MaskSpec& mask, int32_t q_len_of_request,
                      int32_t kv_len_of_request, int32_t group_size);

}  // namespace tessera::detail
