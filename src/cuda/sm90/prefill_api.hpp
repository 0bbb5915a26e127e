// Host-side interface of the Hopper (sm_90a) prefill kernels: what the launcher in
// cuda/attention.cu and the planner knobs in cuda/device.cu need, without CUDA headers.
//
// The sm90 kernels serve ragged and paged prefill with fp16/bf16 q/k/v on compute capability
// 9.x, head_dim up to 256 (multiples of 8, padded to 64/128/256), any GQA group up to the CTA
// tile's rows. Everything else (older GPUs, fp8 K/V, a group wider than the tile) goes to the
// portable sm80 kernels, which serve every plan; prefill_unsupported_reason says why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/prefill_args.hpp"
#include "tessera/types.hpp"

namespace tessera::detail::sm90 {

// One compiled kernel (head_dim bucket x dtype x soft-cap) and its launch shape.
struct PrefillKernel {
  const char* name;
  int head_dim;  // instantiated head_dim (64, 128, 256)
  int block_m;   // packed query rows of a CTA tile (64 per consumer warpgroup)
  int block_n;   // keys per K/V tile
  int num_threads;
  int stages;
  size_t smem_bytes;
  // Builds the TMA tensor maps for the problem's tensors and launches one CTA per worker on
  // `stream`. Returns false without launching, the reason in *why, when TMA cannot read q (a
  // stride it does not take, a group wider than the tile): the caller runs the sm80 kernel.
  // K/V and o that TMA cannot describe are gathered / stored by threads instead. Throws
  // tessera::Error naming the kernel and launch shape when the launch fails.
  bool (*try_launch)(const PrefillArgs& args, void* stream, std::string* why);
};

using detail::prefill_head_dim_bucket;  // cuda/prefill_args.hpp

// Packed rows of a CTA tile for a GQA group: whole tokens, each with its whole group
// (block_m / group tokens), or 0 when the group is wider than the tile.
constexpr int prefill_tile_rows(int block_m, int group) {
  return group >= 1 && group <= block_m ? block_m / group * group : 0;
}

// Per-bucket tables, one per translation unit (prefill_d64.cu, prefill_d128.cu, prefill_d256.cu).
const PrefillKernel* prefill_kernel_d64(DType dtype, bool soft_cap);
const PrefillKernel* prefill_kernel_d128(DType dtype, bool soft_cap);
const PrefillKernel* prefill_kernel_d256(DType dtype, bool soft_cap);
// d128 with 176-key tiles and d64 with 192-key tiles, for ragged K/V without a causal mask,
// window or soft-cap.
const PrefillKernel* prefill_kernel_d128_wide(DType dtype);
const PrefillKernel* prefill_kernel_d64_wide(DType dtype);
// d128 for paged caches with pages shorter than a key tile (V copied one box per page).
const PrefillKernel* prefill_kernel_d128_paged(DType dtype, bool soft_cap);

// Whether the d128 page-by-page V kernel serves a problem: paged K/V whose pages are shorter than
// its key tile, head_dim exactly 128 (the 5-d V box spans whole rows), and not turned off by
// TESSERA_SM90_PAGED_V=0 (for timing the two side by side).
bool page_by_page_v(int head_dim, bool paged, int32_t page_size);

// When the wide-tile kernels (d128 176-key, d64 192-key) run: for ragged K/V without a causal
// mask, window or soft-cap whose requests all have at least kWideTilesMinKeysD64 / D128 keys
// (default), never (TESSERA_SM90_WIDE=0) or whenever the mask allows (TESSERA_SM90_WIDE=1, for
// tests and timing). Short requests lose with it: 512 keys are 3 tiles of 176 (or of 192) with
// the last one partial (gathered by threads, not TMA) - d128 334 vs 390 TFLOP/s at 32 x 512 on
// the H200; d64 214 vs 260 at 32 x 512 on an H100, +0.7% at 4 x 4096, +5% at 1 x 16384. Since
// the one-block softmax the 128-key d128 kernel wins at 4096 keys (H100, 2026-12-06: 683.9 vs
// 661.2 TFLOP/s at 4 x 4096), ties at 6144 and 8192, and loses from 10000 keys up (677 vs 693
// at 1 x 10000, 661 vs 715 at 1 x 12288, 708 vs 719 at 1 x 16384): d128 switches at 8192
// (docs/PERF.md).
enum class WideTiles { kOff, kLongKeys, kAlways };
WideTiles wide_tiles_mode();
inline constexpr int32_t kWideTilesMinKeysD64 = 4096;
inline constexpr int32_t kWideTilesMinKeysD128 = 8192;

// wide_tiles_allowed: the problem's mask and K/V allow the wide-tile kernel;
// shortest_kv_len: the fewest keys of any request of the plan; page_by_page: page_by_page_v()
// of the problem.
inline const PrefillKernel* find_prefill_kernel(int head_dim, DType dtype, bool soft_cap,
                                                bool wide_tiles_allowed = false,
                                                int64_t shortest_kv_len = 0,
                                                bool page_by_page = false) {
  const WideTiles mode = wide_tiles_allowed && !soft_cap ? wide_tiles_mode() : WideTiles::kOff;
  const int bucket = prefill_head_dim_bucket(head_dim);
  const int32_t min_keys = bucket == 64 ? kWideTilesMinKeysD64 : kWideTilesMinKeysD128;
  const bool wide = mode == WideTiles::kAlways ||
                    (mode == WideTiles::kLongKeys && shortest_kv_len >= min_keys);
  switch (bucket) {
    case 64: return wide ? prefill_kernel_d64_wide(dtype) : prefill_kernel_d64(dtype, soft_cap);
    case 128:
      if (wide) return prefill_kernel_d128_wide(dtype);
      return page_by_page ? prefill_kernel_d128_paged(dtype, soft_cap)
                          : prefill_kernel_d128(dtype, soft_cap);
    case 256: return prefill_kernel_d256(dtype, soft_cap);
    default: return nullptr;
  }
}

// Empty when the sm90 kernels can serve prefill of this shape on a device of compute capability
// sm_major.sm_minor; otherwise why not (shown by `tessera plan --explain`). Also honours
// TESSERA_PREFILL_KERNEL=sm80 (forces the portable kernels, for side-by-side timing).
std::string prefill_unsupported_reason(int sm_major, int head_dim, int num_qo_heads,
                                       int num_kv_heads, DType q_dtype, DType kv_dtype);

// Decode on sm_90: the sm90 prefill kernels can also serve batch decode (GQA-packed rows as the
// wgmma M dimension, K/V pages through TMA) when TESSERA_DECODE_KERNEL=sm90, the shape is one
// prefill_unsupported_reason accepts and K/V have q's dtype. By default decode runs the sm80
// decode kernels (faster on paged caches today, see docs/PERF.md).
bool serves_decode(int sm_major, int head_dim, int num_qo_heads, int num_kv_heads, DType q_dtype,
                   DType kv_dtype);

}  // namespace tessera::detail::sm90
