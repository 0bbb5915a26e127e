// What the GPU attention tests share beyond gpu_test_support.hpp: whether the device is Hopper,
// the kernel that served the last run of a case, and
// a hand-made plan (make_test_plan) of an attention case through the CUDA backend's entry
// (cuda_run_attention uploads and dispatches), over device copies of the case's bytes (NaN
// padding, spare pages and sinks included), with NaN-filled outputs and workspace. Shared by the
// GPU tests that check split-KV partials and merges on every row. Header-only; CUDA builds only.
#pragma once

#include <string>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_test_support.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include "core/workspace_layout.hpp"
#include "cuda/cuda_backend.hpp"

namespace tessera::test {

inline bool hopper() { return detail::cuda_device_info(kGpu.index).sm_major == 9; }

// The kernel of the last decode (for a decode case) or prefill launch.
inline std::string last_kernel(const AttentionCase& c) {
  return op_of(c) == AttentionOp::kDecode ? detail::cuda_last_decode_kernel()
                                          : detail::cuda_last_prefill_kernel();
}

inline Outputs run_hand_made_on_gpu(AttentionBuffers& buffers, const TestPlanOptions& options) {
  Plan plan = make_test_plan(buffers.test_case, options);
  plan.device = kGpu;
  plan.workspace_bytes = detail::WorkspaceLayout::of(plan).total;
  poison_outputs(buffers);
  DeviceBuffer q(buffers.q), k(buffers.k), v(buffers.v), o(buffers.o), lse(buffers.lse);
  DeviceBuffer qo_indptr(buffers.qo_indptr), kv_indptr(buffers.kv_indptr);
  DeviceBuffer page_indptr(buffers.page_indptr), page_indices(buffers.page_indices);
  DeviceBuffer last_page_len(buffers.last_page_len), sinks(buffers.sinks);
  BufferPointers pointers;
  pointers.q = q.data();
  pointers.k = k.data();
  pointers.v = v.data();
  pointers.o = o.data();
  pointers.lse = buffers.test_case.with_lse ? static_cast<float*>(lse.data()) : nullptr;
  pointers.qo_indptr = static_cast<const int32_t*>(qo_indptr.data());
  pointers.kv_indptr = static_cast<const int32_t*>(kv_indptr.data());
  pointers.page_indptr = static_cast<const int32_t*>(page_indptr.data());
  pointers.page_indices = static_cast<const int32_t*>(page_indices.data());
  pointers.last_page_len = static_cast<const int32_t*>(last_page_len.data());
  pointers.sinks = buffers.test_case.with_sinks ? static_cast<const float*>(sinks.data()) : nullptr;
  DeviceBuffer workspace(plan.workspace_bytes);
  detail::cuda_memset(workspace.data(), 0xff, workspace.bytes(), nullptr);
  detail::cuda_run_attention(plan, make_problem(buffers, pointers),
                             Workspace{workspace.data(), workspace.bytes()}, nullptr);
  detail::cuda_synchronize(nullptr);
  return Outputs{o.download<uint8_t>(), lse.download<uint8_t>()};
}

}  // namespace tessera::test

#endif  // TESSERA_HAVE_CUDA
