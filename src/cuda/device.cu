// CUDA device queries, and the plan-time kernel choice recorded in a plan.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_select.hpp"

namespace tessera::detail {

int cuda_device_count_or_zero() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: clear the error, report none
    return 0;
  }
  return count;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) {
    return count > 0 ? std::string() : "cudaGetDeviceCount found no CUDA device";
  }
  (void)cudaGetLastError();
  std::string reason = "cudaGetDeviceCount failed: " + cuda_error_text(status);
  if (status == cudaErrorInsufficientDriver) {
    // The static CUDA runtime loads libcuda.so.1 on its first call: this is what it answers when
    // that library is missing (a host without the NVIDIA driver) or older than the runtime.
    reason += "; the NVIDIA driver (libcuda.so.1) is missing or older than the CUDA runtime " +
              std::to_string(CUDART_VERSION / 1000) + "." +
              std::to_string(CUDART_VERSION % 1000 / 10) + " this library was built with";
  } else if (status == cudaErrorNoDevice) {
    reason += "; check CUDA_VISIBLE_DEVICES";
  }
  return reason;
}

std::atomic<uint64_t>& cuda_context_epoch() {
  static std::atomic<uint64_t> epoch{0};
  return epoch;
}

int cuda_current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

uint64_t cuda_stream_capture_id(void* stream) {
  static const int count = cuda_device_count_or_zero();
  if (count == 0) return 0;  // no device, no capture (and no driver to ask)
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t error =
      cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id);
  if (error != cudaSuccess) {
    // E.g. the legacy stream while another stream of its device captures globally: report it
    // without leaving the error for the next launch check (ours or the caller's) to find.
    cudaGetLastError();
    check_cuda(error, "cudaStreamGetCaptureInfo");
  }
  // The id is defined only while the capture is active (not once a prohibited call has
  // invalidated it).
  return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0;
}

const CudaDeviceInfo& cuda_device_info(int device) {
  // Filled on first use per device; entries are never moved or freed, so references stay valid.
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaDeviceInfo>> cache;
  static const int count = cuda_device_count_or_zero();  // fixed for the process lifetime
  std::lock_guard<std::mutex> lock(mutex);
  if (count == 0) {
    throw Error(Error::Kind::kUnsupported,
                "no CUDA device is available (" + cuda_unavailable_reason() + ")");
  }
  if (device < 0 || device >= count) {
    throw Error(Error::Kind::kInvalidArgument, "CUDA device " + std::to_string(device) +
                                                   " does not exist (" + std::to_string(count) +
                                                   " visible)");
  }
  if (cache.size() < static_cast<size_t>(count)) cache.resize(static_cast<size_t>(count));
  if (!cache[device]) {
    cudaDeviceProp properties{};
    check_cuda(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
    auto info = std::make_unique<CudaDeviceInfo>();
    info->device = device;
    info->sm_major = properties.major;
    info->sm_minor = properties.minor;
    info->num_sms = properties.multiProcessorCount;
    info->max_smem_per_block_optin = properties.sharedMemPerBlockOptin;
    info->smem_per_sm = properties.sharedMemPerMultiprocessor;
    info->regs_per_sm = properties.regsPerMultiprocessor;
    info->name = properties.name;
    cache[device] = std::move(info);
  }
  return *cache[device];
}

void cuda_choose_kernel(Plan& plan) {
  const KernelChoice choice = select_kernel(plan);
  plan.kernel_id = choice.kernel_id;
  plan.kernel_options = choice.options;
  plan.kernel = choice.reason;
}

}  // namespace tessera::detail
