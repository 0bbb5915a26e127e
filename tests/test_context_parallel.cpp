// Context parallelism on the CPU: the zigzag sharding and ring schedule (coverage of every
// visible (query, key) pair exactly once, no fully masked block, balance), the K/V exchange cost
// model, and N = 1..8 simulated ranks in one process running the same plan and the same step
// functions as the NCCL driver, with the communication done by copies between the ranks'
// workspaces, against the single-device CPU reference. Also decode over KV shards and the NCCL
// loader's errors (no NCCL and no GPU are needed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/scoped_env.hpp"
#include "core/half.hpp"
#include "tessera/backend.hpp"
#include "tessera/context_parallel.hpp"

namespace tessera {
namespace {

uint64_t test_seed() {
  const char* env = std::getenv("TESSERA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : 20240808;
}

// Host bytes of a contiguous [rows, heads, head_dim] tensor (or [rows, heads] for float lse).
struct Tensor {
  Tensor() = default;
  Tensor(DType dtype, int64_t rows, int64_t heads, int64_t dim)
      : dtype(dtype), rows(rows), heads(heads), dim(dim),
        bytes(static_cast<size_t>(rows * heads * std::max<int64_t>(dim, 1)) * dtype_size(dtype) +
              1) {}
  int64_t row_elements() const { return heads * std::max<int64_t>(dim, 1); }
  float get(int64_t i) const { return detail::load_as_float(bytes.data(), dtype, i); }
  void set(int64_t i, float value) { detail::store_from_float(bytes.data(), dtype, i, value); }
  char* row(int64_t r) {
    return reinterpret_cast<char*>(bytes.data()) +
           static_cast<size_t>(r * row_elements()) * dtype_size(dtype);
  }
  size_t row_bytes() const { return static_cast<size_t>(row_elements()) * dtype_size(dtype); }
  TensorView view() {
    return dim == 0 ? make_view(bytes.data(), dtype, {rows, heads})
                    : make_view(bytes.data(), dtype, {rows, heads, dim});
  }
  void fill_normal(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < rows * row_elements(); ++i) set(i, normal(rng));
  }

  DType dtype = DType::kFloat32;
  int64_t rows = 0, heads = 0, dim = 0;
  std::vector<unsigned char> bytes;
};

// 256-byte aligned host workspace.
struct HostWorkspace {
  explicit HostWorkspace(size_t bytes) : storage(bytes + 256) {}
  Workspace get() {
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    return {storage.data() + ((256 - address % 256) % 256), storage.size() - 256};
  }
  std::vector<unsigned char> storage;
};

struct Error2 {
  double rel_l2 = 0, lse_max_abs = 0;
  int64_t non_finite = 0;
};

Error2 compare(const Tensor& o, const Tensor& o_ref, const Tensor& lse, const Tensor& lse_ref) {
  Error2 e;
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < o.rows * o.row_elements(); ++i) {
    const double a = o.get(i), b = o_ref.get(i);
    if (!std::isfinite(a)) ++e.non_finite;
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  e.rel_l2 = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  for (int64_t i = 0; i < lse.rows * lse.heads; ++i) {
    const double a = lse.get(i), b = lse_ref.get(i);
    if (std::isnan(a) || std::isinf(a) != std::isinf(b)) {
      ++e.non_finite;  // NaN, or -inf (no key seen) on one side only
    } else if (!std::isinf(b)) {
      e.lse_max_abs = std::max(e.lse_max_abs, std::abs(a - b));
    }
  }
  return e;
}

// The single-device answer: the double-precision CPU reference over the whole sequence.
void reference_prefill(Tensor& q, Tensor& k, Tensor& v, bool causal, Tensor& o, Tensor& lse) {
  const int32_t n = static_cast<int32_t>(q.rows);
  std::vector<int32_t> indptr = {0, n};
  AttentionOptions options;
  options.causal = causal;
  set_cpu_impl(CpuImpl::kReference);
  ragged_prefill(q.view(), k.view(), v.view(), make_view(indptr.data(), DType::kInt32, {2}),
                 make_view(indptr.data(), DType::kInt32, {2}), o.view(), lse.view(), options);
  set_cpu_impl(CpuImpl::kFast);
}

// ============================================================================ sharding

TEST(ZigzagSharding, ChunksPartitionTheSequenceEvenly) {
  for (int32_t n = 1; n <= 8; ++n) {
    for (int64_t len : {0, 1, 2, 7, 15, 16, 17, 100, 129, 1000}) {
      const ZigzagSharding s = make_zigzag_sharding(len, n);
      int64_t total = 0, shortest = len, longest = 0;
      for (int32_t c = 0; c < s.num_chunks(); ++c) {
        EXPECT_EQ(s.chunk_begin(c), total);
        total += s.chunk_length(c);
        shortest = std::min(shortest, s.chunk_length(c));
        longest = std::max(longest, s.chunk_length(c));
        EXPECT_EQ(s.owner(c), c < n ? c : 2 * n - 1 - c);
      }
      EXPECT_EQ(total, len);
      EXPECT_LE(longest - shortest, 1) << "n " << n << " len " << len;
      // Local rows map one-to-one onto the sequence.
      std::vector<int> seen(static_cast<size_t>(len), 0);
      int64_t rows = 0;
      for (int32_t r = 0; r < n; ++r) {
        rows += s.rank_length(r);
        EXPECT_EQ(s.rank_length(r), s.chunk_length(r) + s.chunk_length(2 * n - 1 - r));
        for (int64_t i = 0; i < s.rank_length(r); ++i) ++seen[s.global_position(r, i)];
        // Rows of a rank are in position order (the schedule relies on it).
        for (int64_t i = 1; i < s.rank_length(r); ++i) {
          EXPECT_LT(s.global_position(r, i - 1), s.global_position(r, i));
        }
      }
      EXPECT_EQ(rows, len);
      EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    }
  }
  EXPECT_THROW(make_zigzag_sharding(10, 0), Error);
  EXPECT_THROW(make_zigzag_sharding(-1, 2), Error);
}

TEST(ZigzagSharding, ChunkPairClassification) {
  EXPECT_EQ(classify_chunk_pair(3, 1, true), BlockVisibility::kFull);
  EXPECT_EQ(classify_chunk_pair(3, 3, true), BlockVisibility::kDiagonal);
  EXPECT_EQ(classify_chunk_pair(3, 4, true), BlockVisibility::kMasked);
  EXPECT_EQ(classify_chunk_pair(3, 4, false), BlockVisibility::kFull);
  EXPECT_EQ(classify_chunk_pair(3, 3, false), BlockVisibility::kFull);
}

// ============================================================================ schedule

ContextParallelPlan cpu_plan(int64_t len, int n, int rank, bool causal,
                             KVExchange exchange = KVExchange::kRing, int hq = 2, int hkv = 1,
                             int dim = 64, DType dtype = DType::kBFloat16) {
  AttentionOptions options;
  options.causal = causal;
  return plan_context_parallel_prefill(len, n, rank, hq, hkv, dim, dtype, options, Device{},
                                       exchange);
}

// Marks every (query, key) pair each block computes, in global positions, and checks the
// schedule's invariants along the way.
TEST(ContextParallelSchedule, EveryVisiblePairExactlyOnceAndNoMaskedBlock) {
  for (bool causal : {true, false}) {
    for (int32_t n = 1; n <= 8; ++n) {
      for (int64_t len : {1, 3, 2 * n - 1, 2 * n, 2 * n + 1, 37, 64, 101}) {
        SCOPED_TRACE(testing::Message() << "causal " << causal << " n " << n << " len " << len);
        std::vector<int> covered(static_cast<size_t>(len * len), 0);
        for (int32_t rank = 0; rank < n; ++rank) {
          const ContextParallelPlan plan = cpu_plan(len, n, rank, causal);
          const ZigzagSharding& s = plan.sharding;
          ASSERT_EQ(plan.step_indptr.size(), static_cast<size_t>(n) + 1);
          ASSERT_EQ(plan.block_plans.size(), plan.blocks.size());
          std::vector<int> state_writes(static_cast<size_t>(plan.num_states), 0);
          for (size_t b = 0; b < plan.blocks.size(); ++b) {
            const ContextParallelBlock& block = plan.blocks[b];
            EXPECT_GE(static_cast<int32_t>(b), plan.step_indptr[block.step]);
            EXPECT_LT(static_cast<int32_t>(b), plan.step_indptr[block.step + 1]);
            EXPECT_EQ(block.source_rank, plan.source_rank(block.step));
            ASSERT_LT(block.q_begin, block.q_end);
            ASSERT_LT(block.kv_begin, block.kv_end);
            EXPECT_LE(block.kv_end, s.rank_length(block.source_rank));
            EXPECT_TRUE(!block.causal || causal);
            const int64_t q_len = block.q_end - block.q_begin;
            const int64_t kv_len = block.kv_end - block.kv_begin;
            int64_t pairs = 0;
            for (int64_t i = 0; i < q_len; ++i) {
              const int64_t qpos = s.global_position(rank, block.q_begin + i);
              for (int64_t j = 0; j < kv_len; ++j) {
                // The block's own mask (bottom-right aligned when causal).
                if (block.causal && j > i + kv_len - q_len) continue;
                const int64_t kpos = s.global_position(block.source_rank, block.kv_begin + j);
                EXPECT_TRUE(!causal || kpos <= qpos) << "block computes a masked pair";
                ++covered[static_cast<size_t>(qpos * len + kpos)];
                ++pairs;
              }
              const int64_t state = block.state_begin + i * block.state_stride;
              ASSERT_LT(state, plan.num_states);
              ++state_writes[static_cast<size_t>(state)];
              // The state belongs to this row's merge range.
              const int64_t row = block.q_begin + i;
              EXPECT_GE(state, plan.merge_indptr[row]);
              EXPECT_LT(state, plan.merge_indptr[row + 1]);
            }
            EXPECT_EQ(pairs, block.visible_pairs);
            // No fully masked block: and no block containing a fully masked chunk pair.
            EXPECT_GT(pairs, 0);
            for (int64_t i : {int64_t{0}, q_len - 1}) {
              const int32_t q_chunk = [&] {
                const int64_t p = s.global_position(rank, block.q_begin + i);
                for (int32_t c = 0;; ++c) {
                  if (p < s.chunk_begin(c + 1)) return c;
                }
              }();
              for (int64_t j : {int64_t{0}, kv_len - 1}) {
                const int64_t p = s.global_position(block.source_rank, block.kv_begin + j);
                int32_t kv_chunk = 0;
                while (p >= s.chunk_begin(kv_chunk + 1)) ++kv_chunk;
                EXPECT_NE(classify_chunk_pair(q_chunk, kv_chunk, causal),
                          BlockVisibility::kMasked);
              }
            }
          }
          // Every partial state is written exactly once.
          for (int w : state_writes) EXPECT_EQ(w, 1);
          EXPECT_EQ(plan.merge_indptr.back(), plan.num_states);
        }
        for (int64_t qpos = 0; qpos < len; ++qpos) {
          for (int64_t kpos = 0; kpos < len; ++kpos) {
            const int expected = (!causal || kpos <= qpos) ? 1 : 0;
            ASSERT_EQ(covered[static_cast<size_t>(qpos * len + kpos)], expected)
                << "query " << qpos << " key " << kpos;
          }
        }
      }
    }
  }
}

// Causal work per rank and per ring step. Stated bound: with seq_len a multiple of 2N every rank
// does exactly the same work in every step; otherwise chunks differ by one token, the spread
// (max - min) of a step is at most 4 * ceil(seq_len / 2N) + 4 pairs (four query rows of one
// chunk's keys, against ~2 * (seq_len / 2N)^2 pairs per step) and over the whole prefill at most
// 2 * seq_len pairs (two query rows of the full sequence).
TEST(ContextParallelSchedule, CausalWorkIsBalanced) {
  for (int32_t n = 2; n <= 8; ++n) {
    for (int64_t len : {int64_t{2} * n * 5, int64_t{2} * n * 64, int64_t{2} * n * 64 + 1,
                        int64_t{2} * n * 64 + n, int64_t{2} * n * 64 + 2 * n - 1, int64_t{999},
                        int64_t{4097}}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " len " << len);
      std::vector<int64_t> total(static_cast<size_t>(n), 0);
      std::vector<std::vector<int64_t>> step(static_cast<size_t>(n),
                                             std::vector<int64_t>(static_cast<size_t>(n), 0));
      for (int32_t rank = 0; rank < n; ++rank) {
        for (const ContextParallelBlock& b : cpu_plan(len, n, rank, true).blocks) {
          total[rank] += b.visible_pairs;
          step[b.step][rank] += b.visible_pairs;
        }
      }
      const bool even = len % (2 * n) == 0;
      const int64_t chunk = (len + 2 * n - 1) / (2 * n);
      const auto spread = [](const std::vector<int64_t>& v) {
        return *std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end());
      };
      EXPECT_LE(spread(total), even ? 0 : 2 * len);
      for (int32_t t = 0; t < n; ++t) EXPECT_LE(spread(step[t]), even ? 0 : 4 * chunk + 4);
      int64_t sum = 0;
      for (int64_t w : total) sum += w;
      EXPECT_EQ(sum, len * (len + 1) / 2);  // all causal pairs, none twice
    }
  }
}

