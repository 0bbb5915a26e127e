// Tessera auxiliary ops: paged-KV append, block_table -> CSR, merge of attention states, RoPE.
// Every op takes up to 65536 heads and a head_dim up to 4096.
#pragma once

#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera {

// ---- RoPE ----
// Rotates the first rotary_dim features of every head of q and k in place by position.
//  NeoX style (interleave = false): pairs (x[i], x[i + rotary_dim/2]).
//  GPT-J style (interleave = true): pairs (x[2i], x[2i+1]).
// Frequency of pair i: theta^(-2i / rotary_dim) / rope_scale, optionally rescaled per Llama 3.1.
struct RopeOptions {
  int32_t rotary_dim = 0;  // 0: head_dim; at most 256
  bool interleave = false;
  float rope_theta = 1e4f;
  float rope_scale = 1.0f;  // linear position interpolation (positions / rope_scale)
  // Llama 3.1 frequency scaling (used when llama31 is true). The factor is llama31_factor;
  // leave rope_scale at 1 (FlashInfer's apply_llama31_rope passes the factor as rope_scale —
  // here both would apply).
  bool llama31 = false;
  float llama31_factor = 8.0f;
  float llama31_low_freq_factor = 1.0f;
  float llama31_high_freq_factor = 4.0f;
  int32_t llama31_original_max_position = 8192;
};

// q [nnz, Hq, D], k [nnz, Hk, D] (either may be an empty view), positions [nnz] int32.
void apply_rope_inplace(const TensorView& q, const TensorView& k, const TensorView& positions,
                        const RopeOptions& options, void* stream = nullptr);

// RoPE from a precomputed table, as vLLM's rotary_embedding and FlashInfer's
// apply_rope_with_cos_sin_cache take it: cos_sin_cache [max_position, rotary_dim] float32
// (contiguous rows), row p holding cos of the rotary_dim / 2 pairs at position p, then their sin
// (vLLM's RotaryEmbedding.cos_sin_cache; any scaling scheme baked in). Rotates the first
// rotary_dim features of every head of q [nnz, Hq, D] and k [nnz, Hk, D] (either may be an empty
// view) in place: interleave = false (NeoX, vLLM's is_neox = true) pairs x[i] with
// x[i + rotary_dim / 2], true (GPT-J) x[2i] with x[2i + 1]; x' = x cos - y sin, y' = y cos +
// x sin in float. positions [nnz] int32 or int64, each in [0, max_position): read on the host
// and checked for CPU tensors (and for CUDA tensors in checked mode, set_index_checking);
// unchecked on a CUDA device, an out-of-range position never reads outside the table: its
// token's rotated features are set to NaN.
void apply_rope_with_cos_sin_cache_inplace(const TensorView& q, const TensorView& k,
                                           const TensorView& positions,
                                           const TensorView& cos_sin_cache,
                                           bool interleave = false, void* stream = nullptr);

// ---- paged KV append ----
// Scatters new rows k_new/v_new [nnz, Hkv, D] (ragged by append_indptr [B+1]) into the paged
// cache. The page table must already describe the cache *after* the append: request b's new rows
// land at positions kv_len_b - append_len_b ... kv_len_b - 1. With `rope` non-null, k rows are
// rotated by those positions as they are written (fused RoPE on k). An fp8 cache stores the
// values as given (converted with saturation): quantisation scales are the caller's, applied
// before the append and passed to attention as k_scale / v_scale.
void append_paged_kv_cache(const TensorView& k_new, const TensorView& v_new,
                           const TensorView& append_indptr, const PagedKVCache& kv,
                           const RopeOptions* rope = nullptr, void* stream = nullptr);

// ---- vLLM / FlashAttention block table -> CSR page table ----
// block_table [B, max_pages] int32, seq_lens [B] int32. Outputs: page_indptr [B+1],
// page_indices [>= sum of pages] and last_page_len [B], all int32 on the same device.
void block_table_to_csr(const TensorView& block_table, const TensorView& seq_lens, int page_size,
                        const TensorView& page_indptr, const TensorView& page_indices,
                        const TensorView& last_page_len, void* stream = nullptr);

// ---- merging attention states ----
// Exact combination of two partial attentions over disjoint key sets:
//  o_a, o_b [N, H, D] (q dtype or float32), lse_a, lse_b [N, H] float32 -> o_out, lse_out
//  (lse_out optional). A state with lse = -inf is empty (its o is never read); one with lse NaN
//  (or +inf) makes the merged row NaN, o and lse (include/tessera/attention.hpp, non-finite inputs).
void merge_state(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                 const TensorView& lse_b, const TensorView& o_out, const TensorView& lse_out,
                 void* stream = nullptr);
// Variable-length merge: states [S, H, D] and lse [S, H], ragged by indptr [N+1] (row n merges
// states indptr[n] .. indptr[n+1]-1) -> o_out [N, H, D], lse_out [N, H] (optional).
// A row with no state gives o = 0, lse = -inf; empty and NaN states as in merge_state.
void merge_states(const TensorView& states, const TensorView& lse, const TensorView& indptr,
                  const TensorView& o_out, const TensorView& lse_out, void* stream = nullptr);

}  // namespace tessera
