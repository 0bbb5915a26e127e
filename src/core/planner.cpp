// The planner (see planner.hpp): the cost model, capacity_bound, and make_plan's steps 1 (query
// tiles) and 2 (the split-KV search) and the work list. Steps 3 (LPT) and 4 (L2 sections) are in
// planner_schedule.cpp, Plan::explain in planner_explain.cpp.
#include "core/planner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/planner_internal.hpp"
#include "core/settings.hpp"
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

int64_t visible_pairs(const MaskSpec& mask, int32_t q_start, int32_t q_len, int32_t q_len_total,
                      int32_t kv_len, int32_t kv_start, int32_t kv_end) {
  // Keys of row t inside [kv_start, kv_end).
  const auto row_pairs = [&](int64_t t) -> int64_t {
    int32_t first, last;
    mask.visible_range(static_cast<int32_t>(t), q_len_total, kv_len, &first, &last);
    first = std::max(first, kv_start);
    last = std::min(last, kv_end);
    return last > first ? last - first : 0;
  };
  const int64_t begin = q_start, end = int64_t{q_start} + std::max(q_len, 0);
  int64_t pairs = 0;
  if (end - begin <= 8) {
    for (int64_t t = begin; t < end; ++t) pairs += row_pairs(t);
    return pairs;
  }
  // Every bound of a row's range is a constant (0, kv_len, kv_start, kv_end) or the row's
  // diagonal plus a constant (1 if causal, window_right + 1, -window_left), so row_pairs is
  // continuous and linear in t between the rows where a diagonal bound meets a constant one
  // (slopes are 0 or 1, so they meet at whole rows). Cut there and sum each stretch as an
  // arithmetic series.
  const int64_t diag0 = int64_t{kv_len} - q_len_total;  // row t's diagonal key: t + diag0
  int64_t offsets[3];
  int num_offsets = 0;
  if (mask.causal) offsets[num_offsets++] = 1;
  if (mask.window_right >= 0) offsets[num_offsets++] = int64_t{mask.window_right} + 1;
  if (mask.window_left >= 0) offsets[num_offsets++] = -int64_t{mask.window_left};
  const int64_t constants[4] = {0, kv_len, kv_start, kv_end};
  int64_t cuts[3 * 4 + 2];
  int n = 0;
  cuts[n++] = begin;
  for (int o = 0; o < num_offsets; ++o) {
    for (const int64_t constant : constants) {
      const int64_t row = constant - offsets[o] - diag0;
      if (row > begin && row < end) cuts[n++] = row;
    }
  }
  cuts[n++] = end;
  for (int i = 2; i < n - 1; ++i) {  // insertion sort of the (few) inner cuts
    for (int j = i; j > 1 && cuts[j] < cuts[j - 1]; --j) std::swap(cuts[j], cuts[j - 1]);
  }
  for (int i = 0; i + 1 < n; ++i) {
    const int64_t a = cuts[i], b = cuts[i + 1];
    if (a == b) continue;
    const int64_t count = b - a;
    pairs += count == 1 ? row_pairs(a) : (row_pairs(a) + row_pairs(b - 1)) * count / 2;
  }
  return pairs;
}

double work_item_cost(const WorkItem& item, const MaskSpec& mask, int32_t q_len_of_request,
                      int32_t kv_len_of_request, int32_t group_size) {
  const int64_t pairs = visible_pairs(mask, item.q_start, item.q_len, q_len_of_request,
                                      kv_len_of_request, item.kv_start, item.kv_end);
  const double keys = static_cast<double>(item.kv_end - item.kv_start);
  return static_cast<double>(pairs) * group_size + keys * kCostPerKeyRead + kCostPerItem;
}

namespace planner_internal {

PlannerScratch& planner_scratch() {
  thread_local PlannerScratch scratch;
  return scratch;
}

}  // namespace planner_internal

using namespace planner_internal;

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

