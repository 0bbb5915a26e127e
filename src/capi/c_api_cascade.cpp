// The C ABI of multi-level cascade attention (tessera.h, tessera/cascade.hpp).
#include <string>
#include <vector>

#include "capi/c_api_internal.hpp"
#include "tessera/cascade.hpp"
#include "tessera/tessera.h"

struct tessera_cascade_plan {
  tessera::CascadePlan plan;
};

namespace {

using namespace tessera::capi;  // NOLINT: the ABI layer's shared helpers

constexpr int kMaxLevels = 16;

void check_level_count(const Converter& convert, const void* levels, int num_levels) {
  if (num_levels < 1 || num_levels > kMaxLevels) {
    convert.fail("num_levels", "expected 1.." + std::to_string(kMaxLevels) + ", got " +
                                   std::to_string(num_levels));
  }
  if (levels == nullptr) convert.fail("levels", "expected num_levels entries, got NULL");
}

const tessera::CascadePlan& cascade_plan(const Converter& convert,
                                         const tessera_cascade_plan* plan) {
  if (plan == nullptr) convert.fail("plan", "expected a tessera_cascade_plan, got NULL");
  return plan->plan;
}

}  // namespace

extern "C" {

tessera_status tessera_plan_cascade(const tessera_cascade_level_lengths* levels, int num_levels,
                                    int page_size, int num_qo_heads, int num_kv_heads,
                                    int head_dim, const tessera_attention_options* options,
                                    int device_type, int device_id, tessera_cascade_plan** out) {
  constexpr const char* kFunction = "tessera_plan_cascade";
  if (out != nullptr) *out = nullptr;
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    if (out == nullptr) convert.fail("out", "expected a tessera_cascade_plan**, got NULL");
    check_level_count(convert, levels, num_levels);
    std::vector<tessera::CascadeLevelLengths> lengths;
    for (int l = 0; l < num_levels; ++l) {
      const tessera_cascade_level_lengths& level = levels[l];
      convert.batch_size(level.batch_size);
      const std::string prefix = "levels[" + std::to_string(l) + "].";
      lengths.push_back(
          {convert.host_array(level.qo_indptr, level.batch_size + 1, (prefix + "qo_indptr").c_str()),
           convert.host_array(level.page_indptr, level.batch_size + 1,
                              (prefix + "page_indptr").c_str()),
           convert.host_array(level.last_page_len, level.batch_size,
                              (prefix + "last_page_len").c_str())});
    }
    *out = new tessera_cascade_plan{tessera::plan_cascade(
        lengths, page_size, num_qo_heads, num_kv_heads, head_dim, attention_options(options),
        convert.device(device_type, device_id))};
  });
}

size_t tessera_cascade_plan_workspace_bytes(const tessera_cascade_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.workspace_bytes;
}

int tessera_cascade_plan_num_levels(const tessera_cascade_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.num_levels();
}

tessera_status tessera_cascade_plan_explain(const tessera_cascade_plan* plan, char* buffer,
                                            size_t capacity, size_t* needed) {
  constexpr const char* kFunction = "tessera_cascade_plan_explain";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    copy_text(convert, cascade_plan(convert, plan).explain(), buffer, capacity, needed);
  });
}

tessera_status tessera_cascade_plan_upload(tessera_cascade_plan* plan, void* workspace,
                                           size_t workspace_bytes, void* stream) {
  constexpr const char* kFunction = "tessera_cascade_plan_upload";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    cascade_plan(convert, plan);
    tessera::upload_cascade(plan->plan, {workspace, workspace_bytes}, stream);
  });
}

void tessera_cascade_plan_destroy(tessera_cascade_plan* plan) {
  delete plan;
}

tessera_status tessera_run_cascade(const tessera_cascade_plan* plan, const DLTensor* q,
                                   const DLTensor* k_cache, const DLTensor* v_cache, int layout,
                                   const tessera_cascade_level* levels, int num_levels,
                                   const DLTensor* o, const DLTensor* lse, void* workspace,
                                   size_t workspace_bytes, void* stream,
                                   const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_run_cascade";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::CascadePlan& cascade = cascade_plan(convert, plan);
    check_level_count(convert, levels, num_levels);
    std::vector<tessera::CascadeLevel> views;
    for (int l = 0; l < num_levels; ++l) {
      const tessera_cascade_level& level = levels[l];
      const std::string prefix = "levels[" + std::to_string(l) + "].";
      views.push_back({convert.optional(level.qo_indptr, (prefix + "qo_indptr").c_str()),
                       convert.tensor(level.page_indptr, (prefix + "page_indptr").c_str()),
                       convert.tensor(level.page_indices, (prefix + "page_indices").c_str()),
                       convert.tensor(level.last_page_len, (prefix + "last_page_len").c_str())});
    }
    // Out-of-range layouts pass through unchanged: the C++ API rejects them by name.
    tessera::run_cascade(cascade, convert.tensor(q, "q"), convert.tensor(k_cache, "k_cache"),
                         convert.tensor(v_cache, "v_cache"), static_cast<tessera::KVLayout>(layout),
                         views, convert.tensor(o, "o"), convert.optional(lse, "lse"),
                         {workspace, workspace_bytes}, stream, convert.run_options(run_options));
  });
}

}  // extern "C"
