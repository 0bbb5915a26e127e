// FlashAttention-2 forward for prefill on sm80+ (Ampere, Ada; the portable path on Hopper).
//
// One persistent CTA per planner worker walks work[worker_indptr[w] .. worker_indptr[w + 1]).
// A work item (request, kv head, q rows, key range) is cut into CTA tiles of BLOCK_M packed rows
// (tokens x query heads of the kv head's group, see prefill_traits.cuh). Per tile:
//   Q tile -> smem once (cp.async), then for every key tile that some row can see:
//     S = Q K^T               mma.sync m16n8k16, f32 accumulate, Q and K via ldmatrix
//     S = cap*tanh(S/cap)     soft-cap (template flag), before the mask
//     mask                    only on key tiles that cross a row's visible-range boundary
//     online softmax          base 2, scale folded into one FFMA per logit, guarded -inf rows
//     O += P V                P re-packed from the S accumulators, V via ldmatrix.trans
//   O / l -> o (q dtype, through smem for 16-byte stores) and lse, or float partials + lse
//   into the workspace when the plan split the key range (merged by merge_partials.cu).
//
// Pipeline (K and V each have kStages buffers; see "Stages" in prefill_traits.cuh):
//   prologue: K[0] (+Q), V[0], K[1], V[1], ..., K[S-1]           (2S - 1 commit groups)
//   key tile t:
//     wait K[t]; __syncthreads    -> every warp is also done with P x V of tile t-1
//     issue V[t+S-1] into the V buffer tile t-1 used; fill key offsets of tile t+S
//     S = Q K[t]^T, mask, softmax
//     wait V[t]; __syncthreads    -> every warp is also done with K[t]'s buffer
//     issue K[t+S] into it
//     O += P V[t]
// Both waits leave exactly 2S - 2 younger groups in flight (one group is committed after each
// wait, empty when past the last tile), so wait_group takes a compile-time count. With S = 1
// this is FA2's schedule: V loads under Q K^T, K loads under softmax and P V.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/problem.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_entry.cuh"
#include "cuda/kernel_registry.hpp"
#include "cuda/ptx/grid_dependency.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/math.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/shuffle.cuh"
#include "cuda/sm80/element_ops.cuh"
#include "cuda/sm80/prefill_api.hpp"
#include "cuda/sm80/prefill_epilogue.cuh"
#include "cuda/sm80/prefill_tile_io.cuh"
#include "cuda/sm80/prefill_traits.cuh"

namespace tessera::detail::sm80 {

// Byte offset, inside a swizzled row, of 16-byte chunk 2 * step + lane_bit, where the lane
// supplies lane_xor = lane_bit ^ (row % 8). Equal to the chunk part of
// ptx::swizzled_chunk_offset, written so that an unrolled `step` leaves one of four per-lane
// values plus an immediate (the ldmatrix address needs no other integer math).
__device__ __forceinline__ uint32_t chunk_pair_offset(int step, int lane_xor) {
  return static_cast<uint32_t>((step / 4) * 128 + (((2 * (step % 4)) ^ lane_xor) << 4));
}

// S = Q K^T for one key tile. q_lane_base / k_lane_base: this lane's ldmatrix row address.
template <class Traits, DType kDType>
__device__ __forceinline__ void compute_scores(
    float (&acc_s)[Traits::kMmaRowBlocks][Traits::kScoreCols][4], uint32_t q_lane_base,
    int q_lane_xor, uint32_t k_lane_base, int k_lane_xor) {
  using Element = ElementOps<kDType>;
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int n = 0; n < Traits::kScoreCols; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[m][n][e] = 0.0f;
    }
  }
#pragma unroll
  for (int step = 0; step < Traits::kHeadSteps; ++step) {
    uint32_t q_frag[Traits::kMmaRowBlocks][4];
#pragma unroll
    for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
      ptx::ldmatrix_x4(q_frag[m], q_lane_base + m * 16 * Traits::kRowBytes +
                                      chunk_pair_offset(step, q_lane_xor));
    }
#pragma unroll
    for (int pair = 0; pair < Traits::kBlockN / 16; ++pair) {
      // Keys 16*pair .. +15, head dims 16*step .. +15: B fragments of two 8-key columns.
      uint32_t k_frag[4];
      ptx::ldmatrix_x4(k_frag, k_lane_base + pair * 16 * Traits::kRowBytes +
                                   chunk_pair_offset(step, k_lane_xor));
#pragma unroll
      for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
        Element::mma(acc_s[m][2 * pair], q_frag[m], k_frag[0], k_frag[1]);
        Element::mma(acc_s[m][2 * pair + 1], q_frag[m], k_frag[2], k_frag[3]);
      }
    }
  }
}

