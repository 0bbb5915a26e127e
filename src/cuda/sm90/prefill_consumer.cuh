// Consumer warpgroups of the sm90 prefill kernel: wgmma for S = Q K^T (both operands in shared
// memory) and O += P V (P in registers, V in shared memory), online softmax in between, and
// the epilogue. Each consumer warpgroup owns 64 packed rows of the CTA tile; all of them read
// the same K/V ring slots.
//
// Schedule of one CTA tile with n key tiles (FlashAttention-3, arXiv:2407.08608, 3.2):
//   S_0 = Q K_0^T; softmax(S_0) -> P_0
//   for t = 1 .. n-1:                               intra-warpgroup pipelining:
//     issue S_t = Q K_t^T                             S_t runs on the tensor cores while
//     O *= correction_{t-1}; issue O += P_{t-1} V_{t-1}  P_{t-1} V_{t-1} is queued behind it,
//     wait S_t; softmax(S_t) -> P_t, correction_t    and the softmax of S_t overlaps P V
//     wait P_{t-1} V_{t-1}
//   O *= correction_{n-1}; O += P_{n-1} V_{n-1}; epilogue
// (kRescaleLate kernels - head_dim <= 128 - move each O *= correction_t to right after the wait
// for P_{t-1} V_{t-1}, out of the scheduler turn, into the softmax's basic block.)
// Ping-pong between warpgroups (same paper, 3.1): a warpgroup issues its GEMMs only after the
// previous warpgroup issued its own (named barrier per warpgroup, passed round-robin), so one
// warpgroup's softmax runs while another's GEMMs keep the tensor cores busy.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <numbers>

#include "core/problem.hpp"
#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/math.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/shuffle.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/row_finish.cuh"
#include "cuda/sm90/prefill_producer.cuh"
#include "cuda/sm90/prefill_tile.cuh"
#include "cuda/sm90/prefill_traits.cuh"

namespace tessera::detail::sm90 {

template <DType kDType>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (kDType == DType::kBFloat16) {
    return ptx::pack_bf16x2(lo, hi);
  } else {
    return ptx::pack_f16x2(lo, hi);
  }
}

// In-place pairwise reduction of a register array (an odd count first folds its last element
// into the first). Recursion on the size keeps every index a compile-time constant (a halving
// loop is not unrolled by nvcc, which then moves the array to local memory).
template <int kCount, class Op>
__device__ __forceinline__ float tree_reduce(float (&values)[kCount], Op op) {
  if constexpr (kCount == 1) {
    return values[0];
  } else if constexpr (kCount % 2 == 1) {
    values[0] = op(values[0], values[kCount - 1]);
    return tree_reduce(reinterpret_cast<float(&)[kCount - 1]>(values), op);
  } else {
#pragma unroll
    for (int i = 0; i < kCount / 2; ++i) values[i] = op(values[i], values[i + kCount / 2]);
    return tree_reduce(reinterpret_cast<float(&)[kCount / 2]>(values), op);
  }
}
template <int kCount>
__device__ __forceinline__ float tree_reduce_max(float (&values)[kCount]) {
  return tree_reduce(values, [](float a, float b) { return ptx::max_nan(a, b); });
}
template <int kCount>
__device__ __forceinline__ float tree_reduce_sum(float (&values)[kCount]) {
  return tree_reduce(values, [](float a, float b) { return a + b; });
}

template <class Traits, DType kDType, bool kSoftCap>
class PrefillConsumer {
  static constexpr int kScoreRegs = Traits::kScoreRegisters;
  static constexpr int kOutputRegs = Traits::kOutputRegisters;
  static constexpr int kKeySteps = Traits::kKeySteps;
  static constexpr uint32_t kSchedulerThreads = 2 * Traits::kWarpgroupThreads;
  static constexpr bool kNarrow = Traits::kNarrowTileMath;  // prefill_tile.cuh
  // Where O takes the correction of the key tile just softmaxed: right after the previous P V
  // has landed (late: FA3's place for head_dim <= 128, the multiplications in the exponentials'
  // basic block), or at the next scheduler turn, between the next Q K^T and P V. Late is the
  // faster up to head_dim 128; d256 (128 output registers against 32 exponentials a tile) keeps
  // the turn (timed per kernel: docs/log/PERF.md, 2026-12-04 and 2026-12-05).
  static constexpr bool kRescaleLate = Traits::kHeadDim <= 128;
  // Largest |max * scale| for which the exponentials take the one-FFMA form (softmax_tile).
  static constexpr float kOneFfmaBaseLimit = 1048576.0f;  // 2^20

