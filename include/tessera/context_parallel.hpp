// Context-parallel attention: one long sequence's prefill, or a batch's decode, spread over N
// ranks (GPUs) that each hold a slice of the sequence, with the partial attentions combined
// exactly by merge_states (include/tessera/ops.hpp).
//
// Prefill: q, k and v of ONE sequence of seq_len tokens (self-attention: the keys are the
// queries' own tokens) are sharded by sequence with the load-balanced "zigzag" split. The
// sequence is cut into 2N chunks, chunk c = tokens [floor(c L / 2N), floor((c+1) L / 2N)), so
// chunk lengths differ by at most one token and nothing is padded: seq_len need not be a multiple
// of 2N (a chunk may even be empty when seq_len < 2N). Rank r holds chunks r and 2N-1-r, in that
// order, as its local rows [0, len(r)) and [len(r), len(r) + len(2N-1-r)). Under a causal mask
// the early chunk of a rank sees few keys and the late chunk many, so every rank gets the same
// visible work up to two query rows, and so does every ring step.
//
// Schedule: N steps; at step t rank r attends its local queries against the K/V shard of rank
// (r - t) mod N. The keys a query chunk sees in a shard are always a prefix of the shard's rows
// (the shard's chunks are in position order), so each (query chunk, shard) pair is at most one
// attention block: non-causal when every key of the prefix precedes the chunk, causal when the
// prefix ends with the query chunk itself (the bottom-right aligned mask is then exactly the
// global causal mask, since kv_len - q_len = the number of earlier keys). Fully masked pairs
// are never scheduled. Each block runs as one plan_ragged_prefill / run_ragged_prefill call and
// writes a partial (o, lse) state (in q's dtype; a row of the high chunk has N of them, of the
// low chunk of rank r, r + 1: the workspace holds up to N times o) and one merge_states call
// combines every row's states at the end.
// K/V reach the ranks either by a ring (send to rank r+1, receive from rank r-1, overlapped with
// the block of the current step) or by one all-gather (overlapped with step 0); a cost model
// picks one (KVExchange::kAuto).
//
// Decode: every rank holds a shard of each request's KV cache (any split: a request's keys
// are the disjoint union of the shards) and the same q; each rank decodes against its shard,
// the partial (o, lse) are all-gathered and merged. A shard may hold no key of a request.
//
// Communication is NCCL, loaded at first use with dlopen("libnccl.so.2") (or the path in
// TESSERA_NCCL_LIBRARY): the library is not linked, so a build without NCCL still works and the
// NCCL entry points throw Error(kUnsupported) naming what is missing. The caller owns the
// communicator (ncclComm_t, passed as void*), whose rank and size must equal the plan's.
// NCCL's NVLink multicast (NVLS) must stay off: on a shared host it can take the GPUs out of
// service. Set NCCL_NVLS_ENABLE=0 in the environment before creating the communicator
// (disable_nccl_nvls() does it for the current process when the variable is unset; the loader
// calls it too, but a communicator created before that keeps its setting).
//
// Limits: one sequence per prefill call; fp16 / bf16 (and float32 on the CPU) q/k/v of one
// dtype; no sliding window in prefill (kUnsupported); soft-cap and sm_scale apply as usual.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera {

// ---- sharding ----

struct ZigzagSharding {
  int64_t seq_len = 0;
  int32_t world_size = 1;

  int32_t num_chunks() const { return 2 * world_size; }
  int64_t chunk_begin(int32_t chunk) const;  // first token of `chunk` (chunk <= 2N: 2N = end)
  int64_t chunk_length(int32_t chunk) const;
  int32_t low_chunk(int32_t rank) const { return rank; }
  int32_t high_chunk(int32_t rank) const { return 2 * world_size - 1 - rank; }
  int32_t owner(int32_t chunk) const;              // rank holding `chunk`
  int64_t rank_length(int32_t rank) const;         // local rows of a rank
  int64_t max_rank_length() const;
  int64_t global_position(int32_t rank, int64_t local_row) const;
};

// Validates (seq_len >= 0, 1 <= world_size <= 4096, seq_len < 2^31) and returns the sharding.
ZigzagSharding make_zigzag_sharding(int64_t seq_len, int world_size);