// s -> log2(e) * cap * tanh(sm_scale * s / cap): the soft-capped logit, already in base 2.
// tanh(x) = 1 - 2 / (e^(2x) + 1) from ex2 and rcp (both ~1 ulp) keeps the capped logit accurate to
// ~1e-7 * cap, where tanh.approx (2^-11 relative) would be off by up to ~0.02 at cap 50. The
// limits are exact: e^(2x) = inf gives 1, e^(2x) = 0 gives -1. pre = 2 log2(e) sm_scale / cap,
// post = log2(e) cap (PrefillArgs).
template <class Traits>
__device__ __forceinline__ void apply_soft_cap(
    float (&acc_s)[Traits::kMmaRowBlocks][Traits::kScoreCols][4], float pre, float post) {
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int n = 0; n < Traits::kScoreCols; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float exp_2x = ptx::ex2_approx(pre * acc_s[m][n][e]);
        const float tanh_x = fmaf(-2.0f, ptx::rcp_approx(exp_2x + 1.0f), 1.0f);
        acc_s[m][n][e] = post * tanh_x;
      }
    }
  }
}

// Sets invisible (row, key) scores to -inf. Accumulator element e of column n is key
// n * 8 + 2 * (lane % 4) + (e % 2) of row lane / 4 + 8 * (e / 2) of the 16-row block.
template <class Traits>
__device__ __forceinline__ void apply_mask(
    float (&acc_s)[Traits::kMmaRowBlocks][Traits::kScoreCols][4], const PrefillRowInfo* row_info,
    int warp_first_row, int lane, int32_t tile_first_key) {
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const PrefillRowInfo info = row_info[warp_first_row + m * 16 + lane / 4 + 8 * h];
#pragma unroll
      for (int n = 0; n < Traits::kScoreCols; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int32_t key = tile_first_key + n * 8 + 2 * (lane % 4) + e;
          if (key < info.first_key || key >= info.last_key) acc_s[m][n][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

// Online softmax over one key tile (FlashAttention-2, Algorithm 1): updates the running max and
// sum, rescales O, and packs P = 2^(s * scale - max * scale) into mma A fragments.
template <class Traits, DType kDType>
__device__ __forceinline__ void online_softmax(
    float (&acc_s)[Traits::kMmaRowBlocks][Traits::kScoreCols][4], PrefillWarpState<Traits>& state,
    float scale, uint32_t (&p_frag)[Traits::kMmaRowBlocks][Traits::kKeySteps][4]) {
  using Element = ElementOps<kDType>;
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float new_max = state.row_max[m][h];
      if constexpr (Traits::kTreeReduce) {
        // Pairwise tree: log2(kScoreCols) dependent FMNMX instead of a kScoreCols-long chain.
        float partial[Traits::kScoreCols];
#pragma unroll
        for (int n = 0; n < Traits::kScoreCols; ++n) {
          partial[n] = ptx::max_nan(acc_s[m][n][2 * h], acc_s[m][n][2 * h + 1]);
        }
#pragma unroll
        for (int stride = 1; stride < Traits::kScoreCols; stride *= 2) {
#pragma unroll
          for (int n = 0; n + stride < Traits::kScoreCols; n += 2 * stride) {
            partial[n] = ptx::max_nan(partial[n], partial[n + stride]);
          }
        }
        new_max = ptx::max_nan(new_max, partial[0]);
      } else {
#pragma unroll
        for (int n = 0; n < Traits::kScoreCols; ++n) {
          new_max = ptx::max_nan(new_max, ptx::max_nan(acc_s[m][n][2 * h], acc_s[m][n][2 * h + 1]));
        }
      }
      new_max = ptx::quad_max(new_max);
      // A row that has seen only masked keys keeps max = -inf; using 0 as the exponent base
      // then turns every 2^(-inf - base) into an exact 0 instead of NaN (-inf - -inf).
      // The exponent is s * scale - base with the product rounded on its own (no FMA): the row's
      // maximum then gives exactly 2^0 = 1. With fmaf(s, scale, -base) it gives 2^r, r the
      // rounding error of base, which for logits beyond ~2^30 (fp16 inputs near 65504) reaches
      // hundreds and underflows every P of the row to 0 (0/0 = NaN in the epilogue).
      const float base = new_max == -INFINITY ? 0.0f : __fmul_rn(new_max, scale);
      const float correction = ptx::ex2_approx(__fmul_rn(state.row_max[m][h], scale) - base);
      state.row_max[m][h] = new_max;
      float sum = state.row_sum[m][h] * correction;
#pragma unroll
      for (int d = 0; d < Traits::kOutputCols; ++d) {
        state.acc_o[m][d][2 * h] *= correction;
        state.acc_o[m][d][2 * h + 1] *= correction;
      }
#pragma unroll
      for (int n = 0; n < Traits::kScoreCols; ++n) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          acc_s[m][n][e] = ptx::ex2_approx(__fmul_rn(acc_s[m][n][e], scale) - base);
        }
      }
      if constexpr (Traits::kTreeReduce) {
        // Same pairwise tree for the sum (reassociated: rounding differs in the last bits).
        float partial[Traits::kScoreCols];
#pragma unroll
        for (int n = 0; n < Traits::kScoreCols; ++n) {
          partial[n] = acc_s[m][n][2 * h] + acc_s[m][n][2 * h + 1];
        }
#pragma unroll
        for (int stride = 1; stride < Traits::kScoreCols; stride *= 2) {
#pragma unroll
          for (int n = 0; n + stride < Traits::kScoreCols; n += 2 * stride) {
            partial[n] += partial[n + stride];
          }
        }
        sum += partial[0];
      } else {
#pragma unroll
        for (int n = 0; n < Traits::kScoreCols; ++n) {
          sum += acc_s[m][n][2 * h];
          sum += acc_s[m][n][2 * h + 1];
        }
      }
      state.row_sum[m][h] = sum;
    }
    // The S accumulator of key columns 2k, 2k+1 is exactly the A fragment of P's k-step k.
#pragma unroll
    for (int k = 0; k < Traits::kKeySteps; ++k) {
      p_frag[m][k][0] = Element::pack(acc_s[m][2 * k][0], acc_s[m][2 * k][1]);
      p_frag[m][k][1] = Element::pack(acc_s[m][2 * k][2], acc_s[m][2 * k][3]);
      p_frag[m][k][2] = Element::pack(acc_s[m][2 * k + 1][0], acc_s[m][2 * k + 1][1]);
      p_frag[m][k][3] = Element::pack(acc_s[m][2 * k + 1][2], acc_s[m][2 * k + 1][3]);
    }
  }
}

