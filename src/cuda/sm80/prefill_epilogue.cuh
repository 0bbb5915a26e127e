// Register state of one warp of the sm80 prefill kernel and its epilogue: final normalisation
// and the two ways a CTA tile leaves the kernel - the output in q's dtype (plus lse), or float
// partials for a split key range (merged later by merge_partials.cu).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <numbers>

#include "core/problem.hpp"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/row_finish.cuh"
#include "cuda/ptx/shuffle.cuh"
#include "cuda/sm80/element_ops.cuh"
#include "cuda/sm80/prefill_api.hpp"
#include "cuda/sm80/prefill_tile_io.cuh"
#include "cuda/sm80/prefill_traits.cuh"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {

// Accumulators a warp carries across the key tiles of one CTA tile. Index [m][h] of the row
// statistics is row m * 16 + lane / 4 + 8 * h of the warp's rows, i.e. the rows of accumulator
// elements 2h and 2h + 1 of every 8-wide column (see ptx/mma.cuh).
template <class Traits>
struct PrefillWarpState {
  float acc_o[Traits::kMmaRowBlocks][Traits::kOutputCols][4];
  float row_max[Traits::kMmaRowBlocks][2];  // max of the raw (unscaled) scores seen so far
  float row_sum[Traits::kMmaRowBlocks][2];  // this lane's part of sum 2^(s * scale - max * scale)
};

// Divides O by the row sum and returns each row's natural-log lse (row_finish.cuh: a row without
// keys gets O = 0 and lse = -inf, a row with a NaN or +inf score NaN in both). sum = sum_j
// 2^(s_j * scale - max * scale), so max * scale is the row's base 2 exponent base. With `sinks`
// (final rows only; row_info gives each packed row's head) the row's sink joins the denominator.
template <class Traits>
__device__ __forceinline__ void normalise_rows(PrefillWarpState<Traits>& state, float scale,
                                               float (&lse)[Traits::kMmaRowBlocks][2],
                                               const float* sinks,
                                               const PrefillRowInfo* row_info,
                                               int warp_first_row, int lane) {
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = ptx::quad_sum(state.row_sum[m][h]);
      const float base = state.row_max[m][h] * scale;
      RowFinish finish;
      if (sinks != nullptr) {
        const PrefillRowInfo info = row_info[warp_first_row + m * 16 + lane / 4 + 8 * h];
        finish = finish_row(base, sum, sinks, info.head, info.token >= 0);
      } else {
        finish = finish_row(base, sum);
      }
      lse[m][h] = finish.lse;
#pragma unroll
      for (int d = 0; d < Traits::kOutputCols; ++d) {
        state.acc_o[m][d][2 * h] *= finish.factor;
        state.acc_o[m][d][2 * h + 1] *= finish.factor;
      }
    }
  }
}

// o (q dtype) and lse of the tile's valid rows. Each warp stages its own rows in its own rows of
// the Q tile (only this warp ever reads them), then writes whole 16-byte chunks per lane so that
// consecutive lanes store consecutive bytes of a row.
template <class Traits, DType kDType>
__device__ __forceinline__ void store_output_tile(
    const PrefillArgs& args, const PrefillTileGeometry& tile, const PrefillRowInfo* row_info,
    PrefillWarpState<Traits>& state, unsigned char* smem, int warp_first_row, int lane) {
  using Element = ElementOps<kDType>;
  const AttentionProblem& problem = args.problem;
  float lse[Traits::kMmaRowBlocks][2];
  normalise_rows<Traits>(state, args.score_scale_log2, lse, problem.sinks, row_info,
                         warp_first_row, lane);
  unsigned char* staging = smem + Traits::kQOffset;
  __syncwarp();  // this warp's last ldmatrix reads of its Q rows come before the overwrite
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_first_row + m * 16 + lane / 4 + 8 * h;
#pragma unroll
      for (int d = 0; d < Traits::kOutputCols; ++d) {
        const uint32_t offset = ptx::swizzled_chunk_offset<Traits::kChunksPerRow>(row, d);
        *reinterpret_cast<uint32_t*>(staging + offset + 4 * (lane % 4)) =
            Element::pack(state.acc_o[m][d][2 * h], state.acc_o[m][d][2 * h + 1]);
      }
      if (problem.lse != nullptr && lane % 4 == 0) {
        const PrefillRowInfo info = row_info[row];
        if (info.token >= 0)
          problem.lse[info.token * problem.lse_stride_token + info.head] = lse[m][h];
      }
    }
  }
  __syncwarp();
  constexpr int kWarpChunks = Traits::kWarpRows * Traits::kChunksPerRow;
  static_assert(kWarpChunks % 32 == 0, "whole warp iterations");
#pragma unroll 4
  for (int index = lane; index < kWarpChunks; index += 32) {
    const int row = warp_first_row + index / Traits::kChunksPerRow;
    const int chunk = index % Traits::kChunksPerRow;
    const PrefillRowInfo info = row_info[row];
    if (info.token < 0 || chunk * 8 >= problem.head_dim) continue;
    const uint4 value = *reinterpret_cast<const uint4*>(
        staging + ptx::swizzled_chunk_offset<Traits::kChunksPerRow>(row, chunk));
    uint16_t* dst = static_cast<uint16_t*>(problem.o) + info.token * problem.o_stride_token +
                    info.head * problem.o_stride_head + chunk * 8;
    *reinterpret_cast<uint4*>(dst) = value;
  }
}

// Split key range: normalised float o and natural-log lse of packed row r of the work item go to
// workspace row item.partial_row + r (= partial_row + token * group + head_in_group, the CPU
// backend's convention), head_dim floats per row.
template <class Traits>
__device__ __forceinline__ void store_partial_tile(const PrefillArgs& args, const WorkItem& item,
                                                   const PrefillTileGeometry& tile,
                                                   PrefillWarpState<Traits>& state,
                                                   int warp_first_row, int lane) {
  float lse[Traits::kMmaRowBlocks][2];
  // A partial: the merge folds the sinks in (once per row).
  normalise_rows<Traits>(state, args.score_scale_log2, lse, nullptr, nullptr, 0, lane);
  const int32_t head_dim = args.problem.head_dim;
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_first_row + m * 16 + lane / 4 + 8 * h;
      if (row >= tile.rows) continue;
      const int64_t partial_row = int64_t{item.partial_row} + tile.row0 + row;
      float* dst = args.partial_o + partial_row * head_dim;
#pragma unroll
      for (int d = 0; d < Traits::kOutputCols; ++d) {
        const int column = d * 8 + 2 * (lane % 4);
        if (column < head_dim) {
          *reinterpret_cast<float2*>(dst + column) =
              make_float2(state.acc_o[m][d][2 * h], state.acc_o[m][d][2 * h + 1]);
        }
      }
      if (lane % 4 == 0) args.partial_lse[partial_row] = lse[m][h];
    }
  }
}

}  // namespace tessera::detail::sm80
