// Non-finite inputs on the CPU (issue 38; the definition is in include/tessera/attention.hpp):
// NaN, +inf and -inf in q, k and v through ragged prefill, paged prefill (page sizes 1 and 16)
// and decode, causal and not, GQA groups 1 / 4 / 8, fp16 / bf16 (and fp32), on the reference,
// on the fast path through the public API, and on every ISA the host has with a hand-made
// split-KV plan (pieces of 17 keys: partial tiles and merges everywhere). Each case checks that
// exactly the rows the bad value touches are NaN (o and lse) or empty or carry it in one
// feature, and that every other row is bit for bit the run without it and close to the
// reference (tests/common/nonfinite_testing.hpp). Then merge_state / merge_states with NaN and
// empty partials, and checked mode (set_index_checking): a NaN / inf input the call reads is
// rejected naming the tensor and its first index, and nothing the call does not read is.
// The same matrix on the GPU: tests/test_cuda_nonfinite.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/nonfinite_testing.hpp"
#include "core/half.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using detail::CpuIsa;
using test::AttentionBuffers;
using test::AttentionCase;
using test::NonfiniteCase;
using test::NonfiniteReference;
using test::NonfiniteShape;
using test::Outputs;
using test::Poison;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const Device kCpu{DeviceType::kCPU, 0};

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (detail::cpu_supports(isa)) isas.push_back(isa);
  }
  return isas;
}

// Restores the fast path and unchecked mode when a test ends, whatever happened.
class CpuStateGuard {
 public:
  CpuStateGuard() = default;
  ~CpuStateGuard() {
    set_cpu_impl(CpuImpl::kFast);
    set_index_checking(false);
  }
  CpuStateGuard(const CpuStateGuard&) = delete;
  CpuStateGuard& operator=(const CpuStateGuard&) = delete;
};

Outputs run_isa(AttentionBuffers& buffers, const Plan& plan, CpuIsa isa) {
  test::poison_outputs(buffers);
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  detail::cpu_fast_attention_with_isa(plan, test::make_problem(buffers),
                                      Workspace{workspace.data(), workspace.size()}, isa);
  return test::copy_outputs(buffers);
}

// One point of the matrix: the reference itself, the reference and fast paths through the API,
// and every ISA on a hand-made split plan.
void check_point(const NonfiniteShape& shape, Poison poison, uint64_t seed,
                 bool expect_planner_split = false) {
  const CpuStateGuard guard;
  std::mt19937_64 rng(seed);
  NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape(shape), poison, rng);
  SCOPED_TRACE(shape.describe() + ": " + c.describe());
  ASSERT_GT(c.touched, 0) << "the bad value touches no row";
  ASSERT_GT(c.count(test::RowKind::kClean), 0) << "the bad value leaves no row untouched";
  const AttentionCase& ac = c.poisoned.test_case;
  const double tolerance = test::default_tolerance(ac);
  const double lse_tolerance = test::default_lse_tolerance(ac);
  const NonfiniteReference reference = test::nonfinite_reference(c);
  EXPECT_EQ(test::check_nonfinite(c, reference.poisoned, &reference.clean, reference, tolerance,
                                  lse_tolerance),
            "")
      << "the reference";

  for (CpuImpl impl : {CpuImpl::kReference, CpuImpl::kFast}) {
    set_cpu_impl(impl);
    const Plan plan = test::plan_for(c.poisoned, kCpu);
    if (impl == CpuImpl::kFast && expect_planner_split) {
      EXPECT_FALSE(plan.merges.empty()) << "the planner did not split: " << plan.explain();
    }
    const Outputs clean = test::run_through_api(c.clean, kCpu, &plan);
    const Outputs poisoned = test::run_through_api(c.poisoned, kCpu, &plan);
    EXPECT_EQ(test::check_nonfinite(c, poisoned, &clean, reference, tolerance, lse_tolerance), "")
        << (impl == CpuImpl::kFast ? "fast path" : "reference") << " through the API";
  }
  set_cpu_impl(CpuImpl::kFast);

  test::TestPlanOptions split;
  split.q_tile_rows = 16;
  split.kv_chunk = 17;
  split.num_workers = 3;
  const Plan plan = test::make_test_plan(ac, split);
  for (CpuIsa isa : supported_isas()) {
    const Outputs clean = run_isa(c.clean, plan, isa);
    const Outputs poisoned = run_isa(c.poisoned, plan, isa);
    EXPECT_EQ(test::check_nonfinite(c, poisoned, &clean, reference, tolerance, lse_tolerance), "")
        << "fast path, " << detail::cpu_isa_name(isa) << ", split plan (kv pieces of 17)";
  }
}

