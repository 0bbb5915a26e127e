// head_dim_qk != head_dim_vo on the CPU (AttentionOptions::head_dim_vo, issue 34 item 2):
// the reference against identities that use only its equal-width form (the values' features are
// independent columns: a wide v is two narrow ones side by side, a narrow v is the first columns
// of a wide one), then the fast path (every ISA the host has, unsplit and split along keys by
// hand-made plans) and the public plan/run API (the real planner, its own splits included)
// against the reference on random shapes and pairs such as (192, 128) and (64, 512), in ragged
// prefill, paged prefill (NHD / HND, pages 1..128) and decode; the one-shot calls, which take the
// width from v; and the bad-input cases, each named and leaving the outputs untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/validation_fixture.hpp"
#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "tessera/backend.hpp"
#include "tessera/context_parallel.hpp"

namespace tessera {
namespace {

using test::AttentionBuffers;
using test::AttentionCase;
using test::Outputs;

// The pairs the issue names, both directions, and widths that are not multiples of the SIMD
// width (8 / 16 lanes: 40, 72, 152).
const std::vector<std::pair<int32_t, int32_t>> kPairs = {
    {192, 128}, {64, 512}, {128, 64}, {64, 256}, {96, 160}, {40, 72}, {256, 512}, {152, 8}};

std::pair<int32_t, int32_t> random_pair(std::mt19937_64& rng) {
  if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) {  // any pair in range
    return {8 * std::uniform_int_distribution<int32_t>(1, 32)(rng),
            8 * std::uniform_int_distribution<int32_t>(1, 64)(rng)};
  }
  return kPairs[std::uniform_int_distribution<size_t>(0, kPairs.size() - 1)(rng)];
}

// A random case of the given op with a random (qk, vo) pair; lengths kept small for the double
// reference at vo 512.
AttentionCase random_vo_case(std::mt19937_64& rng, bool paged, bool decode) {
  test::RandomCaseOptions options;
  options.allow_paged = paged;
  options.max_reference_macs = 4'000'000;
  AttentionCase c = test::random_case(rng, options);
  if (paged != c.paged) {  // random_case draws paged with some probability
    c.paged = paged;
  }
  const auto [qk, vo] = random_pair(rng);
  c.head_dim = qk;
  c.head_dim_vo = vo == qk ? 0 : vo;
  if (c.paged) c.page_size = std::vector<int32_t>{1, 3, 16, 64, 128}[rng() % 5];
  if (decode) {
    c.paged = true;
    c.uniform_q = true;
    const int32_t q = std::uniform_int_distribution<int32_t>(1, 4)(rng);
    std::fill(c.q_lens.begin(), c.q_lens.end(), q);
    for (int32_t& len : c.kv_lens) len = std::min(len, 200);
  }
  c.with_sinks = rng() % 4 == 0;
  return c;
}

Outputs reference(AttentionBuffers& buffers) {
  test::poison_outputs(buffers);
  detail::cpu_reference_attention(test::make_problem(buffers));
  return test::copy_outputs(buffers);
}

void expect_close(const AttentionBuffers& buffers, const Outputs& actual, const Outputs& expected,
                  const std::string& what) {
  const AttentionCase& c = buffers.test_case;
  const test::Comparison result = test::compare_outputs(buffers, actual, expected);
  EXPECT_TRUE(result.ok(test::default_tolerance(c), test::default_lse_tolerance(c)))
      << what << ": " << result.describe() << " | " << c.describe();
}

// ---- the reference, against its equal-width form ----

// v of width 2d is [v1 | v2]: o over (d, 2d) is o over (d, d) with v1 beside o over (d, d) with
// v2, and all three lse agree. Exact: each feature's sum is computed on its own.
TEST(HeadDimVoReference, WideValuesAreNarrowOnesSideBySide) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 12; ++trial) {
    AttentionCase c = random_vo_case(rng, trial % 2 == 1, trial % 4 == 3);
    c.head_dim = 8 * std::uniform_int_distribution<int32_t>(1, 16)(rng);
    c.head_dim_vo = 2 * c.head_dim;
    c.q_dtype = c.kv_dtype = DType::kFloat32;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs wide = reference(buffers);

    detail::AttentionProblem halves = test::make_problem(buffers);
    halves.head_dim_vo = c.head_dim;
    test::poison_outputs(buffers);
    detail::cpu_reference_attention(halves);  // v1 -> o[:, :, :d]
    const Outputs first = test::copy_outputs(buffers);
    halves.kv.v = static_cast<const float*>(halves.kv.v) + c.head_dim;
    halves.o = static_cast<float*>(halves.o) + c.head_dim;
    detail::cpu_reference_attention(halves);  // v2 -> o[:, :, d:]
    const Outputs both = test::copy_outputs(buffers);
    EXPECT_EQ(wide.lse, first.lse) << c.describe();  // (empty without lse)
    EXPECT_EQ(wide.o, both.o) << c.describe();
  }
}

