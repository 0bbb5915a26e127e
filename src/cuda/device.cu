// CUDA device queries and the planner knobs of the CUDA backend.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/sm80/decode_api.hpp"
#include "cuda/sm80/prefill_api.hpp"
#include "cuda/sm80/prefill_traits.cuh"
#include "cuda/sm90/prefill_api.hpp"

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

int cuda_current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

const CudaDeviceInfo& cuda_device_info(int device) {
  // Filled on first use per device; entries are never moved or freed, so references stay valid.
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaDeviceInfo>> cache;
  static const int count = cuda_device_count_or_zero();  // fixed for the process lifetime
  std::lock_guard<std::mutex> lock(mutex);
  if (count == 0) {
    throw Error(Error::Kind::kRuntime, "no CUDA device (or no CUDA driver) is available");
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

PlanConfig cuda_plan_config(AttentionOp op, int num_qo_heads, int num_kv_heads, int head_dim,
                            DType kv_dtype_hint, int device) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  const DType hint = kv_dtype_hint == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  if (op == AttentionOp::kDecode &&
      !sm90::serves_decode(info.sm_major, head_dim, num_qo_heads, num_kv_heads, hint, hint)) {
    return cuda_decode_plan_config(num_qo_heads, num_kv_heads, head_dim, info);
  }
  const int bucket = sm80::prefill_head_dim_bucket(head_dim);
  if (bucket == 0) {
    throw Error(Error::Kind::kUnsupported,
                "head_dim " + std::to_string(head_dim) +
                    " is not supported by the CUDA prefill kernels (a multiple of 8 up to 256)");
  }
  if (sm90::prefill_unsupported_reason(info.sm_major, head_dim, num_qo_heads, num_kv_heads, hint,
                                       hint)
          .empty()) {
    // Hopper kernels: one persistent CTA per SM, tiles of whole tokens x the GQA group.
    const sm90::PrefillKernel* kernel = sm90::find_prefill_kernel(head_dim, hint, false);
    PlanConfig config;
    config.q_tile_rows =
        sm90::prefill_tile_rows(kernel->block_m, num_qo_heads / std::max(num_kv_heads, 1));
    config.num_workers = info.num_sms;
    config.split_kv = true;
    config.min_kv_chunk = std::max(config.min_kv_chunk, 4 * kernel->block_n);
    return config;
  }
  // Occupancy of the kernel that will run (the soft-cap variant has the same shape); an fp8
  // hint is costed as fp16, run() rejects fp8 K/V for now.
  const sm80::PrefillKernel* kernel = sm80::find_prefill_kernel(head_dim, hint, false);
  const int ctas_per_sm = kernel != nullptr ? kernel->max_ctas_per_sm(device) : 0;

  PlanConfig config;
  // A CTA tile holds BLOCK_M packed rows; a query-head group larger than that still gets whole
  // tokens per work item (the planner needs q_tile_rows >= group) and the kernel walks such an
  // item in several CTA tiles.
  // BLOCK_M of the kernel variant that run() will launch (TESSERA_PREFILL_VARIANT).
  config.q_tile_rows =
      std::max(kernel != nullptr ? kernel->block_m : sm80::prefill_block_m(bucket),
               num_qo_heads / std::max(num_kv_heads, 1));
  // One persistent CTA per resident slot: the grid fills the GPU exactly once.
  config.num_workers = info.num_sms * std::max(ctas_per_sm, 1);
  config.split_kv = true;
  // Split pieces shorter than a few key tiles would spend more on partial stores and the merge
  // than they gain in balance.
  config.min_kv_chunk =
      std::max(config.min_kv_chunk, 4 * (kernel != nullptr ? kernel->block_n : 64));
  return config;
}

}  // namespace tessera::detail

namespace tessera::detail {

std::string cuda_plan_kernel_note(AttentionOp op, int num_qo_heads, int num_kv_heads,
                                  int head_dim, int device) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  if (op == AttentionOp::kDecode) {
    if (sm90::serves_decode(info.sm_major, head_dim, num_qo_heads, num_kv_heads,
                            DType::kBFloat16, DType::kBFloat16)) {
      return "sm90 decode (the sm90 prefill kernels: GQA-packed rows on wgmma, K/V pages by "
             "TMA, one CTA per SM); fp8 K/V caches and unaligned views run the sm80 decode "
             "kernels";
    }
    return "CUDA decode kernels (sm80 family: mma.sync over the GQA group, CUDA cores for fp8 "
           "K/V)";
  }
  const std::string reason = sm90::prefill_unsupported_reason(
      info.sm_major, head_dim, num_qo_heads, num_kv_heads, DType::kBFloat16, DType::kBFloat16);
  if (reason.empty()) {
    return "sm90 prefill (warp-specialised TMA + wgmma, one CTA per SM); the sm80 kernels take "
           "over at run time for fp8 K/V or tensors whose strides TMA cannot describe";
  }
  return "sm80 prefill (mma.sync): the sm90 kernels do not serve this because " + reason;
}

}  // namespace tessera::detail
