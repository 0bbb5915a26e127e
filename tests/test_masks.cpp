// Custom masks (prefill) and tree masks (speculative decoding) on the CPU (issue 34 items 4 and
// 5; RunOptions in include/tessera/attention.hpp, bits in src/core/masks.hpp). First the bit
// helpers against bit-by-bit definitions; then the reference against an independent brute force
// (the visible set of every row written out from the masks' truth) and against identities that
// need no mask code at all (a causal-pattern mask is causal = true, an all-ones mask is no mask,
// a window-pattern mask is the window, a chain tree is causal decode, an all-ones tree is
// non-causal decode, an all-zeros mask empties every row); then the fast path (every ISA the
// host has, unsplit and split by hand-made plans) and the public plan/run API (the real planner)
// against the reference over random shapes: odd lengths, empty requests, GQA 1..8, page sizes
// 1..128, masks combined with causal / window / soft-cap / sinks, trees of 1..64 drafts, key
// ranges long enough for the planner to split. Every run writes into outputs poisoned with NaN.
// A masked key's K and V are never read (NaN there changes nothing). Validation: every error
// names its field and leaves the outputs untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/masks_testing.hpp"
#include "common/sinks_testing.hpp"
#include "common/validation_fixture.hpp"
#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "tessera/backend.hpp"
#include "tessera/cascade.hpp"