// A narrow v (vo < qk) gives the first vo features of the equal-width result over the same rows.
TEST(HeadDimVoReference, NarrowValuesAreTheFirstColumns) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 12; ++trial) {
    AttentionCase c = random_vo_case(rng, trial % 2 == 1, trial % 4 == 3);
    c.head_dim = 16 * std::uniform_int_distribution<int32_t>(1, 16)(rng);
    c.head_dim_vo = 0;
    c.q_dtype = c.kv_dtype = DType::kFloat32;
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs full = reference(buffers);
    detail::AttentionProblem narrow = test::make_problem(buffers);
    const int32_t vo = 8 * std::uniform_int_distribution<int32_t>(1, c.head_dim / 8 - 1)(rng);
    narrow.head_dim_vo = vo;
    test::poison_outputs(buffers);
    detail::cpu_reference_attention(narrow);
    const Outputs part = test::copy_outputs(buffers);
    EXPECT_EQ(full.lse, part.lse) << c.describe();  // (empty without lse)
    for (int64_t token = 0; token < c.total_q(); ++token) {
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        const size_t at = (token * buffers.o_stride_token + h * buffers.o_stride_head) * 4;
        EXPECT_EQ(std::memcmp(full.o.data() + at, part.o.data() + at, vo * 4u), 0)
            << "token " << token << " head " << h << ", vo " << vo << ": " << c.describe();
        // Past vo the narrow run wrote nothing: the poison is still there.
        float after = 0;
        std::memcpy(&after, part.o.data() + at + vo * 4u, 4);
        EXPECT_TRUE(std::isnan(after)) << "wrote past head_dim_vo: " << c.describe();
      }
    }
  }
}

// ---- the fast path and the public API against the reference ----

TEST(HeadDimVoFastPath, EveryIsaSplitAndUnsplitMatchesTheReference) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 24; ++trial) {
    const AttentionCase c = random_vo_case(rng, trial % 3 != 0, trial % 3 == 2);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs expected = reference(buffers);
    for (detail::CpuIsa isa :
         {detail::CpuIsa::kGeneric, detail::CpuIsa::kAvx2, detail::CpuIsa::kAvx512}) {
      if (!detail::cpu_supports(isa)) continue;
      for (const test::TestPlanOptions& options :
           {test::TestPlanOptions{64, 0, 2}, test::TestPlanOptions{16, 37, 3}}) {
        test::poison_outputs(buffers);
        const Plan plan = test::make_test_plan(c, options);
        std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
        set_num_threads(2);
        detail::cpu_fast_attention_with_isa(plan, test::make_problem(buffers),
                                            Workspace{workspace.data(), workspace.size()}, isa);
        set_num_threads(0);
        expect_close(buffers, test::copy_outputs(buffers), expected,
                     std::string("fast path ") + detail::cpu_isa_name(isa) +
                         (options.kv_chunk > 0 ? " split" : " unsplit"));
      }
    }
  }
}

TEST(HeadDimVoApi, PlanAndRunMatchTheReference) {
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 30; ++trial) {
    const bool decode = trial % 3 == 2;
    const AttentionCase c = random_vo_case(rng, trial % 3 != 0, decode);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs expected = reference(buffers);
    const Plan plan = test::plan_for(buffers, Device{});
    ASSERT_EQ(plan.head_dim_v(), c.head_dim_v());
    expect_close(buffers, test::run_through_api(buffers, Device{}, &plan), expected,
                 op_name(plan.op));
  }
}

// ---- the one-shot calls and validation (the fixture's head_dim 16, v of width 8) ----

class HeadDimVoValidation : public test::ValidationTest {
 protected:
  static constexpr int kVo = 8;
  void SetUp() override {
    ValidationTest::SetUp();
    v_narrow =
        make_view(v_narrow_data.data(), DType::kFloat32, {test::kTotalKv, test::kKvHeads, kVo});
    v_cache_narrow = make_view(v_cache_narrow_data.data(), DType::kFloat32,
                               {test::kNumPages, test::kPageSize, test::kKvHeads, kVo});
    narrow_cache = cache;
    narrow_cache.v_cache = v_cache_narrow;
    o_narrow =
        make_view(o_narrow_data.data(), DType::kFloat32, {test::kTotalQ, test::kQoHeads, kVo});
    o_decode_narrow =
        make_view(o_decode_narrow_data.data(), DType::kFloat32, {2, test::kQoHeads, kVo});
    options.head_dim_vo = kVo;
  }
  std::vector<float> v_narrow_data = test::pattern(test::kTotalKv * test::kKvHeads * kVo);
  std::vector<float> v_cache_narrow_data =
      test::pattern(test::kNumPages * test::kPageSize * test::kKvHeads * kVo);
  std::vector<float> o_narrow_data =
      std::vector<float>(test::kTotalQ * test::kQoHeads * kVo, test::kOutputSentinel);
  std::vector<float> o_decode_narrow_data =
      std::vector<float>(2 * test::kQoHeads * kVo, test::kOutputSentinel);
  TensorView v_narrow, v_cache_narrow, o_narrow, o_decode_narrow;
  PagedKVCache narrow_cache;
  AttentionOptions options;
};

