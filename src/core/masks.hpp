// Custom masks (prefill) and tree masks (speculative decoding): the bits an AttentionProblem
// carries (RunOptions::custom_mask / mask_indptr / tree_mask, include/tessera/attention.hpp) and
// the one definition of which keys a query row sees through them, used by the CPU reference
// (src/cpu/reference_rows.cpp) and the CPU fast path (src/cpu/fast_attention_impl.hpp).
//
// Both are bit strings packed little-endian: bit b is bit (b % 8) of byte b / 8, as
// numpy.packbits(..., bitorder="little") and FlashInfer's packed_custom_mask lay them out.
//  * custom: request r's bits start at byte custom_indptr[r]; bit (i * kv_len + j) says whether
//    query row i (0-based within the request) sees key j.
//  * tree: request r's bits start at byte r * tree_stride; the draft keys are the request's last
//    q_len keys (draft d = key j - (kv_len - q_len)); row i sees every key before them (the
//    prefix) and draft d iff bit (i * q_len + d) is set.
// The mask ANDs with the plan's causal / window range (MaskSpec), which callers apply as before;
// a row that sees no key ends as such a row always does (o = 0, lse = -inf or the sink).
// Validation (core/masks.cpp, set_key_mask) guarantees that every bit read here is inside the
// caller's buffers.
#pragma once

#include <cstdint>

// Always inlined on the host: the CPU kernels' ISA translation units (AVX2, AVX-512) include
// this header, and an out-of-line copy compiled with their flags could be the one the linker
// keeps for the baseline build too (src/cpu/fast_attention_impl.hpp).
#if defined(__CUDACC__)
#define TESSERA_MASK_FN __host__ __device__ __forceinline__
#else
#define TESSERA_MASK_FN [[gnu::always_inline]] inline
#endif

namespace tessera::detail {

// Bits t in [lo, hi) set, for 0 <= lo <= hi <= 64.
TESSERA_MASK_FN uint64_t bit_range(int32_t lo, int32_t hi) {
  const uint64_t below_hi = hi >= 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1;
  const uint64_t below_lo = lo >= 64 ? ~uint64_t{0} : (uint64_t{1} << lo) - 1;
  return below_hi & ~below_lo;
}

// Bits [bit, bit + count) of a little-endian bit string, count in 1..64: bit t of the result is
// bit (bit + t) of the string. Reads only the (at most 9) bytes that hold those bits.
TESSERA_MASK_FN uint64_t load_bits(const uint8_t* bytes, int64_t bit, int32_t count) {
  const uint8_t* first = bytes + (bit >> 3);
  const int32_t shift = static_cast<int32_t>(bit & 7);
  const int32_t num_bytes = (shift + count + 7) >> 3;  // 1..9
  uint64_t word = 0;
  for (int32_t b = 0; b < num_bytes && b < 8; ++b) word |= uint64_t{first[b]} << (8 * b);
  word >>= shift;
  if (num_bytes == 9) word |= uint64_t{first[8]} << (64 - shift);  // shift >= 1 here
  return word & bit_range(0, count);
}

struct KeyMask {
  const uint8_t* custom = nullptr;         // custom_mask (prefill), or null
  const int32_t* custom_indptr = nullptr;  // mask_indptr [B + 1]: byte offset of each request
  const uint8_t* tree = nullptr;           // tree_mask rows (decode), or null
  int64_t tree_stride = 0;                 // bytes from one request's row to the next

  TESSERA_MASK_FN bool active() const { return custom != nullptr || tree != nullptr; }

  // Which of keys key0 .. key0 + count - 1 (count in 1..64, inside [0, kv_len)) query row i of
  // `request` (q_len rows, kv_len keys) may see through the mask: bit t for key key0 + t. All
  // ones without a mask.
  TESSERA_MASK_FN uint64_t row_bits(int32_t request, int32_t i, int32_t key0, int32_t count,
                                    int32_t q_len, int32_t kv_len) const {
    if (custom != nullptr) {
      const int64_t bit = int64_t{custom_indptr[request]} * 8 + int64_t{i} * kv_len + key0;
      return load_bits(custom, bit, count);
    }
    if (tree == nullptr) return bit_range(0, count);
    const int32_t first_draft = kv_len - q_len;  // may be negative: fewer keys than drafts
    int32_t prefix = first_draft - key0;         // keys of the range before the drafts
    prefix = prefix < 0 ? 0 : prefix > count ? count : prefix;
    uint64_t bits = bit_range(0, prefix);
    if (prefix < count) {
      const uint8_t* row = tree + request * tree_stride;
      const int32_t draft = key0 + prefix - first_draft;  // >= 0
      bits |= load_bits(row, int64_t{i} * q_len + draft, count - prefix) << prefix;
    }
    return bits;
  }

  TESSERA_MASK_FN bool visible(int32_t request, int32_t i, int32_t j, int32_t q_len,
                               int32_t kv_len) const {
    return (row_bits(request, i, j, 1, q_len, kv_len) & 1) != 0;
  }
};

}  // namespace tessera::detail
