// The CUDA-core compute policy of the sm80 batch decode (decode_kernel.cuh): every K/V dtype
// (fp16, bf16, e4m3, e5m2) and head_dim bucket (64, 128, 256), any number of packed rows.
// Shapes and the shared-memory map are in decode_traits.cuh, element conversions in
// decode_dequant.cuh. Per item:
//   1. passes of up to kRowsPerPass rows (one pass unless q_per_request x group is large): each
//      row slot loads its query rows into registers, pre-scaled so scores come out in base 2;
//   2. the shared key loop (stream_key_tiles): scores per chunk of kKeysPerChunk keys, online
//      softmax, P x V on CUDA cores;
//   3. key partitions of a row group are merged in shared memory and the rows are written.
// Split-KV pieces end as float partials that the separate merge launch combines (with the fused
// merge's code inlined, ptxas spills 24-76 bytes in several sm_80 instantiations).
#pragma once

#include "cuda/sm80/decode_kernel.cuh"

namespace tessera::detail::sm80 {

// ---------------------------------------------------------------------------- loader

// Issues the copies of one K/V tile into ring stage `stage`, whose key-row offsets sit in the
// offsets slot of the same index. Thread t copies chunk t % kCopiesPerRow of rows
// t / kCopiesPerRow + pass * kRowsPerCopyPass: consecutive threads, consecutive 16 bytes.
template <class Traits>
__device__ __forceinline__ void issue_tile_copies(const DecodeArgs& args, uint8_t* shared,
                                                  const longlong2* key_offsets, int stage) {
  const KVSource& kv = args.problem.kv;
  const auto* k_base = static_cast<const uint8_t*>(kv.k);
  const auto* v_base = static_cast<const uint8_t*>(kv.v);
  const int chunk = threadIdx.x % Traits::kCopiesPerRow;
  const int32_t chunk_byte = chunk * Traits::kCopyBytes;
  const int32_t row_bytes = args.problem.head_dim * Traits::kKVBytes;  // real, not padded
  const uint32_t chunk_bytes =
      static_cast<uint32_t>(max(0, min(Traits::kCopyBytes, row_bytes - chunk_byte)));  // 0, 8 or 16
  uint8_t* k_stage = shared + Traits::kKRingOffset + stage * Traits::kTileBytes;
  uint8_t* v_stage = shared + Traits::kVRingOffset + stage * Traits::kTileBytes;
  const longlong2* offsets = key_offsets + stage * Traits::kTileKeys;
#pragma unroll
  for (int pass = 0; pass < Traits::kCopyPasses; ++pass) {
    const int row = threadIdx.x / Traits::kCopiesPerRow + pass * Traits::kRowsPerCopyPass;
    const longlong2 offset = offsets[row];
    const uint32_t valid = offset.x >= 0 ? chunk_bytes : 0u;
    const int64_t k_byte = offset.x * Traits::kKVBytes + chunk_byte;
    const int64_t v_byte = offset.y * Traits::kKVBytes + chunk_byte;
    const int shared_byte = row * Traits::kRowBytes + chunk_byte;
    copy_key_chunk(k_stage + shared_byte, valid > 0 ? k_base + k_byte : k_base, valid,
                   args.copy_granularity, kv.k);
    copy_key_chunk(v_stage + shared_byte, valid > 0 ? v_base + v_byte : v_base, valid,
                   args.copy_granularity, kv.v);
  }
}

// ---------------------------------------------------------------------------- compute

// The query rows one row slot holds, with their softmax state.
template <class Traits>
struct SlotRows {
  static constexpr int kRows = Traits::kRowsPerThread;
  float q[kRows][Traits::kVec];  // pre-scaled query features of this lane
  float o[kRows][Traits::kVec];  // unnormalised output features of this lane
  float max_score[kRows];        // running max of the base-2 scores (-inf: none yet)
  float sum_exp[kRows];          // running sum of 2^(score - max_score)
  int32_t first_key[kRows];      // visible keys [first_key, last_key); empty for padding rows
  int32_t last_key[kRows];
};

template <class Traits, DType kQDType>
__device__ __forceinline__ void load_slot_rows(const DecodeArgs& args, const DecodeItem& item,
                                               int32_t first_row, bool active, int lane,
                                               SlotRows<Traits>& rows) {
  const AttentionProblem& problem = args.problem;
#pragma unroll
  for (int i = 0; i < Traits::kRowsPerThread; ++i) {
    const int32_t row = first_row + i;
    rows.max_score[i] = -INFINITY;
    rows.sum_exp[i] = 0.0f;
    rows.first_key[i] = rows.last_key[i] = 0;
#pragma unroll
    for (int e = 0; e < Traits::kVec; ++e) rows.q[i][e] = rows.o[i][e] = 0.0f;
    if (!active || row >= item.rows) continue;
    const int32_t t = row / item.group;
    const int32_t head = item.work.kv_head * item.group + (row - t * item.group);
    const int64_t token = problem.q_begin(item.work.request) + item.work.q_start + t;
    const auto* q_row = static_cast<const uint16_t*>(problem.q) + token * problem.q_stride_token +
                        head * problem.q_stride_head;
#pragma unroll
    for (int e = 0; e < Traits::kVec; ++e) {
      const int feature = lane * Traits::kVec + e;
      if (feature < problem.head_dim) {
        rows.q[i][e] = QElement<kQDType>::load(q_row + feature) * args.q_scale;
      }
    }
    item_visible_keys(problem, item, t, &rows.first_key[i], &rows.last_key[i]);
  }
}

// Scores, online softmax and P x V for the chunks of one tile that belong to this slot's key
// partition. The step count is the same for every slot of the CTA, so the shuffles inside are
// executed by all lanes of every warp; a slot without a chunk in a step masks all its keys.
template <class Traits, DType kKVDType>
__device__ __forceinline__ void consume_tile(const DecodeArgs& args, const uint8_t* k_stage,
                                             const uint8_t* v_stage, int32_t tile_first_key,
                                             int partitions, int partition, int lane,
                                             SlotRows<Traits>& rows) {
  constexpr int kRows = Traits::kRowsPerThread;
  constexpr int kKeys = Traits::kKeysPerChunk;
  const int steps = (Traits::kChunksPerTile + partitions - 1) / partitions;
  const int lane_byte = lane * Traits::kVec * Traits::kKVBytes;
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    const int chunk = partition + step * partitions;
    const bool chunk_valid = partition < partitions && chunk < Traits::kChunksPerTile;
    const int chunk_row = (chunk_valid ? chunk : 0) * kKeys;
    const int32_t chunk_first_key = tile_first_key + chunk * kKeys;

    float score[kKeys][kRows];
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      float key[Traits::kVec];
      KVElement<kKVDType>::load8(k_stage + (chunk_row + k) * Traits::kRowBytes + lane_byte, key);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < Traits::kVec; ++e) dot = fmaf(rows.q[i][e], key[e], dot);
        score[k][i] = row_slot_sum<Traits::kLanesPerRow>(dot);
      }
    }

    float probability[kKeys][kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float chunk_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        float s = args.soft_cap ? args.soft_cap_log2 * soft_cap_tanh(score[k][i]) : score[k][i];
        const int32_t key_index = chunk_first_key + k;
        const bool visible =
            chunk_valid && key_index >= rows.first_key[i] && key_index < rows.last_key[i];
        s = visible ? s : -INFINITY;
        score[k][i] = s;
        chunk_max = ptx::max_nan(chunk_max, s);
      }
      const float new_max = ptx::max_nan(rows.max_score[i], chunk_max);
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // no -inf - -inf
      const float rescale = ptx::ex2_approx(rows.max_score[i] - base);
      rows.max_score[i] = new_max;
      float sum = rows.sum_exp[i] * rescale;
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        probability[k][i] = ptx::ex2_approx(score[k][i] - base);
        sum += probability[k][i];
      }
      rows.sum_exp[i] = sum;
