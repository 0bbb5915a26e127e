// One launcher for every persistent attention kernel: the shared-memory opt-in (once per
// device), the launch of one CTA per worker, the launch check naming the kernel, and the
// occupancy query the planner sizes its workers with. A kernel family writes only its name
// function and its registry rows (kernel_registry.hpp).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_registry.hpp"

namespace tessera::detail {

// Kernel: the __global__ function, taking its parameters by value (Params).
// Traits: kNumThreads and kSmemBytes of the kernel. Name: a function returning its name.
template <class Params, void (*Kernel)(Params), class Traits, const char* (*Name)()>
struct KernelEntry {
  // Opts the kernel into its dynamic shared memory (> 48 KiB) on the current device, once.
  static void enable_smem() {
    static std::atomic<uint64_t> configured_devices{0};
    static std::atomic<uint64_t> configured_epoch{0};
    enable_dynamic_smem_once(Kernel, Traits::kSmemBytes, Name(), configured_devices,
                             configured_epoch);
  }

  // `workers` CTAs on `stream` (nothing for none); throws naming the kernel and launch shape.
  // pdl: a programmatic dependent launch (the kernels wait for the previous kernel with
  // griddepcontrol.wait before touching memory; ptx/grid_dependency.cuh).
  static void launch(const Params& params, int32_t workers, void* stream, bool pdl) {
    if (workers <= 0) return;
    enable_smem();
    const dim3 grid(static_cast<unsigned>(workers));
    const dim3 block(Traits::kNumThreads);
    if (!pdl) {
      Kernel<<<grid, block, Traits::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(params);
    } else {
      cudaLaunchAttribute attribute{};
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = grid;
      config.blockDim = block;
      config.dynamicSmemBytes = Traits::kSmemBytes;
      config.stream = static_cast<cudaStream_t>(stream);
      config.attrs = &attribute;
      config.numAttrs = 1;
      check_cuda(cudaLaunchKernelEx(&config, Kernel, params), Name());
    }
    check_kernel_launch(Name(), grid, block, Traits::kSmemBytes);
  }

  // Params that carry their grid and problem (PrefillArgs, DecodeArgs): the registry's launch.
  static void launch_workers(const Params& params, void* stream) {
    launch(params, params.num_workers, stream, params.problem.enable_pdl);
  }

  // The registry instance of this kernel for (q, K/V) dtypes, without its launch pointer (the
  // family sets the one its rows use).
  static KernelInstance instance(DType q_dtype, DType kv_dtype) {
    KernelInstance entry;
    entry.q_dtype = q_dtype;
    entry.kv_dtype = kv_dtype;
    entry.name = Name();
    entry.max_ctas_per_sm = &max_ctas_per_sm;
    return entry;
  }

  // Resident CTAs per SM on `device`; 0 when the kernel cannot run there.
  static int max_ctas_per_sm(int device) {
    try {
      CudaDeviceGuard guard(device);
      enable_smem();
      int ctas = 0;
      check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, Kernel, Traits::kNumThreads,
                                                               Traits::kSmemBytes),
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      return ctas;
    } catch (const Error&) {
      cudaGetLastError();  // clear the error the query left behind: the caller sees 0
      return 0;
    }
  }
};

}  // namespace tessera::detail
