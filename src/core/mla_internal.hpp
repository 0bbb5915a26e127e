// Shared pieces of the MLA entry points (mla_api.cpp: attention; mla_append.cpp: the cache
// append) and the ops' checks they reuse (defined in ops_api.cpp).
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "core/validate.hpp"
#include "tessera/mla.hpp"

namespace tessera::detail {

inline constexpr int kMaxMlaLoraRank = 512;
inline constexpr int kMaxMlaRopeDim = 128;

// kv_lora_rank a multiple of 8 in [8, 512], rope_dim a multiple of 8 in [0, 128].
void check_mla_widths(const ArgChecker& check, int kv_lora_rank, int rope_dim);
// Error(kUnsupported) naming 'device' for anything but the CPU (no MLA kernels on CUDA yet).
void check_mla_device(const ArgChecker& check, Device device);
// ckv_cache [num_pages, page_size, kv_lora_rank] and (rope_dim > 0) kpe_cache [num_pages,
// page_size, rope_dim] of `dtype` on `device`; `written`: they are outputs (no aliasing).
void check_mla_caches(const ArgChecker& check, const MlaPagedCache& cache, int kv_lora_rank,
                      int rope_dim, int64_t page_size, DType dtype, Device device, bool written);
// The paged KVSource of a checked cache: K = [ckv | kpe] rows (kpe as KVSource::k_rope unless it
// continues ckv's rows in memory), V = ckv, one kv head.
KVSource mla_kv_source(const MlaPagedCache& cache, int rope_dim);

// ops_api.cpp: append_paged_kv_cache's checks of its RoPE options against head_dim, and (host
// arrays) of append_indptr [batch + 1] against nnz rows and of the page table (lengths, the
// page ids against num_pages) of `cache`, which describes the cache after the append; rows_of
// names the tensor of the nnz rows in messages.
void check_rope_options(const ArgChecker& check, const RopeOptions& options, int64_t head_dim);
void check_append_page_table(const ArgChecker& check, const int32_t* append_indptr, int64_t batch,
                             int64_t nnz, const KVSource& cache, int64_t page_size,
                             int64_t page_indices_len, int64_t num_pages, const char* rows_of);

}  // namespace tessera::detail
