// Per-tile bookkeeping and global <-> shared traffic of the sm80 prefill kernel: which keys a
// CTA tile has to visit, the per-row and per-key tables it keeps in shared memory, and the
// cp.async loaders that fill the swizzled Q/K/V tiles. The math lives in prefill_kernel.cuh.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/sm80/prefill_traits.cuh"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {

// One CTA tile: packed rows [row0, row0 + rows) of a work item and the keys they may see.
struct PrefillTileGeometry {
  int32_t request;
  int32_t kv_head;
  int32_t group;   // query heads per kv head
  int32_t row0;    // first packed row of the tile within the work item
  int32_t rows;    // valid packed rows, 1 .. BLOCK_M
  int32_t q_len;   // query tokens of the request
  int32_t kv_len;  // keys of the request
  // Union of the visible key ranges of the tile's rows, intersected with the work item's
  // [kv_start, kv_end): key tile t covers keys [key_begin + t * BLOCK_N, + BLOCK_N).
  int32_t key_begin;
  int32_t key_end;
  int32_t num_key_tiles;
  // Keys visible to every row of the tile: a key tile inside this range needs no element mask.
  int32_t unmasked_begin;
  int32_t unmasked_end;
};

// MaskSpec::visible_range is monotone in the query row (both ends are non-decreasing), so the
// first and last token of the tile bound the union (first.lo, last.hi) and the intersection
// (last.lo, first.hi) of all its rows' ranges. Key tiles outside the union are skipped
// entirely; key tiles inside the intersection skip the element mask.
template <class Traits>
__device__ __forceinline__ PrefillTileGeometry make_tile_geometry(const AttentionProblem& problem,
                                                                  const WorkItem& item,
                                                                  int32_t row0,
                                                                  int32_t rows_total) {
  PrefillTileGeometry tile;
  tile.request = item.request;
  tile.kv_head = item.kv_head;
  tile.group = problem.group_size();
  tile.row0 = row0;
  tile.rows = min(Traits::kBlockM, rows_total - row0);
  tile.q_len = problem.q_len(item.request);
  tile.kv_len = problem.kv.kv_len(item.request);
  const int32_t first_token = item.q_start + row0 / tile.group;
  const int32_t last_token = item.q_start + (row0 + tile.rows - 1) / tile.group;
  int32_t first_lo, first_hi, last_lo, last_hi;
  problem.mask.visible_range(first_token, tile.q_len, tile.kv_len, &first_lo, &first_hi);
  problem.mask.visible_range(last_token, tile.q_len, tile.kv_len, &last_lo, &last_hi);
  // visible_range never exceeds [0, kv_len), so neither do these, whatever the work item says.
  tile.key_begin = max(item.kv_start, first_lo);
  tile.key_end = max(tile.key_begin, min(item.kv_end, last_hi));
  tile.num_key_tiles = (tile.key_end - tile.key_begin + Traits::kBlockN - 1) / Traits::kBlockN;
  tile.unmasked_begin = max(item.kv_start, last_lo);
  tile.unmasked_end = min(item.kv_end, first_hi);
  return tile;
}

// True when some element of key tile `key_tile` is invisible to some row (boundary tile).
template <class Traits>
__device__ __forceinline__ bool key_tile_needs_mask(const PrefillTileGeometry& tile, int key_tile) {
  const int32_t first_key = tile.key_begin + key_tile * Traits::kBlockN;
  return first_key < tile.unmasked_begin || first_key + Traits::kBlockN > tile.unmasked_end;
}

// Row table: global token, qo head and visible key range of every packed row of the tile.
// Padding rows (past tile.rows) get token -1 and an empty key range. Written by the whole CTA
// between two __syncthreads (see prefill_kernel.cuh).
template <class Traits>
__device__ __forceinline__ void fill_row_info(const AttentionProblem& problem, const WorkItem& item,
                                              const PrefillTileGeometry& tile,
                                              PrefillRowInfo* row_info) {
  const int32_t q_begin = problem.q_begin(tile.request);
  for (int row = threadIdx.x; row < Traits::kBlockM; row += Traits::kNumThreads) {
    PrefillRowInfo info{-1, 0, 0, 0};
    if (row < tile.rows) {
      const int32_t packed_row = tile.row0 + row;
      const int32_t token_in_tile = packed_row / tile.group;
      const int32_t head_in_group = packed_row - token_in_tile * tile.group;
      const int32_t token = item.q_start + token_in_tile;
      int32_t first_key, last_key;
      problem.mask.visible_range(token, tile.q_len, tile.kv_len, &first_key, &last_key);
      first_key = max(first_key, item.kv_start);
      last_key = max(first_key, min(last_key, item.kv_end));
      info = {q_begin + token, tile.kv_head * tile.group + head_in_group, first_key, last_key};
    }
    row_info[row] = info;
  }
}

