// cuda_apply_rope: rotary position embedding of q and k, in place.
//
// One CTA per token: its threads first evaluate cos/sin of every pair once (in double, see
// rope_common.cuh) into shared memory, then rotate every head of q and of k with them. RoPE is a
// memory-bound pass over q and k; the per-token table keeps the double-precision trigonometry at
// rotary_dim / 2 evaluations per token instead of one per element.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/dtype_convert.cuh"
#include "cuda/ops/rope_common.cuh"

namespace tessera::detail {
namespace {

constexpr int kRopeThreads = 128;
constexpr int64_t kMaxGridX = 2147483647;  // one CTA per token

// One tensor to rotate: [nnz, heads, head_dim] with element strides.
struct RopeTensor {
  void* data = nullptr;
  DType dtype = DType::kFloat16;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  int32_t heads = 0;  // 0: absent
};

struct RopeParams {
  RopeTensor q;
  RopeTensor k;
  const int32_t* positions = nullptr;
  RopeFrequencies table;
};

__device__ void rotate_heads(const RopeTensor& tensor, int64_t token, const float* cos_values,
                             const float* sin_values, int32_t rotary_dim, bool interleave) {
  const int32_t pairs = rotary_dim / 2;
  const int32_t tasks = tensor.heads * pairs;
  for (int32_t task = threadIdx.x; task < tasks; task += blockDim.x) {
    const int32_t head = task / pairs;
    const int32_t pair = task - head * pairs;
    int32_t first, second;
    rope_pair_features(pair, rotary_dim, interleave, &first, &second);
    const int64_t base = token * tensor.stride_token + head * tensor.stride_head;
    float x = load_element_as_float(tensor.data, tensor.dtype, base + first);
    float y = load_element_as_float(tensor.data, tensor.dtype, base + second);
    rope_rotate_pair(&x, &y, cos_values[pair], sin_values[pair]);
    store_element_from_float(tensor.data, tensor.dtype, base + first, x);
    store_element_from_float(tensor.data, tensor.dtype, base + second, y);
  }
}

__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(const __grid_constant__ RopeParams params) {
  __shared__ float cos_values[kMaxRopePairs];
  __shared__ float sin_values[kMaxRopePairs];
  const int64_t token = blockIdx.x;
  const int32_t position = params.positions[token];
  const int32_t pairs = params.table.rotary_dim / 2;
  for (int32_t pair = threadIdx.x; pair < pairs; pair += blockDim.x) {
    rope_cos_sin(position, params.table.frequency[pair], &cos_values[pair], &sin_values[pair]);
  }
  __syncthreads();
  if (params.q.heads > 0) {
    rotate_heads(params.q, token, cos_values, sin_values, params.table.rotary_dim,
                 params.table.interleave);
  }
  if (params.k.heads > 0) {
    rotate_heads(params.k, token, cos_values, sin_values, params.table.rotary_dim,
                 params.table.interleave);
  }
}

// apply_rope_with_cos_sin_cache: the angles come from the caller's table.
struct RopeTableParams {
  RopeTensor q;
  RopeTensor k;
  const void* positions = nullptr;
  bool wide_positions = false;  // int64 (else int32)
  const float* table = nullptr;  // [max_position, rotary_dim]: cos of the pairs, then sin
  int64_t table_stride = 0;
  int64_t max_position = 0;
  int32_t rotary_dim = 0;
  bool interleave = false;
};

// The rotated features of one token's heads set to NaN (an out-of-range position).
__device__ void poison_heads(const RopeTensor& tensor, int64_t token, int32_t rotary_dim) {
  const int32_t tasks = tensor.heads * rotary_dim;
  for (int32_t task = threadIdx.x; task < tasks; task += blockDim.x) {
    const int32_t head = task / rotary_dim;
    const int32_t feature = task - head * rotary_dim;
    store_element_from_float(tensor.data, tensor.dtype,
                             token * tensor.stride_token + head * tensor.stride_head + feature,
                             __int_as_float(0x7fc00000));
  }
}

__global__ void __launch_bounds__(kRopeThreads)
    rope_table_kernel(const __grid_constant__ RopeTableParams params) {
  const int64_t token = blockIdx.x;
  const int64_t position = params.wide_positions
                               ? static_cast<const int64_t*>(params.positions)[token]
                               : static_cast<const int32_t*>(params.positions)[token];
  const RopeTensor* tensors[2] = {&params.q, &params.k};
  if (position < 0 || position >= params.max_position) {  // never read outside the table
    for (const RopeTensor* tensor : tensors) {
      if (tensor->heads > 0) poison_heads(*tensor, token, params.rotary_dim);
    }
    return;
  }
  const float* cos_values = params.table + position * params.table_stride;
  const float* sin_values = cos_values + params.rotary_dim / 2;
  for (const RopeTensor* tensor : tensors) {
    if (tensor->heads > 0) {
      rotate_heads(*tensor, token, cos_values, sin_values, params.rotary_dim, params.interleave);
    }
  }
}

RopeTensor rope_tensor_of(const TensorView& view) {
  RopeTensor tensor;
  if (!has_value(view) || view.numel() == 0) return tensor;
  tensor.data = view.data;
  tensor.dtype = view.dtype;
  tensor.stride_token = view.stride[0];
  tensor.stride_head = view.stride[1];
  tensor.heads = static_cast<int32_t>(view.shape[1]);
  return tensor;
}

}  // namespace

void cuda_apply_rope(const TensorView& q, const TensorView& k, const int32_t* positions,
                     const RopeOptions& options, void* stream) {
  RopeParams params;
  params.q = rope_tensor_of(q);
  params.k = rope_tensor_of(k);
  if (params.q.heads == 0 && params.k.heads == 0) return;
  const TensorView& present = params.q.heads > 0 ? q : k;
  const int64_t nnz = present.shape[0];
  if (nnz == 0) return;
  if (nnz > kMaxGridX) {
    throw Error(Error::Kind::kUnsupported,
                "apply_rope_inplace: more than 2^31 - 1 tokens in one call is not supported");
  }
  const int32_t head_dim = static_cast<int32_t>(present.shape[2]);
  const int32_t rotary_dim = options.rotary_dim == 0 ? head_dim : options.rotary_dim;
  params.positions = positions;
  params.table = make_rope_frequencies(rotary_dim, options);

  const dim3 grid(static_cast<unsigned>(nnz));
  const dim3 block(kRopeThreads);
  rope_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(params);
  check_kernel_launch("rope_kernel", grid, block, 0);
}

void cuda_apply_rope_cos_sin_cache(const TensorView& q, const TensorView& k,
                                   const TensorView& positions, const TensorView& cos_sin_cache,
                                   bool interleave, void* stream) {
  RopeTableParams params;
  params.q = rope_tensor_of(q);
  params.k = rope_tensor_of(k);
  if (params.q.heads == 0 && params.k.heads == 0) return;
  const TensorView& present = params.q.heads > 0 ? q : k;
  const int64_t nnz = present.shape[0];
  if (nnz == 0) return;
  if (nnz > kMaxGridX) {
    throw Error(Error::Kind::kUnsupported,
                "apply_rope_with_cos_sin_cache_inplace: more than 2^31 - 1 tokens in one call is "
                "not supported");
  }
  params.positions = positions.data;
  params.wide_positions = positions.dtype == DType::kInt64;
  params.table = cos_sin_cache.ptr<const float>();
  params.table_stride = cos_sin_cache.stride[0];
  params.max_position = cos_sin_cache.shape[0];
  params.rotary_dim = static_cast<int32_t>(cos_sin_cache.shape[1]);
  params.interleave = interleave;
  const dim3 grid(static_cast<unsigned>(nnz));
  const dim3 block(kRopeThreads);
  rope_table_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(params);
  check_kernel_launch("rope_table_kernel", grid, block, 0);
}

}  // namespace tessera::detail
