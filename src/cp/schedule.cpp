// Context-parallel prefill: the zigzag sharding, the chunk-pair mask classification, the ring
// schedule of a rank (which blocks, which partial state slots), the K/V exchange cost model and
// the workspace layout. Host-only and pure: the same plan drives the NCCL path and the CPU
// simulation of the tests.
#include <algorithm>
#include <array>
#include <sstream>

#include "core/validate.hpp"
#include "tessera/context_parallel.hpp"

namespace tessera {
namespace {

using detail::ArgChecker;

constexpr size_t kAlignment = 256;
size_t align_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// (query, key) pairs of a q_len x kv_len block, per head: all of them, or the bottom-right
// aligned causal ones (query i sees keys j <= i + kv_len - q_len).
int64_t block_pairs(int64_t q_len, int64_t kv_len, bool causal) {
  if (!causal) return q_len * kv_len;
  int64_t pairs = 0;
  for (int64_t i = 0; i < q_len; ++i) {
    pairs += std::clamp<int64_t>(i + kv_len - q_len + 1, 0, kv_len);
  }
  return pairs;
}

struct LocalChunk {
  int32_t chunk;
  int32_t row_begin;  // in the rank's local rows
  int32_t length;
};

std::array<LocalChunk, 2> local_chunks(const ZigzagSharding& s, int32_t rank) {
  const int32_t low = s.low_chunk(rank), high = s.high_chunk(rank);
  const auto low_len = static_cast<int32_t>(s.chunk_length(low));
  return {LocalChunk{low, 0, low_len},
          LocalChunk{high, low_len, static_cast<int32_t>(s.chunk_length(high))}};
}

// The blocks of `rank` before slots are assigned: per step, per local query chunk, the prefix
// of the source shard the chunk sees.
struct RawBlock {
  ContextParallelBlock block;
  int region;  // 0: low chunk, 1: high chunk
};

std::vector<RawBlock> raw_blocks(const ZigzagSharding& s, int32_t rank, bool causal) {
  std::vector<RawBlock> out;
  const int32_t n = s.world_size;
  const auto queries = local_chunks(s, rank);
  for (int32_t step = 0; step < n; ++step) {
    const int32_t source = (rank - step + n) % n;
    const auto keys = local_chunks(s, source);
    for (int region = 0; region < 2; ++region) {
      const LocalChunk& q = queries[region];
      if (q.length == 0) continue;
      int32_t kv_end = 0;
      bool diagonal = false;
      for (const LocalChunk& kv : keys) {  // position order: once masked, masked after
        const BlockVisibility visibility = classify_chunk_pair(q.chunk, kv.chunk, causal);
        if (visibility == BlockVisibility::kMasked) break;
        kv_end = kv.row_begin + kv.length;
        if (visibility == BlockVisibility::kDiagonal) {
          diagonal = true;
          break;
        }
      }
      if (kv_end == 0) continue;  // fully masked, or only empty key chunks
      ContextParallelBlock block;
      block.step = step;
      block.source_rank = source;
      block.q_begin = q.row_begin;
      block.q_end = q.row_begin + q.length;
      block.kv_begin = 0;
      block.kv_end = kv_end;
      block.causal = diagonal;
      block.visible_pairs = block_pairs(q.length, kv_end, diagonal);
      out.push_back({block, region});
    }
  }
  return out;
}

// Assigns partial state slots (region r's rows hold slots[r] states each, low region first)
// and joins a step's two blocks into one call when they are interchangeable: same key prefix,
// no mask, and the same slot in regions of the same width (then one stride addresses both).
std::vector<ContextParallelBlock> assign_states(std::vector<RawBlock> raw,
                                                const std::array<LocalChunk, 2>& queries,
                                                std::vector<int32_t>& merge_indptr,
                                                int64_t& num_states) {
  int32_t slots[2] = {0, 0};
  std::vector<int32_t> slot_of(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) slot_of[i] = slots[raw[i].region]++;
  const int64_t region_base[2] = {0, int64_t{queries[0].length} * slots[0]};
  num_states = region_base[1] + int64_t{queries[1].length} * slots[1];

  merge_indptr.assign(static_cast<size_t>(queries[0].length + queries[1].length) + 1, 0);
  int64_t next = 0;
  for (int region = 0; region < 2; ++region) {
    for (int32_t row = 0; row < queries[region].length; ++row) {
      merge_indptr[static_cast<size_t>(queries[region].row_begin + row)] =
          static_cast<int32_t>(next);
      next += slots[region];
    }
  }
  merge_indptr.back() = static_cast<int32_t>(next);

  std::vector<ContextParallelBlock> blocks;
  for (size_t i = 0; i < raw.size(); ++i) {
    ContextParallelBlock block = raw[i].block;
    const int region = raw[i].region;
    block.state_stride = slots[region];
    block.state_begin = region_base[region] + slot_of[i];
    if (!blocks.empty() && region == 1) {
      ContextParallelBlock& previous = blocks.back();
      const bool joinable = previous.step == block.step && previous.q_end == block.q_begin &&
                            previous.kv_end == block.kv_end && !previous.causal &&
                            !block.causal && previous.state_stride == block.state_stride &&
                            previous.state_begin + int64_t{previous.q_end - previous.q_begin} *
                                                       previous.state_stride ==
                                block.state_begin;
      if (joinable) {
        previous.q_end = block.q_end;
        previous.visible_pairs += block.visible_pairs;
        continue;
      }
    }
    blocks.push_back(block);
  }
  return blocks;
}

double step_compute_us(int64_t pairs, int num_qo_heads, int head_dim,
                       const ContextParallelCostModel& model) {
  // QK^T and PV: 2 multiply-adds per (pair, head, feature) = 4 flops.
  const double flops = 4.0 * static_cast<double>(pairs) * num_qo_heads * head_dim;
  return flops / (model.attention_tflops * 1e12) * 1e6;
}

}  // namespace

// ---- sharding ----

int64_t ZigzagSharding::chunk_begin(int32_t chunk) const {
  return static_cast<int64_t>(chunk) * seq_len / num_chunks();
}
int64_t ZigzagSharding::chunk_length(int32_t chunk) const {
  return chunk_begin(chunk + 1) - chunk_begin(chunk);
}
int32_t ZigzagSharding::owner(int32_t chunk) const {
  return chunk < world_size ? chunk : 2 * world_size - 1 - chunk;
}
int64_t ZigzagSharding::rank_length(int32_t rank) const {
  return chunk_length(low_chunk(rank)) + chunk_length(high_chunk(rank));
}
int64_t ZigzagSharding::max_rank_length() const {
  int64_t longest = 0;
  for (int32_t r = 0; r < world_size; ++r) longest = std::max(longest, rank_length(r));
  return longest;
}
int64_t ZigzagSharding::global_position(int32_t rank, int64_t local_row) const {
  const int64_t low = chunk_length(low_chunk(rank));
  return local_row < low ? chunk_begin(low_chunk(rank)) + local_row
                         : chunk_begin(high_chunk(rank)) + (local_row - low);
}

ZigzagSharding make_zigzag_sharding(int64_t seq_len, int world_size) {
  const ArgChecker check("make_zigzag_sharding");
  check.require(world_size >= 1 && world_size <= 4096, "world_size",
                [&] { return "expected 1..4096 ranks, got " + std::to_string(world_size); });
  check.require(seq_len >= 0 && seq_len <= INT32_MAX, "seq_len",
                [&] { return "expected 0 <= seq_len < 2^31, got " + std::to_string(seq_len); });
  return ZigzagSharding{seq_len, world_size};
}

BlockVisibility classify_chunk_pair(int32_t q_chunk, int32_t kv_chunk, bool causal) {
  if (!causal || kv_chunk < q_chunk) return BlockVisibility::kFull;
  return kv_chunk == q_chunk ? BlockVisibility::kDiagonal : BlockVisibility::kMasked;
}

const char* kv_exchange_name(KVExchange exchange) {
  switch (exchange) {
    case KVExchange::kAuto: return "auto";
    case KVExchange::kRing: return "ring";
    case KVExchange::kAllGather: return "all-gather";
  }
  return "?";
}

// ---- cost model ----

KVExchangeEstimate estimate_kv_exchange(const ZigzagSharding& sharding, int num_qo_heads,
                                        int num_kv_heads, int head_dim, DType dtype,
                                        bool causal, const ContextParallelCostModel& model) {
  const int32_t n = sharding.world_size;
  // Per step, the slowest rank (every rank waits for its neighbour's shard).
  std::vector<double> step_us(static_cast<size_t>(n), 0.0);
  for (int32_t rank = 0; rank < n; ++rank) {
    std::vector<int64_t> pairs(static_cast<size_t>(n), 0);
    for (const RawBlock& raw : raw_blocks(sharding, rank, causal)) {
      pairs[static_cast<size_t>(raw.block.step)] += raw.block.visible_pairs;
    }
    for (int32_t t = 0; t < n; ++t) {
      step_us[t] = std::max(step_us[t], step_compute_us(pairs[t], num_qo_heads, head_dim, model));
    }
  }
  const double shard_bytes = 2.0 * static_cast<double>(sharding.max_rank_length()) *
                             num_kv_heads * head_dim * static_cast<double>(dtype_size(dtype));
  const double p2p_us = model.step_latency_us + shard_bytes / (model.p2p_gbytes_per_s * 1e3);
  const double gather_us = n == 1 ? 0.0
                                  : model.collective_latency_us +
                                        (n - 1) * shard_bytes /
                                            (model.all_gather_gbytes_per_s * 1e3);
  KVExchangeEstimate estimate;
  for (int32_t t = 0; t < n; ++t) {
    estimate.compute_us += step_us[t];
    // Step t's compute overlaps the transfer of step t+1's shard; the last step has none.
    estimate.ring_us += t + 1 < n ? std::max(step_us[t], p2p_us) : step_us[t];
    estimate.all_gather_us += t == 0 ? std::max(step_us[0], gather_us) : step_us[t];
  }
  // Ties go to the ring: it needs 2 K/V buffers where the all-gather needs N.
  estimate.choice =
      estimate.all_gather_us < estimate.ring_us ? KVExchange::kAllGather : KVExchange::kRing;
  return estimate;
}

// ---- plan ----

ContextParallelPlan plan_context_parallel_prefill(int64_t seq_len, int world_size, int rank,
                                                  int num_qo_heads, int num_kv_heads,
                                                  int head_dim, DType dtype,
                                                  const AttentionOptions& options,
                                                  Device device, KVExchange exchange,
                                                  const ContextParallelCostModel& model) {
  const ArgChecker check("plan_context_parallel_prefill");
  ContextParallelPlan plan;
  plan.sharding = make_zigzag_sharding(seq_len, world_size);
  check.require(rank >= 0 && rank < world_size, "rank", [&] {
    return "expected 0 <= rank < world_size = " + std::to_string(world_size) + ", got " +
           std::to_string(rank);
  });
  detail::check_heads(check, num_qo_heads, num_kv_heads, head_dim);
  check.require(dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
                    (dtype == DType::kFloat32 && device.type == DeviceType::kCPU),
                "dtype", [&] {
                  return std::string("expected float16 or bfloat16 (float32 on the CPU), got ") +
                         dtype_name(dtype);
                });
  if (options.window_left != -1 || options.window_right != -1) {
    check.unsupported("options.window_left",
                      "a sliding window is not supported by context-parallel prefill");
  }
  if (options.head_dim_vo != 0 && options.head_dim_vo != head_dim) {
    check.unsupported("options.head_dim_vo",
                      "context-parallel prefill needs head_dim_vo = head_dim (0), got " +
                          std::to_string(options.head_dim_vo) + " for head_dim " +
                          std::to_string(head_dim));
  }
  check.require(exchange == KVExchange::kAuto || exchange == KVExchange::kRing ||
                    exchange == KVExchange::kAllGather,
                "exchange", "expected kAuto, kRing or kAllGather");
  plan.rank = rank;
  plan.num_qo_heads = num_qo_heads;
  plan.num_kv_heads = num_kv_heads;
  plan.head_dim = head_dim;
  plan.dtype = dtype;
  plan.options = options;
  plan.device = device;
  plan.estimate = estimate_kv_exchange(plan.sharding, num_qo_heads, num_kv_heads, head_dim,
                                       dtype, options.causal, model);
  plan.exchange = exchange == KVExchange::kAuto ? plan.estimate.choice : exchange;

  const auto queries = local_chunks(plan.sharding, rank);
  plan.blocks = assign_states(raw_blocks(plan.sharding, rank, options.causal), queries,
                              plan.merge_indptr, plan.num_states);
  plan.step_indptr.assign(static_cast<size_t>(world_size) + 1, 0);
  for (const ContextParallelBlock& block : plan.blocks) ++plan.step_indptr[block.step + 1];
  for (int32_t t = 0; t < world_size; ++t) plan.step_indptr[t + 1] += plan.step_indptr[t];

  // One attention plan per block; they run one after another in one workspace region.
  for (const ContextParallelBlock& block : plan.blocks) {
    AttentionOptions block_options = options;
    block_options.causal = block.causal;
    const int32_t qo_indptr[2] = {0, block.q_end - block.q_begin};
    const int32_t kv_indptr[2] = {0, block.kv_end - block.kv_begin};
    plan.block_plans.push_back(plan_ragged_prefill(qo_indptr, kv_indptr, num_qo_heads,
                                                   num_kv_heads, head_dim, block_options,
                                                   device));
    plan.attention_bytes = std::max(plan.attention_bytes, plan.block_plans.back().workspace_bytes);
  }

  // Workspace: attention scratch | partial o | partial lse | index arrays | K/V buffers.
  const size_t row_elements = static_cast<size_t>(num_qo_heads) * head_dim;
  size_t offset = 0;
  plan.attention_offset = offset;
  offset = align_up(offset + plan.attention_bytes);
  plan.states_offset = offset;
  offset = align_up(offset + static_cast<size_t>(plan.num_states) * row_elements *
                                 dtype_size(dtype));
  plan.lse_offset = offset;
  offset = align_up(offset + static_cast<size_t>(plan.num_states) * num_qo_heads * sizeof(float));
  plan.index_offset = offset;
  // Per block: qo_indptr[2], kv_indptr[2]; then merge_indptr.
  offset = align_up(offset + (4 * plan.blocks.size() + plan.merge_indptr.size()) *
                                 sizeof(int32_t));
  plan.kv_buffers_offset = offset;
  plan.kv_slot_bytes = align_up(2 * static_cast<size_t>(plan.sharding.max_rank_length()) *
                                num_kv_heads * head_dim * dtype_size(dtype));
  plan.num_kv_slots = plan.exchange == KVExchange::kRing ? std::min(world_size, 2) : world_size;
  offset += plan.kv_slot_bytes * static_cast<size_t>(plan.num_kv_slots);
  plan.workspace_bytes = offset;
  return plan;
}

std::string ContextParallelPlan::explain() const {
  std::ostringstream out;
  out << "context-parallel prefill: seq_len " << sharding.seq_len << ", rank " << rank << "/"
      << world_size() << ", chunks " << sharding.low_chunk(rank) << " ["
      << sharding.chunk_begin(sharding.low_chunk(rank)) << ", "
      << sharding.chunk_begin(sharding.low_chunk(rank) + 1) << ") and "
      << sharding.high_chunk(rank) << " [" << sharding.chunk_begin(sharding.high_chunk(rank))
      << ", " << sharding.chunk_begin(sharding.high_chunk(rank) + 1) << ")\n";
  out << "  exchange " << kv_exchange_name(exchange) << " (estimate: ring " << estimate.ring_us
      << " us, all-gather " << estimate.all_gather_us << " us, compute " << estimate.compute_us
      << " us)\n";
  for (const ContextParallelBlock& b : blocks) {
    out << "  step " << b.step << " kv of rank " << b.source_rank << ": q rows [" << b.q_begin
        << ", " << b.q_end << ") x kv rows [" << b.kv_begin << ", " << b.kv_end << ") "
        << (b.causal ? "causal" : "full") << ", states " << b.state_begin << " + "
        << b.state_stride << "/row, " << b.visible_pairs << " pairs\n";
  }
  out << "  " << num_states << " partial states, workspace " << workspace_bytes << " bytes\n";
  return out.str();
}

}  // namespace tessera
