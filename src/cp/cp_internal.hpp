// Internal helpers of the context-parallel code (src/cp): the host-to-device index copy and the
// NCCL entry points resolved with dlopen / dlsym.
#pragma once

#include <cstddef>

#include "tessera/types.hpp"

namespace tessera::detail {

// memcpy on the CPU, cudaMemcpyAsync on `stream` for a CUDA device (from pageable memory:
// `src` may be freed as soon as this returns).
void cp_copy_host_to_device(void* dst, const void* src, size_t bytes, Device device,
                            void* stream);

// The few NCCL functions context parallelism uses, with NCCL's C types spelled out here so that
// no NCCL header is needed: ncclComm_t and cudaStream_t are opaque pointers, ncclResult_t and
// ncclDataType_t are int enums (ncclSuccess = 0; ncclUint8 = 1 is the only type used: every
// transfer is counted in bytes).
struct NcclApi {
  using Result = int;
  static constexpr int kUint8 = 1;
  int version = 0;  // ncclGetVersion: major * 10000 + minor * 100 + patch (>= 2.9)
  Result (*get_version)(int*) = nullptr;
  const char* (*get_error_string)(Result) = nullptr;
  Result (*group_start)() = nullptr;
  Result (*group_end)() = nullptr;
  Result (*send)(const void*, size_t, int, int, void*, void*) = nullptr;
  Result (*recv)(void*, size_t, int, int, void*, void*) = nullptr;
  Result (*all_gather)(const void*, void*, size_t, int, void*, void*) = nullptr;
  Result (*comm_count)(void*, int*) = nullptr;
  Result (*comm_user_rank)(void*, int*) = nullptr;
};

// Loads NCCL once (TESSERA_NCCL_LIBRARY or libnccl.so.2), sets NCCL_NVLS_ENABLE=0 if unset, and
// returns the resolved API; throws Error(kUnsupported) naming the library or the missing symbol
// (retried on the next call).
const NcclApi& nccl_api();
// Throws Error(kRuntime) "<what>: <ncclGetErrorString>" unless result is ncclSuccess.
void nccl_check(const NcclApi& api, int result, const char* what);

}  // namespace tessera::detail
