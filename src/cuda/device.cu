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
                            DType kv_dtype_hint, int device, int64_t batch) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  const DType hint = kv_dtype_hint == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  if (op == AttentionOp::kDecode &&
      !sm90::serves_decode(info.sm_major, head_dim, num_qo_heads, num_kv_heads, hint, hint)) {
    return cuda_decode_plan_config(num_qo_heads, num_kv_heads, head_dim, info, batch);
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
namespace {

// Where a decode knob came from, for `tessera plan --explain`.
std::string decode_knob_source(TuningSource source, const char* env_name,
                               const CudaDeviceInfo& info, int head_dim, int group) {
  switch (source) {
    case TuningSource::kOverride: return "in-process override (tessera tune)";
    case TuningSource::kEnvironment: return std::string(env_name);
    case TuningSource::kFile: return "tuning file " + process_tuning_file().path;
    case TuningSource::kDefault: break;
  }
  const TuningFile& file = process_tuning_file();
  switch (file.status) {
    case TuningFileStatus::kNoPath: return "built-in default (no tuning file location)";
    case TuningFileStatus::kMissing: return "built-in default (no tuning file " + file.path + ")";
    case TuningFileStatus::kMalformed:
      return "built-in default (tuning file ignored: " + file.error + ")";
    case TuningFileStatus::kLoaded: break;
  }
  return "built-in default (" + file.path + " has no entry for \"" + info.name + "\" head_dim " +
         std::to_string(tuning_head_dim_bucket(head_dim)) + " group " + std::to_string(group) +
         " kv bf16)";
}

std::string decode_kernel_note(int num_qo_heads, int num_kv_heads, int head_dim,
                               const CudaDeviceInfo& info, int64_t batch) {
  const int group = std::max(1, num_qo_heads / std::max(num_kv_heads, 1));
  const CudaDecodeSelection selection =
      cuda_decode_selection(num_qo_heads, num_kv_heads, head_dim, DType::kBFloat16, info, batch);
  const ResolvedDecodeTuning& tuning = selection.tuning;
  std::string note = "sm80 decode kernels on " + info.name + ", bf16 K/V: ";
  if (selection.mma_kernel != nullptr) {
    note += "tensor-core mma variant " + std::to_string(tuning.value.variant) + " (" +
            selection.mma_kernel + ")";
  } else {
    note += "CUDA-core kernel (variant " + std::to_string(tuning.value.variant) + "; " +
            selection.cuda_core_reason + ")";
  }
  note += ", variant from " + decode_knob_source(tuning.variant_source, "TESSERA_DECODE_VARIANT",
                                                 info, head_dim, group);
  if (tuning.heavy_batch) {
    note += ", for a heavy batch (" + std::to_string(batch) + " requests x " +
            std::to_string(num_kv_heads) + " kv heads >= " +
            std::to_string(kHeavyBatchTilesPerSm) + " tiles per SM: variant " +
            std::to_string(kHeavyBatchDecodeVariant) + ")";
  }
  note += "; min split-KV chunk " + std::to_string(tuning.value.min_kv_chunk) + " keys, from " +
          decode_knob_source(tuning.min_kv_chunk_source, "TESSERA_DECODE_MIN_CHUNK", info,
                             head_dim, group);
  note += ". Decided at run time: fp8 K/V, items of more than 16 packed rows (group x query "
          "tokens per request) and K/V views not 16-byte aligned run the CUDA-core kernel; fp16 "
          "K/V take the fp16 entry's variant when it keeps the planned CTAs per SM, else the "
          "plan's (the plan's chunk is the bf16 one)";
  return note;
}

}  // namespace

std::string cuda_plan_kernel_note(AttentionOp op, int num_qo_heads, int num_kv_heads,
                                  int head_dim, int device, int64_t batch) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  if (op == AttentionOp::kDecode) {
    if (sm90::serves_decode(info.sm_major, head_dim, num_qo_heads, num_kv_heads,
                            DType::kBFloat16, DType::kBFloat16)) {
      return "sm90 decode (the sm90 prefill kernels: GQA-packed rows on wgmma, K/V pages by "
             "TMA, one CTA per SM); fp8 K/V caches and unaligned views run the sm80 decode "
             "kernels";
    }
    return decode_kernel_note(num_qo_heads, num_kv_heads, head_dim, info, batch);
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
