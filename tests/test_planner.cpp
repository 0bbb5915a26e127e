// Property tests of the planner (a pure host function): exact coverage of every visible
// (row, head, key) triple, consistent split-KV bookkeeping, bounded imbalance, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <random>
#include <tuple>

#include "common/scoped_env.hpp"
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

// L2 sections (planner.cpp, step 4): causal MHA 4 x 4096 with 32 heads of 128 has 2 MiB of K/V
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

// The planner's search written out directly, as it was before it was made fast (issue 5):
// every split policy builds all its work items and an LPT schedule over a priority queue, the
// shortest busiest worker wins (ties: fewer items). make_plan must choose the same plan.
struct ReferencePlan {
  std::vector<WorkItem> work;  // grouped by worker, in schedule order
  std::vector<WorkItem> items;  // the winner's items in creation order, and their costs
  std::vector<double> costs;
  std::vector<int32_t> worker_indptr;
  std::vector<MergeItem> merges;
  int64_t partial_rows = 0;
  double max_worker_cost = 0;
  double total_cost = 0;
};

ReferencePlan reference_plan(const PlanShape& shape, const PlanConfig& config) {
  const MaskSpec mask = mask_of(shape.options);
  const int32_t group = shape.num_qo_heads / shape.num_kv_heads;
  const int32_t tokens_per_tile = std::max(1, config.q_tile_rows / group);
  const auto ceil_div = [](int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); };
  std::vector<WorkItem> tiles;
  std::vector<double> tile_costs;
  double total_cost = 0;
  for (int32_t b = 0; b < static_cast<int32_t>(shape.q_lens.size()); ++b) {
    const int32_t q_len = shape.q_lens[b], kv_len = shape.kv_lens[b];
    for (int32_t q_start = 0; q_start < q_len; q_start += tokens_per_tile) {
      const int32_t tile_len = std::min(tokens_per_tile, q_len - q_start);
      int32_t first_lo, last_lo, first_hi, last_hi;
      mask.visible_range(q_start, q_len, kv_len, &first_lo, &last_lo);
      mask.visible_range(q_start + tile_len - 1, q_len, kv_len, &first_hi, &last_hi);
      for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
        const WorkItem item{b, h, q_start, tile_len, first_lo, std::max(first_lo, last_hi), -1};
        tiles.push_back(item);
        tile_costs.push_back(work_item_cost(item, mask, q_len, kv_len, group));
        total_cost += tile_costs.back();
      }
    }
  }
  const double fair_share = total_cost / config.num_workers;
  std::vector<std::pair<double, bool>> policies = {{fair_share, true}};
  if (config.split_kv && !config.deterministic) {
    policies = {{fair_share, true}, {fair_share, false}, {fair_share / 2, false},
                {fair_share / 3, false}};
  }
  ReferencePlan best;
  size_t best_items = 0;
  for (size_t p = 0; p < policies.size(); ++p) {
    const auto [target, round_up] = policies[p];
    std::vector<WorkItem> work;
    std::vector<double> costs;
    std::vector<MergeItem> merges;
    int64_t partial_rows = 0;
    for (size_t i = 0; i < tiles.size(); ++i) {
      const WorkItem& tile = tiles[i];
      const int32_t range = tile.kv_end - tile.kv_start;
      int32_t chunk = range;
      if (config.split_kv && range > config.min_kv_chunk) {
        if (config.deterministic) {
          chunk = config.min_kv_chunk;
        } else if (tile_costs[i] > target) {
          const double ratio = tile_costs[i] / target;
          const int32_t by_cost =
              static_cast<int32_t>(round_up ? std::ceil(ratio) : std::round(ratio));
          const int32_t pieces =
              std::max(1, std::min(by_cost, ceil_div(range, config.min_kv_chunk)));
          chunk = std::max(ceil_div(ceil_div(range, pieces), kSplitAlignment) * kSplitAlignment,
                           config.min_kv_chunk);
        }
      }
      std::vector<WorkItem> pieces;
      if (chunk >= range) {
        pieces.push_back(tile);
      } else {
        for (int32_t start = tile.kv_start; start < tile.kv_end;) {
          int32_t end = config.deterministic ? (start / chunk + 1) * chunk : start + chunk;
          end = std::min(end, tile.kv_end);
          WorkItem piece = tile;
          piece.kv_start = start;
          piece.kv_end = end;
          pieces.push_back(piece);
          start = end;
        }
      }
      if (pieces.size() > 1) {
        const int32_t rows = tile.q_len * group;
        merges.push_back({tile.request, tile.kv_head, tile.q_start, tile.q_len,
                          static_cast<int32_t>(partial_rows), static_cast<int32_t>(pieces.size())});
        for (size_t k = 0; k < pieces.size(); ++k) {
          pieces[k].partial_row = static_cast<int32_t>(partial_rows + k * rows);
          pieces[k].merge_index = static_cast<int32_t>(merges.size() - 1);
        }
        partial_rows += static_cast<int64_t>(rows) * pieces.size();
      }
      for (const WorkItem& piece : pieces) {
        work.push_back(piece);
        costs.push_back(pieces.size() == 1
                            ? tile_costs[i]
                            : work_item_cost(piece, mask, shape.q_lens[piece.request],
                                             shape.kv_lens[piece.request], group));
      }
    }
    std::vector<int32_t> order(work.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
    using Load = std::pair<double, int32_t>;
    std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
    for (int32_t w = 0; w < config.num_workers; ++w) loads.push({0.0, w});
    std::vector<int32_t> owner(work.size());
    std::vector<double> worker_cost(config.num_workers, 0.0);
    for (int32_t index : order) {
      auto [load, worker] = loads.top();
      loads.pop();
      owner[index] = worker;
      worker_cost[worker] = load + costs[index];
      loads.push({worker_cost[worker], worker});
    }
    const double makespan = *std::max_element(worker_cost.begin(), worker_cost.end());
    if (p == 0 || makespan < best.max_worker_cost * (1.0 - 1e-9) ||
        (makespan <= best.max_worker_cost * (1.0 + 1e-9) && work.size() < best_items)) {
      best.worker_indptr.assign(config.num_workers + 1, 0);
      for (int32_t w : owner) ++best.worker_indptr[w + 1];
      for (int32_t w = 0; w < config.num_workers; ++w) {
        best.worker_indptr[w + 1] += best.worker_indptr[w];
      }
      std::vector<int32_t> cursor(best.worker_indptr.begin(), best.worker_indptr.end() - 1);
      best.work.assign(work.size(), WorkItem{});
      for (int32_t index : order) best.work[cursor[owner[index]]++] = work[index];
      best.merges = merges;
      best.items = work;
      best.costs = costs;
      best.partial_rows = partial_rows;
      best.max_worker_cost = makespan;
      best_items = work.size();
    }
  }
  best.total_cost = total_cost;
  // Prefill: L2 sections (planner.cpp, step 4) - request groups x kv-head chunks of at most
  // 16 MiB of K and V, groups with the longest item first, LPT section by section, kept when the
  // busiest worker carries at most 2% more.
  const int64_t budget = int64_t{16} << 20, per_key = int64_t{4} * shape.head_dim;
  int64_t longest = 0, all_kv = 0;
  for (int32_t len : shape.kv_lens) {
    longest = std::max<int64_t>(longest, len);
    all_kv += len;
  }
  if (shape.op == AttentionOp::kDecode || all_kv * per_key * shape.num_kv_heads <= budget) {
    return best;
  }
  int32_t chunk = 1;
  for (int32_t c = shape.num_kv_heads; c >= 1; --c) {
    if (shape.num_kv_heads % c == 0 && c * longest * per_key <= budget) {
      chunk = c;
      break;
    }
  }
  std::vector<int32_t> group_of(shape.kv_lens.size());
  int32_t groups = 0;
  for (size_t r = 0, filled = 0; r < shape.kv_lens.size(); ++r) {
    const int64_t bytes = int64_t{shape.kv_lens[r]} * per_key * chunk;
    if (filled > 0 && static_cast<int64_t>(filled) + bytes > budget) {
      ++groups;
      filled = 0;
    }
    group_of[r] = groups;
    filled += static_cast<size_t>(bytes);
  }
  if (groups == 0 && chunk == shape.num_kv_heads) return best;  // one section: plain LPT
  std::vector<double> group_top(static_cast<size_t>(groups) + 1, 0.0);
  for (size_t i = 0; i < best.items.size(); ++i) {
    double& top = group_top[group_of[best.items[i].request]];
    top = std::max(top, best.costs[i]);
  }
  std::vector<int32_t> group_rank(group_top.size());
  {
    std::vector<int32_t> order(group_top.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return group_top[a] > group_top[b]; });
    for (size_t k = 0; k < order.size(); ++k) group_rank[order[k]] = static_cast<int32_t>(k);
  }
  std::vector<int32_t> order(best.items.size());
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](int32_t i) {
    const WorkItem& it = best.items[i];
    return std::make_tuple(group_rank[group_of[it.request]], it.kv_head / chunk, -best.costs[i],
                           it.request, it.q_start, it.kv_start, it.kv_head);
  };
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key(a) < key(b); });
  using Load = std::pair<double, int32_t>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
  for (int32_t w = 0; w < config.num_workers; ++w) loads.push({0.0, w});
  std::vector<int32_t> owner(best.items.size());
  std::vector<double> worker_cost(config.num_workers, 0.0);
  for (int32_t index : order) {
    auto [load, worker] = loads.top();
    loads.pop();
    owner[index] = worker;
    worker_cost[worker] = load + best.costs[index];
    loads.push({worker_cost[worker], worker});
  }
  const double makespan = *std::max_element(worker_cost.begin(), worker_cost.end());
  if (makespan > best.max_worker_cost * 1.02) return best;
  best.worker_indptr.assign(config.num_workers + 1, 0);
  for (int32_t w : owner) ++best.worker_indptr[w + 1];
  for (int32_t w = 0; w < config.num_workers; ++w) best.worker_indptr[w + 1] += best.worker_indptr[w];
  std::vector<int32_t> cursor(best.worker_indptr.begin(), best.worker_indptr.end() - 1);
  for (int32_t index : order) best.work[cursor[owner[index]]++] = best.items[index];
  best.max_worker_cost = makespan;
  return best;
}

