/*
 * Tessera C ABI: the stable surface for FFI (Python, Rust, Go, ...). C99, no C++ needed.
 *
 * Tensors are DLPack `DLTensor`s (dlpack 0.6 headers or newer). Every function that can fail
 * returns a tessera_status, never throws and never aborts; on failure the text of the error
 * ("tessera::<op>: '<argument>': <what was expected, what came>") is kept per thread and read
 * with tessera_last_error(). Arguments are validated before any memory is written, so a failed
 * call leaves its outputs untouched.
 *
 * Semantics are those of the C++ API (include/tessera/attention.hpp and ops.hpp): ragged
 * (varlen) q [total_q, num_qo_heads, head_dim] by int32 qo_indptr [B+1]; ragged K/V
 * [total_kv, num_kv_heads, head_dim] by kv_indptr [B+1]; a paged KV cache
 * [num_pages, page_size, num_kv_heads, head_dim] (NHD) or [num_pages, num_kv_heads, page_size,
 * head_dim] (HND) with a CSR page table; causal masks aligned bottom-right; o in q's dtype,
 * optional lse [total_q, num_qo_heads] float32 (natural log).
 *
 * DLTensor conventions:
 *  - dtype: kDLFloat 32/16, kDLBfloat 16, kDLInt 32/64, kDLUInt 8 (masks), lanes == 1, and for
 *    an fp8 KV cache the DLPack 1.x codes TESSERA_DL_FLOAT8_E4M3FN / TESSERA_DL_FLOAT8_E5M2
 *    with bits == 8.
 *  - device: kDLCPU (and kDLCUDAHost, which is host memory) or kDLCUDA with its device_id;
 *    other device types (kDLCUDAManaged included) are rejected.
 *  - strides: in elements; NULL means contiguous (row-major). byte_offset is honoured.
 *  - 1 <= ndim <= 4.
 *  - `const DLTensor*` makes the descriptor read-only, not the data: outputs are written
 *    through their `data` pointer.
 */
#ifndef TESSERA_TESSERA_H_
#define TESSERA_TESSERA_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

/* Exported even if the library is ever built with -fvisibility=hidden. */
#if defined(__GNUC__)
#define TESSERA_API __attribute__((visibility("default")))
#else
#define TESSERA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped only when a signature or struct layout in this header changes incompatibly. */
#define TESSERA_ABI_VERSION 1

/* DLPack 1.x dtype codes for fp8 (dlpack 0.6 has none); used with bits == 8, lanes == 1.
 * E4M3 is the OCP "fn" variant (no infinities, max 448); E5M2 is IEEE-like. */
#define TESSERA_DL_FLOAT8_E4M3FN 10
#define TESSERA_DL_FLOAT8_E5M2 12

/* KV cache layouts of tessera_paged_kv.layout. */
#define TESSERA_KV_LAYOUT_NHD 0
#define TESSERA_KV_LAYOUT_HND 1

typedef enum tessera_status {
  TESSERA_OK = 0,
  TESSERA_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, value, pointer, ... */
  TESSERA_ERROR_UNSUPPORTED = 2,      /* valid request this build or device cannot serve */
  TESSERA_ERROR_RUNTIME = 3,          /* a failure while running (CUDA error, ...) */
  TESSERA_ERROR_OUT_OF_MEMORY = 4
} tessera_status;

/* Text of the last failure of a status-returning call on this thread; "" after a success.
 * Valid until the next tessera call on this thread. Never NULL. */
TESSERA_API const char* tessera_last_error(void);
/* "major.minor.patch" of the library. */
TESSERA_API const char* tessera_version(void);
/* TESSERA_ABI_VERSION of the library (compare with the header's to detect a mismatch). */
TESSERA_API int tessera_abi_version(void);
/* Visible CUDA devices; 0 in a CPU-only build or without a driver. */
TESSERA_API int tessera_cuda_device_count(void);
/* Why no CUDA device is usable; "" when one is (e.g. "this build of tessera has no CUDA
 * backend", or on a host without the NVIDIA driver the CUDA runtime's answer naming
 * libcuda.so.1). Never NULL; valid until the next call of it on this thread. */
