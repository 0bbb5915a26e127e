// The tensor-core (mma.sync) compute policy of the sm80 batch decode kernel (decode_kernel.cuh);
// the planner picks its rows' variant (warps, stages) per shape, TESSERA_DECODE_VARIANT overrides.
//
// Same work items, loader ring, page prefetch and output conventions as the CUDA-core policy
// (decode_cuda_core.cuh); what changes is the compute, which there costs ~3000 instructions per
// 16 KiB tile (shuffle reductions per key and row, 8-wide FMA per K/V element and row) and made
// the kernel issue-bound. Here the packed query rows of an item (<= 8, or <= 16 with kFullRows)
// are the M dimension of mma.sync m16n8k16 (rows padded with zeros):
//   * each warp owns 16 keys of every tile (tile = 16 x kWarps keys): S = Q K^T is 2 n-tiles x
//     head_dim/16 k-steps, K fragments by ldmatrix straight from the ring; O += P V is one k-step
//     x head_dim/8 n-tiles, V fragments by ldmatrix.trans. ~8x fewer instructions per byte.
//   * the ring rows are XOR-swizzled (16-byte chunk c of key row r lands at c ^ (r % 8)), so the
//     8 row addresses of each ldmatrix hit distinct banks;
//   * online softmax in base 2 per warp (q_scale applied to the fp32 scores, so q stays exact),
//     row sums kept per lane and reduced once per item, O rescaled only when a warp's max moved;
//   * at the end of an item the kWarps key partitions are merged in shared memory.
// Only head_dim <= 128 and K/V of q's dtype (fp16/bf16) with 16-byte-aligned rows; the host
// falls back to the CUDA-core kernel for d256, fp8, odd views and items of more than 16 rows.
#pragma once

#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/ldmatrix.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/sm80/decode_kernel.cuh"
#include "cuda/sm80/merge_rows.cuh"

namespace tessera::detail::sm80 {

// kWarps_ warps split each tile's keys (key warps); kRowTiles_ > 1 (wide GQA groups, issue 39)
// repeats them per 16-row tile of the item's packed rows, so every row tile reads the same K/V
// stage and K/V leaves memory once per item whatever the group width.
template <int kHeadDim_, int kWarps_, int kStagesWanted_, bool kFullRows_, int kRowTiles_ = 1>
struct DecodeMmaTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kKVBytes = 2;
  static constexpr int kKeyWarps = kWarps_;
  static constexpr int kRowTiles = kRowTiles_;
  static constexpr int kWarps = kKeyWarps * kRowTiles;
  static constexpr bool kFullRows = kFullRows_;      // rows 8..15 of the m16 tile in use
  static constexpr int kWarpRows = kFullRows ? 16 : 8;  // rows of one warp's m16 tile
  static constexpr int kMaxRows = kWarpRows * kRowTiles;
  static constexpr int kNumThreads = 32 * kWarps;
  static constexpr int kKeysPerWarp = 16;
  static constexpr int kTileKeys = kKeysPerWarp * kKeyWarps;
  static constexpr int kRowBytes = kHeadDim * kKVBytes;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;  // one K (and one V) tile of a stage
  // Stages capped so that one CTA fits the 227 KiB of an sm_90 block (and ~200 KiB budget).
  static constexpr int kStageCap = (200 * 1024) / (2 * kTileBytes);
  static constexpr int kStages =
      kStagesWanted_ < kStageCap ? kStagesWanted_ : (kStageCap < 2 ? 2 : kStageCap);
  static constexpr int kCopyBytes = 16;
  static constexpr int kCopiesPerRow = kRowBytes / kCopyBytes;
  static constexpr int kRowsPerCopyPass = kNumThreads / kCopiesPerRow;
  // Passes of the copy loop; a CTA with more threads than one tile's chunks (wide row tiles at
  // d64) copies the tile in one pass with the surplus threads idle.
  static constexpr int kCopyPasses =
      kTileKeys >= kRowsPerCopyPass ? kTileKeys / kRowsPerCopyPass : 1;
  static constexpr bool kCopySurplus = kTileKeys < kRowsPerCopyPass;
  static constexpr int kKSteps = kHeadDim / 16;  // k-steps of Q K^T, d-pairs of P V
  static constexpr int kDTiles = kHeadDim / 8;   // n-tiles of O

