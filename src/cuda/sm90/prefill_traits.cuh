// Shapes of the Hopper (sm_90a) prefill kernels, one traits struct per instantiated head_dim.
// Everything the kernel derives from its shape - warp roles, register budgets, fragment sizes,
// the shared-memory map and the mbarrier layout - is computed here.
//
// Roles (FlashAttention-3, arXiv:2407.08608, section 3.1): warpgroup 0 is the producer (one
// thread issues TMA copies; all four warps gather K/V rows with cp.async where TMA cannot be
// used), warpgroups 1..kConsumerWarpgroups are consumers, each owning 64 packed query rows of the
// CTA tile (wgmma's M). Registers move from the producer to the consumers with setmaxnreg.
//
// Choice of shapes (after FA3's tile_size_fwd_sm90; BLOCK_N a power of two so that key tiles
// align with pages, except the non-causal ragged d128 kernel):
//   d64 : 128 x 128, 2 consumer warpgroups, 2 K/V stages, O staged apart from Q   (113 KiB)
//   d128: 128 x 128, 2 consumer warpgroups, 2 K/V stages, O staged apart from Q   (209 KiB)
//         128 x 176 (ragged, no causal mask or window), O staged in Q's buffer   (224 KiB)
//         128 x 128 for pages of 8 .. 64 keys: V tiles page by page              (209 KiB)
//   d64 : 128 x 192 (ragged, no causal mask or window), O staged apart from Q    (144 KiB)
//   d256: 128 x  64, 2 consumer warpgroups, 2 K/V stages, O staged in Q's buffer  (209 KiB)
// One CTA per SM (227 KiB of shared memory per block at most on sm_90). FA3 runs d64 with three
// consumer warpgroups (192 rows); here the producer needs 56 registers (its paged and gather
// paths), which leaves 152 per consumer thread for three warpgroups - the d64 consumer spills
// there - so d64 uses two for now.
//
// Registers (nvcc 13.0, -Xptxas -v): 168 at entry for every kernel (the __launch_bounds__ cap
// of 384 threads), 0 bytes spilled; the producer runs in 56 after setmaxnreg.dec, the consumers
// in 224 after setmaxnreg.inc (56 x 128 + 224 x 256 = 64512 of 65536).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::detail::sm90 {

// Smallest page (in keys, and the multiple every page size must be) that paged K/V takes through
// per-page TMA boxes; smaller or odd pages go through the cp.async gather.
inline constexpr int kMinTmaPageKeys = 8;

template <int kHeadDim_, int kBlockN_, int kConsumerWarpgroups_, int kStages_,
          bool kSeparateOutputSmem_, bool kVPageBoxes_ = false>
struct PrefillShape {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSeparateOutputSmem = kSeparateOutputSmem_;
  // Paged caches with pages shorter than a key tile: a V tile is laid out page by page
  // ([page][column block][rows of the page][64], params.v_page_rows rows per page), so that one
  // TMA box copies a page's row across every column block (prefill_producer.cuh).
  static constexpr bool kVPageBoxes = kVPageBoxes_;
  // The per-tile integer work in its short form (prefill_tile.cuh), except at d64: it speeds up
  // short requests at d128 and d256 but slows d64, whose unchanged main loop ptxas then
  // schedules differently (docs/log/PERF.md, 2026-12-04).
  static constexpr bool kNarrowTileMath = kHeadDim != 64;

  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;  // packed query rows per CTA tile
  static constexpr int kProducerThreads = kWarpgroupThreads;
  static constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kNumThreads = kProducerThreads + kConsumerThreads;

  // setmaxnreg budgets (FA3 uses 24 / 240; our producer's paged-table and gather code spills
  // below 56).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 224 : 152;
  static_assert(kProducerRegisters * kProducerThreads + kConsumerRegisters * kConsumerThreads <=
                    65536,
                "the register budgets exceed the 64K registers of an SM");

  // Per-thread fragments (wgmma m64nNk16, see ptx/wgmma.cuh).
  static constexpr int kScoreRegisters = kBlockN / 2;    // S = Q K^T accumulator, N = BLOCK_N
  static constexpr int kOutputRegisters = kHeadDim / 2;  // O accumulator, N = head_dim
  static constexpr int kHeadSteps = kHeadDim / 16;       // k-steps of Q K^T
  static constexpr int kKeySteps = kBlockN / 16;         // k-steps of P V
  static constexpr int kColumnBlocks = kHeadDim / 64;    // 128-byte column blocks of a row