  // The two rows of the tile this thread holds accumulator elements of (h = 0: d[4j + 0, 1],
  // h = 1: d[4j + 2, 3]), with their visible keys clamped to the work item's range.
  struct Rows {
    int32_t row[2];    // packed row within the CTA tile
    int32_t first[2];  // visible keys [first, last); empty for padding rows
    int32_t last[2];
  };

  // Online-softmax state of this thread's two rows.
  struct Softmax {
    float row_max[2];     // max of the raw scores so far (quad-reduced)
    float row_sum[2];     // this lane's part of sum 2^(s * scale - max * scale)
    float correction[2];  // 2^((old max - new max) * scale) of the last update
  };

 public:
  __device__ __forceinline__ PrefillConsumer(const PrefillParams& params,
                                             const PrefillSmem<Traits>& smem, int warpgroup)
      : params_(params),
        problem_(params.args.problem),
        smem_(smem),
        warpgroup_(ptx::warp_uniform(warpgroup)),
        thread_(static_cast<int>(threadIdx.x) - Traits::kProducerThreads),
        lane_(static_cast<int>(threadIdx.x % 32)) {}

  __device__ void run() {
    // Ping-pong: warpgroup 0 holds the first turn.
    if (warpgroup_ == 0) ptx::named_barrier_arrive(scheduler_barrier(0), kSchedulerThreads);
    // Each warpgroup derives the tiles from the work list itself, exactly as the producer does.
    // (A shared tile ring fed by the producer was tried: correct under the PTX memory model, its
    // mbarrier hand-off of plain shared-memory stores is reported as a race by
    // compute-sanitizer racecheck, and it bought no measurable time; docs/log/PERF.md, v2.)
    RingState ring;
    int32_t q_count = 0;
    for_each_prefill_tile<Traits::kBlockN, kNarrow>(
        params_, [&](const PrefillTile& tile) { consume_tile(tile, ring, q_count); });
    // The last warpgroup's final hand-over is addressed to warpgroup 0: consume it, so no named
    // barrier is left half-arrived when the CTA exits.
    if (warpgroup_ == 0) ptx::named_barrier_sync(scheduler_barrier(0), kSchedulerThreads);
    if (thread_ == 0) ptx::tma_store_wait_all();
  }

 private:
  // One CTA tile: main loop and epilogue (or o = 0 for a tile without keys).
  __device__ void consume_tile(const PrefillTile& tile, RingState& ring, int32_t& q_count) {
    const Rows rows = make_rows(tile);
    float o[kOutputRegs];
#pragma unroll
    for (int i = 0; i < kOutputRegs; ++i) o[i] = 0.0f;
    Softmax softmax{{-INFINITY, -INFINITY}, {0.0f, 0.0f}, {0.0f, 0.0f}};
    if (tile.num_key_tiles == 0) {
      store_direct(tile, rows, o, softmax);  // o = 0, lse = -inf; no Q, no K/V, no barrier
      return;
    }
    attend(tile, rows, ring, q_count, o, softmax);
    if (tile.partial_row >= 0) {
      store_direct(tile, rows, o, softmax);
    } else {
      store_staged(tile, rows, o, softmax);
    }
    if constexpr (!Traits::kSeparateOutputSmem) {
      // The output was staged in Q's buffer: hand it back only now.
      ptx::fence_proxy_async_shared();
      release(smem_.q_empty());
    }
  }