  // Shared memory: [K ring][V ring] during the key loop, the partition merge afterwards,
  // then the key-row offsets.
  static constexpr size_t kRingBytes = size_t{kStages} * kTileBytes;
  static constexpr int kMergeStride = kHeadDim + 8;  // floats per merged row (bank spread)
  static constexpr size_t kMergeOBytes = size_t{kWarps} * kWarpRows * kMergeStride * 4;
  static constexpr size_t kMergeStatBytes = size_t{kWarps} * kWarpRows * 4;
  static constexpr size_t kMergeBytes = kMergeOBytes + 2 * kMergeStatBytes;
  static constexpr size_t kWorkBytes = 2 * kRingBytes > kMergeBytes ? 2 * kRingBytes : kMergeBytes;
  static constexpr size_t kKRingOffset = 0;
  static constexpr size_t kVRingOffset = kRingBytes;
  static constexpr size_t kMergeOOffset = 0;
  static constexpr size_t kMergeMaxOffset = kMergeOBytes;
  static constexpr size_t kMergeSumOffset = kMergeOBytes + kMergeStatBytes;
  // Two key-offset buffers: the current item's, and the next item's first kStages tiles, filled
  // during the current item (cross-item prefetch, MmaDecode::run_item).
  static constexpr size_t kKeyOffsetsOffset = (kWorkBytes + 15) / 16 * 16;
  static constexpr size_t kKeyOffsetsBytes = size_t{kStages} * kTileKeys * 2 * sizeof(int64_t);
  // Then the next work item's DecodeItem, written by thread 0 during the current item.
  static constexpr size_t kNextItemOffset = kKeyOffsetsOffset + 2 * kKeyOffsetsBytes;
  static constexpr size_t kSmemBytes = kNextItemOffset + (sizeof(DecodeItem) + 15) / 16 * 16;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "instantiated head_dims");
  static_assert(kCopiesPerRow >= 8, "the XOR swizzle needs 8 chunks per row");
  static_assert(kTileKeys % kRowsPerCopyPass == 0 || kRowsPerCopyPass % kTileKeys == 0,
                "whole copy passes per tile");
  static_assert(kTileKeys <= kNumThreads, "one thread prefetches one key row's page");
  static_assert(kRowTiles == 1 || kFullRows, "row tiles are full m16 tiles");

  // Warp w's key warp and row tile (w = row_tile * kKeyWarps + key_warp).
  __device__ static int key_warp(int warp) { return kRowTiles == 1 ? warp : warp % kKeyWarps; }
  __device__ static int row_tile(int warp) { return kRowTiles == 1 ? 0 : warp / kKeyWarps; }
};

template <DType kDType>
struct MmaOps;

template <>
struct MmaOps<DType::kFloat16> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    ptx::mma_m16n8k16_f32_f16(d, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return ptx::pack_f16x2(lo, hi);
  }
};

template <>
struct MmaOps<DType::kBFloat16> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    ptx::mma_m16n8k16_f32_bf16(d, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return ptx::pack_bf16x2(lo, hi);
  }
};

// Copies of one K/V tile into ring stage `stage`, swizzled (chunk c of row r at c ^ (r % 8)).
// Rows are 16-byte aligned (host check); chunks past the real head_dim are zero-filled.
template <class Traits>
__device__ __forceinline__ void issue_tile_copies_swizzled(const DecodeArgs& args,
                                                           uint8_t* shared,
                                                           const longlong2* key_offsets,
                                                           int stage) {
  const KVSource& kv = args.problem.kv;
  const auto* k_base = static_cast<const uint8_t*>(kv.k);
  const auto* v_base = static_cast<const uint8_t*>(kv.v);
  const int chunk = threadIdx.x % Traits::kCopiesPerRow;
  const int32_t chunk_byte = chunk * Traits::kCopyBytes;
  const uint32_t chunk_bytes =
      chunk_byte < args.problem.head_dim * Traits::kKVBytes ? Traits::kCopyBytes : 0u;
  const uint32_t k_stage =
      ptx::shared_address(shared + Traits::kKRingOffset + stage * Traits::kTileBytes);
  const uint32_t v_stage =
      ptx::shared_address(shared + Traits::kVRingOffset + stage * Traits::kTileBytes);
  const longlong2* offsets = key_offsets + stage * Traits::kTileKeys;
#pragma unroll
  for (int pass = 0; pass < Traits::kCopyPasses; ++pass) {
    const int row = threadIdx.x / Traits::kCopiesPerRow + pass * Traits::kRowsPerCopyPass;
    if constexpr (Traits::kCopySurplus) {
      if (row >= Traits::kTileKeys) break;
    }
    const longlong2 offset = offsets[row];
    const uint32_t valid = offset.x >= 0 ? chunk_bytes : 0u;
    const uint32_t shared_byte =
        row * Traits::kRowBytes + ((chunk ^ (row & 7)) * Traits::kCopyBytes);
    const uint8_t* k_src = valid > 0 ? k_base + offset.x * Traits::kKVBytes + chunk_byte : k_base;
    const uint8_t* v_src = valid > 0 ? v_base + offset.y * Traits::kKVBytes + chunk_byte : v_base;
    ptx::cp_async_16_partial(k_stage + shared_byte, k_src, valid);
    ptx::cp_async_16_partial(v_stage + shared_byte, v_src, valid);
  }
}