// O += P V for one key tile. v_lane_base: this lane's ldmatrix.trans row address (key lane%16).
template <class Traits, DType kDType>
__device__ __forceinline__ void accumulate_pv(
    PrefillWarpState<Traits>& state,
    const uint32_t (&p_frag)[Traits::kMmaRowBlocks][Traits::kKeySteps][4], uint32_t v_lane_base,
    int v_lane_xor) {
  using Element = ElementOps<kDType>;
#pragma unroll
  for (int k = 0; k < Traits::kKeySteps; ++k) {
#pragma unroll
    for (int pair = 0; pair < Traits::kOutputCols / 2; ++pair) {
      // Keys 16*k .. +15, head dims 16*pair .. +15: B fragments of two 8-wide O columns.
      uint32_t v_frag[4];
      ptx::ldmatrix_x4_trans(
          v_frag, v_lane_base + k * 16 * Traits::kRowBytes + chunk_pair_offset(pair, v_lane_xor));
#pragma unroll
      for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
        Element::mma(state.acc_o[m][2 * pair], p_frag[m][k], v_frag[0], v_frag[1]);
        Element::mma(state.acc_o[m][2 * pair + 1], p_frag[m][k], v_frag[2], v_frag[3]);
      }
    }
  }
}

// One CTA tile from Q load to output store (see the pipeline at the top of this file).
template <class Traits, DType kDType, bool kSoftCap>
__device__ __forceinline__ void prefill_tile(const PrefillArgs& args, const WorkItem& item,
                                             const PrefillTileGeometry& tile, unsigned char* smem) {
  constexpr int kStages = Traits::kStages;
  constexpr int kInFlightGroups = 2 * kStages - 2;
  const AttentionProblem& problem = args.problem;
  const int lane = threadIdx.x % 32;
  const int warp_first_row = (threadIdx.x / 32) * Traits::kWarpRows;
  auto* row_info = reinterpret_cast<PrefillRowInfo*>(smem + Traits::kRowInfoOffset);
  auto* key_offsets = reinterpret_cast<PrefillKeyOffsets*>(smem + Traits::kKeyOffsetsOffset);
  const auto offsets_slot = [&](int key_tile) {
    return key_offsets + (key_tile % Traits::kOffsetSlots) * Traits::kBlockN;
  };
  const uint32_t smem_base = ptx::shared_address(smem);
  const uint32_t q_tile = smem_base + static_cast<uint32_t>(Traits::kQOffset);
  const auto k_tile = [&](int stage) {
    return smem_base + static_cast<uint32_t>(Traits::kKOffset + stage * Traits::kKVTileBytes);
  };
  const auto v_tile = [&](int stage) {
    return smem_base + static_cast<uint32_t>(Traits::kVOffset + stage * Traits::kKVTileBytes);
  };
  const int num_key_tiles = tile.num_key_tiles;

  // ---- prologue: tables, then Q and the first key tiles in flight ----
  __syncthreads();  // every warp is done with the previous tile's buffers and tables
  fill_row_info<Traits>(problem, item, tile, row_info);
  for (int stage = 0; stage < kStages && stage < num_key_tiles; ++stage) {
    fill_key_offsets<Traits>(problem.kv, tile, stage, offsets_slot(stage));
  }
  __syncthreads();
  load_q_tile<Traits>(problem, row_info, q_tile);
#pragma unroll
  for (int stage = 0; stage < kStages; ++stage) {
    if (stage < num_key_tiles) load_k_tile<Traits>(problem, offsets_slot(stage), k_tile(stage));
    ptx::cp_async_commit_group();
    if (stage + 1 < kStages) {
      if (stage < num_key_tiles) load_v_tile<Traits>(problem, offsets_slot(stage), v_tile(stage));
      ptx::cp_async_commit_group();
    }
  }

  PrefillWarpState<Traits> state;
#pragma unroll
  for (int m = 0; m < Traits::kMmaRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      state.row_max[m][h] = -INFINITY;
      state.row_sum[m][h] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < Traits::kOutputCols; ++d) {
#pragma unroll
      for (int e = 0; e < 4; ++e) state.acc_o[m][d][e] = 0.0f;
    }
  }

  // ldmatrix lane addressing (see ldmatrix.cuh / mma.cuh for the fragment layouts):
  //   Q (A operand):   lane supplies row lane % 16, chunk 2*step + lane / 16
  //   K (B, no trans): lane supplies key (lane / 16) * 8 + lane % 8, chunk 2*step + (lane/8) % 2
  //   V (B, trans):    lane supplies key lane % 16, chunk 2*pair + lane / 16
  // Every row block starts at a multiple of 8 rows, so row % 8 == lane % 8 throughout.
  const int qv_lane_xor = (lane / 16) ^ (lane % 8);
  const int k_lane_xor = ((lane / 8) % 2) ^ (lane % 8);
  const uint32_t q_lane_base = q_tile + (warp_first_row + lane % 16) * Traits::kRowBytes;
  const uint32_t k_lane_row_bytes = ((lane / 16) * 8 + lane % 8) * Traits::kRowBytes;
  const uint32_t v_lane_row_bytes = (lane % 16) * Traits::kRowBytes;

  for (int key_tile = 0; key_tile < num_key_tiles; ++key_tile) {
    const int stage = key_tile % kStages;
    ptx::cp_async_wait_group<kInFlightGroups>();  // K[key_tile] (and Q) landed for this thread
    __syncthreads();                              // ... and for every thread
    {
      const int next = key_tile + kStages - 1;
      if (next < num_key_tiles) {
        load_v_tile<Traits>(problem, offsets_slot(next), v_tile(next % kStages));
      }
      ptx::cp_async_commit_group();
      if (next + 1 < num_key_tiles) {
        fill_key_offsets<Traits>(problem.kv, tile, next + 1, offsets_slot(next + 1));
      }
    }

    float acc_s[Traits::kMmaRowBlocks][Traits::kScoreCols][4];
    compute_scores<Traits, kDType>(acc_s, q_lane_base, qv_lane_xor,
                                   k_tile(stage) + k_lane_row_bytes, k_lane_xor);
    if constexpr (kSoftCap) apply_soft_cap<Traits>(acc_s, args.soft_cap_pre, args.soft_cap_post);
    if (key_tile_needs_mask<Traits>(tile, key_tile)) {
      apply_mask<Traits>(acc_s, row_info, warp_first_row, lane,
                         tile.key_begin + key_tile * Traits::kBlockN);
    }
    uint32_t p_frag[Traits::kMmaRowBlocks][Traits::kKeySteps][4];
    online_softmax<Traits, kDType>(acc_s, state, args.score_scale_log2, p_frag);

    ptx::cp_async_wait_group<kInFlightGroups>();  // V[key_tile] landed
    __syncthreads();                              // and every warp is done reading K[stage]
    {
      const int next = key_tile + kStages;
      if (next < num_key_tiles) load_k_tile<Traits>(problem, offsets_slot(next), k_tile(stage));
      ptx::cp_async_commit_group();
    }
    accumulate_pv<Traits, kDType>(state, p_frag, v_tile(stage) + v_lane_row_bytes, qv_lane_xor);
  }
  ptx::cp_async_wait_group<0>();
  // Without key tiles no barrier has ordered the Q copies (issued by all threads, into every
  // warp's rows) before the epilogue reuses the Q tile as staging: add one.
  if (num_key_tiles == 0) __syncthreads();

  if (item.partial_row < 0) {
    store_output_tile<Traits, kDType>(args, tile, row_info, state, smem, warp_first_row, lane);
  } else {
    store_partial_tile<Traits>(args, item, tile, state, warp_first_row, lane);
  }
}

