// Shapes of the CUDA-core policy of the sm80 batch decode (decode_cuda_core.cuh), one traits
// struct per (instantiated head_dim, K/V element size, query rows per thread), and the kernel
// arguments.
//
// Decode is memory-bound: every K/V byte is read once and used by only q_per_request x group
// query rows, so the design goal is bytes in flight, not flops.
//  * Loader: the whole CTA streams tiles of kTileKeys keys (8 KiB of K and 8 KiB of V per stage)
//    through a kStages-deep cp.async ring in shared memory. Each key row is a contiguous
//    head_dim x element piece of the cache (strided by num_kv_heads * head_dim in NHD), copied as
//    16-byte chunks by consecutive threads, so every request is a coalesced row read. With 3
//    stages, two tiles (32 KiB) are in flight per CTA while it computes on the third, and 3-4
//    CTAs per SM keep ~100 KiB in flight per SM - comfortably above the ~40 KiB that the
//    bandwidth-latency product of an H200 SM asks for.
//  * Compute (CUDA cores, fp32 FMA): a "row slot" of kLanesPerRow lanes owns kVec features each
//    of a key row, so one 16-byte (fp16/bf16) or 8-byte (fp8) shared load per lane fetches a
//    key row slice; the slot holds kRowsPerThread query rows in registers and applies every
//    fetched K/V slice to all of them (one shared-memory read and one dequantisation of a K/V
//    row serves every query row of the slot). Dot products are reduced across the slot with
//    xor shuffles. The CTA's kSlots slots split the packed query rows of a work item (row
//    groups) and, when there are fewer row groups than slots, the keys of each tile (key
//    partitions); partitions are merged through shared memory at the end of the item.
//  * Page indices are prefetched: the key-row offsets of tile i + kStages are computed (page
//    lookup + fast division by page_size) while tile i is being consumed, so no global-memory
//    latency sits between two tiles' copies.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {

template <int kHeadDim_, int kKVBytes_, int kRowsPerThread_>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;  // instantiated (padded) head_dim
  static constexpr int kKVBytes = kKVBytes_;  // bytes per K/V element: 2 (fp16/bf16), 1 (fp8)
  static constexpr int kRowsPerThread = kRowsPerThread_;  // query rows held by one row slot

  static constexpr int kNumThreads = 128;
  static constexpr int kNumWarps = kNumThreads / 32;

  // Compute mapping.
  static constexpr int kVec = 8;                             // features per lane of a key row
  static constexpr int kLanesPerRow = kHeadDim / kVec;       // 8 / 16 / 32 lanes per row slot
  static constexpr int kSlots = kNumThreads / kLanesPerRow;  // 16 / 8 / 4 row slots per CTA
  static constexpr int kRowsPerPass = kSlots * kRowsPerThread;
  static constexpr int kKeysPerChunk = 4;  // keys scored together (one max / rescale per chunk)

  // Loader and tiles.
  static constexpr int kRowBytes = kHeadDim * kKVBytes;
  static constexpr int kTileBytes = 8192;  // one K (and one V) tile of a stage
  static constexpr int kTileKeys = kTileBytes / kRowBytes;
  static constexpr int kChunksPerTile = kTileKeys / kKeysPerChunk;
  static constexpr int kStages = 3;
  static constexpr int kCopyBytes = 16;
  static constexpr int kCopiesPerRow = kRowBytes / kCopyBytes;
  static constexpr int kRowsPerCopyPass = kNumThreads / kCopiesPerRow;
  static constexpr int kCopyPasses = kTileKeys / kRowsPerCopyPass;

  // Shared-memory map (bytes from the dynamic shared-memory base):
  //   [K ring: kStages x kTileBytes][V ring: kStages x kTileBytes]   during the key loop
  //   [partition o: kSlots x kRowsPerThread x kHeadDim float][m][d]   at the end of an item
  //   [key-row offsets: kStages x kTileKeys x (k, v) int64]           always
  static constexpr size_t kRingBytes = size_t{kStages} * kTileBytes;
  static constexpr size_t kMergeOBytes = size_t{kSlots} * kRowsPerThread * kHeadDim * 4;
  static constexpr size_t kMergeStatBytes = size_t{kSlots} * kRowsPerThread * 4;
  static constexpr size_t kMergeBytes = kMergeOBytes + 2 * kMergeStatBytes;
  static constexpr size_t kWorkBytes = 2 * kRingBytes > kMergeBytes ? 2 * kRingBytes : kMergeBytes;
  static constexpr size_t kKRingOffset = 0;
  static constexpr size_t kVRingOffset = kRingBytes;
  static constexpr size_t kMergeOOffset = 0;
  static constexpr size_t kMergeMaxOffset = kMergeOBytes;
  static constexpr size_t kMergeSumOffset = kMergeOBytes + kMergeStatBytes;
  static constexpr size_t kKeyOffsetsOffset = kWorkBytes;
  static constexpr size_t kKeyOffsetsBytes = size_t{kStages} * kTileKeys * 2 * sizeof(int64_t);
  static constexpr size_t kSmemBytes = kKeyOffsetsOffset + kKeyOffsetsBytes;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "instantiated head_dims");
  static_assert(kKVBytes == 1 || kKVBytes == 2, "fp16/bf16 or fp8 K/V");
  static_assert(kLanesPerRow <= 32 && 32 % kLanesPerRow == 0, "a row slot lies inside a warp");
  static_assert(kTileKeys % kKeysPerChunk == 0, "whole chunks per tile");
  static_assert(kTileKeys <= kNumThreads, "one thread prefetches one key row's page");
  static_assert(kTileKeys % kRowsPerCopyPass == 0, "whole copy passes per tile");
  static_assert(kMergeOOffset % 16 == 0 && kKeyOffsetsOffset % 16 == 0, "16-byte alignment");
};

