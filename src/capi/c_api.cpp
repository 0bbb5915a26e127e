// The C ABI (include/tessera/tessera.h) over the C++ API. This layer converts DLPack tensors to
// tessera::TensorView, rejects what a TensorView cannot express (NULL descriptors, vector
// dtypes, foreign devices, more than 4 dims), and turns every exception into a status code plus
// the thread's last-error text. All conversions happen before the C++ call, and the C++ API
// validates everything before touching memory, so a failed call writes no output.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <span>
#include <string>
#include <utility>

#include "capi/c_api_internal.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

using namespace tessera::capi;  // NOLINT: this file is the ABI layer over them

extern "C" {

const char* tessera_last_error(void) {
  return g_last_error.c_str();
}

const char* tessera_version(void) {
  return tessera::version_string();
}

int tessera_abi_version(void) {
  return TESSERA_ABI_VERSION;
}

int tessera_cuda_device_count(void) {
  try {
    return tessera::cuda_device_count();
  } catch (...) {
    return 0;  // a driver that cannot be queried has no usable device
  }
}

const char* tessera_cuda_unavailable_reason(void) {
  thread_local std::string reason;
  try {
    reason = tessera::cuda_unavailable_reason();
  } catch (...) {
    return "the CUDA backend could not be queried (out of memory)";
  }
  return reason.c_str();
}

tessera_status tessera_cuda_after_device_reset(int device_id) {
  return guarded("tessera_cuda_after_device_reset",
                 [&] { tessera::cuda_after_device_reset(device_id); });
}

tessera_status tessera_stream_capture_id(void* stream, uint64_t* capture_id) {
  return guarded("tessera_stream_capture_id", [&] {
    if (capture_id == nullptr) {
      throw Error(Error::Kind::kInvalidArgument,
                  "tessera_stream_capture_id: 'capture_id': expected a pointer, got NULL");
    }
    *capture_id = tessera::cuda_stream_capture_id(stream);
  });
}

void tessera_attention_options_default(tessera_attention_options* options) {
  if (options == nullptr) return;
  const tessera::AttentionOptions defaults;
  options->causal = defaults.causal ? 1 : 0;
  options->window_left = defaults.window_left;
  options->window_right = defaults.window_right;
  options->logits_soft_cap = defaults.logits_soft_cap;
  options->sm_scale = defaults.sm_scale;
  options->k_scale = defaults.k_scale;
  options->v_scale = defaults.v_scale;
}

void tessera_run_options_default(tessera_run_options* run_options) {
  if (run_options == nullptr) return;
  run_options->struct_size = sizeof(tessera_run_options);
  run_options->sinks = nullptr;
  run_options->enable_pdl = 0;
  run_options->custom_mask = nullptr;
  run_options->mask_indptr = nullptr;
  run_options->tree_mask = nullptr;
}

void tessera_plan_options_default(tessera_plan_options* plan_options) {
  if (plan_options == nullptr) return;
  plan_options->struct_size = sizeof(tessera_plan_options);
  plan_options->head_dim_vo = 0;
}

void tessera_rope_options_default(tessera_rope_options* options) {
  if (options == nullptr) return;
  const tessera::RopeOptions defaults;
  options->rotary_dim = defaults.rotary_dim;
  options->interleave = defaults.interleave ? 1 : 0;
  options->rope_theta = defaults.rope_theta;
  options->rope_scale = defaults.rope_scale;
  options->llama31 = defaults.llama31 ? 1 : 0;
  options->llama31_factor = defaults.llama31_factor;
  options->llama31_low_freq_factor = defaults.llama31_low_freq_factor;
  options->llama31_high_freq_factor = defaults.llama31_high_freq_factor;
  options->llama31_original_max_position = defaults.llama31_original_max_position;
}

// ---------------------------------------------------------------- plan

tessera_status tessera_plan_ragged_prefill_v2(const int32_t* qo_indptr_host,
                                              const int32_t* kv_indptr_host, int64_t batch_size,
                                              int num_qo_heads, int num_kv_heads, int head_dim,
                                              const tessera_attention_options* options,
                                              const tessera_plan_options* plan_options,
                                              int device_type, int device_id, tessera_plan** out) {
  constexpr const char* kFunction = "tessera_plan_ragged_prefill";
  return make_plan(kFunction, out, [&] {
    const Converter convert(kFunction);
    convert.batch_size(batch_size);
    const auto qo = convert.host_array(qo_indptr_host, batch_size + 1, "qo_indptr_host");
    const auto kv = convert.host_array(kv_indptr_host, batch_size + 1, "kv_indptr_host");
    const Device device = convert.device(device_type, device_id);
    return tessera::plan_ragged_prefill(
        qo, kv, num_qo_heads, num_kv_heads, head_dim,
        convert.plan_options(attention_options(options), plan_options), device);
  });
}

tessera_status tessera_plan_ragged_prefill(const int32_t* qo_indptr_host,
                                           const int32_t* kv_indptr_host, int64_t batch_size,
                                           int num_qo_heads, int num_kv_heads, int head_dim,
                                           const tessera_attention_options* options,
                                           int device_type, int device_id, tessera_plan** out) {
  return tessera_plan_ragged_prefill_v2(qo_indptr_host, kv_indptr_host, batch_size, num_qo_heads,
                                        num_kv_heads, head_dim, options, nullptr, device_type,
                                        device_id, out);
}

tessera_status tessera_plan_paged_prefill_v2(
    const int32_t* qo_indptr_host, const int32_t* page_indptr_host,
    const int32_t* last_page_len_host, int64_t batch_size, int page_size, int num_qo_heads,
    int num_kv_heads, int head_dim, const tessera_attention_options* options,
    const tessera_plan_options* plan_options, int device_type, int device_id, tessera_plan** out) {
  constexpr const char* kFunction = "tessera_plan_paged_prefill";
  return make_plan(kFunction, out, [&] {
    const Converter convert(kFunction);
    convert.batch_size(batch_size);
    const auto qo = convert.host_array(qo_indptr_host, batch_size + 1, "qo_indptr_host");
    const auto pages = convert.host_array(page_indptr_host, batch_size + 1, "page_indptr_host");
    const auto last = convert.host_array(last_page_len_host, batch_size, "last_page_len_host");
    const Device device = convert.device(device_type, device_id);
    return tessera::plan_paged_prefill(
        qo, pages, last, page_size, num_qo_heads, num_kv_heads, head_dim,
        convert.plan_options(attention_options(options), plan_options), device);
  });
}

tessera_status tessera_plan_paged_prefill(const int32_t* qo_indptr_host,
                                          const int32_t* page_indptr_host,
                                          const int32_t* last_page_len_host, int64_t batch_size,
                                          int page_size, int num_qo_heads, int num_kv_heads,
                                          int head_dim, const tessera_attention_options* options,
                                          int device_type, int device_id, tessera_plan** out) {
  return tessera_plan_paged_prefill_v2(qo_indptr_host, page_indptr_host, last_page_len_host,
                                       batch_size, page_size, num_qo_heads, num_kv_heads,
                                       head_dim, options, nullptr, device_type, device_id, out);
}

tessera_status tessera_plan_decode_v2(const int32_t* page_indptr_host,
                                      const int32_t* last_page_len_host, int64_t batch_size,
                                      int page_size, int num_qo_heads, int num_kv_heads,
                                      int head_dim, int q_per_request,
                                      const tessera_attention_options* options,
                                      const tessera_plan_options* plan_options, int device_type,
                                      int device_id, tessera_plan** out) {
  constexpr const char* kFunction = "tessera_plan_decode";
  return make_plan(kFunction, out, [&] {
    const Converter convert(kFunction);
    convert.batch_size(batch_size);
    const auto pages = convert.host_array(page_indptr_host, batch_size + 1, "page_indptr_host");
    const auto last = convert.host_array(last_page_len_host, batch_size, "last_page_len_host");
    const Device device = convert.device(device_type, device_id);
    return tessera::plan_decode(pages, last, page_size, num_qo_heads, num_kv_heads, head_dim,
                                convert.plan_options(attention_options(options), plan_options),
                                device, q_per_request);
  });
}

tessera_status tessera_plan_decode(const int32_t* page_indptr_host,
                                   const int32_t* last_page_len_host, int64_t batch_size,
                                   int page_size, int num_qo_heads, int num_kv_heads, int head_dim,
                                   int q_per_request, const tessera_attention_options* options,
                                   int device_type, int device_id, tessera_plan** out) {
  return tessera_plan_decode_v2(page_indptr_host, last_page_len_host, batch_size, page_size,
                                num_qo_heads, num_kv_heads, head_dim, q_per_request, options,
                                nullptr, device_type, device_id, out);
}

int32_t tessera_plan_head_dim_vo(const tessera_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.head_dim_v();
}

tessera_status tessera_plan_upload(tessera_plan* plan, void* workspace, size_t workspace_bytes,
                                   void* stream) {
  constexpr const char* kFunction = "tessera_plan_upload";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    if (plan == nullptr) convert.fail("plan", "is NULL");
    tessera::upload_plan(plan->plan, tessera::Workspace{workspace, workspace_bytes}, stream);
  });
}