TEST(ContextParallelSchedule, NonCausalJoinsBothChunksIntoOneCall) {
  const ContextParallelPlan plan = cpu_plan(100, 4, 1, false);
  EXPECT_EQ(plan.blocks.size(), 4u);  // one call per step
  for (const ContextParallelBlock& b : plan.blocks) {
    EXPECT_EQ(b.q_begin, 0);
    EXPECT_EQ(b.q_end, plan.local_rows());
    EXPECT_FALSE(b.causal);
  }
  // Causal, rank 0: step 0 = two diagonal blocks, later steps only the high chunk.
  const ContextParallelPlan causal = cpu_plan(100, 4, 0, true);
  EXPECT_TRUE(causal.blocks[0].causal);
  EXPECT_EQ(causal.num_states, 12 * 1 + 13 * 4);  // chunks of 12 and 13 rows: 1 and 4 states
}

TEST(ContextParallelSchedule, RejectsBadArguments) {
  AttentionOptions window;
  window.window_left = 16;
  try {
    plan_context_parallel_prefill(100, 2, 0, 4, 2, 64, DType::kBFloat16, window);
    FAIL() << "a sliding window must be rejected";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("window"), std::string::npos);
  }
  EXPECT_THROW(plan_context_parallel_prefill(100, 2, 2, 4, 2, 64, DType::kBFloat16, {}), Error);
  EXPECT_THROW(plan_context_parallel_prefill(100, 2, 0, 4, 3, 64, DType::kBFloat16, {}), Error);
  EXPECT_THROW(plan_context_parallel_prefill(100, 2, 0, 4, 2, 64, DType::kInt32, {}), Error);
}