// Keys per piece of `tile` under `policy` (>= the key range: not split).
int32_t split_chunk(const QueryTile& tile, const PlanConfig& config, const SplitPolicy& policy) {
  const int32_t range = tile.kv_end - tile.kv_start;
  if (!config.split_kv || range <= config.min_kv_chunk) return range;
  if (config.deterministic) return config.min_kv_chunk;
  if (!(tile.cost > policy.target)) return range;
  const double ratio = tile.cost / policy.target;
  const int32_t by_cost =
      static_cast<int32_t>(policy.round_up ? std::ceil(ratio) : std::round(ratio));
  const int32_t by_size = ceil_div(range, config.min_kv_chunk);
  const int32_t pieces = std::max(1, std::min(by_cost, by_size));
  const int32_t chunk = std::max(
      ceil_div(ceil_div(range, pieces), kSplitAlignment) * kSplitAlignment, config.min_kv_chunk);
  return std::min(chunk, range);  // one piece: always `range`, so equal cuts compare equal
}

// Piece `index` of a tile cut into `chunk`-key pieces: deterministic cuts at absolute multiples
// of chunk, otherwise from kv_start.
void piece_range(const QueryTile& tile, int32_t chunk, bool deterministic, int32_t index,
                 int32_t* kv_start, int32_t* kv_end) {
  const int64_t origin =
      deterministic ? int64_t{tile.kv_start} / chunk * chunk : int64_t{tile.kv_start};
  const int64_t start = origin + int64_t{index} * chunk;
  *kv_start = static_cast<int32_t>(std::max<int64_t>(start, tile.kv_start));
  *kv_end = static_cast<int32_t>(std::min<int64_t>(start + chunk, tile.kv_end));
}

int32_t piece_count(const QueryTile& tile, int32_t chunk, bool deterministic) {
  if (chunk >= tile.kv_end - tile.kv_start) return 1;
  if (deterministic) return (tile.kv_end - 1) / chunk - tile.kv_start / chunk + 1;
  return ceil_div(tile.kv_end - tile.kv_start, chunk);
}

// The candidate's pieces in (tile, piece) order, their costs and the bound's inputs.
void list_pieces(const std::vector<QueryTile>& tiles, const PlanConfig& config,
                 const MaskSpec& mask, const PlanShape& shape, int32_t group, int32_t heads,
                 Candidate* c) {
  c->pieces.clear();
  c->item_cost = CostSum();
  c->largest = 0;
  const std::vector<int32_t>& chunks = *c->chunks;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const QueryTile& tile = tiles[i];
    const int32_t count = piece_count(tile, chunks[i], config.deterministic);
    for (int32_t p = 0; p < count; ++p) {
      Piece piece;
      piece.tile = static_cast<int32_t>(i);
      piece.index = p;
      if (count == 1) {
        piece.kv_start = tile.kv_start;
        piece.kv_end = tile.kv_end;
        piece.cost = tile.cost;
      } else {
        piece_range(tile, chunks[i], config.deterministic, p, &piece.kv_start, &piece.kv_end);
        const WorkItem item{tile.request, 0,        tile.q_start, tile.q_len,
                            piece.kv_start, piece.kv_end, -1};
        piece.cost = work_item_cost(item, mask, shape.q_lens[tile.request],
                                    shape.kv_lens[tile.request], group);
      }
      c->item_cost.add(piece.cost, heads);
      c->largest = std::max(c->largest, piece.cost);
      c->pieces.push_back(piece);
    }
  }
  c->num_items = static_cast<int64_t>(c->pieces.size()) * heads;
}

}  // namespace