TESSERA_API const char* tessera_cuda_unavailable_reason(void);
/* Call after cudaDeviceReset(device_id) before using the library on that device again: forgets
 * every workspace's plan upload (on every device), the device's pinned staging buffers and the
 * kernels' shared-memory opt-ins (tessera/backend.hpp: cuda_after_device_reset). Plans stay
 * valid; tensors and workspaces must be allocated anew. TESSERA_ERROR_UNSUPPORTED without a
 * usable CUDA device, TESSERA_ERROR_INVALID_ARGUMENT for an index out of range. */
TESSERA_API tessera_status tessera_cuda_after_device_reset(int device_id);
/* *capture_id = the id of the CUDA graph capture in progress on `stream` (a cudaStream_t; NULL is
 * the legacy default stream; unique per capture in the process), 0 when no capture is active on
 * it (none, or one invalidated by a prohibited call), in a CPU-only build or without a CUDA
 * device. Querying the legacy stream while another stream captures in global mode fails with
 * TESSERA_ERROR_RUNTIME (the CUDA error is not left pending). */
TESSERA_API tessera_status tessera_stream_capture_id(void* stream, uint64_t* capture_id);

/* ---- options ---- */

typedef struct tessera_attention_options {
  int causal;            /* non-zero: causal mask, aligned bottom-right */
  int32_t window_left;   /* sliding window, -1 = unbounded */
  int32_t window_right;  /* -1 = unbounded */
  float logits_soft_cap; /* cap * tanh(s / cap); 0 = off */
  float sm_scale;        /* 0 = 1 / sqrt(head_dim) */
  float k_scale;         /* fp8 KV dequantisation scales (per tensor); ignored otherwise */
  float v_scale;
} tessera_attention_options;

/* Fills the defaults: not causal, no window, no soft-cap, sm_scale 1/sqrt(D), scales 1. */
TESSERA_API void tessera_attention_options_default(tessera_attention_options* options);

/* Plan-time options beyond tessera_attention_options, for the *_v2 plan calls. Extensible like
 * tessera_run_options: the caller sets struct_size = sizeof(tessera_plan_options) as its header
 * declares it (or calls tessera_plan_options_default), and the library reads only the fields
 * that size covers. plan_options may be NULL (all defaults).
 *  - head_dim_vo: width of v, v_cache and o rows when it differs from head_dim (the q / k width);
 *    0 = head_dim. A multiple of 8 in [8, 512]; a pair other than the equal one runs on the CPU
 *    only (TESSERA_ERROR_UNSUPPORTED naming options.head_dim_vo on CUDA). The one-shot calls
 *    take it from v's (v_cache's) last dimension. */
typedef struct tessera_plan_options {
  size_t struct_size;
  int32_t head_dim_vo;
} tessera_plan_options;

/* Fills the defaults: struct_size = sizeof(tessera_plan_options), head_dim_vo 0. */
TESSERA_API void tessera_plan_options_default(tessera_plan_options* plan_options);

typedef struct tessera_rope_options {
  int32_t rotary_dim; /* 0 = head_dim; even, <= head_dim and <= 256 */
  int interleave;     /* 0: NeoX pairs (x[i], x[i + d/2]); non-zero: GPT-J pairs (x[2i], x[2i+1]) */
  float rope_theta;
  float rope_scale; /* linear position interpolation: positions / rope_scale */
  int llama31;      /* non-zero: Llama 3.1 frequency scaling with the four fields below */
  float llama31_factor;
  float llama31_low_freq_factor;
  float llama31_high_freq_factor;
  int32_t llama31_original_max_position;
} tessera_rope_options;

/* Fills the defaults: rotary_dim = head_dim, NeoX, theta 1e4, scale 1, Llama 3.1 off
 * (factor 8, low 1, high 4, original max position 8192). */
TESSERA_API void tessera_rope_options_default(tessera_rope_options* options);

/* A paged KV cache with a CSR page table (all index arrays int32, on the cache's device):
 * page_indptr [B+1], page_indices [>= page_indptr[B]], last_page_len [B] in [1, page_size]. */
