// FlashAttention-3 style forward for prefill on Hopper (sm_90a): warp-specialised, TMA + wgmma,
// persistent CTAs walking the planner's work lists (one CTA per SM; the planner orders each
// worker's items in L2 sections of K/V, longest first within each).
//
//   warpgroup 0       producer: TMA (or cp.async gather) of Q and the K/V ring   (24-32 regs)
//   warpgroups 1..C   consumers: wgmma, online softmax, epilogue              (160-240 regs)
//
// See prefill_producer.cuh and prefill_consumer.cuh for the two roles, prefill_traits.cuh for the
// shapes, prefill_tile.cuh for the geometry both roles derive from a work item. This file holds
// the kernel entry and its host side: tensor maps, launch, and the per-bucket kernel table.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/problem.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_entry.cuh"
#include "cuda/kernel_registry.hpp"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/sm90/prefill_api.hpp"
#include "cuda/sm90/prefill_consumer.cuh"
#include "cuda/sm90/prefill_producer.cuh"
#include "cuda/sm90/prefill_tile.cuh"
#include "cuda/sm90/prefill_traits.cuh"
#include "cuda/sm90/tensor_map.hpp"

namespace tessera::detail::sm90 {

template <class Traits, DType kDType, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    prefill_kernel(const __grid_constant__ PrefillParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char prefill_smem[];
  // The swizzle atoms need 1024-byte aligned tiles; the window itself is only 16-byte aligned.
  const uint32_t raw = ptx::shared_address(prefill_smem);
  const uint32_t aligned = (raw + 1023u) & ~1023u;
  const PrefillSmem<Traits> smem{aligned, prefill_smem + (aligned - raw)};
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(smem.q_full(), 1);
    ptx::mbarrier_init(smem.q_empty(), Traits::kConsumerWarps);
#pragma unroll
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      ptx::mbarrier_init(smem.k_full(stage), Traits::kProducerThreads);
      ptx::mbarrier_init(smem.k_empty(stage), Traits::kConsumerWarps);
      ptx::mbarrier_init(smem.v_full(stage), Traits::kProducerThreads);
      ptx::mbarrier_init(smem.v_empty(stage), Traits::kConsumerWarps);
    }

    ptx::fence_mbarrier_init();
  }
  // Programmatic launch: the previous kernel's writes (q, K/V, o's earlier readers) are complete
  // from here on; the next kernel may be scheduled (it waits for this one to end).
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  __syncthreads();
  const int warpgroup = static_cast<int>(threadIdx.x) / Traits::kWarpgroupThreads;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    PrefillProducer<Traits>(params, smem).run();
  } else {
    ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
    PrefillConsumer<Traits, kDType, kSoftCap>(params, smem, warpgroup - 1).run();
  }
#else
  __trap();  // sm_90a only; the launcher never selects this kernel elsewhere
#endif
}

// ---- host side ----

template <class Traits, DType kDType, bool kSoftCap>
const char* prefill_kernel_name() {
  static const std::string name = "tessera::sm90::prefill<d" + std::to_string(Traits::kHeadDim) +
                                  (kDType == DType::kBFloat16 ? ", bf16" : ", fp16") +
                                  (Traits::kVPageBoxes ? ", paged V" : "") +
                                  (kSoftCap ? ", soft_cap>" : ">");
  return name.c_str();
}

