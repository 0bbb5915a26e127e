// The KVSource view of a validated PagedKVCache: NHD and HND differ only in which strides are
// the token and head strides.
#pragma once

#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

inline KVSource paged_kv_source(const PagedKVCache& kv) {
  const bool nhd = kv.layout == KVLayout::kNHD;
  const int token_dim = nhd ? 1 : 2, head_dim_index = nhd ? 2 : 1;
  KVSource source;
  source.dtype = kv.k_cache.dtype;
  source.paged = true;
  source.k = kv.k_cache.data;
  source.v = kv.v_cache.data;
  source.k_stride_page = kv.k_cache.stride[0];
  source.v_stride_page = kv.v_cache.stride[0];
  source.k_stride_token = kv.k_cache.stride[token_dim];
  source.v_stride_token = kv.v_cache.stride[token_dim];
  source.k_stride_head = kv.k_cache.stride[head_dim_index];
  source.v_stride_head = kv.v_cache.stride[head_dim_index];
  source.page_indptr = kv.page_indptr.ptr<const int32_t>();
  source.page_indices = kv.page_indices.ptr<const int32_t>();
  source.last_page_len = kv.last_page_len.ptr<const int32_t>();
  source.page_size = static_cast<int32_t>(kv.k_cache.shape[token_dim]);
  source.k_extent = kv.k_cache.shape[0];
  source.v_extent = kv.v_cache.shape[0];
  return source;
}

}  // namespace tessera::detail