// ============================================================================ cost model

TEST(ContextParallelCostModel, LongCausalPrefillRingsShortOneGathers) {
  // 128k tokens, Llama-70B-like heads: a step's attention (ms) dwarfs its shard's transfer.
  const KVExchangeEstimate long_run = estimate_kv_exchange(make_zigzag_sharding(131072, 8), 64,
                                                           8, 128, DType::kBFloat16, true);
  EXPECT_EQ(long_run.choice, KVExchange::kRing);
  EXPECT_NEAR(long_run.ring_us, long_run.compute_us, 1e-6 * long_run.compute_us);
  // 512 tokens over 8 ranks: per-step latency dominates, one collective is cheaper.
  const KVExchangeEstimate short_run =
      estimate_kv_exchange(make_zigzag_sharding(512, 8), 8, 8, 128, DType::kBFloat16, true);
  EXPECT_EQ(short_run.choice, KVExchange::kAllGather);
  EXPECT_LT(short_run.all_gather_us, short_run.ring_us);
  // One rank: nothing to exchange.
  const KVExchangeEstimate one =
      estimate_kv_exchange(make_zigzag_sharding(4096, 1), 8, 8, 128, DType::kBFloat16, true);
  EXPECT_EQ(one.ring_us, one.compute_us);
  EXPECT_EQ(one.all_gather_us, one.compute_us);
  // kAuto follows the model, an explicit choice wins, and the workspace follows the choice.
  AttentionOptions causal;
  causal.causal = true;
  const auto plan = [&](KVExchange e) {
    return plan_context_parallel_prefill(512, 8, 3, 8, 8, 128, DType::kBFloat16, causal, {}, e);
  };
  EXPECT_EQ(plan(KVExchange::kAuto).exchange, KVExchange::kAllGather);
  EXPECT_EQ(plan(KVExchange::kRing).exchange, KVExchange::kRing);
  EXPECT_EQ(plan(KVExchange::kRing).num_kv_slots, 2);
  EXPECT_EQ(plan(KVExchange::kAllGather).num_kv_slots, 8);
  EXPECT_FALSE(plan(KVExchange::kAuto).explain().empty());
}

