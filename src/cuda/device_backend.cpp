// The CUDA backend's entry in the core's backend table (core/device_backend.hpp).
#include "core/device_backend.hpp"

#include <algorithm>
#include <string>

#include "cuda/cuda_backend.hpp"

namespace tessera::detail {
namespace {

std::string describe(int device) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  return "cuda:" + std::to_string(device) + " " + info.name + " sm_" +
         std::to_string(info.sm_major) + std::to_string(info.sm_minor) + ", " +
         std::to_string(info.num_sms) + " SMs";
}

PlanConfig plan_config(AttentionOp op, int num_qo_heads, int num_kv_heads, int head_dim,
                       int device, int64_t batch) {
  return cuda_plan_config(op, num_qo_heads, num_kv_heads, head_dim, DType::kBFloat16, device,
                          batch);
}

// CMake passes its architecture list with ',' for ';' (TESSERA_CUDA_ARCHS_BUILT).
std::string archs_built() {
  std::string archs = TESSERA_CUDA_ARCHS_BUILT;
  std::replace(archs.begin(), archs.end(), ',', ';');
  return archs;
}
const std::string kArchs = archs_built();

const DeviceBackend kCuda = {
    "cuda",
    kArchs.c_str(),
    &cuda_device_count_or_zero,
    &cuda_unavailable_reason,
    &cuda_stream_capture_id,
    &cuda_stream_is_capturing,
    &cuda_after_device_reset,
    &describe,
    &plan_config,
    &cuda_choose_kernel,
    &cuda_run_attention,
    &cuda_upload_plan,
    &cuda_forget_uploads,
    &cuda_alloc,
    &cuda_free,
    &cuda_copy_to_host,
    &cuda_apply_rope,
    &cuda_apply_rope_cos_sin_cache,
    &cuda_append_paged_kv,
    &cuda_block_table_to_csr,
    &cuda_merge_state,
    &cuda_merge_states,
    &cuda_first_nonfinite,
};

}  // namespace

const DeviceBackend* gpu_backend() { return &kCuda; }

}  // namespace tessera::detail
