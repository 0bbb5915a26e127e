// Property tests of the planner (a pure host function): exact coverage of every visible
// (row, head, key) triple, consistent split-KV bookkeeping, bounded imbalance, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <tuple>

#include "core/planner.hpp"
#include "core/workspace_layout.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {
namespace {

PlanShape random_shape(std::mt19937_64& rng, AttentionOp op) {
  PlanShape shape;
  shape.op = op;
  std::uniform_int_distribution<int> batch_dist(1, 12), len_dist(0, 700), group_dist(1, 8);
  std::uniform_int_distribution<int> coin(0, 1), kv_heads_dist(1, 4);
  const int batch = batch_dist(rng);
  const int q_per_request = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int b = 0; b < batch; ++b) {
    const int kv_len = len_dist(rng);
    int q_len = op == AttentionOp::kDecode ? q_per_request : len_dist(rng);
    if (op != AttentionOp::kDecode && coin(rng)) q_len = std::min(q_len, kv_len);
    shape.q_lens.push_back(q_len);
    shape.kv_lens.push_back(kv_len);
  }
  shape.num_kv_heads = kv_heads_dist(rng);
  shape.num_qo_heads = shape.num_kv_heads * group_dist(rng);
  shape.head_dim = 128;
  shape.page_size = 16;
  shape.options.causal = coin(rng);
  if (coin(rng)) shape.options.window_left = std::uniform_int_distribution<int>(0, 300)(rng);
  if (!shape.options.causal && coin(rng)) {
    shape.options.window_right = std::uniform_int_distribution<int>(0, 50)(rng);
  }
  return shape;
}

PlanConfig random_config(std::mt19937_64& rng, int group) {
  PlanConfig config;
  config.q_tile_rows = std::max(group, std::uniform_int_distribution<int>(1, 128)(rng));
  config.num_workers = std::uniform_int_distribution<int>(1, 200)(rng);
  config.split_kv = std::uniform_int_distribution<int>(0, 3)(rng) != 0;
  config.min_kv_chunk = std::uniform_int_distribution<int>(16, 300)(rng);
  config.deterministic = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  return config;
}

