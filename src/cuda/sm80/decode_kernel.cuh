// The sm80 batch decode kernel: persistent CTAs walk their worker's work items; each item is
// (request, kv head, query tokens, key range) and covers the whole GQA group of its kv head, so
// every K/V row is read from memory once per item. Shapes and the shared-memory map are in
// decode_traits.cuh, element conversions in decode_dequant.cuh.
//
// Per item:
//   1. geometry: the item's packed query rows (token t, group head g -> row t * group + g) and
//      the union of their visible key ranges (causal / window clip it; nothing outside is read);
//   2. passes of up to kRowsPerPass rows (one pass unless q_per_request x group is large): each
//      row slot loads its query rows into registers, pre-scaled so scores come out in base 2;
//   3. the key loop: a kStages-deep cp.async ring of K/V tiles, page lookups one tile ahead,
//      scores per chunk of kKeysPerChunk keys, online softmax, P x V on CUDA cores;
//   4. key partitions of a row group are merged in shared memory and the rows are written: o in
//      q's dtype and natural-log lse, or float partials for a split-KV piece.
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
#include "cuda/ptx/math.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/shuffle.cuh"
#include "cuda/sm80/decode_dequant.cuh"
#include "cuda/sm80/decode_traits.cuh"

namespace tessera::detail::sm80 {

// ---------------------------------------------------------------------------- small helpers

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
// where tanh rounds to +-1 in float, so the division never sees an infinite denominator.
__device__ __forceinline__ float soft_cap_tanh(float x) {
  constexpr float kTwoLog2e = 2.0f * std::numbers::log2e_v<float>;
  constexpr float kSaturation = 15.0f;
  const float clamped = fminf(fmaxf(x, -kSaturation), kSaturation);
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

// Issues the copies of one K/V tile into ring stage `stage`, whose key-row offsets sit in the
// offsets slot of the same index. Thread t copies chunk t % kCopiesPerRow of rows
// t / kCopiesPerRow + pass * kRowsPerCopyPass: consecutive threads, consecutive 16 bytes.
template <class Traits>
__device__ __forceinline__ void issue_tile_copies(const DecodeArgs& args, uint8_t* shared,
                                                  const longlong2* key_offsets, int stage) {
  const KVSource& kv = args.problem.kv;
  const auto* k_base = static_cast<const uint8_t*>(kv.k);
  const auto* v_base = static_cast<const uint8_t*>(kv.v);
  const int chunk = threadIdx.x % Traits::kCopiesPerRow;
  const int32_t chunk_byte = chunk * Traits::kCopyBytes;
  const int32_t row_bytes = args.problem.head_dim * Traits::kKVBytes;  // real, not padded
  const uint32_t chunk_bytes =
      static_cast<uint32_t>(max(0, min(Traits::kCopyBytes, row_bytes - chunk_byte)));  // 0, 8 or 16
  uint8_t* k_stage = shared + Traits::kKRingOffset + stage * Traits::kTileBytes;
  uint8_t* v_stage = shared + Traits::kVRingOffset + stage * Traits::kTileBytes;
  const longlong2* offsets = key_offsets + stage * Traits::kTileKeys;
#pragma unroll
  for (int pass = 0; pass < Traits::kCopyPasses; ++pass) {
    const int row = threadIdx.x / Traits::kCopiesPerRow + pass * Traits::kRowsPerCopyPass;
    const longlong2 offset = offsets[row];
    const uint32_t valid = offset.x >= 0 ? chunk_bytes : 0u;
    const int64_t k_byte = offset.x * Traits::kKVBytes + chunk_byte;
    const int64_t v_byte = offset.y * Traits::kKVBytes + chunk_byte;
    const int shared_byte = row * Traits::kRowBytes + chunk_byte;
    copy_key_chunk(k_stage + shared_byte, valid > 0 ? k_base + k_byte : k_base, valid,
                   args.copy_granularity, kv.k);
    copy_key_chunk(v_stage + shared_byte, valid > 0 ? v_base + v_byte : v_base, valid,
                   args.copy_granularity, kv.v);
  }
}

// ---------------------------------------------------------------------------- compute

// The query rows one row slot holds, with their softmax state.
template <class Traits>
struct SlotRows {
  static constexpr int kRows = Traits::kRowsPerThread;
  float q[kRows][Traits::kVec];  // pre-scaled query features of this lane
  float o[kRows][Traits::kVec];  // unnormalised output features of this lane
  float max_score[kRows];        // running max of the base-2 scores (-inf: none yet)
  float sum_exp[kRows];          // running sum of 2^(score - max_score)
  int32_t first_key[kRows];      // visible keys [first_key, last_key); empty for padding rows
  int32_t last_key[kRows];
};

template <class Traits, DType kQDType>
__device__ __forceinline__ void load_slot_rows(const DecodeArgs& args, const DecodeItem& item,
                                               int32_t first_row, bool active, int lane,
                                               SlotRows<Traits>& rows) {
  const AttentionProblem& problem = args.problem;
#pragma unroll
  for (int i = 0; i < Traits::kRowsPerThread; ++i) {
    const int32_t row = first_row + i;
    rows.max_score[i] = -INFINITY;
    rows.sum_exp[i] = 0.0f;
    rows.first_key[i] = rows.last_key[i] = 0;
#pragma unroll
    for (int e = 0; e < Traits::kVec; ++e) rows.q[i][e] = rows.o[i][e] = 0.0f;
    if (!active || row >= item.rows) continue;
    const int32_t t = row / item.group;
    const int32_t head = item.work.kv_head * item.group + (row - t * item.group);
    const int64_t token = problem.q_begin(item.work.request) + item.work.q_start + t;
    const auto* q_row = static_cast<const uint16_t*>(problem.q) + token * problem.q_stride_token +
                        head * problem.q_stride_head;
#pragma unroll
    for (int e = 0; e < Traits::kVec; ++e) {
      const int feature = lane * Traits::kVec + e;
      if (feature < problem.head_dim) {
        rows.q[i][e] = QElement<kQDType>::load(q_row + feature) * args.q_scale;
      }
    }
    item_visible_keys(problem, item, t, &rows.first_key[i], &rows.last_key[i]);
  }
}

// Scores, online softmax and P x V for the chunks of one tile that belong to this slot's key
// partition. The step count is the same for every slot of the CTA, so the shuffles inside are
// executed by all lanes of every warp; a slot without a chunk in a step masks all its keys.
template <class Traits, DType kKVDType>
__device__ __forceinline__ void consume_tile(const DecodeArgs& args, const uint8_t* k_stage,
                                             const uint8_t* v_stage, int32_t tile_first_key,
                                             int partitions, int partition, int lane,
                                             SlotRows<Traits>& rows) {
  constexpr int kRows = Traits::kRowsPerThread;
  constexpr int kKeys = Traits::kKeysPerChunk;
  const int steps = (Traits::kChunksPerTile + partitions - 1) / partitions;
  const int lane_byte = lane * Traits::kVec * Traits::kKVBytes;
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    const int chunk = partition + step * partitions;
    const bool chunk_valid = partition < partitions && chunk < Traits::kChunksPerTile;
    const int chunk_row = (chunk_valid ? chunk : 0) * kKeys;
    const int32_t chunk_first_key = tile_first_key + chunk * kKeys;

    float score[kKeys][kRows];
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      float key[Traits::kVec];
      KVElement<kKVDType>::load8(k_stage + (chunk_row + k) * Traits::kRowBytes + lane_byte, key);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < Traits::kVec; ++e) dot = fmaf(rows.q[i][e], key[e], dot);
        score[k][i] = row_slot_sum<Traits::kLanesPerRow>(dot);
      }
    }

    float probability[kKeys][kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float chunk_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        float s = args.soft_cap ? args.soft_cap_log2 * soft_cap_tanh(score[k][i]) : score[k][i];
        const int32_t key_index = chunk_first_key + k;
        const bool visible =
            chunk_valid && key_index >= rows.first_key[i] && key_index < rows.last_key[i];
        s = visible ? s : -INFINITY;
        score[k][i] = s;
        chunk_max = fmaxf(chunk_max, s);
      }
      const float new_max = fmaxf(rows.max_score[i], chunk_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // no -inf - -inf
      const float rescale = ptx::ex2_approx(rows.max_score[i] - base);
      rows.max_score[i] = new_max;
      float sum = rows.sum_exp[i] * rescale;
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        probability[k][i] = ptx::ex2_approx(score[k][i] - base);
        sum += probability[k][i];
      }
      rows.sum_exp[i] = sum;