// ============================================================================ CPU simulation

struct SimCase {
  int32_t world = 1;
  int64_t len = 0;
  int32_t hq = 4, hkv = 2, dim = 64;
  DType dtype = DType::kBFloat16;
  bool causal = true;
  KVExchange exchange = KVExchange::kRing;
};

// N ranks in lockstep. Each rank owns its shard and workspace; the communication is a copy of
// whole K/V slots between workspaces, as NCCL would move them (ring: rank r-1's current slot into
// rank r's next slot; all-gather: every rank's own slot into the same slot of every other rank).
void simulate_prefill(const SimCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(testing::Message() << "world " << c.world << " len " << c.len << " hq " << c.hq
                                  << " hkv " << c.hkv << " dim " << c.dim << " "
                                  << dtype_name(c.dtype) << (c.causal ? " causal" : " full") << " "
                                  << kv_exchange_name(c.exchange));
  Tensor q(c.dtype, c.len, c.hq, c.dim), k(c.dtype, c.len, c.hkv, c.dim),
      v(c.dtype, c.len, c.hkv, c.dim);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  Tensor o_ref(c.dtype, c.len, c.hq, c.dim), lse_ref(DType::kFloat32, c.len, c.hq, 0);
  reference_prefill(q, k, v, c.causal, o_ref, lse_ref);

  AttentionOptions options;
  options.causal = c.causal;
  struct Rank {
    ContextParallelPlan plan;
    Tensor q, k, v, o, lse;
    HostWorkspace workspace{0};
  };
  std::vector<Rank> ranks(static_cast<size_t>(c.world));
  for (int32_t r = 0; r < c.world; ++r) {
    Rank& rank = ranks[r];
    rank.plan = plan_context_parallel_prefill(c.len, c.world, r, c.hq, c.hkv, c.dim, c.dtype,
                                              options, Device{}, c.exchange);
    const int64_t rows = rank.plan.local_rows();
    rank.q = Tensor(c.dtype, rows, c.hq, c.dim);
    rank.k = Tensor(c.dtype, rows, c.hkv, c.dim);
    rank.v = Tensor(c.dtype, rows, c.hkv, c.dim);
    rank.o = Tensor(c.dtype, rows, c.hq, c.dim);
    rank.lse = Tensor(DType::kFloat32, rows, c.hq, 0);
    std::fill(rank.o.bytes.begin(), rank.o.bytes.end(), 0xff);  // NaN: unwritten rows show
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t p = rank.plan.sharding.global_position(r, i);
      std::memcpy(rank.q.row(i), q.row(p), q.row_bytes());
      std::memcpy(rank.k.row(i), k.row(p), k.row_bytes());
      std::memcpy(rank.v.row(i), v.row(p), v.row_bytes());
    }
    rank.workspace = HostWorkspace(rank.plan.workspace_bytes);
    std::fill(rank.workspace.storage.begin(), rank.workspace.storage.end(), 0xff);
    const Workspace ws = rank.workspace.get();
    prepare_context_parallel_workspace(rank.plan, ws);
    // Pack the local shard into its slot, as the GPU driver does.
    const int32_t own = c.exchange == KVExchange::kRing ? 0 : r;
    if (rows > 0) {
      std::memcpy(context_parallel_kv_slot(rank.plan, ws, own, false).data, rank.k.row(0),
                  rows * k.row_bytes());
      std::memcpy(context_parallel_kv_slot(rank.plan, ws, own, true).data, rank.v.row(0),
                  rows * v.row_bytes());
    }
  }
  const size_t slot_bytes = ranks[0].plan.kv_slot_bytes;
  const auto slot_data = [&](int32_t r, int32_t slot) {
    return context_parallel_kv_slot(ranks[r].plan, ranks[r].workspace.get(), slot, false).data;
  };
  if (c.exchange == KVExchange::kAllGather) {
    for (int32_t src = 0; src < c.world; ++src) {
      for (int32_t dst = 0; dst < c.world; ++dst) {
        if (dst != src) std::memcpy(slot_data(dst, src), slot_data(src, src), slot_bytes);
      }
    }
  }
  for (int32_t step = 0; step < c.world; ++step) {
    if (c.exchange == KVExchange::kRing && step + 1 < c.world) {
      for (int32_t r = 0; r < c.world; ++r) {  // send to r + 1 == receive from r - 1
        std::memcpy(slot_data(r, (step + 1) % 2), slot_data((r + c.world - 1) % c.world, step % 2),
                    slot_bytes);
      }
    }
    for (int32_t r = 0; r < c.world; ++r) {
      Rank& rank = ranks[r];
      const int32_t slot = c.exchange == KVExchange::kRing ? step % 2 : rank.plan.source_rank(step);
      const Workspace ws = rank.workspace.get();
      run_context_parallel_step(rank.plan, step, rank.q.view(),
                                context_parallel_kv_slot(rank.plan, ws, slot, false),
                                context_parallel_kv_slot(rank.plan, ws, slot, true), ws);
    }
  }
  Tensor o(c.dtype, c.len, c.hq, c.dim), lse(DType::kFloat32, c.len, c.hq, 0);
  for (int32_t r = 0; r < c.world; ++r) {
    Rank& rank = ranks[r];
    merge_context_parallel_states(rank.plan, rank.o.view(), rank.lse.view(), rank.workspace.get());
    for (int64_t i = 0; i < rank.plan.local_rows(); ++i) {
      const int64_t p = rank.plan.sharding.global_position(r, i);
      std::memcpy(o.row(p), rank.o.row(i), o.row_bytes());
      std::memcpy(lse.row(p), rank.lse.row(i), lse.row_bytes());
    }
  }
  const Error2 e = compare(o, o_ref, lse, lse_ref);
  EXPECT_EQ(e.non_finite, 0);
  EXPECT_LT(e.rel_l2, c.dtype == DType::kFloat32 ? 1e-5 : 1e-2);
  EXPECT_LT(e.lse_max_abs, 1e-3);
}

