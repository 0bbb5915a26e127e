// Merge of split-KV partial attention states (the second half of a split prefill plan, and of
// decode when the fused merge is off): the prefill kernels write, for each piece of a split key
// range, the normalised float o and the natural-log lse of every packed row into the
// workspace; this kernel combines them (merge_rows.cuh has the arithmetic).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/problem.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/sm80/merge_rows.cuh"
#include "cuda/sm80/prefill_api.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail::sm80 {
namespace {

constexpr int kMergeWarps = 4;
constexpr int kMergeThreads = kMergeWarps * 32;
constexpr int kBlocksPerSm = 8;

template <DType kDType>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const __grid_constant__ MergeArgs args) {
  // The count comes from the uploaded header (graph replays see the current plan's), capped by
  // the slots the workspace holds.
  const int32_t num_merges =
      args.header != nullptr ? min(args.header->num_merges, args.max_merges) : args.max_merges;
  for (int32_t index = blockIdx.x; index < num_merges; index += gridDim.x) {
    merge_split_tile<kDType>(args.problem, args.merges[index], args.partial_o, args.partial_lse,
                             threadIdx.x / 32, kMergeWarps, threadIdx.x % 32);
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
  if (args.problem.head_dim > kMergeMaxHeadDim || args.problem.head_dim % 4 != 0) {
    throw Error(Error::Kind::kUnsupported,
                "merge_partials: head_dim " + std::to_string(args.problem.head_dim) +
                    " is not a multiple of 4 up to " + std::to_string(kMergeMaxHeadDim));
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
