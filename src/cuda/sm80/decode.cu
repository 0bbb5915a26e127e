// Run side of the sm80 batch decode: the plan's registry row (chosen at plan time,
// cuda/kernel_select.cpp) with the fallbacks only the tensors can decide (fp8 K/V, unaligned
// rows, the fp16 tuning entry), and the launch over an uploaded plan. The kernels are in
// decode_kernel.cuh (one kernel template over a compute policy: decode_cuda_core.cuh,
// decode_mma.cuh), their rows added per head_dim by decode_d*.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numbers>
#include <string>

#include "core/tuning.hpp"
#include "core/workspace_layout.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_select.hpp"
#include "cuda/sm80/decode_api.hpp"
#include "cuda/sm80/decode_dequant.cuh"
#include "cuda/sm80/decode_traits.cuh"
#include "cuda/sm80/prefill_api.hpp"  // launch_merge_partials

namespace tessera::detail {
namespace {

const char* name_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "fp8 e4m3";
    case DType::kFloat8E5M2: return "fp8 e5m2";
    case DType::kFloat32: return "fp32";
    default: return "an integer dtype";
  }
}

size_t kv_element_bytes(DType dtype) {
  return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2 ? 1 : 2;
}

// Largest power of two <= 16 dividing every K/V row address: both base pointers and every
// stride that a row address uses, in bytes. 16 is the norm (a contiguous cache with head_dim a
// multiple of 8 elements); narrower only for exotic views.
int32_t kv_copy_granularity(const KVSource& kv) {
  const size_t bytes = kv_element_bytes(kv.dtype);
  uint64_t bits = reinterpret_cast<uintptr_t>(kv.k) | reinterpret_cast<uintptr_t>(kv.v);
  bits |= static_cast<uint64_t>(kv.k_stride_page) * bytes |
          static_cast<uint64_t>(kv.v_stride_page) * bytes;
  bits |= static_cast<uint64_t>(kv.k_stride_head) * bytes |
          static_cast<uint64_t>(kv.v_stride_head) * bytes;
  if (kv.page_size > 1) {
    bits |= static_cast<uint64_t>(kv.k_stride_token) * bytes |
            static_cast<uint64_t>(kv.v_stride_token) * bytes;
  }
  int32_t granularity = 16;
  while (granularity > 1 && (bits & static_cast<uint64_t>(granularity - 1)) != 0) granularity /= 2;
  return granularity;
}

// The variant run() launches: the K/V dtype's own (its tuning entry; the plan resolved the
// bf16 one), unless that one keeps a different number of resident CTAs per SM than the variant
// the plan sized its workers for; then the plan's, so the grid is what the plan counted.
int run_decode_variant(const Plan& plan, const CudaDeviceInfo& info,
                       const AttentionProblem& problem, int group, int item_rows) {
  const DType dtype = problem.kv.dtype;
  const int variant =
      decode_tuning(info, problem.head_dim, group, dtype, plan.config.heavy_batch).value.variant;
  const int planned = plan.config.decode_variant;
  if (planned < 0 || planned == variant || problem.q_dtype != dtype) return variant;
  const int ctas = decode_ctas_per_sm(info, problem.head_dim, dtype, item_rows, variant);
  return ctas == decode_ctas_per_sm(info, problem.head_dim, dtype, item_rows, planned) ? variant
                                                                                         : planned;
}

thread_local const char* last_decode_kernel = "";
thread_local std::string last_decode_fallback;

[[noreturn]] void unsupported(const std::string& message) {
  throw Error(Error::Kind::kUnsupported, "run_decode: " + message);
}

}  // namespace

const char* cuda_last_decode_kernel() { return last_decode_kernel; }
const char* cuda_last_decode_fallback() { return last_decode_fallback.c_str(); }

