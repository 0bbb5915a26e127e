#include "core/planner.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <queue>
#include <sstream>
#include <string>

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

// The smallest split target make_plan tries is the fair share divided by this; capacity_bound's
// balanced-split bound depends on it.
constexpr int kSmallestTargetDivisor = 3;

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

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

// Sorts distinct keys ascending: LSD radix sort in 11-bit digits over the bits in use (a
// comparison sort of a few thousand random keys is bound by branch mispredictions), skipping
// the digits every key shares.
void radix_sort(std::vector<uint64_t>& keys, std::vector<uint64_t>& buffer) {
  constexpr int kDigitBits = 11;
  constexpr size_t kBuckets = size_t{1} << kDigitBits;
  uint64_t all = 0;
  for (const uint64_t key : keys) all |= key;
  const int digits = (std::bit_width(all) + kDigitBits - 1) / kDigitBits;
  buffer.resize(keys.size());
  std::array<uint32_t, kBuckets> counts;
  for (int digit = 0; digit < digits; ++digit) {
    const int shift = digit * kDigitBits;
    std::fill(counts.begin(), counts.end(), 0u);
    for (const uint64_t key : keys) ++counts[(key >> shift) & (kBuckets - 1)];
    if (counts[(keys[0] >> shift) & (kBuckets - 1)] == keys.size()) continue;  // all alike
    uint32_t offset = 0;
    for (uint32_t& count : counts) {
      const uint32_t here = count;
      count = offset;
      offset += here;
    }
    for (const uint64_t key : keys) buffer[counts[(key >> shift) & (kBuckets - 1)]++] = key;
    keys.swap(buffer);
  }
}

// Sorts the pieces (made in (tile, piece) order) by cost descending, then tile, then piece: a
// stable sort by cost. Nothing to do when they are in order already (uniform batches);
// otherwise one integer key per piece, (largest - cost, position), when it fits in 64 bits,
// radix-sorted from 1024 pieces up (prefill batches: thousands of tiles).
void sort_pieces(std::vector<Piece>& pieces, std::vector<uint64_t>& keys,
                 std::vector<uint64_t>& key_buffer, std::vector<Piece>& sorted) {
  const size_t n = pieces.size();
  double largest = 0;
  bool in_order = true;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && pieces[i].cost > pieces[i - 1].cost) in_order = false;
    largest = std::max(largest, pieces[i].cost);
  }
  if (in_order) return;
  const int position_bits = std::bit_width(static_cast<uint64_t>(n - 1));
  if (largest >= static_cast<double>(kExactDoubles) ||
      (static_cast<uint64_t>(largest) >> (64 - position_bits)) != 0) {
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      return a.tile != b.tile ? a.tile < b.tile : a.index < b.index;
    });
    return;
  }
  const uint64_t top = static_cast<uint64_t>(largest);
  keys.resize(n);
  for (size_t i = 0; i < n; ++i) {
    keys[i] = ((top - static_cast<uint64_t>(pieces[i].cost)) << position_bits) | i;
  }
  if (n >= 1024) {
    radix_sort(keys, key_buffer);
  } else {
    std::sort(keys.begin(), keys.end());
  }
  const uint64_t position_mask = (uint64_t{1} << position_bits) - 1;
  sorted.resize(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = pieces[keys[i] & position_mask];
  pieces.swap(sorted);
}

// Item order: the candidate's items longest first; equal costs in the order the items are made
// (request, q tile, kv head, piece), i.e. what a stable sort of that list gives. Pieces are
// sorted by (cost desc, tile, piece), so equal-cost pieces of one tile are adjacent: they are
// expanded kv head by kv head. The schedule and the work list both follow this order.

// 3. LPT: longest item first onto the least-loaded worker (ties: lowest index), so the plan is
//    deterministic and the most expensive items start first.
//
// A worker is one integer key, load << shift | worker (shift: the bits of the largest worker
// index), so that comparing keys compares (load, worker), a total order: the least key is the
// worker the next item goes to. Key is uint64_t when the candidate's total cost fits beside the
// worker bits (always, in practice), unsigned __int128 otherwise. The keys sit in a winner tree
// (nodes 1 .. 2W-1, worker w's leaf at W + w, each inner node the least key below it): giving
// an item replays one leaf-to-root path, whose sibling loads do not wait on the comparisons
// (a heap's sift does), without data-dependent branches. The first items go to idle workers
// 0, 1, ... (costs are > 0), and a long run of equal-cost items is given out level by level
// (assign_level_by_level).
//
// Workers in blocks: every piece stands for `heads` items of equal cost, so every run of equal
// costs holds a multiple of b = gcd(workers, heads) items. Workers b g .. b g + b - 1 (block g)
// then always carry equal loads, and LPT hands the b consecutive items of a run to the b
// workers of one block in index order: from equal loads, the block's first worker taking an
// item leaves its other workers the least (load, worker) keys, those of a block of lower
// index tied at the same load having gone first. So the schedule is LPT over the W / b blocks
// with items in groups of b: the same owners, b times fewer tree updates. (In LptWorkers a
// "worker" is such a block; give() writes the b workers of one.)
template <class Key>
struct LptBuffers {
  std::vector<Key> tree;   // the winner tree, once every worker has had an item
  std::vector<Key> order;  // assign_level_by_level: (rest, worker) keys
};

