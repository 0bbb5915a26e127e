// Device queries and the build description of the public backend API.
#include <cstdint>
#include <string>

#include "cpu/cpu_info.hpp"
#include "tessera/backend.hpp"
#include "core/device_backend.hpp"
#include "tessera/version.hpp"

namespace tessera {

int cuda_device_count() {
  const detail::DeviceBackend* gpu = detail::gpu_backend();
  return gpu != nullptr ? gpu->device_count() : 0;
}

bool cuda_available() { return cuda_device_count() > 0; }

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
  if (const detail::DeviceBackend* gpu = detail::gpu_backend()) return gpu->describe(device.index);
  return "cuda:" + std::to_string(device.index) + " (no CUDA backend in this build)";
}

}  // namespace tessera
