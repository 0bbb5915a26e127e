// The planner's internals, shared by its files (not installed, not for other code):
//   planner.cpp          make_plan's steps 1-2 (query tiles, the split-KV search) and the work
//                        list, capacity_bound, the cost model;
//   planner_schedule.cpp the pieces' order and step 3 (LPT) and step 4 (L2 sections);
//   planner_explain.cpp  Plan::explain.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/planner.hpp"

namespace tessera::detail::planner_internal {

// The smallest split target make_plan tries is the fair share divided by this; capacity_bound's
// balanced-split bound depends on it.
constexpr int kSmallestTargetDivisor = 3;

inline int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

// One (request, q tile): the num_kv_heads work items of the unsplit plan share all of it.
struct QueryTile {
  int32_t request = 0;
  int32_t q_start = 0;
  int32_t q_len = 0;
  int32_t kv_start = 0;
  int32_t kv_end = 0;
  double cost = 0;
};

struct SplitPolicy {
  double target = 0;  // piece cost aimed at
  bool round_up = true;
};

// One piece of a query tile's key range; it stands for num_kv_heads work items of equal cost.
struct Piece {
  double cost = 0;
  int32_t tile = 0;
  int32_t index = 0;  // piece within the tile
  int32_t kv_start = 0;
  int32_t kv_end = 0;
};

// Costs are whole numbers (pairs x group + keys x kCostPerKeyRead + kCostPerItem), so the
// planner keeps its sums and worker loads exactly as int64: the same values that summing the
// doubles item by item gives while every partial sum is below 2^53.
static_assert(kCostPerKeyRead == static_cast<int64_t>(kCostPerKeyRead) &&
                  kCostPerItem == static_cast<int64_t>(kCostPerItem) && kCostPerItem > 0,
              "the planner sums costs exactly as integers");
constexpr int64_t kExactDoubles = int64_t{1} << 53;

// A sum of costs, each added `times` times: exactly the double that adding them one by one in
// that order gives. Kept as an integer (one multiply per cost) while it stays below 2^53, where
// every partial double sum is exact too; beyond that it goes on as that double loop.
class CostSum {
 public:
  void add(double cost, int32_t times) {
    if (exact_) {
      // cost x times and the sum so far both at most 2^52 (checked in doubles: a product
      // that rounds to <= 2^52 is <= 2^52 exactly, being a whole number): the new sum is at
      // most 2^53. A whole cost below 2^53 converts exactly.
      constexpr double kHalf = static_cast<double>(kExactDoubles / 2);
      const int64_t whole = static_cast<int64_t>(cost);
      if (cost * times <= kHalf && sum_ <= kExactDoubles / 2 && cost >= 0 && times >= 0 &&
          static_cast<double>(whole) == cost) {
        sum_ += whole * times;
        return;
      }
      exact_ = false;
      value_ = static_cast<double>(sum_);
    }
    for (int32_t t = 0; t < times; ++t) value_ += cost;
  }
  double value() const { return exact_ ? static_cast<double>(sum_) : value_; }
  bool exact() const { return exact_; }
  int64_t exact_value() const { return sum_; }  // when exact()

 private:
  bool exact_ = true;
  int64_t sum_ = 0;
  double value_ = 0;
};

// A split candidate: the chunk of every tile, its pieces longest first, the LPT schedule.
struct Candidate {
  const std::vector<int32_t>* chunks = nullptr;  // per query tile
  std::vector<Piece> pieces;    // sorted: cost descending, then tile, then piece
  int64_t num_items = 0;        // pieces x kv heads
  CostSum item_cost;            // over all items
  double largest = 0;           // cost of the largest item
  std::vector<int32_t> owner;   // worker of each item, in item order (below)
  double makespan = 0;