// Every visible (request, token, kv head, key) is covered exactly once, every query token of
// every head belongs to exactly one tile, and the split bookkeeping adds up.
void check_plan(const PlanShape& shape, const Plan& plan) {
  const MaskSpec mask = mask_of(shape.options);
  const int group = shape.num_qo_heads / shape.num_kv_heads;
  ASSERT_EQ(plan.worker_indptr.size(), static_cast<size_t>(plan.config.num_workers) + 1);
  ASSERT_EQ(plan.worker_indptr.back(), static_cast<int32_t>(plan.work.size()));
  for (size_t w = 0; w + 1 < plan.worker_indptr.size(); ++w) {
    ASSERT_LE(plan.worker_indptr[w], plan.worker_indptr[w + 1]);
  }
  // coverage[(b, h, t)] -> list of key ranges
  std::map<std::tuple<int, int, int>, std::vector<std::pair<int, int>>> ranges;
  std::map<std::tuple<int, int, int>, int> tile_of_token;
  for (const WorkItem& item : plan.work) {
    ASSERT_GE(item.request, 0);
    ASSERT_LT(item.request, static_cast<int>(shape.q_lens.size()));
    ASSERT_GE(item.q_start, 0);
    ASSERT_GE(item.q_len, 1);
    ASSERT_LE(item.q_start + item.q_len, shape.q_lens[item.request]);
    ASSERT_LE(item.q_len * group, plan.config.q_tile_rows);
    ASSERT_GE(item.kv_start, 0);
    ASSERT_LE(item.kv_start, item.kv_end);
    ASSERT_LE(item.kv_end, shape.kv_lens[item.request]);
    for (int t = item.q_start; t < item.q_start + item.q_len; ++t) {
      ranges[{item.request, item.kv_head, t}].push_back({item.kv_start, item.kv_end});
    }
  }
  for (int b = 0; b < static_cast<int>(shape.q_lens.size()); ++b) {
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      for (int t = 0; t < shape.q_lens[b]; ++t) {
        auto it = ranges.find({b, h, t});
        ASSERT_NE(it, ranges.end()) << "token " << t << " of request " << b << " kv head " << h
                                    << " is in no work item";
        std::vector<std::pair<int, int>> pieces = it->second;
        std::sort(pieces.begin(), pieces.end());
        for (size_t i = 1; i < pieces.size(); ++i) {
          ASSERT_LE(pieces[i - 1].second, pieces[i].first) << "overlapping key ranges";
        }
        int32_t first, last;
        mask.visible_range(t, shape.q_lens[b], shape.kv_lens[b], &first, &last);
        for (int j = first; j < last; ++j) {
          int hits = 0;
          for (auto [lo, hi] : pieces) hits += (j >= lo && j < hi);
          ASSERT_EQ(hits, 1) << "key " << j << " of token " << t << " request " << b;
        }
      }
    }
  }
  // Split bookkeeping: each merge's pieces exist with consecutive partial rows.
  int64_t rows_seen = 0;
  for (const WorkItem& w : plan.work) {
    ASSERT_EQ(w.partial_row < 0, w.merge_index < 0) << "a piece has a partial row iff a merge";
    ASSERT_LT(w.merge_index, static_cast<int32_t>(plan.merges.size()));
  }
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    const MergeItem& merge = plan.merges[m];
    const int rows = merge.q_len * group;
    ASSERT_GE(merge.num_splits, 2);
    const auto pieces_of_merge = std::count_if(plan.work.begin(), plan.work.end(),
        [&](const WorkItem& w) { return w.merge_index == static_cast<int32_t>(m); });
    ASSERT_EQ(pieces_of_merge, merge.num_splits) << "merge_index counts of merge " << m;
    for (int s = 0; s < merge.num_splits; ++s) {
      const int32_t row = merge.first_partial_row + s * rows;
      const bool found = std::any_of(plan.work.begin(), plan.work.end(), [&](const WorkItem& w) {
        return w.partial_row == row && w.request == merge.request &&
               w.kv_head == merge.kv_head && w.q_start == merge.q_start &&
               w.q_len == merge.q_len && w.merge_index == static_cast<int32_t>(m);
      });
      ASSERT_TRUE(found) << "missing piece " << s << " of a split tile";
    }
    rows_seen += static_cast<int64_t>(rows) * merge.num_splits;
  }
  ASSERT_EQ(rows_seen, plan.num_partial_rows);
  ASSERT_EQ(plan.workspace_bytes, WorkspaceLayout::of(plan).total);
}

TEST(Planner, RandomShapesCoverEveryVisiblePairExactlyOnce) {
  std::mt19937_64 rng(20261202);
  for (int trial = 0; trial < 300; ++trial) {
    const AttentionOp op = trial % 3 == 0 ? AttentionOp::kDecode : AttentionOp::kRaggedPrefill;
    const PlanShape shape = random_shape(rng, op);
    const PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    const Plan plan = make_plan(shape, config);
    SCOPED_TRACE("trial " + std::to_string(trial) + "\n" + plan.explain());
    check_plan(shape, plan);
    if (HasFatalFailure()) return;
  }
}

TEST(Planner, IsDeterministic) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const PlanShape shape = random_shape(rng, AttentionOp::kRaggedPrefill);
    const PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    const Plan a = make_plan(shape, config), b = make_plan(shape, config);
    ASSERT_EQ(a.work.size(), b.work.size());
    for (size_t i = 0; i < a.work.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(&a.work[i], &b.work[i], sizeof(WorkItem)));
    }
    EXPECT_EQ(a.worker_indptr, b.worker_indptr);
    EXPECT_EQ(a.merges.size(), b.merges.size());
  }
}

// LPT bound: the busiest worker carries at most the mean plus the largest single item.
TEST(Planner, ImbalanceIsBounded) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    const PlanShape shape = random_shape(rng, AttentionOp::kRaggedPrefill);
    const PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    const Plan plan = make_plan(shape, config);
    const MaskSpec mask = mask_of(shape.options);
    double total = 0, largest = 0;
    for (const WorkItem& item : plan.work) {
      const double cost = work_item_cost(item, mask, shape.q_lens[item.request],
                                         shape.kv_lens[item.request],
                                         shape.num_qo_heads / shape.num_kv_heads);
      total += cost;
      largest = std::max(largest, cost);
    }
    EXPECT_LE(plan.max_worker_cost, total / config.num_workers + largest + 1e-6);
  }
}

