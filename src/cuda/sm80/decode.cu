// Host side of the sm80 batch decode: planner knobs for decode on a device, kernel selection
// (head_dim bucket x q dtype x K/V dtype x query rows per row slot) and the launch over an
// uploaded plan. The kernels are in decode_kernel.cuh, instantiated per head_dim in
// decode_d64.cu / decode_d128.cu / decode_d256.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numbers>
#include <optional>
#include <string>

#include "core/tuning.hpp"
#include "core/workspace_layout.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/sm80/decode_api.hpp"
#include "cuda/sm80/decode_dequant.cuh"
#include "cuda/sm80/decode_traits.cuh"
#include "cuda/sm80/prefill_api.hpp"  // launch_merge_partials

namespace tessera::detail {
namespace {

// A work item holds up to this many packed query rows (tokens x group heads): 64 covers a
// speculative-decode request of 8 tokens with a group of 8, or 16 tokens with a group of 4, in
// one item, so each request's K/V is read once.
constexpr int32_t kDecodeTileRows = 64;
// Split-KV pieces are at least this many keys (2 tiles of the d128 bf16 kernel). The planner
// sizes pieces by cost (fair share of the batch), so this floor only binds on small batches,
// where more, shorter pieces mean more CTAs reading at once: 1 x 1k keys, GQA 32/8, went from
// 20 to 15 us on the H200 with 128 instead of 512, every larger shape unchanged (PERF.md).
constexpr int32_t kDecodeMinKvChunk = 128;
// Deterministic plans cut every long range at multiples of this many keys (their piece count
// sizes a graph capacity's workspace, so it stays at the old 512).
constexpr int32_t kDecodeDeterministicKvChunk = 512;
// Kernel variant that represents the device in the planner's worker count.
constexpr int kPlanningRowsPerThread = 4;

// Kernel family (TESSERA_DECODE_VARIANT, a tuning file entry or an override; core/tuning.hpp):
//   0: CUDA-core kernel (decode_kernel.cuh) for everything;
//   1: tensor-core kernel (decode_mma.cuh), 4 warps x 16 keys per tile, 3 stages (default);
//   2: tensor-core kernel, 4 warps, 4 stages (d128 bf16: 1 CTA/SM, 96 KiB in flight);
//   3: tensor-core kernel, 2 warps x 16 keys per tile, 6 stages;
//   4: tensor-core kernel, 2 warps, 3 stages (d128 bf16: 48 KiB, 4 CTAs/SM);
//   5: tensor-core kernel, 2 warps, 4 stages (d128 bf16: 64 KiB, 3 CTAs/SM).
// 4 and 5 keep as many bytes in flight per SM as 1 in more, smaller CTAs, so one CTA's
// per-item latency (work-list and page-table loads, the end-of-item merge) is covered by others.
// The tensor-core kernel covers q = K/V dtype (fp16/bf16), 16-byte-aligned K/V rows and items of
// <= 16 packed rows (d256: <= 8); anything else runs the CUDA-core kernel whatever the variant.
constexpr int kDefaultDecodeVariant = 1;

// TESSERA_DECODE_VARIANT, read once (for timing the variants side by side); nullopt when unset
// or not a variant.
std::optional<int> decode_variant_from_env() {
  static const std::optional<int> variant = []() -> std::optional<int> {
    const char* text = std::getenv("TESSERA_DECODE_VARIANT");
    if (text == nullptr || *text == '\0') return std::nullopt;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || !is_valid_decode_variant(value)) return std::nullopt;
    return static_cast<int>(value);
  }();
  return variant;
}

// TESSERA_DECODE_MIN_CHUNK (a multiple of 64 in [64, 4096]), read once, to time other piece
// sizes side by side; nullopt when unset or invalid.
std::optional<int32_t> decode_min_kv_chunk_from_env() {
  static const std::optional<int32_t> chunk = []() -> std::optional<int32_t> {
    const char* text = std::getenv("TESSERA_DECODE_MIN_CHUNK");
    if (text == nullptr || *text == '\0') return std::nullopt;
    const long value = std::strtol(text, nullptr, 10);
    if (!is_valid_decode_min_kv_chunk(value)) return std::nullopt;
    return static_cast<int32_t>(value);
  }();
  return chunk;
}

// The knobs in force for decode of (device, head_dim, GQA group, K/V dtype): the in-process
// override, else the environment, else the tuning file's entry, else the defaults above, the
// default variant following the batch rule (core/tuning.hpp) for a heavy batch. A map lookup
// after the file's one load (no file I/O, no allocation on the plan / run path).
ResolvedDecodeTuning decode_tuning(const CudaDeviceInfo& info, int head_dim, int group,
                                   DType kv_dtype, bool heavy_batch) {
  const DecodeTuningQuery query{info.name, tuning_head_dim_bucket(head_dim), group, kv_dtype};
  return apply_batch_rule(
      resolve_decode_tuning(query, decode_variant_from_env(), decode_min_kv_chunk_from_env(),
                            DecodeTuning{kDefaultDecodeVariant, kDecodeMinKvChunk}),
      heavy_batch);
}

// Split-KV pieces merged inside the decode kernel (default), or by the separate merge kernel
// (TESSERA_DECODE_FUSED_MERGE=0, kept to time the two side by side). Read once.
bool fused_decode_merge() {
  static const bool fused = on_unless_zero("TESSERA_DECODE_FUSED_MERGE");
  return fused;
}

// Cross-item prefetch in the tensor-core kernel (default on; TESSERA_DECODE_PREFETCH=0 turns it
// off, kept to time the two side by side). Read once.
bool decode_prefetch_next() {
  static const bool enabled = on_unless_zero("TESSERA_DECODE_PREFETCH");
  return enabled;
}

int decode_head_dim_bucket(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0) return 0;
  if (head_dim <= 64) return 64;
  if (head_dim <= 128) return 128;
  if (head_dim <= 256) return 256;
  return 0;
}

