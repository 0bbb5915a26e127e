// The fast CPU attention kernel (FlashAttention-2 on the CPU) and the glue between the
// ISA-neutral driver (fast_attention.cpp) and the per-ISA translation units.
//
// One work item = query rows [q_start, q_start + q_len) of one request for every query head of
// one kv head, against keys [kv_start, kv_end). The q_len x group_size query rows are packed
// into one block (row r = token * group_size + head in group), so every K/V tile is converted to
// float once and reused by the whole GQA group. Per key tile:
//   S^T = K Q^T          [keys x rows]: register-blocked, vectorised over query rows;
//   online softmax       row statistics are vectors over rows, so max / exp2 / sums vectorise;
//   O = O * alpha + P V  [rows x head_dim]: register-blocked, vectorised over head_dim.
// Q is pre-scaled by sm_scale * k_scale * log2(e) so the softmax runs on exp2.
// Non-finite inputs (include/tessera/attention.hpp) cost no per-element test: a NaN or +inf
// score turns its row's running sum NaN (online_softmax), checked once per row at the end
// (write_rows); only a partly visible tile scans its V for NaN / inf (accumulate_tile).
//
// The kernel is a template over a `Simd` policy (vector type, lane count, register-block shape,
// fp16/bf16 conversions). Each ISA translation unit defines its policy in an anonymous namespace
// and instantiates the template there, so the differently compiled copies never meet at link
// time (no ODR clash between, say, an AVX-512 and a baseline build of the same function).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/problem.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_masks.hpp"
#include "cpu/sink.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// What every work item of one call shares, resolved once by the driver.
struct FastAttentionContext {
  const AttentionProblem* problem = nullptr;
  int32_t group_size = 1;
  // Q is multiplied by q_scale as it is converted. Without soft-cap q_scale is
  // sm_scale * k_scale * log2(e), so Q.K is the base-2 logit; with soft-cap it is
  // sm_scale * k_scale / cap and the kernel maps x -> cap * log2(e) * tanh(x).
  float q_scale = 1.0f;
  float soft_cap = 0.0f;
  float out_scale = 1.0f;            // v_scale, applied once per output row
  const float* fp8_table = nullptr;  // byte -> float for fp8 K/V (256 entries)
  float* partial_o = nullptr;        // workspace rows for split-KV partials
  float* partial_lse = nullptr;
};

// Entry points of one ISA's kernel.
struct FastKernelEntry {
  // Scratch one thread needs to run any work item of at most `max_rows` packed query rows.
  size_t (*scratch_bytes)(int32_t max_rows, int32_t head_dim, int32_t head_dim_vo);
  void (*run_work_item)(const FastAttentionContext& context, const WorkItem& item, void* scratch);
};
FastKernelEntry fast_kernel_generic();
FastKernelEntry fast_kernel_avx2();
FastKernelEntry fast_kernel_avx512();

// cpu_fast_attention with an explicit ISA (tests run every ISA the host supports).
void cpu_fast_attention_with_isa(const Plan& plan, const AttentionProblem& problem,
                                 Workspace workspace, CpuIsa isa);

// Keys per tile: K and V tiles (64 x 256 floats at most) stay in L2 while the Q block and the
// running O stream through L1 against them.
inline constexpr int32_t kFastKeyTile = 64;

template <class Simd>
class FlashAttentionKernel {
 public:
  static size_t scratch_bytes(int32_t max_rows, int32_t head_dim, int32_t head_dim_vo) {
    return ScratchLayout(std::max(max_rows, 1), head_dim, head_dim_vo).total;
  }

  static void run_work_item(const FastAttentionContext& context, const WorkItem& item,
                            void* scratch);

 private:
  using Vec = typename Simd::Vec;
  static constexpr int32_t kLanes = Simd::kLanes;
  static constexpr int32_t kQkRowVecs = Simd::kQkRowVecs;    // S block: query rows (vectors)
  static constexpr int32_t kQkKeys = Simd::kQkKeys;          // S block: keys (broadcasts)
  static constexpr int32_t kPvRows = Simd::kPvRows;          // O block: rows (broadcasts)
  static constexpr int32_t kPvDimVecs = Simd::kPvDimVecs;    // O block: head_dim (vectors)
  static constexpr int32_t kDotRows = Simd::kDotRows;        // dot-product S block: rows
  static constexpr int32_t kDotMaxRows = Simd::kDotMaxRows;  // dot-product S up to this many rows
  static constexpr int32_t kConvertChunk = Simd::kConvertChunk;  // fp16/bf16 per convert
  static constexpr size_t kAlignBytes = 64;
  static constexpr float kLog2E = 1.4426950408889634f;
  static_assert(kLanes % kPvRows == 0, "O row blocks must tile the padded row count");
  static_assert(kFastKeyTile % kQkKeys == 0, "S key blocks must tile a key tile");
  static_assert(kLanes % kDotRows == 0 && kFastKeyTile % kLanes == 0,
                "dot-product S blocks must tile the padded rows and a key tile");
  static_assert(kDotMaxRows <= kLanes, "dot-product rows must fit the padded row count");

  static int32_t round_up(int32_t x, int32_t to) { return (x + to - 1) / to * to; }
  // Local fill: a std::fill<float*> instantiated here with wide-ISA flags could be the copy the
  // linker keeps for the baseline translation units too.
  static void fill(float* dst, int32_t n, float value) {
    for (int32_t i = 0; i < n; ++i) dst[i] = value;
  }