namespace tessera {
namespace {

using test::AttentionBuffers;
using test::AttentionCase;
using test::CaseMasks;
using test::MaskPattern;
using test::Outputs;
using test::TreeShape;

constexpr double kInf = std::numeric_limits<double>::infinity();

int32_t uniform_int(std::mt19937_64& rng, int32_t lo, int32_t hi) {
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}
bool chance(std::mt19937_64& rng, double p) {
  return std::bernoulli_distribution(p)(rng);
}

enum class MaskOp : int32_t { kRagged, kPaged, kDecode };
const char* mask_op_name(MaskOp op) {
  return op == MaskOp::kRagged ? "ragged" : op == MaskOp::kPaged ? "paged" : "decode";
}

// A random case of `op`: ragged or paged prefill (page sizes 1..128), or decode with a random
// number of drafts (1..64, some requests with fewer keys than drafts); sinks sometimes.
AttentionCase mask_case(MaskOp op, std::mt19937_64& rng, std::vector<DType> dtypes = {}) {
  test::RandomCaseOptions options;
  options.allow_paged = false;
  options.max_kv_len = 260;
  if (!dtypes.empty()) options.q_dtypes = dtypes;
  AttentionCase c = test::random_case(rng, options);
  c.uniform_q = false;
  if (op != MaskOp::kRagged) {
    c.paged = true;
    const int32_t page_sizes[] = {1, 2, 7, 16, 64, 128};
    c.page_size = page_sizes[uniform_int(rng, 0, 5)];
    c.layout = chance(rng, 0.5) ? KVLayout::kNHD : KVLayout::kHND;
    c.spare_pages = uniform_int(rng, 0, 2);
  }
  if (op == MaskOp::kDecode) {
    const int32_t drafts[] = {1, 2, 3, 5, 8, 16, 33, 64};
    const int32_t q = drafts[uniform_int(rng, 0, 7)];
    c.uniform_q = true;
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      c.q_lens[b] = q;
      c.kv_lens[b] = chance(rng, 0.15) ? uniform_int(rng, 0, q) : uniform_int(rng, q, q + 140);
    }
    // Many drafts: fewer heads and a smaller head_dim keep the double reference quick.
    c.num_qo_heads = c.num_kv_heads * std::min(c.group_size(), q > 16 ? 2 : 8);
    if (q > 16) c.head_dim = std::min(c.head_dim, 128);
  }
  c.with_sinks = chance(rng, 0.3);
  return c;
}

// The masks of case number `index`: the patterns in turn.
CaseMasks masks_for(const AttentionCase& c, MaskOp op, int index, std::mt19937_64& rng) {
  if (op == MaskOp::kDecode) {
    const TreeShape shapes[] = {TreeShape::kTree, TreeShape::kRandomBits, TreeShape::kChain,
                                TreeShape::kAllOnes};
    return test::tree_masks(c, shapes[index % 4], rng);
  }
  switch (index % 7) {
    case 0: return test::custom_masks(c, MaskPattern::kRandom, rng, 0.5);
    case 1: return test::custom_masks(c, MaskPattern::kRandom, rng, 0.9);
    case 2: return test::custom_masks(c, MaskPattern::kBlocks, rng, 0.5, 64);
    case 3: return test::custom_masks(c, MaskPattern::kBlocks, rng, 0.3, uniform_int(rng, 3, 40));
    case 4: return test::custom_masks(c, MaskPattern::kEmptyRows, rng, 0.2);
    case 5: return test::custom_masks(c, MaskPattern::kRandom, rng, 0.05);
    default: return test::custom_masks(c, MaskPattern::kAllZeros, rng);
  }
}

// The fast path with a hand-made plan on one ISA (2 threads), NaN-filled outputs and workspace.
Outputs run_fast(AttentionBuffers& buffers, const CaseMasks* masks,
                 const test::TestPlanOptions& options, detail::CpuIsa isa) {
  test::poison_outputs(buffers);
  const Plan plan = test::make_test_plan(buffers.test_case, options);
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  detail::AttentionProblem problem = test::make_problem(buffers);
  if (masks != nullptr) problem.key_mask = masks->key_mask();
  set_num_threads(2);
  detail::cpu_fast_attention_with_isa(plan, problem, Workspace{workspace.data(), workspace.size()},
                                      isa);
  set_num_threads(0);
  return test::copy_outputs(buffers);
}

Outputs run_api(AttentionBuffers& buffers, const CaseMasks& masks, const Plan* plan = nullptr) {
  const RunOptions options = masks.run_options();
  return test::run_through_api(buffers, Device{}, plan, &options);
}

std::string compare(const AttentionBuffers& buffers, const Outputs& actual,
                    const Outputs& expected) {
  const AttentionCase& c = buffers.test_case;
  const test::Comparison result = test::compare_outputs(buffers, actual, expected);
  return result.ok(test::default_tolerance(c), test::default_lse_tolerance(c)) ? ""
                                                                               : result.describe();
}

// Every implementation (each ISA unsplit and split, the public API) against `expected`.
void check_all_paths(AttentionBuffers& buffers, const CaseMasks& masks, const Outputs& expected,
                     const std::string& what) {
  for (detail::CpuIsa isa :
       {detail::CpuIsa::kGeneric, detail::CpuIsa::kAvx2, detail::CpuIsa::kAvx512}) {
    if (!detail::cpu_supports(isa)) continue;
    test::TestPlanOptions unsplit, split;
    split.q_tile_rows = 16;
    split.kv_chunk = 48;  // pieces that start inside a 64-key tile
    split.num_workers = 3;
    for (const auto& [options, name] : {std::pair{unsplit, "unsplit"}, {split, "split by 48"}}) {
      EXPECT_EQ(compare(buffers, run_fast(buffers, &masks, options, isa), expected), "")
          << what << ": fast path, " << detail::cpu_isa_name(isa) << ", " << name;
    }
  }
  EXPECT_EQ(compare(buffers, run_api(buffers, masks), expected), "") << what << ": public API";
}

// ---- the bit helpers ----

TEST(MaskBits, LoadBitsMatchesBitByBit) {
  std::mt19937_64 rng(test::sinks_seed(35001));
  std::vector<uint8_t> bytes(64);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  for (int trial = 0; trial < 20000; ++trial) {
    const int32_t count = uniform_int(rng, 1, 64);
    const int64_t bit = uniform_int(rng, 0, 64 * 8 - count);
    uint64_t expected = 0;
    for (int32_t t = 0; t < count; ++t) expected |= uint64_t{test::get_bit(bytes, bit + t)} << t;
    ASSERT_EQ(detail::load_bits(bytes.data(), bit, count), expected) << bit << " " << count;
  }
  EXPECT_EQ(detail::bit_range(0, 64), ~uint64_t{0});
  EXPECT_EQ(detail::bit_range(3, 3), 0u);
  EXPECT_EQ(detail::bit_range(62, 64), uint64_t{3} << 62);
}

// KeyMask::row_bits, custom and tree, against the definition kept by the truth of the masks.
TEST(MaskBits, RowBitsFollowTheDefinition) {
  std::mt19937_64 rng(test::sinks_seed(35002));
  for (int trial = 0; trial < 300; ++trial) {
    const bool tree = trial % 2 == 1;
    AttentionCase c = mask_case(tree ? MaskOp::kDecode : MaskOp::kRagged, rng);
    const CaseMasks masks = tree ? test::tree_masks(c, TreeShape::kRandomBits, rng)
                                 : test::custom_masks(c, MaskPattern::kRandom, rng);
    const detail::KeyMask key_mask = masks.key_mask();
    for (int32_t b = 0; b < c.batch_size(); ++b) {
      const int32_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
      for (int32_t i = 0; i < q_len && kv_len > 0; ++i) {
        const int32_t key0 = uniform_int(rng, 0, kv_len - 1);
        const int32_t count = uniform_int(rng, 1, std::min(64, kv_len - key0));
        const uint64_t bits = key_mask.row_bits(b, i, key0, count, q_len, kv_len);
        for (int32_t t = 0; t < count; ++t) {
          ASSERT_EQ(((bits >> t) & 1) != 0, masks.visible(b, i, key0 + t, q_len, kv_len))
              << c.describe() << " request " << b << " row " << i << " key " << key0 + t;
        }
      }
    }
  }
}

// ---- the reference ----

// An oracle with none of the reference's code: each row's visible keys written out (the
// range of the causal / window mask AND the masks' truth), then a double softmax over them.
struct BruteForce {
  std::vector<double> o, lse;  // [token][head][d], [token][head]
};

BruteForce brute_force(AttentionBuffers& buffers, const CaseMasks& masks) {
  const AttentionCase& c = buffers.test_case;
  const detail::AttentionProblem problem = test::make_problem(buffers);  // K/V addressing only
  const int32_t dim = c.head_dim;
  BruteForce out;
  out.o.assign(static_cast<size_t>(c.total_q()) * c.num_qo_heads * dim, 0.0);
  out.lse.assign(static_cast<size_t>(c.total_q()) * c.num_qo_heads, -kInf);
  const double scale = static_cast<double>(c.resolved_sm_scale()) * c.k_scale;
  int64_t token = 0;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    const int32_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
    for (int32_t i = 0; i < q_len; ++i, ++token) {
      const int64_t diag = int64_t{i} + kv_len - q_len;
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        const int32_t kv_head = h / c.group_size();
        std::vector<int32_t> keys;
        std::vector<double> scores;
        for (int32_t j = 0; j < kv_len; ++j) {
          bool in = masks.visible(b, i, j, q_len, kv_len);
          if (c.causal) in = in && j <= diag;
          if (c.window_left >= 0) in = in && j >= diag - c.window_left;
          if (c.window_right >= 0) in = in && j <= diag + c.window_right;
          if (!in) continue;
          double dot = 0;
          for (int32_t d = 0; d < dim; ++d) {
            dot += detail::load_as_float(
                       buffers.q.data(), c.q_dtype,
                       token * buffers.q_stride_token + h * buffers.q_stride_head + d) *
                   detail::load_as_float(buffers.k.data(), c.kv_dtype,
                                         problem.kv.k_offset(b, kv_head, j) + d);
          }
          double s = dot * scale;
          if (c.soft_cap > 0) s = c.soft_cap * std::tanh(s / c.soft_cap);
          keys.push_back(j);
          scores.push_back(s);
        }
        const size_t row = static_cast<size_t>(token) * c.num_qo_heads + h;
        const double sink = c.with_sinks ? buffers.sinks[h] : -kInf;
        if (keys.empty()) {
          out.lse[row] = sink;
          continue;
        }
        double top = sink;
        for (double s : scores) top = std::max(top, s);
        double sum = std::exp(sink - top);
        for (double s : scores) sum += std::exp(s - top);
        for (size_t n = 0; n < keys.size(); ++n) {
          const double p = std::exp(scores[n] - top) / sum;
          for (int32_t d = 0; d < dim; ++d) {
            out.o[row * dim + d] +=
                p * c.v_scale *
                detail::load_as_float(buffers.v.data(), c.kv_dtype,
                                      problem.kv.v_offset(b, kv_head, keys[n]) + d);
          }
        }
        out.lse[row] = top + std::log(sum);
      }
    }
  }
  return out;
}

