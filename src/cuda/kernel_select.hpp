// Plan-time kernel selection for the CUDA backend: which registry row (kernel_registry.hpp)
// serves a plan, and the planner knobs that follow from it. The one place where a kernel is
// chosen; run() launches the plan's row and only falls back for what a plan cannot know (the
// dtypes and alignment of the tensors, whether TMA can describe them), recording why.
#pragma once

#include <cstdint>
#include <string>

#include "core/tuning.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/kernel_registry.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

struct KernelChoice {
  int32_t kernel_id = -1;    // registry row
  uint32_t options = 0;      // launch options of that family (sm90: kSm90GatherKV)
  std::string reason;        // "kernel #12 sm90 prefill d128 128x128: ..."
};

// The row for `plan` (its op, heads, head_dim, options, page size, lengths and config), on the
// plan's device. Throws tessera::Error(kUnsupported) when no row can serve it there.
KernelChoice select_kernel(const Plan& plan);

// Decode: the bf16 mma / CUDA-core rows and the tuning they are resolved from.
int decode_head_dim_bucket(int head_dim);
// The tensor-core row of `variant` for items of `rows` packed rows; nullptr when none serves.
const KernelRow* decode_mma_row(int head_dim, int rows, int variant);
// The CUDA-core row for items of `rows` packed rows (row slots of 1, 2 or 4 rows).
const KernelRow* decode_core_row(int head_dim, int rows);
// The decode knobs in force for (device, head_dim, group, K/V dtype): core/tuning.hpp's order.
ResolvedDecodeTuning decode_tuning(const CudaDeviceInfo& info, int head_dim, int group,
                                   DType kv_dtype, bool heavy_batch);
// Resident CTAs per SM of the row serving items of `rows` rows with `variant` and `dtype` K/V.
int decode_ctas_per_sm(const CudaDeviceInfo& info, int head_dim, DType dtype, int rows,
                       int variant);
// The sm80 prefill row of the configured tile variant (TESSERA_PREFILL_VARIANT, else the
// head_dim's default) for soft-cap off / on.
const KernelRow* sm80_prefill_row(int head_dim, bool soft_cap);

}  // namespace tessera::detail
