#include "core/planner.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <sstream>

#include "core/validate.hpp"
#include "core/workspace_layout.hpp"

namespace tessera::detail {

MaskSpec mask_of(const AttentionOptions& options) {
  MaskSpec mask;
  mask.causal = options.causal;
  mask.window_left = options.window_left;
  mask.window_right = options.window_right;
  return mask;
}

double work_item_cost(const WorkItem& item, const MaskSpec& mask, int32_t q_len_of_request,
                      int32_t kv_len_of_request, int32_t group_size) {
  int64_t pairs = 0;
  for (int32_t t = item.q_start; t < item.q_start + item.q_len; ++t) {
    int32_t first, last;
    mask.visible_range(t, q_len_of_request, kv_len_of_request, &first, &last);
    first = std::max(first, item.kv_start);
    last = std::min(last, item.kv_end);
    if (last > first) pairs += last - first;
  }
  const double keys = static_cast<double>(item.kv_end - item.kv_start);
  return static_cast<double>(pairs) * group_size + keys * kCostPerKeyRead + kCostPerItem;
}

namespace {

// The keys any row of tokens [q_start, q_start + q_len) may see: rows' visible ranges move
// monotonically with the row, so the union is [first of the first row, last of the last row).
void tile_key_range(const MaskSpec& mask, int32_t q_start, int32_t q_len, int32_t q_len_total,
                    int32_t kv_len, int32_t* kv_start, int32_t* kv_end) {
  int32_t first_lo, last_lo, first_hi, last_hi;
  mask.visible_range(q_start, q_len_total, kv_len, &first_lo, &last_lo);
  mask.visible_range(q_start + q_len - 1, q_len_total, kv_len, &first_hi, &last_hi);
  *kv_start = first_lo;
  *kv_end = std::max(first_lo, last_hi);
}

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

}  // namespace

PlanCapacity capacity_bound(int32_t max_batch, int64_t max_total_q, int32_t max_kv_len,
                            int32_t num_qo_heads, int32_t num_kv_heads, const PlanConfig& config) {
  PlanCapacity capacity;
  if (max_batch <= 0 || num_kv_heads <= 0) return capacity;
  const int64_t group = std::max(1, num_qo_heads / num_kv_heads);
  const int64_t tokens_per_tile = std::max<int64_t>(1, config.q_tile_rows / group);
  max_total_q = std::max<int64_t>(0, max_total_q);
  max_kv_len = std::max(0, max_kv_len);
  // sum_b ceil(q_b / t) <= floor(total / t) + batch; every tile once per kv head.
  const int64_t tiles = (max_total_q / tokens_per_tile + max_batch) * num_kv_heads;
  // A split range gives at most ceil(range / min_kv_chunk) pieces (+1: deterministic cuts at
  // absolute multiples, so the first piece may be short).
  const bool can_split = config.split_kv && max_kv_len > config.min_kv_chunk;
  const int64_t pieces =
      can_split ? (int64_t{max_kv_len} + config.min_kv_chunk - 1) / config.min_kv_chunk + 1 : 1;
  const auto clamp32 = [](int64_t x) {
    return static_cast<int32_t>(std::clamp<int64_t>(x, 1, INT32_MAX));
  };
  capacity.max_work_items = clamp32(tiles * pieces);
  capacity.max_merges = can_split ? clamp32(tiles) : 0;
  // Rows of one tile = its tokens x group; summed over the tiles of one kv head = total_q x group.
  capacity.max_partial_rows = can_split ? max_total_q * num_qo_heads * pieces : 0;
  if (capacity.max_partial_rows == 0) capacity.max_merges = 0;
  return capacity;
}

Plan make_plan(const PlanShape& shape, const PlanConfig& requested_config) {
  const ArgChecker check(std::string("plan_") + op_name(shape.op));
  const PlanCapacity& capacity = shape.capacity;
  PlanConfig config = requested_config;
  if (capacity.deterministic) config.deterministic = true;
  if (capacity.fixed()) {
    check.require(capacity.max_merges >= 0 && capacity.max_partial_rows >= 0, "capacity",
                  "expected max_merges >= 0 and max_partial_rows >= 0");
    if (capacity.max_merges == 0 || capacity.max_partial_rows == 0) config.split_kv = false;
  } else {
    check.require(capacity.max_work_items == 0 && capacity.max_merges == 0 &&
                      capacity.max_partial_rows == 0,
                  "capacity",
                  "max_work_items is 0 (no fixed capacity) but max_merges / max_partial_rows "
                  "are set; set max_work_items (> 0) to fix the capacity");
  }
  const int32_t group = shape.num_qo_heads / shape.num_kv_heads;
  if (config.q_tile_rows < group) {
    check.unsupported("num_qo_heads", "a GQA group of " + std::to_string(group) +
                                          " query heads per kv head exceeds the " +
                                          std::to_string(config.q_tile_rows) +
                                          " packed query rows of this backend's tile");
  }
  check.require(config.num_workers >= 1, "config.num_workers", "expected >= 1");
  check.require(config.min_kv_chunk >= 1, "config.min_kv_chunk", "expected >= 1");

  Plan plan;
  plan.op = shape.op;
  plan.device = shape.device;
  plan.batch_size = static_cast<int32_t>(shape.q_lens.size());
  plan.num_qo_heads = shape.num_qo_heads;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.head_dim = shape.head_dim;
  plan.page_size = shape.page_size;
  plan.options = shape.options;
  plan.config = config;
  plan.capacity = capacity;
  plan.q_lens = shape.q_lens;
  plan.kv_lens = shape.kv_lens;
  for (int32_t len : shape.q_lens) plan.total_q += len;

  const MaskSpec mask = mask_of(shape.options);
  const int32_t tokens_per_tile = std::max(1, config.q_tile_rows / group);

  // 1. Tiles, each with the key range its rows can see.
  std::vector<WorkItem> tiles;
  std::vector<double> tile_costs;
  double total_cost = 0;
  for (int32_t b = 0; b < plan.batch_size; ++b) {
    const int32_t q_len = shape.q_lens[b], kv_len = shape.kv_lens[b];
    for (int32_t q_start = 0; q_start < q_len; q_start += tokens_per_tile) {
      const int32_t tile_len = std::min(tokens_per_tile, q_len - q_start);
      int32_t kv_start, kv_end;
      tile_key_range(mask, q_start, tile_len, q_len, kv_len, &kv_start, &kv_end);
      for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
        WorkItem item{b, h, q_start, tile_len, kv_start, kv_end, -1};
        const double cost = work_item_cost(item, mask, q_len, kv_len, group);
        tiles.push_back(item);
        tile_costs.push_back(cost);
        total_cost += cost;
      }
    }
  }