void expect_same_as_reference(const PlanShape& shape, const Plan& plan) {
  // Step 5 (split_tail) works on a finished plan; it is applied to the reference's too, so that
  // these tests compare the search (steps 1-4). The tail tests below check step 5 itself.
  const ReferencePlan raw = reference_plan(shape, plan.config);
  Plan tailed = plan;  // the plan's shape fields, the reference's lists
  tailed.work = raw.work;
  tailed.worker_indptr = raw.worker_indptr;
  tailed.merges = raw.merges;
  tailed.num_partial_rows = raw.partial_rows;
  tailed.max_worker_cost = raw.max_worker_cost;
  split_tail(shape, tailed);
  ReferencePlan ref = raw;
  ref.work = tailed.work;
  ref.worker_indptr = tailed.worker_indptr;
  ref.merges = tailed.merges;
  ref.partial_rows = tailed.num_partial_rows;
  ref.max_worker_cost = tailed.max_worker_cost;
  ASSERT_EQ(plan.work.size(), ref.work.size());
  for (size_t i = 0; i < ref.work.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(&plan.work[i], &ref.work[i], sizeof(WorkItem)))
        << "work item " << i << ": request " << plan.work[i].request << " kv_head "
        << plan.work[i].kv_head << " q_start " << plan.work[i].q_start << " kv ["
        << plan.work[i].kv_start << ", " << plan.work[i].kv_end << "), reference request "
        << ref.work[i].request << " kv_head " << ref.work[i].kv_head << " q_start "
        << ref.work[i].q_start << " kv [" << ref.work[i].kv_start << ", " << ref.work[i].kv_end
        << ")";
  }
  ASSERT_EQ(plan.worker_indptr, ref.worker_indptr);
  ASSERT_EQ(plan.merges.size(), ref.merges.size());
  for (size_t m = 0; m < ref.merges.size(); ++m) {
    ASSERT_EQ(0, std::memcmp(&plan.merges[m], &ref.merges[m], sizeof(MergeItem))) << "merge " << m;
  }
  ASSERT_EQ(plan.num_partial_rows, ref.partial_rows);
  ASSERT_EQ(plan.max_worker_cost, ref.max_worker_cost);
  ASSERT_EQ(plan.total_cost, ref.total_cost);
}