void tessera_workspace_forget_uploads(const void* workspace) {
  try {
    tessera::forget_uploads(workspace);
  } catch (...) {  // a mutex failure: nothing to report through a void C call
  }
}

size_t tessera_plan_workspace_bytes(const tessera_plan* plan) {
  return plan == nullptr ? 0 : plan->plan.workspace_bytes;
}

tessera_status tessera_plan_explain(const tessera_plan* plan, char* buffer, size_t capacity,
                                    size_t* needed) {
  constexpr const char* kFunction = "tessera_plan_explain";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    copy_text(convert, convert.plan(plan).explain(), buffer, capacity, needed);
  });
}

void tessera_plan_destroy(tessera_plan* plan) {
  delete plan;
}

// ---------------------------------------------------------------- run
// Arguments are converted into locals in parameter order, so that with several bad arguments the
// first one is the one reported (the order of evaluation of call arguments is unspecified).

tessera_status tessera_run_ragged_prefill_v2(const tessera_plan* plan, const DLTensor* q,
                                             const DLTensor* k, const DLTensor* v,
                                             const DLTensor* qo_indptr, const DLTensor* kv_indptr,
                                             const DLTensor* o, const DLTensor* lse,
                                             void* workspace, size_t workspace_bytes, void* stream,
                                             const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_run_ragged_prefill";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::Plan& checked_plan = convert.plan(plan);
    const TensorView q_view = convert.tensor(q, "q");
    const TensorView k_view = convert.tensor(k, "k");
    const TensorView v_view = convert.tensor(v, "v");
    const TensorView qo_indptr_view = convert.tensor(qo_indptr, "qo_indptr");
    const TensorView kv_indptr_view = convert.tensor(kv_indptr, "kv_indptr");
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::run_ragged_prefill(checked_plan, q_view, k_view, v_view, qo_indptr_view,
                                kv_indptr_view, o_view, lse_view, {workspace, workspace_bytes},
                                stream, run);
  });
}