  // 2. Split-KV. Deterministic mode cuts at fixed absolute key positions (multiples of
  //    min_kv_chunk), so the arithmetic of a row never depends on what else is in the batch.
  //    Otherwise a tile costing more than a target piece cost is cut into about cost / target
  //    equal pieces, for a few targets around the fair share (total / workers); each candidate
  //    is scheduled (step 3) and the one with the shortest busiest worker wins (ties: the
  //    fewer pieces). Rounding the piece count to the nearest integer rather than up matters for
  //    uniform batches: 128 tiles of 2.06 fair shares on 264 workers make 256 pieces of 1.03
  //    (one per worker) instead of 384 of 0.69 (two on some workers, 1.37).
  const double fair_share = total_cost / config.num_workers;
  struct SplitPolicy {
    double target = 0;  // piece cost aimed at
    bool round_up = true;
  };
  std::vector<SplitPolicy> policies;
  if (!config.split_kv || config.deterministic) {
    policies.push_back({fair_share, true});
  } else {
    policies = {{fair_share, true}, {fair_share, false}, {fair_share / 2, false},
                {fair_share / 3, false}};
  }
  struct Candidate {
    std::vector<WorkItem> work;
    std::vector<double> costs;
    std::vector<MergeItem> merges;
    int64_t partial_rows = 0;
    std::vector<int32_t> owner;  // worker of each item
    std::vector<int32_t> order;  // items, longest first
    std::vector<double> worker_cost;
    double makespan = 0;
  };
  const auto split_and_schedule = [&](const SplitPolicy& policy) {
    Candidate c;
    for (size_t i = 0; i < tiles.size(); ++i) {
      const WorkItem& tile = tiles[i];
      const int32_t range = tile.kv_end - tile.kv_start;
      int32_t chunk = range;
      if (config.split_kv && range > config.min_kv_chunk) {
        if (config.deterministic) {
          chunk = config.min_kv_chunk;
        } else if (tile_costs[i] > policy.target) {
          const double ratio = tile_costs[i] / policy.target;
          const int32_t by_cost = static_cast<int32_t>(policy.round_up ? std::ceil(ratio)
                                                                       : std::round(ratio));
          const int32_t by_size = ceil_div(range, config.min_kv_chunk);
          const int32_t pieces = std::max(1, std::min(by_cost, by_size));
          chunk = ceil_div(ceil_div(range, pieces), kSplitAlignment) * kSplitAlignment;
          chunk = std::max(chunk, config.min_kv_chunk);
        }
      }
      std::vector<WorkItem> pieces;
      if (chunk >= range) {
        pieces.push_back(tile);
      } else {
        // Deterministic: boundaries at absolute multiples of chunk; otherwise from kv_start.
        int32_t start = tile.kv_start;
        while (start < tile.kv_end) {
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
        MergeItem merge{tile.request, tile.kv_head, tile.q_start, tile.q_len,
                        static_cast<int32_t>(c.partial_rows), static_cast<int32_t>(pieces.size())};
        for (size_t p = 0; p < pieces.size(); ++p) {
          pieces[p].partial_row = static_cast<int32_t>(c.partial_rows + p * rows);
          pieces[p].merge_index = static_cast<int32_t>(c.merges.size());
        }
        c.partial_rows += static_cast<int64_t>(rows) * pieces.size();
        c.merges.push_back(merge);
      }
      for (const WorkItem& piece : pieces) {
        const int32_t b = piece.request;
        c.work.push_back(piece);
        c.costs.push_back(pieces.size() == 1 ? tile_costs[i]
                                             : work_item_cost(piece, mask, shape.q_lens[b],
                                                              shape.kv_lens[b], group));
      }
    }
    // 3. LPT: longest item first onto the least-loaded worker (ties: lowest index), so the plan
    //    is deterministic and the most expensive items start first.
    c.order.resize(c.work.size());
    for (size_t i = 0; i < c.order.size(); ++i) c.order[i] = static_cast<int32_t>(i);
    std::stable_sort(c.order.begin(), c.order.end(),
                     [&](int32_t a, int32_t b) { return c.costs[a] > c.costs[b]; });
    using Load = std::pair<double, int32_t>;
    std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
    for (int32_t w = 0; w < config.num_workers; ++w) loads.push({0.0, w});
    c.owner.resize(c.work.size());
    c.worker_cost.assign(config.num_workers, 0.0);
    for (int32_t index : c.order) {
      auto [load, worker] = loads.top();
      loads.pop();
      c.owner[index] = worker;
      c.worker_cost[worker] = load + c.costs[index];
      loads.push({c.worker_cost[worker], worker});
    }
    c.makespan = c.worker_cost.empty()
                     ? 0.0
                     : *std::max_element(c.worker_cost.begin(), c.worker_cost.end());
    return c;
  };
  Candidate best = split_and_schedule(policies[0]);
  for (size_t p = 1; p < policies.size(); ++p) {
    Candidate other = split_and_schedule(policies[p]);
    // A relative margin so that rounding noise never trades balance for more pieces.
    if (other.makespan < best.makespan * (1.0 - 1e-9) ||
        (other.makespan <= best.makespan * (1.0 + 1e-9) && other.work.size() < best.work.size())) {
      best = std::move(other);
    }
  }
  std::vector<WorkItem>& work = plan.work;
  work = std::move(best.work);
  plan.merges = std::move(best.merges);
  plan.num_partial_rows = best.partial_rows;
  const std::vector<int32_t>& order = best.order;
  const std::vector<int32_t>& owner = best.owner;
  const std::vector<double>& worker_cost = best.worker_cost;

  // Group by worker, keeping each worker's items in longest-first order.
  std::vector<int32_t> count(config.num_workers + 1, 0);
  for (int32_t index : order) ++count[owner[index] + 1];
  plan.worker_indptr.assign(config.num_workers + 1, 0);
  for (int32_t w = 0; w < config.num_workers; ++w) {
    plan.worker_indptr[w + 1] = plan.worker_indptr[w] + count[w + 1];
  }
  std::vector<WorkItem> ordered(work.size());
  std::vector<int32_t> cursor(plan.worker_indptr.begin(), plan.worker_indptr.end() - 1);
  for (int32_t index : order) ordered[cursor[owner[index]]++] = work[index];
  work = std::move(ordered);

  plan.total_cost = total_cost;
  plan.max_worker_cost =
      worker_cost.empty() ? 0.0 : *std::max_element(worker_cost.begin(), worker_cost.end());
  if (capacity.fixed()) {
    const auto exceeds = [&](const char* what, int64_t needed, int64_t limit) {
      if (needed > limit) {
        check.fail("capacity", std::string("the plan exceeds its fixed capacity: it needs ") +
                                   std::to_string(needed) + " " + what + ", capacity." +
                                   (what[0] == 'w' ? "max_work_items"
                                    : what[0] == 'm' ? "max_merges"
                                                     : "max_partial_rows") +
                                   " = " + std::to_string(limit) +
                                   " (plan the largest batch's capacity, e.g. with "
                                   "plan_capacity())");
      }
    };
    exceeds("work items", static_cast<int64_t>(plan.work.size()), capacity.max_work_items);
    exceeds("merges", static_cast<int64_t>(plan.merges.size()), capacity.max_merges);
    exceeds("partial rows", plan.num_partial_rows, capacity.max_partial_rows);
  }
  plan.workspace_bytes = WorkspaceLayout::of(plan).total;
  return plan;
}

}  // namespace tessera::detail

