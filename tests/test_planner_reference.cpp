// The planner's fast search (skipped duplicate / hopeless split policies, per-q-tile costs,
// winner-tree LPT, integer sums, reused buffers, L2 sections) against a direct implementation
// of the same search: make_plan must choose exactly the reference's plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <queue>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/planner.hpp"
#include "tessera/attention.hpp"
#include "test_planner_shapes.hpp"

namespace tessera::detail {
namespace {

using planner_test::random_config;
using planner_test::random_shape;

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
  // Prefill: L2 sections (planner_schedule.cpp, step 4) - request groups x kv-head chunks of at most
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
  const ReferencePlan ref = reference_plan(shape, plan.config);
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

// The sectioned schedule (planner_schedule.cpp, step 4) against the reference on shapes that reach it:
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

}  // namespace
}  // namespace tessera::detail
