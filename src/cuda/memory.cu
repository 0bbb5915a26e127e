// Small synchronous memory helpers for the one-shot API calls, the CLI and the tests. Nothing on
// a plan/run hot path uses these.
#include <cuda_runtime.h>

#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"

namespace tessera::detail {

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
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaSuccess) return ptr;
  (void)cudaGetLastError();  // not left for the next launch check to report as its own
  int device = -1;
  size_t free_bytes = 0, total_bytes = 0;
  std::string where;
  if (cudaGetDevice(&device) == cudaSuccess) where = " on cuda:" + std::to_string(device);
  if (status == cudaErrorMemoryAllocation &&
      cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    where +=
        " (" + std::to_string(free_bytes) + " of " + std::to_string(total_bytes) + " bytes free)";
  }
  (void)cudaGetLastError();
  throw Error(
      status == cudaErrorMemoryAllocation ? Error::Kind::kOutOfMemory : Error::Kind::kRuntime,
      "cudaMalloc of " + std::to_string(bytes) + " bytes" + where +
          " failed: " + cuda_error_text(status));
}

void cuda_free(void* ptr) {
  // Called from destructors (ScratchBuffer, ScanBuffer): never throws. A failure (the context
  // was reset under the buffer) is not left pending for the next launch check.
  if (ptr && cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_memset(void* ptr, int byte, size_t bytes, void* stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemsetAsync(ptr, byte, bytes, static_cast<cudaStream_t>(stream)), "memset");
}

void cuda_synchronize(void* stream) {
  check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "stream synchronize");
}

}  // namespace tessera::detail
