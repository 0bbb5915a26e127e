// cuda_merge_state / cuda_merge_states: exact combination of partial attention states over
// disjoint key sets (split-KV, cascade / shared prefix, context parallel).
//
// A state over key set S is (o_S, lse_S), lse_S = log sum_{j in S} exp(s_j) (natural log). The
// union of disjoint sets is
//   lse = m + log(sum_S exp(lse_S - m)),  o = sum_S exp(lse_S - m) o_S / sum_S exp(lse_S - m)
// with m = max_S lse_S, so no exponential overflows. As on the host (src/cpu/merge.cpp): a state
// with lse = -inf saw no key, has weight 0 and its o is never read (an empty partial's o may be
// uninitialised, and 0 * NaN would poison the result); if every state is empty the result is
// o = 0, lse = -inf. Never NaN.
//
// One warp per (row, head), lanes over head_dim: the weights are computed once per warp (every
// lane reads the same lse values, served by one broadcast), the o rows stream coalesced. Each
// lane reads its features of every input before writing the same features, so o_out may alias
// an input (an in-place merge into o_a), as on the host. Operand dtypes (fp32, fp16, bf16) may
// differ from one another: the conversion is a uniform switch, and the op is memory-bound.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/dtype_convert.cuh"
#include "cuda/ptx/math.cuh"

namespace tessera::detail {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kWarpsPerBlock = kMergeThreads / 32;
constexpr int64_t kMaxGridX = 2147483647;

// A [N, H, D] operand with element strides (the last dim is contiguous).
struct MergeOperand {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t stride_row = 0;
  int64_t stride_head = 0;

  __device__ __forceinline__ int64_t offset(int64_t row, int64_t head) const {
    return row * stride_row + head * stride_head;
  }
};

MergeOperand operand_of(const TensorView& view) {
  return {view.data, view.dtype, view.stride[0], view.stride[1]};
}

struct MergeStateParams {
  MergeOperand o_a, o_b, o_out;
  const float* lse_a = nullptr;
  const float* lse_b = nullptr;
  float* lse_out = nullptr;  // optional
  int64_t rows = 0;
  int32_t heads = 0;
  int32_t head_dim = 0;
};

struct MergeStatesParams {
  MergeOperand states, o_out;
  const float* lse = nullptr;  // [num_states, heads]
  const int32_t* indptr = nullptr;
  float* lse_out = nullptr;  // optional
  int64_t rows = 0;
  int32_t heads = 0;
  int32_t head_dim = 0;
};

__device__ __forceinline__ bool is_empty_state(float lse) {
  return lse == -INFINITY;
}

__device__ void write_empty_row(const MergeOperand& o_out, int64_t row, int32_t head,
                                int32_t head_dim, float* lse_out, int64_t lse_index) {
  const int lane = threadIdx.x % 32;
  const int64_t base = o_out.offset(row, head);
  for (int32_t d = lane; d < head_dim; d += 32) {
    store_element_from_float(o_out.data, o_out.dtype, base + d, 0.0f);
  }
  if (lse_out != nullptr && lane == 0) lse_out[lse_index] = -INFINITY;
}

__global__ void __launch_bounds__(kMergeThreads)
    merge_state_kernel(const __grid_constant__ MergeStateParams params) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= params.rows * params.heads) return;  // whole warps leave together
  const int64_t row = task / params.heads;
  const int32_t head = static_cast<int32_t>(task - row * params.heads);
  const int lane = threadIdx.x % 32;

  const float lse_a = params.lse_a[task];
  const float lse_b = params.lse_b[task];
  const bool a_empty = is_empty_state(lse_a), b_empty = is_empty_state(lse_b);
  if (a_empty && b_empty) {
    write_empty_row(params.o_out, row, head, params.head_dim, params.lse_out, task);
    return;
  }
  const float max_lse = a_empty ? lse_b : (b_empty ? lse_a : fmaxf(lse_a, lse_b));
  const float weight_a = a_empty ? 0.0f : expf(lse_a - max_lse);
  const float weight_b = b_empty ? 0.0f : expf(lse_b - max_lse);
  const float total = weight_a + weight_b;  // >= 1: the larger side has weight exp(0)
  const float scale_a = weight_a / total, scale_b = weight_b / total;

  const int64_t base_a = params.o_a.offset(row, head);
  const int64_t base_b = params.o_b.offset(row, head);
  const int64_t base_out = params.o_out.offset(row, head);
  for (int32_t d = lane; d < params.head_dim; d += 32) {
    float value = 0.0f;
    if (!a_empty)
      value += scale_a * load_element_as_float(params.o_a.data, params.o_a.dtype, base_a + d);
    if (!b_empty)
      value += scale_b * load_element_as_float(params.o_b.data, params.o_b.dtype, base_b + d);
    store_element_from_float(params.o_out.data, params.o_out.dtype, base_out + d, value);
  }
  if (params.lse_out != nullptr && lane == 0) params.lse_out[task] = max_lse + logf(total);
}

