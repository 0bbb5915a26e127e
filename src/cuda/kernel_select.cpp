// Plan-time kernel selection and the planner knobs of the CUDA backend (kernel_select.hpp).
#include "cuda/kernel_select.hpp"

#include <algorithm>
#include <string>

#include "core/settings.hpp"
#include "core/tuning.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/sm80/decode_api.hpp"
#include "cuda/sm80/prefill_api.hpp"
#include "cuda/sm90/prefill_api.hpp"

namespace tessera::detail {
namespace {

// ---- decode knobs ----
// A work item holds up to this many packed query rows (tokens x group heads): 64 covers a
// speculative-decode request of 8 tokens with a group of 8, or 16 tokens with a group of 4, in
// one item, so each request's K/V is read once.
constexpr int32_t kDecodeTileRows = 64;
// Split-KV pieces are at least this many keys (2 tiles of the d128 bf16 kernel). The planner
// sizes pieces by cost, so this floor only binds on small batches, where more, shorter pieces
// mean more CTAs reading at once (1 x 1k keys, GQA 32/8: 20 -> 15 us on the H200).
constexpr int32_t kDecodeMinKvChunk = 128;
// Deterministic plans cut every long range at multiples of this many keys (their piece count
// sizes a graph capacity's workspace).
constexpr int32_t kDecodeDeterministicKvChunk = 512;
// Row-slot height of the CUDA-core kernel that represents the device in the worker count.
constexpr int kPlanningRowsPerThread = 4;
// Decode variant (core/tuning.hpp) without a tuning entry: the 4-warp, 3-stage mma kernel.
// 0 is the CUDA-core kernel; 1..5 the mma (warps, stages) of decode_mma.cuh; 4 and 5 keep as
// many bytes in flight per SM as 1 in more, smaller CTAs, so one CTA's per-item latency is
// covered by others (the heavy-batch rule's choice).
constexpr int kDefaultDecodeVariant = 1;

// Query rows per row slot of the CUDA-core kernel for items of `rows` packed rows: 1 and 2
// exactly, otherwise 4 (more would not fit a 128-thread CTA's registers at 3 CTAs per SM).
int rows_per_thread_for(int rows) { return rows <= 1 ? 1 : (rows == 2 ? 2 : 4); }

std::string row_text(const KernelRow& row) {
  return "kernel #" + std::to_string(row.id) + " " + row.label();
}

// Where a decode knob came from, for `tessera plan --explain`.
std::string knob_source(TuningSource source, const char* env_name, const CudaDeviceInfo& info,
                        int head_dim, int group) {
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

// ---- prefill ----

// Empty when the sm90 rows can serve prefill of this shape on `info`; else why not.
std::string sm90_unsupported_reason(const CudaDeviceInfo& info, int head_dim, int group) {
  if (settings().prefill_force_sm80) {
    return "TESSERA_PREFILL_KERNEL=sm80 selects the portable kernels";
  }
  if (info.sm_major != 9) return "the device is not sm_90 (Hopper)";
  const int bucket = prefill_head_dim_bucket(head_dim);
  const KernelRow* base = find_kernel_row(KernelFamily::kSm90Prefill, bucket, 0);
  if (base == nullptr) return "head_dim " + std::to_string(head_dim) + " has no sm90 bucket";
  if (sm90::prefill_tile_rows(base->shape.block_m, group) == 0) {
    return "a GQA group of " + std::to_string(group) + " query heads is wider than the " +
           std::to_string(base->shape.block_m) + "-row sm90 tile";
  }
  return {};
}

// The sm90 row for a plan the sm90 kernels serve, and why that one.
const KernelRow* sm90_prefill_row(const Plan& plan, std::string* why) {
  const int bucket = prefill_head_dim_bucket(plan.head_dim);
  const AttentionOptions& options = plan.options;
  const bool soft_cap = options.logits_soft_cap != 0.0f;
  const bool paged = plan.op == AttentionOp::kPagedPrefill;
  // 176- and 192-key tiles need ragged K/V (pages do not tile them) and no mask beyond the
  // request's length (causal and window tiles would straddle the mask more).
  const bool wide_allowed = !paged && !options.causal && options.window_left < 0 &&
                            options.window_right < 0 && !soft_cap;
  const int64_t shortest =
      plan.kv_lens.empty() ? 0 : *std::min_element(plan.kv_lens.begin(), plan.kv_lens.end());
  const int32_t min_keys = bucket == 64 ? sm90::kWideTilesMinKeysD64 : sm90::kWideTilesMinKeysD128;
  const WideTilesSetting mode = settings().sm90_wide;
  const bool wide = wide_allowed && (mode == WideTilesSetting::kAlways ||
                                     (mode == WideTilesSetting::kLongKeys && shortest >= min_keys));
  if (wide) {
    const KernelRow* row = find_kernel_row(KernelFamily::kSm90Prefill, bucket, kKernelWideTiles);
    if (row != nullptr) {
      *why = mode == WideTilesSetting::kAlways
                 ? "TESSERA_SM90_WIDE=1"
                 : "ragged, unmasked, every request >= " + std::to_string(min_keys) + " keys";
      return row;
    }
  }
  const uint32_t cap = soft_cap ? kKernelSoftCap : 0u;
  // Pages shorter than the paged-V row's key tile: V copied one box per page (head_dim exactly
  // the row's: the 5-d box spans whole rows).
  if (paged) {
    const KernelRow* row = find_kernel_row(KernelFamily::kSm90Prefill, bucket, cap | kKernelPagedV);
    if (row != nullptr && plan.head_dim == row->shape.head_dim &&
        plan.page_size < row->shape.block_n) {
      *why = "pages of " + std::to_string(plan.page_size) + " keys: V one TMA box per page";
      return row;
    }
  }
  *why = wide_allowed && mode == WideTilesSetting::kLongKeys
             ? "a request shorter than " + std::to_string(min_keys) + " keys keeps the " +
                   "standard tile"
             : "warp-specialised TMA + wgmma, one CTA per SM";
  return find_kernel_row(KernelFamily::kSm90Prefill, bucket, cap);
}

KernelChoice select_prefill(const Plan& plan, const CudaDeviceInfo& info) {
  const bool soft_cap = plan.options.logits_soft_cap != 0.0f;
  std::string reason = sm90_unsupported_reason(info, plan.head_dim, plan.group_size());
  KernelChoice choice;
  if (reason.empty()) {
    std::string why;
    const KernelRow* row = sm90_prefill_row(plan, &why);
    if (row != nullptr && row->shape.smem_bytes <= info.max_smem_per_block_optin) {
      choice.kernel_id = row->id;
      choice.options = settings().sm90_gather_kv ? sm90::kSm90GatherKV : 0u;
      choice.reason = row_text(*row) + ": " + why +
                      (choice.options != 0 ? "; every K/V tile gathered (TESSERA_SM90_KV)" : "") +
                      "; at run time fp8 K/V or a q TMA cannot describe take the sm80 row";
      return choice;
    }
    reason = "the sm90 tile needs more shared memory than the device allows";
  }
  const KernelRow* row = sm80_prefill_row(plan.head_dim, soft_cap);
  if (row == nullptr) {
    throw Error(Error::Kind::kUnsupported,
                "head_dim " + std::to_string(plan.head_dim) +
                    " is not supported by the CUDA prefill kernels (a multiple of 8 up to 256)");
  }
  if (row->shape.smem_bytes > info.max_smem_per_block_optin) {
    throw Error(Error::Kind::kUnsupported,
                "head_dim " + std::to_string(plan.head_dim) + ": " + row->label() + " needs " +
                    std::to_string(row->shape.smem_bytes) +
                    " bytes of shared memory per block, device " + std::to_string(info.device) +
                    " (" + info.name + ") allows " + std::to_string(info.max_smem_per_block_optin));
  }
  choice.kernel_id = row->id;
  choice.reason = row_text(*row) + ": the sm90 kernels do not serve this because " + reason;
  return choice;
}

// ---- decode ----

KernelChoice select_decode(const Plan& plan, const CudaDeviceInfo& info) {
  const int group = std::max(1, plan.group_size());
  const int tokens_per_item = std::max(1, plan.config.q_tile_rows / group);
  const int q_per_request = plan.q_lens.empty() ? 1 : plan.q_lens[0];
  const int item_rows = std::min(q_per_request, tokens_per_item) * group;
  const ResolvedDecodeTuning tuning =
      decode_tuning(info, plan.head_dim, group, DType::kBFloat16, plan.config.heavy_batch);
  const int variant = plan.config.decode_variant >= 0 ? plan.config.decode_variant
                                                      : tuning.value.variant;
  std::string why;
  const KernelRow* row = decode_mma_row(plan.head_dim, item_rows, variant);
  if (row != nullptr && row->shape.smem_bytes > info.max_smem_per_block_optin) {
    why = row->label() + " needs more shared memory than the device allows";
    row = nullptr;
  } else if (row == nullptr) {
    why = variant == 0           ? "variant 0 is the CUDA-core kernel"
          : item_rows > 128      ? std::to_string(item_rows) + " packed rows per item (> 128)"
                                 : "no tensor-core kernel for head_dim " +
                                 std::to_string(plan.head_dim);
  }
  KernelChoice choice;
  if (row == nullptr) {
    row = decode_core_row(plan.head_dim, item_rows);
    if (row == nullptr) {
      throw Error(Error::Kind::kUnsupported,
                  "head_dim " + std::to_string(plan.head_dim) +
                      " is not supported by the CUDA decode kernels (a multiple of 8 up to 256)");
    }
    why = "CUDA-core kernel (variant " + std::to_string(variant) + "; " + why + ")";
  } else {
    why = "tensor-core mma variant " + std::to_string(variant) + " (" +
          row->instance(DType::kBFloat16, DType::kBFloat16)->name + ")";
  }
  choice.kernel_id = row->id;
  choice.reason = row_text(*row) + ": " + why + ", variant from " +
                  knob_source(tuning.variant_source, "TESSERA_DECODE_VARIANT", info,
                              plan.head_dim, group);
  if (plan.config.heavy_batch) {
    choice.reason += ", for a heavy batch (" + std::to_string(plan.batch_size) + " requests x " +
                     std::to_string(plan.num_kv_heads) + " kv heads >= " +
                     std::to_string(kHeavyBatchTilesPerSm) + " tiles per SM: variant " +
                     std::to_string(kHeavyBatchDecodeVariant) + ")";
  }
  choice.reason += "; min split-KV chunk " + std::to_string(plan.config.min_kv_chunk) +
                   " keys, from " +
                   knob_source(tuning.min_kv_chunk_source, "TESSERA_DECODE_MIN_CHUNK", info,
                               plan.head_dim, group) +
                   "; at run time fp8 K/V and K/V views not 16-byte aligned take the CUDA-core "
                   "row; fp16 K/V take the fp16 entry's variant when it keeps the planned CTAs "
                   "per SM";
  return choice;
}

}  // namespace

int decode_head_dim_bucket(int head_dim) { return prefill_head_dim_bucket(head_dim); }

const KernelRow* decode_mma_row(int head_dim, int rows, int variant) {
  if (variant <= 0) return nullptr;
  const int bucket = decode_head_dim_bucket(head_dim);
  // The half-height rows first (items of <= 8 rows), then the full ones (<= 16), both of the
  // tuned variant; wider items take the smallest row-tile row that holds them (not tuned).
  for (const uint32_t height : {0u, static_cast<uint32_t>(kKernelFullRows)}) {
    const KernelRow* row = find_kernel_row(KernelFamily::kSm80DecodeMma, bucket, height, variant);
    if (row != nullptr && rows <= row->shape.rows) return row;
  }
  const KernelRow* smallest_fit = nullptr;
  for (const KernelRow& row : kernel_registry()) {
    if (row.family == KernelFamily::kSm80DecodeMma && row.shape.head_dim == bucket &&
        row.shape.variant == 0 && rows <= row.shape.rows &&
        (smallest_fit == nullptr || row.shape.rows < smallest_fit->shape.rows)) {
      smallest_fit = &row;
    }
  }
  return smallest_fit;
}

const KernelRow* decode_core_row(int head_dim, int rows) {
  return find_kernel_row(KernelFamily::kSm80Decode, decode_head_dim_bucket(head_dim), 0, -1,
                         rows_per_thread_for(rows));
}

ResolvedDecodeTuning decode_tuning(const CudaDeviceInfo& info, int head_dim, int group,
                                   DType kv_dtype, bool heavy_batch) {
  const DecodeTuningQuery query{info.name, tuning_head_dim_bucket(head_dim), group, kv_dtype};
  return apply_batch_rule(
      resolve_decode_tuning(query, settings().decode_variant, settings().decode_min_chunk,
                            DecodeTuning{kDefaultDecodeVariant, kDecodeMinKvChunk}),
      heavy_batch);
}

int decode_ctas_per_sm(const CudaDeviceInfo& info, int head_dim, DType dtype, int rows,
                       int variant) {
  int ctas = 0;
  if (const KernelRow* row = decode_mma_row(head_dim, rows, variant)) {
    if (const KernelInstance* instance = row->instance(dtype, dtype)) {
      ctas = instance->max_ctas_per_sm(info.device);
    }
  }
  if (ctas <= 0) {
    const KernelRow* row = decode_core_row(head_dim, kPlanningRowsPerThread);
    const KernelInstance* instance = row != nullptr ? row->instance(dtype, dtype) : nullptr;
    ctas = instance != nullptr ? instance->max_ctas_per_sm(info.device) : 0;
  }
  return ctas;
}

const KernelRow* sm80_prefill_row(int head_dim, bool soft_cap) {
  const int bucket = prefill_head_dim_bucket(head_dim);
  const int requested = settings().prefill_variant;
  const int variant = sm80::served_prefill_variant(
      bucket, requested >= 0 ? requested : sm80::default_prefill_variant(bucket));
  return find_kernel_row(KernelFamily::kSm80Prefill, bucket, soft_cap ? kKernelSoftCap : 0u,
                         variant);
}

CudaDecodeSelection cuda_decode_selection(int num_qo_heads, int num_kv_heads, int head_dim,
                                          DType kv_dtype, const CudaDeviceInfo& info,
                                          int64_t batch) {
  CudaDecodeSelection selection;
  const int group = num_kv_heads > 0 ? std::max(1, num_qo_heads / num_kv_heads) : 1;
  const bool heavy_batch = is_heavy_decode_batch(batch, num_kv_heads, head_dim, info.num_sms);
  selection.tuning = decode_tuning(info, head_dim, group, kv_dtype, heavy_batch);
  const KernelRow* row = decode_mma_row(head_dim, group, selection.tuning.value.variant);
  const KernelInstance* instance = row != nullptr ? row->instance(kv_dtype, kv_dtype) : nullptr;
  if (instance != nullptr && row->shape.smem_bytes <= info.max_smem_per_block_optin) {
    selection.mma_kernel = instance->name;
  } else if (instance != nullptr) {
    selection.cuda_core_reason = std::string(instance->name) + " needs more shared memory (" +
                                 std::to_string(row->shape.smem_bytes) +
                                 " bytes) than the device allows";
  } else if (selection.tuning.value.variant == 0) {
    selection.cuda_core_reason = "variant 0 is the CUDA-core kernel";
  } else if (group > 128) {
    selection.cuda_core_reason = "a GQA group of " + std::to_string(group) +
                                 " packs more than 128 rows per token";
  } else if (kv_dtype != DType::kFloat16 && kv_dtype != DType::kBFloat16) {
    selection.cuda_core_reason = std::string(dtype_name(kv_dtype)) + " K/V";
  } else {
    selection.cuda_core_reason = "no tensor-core decode kernel for head_dim " +
                                 std::to_string(head_dim) + " (bucket " +
                                 std::to_string(decode_head_dim_bucket(head_dim)) + ")";
  }
  return selection;
}

KernelChoice select_kernel(const Plan& plan) {
  const CudaDeviceInfo& info = cuda_device_info(plan.device.index);
  return plan.op == AttentionOp::kDecode ? select_decode(plan, info) : select_prefill(plan, info);
}

PlanConfig cuda_decode_plan_config(int num_qo_heads, int num_kv_heads, int head_dim,
                                   const CudaDeviceInfo& info, int64_t batch) {
  PlanConfig config;
  const int group = num_kv_heads > 0 ? std::max(1, num_qo_heads / num_kv_heads) : 1;
  config.q_tile_rows = std::max(kDecodeTileRows, group);
  // plan() does not know the K/V dtype: the bf16 entry sizes the workers (decode.cu's
  // run_decode_variant keeps run() on that count).
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

PlanConfig cuda_plan_config(AttentionOp op, int num_qo_heads, int num_kv_heads, int head_dim,
                            DType kv_dtype_hint, int device, int64_t batch) {
  const CudaDeviceInfo& info = cuda_device_info(device);
  if (op == AttentionOp::kDecode) {
    return cuda_decode_plan_config(num_qo_heads, num_kv_heads, head_dim, info, batch);
  }
  const int group = num_qo_heads / std::max(num_kv_heads, 1);
  const int bucket = prefill_head_dim_bucket(head_dim);
  if (bucket == 0) {
    throw Error(Error::Kind::kUnsupported,
                "head_dim " + std::to_string(head_dim) +
                    " is not supported by the CUDA prefill kernels (a multiple of 8 up to 256)");
  }
  PlanConfig config;
  config.split_kv = true;
  if (sm90_unsupported_reason(info, head_dim, group).empty()) {
    // Hopper kernels: one persistent CTA per SM, tiles of whole tokens x the GQA group, sized
    // by the standard row (the wide and paged-V rows take the same work items).
    const KernelRow* row = find_kernel_row(KernelFamily::kSm90Prefill, bucket, 0);
    config.q_tile_rows = sm90::prefill_tile_rows(row->shape.block_m, group);
    config.num_workers = info.num_sms;
    config.min_kv_chunk = std::max(config.min_kv_chunk, 4 * row->shape.block_n);
    return config;
  }
  // Occupancy of the row that will run (the soft-cap row has the same shape); an fp8 hint is
  // costed as fp16, run() rejects fp8 K/V in prefill.
  const DType hint = kv_dtype_hint == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  const KernelRow* row = sm80_prefill_row(head_dim, false);
  const KernelInstance* instance = row != nullptr ? row->instance(hint, hint) : nullptr;
  const int ctas_per_sm = instance != nullptr ? instance->max_ctas_per_sm(device) : 0;
  // A CTA tile holds BLOCK_M packed rows; a query-head group larger than that still gets whole
  // tokens per work item (the planner needs q_tile_rows >= group) and the kernel walks such an
  // item in several CTA tiles.
  config.q_tile_rows = std::max(row->shape.block_m, group);
  // One persistent CTA per resident slot: the grid fills the GPU exactly once.
  config.num_workers = info.num_sms * std::max(ctas_per_sm, 1);
  // Split pieces shorter than a few key tiles would spend more on partial stores and the merge
  // than they gain in balance.
  config.min_kv_chunk = std::max(config.min_kv_chunk, 4 * row->shape.block_n);
  return config;
}

}  // namespace tessera::detail