TEST(MaskReference, MatchesBruteForce) {
  std::mt19937_64 rng(test::sinks_seed(35100));
  for (int index = 0; index < 42; ++index) {
    const MaskOp op = static_cast<MaskOp>(index % 3);
    AttentionCase c = mask_case(op, rng, {DType::kFloat32});
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const CaseMasks masks = masks_for(c, op, index / 3, rng);
    const Outputs reference = test::run_reference(buffers, masks);
    const BruteForce brute = brute_force(buffers, masks);
    int64_t token = 0;
    for (int32_t b = 0; b < c.batch_size(); ++b) {
      for (int32_t i = 0; i < c.q_lens[b]; ++i, ++token) {
        for (int32_t h = 0; h < c.num_qo_heads; ++h) {
          const size_t row = static_cast<size_t>(token) * c.num_qo_heads + h;
          for (int32_t d = 0; d < c.head_dim; ++d) {
            const double ref = detail::load_as_float(
                reference.o.data(), c.q_dtype,
                token * buffers.o_stride_token + h * buffers.o_stride_head + d);
            const double want = brute.o[row * c.head_dim + d];
            ASSERT_NEAR(ref, want, 1e-5 * (1 + std::fabs(want))) << c.describe() << " row " << row;
          }
          if (!c.with_lse) continue;
          float lse;
          std::memcpy(&lse, reference.lse.data() + (token * buffers.lse_stride_token + h) * 4, 4);
          if (brute.lse[row] == -kInf) {
            ASSERT_EQ(lse, -std::numeric_limits<float>::infinity()) << c.describe();
          } else {
            ASSERT_NEAR(lse, brute.lse[row], 1e-5 * (1 + std::fabs(brute.lse[row])))
                << c.describe();
          }
        }
      }
    }
  }
}

// Replaces the masks' bits by `rule(request, i, j, q_len, kv_len)` (custom masks only).
void rewrite_bits(CaseMasks& masks, const AttentionCase& c,
                  const std::function<bool(int32_t, int32_t, int32_t, int32_t, int32_t)>& rule) {
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    const int32_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
    for (int32_t i = 0; i < q_len; ++i) {
      for (int32_t j = 0; j < kv_len; ++j) {
        const bool on = rule(b, i, j, q_len, kv_len);
        masks.sees[b][static_cast<size_t>(i) * kv_len + j] = on;
        test::set_bit(&masks.custom, int64_t{masks.indptr[b]} * 8 + int64_t{i} * kv_len + j, on);
      }
    }
  }
}