typedef struct tessera_paged_kv {
  const DLTensor* k_cache;
  const DLTensor* v_cache;
  const DLTensor* page_indptr;
  const DLTensor* page_indices;
  const DLTensor* last_page_len;
  int layout; /* TESSERA_KV_LAYOUT_NHD or TESSERA_KV_LAYOUT_HND */
} tessera_paged_kv;

/* ---- plan / run ----
 * A plan is built on the host from host copies of the lengths (a pure, deterministic function)
 * and is immutable afterwards, so one plan may be run from several threads at once. Run calls
 * never allocate and never synchronise the host on CUDA; they need a caller-owned workspace on
 * the plan's device of at least tessera_plan_workspace_bytes(plan) bytes.
 * `options` may be NULL (defaults). device_type is kDLCPU or kDLCUDA (DLDeviceType values). */

typedef struct tessera_plan tessera_plan;

/* qo_indptr_host and kv_indptr_host: batch_size + 1 host int32 values each. */
TESSERA_API tessera_status tessera_plan_ragged_prefill(
    const int32_t* qo_indptr_host, const int32_t* kv_indptr_host, int64_t batch_size,
    int num_qo_heads, int num_kv_heads, int head_dim, const tessera_attention_options* options,
    int device_type, int device_id, tessera_plan** out);

/* qo_indptr_host, page_indptr_host: batch_size + 1 values; last_page_len_host: batch_size. */
TESSERA_API tessera_status tessera_plan_paged_prefill(
    const int32_t* qo_indptr_host, const int32_t* page_indptr_host,
    const int32_t* last_page_len_host, int64_t batch_size, int page_size, int num_qo_heads,
    int num_kv_heads, int head_dim, const tessera_attention_options* options, int device_type,
    int device_id, tessera_plan** out);

/* Decode with q_per_request query tokens per request (1, or a few for speculative decoding):
 * q is [batch_size * q_per_request, num_qo_heads, head_dim]. */
TESSERA_API tessera_status tessera_plan_decode(const int32_t* page_indptr_host,
                                               const int32_t* last_page_len_host,
                                               int64_t batch_size, int page_size, int num_qo_heads,
                                               int num_kv_heads, int head_dim, int q_per_request,
                                               const tessera_attention_options* options,
                                               int device_type, int device_id, tessera_plan** out);

/* The plan calls above with plan-time options (the versions without _v2 are these with NULL). */
TESSERA_API tessera_status tessera_plan_ragged_prefill_v2(
    const int32_t* qo_indptr_host, const int32_t* kv_indptr_host, int64_t batch_size,
    int num_qo_heads, int num_kv_heads, int head_dim, const tessera_attention_options* options,
    const tessera_plan_options* plan_options, int device_type, int device_id, tessera_plan** out);

TESSERA_API tessera_status tessera_plan_paged_prefill_v2(
    const int32_t* qo_indptr_host, const int32_t* page_indptr_host,
    const int32_t* last_page_len_host, int64_t batch_size, int page_size, int num_qo_heads,
    int num_kv_heads, int head_dim, const tessera_attention_options* options,
    const tessera_plan_options* plan_options, int device_type, int device_id, tessera_plan** out);

TESSERA_API tessera_status tessera_plan_decode_v2(
    const int32_t* page_indptr_host, const int32_t* last_page_len_host, int64_t batch_size,
    int page_size, int num_qo_heads, int num_kv_heads, int head_dim, int q_per_request,
    const tessera_attention_options* options, const tessera_plan_options* plan_options,
    int device_type, int device_id, tessera_plan** out);

/* Width of the plan's v and o rows (head_dim_vo, resolved: head_dim when not set); 0 for NULL. */
TESSERA_API int32_t tessera_plan_head_dim_vo(const tessera_plan* plan);

/* Copies the plan's work lists into `workspace` (the plan's device, at least
 * tessera_plan_workspace_bytes(plan) bytes) with one asynchronous copy on `stream`, so that later
 * runs with this workspace skip their own upload (see tessera::upload_plan). Never synchronises;
 * a no-op for CPU plans; an error while `stream` is being captured into a CUDA graph. */
