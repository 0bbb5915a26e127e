// The C ABI of MLA (tessera.h, tessera/mla.hpp): conversions only; every check is the C++ API's.
#include <string>

#include "capi/c_api_internal.hpp"
#include "tessera/mla.hpp"
#include "tessera/tessera.h"

struct tessera_mla_plan {
  tessera::MlaPlan plan;
};

namespace {

using namespace tessera::capi;  // NOLINT: the ABI layer's shared helpers

tessera::MlaOptions mla_options(const tessera_mla_options* options) {
  tessera::MlaOptions result;
  if (options == nullptr) return result;
  result.causal = options->causal != 0;
  result.sm_scale = options->sm_scale;
  return result;
}

tessera::MlaPagedCache mla_cache(const Converter& convert, const tessera_mla_cache* cache) {
  if (cache == nullptr) convert.fail("cache", "expected a tessera_mla_cache, got NULL");
  tessera::MlaPagedCache result;
  result.ckv_cache = convert.tensor(cache->ckv_cache, "ckv_cache");
  result.kpe_cache = convert.optional(cache->kpe_cache, "kpe_cache");
  result.page_indptr = convert.tensor(cache->page_indptr, "page_indptr");
  result.page_indices = convert.tensor(cache->page_indices, "page_indices");
  result.last_page_len = convert.tensor(cache->last_page_len, "last_page_len");
  return result;
}

const tessera::MlaPlan& mla_plan(const Converter& convert, const tessera_mla_plan* plan) {
  if (plan == nullptr) convert.fail("plan", "expected a tessera_mla_plan, got NULL");
  return plan->plan;
}

}  // namespace

extern "C" {

tessera_status tessera_plan_mla(const int32_t* qo_indptr, const int32_t* page_indptr,
                                const int32_t* last_page_len, int64_t batch_size, int page_size,
                                int num_heads, int kv_lora_rank, int rope_dim,
                                const tessera_mla_options* options, int device_type, int device_id,
                                tessera_mla_plan** out) {
  constexpr const char* kFunction = "tessera_plan_mla";
  if (out != nullptr) *out = nullptr;
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    if (out == nullptr) convert.fail("out", "expected a tessera_mla_plan**, got NULL");
    convert.batch_size(batch_size);
    // One at a time, so the first bad array is the one named.
    const auto qo = convert.host_array(qo_indptr, batch_size + 1, "qo_indptr");
    const auto pages = convert.host_array(page_indptr, batch_size + 1, "page_indptr");
    const auto last = convert.host_array(last_page_len, batch_size, "last_page_len");
    const tessera::Device device = convert.device(device_type, device_id);
    *out =
        new tessera_mla_plan{tessera::plan_mla(qo, pages, last, page_size, num_heads, kv_lora_rank,
                                               rope_dim, mla_options(options), device)};
  });
}

size_t tessera_mla_plan_workspace_bytes(const tessera_mla_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.workspace_bytes();
}

tessera_status tessera_mla_plan_explain(const tessera_mla_plan* plan, char* buffer, size_t capacity,
                                        size_t* needed) {
  constexpr const char* kFunction = "tessera_mla_plan_explain";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    copy_text(convert, mla_plan(convert, plan).explain(), buffer, capacity, needed);
  });
}

void tessera_mla_plan_destroy(tessera_mla_plan* plan) {
  delete plan;
}

tessera_status tessera_run_mla(const tessera_mla_plan* plan, const DLTensor* q_nope,
                               const DLTensor* q_pe, const tessera_mla_cache* cache,
                               const DLTensor* qo_indptr, const DLTensor* o, const DLTensor* lse,
                               void* workspace, size_t workspace_bytes, void* stream) {
  constexpr const char* kFunction = "tessera_run_mla";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::MlaPlan& mla = mla_plan(convert, plan);
    tessera::run_mla(mla, convert.tensor(q_nope, "q_nope"), convert.optional(q_pe, "q_pe"),
                     mla_cache(convert, cache), convert.tensor(qo_indptr, "qo_indptr"),
                     convert.tensor(o, "o"), convert.optional(lse, "lse"),
                     {workspace, workspace_bytes}, stream);
  });
}

tessera_status tessera_mla_attention(const DLTensor* q_nope, const DLTensor* q_pe,
                                     const tessera_mla_cache* cache, const DLTensor* qo_indptr,
                                     const DLTensor* o, const DLTensor* lse,
                                     const tessera_mla_options* options, void* stream) {
  constexpr const char* kFunction = "tessera_mla_attention";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    tessera::mla_attention(convert.tensor(q_nope, "q_nope"), convert.optional(q_pe, "q_pe"),
                           mla_cache(convert, cache), convert.tensor(qo_indptr, "qo_indptr"),
                           convert.tensor(o, "o"), convert.optional(lse, "lse"),
                           mla_options(options), stream);
  });
}

tessera_status tessera_append_paged_mla_cache(const DLTensor* ckv_new, const DLTensor* kpe_new,
                                              const DLTensor* append_indptr,
                                              const tessera_mla_cache* cache,
                                              const tessera_rope_options* rope, void* stream) {
  constexpr const char* kFunction = "tessera_append_paged_mla_cache";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::RopeOptions rope_settings = rope_options(rope);
    tessera::append_paged_mla_cache(
        convert.tensor(ckv_new, "ckv_new"), convert.optional(kpe_new, "kpe_new"),
        convert.tensor(append_indptr, "append_indptr"), mla_cache(convert, cache),
        rope != nullptr ? &rope_settings : nullptr, stream);
  });
}

}  // extern "C"