TEST(ContextParallelSimulation, MatchesSingleDeviceReference) {
  std::mt19937_64 rng(test_seed());
  const std::vector<std::pair<int, int>> heads = {{4, 4}, {4, 2}, {8, 2}, {8, 1}};
  int cases = 0;
  for (int32_t world = 1; world <= 8; ++world) {
    for (bool causal : {true, false}) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        SimCase c;
        c.world = world;
        c.causal = causal;
        c.dtype = dtype;
        const auto [hq, hkv] = heads[static_cast<size_t>(cases) % heads.size()];
        c.hq = hq;
        c.hkv = hkv;
        c.dim = cases % 3 == 0 ? 128 : (cases % 3 == 1 ? 64 : 80);
        // Odd lengths, none a multiple of 2N (the uneven chunks are the interesting part).
        c.len = std::uniform_int_distribution<int64_t>(20, 190)(rng) | 1;
        if (c.len % (2 * world) == 0) ++c.len;
        c.exchange = cases % 2 == 0 ? KVExchange::kRing : KVExchange::kAllGather;
        simulate_prefill(c, rng);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 32);
}

TEST(ContextParallelSimulation, ShortSequencesWithEmptyChunksAndFloat32) {
  std::mt19937_64 rng(test_seed() + 1);
  for (int32_t world : {3, 8}) {
    for (int64_t len : {1, 2, 5, 2 * world - 1, 2 * world}) {
      for (KVExchange exchange : {KVExchange::kRing, KVExchange::kAllGather}) {
        SimCase c;
        c.world = world;
        c.len = len;
        c.exchange = exchange;
        c.dtype = len % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
        simulate_prefill(c, rng);
      }
    }
  }
}

