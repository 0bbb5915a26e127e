// Multi-head latent attention (MLA, DeepSeek-V2 / V3), absorbed form, over a paged latent cache
// (issue 37). Decode (one or a few query tokens per request: MTP) and prefill (ragged queries,
// causal bottom-right) are one call: queries are ragged by qo_indptr.
//
// Semantics, per request b, query token i, query head h (every head shares the cache):
//  * The cache holds one latent vector ckv_j [kv_lora_rank] and one rotary key kpe_j [rope_dim]
//    per token j (DeepSeek: 512 and 64); RoPE is already applied to kpe (append_paged_mla_cache
//    can apply it while writing).
//  * Queries: q_nope [total_q, num_heads, kv_lora_rank] (already multiplied by the absorbed
//    W_UK) and q_pe [total_q, num_heads, rope_dim] (rotated).
//  * s_j = sm_scale * (q_nope . ckv_j + q_pe . kpe_j) over the visible keys (all of the request's
//    keys; with causal, key j is visible to query i iff j <= i + kv_len - q_len),
//    o = sum_j softmax(s)_j ckv_j  [total_q, num_heads, kv_lora_rank] in q's dtype,
//    lse (optional) = log sum_j exp(s_j), float32 [total_q, num_heads], natural log.
//    sm_scale is the caller's (DeepSeek's includes the YaRN mscale^2 / sqrt(192)); 0 means
//    1 / sqrt(kv_lora_rank + rope_dim). A row with no visible key gives o = 0 and lse = -inf.
//    Non-finite inputs follow include/tessera/attention.hpp.
//  * This is multi-query attention with a q/k width of kv_lora_rank + rope_dim and a v/o width
//    of kv_lora_rank in which V is the ckv part of K: the plan is an ordinary Plan (num_kv_heads
//    1, head_dim kv_lora_rank + rope_dim, head_dim_vo kv_lora_rank), so split-KV and its merge,
//    the CPU reference and the fast path are those of the other ops (no copy of q or the cache).
//  * Widths: kv_lora_rank a multiple of 8 in [8, 512], rope_dim a multiple of 8 in [0, 128];
//    num_heads in [1, 65536] (DeepSeek: 16..128 per GPU); page sizes 1.. (FlashMLA's 64).
//  * dtypes: q_nope, q_pe, o and both caches one of float32 / float16 / bfloat16, all the same.
//  * Backends: CPU only for now. A CUDA device is Error(kUnsupported) naming 'device' at plan
//    time (and in the one-shot and append calls) before anything is read or written.
// Every error names the argument ('q_nope', 'q_pe', 'ckv_cache', 'kpe_cache', 'kv_lora_rank',
// 'rope_dim', 'num_heads', ...) and what was expected; nothing is written on bad input.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "tessera/attention.hpp"
#include "tessera/ops.hpp"
#include "tessera/types.hpp"

namespace tessera {

struct MlaOptions {
  bool causal = false;    // bottom-right aligned (prefill; decode of one token sees every key)
  float sm_scale = 0.0f;  // 0: 1 / sqrt(kv_lora_rank + rope_dim)
};

// The paged latent cache and its CSR page table (as PagedKVCache's).
//  ckv_cache [num_pages, page_size, kv_lora_rank], kpe_cache [num_pages, page_size, rope_dim]:
//  same dtype, device, num_pages and page_size; any strides but a contiguous last dim, so a
//  combined cache [num_pages, page_size, kv_lora_rank + rope_dim] (FlashMLA's) is two views of
//  it (split_mla_cache). With rope_dim 0, kpe_cache may be an empty view.
//  page_indptr [B+1], page_indices [>= page_indptr[B]], last_page_len [B], int32.
struct MlaPagedCache {
  TensorView ckv_cache;
  TensorView kpe_cache;
  TensorView page_indptr;
  TensorView page_indices;
  TensorView last_page_len;
};

// The ckv and kpe views of a combined cache [num_pages, page_size, kv_lora_rank + rope_dim]:
// ckv_cache its first kv_lora_rank features, kpe_cache the rest (page table left empty).
// Throws Error(kInvalidArgument) naming 'cache' or 'kv_lora_rank'.
MlaPagedCache split_mla_cache(const TensorView& cache, int kv_lora_rank);

// A plan of one MLA batch: the MQA plan that serves it and the two widths.
struct MlaPlan {
  Plan attention;  // num_kv_heads 1, head_dim kv_lora_rank + rope_dim, head_dim_vo kv_lora_rank
  int32_t kv_lora_rank = 0;
  int32_t rope_dim = 0;
  MlaOptions options{};

  int32_t num_heads() const { return attention.num_qo_heads; }
  size_t workspace_bytes() const { return attention.workspace_bytes; }
  std::string explain() const;
};

// Host lengths in: qo_indptr [B+1] (decode: 0, 1, 2, ... or 0, 2, 4, ... for two tokens each),
// page_indptr [B+1] and last_page_len [B] of the cache after the new tokens were appended.
MlaPlan plan_mla(std::span<const int32_t> qo_indptr, std::span<const int32_t> page_indptr,
                 std::span<const int32_t> last_page_len, int page_size, int num_heads,
                 int kv_lora_rank, int rope_dim, const MlaOptions& options = {}, Device device = {},
                 const PlanCapacity& capacity = {});

// Runs the plan: q_nope, q_pe as above (rows ragged by qo_indptr [B+1], the same lengths as the
// plan's), o [total_q, num_heads, kv_lora_rank] (q's dtype), lse optional. On the CPU the
// workspace is plan.workspace_bytes() of host memory (split-KV partials).
void run_mla(const MlaPlan& plan, const TensorView& q_nope, const TensorView& q_pe,
             const MlaPagedCache& cache, const TensorView& qo_indptr, const TensorView& o,
             const TensorView& lse, Workspace workspace, void* stream = nullptr);

// One shot: plan (from the index arrays, read on the host) and run with an internal workspace.
// num_heads, kv_lora_rank and rope_dim come from q_nope / q_pe.
void mla_attention(const TensorView& q_nope, const TensorView& q_pe, const MlaPagedCache& cache,
                   const TensorView& qo_indptr, const TensorView& o, const TensorView& lse = {},
                   const MlaOptions& options = {}, void* stream = nullptr);

// Writes the latent rows of new tokens into the cache: ckv_new [nnz, kv_lora_rank] and kpe_new
// [nnz, rope_dim] (ragged by append_indptr [B+1]) land at request b's last append_len_b
// positions (the page table describes the cache after the append, as append_paged_kv_cache's).
// With `rope` non-null, kpe rows are rotated by those positions as they are written (DeepSeek's
// rope is GPT-J style: rope->interleave = true). Values are converted to the cache dtype.
void append_paged_mla_cache(const TensorView& ckv_new, const TensorView& kpe_new,
                            const TensorView& append_indptr, const MlaPagedCache& cache,
                            const RopeOptions* rope = nullptr, void* stream = nullptr);

}  // namespace tessera