#pragma unroll
      for (int e = 0; e < Traits::kVec; ++e) rows.o[i][e] *= rescale;
    }

#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      float value[Traits::kVec];
      KVElement<kKVDType>::load8(v_stage + (chunk_row + k) * Traits::kRowBytes + lane_byte, value);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
#pragma unroll
        for (int e = 0; e < Traits::kVec; ++e) {
          rows.o[i][e] = fmaf(probability[k][i], value[e], rows.o[i][e]);
        }
      }
    }
  }
}

// Streams the item's key range through the ring and consumes it.
template <class Traits, DType kKVDType>
__device__ __forceinline__ void run_key_loop(const DecodeArgs& args, const DecodeItem& item,
                                             uint8_t* shared, int partitions, int partition,
                                             int lane, SlotRows<Traits>& rows) {
  constexpr int kStages = Traits::kStages;
  constexpr int kTileKeys = Traits::kTileKeys;
  auto* key_offsets = reinterpret_cast<longlong2*>(shared + Traits::kKeyOffsetsOffset);
  const int32_t num_tiles = (item.key_end - item.key_begin + kTileKeys - 1) / kTileKeys;

  // Prologue: offsets of tiles 0 .. kStages-1 (all their page lookups in flight at once), then
  // the copies of tiles 0 .. kStages-2.
  for (int index = threadIdx.x; index < kStages * kTileKeys; index += Traits::kNumThreads) {
    const PrefetchedKey key = prefetch_key(args, item, int64_t{item.key_begin} + index);
    key_offsets[index] = key_row_offsets(args, item, key);
  }
  __syncthreads();
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (stage < num_tiles) issue_tile_copies<Traits>(args, shared, key_offsets, stage);
    ptx::cp_async_commit_group();
  }