// Per-lane state of one warp's key partition. Lane l holds rows g = l / 4 and g + 8.
template <class Traits>
struct MmaWarpState {
  static constexpr int kRowSets = Traits::kFullRows ? 2 : 1;
  uint32_t q[Traits::kKSteps][4];  // A fragments of Q (rows g, g + 8), unscaled
  float o[Traits::kDTiles][4];     // O accumulators (rows g, g + 8; dims 8 d + 2 (l % 4) + {0,1})
  float max_score[kRowSets];       // running max (base 2, scaled), -inf: none yet
  float sum_exp[kRowSets];         // this lane's part of the running sum
  int32_t first_key[kRowSets];
  int32_t last_key[kRowSets];
};

template <class Traits, DType kDType>
__device__ __forceinline__ void mma_load_rows(const DecodeArgs& args, const DecodeItem& item,
                                              int row_tile, int lane,
                                              MmaWarpState<Traits>& state) {
  const AttentionProblem& problem = args.problem;
  const int group_row = lane / 4, quad_lane = lane % 4;
#pragma unroll
  for (int set = 0; set < 2; ++set) {
    const int32_t row = row_tile * Traits::kWarpRows + group_row + 8 * set;
    const bool used = (set == 0 || Traits::kFullRows) && row < item.rows;
    const uint16_t* q_row = nullptr;
    int32_t t = 0;
    if (used) {
      t = row / item.group;
      const int32_t head = item.work.kv_head * item.group + (row - t * item.group);
      const int64_t token = problem.q_begin(item.work.request) + item.work.q_start + t;
      q_row = static_cast<const uint16_t*>(problem.q) + token * problem.q_stride_token +
              head * problem.q_stride_head;
    }
#pragma unroll
    for (int ks = 0; ks < Traits::kKSteps; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int feature = ks * 16 + half * 8 + 2 * quad_lane;
        uint32_t packed = 0;
        if (used && feature < problem.head_dim) {  // head_dim is a multiple of 8
          packed = uint32_t{q_row[feature]} | (uint32_t{q_row[feature + 1]} << 16);
        }
        state.q[ks][set + 2 * half] = packed;
      }
    }
    if (set < MmaWarpState<Traits>::kRowSets) {
      state.max_score[set] = -INFINITY;
      state.sum_exp[set] = 0.0f;
      state.first_key[set] = state.last_key[set] = 0;
      if (used) item_visible_keys(problem, item, t, &state.first_key[set], &state.last_key[set]);
    }
  }
#pragma unroll
  for (int d = 0; d < Traits::kDTiles; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) state.o[d][e] = 0.0f;
  }
}