template <class Traits, DType kDType, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kNumThreads, Traits::kMinCtasPerSm)
    prefill_kernel(const __grid_constant__ PrefillArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // cp.async and bf16 mma need sm_80; the launcher never targets older devices
#else
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (Traits::kNeedsSm90) {
    __trap();  // never selected below sm_90 (select_prefill_variant)
    return;
  }
#endif
  extern __shared__ __align__(128) unsigned char prefill_smem[];
  const int worker = blockIdx.x;
  const int32_t work_begin = args.worker_indptr[worker];
  const int32_t work_end = args.worker_indptr[worker + 1];
  // Programmatic launch (ptx/grid_dependency.cuh): only the plan's lists are read before this.
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int32_t group = args.problem.group_size();
  for (int32_t w = work_begin; w < work_end; ++w) {
    const WorkItem item = args.work[w];
    // A work item may hold more packed rows than one CTA tile (e.g. a query-head group larger
    // than BLOCK_M): walk it tile by tile.
    const int32_t rows_total = item.q_len * group;
    for (int32_t row0 = 0; row0 < rows_total; row0 += Traits::kBlockM) {
      const PrefillTileGeometry tile =
          make_tile_geometry<Traits>(args.problem, item, row0, rows_total);
      prefill_tile<Traits, kDType, kSoftCap>(args, item, tile, prefill_smem);
    }
  }
#endif
}