#pragma unroll 1
  for (int32_t tile = 0; tile < num_tiles; ++tile) {
    // Tile `tile` has landed once at most kStages-2 younger groups are pending; the barrier
    // makes every thread's copies visible and retires the stage consumed last iteration.
    ptx::cp_async_wait_group<kStages - 2>();
    __syncthreads();
    const int stage = tile % kStages;
    // Page lookup of tile + kStages now; its offsets are stored after this tile's compute,
    // hiding the global-memory latency behind it.
    PrefetchedKey next_key{-1, 0};
    if (threadIdx.x < kTileKeys) {
      next_key = prefetch_key(
          args, item, int64_t{item.key_begin} + int64_t{tile + kStages} * kTileKeys + threadIdx.x);
    }
    const int32_t refill = tile + kStages - 1;
    if (refill < num_tiles) issue_tile_copies<Traits>(args, shared, key_offsets, refill % kStages);
    ptx::cp_async_commit_group();

    consume_tile<Traits, kKVDType>(args, shared + Traits::kKRingOffset + stage * Traits::kTileBytes,
                                   shared + Traits::kVRingOffset + stage * Traits::kTileBytes,
                                   item.key_begin + tile * kTileKeys, partitions, partition, lane,
                                   rows);

    // Offsets slot `stage` held tile `tile`'s offsets, read when its copies were issued.
    if (threadIdx.x < kTileKeys) {
      key_offsets[stage * kTileKeys + threadIdx.x] = key_row_offsets(args, item, next_key);
    }
  }
  ptx::cp_async_wait_group<0>();
  __syncthreads();  // the ring is free: the merge below reuses it
}

// ---------------------------------------------------------------------------- epilogue

// Writes packed row `row` of the item, features [4 quad, 4 quad + 4): o (q dtype) and lse at
// the problem's strides, or a float partial for a split-KV piece.
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

