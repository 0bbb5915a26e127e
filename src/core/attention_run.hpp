// The validation half of run_paged_prefill / run_decode, for callers that must check every call
// of a sequence before launching any of them (cascade attention, src/core/cascade.cpp).
#pragma once

#include "core/problem.hpp"
#include "core/validate.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// Every check of run_paged_prefill (op kPagedPrefill) or run_decode (kDecode: qo_indptr is not
// read), checked mode's included; returns the problem that dispatch_attention
// (core/dispatch.hpp) runs. Throws tessera::Error naming the argument; writes nothing.
AttentionProblem prepare_paged_run(AttentionOp op, const Plan& plan, const TensorView& q,
                                   const PagedKVCache& kv, const TensorView& qo_indptr,
                                   const TensorView& o, const TensorView& lse, Workspace workspace,
                                   void* stream, const RunOptions& run_options);

// RunOptions::custom_mask / mask_indptr / tree_mask (include/tessera/attention.hpp) against the
// plan and its op: a custom mask for prefill only, a tree mask for decode only, none on a CUDA
// plan (Error kUnsupported), shapes, dtypes, devices and the mask_indptr values. Sets
// problem.key_mask (core/masks.hpp); throws tessera::Error naming the field, writes nothing.
// Defined in core/masks.cpp.
void set_key_mask(const ArgChecker& check, const Plan& plan, const RunOptions& run_options,
                  AttentionProblem& problem);

// The run calls' checks of q [total_q, num_qo_heads, head_dim], o (q's shape and dtype) and the
// optional lse [total_q, num_qo_heads] against `plan`.
void check_run_outputs(const ArgChecker& check, const Plan& plan, const TensorView& q,
                       const TensorView& o, const TensorView& lse);

// run_paged_prefill / run_decode's checks of the page table (page_indptr, page_indices,
// last_page_len of `kv`; its k_cache / v_cache are not read) against the plan, for a cache of
// num_pages pages: shapes, and on the host (CPU, or checked mode) the lengths and page ids.
void check_page_table(const ArgChecker& check, const Plan& plan, const PagedKVCache& kv,
                      int64_t num_pages, void* stream);

// The last checks of a run before dispatch: the fp8 scales (1 for other K/V dtypes) and, in
// checked mode, the scan of every input the call reads for NaN / inf.
void finish_run_checks(const ArgChecker& check, const Plan& plan, AttentionProblem& problem,
                       void* stream);

// plan_paged_prefill with errors named by `check`'s op and head_dim bounded by max_head_dim
// instead of 256 (MLA: kv_lora_rank + rope_dim, its entry point checking both).
Plan plan_paged_prefill_as(const ArgChecker& check, std::span<const int32_t> qo_indptr,
                           std::span<const int32_t> page_indptr,
                           std::span<const int32_t> last_page_len, int page_size, int num_qo_heads,
                           int num_kv_heads, int head_dim, const AttentionOptions& options,
                           Device device, const PlanCapacity& capacity, int max_head_dim);

}  // namespace tessera::detail