// The fast search (skipped duplicate / hopeless policies, per-q-tile costs, one sift per item)
// picks exactly the plan of the direct search: random shapes and configs, and serving-sized
// batches (uniform, skewed, mixed prefill + decode) on many workers where the policies differ.
TEST(Planner, FastSearchChoosesTheReferencePlan) {
  std::mt19937_64 rng(505);
  for (int trial = 0; trial < 1000; ++trial) {
    const AttentionOp op = trial % 3 == 0 ? AttentionOp::kDecode : AttentionOp::kRaggedPrefill;
    const PlanShape shape = random_shape(rng, op);
    const PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    const Plan plan = make_plan(shape, config);
    SCOPED_TRACE("random trial " + std::to_string(trial));
    expect_same_as_reference(shape, plan);
    if (HasFatalFailure()) return;
  }
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 200; ++trial) {
    PlanShape shape;
    shape.op = trial % 2 == 0 ? AttentionOp::kDecode : AttentionOp::kPagedPrefill;
    shape.num_kv_heads = std::vector<int>{1, 2, 8}[trial % 3];
    shape.num_qo_heads = shape.num_kv_heads * std::vector<int>{1, 4, 8}[uniform(0, 2)];
    shape.head_dim = 128;
    shape.page_size = 16;
    shape.options.causal = shape.op != AttentionOp::kDecode;
    const int batch = uniform(1, 300);
    const int kind = trial % 4;  // uniform, random, skewed, mixed
    const int base = uniform(1, 8192);
    for (int b = 0; b < batch; ++b) {
      int kv = kind == 0 ? base : uniform(1, 32768);
      if (kind == 2) kv = b == 0 ? uniform(16384, 65536) : uniform(16, 1024);
      int q = shape.op == AttentionOp::kDecode ? 1 : uniform(1, 64);
      if (kind == 3 && shape.op != AttentionOp::kDecode) q = b < 3 ? uniform(300, 2000) : 1;
      shape.q_lens.push_back(q);
      shape.kv_lens.push_back(std::max(kv, q));
    }
    PlanConfig config;
    config.q_tile_rows = std::max(64, shape.num_qo_heads / shape.num_kv_heads);
    config.num_workers = std::vector<int>{132, 264, 1000}[uniform(0, 2)];
    config.min_kv_chunk = std::vector<int>{256, 512}[uniform(0, 1)];
    config.deterministic = uniform(0, 5) == 0;
    const Plan plan = make_plan(shape, config);
    SCOPED_TRACE("serving trial " + std::to_string(trial));
    expect_same_as_reference(shape, plan);
    if (HasFatalFailure()) return;
  }
}

