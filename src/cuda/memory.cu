// Small synchronous memory helpers for the one-shot API calls, the CLI and the tests. Nothing on
// a plan/run hot path uses these.
#include <cuda_runtime.h>

#include <string>

#include "cuda/cuda_backend.hpp"

namespace tessera::detail {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kRuntime,
                std::string("tessera: CUDA error in ") + what + ": " + cudaGetErrorString(status));
  }
}

}  // namespace

void cuda_copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "copy to host");
  check_cuda(cudaStreamSynchronize(s), "copy to host (synchronize)");
}

void cuda_copy_to_device(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
  check_cuda(cudaStreamSynchronize(s), "copy to device (synchronize)");
}

void* cuda_alloc(size_t bytes) {
  void* ptr = nullptr;
  if (bytes == 0) return nullptr;
  check_cuda(cudaMalloc(&ptr, bytes), ("allocation of " + std::to_string(bytes) + " bytes").c_str());
  return ptr;
}

void cuda_free(void* ptr) {
  if (ptr) cudaFree(ptr);
}

void cuda_memset(void* ptr, int byte, size_t bytes, void* stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemsetAsync(ptr, byte, bytes, static_cast<cudaStream_t>(stream)), "memset");
}

void cuda_synchronize(void* stream) {
  check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "stream synchronize");
}

}  // namespace tessera::detail
