#include "cli/info.hpp"

#include <iostream>
#include <string>

#include "tessera/backend.hpp"

namespace tessera::cli {

int run_info() {
  const BuildInfo build = build_info();
  std::cout << "tessera " << build.version << "\n";
  if (build.cuda) {
    std::cout << "build: CUDA backend compiled in, archs " << build.cuda_archs << "\n";
  } else {
    std::cout << "build: no CUDA backend (CPU only; configure with -DTESSERA_ENABLE_CUDA=ON and "
                 "nvcc to build it)\n";
  }
  std::cout << "cpu kernels: " << build.cpu_isa;
  if (build.cpu_isa != build.cpu_isa_supported) {
    std::cout << " (TESSERA_CPU_ISA caps it; this CPU has " << build.cpu_isa_supported << ")";
  }
  std::cout << "\n"
            << describe_device(Device{DeviceType::kCPU, 0}) << "\n"
            << "cuda devices: " << cuda_device_count() << "\n";
  for (int i = 0; i < cuda_device_count(); ++i) {
    std::cout << "  " << describe_device(Device{DeviceType::kCUDA, i}) << "\n";
  }
  return 0;
}

}  // namespace tessera::cli