// How much of the (query chunk, key chunk) block a mask lets through.
enum class BlockVisibility : int32_t {
  kFull = 0,      // every query sees every key
  kDiagonal = 1,  // the same chunk: causal inside the block
  kMasked = 2,    // no query sees any key
};
BlockVisibility classify_chunk_pair(int32_t q_chunk, int32_t kv_chunk, bool causal);

// ---- schedule ----

// One attention call of a rank: its local query rows [q_begin, q_end) against rows
// [kv_begin, kv_end) of the K/V shard of `source_rank`, at ring step `step`. The output is the
// partial state of those rows at state index state_begin + (row - q_begin) * state_stride.
struct ContextParallelBlock {
  int32_t step = 0;
  int32_t source_rank = 0;
  int32_t q_begin = 0, q_end = 0;
  int32_t kv_begin = 0, kv_end = 0;  // kv_begin is always 0: a query sees a prefix of a shard
  bool causal = false;               // bottom-right aligned causal mask (the diagonal block)
  int64_t state_begin = 0;
  int32_t state_stride = 1;
  int64_t visible_pairs = 0;  // (query, key) pairs the block computes, per query head
};

enum class KVExchange : int32_t { kAuto = 0, kRing = 1, kAllGather = 2 };
const char* kv_exchange_name(KVExchange exchange);

// Cost model of the K/V exchange. The defaults are estimates for 8 NVLink-connected H200s, not
// measurements (docs/PERF.md: no multi-GPU machine has been available to calibrate them).
struct ContextParallelCostModel {
  double attention_tflops = 400.0;   // sustained attention throughput per GPU
  double p2p_gbytes_per_s = 120.0;   // ring send/recv between neighbours, each direction
  double all_gather_gbytes_per_s = 120.0;  // NCCL all-gather bus bandwidth (NVLS off)
  double step_latency_us = 25.0;     // per ring step: NCCL group + event waits + launches
  double collective_latency_us = 40.0;  // one all-gather
};

struct KVExchangeEstimate {
  double ring_us = 0;
  double all_gather_us = 0;
  double compute_us = 0;  // the slowest rank's attention, no communication
  KVExchange choice = KVExchange::kRing;
};

struct ContextParallelPlan {
  ZigzagSharding sharding{};
  int32_t rank = 0;
  int32_t num_qo_heads = 0, num_kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBFloat16;  // q, k, v, o
  AttentionOptions options{};
  Device device{};
  KVExchange exchange = KVExchange::kRing;  // resolved: kRing or kAllGather
  KVExchangeEstimate estimate{};

  std::vector<ContextParallelBlock> blocks;  // in step order
  std::vector<int32_t> step_indptr;          // [world_size + 1]: blocks of step t
  std::vector<Plan> block_plans;             // one attention plan per block
  std::vector<int32_t> merge_indptr;         // [local rows + 1]: states of each local row
  int64_t num_states = 0;

  // Workspace layout (byte offsets; all 256-byte aligned). kv_buffers: the ring's two K/V
  // buffers or the all-gather's N slots, each K then V of max_rank_length rows.
  size_t attention_offset = 0, attention_bytes = 0;
  size_t states_offset = 0, lse_offset = 0, index_offset = 0;
  size_t kv_buffers_offset = 0, kv_slot_bytes = 0;
  int32_t num_kv_slots = 0;
  size_t workspace_bytes = 0;

  int32_t world_size() const { return sharding.world_size; }
  int32_t local_rows() const { return static_cast<int32_t>(sharding.rank_length(rank)); }
  int32_t source_rank(int32_t step) const {
    return (rank - step % world_size() + world_size()) % world_size();
  }
  std::string explain() const;
};

// Pure and deterministic. kAuto picks the exchange with the cost model. Throws Error naming the
// argument for bad shapes, a rank outside [0, world_size), or a sliding window (kUnsupported).
ContextParallelPlan plan_context_parallel_prefill(int64_t seq_len, int world_size, int rank,
                                                  int num_qo_heads, int num_kv_heads,
                                                  int head_dim, DType dtype,
                                                  const AttentionOptions& options,
                                                  Device device = {},
                                                  KVExchange exchange = KVExchange::kAuto,
                                                  const ContextParallelCostModel& model = {});