// Merges the key partitions of every row group of the pass and writes the rows.
template <class Traits, DType kQDType>
__device__ __forceinline__ void merge_and_store(const DecodeArgs& args, const DecodeItem& item,
                                                uint8_t* shared, int32_t first_group, int groups,
                                                int partitions, int slot, int lane,
                                                const SlotRows<Traits>& rows) {
  constexpr int kRows = Traits::kRowsPerThread;
  auto* merge_o = reinterpret_cast<float*>(shared + Traits::kMergeOOffset);
  auto* merge_max = reinterpret_cast<float*>(shared + Traits::kMergeMaxOffset);
  auto* merge_sum = reinterpret_cast<float*>(shared + Traits::kMergeSumOffset);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float* destination = merge_o + (slot * kRows + i) * Traits::kHeadDim + lane * Traits::kVec;
#pragma unroll
    for (int e = 0; e < Traits::kVec; e += 4) {
      *reinterpret_cast<float4*>(destination + e) =
          make_float4(rows.o[i][e], rows.o[i][e + 1], rows.o[i][e + 2], rows.o[i][e + 3]);
    }
    if (lane == 0) {
      merge_max[slot * kRows + i] = rows.max_score[i];
      merge_sum[slot * kRows + i] = rows.sum_exp[i];
    }
  }
  __syncthreads();

  const int32_t rows_in_pass = min(groups * kRows, item.rows - first_group * kRows);
  const int32_t quads = args.problem.head_dim / 4;
  constexpr float kLn2 = std::numbers::ln2_v<float>;
  for (int32_t task = threadIdx.x; task < rows_in_pass * quads; task += Traits::kNumThreads) {
    const int32_t local_row = task / quads;
    const int32_t quad = task - local_row * quads;
    const int group_index = local_row / kRows, i = local_row % kRows;
    float best = -INFINITY;
    for (int p = 0; p < partitions; ++p) {
      best = fmaxf(best, merge_max[(p * groups + group_index) * kRows + i]);
    }
    float4 accumulator = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float total = 0.0f;
    if (best != -INFINITY) {
      for (int p = 0; p < partitions; ++p) {
        const int state = (p * groups + group_index) * kRows + i;
        const float weight = ptx::ex2_approx(merge_max[state] - best);
        total += weight * merge_sum[state];
        const float4 part =
            *reinterpret_cast<const float4*>(merge_o + state * Traits::kHeadDim + quad * 4);
        accumulator.x += weight * part.x;
        accumulator.y += weight * part.y;
        accumulator.z += weight * part.z;
        accumulator.w += weight * part.w;
      }
    }
    const float scale = total > 0.0f ? args.output_scale / total : 0.0f;
    accumulator.x *= scale;
    accumulator.y *= scale;
    accumulator.z *= scale;
    accumulator.w *= scale;
    const float lse = total > 0.0f ? (best + __log2f(total)) * kLn2 : -INFINITY;
    store_output_quad<kQDType>(args, item, first_group * kRows + local_row, quad, accumulator, lse);
  }
  __syncthreads();  // shared memory is reused by the next pass / item
}

// ---------------------------------------------------------------------------- the kernel

template <class Traits, DType kQDType, DType kKVDType>
__device__ __forceinline__ void decode_work_item(const DecodeArgs& args, const WorkItem& work,
                                                 uint8_t* shared) {
  constexpr int kRows = Traits::kRowsPerThread;
  const DecodeItem item = make_decode_item(args, work);
  const int slot = threadIdx.x / Traits::kLanesPerRow;
  const int lane = threadIdx.x % Traits::kLanesPerRow;
  const int32_t row_groups = (item.rows + kRows - 1) / kRows;
  for (int32_t first_group = 0; first_group < row_groups; first_group += Traits::kSlots) {
    // Row groups of this pass take the first slots; when there are fewer groups than slots the
    // slots left over become extra key partitions of the groups (partition p of group g is slot
    // p * groups + g); slots past partitions * groups idle with empty rows.
    const int groups = min(Traits::kSlots, row_groups - first_group);
    const int partitions = Traits::kSlots / groups;
    const int slot_group = slot % groups, partition = slot / groups;
    const bool active = partition < partitions;
    SlotRows<Traits> rows;
    load_slot_rows<Traits, kQDType>(args, item, (first_group + slot_group) * kRows, active, lane,
                                    rows);
    run_key_loop<Traits, kKVDType>(args, item, shared, partitions, partition, lane, rows);
    merge_and_store<Traits, kQDType>(args, item, shared, first_group, groups, partitions, slot,
                                     lane, rows);
  }
}

