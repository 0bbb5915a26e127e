// The backend table: what the core needs from a GPU backend, as one table of functions that the
// backend fills in (src/cuda/device_backend.cpp). Builds without one link
// src/nogpu/device_backend.cpp, whose gpu_backend() is nullptr, so the core never tests a build
// flag. Every function receives arguments the core has already validated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/ops.hpp"

namespace tessera::detail {

struct DeviceBackend {
  const char* name;  // "cuda"
  const char* archs;  // the architectures compiled, CMake's list ("80;90a")
  int (*device_count)();  // devices visible now (0 without a driver or device; never throws)
  std::string (*unavailable_reason)();  // why device_count() is 0 ("" when it is not)
  uint64_t (*stream_capture_id)(void* stream);  // 0: not capturing
  // True while `stream` is being captured into a CUDA graph (the calls that synchronise refuse
  // it before any CUDA call, so the capture stays valid).
  bool (*stream_is_capturing)(void* stream);
  // After cudaDeviceReset of `device` (tessera::cuda_after_device_reset).
  void (*after_device_reset)(int device);
  std::string (*describe)(int device);          // "cuda:0 NVIDIA H200 sm_90, 132 SMs"

  // Planning: the knobs of the kernels that will serve (op, heads, head_dim) on `device`
  // (batch: the request count where a knob may follow it, 0 where it must not), and the kernel
  // row recorded in a finished plan (plan.kernel_id / kernel_options / kernel).
  PlanConfig (*plan_config)(AttentionOp op, int num_qo_heads, int num_kv_heads, int head_dim,
                            int device, int64_t batch);
  void (*choose_kernel)(Plan& plan);

  void (*run_attention)(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                        void* stream);
  uint64_t (*upload_plan)(const Plan& plan, Workspace workspace, void* stream);
  void (*forget_uploads)(const void* workspace);

  void* (*alloc)(size_t bytes);
  void (*free)(void* ptr);
  void (*copy_to_host)(void* dst, const void* src, size_t bytes, void* stream);  // syncs stream

  void (*apply_rope)(const TensorView& q, const TensorView& k, const int32_t* positions,
                     const RopeOptions& options, void* stream);
  void (*apply_rope_cos_sin_cache)(const TensorView& q, const TensorView& k,
                                   const TensorView& positions, const TensorView& cos_sin_cache,
                                   bool interleave, void* stream);
  void (*append_paged_kv)(const TensorView& k_new, const TensorView& v_new,
                          const int32_t* append_indptr, const KVSource& cache, int32_t batch_size,
                          int32_t num_kv_heads, int32_t head_dim, const RopeOptions* rope,
                          void* stream);
  void (*block_table_to_csr)(const TensorView& block_table, const int32_t* seq_lens,
                             int page_size, int32_t* page_indptr, int32_t* page_indices,
                             int32_t* last_page_len, void* stream);
  void (*merge_state)(const TensorView& o_a, const float* lse_a, const TensorView& o_b,
                      const float* lse_b, const TensorView& o_out, float* lse_out, void* stream);
  void (*merge_states)(const TensorView& states, const float* lse, const int32_t* indptr,
                       const TensorView& o_out, float* lse_out, void* stream);

  // Checked mode (core/nonfinite_check.hpp): the first NaN / inf among rows x heads x head_dim
  // elements of a float tensor on `device`, element (r, h, d) at row_offsets[r] + h * head_stride
  // + d (row_offsets: a host array of `rows` element offsets). Returns
  // r * heads * head_dim + h * head_dim + d of the first (lowest) one, or -1 when all are finite.
  // Synchronises `stream`.
  int64_t (*first_nonfinite)(int device, const void* data, DType dtype,
                             const int64_t* row_offsets, int64_t rows, int32_t heads,
                             int64_t head_stride, int32_t head_dim, void* stream);
};

// The GPU backend compiled into this library; nullptr when it has none.
const DeviceBackend* gpu_backend();

}  // namespace tessera::detail
