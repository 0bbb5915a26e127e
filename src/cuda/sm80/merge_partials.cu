// Merge of split-KV partial attention states (the second half of a split plan).
//
// The prefill (and decode) kernels write, for each piece of a split key range, the normalised
// float o and the natural-log lse of every packed row into the workspace. For a MergeItem with
// S splits, packed row r (token r / group, head r % group) of split s sits at workspace row
// first_partial_row + s * q_len * group + r. Exact combination over disjoint key sets:
//   M = max_s lse_s,  w_s = exp(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,  lse = M + log sum w
// An all-empty row (every lse_s = -inf) gives o = 0, lse = -inf; an empty split has w_s = 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/problem.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/sm80/element_ops.cuh"
#include "cuda/sm80/prefill_api.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {
namespace {

constexpr int kMergeWarps = 4;
constexpr int kMergeThreads = kMergeWarps * 32;
constexpr int kMaxHeadDim = 256;
// One warp per output row; lane l owns columns 4 * (l + 32 * i), i < kChunksPerLane.
constexpr int kChunksPerLane = kMaxHeadDim / (4 * 32);
constexpr int kBlocksPerSm = 8;

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, mask));
  }
  return value;
}

template <DType kDType>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const __grid_constant__ MergeArgs args) {
  using Element = ElementOps<kDType>;
  const AttentionProblem& problem = args.problem;
  const int32_t group = problem.group_size();
  const int32_t head_dim = problem.head_dim;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // The count comes from the uploaded header (graph replays see the current plan's), capped by
  // the slots the workspace holds.
  const int32_t num_merges =
      args.header != nullptr ? min(args.header->num_merges, args.max_merges) : args.max_merges;
  for (int32_t index = blockIdx.x; index < num_merges; index += gridDim.x) {
    const MergeItem item = args.merges[index];
    const int32_t rows = item.q_len * group;
    const int32_t q_begin = problem.q_begin(item.request);
    for (int32_t row = warp; row < rows; row += kMergeWarps) {
      const int32_t token_in_item = row / group;
      const int32_t token = q_begin + item.q_start + token_in_item;
      const int32_t head = item.kv_head * group + (row - token_in_item * group);
      const float* split_lse = args.partial_lse + item.first_partial_row + row;
      const float* split_o =
          args.partial_o + (int64_t{item.first_partial_row} + row) * int64_t{head_dim};
      const int64_t split_stride = int64_t{rows};  // rows between consecutive splits

      float max_lse = -INFINITY;
      for (int32_t split = lane; split < item.num_splits; split += 32) {
        max_lse = fmaxf(max_lse, split_lse[split * split_stride]);
      }
      max_lse = warp_max(max_lse);

      float acc[kChunksPerLane][4] = {};
      float weight_sum = 0.0f;
      if (max_lse != -INFINITY) {
        for (int32_t split = 0; split < item.num_splits; ++split) {
          const float weight = expf(split_lse[split * split_stride] - max_lse);
          weight_sum += weight;
          const float* o_row = split_o + split * split_stride * head_dim;
#pragma unroll
          for (int i = 0; i < kChunksPerLane; ++i) {
            const int column = 4 * (lane + 32 * i);
            if (column < head_dim) {
              const float4 value = *reinterpret_cast<const float4*>(o_row + column);
              acc[i][0] += weight * value.x;
              acc[i][1] += weight * value.y;
              acc[i][2] += weight * value.z;
              acc[i][3] += weight * value.w;
            }
          }
        }
      }
      // weight_sum >= 1 whenever max_lse is finite (the max split has weight 1).
      const float inverse = weight_sum > 0.0f ? 1.0f / weight_sum : 0.0f;
      uint16_t* o_row = static_cast<uint16_t*>(problem.o) + token * problem.o_stride_token +
                        head * problem.o_stride_head;
      // Decode accepts o views of any element alignment (prefill requires 16-byte rows), so the
      // 8-byte vector store is used only when the row allows it.
      const bool vector_aligned = (reinterpret_cast<uintptr_t>(o_row) & 7u) == 0;
#pragma unroll
      for (int i = 0; i < kChunksPerLane; ++i) {
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
        problem.lse[token * problem.lse_stride_token + head] =
            weight_sum > 0.0f ? max_lse + logf(weight_sum) : -INFINITY;
      }
    }
  }
}

template <DType kDType>
void launch_merge(const MergeArgs& args, int num_sms, cudaStream_t stream, const char* name) {
  const dim3 grid(
      static_cast<unsigned>(std::min(args.max_merges, std::max(num_sms, 1) * kBlocksPerSm)));
  const dim3 block(kMergeThreads);
  merge_partials_kernel<kDType><<<grid, block, 0, stream>>>(args);
  check_kernel_launch(name, grid, block, 0);
}

}  // namespace

void launch_merge_partials(const MergeArgs& args, int num_sms, void* stream) {
  if (args.max_merges <= 0) return;
  if (args.problem.head_dim > kMaxHeadDim || args.problem.head_dim % 4 != 0) {
    throw Error(Error::Kind::kUnsupported,
                "merge_partials: head_dim " + std::to_string(args.problem.head_dim) +
                    " is not a multiple of 4 up to " + std::to_string(kMaxHeadDim));
  }
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (args.problem.q_dtype) {
    case DType::kFloat16:
      launch_merge<DType::kFloat16>(args, num_sms, cuda_stream,
                                    "tessera::sm80::merge_partials<fp16>");
      break;
    case DType::kBFloat16:
      launch_merge<DType::kBFloat16>(args, num_sms, cuda_stream,
                                     "tessera::sm80::merge_partials<bf16>");
      break;
    default:
      throw Error(Error::Kind::kUnsupported, std::string("merge_partials: o dtype ") +
                                                 dtype_name(args.problem.q_dtype) +
                                                 " is not supported (fp16 or bf16)");
  }
}

}  // namespace tessera::detail::sm80