__global__ void __launch_bounds__(kMergeThreads)
    merge_states_kernel(const __grid_constant__ MergeStatesParams params) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= params.rows * params.heads) return;  // whole warps leave together
  const int64_t row = task / params.heads;
  const int32_t head = static_cast<int32_t>(task - row * params.heads);
  const int lane = threadIdx.x % 32;
  const int32_t first_state = params.indptr[row];
  const int32_t end_state = params.indptr[row + 1];
  const float* lse = params.lse + head;  // lse of state s at lse[s * heads]

  float max_lse = -INFINITY;
  for (int32_t state = first_state; state < end_state; ++state) {
    const float value = lse[static_cast<int64_t>(state) * params.heads];
    // max_nan: a NaN state (a row with a NaN score) makes the merged row NaN, even alone.
    if (!is_empty_state(value)) max_lse = ptx::max_nan(max_lse, value);
  }
  if (is_empty_state(max_lse)) {
    write_empty_row(params.o_out, row, head, params.head_dim, params.lse_out, task);
    return;
  }
  float total = 0.0f;
  for (int32_t state = first_state; state < end_state; ++state) {
    const float value = lse[static_cast<int64_t>(state) * params.heads];
    if (!is_empty_state(value)) total += expf(value - max_lse);
  }
  const float inverse_total = 1.0f / total;  // total >= 1, or NaN

  const int64_t base_out = params.o_out.offset(row, head);
  for (int32_t d = lane; d < params.head_dim; d += 32) {
    float accumulator = 0.0f;
    for (int32_t state = first_state; state < end_state; ++state) {
      const float value = lse[static_cast<int64_t>(state) * params.heads];
      if (is_empty_state(value)) continue;
      const float weight = expf(value - max_lse) * inverse_total;
      accumulator += weight * load_element_as_float(params.states.data, params.states.dtype,
                                                    params.states.offset(state, head) + d);
    }
    store_element_from_float(params.o_out.data, params.o_out.dtype, base_out + d, accumulator);
  }
  if (params.lse_out != nullptr && lane == 0) params.lse_out[task] = max_lse + logf(total);
}

dim3 merge_grid(int64_t tasks, const char* op) {
  const int64_t blocks = (tasks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > kMaxGridX) {
    throw Error(Error::Kind::kUnsupported,
                std::string(op) + ": too many (row, head) pairs for one launch");
  }
  return dim3(static_cast<unsigned>(blocks));
}

}  // namespace

void cuda_merge_state(const TensorView& o_a, const float* lse_a, const TensorView& o_b,
                      const float* lse_b, const TensorView& o_out, float* lse_out, void* stream) {
  MergeStateParams params;
  params.o_a = operand_of(o_a);
  params.o_b = operand_of(o_b);
  params.o_out = operand_of(o_out);
  params.lse_a = lse_a;
  params.lse_b = lse_b;
  params.lse_out = lse_out;
  params.rows = o_a.shape[0];
  params.heads = static_cast<int32_t>(o_a.shape[1]);
  params.head_dim = static_cast<int32_t>(o_a.shape[2]);
  const int64_t tasks = params.rows * params.heads;
  if (tasks == 0) return;
  const dim3 grid = merge_grid(tasks, "merge_state"), block(kMergeThreads);
  merge_state_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(params);
  check_kernel_launch("merge_state_kernel", grid, block, 0);
}

void cuda_merge_states(const TensorView& states, const float* lse, const int32_t* indptr,
                       const TensorView& o_out, float* lse_out, void* stream) {
  MergeStatesParams params;
  params.states = operand_of(states);
  params.o_out = operand_of(o_out);
  params.lse = lse;
  params.indptr = indptr;
  params.lse_out = lse_out;
  params.rows = o_out.shape[0];
  params.heads = static_cast<int32_t>(o_out.shape[1]);
  params.head_dim = static_cast<int32_t>(o_out.shape[2]);
  const int64_t tasks = params.rows * params.heads;
  if (tasks == 0) return;
  const dim3 grid = merge_grid(tasks, "merge_states"), block(kMergeThreads);
  merge_states_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(params);
  check_kernel_launch("merge_states_kernel", grid, block, 0);
}

}  // namespace tessera::detail
