// The planner's schedules (see planner.hpp): the pieces' order, step 3 (LPT onto the
// least-loaded worker) and step 4 (L2 sections of prefill plans).
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/planner_internal.hpp"

namespace tessera::detail::planner_internal {

namespace {

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

}  // namespace

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

namespace {

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
  Key largest_ = 0;   // the largest key: the busiest worker
  int32_t idle_ = 0;  // workers idle_.. have had no item yet
};

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

}  // namespace

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
//    and a chunk of their kv heads whose K and V together take at most the section budget
//    (settings().plan_section_bytes, TESSERA_PLAN_L2_MB, default 16 MiB; 16-bit elements
//    assumed), LPT within each section from the loads the sections before it left, sections
//    with the longest items first. The workers then sweep the sections together and read each
//    section's K/V from DRAM about once (FlashAttention-3 orders its tiles in head sections for
//    the same reason). Kept only when its busiest worker carries at most kSectionMakespanSlack
//    (planner_internal.hpp) more than plain LPT's; decode items each read their own K/V and keep
//    plain LPT. TESSERA_PLAN_L2_MB=0 turns sections off (plain LPT, for timing).
constexpr int64_t kSectionElementBytes = 2;  // K/V element size assumed (fp16 / bf16)

// Fills `sec` for the shape (false: one section would hold everything, nothing to do).
bool make_sections(const PlanShape& shape, const std::vector<QueryTile>& tiles,
                   const std::vector<Piece>& sorted_pieces, int32_t heads, int64_t budget,
                   Sections& sec) {
  if (budget <= 0) return false;
  const int32_t head_dim_v =
      shape.options.head_dim_vo > 0 ? shape.options.head_dim_vo : shape.head_dim;
  const int64_t per_key = kSectionElementBytes * (shape.head_dim + head_dim_v);  // K and V
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

double schedule_sections(const Sections& sec, int32_t workers, const CostSum& total,
                         PlannerScratch& scratch, std::vector<int32_t>& owner) {
  const LptGeometry g = lpt_geometry(workers, sec.chunk_heads, total);
  return g.fits64 ? schedule_sections_with(sec, g, scratch.lpt64, owner)
                  : schedule_sections_with(sec, g, scratch.lpt128, owner);
}

}  // namespace tessera::detail::planner_internal