// The estimate alone (what kAuto compares): compute per step from the blocks' visible pairs,
// the ring's step-by-step overlap of the next shard's transfer with the current step, the
// all-gather's one transfer overlapped with step 0.
KVExchangeEstimate estimate_kv_exchange(const ZigzagSharding& sharding, int num_qo_heads,
                                        int num_kv_heads, int head_dim, DType dtype,
                                        bool causal, const ContextParallelCostModel& model = {});

// ---- the pieces of a rank's prefill (the NCCL driver below and the CPU simulation in the
// tests run exactly these, in this order) ----
// q: local rows [local_rows, Hq, D]; k_shard, v_shard: the shard of source_rank(step),
// [>= that rank's rows, Hkv, D]; o: [local_rows, Hq, D]; lse: [local_rows, Hq] float32 or empty.

// Writes the plan's index arrays into the workspace (one copy, async on `stream`).
void prepare_context_parallel_workspace(const ContextParallelPlan& plan, Workspace workspace,
                                        void* stream = nullptr);
// Runs the blocks of `step` through run_ragged_prefill, writing their partial states.
void run_context_parallel_step(const ContextParallelPlan& plan, int32_t step,
                               const TensorView& q, const TensorView& k_shard,
                               const TensorView& v_shard, Workspace workspace,
                               void* stream = nullptr);
// Merges every partial state into o / lse with one merge_states call.
void merge_context_parallel_states(const ContextParallelPlan& plan, const TensorView& o,
                                   const TensorView& lse, Workspace workspace,
                                   void* stream = nullptr);
// K and V of the workspace's K/V buffer `slot` (ring: slot = step % 2; all-gather: the source
// rank) as [max_rank_length, Hkv, D] views on the plan's device.
TensorView context_parallel_kv_slot(const ContextParallelPlan& plan, Workspace workspace,
                                    int32_t slot, bool value);

// ---- the NCCL driver (CUDA tensors; one call per rank, collective over `nccl_comm`) ----
// q, k, v: this rank's zigzag rows (k, v: [local_rows, Hkv, D], head dim contiguous within a
// token). Exchanges K/V as plan.exchange says, overlapping communication with attention on a
// second stream, and writes o / lse. Does not synchronise the host.
void run_context_parallel_prefill(const ContextParallelPlan& plan, const TensorView& q,
                                  const TensorView& k, const TensorView& v, const TensorView& o,
                                  const TensorView& lse, Workspace workspace, void* nccl_comm,
                                  void* stream = nullptr);

// ---- decode ----
// local_plan: plan_decode of this rank's KV shard (the same batch, heads and options on every
// rank). Causal decode with more than one query per request is unsupported (the shard of a
// request's middle would need the mask shifted): use q_per_request = 1 or options.causal false.
size_t context_parallel_decode_workspace_bytes(const Plan& local_plan, int world_size,
                                               DType dtype);
// Decodes q against this rank's shard into gather slot `rank` of the workspace.
void run_context_parallel_decode_local(const Plan& local_plan, int world_size, int rank,
                                       const TensorView& q, const PagedKVCache& kv_shard,
                                       Workspace workspace, void* stream = nullptr);
// Slot `slot` of the gathered partials: o [rows, Hq, D] in `dtype` and lse [rows, Hq] float32.
TensorView context_parallel_decode_slot(const Plan& local_plan, int world_size, DType dtype,
                                        Workspace workspace, int32_t slot, bool lse);
// Merges the N gathered partials into o (contiguous [rows, Hq, D]) and lse (optional).
void merge_context_parallel_decode(const Plan& local_plan, int world_size, DType dtype,
                                   const TensorView& o, const TensorView& lse,
                                   Workspace workspace, void* stream = nullptr);
// local + NCCL all-gather of (o, lse) + merge. CUDA tensors.
void run_context_parallel_decode(const Plan& local_plan, int world_size, int rank,
                                 const TensorView& q, const PagedKVCache& kv_shard,
                                 const TensorView& o, const TensorView& lse,
                                 Workspace workspace, void* nccl_comm, void* stream = nullptr);

// ---- NCCL availability ----
// Loads NCCL if needed; false (with the reason in *why) when it cannot be loaded or is older
// than 2.7 (ncclSend / ncclRecv). Retried on every call until it succeeds.
bool nccl_available(std::string* why = nullptr);
// Sets NCCL_NVLS_ENABLE=0 unless the variable is already set; returns its value afterwards.
std::string disable_nccl_nvls();

}  // namespace tessera