// The planner after issue 5's second pass (winner-tree LPT on packed keys, level-by-level
// runs, integer sums, early-stopped candidates, reused per-thread buffers) against the direct
// implementation above, on many serving-sized batches: an H200's decode and prefill knobs and
// others, worker counts around powers of two (the tree's shape), batches of equal costs (long
// runs, level by level) and of distinct costs, and skewed ones where split policies compete.
// Each shape is planned twice in a row (the second call reuses the buffers of the first).
TEST(Planner, ServingBatchesMatchTheReferencePlan) {
  std::mt19937_64 rng(20260505);
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  int with_merges = 0;
  for (int trial = 0; trial < 600; ++trial) {
    PlanShape shape;
    const int op_kind = trial % 3;
    shape.op = op_kind == 0   ? AttentionOp::kDecode
               : op_kind == 1 ? AttentionOp::kPagedPrefill
                              : AttentionOp::kRaggedPrefill;
    const bool decode = shape.op == AttentionOp::kDecode;
    shape.num_kv_heads = std::vector<int>{1, 2, 4, 8}[uniform(0, 3)];
    shape.num_qo_heads = shape.num_kv_heads * std::vector<int>{1, 4, 8}[uniform(0, 2)];
    shape.head_dim = 128;
    shape.page_size = 16;
    shape.options.causal = !decode && uniform(0, 3) != 0;
    if (uniform(0, 5) == 0) shape.options.window_left = uniform(0, 4096);
    const int batch = decode ? uniform(1, 512) : uniform(1, 64);
    const int q_per_request = decode ? std::vector<int>{1, 1, 1, 2, 4}[uniform(0, 4)] : 1;
    const int kind = uniform(0, 5);  // uniform, random, skewed, bimodal, tiny, mixed
    const int base = uniform(1, 32768);
    for (int b = 0; b < batch; ++b) {
      int kv = base;
      if (kind == 1) kv = uniform(1, 32768);
      if (kind == 2) kv = b == 0 ? uniform(16384, 131072) : uniform(16, 1024);
      if (kind == 3) kv = uniform(0, 1) ? 512 : 16384;
      if (kind == 4) kv = uniform(0, 64);
      int q = decode ? q_per_request : uniform(1, std::min(512, std::max(1, kv)));
      if (kind == 5 && !decode) q = b < 3 ? uniform(300, 2000) : 1;
      if (!decode) kv = std::max(kv, q);
      shape.q_lens.push_back(q);
      shape.kv_lens.push_back(kv);
    }
    PlanConfig config;
    const int group = shape.num_qo_heads / shape.num_kv_heads;
    if (uniform(0, 1) == 0) {  // an H200's knobs (bench --suite plan)
      config.q_tile_rows = std::max(decode ? 64 : 128, group);
      config.num_workers = decode ? 264 : 132;
      config.min_kv_chunk = decode ? 128 : 512;
      config.deterministic_kv_chunk = decode ? 512 : 0;
    } else {
      config.q_tile_rows = std::max(std::vector<int>{16, 64, 128}[uniform(0, 2)], group);
      config.num_workers = std::vector<int>{1,   2,   3,   6,   63,  64,   65,  127,
                                            128, 129, 132, 264, 528, 1000, 4096}[uniform(0, 14)];
      config.min_kv_chunk = std::vector<int>{64, 128, 256, 512, 1000}[uniform(0, 4)];
    }
    config.split_kv = uniform(0, 9) != 0;
    config.deterministic = uniform(0, 7) == 0;
    SCOPED_TRACE("serving trial " + std::to_string(trial));
    const Plan plan = make_plan(shape, config);
    expect_same_as_reference(shape, plan);
    if (HasFatalFailure()) return;
    const Plan again = make_plan(shape, config);
    expect_same_as_reference(shape, again);
    if (HasFatalFailure()) return;
    with_merges += !plan.merges.empty();
  }
  EXPECT_GT(with_merges, 100) << "too few trials split a key range";
}

