// Backend selection and device queries.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/types.hpp"

namespace tessera {

// Which implementation serves calls on CPU tensors. kFast is the tiled multithreaded path (the
// default); kReference is the double-accumulating oracle used by tests.
enum class CpuImpl : int32_t { kFast = 0, kReference = 1 };
void set_cpu_impl(CpuImpl impl);
CpuImpl cpu_impl();

// Number of threads the CPU backend uses (default: hardware concurrency, or TESSERA_NUM_THREADS).
void set_num_threads(int threads);
int num_threads();

// Checked mode for device-resident index arrays. Index arrays on the GPU (qo/kv/page indptr,
// page_indices, last_page_len) are normally trusted by run_*: they are on the device and reading
// them would synchronise. With checking on, run_* first copies them to the host (synchronising
// the stream), applies every check the CPU path applies (monotone indptr, lengths equal to the
// plan's, page ids in [0, num_pages), last_page_len in [1, page_size]) and throws naming the
// first bad entry before any kernel is launched. It also scans the q, k and v elements the call
// reads (q rows that see a key; each request's keys its rows see, every head and dim) for NaN and
// +-inf, on the CPU for host tensors and with one small kernel for device tensors, and throws
// naming the tensor and its first such element in (request, token / key, head, dim) order, e.g.
// "'k_cache': non-finite value nan at page 3, token 5 (request 0, key 21), head 1, dim 17";
// unread memory (padding, other pages, masked keys) is not checked. Without checked mode
// non-finite inputs follow the semantics of tessera/attention.hpp. Off by default;
// TESSERA_CHECK=1 in the environment turns it on at start-up. Not for CUDA-graph capture (it
// synchronises).
void set_index_checking(bool on);
bool index_checking();

// True when this build has the CUDA backend and a CUDA device is visible.
bool cuda_available();
int cuda_device_count();
// Why no CUDA device is usable, "" when one is: "this build of tessera has no CUDA backend",
// or the CUDA runtime's answer, e.g. on a host without the NVIDIA driver "cudaGetDeviceCount
// failed: cudaErrorInsufficientDriver (...); the NVIDIA driver (libcuda.so.1) is missing or
// older than the CUDA runtime 13.0 this library was built with". Never throws. A call on a
// CUDA device then fails with Error(kUnsupported) quoting it; the CPU backend is unaffected.
std::string cuda_unavailable_reason();

// Call after cudaDeviceReset(device) (or anything else that destroys the device's primary
// context) before using the library on that device again. A reset frees every allocation of
// the device and forgets every function attribute set in its context; what the library kept
// for it is then stale: which plan each workspace address holds (the next allocations reuse
// the addresses, so a run_*() could skip its upload and read a workspace that never got it),
// its pinned staging buffers and events, and the kernels' shared-memory opt-ins. This forgets
// all of it (every workspace's upload, on every device: each plan's next run_*() uploads
// again). Plans are host objects and stay valid; tensors and workspaces must be allocated
// anew (and upload_plan called again where CUDA graphs replay them). Throws Error(kUnsupported)
// without a usable CUDA device and Error(kInvalidArgument) for an index out of range.
void cuda_after_device_reset(int device);

// The id of the CUDA graph capture in progress on `stream` (a cudaStream_t; the CUDA runtime's
// capture sequence id, unique per capture in the process), or 0 when no capture is active on it.
// 0 in a CPU-only build or without a CUDA device. Integrations use it to share what one capture
// makes.
uint64_t cuda_stream_capture_id(void* stream);

// What this build of the library holds (`tessera info` prints it).
struct BuildInfo {
  std::string version;           // version_string()
  bool cuda = false;             // the CUDA backends are compiled in
  std::string cuda_archs;        // the CUDA architectures compiled (CMake's TESSERA_CUDA_ARCHS,
                                 // e.g. "80;90a"); "" without the CUDA backends
  std::string cpu_isa;           // the ISA the fast CPU kernels use here: generic, avx2, avx512
                                 // (the best this CPU has, capped by TESSERA_CPU_ISA)
  std::string cpu_isa_supported;  // the best ISA this CPU has
};
BuildInfo build_info();

// A short description of a device ("cpu: 2 threads, avx512", "cuda:0 NVIDIA H200 sm_90, 132 SMs").
std::string describe_device(Device device);

}  // namespace tessera