template <class Traits, DType kQDType, DType kKVDType>
__global__ void __launch_bounds__(Traits::kNumThreads)
    decode_kernel(const __grid_constant__ DecodeArgs args) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int32_t begin = args.worker_indptr[blockIdx.x];
  const int32_t end = args.worker_indptr[blockIdx.x + 1];
  for (int32_t index = begin; index < end; ++index) {
    decode_work_item<Traits, kQDType, kKVDType>(args, args.work[index], shared);
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

template <class Traits, DType kQDType, DType kKVDType>
const char* decode_kernel_name() {
  static const auto name = [] {
    struct Text {
      char text[96];
    } result{};
    std::snprintf(result.text, sizeof(result.text),
                  "sm80::decode_kernel<d%d, q %s, kv %s, rows %d>", Traits::kHeadDim,
                  decode_dtype_name(kQDType), decode_dtype_name(kKVDType), Traits::kRowsPerThread);
    return result;
  }();
  return name.text;
}

template <class Traits, DType kQDType, DType kKVDType>
using DecodeEntry = KernelEntry<DecodeArgs, decode_kernel<Traits, kQDType, kKVDType>, Traits,
                                decode_kernel_name<Traits, kQDType, kKVDType>>;

template <int kHeadDim, DType kQDType, DType kKVDType, int kRowsPerThread>
KernelInstance decode_instance() {
  using Traits = DecodeTraits<kHeadDim, KVElement<kKVDType>::kBytes, kRowsPerThread>;
  using Entry = DecodeEntry<Traits, kQDType, kKVDType>;
  KernelInstance instance = Entry::instance(kQDType, kKVDType);
  instance.decode = &Entry::launch_workers;
  return instance;
}

// One row per row-slot height: q fp16/bf16 x K/V (q's dtype, e4m3, e5m2). The fp8 instances
// have other traits (1-byte elements) but the same rows and threads; the row shows the 2-byte
// one.
template <int kHeadDim, int kRowsPerThread>
KernelRow decode_row() {
  using Traits = DecodeTraits<kHeadDim, 2, kRowsPerThread>;
  KernelRow row;
  row.family = KernelFamily::kSm80Decode;
  row.shape.head_dim = Traits::kHeadDim;
  row.shape.num_threads = Traits::kNumThreads;
  row.shape.smem_bytes = Traits::kSmemBytes;
  row.shape.rows = Traits::kRowsPerThread;
  constexpr DType kF16 = DType::kFloat16, kB16 = DType::kBFloat16;
  constexpr DType kE4M3 = DType::kFloat8E4M3, kE5M2 = DType::kFloat8E5M2;
  row.instances = {decode_instance<kHeadDim, kF16, kF16, kRowsPerThread>(),
                   decode_instance<kHeadDim, kF16, kE4M3, kRowsPerThread>(),
                   decode_instance<kHeadDim, kF16, kE5M2, kRowsPerThread>(),
                   decode_instance<kHeadDim, kB16, kB16, kRowsPerThread>(),
                   decode_instance<kHeadDim, kB16, kE4M3, kRowsPerThread>(),
                   decode_instance<kHeadDim, kB16, kE5M2, kRowsPerThread>()};
  return row;
}

// The three row-slot heights (1, 2, 4) of one head_dim bucket: 18 kernels.
template <int kHeadDim>
void add_decode_rows(KernelRows& rows) {
  rows.push_back(decode_row<kHeadDim, 1>());
  rows.push_back(decode_row<kHeadDim, 2>());
  rows.push_back(decode_row<kHeadDim, 4>());
}

}  // namespace tessera::detail::sm80
