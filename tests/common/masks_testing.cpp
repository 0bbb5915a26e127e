#include "common/masks_testing.hpp"

#include <algorithm>

#include "core/backends.hpp"

namespace tessera::test {
namespace {

int32_t uniform_int(std::mt19937_64& rng, int32_t lo, int32_t hi) {  // inclusive
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}
bool chance(std::mt19937_64& rng, double p) {
  return std::bernoulli_distribution(p)(rng);
}

void append_garbage(std::vector<uint8_t>* bytes, int64_t count, std::mt19937_64& rng) {
  for (int64_t i = 0; i < count; ++i) bytes->push_back(static_cast<uint8_t>(rng()));
}

}  // namespace

const char* mask_pattern_name(MaskPattern pattern) {
  switch (pattern) {
    case MaskPattern::kRandom: return "random";
    case MaskPattern::kBlocks: return "blocks";
    case MaskPattern::kAllOnes: return "all-ones";
    case MaskPattern::kAllZeros: return "all-zeros";
    case MaskPattern::kCausal: return "causal";
    case MaskPattern::kEmptyRows: return "empty-rows";
  }
  return "?";
}

const char* tree_shape_name(TreeShape shape) {
  switch (shape) {
    case TreeShape::kChain: return "chain";
    case TreeShape::kTree: return "tree";
    case TreeShape::kRandomBits: return "random-bits";
    case TreeShape::kAllOnes: return "all-ones";
  }
  return "?";
}

void set_bit(std::vector<uint8_t>* bytes, int64_t bit, bool value) {
  uint8_t& byte = (*bytes)[static_cast<size_t>(bit >> 3)];
  const uint8_t flag = static_cast<uint8_t>(1u << (bit & 7));
  byte = value ? static_cast<uint8_t>(byte | flag) : static_cast<uint8_t>(byte & ~flag);
}

bool get_bit(const std::vector<uint8_t>& bytes, int64_t bit) {
  return ((bytes[static_cast<size_t>(bit >> 3)] >> (bit & 7)) & 1) != 0;
}

bool CaseMasks::visible(int32_t request, int32_t i, int32_t j, int32_t q_len,
                        int32_t kv_len) const {
  const std::vector<uint8_t>& bits = sees[static_cast<size_t>(request)];
  if (!tree) return bits[static_cast<size_t>(i) * kv_len + j] != 0;
  const int32_t first_draft = kv_len - q_len;
  if (j < first_draft) return true;  // the prefix
  return bits[static_cast<size_t>(i) * q_len + (j - first_draft)] != 0;
}

detail::KeyMask CaseMasks::key_mask() const {
  detail::KeyMask mask;
  if (tree) {
    mask.tree = tree_bytes.data();
    mask.tree_stride = tree_stride;
  } else {
    mask.custom = custom.data();
    mask.custom_indptr = indptr.data();
  }
  return mask;
}

RunOptions CaseMasks::run_options() const {
  RunOptions options;
  if (tree) {
    options.tree_mask =
        make_view(const_cast<uint8_t*>(tree_bytes.data()), DType::kUInt8,
                  {static_cast<int64_t>(sees.size()), tree_row_bytes}, {tree_stride, 1});
  } else {
    options.custom_mask = make_view(const_cast<uint8_t*>(custom.data()), DType::kUInt8,
                                    {static_cast<int64_t>(custom.size())});
    options.mask_indptr = make_view(const_cast<int32_t*>(indptr.data()), DType::kInt32,
                                    {static_cast<int64_t>(indptr.size())});
  }
  return options;
}

CaseMasks custom_masks(const AttentionCase& c, MaskPattern pattern, std::mt19937_64& rng,
                       double density, int32_t block) {
  CaseMasks masks;
  masks.indptr.push_back(uniform_int(rng, 0, 3));  // a first offset > 0 is allowed
  append_garbage(&masks.custom, masks.indptr[0], rng);
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    const int32_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
    std::vector<uint8_t> sees(static_cast<size_t>(q_len) * kv_len, 0);
    const std::vector<uint8_t> block_on = [&] {  // per (row block, key block) for kBlocks
      std::vector<uint8_t> on(static_cast<size_t>(q_len / block + 1) * (kv_len / block + 1));
      for (uint8_t& x : on) x = chance(rng, density);
      return on;
    }();
    for (int32_t i = 0; i < q_len; ++i) {
      const bool empty_row = pattern == MaskPattern::kEmptyRows && chance(rng, 1.0 / 3);
      for (int32_t j = 0; j < kv_len; ++j) {
        bool on = false;
        switch (pattern) {
          case MaskPattern::kRandom: on = chance(rng, density); break;
          case MaskPattern::kBlocks:
            on = block_on[static_cast<size_t>(i / block) * (kv_len / block + 1) + j / block] != 0;
            break;
          case MaskPattern::kAllOnes: on = true; break;
          case MaskPattern::kAllZeros: on = false; break;
          case MaskPattern::kCausal: on = j <= i + kv_len - q_len; break;
          case MaskPattern::kEmptyRows: on = !empty_row && chance(rng, density); break;
        }
        sees[static_cast<size_t>(i) * kv_len + j] = on;
      }
    }
    // The segment: random bytes (bits past q_len x kv_len stay random), then the bits.
    const int64_t start = masks.indptr.back();
    const int64_t bytes = (static_cast<int64_t>(q_len) * kv_len + 7) / 8 + uniform_int(rng, 0, 2);
    append_garbage(&masks.custom, bytes, rng);
    std::vector<uint8_t> segment(masks.custom.begin() + start, masks.custom.end());
    for (size_t bit = 0; bit < sees.size(); ++bit) {
      set_bit(&segment, static_cast<int64_t>(bit), sees[bit] != 0);
    }
    std::copy(segment.begin(), segment.end(), masks.custom.begin() + start);
    masks.indptr.push_back(static_cast<int32_t>(start + bytes));
    masks.sees.push_back(std::move(sees));
  }
  append_garbage(&masks.custom, uniform_int(rng, 0, 3), rng);  // bytes past the last segment
  if (masks.custom.empty()) masks.custom.push_back(0);         // a pointer to hand out
  return masks;
}

