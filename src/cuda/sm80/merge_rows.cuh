// Merge of the split-KV partial states of one split tile, one warp per output row. Used by the
// standalone merge kernel (merge_partials.cu, after prefill) and fused into the decode kernels
// (the CTA that finishes a tile's last piece merges it, decode_mma.cuh).
//
// A MergeItem with S splits: packed row r (token r / group, head r % group) of split s sits at
// partial row first_partial_row + s * q_len * group + r. Exact combination over disjoint keys:
//   M = max_s lse_s,  w_s = exp(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,  lse = M + log sum w
// An all-empty row (every lse_s = -inf) gives o = 0, lse = -inf; an empty split has w_s = 0.
// Partials are read with ld.global.cg (L2, not L1): in the fused path other CTAs wrote them
// during this kernel, and L1 is not coherent with their stores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <numbers>

#include "core/problem.hpp"
#include "cuda/ptx/math.cuh"
#include "cuda/row_finish.cuh"
#include "cuda/sm80/element_ops.cuh"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {

inline constexpr int kMergeMaxHeadDim = 256;
// Lane l owns columns 4 * (l + 32 * i), i < kMergeChunksPerLane.
inline constexpr int kMergeChunksPerLane = kMergeMaxHeadDim / (4 * 32);
// Splits whose partial rows are loaded together (see merge_partial_row).
inline constexpr int kMergeBatch = 8;

__device__ __forceinline__ float merge_warp_max(float value) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    value = ptx::max_nan(value, __shfl_xor_sync(0xffffffffu, value, mask));
  }
  return value;
}

// Warp-cooperative: every lane of the warp calls it with the same row.
template <DType kDType>
__device__ __forceinline__ void merge_partial_row(const AttentionProblem& problem,
                                                  const MergeItem& item, int32_t row,
                                                  const float* partial_o,
                                                  const float* partial_lse, int lane) {
  using Element = ElementOps<kDType>;
  const int32_t group = problem.group_size();
  const int32_t head_dim = problem.head_dim;
  const int32_t rows = item.q_len * group;
  const int32_t token_in_item = row / group;
  const int32_t token = problem.q_begin(item.request) + item.q_start + token_in_item;
  const int32_t head = item.kv_head * group + (row - token_in_item * group);
  const float* split_lse = partial_lse + item.first_partial_row + row;
  const float* split_o = partial_o + (int64_t{item.first_partial_row} + row) * int64_t{head_dim};
  const int64_t split_stride = int64_t{rows};  // rows between consecutive splits

  float max_lse = -INFINITY;
  for (int32_t split = lane; split < item.num_splits; split += 32) {
    max_lse = ptx::max_nan(max_lse, __ldcg(split_lse + split * split_stride));
  }
  max_lse = merge_warp_max(max_lse);

  // Splits are consumed in batches of kMergeBatch: the batch's partial rows are all loaded
  // before any is accumulated, so a tile of S splits costs ~S / kMergeBatch L2 round trips
  // instead of S (with one split per round trip, the merge of a 32-way split was a ~10 us tail
  // of the fused decode). The weights of 32 splits come from one lane-parallel load and are
  // broadcast by shuffles. Accumulation stays in split order (the result does not change).
  float acc[kMergeChunksPerLane][4] = {};
  float weight_sum = 0.0f;
  if (max_lse != -INFINITY) {
#pragma unroll 1
    for (int32_t base = 0; base < item.num_splits; base += 32) {
      const int32_t count = min(32, item.num_splits - base);
      const float lane_weight =
          lane < count ? expf(__ldcg(split_lse + (base + lane) * split_stride) - max_lse) : 0.0f;
#pragma unroll 1
      for (int32_t first = 0; first < count; first += kMergeBatch) {
        float4 values[kMergeBatch][kMergeChunksPerLane];
#pragma unroll
        for (int b = 0; b < kMergeBatch; ++b) {
          const float* o_row = split_o + (base + first + b) * split_stride * head_dim;
#pragma unroll
          for (int i = 0; i < kMergeChunksPerLane; ++i) {
            const int column = 4 * (lane + 32 * i);
            values[b][i] = first + b < count && column < head_dim
                               ? __ldcg(reinterpret_cast<const float4*>(o_row + column))
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int b = 0; b < kMergeBatch; ++b) {
          if (first + b < count) {  // warp-uniform
            const float weight = __shfl_sync(0xffffffffu, lane_weight, first + b);
            weight_sum += weight;
#pragma unroll
            for (int i = 0; i < kMergeChunksPerLane; ++i) {
              acc[i][0] += weight * values[b][i].x;
              acc[i][1] += weight * values[b][i].y;
              acc[i][2] += weight * values[b][i].z;
              acc[i][3] += weight * values[b][i].w;
            }
          }
        }
      }
    }
  }
  // weight_sum >= 1 whenever max_lse is finite (the max split has weight 1); a NaN split lse
  // makes max_lse (max_nan), every weight and the row NaN. The weights are 2^((lse - max_lse)
  // log2 e), so max_lse log2 e is the row's base 2 exponent base (row_finish.cuh), and the
  // row's sink (partials never hold it) joins here.
  const RowFinish finish = finish_row(max_lse * std::numbers::log2e_v<float>, weight_sum,
                                      problem.sinks, head, true);
  const float inverse = finish.factor;
  uint16_t* o_row = static_cast<uint16_t*>(problem.o) + token * problem.o_stride_token +
                    head * problem.o_stride_head;
  // Decode accepts o views of any element alignment (prefill requires 16-byte rows), so the
  // 8-byte vector store is used only when the row allows it.
  const bool vector_aligned = (reinterpret_cast<uintptr_t>(o_row) & 7u) == 0;
#pragma unroll
  for (int i = 0; i < kMergeChunksPerLane; ++i) {
    const int column = 4 * (lane + 32 * i);
    if (column < head_dim) {
      const uint2 packed = make_uint2(Element::pack(acc[i][0] * inverse, acc[i][1] * inverse),
                                      Element::pack(acc[i][2] * inverse, acc[i][3] * inverse));
      if (vector_aligned) {
        *reinterpret_cast<uint2*>(o_row + column) = packed;
      } else {
        o_row[column + 0] = static_cast<uint16_t>(packed.x & 0xffffu);
        o_row[column + 1] = static_cast<uint16_t>(packed.x >> 16);
        o_row[column + 2] = static_cast<uint16_t>(packed.y & 0xffffu);
        o_row[column + 3] = static_cast<uint16_t>(packed.y >> 16);
      }
    }
  }
  if (problem.lse != nullptr && lane == 0) {
    problem.lse[token * problem.lse_stride_token + head] = finish.lse;
  }
}

// Every row of one split tile, rows spread over the `num_warps` warps of the caller.
template <DType kDType>
__device__ __forceinline__ void merge_split_tile(const AttentionProblem& problem,
                                                 const MergeItem& item, const float* partial_o,
                                                 const float* partial_lse, int warp,
                                                 int num_warps, int lane) {
  const int32_t rows = item.q_len * problem.group_size();
  for (int32_t row = warp; row < rows; row += num_warps) {
    merge_partial_row<kDType>(problem, item, row, partial_o, partial_lse, lane);
  }
}

}  // namespace tessera::detail::sm80