// One warp's 16 keys of a tile (those of its key warp): S = Q K^T, online softmax, O += P V.
template <class Traits, DType kDType>
__device__ __forceinline__ void mma_consume_tile(const DecodeArgs& args, uint32_t k_stage,
                                                 uint32_t v_stage, int32_t tile_first_key,
                                                 int warp, int lane,
                                                 MmaWarpState<Traits>& state) {
  warp = Traits::key_warp(warp);
  using Ops = MmaOps<kDType>;
  constexpr int kSets = MmaWarpState<Traits>::kRowSets;
  const int matrix = lane / 8, matrix_row = lane % 8;
  const int quad_lane = lane % 4;

  // K fragments: matrices {keys 0-7, dims lo}, {keys 0-7, dims hi}, {keys 8-15, lo}, {8-15, hi}.
  const int k_key = warp * Traits::kKeysPerWarp + (matrix / 2) * 8 + matrix_row;
  const uint32_t k_row = k_stage + k_key * Traits::kRowBytes;
  float s[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < Traits::kKSteps; ++ks) {
    uint32_t kf[4];
    const int chunk = 2 * ks + (matrix & 1);
    ptx::ldmatrix_x4(kf, k_row + ((chunk ^ matrix_row) * 16));
    Ops::mma(s[0], state.q[ks], kf[0], kf[1]);
    Ops::mma(s[1], state.q[ks], kf[2], kf[3]);
  }

  // Scale, mask, online softmax. Element (j, e): row set e / 2, key 8 j + 2 quad_lane + e % 2.
  const int32_t key0 = tile_first_key + warp * Traits::kKeysPerWarp + 2 * quad_lane;
  float rescale[kSets];
  float p[2][4];
#pragma unroll
  for (int set = 0; set < kSets; ++set) {
    float chunk_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 2 * set + c;
        float v = s[j][e] * args.q_scale;
        if (args.soft_cap) v = args.soft_cap_log2 * soft_cap_tanh(v);
        const int32_t key = key0 + 8 * j + c;
        const bool visible = key >= state.first_key[set] && key < state.last_key[set];
        v = visible ? v : -INFINITY;
        s[j][e] = v;
        chunk_max = ptx::max_nan(chunk_max, v);
      }
    }
    chunk_max = ptx::quad_max(chunk_max);
    const float new_max = ptx::max_nan(state.max_score[set], chunk_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    rescale[set] = ptx::ex2_approx(state.max_score[set] - base);
    state.max_score[set] = new_max;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 2 * set + c;
        p[j][e] = ptx::ex2_approx(s[j][e] - base);
        sum += p[j][e];
      }
    }
    state.sum_exp[set] = state.sum_exp[set] * rescale[set] + sum;
  }
  bool moved = rescale[0] != 1.0f;
  if constexpr (kSets == 2) moved = moved || rescale[1] != 1.0f;
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int d = 0; d < Traits::kDTiles; ++d) {
      state.o[d][0] *= rescale[0];
      state.o[d][1] *= rescale[0];
      if constexpr (kSets == 2) {
        state.o[d][2] *= rescale[1];
        state.o[d][3] *= rescale[1];
      }
    }
  }

  uint32_t pf[4];
  pf[0] = Ops::pack(p[0][0], p[0][1]);
  pf[2] = Ops::pack(p[1][0], p[1][1]);
  if constexpr (kSets == 2) {
    pf[1] = Ops::pack(p[0][2], p[0][3]);
    pf[3] = Ops::pack(p[1][2], p[1][3]);
  } else {
    pf[1] = pf[3] = 0u;
  }

  // V fragments (transposed): matrices {keys 0-7, dims d}, {keys 8-15, d}, {0-7, d+1}, {8-15, d+1}.
  const int v_key = warp * Traits::kKeysPerWarp + (matrix & 1) * 8 + matrix_row;
  const uint32_t v_row = v_stage + v_key * Traits::kRowBytes;
#pragma unroll
  for (int dp = 0; dp < Traits::kKSteps; ++dp) {
    uint32_t vf[4];
    const int chunk = 2 * dp + (matrix >> 1);
    ptx::ldmatrix_x4_trans(vf, v_row + ((chunk ^ matrix_row) * 16));
    Ops::mma(state.o[2 * dp], pf, vf[0], vf[1]);
    Ops::mma(state.o[2 * dp + 1], pf, vf[2], vf[3]);
  }
}

// The next item of this CTA, prepared during the current one so that its first K/V copies go out
// as soon as the current item is stored: the work item and its request's metadata are loaded
// after tile 0 is consumed, the page ids of its first kStages tiles after tile 1, while the
// ring's copies are in flight (the loads' latency hides behind the wait for them). Without this
// every item began with four dependent global loads (work item, page_indptr / last_page_len,
// page ids, then K/V).
// The DecodeItem itself waits in shared memory (Traits::kNextItemOffset, written by thread 0):
// held in registers through the key loop it made ptxas spill.
struct NextDecodeItem {
  bool item_ready = false;     // the shared slot holds the next work item
  bool offsets_ready = false;  // its first kStages tiles' key offsets are in the other buffer
};

