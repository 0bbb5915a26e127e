// The internal interface between the core (validation, planning, dispatch) and the backends.
// Every function here receives arguments that the core has already validated.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/ops.hpp"

namespace tessera::detail {

// ---- cpu backend (src/cpu) ----
// Naive oracle: accumulates in double, ignores any plan. Writes o and (if set) lse.
void cpu_reference_attention(const AttentionProblem& problem);
// Fast path: tiled online softmax, multithreaded over plan.work (workers = threads), vectorised.
// Split-KV partials go to the workspace (plan.workspace_bytes) and are merged per plan.merges.
void cpu_fast_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace);

// Positions already checked to lie in [0, cos_sin_cache.shape[0]).
void cpu_apply_rope_cos_sin_cache(const TensorView& q, const TensorView& k,
                                  const TensorView& positions, const TensorView& cos_sin_cache,
                                  bool interleave);
void cpu_apply_rope(const TensorView& q, const TensorView& k, const int32_t* positions,
                    const RopeOptions& options);
void cpu_append_paged_kv(const TensorView& k_new, const TensorView& v_new,
                         const int32_t* append_indptr, const KVSource& cache, int32_t batch_size,
                         int32_t num_kv_heads, int32_t head_dim, const RopeOptions* rope,
                         int32_t head_dim_v = -1);  // v rows' width; -1: head_dim
void cpu_block_table_to_csr(const TensorView& block_table, const int32_t* seq_lens, int page_size,
                            int32_t* page_indptr, int32_t* page_indices, int32_t* last_page_len);
void cpu_merge_state(const TensorView& o_a, const float* lse_a, const TensorView& o_b,
                     const float* lse_b, const TensorView& o_out, float* lse_out);
void cpu_merge_states(const TensorView& states, const float* lse, const int32_t* indptr,
                      const TensorView& o_out, float* lse_out);

// The CUDA backend's interface is src/cuda/cuda_backend.hpp (built when TESSERA_HAVE_CUDA).

}  // namespace tessera::detail