TEST(ContextParallelSimulation, LongerSequenceSpansManyTiles) {
  std::mt19937_64 rng(test_seed() + 2);
  SimCase c;
  c.world = 4;
  c.len = 1001;
  c.hq = 8;
  c.hkv = 2;
  c.dim = 64;
  simulate_prefill(c, rng);
}

// ---- decode: KV shards, local decode, the all-gather as copies, merge ----

void simulate_decode(int32_t world, int32_t q_per_request, bool causal, DType dtype,
                     std::mt19937_64& rng) {
  SCOPED_TRACE(testing::Message() << "decode world " << world << " q/request " << q_per_request
                                  << (causal ? " causal " : " ") << dtype_name(dtype));
  const int32_t batch = std::uniform_int_distribution<int32_t>(1, 4)(rng);
  const int32_t hq = 8, hkv = 2, dim = 64, page = 16;
  std::vector<int32_t> kv_lens(static_cast<size_t>(batch));
  for (int32_t& len : kv_lens) len = std::uniform_int_distribution<int32_t>(0, 300)(rng);
  kv_lens[0] = std::max(kv_lens[0], 1);
  std::vector<int32_t> kv_indptr = {0}, qo_indptr = {0};
  for (int32_t len : kv_lens) {
    kv_indptr.push_back(kv_indptr.back() + len);
    qo_indptr.push_back(qo_indptr.back() + q_per_request);
  }
  const int64_t rows = int64_t{batch} * q_per_request;
  Tensor q(dtype, rows, hq, dim), k(dtype, kv_indptr.back(), hkv, dim),
      v(dtype, kv_indptr.back(), hkv, dim);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  Tensor o_ref(dtype, rows, hq, dim), lse_ref(DType::kFloat32, rows, hq, 0);
  AttentionOptions options;
  options.causal = causal;
  set_cpu_impl(CpuImpl::kReference);
  ragged_prefill(q.view(), k.view(), v.view(),
                 make_view(qo_indptr.data(), DType::kInt32, {batch + 1}),
                 make_view(kv_indptr.data(), DType::kInt32, {batch + 1}), o_ref.view(),
                 lse_ref.view(), options);
  set_cpu_impl(CpuImpl::kFast);

  // Rank r holds keys [cut[b][r], cut[b][r + 1]) of request b: random contiguous cuts.
  struct Rank {
    Tensor k_cache, v_cache;
    std::vector<int32_t> page_indptr = {0}, page_indices, last_page_len;
    Plan plan;
    HostWorkspace workspace{0};
  };
  std::vector<Rank> ranks(static_cast<size_t>(world));
  std::vector<std::vector<int32_t>> pages_of(static_cast<size_t>(world));
  for (int32_t b = 0; b < batch; ++b) {
    std::vector<int32_t> cut = {0, kv_lens[b]};
    for (int32_t r = 1; r < world; ++r) {
      cut.push_back(std::uniform_int_distribution<int32_t>(0, kv_lens[b])(rng));
    }
    std::sort(cut.begin(), cut.end());
    for (int32_t r = 0; r < world; ++r) {
      Rank& rank = ranks[r];
      const int32_t tokens = cut[r + 1] - cut[r];
      const int32_t pages = (tokens + page - 1) / page;
      for (int32_t p = 0; p < pages; ++p) pages_of[r].push_back(kv_indptr[b] + cut[r] + p * page);
      rank.page_indptr.push_back(rank.page_indptr.back() + pages);
      rank.last_page_len.push_back(pages == 0 ? 0 : tokens - (pages - 1) * page);
    }
  }
  Tensor o_first;
  for (int32_t r = 0; r < world; ++r) {
    Rank& rank = ranks[r];
    const int32_t num_pages = rank.page_indptr.back();
    rank.k_cache = Tensor(dtype, int64_t{std::max(num_pages, 1)} * page, hkv, dim);
    rank.v_cache = Tensor(dtype, int64_t{std::max(num_pages, 1)} * page, hkv, dim);
    for (int32_t p = 0; p < num_pages; ++p) {
      rank.page_indices.push_back(p);
      // Token rows of this page (the last page of a request may be partial: copy what exists).
      const int32_t first = pages_of[r][p];
      for (int32_t t = 0; t < page && first + t < k.rows; ++t) {
        std::memcpy(rank.k_cache.row(int64_t{p} * page + t), k.row(first + t), k.row_bytes());
        std::memcpy(rank.v_cache.row(int64_t{p} * page + t), v.row(first + t), v.row_bytes());
      }
    }
    rank.plan = plan_decode(rank.page_indptr, rank.last_page_len, page, hq, hkv, dim, options,
                            Device{}, q_per_request);
    rank.workspace = HostWorkspace(context_parallel_decode_workspace_bytes(rank.plan, world, dtype));
    PagedKVCache cache;
    cache.k_cache = make_view(rank.k_cache.bytes.data(), dtype, {std::max(num_pages, 1), page, hkv, dim});
    cache.v_cache = make_view(rank.v_cache.bytes.data(), dtype, {std::max(num_pages, 1), page, hkv, dim});
    cache.page_indptr = make_view(rank.page_indptr.data(), DType::kInt32, {batch + 1});
    rank.page_indices.push_back(0);  // never read: keeps the view non-empty
    cache.page_indices = make_view(rank.page_indices.data(), DType::kInt32,
                                   {static_cast<int64_t>(rank.page_indices.size())});
    cache.last_page_len = make_view(rank.last_page_len.data(), DType::kInt32, {batch});
    run_context_parallel_decode_local(rank.plan, world, r, q.view(), cache, rank.workspace.get());
  }
  // The all-gather of (o, lse): slot r of rank r into slot r of every rank.
  for (int32_t src = 0; src < world; ++src) {
    for (int32_t dst = 0; dst < world; ++dst) {
      if (dst == src) continue;
      for (bool is_lse : {false, true}) {
        const TensorView from = context_parallel_decode_slot(ranks[src].plan, world, dtype,
                                                             ranks[src].workspace.get(), src, is_lse);
        const TensorView to = context_parallel_decode_slot(ranks[dst].plan, world, dtype,
                                                           ranks[dst].workspace.get(), src, is_lse);
        std::memcpy(to.data, from.data, static_cast<size_t>(from.numel()) * dtype_size(from.dtype));
      }
    }
  }
  for (int32_t r = 0; r < world; ++r) {
    Tensor o(dtype, rows, hq, dim), lse(DType::kFloat32, rows, hq, 0);
    merge_context_parallel_decode(ranks[r].plan, world, dtype, o.view(), lse.view(),
                                  ranks[r].workspace.get());
    const Error2 e = compare(o, o_ref, lse, lse_ref);
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_LT(e.rel_l2, 1e-2);
    EXPECT_LT(e.lse_max_abs, 1e-3);
    if (r == 0) {
      o_first = o;
    } else {
      EXPECT_EQ(o.bytes, o_first.bytes) << "ranks disagree";
    }
  }
}