TESSERA_API tessera_status tessera_plan_upload(tessera_plan* plan, void* workspace,
                                               size_t workspace_bytes, void* stream);
/* The memory at `workspace` no longer holds what tessera_plan_upload put there (freed, handed
 * out again, or overwritten): the next run of any plan with it uploads the lists itself (see
 * tessera::forget_uploads). Host-only, never fails. */
TESSERA_API void tessera_workspace_forget_uploads(const void* workspace);

/* Workspace a run of this plan needs (0 for a NULL plan). */
TESSERA_API size_t tessera_plan_workspace_bytes(const tessera_plan* plan);

/* Human-readable description of the plan's partition, NUL-terminated. *needed (optional)
 * receives the size including the NUL. buffer may be NULL with capacity 0 to query the size.
 * If capacity is too small the text is truncated (still NUL-terminated when capacity > 0) and
 * TESSERA_ERROR_INVALID_ARGUMENT is returned. */
TESSERA_API tessera_status tessera_plan_explain(const tessera_plan* plan, char* buffer,
                                                size_t capacity, size_t* needed);

/* Frees a plan; NULL is a no-op. */
TESSERA_API void tessera_plan_destroy(tessera_plan* plan);

/* lse may be NULL (not written). stream: a cudaStream_t for CUDA tensors, ignored on the CPU. */
TESSERA_API tessera_status tessera_run_ragged_prefill(const tessera_plan* plan, const DLTensor* q,
                                                      const DLTensor* k, const DLTensor* v,
                                                      const DLTensor* qo_indptr,
                                                      const DLTensor* kv_indptr, const DLTensor* o,
                                                      const DLTensor* lse, void* workspace,
                                                      size_t workspace_bytes, void* stream);

TESSERA_API tessera_status tessera_run_paged_prefill(const tessera_plan* plan, const DLTensor* q,
                                                     const tessera_paged_kv* kv,
                                                     const DLTensor* qo_indptr, const DLTensor* o,
                                                     const DLTensor* lse, void* workspace,
                                                     size_t workspace_bytes, void* stream);

TESSERA_API tessera_status tessera_run_decode(const tessera_plan* plan, const DLTensor* q,
                                              const tessera_paged_kv* kv, const DLTensor* o,
                                              const DLTensor* lse, void* workspace,
                                              size_t workspace_bytes, void* stream);

/* Per-call options of the *_v2 run and one-shot calls (tessera::RunOptions). Extensible: the
 * caller sets struct_size = sizeof(tessera_run_options) as its header declares it (or calls
 * tessera_run_options_default), and the library reads only the fields that size covers, so a
 * caller built against this header keeps working with a library whose struct has grown.
 * run_options may be NULL (all off).
 *  - sinks: optional attention sinks, float32 [num_qo_heads] on q's device (NULL: none): one
 *    logit per query head, in the units of the scaled (and soft-capped) scores, that joins each
 *    row's softmax denominator and has no value row (gpt-oss's s_aux; include/tessera/
 *    attention.hpp). A row without keys gets o = 0, lse = the sink. Captured into a CUDA graph
 *    like q (the graph reads that buffer at every replay).
 *  - enable_pdl: nonzero for a programmatic dependent launch (sm_90+ CUDA; ignored elsewhere):
 *    the kernel may start while the previous kernel in the stream runs and waits for it before
 *    touching any tensor (include/tessera/attention.hpp, RunOptions).
 *  - custom_mask + mask_indptr (prefill: ragged and paged; NULL: none): FlashInfer's
 *    packed_custom_mask and mask_indptr. custom_mask is uint8 (kDLUInt, 8 bits) [bytes], a bit
 *    string packed little-endian (bit b = bit b % 8 of byte b / 8); mask_indptr int32
 *    [batch_size + 1], non-decreasing from a value >= 0: request r's bits start at byte
 *    mask_indptr[r], and bit (i * kv_len_r + j) is 1 when its query row i may see its key j.
 *    Each request needs ceil(q_len_r * kv_len_r / 8) bytes; mask_indptr[batch_size] <= the
 *    bytes of custom_mask. ANDs with the causal / window masks; combines with sinks.
 *  - tree_mask (decode; NULL: none): uint8 [batch_size, >= ceil(q_per_request^2 / 8)], one
 *    little-endian bit string per request: draft token i sees every key before the request's
 *    last q_per_request keys (the drafts' own keys) and draft key d iff bit
 *    (i * q_per_request + d) is set. ANDs with the plan's masks (plan causal = 0 and the tree
 *    alone decides among the drafts).
 *    Masks are host memory read during the call: CPU plans only for now (a CUDA plan returns
 *    TESSERA_ERROR_UNSUPPORTED naming the field); a custom mask on decode or a tree mask on
 *    prefill is TESSERA_ERROR_INVALID_ARGUMENT. Added after enable_pdl: a caller whose
 *    struct_size stops before them passes none. */
