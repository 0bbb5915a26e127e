// Device queries and the build description of the public backend API.
#include <cstdint>
#include <string>

#include "core/device_backend.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "cpu/cpu_info.hpp"
#include "tessera/backend.hpp"
#include "tessera/version.hpp"

namespace tessera {

int cuda_device_count() {
  const detail::DeviceBackend* gpu = detail::gpu_backend();
  return gpu != nullptr ? gpu->device_count() : 0;
}

bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_unavailable_reason() {
  const detail::DeviceBackend* gpu = detail::gpu_backend();
  if (gpu == nullptr) return "this build of tessera has no CUDA backend (built without nvcc)";
  return gpu->device_count() > 0 ? std::string() : gpu->unavailable_reason();
}

void cuda_after_device_reset(int device) {
  const detail::ArgChecker check("cuda_after_device_reset");
  detail::check_device_usable(check, Device{DeviceType::kCUDA, device});
  detail::gpu_backend()->after_device_reset(device);
}

uint64_t cuda_stream_capture_id(void* stream) {
  const detail::DeviceBackend* gpu = detail::gpu_backend();
  return gpu != nullptr ? gpu->stream_capture_id(stream) : 0;
}

BuildInfo build_info() {
  BuildInfo info;
  info.version = version_string();
  if (const detail::DeviceBackend* gpu = detail::gpu_backend()) {
    info.cuda = true;
    info.cuda_archs = gpu->archs;
  }
  info.cpu_isa = detail::cpu_isa_name();
  info.cpu_isa_supported = detail::cpu_isa_name(
      detail::cpu_supports(detail::CpuIsa::kAvx512) ? detail::CpuIsa::kAvx512
      : detail::cpu_supports(detail::CpuIsa::kAvx2) ? detail::CpuIsa::kAvx2
                                                    : detail::CpuIsa::kGeneric);
  return info;
}

std::string describe_device(Device device) {
  if (device.type == DeviceType::kCPU) {
    return "cpu: " + std::to_string(num_threads()) + " threads, " + detail::cpu_isa_name();
  }
  const std::string name = "cuda:" + std::to_string(device.index);
  const detail::DeviceBackend* gpu = detail::gpu_backend();
  if (gpu == nullptr) return name + " (no CUDA backend in this build)";
  if (gpu->device_count() == 0)
    return name + " (no CUDA device: " + gpu->unavailable_reason() + ")";
  return gpu->describe(device.index);
}

}  // namespace tessera