#pragma unroll
      for (int e = 0; e < Traits::kVec; ++e) rows.o[i][e] *= rescale;
    }

#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      float value[Traits::kVec];
      KVElement<kKVDType>::load8(v_stage + (chunk_row + k) * Traits::kRowBytes + lane_byte, value);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
#pragma unroll
        for (int e = 0; e < Traits::kVec; ++e) {
          rows.o[i][e] = fmaf(probability[k][i], value[e], rows.o[i][e]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------- epilogue

// Merges the key partitions of every row group of the pass and writes the rows.
template <class Traits, DType kQDType>
__device__ __forceinline__ void merge_and_store(const DecodeArgs& args, const DecodeItem& item,
                                                uint8_t* shared, int32_t first_group, int groups,
                                                int partitions, int slot, int lane,
                                                const SlotRows<Traits>& rows) {
  constexpr int kRows = Traits::kRowsPerThread;
  auto* merge_o = reinterpret_cast<float*>(shared + Traits::kMergeOOffset);
  auto* merge_max = reinterpret_cast<float*>(shared + Traits::kMergeMaxOffset);
  auto* merge_sum = reinterpret_cast<float*>(shared + Traits::kMergeSumOffset);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float* destination = merge_o + (slot * kRows + i) * Traits::kHeadDim + lane * Traits::kVec;
#pragma unroll
    for (int e = 0; e < Traits::kVec; e += 4) {
      *reinterpret_cast<float4*>(destination + e) =
          make_float4(rows.o[i][e], rows.o[i][e + 1], rows.o[i][e + 2], rows.o[i][e + 3]);
    }
    if (lane == 0) {
      merge_max[slot * kRows + i] = rows.max_score[i];
      merge_sum[slot * kRows + i] = rows.sum_exp[i];
    }
  }
  __syncthreads();

  const int32_t rows_in_pass = min(groups * kRows, item.rows - first_group * kRows);
  const int32_t quads = args.problem.head_dim / 4;
  for (int32_t task = threadIdx.x; task < rows_in_pass * quads; task += Traits::kNumThreads) {
    const int32_t local_row = task / quads;
    const int32_t quad = task - local_row * quads;
    const int group_index = local_row / kRows, i = local_row % kRows;
    float best = -INFINITY;
    for (int p = 0; p < partitions; ++p) {
      best = ptx::max_nan(best, merge_max[(p * groups + group_index) * kRows + i]);
    }
    float4 accumulator = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float total = 0.0f;
    if (best != -INFINITY) {
      for (int p = 0; p < partitions; ++p) {
        const int state = (p * groups + group_index) * kRows + i;
        const float weight = ptx::ex2_approx(merge_max[state] - best);
        total += weight * merge_sum[state];
        const float4 part =
            *reinterpret_cast<const float4*>(merge_o + state * Traits::kHeadDim + quad * 4);
        accumulator.x += weight * part.x;
        accumulator.y += weight * part.y;
        accumulator.z += weight * part.z;
        accumulator.w += weight * part.w;
      }
    }
    const int32_t row = first_group * kRows + local_row;
    const RowFinish finish = finish_decode_row(args, item, row, best, total);
    accumulator.x *= finish.factor;
    accumulator.y *= finish.factor;
    accumulator.z *= finish.factor;
    accumulator.w *= finish.factor;
    store_output_quad<kQDType>(args, item, row, quad, accumulator, finish.lse);
  }
  __syncthreads();  // shared memory is reused by the next pass / item
}

// ---------------------------------------------------------------------------- the kernel

// ---------------------------------------------------------------------------- the policy

template <class Traits_, DType kQDType_, DType kKVDType_>
struct CudaCoreDecode {
  using Traits = Traits_;
  static constexpr DType kQDType = kQDType_;
  static constexpr DType kKVDType = kKVDType_;
  struct Cta {};

  __device__ static void run_item(const DecodeArgs& args, int32_t index, int32_t /*end*/,
                                  uint8_t* shared, Cta& /*cta*/) {
    constexpr int kRows = Traits::kRowsPerThread;
    const DecodeItem item = make_decode_item(args, args.work[index]);
    const int slot = threadIdx.x / Traits::kLanesPerRow;
    const int lane = threadIdx.x % Traits::kLanesPerRow;
    const int32_t row_groups = (item.rows + kRows - 1) / kRows;
    auto* key_offsets = reinterpret_cast<longlong2*>(shared + Traits::kKeyOffsetsOffset);
    for (int32_t first_group = 0; first_group < row_groups; first_group += Traits::kSlots) {
      // Row groups of this pass take the first slots; when there are fewer groups than slots the
      // slots left over become extra key partitions of the groups (partition p of group g is
      // slot p * groups + g); slots past partitions * groups idle with empty rows.
      const int groups = min(Traits::kSlots, row_groups - first_group);
      const int partitions = Traits::kSlots / groups;
      const int slot_group = slot % groups, partition = slot / groups;
      const bool active = partition < partitions;
      SlotRows<Traits> rows;
      load_slot_rows<Traits, kQDType>(args, item, (first_group + slot_group) * kRows, active,
                                      lane, rows);
      stream_key_tiles<Traits>(
          args, item, key_offsets, false,
          [&](const longlong2* offsets, int stage) {
            issue_tile_copies<Traits>(args, shared, offsets, stage);
          },
          [&](int stage, int32_t first_key) {
            consume_tile<Traits, kKVDType>(
                args, shared + Traits::kKRingOffset + stage * Traits::kTileBytes,
                shared + Traits::kVRingOffset + stage * Traits::kTileBytes, first_key,
                partitions, partition, lane, rows);
          },
          [](int32_t) {});
      merge_and_store<Traits, kQDType>(args, item, shared, first_group, groups, partitions, slot,
                                       lane, rows);
    }
  }

  static void describe(char* text, size_t size) {
    std::snprintf(text, size, "sm80::decode_kernel<d%d, q %s, kv %s, rows %d>", Traits::kHeadDim,
                  decode_dtype_name(kQDType), decode_dtype_name(kKVDType), Traits::kRowsPerThread);
  }
};

// ---------------------------------------------------------------------------- host side

// One row per row-slot height: q fp16/bf16 x K/V (q's dtype, e4m3, e5m2). The fp8 instances
// have other traits (1-byte elements) but the same rows and threads; the row shows the 2-byte
// one.
template <int kHeadDim, DType kQDType, DType kKVDType, int kRowsPerThread>
KernelInstance cuda_core_decode_instance() {
  using Traits = DecodeTraits<kHeadDim, KVElement<kKVDType>::kBytes, kRowsPerThread>;
  return decode_instance<CudaCoreDecode<Traits, kQDType, kKVDType>>();
}

template <int kHeadDim, int kRowsPerThread>
KernelRow decode_row() {
  using Traits = DecodeTraits<kHeadDim, 2, kRowsPerThread>;
  KernelRow row;
  row.family = KernelFamily::kSm80Decode;
  row.shape.head_dim = Traits::kHeadDim;
  row.shape.num_threads = Traits::kNumThreads;
  row.shape.smem_bytes = Traits::kSmemBytes;
  row.shape.rows = Traits::kRowsPerThread;
  constexpr DType kF16 = DType::kFloat16, kB16 = DType::kBFloat16;
  constexpr DType kE4M3 = DType::kFloat8E4M3, kE5M2 = DType::kFloat8E5M2;
  row.instances = {cuda_core_decode_instance<kHeadDim, kF16, kF16, kRowsPerThread>(),
                   cuda_core_decode_instance<kHeadDim, kF16, kE4M3, kRowsPerThread>(),
                   cuda_core_decode_instance<kHeadDim, kF16, kE5M2, kRowsPerThread>(),
                   cuda_core_decode_instance<kHeadDim, kB16, kB16, kRowsPerThread>(),
                   cuda_core_decode_instance<kHeadDim, kB16, kE4M3, kRowsPerThread>(),
                   cuda_core_decode_instance<kHeadDim, kB16, kE5M2, kRowsPerThread>()};
  return row;
}

// The three row-slot heights (1, 2, 4) of one head_dim bucket: 18 kernels.
template <int kHeadDim>
void add_decode_rows(KernelRows& rows) {
  rows.push_back(decode_row<kHeadDim, 1>());
  rows.push_back(decode_row<kHeadDim, 2>());
  rows.push_back(decode_row<kHeadDim, 4>());
}

}  // namespace tessera::detail::sm80