typedef struct tessera_run_options {
  size_t struct_size;
  const DLTensor* sinks;
  int32_t enable_pdl;
  const DLTensor* custom_mask;
  const DLTensor* mask_indptr;
  const DLTensor* tree_mask;
} tessera_run_options;

/* Fills the defaults: struct_size = sizeof(tessera_run_options), no sinks, no PDL, no masks. */
TESSERA_API void tessera_run_options_default(tessera_run_options* run_options);

/* The run calls above with per-call options (the versions without _v2 are these with NULL). */
TESSERA_API tessera_status tessera_run_ragged_prefill_v2(
    const tessera_plan* plan, const DLTensor* q, const DLTensor* k, const DLTensor* v,
    const DLTensor* qo_indptr, const DLTensor* kv_indptr, const DLTensor* o, const DLTensor* lse,
    void* workspace, size_t workspace_bytes, void* stream, const tessera_run_options* run_options);

TESSERA_API tessera_status tessera_run_paged_prefill_v2(
    const tessera_plan* plan, const DLTensor* q, const tessera_paged_kv* kv,
    const DLTensor* qo_indptr, const DLTensor* o, const DLTensor* lse, void* workspace,
    size_t workspace_bytes, void* stream, const tessera_run_options* run_options);

TESSERA_API tessera_status tessera_run_decode_v2(const tessera_plan* plan, const DLTensor* q,
                                                 const tessera_paged_kv* kv, const DLTensor* o,
                                                 const DLTensor* lse, void* workspace,
                                                 size_t workspace_bytes, void* stream,
                                                 const tessera_run_options* run_options);

/* ---- one-shot calls ----
 * plan + run with an internal workspace. The index arrays are read on the host, so for CUDA
 * tensors these synchronise the stream: use plan/run on a serving hot path. */

TESSERA_API tessera_status tessera_ragged_prefill(const DLTensor* q, const DLTensor* k,
                                                  const DLTensor* v, const DLTensor* qo_indptr,
                                                  const DLTensor* kv_indptr, const DLTensor* o,
                                                  const DLTensor* lse,
                                                  const tessera_attention_options* options,
                                                  void* stream);

TESSERA_API tessera_status tessera_paged_prefill(const DLTensor* q, const tessera_paged_kv* kv,
                                                 const DLTensor* qo_indptr, const DLTensor* o,
                                                 const DLTensor* lse,
                                                 const tessera_attention_options* options,
                                                 void* stream);

/* q: [batch_size * q_per_request, num_qo_heads, head_dim]; batch_size from kv->page_indptr. */
TESSERA_API tessera_status tessera_decode(const DLTensor* q, const tessera_paged_kv* kv,
                                          const DLTensor* o, const DLTensor* lse,
                                          const tessera_attention_options* options, void* stream);

/* The one-shot calls above with per-call options (see tessera_run_options). */
TESSERA_API tessera_status tessera_ragged_prefill_v2(
    const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* qo_indptr,
    const DLTensor* kv_indptr, const DLTensor* o, const DLTensor* lse,
    const tessera_attention_options* options, void* stream, const tessera_run_options* run_options);

TESSERA_API tessera_status tessera_paged_prefill_v2(const DLTensor* q, const tessera_paged_kv* kv,
                                                    const DLTensor* qo_indptr, const DLTensor* o,
                                                    const DLTensor* lse,
                                                    const tessera_attention_options* options,
                                                    void* stream,
                                                    const tessera_run_options* run_options);

