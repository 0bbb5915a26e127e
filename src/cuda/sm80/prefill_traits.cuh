// Tile shapes of the sm80 FlashAttention-2 style prefill kernels, one traits struct per
// instantiated head_dim. Everything a kernel derives from its shape (fragment counts, loader
// mapping, shared-memory map) is computed here, so the kernel itself has no magic numbers.
//
// Packed rows: a CTA tile holds BLOCK_M "packed" query rows of one kv head: packed row r of a
// work item is token q_start + r / group of the request and qo head kv_head * group + r % group
// (FlashInfer-style GQA packing), so every K/V tile loaded into shared memory serves the whole
// query-head group.
//
// Choice of shapes (FlashAttention-2 forward, csrc/flash_attn/src/flash_fwd_launch_template.h):
//   d64  : 128 x 64, 4 warps x 32 rows, 2 K/V stages   (smem 52 KiB)
//   d128 : 128 x 64, 4 warps x 32 rows, 1 K/V stage    (smem 68 KiB; FA2's sm80 d128 shape)
//   d256 :  64 x 64, 4 warps x 16 rows, 1 K/V stage    (smem 99 KiB; FA2's sm86/89 d256 shape,
//          which also fits the 99 KiB per-block limit of Ada and gives 2 CTAs/SM on Hopper)
// A warp owning 32 rows reuses every K/V fragment it loads from shared memory for two mma row
// blocks, halving shared-memory traffic per flop; at d256 its 32 x 256 f32 accumulator would not
// fit in registers, so d256 uses 16 rows per warp.
// "Stages" counts K (and V) buffers. K and V have separate buffers and the pipeline refills each
// as soon as the warps are done with it (K during softmax and P x V, V during the next Q x K^T),
// so even one stage double-buffers the key stream, as in FA2. d128 keeps one stage so that
// 2 CTAs fit in the 164 KiB of an A100 SM (two stages would need 101 KiB per CTA).
//
// Registers per thread / dynamic smem per CTA (nvcc 13.0 -Xptxas -v; identical for fp16 and
// bf16; 0 bytes spilled, 0 bytes stack in every variant). Refresh when shapes change.
//                 sm_80            sm_90a           smem bytes
//   d64           235 (cap: 223)   237 (cap: 226)    53248
//   d128          252 (cap: 255)   252 (cap: 255)    69632
//   d256          248 (cap: 244)   250 (cap: 252)   101376
// ("cap" = the soft-cap variant.) At <= 255 registers and 128 threads, 2 CTAs fit the 64K
// registers of an SM; with these smem sizes that is 2 CTAs/SM on A100 and H100/H200 for every
// head_dim (1 for d256 on A100, whose SM has 164 KiB).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::detail::sm80 {

// One packed query row of the current CTA tile, written once per tile (prefill_kernel.cuh).
struct PrefillRowInfo {
  int32_t token;      // global query row (q/o/lse token index); -1: padding row past the tile
  int32_t head;       // qo head
  int32_t first_key;  // visible keys of this row within the work item: [first_key, last_key)
  int32_t last_key;
};

// Element offsets of one key row of a K/V tile (paged gather / ragged rows, head included);
// -1: no key (past the end of the range) -> zero-filled.
struct PrefillKeyOffsets {
  int64_t k;
  int64_t v;
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNumWarps_, int kStages_,
          int kMinCtasPerSm_, int kVariant_ = 0>
struct PrefillShape {
  // Run-time selectable variant (TESSERA_PREFILL_VARIANT, prefill_api.hpp); 0 = the default
  // shapes. Variants > 0 also use the tree reductions of online_softmax (kTreeReduce).
  static constexpr int kVariant = kVariant_;
  static constexpr bool kTreeReduce = kVariant_ != 0;
  // Compiled for sm_90+ only (its sm_80 build would spill); on older devices the variant
  // selection falls back to variant 0 (select_prefill_variant) and the sm_80 body traps.
  static constexpr bool kNeedsSm90 = false;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumWarps = kNumWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;  // __launch_bounds__ hint
  static constexpr int kNumThreads = kNumWarps * 32;

  // mma.m16n8k16 fragment counts per warp.
  static constexpr int kWarpRows = kBlockM / kNumWarps;  // query rows owned by one warp
  static constexpr int kMmaRowBlocks = kWarpRows / 16;   // 16-row A fragments per warp
  static constexpr int kScoreCols = kBlockN / 8;         // 8-key accumulator columns of S
  static constexpr int kOutputCols = kHeadDim / 8;       // 8-wide accumulator columns of O
  static constexpr int kHeadSteps = kHeadDim / 16;       // k-steps of Q x K^T
  static constexpr int kKeySteps = kBlockN / 16;         // k-steps of P x V

  // Shared-memory tiles: rows of kHeadDim 16-bit elements = kChunksPerRow 16-byte chunks.
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kRowBytes = kHeadDim * 2;
  // Loader: 8 consecutive lanes copy 8 consecutive chunks (128 contiguous bytes) of one row, so
  // each quarter warp is one coalesced 128-byte request and writes a full swizzled bank line.
  static constexpr int kLoaderLanesPerRow = 8;
  static constexpr int kLoaderChunksPerLane = kChunksPerRow / kLoaderLanesPerRow;
  static constexpr int kLoaderRowsPerPass = kNumThreads / kLoaderLanesPerRow;