// The sectioned schedule (planner.cpp, step 4) against the reference on shapes that reach it:
// K/V above 16 MiB, kv heads that give chunks of 1..12 heads and worker blocks of several
// workers (gcd(workers, chunk heads) > 1), head_dim 64..256, empty requests, windows, splits.
TEST(Planner, SectionedPlansMatchTheReferencePlan) {
  std::mt19937_64 rng(2026);
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 120; ++trial) {
    PlanShape shape;
    shape.op = trial % 2 == 0 ? AttentionOp::kRaggedPrefill : AttentionOp::kPagedPrefill;
    shape.num_kv_heads = std::vector<int>{1, 2, 3, 4, 6, 8, 12}[uniform(0, 6)];
    shape.num_qo_heads = shape.num_kv_heads * std::vector<int>{1, 2, 4}[uniform(0, 2)];
    shape.head_dim = std::vector<int>{64, 128, 256}[uniform(0, 2)];
    shape.page_size = 16;
    shape.options.causal = uniform(0, 1) == 1;
    if (uniform(0, 3) == 0) shape.options.window_left = uniform(0, 4096);
    const int batch = uniform(1, 40);
    for (int b = 0; b < batch; ++b) {
      const int kv = uniform(0, 9) == 0 ? 0 : uniform(1, 16384);
      const int q = uniform(0, 9) == 0 ? 0 : std::min(kv, uniform(1, 4096));
      shape.q_lens.push_back(q);
      shape.kv_lens.push_back(kv);
    }
    PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    config.q_tile_rows = std::max(config.q_tile_rows, 64);  // tiles of serving size
    config.min_kv_chunk = std::max(config.min_kv_chunk, 128);
    if (uniform(0, 1) == 1) config.num_workers = 12 * uniform(1, 16);  // blocks of 2..12
    const Plan plan = make_plan(shape, config);
    SCOPED_TRACE("sectioned trial " + std::to_string(trial));
    expect_same_as_reference(shape, plan);
    if (HasFatalFailure()) return;
  }
}