// A masked run equals an unmasked run of another case: the reference bit for bit, every other
// path within tolerance of the unmasked reference.
void expect_same_as(AttentionBuffers& masked, const CaseMasks& masks, AttentionBuffers& plain,
                    const std::string& what) {
  const Outputs expected = test::run_reference(plain);
  const Outputs reference = test::run_reference(masked, masks);
  EXPECT_EQ(reference.o, expected.o) << what << ": reference o";
  EXPECT_EQ(reference.lse, expected.lse) << what << ": reference lse";
  check_all_paths(masked, masks, expected, what);
}

TEST(MaskReference, IdentitiesWithoutMaskCode) {
  std::mt19937_64 rng(test::sinks_seed(35200));
  for (int index = 0; index < 12; ++index) {
    const MaskOp op = index % 2 ? MaskOp::kPaged : MaskOp::kRagged;
    AttentionCase c = mask_case(op, rng);
    c.causal = false;
    c.window_left = c.window_right = -1;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const std::string name = std::string(mask_op_name(op)) + " " + c.describe();
    // A causal-pattern mask is causal = true.
    AttentionBuffers causal = buffers;
    causal.test_case.causal = true;
    expect_same_as(buffers, test::custom_masks(c, MaskPattern::kCausal, rng), causal,
                   "causal pattern, " + name);
    // A window-pattern mask is the window (with causal on both sides).
    const int32_t left = uniform_int(rng, 0, 40), right = uniform_int(rng, 0, 9);
    CaseMasks window = test::custom_masks(c, MaskPattern::kAllOnes, rng);
    rewrite_bits(window, c, [&](int32_t, int32_t i, int32_t j, int32_t q_len, int32_t kv_len) {
      const int64_t diag = int64_t{i} + kv_len - q_len;
      return j >= diag - left && j <= diag + right;
    });
    AttentionBuffers windowed = causal;
    windowed.test_case.window_left = left;
    windowed.test_case.window_right = right;
    expect_same_as(causal, window, windowed, "window pattern, " + name);
    // An all-ones mask is no mask, whatever else the case has.
    AttentionBuffers ones = windowed;
    ones.test_case.soft_cap = 30.0f;
    expect_same_as(ones, test::custom_masks(c, MaskPattern::kAllOnes, rng), ones,
                   "all ones, " + name);
    // An all-zeros mask empties every row: o = 0, lse = -inf (the sink with sinks).
    AttentionBuffers zeros = buffers;
    zeros.test_case.causal = true;
    zeros.test_case.window_left = left;
    const Outputs none =
        test::run_reference(zeros, test::custom_masks(c, MaskPattern::kAllZeros, rng));
    for (int64_t token = 0; token < c.total_q(); ++token) {
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        for (int32_t d = 0; d < c.head_dim; ++d) {
          ASSERT_EQ(
              detail::load_as_float(none.o.data(), c.q_dtype,
                                    token * zeros.o_stride_token + h * zeros.o_stride_head + d),
              0.0);
        }
        if (!c.with_lse) continue;
        float lse;
        std::memcpy(&lse, none.lse.data() + (token * zeros.lse_stride_token + h) * 4, 4);
        EXPECT_EQ(lse, c.with_sinks ? zeros.sinks[h] : -std::numeric_limits<float>::infinity());
      }
    }
    check_all_paths(zeros, test::custom_masks(c, MaskPattern::kAllZeros, rng), none,
                    "all zeros, " + name);
  }
}

// A chain tree is causal decode (planned causal or not); an all-ones tree is non-causal decode.
TEST(MaskReference, TreeIdentities) {
  std::mt19937_64 rng(test::sinks_seed(35300));
  for (int index = 0; index < 16; ++index) {
    AttentionCase c = mask_case(MaskOp::kDecode, rng);
    c.window_left = c.window_right = -1;
    c.causal = index % 2 == 0;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    AttentionBuffers causal = buffers;
    causal.test_case.causal = true;
    const std::string name = c.describe();
    expect_same_as(buffers, test::tree_masks(c, TreeShape::kChain, rng), causal, "chain, " + name);
    AttentionBuffers open = buffers;
    open.test_case.causal = false;
    expect_same_as(open, test::tree_masks(c, TreeShape::kAllOnes, rng), open, "all ones, " + name);
  }
}

// ---- the fast path and the public API against the reference ----

class MaskMatrix : public ::testing::TestWithParam<MaskOp> {};