// ---- host side: launch, occupancy and the per-bucket table ----

template <class Traits, DType kDType, bool kSoftCap>
const char* prefill_kernel_name() {
  static const std::string name =
      "tessera::sm80::prefill<d" + std::to_string(Traits::kHeadDim) + ", " +
      ElementOps<kDType>::kName + (kSoftCap ? ", soft_cap" : "") +
      (Traits::kVariant == 0
           ? std::string(">")
           : ", v" + std::to_string(Traits::kVariant) + " " + std::to_string(Traits::kBlockM) +
                 "x" + std::to_string(Traits::kBlockN) + "w" +
                 std::to_string(Traits::kNumWarps) + "s" + std::to_string(Traits::kStages) + ">");
  return name.c_str();
}

template <class Traits, DType kDType, bool kSoftCap>
using PrefillEntry = KernelEntry<PrefillArgs, prefill_kernel<Traits, kDType, kSoftCap>, Traits,
                                 prefill_kernel_name<Traits, kDType, kSoftCap>>;

template <class Traits, DType kDType, bool kSoftCap>
KernelInstance prefill_instance() {
  using Entry = PrefillEntry<Traits, kDType, kSoftCap>;
  KernelInstance instance = Entry::instance(kDType, kDType);
  instance.prefill = &Entry::launch_workers;
  return instance;
}

template <class Traits, bool kSoftCap>
KernelRow prefill_row() {
  using Shape = std::conditional_t<kSoftCap, typename PrefillSoftCapTraits<Traits>::type, Traits>;
  static_assert(Shape::kBlockM == Traits::kBlockM && Shape::kBlockN == Traits::kBlockN,
                "the planner sizes work items for both kernels of a pair");
  KernelRow row;
  row.family = KernelFamily::kSm80Prefill;
  row.features = kSoftCap ? kKernelSoftCap : 0u;
  row.shape = {Shape::kHeadDim, Shape::kBlockM,    Shape::kBlockN,    Shape::kNumThreads,
               Shape::kStages,  Shape::kSmemBytes, 0,                 Shape::kVariant};
  row.instances = {prefill_instance<Shape, DType::kFloat16, kSoftCap>(),
                   prefill_instance<Shape, DType::kBFloat16, kSoftCap>()};
  return row;
}

// The rows of one tile shape (soft-cap off / on, fp16 and bf16 each).
template <class Traits>
void add_prefill_rows(KernelRows& rows) {
  rows.push_back(prefill_row<Traits, false>());
  rows.push_back(prefill_row<Traits, true>());
}

}  // namespace tessera::detail::sm80