template <class Traits, DType kDType>
__device__ __forceinline__ void mma_merge_and_store(const DecodeArgs& args, const DecodeItem& item,
                                                    uint8_t* shared, int warp, int lane,
                                                    const MmaWarpState<Traits>& state) {
  constexpr int kSets = MmaWarpState<Traits>::kRowSets;
  auto* merge_o = reinterpret_cast<float*>(shared + Traits::kMergeOOffset);
  auto* merge_max = reinterpret_cast<float*>(shared + Traits::kMergeMaxOffset);
  auto* merge_sum = reinterpret_cast<float*>(shared + Traits::kMergeSumOffset);
  const int group_row = lane / 4, quad_lane = lane % 4;
#pragma unroll
  for (int set = 0; set < kSets; ++set) {
    const int row = group_row + 8 * set;
    const int state_index = warp * Traits::kWarpRows + row;
    float* destination = merge_o + state_index * Traits::kMergeStride + 2 * quad_lane;
#pragma unroll
    for (int d = 0; d < Traits::kDTiles; ++d) {
      *reinterpret_cast<float2*>(destination + 8 * d) =
          make_float2(state.o[d][2 * set], state.o[d][2 * set + 1]);
    }
    const float sum = ptx::quad_sum(state.sum_exp[set]);
    if (quad_lane == 0) {
      merge_max[state_index] = state.max_score[set];
      merge_sum[state_index] = sum;
    }
  }
  __syncthreads();

  const int32_t rows = min(item.rows, Traits::kMaxRows);
  const int32_t quads = args.problem.head_dim / 4;
  for (int32_t task = threadIdx.x; task < rows * quads; task += Traits::kNumThreads) {
    const int32_t row = task / quads;
    const int32_t quad = task - row * quads;
    // The states of `row`: one per key warp of its row tile.
    const int32_t tile = Traits::kRowTiles == 1 ? 0 : row / Traits::kWarpRows;
    const int32_t first_state =
        tile * Traits::kKeyWarps * Traits::kWarpRows + (row - tile * Traits::kWarpRows);
    float best = -INFINITY;
#pragma unroll
    for (int w = 0; w < Traits::kKeyWarps; ++w) {
      best = ptx::max_nan(best, merge_max[first_state + w * Traits::kWarpRows]);
    }
    float4 accumulator = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float total = 0.0f;
    if (best != -INFINITY) {
#pragma unroll
      for (int w = 0; w < Traits::kKeyWarps; ++w) {
        const int state_index = first_state + w * Traits::kWarpRows;
        const float weight = ptx::ex2_approx(merge_max[state_index] - best);
        total += weight * merge_sum[state_index];
        const float4 part = *reinterpret_cast<const float4*>(
            merge_o + state_index * Traits::kMergeStride + quad * 4);
        accumulator.x += weight * part.x;
        accumulator.y += weight * part.y;
        accumulator.z += weight * part.z;
        accumulator.w += weight * part.w;
      }
    }
    const RowFinish finish = finish_decode_row(args, item, row, best, total);
    accumulator.x *= finish.factor;
    accumulator.y *= finish.factor;
    accumulator.z *= finish.factor;
    accumulator.w *= finish.factor;
    store_output_quad<kDType>(args, item, row, quad, accumulator, finish.lse);
  }
  __syncthreads();  // shared memory is reused by the next item
}

