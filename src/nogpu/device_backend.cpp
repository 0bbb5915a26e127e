// Builds without a GPU backend (TESSERA_ENABLE_CUDA=OFF, or no nvcc): the core sees no table.
#include "core/device_backend.hpp"

namespace tessera::detail {

const DeviceBackend* gpu_backend() { return nullptr; }

}  // namespace tessera::detail
