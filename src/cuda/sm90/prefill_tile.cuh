// Kernel parameters of the sm90 prefill kernels and the CTA-tile geometry that the producer and
// the consumer warpgroups derive, each on its own, from the same work item - so they agree on
// every tile and key tile without talking to each other.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain 128-byte struct; no driver library is linked)

#include <cstdint>

#include "core/problem.hpp"
#include "cuda/prefill_args.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail::sm90 {

// Everything the kernel reads, passed by value as one __grid_constant__ parameter. The tensor
// maps must stay in parameter space: TMA instructions take their generic address.
struct alignas(128) PrefillParams {
  CUtensorMap q_map;  // q as {head_dim, num_qo_heads, rows}, box {64, group, tokens_per_tile}
  CUtensorMap o_map;  // o, same shape and box (TMA store of whole tiles)
  // K / V: ragged {head_dim, num_kv_heads, rows}, box {64, 1, BLOCK_N}; paged
  // {head_dim, page rows, num_kv_heads, pages}, box {64, kv_box_rows, 1, 1}. The head and row
  // dimensions are swapped when kv_heads_first says so (TMA wants increasing strides).
  CUtensorMap k_map;
  CUtensorMap v_map;
  PrefillArgs args;
  int32_t tokens_per_tile = 0;  // query tokens of a CTA tile (BLOCK_M / group)
  int32_t kv_tma = 0;           // 1: K/V tiles inside a request are copied by TMA; 0: gathered
  int32_t kv_heads_first = 0;   // 1: map dimension 1 is the head, 2 the row; 0: the reverse
  // Paged K/V with kv_tma: rows of one box, min(page_size, BLOCK_N) (page_size is a multiple of
  // 8 that divides or is divided by BLOCK_N).
  int32_t kv_box_rows = 0;
  int32_t o_tma = 0;  // 1: whole output tiles leave through a TMA store
  // log2(page_size) when the page size is a power of two, else -1: the gather then finds a
  // key's page with a shift instead of a division.
  int32_t page_shift = -1;
  // Traits::kVPageBoxes kernels: rows per page of the V tile layout (prefill_traits.cuh) and
  // their log2; BLOCK_N (the usual layout) when V is not copied page by page.
  int32_t v_page_rows = 0;
  int32_t v_page_rows_shift = 0;
  // The GQA group (query heads per kv head) and its log2 when it is a power of two, else -1:
  // kernels with Traits::kNarrowTileMath split packed rows into (token, head) with a shift
  // instead of a division.
  int32_t group = 1;
  int32_t group_shift = -1;
};

// One CTA tile: tokens [token0, token0 + tokens) of a work item, all query heads of its kv head,
// and the key tiles its rows can see.
struct PrefillTile {
  int32_t request;
  int32_t kv_head;
  int32_t q_begin;            // global row of the request's first query token
  int32_t q_len;              // query tokens of the request
  int32_t kv_len;             // keys of the request
  int32_t token0;             // first query token of the tile, within the request
  int32_t tokens;             // 1 .. tokens_per_tile
  int32_t rows;               // tokens x group packed rows
  int32_t first_row_in_item;  // packed row of the work item where the tile starts (partials)
  int32_t kv_start;           // the work item's key range
  int32_t kv_end;
  int32_t partial_row;  // the work item's first partial row, -1 when it writes o directly
  // Key tile t covers keys [key0 + t * BLOCK_N, + BLOCK_N); key0 is a multiple of BLOCK_N, so
  // key tiles line up with pages. Keys outside a row's visible range are masked.
  int32_t key0;
  int32_t num_key_tiles;
  // Keys visible to every row of the tile: a key tile inside needs no element mask.
  int32_t unmasked_begin;
  int32_t unmasked_end;
};

// value / divisor with a shift when the host found the divisor a power of two (shift >= 0, see
// shift_of in prefill_kernel.cuh): a 32-bit division is ~20 instructions.
__device__ __forceinline__ int32_t divide_by(int32_t value, int32_t divisor, int32_t shift) {
  return shift >= 0 ? value >> shift : value / divisor;
}