TEST_P(MaskMatrix, FastPathAndApiMatchTheReference) {
  std::mt19937_64 rng(test::sinks_seed(35400 + static_cast<uint64_t>(GetParam())));
  for (int index = 0; index < 28; ++index) {
    AttentionCase c = mask_case(GetParam(), rng);
    // Tree bits above the diagonal count only without causal: both kinds of plan.
    if (GetParam() == MaskOp::kDecode && chance(rng, 0.5)) c.causal = false;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const CaseMasks masks = masks_for(c, GetParam(), index, rng);
    const Outputs expected = test::run_reference(buffers, masks);
    check_all_paths(buffers, masks, expected,
                    std::string(masks.tree ? "tree" : "custom") + " #" + std::to_string(index) +
                        ": " + c.describe());
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, MaskMatrix,
                         ::testing::Values(MaskOp::kRagged, MaskOp::kPaged, MaskOp::kDecode),
                         [](const auto& info) { return std::string(mask_op_name(info.param)); });

// Block masks (64 x 64 blocks, as the bench) over every page size and GQA ratio, lengths that
// are not multiples of anything.
TEST(Masks, BlockMasksOverPageSizesAndGroups) {
  std::mt19937_64 rng(test::sinks_seed(35500));
  for (int32_t page_size : {1, 3, 16, 64, 128}) {
    for (int32_t group : {1, 2, 3, 8}) {
      AttentionCase c;
      c.q_lens = {67, 0, 130, 1};
      c.kv_lens = {131, 40, 197, 0};
      c.num_kv_heads = 2;
      c.num_qo_heads = 2 * group;
      c.head_dim = 64;
      c.q_dtype = c.kv_dtype = DType::kBFloat16;
      c.paged = page_size != 3 || group != 3;  // one ragged case too
      c.page_size = page_size;
      c.causal = group % 2 == 1;
      AttentionBuffers buffers = test::make_buffers(c, rng);
      const CaseMasks masks = test::custom_masks(c, MaskPattern::kBlocks, rng, 0.5, 64);
      check_all_paths(buffers, masks, test::run_reference(buffers, masks), c.describe());
    }
  }
}

// Long key ranges that the CPU planner itself splits (8 threads): custom and tree masks.
TEST(Masks, PlannerSplitsLongRanges) {
  set_num_threads(8);
  std::mt19937_64 rng(test::sinks_seed(35600));
  for (bool tree : {false, true}) {
    AttentionCase c;
    c.q_lens = tree ? std::vector<int32_t>{6, 6} : std::vector<int32_t>{9, 3};
    c.kv_lens = {3000, 37};
    c.uniform_q = tree;
    c.paged = true;
    c.page_size = 16;
    c.num_kv_heads = 2;
    c.num_qo_heads = 8;
    c.head_dim = 64;
    c.causal = true;
    c.with_sinks = true;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const CaseMasks masks = tree ? test::tree_masks(c, TreeShape::kTree, rng)
                                 : test::custom_masks(c, MaskPattern::kBlocks, rng, 0.5, 64);
    const Plan plan = test::plan_for(buffers, Device{});
    EXPECT_FALSE(plan.merges.empty()) << "the planner did not split:\n" << plan.explain();
    const Outputs expected = test::run_reference(buffers, masks);
    EXPECT_EQ(compare(buffers, run_api(buffers, masks, &plan), expected), "") << c.describe();
  }
  set_num_threads(0);
}

// K and V of a key that the mask hides from every row are never read: NaN there changes
// nothing. NaN in the V of a key some rows see makes exactly those rows NaN (as the reference).
TEST(Masks, MaskedKeysAreNeverRead) {
  std::mt19937_64 rng(test::sinks_seed(35700));
  for (int index = 0; index < 9; ++index) {
    const MaskOp op = static_cast<MaskOp>(index % 3);
    AttentionCase c = mask_case(op, rng, {DType::kFloat32});
    c.kv_dtype = DType::kFloat32;
    AttentionBuffers clean = test::make_buffers(c, rng);
    const CaseMasks masks = op == MaskOp::kDecode
                                ? test::tree_masks(c, TreeShape::kTree, rng)
                                : test::custom_masks(c, MaskPattern::kBlocks, rng, 0.4, 32);
    const Outputs expected = test::run_reference(clean, masks);
    AttentionBuffers hidden = clean, partly = clean;
    const detail::AttentionProblem problem = test::make_problem(clean);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int32_t b = 0; b < c.batch_size(); ++b) {
      for (int32_t j = 0; j < c.kv_lens[b]; ++j) {
        int32_t seen = 0;
        for (int32_t i = 0; i < c.q_lens[b]; ++i) {
          seen += masks.visible(b, i, j, c.q_lens[b], c.kv_lens[b]) &&
                  c.mask().visible(i, j, c.q_lens[b], c.kv_lens[b]);
        }
        const bool hide = seen == 0, poison_v = seen > 0 && chance(rng, 0.02);
        for (int32_t h = 0; h < c.num_kv_heads; ++h) {
          for (int32_t d = 0; d < c.head_dim; ++d) {
            float* k = reinterpret_cast<float*>(hidden.k.data()) + problem.kv.k_offset(b, h, j);
            float* v = reinterpret_cast<float*>(hidden.v.data()) + problem.kv.v_offset(b, h, j);
            if (hide) k[d] = v[d] = nan;
            if (poison_v)
              reinterpret_cast<float*>(partly.v.data())[problem.kv.v_offset(b, h, j) + d] = nan;
          }
        }
      }
    }
    check_all_paths(hidden, masks, expected, "hidden keys NaN, " + c.describe());
    // Partly seen keys with NaN V: NaN exactly where the reference has it.
    const Outputs nan_expected = test::run_reference(partly, masks);
    for (detail::CpuIsa isa :
         {detail::CpuIsa::kGeneric, detail::CpuIsa::kAvx2, detail::CpuIsa::kAvx512}) {
      if (!detail::cpu_supports(isa)) continue;
      const Outputs actual = run_fast(partly, &masks, {}, isa);
      for (size_t e = 0; e < actual.o.size() / 4; ++e) {
        float got, want;
        std::memcpy(&got, actual.o.data() + e * 4, 4);
        std::memcpy(&want, nan_expected.o.data() + e * 4, 4);
        ASSERT_EQ(std::isnan(got), std::isnan(want)) << c.describe() << " element " << e;
        if (!std::isnan(want)) {
          ASSERT_NEAR(got, want, 1e-4 * (1 + std::fabs(want)));
        }
      }
    }
  }
}