TESSERA_API tessera_status tessera_decode_v2(const DLTensor* q, const tessera_paged_kv* kv,
                                             const DLTensor* o, const DLTensor* lse,
                                             const tessera_attention_options* options,
                                             void* stream, const tessera_run_options* run_options);

/* ---- ops ---- */
/* Each op takes up to 65536 heads and a head_dim up to 4096. */

/* Rotates q [nnz, Hq, D] and/or k [nnz, Hk, D] in place (either may be NULL, not both) by
 * positions [nnz] int32. options may be NULL (defaults). */
TESSERA_API tessera_status tessera_apply_rope_inplace(const DLTensor* q, const DLTensor* k,
                                                      const DLTensor* positions,
                                                      const tessera_rope_options* options,
                                                      void* stream);

/* RoPE from a precomputed table (vLLM's rotary_embedding, FlashInfer's
 * apply_rope_with_cos_sin_cache): cos_sin_cache [max_position, rotary_dim] float32, row p the
 * cos of the rotary_dim / 2 pairs at position p then their sin; positions [nnz] int32 or int64
 * in [0, max_position) (checked for host tensors and in checked mode; on a device, a token with
 * an out-of-range position gets NaN in its rotated features, and nothing outside the table is
 * read). interleave 0: NeoX pairs (x[i], x[i + rotary_dim / 2]); non-zero: GPT-J pairs. q or k
 * may be NULL, not both (tessera::apply_rope_with_cos_sin_cache_inplace). */
TESSERA_API tessera_status tessera_apply_rope_with_cos_sin_cache_inplace(
    const DLTensor* q, const DLTensor* k, const DLTensor* positions, const DLTensor* cos_sin_cache,
    int interleave, void* stream);

/* Scatters k_new/v_new [nnz, Hkv, D], ragged by append_indptr [B+1], into the paged cache,
 * whose page table already describes the cache after the append. rope non-NULL: k rows are
 * rotated by their positions as they are written. */
TESSERA_API tessera_status tessera_append_paged_kv_cache(
    const DLTensor* k_new, const DLTensor* v_new, const DLTensor* append_indptr,
    const tessera_paged_kv* kv, const tessera_rope_options* rope, void* stream);

/* vLLM / FlashAttention block_table [B, max_pages] int32 + seq_lens [B] int32 -> CSR page table
 * page_indptr [B+1], page_indices [>= total pages], last_page_len [B] (outputs, int32). */
TESSERA_API tessera_status tessera_block_table_to_csr(const DLTensor* block_table,
                                                      const DLTensor* seq_lens, int page_size,
                                                      const DLTensor* page_indptr,
                                                      const DLTensor* page_indices,
                                                      const DLTensor* last_page_len, void* stream);

/* Exact merge of two partial attentions over disjoint key sets: o [N, H, D], lse [N, H] float32.
 * lse_out may be NULL. */
TESSERA_API tessera_status tessera_merge_state(const DLTensor* o_a, const DLTensor* lse_a,
                                               const DLTensor* o_b, const DLTensor* lse_b,
                                               const DLTensor* o_out, const DLTensor* lse_out,
                                               void* stream);

/* Variable-length merge: states [S, H, D], lse [S, H], indptr [N+1] int32 -> o_out [N, H, D],
 * lse_out [N, H] (may be NULL). A row with no state gives o = 0, lse = -inf. */
TESSERA_API tessera_status tessera_merge_states(const DLTensor* states, const DLTensor* lse,
                                                const DLTensor* indptr, const DLTensor* o_out,
                                                const DLTensor* lse_out, void* stream);

/* ---- multi-level cascade attention (tessera/cascade.hpp) ----
 * Every level covers the same total_q query rows and groups them with its own qo_indptr and page
 * table into the one k_cache / v_cache; a row attends in one softmax to its group's keys at every
 * level: all of them at the upper levels (shared prefixes, no mask), and at the last level as
 * paged prefill with `options` (causal aligned bottom-right to that level's keys). Sliding
 * windows are rejected. Sinks (run_options) join the softmax once; masks in run_options are
 * rejected. 1..16 levels. */

