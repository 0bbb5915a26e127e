// The sm80 batch decode kernel, one template over its compute policy: persistent CTAs walk their
// worker's work items; each item is (request, kv head, query tokens, key range) and covers the
// whole GQA group of its kv head, so every K/V row is read from memory once per item.
//
// What every policy shares (this file):
//   * the item's geometry: its packed query rows (token t, group head g -> row t * group + g) and
//     the union of their visible key ranges (causal / window clip it; nothing outside is read);
//   * the loader: a kStages-deep cp.async ring of K/V tiles fed by page lookups kStages tiles
//     ahead (stream_key_tiles), and the output store (o in q's dtype and natural-log lse, or
//     float partials for a split-KV piece);
//   * the kernel itself (decode_kernel<Policy>) and its registry instance.
// What a policy brings (Policy::run_item): how query rows are held, how a tile is consumed and
// how key partitions are merged. Two policies:
//   * decode_cuda_core.cuh: row slots of lanes, fp32 FMA; every K/V dtype and head_dim;
//   * decode_mma.cuh: mma.sync m16n8k16 over the packed rows; fp16/bf16, head_dim <= 128, with
//     a cross-item prefetch and the split-KV merge fused in.
// Rows that see no key end with o = 0 and lse = -inf: the running max stays -inf, every exp2 is
// taken against a finite base (0 when the max is -inf), and zero-filled tail rows of the last
// tile keep 0 * V finite.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <numbers>

#include "core/problem.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_entry.cuh"
#include "cuda/kernel_registry.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/cp_async_sized.cuh"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/math.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/shuffle.cuh"
#include "cuda/row_finish.cuh"
#include "cuda/sm80/decode_dequant.cuh"
#include "cuda/sm80/decode_traits.cuh"