// The K/V maps of one tensor (k or v): ragged rows or pages; heads_first as in PrefillParams.
template <class Traits>
bool encode_kv_map(CUtensorMap* map, const AttentionProblem& problem, bool values, int32_t box_rows,
                   bool heads_first, std::string* why) {
  const KVSource& kv = problem.kv;
  const void* base = values ? kv.v : kv.k;
  const int64_t stride_token = values ? kv.v_stride_token : kv.k_stride_token;
  const int64_t stride_head = values ? kv.v_stride_head : kv.k_stride_head;
  const int64_t extent = std::max<int64_t>(values ? kv.v_extent : kv.k_extent, 1);
  const TensorMapDim column{problem.head_dim, 1, 64};
  const TensorMapDim heads{problem.num_kv_heads, stride_head, 1};
  if (!kv.paged) {
    const TensorMapDim rows{extent, stride_token, static_cast<uint32_t>(Traits::kBlockN)};
    const TensorMapDim dims[3] = {column, heads_first ? heads : rows, heads_first ? rows : heads};
    return encode_tensor_map(map, kv.dtype, base, dims, 3, why);
  }
  const TensorMapDim rows{kv.page_size, stride_token, static_cast<uint32_t>(box_rows)};
  const TensorMapDim pages{extent, values ? kv.v_stride_page : kv.k_stride_page, 1};
  const TensorMapDim dims[4] = {column, heads_first ? heads : rows, heads_first ? rows : heads,
                                pages};
  return encode_tensor_map(map, kv.dtype, base, dims, 4, why);
}

// log2(x) when x is a power of two, else -1 (the kernels then divide; see divide_by).
inline int32_t shift_of(int32_t x) {
  return x > 0 && std::has_single_bit(static_cast<uint32_t>(x))
             ? std::countr_zero(static_cast<uint32_t>(x))
             : -1;
}

// Builds the kernel parameters (options: the plan's kSm90* bits); false (with the reason) when
// TMA cannot read q - the caller then runs the sm80 kernel. K/V and o fall back to gathers and plain stores on their own.
template <class Traits>
bool make_prefill_params(const PrefillArgs& args, uint32_t options, PrefillParams* params,
                         std::string* why) {
  const AttentionProblem& problem = args.problem;
  const int32_t group = problem.group_size();
  const int32_t tile_rows = prefill_tile_rows(Traits::kBlockM, group);
  if (tile_rows == 0) {
    *why = "a GQA group of " + std::to_string(group) + " is wider than the " +
           std::to_string(Traits::kBlockM) + "-row tile";
    return false;
  }
  std::memset(static_cast<void*>(params), 0, sizeof(PrefillParams));
  params->args = args;
  params->tokens_per_tile = tile_rows / group;
  params->group = group;
  params->group_shift = shift_of(group);
  const auto q_like = [&](int64_t extent, int64_t stride_token, int64_t stride_head,
                          TensorMapDim(&dims)[3]) {
    dims[0] = {problem.head_dim, 1, 64};
    dims[1] = {problem.num_qo_heads, stride_head, static_cast<uint32_t>(group)};
    dims[2] = {std::max<int64_t>(extent, 1), stride_token,
               static_cast<uint32_t>(params->tokens_per_tile)};
  };
  TensorMapDim dims[3];
  q_like(problem.q_extent, problem.q_stride_token, problem.q_stride_head, dims);
  std::string reason;
  if (!encode_tensor_map(&params->q_map, problem.q_dtype, problem.q, dims, 3, &reason)) {
    *why = "q: " + reason;
    return false;
  }
  q_like(problem.o_extent, problem.o_stride_token, problem.o_stride_head, dims);
  params->o_tma = encode_tensor_map(&params->o_map, problem.q_dtype, problem.o, dims, 3, &reason);

  const KVSource& kv = problem.kv;
  const auto heads_first = [&](int64_t stride_head, int64_t stride_token) {
    return problem.num_kv_heads == 1 || stride_head <= stride_token;
  };
  const bool k_heads_first = heads_first(kv.k_stride_head, kv.k_stride_token);
  int32_t box_rows = Traits::kBlockN;
  bool kv_tma = k_heads_first == heads_first(kv.v_stride_head, kv.v_stride_token);
  if (kv.paged) {
    const int32_t page = kv.page_size;
    const bool aligned =
        page % kMinTmaPageKeys == 0 &&
        (Traits::kBlockN % page == 0 || page % Traits::kBlockN == 0);
    kv_tma = kv_tma && aligned;
    box_rows = std::min(page, Traits::kBlockN);
  }
  // The plan's kSm90GatherKV: every key tile through the cp.async gather (tests the fallback).
  if ((options & kSm90GatherKV) != 0) kv_tma = false;
  kv_tma =
      kv_tma &&
      encode_kv_map<Traits>(&params->k_map, problem, false, box_rows, k_heads_first, &reason) &&
      encode_kv_map<Traits>(&params->v_map, problem, true, box_rows, k_heads_first, &reason);
  params->kv_tma = kv_tma ? 1 : 0;
  params->kv_heads_first = k_heads_first ? 1 : 0;
  params->kv_box_rows = kv.paged ? box_rows : 0;
  params->page_shift = kv.paged ? shift_of(kv.page_size) : -1;
  // Page-by-page V (Traits::kVPageBoxes): one 5-d box per page, {64 columns, the page's rows,
  // every column block (64 elements apart), head, page} - its strides are not increasing, which
  // the driver accepts. Without that map (or with pages of a whole key tile) V keeps the usual
  // layout, which is the same formula with BLOCK_N rows per page.
  params->v_page_rows = Traits::kBlockN;
  if constexpr (Traits::kVPageBoxes) {
    if (kv_tma && kv.paged && box_rows < Traits::kBlockN &&
        problem.head_dim == Traits::kHeadDim) {
      const TensorMapDim v_dims[5] = {
          {64, 1, 64},
          {kv.page_size, kv.v_stride_token, static_cast<uint32_t>(box_rows)},
          {Traits::kColumnBlocks, 64, static_cast<uint32_t>(Traits::kColumnBlocks)},
          {problem.num_kv_heads, kv.v_stride_head, 1},
          {std::max<int64_t>(kv.v_extent, 1), kv.v_stride_page, 1}};
      CUtensorMap v_map;
      if (encode_tensor_map(&v_map, kv.dtype, kv.v, v_dims, 5, &reason,
                            /*any_stride_order=*/true)) {
        params->v_map = v_map;
        params->v_page_rows = box_rows;
      }
    }
  }
  params->v_page_rows_shift = std::countr_zero(static_cast<uint32_t>(params->v_page_rows));
  return true;
}

