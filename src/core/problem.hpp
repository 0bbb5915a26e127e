// The validated, backend-facing description of one attention call. Front ends (C++ API, C ABI)
// validate their arguments and build an AttentionProblem; backends (cpu, cuda) consume it
// together with a Plan. Everything here is plain data so it can be copied to a kernel.
#pragma once

#include <cstdint>

#include "core/masks.hpp"
#include "tessera/types.hpp"

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__ __forceinline__
#else
#define TESSERA_HD inline
#endif

namespace tessera::detail {

// Where keys and values come from: a ragged pair of tensors or a paged cache. Strides are in
// elements. For a paged cache, stride_token is the stride between rows of one page and
// stride_page the stride between pages (NHD and HND differ only in these strides).
struct KVSource {
  DType dtype = DType::kFloat16;
  bool paged = false;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_stride_token = 0, k_stride_head = 0, k_stride_page = 0;
  int64_t v_stride_token = 0, v_stride_head = 0, v_stride_page = 0;
  // ragged
  const int32_t* kv_indptr = nullptr;
  // paged
  const int32_t* page_indptr = nullptr;
  const int32_t* page_indices = nullptr;
  const int32_t* last_page_len = nullptr;
  int32_t page_size = 0;
  // Rows (ragged) or pages (paged) the k / v tensors hold: bounds for copy engines that address
  // the tensor as a whole (TMA), never used to find a request's keys.
  int64_t k_extent = 0;
  int64_t v_extent = 0;
  // Optional second segment of every key row (MLA's rotary key kpe, issue 37): where set, key
  // elements [head_dim - rope_dim, head_dim) come from this row of k_rope (same page table as k),
  // the first head_dim - rope_dim from k. Null: a key row is head_dim elements of k. CPU only.
  const void* k_rope = nullptr;
  int64_t k_rope_stride_token = 0, k_rope_stride_head = 0, k_rope_stride_page = 0;

  // Element offset of key/value row `j` (0-based within the request) of request `b`, head `h`.
  // The caller guarantees 0 <= j < kv_len(b).
  TESSERA_HD int64_t k_offset(int b, int h, int j) const {
    return row_offset(b, j, k_stride_token, k_stride_page) + h * k_stride_head;
  }
  TESSERA_HD int64_t v_offset(int b, int h, int j) const {
    return row_offset(b, j, v_stride_token, v_stride_page) + h * v_stride_head;
  }
  TESSERA_HD int64_t k_rope_offset(int b, int h, int j) const {
    return row_offset(b, j, k_rope_stride_token, k_rope_stride_page) + h * k_rope_stride_head;
  }
  TESSERA_HD int64_t row_offset(int b, int j, int64_t stride_token, int64_t stride_page) const {
    if (!paged) return static_cast<int64_t>(kv_indptr[b] + j) * stride_token;
    const int32_t page = page_indices[page_indptr[b] + j / page_size];
    return static_cast<int64_t>(page) * stride_page +
           static_cast<int64_t>(j % page_size) * stride_token;
  }
  TESSERA_HD int32_t kv_len(int b) const {
    if (!paged) return kv_indptr[b + 1] - kv_indptr[b];
    const int32_t pages = page_indptr[b + 1] - page_indptr[b];
    return pages == 0 ? 0 : (pages - 1) * page_size + last_page_len[b];
  }
};

// Which keys query row i (0-based within its request) may see. Bottom-right aligned:
// offset = kv_len - q_len, so the last query row lines up with the last key.
struct MaskSpec {
  bool causal = false;
  int32_t window_left = -1;   // -1: unbounded
  int32_t window_right = -1;  // -1: unbounded