  // No schedule's busiest worker carries less than its largest item or the mean load.
  double lower_bound(int32_t workers) const {
    return std::max(largest, item_cost.value() / workers);
  }
};

// The buffers of step 3's LPT over keys of type Key (planner_schedule.cpp).
template <class Key>
struct LptBuffers {
  std::vector<Key> tree;   // the winner tree, once every worker has had an item
  std::vector<Key> order;  // assign_level_by_level: (rest, worker) keys
};

// The sections of a prefill plan (step 4): request groups x kv-head chunks.
struct Sections {
  int32_t chunk_heads = 0;             // kv heads per chunk, a divisor of the kv heads
  int32_t chunks = 0;                  // kv heads / chunk_heads
  int32_t num_groups = 0;
  std::vector<int32_t> group_of;       // per request
  std::vector<int32_t> group_order;    // groups, longest item first
  std::vector<int32_t> group_first;    // per group: its first piece in `pieces` (+ end)
  std::vector<Piece> pieces;           // the candidate's pieces, by group, cost descending
  std::vector<int32_t> next;           // make_sections' cursor per group
};

// Buffers reused from call to call on a thread: a serving engine plans every step, and once
// they have grown a plan allocates nothing but its own lists.
struct PlannerScratch {
  std::vector<QueryTile> tiles;
  std::vector<int32_t> chunks[4];  // per split policy
  Candidate candidates[2];
  std::vector<uint64_t> sort_keys, sort_buffer;
  std::vector<Piece> sorted_pieces;
  LptBuffers<uint64_t> lpt64;
  LptBuffers<unsigned __int128> lpt128;
  std::vector<int32_t> first_merge, pieces_of, cursor;
  Sections sections;                    // step 4
  std::vector<int32_t> section_owner;
  std::vector<int64_t> first_partial_row;

  // A very large plan's buffers are not kept for the next call.
  void trim() {
    constexpr size_t kKeep = size_t{1} << 16;
    if (tiles.capacity() > kKeep || candidates[0].owner.capacity() > 16 * kKeep ||
        candidates[1].owner.capacity() > 16 * kKeep || section_owner.capacity() > 16 * kKeep) {
      *this = PlannerScratch();
    }
  }
};

// The calling thread's buffers (planner.cpp).
PlannerScratch& planner_scratch();

// ---- planner_schedule.cpp ----

// Sorts the pieces (made in (tile, piece) order) by cost descending, then tile, then piece (a
// stable sort by cost); keys, key_buffer and sorted are scratch space.
void sort_pieces(std::vector<Piece>& pieces, std::vector<uint64_t>& keys,
                 std::vector<uint64_t>& key_buffer, std::vector<Piece>& sorted);

// Step 3: schedules the candidate's (sorted) items by LPT into c.owner and c.makespan; stops
// early, returning false, once its busiest worker carries more than `stop_above`.
bool schedule(Candidate& c, int32_t heads, int32_t workers, double stop_above,
              PlannerScratch& scratch);

// Step 4: a sectioned schedule is kept when its busiest worker carries at most this much more
// than plain LPT's.
constexpr double kSectionMakespanSlack = 0.02;

// Fills `sec` for the shape (false: one section would hold everything, nothing to do).
// `budget`: the bytes of K/V of one section (settings().plan_section_bytes; 0: no sections).
bool make_sections(const PlanShape& shape, const std::vector<QueryTile>& tiles,
                   const std::vector<Piece>& sorted_pieces, int32_t heads, int64_t budget,
                   Sections& sec);

// LPT over the sectioned item order (for_each_section_item) into `owner` (resized by the
// caller); returns the busiest worker's load. `total`: the cost of all items.
double schedule_sections(const Sections& sec, int32_t workers, const CostSum& total,
                         PlannerScratch& scratch, std::vector<int32_t>& owner);

// Calls visit(piece, kv head) for every item of the sectioned schedule, in its order: sections
// (group order, then chunk), within one the group's pieces (cost descending), each piece kv head
// by kv head of the chunk.
template <class Visit>
void for_each_section_item(const Sections& sec, Visit&& visit) {
  for (int32_t g : sec.group_order) {
    for (int32_t c = 0; c < sec.chunks; ++c) {
      for (int32_t i = sec.group_first[g]; i < sec.group_first[g + 1]; ++i) {
        for (int32_t h = c * sec.chunk_heads; h < (c + 1) * sec.chunk_heads; ++h) {
          visit(sec.pieces[static_cast<size_t>(i)], h);
        }
      }
    }
  }
}

}  // namespace tessera::detail::planner_internal