enum class Layout { kRagged, kPaged1, kPaged16, kDecode1, kDecode16 };

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kRagged: return "Ragged";
    case Layout::kPaged1: return "PagedPage1";
    case Layout::kPaged16: return "PagedPage16";
    case Layout::kDecode1: return "DecodePage1";
    case Layout::kDecode16: return "DecodePage16";
  }
  return "?";
}

class NonfiniteMatrix : public ::testing::TestWithParam<std::tuple<Layout, Poison>> {};

TEST_P(NonfiniteMatrix, TouchedRowsOnlyOnEveryCpuPath) {
  const auto [layout, poison] = GetParam();
  uint64_t seed = 1000 * static_cast<uint64_t>(layout) + static_cast<uint64_t>(poison);
  int decode_variant = 0;
  for (bool causal : {false, true}) {
    for (int group : {1, 4, 8}) {
      std::vector<DType> dtypes = {DType::kFloat16, DType::kBFloat16};
      if (group == 4) dtypes.push_back(DType::kFloat32);
      for (DType dtype : dtypes) {
        NonfiniteShape shape;
        shape.paged = layout != Layout::kRagged;
        shape.decode = layout == Layout::kDecode1 || layout == Layout::kDecode16;
        shape.page_size = layout == Layout::kPaged1 || layout == Layout::kDecode1 ? 1 : 16;
        shape.causal = causal;
        shape.group_size = group;
        shape.dtype = dtype;
        shape.q_per_request = 1 + decode_variant++ % 4;  // decode: 1 .. 4 query tokens
        check_point(shape, poison, ++seed);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

std::string matrix_name(const ::testing::TestParamInfo<std::tuple<Layout, Poison>>& info) {
  return std::string(layout_name(std::get<0>(info.param))) + "_" +
         test::poison_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Cpu, NonfiniteMatrix,
                         ::testing::Combine(::testing::Values(Layout::kRagged, Layout::kPaged1,
                                                              Layout::kPaged16, Layout::kDecode1,
                                                              Layout::kDecode16),
                                            ::testing::ValuesIn(test::kAllPoisons)),
                         matrix_name);

TEST(NonfiniteCpu, LongDecodeSplitByThePlanner) {
  // One long request: the CPU planner splits its keys across threads, so a NaN partial meets
  // finite and empty ones in the merge.
  const int saved_threads = num_threads();
  set_num_threads(4);
  for (Poison poison : test::kAllPoisons) {
    NonfiniteShape shape;
    shape.decode = true;
    shape.paged = true;
    shape.page_size = 16;
    shape.causal = true;
    shape.group_size = 4;
    shape.dtype = DType::kBFloat16;
    shape.q_per_request = 2;
    shape.long_kv = 1500;
    check_point(shape, poison, 7000 + static_cast<uint64_t>(poison), /*expect_planner_split=*/true);
  }
  set_num_threads(saved_threads);
}

TEST(NonfiniteCpu, SoftCapMakesInfiniteScoresFinite) {
  // cap * tanh(+-inf / cap) = +-cap: under a soft-cap a +inf score is finite (NaN stays NaN).
  const CpuStateGuard guard;
  for (CpuImpl impl : {CpuImpl::kReference, CpuImpl::kFast}) {
    set_cpu_impl(impl);
    std::mt19937_64 rng(31);
    AttentionCase shape = test::nonfinite_shape({});
    shape.soft_cap = 10.0f;
    NonfiniteCase c = test::make_nonfinite_case(shape, Poison::kKPosInf, rng);
    const Outputs out = test::run_through_api(c.poisoned, kCpu);
    const Outputs expected = test::run_reference(c.poisoned);
    const test::Comparison result = test::compare_outputs(c.poisoned, out, expected);
    EXPECT_TRUE(result.ok(test::default_tolerance(shape), test::default_lse_tolerance(shape)))
        << result.describe();
  }
}

// ---- merge_state / merge_states ----

TEST(NonfiniteMerge, MergeStateNaNAndEmptyPartials) {
  const test::MergeStateCase m = test::merge_state_case();
  std::vector<float> o(m.o_a.size(), 7.0f), lse(m.lse_a.size(), 7.0f);
  auto view3 = [&](const std::vector<float>& x) {
    return make_view(const_cast<float*>(x.data()), DType::kFloat32, {m.n, m.h, m.d});
  };
  auto view2 = [&](const std::vector<float>& x) {
    return make_view(const_cast<float*>(x.data()), DType::kFloat32, {m.n, m.h});
  };
  merge_state(view3(m.o_a), view2(m.lse_a), view3(m.o_b), view2(m.lse_b), view3(o), view2(lse));
  EXPECT_EQ(test::check_merge_state(m, o, lse), "");
  // In place (o_out = o_a), as split-KV cascades use it.
  std::vector<float> o_a = m.o_a;
  merge_state(view3(o_a), view2(m.lse_a), view3(m.o_b), view2(m.lse_b), view3(o_a), view2(lse));
  EXPECT_EQ(test::check_merge_state(m, o_a, lse), "") << "in place";
}

TEST(NonfiniteMerge, MergeStatesNaNAndEmptyPartials) {
  test::MergeStatesCase m = test::merge_states_case();
  const int64_t states = static_cast<int64_t>(m.lse.size()), rows = m.rows();
  std::vector<float> o(rows * m.h * m.d, 7.0f), lse_out(rows * m.h, 7.0f);
  merge_states(make_view(m.states.data(), DType::kFloat32, {states, m.h, m.d}),
               make_view(m.lse.data(), DType::kFloat32, {states, m.h}),
               make_view(m.indptr.data(), DType::kInt32, {rows + 1}),
               make_view(o.data(), DType::kFloat32, {rows, m.h, m.d}),
               make_view(lse_out.data(), DType::kFloat32, {rows, m.h}));
  EXPECT_EQ(test::check_merge_states(m, o, lse_out), "");
}

// ---- checked mode ----

// Runs `buffers` through the API with checked mode on; returns the error text ("" if none).
std::string checked_run(AttentionBuffers& buffers) {
  const CpuStateGuard guard;
  set_index_checking(true);
  try {
    (void)test::run_through_api(buffers, kCpu);
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kInvalidArgument) << error.what();
    return error.what();
  }
  return "";
}

TEST(NonfiniteChecked, RejectsTheFirstBadInputNamingIt) {
  for (bool paged : {false, true}) {
    for (bool decode : {false, true}) {
      if (decode && !paged) continue;
      NonfiniteShape shape;
      shape.paged = paged;
      shape.decode = decode;
      shape.causal = true;
      shape.group_size = 4;
      shape.q_per_request = 3;
      for (Poison poison : test::kAllPoisons) {
        if (poison == Poison::kAllScoresNegInf) continue;  // its first bad key is not the site
        std::mt19937_64 rng(40 + static_cast<uint64_t>(poison));
        NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape(shape), poison, rng);
        SCOPED_TRACE(shape.describe() + ": " + c.describe());
        EXPECT_EQ(checked_run(c.clean), "");
        const std::string error = checked_run(c.poisoned);
        const std::string expected = test::checked_message(c);
        EXPECT_EQ(error.rfind(expected, 0), 0u) << "got: " << error << "\nexpected: " << expected;
        // Nothing ran: the outputs keep the poison run_through_api wrote into them.
        for (uint8_t byte : c.poisoned.o) ASSERT_EQ(byte, 0xff);
      }
    }
  }
}

TEST(NonfiniteChecked, FirstInTheOrderOfRequestsKeysHeadsDims) {
  // Two bad keys: the earlier key is reported though its head and dim come later.
  NonfiniteShape shape;
  shape.paged = true;
  shape.page_size = 1;
  shape.group_size = 2;
  std::mt19937_64 rng(50);
  NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape(shape), Poison::kKNaN, rng);
  const detail::AttentionProblem problem = test::make_problem(c.poisoned);
  const int32_t later_key = c.site.key + 3;
  detail::store_from_float(c.poisoned.k.data(), c.poisoned.test_case.kv_dtype,
                           problem.kv.k_offset(c.site.request, 0, later_key) + 1, kInf);
  const std::string error = checked_run(c.poisoned);
  EXPECT_NE(error.find("'k_cache': non-finite value nan at " + test::checked_key_where(c)),
            std::string::npos)
      << error;
}

TEST(NonfiniteChecked, IgnoresWhatTheCallDoesNotRead) {
  // NaN in stride padding, spare pages and page tails (make_buffers), in a q row that sees no
  // key, and in keys outside every row's window: not read, so not reported, and the result is
  // the reference's.
  NonfiniteShape shape;
  shape.paged = true;
  shape.page_size = 16;
  shape.group_size = 4;
  std::mt19937_64 rng(60);
  AttentionCase ac = test::nonfinite_shape(shape);
  ac.window_left = 4;  // the site request's rows see keys >= 70 - 21 - 4 only
  ac.causal = true;
  AttentionBuffers buffers = test::make_buffers(ac, rng);
  const detail::AttentionProblem problem = test::make_problem(buffers);
  for (int32_t d = 0; d < ac.head_dim; ++d) {
    detail::store_from_float(buffers.q.data(), ac.q_dtype, d, kNaN);  // request 0: no key
    for (int32_t j : {0, 10, 44}) {
      detail::store_from_float(buffers.k.data(), ac.kv_dtype, problem.kv.k_offset(1, 1, j) + d,
                               kNaN);
      detail::store_from_float(buffers.v.data(), ac.kv_dtype, problem.kv.v_offset(1, 0, j) + d,
                               kInf);
    }
  }
  EXPECT_EQ(checked_run(buffers), "");
  const Outputs expected = test::run_reference(buffers);
  const test::Comparison result =
      test::compare_outputs(buffers, test::run_through_api(buffers, kCpu), expected);
  EXPECT_TRUE(result.ok(test::default_tolerance(ac), test::default_lse_tolerance(ac)))
      << result.describe();
  // Key 45 is the first one a row sees.
  detail::store_from_float(buffers.k.data(), ac.kv_dtype, problem.kv.k_offset(1, 1, 45) + 2, -kInf);
  EXPECT_NE(checked_run(buffers).find("(request 1, key 45), head 1, dim 2"), std::string::npos);
}

TEST(NonfiniteChecked, Fp8CacheNaNAndInf) {
  // e4m3 has NaN (S.1111.111) but no inf; e5m2 has both.
  for (DType dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    AttentionCase ac = test::nonfinite_shape({});
    ac.paged = true;
    ac.q_dtype = DType::kBFloat16;
    ac.kv_dtype = dtype;
    std::mt19937_64 rng(70);
    AttentionBuffers buffers = test::make_buffers(ac, rng);
    EXPECT_EQ(checked_run(buffers), "") << dtype_name(dtype);
    const detail::AttentionProblem problem = test::make_problem(buffers);
    const bool e4m3 = dtype == DType::kFloat8E4M3;
    buffers.v[problem.kv.v_offset(1, 1, 33) + 5] = e4m3 ? 0x7f : 0x7c;  // NaN / +inf
    const std::string error = checked_run(buffers);
    EXPECT_NE(error.find(std::string("'v_cache': non-finite value ") + (e4m3 ? "nan" : "inf")),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("(request 1, key 33), head 1, dim 5"), std::string::npos) << error;
  }
}

TEST(NonfiniteChecked, OffByDefault) {
  EXPECT_FALSE(index_checking());
  std::mt19937_64 rng(80);
  NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape({}), Poison::kKNaN, rng);
  EXPECT_NO_THROW((void)test::run_through_api(c.poisoned, kCpu));
}

}  // namespace
}  // namespace tessera