// Key offset table of key tile `key_tile`: the element offsets of its K and V rows (page gather
// for a paged cache, NHD/HND through the strides), or -1 past the tile's key range. Computing
// them once per tile, one key per thread and a pipeline stage ahead of the copies, keeps the
// page-table lookups and divisions by page_size out of the cp.async issue path.
template <class Traits>
__device__ __forceinline__ void fill_key_offsets(const KVSource& kv,
                                                 const PrefillTileGeometry& tile, int key_tile,
                                                 PrefillKeyOffsets* slot) {
  const int32_t tile_first_key = tile.key_begin + key_tile * Traits::kBlockN;
  for (int index = threadIdx.x; index < 2 * Traits::kBlockN; index += Traits::kNumThreads) {
    const bool is_value = index >= Traits::kBlockN;
    const int row = is_value ? index - Traits::kBlockN : index;
    const int32_t key = tile_first_key + row;
    int64_t offset = -1;
    if (key < tile.key_end) {
      offset = is_value ? kv.v_offset(tile.request, tile.kv_head, key)
                        : kv.k_offset(tile.request, tile.kv_head, key);
    }
    if (is_value) {
      slot[row].v = offset;
    } else {
      slot[row].k = offset;
    }
  }
}

// Issues the cp.async copies of a kRows x kHeadDim tile into swizzled shared memory. Row `r`
// comes from `base + row_offset(r)` (elements); a negative offset, or a chunk past the real
// head_dim, is zero-filled, so padded rows and columns contribute exact zeros to every product.
template <class Traits, int kRows, class RowOffset>
__device__ __forceinline__ void load_tile_async(uint32_t smem_tile, const uint16_t* base,
                                                int32_t head_dim, RowOffset row_offset) {
  static_assert(kRows % Traits::kLoaderRowsPerPass == 0, "loader passes must tile the rows");
  const int lane_chunk = threadIdx.x % Traits::kLoaderLanesPerRow;
  const int first_row = threadIdx.x / Traits::kLoaderLanesPerRow;
#pragma unroll
  for (int pass = 0; pass < kRows / Traits::kLoaderRowsPerPass; ++pass) {
    const int row = pass * Traits::kLoaderRowsPerPass + first_row;
    const int64_t offset = row_offset(row);
#pragma unroll
    for (int i = 0; i < Traits::kLoaderChunksPerLane; ++i) {
      const int chunk = lane_chunk + i * Traits::kLoaderLanesPerRow;
      const bool valid = offset >= 0 && chunk * 8 < head_dim;
      const uint16_t* src = valid ? base + offset + chunk * 8 : base;
      ptx::cp_async_16_zfill(
          smem_tile + ptx::swizzled_chunk_offset<Traits::kChunksPerRow>(row, chunk), src, valid);
    }
  }
}

// Q tile: packed row r -> token row_info[r].token, head row_info[r].head.
template <class Traits>
__device__ __forceinline__ void load_q_tile(const AttentionProblem& problem,
                                            const PrefillRowInfo* row_info, uint32_t smem_tile) {
  load_tile_async<Traits, Traits::kBlockM>(
      smem_tile, static_cast<const uint16_t*>(problem.q), problem.head_dim, [&](int row) {
        const PrefillRowInfo info = row_info[row];
        return info.token < 0
                   ? int64_t{-1}
                   : info.token * problem.q_stride_token + info.head * problem.q_stride_head;
      });
}

template <class Traits>
__device__ __forceinline__ void load_k_tile(const AttentionProblem& problem,
                                            const PrefillKeyOffsets* slot, uint32_t smem_tile) {
  load_tile_async<Traits, Traits::kBlockN>(smem_tile, static_cast<const uint16_t*>(problem.kv.k),
                                           problem.head_dim, [&](int row) { return slot[row].k; });
}

template <class Traits>
__device__ __forceinline__ void load_v_tile(const AttentionProblem& problem,
                                            const PrefillKeyOffsets* slot, uint32_t smem_tile) {
  load_tile_async<Traits, Traits::kBlockN>(smem_tile, static_cast<const uint16_t*>(problem.kv.v),
                                           problem.head_dim, [&](int row) { return slot[row].v; });
}

}  // namespace tessera::detail::sm80