CaseMasks tree_masks(const AttentionCase& c, TreeShape shape, std::mt19937_64& rng) {
  CaseMasks masks;
  masks.tree = true;
  const int32_t q = c.q_lens.empty() ? 1 : c.q_lens[0];
  masks.q_per_request = q;
  masks.tree_row_bytes = (static_cast<int64_t>(q) * q + 7) / 8 + uniform_int(rng, 0, 2);
  masks.tree_stride = masks.tree_row_bytes + uniform_int(rng, 0, 3);
  append_garbage(&masks.tree_bytes, std::max<int64_t>(1, c.batch_size() * masks.tree_stride), rng);
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    std::vector<uint8_t> sees(static_cast<size_t>(q) * q, 0);
    std::vector<int32_t> parent(q, -1);
    for (int32_t i = 0; i < q; ++i) {
      parent[i] = shape == TreeShape::kChain ? i - 1 : i == 0 ? -1 : uniform_int(rng, -1, i - 1);
    }
    for (int32_t i = 0; i < q; ++i) {
      for (int32_t d = 0; d < q; ++d) {
        bool on = false;
        switch (shape) {
          case TreeShape::kChain:
          case TreeShape::kTree:  // d is i or one of its ancestors
            for (int32_t a = i; a >= 0 && !on; a = parent[a]) on = a == d;
            break;
          case TreeShape::kRandomBits: on = chance(rng, 0.5); break;
          case TreeShape::kAllOnes: on = true; break;
        }
        sees[static_cast<size_t>(i) * q + d] = on;
      }
    }
    std::vector<uint8_t> row(masks.tree_bytes.begin() + b * masks.tree_stride,
                             masks.tree_bytes.begin() + (b + 1) * masks.tree_stride);
    for (size_t bit = 0; bit < sees.size(); ++bit) {
      set_bit(&row, static_cast<int64_t>(bit), sees[bit] != 0);
    }
    std::copy(row.begin(), row.end(), masks.tree_bytes.begin() + b * masks.tree_stride);
    masks.sees.push_back(std::move(sees));
  }
  return masks;
}

Outputs run_reference(AttentionBuffers& buffers, const CaseMasks& masks) {
  poison_outputs(buffers);
  detail::AttentionProblem problem = make_problem(buffers);
  problem.key_mask = masks.key_mask();
  detail::cpu_reference_attention(problem);
  return copy_outputs(buffers);
}

}  // namespace tessera::test
