#include "core/dispatch.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "core/backends.hpp"
#include "core/device_backend.hpp"
#include "tessera/backend.hpp"

namespace tessera::detail {

// CPU planner knobs: tiles of 64 packed rows (or one token's whole GQA group), one worker per
// thread, split-KV for long key ranges so a single long request still uses every core.
inline constexpr int32_t kCpuTileRows = 64;
inline constexpr int32_t kCpuMinKvChunk = 512;

namespace {

const DeviceBackend& gpu_or_throw(std::string_view who) {
  const DeviceBackend* gpu = gpu_backend();
  if (gpu == nullptr) {
    ArgChecker(std::string(who)).unsupported("device", "this build of tessera has no CUDA backend");
  }
  return *gpu;
}

}  // namespace

void check_device_usable(const ArgChecker& check, Device device) {
  if (device.type == DeviceType::kCPU) return;
  const DeviceBackend* gpu = gpu_backend();
  if (gpu == nullptr) {
    check.unsupported("device", "this build of tessera has no CUDA backend (built without nvcc)");
  }
  const int count = gpu->device_count();
  if (count == 0) {
    check.unsupported("device",
                      "no CUDA device is visible on this host (" + gpu->unavailable_reason() + ")");
  }
  if (device.index < 0 || device.index >= count) {
    check.fail("device", "expected a CUDA device index in [0, " + std::to_string(count) +
                             "), got " + std::to_string(device.index));
  }
}

void check_not_capturing(const ArgChecker& check, Device device, void* stream, const char* why) {
  if (device.type == DeviceType::kCPU) return;
  if (!gpu_or_throw(check.op()).stream_is_capturing(stream)) return;
  check.fail("stream", std::string("is being captured into a CUDA graph, and ") + why +
                           ", which a capture does not allow; nothing was enqueued and the "
                           "capture is still valid. Call it outside the capture, or capture the "
                           "plan / upload_plan / run_* path instead");
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
  return gpu_or_throw("plan").plan_config(op, num_qo_heads, num_kv_heads, head_dim, device.index,
                                          batch);
}

void choose_kernel(Plan& plan) {
  if (plan.device.type == DeviceType::kCPU) {
    plan.kernel_id = -1;
    plan.kernel = cpu_impl() == CpuImpl::kReference
                      ? "CPU reference (double accumulation, set_cpu_impl(kReference))"
                      : "CPU fast path (tiled online softmax, GQA packing, per-ISA vector kernels)";
    return;
  }
  gpu_or_throw("plan").choose_kernel(plan);
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
  if (problem.head_dim_v() != problem.head_dim) {  // a plan built by hand: plan_* refuses it
    throw Error(Error::Kind::kUnsupported,
                "tessera::run: 'plan': head_dim_vo != head_dim runs on the CPU backend only");
  }
  gpu_or_throw("run").run_attention(plan, problem, workspace, stream);
}

uint64_t dispatch_upload_plan(const Plan& plan, Workspace workspace, void* stream) {
  if (plan.device.type == DeviceType::kCPU) return 0;
  return gpu_or_throw("upload_plan").upload_plan(plan, workspace, stream);
}

void dispatch_forget_uploads(const void* workspace) {
  if (const DeviceBackend* gpu = gpu_backend()) gpu->forget_uploads(workspace);
}

ScratchBuffer::ScratchBuffer(const ArgChecker& check, Device device, size_t bytes)
    : device_(device), bytes_(bytes) {
  if (bytes == 0) return;
  const auto out_of_memory = [&](const std::string& detail) {
    throw Error(Error::Kind::kOutOfMemory,
                "tessera::" + std::string(check.op()) + ": 'workspace': the call's own " +
                    device_name(device) + " workspace of " + std::to_string(bytes) +
                    " bytes could not be allocated (" + detail +
                    "); nothing was written. Plan once and pass a workspace to run_* instead");
  };
  if (device.type == DeviceType::kCPU) {
    data_ = std::malloc(bytes);
    if (!data_) out_of_memory("malloc failed");
    return;
  }
  try {
    data_ = gpu_or_throw(check.op()).alloc(bytes);
  } catch (const Error& error) {
    if (error.kind() != Error::Kind::kOutOfMemory) throw;
    out_of_memory(error.what());
  }
}

ScratchBuffer::~ScratchBuffer() {
  if (!data_) return;
  if (device_.type == DeviceType::kCPU) {
    std::free(data_);
    return;
  }
  gpu_backend()->free(data_);  // data_ came from it
}

std::vector<int32_t> read_int32_array(const TensorView& view, void* stream) {
  std::vector<int32_t> values(static_cast<size_t>(view.shape[0]));
  if (values.empty()) return values;
  if (view.device.type == DeviceType::kCPU) {
    std::memcpy(values.data(), view.data, values.size() * sizeof(int32_t));
    return values;
  }
  gpu_or_throw("read").copy_to_host(values.data(), view.data, values.size() * sizeof(int32_t),
                                    stream);
  return values;
}

std::vector<int64_t> read_index_values(const TensorView& view, void* stream) {
  if (view.dtype == DType::kInt32) {
    const std::vector<int32_t> narrow = read_int32_array(view, stream);
    return {narrow.begin(), narrow.end()};
  }
  std::vector<int64_t> values(static_cast<size_t>(view.shape[0]));
  if (values.empty()) return values;
  if (view.device.type == DeviceType::kCPU) {
    std::memcpy(values.data(), view.data, values.size() * sizeof(int64_t));
    return values;
  }
  gpu_or_throw("read").copy_to_host(values.data(), view.data, values.size() * sizeof(int64_t),
                                    stream);
  return values;
}

}  // namespace tessera::detail