typedef struct tessera_cascade_plan tessera_cascade_plan;

/* Host lengths of one level: qo_indptr and page_indptr batch_size + 1 values, last_page_len
 * batch_size values. */
typedef struct tessera_cascade_level_lengths {
  const int32_t* qo_indptr;
  const int32_t* page_indptr;
  const int32_t* last_page_len;
  int64_t batch_size;
} tessera_cascade_level_lengths;

/* Index tensors of one level on the plan's device (int32; qo_indptr is not read for a level
 * whose requests each hold one query row, which runs the decode kernels). */
typedef struct tessera_cascade_level {
  const DLTensor* qo_indptr;
  const DLTensor* page_indptr;
  const DLTensor* page_indices;
  const DLTensor* last_page_len;
} tessera_cascade_level;

TESSERA_API tessera_status tessera_plan_cascade(const tessera_cascade_level_lengths* levels,
                                                int num_levels, int page_size, int num_qo_heads,
                                                int num_kv_heads, int head_dim,
                                                const tessera_attention_options* options,
                                                int device_type, int device_id,
                                                tessera_cascade_plan** out);
/* Workspace a run needs (0 for NULL); the number of levels (0 for NULL). */
TESSERA_API size_t tessera_cascade_plan_workspace_bytes(const tessera_cascade_plan* plan);
TESSERA_API int tessera_cascade_plan_num_levels(const tessera_cascade_plan* plan);
/* Each level's op and partition, as tessera_plan_explain. */
TESSERA_API tessera_status tessera_cascade_plan_explain(const tessera_cascade_plan* plan,
                                                        char* buffer, size_t capacity,
                                                        size_t* needed);
/* Uploads every level's work lists into the workspace (see tessera_plan_upload). */
TESSERA_API tessera_status tessera_cascade_plan_upload(tessera_cascade_plan* plan, void* workspace,
                                                       size_t workspace_bytes, void* stream);
TESSERA_API void tessera_cascade_plan_destroy(tessera_cascade_plan* plan);

/* q, o [total_q, num_qo_heads, head_dim]; lse optional float32 [total_q, num_qo_heads];
 * k_cache / v_cache as in tessera_paged_kv with `layout`; levels: num_levels entries as planned.
 * run_options may be NULL. Every argument is checked before o or lse is written. */
TESSERA_API tessera_status tessera_run_cascade(
    const tessera_cascade_plan* plan, const DLTensor* q, const DLTensor* k_cache,
    const DLTensor* v_cache, int layout, const tessera_cascade_level* levels, int num_levels,
    const DLTensor* o, const DLTensor* lse, void* workspace, size_t workspace_bytes, void* stream,
    const tessera_run_options* run_options);

/* ---- MLA: DeepSeek-style multi-head latent attention, absorbed (tessera/mla.hpp) ----
 * Per token the paged cache holds a latent ckv [kv_lora_rank] and a rotary key kpe [rope_dim],
 * shared by every query head; queries are q_nope [total_q, num_heads, kv_lora_rank] (times the
 * absorbed W_UK) and q_pe [total_q, num_heads, rope_dim], ragged by qo_indptr (decode: one or a
 * few rows per request; prefill: causal bottom-right with options.causal). Scores
 * sm_scale * (q_nope . ckv + q_pe . kpe), o = softmax . ckv [total_q, num_heads, kv_lora_rank] in
 * q's dtype, lse optional float32 [total_q, num_heads]. kv_lora_rank a multiple of 8 in [8, 512],
 * rope_dim a multiple of 8 in [0, 128]. CPU only for now: a CUDA device is
 * TESSERA_ERROR_UNSUPPORTED naming 'device' at plan time. */

typedef struct tessera_mla_plan tessera_mla_plan;

typedef struct tessera_mla_options {
  int causal;     /* non-zero: causal mask, aligned bottom-right */
  float sm_scale; /* 0 = 1 / sqrt(kv_lora_rank + rope_dim); DeepSeek's includes the YaRN factor */
} tessera_mla_options;