// ---- validation, the one-shot calls, cascade and CUDA plans ----

// The fixture's shapes (tests/common/validation_fixture.hpp): prefill q_lens {3, 2}, kv_lens
// {4, 3}, so request 0 needs ceil(12 / 8) = 2 mask bytes and request 1 ceil(6 / 8) = 1; decode
// with one draft per request needs 1 tree byte per request.
class MaskValidation : public test::ValidationTest {
 protected:
  std::vector<uint8_t> mask_bytes = std::vector<uint8_t>(8, 0xa5);
  std::vector<int32_t> offsets = {0, 2, 3};
  std::vector<int32_t> wide_offsets = std::vector<int32_t>(3, 0);
  std::vector<uint8_t> tree_bytes = std::vector<uint8_t>(8, 0xff);

  TensorView custom(int64_t bytes = 3) {
    return make_view(mask_bytes.data(), DType::kUInt8, {bytes});
  }
  TensorView indptr() { return make_view(offsets.data(), DType::kInt32, {3}); }
  TensorView tree(int64_t rows = 2, int64_t bytes = 1) {
    return make_view(tree_bytes.data(), DType::kUInt8, {rows, bytes});
  }
  static RunOptions with(TensorView custom_mask, TensorView mask_indptr,
                         TensorView tree_mask = {}) {
    RunOptions options;
    options.custom_mask = custom_mask;
    options.mask_indptr = mask_indptr;
    options.tree_mask = tree_mask;
    return options;
  }
  // Every prefill entry point with `options` rejected naming `field`.
  void expect_prefill_rejected(const RunOptions& options, const std::string& field,
                               Error::Kind kind = Error::Kind::kInvalidArgument) {
    expect_rejected(
        [&] {
          run_ragged_prefill(ragged_plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace, nullptr,
                             options);
        },
        kind, field);
    expect_rejected(
        [&] {
          run_paged_prefill(paged_plan, q, cache, qo_indptr, o, lse, workspace, nullptr, options);
        },
        kind, field);
    expect_rejected(
        [&] { ragged_prefill(q, k, v, qo_indptr, kv_indptr, o, lse, {}, nullptr, options); }, kind,
        field);
    expect_rejected([&] { paged_prefill(q, cache, qo_indptr, o, lse, {}, nullptr, options); }, kind,
                    field);
  }
  void expect_decode_rejected(const RunOptions& options, const std::string& field) {
    expect_invalid(
        [&] {
          run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace, nullptr,
                     options);
        },
        field);
    expect_invalid([&] { decode(q_decode, cache, o_decode, lse_decode, {}, nullptr, options); },
                   field);
  }
};

TEST_F(MaskValidation, CustomMaskErrorsNameTheField) {
  const std::string mask = "run_options.custom_mask", ind = "run_options.mask_indptr";
  std::vector<int32_t> int_bytes(8, 0);
  expect_prefill_rejected(with(custom(), {}), ind);   // mask without offsets
  expect_prefill_rejected(with({}, indptr()), mask);  // offsets without mask
  expect_prefill_rejected(with(make_view(int_bytes.data(), DType::kInt32, {3}), indptr()), mask);
  expect_prefill_rejected(with(make_view(mask_bytes.data(), DType::kUInt8, {1, 3}), indptr()),
                          mask);  // 2-D
  expect_prefill_rejected(with(make_view(mask_bytes.data(), DType::kUInt8, {3}, {2}), indptr()),
                          mask);  // strided
  expect_prefill_rejected(with(make_view(nullptr, DType::kUInt8, {3}), indptr()), mask);
  expect_prefill_rejected(
      with(make_view(mask_bytes.data(), DType::kUInt8, {3}, Device{DeviceType::kCUDA, 0}),
           indptr()),
      mask);
  expect_prefill_rejected(with(custom(), make_view(offsets.data(), DType::kInt32, {2})), ind);
  expect_prefill_rejected(with(custom(), make_view(int_bytes.data(), DType::kInt64, {3})), ind);
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{-1, 2, 3},  // negative start
                                          std::vector<int32_t>{0, 3, 2},   // decreasing
                                          std::vector<int32_t>{0, 1, 2},   // request 0: 1 < 2 bytes
                                          std::vector<int32_t>{0, 2, 2},   // request 1: 0 < 1
                                          std::vector<int32_t>{0, 2, 4}}) {  // past the 3 bytes
    offsets = bad;
    expect_prefill_rejected(with(custom(), indptr()), ind);
  }
  offsets = {0, 2, 3};
  // Decode takes no custom mask: whichever of the pair is given is named.
  expect_decode_rejected(with(custom(), indptr()), mask);
  expect_decode_rejected(with({}, indptr()), ind);
  // Exactly enough bytes and a first offset > 0 are fine; the mask reaches the rows.
  offsets = {1, 3, 4};
  run_ragged_prefill(ragged_plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace, nullptr,
                     with(custom(4), indptr()));
}