tessera_status tessera_run_ragged_prefill(const tessera_plan* plan, const DLTensor* q,
                                          const DLTensor* k, const DLTensor* v,
                                          const DLTensor* qo_indptr, const DLTensor* kv_indptr,
                                          const DLTensor* o, const DLTensor* lse, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  return tessera_run_ragged_prefill_v2(plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace,
                                       workspace_bytes, stream, nullptr);
}

tessera_status tessera_run_paged_prefill_v2(const tessera_plan* plan, const DLTensor* q,
                                            const tessera_paged_kv* kv, const DLTensor* qo_indptr,
                                            const DLTensor* o, const DLTensor* lse,
                                            void* workspace, size_t workspace_bytes, void* stream,
                                            const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_run_paged_prefill";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::Plan& checked_plan = convert.plan(plan);
    const TensorView q_view = convert.tensor(q, "q");
    const tessera::PagedKVCache cache = convert.paged_kv(kv);
    const TensorView qo_indptr_view = convert.tensor(qo_indptr, "qo_indptr");
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::run_paged_prefill(checked_plan, q_view, cache, qo_indptr_view, o_view, lse_view,
                               {workspace, workspace_bytes}, stream, run);
  });
}

tessera_status tessera_run_paged_prefill(const tessera_plan* plan, const DLTensor* q,
                                         const tessera_paged_kv* kv, const DLTensor* qo_indptr,
                                         const DLTensor* o, const DLTensor* lse, void* workspace,
                                         size_t workspace_bytes, void* stream) {
  return tessera_run_paged_prefill_v2(plan, q, kv, qo_indptr, o, lse, workspace, workspace_bytes,
                                      stream, nullptr);
}

tessera_status tessera_run_decode_v2(const tessera_plan* plan, const DLTensor* q,
                                     const tessera_paged_kv* kv, const DLTensor* o,
                                     const DLTensor* lse, void* workspace, size_t workspace_bytes,
                                     void* stream, const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_run_decode";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const tessera::Plan& checked_plan = convert.plan(plan);
    const TensorView q_view = convert.tensor(q, "q");
    const tessera::PagedKVCache cache = convert.paged_kv(kv);
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::run_decode(checked_plan, q_view, cache, o_view, lse_view, {workspace, workspace_bytes},
                        stream, run);
  });
}

tessera_status tessera_run_decode(const tessera_plan* plan, const DLTensor* q,
                                  const tessera_paged_kv* kv, const DLTensor* o,
                                  const DLTensor* lse, void* workspace, size_t workspace_bytes,
                                  void* stream) {
  return tessera_run_decode_v2(plan, q, kv, o, lse, workspace, workspace_bytes, stream, nullptr);
}