/* ckv_cache [num_pages, page_size, kv_lora_rank] and kpe_cache [num_pages, page_size, rope_dim]
 * (NULL when rope_dim is 0), one dtype; a combined cache [num_pages, page_size, kv_lora_rank +
 * rope_dim] is passed as two strided views of it. int32 page table as tessera_paged_kv's. */
typedef struct tessera_mla_cache {
  const DLTensor* ckv_cache;
  const DLTensor* kpe_cache;
  const DLTensor* page_indptr;
  const DLTensor* page_indices;
  const DLTensor* last_page_len;
} tessera_mla_cache;

/* Host lengths: qo_indptr and page_indptr batch_size + 1 values, last_page_len batch_size.
 * options may be NULL (not causal, default scale). */
TESSERA_API tessera_status tessera_plan_mla(const int32_t* qo_indptr, const int32_t* page_indptr,
                                            const int32_t* last_page_len, int64_t batch_size,
                                            int page_size, int num_heads, int kv_lora_rank,
                                            int rope_dim, const tessera_mla_options* options,
                                            int device_type, int device_id, tessera_mla_plan** out);
/* Workspace a run needs (0 for NULL). */
TESSERA_API size_t tessera_mla_plan_workspace_bytes(const tessera_mla_plan* plan);
TESSERA_API tessera_status tessera_mla_plan_explain(const tessera_mla_plan* plan, char* buffer,
                                                    size_t capacity, size_t* needed);
TESSERA_API void tessera_mla_plan_destroy(tessera_mla_plan* plan);
/* q_pe may be NULL when rope_dim is 0; lse may be NULL. Nothing is written on bad input. */
TESSERA_API tessera_status tessera_run_mla(const tessera_mla_plan* plan, const DLTensor* q_nope,
                                           const DLTensor* q_pe, const tessera_mla_cache* cache,
                                           const DLTensor* qo_indptr, const DLTensor* o,
                                           const DLTensor* lse, void* workspace,
                                           size_t workspace_bytes, void* stream);
/* Plan + run with an internal workspace (index arrays read on the host). */
TESSERA_API tessera_status tessera_mla_attention(const DLTensor* q_nope, const DLTensor* q_pe,
                                                 const tessera_mla_cache* cache,
                                                 const DLTensor* qo_indptr, const DLTensor* o,
                                                 const DLTensor* lse,
                                                 const tessera_mla_options* options, void* stream);
/* ckv_new [nnz, kv_lora_rank], kpe_new [nnz, rope_dim] (NULL when rope_dim is 0), ragged by
 * append_indptr [B+1], into the last positions of each request (the page table describes the
 * cache after the append); rope non-NULL: kpe rows rotated by their positions as written. */
TESSERA_API tessera_status tessera_append_paged_mla_cache(
    const DLTensor* ckv_new, const DLTensor* kpe_new, const DLTensor* append_indptr,
    const tessera_mla_cache* cache, const tessera_rope_options* rope, void* stream);

/* ---- CPU backend controls (process-wide) ---- */

/* Threads of the CPU backend: >= 1 pins the count, 0 restores the default
 * (TESSERA_NUM_THREADS or the hardware count). */
TESSERA_API tessera_status tessera_set_num_threads(int threads);

/* Checked mode (process-wide): with enable != 0, run calls copy device-resident index arrays
   (indptr, page_indices, last_page_len) to the host, synchronising the stream, and validate
   them like host arrays before any kernel runs; a bad entry returns
   TESSERA_ERROR_INVALID_ARGUMENT naming it. It also rejects NaN / inf in the q, k and v elements
   a call reads (TESSERA_ERROR_INVALID_ARGUMENT naming the tensor and the first such element;
   tessera/backend.hpp). Off by default (TESSERA_CHECK=1 turns it on). */
TESSERA_API tessera_status tessera_set_index_checking(int enable);
TESSERA_API int tessera_index_checking(void);
/* Non-zero: serve CPU attention with the double-accumulating reference (tests); 0: the fast
 * tiled path (the default). */
TESSERA_API tessera_status tessera_set_cpu_reference(int enable);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TESSERA_TESSERA_H_ */