namespace tessera::detail::sm80 {


// Sum over the kLanes lanes of a row slot (aligned lane groups of one warp). Every lane of the
// warp executes it: callers keep their loops uniform across the warp.
template <int kLanes>
__device__ __forceinline__ float row_slot_sum(float value) {
  if constexpr (kLanes >= 32) value += ptx::shfl_xor<16>(value);
  if constexpr (kLanes >= 16) value += ptx::shfl_xor<8>(value);
  if constexpr (kLanes >= 8) value += ptx::shfl_xor<4>(value);
  if constexpr (kLanes >= 4) value += ptx::shfl_xor<2>(value);
  if constexpr (kLanes >= 2) value += ptx::shfl_xor<1>(value);
  return value;
}

// tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)) with the SFU's ex2: absolute error ~1e-7, where
// tanh.approx has 2^-11 relative error (~0.02 in a logit capped at 50). |x| is clamped at 15,
// where tanh rounds to +-1 in float, so the division never sees an infinite denominator; the
// clamp keeps NaN (max_nan / min_nan), which fmaxf / fminf would turn into -+15.
__device__ __forceinline__ float soft_cap_tanh(float x) {
  constexpr float kTwoLog2e = 2.0f * std::numbers::log2e_v<float>;
  constexpr float kSaturation = 15.0f;
  const float clamped = ptx::min_nan(ptx::max_nan(x, -kSaturation), kSaturation);
  return 1.0f - __fdividef(2.0f, 1.0f + ptx::ex2_approx(clamped * kTwoLog2e));
}

// ---------------------------------------------------------------------------- item geometry

struct DecodeItem {
  WorkItem work;
  int32_t group;          // query heads per kv head
  int32_t rows;           // packed query rows: work.q_len * group
  int32_t kv_len;         // keys of the request
  int32_t q_len_request;  // query tokens of the request (mask alignment)
  int32_t first_page;     // page_indptr[request]
  int32_t key_begin;      // keys any row of the item sees, within [kv_start, kv_end)
  int32_t key_end;
};

// Visible keys of item token t (0-based within the item), clipped to the item's key range.
__device__ __forceinline__ void item_visible_keys(const AttentionProblem& problem,
                                                  const DecodeItem& item, int32_t t, int32_t* first,
                                                  int32_t* last) {
  problem.mask.visible_range(item.work.q_start + t, item.q_len_request, item.kv_len, first, last);
  *first = max(*first, item.work.kv_start);
  *last = min(*last, item.work.kv_end);
  if (*last < *first) *last = *first;
}

__device__ __forceinline__ DecodeItem make_decode_item(const DecodeArgs& args,
                                                       const WorkItem& work) {
  const AttentionProblem& problem = args.problem;
  DecodeItem item;
  item.work = work;
  item.group = problem.num_qo_heads / problem.num_kv_heads;
  item.rows = work.q_len * item.group;
  item.kv_len = problem.kv.kv_len(work.request);
  item.q_len_request = problem.q_len(work.request);
  item.first_page = problem.kv.page_indptr[work.request];
  // Visible ranges move monotonically with the token, so their union is one interval.
  int32_t begin = work.kv_end, end = work.kv_start;
  for (int32_t t = 0; t < work.q_len; ++t) {
    int32_t first, last;
    item_visible_keys(problem, item, t, &first, &last);
    if (first < last) {
      begin = min(begin, first);
      end = max(end, last);
    }
  }
  if (end <= begin) begin = end = work.kv_start;
  item.key_begin = begin;
  item.key_end = end;
  return item;
}

// ---------------------------------------------------------------------------- loader

// A key row's page, looked up one tile ahead of its copy; page < 0: no key (zero-filled).
struct PrefetchedKey {
  int32_t page;
  int32_t slot;  // row within the page
};

__device__ __forceinline__ PrefetchedKey prefetch_key(const DecodeArgs& args,
                                                      const DecodeItem& item, int64_t key) {
  if (key >= item.key_end) return {-1, 0};
  uint32_t page_of_request, slot;
  args.page_size.divmod(static_cast<uint32_t>(key), &page_of_request, &slot);
  const int32_t page =
      args.problem.kv.page_indices[item.first_page + static_cast<int32_t>(page_of_request)];
  return {page, static_cast<int32_t>(slot)};
}

// Element offsets of the key row in K and V (kv head included), (-1, -1) for no key.
__device__ __forceinline__ longlong2 key_row_offsets(const DecodeArgs& args, const DecodeItem& item,
                                                     PrefetchedKey key) {
  if (key.page < 0) return make_longlong2(-1, -1);
  const KVSource& kv = args.problem.kv;
  const int64_t page = key.page, slot = key.slot, head = item.work.kv_head;
  return make_longlong2(
      page * kv.k_stride_page + slot * kv.k_stride_token + head * kv.k_stride_head,
      page * kv.v_stride_page + slot * kv.v_stride_token + head * kv.v_stride_head);
}

// Copies one 16-byte chunk of a key row (valid_bytes of it: 0, 8 or 16; the rest zero-filled)
// with the widest copy the row alignment allows. `fallback` is a valid global address to name
// when nothing is read. Granularities below 4 bytes (odd views) are copied synchronously.
__device__ __forceinline__ void copy_key_chunk(uint8_t* destination, const uint8_t* source,
                                               uint32_t valid_bytes, int32_t granularity,
                                               const void* fallback) {
  const uint32_t address = ptx::shared_address(destination);
  if (granularity == 16) {
    ptx::cp_async_16_partial(address, valid_bytes > 0 ? source : fallback, valid_bytes);
  } else if (granularity == 8) {
#pragma unroll
    for (uint32_t piece = 0; piece < 16; piece += 8) {
      const bool valid = piece < valid_bytes;
      ptx::cp_async_8_partial(address + piece, valid ? source + piece : fallback, valid ? 8 : 0);
    }
  } else if (granularity == 4) {
#pragma unroll
    for (uint32_t piece = 0; piece < 16; piece += 4) {
      const bool valid = piece < valid_bytes;
      ptx::cp_async_4_partial(address + piece, valid ? source + piece : fallback, valid ? 4 : 0);
    }
  } else {
    // Rows not even 4-byte aligned (exotic views): synchronous byte loads packed into 4-byte
    // shared stores, kept rolled so this rarely used path costs no registers in the common one.
#pragma unroll 1
    for (uint32_t word = 0; word < 16; word += 4) {
      uint32_t packed = 0;
#pragma unroll
      for (uint32_t byte = 0; byte < 4; ++byte) {
        if (word + byte < valid_bytes) packed |= uint32_t{source[word + byte]} << (8 * byte);
      }
      *reinterpret_cast<uint32_t*>(destination + word) = packed;
    }
  }
}


// Key-row offsets of the item's first kStages tiles (their page lookups all in flight at once).
template <class Traits>
__device__ __forceinline__ void fill_first_key_offsets(const DecodeArgs& args,
                                                       const DecodeItem& item,
                                                       longlong2* key_offsets) {
#pragma unroll 1
  for (int index = threadIdx.x; index < Traits::kStages * Traits::kTileKeys;
       index += Traits::kNumThreads) {
    const PrefetchedKey key = prefetch_key(args, item, int64_t{item.key_begin} + index);
    key_offsets[index] = key_row_offsets(args, item, key);
  }
}

// Streams the item's key range through the ring: copy_tile(key_offsets, stage) issues one tile's
// copies into a ring stage, consume(stage, first_key) uses a landed one, after_tile(tile) runs
// at the end of each iteration (uniform across the CTA). key_offsets holds kStages tiles' offsets
// (already filled when offsets_ready). Ends with the ring drained and free for a merge.
template <class Traits, class CopyTile, class Consume, class AfterTile>
__device__ __forceinline__ void stream_key_tiles(const DecodeArgs& args, const DecodeItem& item,
                                                 longlong2* key_offsets, bool offsets_ready,
                                                 CopyTile&& copy_tile, Consume&& consume,
                                                 AfterTile&& after_tile) {
  constexpr int kStages = Traits::kStages;
  constexpr int kTileKeys = Traits::kTileKeys;
  const int32_t num_tiles = (item.key_end - item.key_begin + kTileKeys - 1) / kTileKeys;

  // Prologue: the copies of tiles 0 .. kStages-2.
  if (!offsets_ready) fill_first_key_offsets<Traits>(args, item, key_offsets);
  __syncthreads();
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (stage < num_tiles) copy_tile(key_offsets, stage);
    ptx::cp_async_commit_group();
  }

#pragma unroll 1
  for (int32_t tile = 0; tile < num_tiles; ++tile) {
    // Page lookup of tile + kStages first, so its latency overlaps the wait below as well as
    // this tile's compute; its offsets are stored at the end of the iteration.
    PrefetchedKey next_key{-1, 0};
    if (threadIdx.x < kTileKeys) {
      next_key = prefetch_key(
          args, item, int64_t{item.key_begin} + int64_t{tile + kStages} * kTileKeys + threadIdx.x);
    }
    // Tile `tile` has landed once at most kStages-2 younger groups are pending; the barrier
    // makes every thread's copies visible and retires the stage consumed last iteration.
    ptx::cp_async_wait_group<kStages - 2>();
    __syncthreads();
    const int stage = tile % kStages;
    const int32_t refill = tile + kStages - 1;
    if (refill < num_tiles) copy_tile(key_offsets, refill % kStages);
    ptx::cp_async_commit_group();

    consume(stage, item.key_begin + tile * kTileKeys);

    // Offsets slot `stage` held tile `tile`'s offsets, read when its copies were issued.
    if (threadIdx.x < kTileKeys) {
      key_offsets[stage * kTileKeys + threadIdx.x] = key_row_offsets(args, item, next_key);
    }
    after_tile(tile);
  }
  ptx::cp_async_wait_group<0>();
  __syncthreads();  // the ring is free: the merge reuses it
}