const sm80::DecodeKernel* find_decode_kernel(int head_dim, DType q_dtype, DType kv_dtype,
                                             int rows_per_thread) {
  switch (decode_head_dim_bucket(head_dim)) {
    case 64: return sm80::decode_kernel_d64(q_dtype, kv_dtype, rows_per_thread);
    case 128: return sm80::decode_kernel_d128(q_dtype, kv_dtype, rows_per_thread);
    case 256: return sm80::decode_kernel_d256(q_dtype, kv_dtype, rows_per_thread);
    default: return nullptr;
  }
}

// The tensor-core kernel of `variant` for items of `rows` packed rows, or nullptr (variant 0,
// fp8 K/V, more rows than it holds, no instantiation).
const sm80::DecodeKernel* find_decode_mma_kernel(int head_dim, DType q_dtype, DType kv_dtype,
                                                 int rows, int variant) {
  if (rows > 16 || q_dtype != kv_dtype || variant == 0) return nullptr;
  const bool full_rows = rows > 8;
  switch (decode_head_dim_bucket(head_dim)) {
    case 64: return sm80::decode_mma_kernel_d64(q_dtype, kv_dtype, full_rows, variant);
    case 128: return sm80::decode_mma_kernel_d128(q_dtype, kv_dtype, full_rows, variant);
    case 256: return sm80::decode_mma_kernel_d256(q_dtype, kv_dtype, full_rows, variant);
    default: return nullptr;
  }
}

// Query rows per row slot for items of `rows` packed rows: 1 and 2 exactly, otherwise 4 (more
// would not fit the registers of a 128-thread CTA at 3 CTAs per SM; large items take several
// row passes).
int rows_per_thread_for(int rows) {
  return rows <= 1 ? 1 : (rows == 2 ? 2 : 4);
}

// Resident CTAs per SM of the kernel serving items of `rows` packed rows with `variant` and
// `dtype` K/V (= q): the tensor-core kernel, or the CUDA-core kernel where there is none (as
// planned, with kPlanningRowsPerThread); 0 when neither can run.
int decode_ctas_per_sm(const CudaDeviceInfo& info, int head_dim, DType dtype, int rows,
                       int variant) {
  const sm80::DecodeKernel* kernel = find_decode_mma_kernel(head_dim, dtype, dtype, rows, variant);
  int ctas = kernel != nullptr ? kernel->max_ctas_per_sm(info.device) : 0;
  if (ctas <= 0) {
    kernel = find_decode_kernel(head_dim, dtype, dtype, kPlanningRowsPerThread);
    ctas = kernel != nullptr ? kernel->max_ctas_per_sm(info.device) : 0;
  }
  return ctas;
}

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

[[noreturn]] void unsupported(const std::string& message) {
  throw Error(Error::Kind::kUnsupported, "run_decode: " + message);
}

}  // namespace

const char* cuda_last_decode_kernel() { return last_decode_kernel; }

