// Device queries and the build description of the public backend API.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu/cpu_info.hpp"
#include "tessera/backend.hpp"
#include "tessera/version.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {

int cuda_device_count() {
#if defined(TESSERA_HAVE_CUDA)
  return detail::cuda_device_count_or_zero();
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

uint64_t cuda_stream_capture_id([[maybe_unused]] void* stream) {
#if defined(TESSERA_HAVE_CUDA)
  return detail::cuda_stream_capture_id(stream);
#else
  return 0;
#endif
}

BuildInfo build_info() {
  BuildInfo info;
  info.version = version_string();
#if defined(TESSERA_HAVE_CUDA)
  info.cuda = true;
#if defined(TESSERA_CUDA_ARCHS_BUILT)
  info.cuda_archs = TESSERA_CUDA_ARCHS_BUILT;  // CMake's list with ',' for ';'
  std::replace(info.cuda_archs.begin(), info.cuda_archs.end(), ',', ';');
#endif
#endif
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
#if defined(TESSERA_HAVE_CUDA)
  const detail::CudaDeviceInfo& info = detail::cuda_device_info(device.index);
  return "cuda:" + std::to_string(device.index) + " " + info.name + " sm_" +
         std::to_string(info.sm_major) + std::to_string(info.sm_minor) + ", " +
         std::to_string(info.num_sms) + " SMs";
#else
  return "cuda:" + std::to_string(device.index) + " (no CUDA backend in this build)";
#endif
}

}  // namespace tessera
