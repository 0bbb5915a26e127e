// The CPU fast path's masking steps: for custom and tree masks (core/masks.hpp), per key tile,
// which keys each query token of a work item sees (its causal / window range ANDed with the mask's
// bits), and the scores of the keys a row does not see set to -inf before the online softmax. Tiles
// that no token sees are skipped by the kernel (fast_attention_impl.hpp); a tile that every
// token sees whole runs unmasked.
//
// Always inlined: the per-ISA translation units include this header, and an out-of-line copy
// compiled with AVX-512 flags could be the one the linker keeps for the baseline build.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/masks.hpp"
#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// The keys of tile [key0, key0 + keys) (keys <= 64) that each token t of `item` sees, range
// [first_key[t], last_key[t]) and mask together, as bits (bit j: key key0 + j) in words[t];
// *any: some token sees one, *all: every token sees all of them.
[[gnu::always_inline]] inline void tile_mask_words(
    const AttentionProblem& problem, const WorkItem& item, int32_t tokens, int32_t request_q_len,
    int32_t kv_len, int32_t key0, int32_t keys, const int32_t* first_key, const int32_t* last_key,
    uint64_t* words, bool* any, bool* all) {
  const uint64_t full = bit_range(0, keys);
  *any = false;
  *all = true;
  for (int32_t t = 0; t < tokens; ++t) {
    const int32_t lo = std::clamp(first_key[t] - key0, 0, keys);
    const int32_t hi = std::clamp(last_key[t] - key0, lo, keys);
    uint64_t word = bit_range(lo, hi);
    if (word != 0) {
      word &= problem.key_mask.row_bits(item.request, item.q_start + t, key0, keys, request_q_len,
                                        kv_len);
    }
    words[t] = word;
    *any = *any || word != 0;
    *all = *all && word == full;
  }
}

// S^T tile [keys x rows_padded]: the scores of keys that row r (token r / group_size) does not
// see (a 0 bit of its word) become -inf, so their p is exactly 0.
[[gnu::always_inline]] inline void mask_scores(float* s_tile, int32_t rows, int32_t rows_padded,
                                               int32_t keys, int32_t group_size,
                                               const uint64_t* words) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int32_t r = 0; r < rows; ++r) {
    const uint64_t word = words[r / group_size];
    for (int32_t j = 0; j < keys; ++j) {
      if (((word >> j) & 1) == 0) s_tile[j * rows_padded + r] = minus_inf;
    }
  }
}

// Whether some token sees keys [key0, key0 + keys) of its range [first_key[t], last_key[t]), and
// whether every token sees all of them (the kernel skips and masks tiles by these).
[[gnu::always_inline]] inline void tile_visibility(int32_t tokens, const int32_t* first_key,
                                                   const int32_t* last_key, int32_t key0,
                                                   int32_t keys, bool* any, bool* all) {
  for (int32_t t = 0; t < tokens; ++t) {
    if (first_key[t] < key0 + keys && last_key[t] > key0 && first_key[t] < last_key[t]) {
      *any = true;
    }
    if (first_key[t] > key0 || last_key[t] < key0 + keys) *all = false;
  }
}

// Without a mask: the scores (S^T tile, rows_padded per key) of the keys outside each row's
// range set to -inf.
[[gnu::always_inline]] inline void mask_outside_ranges(float* s_tile, int32_t rows,
                                                       int32_t rows_padded, int32_t keys,
                                                       int32_t key0, int32_t group_size,
                                                       const int32_t* first_key,
                                                       const int32_t* last_key) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t t = r / group_size;
    const int32_t visible_lo = std::clamp(first_key[t] - key0, 0, keys);
    const int32_t visible_hi = std::clamp(last_key[t] - key0, visible_lo, keys);
    for (int32_t j = 0; j < visible_lo; ++j) s_tile[j * rows_padded + r] = minus_inf;
    for (int32_t j = visible_hi; j < keys; ++j) s_tile[j * rows_padded + r] = minus_inf;
  }
}

}  // namespace tessera::detail