PlanConfig cuda_decode_plan_config(int num_qo_heads, int num_kv_heads, int head_dim,
                                   const CudaDeviceInfo& info, int64_t batch) {
  PlanConfig config;
  const int group = num_kv_heads > 0 ? std::max(1, num_qo_heads / num_kv_heads) : 1;
  config.q_tile_rows = std::max(kDecodeTileRows, group);
  // plan() does not know the K/V dtype: the bf16 entry sizes the workers (run_decode_variant).
  const ResolvedDecodeTuning tuning = decode_tuning(
      info, head_dim, group, DType::kBFloat16,
      is_heavy_decode_batch(batch, num_kv_heads, head_dim, info.num_sms));
  config.heavy_batch = tuning.heavy_batch;
  config.decode_variant = tuning.value.variant;
  const int ctas_per_sm =
      decode_ctas_per_sm(info, head_dim, DType::kBFloat16, group, tuning.value.variant);
  config.num_workers = std::max(1, info.num_sms) * std::max(1, ctas_per_sm);
  config.split_kv = true;
  config.min_kv_chunk = tuning.value.min_kv_chunk;
  config.deterministic = false;
  config.deterministic_kv_chunk = kDecodeDeterministicKvChunk;
  return config;
}

CudaDecodeSelection cuda_decode_selection(int num_qo_heads, int num_kv_heads, int head_dim,
                                          DType kv_dtype, const CudaDeviceInfo& info,
                                          int64_t batch) {
  CudaDecodeSelection selection;
  const int group = num_kv_heads > 0 ? std::max(1, num_qo_heads / num_kv_heads) : 1;
  const bool heavy_batch = is_heavy_decode_batch(batch, num_kv_heads, head_dim, info.num_sms);
  selection.tuning = decode_tuning(info, head_dim, group, kv_dtype, heavy_batch);
  const sm80::DecodeKernel* kernel =
      find_decode_mma_kernel(head_dim, kv_dtype, kv_dtype, group, selection.tuning.value.variant);
  if (kernel != nullptr && kernel->smem_bytes <= info.max_smem_per_block_optin) {
    selection.mma_kernel = kernel->name;
  } else if (kernel != nullptr) {
    selection.cuda_core_reason = std::string(kernel->name) + " needs more shared memory (" +
                                 std::to_string(kernel->smem_bytes) +
                                 " bytes) than the device allows";
  } else if (selection.tuning.value.variant == 0) {
    selection.cuda_core_reason = "variant 0 is the CUDA-core kernel";
  } else if (group > 16) {
    selection.cuda_core_reason = "a GQA group of " + std::to_string(group) +
                                 " packs more than 16 rows per token";
  } else if (kv_dtype != DType::kFloat16 && kv_dtype != DType::kBFloat16) {
    selection.cuda_core_reason = std::string(name_of(kv_dtype)) + " K/V";
  } else {
    selection.cuda_core_reason = "no tensor-core decode kernel for head_dim " +
                                 std::to_string(head_dim) + " (bucket " +
                                 std::to_string(decode_head_dim_bucket(head_dim)) + ")";
  }
  return selection;
}

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
  const sm80::DecodeKernel* kernel = nullptr;
  if (copy_granularity == 16) {
    kernel = find_decode_mma_kernel(problem.head_dim, problem.q_dtype, problem.kv.dtype, item_rows,
                                    run_decode_variant(plan, info, problem, group, item_rows));
    if (kernel != nullptr && kernel->smem_bytes > info.max_smem_per_block_optin) kernel = nullptr;
  }
  // Only the tensor-core kernels merge split pieces themselves (finish_split_piece).
  const bool kernel_merges = kernel != nullptr;
  if (kernel == nullptr) {
    kernel = find_decode_kernel(problem.head_dim, problem.q_dtype, problem.kv.dtype,
                                rows_per_thread_for(item_rows));
  }
  if (kernel == nullptr) {
    unsupported(std::string("no CUDA decode kernel for head_dim ") +
                std::to_string(problem.head_dim) + ", q " + name_of(problem.q_dtype) + ", K/V " +
                name_of(problem.kv.dtype) +
                " (supported: head_dim a multiple of 8 up to 256; q fp16/bf16; K/V as q or fp8)");
  }
  if (info.sm_major < 8) {  // cp.async and the bf16 conversions are sm_80+
    unsupported("CUDA decode needs compute capability 8.0 or newer; device " + info.name +
                " is sm_" + std::to_string(info.sm_major) + std::to_string(info.sm_minor));
  }
  if (kernel->smem_bytes > info.max_smem_per_block_optin) {
    unsupported(std::string(kernel->name) + " needs " + std::to_string(kernel->smem_bytes) +
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
  args.prefetch_next = decode_prefetch_next();

  // Split-KV pieces wrote float partials that must be combined into o / lse. Uploaded by
  // upload_plan, the merge slots come from the capacity and the count from the header.
  const int64_t merge_slots =
      header_uploaded ? layout.merge_slots : static_cast<int64_t>(plan.merges.size());
  const bool fused = merge_slots > 0 && kernel_merges && fused_decode_merge();
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
  kernel->launch(args, stream);
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