template <class Key>
class LptWorkers {
 public:
  // `workers` blocks of `block` workers each (shift: the bits of the largest block index).
  LptWorkers(LptBuffers<Key>& buffers, int32_t workers, int shift, int32_t block)
      : tree_(buffers.tree),
        order_(buffers.order),
        workers_(workers),
        shift_(shift),
        block_(block),
        worker_mask_((Key{1} << shift) - 1) {
    tree_.resize(2 * static_cast<size_t>(workers));
  }

  // Gives `count` groups of `block` items of cost `cost` out one group at a time, writing each
  // item's worker (block worker x block + position in the group) to owner[i].
  void assign(int64_t cost, int64_t count, int32_t* owner) {
    const Key step = static_cast<Key>(cost) << shift_;
    Key* const leaves = tree_.data() + workers_;
    for (; count > 0 && idle_ < workers_; --count) {  // idle workers first, in index order
      leaves[idle_] = step | static_cast<Key>(idle_);
      largest_ = std::max(largest_, leaves[idle_]);
      owner = give(owner, idle_++);
      if (idle_ == workers_) build();
    }
    if (count == 0) return;
    if (count >= workers_ && assign_level_by_level(cost, count, owner)) return;
    Key* const tree = tree_.data();
    Key top = tree[1];  // carried in a register from one item to the next
    for (; count > 0; --count) {
      const int32_t worker = worker_of(top);
      owner = give(owner, worker);
      Key key = top + step;
      largest_ = std::max(largest_, key);
      size_t node = static_cast<size_t>(workers_) + worker;
      tree[node] = key;
      for (; node > 1; node >>= 1) {
        key = std::min(key, tree[node ^ 1]);
        tree[node >> 1] = key;
      }
      top = key;  // the root
    }
  }

  // The busiest worker's load.
  int64_t max_load() const { return load_of(largest_); }

 private:
  // One group of items to block `worker`: its workers in index order.
  int32_t* give(int32_t* owner, int32_t worker) const {
    const int32_t first = worker * block_;
    for (int32_t i = 0; i < block_; ++i) *owner++ = first + i;
    return owner;
  }

  int64_t load_of(Key key) const { return static_cast<int64_t>(key >> shift_); }
  int32_t worker_of(Key key) const { return static_cast<int32_t>(key & worker_mask_); }

  void build() {
    for (size_t node = static_cast<size_t>(workers_); node-- > 1;) {
      tree_[node] = std::min(tree_[2 * node], tree_[2 * node + 1]);
    }
  }

  // Equal costs c: worker w's loads are L_w, L_w + c, L_w + 2c, ..., and the tree hands items
  // out in the order of (load, worker) over all of those. Writing L_w = level_w * c + rest_w
  // (0 <= rest_w < c), that is level by level, and within a level the workers that have
  // reached it ordered by (rest_w, w): one sort (none when the rests are in worker order
  // already, e.g. all equal) instead of a tree update per item. Used (returns true) when the
  // levels of the loads are close enough that few passes over the workers are empty.
  bool assign_level_by_level(int64_t cost, int64_t count, int32_t* owner) {
    const int64_t low = load_of(tree_[1]), high = load_of(largest_);
    if ((high / cost - low / cost) * workers_ > 4 * count) return false;
    Key* const leaves = tree_.data() + workers_;
    order_.resize(static_cast<size_t>(workers_));
    for (int32_t w = 0; w < workers_; ++w) {
      order_[w] = (static_cast<Key>(load_of(leaves[w]) % cost) << shift_) | static_cast<Key>(w);
    }
    if (!std::is_sorted(order_.begin(), order_.end())) std::sort(order_.begin(), order_.end());
    // Level `level` holds loads in [level * c, (level + 1) * c); a worker given an item moves
    // to the next level. The leaves keep the keys: (load + c) << shift | w = key + step.
    const Key step = static_cast<Key>(cost) << shift_;
    for (int64_t next_level = (low / cost + 1) * cost; count > 0; next_level += cost) {
      const Key below = static_cast<Key>(next_level) << shift_;  // keys of loads < next_level
      for (const Key entry : order_) {
        const int32_t worker = worker_of(entry);
        if (leaves[worker] >= below) continue;
        owner = give(owner, worker);
        leaves[worker] += step;
        largest_ = std::max(largest_, leaves[worker]);
        if (--count == 0) break;
      }
    }
    build();
    return true;
  }