// Fused split-KV merge: after a CTA has written a piece's partials, it counts the piece done in
// the tile's counter (workspace, zeroed by every plan upload); the CTA that completes the count
// merges every piece of the tile into o / lse and sets the counter back to 0, so the next run
// (or graph replay) of the same upload starts from zero. No CTA ever waits for another. This
// replaces the separate merge launch (and its launch gap) of the unfused path. Only this
// tensor-core kernel uses it; the CUDA-core kernel (decode_cuda_core.cuh: fp8 K/V, head_dim 256,
// wide items) keeps the separate merge: with the merge's code inlined or called, ptxas spills 24-76
// bytes in several of its sm_80 instantiations.
// Ordering (the threadFenceReduction pattern of the CUDA samples): every writer fences its
// partial stores at gpu scope before the barrier that precedes the count, and the merging CTA
// fences after observing the full count and reads partials through L2 (merge_rows.cuh).
template <DType kQDType>
__device__ __forceinline__ void finish_split_piece(const DecodeArgs& args, const WorkItem& work) {
  if (args.merge_counters == nullptr || work.merge_index < 0) return;
  __threadfence();
  __syncthreads();
  int completes = 0;
  if (threadIdx.x == 0) {
    const int32_t splits = args.merges[work.merge_index].num_splits;
    completes = atomicAdd(args.merge_counters + work.merge_index, 1) + 1 == splits;
  }
  if (!__syncthreads_or(completes)) return;  // uniform across the CTA
  __threadfence();
  merge_split_tile<kQDType>(args.problem, args.merges[work.merge_index], args.partial_o,
                            args.partial_lse, threadIdx.x / 32, blockDim.x / 32, threadIdx.x % 32);
  if (threadIdx.x == 0) args.merge_counters[work.merge_index] = 0;
}

// ---------------------------------------------------------------------------- the policy

template <class Traits_, DType kDType>
struct MmaDecode {
  using Traits = Traits_;
  static constexpr DType kQDType = kDType;
  static constexpr DType kKVDType = kDType;
  struct Cta {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    NextDecodeItem next;
    int parity = 0;  // which key-offset buffer holds the current item's offsets
  };

  __device__ static void run_item(const DecodeArgs& args, int32_t index, int32_t end,
                                  uint8_t* shared, Cta& cta) {
    const int warp = cta.warp, lane = cta.lane;
    NextDecodeItem& next = cta.next;
    // The shared slot was written before the barriers that ended the previous item, and is
    // written again only after the key loop's first barrier.
    const DecodeItem item =
        next.item_ready ? *reinterpret_cast<const DecodeItem*>(shared + Traits::kNextItemOffset)
                        : make_decode_item(args, args.work[index]);
    const bool offsets_ready = next.offsets_ready;
    next.item_ready = next.offsets_ready = false;
    const int32_t next_index = index + 1 < end ? index + 1 : -1;
    MmaWarpState<Traits> state;
    mma_load_rows<Traits, kDType>(args, item, Traits::row_tile(warp), lane, state);

    constexpr int kOffsetsPerBuffer = Traits::kStages * Traits::kTileKeys;
    auto* offsets_base = reinterpret_cast<longlong2*>(shared + Traits::kKeyOffsetsOffset);
    longlong2* key_offsets = offsets_base + cta.parity * kOffsetsPerBuffer;
    longlong2* next_offsets = offsets_base + (cta.parity ^ 1) * kOffsetsPerBuffer;
    const uint32_t k_ring = ptx::shared_address(shared + Traits::kKRingOffset);
    const uint32_t v_ring = ptx::shared_address(shared + Traits::kVRingOffset);
    stream_key_tiles<Traits>(
        args, item, key_offsets, offsets_ready,
        [&](const longlong2* offsets, int stage) {
          issue_tile_copies_swizzled<Traits>(args, shared, offsets, stage);
        },
        [&](int stage, int32_t first_key) {
          mma_consume_tile<Traits, kDType>(args, k_ring + stage * Traits::kTileBytes,
                                           v_ring + stage * Traits::kTileBytes, first_key, warp,
                                           lane, state);
        },
        [&](int32_t tile) {
          // Cross-item prefetch (uniform across the CTA: next_index and tile are).
          if (next_index < 0) return;
          auto* next_item = reinterpret_cast<DecodeItem*>(shared + Traits::kNextItemOffset);
          if (tile == 0) {
            // Read by every thread after the next iteration's barrier (or the end-of-item ones).
            if (threadIdx.x == 0) *next_item = make_decode_item(args, args.work[next_index]);
            next.item_ready = true;
          } else if (tile == 1) {
            // Each thread writes its own indices; read after the next item's first barrier.
            fill_first_key_offsets<Traits>(args, *next_item, next_offsets);
            next.offsets_ready = true;
          }
        });
    mma_merge_and_store<Traits, kDType>(args, item, shared, warp, lane, state);
    finish_split_piece<kDType>(args, item.work);
    if (next.offsets_ready) cta.parity ^= 1;  // the next item's offsets are in the other buffer
  }