// The per-tile integer work in two forms (kNarrow, PrefillShape::kNarrowTileMath): the mask's
// visible range in 32-bit arithmetic (MaskSpec::visible_range_narrow) and the GQA group from the
// kernel parameters, or the 64-bit range and the group computed from the problem. Both give the
// same values; the narrow form, with the consumers' shift for the packed row's token
// (PrefillConsumer::row_token), is ~300 fewer instructions per tile.
template <bool kNarrow>
__device__ __forceinline__ void row_visible_range(const MaskSpec& mask, int32_t i, int32_t q_len,
                                                  int32_t kv_len, int32_t* first, int32_t* last) {
  if constexpr (kNarrow) {
    mask.visible_range_narrow(i, q_len, kv_len, first, last);
  } else {
    mask.visible_range(i, q_len, kv_len, first, last);
  }
}

// MaskSpec::visible_range is monotone in the query row, so the first and the last token bound
// the union and the intersection of the tile's rows' ranges (as in the sm80 kernel).
template <int kBlockN, bool kNarrow>
__device__ __forceinline__ PrefillTile make_prefill_tile(const PrefillParams& params,
                                                         const WorkItem& item,
                                                         int32_t token_offset) {
  const AttentionProblem& problem = params.args.problem;
  const int32_t tokens_per_tile = params.tokens_per_tile;
  PrefillTile tile;
  const int32_t group = kNarrow ? params.group : problem.group_size();
  tile.request = item.request;
  tile.kv_head = item.kv_head;
  tile.q_begin = problem.q_begin(item.request);
  tile.q_len = problem.q_len(item.request);
  tile.kv_len = problem.kv.kv_len(item.request);
  tile.token0 = item.q_start + token_offset;
  tile.tokens = min(tokens_per_tile, item.q_len - token_offset);
  tile.rows = tile.tokens * group;
  tile.first_row_in_item = token_offset * group;
  tile.kv_start = item.kv_start;
  tile.kv_end = item.kv_end;
  tile.partial_row = item.partial_row;
  int32_t first_lo, first_hi, last_lo, last_hi;
  row_visible_range<kNarrow>(problem.mask, tile.token0, tile.q_len, tile.kv_len, &first_lo,
                             &first_hi);
  row_visible_range<kNarrow>(problem.mask, tile.token0 + tile.tokens - 1, tile.q_len, tile.kv_len,
                             &last_lo, &last_hi);
  const int32_t key_begin = max(item.kv_start, first_lo);
  const int32_t key_end = min(item.kv_end, last_hi);
  tile.key0 = key_begin - key_begin % kBlockN;
  tile.num_key_tiles = key_end > key_begin ? (key_end - tile.key0 + kBlockN - 1) / kBlockN : 0;
  tile.unmasked_begin = max(item.kv_start, last_lo);
  tile.unmasked_end = min(item.kv_end, first_hi);
  return tile;
}

// Calls fn(tile) for every CTA tile of this CTA's worker, in plan order: the producer and every
// consumer warpgroup walk the same sequence, which is what keeps their rings in step.
template <int kBlockN, bool kNarrow, class Fn>
__device__ __forceinline__ void for_each_prefill_tile(const PrefillParams& params, Fn&& fn) {
  const int32_t worker = blockIdx.x;
  const int32_t work_begin = params.args.worker_indptr[worker];
  const int32_t work_end = params.args.worker_indptr[worker + 1];
  for (int32_t w = work_begin; w < work_end; ++w) {
    const WorkItem item = params.args.work[w];
    for (int32_t offset = 0; offset < item.q_len; offset += params.tokens_per_tile) {
      fn(make_prefill_tile<kBlockN, kNarrow>(params, item, offset));
    }
  }
}

template <int kBlockN>
__device__ __forceinline__ bool key_tile_needs_mask(const PrefillTile& tile, int key_tile) {
  const int32_t first_key = tile.key0 + key_tile * kBlockN;
  return first_key < tile.unmasked_begin || first_key + kBlockN > tile.unmasked_end;
}

// Key tiles that TMA cannot copy safely are gathered by the producer warpgroup with cp.async:
// a tile running past the request's last key (the rows behind it may be another request's, a
// page's unwritten tail, or uninitialised memory whose NaNs would survive P = 0 in P V; the
// gather zero-fills them), and every tile when TMA cannot describe K/V (pages TMA cannot copy,
// strides it does not take).
template <int kBlockN>
__device__ __forceinline__ bool key_tile_is_gathered(const PrefillParams& params,
                                                     const PrefillTile& tile, int key_tile) {
  const int32_t first_key = tile.key0 + key_tile * kBlockN;
  return first_key + kBlockN > tile.kv_len || params.kv_tma == 0;
}

}  // namespace tessera::detail::sm90
