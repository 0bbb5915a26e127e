// Property tests of the planner (a pure host function): exact coverage of every visible
// (row, head, key) triple, consistent split-KV bookkeeping, bounded imbalance, determinism, L2
// sections. tests/test_planner_reference.cpp checks that the fast search picks the plan of a
// direct implementation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/scoped_env.hpp"
#include "core/planner.hpp"
#include "core/workspace_layout.hpp"
#include "tessera/attention.hpp"
#include "test_planner_shapes.hpp"

namespace tessera::detail {
namespace {

using planner_test::random_config;
using planner_test::random_shape;

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

// visible_pairs sums a tile's visible keys in closed form: the same count as row by row, for
// every mask (causal, windows on either side, none), queries longer or shorter than the keys,
// and key ranges cutting the rows anywhere, including empty ones.
TEST(Planner, VisiblePairsEqualTheRowByRowCount) {
  std::mt19937_64 rng(77);
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  int nonzero = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    MaskSpec mask;
    mask.causal = uniform(0, 1) == 1;
    mask.window_left = uniform(0, 2) == 0 ? -1 : uniform(0, 300);
    mask.window_right = uniform(0, 2) == 0 ? -1 : uniform(0, 300);
    const int32_t q_total = uniform(1, 600);
    const int32_t kv_len = uniform(0, 3) == 0 ? uniform(0, 40) : uniform(0, 900);
    const int32_t q_start = uniform(0, q_total - 1);
    const int32_t q_len = uniform(1, q_total - q_start);
    const int32_t kv_start = uniform(0, kv_len);
    const int32_t kv_end = uniform(kv_start, kv_len);
    int64_t expected = 0;
    for (int32_t t = q_start; t < q_start + q_len; ++t) {
      int32_t first, last;
      mask.visible_range(t, q_total, kv_len, &first, &last);
      first = std::max(first, kv_start);
      last = std::min(last, kv_end);
      if (last > first) expected += last - first;
    }
    nonzero += expected > 0;
    ASSERT_EQ(visible_pairs(mask, q_start, q_len, q_total, kv_len, kv_start, kv_end), expected)
        << "trial " << trial << ": causal " << mask.causal << ", window (" << mask.window_left
        << ", " << mask.window_right << "), rows [" << q_start << ", " << q_start + q_len << ") of "
        << q_total << ", keys [" << kv_start << ", " << kv_end << ") of " << kv_len;
  }
  EXPECT_GT(nonzero, 10000);
}

// The GPU kernels' 32-bit visible_range_narrow equals the 64-bit visible_range for every row of
// a request (0 <= i < q_len), small and near-INT32_MAX lengths and windows alike (where the
// 32-bit sums would overflow if formed unguarded).
TEST(Planner, NarrowVisibleRangeEqualsTheWideOne) {
  std::mt19937_64 rng(78);
  const auto pick = [&](int64_t lo, int64_t hi) {
    return static_cast<int32_t>(std::uniform_int_distribution<int64_t>(lo, hi)(rng));
  };
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  const auto length = [&](int32_t at_least) {
    switch (pick(0, 3)) {
      case 0: return pick(at_least, 40);
      case 1: return pick(at_least, 5000);
      case 2: return pick(std::max(at_least, kMax - 50), kMax);
      default: return pick(at_least, kMax);
    }
  };
  const auto window = [&]() {
    switch (pick(0, 4)) {
      case 0: return -1;
      case 1: return pick(0, 60);
      case 2: return pick(kMax - 50, kMax);
      default: return pick(0, kMax);
    }
  };
  for (int trial = 0; trial < 200000; ++trial) {
    MaskSpec mask;
    mask.causal = pick(0, 1) == 1;
    mask.window_left = window();
    mask.window_right = window();
    const int32_t q_len = length(1);
    const int32_t kv_len = length(0);
    const int32_t i = pick(0, 2) == 0 ? q_len - 1 - pick(0, std::min(q_len - 1, 40))
                                      : pick(0, q_len - 1);
    int32_t wide_first, wide_last, narrow_first, narrow_last;
    mask.visible_range(i, q_len, kv_len, &wide_first, &wide_last);
    mask.visible_range_narrow(i, q_len, kv_len, &narrow_first, &narrow_last);
    ASSERT_TRUE(wide_first == narrow_first && wide_last == narrow_last)
        << "trial " << trial << ": causal " << mask.causal << ", window (" << mask.window_left
        << ", " << mask.window_right << "), row " << i << " of " << q_len << ", " << kv_len
        << " keys: wide [" << wide_first << ", " << wide_last << "), narrow [" << narrow_first
        << ", " << narrow_last << ")";
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

// L2 sections (planner_schedule.cpp, step 4): causal MHA 4 x 4096 with 32 heads of 128 has 2 MiB of K/V
// per (request, head), so sections are one request x 8 heads (16 MiB). Every worker must run its
// items section by section, through most of the 16 sections, and the balance must stay within
// the 2% the planner allows over plain LPT (plain LPT is within 0.1% of the mean here).
TEST(Planner, PrefillWorkersSweepL2SectionsTogether) {
  PlanShape shape;
  shape.op = AttentionOp::kRaggedPrefill;
  shape.q_lens.assign(4, 4096);
  shape.kv_lens.assign(4, 4096);
  shape.num_qo_heads = shape.num_kv_heads = 32;
  shape.head_dim = 128;
  shape.options.causal = true;
  PlanConfig config;
  config.q_tile_rows = 128;
  config.num_workers = 132;
  config.min_kv_chunk = 512;
  const Plan plan = make_plan(shape, config);
  check_plan(shape, plan);
  for (int32_t w = 0; w < config.num_workers; ++w) {
    int32_t previous = -1, sections = 0;
    for (int32_t i = plan.worker_indptr[w]; i < plan.worker_indptr[w + 1]; ++i) {
      const int32_t section = plan.work[i].request * 4 + plan.work[i].kv_head / 8;
      ASSERT_GE(section, previous) << "worker " << w << " item " << i;
      sections += section != previous;
      previous = section;
    }
    EXPECT_GE(sections, 8) << "worker " << w;
  }
  EXPECT_LE(plan.max_worker_cost, 1.02 * plan.total_cost / config.num_workers);
  // Decode plans keep plain LPT: longest first within a worker.
  shape.op = AttentionOp::kDecode;
  shape.q_lens.assign(4, 1);
  const Plan decode = make_plan(shape, config);
  for (int32_t w = 0; w < config.num_workers; ++w) {
    for (int32_t i = decode.worker_indptr[w] + 1; i < decode.worker_indptr[w + 1]; ++i) {
      EXPECT_GE(decode.work[i - 1].kv_end - decode.work[i - 1].kv_start,
                decode.work[i].kv_end - decode.work[i].kv_start);
    }
  }
}

// TESSERA_PLAN_L2_MB (settings().plan_section_bytes) sizes the sections: 8 MiB gives sections of
// one request x 4 heads for the batch above, and 0 turns them off (plain LPT: every worker's
// items longest first, as decode plans are scheduled).
TEST(Planner, PlanL2MbSizesOrTurnsOffTheSections) {
  PlanShape shape;
  shape.op = AttentionOp::kRaggedPrefill;
  shape.q_lens.assign(4, 4096);
  shape.kv_lens.assign(4, 4096);
  shape.num_qo_heads = shape.num_kv_heads = 32;
  shape.head_dim = 128;
  shape.options.causal = true;
  PlanConfig config;
  config.q_tile_rows = 128;
  config.num_workers = 132;
  config.min_kv_chunk = 512;
  const Plan sectioned = make_plan(shape, config);
  const MaskSpec mask = mask_of(shape.options);
  const auto cost = [&](const WorkItem& item) {
    return work_item_cost(item, mask, 4096, 4096, 1);
  };
  {
    const test::ScopedEnv half("TESSERA_PLAN_L2_MB", "8");
    const Plan plan = make_plan(shape, config);
    for (int32_t w = 0; w < config.num_workers; ++w) {
      for (int32_t i = plan.worker_indptr[w] + 1; i < plan.worker_indptr[w + 1]; ++i) {
        const auto section = [&](const WorkItem& item) {
          return item.request * 8 + item.kv_head / 4;
        };
        ASSERT_LE(section(plan.work[i - 1]), section(plan.work[i])) << "worker " << w;
      }
    }
    EXPECT_LE(plan.max_worker_cost, 1.02 * plan.total_cost / config.num_workers);
  }
  {
    const test::ScopedEnv off("TESSERA_PLAN_L2_MB", "0");
    const Plan plain = make_plan(shape, config);
    ASSERT_EQ(plain.work.size(), sectioned.work.size());
    bool differs = false;
    for (int32_t w = 0; w < config.num_workers; ++w) {
      for (int32_t i = plain.worker_indptr[w] + 1; i < plain.worker_indptr[w + 1]; ++i) {
        ASSERT_GE(cost(plain.work[i - 1]), cost(plain.work[i])) << "worker " << w;
      }
    }
    for (size_t i = 0; i < plain.work.size() && !differs; ++i) {
      differs = std::memcmp(&plain.work[i], &sectioned.work[i], sizeof(WorkItem)) != 0;
    }
    EXPECT_TRUE(differs) << "TESSERA_PLAN_L2_MB=0 left the sectioned schedule";
    EXPECT_LE(plain.max_worker_cost, sectioned.max_worker_cost);
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