template <class Traits, DType kDType, bool kSoftCap>
using PrefillEntry = KernelEntry<PrefillParams, prefill_kernel<Traits, kDType, kSoftCap>, Traits,
                                 prefill_kernel_name<Traits, kDType, kSoftCap>>;

template <class Traits, DType kDType, bool kSoftCap>
bool try_launch_prefill(const PrefillArgs& args, uint32_t options, void* stream,
                        std::string* why) {
  PrefillParams params;
  if (!make_prefill_params<Traits>(args, options, &params, why)) return false;
  PrefillEntry<Traits, kDType, kSoftCap>::launch(params, args.num_workers, stream,
                                                 args.problem.enable_pdl);
  return true;
}

template <class Traits, DType kDType, bool kSoftCap>
KernelInstance prefill_instance() {
  KernelInstance instance = PrefillEntry<Traits, kDType, kSoftCap>::instance(kDType, kDType);
  instance.try_prefill = &try_launch_prefill<Traits, kDType, kSoftCap>;
  return instance;
}

// The registry row of one shape with soft-cap off or on, its fp16 and bf16 instances.
template <class Traits, bool kSoftCap>
KernelRow prefill_row(uint32_t features) {
  KernelRow row;
  row.family = KernelFamily::kSm90Prefill;
  row.features = features | (kSoftCap ? kKernelSoftCap : 0u) |
                 (Traits::kVPageBoxes ? kKernelPagedV : 0u);
  row.shape = {Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN, Traits::kNumThreads,
               Traits::kStages, Traits::kSmemBytes, 0, 0};
  row.instances = {prefill_instance<Traits, DType::kFloat16, kSoftCap>(),
                   prefill_instance<Traits, DType::kBFloat16, kSoftCap>()};
  return row;
}

// Both rows of a shape (soft-cap off / on).
template <class Traits>
void add_prefill_rows(KernelRows& rows, uint32_t features = 0) {
  rows.push_back(prefill_row<Traits, false>(features));
  rows.push_back(prefill_row<Traits, true>(features));
}

}  // namespace tessera::detail::sm90