// TESSERA_PLAN_TAIL for a guard's lifetime (the planner reads it on every plan).
using test::ScopedEnv;

// Step 5 (split_tail) on the d128 target shapes of an H200 (one persistent CTA per SM).
PlanShape uniform_prefill(int batch, int tokens, int heads) {
  PlanShape shape;
  shape.op = AttentionOp::kRaggedPrefill;
  shape.q_lens.assign(static_cast<size_t>(batch), tokens);
  shape.kv_lens.assign(static_cast<size_t>(batch), tokens);
  shape.num_qo_heads = heads;
  shape.num_kv_heads = heads;
  shape.head_dim = 128;
  return shape;
}

PlanConfig h200_prefill_config() {
  PlanConfig config;
  config.q_tile_rows = 128;
  config.num_workers = 132;
  config.min_kv_chunk = 704;  // 4 x 176-key tiles
  return config;
}

// check_plan for non-causal uniform batches too long for its key-by-key walk: every (request,
// kv head, q tile) is covered by key ranges that tile [0, kv_len) without overlap, merges name
// their pieces, and the workspace is the plan's.
void check_uniform_plan(const PlanShape& shape, const Plan& plan) {
  const int group = shape.num_qo_heads / shape.num_kv_heads;
  ASSERT_EQ(plan.worker_indptr.back(), static_cast<int32_t>(plan.work.size()));
  std::map<std::tuple<int, int, int, int>, std::vector<std::pair<int, int>>> ranges;
  for (const WorkItem& item : plan.work) {
    ranges[{item.request, item.kv_head, item.q_start, item.q_len}].push_back(
        {item.kv_start, item.kv_end});
  }
  int64_t tiles = 0;
  for (int b = 0; b < static_cast<int>(shape.q_lens.size()); ++b) {
    tiles += (shape.q_lens[b] + plan.config.q_tile_rows - 1) / plan.config.q_tile_rows;
  }
  ASSERT_EQ(ranges.size(), static_cast<size_t>(tiles * shape.num_kv_heads));
  for (auto& [key, pieces] : ranges) {
    std::sort(pieces.begin(), pieces.end());
    int covered = 0;
    for (auto [lo, hi] : pieces) {
      ASSERT_EQ(lo, covered) << "a gap or an overlap in the key ranges";
      covered = hi;
    }
    ASSERT_EQ(covered, shape.kv_lens[std::get<0>(key)]);
  }
  int64_t rows = 0;
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    const MergeItem& merge = plan.merges[m];
    std::vector<int32_t> rows_of_pieces;
    for (const WorkItem& w : plan.work) {
      if (w.merge_index != static_cast<int32_t>(m)) continue;
      ASSERT_EQ(std::make_tuple(w.request, w.kv_head, w.q_start, w.q_len),
                std::make_tuple(merge.request, merge.kv_head, merge.q_start, merge.q_len));
      rows_of_pieces.push_back(w.partial_row);
    }
    ASSERT_EQ(static_cast<int>(rows_of_pieces.size()), merge.num_splits);
    std::sort(rows_of_pieces.begin(), rows_of_pieces.end());
    for (int s = 0; s < merge.num_splits; ++s) {
      ASSERT_EQ(rows_of_pieces[s], merge.first_partial_row + s * merge.q_len * group);
    }
    rows += int64_t{merge.q_len} * group * merge.num_splits;
  }
  ASSERT_EQ(rows, plan.num_partial_rows);
  ASSERT_EQ(plan.workspace_bytes, WorkspaceLayout::of(plan).total);
}

