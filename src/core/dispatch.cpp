#include "core/dispatch.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "core/backends.hpp"
#include "tessera/backend.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera::detail {

// CPU planner knobs: tiles of 64 packed rows (or one token's whole GQA group), one worker per
// thread, split-KV for long key ranges so a single long request still uses every core.
inline constexpr int32_t kCpuTileRows = 64;
inline constexpr int32_t kCpuMinKvChunk = 512;

void check_device_usable(const ArgChecker& check, Device device) {
  if (device.type == DeviceType::kCPU) return;
#if defined(TESSERA_HAVE_CUDA)
  const int count = cuda_device_count_or_zero();
  if (count == 0) check.unsupported("device", "no CUDA device is visible on this host");
  if (device.index < 0 || device.index >= count) {
    check.fail("device", "expected a CUDA device index in [0, " + std::to_string(count) +
                             "), got " + std::to_string(device.index));
  }
#else
  check.unsupported("device", "this build of tessera has no CUDA backend (built without nvcc)");
#endif
}

PlanConfig plan_config_for(AttentionOp op, Device device, int num_qo_heads, int num_kv_heads,
                           int head_dim, int64_t batch) {
  if (device.type == DeviceType::kCPU) {
    PlanConfig config;
    config.q_tile_rows = std::max(kCpuTileRows, num_qo_heads / num_kv_heads);
    config.num_workers = num_threads();
    config.split_kv = true;
    config.min_kv_chunk = kCpuMinKvChunk;
    return config;
  }
#if defined(TESSERA_HAVE_CUDA)
  return cuda_plan_config(op, num_qo_heads, num_kv_heads, head_dim, DType::kBFloat16,
                          device.index, batch);
#else
  ArgChecker("plan").unsupported("device", "this build of tessera has no CUDA backend");
#endif
}

std::string plan_kernel_note(AttentionOp op, Device device, int num_qo_heads, int num_kv_heads,
                             int head_dim, int64_t batch) {
  if (device.type == DeviceType::kCPU) {
    return cpu_impl() == CpuImpl::kReference
               ? "CPU reference (double accumulation, TESSERA_CPU_IMPL=reference)"
               : "CPU fast path (tiled online softmax, GQA packing, per-ISA vector kernels)";
  }
#if defined(TESSERA_HAVE_CUDA)
  return cuda_plan_kernel_note(op, num_qo_heads, num_kv_heads, head_dim, device.index, batch);
#else
  return "no CUDA backend in this build";
#endif
}

void dispatch_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                        void* stream) {
  if (plan.device.type == DeviceType::kCPU) {
    if (cpu_impl() == CpuImpl::kReference) {
      cpu_reference_attention(problem);
    } else {
      cpu_fast_attention(plan, problem, workspace);
    }
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  cuda_run_attention(plan, problem, workspace, stream);
#endif
}

uint64_t dispatch_upload_plan(const Plan& plan, Workspace workspace, void* stream) {
  if (plan.device.type == DeviceType::kCPU) return 0;
#if defined(TESSERA_HAVE_CUDA)
  return cuda_upload_plan(plan, workspace, stream);
#else
  return 0;
#endif
}

void dispatch_forget_uploads([[maybe_unused]] const void* workspace) {
#if defined(TESSERA_HAVE_CUDA)
  cuda_forget_uploads(workspace);
#endif
}

ScratchBuffer::ScratchBuffer(Device device, size_t bytes) : device_(device), bytes_(bytes) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    data_ = std::malloc(bytes);
    if (!data_) throw std::bad_alloc();  // the C ABI maps it to TESSERA_ERROR_OUT_OF_MEMORY
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  data_ = cuda_alloc(bytes);
#endif
}

ScratchBuffer::~ScratchBuffer() {
  if (!data_) return;
  if (device_.type == DeviceType::kCPU) {
    std::free(data_);
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  cuda_free(data_);
#endif
}

std::vector<int32_t> read_int32_array(const TensorView& view, void* stream) {
  std::vector<int32_t> values(static_cast<size_t>(view.shape[0]));
  if (values.empty()) return values;
  if (view.device.type == DeviceType::kCPU) {
    std::memcpy(values.data(), view.data, values.size() * sizeof(int32_t));
    return values;
  }
#if defined(TESSERA_HAVE_CUDA)
  cuda_copy_to_host(values.data(), view.data, values.size() * sizeof(int32_t), stream);
#endif
  return values;
}

}  // namespace tessera::detail