  // Visible keys of row i form the half-open range [first, last) (may be empty).
  TESSERA_HD void visible_range(int32_t i, int32_t q_len, int32_t kv_len, int32_t* first,
                                int32_t* last) const {
    const int64_t diag = static_cast<int64_t>(i) + kv_len - q_len;  // key aligned with row i
    int64_t lo = 0, hi = kv_len;
    if (causal) hi = hi < diag + 1 ? hi : diag + 1;
    if (window_right >= 0) hi = hi < diag + window_right + 1 ? hi : diag + window_right + 1;
    if (window_left >= 0) lo = lo > diag - window_left ? lo : diag - window_left;
    if (hi < lo) hi = lo;
    if (lo > kv_len) lo = hi = kv_len;
    if (hi < 0) lo = hi = 0;
    *first = static_cast<int32_t>(lo);
    *last = static_cast<int32_t>(hi);
  }
  // visible_range in 32-bit arithmetic, for 0 <= i < q_len and kv_len >= 0 (what the GPU
  // kernels ask; the 64-bit form costs them ~40 instructions of wide compares and selects per
  // call, several calls per tile). diag = i + (kv_len - q_len) lies in [kv_len - q_len, kv_len),
  // and each window bound is formed only when it falls inside (-1, kv_len], so nothing
  // overflows. Equal to visible_range there (tests/test_planner.cpp checks it).
  TESSERA_HD void visible_range_narrow(int32_t i, int32_t q_len, int32_t kv_len, int32_t* first,
                                       int32_t* last) const {
    const int32_t diag = i + (kv_len - q_len);
    const int32_t after = q_len - 1 - i;  // keys past the diagonal: kv_len - 1 - diag
    int32_t lo = 0, hi = kv_len;
    if (causal) hi = hi < diag + 1 ? hi : diag + 1;
    if (window_right >= 0 && window_right < after) {
      hi = hi < diag + window_right + 1 ? hi : diag + window_right + 1;
    }
    if (window_left >= 0 && window_left < diag) lo = diag - window_left;
    if (hi < lo) hi = lo;
    if (hi < 0) lo = hi = 0;
    *first = lo;
    *last = hi;
  }
  TESSERA_HD bool visible(int32_t i, int32_t j, int32_t q_len, int32_t kv_len) const {
    int32_t first, last;
    visible_range(i, q_len, kv_len, &first, &last);
    return j >= first && j < last;
  }
};

struct AttentionProblem {
  DType q_dtype = DType::kFloat16;  // q and o
  int32_t batch_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;     // q / k width
  int32_t head_dim_vo = 0;  // v / o width (0: head_dim)

  const void* q = nullptr;
  int64_t q_stride_token = 0, q_stride_head = 0;
  int64_t q_extent = 0;  // rows of the q tensor (>= the plan's total_q; bounds for TMA)
  // Ragged queries: qo_indptr[B+1]. Null for decode, where request b owns rows
  // [b * q_per_request, (b+1) * q_per_request).
  const int32_t* qo_indptr = nullptr;
  int32_t q_per_request = 1;
  // The rope part of q and k rows (MLA, issue 37: q_pe / kpe beside q_nope / ckv): where q_rope
  // (kv.k_rope) is set, the last rope_dim elements of a q (key) row come from it and the first
  // head_dim - rope_dim from q (kv.k). CPU backend only (mla_api.cpp refuses other devices).
  int32_t rope_dim = 0;
  const void* q_rope = nullptr;
  int64_t q_rope_stride_token = 0, q_rope_stride_head = 0;
  bool mla = false;  // an MLA call: checked mode names q_nope / q_pe / ckv_cache / kpe_cache

  KVSource kv;

  void* o = nullptr;
  int64_t o_stride_token = 0, o_stride_head = 0;
  int64_t o_extent = 0;  // rows of the o tensor
  float* lse = nullptr;  // optional, [total_q, num_qo_heads] with lse_stride_token
  int64_t lse_stride_token = 0;
  // Optional attention sinks, float32 [num_qo_heads] (gpt-oss, FA4's learnable_sink): one logit
  // per query head, in the units of the scaled (and soft-capped) scores, that joins every row's
  // softmax denominator and has no value row. Folded in where a row is finished (never into a
  // split-KV partial: the merge folds it once).
  const float* sinks = nullptr;
  // Programmatic dependent launch (RunOptions::enable_pdl): the CUDA kernels are launched so they
  // may start while the previous kernel in the stream runs, and wait for it (griddepcontrol.wait)
  // before touching memory; ignored on the CPU and below sm_90.
  bool enable_pdl = false;

  float sm_scale = 0.0f;  // resolved (never 0)
  float soft_cap = 0.0f;  // 0: off
  float k_scale = 1.0f;   // fp8 KV dequantisation
  float v_scale = 1.0f;
  MaskSpec mask;
  // Optional custom (prefill) or tree (decode) mask, ANDed with `mask` (core/masks.hpp); CPU
  // backend only (set_key_mask rejects one on a CUDA plan).
  KeyMask key_mask;

  TESSERA_HD int32_t group_size() const { return num_qo_heads / num_kv_heads; }
  TESSERA_HD int32_t head_dim_v() const { return head_dim_vo > 0 ? head_dim_vo : head_dim; }
  // Elements of a q / key row that come from q / kv.k (the rest from q_rope / kv.k_rope).
  TESSERA_HD int32_t q_main_dim() const { return q_rope ? head_dim - rope_dim : head_dim; }
  TESSERA_HD int32_t k_main_dim() const { return kv.k_rope ? head_dim - rope_dim : head_dim; }
  TESSERA_HD int32_t q_begin(int b) const { return qo_indptr ? qo_indptr[b] : b * q_per_request; }
  TESSERA_HD int32_t q_len(int b) const {
    return qo_indptr ? qo_indptr[b + 1] - qo_indptr[b] : q_per_request;
  }
};

}  // namespace tessera::detail