// One 16384-token request, 16 heads: 2048 equal items, 15 rounds of 132 and 68 more. The 68
// last items are cut into key pieces (each a merge of 2..8 pieces at the end of some worker's
// list), and the busiest worker drops from 16 items to about 15.6.
TEST(Planner, TailOfAUniformPrefillBatchIsCutIntoPieces) {
  const ScopedEnv on("TESSERA_PLAN_TAIL", "1");
  const PlanShape shape = uniform_prefill(1, 16384, 16);
  const Plan plan = make_plan(shape, h200_prefill_config());
  check_uniform_plan(shape, plan);
  if (HasFatalFailure()) return;
  const double item = work_item_cost(WorkItem{0, 0, 0, 128, 0, 16384, -1}, mask_of(shape.options),
                                     16384, 16384, 1);
  EXPECT_EQ(plan.merges.size(), 68u);
  EXPECT_GT(plan.max_worker_cost, 15.5 * item);
  EXPECT_LT(plan.max_worker_cost, 15.75 * item);
  for (const MergeItem& merge : plan.merges) {
    EXPECT_GE(merge.num_splits, 2);
    EXPECT_LE(merge.num_splits, 8);
  }
  // Pieces come after every whole item of their worker; every worker's load is below 16 items.
  for (size_t w = 0; w + 1 < plan.worker_indptr.size(); ++w) {
    bool piece_seen = false;
    double load = 0;
    for (int32_t i = plan.worker_indptr[w]; i < plan.worker_indptr[w + 1]; ++i) {
      const WorkItem& it = plan.work[i];
      if (it.merge_index >= 0) piece_seen = true;
      EXPECT_TRUE(it.merge_index >= 0 || !piece_seen) << "a whole item after a piece, worker " << w;
      EXPECT_GE(it.kv_end - it.kv_start, it.merge_index >= 0 ? 704 : 16384);
      load += work_item_cost(it, mask_of(shape.options), 16384, 16384, 1);
    }
    EXPECT_LE(load, plan.max_worker_cost);
  }
}

// Where cutting gains under 2% the plan keeps its whole items: 4 x 4096 tokens (2048 items of a
// quarter of the keys, so each piece's own overhead weighs four times more), causal batches
// (LPT over unequal items already ends within a small item of the mean), deterministic plans
// and decode.
TEST(Planner, TailIsLeftWholeWhereCuttingGainsLittle) {
  const ScopedEnv on("TESSERA_PLAN_TAIL", "1");
  const PlanConfig config = h200_prefill_config();
  {
    const PlanShape shape = uniform_prefill(4, 4096, 16);
    const Plan plan = make_plan(shape, config);
    const double item = work_item_cost(WorkItem{0, 0, 0, 128, 0, 4096, -1},
                                       mask_of(shape.options), 4096, 4096, 1);
    EXPECT_TRUE(plan.merges.empty());
    EXPECT_EQ(plan.max_worker_cost, 16 * item);
  }
  {
    PlanShape shape = uniform_prefill(1, 16384, 16);
    shape.options.causal = true;
    EXPECT_TRUE(make_plan(shape, config).merges.empty());
  }
  {
    PlanConfig deterministic = config;
    deterministic.deterministic = true;
    deterministic.min_kv_chunk = 16384;  // fixed cuts that leave every item whole
    const PlanShape shape = uniform_prefill(1, 16384, 16);
    EXPECT_TRUE(make_plan(shape, deterministic).merges.empty());
  }
}