PlanCapacity capacity_bound(int32_t max_batch, int64_t max_total_q, int32_t max_kv_len,
                            int32_t num_qo_heads, int32_t num_kv_heads,
                            const PlanConfig& requested_config) {
  PlanConfig config = requested_config;
  if (config.deterministic && config.deterministic_kv_chunk > 0) {
    config.min_kv_chunk = config.deterministic_kv_chunk;  // as make_plan does
  }
  PlanCapacity capacity;
  if (max_batch <= 0 || num_kv_heads <= 0) return capacity;
  const int64_t group = std::max(1, num_qo_heads / num_kv_heads);
  const int64_t tokens_per_tile = std::max<int64_t>(1, config.q_tile_rows / group);
  max_total_q = std::max<int64_t>(0, max_total_q);
  max_kv_len = std::max(0, max_kv_len);
  // Products and sums saturate at INT64_MAX (the results are clamped below): extreme maxima
  // must give the largest capacity, not a wrapped one.
  const auto times = [](int64_t a, int64_t b) {
    int64_t product = 0;
    return __builtin_mul_overflow(a, b, &product) ? INT64_MAX : product;
  };
  const auto plus = [](int64_t a, int64_t b) {
    int64_t sum = 0;
    return __builtin_add_overflow(a, b, &sum) ? INT64_MAX : sum;
  };
  // sum_b ceil(q_b / t) <= floor(total / t) + batch; every tile once per kv head.
  const int64_t tiles = times(max_total_q / tokens_per_tile + max_batch, num_kv_heads);
  // A split range gives at most ceil(range / min_kv_chunk) pieces (+1: deterministic cuts at
  // absolute multiples, so the first piece may be short).
  const bool can_split = config.split_kv && max_kv_len > config.min_kv_chunk;
  const int64_t pieces =
      can_split ? (int64_t{max_kv_len} + config.min_kv_chunk - 1) / config.min_kv_chunk + 1 : 1;
  const auto clamp32 = [](int64_t x) {
    return static_cast<int32_t>(std::clamp<int64_t>(x, 1, INT32_MAX));
  };
  int64_t work_items = times(tiles, pieces);
  // Rows of one tile = its tokens x group; summed over the tiles of one kv head = total_q x group.
  int64_t partial_rows = can_split ? times(times(max_total_q, num_qo_heads), pieces) : 0;
  if (can_split && !config.deterministic) {
    // Balanced splits are bounded by the worker count too: every policy of make_plan cuts a
    // tile of cost c into at most round(c / target) or ceil(c / target) pieces with
    // target >= fair share / kSmallestTargetDivisor (3) = total cost / (3 workers), so a tile
    // has at most 3 c / fair + 1 pieces and the plan at most 3 workers + tiles items in all,
    // whatever the lengths. This keeps graph workspaces small when min_kv_chunk is small.
    const int64_t by_workers = plus(kSmallestTargetDivisor * int64_t{config.num_workers}, tiles);
    const int64_t rows_per_tile = std::min<int64_t>(config.q_tile_rows, tokens_per_tile * group);
    work_items = std::min(work_items, by_workers);
    partial_rows = std::min(partial_rows, times(by_workers, rows_per_tile));
  }
  capacity.max_work_items = clamp32(work_items);
  capacity.max_merges = can_split ? clamp32(tiles) : 0;
  // make_plan refuses a plan of more partial rows (work items index them in 32 bits).
  capacity.max_partial_rows = std::min<int64_t>(partial_rows, INT32_MAX);
  if (capacity.max_partial_rows == 0) capacity.max_merges = 0;
  return capacity;
}

