// Small host helpers shared by the CUDA backend: error checks that throw tessera::Error with the
// failing call or kernel named, a scoped current-device switch, and the on/off switches of the
// environment.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tessera/types.hpp"

namespace tessera::detail {

inline std::string cuda_error_text(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
}

// Throws Error(kRuntime) "<what> failed: <cuda error>" when status is not cudaSuccess
// (kOutOfMemory for cudaErrorMemoryAllocation). The runtime also keeps a failed call's error as
// the thread's last error, which the next launch check (check_kernel_launch, or the caller's
// own) would report as its own: it is cleared here (a sticky error stays, as it must).
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(status == cudaErrorMemoryAllocation ? Error::Kind::kOutOfMemory
                                                    : Error::Kind::kRuntime,
                std::string(what) + " failed: " + cuda_error_text(status));
  }
}

// Call right after a <<<...>>> launch: reports a launch failure with the kernel and its shape.
inline void check_kernel_launch(const char* kernel_name, dim3 grid, dim3 block, size_t smem_bytes) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  throw Error(Error::Kind::kRuntime,
              std::string("launch of ") + kernel_name + " failed (grid " + std::to_string(grid.x) +
                  "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", block " +
                  std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
                  std::to_string(block.z) + ", " + std::to_string(smem_bytes) +
                  " bytes of dynamic shared memory): " + cuda_error_text(status));
}

// Bumped by cuda_after_device_reset (tessera::cuda_after_device_reset): a cudaDeviceReset
// destroys the primary context and with it every function attribute set in it, so the
// shared-memory opt-ins below are made again (the llama.cpp CUDA backend hit the same).
std::atomic<uint64_t>& cuda_context_epoch();

// Opts `kernel` into `smem_bytes` of dynamic shared memory (needed above 48 KiB) once per device
// and context epoch: `configured_devices` is the kernel's own bit set of devices already done
// and `configured_epoch` the epoch they were done in (function-local statics of the caller), so
// the hot path costs one cudaGetDevice and two atomic loads. Two threads may both set the
// attribute after an epoch change; setting it twice is harmless.
template <class Kernel>
void enable_dynamic_smem_once(Kernel kernel, size_t smem_bytes, const char* kernel_name,
                              std::atomic<uint64_t>& configured_devices,
                              std::atomic<uint64_t>& configured_epoch) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t epoch = cuda_context_epoch().load(std::memory_order_acquire);
  if (configured_epoch.load(std::memory_order_acquire) != epoch) {
    configured_devices.store(0, std::memory_order_release);
    configured_epoch.store(epoch, std::memory_order_release);
  }
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (configured_devices.load(std::memory_order_acquire) & bit) != 0) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem_bytes)),
             kernel_name);
  configured_devices.fetch_or(bit, std::memory_order_release);
}

// Makes `device` current for the guard's lifetime (no-op when it already is).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CudaDeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace tessera::detail