  std::vector<Key>& tree_;
  std::vector<Key>& order_;
  const int32_t workers_;
  const int shift_;
  const int32_t block_;
  const Key worker_mask_;
  Key largest_ = 0;    // the largest key: the busiest worker
  int32_t idle_ = 0;   // workers idle_.. have had no item yet
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

PlannerScratch& planner_scratch() {
  thread_local PlannerScratch scratch;
  return scratch;
}

// LptWorkers' geometry for items that come `per_piece` at a time (kv heads of a piece): blocks
// of gcd(workers, per_piece) workers, the bits of the largest block index, and whether every
// load (at most the total cost) fits a uint64_t key beside them.
struct LptGeometry {
  int32_t block = 1;
  int32_t blocks = 1;
  int shift = 0;
  bool fits64 = false;
};

LptGeometry lpt_geometry(int32_t workers, int32_t per_piece, const CostSum& total) {
  LptGeometry g;
  g.block = std::gcd(workers, per_piece);
  g.blocks = workers / g.block;
  g.shift = std::bit_width(static_cast<uint32_t>(g.blocks - 1));
  g.fits64 = total.exact() &&
             (g.shift == 0 || (static_cast<uint64_t>(total.exact_value()) >> (64 - g.shift)) == 0);
  return g;
}

template <class Key>
bool schedule_with(Candidate& c, int32_t heads, const LptGeometry& g, double stop_above,
                   LptBuffers<Key>& buffers) {
  LptWorkers<Key> lpt(buffers, g.blocks, g.shift, g.block);
  // The item order keeps the items of equal-cost pieces together: one run each, of
  // (pieces x heads) / block groups.
  int64_t position = 0;
  for (size_t run = 0; run < c.pieces.size();) {
    size_t end = run + 1;
    while (end < c.pieces.size() && c.pieces[end].cost == c.pieces[run].cost) ++end;
    const int64_t count = static_cast<int64_t>(end - run) * heads;
    lpt.assign(static_cast<int64_t>(c.pieces[run].cost), count / g.block,
               c.owner.data() + position);
    position += count;
    run = end;
    if (static_cast<double>(lpt.max_load()) > stop_above) return false;
  }
  c.makespan = static_cast<double>(lpt.max_load());
  return true;
}

// Schedules the candidate's (sorted) items; stops early, returning false, once its busiest
// worker carries more than `stop_above` (loads only grow: it cannot win any more).
bool schedule(Candidate& c, int32_t heads, int32_t workers, double stop_above,
              PlannerScratch& scratch) {
  c.owner.resize(static_cast<size_t>(c.num_items));
  const LptGeometry g = lpt_geometry(workers, heads, c.item_cost);  // workers in blocks
  if (g.fits64) return schedule_with(c, heads, g, stop_above, scratch.lpt64);
  return schedule_with(c, heads, g, stop_above, scratch.lpt128);
}

// 4. L2 sections (prefill plans). Longest first, every worker runs the same query tile index at
//    the same time, each for a different (request, kv head): the K/V in flight at once is that
//    of every head of the batch (4 x 4096 tokens, 16 heads of 128: 128 MiB against a 50 MiB L2),
//    and a key tile is read from DRAM again for every query tile of its head. So prefill items
//    are scheduled section by section instead: a section is a group of consecutive requests
//    and a chunk of their kv heads whose K and V together take at most kL2SectionBytes
//    (16-bit elements assumed), LPT within each section from the loads the sections before it
//    left, sections with the longest items first. The workers then sweep the sections together
//    and read each section's K/V from DRAM about once (FlashAttention-3 orders its tiles in
//    head sections for the same reason). Kept only when its busiest worker carries at most
//    kSectionMakespanSlack more than plain LPT's; decode items each read their own K/V and keep
//    plain LPT. TESSERA_PLAN_ORDER=cost turns sections off (for timing); TESSERA_PLAN_L2_MB sets
//    the section size in MiB.
constexpr int64_t kL2SectionBytes = int64_t{16} << 20;
constexpr int64_t kSectionElementBytes = 2;  // K/V element size assumed (fp16 / bf16)
constexpr double kSectionMakespanSlack = 0.02;

int64_t section_bytes() {
  static const int64_t bytes = [] {
    const char* order = std::getenv("TESSERA_PLAN_ORDER");
    if (order != nullptr && std::string(order) == "cost") return int64_t{0};
    const char* mib = std::getenv("TESSERA_PLAN_L2_MB");
    if (mib != nullptr && *mib != '\0') {
      const long value = std::strtol(mib, nullptr, 10);  // 0 or less: no sections
      return value > 0 ? int64_t{std::min(value, 1L << 30)} << 20 : int64_t{0};
    }
    return kL2SectionBytes;
  }();
  return bytes;
}

// Fills `sec` for the shape (false: one section would hold everything, nothing to do).
bool make_sections(const PlanShape& shape, const std::vector<QueryTile>& tiles,
                   const std::vector<Piece>& sorted_pieces, int32_t heads, int64_t budget,
                   Sections& sec) {
  if (budget <= 0) return false;
  const int64_t per_key = 2 * kSectionElementBytes * shape.head_dim;  // K and V of one key
  int64_t largest = 0, total = 0;
  for (int32_t kv_len : shape.kv_lens) {
    largest = std::max<int64_t>(largest, kv_len);
    total += kv_len;
  }
  if (total <= budget / (per_key * heads)) return false;  // all of it fits one section
  // The largest divisor of heads whose chunk of the longest request fits the budget.
  int32_t chunk = 1;
  for (int32_t c = heads; c >= 1; --c) {
    if (heads % c == 0 && c * largest * per_key <= budget) {
      chunk = c;
      break;
    }
  }
  sec.chunk_heads = chunk;
  sec.chunks = heads / chunk;
  const size_t batch = shape.kv_lens.size();
  sec.group_of.resize(batch);
  int32_t group = 0;
  int64_t filled = 0;
  for (size_t r = 0; r < batch; ++r) {
    const int64_t bytes = int64_t{shape.kv_lens[r]} * per_key * chunk;
    if (filled > 0 && filled + bytes > budget) {
      ++group;
      filled = 0;
    }
    sec.group_of[r] = group;
    filled += bytes;
  }
  sec.num_groups = group + 1;
  if (sec.num_groups == 1 && sec.chunks == 1) return false;  // one section: plain LPT
  // The pieces by group, each group's in the candidate's order (cost descending): a stable
  // counting sort.
  sec.group_first.assign(static_cast<size_t>(sec.num_groups) + 1, 0);
  for (const Piece& piece : sorted_pieces) {
    ++sec.group_first[static_cast<size_t>(sec.group_of[tiles[piece.tile].request]) + 1];
  }
  for (int32_t g = 0; g < sec.num_groups; ++g) sec.group_first[g + 1] += sec.group_first[g];
  sec.pieces.resize(sorted_pieces.size());
  sec.next.assign(sec.group_first.begin(), sec.group_first.end() - 1);
  for (const Piece& piece : sorted_pieces) {
    sec.pieces[static_cast<size_t>(sec.next[sec.group_of[tiles[piece.tile].request]]++)] = piece;
  }
  // Groups whose largest item is largest first (ties: request order), so that no long item is
  // left to the end of the schedule.
  sec.group_order.resize(static_cast<size_t>(sec.num_groups));
  std::iota(sec.group_order.begin(), sec.group_order.end(), 0);
  const auto top = [&](int32_t g) {
    return sec.group_first[g] < sec.group_first[g + 1] ? sec.pieces[sec.group_first[g]].cost : 0.0;
  };
  std::stable_sort(sec.group_order.begin(), sec.group_order.end(),
                   [&](int32_t a, int32_t b) { return top(a) > top(b); });
  return true;
}

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

// LPT over the sectioned item order into `owner`; returns the busiest worker's load.
template <class Key>
double schedule_sections_with(const Sections& sec, const LptGeometry& g, LptBuffers<Key>& buffers,
                              std::vector<int32_t>& owner) {
  LptWorkers<Key> lpt(buffers, g.blocks, g.shift, g.block);
  int32_t* out = owner.data();
  for (int32_t group : sec.group_order) {
    const int32_t group_end = sec.group_first[group + 1];
    for (int32_t c = 0; c < sec.chunks; ++c) {
      for (int32_t run = sec.group_first[group]; run < group_end;) {
        int32_t end = run + 1;
        while (end < group_end && sec.pieces[end].cost == sec.pieces[run].cost) ++end;
        const int64_t count = int64_t{end - run} * sec.chunk_heads;
        lpt.assign(static_cast<int64_t>(sec.pieces[run].cost), count / g.block, out);
        out += count;
        run = end;
      }
    }
  }
  return static_cast<double>(lpt.max_load());
}

// 5. The tail (prefill plans). Items of equal cost fill the workers in whole rounds: 2048
//    items on 132 workers are 15 rounds and 68 items, so 68 workers run a 16th item while 64
//    wait (the makespan is 16 items for a mean of 15.5, 3% lost; every batch whose tiles are
//    alike, i.e. every uniform prefill batch, loses up to one item's time this way). No split
//    policy of step 2 cuts such items (each costs far less than the fair share), so the last
//    items of the busiest workers are cut here instead: each into m key pieces (2 <= m <= 8,
//    of at least min_kv_chunk keys but the last, as in step 2) that go longest first onto the
//    least-loaded workers, for the m that gives the shortest busiest worker. Each piece is
//    costed with the extra prologue and epilogue of two key tiles (kTailPieceOverheadKeys,
//    beyond the model's kCostPerItem: what a work item costs the sm90 kernels), and the cut is kept
//    only when the busiest worker gains kTailMinGain or more (2%: the merge launch and the
//    partial stores are not in the model; at 4 x 4096 tokens the gain is about 1%, at 16384
//    about 2.5%). Deterministic plans keep their fixed cuts; a fixed capacity that cannot hold
//    the pieces keeps the plan as it is. TESSERA_PLAN_TAIL=1 / 0 turns this step on / off
//    (kTailByDefault without it: off, the model's gain was not measured on an H100).
constexpr double kTailMinGain = 0.02;
constexpr int32_t kTailMaxPieces = 8;
// What a piece costs beyond the model's kCostPerItem: the prologue and epilogue of the sm90
// kernels, about two 128-key tiles of the q tile.
constexpr int32_t kTailPieceOverheadKeys = 2 * 128;

double tail_piece_overhead(const PlanConfig& config) {
  return static_cast<double>(config.q_tile_rows) * kTailPieceOverheadKeys;
}

// Whether step 5 runs without TESSERA_PLAN_TAIL: off, since on an H100 it gained nothing beyond
// the noise at d128 and d64 1 x 16384 (docs/PERF.md, 2026-12-06, fourth session).
constexpr bool kTailByDefault = false;

// TESSERA_PLAN_TAIL=1 / 0 turns step 5 on / off; read on every plan (one getenv), so that tests
// can plan both ways in one process.
bool tail_enabled() {
  const char* value = std::getenv("TESSERA_PLAN_TAIL");
  if (value == nullptr || *value == '\0') return kTailByDefault;
  return std::string(value) != "0";
}

// Plans step 5 may cut: prefill, split-KV allowed and not deterministic, and the step on.
bool tail_applies(const PlanShape& shape, const Plan& plan) {
  return plan.config.split_kv && !plan.config.deterministic &&
         shape.op != AttentionOp::kDecode && !plan.work.empty() && tail_enabled();
}

// An item's cut into at most m pieces: `chunk` keys each (a multiple of kSplitAlignment, at
// least min_kv_chunk), the last one shorter (as step 2's cuts).
struct TailCut {
  int32_t worker = 0;  // whose last item it is
  double cost = 0;     // the whole item's
  int32_t range = 0;   // its keys
};

int32_t tail_chunk(int32_t range, int32_t m, int32_t min_kv_chunk) {
  const int32_t count = std::min(m, range / min_kv_chunk);
  return std::max(ceil_div(ceil_div(range, count), kSplitAlignment) * kSplitAlignment,
                  min_kv_chunk);
}

// The busiest load after giving `pieces` (longest first, each with `overhead`) to the
// least-loaded of the workers of loads `rest` (ties: lowest index); owner: where each went.
double place_tail_pieces(const std::vector<double>& rest, const std::vector<double>& pieces,
                         double overhead, std::vector<int32_t>* owner) {
  using Load = std::pair<double, int32_t>;
  std::vector<Load> heap(rest.size());
  for (size_t w = 0; w < rest.size(); ++w) heap[w] = {rest[w], static_cast<int32_t>(w)};
  const auto later = std::greater<Load>();
  std::make_heap(heap.begin(), heap.end(), later);
  double most = *std::max_element(rest.begin(), rest.end());
  if (owner != nullptr) owner->clear();
  for (const double cost : pieces) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Load& least = heap.back();
    if (owner != nullptr) owner->push_back(least.second);
    least.first += cost + overhead;
    most = std::max(most, least.first);
    std::push_heap(heap.begin(), heap.end(), later);
  }
  return most;
}

}  // namespace

