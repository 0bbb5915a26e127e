// CPU append of new K/V rows into a paged KV cache, with optional fused RoPE on K.
//
// The page table already describes the cache after the append, so request b's append_len new
// rows are its last append_len positions: kv_len(b) - append_len + i. Every destination element
// is addressed through KVSource, which is what the attention kernels read through, so NHD and HND
// caches (which differ only in strides) need no separate code.
//
// Values are converted from the dtype of k_new / v_new to the cache dtype with store_from_float
// (round to nearest even; fp8 saturates). A quantisation scale for an fp8 cache is the caller's
// business: the cache holds exactly the converted value.
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"

namespace tessera::detail {
namespace {

// Describes one of the two halves (K or V) of the append.
struct AppendSide {
  const TensorView* source;  // [nnz, heads, head_dim]
  void* cache;               // the cache buffer (KVSource only carries const pointers)
  bool is_key;
};

// Copies head row `head` of source row `row` into cache position `position` of request `request`.
void copy_row(const AppendSide& side, const KVSource& cache, int32_t request, int64_t row,
              int32_t head, int32_t position, int32_t head_dim) {
  if (head_dim == 0) return;  // MLA without a rope part: no key row
  const TensorView& source = *side.source;
  const int64_t source_offset = row * source.stride[0] + head * source.stride[1];
  const int64_t cache_offset = side.is_key ? cache.k_offset(request, head, position)
                                           : cache.v_offset(request, head, position);
  if (source.dtype == cache.dtype) {
    // Same format: a byte copy is exact, NaN payloads included.
    const size_t bytes = dtype_size(cache.dtype);
    std::memcpy(static_cast<char*>(side.cache) + cache_offset * bytes,
                static_cast<const char*>(source.data) + source_offset * bytes,
                static_cast<size_t>(head_dim) * bytes);
    return;
  }
  for (int32_t d = 0; d < head_dim; ++d) {
    store_from_float(side.cache, cache.dtype, cache_offset + d,
                     load_as_float(source.data, source.dtype, source_offset + d));
  }
}

// Appends request `request`'s K rows rotated by their positions. The rows are widened to a float
// scratch buffer and rotated by cpu_apply_rope itself, so the fused path runs the same arithmetic
// as rotating k_new in place and appending afterwards: the two agree bit for bit whenever k_new
// is fp32 or has the cache's dtype (otherwise the unfused path rounds twice, to k_new's dtype and
// then to the cache's, and the fused one once).
void append_rotated_keys(const TensorView& k_new, void* k_cache, const KVSource& cache,
                         int32_t request, int64_t first_row, int32_t append_len,
                         int32_t first_position, int32_t num_kv_heads, int32_t head_dim,
                         const RopeOptions& rope) {
  const int64_t row_elements = static_cast<int64_t>(num_kv_heads) * head_dim;
  std::vector<float> rows(static_cast<size_t>(append_len * row_elements));
  std::vector<int32_t> positions(static_cast<size_t>(append_len));
  for (int32_t i = 0; i < append_len; ++i) {
    positions[i] = first_position + i;
    for (int32_t head = 0; head < num_kv_heads; ++head) {
      const int64_t source_offset = (first_row + i) * k_new.stride[0] + head * k_new.stride[1];
      float* destination = rows.data() + i * row_elements + head * head_dim;
      for (int32_t d = 0; d < head_dim; ++d) {
        destination[d] = load_as_float(k_new.data, k_new.dtype, source_offset + d);
      }
    }
  }

  TensorView scratch;
  scratch.data = rows.data();
  scratch.dtype = DType::kFloat32;
  scratch.ndim = 3;
  scratch.shape[0] = append_len;
  scratch.shape[1] = num_kv_heads;
  scratch.shape[2] = head_dim;
  scratch.stride[0] = row_elements;
  scratch.stride[1] = head_dim;
  scratch.stride[2] = 1;
  cpu_apply_rope(TensorView{}, scratch, positions.data(), rope);

  for (int32_t i = 0; i < append_len; ++i) {
    for (int32_t head = 0; head < num_kv_heads; ++head) {
      const float* source = rows.data() + i * row_elements + head * head_dim;
      const int64_t cache_offset = cache.k_offset(request, head, first_position + i);
      for (int32_t d = 0; d < head_dim; ++d) {
        store_from_float(k_cache, cache.dtype, cache_offset + d, source[d]);
      }
    }
  }
}

}  // namespace

void cpu_append_paged_kv(const TensorView& k_new, const TensorView& v_new,
                         const int32_t* append_indptr, const KVSource& cache, int32_t batch_size,
                         int32_t num_kv_heads, int32_t head_dim, const RopeOptions* rope,
                         int32_t head_dim_v) {
  if (head_dim_v < 0) head_dim_v = head_dim;  // MLA: kpe (k, rope_dim) beside ckv (v)
  // The cache is writable memory handed in through PagedKVCache; KVSource is the read-side
  // descriptor shared with the attention kernels and therefore carries const pointers.
  void* k_cache = const_cast<void*>(cache.k);
  void* v_cache = const_cast<void*>(cache.v);
  const AppendSide key_side{&k_new, k_cache, true};
  const AppendSide value_side{&v_new, v_cache, false};

  for (int32_t request = 0; request < batch_size; ++request) {
    const int64_t first_row = append_indptr[request];
    const int32_t append_len = append_indptr[request + 1] - append_indptr[request];
    if (append_len == 0) continue;
    const int32_t first_position = cache.kv_len(request) - append_len;

    if (rope != nullptr) {
      append_rotated_keys(k_new, k_cache, cache, request, first_row, append_len, first_position,
                          num_kv_heads, head_dim, *rope);
    }
    for (int32_t i = 0; i < append_len; ++i) {
      for (int32_t head = 0; head < num_kv_heads; ++head) {
        if (rope == nullptr) {
          copy_row(key_side, cache, request, first_row + i, head, first_position + i, head_dim);
        }
        copy_row(value_side, cache, request, first_row + i, head, first_position + i, head_dim_v);
      }
    }
  }
}

}  // namespace tessera::detail
