// append_paged_mla_cache (include/tessera/mla.hpp): the paged append of the other caches
// (cpu/append_kv.cpp) with kpe as the "key" rows (rotated there when asked, by the same RoPE
// code) and ckv as the "value" rows of another width, both one head wide.
#include <string>

#include "core/backends.hpp"
#include "core/mla_internal.hpp"
#include "core/validate.hpp"
#include "tessera/mla.hpp"

namespace tessera {
namespace {

// [nnz, width] as [nnz, 1, width]: the one-head rows cpu_append_paged_kv reads.
TensorView one_head(const TensorView& rows) {
  TensorView view = rows;
  view.ndim = 3;
  view.shape[2] = rows.shape[1];
  view.stride[2] = 1;
  view.shape[1] = 1;
  view.stride[1] = rows.shape[1];
  return view;
}

}  // namespace

void append_paged_mla_cache(const TensorView& ckv_new, const TensorView& kpe_new,
                            const TensorView& append_indptr, const MlaPagedCache& cache,
                            const RopeOptions* rope, void* stream) {
  const detail::ArgChecker check("append_paged_mla_cache");
  check.tensor(ckv_new, "ckv_new", 2, "[nnz, kv_lora_rank]");
  const Device device = ckv_new.device;
  detail::check_mla_device(check, device);
  check.dtype_in(ckv_new, "ckv_new", {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  const int64_t nnz = ckv_new.shape[0];
  const bool has_rope = has_value(kpe_new);
  if (has_rope) {
    check.tensor(kpe_new, "kpe_new", 2, "[nnz, rope_dim]");
    check.dtype_is(kpe_new, "kpe_new", ckv_new.dtype);
    check.device_is(kpe_new, "kpe_new", device);
    check.dim_is(kpe_new, "kpe_new", 0, nnz, "nnz, the rows of ckv_new");
  }
  check.require(has_rope || !has_value(cache.kpe_cache), "kpe_new",
                "expected [nnz, rope_dim] rows: the cache has a kpe_cache");
  const int64_t lora = ckv_new.shape[1], rope_dim = has_rope ? kpe_new.shape[1] : 0;
  check.require(lora <= detail::kMaxMlaLoraRank && rope_dim <= detail::kMaxMlaRopeDim,
                lora <= detail::kMaxMlaLoraRank ? "kpe_new" : "ckv_new", [&] {
                  return "expected kv_lora_rank <= " + std::to_string(detail::kMaxMlaLoraRank) +
                         " and rope_dim <= " + std::to_string(detail::kMaxMlaRopeDim) + ", got " +
                         std::to_string(lora) + " and " + std::to_string(rope_dim);
                });
  detail::check_mla_widths(check, static_cast<int>(lora), static_cast<int>(rope_dim));
  check.tensor(cache.ckv_cache, "ckv_cache", 3, "[num_pages, page_size, kv_lora_rank]");
  const int64_t page_size = cache.ckv_cache.shape[1];
  check.require(page_size >= 1 && page_size <= INT32_MAX, "ckv_cache", [&] {
    return "expected page_size in [1, 2^31), got " + std::to_string(page_size);
  });
  // The cache may hold another dtype than the new rows (converted, as append_paged_kv_cache).
  check.dtype_in(cache.ckv_cache, "ckv_cache",
                 {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  detail::check_mla_caches(check, cache, static_cast<int>(lora), static_cast<int>(rope_dim),
                           page_size, cache.ckv_cache.dtype, device, /*written=*/true);
  check.index_array(append_indptr, "append_indptr", -1, device);
  const int64_t batch = append_indptr.shape[0] - 1;
  check.require(batch >= 0 && batch <= INT32_MAX, "append_indptr", [&] {
    return "expected batch_size + 1 in [1, 2^31] elements, got " +
           std::to_string(append_indptr.shape[0]);
  });
  check.index_array(cache.page_indptr, "page_indptr", batch + 1, device);
  check.index_array(cache.page_indices, "page_indices", -1, device);
  check.index_array(cache.last_page_len, "last_page_len", batch, device);
  if (rope != nullptr) {
    check.require(has_rope, "rope", "RoPE needs kpe rows: kpe_new is empty (rope_dim 0)");
    detail::check_rope_options(check, *rope, rope_dim);
  }
  detail::KVSource kv = detail::mla_kv_source(cache, static_cast<int>(rope_dim));
  // The writer addresses the kpe rows as the keys of its own KVSource: k = kpe, v = ckv.
  kv.k = has_rope ? cache.kpe_cache.data : nullptr;
  kv.k_stride_page = has_rope ? cache.kpe_cache.stride[0] : 0;
  kv.k_stride_token = has_rope ? cache.kpe_cache.stride[1] : 0;
  kv.k_rope = nullptr;
  const int32_t* append = append_indptr.ptr<const int32_t>();
  detail::check_append_page_table(check, append, batch, nnz, kv, page_size,
                                  cache.page_indices.shape[0], cache.ckv_cache.shape[0], "ckv_new");
  const TensorView ckv_rows = one_head(ckv_new);
  const TensorView kpe_rows = has_rope ? one_head(kpe_new) : TensorView{};
  detail::cpu_append_paged_kv(kpe_rows, ckv_rows, append, kv, static_cast<int32_t>(batch),
                              /*num_kv_heads=*/1, static_cast<int32_t>(rope_dim), rope,
                              static_cast<int32_t>(lora));
}

}  // namespace tessera