  __device__ __forceinline__ static uint32_t scheduler_barrier(int warpgroup) {
    return kSchedulerBarrierBase + static_cast<uint32_t>(warpgroup);
  }
  __device__ __forceinline__ void scheduler_wait() const {
    if constexpr (Traits::kConsumerWarpgroups > 1) {
      ptx::named_barrier_sync(scheduler_barrier(warpgroup_), kSchedulerThreads);
    }
  }
  __device__ __forceinline__ void scheduler_pass() const {
    if constexpr (Traits::kConsumerWarpgroups > 1) {
      ptx::named_barrier_arrive(scheduler_barrier((warpgroup_ + 1) % Traits::kConsumerWarpgroups),
                                kSchedulerThreads);
    }
  }
  // One arrival per consumer warp (empty barriers count kConsumerWarps). __syncwarp orders
  // every lane's reads of the buffer (the tile ring's plain loads; wgmma reads are complete at
  // the warp-synchronous wait_group) before lane 0's arrival releases it; without it
  // compute-sanitizer racecheck reports the producer's next write to a tile-ring slot racing
  // with the other lanes' reads.
  __device__ __forceinline__ void release(uint32_t barrier) const {
    __syncwarp();
    if (lane_ == 0) ptx::mbarrier_arrive(barrier);
  }