  static void describe(char* text, size_t size) {
    std::snprintf(text, size, "sm80::decode_mma_kernel<d%d, %s, rows %d, warps %d, stages %d>",
                  Traits::kHeadDim, decode_dtype_name(kDType), Traits::kMaxRows, Traits::kWarps,
                  Traits::kStages);
  }
};

// ---------------------------------------------------------------------------- host side

// Variant (core/tuning.hpp) = (warps, stages): 1 = (4, 3), 2 = (4, 4), 3 = (2, 6), 4 = (2, 3),
// 5 = (2, 4); items of <= 8 (kFullRows false) or <= 16 packed rows; fp16 and bf16.
template <int kHeadDim, int kVariant, int kWarps, int kStages, bool kFullRows>
KernelRow decode_mma_row() {
  using Traits = DecodeMmaTraits<kHeadDim, kWarps, kStages, kFullRows>;
  KernelRow row;
  row.family = KernelFamily::kSm80DecodeMma;
  row.features = kFullRows ? kKernelFullRows : 0u;
  row.shape.head_dim = Traits::kHeadDim;
  row.shape.num_threads = Traits::kNumThreads;
  row.shape.stages = Traits::kStages;
  row.shape.smem_bytes = Traits::kSmemBytes;
  row.shape.rows = Traits::kMaxRows;
  row.shape.variant = kVariant;
  row.instances = {decode_instance<MmaDecode<Traits, DType::kFloat16>>(),
                   decode_instance<MmaDecode<Traits, DType::kBFloat16>>()};
  return row;
}

template <int kHeadDim, bool kFullRows>
void add_decode_mma_variants(KernelRows& rows) {
  rows.push_back(decode_mma_row<kHeadDim, 1, 4, 3, kFullRows>());
  rows.push_back(decode_mma_row<kHeadDim, 2, 4, 4, kFullRows>());
  rows.push_back(decode_mma_row<kHeadDim, 3, 2, 6, kFullRows>());
  rows.push_back(decode_mma_row<kHeadDim, 4, 2, 3, kFullRows>());
  rows.push_back(decode_mma_row<kHeadDim, 5, 2, 4, kFullRows>());
}

// Wide GQA groups (17..128 packed rows per item, issue 39): kRowTiles m16 row tiles, each over
// kKeyWarps key warps, sharing every K/V stage. Not tuned (variant 0 in the row); chosen by the
// item's row count, the smallest that holds it.
template <int kHeadDim, int kKeyWarps, int kStages, int kRowTiles>
KernelRow decode_mma_wide_row() {
  using Traits = DecodeMmaTraits<kHeadDim, kKeyWarps, kStages, true, kRowTiles>;
  KernelRow row;
  row.family = KernelFamily::kSm80DecodeMma;
  row.features = kKernelFullRows;
  row.shape.head_dim = Traits::kHeadDim;
  row.shape.num_threads = Traits::kNumThreads;
  row.shape.stages = Traits::kStages;
  row.shape.smem_bytes = Traits::kSmemBytes;
  row.shape.rows = Traits::kMaxRows;
  row.shape.variant = 0;
  row.instances = {decode_instance<MmaDecode<Traits, DType::kFloat16>>(),
                   decode_instance<MmaDecode<Traits, DType::kBFloat16>>()};
  return row;
}

// Tensor-core rows of one head_dim bucket. d256 has none: 256 dims of accumulators plus the Q
// fragments spill at 255 registers; it keeps the CUDA-core kernel.
template <int kHeadDim>
void add_decode_mma_rows(KernelRows& rows) {
  if constexpr (kHeadDim <= 128) {
    add_decode_mma_variants<kHeadDim, false>(rows);
    add_decode_mma_variants<kHeadDim, true>(rows);
    // 32 rows: 2 row tiles x 2 key warps (128 threads, 4 stages of 32 keys); 64: 4 x 2 (256,
    // 6 stages); 128: 8 x 1 (256, 9 stages of 16 keys: cp.async.wait_group takes <= 7). At ~170
    // registers a 256-thread CTA is alone on its SM, so the deeper rings keep 56-80 KiB of K/V
    // in flight there.
    rows.push_back(decode_mma_wide_row<kHeadDim, 2, 4, 2>());
    rows.push_back(decode_mma_wide_row<kHeadDim, 2, 6, 4>());
    rows.push_back(decode_mma_wide_row<kHeadDim, 1, 9, 8>());
  }
}

}  // namespace tessera::detail::sm80