// ---------------------------------------------------------------------------- epilogue

// Writes packed row `row` of the item, features [4 quad, 4 quad + 4): o (q dtype) and lse at
// the problem's strides, or a float partial for a split-KV piece.
// Query head of packed row `row` of the item (token t = row / group, head t * group + g).
__device__ __forceinline__ int32_t decode_row_head(const DecodeItem& item, int32_t row) {
  return item.work.kv_head * item.group + row % item.group;
}

// The row's o factor and lse from its base-2 max and sum (row_finish.cuh), with its sink when
// the call has sinks and the item writes o (a split piece's partial leaves the sink to the merge).
__device__ __forceinline__ RowFinish finish_decode_row(const DecodeArgs& args,
                                                       const DecodeItem& item, int32_t row,
                                                       float best, float total) {
  RowFinish finish = finish_row(best, total, args.problem.sinks, decode_row_head(item, row),
                                item.work.partial_row < 0);
  finish.factor *= args.output_scale;
  return finish;
}

template <DType kQDType>
__device__ __forceinline__ void store_output_quad(const DecodeArgs& args, const DecodeItem& item,
                                                  int32_t row, int32_t quad, float4 value,
                                                  float lse) {
  const AttentionProblem& problem = args.problem;
  if (item.work.partial_row >= 0) {
    const int64_t partial = int64_t{item.work.partial_row} + row;
    *reinterpret_cast<float4*>(args.partial_o + partial * problem.head_dim + quad * 4) = value;
    if (quad == 0) args.partial_lse[partial] = lse;
    return;
  }
  const int32_t t = row / item.group;
  const int32_t head = item.work.kv_head * item.group + (row - t * item.group);
  const int64_t token = problem.q_begin(item.work.request) + item.work.q_start + t;
  auto* o_row = static_cast<uint16_t*>(problem.o) + token * problem.o_stride_token +
                head * problem.o_stride_head + quad * 4;
  QElement<kQDType>::store(o_row + 0, value.x);
  QElement<kQDType>::store(o_row + 1, value.y);
  QElement<kQDType>::store(o_row + 2, value.z);
  QElement<kQDType>::store(o_row + 3, value.w);
  if (problem.lse != nullptr && quad == 0) {
    problem.lse[token * problem.lse_stride_token + head] = lse;
  }
}