  __device__ __forceinline__ Rows make_rows(const PrefillTile& tile) const {
    Rows rows;
    const int32_t group = problem_.group_size();
    const int warp = (thread_ / 32) % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t row = warpgroup_ * 64 + warp * 16 + lane_ / 4 + 8 * h;
      rows.row[h] = row;
      int32_t first = 0, last = 0;
      if (row < tile.rows) {
        const int32_t token = tile.token0 + (kNarrow ? row_token(row) : row / group);
        row_visible_range<kNarrow>(problem_.mask, token, tile.q_len, tile.kv_len, &first, &last);
        first = max(first, tile.kv_start);
        last = max(first, min(last, tile.kv_end));
      }
      rows.first[h] = first;
      rows.last[h] = last;
    }
    return rows;
  }

  // Waits for ring slot `stage` of `full` (use parity) and, when the producer gathered the tile
  // with cp.async (generic proxy), orders those writes before this warpgroup's wgmma reads.
  __device__ __forceinline__ void wait_full(uint32_t full, uint32_t parity, bool gathered) const {
    ptx::mbarrier_wait(full, parity);
    if (gathered) ptx::fence_proxy_async_shared();
  }

  // S = Q K^T for the key tile in ring slot `stage`: kHeadSteps wgmma, one commit group.
  __device__ __forceinline__ void issue_scores(float (&s)[kScoreRegs], int stage) const {
    const uint32_t q_rows = smem_.q() + static_cast<uint32_t>(warpgroup_ * 64 * Traits::kRowBytes);
    const uint64_t a0 = ptx::wgmma_opaque(ptx::wgmma_descriptor_sw128(q_rows, 16, 1024));
    const uint64_t b0 = ptx::wgmma_opaque(ptx::wgmma_descriptor_sw128(smem_.k(stage), 16, 1024));
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < Traits::kHeadSteps; ++step) {
      const uint32_t in_block = static_cast<uint32_t>((step % 4) * 32);
      const uint32_t block = static_cast<uint32_t>(step / 4);
      const uint64_t a = ptx::wgmma_descriptor_advance(
          a0, block * static_cast<uint32_t>(Traits::kQBlockBytes) + in_block);
      const uint64_t b = ptx::wgmma_descriptor_advance(
          b0, block * static_cast<uint32_t>(Traits::kKVBlockBytes) + in_block);
      ptx::Wgmma<Traits::kBlockN, kDType>::ss(s, a, b, step > 0 ? 1 : 0);
    }
    ptx::wgmma_commit_group();
  }

  // O += P V for the key tile in ring slot `stage`: kKeySteps wgmma (A = P from registers,
  // B = V MN-major), one commit group.
  __device__ __forceinline__ void issue_pv(float (&o)[kOutputRegs],
                                           const uint32_t (&p)[kKeySteps][4], int stage) const {
    // The usual layout: column blocks kKVBlockBytes apart (leading byte offset), 8-row groups
    // 1024 bytes apart (stride byte offset), k-step s at row 16 s. Page-by-page V
    // (prefill_traits.cuh), R rows per page: column blocks R rows apart, k-step s at page
    // 16 s / R, row 16 s % R - its 16 keys inside one page or, at R = 8, in two pages whose
    // 8-row halves are then a page apart.
    uint32_t leading = static_cast<uint32_t>(Traits::kKVBlockBytes);
    uint32_t stride = 1024;
    uint32_t rows = Traits::kBlockN, shift = 0, page_bytes = 0;
    if constexpr (Traits::kVPageBoxes) {
      rows = static_cast<uint32_t>(params_.v_page_rows);
      shift = static_cast<uint32_t>(params_.v_page_rows_shift);
      page_bytes = rows * Traits::kColumnBlocks * Traits::kRowBytes;
      leading = rows * Traits::kRowBytes;
      if (rows < 16) stride = page_bytes;
    }
    const uint64_t b0 =
        ptx::wgmma_opaque(ptx::wgmma_descriptor_sw128(smem_.v(stage), leading, stride));
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kKeySteps; ++step) {
      const uint32_t key = static_cast<uint32_t>(step * 16);
      uint32_t offset = key * Traits::kRowBytes;
      if constexpr (Traits::kVPageBoxes) {
        offset = (key >> shift) * page_bytes + (key & (rows - 1)) * Traits::kRowBytes;
      }
      ptx::Wgmma<Traits::kHeadDim, kDType>::rs_b_mn_major(
          o, p[step], ptx::wgmma_descriptor_advance(b0, offset), 1);
    }
    ptx::wgmma_commit_group();
  }

  // Soft-cap, mask and online softmax of key tile t; afterwards s holds the unnormalised
  // probabilities 2^(s * scale - max * scale). Everything from the exponentials on (and the
  // caller's code after it: the wait for the previous P V, P's packing, O's rescale) is one
  // basic block: ptxas then interleaves the SFU's exponentials with the sums, conversions and
  // multiplications. (Split into several blocks by a vote, it issued 88 FFMA, then 88 MUFU, then
  // the sums.)
  __device__ __forceinline__ void softmax_tile(float (&s)[kScoreRegs], const PrefillTile& tile,
                                               const Rows& rows, int t, Softmax& softmax) const {
    if constexpr (kSoftCap) {
      // log2(e) * cap * tanh(sm_scale * s / cap) from ex2 and rcp (see sm80/prefill_kernel.cuh).
      const float pre = params_.args.soft_cap_pre, post = params_.args.soft_cap_post;
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) {
        const float exp_2x = ptx::ex2_approx(pre * s[i]);
        s[i] = post * fmaf(-2.0f, ptx::rcp_approx(exp_2x + 1.0f), 1.0f);
      }
    }
    if (key_tile_needs_mask<Traits::kBlockN>(tile, t)) {
      const int32_t key_base = tile.key0 + t * Traits::kBlockN + 2 * (lane_ % 4);
#pragma unroll
      for (int j = 0; j < kScoreRegs / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int32_t key = key_base + 8 * j + e;
            if (key < rows.first[h] || key >= rows.last[h]) s[4 * j + 2 * h + e] = -INFINITY;
          }
        }
      }
    }
    float scale = params_.args.score_scale_log2;
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Pairwise trees (log2 depth instead of a kScoreRegs / 2 long dependent chain: a
      // warpgroup's softmax is latency-bound while the other warpgroup's GEMMs run).
      float partial[kScoreRegs / 4];
#pragma unroll
      for (int j = 0; j < kScoreRegs / 4; ++j) {
        partial[j] = ptx::max_nan(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
      }
      const float new_max =
          ptx::quad_max(ptx::max_nan(softmax.row_max[h], tree_reduce_max(partial)));
      // A row with only masked keys so far keeps max = -inf and uses 0 as the exponent base
      // (exact zeros, no -inf - -inf). base = max * scale rounded; every probability of the row,
      // the correction of its running sum and its lse use that same rounded base, so its
      // rounding error r shifts every exponent alike and cancels - as long as 2^r stays near 1.
      base[h] = new_max == -INFINITY ? 0.0f : __fmul_rn(new_max, scale);
      softmax.correction[h] = ptx::ex2_approx(__fmul_rn(softmax.row_max[h], scale) - base[h]);
      softmax.row_max[h] = new_max;
    }
    // One FFMA per score then suffices (FlashAttention's form). Beyond |base| = 2^20 (logits
    // near fp16's range: r can reach hundreds and 2^r underflows the row) the product is rounded
    // on its own first, so the row maximum gives exactly 2^0 (the sm80 kernel's form): a warp
    // with such a row (chosen per warp) turns its scores into those exponents first, in a block
    // of its own, and the common FFMA below becomes s * 1 - 0, exact.
    // A NaN or infinite base (a row that is NaN whatever form it takes) votes for the common
    // form, so the rows beside it in the warp keep the bits they have without it.
    const auto one_ffma = [](float b) {
      return !(fabsf(b) >= kOneFfmaBaseLimit) || fabsf(b) == INFINITY;
    };
    if (!__all_sync(0xffffffffu, one_ffma(base[0]) && one_ffma(base[1]))) {
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) s[i] = __fmul_rn(s[i], scale) - base[(i / 2) % 2];
      scale = 1.0f;
      base[0] = base[1] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kScoreRegs; ++i) {
      s[i] = ptx::ex2_approx(fmaf(s[i], scale, -base[(i / 2) % 2]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float partial[kScoreRegs / 4];
#pragma unroll
      for (int j = 0; j < kScoreRegs / 4; ++j) {
        partial[j] = s[4 * j + 2 * h] + s[4 * j + 2 * h + 1];
      }
      softmax.row_sum[h] = softmax.row_sum[h] * softmax.correction[h] + tree_reduce_sum(partial);
    }
  }

  __device__ __forceinline__ void rescale_output(float (&o)[kOutputRegs],
                                                 const Softmax& softmax) const {
    // No vote to skip a warp whose rows all kept their maximum (correction exactly 1): with the
    // late rescale the multiplications sit in the exponentials' basic block, in the SFU's shadow,
    // and a vote would split that block (timed: skipping gained nothing; docs/log/PERF.md).
#pragma unroll
    for (int j = 0; j < kOutputRegs / 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * j + 2 * h] *= softmax.correction[h];
        o[4 * j + 2 * h + 1] *= softmax.correction[h];
      }
    }
  }

  // P's A fragments from the probabilities (see ptx/wgmma.cuh: columns 16k .. 16k + 15 of the
  // S accumulator are k-step k of P V).
  __device__ __forceinline__ static void pack_probabilities(const float (&s)[kScoreRegs],
                                                            uint32_t (&p)[kKeySteps][4]) {
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        p[k][i] = pack_pair<kDType>(s[8 * k + 2 * i], s[8 * k + 2 * i + 1]);
    }
  }

  // The main loop of one CTA tile (schedule at the top of this file).
  __device__ void attend(const PrefillTile& tile, const Rows& rows, RingState& ring,
                         int32_t& q_count, float (&o)[kOutputRegs], Softmax& softmax) {
    // A warpgroup whose 64 rows are all padding (decode: a few packed rows per tile) keeps the
    // barrier protocol but leaves the tensor cores to the others. Not at d256, whose 128-float
    // output accumulator leaves no registers for the second path (ptxas spills).
    if constexpr (Traits::kHeadDim <= 128) {
      if (warpgroup_ * 64 >= tile.rows) {
        attend_idle(tile, ring, q_count);
        return;
      }
    }
    float s[kScoreRegs];
    uint32_t p[kKeySteps][4];
    const int n = tile.num_key_tiles;
    ptx::mbarrier_wait(smem_.q_full(), static_cast<uint32_t>(q_count & 1));
    ++q_count;

    // Key tile 0.
    int stage = ptx::warp_uniform(ring.stage<Traits::kStages>());
    wait_full(smem_.k_full(stage), ring.parity<Traits::kStages>(),
              key_tile_is_gathered<Traits::kBlockN>(params_, tile, 0));
    scheduler_wait();
    issue_scores(s, stage);
    scheduler_pass();
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(s);
    release(smem_.k_empty(stage));
    if (Traits::kSeparateOutputSmem && n == 1) release(smem_.q_empty());
    softmax_tile(s, tile, rows, 0, softmax);
    pack_probabilities(s, p);
    RingState previous = ring;  // the slot whose V the pending P multiplies
    ++ring.count;

    for (int t = 1; t < n; ++t) {
      stage = ptx::warp_uniform(ring.stage<Traits::kStages>());
      const int previous_stage = ptx::warp_uniform(previous.stage<Traits::kStages>());
      wait_full(smem_.k_full(stage), ring.parity<Traits::kStages>(),
                key_tile_is_gathered<Traits::kBlockN>(params_, tile, t));
      scheduler_wait();
      issue_scores(s, stage);
      if constexpr (!kRescaleLate) rescale_output(o, softmax);
      wait_full(smem_.v_full(previous_stage), previous.parity<Traits::kStages>(),
                key_tile_is_gathered<Traits::kBlockN>(params_, tile, t - 1));
      issue_pv(o, p, previous_stage);
      scheduler_pass();
      ptx::wgmma_wait_group<1>();  // S_t is done (P_{t-1} V_{t-1} may still run)
      ptx::wgmma_fence_operands(s);
      release(smem_.k_empty(stage));
      if (Traits::kSeparateOutputSmem && t == n - 1) release(smem_.q_empty());
      softmax_tile(s, tile, rows, t, softmax);
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(o);
#pragma unroll
      for (int k = 0; k < kKeySteps; ++k) ptx::wgmma_fence_operands(p[k]);
      release(smem_.v_empty(previous_stage));
      pack_probabilities(s, p);
      if constexpr (kRescaleLate) rescale_output(o, softmax);
      previous = ring;
      ++ring.count;
    }

    // The last P V (a late rescale already happened in the loop; after key tile 0 O is zero).
    if constexpr (!kRescaleLate) rescale_output(o, softmax);
    const int last_stage = ptx::warp_uniform(previous.stage<Traits::kStages>());
    wait_full(smem_.v_full(last_stage), previous.parity<Traits::kStages>(),
              key_tile_is_gathered<Traits::kBlockN>(params_, tile, n - 1));
    scheduler_wait();
    issue_pv(o, p, last_stage);
    scheduler_pass();
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(o);
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) ptx::wgmma_fence_operands(p[k]);
    release(smem_.v_empty(last_stage));
  }

  // attend() for a warpgroup without rows in the tile: the same waits, scheduler turns and
  // releases in the same order, no GEMM (a separate path, so the busy one keeps its wgmma
  // pipelining: ptxas serialises wgmma when accumulators are live across such branches).
  __device__ void attend_idle(const PrefillTile& tile, RingState& ring, int32_t& q_count) const {
    const int n = tile.num_key_tiles;
    ptx::mbarrier_wait(smem_.q_full(), static_cast<uint32_t>(q_count & 1));
    ++q_count;
    RingState previous = ring;
    for (int t = 0; t < n; ++t) {
      const int stage = ring.stage<Traits::kStages>();
      ptx::mbarrier_wait(smem_.k_full(stage), ring.parity<Traits::kStages>());
      scheduler_wait();
      if (t > 0) {
        ptx::mbarrier_wait(smem_.v_full(previous.stage<Traits::kStages>()),
                           previous.parity<Traits::kStages>());
      }
      scheduler_pass();
      release(smem_.k_empty(stage));
      if (Traits::kSeparateOutputSmem && t == n - 1) release(smem_.q_empty());
      if (t > 0) release(smem_.v_empty(previous.stage<Traits::kStages>()));
      previous = ring;
      ++ring.count;
    }
    ptx::mbarrier_wait(smem_.v_full(previous.stage<Traits::kStages>()),
                       previous.parity<Traits::kStages>());
    scheduler_wait();
    scheduler_pass();
    release(smem_.v_empty(previous.stage<Traits::kStages>()));
  }

  // Divides O by the row sums; lse (natural log) of each row (row_finish.cuh: -inf for a row that
  // saw no key, NaN for a row with a NaN or +inf score). With sinks, a final row's sink joins its
  // denominator; a split-KV partial leaves that to the merge.
  __device__ __forceinline__ void normalise(float (&o)[kOutputRegs], const Softmax& softmax,
                                            const PrefillTile& tile, const Rows& rows,
                                            float (&lse)[2]) const {
    const float scale = params_.args.score_scale_log2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = ptx::quad_sum(softmax.row_sum[h]);
      const float base = softmax.row_max[h] * scale;
      RowFinish finish;
      if (problem_.sinks != nullptr && tile.partial_row < 0 && rows.row[h] < tile.rows) {
        finish = finish_row_with_sink(base, sum, problem_.sinks[output_head(tile, rows.row[h])]);
      } else {
        finish = finish_row(base, sum);
      }
      lse[h] = finish.lse;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        o[4 * j + 2 * h] *= finish.factor;
        o[4 * j + 2 * h + 1] *= finish.factor;
      }
    }
  }

  // kNarrow (prefill_tile.cuh): a packed row's query token within the tile, row / group, with a
  // shift when the group is a power of two.
  __device__ __forceinline__ int32_t row_token(int32_t row) const {
    return divide_by(row, params_.group, params_.group_shift);
  }
  __device__ __forceinline__ int32_t output_token(const PrefillTile& tile, int32_t row) const {
    if constexpr (kNarrow) return tile.q_begin + tile.token0 + row_token(row);
    return tile.q_begin + tile.token0 + row / problem_.group_size();
  }
  __device__ __forceinline__ int32_t output_head(const PrefillTile& tile, int32_t row) const {
    if constexpr (kNarrow) {
      return tile.kv_head * params_.group + (row - row_token(row) * params_.group);
    }
    const int32_t group = problem_.group_size();
    return tile.kv_head * group + row % group;
  }

  // Straight from registers: float partials of a split key range (row item.partial_row +
  // packed row within the item, as the merge kernel expects), or o in q's dtype for a tile
  // without keys.
  __device__ void store_direct(const PrefillTile& tile, const Rows& rows, float (&o)[kOutputRegs],
                               const Softmax& softmax) const {
    float lse[2];
    normalise(o, softmax, tile, rows, lse);
    const int32_t head_dim = problem_.head_dim;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t row = rows.row[h];
      if (row >= tile.rows) continue;
      if (tile.partial_row >= 0) {
        const int64_t partial_row = int64_t{tile.partial_row} + tile.first_row_in_item + row;
        float* dst = params_.args.partial_o + partial_row * head_dim;
#pragma unroll
        for (int j = 0; j < kOutputRegs / 4; ++j) {
          const int column = 8 * j + 2 * (lane_ % 4);
          if (column < head_dim) {
            *reinterpret_cast<float2*>(dst + column) =
                make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
          }
        }
        if (lane_ % 4 == 0) params_.args.partial_lse[partial_row] = lse[h];
      } else {
        const int32_t token = output_token(tile, row);
        const int32_t head = output_head(tile, row);
        uint16_t* dst = static_cast<uint16_t*>(problem_.o) + token * problem_.o_stride_token +
                        head * problem_.o_stride_head;
#pragma unroll
        for (int j = 0; j < kOutputRegs / 4; ++j) {
          const int column = 8 * j + 2 * (lane_ % 4);
          if (column < head_dim) {
            *reinterpret_cast<uint32_t*>(dst + column) =
                pack_pair<kDType>(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
          }
        }
        if (problem_.lse != nullptr && lane_ % 4 == 0) {
          problem_.lse[token * problem_.lse_stride_token + head] = lse[h];
        }
      }
    }
  }

  // o in q's dtype through the staging tile: a TMA store of the whole tile when it holds
  // tokens_per_tile tokens (it then lies inside one request) and o has a map, else 16-byte
  // stores of its rows.
  __device__ void store_staged(const PrefillTile& tile, const Rows& rows, float (&o)[kOutputRegs],
                               const Softmax& softmax) const {
    float lse[2];
    normalise(o, softmax, tile, rows, lse);
    // The previous tile's TMA store must have read the staging tile before it is rewritten.
    if (thread_ == 0) ptx::tma_store_wait_read();
    ptx::named_barrier_sync(kEpilogueBarrier, Traits::kConsumerThreads);
    unsigned char* staging = smem_.o_generic();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Opaque, so the optimiser does not hoist this thread's 2 x head_dim / 8 staging offsets
      // out of the tile loop and keep them live through the main loop.
      int32_t row = rows.row[h];
      asm volatile("" : "+r"(row));
      const uint32_t row_offset = static_cast<uint32_t>(row) * Traits::kRowBytes;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        const uint32_t offset = static_cast<uint32_t>(j / 8) * Traits::kQBlockBytes + row_offset +
                                static_cast<uint32_t>(((j % 8) ^ (row % 8)) << 4) +
                                4 * static_cast<uint32_t>(lane_ % 4);
        *reinterpret_cast<uint32_t*>(staging + offset) =
            pack_pair<kDType>(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
      }
      if (problem_.lse != nullptr && lane_ % 4 == 0 && row < tile.rows) {
        problem_.lse[output_token(tile, row) * problem_.lse_stride_token + output_head(tile, row)] =
            lse[h];
      }
    }
    if (params_.o_tma != 0 && tile.tokens == params_.tokens_per_tile) {
      ptx::fence_proxy_async_shared();  // the stores above, before the TMA unit reads them
      ptx::named_barrier_sync(kEpilogueBarrier, Traits::kConsumerThreads);
      if (thread_ == 0) {
        const int32_t group = problem_.group_size();
#pragma unroll
        for (int block = 0; block < Traits::kColumnBlocks; ++block) {
          ptx::tma_store_3d(&params_.o_map,
                            smem_.o() + block * static_cast<uint32_t>(Traits::kQBlockBytes),
                            block * 64, tile.kv_head * group, tile.q_begin + tile.token0);
        }
        ptx::tma_store_commit();
        // Staged in Q's buffer: the producer may refill it once the store has read it.
        if constexpr (!Traits::kSeparateOutputSmem) ptx::tma_store_wait_read();
      }
      __syncwarp();
      return;
    }
    ptx::named_barrier_sync(kEpilogueBarrier, Traits::kConsumerThreads);
    constexpr int kChunksPerRow = Traits::kColumnBlocks * 8;
    const int32_t head_dim = problem_.head_dim;
    for (int index = thread_; index < tile.rows * kChunksPerRow;
         index += Traits::kConsumerThreads) {
      const int32_t row = index / kChunksPerRow;
      const int chunk = index % kChunksPerRow;
      if (chunk * 8 >= head_dim) continue;
      const uint4 value = *reinterpret_cast<const uint4*>(
          staging + (chunk / 8) * Traits::kQBlockBytes + row * Traits::kRowBytes +
          (((chunk % 8) ^ (row % 8)) << 4));
      uint16_t* dst = static_cast<uint16_t*>(problem_.o) +
                      output_token(tile, row) * problem_.o_stride_token +
                      output_head(tile, row) * problem_.o_stride_head + chunk * 8;
      *reinterpret_cast<uint4*>(dst) = value;
    }
    __syncwarp();
  }

  const PrefillParams& params_;
  const AttentionProblem& problem_;
  PrefillSmem<Traits> smem_;
  int warpgroup_;  // consumer warpgroup 0 .. kConsumerWarpgroups - 1
  int thread_;     // consumer thread 0 .. kConsumerThreads - 1
  int lane_;
};

}  // namespace tessera::detail::sm90