TEST(ContextParallelSimulation, DecodeOverKvShards) {
  std::mt19937_64 rng(test_seed() + 3);
  for (int32_t world = 1; world <= 8; ++world) {
    simulate_decode(world, 1, true, world % 2 ? DType::kBFloat16 : DType::kFloat16, rng);
    simulate_decode(world, 3, false, DType::kBFloat16, rng);
  }
}

TEST(ContextParallelSimulation, CausalDecodeWithSeveralQueriesIsRejected) {
  AttentionOptions causal;
  causal.causal = true;
  const std::vector<int32_t> indptr = {0, 1}, last = {5};
  const Plan plan = plan_decode(indptr, last, 16, 4, 2, 64, causal, Device{}, 2);
  try {
    context_parallel_decode_workspace_bytes(plan, 2, DType::kBFloat16);
    FAIL() << "expected kUnsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::kUnsupported);
  }
}

// ============================================================================ NCCL loading

using test::ScopedEnv;

TEST(ContextParallelNccl, MissingLibraryIsAClearUnsupportedError) {
  {
    ScopedEnv env("TESSERA_NCCL_LIBRARY", "/nonexistent/libnccl-for-test.so.2");
    std::string why;
    EXPECT_FALSE(nccl_available(&why));
    EXPECT_NE(why.find("/nonexistent/libnccl-for-test.so.2"), std::string::npos) << why;
    EXPECT_NE(why.find("NCCL"), std::string::npos) << why;
  }
  {
    // A library that loads but is not NCCL: the first missing symbol is named.
    ScopedEnv env("TESSERA_NCCL_LIBRARY", "libm.so.6");
    std::string why;
    EXPECT_FALSE(nccl_available(&why));
    EXPECT_NE(why.find("ncclGetVersion"), std::string::npos) << why;
  }
}

TEST(ContextParallelNccl, NvlsIsDisabledUnlessTheUserChose) {
  {
    ScopedEnv env("NCCL_NVLS_ENABLE", nullptr);
    EXPECT_EQ(disable_nccl_nvls(), "0");
    EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  }
  {
    ScopedEnv env("NCCL_NVLS_ENABLE", "1");
    EXPECT_EQ(disable_nccl_nvls(), "1");
  }
}

TEST(ContextParallelNccl, DriversRejectCpuTensors) {
  const ContextParallelPlan plan = cpu_plan(64, 2, 0, true);
  Tensor q(DType::kBFloat16, plan.local_rows(), 2, 64), kv(DType::kBFloat16, plan.local_rows(), 1, 64);
  Tensor o(DType::kBFloat16, plan.local_rows(), 2, 64);
  try {
    run_context_parallel_prefill(plan, q.view(), kv.view(), kv.view(), o.view(), {}, {}, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