  // Key offset table: one slot per tile in flight (see the pipeline in prefill_kernel.cuh).
  static constexpr int kOffsetSlots = kStages < 2 ? 2 : kStages;

  // Shared-memory map (bytes from the dynamic shared-memory base).
  static constexpr size_t kQTileBytes = size_t{kBlockM} * kRowBytes;
  static constexpr size_t kKVTileBytes = size_t{kBlockN} * kRowBytes;
  static constexpr size_t kQOffset = 0;
  static constexpr size_t kKOffset = kQOffset + kQTileBytes;
  static constexpr size_t kVOffset = kKOffset + kStages * kKVTileBytes;
  static constexpr size_t kKeyOffsetsOffset = kVOffset + kStages * kKVTileBytes;
  static constexpr size_t kRowInfoOffset =
      kKeyOffsetsOffset + size_t{kOffsetSlots} * kBlockN * sizeof(PrefillKeyOffsets);
  static constexpr size_t kSmemBytes = kRowInfoOffset + size_t{kBlockM} * sizeof(PrefillRowInfo);

  static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory opt-in of sm_90");
  static_assert(kHeadDim % 64 == 0, "swizzle and loader need rows of 8k chunks");
  static_assert(kWarpRows % 16 == 0 && kMmaRowBlocks >= 1, "a warp owns whole 16-row blocks");
  static_assert(kBlockN % 16 == 0, "P x V consumes keys 16 at a time");
  static_assert(kBlockM % kLoaderRowsPerPass == 0 && kBlockN % kLoaderRowsPerPass == 0,
                "loader passes must tile Q and K/V exactly");
  static_assert(kStages >= 1 && 2 * kStages - 2 <= 7, "cp.async.wait_group takes 0..7");
  static_assert(kKOffset % 128 == 0 && kVOffset % 128 == 0 && kKeyOffsetsOffset % 128 == 0,
                "tiles start on 128-byte lines so the swizzle maps chunks to distinct banks");
};

template <int kHeadDim>
struct PrefillTraits;

template <>
struct PrefillTraits<64> : PrefillShape<64, 128, 64, 4, 2, 2> {};
template <>
struct PrefillTraits<128> : PrefillShape<128, 128, 64, 4, 1, 1> {};
template <>
struct PrefillTraits<256> : PrefillShape<256, 64, 64, 4, 1, 1> {};

// Tuning variants, selected at run time by TESSERA_PREFILL_VARIANT (read once on the host; see
// prefill_variant() in prefill_api.hpp). Variant 0 is PrefillTraits above. Shapes that need more
// shared memory than an A100 gives a block are refused by the launcher there (use variant 0).
//   variant 1: d64  128 x 128, 4 warps x 32 rows, 2 stages (FA2's non-causal d64 tile)
//              d128 128 x  64, 4 warps x 32 rows, 1 stage  (= variant 0 + tree reductions)
//              d256 128 x  64, 8 warps x 16 rows, 1 stage  (FA2's Hopper d256 tile, 1 CTA/SM)
//   variant 2: d64  128 x  64, 8 warps x 16 rows, 2 stages, 2 CTAs/SM (16 warps per SM)
//              d128 128 x  64, 4 warps x 32 rows, 2 stages (Hopper-class smem, 2 CTAs/SM)
//              d256 128 x  64, 8 warps x 16 rows, 2 stages (1 CTA/SM)
// Registers (nvcc 13.0 -Xptxas -v, plain / soft-cap, sm_90a; 0 spills) and smem per CTA:
//   d64  v1 255/255 88064 B (2 CTAs/SM)   v2 128/128 53248 B (2 CTAs x 8 warps/SM)
//   d128 v1 253/251 69632 B (2 CTAs/SM)   v2 255/(v1's) 102400 B (2 CTAs/SM on sm_90)
//   d256 v1 252/255 135168 B (1 CTA/SM)   v2 253/255 200704 B (1 CTA/SM)
template <int kHeadDim, int kVariant>
struct PrefillVariantTraits;
template <>
struct PrefillVariantTraits<64, 1> : PrefillShape<64, 128, 128, 4, 2, 2, 1> {};
template <>
struct PrefillVariantTraits<64, 2> : PrefillShape<64, 128, 64, 8, 2, 2, 2> {};
template <>
struct PrefillVariantTraits<128, 1> : PrefillShape<128, 128, 64, 4, 1, 1, 1> {};
// d128 has no variant 2: its 2-stage shape was slower than variant 0 and spills once the
// softmax exponent is computed without FMA; variant 2 selects variant 1 at d128
// (prefill_kernel.cuh).
template <>
struct PrefillVariantTraits<256, 1> : PrefillShape<256, 128, 64, 8, 1, 1, 1> {};
template <>
struct PrefillVariantTraits<256, 2> : PrefillShape<256, 128, 64, 8, 2, 1, 2> {};

// Traits of the soft-cap kernel paired with a shape (a hook for shapes whose soft-cap math would
// exceed 255 registers; none needs it today).
template <class Traits>
struct PrefillSoftCapTraits {
  using type = Traits;
};

// Query rows per work item that the planner should use for a head_dim served by these kernels.
constexpr int prefill_block_m(int head_dim_bucket) {
  switch (head_dim_bucket) {
    case 64: return PrefillTraits<64>::kBlockM;
    case 128: return PrefillTraits<128>::kBlockM;
    case 256: return PrefillTraits<256>::kBlockM;
    default: return 0;
  }
}

}  // namespace tessera::detail::sm80