void cuda_decode_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                           void* stream, bool header_uploaded) {
  last_decode_kernel = "";
  // Nothing to attend. A fixed-capacity plan launches anyway: a graph captured with it must
  // serve later plans of that capacity (an empty worker range is a no-op).
  if (plan.worker_indptr.size() < 2 || (plan.work.empty() && !plan.capacity.fixed())) return;
  if (!problem.kv.paged) unsupported("the CUDA decode kernel reads a paged KV cache");
  if (problem.qo_indptr != nullptr) {
    unsupported("the CUDA decode kernel takes q_per_request rows per request, not qo_indptr");
  }
  const int group = problem.num_qo_heads / problem.num_kv_heads;
  const int tokens_per_item = std::max(1, plan.config.q_tile_rows / group);
  const int item_rows = std::min(problem.q_per_request, tokens_per_item) * group;
  const CudaDeviceInfo& info = cuda_device_info(plan.device.index);
  const int32_t copy_granularity = kv_copy_granularity(problem.kv);
  const KernelRow* row = &kernel_row(plan.kernel_id >= 0 ? plan.kernel_id
                                                         : select_kernel(plan).kernel_id);
  std::string& fallback = last_decode_fallback;
  fallback.clear();
  if (row->family == KernelFamily::kSm80DecodeMma) {
    const int variant = run_decode_variant(plan, info, problem, group, item_rows);
    if (copy_granularity != 16) {
      fallback = "K/V rows are " + std::to_string(copy_granularity) + "-byte aligned";
    } else if (problem.q_dtype != problem.kv.dtype) {
      fallback = std::string(name_of(problem.kv.dtype)) + " K/V with " + name_of(problem.q_dtype) +
                 " q";
    } else if (variant != row->shape.variant) {
      const KernelRow* tuned = decode_mma_row(problem.head_dim, item_rows, variant);
      if (tuned == nullptr || tuned->shape.smem_bytes > info.max_smem_per_block_optin) {
        fallback = "the " + std::string(name_of(problem.kv.dtype)) + " tuning entry's variant " +
                   std::to_string(variant);
      } else {
        row = tuned;
      }
    }
    if (!fallback.empty()) row = decode_core_row(problem.head_dim, item_rows);
  }
  const KernelInstance* kernel =
      row != nullptr ? row->instance(problem.q_dtype, problem.kv.dtype) : nullptr;
  if (kernel == nullptr) {
    unsupported(std::string("no CUDA decode kernel for head_dim ") +
                std::to_string(problem.head_dim) + ", q " + name_of(problem.q_dtype) + ", K/V " +
                name_of(problem.kv.dtype) +
                " (supported: head_dim a multiple of 8 up to 256; q fp16/bf16; K/V as q or fp8)");
  }
  // Only the tensor-core kernels merge split pieces themselves (finish_split_piece).
  const bool kernel_merges = row->family == KernelFamily::kSm80DecodeMma;
  if (info.sm_major < 8) {  // cp.async and the bf16 conversions are sm_80+
    unsupported("CUDA decode needs compute capability 8.0 or newer; device " + info.name +
                " is sm_" + std::to_string(info.sm_major) + std::to_string(info.sm_minor));
  }
  if (row->shape.smem_bytes > info.max_smem_per_block_optin) {
    unsupported(std::string(kernel->name) + " needs " + std::to_string(row->shape.smem_bytes) +
                " bytes of shared memory per block, device " + info.name + " allows " +
                std::to_string(info.max_smem_per_block_optin));
  }

  const WorkspaceLayout layout = WorkspaceLayout::of(plan);
  auto* base = static_cast<uint8_t*>(workspace.data);
  sm80::DecodeArgs args;
  args.problem = problem;
  args.work = reinterpret_cast<const WorkItem*>(base + layout.work);
  args.worker_indptr = reinterpret_cast<const int32_t*>(base + layout.worker_indptr);
  args.num_workers = static_cast<int32_t>(plan.worker_indptr.size() - 1);
  args.partial_o = reinterpret_cast<float*>(base + layout.partial_o);
  args.partial_lse = reinterpret_cast<float*>(base + layout.partial_lse);
  args.page_size = sm80::FastDivmod::make(static_cast<uint32_t>(problem.kv.page_size));

  // e4m3 is widened to fp16 at 2^-8 of its value (decode_dequant.cuh); the 2^8 goes here.
  const float dequant = problem.kv.dtype == DType::kFloat8E4M3
                            ? sm80::KVElement<DType::kFloat8E4M3>::kDequantFactor
                            : 1.0f;
  // k_scale / v_scale are applied whatever the K/V dtype, exactly as the CPU backends do (the
  // public API documents them for fp8 caches; with fp16/bf16 K/V they are left at 1).
  const float k_scale = problem.k_scale * dequant;
  const float v_scale = problem.v_scale * dequant;
  constexpr float kLog2e = std::numbers::log2e_v<float>;
  if (problem.soft_cap > 0.0f) {
    args.soft_cap = true;
    args.q_scale = problem.sm_scale * k_scale / problem.soft_cap;
    args.soft_cap_log2 = problem.soft_cap * kLog2e;
  } else {
    args.soft_cap = false;
    args.q_scale = problem.sm_scale * k_scale * kLog2e;
  }
  args.output_scale = v_scale;
  args.copy_granularity = copy_granularity;

  // Split-KV pieces wrote float partials that must be combined into o / lse. Uploaded by
  // upload_plan, the merge slots come from the capacity and the count from the header.
  const int64_t merge_slots =
      header_uploaded ? layout.merge_slots : static_cast<int64_t>(plan.merges.size());
  const bool fused = merge_slots > 0 && kernel_merges;
  if (fused) {
    // The last CTA to finish a tile's piece merges it. upload_plan zeroed the counters; run()'s
    // own upload (not header_uploaded) zeroes them here, in stream order.
    args.merges = reinterpret_cast<const MergeItem*>(base + layout.merges);
    args.merge_counters = reinterpret_cast<int32_t*>(base + layout.merge_counters);
    if (!header_uploaded) {
      check_cuda(cudaMemsetAsync(args.merge_counters, 0,
                                 static_cast<size_t>(merge_slots) * sizeof(int32_t),
                                 static_cast<cudaStream_t>(stream)),
                 "cudaMemsetAsync (decode merge counters)");
    }
  }
  kernel->decode(args, stream);
  last_decode_kernel = kernel->name;
  if (merge_slots > 0 && !fused) {
    sm80::MergeArgs merge;
    merge.problem = problem;
    merge.merges = reinterpret_cast<const MergeItem*>(base + layout.merges);
    merge.header =
        header_uploaded ? reinterpret_cast<const PlanHeader*>(base + layout.header) : nullptr;
    merge.max_merges = static_cast<int32_t>(merge_slots);
    merge.partial_o = args.partial_o;
    merge.partial_lse = args.partial_lse;
    sm80::launch_merge_partials(merge, info.num_sms, stream);
  }
}

}  // namespace tessera::detail
