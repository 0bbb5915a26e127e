// Custom and tree masks for the attention tests (tests/test_masks.cpp, tests/test_capi_masks.cpp,
// tests/test_cuda_masks.cpp): random masks of a case (tests/common/attention_testing.hpp) packed
// the way RunOptions::custom_mask / mask_indptr / tree_mask take them (include/tessera/
// attention.hpp), with the truth they encode kept beside the bytes. The bytes carry random
// padding wherever the definition says bits are not read: past a request's q_len x kv_len bits,
// between segments, before the first one, and past each tree row inside a wider row stride.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "common/attention_testing.hpp"
#include "core/masks.hpp"
#include "tessera/attention.hpp"

namespace tessera::test {

// Custom-mask patterns (prefill).
enum class MaskPattern : int32_t {
  kRandom,     // each bit visible with probability `density`
  kBlocks,     // `block` x `block` blocks of (query row, key), each visible with `density`
  kAllOnes,    // = no mask
  kAllZeros,   // every row empty
  kCausal,     // j <= i + kv_len - q_len: = causal
  kEmptyRows,  // random bits, and about a third of the rows see nothing
};
const char* mask_pattern_name(MaskPattern pattern);

// Tree-mask shapes (decode, q_per_request drafts).
enum class TreeShape : int32_t {
  kChain,       // draft i sees drafts 0..i: = causal decode
  kTree,        // a random tree in topological order: ancestors and itself
  kRandomBits,  // any bits (drafts in no order; plan without causal to honour them all)
  kAllOnes,     // every draft sees every draft: = non-causal decode
};
const char* tree_shape_name(TreeShape shape);

// Little-endian bit `bit` of `bytes` (numpy.packbits(bitorder="little")).
void set_bit(std::vector<uint8_t>* bytes, int64_t bit, bool value);
bool get_bit(const std::vector<uint8_t>& bytes, int64_t bit);

struct CaseMasks {
  bool tree = false;
  // The truth, per request: q_len x kv_len (custom) or q_per_request x q_per_request over the
  // drafts (tree), row-major, 1 = visible.
  std::vector<std::vector<uint8_t>> sees;
  std::vector<uint8_t> custom;      // custom_mask bytes
  std::vector<int32_t> indptr;      // mask_indptr
  std::vector<uint8_t> tree_bytes;  // batch x tree_stride bytes (at least 1)
  int64_t tree_row_bytes = 0;       // the view's second dim: >= ceil(q^2 / 8)
  int64_t tree_stride = 0;          // >= tree_row_bytes
  int32_t q_per_request = 0;

  // The definition (attention.hpp), from the truth: may row i of `request` see key j through
  // the mask (the causal / window range aside)?
  bool visible(int32_t request, int32_t i, int32_t j, int32_t q_len, int32_t kv_len) const;
  // What set_key_mask makes of run_options() (for the reference and the fast path directly).
  detail::KeyMask key_mask() const;
  // Host views of the bytes, as RunOptions fields.
  RunOptions run_options() const;
};

// A custom mask for every request of prefill case `c`.
CaseMasks custom_masks(const AttentionCase& c, MaskPattern pattern, std::mt19937_64& rng,
                       double density = 0.5, int32_t block = 64);
// A tree mask for decode case `c` (uniform_q: q_lens[0] drafts per request).
CaseMasks tree_masks(const AttentionCase& c, TreeShape shape, std::mt19937_64& rng);

// The reference (cpu_reference_attention) with the masks; outputs poisoned first.
Outputs run_reference(AttentionBuffers& buffers, const CaseMasks& masks);

}  // namespace tessera::test