// ---------------------------------------------------------------------------- the kernel

// Policy: Traits (kNumThreads, the shared-memory map), kQDType / kKVDType, Cta (state a CTA keeps
// across its items), run_item(args, index, end, shared, cta) and name().
template <class Policy>
__global__ void __launch_bounds__(Policy::Traits::kNumThreads)
    decode_kernel(const __grid_constant__ DecodeArgs args) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int32_t begin = args.worker_indptr[blockIdx.x];
  const int32_t end = args.worker_indptr[blockIdx.x + 1];
  // Programmatic launch (ptx/grid_dependency.cuh): the plan's lists were uploaded before the
  // previous kernel; everything else (q, K/V, o, the split scratch and merge counters) waits.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  typename Policy::Cta cta;
  for (int32_t index = begin; index < end; ++index) {
    Policy::run_item(args, index, end, shared, cta);
  }
}

// ---------------------------------------------------------------------------- host side

inline const char* decode_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    default: return "?";
  }
}

template <class Policy>
const char* decode_kernel_name() {
  static const auto name = [] {
    struct Text {
      char text[112];
    } result{};
    Policy::describe(result.text, sizeof(result.text));
    return result;
  }();
  return name.text;
}

template <class Policy>
KernelInstance decode_instance() {
  using Entry = KernelEntry<DecodeArgs, decode_kernel<Policy>, typename Policy::Traits,
                            decode_kernel_name<Policy>>;
  KernelInstance instance = Entry::instance(Policy::kQDType, Policy::kKVDType);
  instance.decode = &Entry::launch_workers;
  return instance;
}

}  // namespace tessera::detail::sm80