TEST_F(HeadDimVoValidation, OneShotCallsTakeTheWidthFromV) {
  const Plan ragged = plan_ragged_prefill(qo_indptr_values, kv_indptr_values, test::kQoHeads,
                                          test::kKvHeads, test::kHeadDim, options);
  std::vector<uint8_t> space(std::max<size_t>(ragged.workspace_bytes, 1));
  run_ragged_prefill(ragged, q, k, v_narrow, qo_indptr, kv_indptr, o_narrow, lse,
                     {space.data(), space.size()});
  const std::vector<float> planned = o_narrow_data;
  std::fill(o_narrow_data.begin(), o_narrow_data.end(), test::kOutputSentinel);
  ragged_prefill(q, k, v_narrow, qo_indptr, kv_indptr, o_narrow, lse);  // no head_dim_vo given
  EXPECT_EQ(o_narrow_data, planned);
  EXPECT_NE(o_narrow_data[0], test::kOutputSentinel);

  const Plan decode_plan_vo = plan_decode(page_indptr_values, last_page_len_values, test::kPageSize,
                                          test::kQoHeads, test::kKvHeads, test::kHeadDim, options);
  space.assign(std::max<size_t>(decode_plan_vo.workspace_bytes, 1), 0);
  run_decode(decode_plan_vo, q_decode, narrow_cache, o_decode_narrow, lse_decode,
             {space.data(), space.size()});
  const std::vector<float> planned_decode = o_decode_narrow_data;
  std::fill(o_decode_narrow_data.begin(), o_decode_narrow_data.end(), test::kOutputSentinel);
  decode(q_decode, narrow_cache, o_decode_narrow, lse_decode);
  EXPECT_EQ(o_decode_narrow_data, planned_decode);
  paged_prefill(q, narrow_cache, qo_indptr, o_narrow, lse);  // runs: the width from v_cache
}

TEST_F(HeadDimVoValidation, RejectsBadWidthsByName) {
  for (int32_t bad : {-8, 4, 12, 520, 1024}) {
    AttentionOptions bad_options;
    bad_options.head_dim_vo = bad;
    expect_invalid(
        [&] {
          (void)plan_ragged_prefill(qo_indptr_values, kv_indptr_values, test::kQoHeads,
                                    test::kKvHeads, test::kHeadDim, bad_options);
        },
        "options.head_dim_vo");
    expect_invalid(
        [&] {
          (void)plan_decode(page_indptr_values, last_page_len_values, test::kPageSize,
                            test::kQoHeads, test::kKvHeads, test::kHeadDim, bad_options);
        },
        "options.head_dim_vo");
  }
  const Plan ragged = plan_ragged_prefill(qo_indptr_values, kv_indptr_values, test::kQoHeads,
                                          test::kKvHeads, test::kHeadDim, options);
  const Plan paged =
      plan_paged_prefill(qo_indptr_values, page_indptr_values, last_page_len_values,
                         test::kPageSize, test::kQoHeads, test::kKvHeads, test::kHeadDim, options);
  std::vector<uint8_t> space(std::max({ragged.workspace_bytes, paged.workspace_bytes, size_t{1}}));
  const Workspace ws{space.data(), space.size()};
  const auto snapshot_narrow = o_narrow_data;
  // v of the qk width for a plan of vo 8; o of the qk width; v_cache of the qk width.
  expect_invalid(
      [&] { run_ragged_prefill(ragged, q, k, v, qo_indptr, kv_indptr, o_narrow, lse, ws); }, "v");
  expect_invalid(
      [&] { run_ragged_prefill(ragged, q, k, v_narrow, qo_indptr, kv_indptr, o, lse, ws); }, "o");
  expect_invalid([&] { run_paged_prefill(paged, q, cache, qo_indptr, o_narrow, lse, ws); },
                 "v_cache");
  // A plan of equal widths given narrow tensors.
  expect_invalid(
      [&] {
        run_ragged_prefill(ragged_plan, q, k, v_narrow, qo_indptr, kv_indptr, o, lse, workspace);
      },
      "v");
  EXPECT_EQ(o_narrow_data, snapshot_narrow);
  // Context-parallel prefill keeps equal widths.
  EXPECT_TRUE(test::fails_with(
      [&] {
        (void)plan_context_parallel_prefill(64, 2, 0, test::kQoHeads, test::kKvHeads,
                                            test::kHeadDim, DType::kFloat32, options);
      },
      Error::Kind::kUnsupported, "'options.head_dim_vo'"));
}

}  // namespace
}  // namespace tessera