  // Shared memory: every tile is kColumnBlocks blocks of [rows][64] 16-bit elements, 128-byte
  // rows, 128-byte swizzle (what the TMA maps write; see ptx/wgmma.cuh).
  static constexpr size_t kRowBytes = 128;
  static constexpr size_t kQBlockBytes = size_t{kBlockM} * kRowBytes;
  static constexpr size_t kQBytes = kQBlockBytes * kColumnBlocks;
  static constexpr size_t kKVBlockBytes = size_t{kBlockN} * kRowBytes;
  static constexpr size_t kKVStageBytes = kKVBlockBytes * kColumnBlocks;
  static constexpr size_t kQOffset = 0;
  static constexpr size_t kKOffset = kQOffset + kQBytes;
  static constexpr size_t kVOffset = kKOffset + kStages * kKVStageBytes;
  static constexpr size_t kOOffset =
      kSeparateOutputSmem ? kVOffset + kStages * kKVStageBytes : kQOffset;
  static constexpr size_t kTilesEnd =
      kSeparateOutputSmem ? kOOffset + kQBytes : kVOffset + kStages * kKVStageBytes;
  // Producer-side page table (paged caches): page ids of kPageTableKeys consecutive keys per
  // slot (one page per key at page_size 1), double-buffered (prefill_producer.cuh).
  static constexpr int kPageTableKeys = 2048 / kBlockN * kBlockN;
  static constexpr int kPageTableEntries = kPageTableKeys + 8;
  static constexpr size_t kPageTableOffset = kTilesEnd;
  static constexpr size_t kPageTableBytes = 2 * size_t{kPageTableEntries} * sizeof(int32_t);
  // mbarriers: q_full, q_empty, then k_full, k_empty, v_full, v_empty per stage.
  static constexpr size_t kBarrierOffset = kPageTableOffset + kPageTableBytes;
  static constexpr int kNumBarriers = 2 + 4 * kStages;
  static constexpr size_t kBarrierBytes = size_t{kNumBarriers} * 8;
  // The dynamic shared-memory window is only guaranteed 16-byte alignment; the kernel rounds
  // its base up to 1024 (the swizzle atom), which this slack pays for.
  static constexpr size_t kAlignmentSlack = 1024;
  static constexpr size_t kSmemBytes = kBarrierOffset + kBarrierBytes + kAlignmentSlack;

  static_assert(kHeadDim % 64 == 0, "rows are whole 128-byte column blocks");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256 && kBlockN >= 64, "wgmma N / TMA box rows");
  static_assert(kHeadDim <= 256, "wgmma N of P V");
  static_assert(kQBlockBytes % 1024 == 0 && kKVBlockBytes % 1024 == 0,
                "every tile block starts on a swizzle atom");
  static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory opt-in of sm_90");
  static_assert(kStages >= 1, "at least one K/V stage");
  static_assert(kPageTableKeys % kBlockN == 0, "page-table chunks hold whole key tiles");
};

template <int kHeadDim>
struct PrefillTraits;
template <>
struct PrefillTraits<64> : PrefillShape<64, 128, 2, 2, true> {};
template <>
struct PrefillTraits<128> : PrefillShape<128, 128, 2, 2, true> {};
template <>
struct PrefillTraits<256> : PrefillShape<256, 64, 2, 2, false> {};

// d128 with 176-key tiles (FA3's non-causal d128 shape): 37% more GEMM per softmax round trip
// and ping-pong hand-over than 128-key tiles. O is staged in Q's buffer so the two 44 KiB K/V
// stages fit (224 KiB). Chosen by run() for ragged K/V without a causal mask, window or
// soft-cap: paged caches keep 128-key tiles (pages of 32 or 64 keys do not tile 176), causal
// tiles would cross the diagonal more often, and the soft-cap variant spills at this width.
struct PrefillTraitsD128Wide : PrefillShape<128, 176, 2, 2, false> {};

// d64 with 192-key tiles for the same problems as the d128 176-key kernel (ragged K/V, no causal
// mask, window or soft-cap, long requests): each softmax round trip and ping-pong hand-over
// carries 50% more GEMM than with 128-key tiles (S 96 + P 48 + O 32 registers per thread).
// 224-key tiles spill (48 bytes).
struct PrefillTraitsD64Wide : PrefillShape<64, 192, 2, 2, true> {};

// d128 for paged caches with pages of 8 .. 64 keys: V tiles page by page, one TMA box per page
// for both column blocks (8 boxes of 4 KiB per V tile at page 16 instead of 16 of 2 KiB; K keeps
// its per-block boxes, the layout Q K^T reads). Chosen by run() for such caches.
struct PrefillTraitsD128Paged : PrefillShape<128, 128, 2, 2, true, true> {};

// Named barriers (0 is __syncthreads): the consumers' epilogue barrier, the producer
// warpgroup's own, and one per consumer warpgroup for the ping-pong schedule.
inline constexpr uint32_t kEpilogueBarrier = 1;
inline constexpr uint32_t kProducerBarrier = 2;
inline constexpr uint32_t kSchedulerBarrierBase = 3;

}  // namespace tessera::detail::sm90
