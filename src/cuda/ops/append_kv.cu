// cuda_append_paged_kv: scatters new K/V rows into a paged cache, optionally rotating K (fused
// RoPE), converting to the cache dtype (fp8 included) on the way.
//
// Semantics are the CPU backend's (src/cpu/append_kv.cpp): the page table already describes the
// cache after the append, so row i of request b (append_len_b rows) lands at position
// kv_len_b - append_len_b + i. Same-dtype rows are copied bit for bit; otherwise each element goes
// through float with the host's rounding rules (cuda/dtype_convert.cuh). With RoPE, K goes
// through float like on the host, so "rotate, then append" and the fused append agree.
//
// One CTA per new row, its threads over (head, feature): consecutive threads touch consecutive
// features, so reads of k_new/v_new and writes of one cache row are coalesced. The row's request
// comes from a binary search of append_indptr (no host-side precomputation, so the op needs no
// workspace and is CUDA-graph safe).
//
// The page table lives on the device and cannot be checked on the host without a
// synchronisation, so the kernel itself refuses to write through an entry that would be out of
// range of the request (a position outside [0, kv_len) or a negative page index).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/dtype_convert.cuh"
#include "cuda/ops/rope_common.cuh"

namespace tessera::detail {
namespace {

constexpr int kAppendThreads = 128;
constexpr int64_t kMaxGridX = 2147483647;  // one CTA per new row

struct AppendSide {
  const void* source = nullptr;  // [nnz, num_kv_heads, head_dim]
  int64_t source_stride_token = 0;
  int64_t source_stride_head = 0;
  void* cache = nullptr;
  int64_t cache_stride_page = 0;
  int64_t cache_stride_token = 0;
  int64_t cache_stride_head = 0;
};

struct AppendParams {
  AppendSide key;
  AppendSide value;
  DType source_dtype = DType::kFloat16;
  DType cache_dtype = DType::kFloat16;
  const int32_t* append_indptr = nullptr;
  const int32_t* page_indptr = nullptr;
  const int32_t* page_indices = nullptr;
  const int32_t* last_page_len = nullptr;
  int32_t page_size = 0;
  int32_t batch_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  bool rope = false;
  RopeFrequencies table;
};

// The request owning new row `row`: the last b with append_indptr[b] <= row.
__device__ int32_t request_of_row(const int32_t* append_indptr, int32_t batch_size, int64_t row) {
  int32_t low = 0, high = batch_size;  // append_indptr[low] <= row < append_indptr[high]
  while (high - low > 1) {
    const int32_t middle = low + (high - low) / 2;  // low + high overflows past 2^30 requests
    if (append_indptr[middle] <= row) {
      low = middle;
    } else {
      high = middle;
    }
  }
  return low;
}

// Copies (with conversion) features [first_feature, head_dim) of every head of one row.
__device__ void copy_row_features(const AppendSide& side, const AppendParams& params, int64_t row,
                                  int64_t cache_row_offset, int32_t first_feature) {
  const int32_t features = params.head_dim - first_feature;
  const int32_t tasks = params.num_kv_heads * features;
  const bool same_dtype = params.source_dtype == params.cache_dtype;
  for (int32_t task = threadIdx.x; task < tasks; task += blockDim.x) {
    const int32_t head = task / features;
    const int32_t feature = first_feature + (task - head * features);
    const int64_t source_index =
        row * side.source_stride_token + head * side.source_stride_head + feature;
    const int64_t cache_index = cache_row_offset + head * side.cache_stride_head + feature;
    if (same_dtype) {
      copy_element_bits(side.cache, cache_index, side.source, source_index, params.cache_dtype);
    } else {
      store_element_from_float(
          side.cache, params.cache_dtype, cache_index,
          load_element_as_float(side.source, params.source_dtype, source_index));
    }
  }
}

// Rotates features [0, rotary_dim) of every head of the K row and stores them; the features past
// rotary_dim go through float too, as on the host.
__device__ void append_rotated_key(const AppendParams& params, int64_t row,
                                   int64_t cache_row_offset, const float* cos_values,
                                   const float* sin_values) {
  const AppendSide& side = params.key;
  const int32_t rotary_dim = params.table.rotary_dim;
  const int32_t pairs = rotary_dim / 2;
  const int32_t tasks = params.num_kv_heads * pairs;
  for (int32_t task = threadIdx.x; task < tasks; task += blockDim.x) {
    const int32_t head = task / pairs;
    const int32_t pair = task - head * pairs;
    int32_t first, second;
    rope_pair_features(pair, rotary_dim, params.table.interleave, &first, &second);
    const int64_t source_base = row * side.source_stride_token + head * side.source_stride_head;
    const int64_t cache_base = cache_row_offset + head * side.cache_stride_head;
    float x = load_element_as_float(side.source, params.source_dtype, source_base + first);
    float y = load_element_as_float(side.source, params.source_dtype, source_base + second);
    rope_rotate_pair(&x, &y, cos_values[pair], sin_values[pair]);
    store_element_from_float(side.cache, params.cache_dtype, cache_base + first, x);
    store_element_from_float(side.cache, params.cache_dtype, cache_base + second, y);
  }
  const int32_t features = params.head_dim - rotary_dim;
  const int32_t tail_tasks = params.num_kv_heads * features;
  for (int32_t task = threadIdx.x; task < tail_tasks; task += blockDim.x) {
    const int32_t head = task / features;
    const int32_t feature = rotary_dim + (task - head * features);
    const float value = load_element_as_float(
        side.source, params.source_dtype,
        row * side.source_stride_token + head * side.source_stride_head + feature);
    store_element_from_float(side.cache, params.cache_dtype,
                             cache_row_offset + head * side.cache_stride_head + feature, value);
  }
}

__global__ void __launch_bounds__(kAppendThreads)
    append_paged_kv_kernel(const __grid_constant__ AppendParams params) {
  __shared__ float cos_values[kMaxRopePairs];
  __shared__ float sin_values[kMaxRopePairs];
  const int64_t row = blockIdx.x;
  const int32_t request = request_of_row(params.append_indptr, params.batch_size, row);
  const int32_t first_row = params.append_indptr[request];
  const int32_t append_len = params.append_indptr[request + 1] - first_row;
  const int32_t first_page = params.page_indptr[request];
  const int32_t num_pages = params.page_indptr[request + 1] - first_page;
  // In 64 bits: a page table (which the host cannot check) describing more than 2^31 - 1 keys
  // must not wrap to a small kv_len and send the row to a wrong position; it is refused instead.
  const int64_t kv_len =
      num_pages > 0 ? int64_t{num_pages - 1} * params.page_size + params.last_page_len[request] : 0;
  const int64_t row_position = kv_len - append_len + (row - first_row);
  // Uniform across the CTA (every thread computed the same values), so returning before the
  // barrier below is safe.
  if (kv_len > INT32_MAX || row_position < 0 || row_position >= kv_len) return;
  const int32_t position = static_cast<int32_t>(row_position);
  // The cos/sin table first: sincos in double may call its slow-path argument reduction, and
  // keeping little state alive across that call keeps the kernel free of register spills.
  if (params.rope) {
    for (int32_t pair = threadIdx.x; pair < params.table.rotary_dim / 2; pair += blockDim.x) {
      rope_cos_sin(position, params.table.frequency[pair], &cos_values[pair], &sin_values[pair]);
    }
    __syncthreads();
  }
  const int32_t page = params.page_indices[first_page + position / params.page_size];
  if (page < 0) return;  // uniform, and after the only barrier
  const int32_t slot = position % params.page_size;

  const int64_t key_row_offset = static_cast<int64_t>(page) * params.key.cache_stride_page +
                                 static_cast<int64_t>(slot) * params.key.cache_stride_token;
  const int64_t value_row_offset = static_cast<int64_t>(page) * params.value.cache_stride_page +
                                   static_cast<int64_t>(slot) * params.value.cache_stride_token;
  if (params.rope) {
    append_rotated_key(params, row, key_row_offset, cos_values, sin_values);
  } else {
    copy_row_features(params.key, params, row, key_row_offset, 0);
  }
  copy_row_features(params.value, params, row, value_row_offset, 0);
}

}  // namespace

void cuda_append_paged_kv(const TensorView& k_new, const TensorView& v_new,
                          const int32_t* append_indptr, const KVSource& cache, int32_t batch_size,
                          int32_t num_kv_heads, int32_t head_dim, const RopeOptions* rope,
                          void* stream) {
  const int64_t nnz = k_new.shape[0];
  if (nnz == 0 || batch_size == 0 || num_kv_heads == 0) return;
  if (nnz > kMaxGridX) {
    throw Error(Error::Kind::kUnsupported,
                "append_paged_kv_cache: more than 2^31 - 1 new rows in one call is not supported");
  }
  AppendParams params;
  // KVSource is the read-side descriptor and carries const pointers; the cache is writable
  // memory handed in through PagedKVCache.
  params.key = {
      k_new.data,          k_new.stride[0],      k_new.stride[1],    const_cast<void*>(cache.k),
      cache.k_stride_page, cache.k_stride_token, cache.k_stride_head};
  params.value = {
      v_new.data,          v_new.stride[0],      v_new.stride[1],    const_cast<void*>(cache.v),
      cache.v_stride_page, cache.v_stride_token, cache.v_stride_head};
  params.source_dtype = k_new.dtype;
  params.cache_dtype = cache.dtype;
  params.append_indptr = append_indptr;
  params.page_indptr = cache.page_indptr;
  params.page_indices = cache.page_indices;
  params.last_page_len = cache.last_page_len;
  params.page_size = cache.page_size;
  params.batch_size = batch_size;
  params.num_kv_heads = num_kv_heads;
  params.head_dim = head_dim;
  params.rope = rope != nullptr;
  if (rope != nullptr) {
    const int32_t rotary_dim = rope->rotary_dim == 0 ? head_dim : rope->rotary_dim;
    params.table = make_rope_frequencies(rotary_dim, *rope);
  }

  const dim3 grid(static_cast<unsigned>(nnz));
  const dim3 block(kAppendThreads);
  append_paged_kv_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(params);
  check_kernel_launch("append_paged_kv_kernel", grid, block, 0);
}

}  // namespace tessera::detail
