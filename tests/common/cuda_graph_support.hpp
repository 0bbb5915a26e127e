// RAII owners of a CUDA stream and of a captured graph with its executable, shared by the tests
// and programs that capture run_*() into CUDA graphs (test_cuda_graph, test_mixed_batch, the
// soak). Only meaningful in builds with the CUDA backend.
#pragma once

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

namespace tessera::test {

// A non-blocking stream (capture needs one: the legacy default stream cannot be captured). A
// failed creation leaves get() null, which the first call on it reports.
class CudaStream {
 public:
  CudaStream() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Filled by cudaStreamEndCapture / cudaGraphInstantiate; destroys whatever it holds.
struct CudaGraph {
  CudaGraph() = default;
  ~CudaGraph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

}  // namespace tessera::test
#endif