void split_tail(const PlanShape& shape, Plan& plan) {
  if (!tail_applies(shape, plan)) return;
  const PlanConfig& config = plan.config;
  const int32_t workers = config.num_workers;
  const int32_t group = shape.num_qo_heads / shape.num_kv_heads;
  const MaskSpec mask = mask_of(shape.options);
  const auto cost_of = [&](const WorkItem& item) {
    return work_item_cost(item, mask, shape.q_lens[item.request], shape.kv_lens[item.request],
                          group);
  };
  // Each worker's load and its last item's cost.
  std::vector<double> load(static_cast<size_t>(workers), 0.0);
  std::vector<double> last_cost(static_cast<size_t>(workers), 0.0);
  for (int32_t w = 0; w < workers; ++w) {
    for (int32_t i = plan.worker_indptr[w]; i < plan.worker_indptr[w + 1]; ++i) {
      last_cost[w] = cost_of(plan.work[i]);
      load[w] += last_cost[w];
    }
  }
  const double busiest = *std::max_element(load.begin(), load.end());
  const double idlest = *std::min_element(load.begin(), load.end());
  // Whatever the cut, the busiest worker carries at least the mean load (pieces only add).
  double sum = 0;
  for (const double l : load) sum += l;
  const double goal = busiest * (1.0 - kTailMinGain);
  if (!(sum / workers < goal)) return;
  // The busiest workers' last items: whole, long enough for two pieces, and ending more than
  // half of themselves after the idlest worker is done.
  std::vector<TailCut> cuts;
  std::vector<double> rest = load;  // loads without the cut items
  for (int32_t w = 0; w < workers; ++w) {
    if (plan.worker_indptr[w + 1] == plan.worker_indptr[w]) continue;
    const WorkItem& last = plan.work[plan.worker_indptr[w + 1] - 1];
    const int32_t range = last.kv_end - last.kv_start;
    // (Two pieces at the coarsest cut: the 64-key rounding can make one chunk the whole range.)
    if (last.merge_index >= 0 || range < 2 * config.min_kv_chunk ||
        ceil_div(range, tail_chunk(range, 2, config.min_kv_chunk)) < 2 ||
        !(load[w] - last_cost[w] / 2 > idlest)) {
      continue;
    }
    cuts.push_back({w, last_cost[w], range});
    rest[w] -= last_cost[w];
  }
  if (cuts.empty()) return;
  const double overhead = tail_piece_overhead(config);
  // Choosing m: each item's pieces costed as equal shares of its pair and key terms (exact for
  // unmasked items up to the last piece's rounding). When the cut items are alike and the
  // rest loads equal (a uniform batch), the busiest load is the rest plus ceil(n / workers)
  // pieces; otherwise the pieces are placed.
  bool alike = true;
  for (const TailCut& cut : cuts) {
    alike = alike && cut.cost == cuts[0].cost && cut.range == cuts[0].range;
  }
  const double rest_high = *std::max_element(rest.begin(), rest.end());
  alike = alike && rest_high == *std::min_element(rest.begin(), rest.end());
  std::vector<double> shares;
  int32_t best_m = 0;
  double best_makespan = goal;
  for (int32_t m = 2; m <= kTailMaxPieces; ++m) {
    double makespan = 0;
    if (alike) {
      const int32_t count = ceil_div(cuts[0].range, tail_chunk(cuts[0].range, m,
                                                                config.min_kv_chunk));
      const double share = (cuts[0].cost - kCostPerItem) / count + kCostPerItem + overhead;
      const int64_t n = int64_t{count} * static_cast<int64_t>(cuts.size());
      makespan = rest_high + static_cast<double>((n + workers - 1) / workers) * share;
    } else {
      shares.clear();
      for (const TailCut& cut : cuts) {
        const int32_t count =
            ceil_div(cut.range, tail_chunk(cut.range, m, config.min_kv_chunk));
        const double share = (cut.cost - kCostPerItem) / count + kCostPerItem;
        shares.insert(shares.end(), static_cast<size_t>(count), share);
      }
      std::sort(shares.begin(), shares.end(), std::greater<double>());
      makespan = place_tail_pieces(rest, shares, overhead, nullptr);
    }
    if (makespan < best_makespan) {
      best_makespan = makespan;
      best_m = m;
    }
  }
  if (best_m == 0) return;

  // The pieces of best_m with their exact costs, placed; kept if they still gain enough.
  struct TailPiece {
    WorkItem item;
    int32_t cut = 0;
    double cost = 0;
  };
  std::vector<TailPiece> pieces;
  std::vector<int32_t> counts(cuts.size());
  std::vector<int64_t> first_row(cuts.size());
  const int32_t first_merge = static_cast<int32_t>(plan.merges.size());
  int64_t rows_total = plan.num_partial_rows;
  for (size_t c = 0; c < cuts.size(); ++c) {
    const WorkItem& whole = plan.work[plan.worker_indptr[cuts[c].worker + 1] - 1];
    const int32_t chunk = tail_chunk(cuts[c].range, best_m, config.min_kv_chunk);
    counts[c] = ceil_div(cuts[c].range, chunk);
    first_row[c] = rows_total;
    const int32_t rows = whole.q_len * group;
    for (int32_t p = 0; p < counts[c]; ++p) {
      TailPiece piece;
      piece.item = whole;
      piece.item.kv_start = static_cast<int32_t>(whole.kv_start + int64_t{p} * chunk);
      piece.item.kv_end = static_cast<int32_t>(
          std::min<int64_t>(whole.kv_end, int64_t{piece.item.kv_start} + chunk));
      // (Beyond INT32_MAX only when the plan is given up below.)
      piece.item.partial_row = static_cast<int32_t>(
          std::min<int64_t>(rows_total + int64_t{p} * rows, INT32_MAX));
      piece.item.merge_index = first_merge + static_cast<int32_t>(c);
      piece.cut = static_cast<int32_t>(c);
      piece.cost = cost_of(piece.item);
      pieces.push_back(piece);
    }
    rows_total += int64_t{rows} * counts[c];
  }
  const int64_t work_total = static_cast<int64_t>(plan.work.size()) -
                             static_cast<int64_t>(cuts.size()) +
                             static_cast<int64_t>(pieces.size());
  const int64_t merges_total = first_merge + static_cast<int64_t>(cuts.size());
  if (rows_total > INT32_MAX) return;
  if (plan.capacity.fixed() &&
      (work_total > plan.capacity.max_work_items || merges_total > plan.capacity.max_merges ||
       rows_total > plan.capacity.max_partial_rows)) {
    return;
  }
  // Longest first; ties in (cut, piece) order.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const TailPiece& a, const TailPiece& b) { return a.cost > b.cost; });
  std::vector<double> costs(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) costs[i] = pieces[i].cost;
  std::vector<int32_t> owner;
  if (!(place_tail_pieces(rest, costs, overhead, &owner) < goal)) return;

  // Merges in cut order, their partial rows as the pieces were numbered.
  for (size_t c = 0; c < cuts.size(); ++c) {
    const WorkItem& whole = plan.work[plan.worker_indptr[cuts[c].worker + 1] - 1];
    plan.merges.push_back({whole.request, whole.kv_head, whole.q_start, whole.q_len,
                           static_cast<int32_t>(first_row[c]), counts[c]});
  }
  plan.num_partial_rows = rows_total;
  // New lists: each worker's items less its cut last one, then its pieces in placement order.
  std::vector<int32_t> added(static_cast<size_t>(workers) + 1, 0);  // pieces per worker
  for (const int32_t w : owner) ++added[w + 1];
  std::vector<bool> is_cut(static_cast<size_t>(workers), false);
  for (const TailCut& cut : cuts) is_cut[cut.worker] = true;
  std::vector<int32_t> indptr(static_cast<size_t>(workers) + 1, 0);
  std::vector<WorkItem> work(static_cast<size_t>(work_total));
  std::vector<int32_t> next(static_cast<size_t>(workers));  // each worker's first piece slot
  for (int32_t w = 0; w < workers; ++w) {
    const int32_t kept = plan.worker_indptr[w + 1] - plan.worker_indptr[w] - (is_cut[w] ? 1 : 0);
    std::copy_n(plan.work.begin() + plan.worker_indptr[w], kept, work.begin() + indptr[w]);
    next[w] = indptr[w] + kept;
    indptr[w + 1] = next[w] + added[w + 1];
  }
  std::vector<double> final_load = rest;
  for (size_t i = 0; i < pieces.size(); ++i) {
    work[next[owner[i]]++] = pieces[i].item;
    final_load[owner[i]] += pieces[i].cost;
  }
  plan.work = std::move(work);
  plan.worker_indptr = std::move(indptr);
  plan.max_worker_cost = *std::max_element(final_load.begin(), final_load.end());
  plan.workspace_bytes = WorkspaceLayout::of(plan).total;
}

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