TEST_F(MaskValidation, TreeMaskErrorsNameTheField) {
  const std::string field = "run_options.tree_mask";
  std::vector<int32_t> ints(4, 0);
  expect_decode_rejected(with({}, {}, make_view(ints.data(), DType::kInt32, {2, 1})), field);
  expect_decode_rejected(with({}, {}, make_view(tree_bytes.data(), DType::kUInt8, {2})), field);
  expect_decode_rejected(with({}, {}, tree(3, 1)), field);  // batch 2
  expect_decode_rejected(with({}, {}, tree(2, 0)), field);  // < ceil(1 / 8) = 1 byte
  expect_decode_rejected(with({}, {}, make_view(tree_bytes.data(), DType::kUInt8, {2, 2}, {2, 2})),
                         field);  // strided bytes
  expect_decode_rejected(with({}, {}, make_view(nullptr, DType::kUInt8, {2, 1})), field);
  expect_decode_rejected(
      with({}, {},
           make_view(tree_bytes.data(), DType::kUInt8, {2, 1}, Device{DeviceType::kCUDA, 0})),
      field);
  // Prefill takes no tree mask.
  expect_prefill_rejected(with({}, {}, tree()), field);
  // A row stride of 0 (one tree for the batch) is fine.
  run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace, nullptr,
             with({}, {}, make_view(tree_bytes.data(), DType::kUInt8, {2, 1}, {0, 1})));
}

// The same plan on a CUDA device: Error(kUnsupported) naming the field before any launch (the
// tensors here are host memory labelled CUDA: nothing may touch them). tests/test_cuda_masks.cpp
// checks the same on a real GPU.
TEST_F(MaskValidation, CudaPlansRejectMasksAsUnsupported) {
  const Device gpu{DeviceType::kCUDA, 0};
  auto on_gpu = [&](TensorView view) {
    view.device = gpu;
    return view;
  };
  std::vector<uint16_t> half_q(test::kTotalQ * test::kQoHeads * test::kHeadDim, 0);
  std::vector<uint16_t> half_kv(test::kTotalKv * test::kKvHeads * test::kHeadDim, 0);
  Plan plan = ragged_plan;
  plan.device = gpu;
  const TensorView q16 = on_gpu(
      make_view(half_q.data(), DType::kFloat16, {test::kTotalQ, test::kQoHeads, test::kHeadDim}));
  const TensorView o16 = on_gpu(
      make_view(out.o.data(), DType::kFloat16, {test::kTotalQ, test::kQoHeads, test::kHeadDim}));
  const TensorView kv16 = on_gpu(
      make_view(half_kv.data(), DType::kFloat16, {test::kTotalKv, test::kKvHeads, test::kHeadDim}));
  expect_rejected(
      [&] {
        run_ragged_prefill(plan, q16, kv16, kv16, on_gpu(qo_indptr), on_gpu(kv_indptr), o16, {},
                           workspace, nullptr, with(on_gpu(custom()), on_gpu(indptr())));
      },
      Error::Kind::kUnsupported, "run_options.custom_mask");
  Plan decode_gpu = decode_plan;
  decode_gpu.device = gpu;
  const TensorView qd16 =
      on_gpu(make_view(half_q.data(), DType::kFloat16, {2, test::kQoHeads, test::kHeadDim}));
  const TensorView od16 =
      on_gpu(make_view(out.o_decode.data(), DType::kFloat16, {2, test::kQoHeads, test::kHeadDim}));
  std::vector<uint16_t> half_cache(
      test::kNumPages * test::kPageSize * test::kKvHeads * test::kHeadDim, 0);
  PagedKVCache gpu_cache = cache;
  gpu_cache.k_cache = gpu_cache.v_cache =
      on_gpu(make_view(half_cache.data(), DType::kFloat16,
                       {test::kNumPages, test::kPageSize, test::kKvHeads, test::kHeadDim}));
  gpu_cache.page_indptr = on_gpu(cache.page_indptr);
  gpu_cache.page_indices = on_gpu(cache.page_indices);
  gpu_cache.last_page_len = on_gpu(cache.last_page_len);
  expect_rejected(
      [&] {
        run_decode(decode_gpu, qd16, gpu_cache, od16, {}, workspace, nullptr,
                   with({}, {}, on_gpu(tree())));
      },
      Error::Kind::kUnsupported, "run_options.tree_mask");
}