// Fast unsigned division by a run-time constant (page_size), Granlund & Montgomery,
// "Division by invariant integers using multiplication" (PLDI 1994), as in CUTLASS FastDivmod:
// q = (umulhi(n, multiplier) + n) >> shift, exact for 0 <= n < 2^31.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  static FastDivmod make(uint32_t divisor) {
    FastDivmod result;
    result.divisor = divisor;
    uint32_t shift = 0;
    while ((uint64_t{1} << shift) < divisor) ++shift;  // ceil(log2(divisor))
    result.shift = shift;
    result.multiplier = static_cast<uint32_t>(
        ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
    if (divisor == 1) result.multiplier = 0;  // (0 + n) >> 0 = n
    return result;
  }

#if defined(__CUDACC__)
  __device__ __forceinline__ void divmod(uint32_t n, uint32_t* quotient,
                                         uint32_t* remainder) const {
    *quotient = (__umulhi(n, multiplier) + n) >> shift;
    *remainder = n - *quotient * divisor;
  }
#endif
};

// Everything a decode kernel reads, built on the host and passed by value (__grid_constant__).
struct DecodeArgs {
  AttentionProblem problem;                // device pointers, strides, mask, scales
  const WorkItem* work = nullptr;          // uploaded plan.work
  const int32_t* worker_indptr = nullptr;  // [num_workers + 1]
  int32_t num_workers = 0;                 // grid size: one persistent CTA per worker
  float* partial_o = nullptr;              // [num_partial_rows, head_dim] float32 (split-KV pieces)
  float* partial_lse = nullptr;            // [num_partial_rows] float32, natural log
  // Fused merge of split pieces (finish_split_piece): uploaded plan.merges and one zeroed
  // counter per merge slot; null: the host launches the merge kernel instead.
  const MergeItem* merges = nullptr;
  int32_t* merge_counters = nullptr;
  FastDivmod page_size;
  // Scores are computed in base 2: score = dot(q * q_scale, k_stored). Without soft-cap
  // q_scale = sm_scale * k_scale * dequant * log2(e); with soft-cap q_scale folds 1 / cap in
  // instead and score = soft_cap_log2 * tanh(dot) with soft_cap_log2 = cap * log2(e).
  float q_scale = 0.0f;
  float soft_cap_log2 = 0.0f;
  bool soft_cap = false;
  // o = sum p v_stored / sum p * output_scale, output_scale = v_scale * dequant.
  float output_scale = 1.0f;
  // Largest power of two <= 16 dividing every K/V row address: the cp.async width.
  int32_t copy_granularity = 16;
};

}  // namespace tessera::detail::sm80