namespace {

// make_plan's config: the capacity's deterministic mode and the deterministic piece size
// applied, split-KV off for a fixed capacity without merge or partial room; the capacity and
// the config checked.
PlanConfig effective_config(const PlanShape& shape, const PlanConfig& requested_config,
                            const ArgChecker& check) {
  const PlanCapacity& capacity = shape.capacity;
  PlanConfig config = requested_config;
  if (capacity.deterministic) config.deterministic = true;
  if (config.deterministic && config.deterministic_kv_chunk > 0) {
    config.min_kv_chunk = config.deterministic_kv_chunk;
  }
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
  return config;
}

// A plan of the shape under `config`, without its lists.
Plan plan_of_shape(const PlanShape& shape, const PlanConfig& config) {
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
  plan.capacity = shape.capacity;
  plan.q_lens = shape.q_lens;
  plan.kv_lens = shape.kv_lens;
  for (int32_t len : shape.q_lens) plan.total_q += len;
  return plan;
}

// 1. Query tiles, each with the key range its rows can see. The num_kv_heads tiles of one
//    (request, q tile) cost the same, so everything below works per query tile and expands
//    to the kv heads only when scheduling. Returns the cost of all items, tile by tile and kv
//    head by kv head.
CostSum make_tiles(const PlanShape& shape, const MaskSpec& mask, int32_t group,
                   int32_t tokens_per_tile, std::vector<QueryTile>& tiles) {
  const int32_t heads = shape.num_kv_heads;
  const int32_t batch_size = static_cast<int32_t>(shape.q_lens.size());
  tiles.clear();
  CostSum total;
  {
    int64_t count = 0;
    for (int32_t q_len : shape.q_lens) count += (q_len + tokens_per_tile - 1) / tokens_per_tile;
    tiles.reserve(static_cast<size_t>(count));
  }
  for (int32_t b = 0; b < batch_size; ++b) {
    const int32_t q_len = shape.q_lens[b], kv_len = shape.kv_lens[b];
    for (int32_t q_start = 0; q_start < q_len; q_start += tokens_per_tile) {
      QueryTile tile;
      tile.request = b;
      tile.q_start = q_start;
      tile.q_len = std::min(tokens_per_tile, q_len - q_start);
      tile_key_range(mask, q_start, tile.q_len, q_len, kv_len, &tile.kv_start, &tile.kv_end);
      const WorkItem item{b, 0, q_start, tile.q_len, tile.kv_start, tile.kv_end, -1};
      tile.cost = work_item_cost(item, mask, q_len, kv_len, group);
      total.add(tile.cost, heads);
      tiles.push_back(tile);
    }
  }
  return total;
}

// 2. Split-KV. Deterministic mode cuts at fixed absolute key positions (multiples of
//    min_kv_chunk), so the arithmetic of a row never depends on what else is in the batch.
//    Otherwise a tile costing more than a target piece cost is cut into about cost / target
//    equal pieces, for a few targets around the fair share (total / workers); each candidate
//    is scheduled (step 3) and the one with the shortest busiest worker wins (ties: the
//    fewer pieces). Rounding the piece count to the nearest integer rather than up matters for
//    uniform batches: 128 tiles of 2.06 fair shares on 264 workers make 256 pieces of 1.03
//    (one per worker) instead of 384 of 0.69 (two on some workers, 1.37).
//
//    plan() runs once per serving step, so the search is kept cheap without changing its
//    result (tests/test_planner_reference.cpp compares it with a direct implementation): a
//    policy whose cuts equal an earlier policy's (the usual case: no tile exceeds any target)
//    is skipped, as is one whose lower bound on the busiest worker (its largest piece, its mean
//    load) already loses to the best so far, and a schedule stops as soon as a worker carries
//    more than the best so far; only costs are scheduled while searching, the work items are
//    built once for the winner.
constexpr int kNumPolicies = 4;

// How many of the policies to try: 1 when split-KV is off or deterministic, or when no tile
// that may be split costs more than the smallest target (every policy leaves every tile whole,
// split_chunk, so the others would be skipped as duplicates).
int policies_to_try(const std::vector<QueryTile>& tiles, const PlanConfig& config,
                    const SplitPolicy (&policies)[kNumPolicies]) {
  int num_policies = !config.split_kv || config.deterministic ? 1 : kNumPolicies;
  if (num_policies > 1) {
    double largest_splittable = 0;
    for (const QueryTile& tile : tiles) {
      if (tile.kv_end - tile.kv_start > config.min_kv_chunk) {
        largest_splittable = std::max(largest_splittable, tile.cost);
      }
    }
    if (!(largest_splittable > policies[num_policies - 1].target)) num_policies = 1;
  }
  return num_policies;
}

// The winning candidate (one of scratch.candidates), scheduled.
const Candidate& search_split_policies(const PlanShape& shape, const PlanConfig& config,
                                       const MaskSpec& mask, int32_t group, double total_cost,
                                       PlannerScratch& scratch) {
  const std::vector<QueryTile>& tiles = scratch.tiles;
  const int32_t heads = shape.num_kv_heads;
  const double fair_share = total_cost / config.num_workers;
  const SplitPolicy policies[kNumPolicies] = {{fair_share, true},
                                              {fair_share, false},
                                              {fair_share / 2, false},
                                              {fair_share / kSmallestTargetDivisor, false}};
  const int num_policies = policies_to_try(tiles, config, policies);
  Candidate* best = &scratch.candidates[0];
  Candidate* trial = &scratch.candidates[1];
  for (int p = 0; p < num_policies; ++p) {
    std::vector<int32_t>& chunks = scratch.chunks[p];
    chunks.resize(tiles.size());
    for (size_t i = 0; i < tiles.size(); ++i) {
      chunks[i] = split_chunk(tiles[i], config, policies[p]);
    }
    bool seen = false;  // the same cuts as an earlier policy
    for (int q = 0; q < p && !seen; ++q) seen = scratch.chunks[q] == chunks;
    if (seen) continue;
    const bool first = p == 0;
    trial->chunks = &chunks;
    list_pieces(tiles, config, mask, shape, group, heads, trial);
    // A relative margin so that rounding noise never trades balance for more pieces.
    const double no_better =
        first ? std::numeric_limits<double>::infinity() : best->makespan * (1.0 + 1e-9);
    if (!first && trial->lower_bound(config.num_workers) > no_better) continue;
    sort_pieces(trial->pieces, scratch.sort_keys, scratch.sort_buffer, scratch.sorted_pieces);
    if (!schedule(*trial, heads, config.num_workers, no_better, scratch)) continue;
    if (first || trial->makespan < best->makespan * (1.0 - 1e-9) ||
        (trial->makespan <= no_better && trial->num_items < best->num_items)) {
      std::swap(best, trial);
    }
  }
  return *best;
}

// The winner's merges and partial rows in (request, q tile, kv head) order, and per tile its
// piece count, first merge and first partial row (scratch.pieces_of, first_merge,
// first_partial_row).
void add_merges(const PlanShape& shape, const Candidate& best, int32_t group,
                const ArgChecker& check, PlannerScratch& scratch, Plan& plan) {
  const std::vector<QueryTile>& tiles = scratch.tiles;
  const std::vector<int32_t>& best_chunks = *best.chunks;
  const int32_t heads = shape.num_kv_heads;
  std::vector<int32_t>& first_merge = scratch.first_merge;
  std::vector<int32_t>& pieces_of = scratch.pieces_of;
  std::vector<int64_t>& first_partial_row = scratch.first_partial_row;
  first_merge.resize(tiles.size());
  pieces_of.resize(tiles.size());
  first_partial_row.resize(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    const QueryTile& tile = tiles[i];
    pieces_of[i] = piece_count(tile, best_chunks[i], plan.config.deterministic);
    first_merge[i] = static_cast<int32_t>(plan.merges.size());
    first_partial_row[i] = plan.num_partial_rows;
    if (pieces_of[i] == 1) continue;
    const int32_t rows = tile.q_len * group;
    for (int32_t h = 0; h < heads; ++h) {
      plan.merges.push_back({tile.request, h, tile.q_start, tile.q_len,
                             static_cast<int32_t>(plan.num_partial_rows), pieces_of[i]});
      plan.num_partial_rows += static_cast<int64_t>(rows) * pieces_of[i];
    }
    // Work items and merges index partial rows in 32 bits (a workspace of >= 2^31 rows of
    // head_dim floats, 1 TiB at head_dim 128, is out of reach anyway).
    if (plan.num_partial_rows > INT32_MAX) {
      check.unsupported(shape.op == AttentionOp::kRaggedPrefill ? "kv_indptr" : "page_indptr",
                        "the batch's split-KV plan needs " +
                            std::to_string(plan.num_partial_rows) +
                            "+ partial rows, more than 2^31 - 1");
    }
  }
}

// Step 4: the sectioned schedule of the winner's pieces (scratch.sections, section_owner) when
// it balances about as well as plain LPT; sets *makespan to the chosen schedule's.
bool use_sections(const PlanShape& shape, const Candidate& best, int32_t workers,
                  PlannerScratch& scratch, double* makespan) {
  *makespan = best.makespan;
  if (shape.op == AttentionOp::kDecode ||
      !make_sections(shape, scratch.tiles, best.pieces, shape.num_kv_heads,
                     settings().plan_section_bytes, scratch.sections)) {
    return false;
  }
  scratch.section_owner.resize(best.owner.size());
  const double sectioned_makespan = schedule_sections(scratch.sections, workers, best.item_cost,
                                                      scratch, scratch.section_owner);
  if (!(sectioned_makespan <= best.makespan * (1.0 + kSectionMakespanSlack))) return false;
  *makespan = sectioned_makespan;
  return true;
}

// The work list: items grouped by worker (`owner`: each item's, in schedule order), each
// worker's items in the schedule's order (longest first, or section by section: step 4).
void fill_work(const Candidate& best, const std::vector<int32_t>& owner, bool sectioned,
               int32_t group, int32_t heads, PlannerScratch& scratch, Plan& plan) {
  const int32_t workers = plan.config.num_workers;
  plan.worker_indptr.assign(workers + 1, 0);
  for (int32_t worker : owner) ++plan.worker_indptr[worker + 1];
  for (int32_t w = 0; w < workers; ++w) plan.worker_indptr[w + 1] += plan.worker_indptr[w];
  std::vector<int32_t>& cursor = scratch.cursor;
  cursor.assign(plan.worker_indptr.begin(), plan.worker_indptr.end() - 1);
  plan.work.resize(owner.size());
  WorkItem* const work = plan.work.data();
  int32_t* const next_slot = cursor.data();
  const int32_t* worker_of_item = owner.data();
  const std::vector<QueryTile>& tiles = scratch.tiles;
  const std::vector<int32_t>& pieces_of = scratch.pieces_of;
  const std::vector<int32_t>& first_merge = scratch.first_merge;
  const std::vector<int64_t>& first_partial_row = scratch.first_partial_row;
  const std::vector<Piece>& pieces = best.pieces;
  // Work item of piece `piece` of tile t for kv head h (a split tile's piece writes its partial
  // rows and names its merge).
  const auto piece_item = [&](int32_t t, const Piece& piece, int32_t h) {
    const QueryTile& tile = tiles[t];
    WorkItem item{tile.request, h, tile.q_start, tile.q_len, piece.kv_start, piece.kv_end, -1};
    if (pieces_of[t] > 1) {
      item.partial_row = static_cast<int32_t>(
          first_partial_row[t] +
          (int64_t{h} * pieces_of[t] + piece.index) * (int64_t{tile.q_len} * group));
      item.merge_index = first_merge[t] + h;
    }
    return item;
  };
  if (sectioned) {
    // Items in the sectioned schedule's order, each to the next free slot of its worker.
    for_each_section_item(scratch.sections, [&](const Piece& piece, int32_t h) {
      work[next_slot[*worker_of_item++]++] = piece_item(piece.tile, piece, h);
    });
    return;
  }
  // Items in the schedule's order (see item order, planner_schedule.cpp), one run of a tile's
  // equal-cost pieces at a time, each to the next free slot of its worker.
  for (size_t run = 0; run < pieces.size();) {
    size_t end = run + 1;
    while (end < pieces.size() && pieces[end].cost == pieces[run].cost &&
           pieces[end].tile == pieces[run].tile) {
      ++end;
    }
    const int32_t t = pieces[run].tile;
    if (pieces_of[t] == 1) {  // a whole tile: one piece, built once
      WorkItem item = piece_item(t, pieces[run], 0);
      for (int32_t h = 0; h < heads; ++h) {
        item.kv_head = h;
        work[next_slot[*worker_of_item++]++] = item;
      }
    } else {
      for (int32_t h = 0; h < heads; ++h) {
        for (size_t p = run; p < end; ++p) {
          work[next_slot[*worker_of_item++]++] = piece_item(t, pieces[p], h);
        }
      }
    }
    run = end;
  }
}

// A plan of a fixed capacity must fit it.
void check_capacity(const Plan& plan, const PlanCapacity& capacity, const ArgChecker& check) {
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

}  // namespace

Plan make_plan(const PlanShape& shape, const PlanConfig& requested_config) {
  const ArgChecker check(std::string("plan_") + op_name(shape.op));
  const PlanConfig config = effective_config(shape, requested_config, check);
  Plan plan = plan_of_shape(shape, config);
  const MaskSpec mask = mask_of(shape.options);
  const int32_t group = shape.num_qo_heads / shape.num_kv_heads;
  const int32_t tokens_per_tile = std::max(1, config.q_tile_rows / group);
  PlannerScratch& scratch = planner_scratch();
  const double total_cost = make_tiles(shape, mask, group, tokens_per_tile, scratch.tiles).value();
  const Candidate& best = search_split_policies(shape, config, mask, group, total_cost, scratch);
  add_merges(shape, best, group, check, scratch, plan);
  double makespan = 0;
  const bool sectioned = use_sections(shape, best, config.num_workers, scratch, &makespan);
  fill_work(best, sectioned ? scratch.section_owner : best.owner, sectioned, group,
            shape.num_kv_heads, scratch, plan);
  plan.total_cost = total_cost;
  plan.max_worker_cost = makespan;  // the busiest worker's load
  scratch.trim();
  if (shape.capacity.fixed()) check_capacity(plan, shape.capacity, check);
  plan.workspace_bytes = WorkspaceLayout::of(plan).total;
  return plan;
}

}  // namespace tessera::detail