Plan make_plan(const PlanShape& shape, const PlanConfig& requested_config) {
  const ArgChecker check(std::string("plan_") + op_name(shape.op));
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
  const int32_t heads = shape.num_kv_heads;

  // 1. Query tiles, each with the key range its rows can see. The num_kv_heads tiles of one
  //    (request, q tile) cost the same, so everything below works per query tile and expands
  //    to the kv heads only when scheduling.
  PlannerScratch& scratch = planner_scratch();
  std::vector<QueryTile>& tiles = scratch.tiles;
  tiles.clear();
  CostSum total;  // over all items, tile by tile and kv head by kv head
  {
    int64_t count = 0;
    for (int32_t q_len : shape.q_lens) count += (q_len + tokens_per_tile - 1) / tokens_per_tile;
    tiles.reserve(static_cast<size_t>(count));
  }
  for (int32_t b = 0; b < plan.batch_size; ++b) {
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
  const double total_cost = total.value();

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
  //    result (tests/test_planner.cpp compares it with a direct implementation): a policy
  //    whose cuts equal an earlier policy's (the usual case: no tile exceeds any target) is
  //    skipped, as is one whose lower bound on the busiest worker (its largest piece, its mean
  //    load) already loses to the best so far, and a schedule stops as soon as a worker carries
  //    more than the best so far; only costs are scheduled while searching, the work items are
  //    built once for the winner.
  const double fair_share = total_cost / config.num_workers;
  const SplitPolicy policies[] = {{fair_share, true},
                                  {fair_share, false},
                                  {fair_share / 2, false},
                                  {fair_share / kSmallestTargetDivisor, false}};
  int num_policies = !config.split_kv || config.deterministic ? 1 : 4;
  if (num_policies > 1) {
    // No tile that may be split costs more than the smallest target: every policy leaves
    // every tile whole (split_chunk), so the others would be skipped as duplicates.
    double largest_splittable = 0;
    for (const QueryTile& tile : tiles) {
      if (tile.kv_end - tile.kv_start > config.min_kv_chunk) {
        largest_splittable = std::max(largest_splittable, tile.cost);
      }
    }
    if (!(largest_splittable > policies[num_policies - 1].target)) num_policies = 1;
  }
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

  // The winner's work items: merges and partial rows in (request, q tile, kv head) order,
  // items grouped by worker, each worker's items in the schedule's order (longest first, or
  // section by section: step 4).
  const std::vector<int32_t>& best_chunks = *best->chunks;
  std::vector<int32_t>& first_merge = scratch.first_merge;
  std::vector<int32_t>& pieces_of = scratch.pieces_of;
  std::vector<int64_t>& first_partial_row = scratch.first_partial_row;
  first_merge.resize(tiles.size());
  pieces_of.resize(tiles.size());
  first_partial_row.resize(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    const QueryTile& tile = tiles[i];
    pieces_of[i] = piece_count(tile, best_chunks[i], config.deterministic);
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
  // Step 4: the sectioned schedule of the winner's pieces, when it balances about as well.
  Sections& sections = scratch.sections;
  std::vector<int32_t>& section_owner = scratch.section_owner;
  double makespan = best->makespan;
  bool sectioned = false;
  if (shape.op != AttentionOp::kDecode &&
      make_sections(shape, tiles, best->pieces, heads, section_bytes(), sections)) {
    section_owner.resize(best->owner.size());
    const LptGeometry g =
        lpt_geometry(config.num_workers, sections.chunk_heads, best->item_cost);
    const double sectioned_makespan =
        g.fits64 ? schedule_sections_with(sections, g, scratch.lpt64, section_owner)
                 : schedule_sections_with(sections, g, scratch.lpt128, section_owner);
    if (sectioned_makespan <= best->makespan * (1.0 + kSectionMakespanSlack)) {
      sectioned = true;
      makespan = sectioned_makespan;
    }
  }
  const std::vector<int32_t>& owner = sectioned ? section_owner : best->owner;
  plan.worker_indptr.assign(config.num_workers + 1, 0);
  for (int32_t worker : owner) ++plan.worker_indptr[worker + 1];
  for (int32_t w = 0; w < config.num_workers; ++w) {
    plan.worker_indptr[w + 1] += plan.worker_indptr[w];
  }
  std::vector<int32_t>& cursor = scratch.cursor;
  cursor.assign(plan.worker_indptr.begin(), plan.worker_indptr.end() - 1);
  plan.work.resize(owner.size());
  WorkItem* const work = plan.work.data();
  int32_t* const next_slot = cursor.data();
  const int32_t* worker_of_item = owner.data();
  const std::vector<Piece>& pieces = best->pieces;
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
    for_each_section_item(sections, [&](const Piece& piece, int32_t h) {
      work[next_slot[*worker_of_item++]++] = piece_item(piece.tile, piece, h);
    });
  } else {
    // Items in the schedule's order (see item order above), one run of a tile's equal-cost
    // pieces at a time, each to the next free slot of its worker.
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
  plan.total_cost = total_cost;
  plan.max_worker_cost = makespan;  // the busiest worker's load
  split_tail(shape, plan);  // step 5 (off by default)
  scratch.trim();
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
