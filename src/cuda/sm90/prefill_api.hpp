// Host-side facts of the Hopper (sm_90a) prefill kernels that plan-time selection
// (cuda/kernel_select.cpp) and the launcher need, without CUDA headers. The kernels themselves
// are rows of the kernel registry (cuda/kernel_registry.hpp), added by sm90/prefill_d*.cu.
//
// The sm90 kernels serve ragged and paged prefill with fp16/bf16 q/k/v on compute capability
// 9.x, head_dim up to 256 (multiples of 8, padded to 64/128/256), any GQA group up to the CTA
// tile's rows. Everything else (older GPUs, fp8 K/V, a group wider than the tile) goes to the
// portable sm80 kernels, which serve every plan.
#pragma once

#include <cstdint>

namespace tessera::detail::sm90 {

// Packed rows of a CTA tile for a GQA group: whole tokens, each with its whole group
// (block_m / group tokens), or 0 when the group is wider than the tile.
constexpr int prefill_tile_rows(int block_m, int group) {
  return group >= 1 && group <= block_m ? block_m / group * group : 0;
}

// Launch options a plan carries to the sm90 kernels (Plan::kernel_options).
inline constexpr uint32_t kSm90GatherKV = 1u << 0;  // every K/V tile by the cp.async gather

// The wide-tile kernels (d128 176 keys, d64 192 keys) serve ragged K/V without a causal mask,
// window or soft-cap whose requests all have at least this many keys: short requests lose with
// them (512 keys are 3 tiles of 176, the last one partial and gathered by threads), and the
// 128-key d128 kernel wins up to about 8192 keys since its one-block softmax (docs/log/PERF.md).
inline constexpr int32_t kWideTilesMinKeysD64 = 4096;
inline constexpr int32_t kWideTilesMinKeysD128 = 8192;

}  // namespace tessera::detail::sm90