  // Byte offsets of the per-thread buffers of one work item.
  struct ScratchLayout {
    int32_t rows_padded;  // query rows, padded to whole vectors
    int32_t qk_padded;    // head_dim (q / k width), padded to whole vectors (Q and K rows)
    int32_t dim_padded;   // head_dim_vo, padded to whole vectors (V and O rows)
    size_t q_t, o, row_max, row_sum, row_alpha, k_tile, v_tile, s_tile, row_buffer, k_offsets,
        v_offsets, first_key, last_key, mask_words, total;

    ScratchLayout(int32_t rows, int32_t head_dim, int32_t head_dim_vo)
        : rows_padded(round_up(rows, kLanes)),
          qk_padded(round_up(head_dim, kLanes)),
          dim_padded(round_up(head_dim_vo, kLanes)) {
      size_t offset = 0;
      auto take = [&offset](size_t bytes) {
        const size_t at = offset;
        offset += (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
        return at;
      };
      const size_t f = sizeof(float);
      q_t = take(f * qk_padded * rows_padded);  // Q^T, or row-major Q for few rows
      o = take(f * rows_padded * dim_padded);
      row_max = take(f * rows_padded);
      row_sum = take(f * rows_padded);
      row_alpha = take(f * rows_padded);
      k_tile = take(f * kFastKeyTile * qk_padded);
      v_tile = take(f * kFastKeyTile * dim_padded);
      s_tile = take(f * kFastKeyTile * rows_padded);
      row_buffer = take(f * std::max(qk_padded, dim_padded) + f * kConvertChunk);
      k_offsets = take(sizeof(int64_t) * kFastKeyTile);
      v_offsets = take(sizeof(int64_t) * kFastKeyTile);
      first_key = take(sizeof(int32_t) * rows);
      last_key = take(sizeof(int32_t) * rows);
      mask_words = take(sizeof(uint64_t) * rows);  // per token: its visible keys of a tile
      total = offset + kAlignBytes;                // room to align the caller's base pointer
    }
  };

  // ---- vector math ----

  // 2^x with a degree-6 polynomial on the fractional part (Cephes exp2f, rel. error ~2e-7).
  // Inputs are clamped to [-127, 127]: at -127 the exponent field is 0, so exp2(-inf) and every
  // masked logit give exactly 0, which is what keeps fully masked rows at o = 0. NaN passes
  // through: Simd::max / min return their second operand when either is NaN (x86 maxps / minps;
  // the generic policy's compare-and-select alike), so the bound goes first. exp2(NaN) = NaN is
  // what carries a NaN / +inf score into the row sum (see online_softmax).
  static Vec exp2(Vec x) {
    constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    x = Simd::min(Simd::set1(127.0f), Simd::max(Simd::set1(-127.0f), x));
    const Vec shifted = Simd::add(x, Simd::set1(kRoundMagic));
    const Vec whole = Simd::sub(shifted, Simd::set1(kRoundMagic));
    const Vec f = Simd::sub(x, whole);
    Vec p = Simd::set1(1.535336188319500e-4f);
    p = Simd::fmadd(p, f, Simd::set1(1.339887440266574e-3f));
    p = Simd::fmadd(p, f, Simd::set1(9.618437357674640e-3f));
    p = Simd::fmadd(p, f, Simd::set1(5.550332471162809e-2f));
    p = Simd::fmadd(p, f, Simd::set1(2.402264791363012e-1f));
    p = Simd::fmadd(p, f, Simd::set1(6.931472028550421e-1f));
    p = Simd::fmadd(p, f, Simd::set1(1.0f));
    return Simd::mul(p, Simd::pow2_from_shifted(shifted));
  }

  // ---- conversions ----

  // Converts n elements at element `offset` of `base` (any K/V/Q dtype) to float.
  static void load_row(const void* base, DType dtype, int64_t offset, int32_t n,
                       const float* fp8_table, float* dst) {
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(dst, static_cast<const float*>(base) + offset, sizeof(float) * n);
        return;
      case DType::kFloat16:
      case DType::kBFloat16: {
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
        const bool fp16 = dtype == DType::kFloat16;
        int32_t d = 0;
        for (; d + kConvertChunk <= n; d += kConvertChunk) {
          fp16 ? Simd::load_fp16(src + d, dst + d) : Simd::load_bf16(src + d, dst + d);
        }
        if (d < n) {  // head_dim not a multiple of the chunk: convert a padded copy
          uint16_t tail[kConvertChunk] = {};
          float converted[kConvertChunk];
          std::memcpy(tail, src + d, sizeof(uint16_t) * (n - d));
          fp16 ? Simd::load_fp16(tail, converted) : Simd::load_bf16(tail, converted);
          std::memcpy(dst + d, converted, sizeof(float) * (n - d));
        }
        return;
      }
      case DType::kFloat8E4M3:
      case DType::kFloat8E5M2: {
        const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
        for (int32_t d = 0; d < n; ++d) dst[d] = fp8_table[src[d]];
        return;
      }
      default: std::memset(dst, 0, sizeof(float) * n); return;
    }
  }