TEST_F(MaskValidation, CascadeTakesNoMask) {
  const std::vector<CascadeLevelLengths> lengths = {
      {qo_indptr_values, page_indptr_values, last_page_len_values}};
  const CascadePlan plan =
      plan_cascade(lengths, test::kPageSize, test::kQoHeads, test::kKvHeads, test::kHeadDim, {});
  std::vector<unsigned char> space(std::max<size_t>(plan.workspace_bytes, 1));
  const CascadeLevel level{qo_indptr, cache.page_indptr, cache.page_indices, cache.last_page_len};
  for (const auto& [options, field] :
       {std::pair{with(custom(), indptr()), "run_options.custom_mask"},
        {with({}, {}, tree()), "run_options.tree_mask"}}) {
    expect_invalid(
        [&] {
          run_cascade(plan, q, cache.k_cache, cache.v_cache, KVLayout::kNHD, {&level, 1}, o, lse,
                      {space.data(), space.size()}, nullptr, options);
        },
        field);
  }
}

// The one-shot calls take the masks like plan + run.
TEST(Masks, OneShotCallsMatchPlanAndRun) {
  std::mt19937_64 rng(test::sinks_seed(35800));
  for (MaskOp op : {MaskOp::kRagged, MaskOp::kPaged, MaskOp::kDecode}) {
    AttentionCase c = mask_case(op, rng, {DType::kFloat32});
    c.q_head_pad = c.q_token_pad = c.o_head_pad = c.o_token_pad = c.kv_head_pad = 0;
    c.kv_token_pad = c.lse_token_pad = 0;
    c.with_sinks = false;
    c.kv_dtype = DType::kFloat32;
    c.k_scale = c.v_scale = 1.0f;
    c.spare_pages = 0;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const CaseMasks masks = masks_for(c, op, 0, rng);
    const Outputs planned = run_api(buffers, masks);
    test::poison_outputs(buffers);
    const test::BufferPointers p = test::host_pointers(buffers);
    const int64_t rows = c.total_q();
    auto view3 = [&](const void* data, DType dtype, int64_t n, int64_t h) {
      return make_view(const_cast<void*>(data), dtype, {n, h, c.head_dim});
    };
    const TensorView qv = view3(p.q, c.q_dtype, rows, c.num_qo_heads);
    const TensorView ov = view3(p.o, c.q_dtype, rows, c.num_qo_heads);
    const TensorView lv =
        c.with_lse ? make_view(p.lse, DType::kFloat32, {rows, c.num_qo_heads}) : TensorView{};
    const TensorView qo = make_view(buffers.qo_indptr.data(), DType::kInt32,
                                    {static_cast<int64_t>(buffers.qo_indptr.size())});
    AttentionOptions options = test::options_of(c);
    const RunOptions run_options = masks.run_options();
    if (op == MaskOp::kRagged) {
      const TensorView kv_indptr = make_view(buffers.kv_indptr.data(), DType::kInt32,
                                             {static_cast<int64_t>(buffers.kv_indptr.size())});
      const int64_t kv_rows = std::max<int64_t>(c.total_kv(), 0);
      ragged_prefill(qv, view3(p.k, c.kv_dtype, kv_rows, c.num_kv_heads),
                     view3(p.v, c.kv_dtype, kv_rows, c.num_kv_heads), qo, kv_indptr, ov, lv,
                     options, nullptr, run_options);
    } else {
      PagedKVCache cache;
      cache.layout = c.layout;
      const bool nhd = c.layout == KVLayout::kNHD;
      for (auto [target, data] : {std::pair{&cache.k_cache, p.k}, {&cache.v_cache, p.v}}) {
        *target = nhd ? make_view(const_cast<void*>(data), c.kv_dtype,
                                  {buffers.num_pages, c.page_size, c.num_kv_heads, c.head_dim})
                      : make_view(const_cast<void*>(data), c.kv_dtype,
                                  {buffers.num_pages, c.num_kv_heads, c.page_size, c.head_dim});
      }
      auto ints = [](std::vector<int32_t>& values) {
        return make_view(values.data(), DType::kInt32, {static_cast<int64_t>(values.size())});
      };
      cache.page_indptr = ints(buffers.page_indptr);
      cache.page_indices = ints(buffers.page_indices);
      cache.last_page_len = ints(buffers.last_page_len);
      if (op == MaskOp::kPaged) {
        paged_prefill(qv, cache, qo, ov, lv, options, nullptr, run_options);
      } else {
        decode(qv, cache, ov, lv, options, nullptr, run_options);
      }
    }
    EXPECT_EQ(buffers.o, planned.o) << mask_op_name(op) << " " << c.describe();
    EXPECT_EQ(buffers.lse, planned.lse) << mask_op_name(op) << " " << c.describe();
  }
}

}  // namespace
}  // namespace tessera