// ---------------------------------------------------------------- one-shot

tessera_status tessera_ragged_prefill_v2(const DLTensor* q, const DLTensor* k, const DLTensor* v,
                                         const DLTensor* qo_indptr, const DLTensor* kv_indptr,
                                         const DLTensor* o, const DLTensor* lse,
                                         const tessera_attention_options* options, void* stream,
                                         const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_ragged_prefill";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView q_view = convert.tensor(q, "q");
    const TensorView k_view = convert.tensor(k, "k");
    const TensorView v_view = convert.tensor(v, "v");
    const TensorView qo_indptr_view = convert.tensor(qo_indptr, "qo_indptr");
    const TensorView kv_indptr_view = convert.tensor(kv_indptr, "kv_indptr");
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::ragged_prefill(q_view, k_view, v_view, qo_indptr_view, kv_indptr_view, o_view,
                            lse_view, attention_options(options), stream, run);
  });
}

tessera_status tessera_ragged_prefill(const DLTensor* q, const DLTensor* k, const DLTensor* v,
                                      const DLTensor* qo_indptr, const DLTensor* kv_indptr,
                                      const DLTensor* o, const DLTensor* lse,
                                      const tessera_attention_options* options, void* stream) {
  return tessera_ragged_prefill_v2(q, k, v, qo_indptr, kv_indptr, o, lse, options, stream,
                                   nullptr);
}

tessera_status tessera_paged_prefill_v2(const DLTensor* q, const tessera_paged_kv* kv,
                                        const DLTensor* qo_indptr, const DLTensor* o,
                                        const DLTensor* lse,
                                        const tessera_attention_options* options, void* stream,
                                        const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_paged_prefill";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView q_view = convert.tensor(q, "q");
    const tessera::PagedKVCache cache = convert.paged_kv(kv);
    const TensorView qo_indptr_view = convert.tensor(qo_indptr, "qo_indptr");
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::paged_prefill(q_view, cache, qo_indptr_view, o_view, lse_view,
                           attention_options(options), stream, run);
  });
}

tessera_status tessera_paged_prefill(const DLTensor* q, const tessera_paged_kv* kv,
                                     const DLTensor* qo_indptr, const DLTensor* o,
                                     const DLTensor* lse, const tessera_attention_options* options,
                                     void* stream) {
  return tessera_paged_prefill_v2(q, kv, qo_indptr, o, lse, options, stream, nullptr);
}

tessera_status tessera_decode_v2(const DLTensor* q, const tessera_paged_kv* kv, const DLTensor* o,
                                 const DLTensor* lse, const tessera_attention_options* options,
                                 void* stream, const tessera_run_options* run_options) {
  constexpr const char* kFunction = "tessera_decode";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView q_view = convert.tensor(q, "q");
    const tessera::PagedKVCache cache = convert.paged_kv(kv);
    const TensorView o_view = convert.tensor(o, "o");
    const TensorView lse_view = convert.optional(lse, "lse");
    const tessera::RunOptions run = convert.run_options(run_options);
    tessera::decode(q_view, cache, o_view, lse_view, attention_options(options), stream, run);
  });
}

tessera_status tessera_decode(const DLTensor* q, const tessera_paged_kv* kv, const DLTensor* o,
                              const DLTensor* lse, const tessera_attention_options* options,
                              void* stream) {
  return tessera_decode_v2(q, kv, o, lse, options, stream, nullptr);
}

// ---------------------------------------------------------------- ops

tessera_status tessera_apply_rope_inplace(const DLTensor* q, const DLTensor* k,
                                          const DLTensor* positions,
                                          const tessera_rope_options* options, void* stream) {
  constexpr const char* kFunction = "tessera_apply_rope_inplace";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView q_view = convert.optional(q, "q");
    const TensorView k_view = convert.optional(k, "k");
    const TensorView positions_view = convert.tensor(positions, "positions");
    tessera::apply_rope_inplace(q_view, k_view, positions_view, rope_options(options), stream);
  });
}

tessera_status tessera_apply_rope_with_cos_sin_cache_inplace(const DLTensor* q, const DLTensor* k,
                                                             const DLTensor* positions,
                                                             const DLTensor* cos_sin_cache,
                                                             int interleave, void* stream) {
  constexpr const char* kFunction = "tessera_apply_rope_with_cos_sin_cache_inplace";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView q_view = convert.optional(q, "q");
    const TensorView k_view = convert.optional(k, "k");
    const TensorView positions_view = convert.tensor(positions, "positions");
    const TensorView table_view = convert.tensor(cos_sin_cache, "cos_sin_cache");
    tessera::apply_rope_with_cos_sin_cache_inplace(q_view, k_view, positions_view, table_view,
                                                   interleave != 0, stream);
  });
}