namespace tessera {

std::string Plan::explain() const {
  std::ostringstream out;
  const int32_t group = num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0;
  int64_t total_kv = 0;
  for (int32_t len : kv_lens) total_kv += len;
  out << "plan: " << op_name(op) << " on " << device_name(device) << "\n"
      << "  batch " << batch_size << ", query tokens " << total_q << ", kv tokens " << total_kv
      << ", heads " << num_qo_heads << " qo / " << num_kv_heads << " kv (group " << group
      << "), head_dim " << head_dim;
  if (page_size > 0) out << ", page_size " << page_size;
  out << "\n  mask: " << (options.causal ? "causal" : "full") << ", window ("
      << options.window_left << ", " << options.window_right << "), soft-cap "
      << options.logits_soft_cap << "\n";
  if (!kernel.empty()) out << "  kernel: " << kernel << "\n";
  out << "  tiling: " << config.q_tile_rows << " packed rows per tile ("
      << std::max(1, config.q_tile_rows / std::max(1, group)) << " tokens x " << group
      << " heads), " << config.num_workers << " workers, split-KV "
      << (config.split_kv ? "on" : "off") << " (min chunk " << config.min_kv_chunk << " keys"
      << (config.deterministic ? ", deterministic fixed chunks" : "") << ")\n";
  int64_t split_pieces = 0;
  for (const MergeItem& m : merges) split_pieces += m.num_splits;
  out << "  work items " << work.size() << " (" << merges.size() << " tiles split into "
      << split_pieces << " pieces), partial rows " << num_partial_rows << ", workspace "
      << workspace_bytes << " bytes\n";
  if (capacity.fixed()) {
    out << "  fixed capacity: " << capacity.max_work_items << " work items, "
        << capacity.max_merges << " merges, " << capacity.max_partial_rows << " partial rows\n";
  }
  const int32_t workers = static_cast<int32_t>(worker_indptr.size()) - 1;
  int32_t busy = 0;
  for (int32_t w = 0; w < workers; ++w) busy += worker_indptr[w + 1] > worker_indptr[w];
  const double mean = workers > 0 ? total_cost / workers : 0.0;
  out << "  cost: total " << total_cost << ", busiest worker " << max_worker_cost << ", mean "
      << mean << ", imbalance (max/mean) " << (mean > 0 ? max_worker_cost / mean : 1.0) << ", "
      << busy << "/" << workers << " workers busy\n";
  const size_t shown = std::min<size_t>(work.size(), 16);
  for (int32_t w = 0, printed = 0; w < workers && printed < static_cast<int32_t>(shown); ++w) {
    for (int32_t i = worker_indptr[w]; i < worker_indptr[w + 1] && printed < 16; ++i, ++printed) {
      const WorkItem& item = work[i];
      out << "    worker " << w << ": request " << item.request << " kv_head " << item.kv_head
          << " q [" << item.q_start << ", " << item.q_start + item.q_len << ") kv ["
          << item.kv_start << ", " << item.kv_end << ")";
      if (item.partial_row >= 0) out << " -> partial row " << item.partial_row;
      out << "\n";
    }
  }
  if (work.size() > shown) out << "    ... " << work.size() - shown << " more items\n";
  return out.str();
}

}  // namespace tessera
