// Internal interface of the CUDA backend (host-callable; no CUDA headers needed to include it).
// The core calls these after validation. All of them are asynchronous on `stream`.
#pragma once

#include <cstdint>
#include <string>

#include "core/problem.hpp"
#include "core/tuning.hpp"
#include "tessera/attention.hpp"
#include "tessera/ops.hpp"

namespace tessera::detail {

struct CudaDeviceInfo {
  int device = 0;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  size_t max_smem_per_block_optin = 0;  // bytes
  size_t smem_per_sm = 0;
  int regs_per_sm = 0;
  std::string name;
};
// Cached per device. Throws tessera::Error when no device / driver.
const CudaDeviceInfo& cuda_device_info(int device);
int cuda_device_count_or_zero();
// Why no device is usable ("" when one is): the error of cudaGetDeviceCount, with a hint for
// a missing driver (libcuda.so.1) or an empty CUDA_VISIBLE_DEVICES.
std::string cuda_unavailable_reason();
int cuda_current_device();
uint64_t cuda_stream_capture_id(void* stream);  // 0: not capturing
// True while `stream` is being captured (active or invalidated capture); throws for the legacy
// stream while another stream of its device captures in global mode.
bool cuda_stream_is_capturing(void* stream);
// tessera::cuda_after_device_reset: forgets every upload, drops `device`'s pinned staging
// blocks and makes every kernel's shared-memory opt-in again (src/cuda/attention.cu).
void cuda_after_device_reset(int device);

// Fills the planner knobs for this device and problem (tile rows of the kernel that will serve
// it, persistent worker count, split-KV policy).
// batch: the plan's request count (decode's batch rule, see cuda_decode_plan_config); 0: none.
PlanConfig cuda_plan_config(AttentionOp op, int num_qo_heads, int num_kv_heads, int head_dim,
                            DType kv_dtype_hint, int device, int64_t batch = 0);

// Chooses the kernel registry row that serves `plan` (cuda/kernel_select.cpp) and records it
// in plan.kernel_id, plan.kernel_options and plan.kernel (the row and why, for explain()).
void cuda_choose_kernel(Plan& plan);

// How the sm80 decode kernels serve decode of (heads, head_dim) with `kv_dtype` K/V (= q) on
// `info`, one query token per request (src/cuda/sm80/decode.cu; `tessera plan --explain`).
struct CudaDecodeSelection {
  ResolvedDecodeTuning tuning;       // kernel variant and minimum split chunk, and their sources
  const char* mma_kernel = nullptr;  // the tensor-core kernel; nullptr: the CUDA-core kernel
  std::string cuda_core_reason;      // why the CUDA-core kernel, when mma_kernel is nullptr
};
CudaDecodeSelection cuda_decode_selection(int num_qo_heads, int num_kv_heads, int head_dim,
                                          DType kv_dtype, const CudaDeviceInfo& info,
                                          int64_t batch = 0);

// The name of the prefill kernel this thread launched last, and of the decode kernel its last
// decode run launched ("" when that run launched none) - tests check which ran. The fallbacks:
// why this thread's last run did not launch its plan's row ("" when it did).
const char* cuda_last_prefill_kernel();
const char* cuda_last_decode_kernel();
const char* cuda_last_prefill_fallback();
const char* cuda_last_decode_fallback();

// Copies the plan's header and lists into the workspace (WorkspaceLayout) with one
// cudaMemcpyAsync from a pinned staging buffer of a per-device pool; does not synchronise.
// Returns the upload's generation (never 0), remembered per workspace pointer so that
// cuda_run_attention can tell whether a plan's upload is still the workspace's latest.
uint64_t cuda_upload_plan(const Plan& plan, Workspace workspace, void* stream);
// Forgets which upload `workspace` holds (tessera::forget_uploads).
void cuda_forget_uploads(const void* workspace);
// Uploads that went through pageable memory because the staging pool was full (tests).
uint64_t cuda_staging_overflow_uploads();

// Attention: uploads the plan's lists into the workspace (WorkspaceLayout) unless the plan was
// uploaded there by cuda_upload_plan and nothing has overwritten it since, and launches the
// prefill or decode kernel, then the merge of split-KV partials.
void cuda_run_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                        void* stream);

// Memory helpers for the one-shot (synchronising) calls and the CLI. Implemented in
// src/cuda/memory.cu; each throws tessera::Error(kRuntime) naming the CUDA error.
void cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream);  // syncs stream
void cuda_copy_to_device(void* dst, const void* src, size_t bytes, void* stream);  // syncs stream
void* cuda_alloc(size_t bytes);
void cuda_free(void* ptr);
void cuda_synchronize(void* stream);
void cuda_memset(void* ptr, int byte, size_t bytes, void* stream);  // asynchronous

// Ops (device pointers; arguments validated by the core).
void cuda_apply_rope_cos_sin_cache(const TensorView& q, const TensorView& k,
                                   const TensorView& positions, const TensorView& cos_sin_cache,
                                   bool interleave, void* stream);
void cuda_apply_rope(const TensorView& q, const TensorView& k, const int32_t* positions,
                     const RopeOptions& options, void* stream);
void cuda_append_paged_kv(const TensorView& k_new, const TensorView& v_new,
                          const int32_t* append_indptr, const KVSource& cache, int32_t batch_size,
                          int32_t num_kv_heads, int32_t head_dim, const RopeOptions* rope,
                          void* stream);
void cuda_block_table_to_csr(const TensorView& block_table, const int32_t* seq_lens,
                             int page_size, int32_t* page_indptr, int32_t* page_indices,
                             int32_t* last_page_len, void* stream);
void cuda_merge_state(const TensorView& o_a, const float* lse_a, const TensorView& o_b,
                      const float* lse_b, const TensorView& o_out, float* lse_out, void* stream);
void cuda_merge_states(const TensorView& states, const float* lse, const int32_t* indptr,
                       const TensorView& o_out, float* lse_out, void* stream);
// Checked mode: the first NaN / inf of rows x heads x head_dim elements of a device tensor
// (DeviceBackend::first_nonfinite; src/cuda/ops/nonfinite.cu). Synchronises `stream`.
int64_t cuda_first_nonfinite(int device, const void* data, DType dtype,
                             const int64_t* row_offsets, int64_t rows, int32_t heads,
                             int64_t head_stride, int32_t head_dim, void* stream);

}  // namespace tessera::detail