// Step 5 on random shapes (masks, GQA, windows, empty requests, few and many workers): where it
// changes the plan (TESSERA_PLAN_TAIL=1), the plan still covers every visible pair once, and its
// busiest worker is at least 2% shorter than that of the same plan without step 5 (=0).
TEST(Planner, TailCutsKeepCoverageAndShortenTheBusiestWorker) {
  std::mt19937_64 rng(6061);
  int changed = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    PlanShape shape = random_shape(rng, AttentionOp::kRaggedPrefill);
    for (int32_t& len : shape.kv_lens) len *= 4;  // long enough to cut
    if (trial % 2 == 0) {
      shape.op = AttentionOp::kPagedPrefill;
      shape.kv_lens.assign(shape.kv_lens.size(), shape.kv_lens[0]);  // uniform batches
      shape.q_lens.assign(shape.q_lens.size(), shape.q_lens[0]);
    }
    for (size_t b = 0; b < shape.q_lens.size(); ++b) {
      shape.q_lens[b] = std::min(shape.q_lens[b], shape.kv_lens[b]);
    }
    PlanConfig config = random_config(rng, shape.num_qo_heads / shape.num_kv_heads);
    config.min_kv_chunk = std::max(config.min_kv_chunk, 64);
    config.deterministic = false;
    Plan plan, whole;
    {
      const ScopedEnv on("TESSERA_PLAN_TAIL", "1");
      plan = make_plan(shape, config);
    }
    {
      const ScopedEnv off("TESSERA_PLAN_TAIL", "0");
      whole = make_plan(shape, config);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    if (plan.work.size() == whole.work.size() && plan.merges.size() == whole.merges.size()) {
      EXPECT_EQ(plan.max_worker_cost, whole.max_worker_cost);
      continue;
    }
    ++changed;
    check_plan(shape, plan);
    if (HasFatalFailure()) return;
    EXPECT_GT(plan.merges.size(), whole.merges.size());
    EXPECT_LE(plan.max_worker_cost, whole.max_worker_cost * 0.98);
    for (size_t m = whole.merges.size(); m < plan.merges.size(); ++m) {
      EXPECT_GE(plan.merges[m].num_splits, 2);
      EXPECT_LE(plan.merges[m].num_splits, 8);
    }
  }
  EXPECT_GE(changed, 20) << "too few random plans had a tail to cut";
}

// A fixed capacity sized for the whole items (a CUDA graph's) has no room for the pieces: the
// plan keeps its items and stays within the capacity.
TEST(Planner, TailIsLeftWholeWhenTheCapacityHasNoRoom) {
  const ScopedEnv on("TESSERA_PLAN_TAIL", "1");
  PlanShape shape = uniform_prefill(1, 16384, 16);
  shape.capacity.max_work_items = 2048;
  shape.capacity.max_merges = 64;
  shape.capacity.max_partial_rows = int64_t{1} << 20;
  const Plan plan = make_plan(shape, h200_prefill_config());
  check_uniform_plan(shape, plan);
  EXPECT_EQ(plan.work.size(), 2048u);
  EXPECT_TRUE(plan.merges.empty());
  // With room (the bound plan_capacity would give), the tail is cut as without a capacity.
  shape.capacity = capacity_bound(1, 16384, 16384, 16, 16, h200_prefill_config());
  const Plan roomy = make_plan(shape, h200_prefill_config());
  check_uniform_plan(shape, roomy);
  EXPECT_EQ(roomy.merges.size(), 68u);
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