tessera_status tessera_append_paged_kv_cache(const DLTensor* k_new, const DLTensor* v_new,
                                             const DLTensor* append_indptr,
                                             const tessera_paged_kv* kv,
                                             const tessera_rope_options* rope, void* stream) {
  constexpr const char* kFunction = "tessera_append_paged_kv_cache";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView k_new_view = convert.tensor(k_new, "k_new");
    const TensorView v_new_view = convert.tensor(v_new, "v_new");
    const TensorView append_indptr_view = convert.tensor(append_indptr, "append_indptr");
    const tessera::PagedKVCache cache = convert.paged_kv(kv);
    const tessera::RopeOptions rope_settings = rope_options(rope);
    tessera::append_paged_kv_cache(k_new_view, v_new_view, append_indptr_view, cache,
                                   rope != nullptr ? &rope_settings : nullptr, stream);
  });
}

tessera_status tessera_block_table_to_csr(const DLTensor* block_table, const DLTensor* seq_lens,
                                          int page_size, const DLTensor* page_indptr,
                                          const DLTensor* page_indices,
                                          const DLTensor* last_page_len, void* stream) {
  constexpr const char* kFunction = "tessera_block_table_to_csr";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView block_table_view = convert.tensor(block_table, "block_table");
    const TensorView seq_lens_view = convert.tensor(seq_lens, "seq_lens");
    const TensorView page_indptr_view = convert.tensor(page_indptr, "page_indptr");
    const TensorView page_indices_view = convert.tensor(page_indices, "page_indices");
    const TensorView last_page_len_view = convert.tensor(last_page_len, "last_page_len");
    tessera::block_table_to_csr(block_table_view, seq_lens_view, page_size, page_indptr_view,
                                page_indices_view, last_page_len_view, stream);
  });
}

tessera_status tessera_merge_state(const DLTensor* o_a, const DLTensor* lse_a, const DLTensor* o_b,
                                   const DLTensor* lse_b, const DLTensor* o_out,
                                   const DLTensor* lse_out, void* stream) {
  constexpr const char* kFunction = "tessera_merge_state";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView o_a_view = convert.tensor(o_a, "o_a");
    const TensorView lse_a_view = convert.tensor(lse_a, "lse_a");
    const TensorView o_b_view = convert.tensor(o_b, "o_b");
    const TensorView lse_b_view = convert.tensor(lse_b, "lse_b");
    const TensorView o_out_view = convert.tensor(o_out, "o_out");
    const TensorView lse_out_view = convert.optional(lse_out, "lse_out");
    tessera::merge_state(o_a_view, lse_a_view, o_b_view, lse_b_view, o_out_view, lse_out_view,
                         stream);
  });
}

tessera_status tessera_merge_states(const DLTensor* states, const DLTensor* lse,
                                    const DLTensor* indptr, const DLTensor* o_out,
                                    const DLTensor* lse_out, void* stream) {
  constexpr const char* kFunction = "tessera_merge_states";
  return guarded(kFunction, [&] {
    const Converter convert(kFunction);
    const TensorView states_view = convert.tensor(states, "states");
    const TensorView lse_view = convert.tensor(lse, "lse");
    const TensorView indptr_view = convert.tensor(indptr, "indptr");
    const TensorView o_out_view = convert.tensor(o_out, "o_out");
    const TensorView lse_out_view = convert.optional(lse_out, "lse_out");
    tessera::merge_states(states_view, lse_view, indptr_view, o_out_view, lse_out_view, stream);
  });
}

// ---------------------------------------------------------------- CPU backend controls

tessera_status tessera_set_num_threads(int threads) {
  return guarded("tessera_set_num_threads", [&] { tessera::set_num_threads(threads); });
}

tessera_status tessera_set_index_checking(int enable) {
  return guarded("tessera_set_index_checking",
                 [&] { tessera::set_index_checking(enable != 0); });
}

int tessera_index_checking(void) { return tessera::index_checking() ? 1 : 0; }

tessera_status tessera_set_cpu_reference(int enable) {
  return guarded("tessera_set_cpu_reference", [&] {
    tessera::set_cpu_impl(enable != 0 ? tessera::CpuImpl::kReference : tessera::CpuImpl::kFast);
  });
}

}  // extern "C"