  // Stores n floats as `dtype` (fp32 / fp16 / bf16, round-to-nearest-even).
  static void store_row(const float* src, DType dtype, int32_t n, void* base, int64_t offset) {
    if (dtype == DType::kFloat32) {
      std::memcpy(static_cast<float*>(base) + offset, src, sizeof(float) * n);
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(base) + offset;
    const bool fp16 = dtype == DType::kFloat16;
    int32_t d = 0;
    for (; d + kConvertChunk <= n; d += kConvertChunk) {
      fp16 ? Simd::store_fp16(src + d, dst + d) : Simd::store_bf16(src + d, dst + d);
    }
    if (d < n) {
      float tail[kConvertChunk] = {};
      uint16_t converted[kConvertChunk];
      std::memcpy(tail, src + d, sizeof(float) * (n - d));
      fp16 ? Simd::store_fp16(tail, converted) : Simd::store_bf16(tail, converted);
      std::memcpy(dst + d, converted, sizeof(uint16_t) * (n - d));
    }
  }

  // ---- K/V addressing ----

  // Element offsets of K and V rows key0 .. key0+keys-1 of (request, kv_head). Same arithmetic
  // as KVSource::k_offset / v_offset, but walking pages incrementally: one division per tile
  // instead of two per key.
  static void tile_offsets(const KVSource& kv, int32_t request, int32_t kv_head, int32_t key0,
                           int32_t keys, int64_t* k_offsets, int64_t* v_offsets) {
    const int64_t k_head = static_cast<int64_t>(kv_head) * kv.k_stride_head;
    const int64_t v_head = static_cast<int64_t>(kv_head) * kv.v_stride_head;
    if (!kv.paged) {
      const int64_t row0 = static_cast<int64_t>(kv.kv_indptr[request]) + key0;
      for (int32_t j = 0; j < keys; ++j) {
        k_offsets[j] = (row0 + j) * kv.k_stride_token + k_head;
        v_offsets[j] = (row0 + j) * kv.v_stride_token + v_head;
      }
      return;
    }
    const int32_t* pages = kv.page_indices + kv.page_indptr[request];
    int32_t page_slot = key0 / kv.page_size;
    int32_t in_page = key0 % kv.page_size;
    for (int32_t j = 0; j < keys; ++j) {
      const int64_t page = pages[page_slot];
      k_offsets[j] = page * kv.k_stride_page + in_page * kv.k_stride_token + k_head;
      v_offsets[j] = page * kv.v_stride_page + in_page * kv.v_stride_token + v_head;
      if (++in_page == kv.page_size) {
        in_page = 0;
        ++page_slot;
      }
    }
  }

  // Prefetches (into L2) the cache lines of `keys` rows of head_dim elements of element_bytes.
  static void prefetch_rows(const void* base, const int64_t* offsets, int32_t keys,
                            int64_t element_bytes, int64_t row_bytes) {
    constexpr int64_t kCacheLine = 64;
    for (int32_t j = 0; j < keys; ++j) {
      const char* row = static_cast<const char*>(base) + offsets[j] * element_bytes;
      for (int64_t line = 0; line < row_bytes; line += kCacheLine) {
        __builtin_prefetch(row + line, 0, 2);
      }
    }
  }

  // ---- register-blocked micro-kernels ----

  // s[j][r] = sum_d k[j][d] * q_t[d][r] for kKeys keys x kRowVecs vectors of rows.
  template <int kRowVecs, int kKeys>
  static void score_block(const float* q_t, int32_t rows_padded, const float* k, int32_t k_stride,
                          int32_t head_dim, float* s) {
    Vec acc[kKeys][kRowVecs];
    for (int j = 0; j < kKeys; ++j)
      for (int i = 0; i < kRowVecs; ++i) acc[j][i] = Simd::zero();
    for (int32_t d = 0; d < head_dim; ++d) {
      Vec q[kRowVecs];
      for (int i = 0; i < kRowVecs; ++i) q[i] = Simd::load(q_t + d * rows_padded + i * kLanes);
      for (int j = 0; j < kKeys; ++j) {
        const Vec key = Simd::set1(k[j * k_stride + d]);
        for (int i = 0; i < kRowVecs; ++i) acc[j][i] = Simd::fmadd(key, q[i], acc[j][i]);
      }
    }
    for (int j = 0; j < kKeys; ++j)
      for (int i = 0; i < kRowVecs; ++i) Simd::store(s + j * rows_padded + i * kLanes, acc[j][i]);
  }

  // o[r][:] = o[r][:] * alpha[r] + sum_j p[j][r] * v[j][:] for kRows rows x kDimVecs vectors.
  template <int kRows, int kDimVecs>
  static void value_block(const float* p, int32_t rows_padded, const float* v, int32_t dim_padded,
                          int32_t keys, const float* alpha, float* o) {
    Vec acc[kRows][kDimVecs];
    for (int r = 0; r < kRows; ++r) {
      const Vec scale = Simd::set1(alpha[r]);
      for (int i = 0; i < kDimVecs; ++i) {
        acc[r][i] = Simd::mul(Simd::load(o + r * dim_padded + i * kLanes), scale);
      }
    }
    for (int32_t j = 0; j < keys; ++j) {
      Vec value[kDimVecs];
      for (int i = 0; i < kDimVecs; ++i) value[i] = Simd::load(v + j * dim_padded + i * kLanes);
      for (int r = 0; r < kRows; ++r) {
        const Vec weight = Simd::set1(p[j * rows_padded + r]);
        for (int i = 0; i < kDimVecs; ++i) acc[r][i] = Simd::fmadd(weight, value[i], acc[r][i]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < kDimVecs; ++i) Simd::store(o + r * dim_padded + i * kLanes, acc[r][i]);
  }

  // Few query rows (decode, small GQA groups): s[j][r] = q[r] . k[j] as dot products over
  // head_dim, so the work follows the real rows instead of whole vectors of rows. One block is
  // kDotRowsBlock rows x (kLanes / kDotRowsBlock) keys: kLanes accumulators, reduced at the end
  // into one vector whose lane i is the sum of accumulator i. q and k rows are zero-padded to
  // dim_padded.
  template <int kDotRowsBlock>
  static void dot_score_block(const float* q, const float* k, int32_t dim_padded,
                              int32_t rows_padded, float* s) {
    constexpr int kKeys = kLanes / kDotRowsBlock;
    Vec acc[kLanes];  // accumulator of (key j, row r) at j * kDotRowsBlock + r
    for (int i = 0; i < kLanes; ++i) acc[i] = Simd::zero();
    for (int32_t d = 0; d < dim_padded; d += kLanes) {
      Vec query[kDotRowsBlock];
      for (int r = 0; r < kDotRowsBlock; ++r) query[r] = Simd::load(q + r * dim_padded + d);
      for (int j = 0; j < kKeys; ++j) {
        const Vec key = Simd::load(k + j * dim_padded + d);
        for (int r = 0; r < kDotRowsBlock; ++r) {
          acc[j * kDotRowsBlock + r] = Simd::fmadd(query[r], key, acc[j * kDotRowsBlock + r]);
        }
      }
    }
    float sums[kLanes];
    Simd::store(sums, Simd::reduce_lanes(acc));
    for (int j = 0; j < kKeys; ++j)
      for (int r = 0; r < kDotRowsBlock; ++r) s[j * rows_padded + r] = sums[j * kDotRowsBlock + r];
  }

  // S^T tile for rows <= kDotMaxRows; keys are processed up to a multiple of kLanes.
  static void compute_scores_dot(const float* q, int32_t rows, int32_t rows_padded,
                                 const float* k_tile, int32_t dim_padded, int32_t keys,
                                 float* s_tile) {
    const int32_t keys_blocked = round_up(keys, kLanes);
    if (rows == 1) {
      for (int32_t j = 0; j < keys_blocked; j += kLanes) {
        dot_score_block<1>(q, k_tile + j * dim_padded, dim_padded, rows_padded,
                           s_tile + j * rows_padded);
      }
      return;
    }
    constexpr int32_t kKeys = kLanes / kDotRows;
    for (int32_t r = 0; r < rows; r += kDotRows) {
      for (int32_t j = 0; j < keys_blocked; j += kKeys) {
        dot_score_block<kDotRows>(q + r * dim_padded, k_tile + j * dim_padded, dim_padded,
                                  rows_padded, s_tile + j * rows_padded + r);
      }
    }
  }

  // S^T tile = K tile . Q^T over all padded rows; keys_padded is a multiple of kQkKeys.
  static void compute_scores(const float* q_t, int32_t rows_padded, const float* k_tile,
                             int32_t dim_padded, int32_t head_dim, int32_t keys_padded,
                             float* s_tile) {
    const int32_t row_vecs = rows_padded / kLanes;
    int32_t rv = 0;
    for (; rv + kQkRowVecs <= row_vecs; rv += kQkRowVecs) {
      for (int32_t j = 0; j < keys_padded; j += kQkKeys) {
        score_block<kQkRowVecs, kQkKeys>(q_t + rv * kLanes, rows_padded, k_tile + j * dim_padded,
                                         dim_padded, head_dim,
                                         s_tile + j * rows_padded + rv * kLanes);
      }
    }
    for (; rv < row_vecs; ++rv) {
      for (int32_t j = 0; j < keys_padded; j += kQkKeys) {
        score_block<1, kQkKeys>(q_t + rv * kLanes, rows_padded, k_tile + j * dim_padded, dim_padded,
                                head_dim, s_tile + j * rows_padded + rv * kLanes);
      }
    }
  }

  // O = O * alpha + P V for the first pv_rows rows (a multiple of kPvRows).
  static void accumulate_values(const float* p_tile, int32_t rows_padded, int32_t pv_rows,
                                const float* v_tile, int32_t dim_padded, int32_t keys,
                                const float* alpha, float* o) {
    const int32_t dim_vecs = dim_padded / kLanes;
    int32_t dv = 0;
    for (; dv + kPvDimVecs <= dim_vecs; dv += kPvDimVecs) {
      for (int32_t r = 0; r < pv_rows; r += kPvRows) {
        value_block<kPvRows, kPvDimVecs>(p_tile + r, rows_padded, v_tile + dv * kLanes, dim_padded,
                                         keys, alpha + r, o + r * dim_padded + dv * kLanes);
      }
    }
    for (; dv < dim_vecs; ++dv) {
      for (int32_t r = 0; r < pv_rows; r += kPvRows) {
        value_block<kPvRows, 1>(p_tile + r, rows_padded, v_tile + dv * kLanes, dim_padded, keys,
                                alpha + r, o + r * dim_padded + dv * kLanes);
      }
    }
  }

  // True when every element of the first `keys` V rows is finite: 0 * x is 0 for finite x and
  // NaN for NaN / inf, so one FMA per vector and a single check at the end.
  static bool values_finite(const float* v_tile, int32_t keys, int32_t dim_padded) {
    Vec acc = Simd::zero();
    const Vec zero = Simd::zero();
    const int32_t count = keys * dim_padded;
    for (int32_t i = 0; i < count; i += kLanes)
      acc = Simd::fmadd(Simd::load(v_tile + i), zero, acc);
    float lanes[kLanes];
    Simd::store(lanes, acc);
    bool finite = true;
    for (int32_t i = 0; i < kLanes; ++i) finite = finite && lanes[i] == 0.0f;
    return finite;
  }

  // O = O * alpha + P V for one tile. A tile that some row sees only in part holds keys masked
  // for that row with p = 0 exactly, and 0 * (NaN or inf) in their V would reach the row: a
  // masked key must not be read. So when such a tile's V is not all finite (rare: one scan of
  // the tile), each row accumulates only its own visible keys.
  [[gnu::always_inline]] static void accumulate_tile(const float* p_tile, int32_t rows,
                                                     int32_t rows_padded, int32_t pv_rows,
                                                     const float* v_tile, int32_t dim_padded,
                                                     int32_t keys, int32_t key0, bool all_visible,
                                                     int32_t group_size, const int32_t* first_key,
                                                     const int32_t* last_key, const float* alpha,
                                                     const uint64_t* mask_words, float* o) {
    if (all_visible || values_finite(v_tile, keys, dim_padded)) {
      accumulate_values(p_tile, rows_padded, pv_rows, v_tile, dim_padded, keys, alpha, o);
      return;
    }
    if (mask_words != nullptr) {
      accumulate_mask_runs(p_tile, rows, rows_padded, v_tile, dim_padded, group_size, mask_words,
                           alpha, o);
      return;
    }
    const int32_t dim_vecs = dim_padded / kLanes;
    for (int32_t r = 0; r < rows; ++r) {
      const int32_t t = r / group_size;
      const int32_t lo = std::clamp(first_key[t] - key0, 0, keys);
      const int32_t hi = std::clamp(last_key[t] - key0, lo, keys);
      const float* p = p_tile + lo * rows_padded + r;
      const float* v = v_tile + lo * dim_padded;
      float* o_row = o + r * dim_padded;
      int32_t dv = 0;
      for (; dv + kPvDimVecs <= dim_vecs; dv += kPvDimVecs) {
        value_block<1, kPvDimVecs>(p, rows_padded, v + dv * kLanes, dim_padded, hi - lo, alpha + r,
                                   o_row + dv * kLanes);
      }
      for (; dv < dim_vecs; ++dv) {
        value_block<1, 1>(p, rows_padded, v + dv * kLanes, dim_padded, hi - lo, alpha + r,
                          o_row + dv * kLanes);
      }
    }
  }

  // ---- custom and tree masks (core/masks.hpp) ----

  // accumulate_tile's per-row path under a mask: O row = O row * alpha + P V over each run of
  // consecutive visible keys (alpha applied once), so a masked key's V is never read.
  static void accumulate_mask_runs(const float* p_tile, int32_t rows, int32_t rows_padded,
                                   const float* v_tile, int32_t dim_padded, int32_t group_size,
                                   const uint64_t* words, const float* alpha, float* o) {
    const int32_t dim_vecs = dim_padded / kLanes;
    const float one = 1.0f;
    for (int32_t r = 0; r < rows; ++r) {
      float* o_row = o + r * dim_padded;
      const float* row_alpha = alpha + r;
      uint64_t word = words[r / group_size];
      bool scaled = false;
      while (!scaled || word != 0) {
        const int32_t lo = word == 0 ? 0 : std::countr_zero(word);
        const int32_t run = word == 0 ? 0 : std::countr_one(word >> lo);
        const float* p = p_tile + lo * rows_padded + r;
        const float* v = v_tile + lo * dim_padded;
        int32_t dv = 0;
        for (; dv + kPvDimVecs <= dim_vecs; dv += kPvDimVecs) {
          value_block<1, kPvDimVecs>(p, rows_padded, v + dv * kLanes, dim_padded, run, row_alpha,
                                     o_row + dv * kLanes);
        }
        for (; dv < dim_vecs; ++dv) {
          value_block<1, 1>(p, rows_padded, v + dv * kLanes, dim_padded, run, row_alpha,
                            o_row + dv * kLanes);
        }
        word &= ~bit_range(lo, lo + run);
        row_alpha = &one;  // alpha once per row
        scaled = true;
      }
    }
  }

  // ---- run_work_item's steps (inlined into it: one function's machine code, as before) ----

  // Visible keys of each token, clipped to the item's key range (first_key / last_key per
  // token); widens [*lo, *hi) to cover them all.
  [[gnu::always_inline]] static void visible_keys(const AttentionProblem& problem,
                                                  const WorkItem& item, int32_t tokens,
                                                  int32_t request_q_len, int32_t kv_len,
                                                  int32_t* first_key, int32_t* last_key,
                                                  int32_t* lo, int32_t* hi) {
    for (int32_t t = 0; t < tokens; ++t) {
      int32_t first = 0, last = 0;
      problem.mask.visible_range(item.q_start + t, request_q_len, kv_len, &first, &last);
      first = std::max(first, item.kv_start);
      last = std::max(first, std::min(last, item.kv_end));
      first_key[t] = first;
      last_key[t] = last;
      if (first < last) {
        *lo = std::min(*lo, first);
        *hi = std::max(*hi, last);
      }
    }
  }

  // Pre-scaled Q: row-major for the dot-product S (few rows), else Q^T for the register-blocked
  // S. Padding rows and columns are zero so their scores stay finite.
  [[gnu::always_inline]] static void load_queries(const FastAttentionContext& context,
                                                  const WorkItem& item, int32_t rows,
                                                  int32_t rows_padded, int32_t dim_padded,
                                                  bool dot_scores, int64_t first_token,
                                                  float* row_buffer, float* q_t) {
    const AttentionProblem& problem = *context.problem;
    const int32_t group_size = context.group_size;
    const int32_t head_dim = problem.head_dim, main_dim = problem.q_main_dim();
    std::memset(q_t, 0, sizeof(float) * dim_padded * rows_padded);
    for (int32_t r = 0; r < rows; ++r) {
      const int32_t qo_head = item.kv_head * group_size + r % group_size;
      const int64_t token = first_token + r / group_size;
      load_row(problem.q, problem.q_dtype,
               token * problem.q_stride_token + qo_head * problem.q_stride_head, main_dim, nullptr,
               row_buffer);
      if (main_dim < head_dim) {  // the rope part (MLA's q_pe) from its own tensor
        load_row(problem.q_rope, problem.q_dtype,
                 token * problem.q_rope_stride_token + qo_head * problem.q_rope_stride_head,
                 head_dim - main_dim, nullptr, row_buffer + main_dim);
      }
      if (dot_scores) {
        for (int32_t d = 0; d < head_dim; ++d)
          q_t[r * dim_padded + d] = row_buffer[d] * context.q_scale;
      } else {
        for (int32_t d = 0; d < head_dim; ++d)
          q_t[d * rows_padded + r] = row_buffer[d] * context.q_scale;
      }
    }
  }

  // Normalise and write: the final output (q dtype) or a float partial for the merge.
  [[gnu::always_inline]] static void write_rows(const FastAttentionContext& context,
                                                const WorkItem& item, int32_t rows,
                                                int32_t dim_padded, int64_t first_token,
                                                const float* o, const float* row_max,
                                                const float* row_sum, float* row_buffer) {
    const AttentionProblem& problem = *context.problem;
    const int32_t group_size = context.group_size;
    const int32_t head_dim = problem.head_dim_v();  // o and partial rows: the v width
    const float minus_inf_lse = -std::numeric_limits<float>::infinity();
    constexpr double kLn2 = 0.69314718055994530942;
    for (int32_t r = 0; r < rows; ++r) {
      const float sum = row_sum[r];
      // sum == 0 exactly when the row saw no key, or only -inf scores: every probability was
      // exp2(-inf) = 0. Such a row is o = 0 even where an infinite v made its accumulator
      // 0 * inf = NaN; as a split-KV partial it keeps 0 * that accumulator, so the merge sees
      // the NaN a single pass would have (merge_partials). A NaN sum (a NaN or +inf score)
      // makes the row and its lse NaN.
      // A final row with a sink folds it here (sink.hpp; one term per row), a partial never.
      const bool empty = sum == 0.0f;
      const int32_t qo_head = item.kv_head * group_size + r % group_size;
      const double row_lse =
          empty ? minus_inf_lse : (row_max[r] + std::log2(static_cast<double>(sum))) * kLn2;
      float lse = static_cast<float>(row_lse);
      bool zero_row = empty && item.partial_row < 0;
      float row_scale = empty ? 0.0f : context.out_scale / sum;
      if (problem.sinks != nullptr && item.partial_row < 0) {
        const SinkFold fold = fold_sink(row_lse, problem.sinks[qo_head]);
        lse = static_cast<float>(fold.lse);
        row_scale = static_cast<float>(row_scale * fold.factor);
        zero_row = zero_row && !std::isnan(fold.factor);  // a NaN sink: the row is NaN
        if (std::isnan(fold.factor)) row_scale = std::numeric_limits<float>::quiet_NaN();
      }
      const Vec scale = Simd::set1(row_scale);
      const float* o_row = o + r * dim_padded;
      for (int32_t d = 0; d < dim_padded; d += kLanes) {
        Simd::store(row_buffer + d,
                    zero_row ? Simd::zero() : Simd::mul(Simd::load(o_row + d), scale));
      }
      if (item.partial_row >= 0) {
        const int64_t partial = static_cast<int64_t>(item.partial_row) + r;
        std::memcpy(context.partial_o + partial * head_dim, row_buffer, sizeof(float) * head_dim);
        context.partial_lse[partial] = lse;
        continue;
      }
      const int64_t token = first_token + r / group_size;
      store_row(row_buffer, problem.q_dtype, head_dim, problem.o,
                token * problem.o_stride_token + qo_head * problem.o_stride_head);
      if (problem.lse) problem.lse[token * problem.lse_stride_token + qo_head] = lse;
    }
  }

  // Online softmax over one tile: updates the running max / sum, writes P = exp2(S - max) in
  // place and the factor alpha that rescales the O accumulated so far.
  // Non-finite scores need no test here: a NaN score gives p = exp2(NaN) = NaN, and a +inf one
  // makes the max +inf and its p = exp2(inf - inf) = NaN, so the row sum turns NaN and stays NaN
  // (sum * alpha + ...), and so does the row of O; write_rows then writes o = NaN, lse = NaN.
  // The max may drop a NaN (maxps returns its second operand then), which only matters once the
  // sum is NaN already. A -inf score is p = 0, like a masked key.
  static void online_softmax(float* s_tile, int32_t rows_padded, int32_t keys, float* row_max,
                             float* row_sum, float* row_alpha) {
    // A row that has seen no key yet keeps max = -inf; subtracting -FLT_MAX instead keeps
    // exp2(-inf - m) at exactly 0 rather than NaN.
    const Vec lowest = Simd::set1(std::numeric_limits<float>::lowest());
    for (int32_t r = 0; r < rows_padded; r += kLanes) {
      Vec tile_max = Simd::load(s_tile + r);
      for (int32_t j = 1; j < keys; ++j) {
        tile_max = Simd::max(tile_max, Simd::load(s_tile + j * rows_padded + r));
      }
      const Vec old_max = Simd::load(row_max + r);
      const Vec new_max = Simd::max(old_max, tile_max);
      const Vec subtrahend = Simd::max(new_max, lowest);
      const Vec alpha = exp2(Simd::sub(old_max, subtrahend));
      Vec sum0 = Simd::zero(), sum1 = Simd::zero();  // two chains hide the add latency
      int32_t j = 0;
      for (; j + 2 <= keys; j += 2) {
        float* s0 = s_tile + j * rows_padded + r;
        float* s1 = s0 + rows_padded;
        const Vec p0 = exp2(Simd::sub(Simd::load(s0), subtrahend));
        const Vec p1 = exp2(Simd::sub(Simd::load(s1), subtrahend));
        Simd::store(s0, p0);
        Simd::store(s1, p1);
        sum0 = Simd::add(sum0, p0);
        sum1 = Simd::add(sum1, p1);
      }
      if (j < keys) {
        float* s0 = s_tile + j * rows_padded + r;
        const Vec p0 = exp2(Simd::sub(Simd::load(s0), subtrahend));
        Simd::store(s0, p0);
        sum0 = Simd::add(sum0, p0);
      }
      Simd::store(row_max + r, new_max);
      Simd::store(row_alpha + r, alpha);
      Simd::store(row_sum + r, Simd::fmadd(Simd::load(row_sum + r), alpha, Simd::add(sum0, sum1)));
    }
  }

  // s -> cap * log2(e) * tanh(s), with tanh(y) = 1 - 2 / (exp(2y) + 1) (saturates cleanly).
  static void apply_soft_cap(float* s_tile, int32_t count, float soft_cap) {
    const Vec two_log2e = Simd::set1(2.0f * kLog2E);
    const Vec one = Simd::set1(1.0f), two = Simd::set1(2.0f);
    const Vec scale = Simd::set1(soft_cap * kLog2E);
    for (int32_t i = 0; i < count; i += kLanes) {
      const Vec e = exp2(Simd::mul(Simd::load(s_tile + i), two_log2e));
      const Vec tanh = Simd::sub(one, Simd::div(two, Simd::add(e, one)));
      Simd::store(s_tile + i, Simd::mul(tanh, scale));
    }
  }
};

template <class Simd>
void FlashAttentionKernel<Simd>::run_work_item(const FastAttentionContext& context,
                                               const WorkItem& item, void* scratch) {
  const AttentionProblem& problem = *context.problem;
  const KVSource& kv = problem.kv;
  const int32_t group_size = context.group_size;
  const int32_t head_dim = problem.head_dim, head_dim_v = problem.head_dim_v();
  const int32_t tokens = item.q_len;
  const int32_t rows = tokens * group_size;
  if (rows <= 0) return;
  const ScratchLayout layout(rows, head_dim, head_dim_v);
  const int32_t rows_padded = layout.rows_padded;
  const int32_t qk_padded = layout.qk_padded;       // Q, K rows
  const int32_t dim_padded = layout.dim_padded;     // V, O rows
  const int32_t pv_rows = round_up(rows, kPvRows);  // skip O blocks made only of padding rows

  const uintptr_t base_address = reinterpret_cast<uintptr_t>(scratch);
  std::byte* base =
      static_cast<std::byte*>(scratch) + ((kAlignBytes - base_address % kAlignBytes) % kAlignBytes);
  float* q_t = reinterpret_cast<float*>(base + layout.q_t);
  float* o = reinterpret_cast<float*>(base + layout.o);
  float* row_max = reinterpret_cast<float*>(base + layout.row_max);
  float* row_sum = reinterpret_cast<float*>(base + layout.row_sum);
  float* row_alpha = reinterpret_cast<float*>(base + layout.row_alpha);
  float* k_tile = reinterpret_cast<float*>(base + layout.k_tile);
  float* v_tile = reinterpret_cast<float*>(base + layout.v_tile);
  float* s_tile = reinterpret_cast<float*>(base + layout.s_tile);
  float* row_buffer = reinterpret_cast<float*>(base + layout.row_buffer);
  int64_t* k_offsets = reinterpret_cast<int64_t*>(base + layout.k_offsets);
  int64_t* v_offsets = reinterpret_cast<int64_t*>(base + layout.v_offsets);
  int32_t* first_key = reinterpret_cast<int32_t*>(base + layout.first_key);
  int32_t* last_key = reinterpret_cast<int32_t*>(base + layout.last_key);
  uint64_t* mask_words = reinterpret_cast<uint64_t*>(base + layout.mask_words);
  const bool masked = problem.key_mask.active();  // a custom / tree mask: tiles use mask_words

  const int32_t request = item.request;
  const int32_t request_q_len = problem.q_len(request);
  const int32_t kv_len = kv.kv_len(request);
  const int64_t first_token = static_cast<int64_t>(problem.q_begin(request)) + item.q_start;

  int32_t lo = item.kv_end, hi = item.kv_start;  // [lo, hi): every key some token sees
  visible_keys(problem, item, tokens, request_q_len, kv_len, first_key, last_key, &lo, &hi);
  const bool dot_scores = rows <= kDotMaxRows;
  load_queries(context, item, rows, rows_padded, qk_padded, dot_scores, first_token, row_buffer,
               q_t);
  std::memset(o, 0, sizeof(float) * rows_padded * dim_padded);
  // The dot-product S leaves padding rows unwritten: keep them finite for the softmax.
  if (dot_scores) std::memset(s_tile, 0, sizeof(float) * kFastKeyTile * rows_padded);
  fill(row_max, rows_padded, -std::numeric_limits<float>::infinity());
  fill(row_sum, rows_padded, 0.0f);

  const int64_t kv_element_bytes = static_cast<int64_t>(dtype_size(kv.dtype));
  const int32_t k_main_dim = problem.k_main_dim();
  const int64_t k_row_bytes = k_main_dim * kv_element_bytes;
  const int64_t v_row_bytes = head_dim_v * kv_element_bytes;
  // V rows are the first head_dim_v elements of the K rows (MLA's ckv): copy, don't convert.
  const bool v_is_k_prefix = kv.v == kv.k && kv.v_stride_token == kv.k_stride_token &&
                             kv.v_stride_page == kv.k_stride_page &&
                             kv.v_stride_head == kv.k_stride_head && head_dim_v <= k_main_dim;
  for (int32_t key0 = lo; key0 < hi; key0 += kFastKeyTile) {
    const int32_t keys = std::min(kFastKeyTile, hi - key0);
    const int32_t keys_padded = round_up(keys, kQkKeys);
    // Skip tiles no token sees; mask only tiles that some token sees partially.
    bool any_visible = false, all_visible = true;
    tile_visibility(tokens, first_key, last_key, key0, keys, &any_visible, &all_visible);
    if (masked && any_visible) {
      tile_mask_words(problem, item, tokens, request_q_len, kv_len, key0, keys, first_key, last_key,
                      mask_words, &any_visible, &all_visible);
    }
    if (!any_visible) continue;  // fully masked tiles are skipped

    tile_offsets(kv, request, item.kv_head, key0, keys, k_offsets, v_offsets);
    for (int32_t j = 0; j < keys; ++j) {
      float* k_row = k_tile + j * qk_padded;
      float* v_row = v_tile + j * dim_padded;
      load_row(kv.k, kv.dtype, k_offsets[j], k_main_dim, context.fp8_table, k_row);
      if (k_main_dim < head_dim) {  // the rope part (MLA's kpe) from its own tensor
        load_row(kv.k_rope, kv.dtype, kv.k_rope_offset(request, item.kv_head, key0 + j),
                 head_dim - k_main_dim, context.fp8_table, k_row + k_main_dim);
      }
      if (v_is_k_prefix) {  // MLA: V is the ckv part of K, converted once
        std::memcpy(v_row, k_row, sizeof(float) * head_dim_v);
      } else {
        load_row(kv.v, kv.dtype, v_offsets[j], head_dim_v, context.fp8_table, v_row);
      }
      fill(k_row + head_dim, qk_padded - head_dim, 0.0f);
      fill(v_row + head_dim_v, dim_padded - head_dim_v, 0.0f);
    }
    // Scattered K/V rows (one head's slice of a token, pages in any order) defeat the hardware
    // prefetcher; fetch the next tile while this one is computed.
    if (key0 + kFastKeyTile < hi) {
      const int32_t next_keys = std::min(kFastKeyTile, hi - key0 - kFastKeyTile);
      tile_offsets(kv, request, item.kv_head, key0 + kFastKeyTile, next_keys, k_offsets, v_offsets);
      prefetch_rows(kv.k, k_offsets, next_keys, kv_element_bytes, k_row_bytes);
      if (!v_is_k_prefix) prefetch_rows(kv.v, v_offsets, next_keys, kv_element_bytes, v_row_bytes);
    }
    // Keys past the end of the range still go through the S block: keep them finite.
    const int32_t keys_computed = dot_scores ? round_up(keys, kLanes) : keys_padded;
    std::memset(k_tile + keys * qk_padded, 0, sizeof(float) * (keys_computed - keys) * qk_padded);

    if (dot_scores) {
      compute_scores_dot(q_t, rows, rows_padded, k_tile, qk_padded, keys, s_tile);
    } else {
      compute_scores(q_t, rows_padded, k_tile, qk_padded, head_dim, keys_padded, s_tile);
    }
    if (context.soft_cap > 0.0f) apply_soft_cap(s_tile, keys * rows_padded, context.soft_cap);
    if (!all_visible && masked) {
      mask_scores(s_tile, rows, rows_padded, keys, group_size, mask_words);
    } else if (!all_visible) {
      mask_outside_ranges(s_tile, rows, rows_padded, keys, key0, group_size, first_key, last_key);
    }
    online_softmax(s_tile, rows_padded, keys, row_max, row_sum, row_alpha);
    accumulate_tile(s_tile, rows, rows_padded, pv_rows, v_tile, dim_padded, keys, key0, all_visible,
                    group_size, first_key, last_key, row_alpha, masked ? mask_words : nullptr, o);
  }

  write_rows(context, item, rows, dim_padded, first_token, o, row_max, row_sum, row_buffer);
}

}  // namespace tessera::detail
