// Plan invariants without gtest (the fuzz target's copy of tests/test_planner.cpp's check_plan,
// with flat arrays instead of maps so that it stays cheap): every visible (request, kv head,
// query token, key) is covered by exactly one work item, items stay inside their request, and
// the split-KV bookkeeping (merge items, partial rows, workspace size) adds up.
// Returns an empty string when the plan is sound, else what is wrong.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/planner.hpp"
#include "core/workspace_layout.hpp"

namespace tessera::detail {

inline std::string plan_violation(const PlanShape& shape, const Plan& plan) {
  const MaskSpec mask = mask_of(shape.options);
  const int group = shape.num_qo_heads / shape.num_kv_heads;
  const int batch = static_cast<int>(shape.q_lens.size());
  if (plan.worker_indptr.size() != static_cast<size_t>(plan.config.num_workers) + 1) {
    return "worker_indptr size";
  }
  if (plan.worker_indptr.front() != 0 ||
      plan.worker_indptr.back() != static_cast<int32_t>(plan.work.size())) {
    return "worker_indptr ends";
  }
  for (size_t w = 0; w + 1 < plan.worker_indptr.size(); ++w) {
    if (plan.worker_indptr[w] > plan.worker_indptr[w + 1]) return "worker_indptr decreasing";
  }
  // Row r of (request b, kv head h, token t): offsets per request.
  std::vector<int64_t> row_base(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    row_base[b + 1] = row_base[b] + static_cast<int64_t>(shape.q_lens[b]) * shape.num_kv_heads;
  }
  std::vector<std::vector<std::pair<int32_t, int32_t>>> ranges(row_base[batch]);
  for (const WorkItem& item : plan.work) {
    if (item.request < 0 || item.request >= batch) return "item request out of range";
    if (item.kv_head < 0 || item.kv_head >= shape.num_kv_heads) return "item kv_head out of range";
    if (item.q_start < 0 || item.q_len < 1 || item.q_start + item.q_len > shape.q_lens[item.request]) {
      return "item query rows out of range";
    }
    if (item.q_len * group > plan.config.q_tile_rows) return "item exceeds q_tile_rows";
    if (item.kv_start < 0 || item.kv_start > item.kv_end ||
        item.kv_end > shape.kv_lens[item.request]) {
      return "item key range out of range";
    }
    for (int t = item.q_start; t < item.q_start + item.q_len; ++t) {
      ranges[row_base[item.request] + static_cast<int64_t>(t) * shape.num_kv_heads + item.kv_head]
          .push_back({item.kv_start, item.kv_end});
    }
  }
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < shape.q_lens[b]; ++t) {
      int32_t first, last;
      mask.visible_range(t, shape.q_lens[b], shape.kv_lens[b], &first, &last);
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        auto& pieces = ranges[row_base[b] + static_cast<int64_t>(t) * shape.num_kv_heads + h];
        if (pieces.empty()) return "a query token is in no work item";
        std::sort(pieces.begin(), pieces.end());
        // The pieces, clipped to the visible range, must tile [first, last) exactly once.
        int32_t covered = first;
        for (size_t i = 0; i < pieces.size(); ++i) {
          if (i > 0 && pieces[i - 1].second > pieces[i].first) return "overlapping key ranges";
          const int32_t lo = std::max(pieces[i].first, first);
          const int32_t hi = std::min(pieces[i].second, last);
          if (lo >= hi) continue;
          if (lo != covered) return "a visible key is in no work item";
          covered = hi;
        }
        if (covered != std::max(first, last)) return "a visible key is in no work item";
      }
    }
  }
  int64_t rows_seen = 0;
  std::unordered_map<int32_t, const WorkItem*> by_partial_row;
  std::vector<int32_t> pieces_of_merge(plan.merges.size(), 0);
  for (const WorkItem& w : plan.work) {
    if (w.partial_row >= 0 && !by_partial_row.emplace(w.partial_row, &w).second) {
      return "two work items write the same partial row";
    }
    if ((w.partial_row < 0) != (w.merge_index < 0)) return "partial row without merge index";
    if (w.merge_index >= static_cast<int32_t>(plan.merges.size())) return "merge index out of range";
    if (w.merge_index >= 0) ++pieces_of_merge[w.merge_index];
  }
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    if (pieces_of_merge[m] != plan.merges[m].num_splits) return "merge index count mismatch";
  }
  for (const MergeItem& merge : plan.merges) {
    const int rows = merge.q_len * group;
    if (merge.num_splits < 2) return "merge of fewer than 2 splits";
    for (int s = 0; s < merge.num_splits; ++s) {
      const int32_t row = merge.first_partial_row + s * rows;
      const auto it = by_partial_row.find(row);
      const WorkItem* w = it == by_partial_row.end() ? nullptr : it->second;
      if (w == nullptr || w->request != merge.request || w->kv_head != merge.kv_head ||
          w->q_start != merge.q_start || w->q_len != merge.q_len) {
        return "missing piece of a split tile";
      }
    }
    rows_seen += static_cast<int64_t>(rows) * merge.num_splits;
  }
  if (rows_seen != plan.num_partial_rows) return "num_partial_rows mismatch";
  for (const WorkItem& item : plan.work) {
    if (item.partial_row >= 0 &&
        item.partial_row + static_cast<int64_t>(item.q_len) * group > plan.num_partial_rows) {
      return "partial row out of the workspace";
    }
  }
  if (plan.workspace_bytes != WorkspaceLayout::of(plan).total) return "workspace_bytes mismatch";
  return {};
}

}  // namespace tessera::detail