// FlashInfer's motivating case: one long request beside many short ones must not leave most
// workers idle. With split-KV the busiest worker stays close to the mean.
TEST(Planner, SkewedDecodeBatchIsBalancedBySplitKv) {
  PlanShape shape;
  shape.op = AttentionOp::kDecode;
  shape.q_lens.assign(256, 1);
  shape.kv_lens.assign(256, 512);
  shape.kv_lens[0] = 32768;
  shape.num_qo_heads = 32;
  shape.num_kv_heads = 8;
  shape.head_dim = 128;
  shape.page_size = 16;
  PlanConfig config;
  config.q_tile_rows = 64;
  config.num_workers = 132;
  config.min_kv_chunk = 256;
  const Plan plan = make_plan(shape, config);
  check_plan(shape, plan);
  const double mean = plan.total_cost / config.num_workers;
  EXPECT_LT(plan.max_worker_cost / mean, 1.25) << plan.explain();
  EXPECT_FALSE(plan.merges.empty());
  config.split_kv = false;
  const Plan unsplit = make_plan(shape, config);
  EXPECT_GT(unsplit.max_worker_cost / mean, 2.0) << "without split-KV the long request dominates";
}

// Deterministic mode: split points are fixed multiples of the chunk, whatever else the batch
// holds, so request 0's arithmetic is identical in both batches.
TEST(Planner, DeterministicSplitsDoNotDependOnTheBatch) {
  PlanShape alone;
  alone.op = AttentionOp::kDecode;
  alone.q_lens = {1};
  alone.kv_lens = {5000};
  alone.num_qo_heads = alone.num_kv_heads = 4;
  alone.head_dim = 64;
  PlanShape crowded = alone;
  for (int i = 0; i < 100; ++i) {
    crowded.q_lens.push_back(1);
    crowded.kv_lens.push_back(100 + 37 * i);
  }
  PlanConfig config;
  config.num_workers = 16;
  config.min_kv_chunk = 1024;
  config.deterministic = true;
  auto pieces_of_request0 = [&](const Plan& plan) {
    std::vector<std::tuple<int, int, int>> pieces;
    for (const WorkItem& item : plan.work) {
      if (item.request == 0) pieces.push_back({item.kv_head, item.kv_start, item.kv_end});
    }
    std::sort(pieces.begin(), pieces.end());
    return pieces;
  };
  const auto a = pieces_of_request0(make_plan(alone, config));
  const auto b = pieces_of_request0(make_plan(crowded, config));
  EXPECT_EQ(a, b);
  for (auto [head, start, end] : a) EXPECT_EQ(start % 1024, 0);
}

TEST(Planner, EmptyRequestsAndRowsWithoutKeysGetItems) {
  PlanShape shape;
  shape.q_lens = {0, 5, 3, 0};
  shape.kv_lens = {4, 0, 2, 0};  // request 2: causal q_len 3 > kv_len 2: row 0 sees nothing
  shape.num_qo_heads = 6;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  shape.options.causal = true;
  PlanConfig config;
  const Plan plan = make_plan(shape, config);
  check_plan(shape, plan);
  EXPECT_EQ(plan.total_q, 8);
}

TEST(Planner, GroupLargerThanTileIsAClearError) {
  PlanShape shape;
  shape.q_lens = {1};
  shape.kv_lens = {1};
  shape.num_qo_heads = 96;
  shape.num_kv_heads = 1;
  shape.head_dim = 64;
  PlanConfig config;
  config.q_tile_rows = 64;
  try {
    make_plan(shape, config);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kUnsupported);
    EXPECT_NE(std::string(error.what()).find("num_qo_heads"), std::string::npos);
  }
}

TEST(Planner, ExplainDescribesThePartition) {
  PlanShape shape;
  shape.q_lens = {100};
  shape.kv_lens = {4000};
  shape.num_qo_heads = 8;
  shape.num_kv_heads = 2;
  shape.head_dim = 128;
  PlanConfig config;
  config.num_workers = 8;
  const std::string text = make_plan(shape, config).explain();
  EXPECT_NE(text.find("ragged_prefill"), std::string::npos);
  EXPECT_NE(text.find("group 4"), std::string::npos);
  EXPECT_NE(text.find("imbalance"), std::string::npos);
  EXPECT_NE(text.find("worker 0"), std::string::npos);
}

}  // namespace
}  // namespace tessera::detail
