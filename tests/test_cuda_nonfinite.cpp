// The GPU half of tests/test_nonfinite.cpp (issue 38; the definition is in
// include/tessera/attention.hpp): NaN, +inf and -inf in q, k and v through the CUDA backend,
// checked against the CPU reference and the definition (tests/common/nonfinite_testing.hpp):
// exactly the rows the bad value touches are NaN (o and lse), empty, or carry it in one
// feature; every other row is bit for bit the run without it and close to the reference.
//
// The matrix: ragged prefill, paged prefill (page 1, 16) and decode (page 1, 16; 1..4 queries
// per request) x causal or not x GQA 1 / 4 / 8 x head_dim 64 / 128 / 256 (fp16 and bf16 in
// turn) x 10 poisons. Each point runs the public plan (the planner's kernel), on Hopper the
// prefill once more on the portable sm80 kernels (TESSERA_PREFILL_KERNEL=sm80), and a hand-made
// split-KV plan (pieces of 17 keys: partials and merges on every row). Then long key ranges the
// planner itself splits (decode with 1..4 queries, prefill), a bf16 head_dim 128 prefill that the
// sm90 kernels serve on Hopper, merge_state / merge_states with NaN and empty partials on the
// device, and checked mode on device tensors (src/cuda/ops/nonfinite.cu).
//
// Without a CUDA device every test skips (exit 77 under ctest). TESSERA_TEST_REDUCED=1 shrinks
// the matrix; CudaNonfiniteSanitizer.* is a few small cases (and the checked-mode scan kernel) for
//   compute-sanitizer --tool memcheck test_cuda_nonfinite --gtest_filter='*Sanitizer*'
// TESSERA_TEST_SEED varies the random inputs.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_hand_made.hpp"
#include "common/gpu_test_support.hpp"
#include "common/nonfinite_testing.hpp"
#include "common/scoped_env.hpp"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include "core/half.hpp"
#include "core/settings.hpp"
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::AttentionBuffers;
using test::AttentionCase;
using test::hopper;
using test::last_kernel;
using test::DeviceBuffer;
using test::kGpu;
using test::NonfiniteCase;
using test::NonfiniteReference;
using test::NonfiniteShape;
using test::Outputs;
using test::Poison;
using test::reduced_run;

// P is rounded to the input dtype before P x V on the GPU (FlashAttention-2), so fp16/bf16
// outputs are held to 1e-2 relative L2, as in test_cuda_prefill.
constexpr double kOutputTolerance = 1e-2;

Outputs run_hand_made(AttentionBuffers& buffers, const test::TestPlanOptions& options) {
  return test::run_hand_made_on_gpu(buffers, options);
}

struct PointChecks {
  bool expect_planner_split = false;  // the public plan must split some key range
  bool expect_sm90 = false;           // on Hopper the public plan must run an sm90 kernel
};

// One point: the public plan, the sm80 prefill on Hopper, a hand-made split plan.
void check_point(const NonfiniteShape& shape, Poison poison, uint64_t seed,
                 const PointChecks& checks = {}) {
  std::mt19937_64 rng(seed + test::seed_from_env(0));  // TESSERA_TEST_SEED shifts every point
  NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape(shape), poison, rng);
  SCOPED_TRACE(shape.describe() + ": " + c.describe());
  ASSERT_GT(c.touched, 0) << "the bad value touches no row";
  const AttentionCase& ac = c.poisoned.test_case;
  const double lse_tolerance = test::default_lse_tolerance(ac);
  const NonfiniteReference reference = test::nonfinite_reference(c);
  const auto run_public = [&](const std::string& name) {
    const Plan plan = test::plan_for(c.poisoned, kGpu);
    const Outputs clean = test::run_through_api(c.clean, kGpu, &plan);
    const Outputs poisoned = test::run_through_api(c.poisoned, kGpu, &plan);
    EXPECT_EQ(
        test::check_nonfinite(c, poisoned, &clean, reference, kOutputTolerance, lse_tolerance), "")
        << name << ", kernel " << last_kernel(ac) << "\n  " << plan.kernel;
    return plan;
  };
  const Plan plan = run_public("public plan");
  if (checks.expect_planner_split) {
    EXPECT_FALSE(plan.merges.empty()) << "the planner did not split:\n" << plan.explain();
  }
  const bool prefill = test::op_of(ac) != AttentionOp::kDecode;
  if (checks.expect_sm90 && hopper() && !detail::settings().prefill_force_sm80) {
    EXPECT_EQ(last_kernel(ac).rfind("tessera::sm90::", 0), 0u) << "ran " << last_kernel(ac);
  }
  if (prefill && hopper()) {
    const test::ScopedEnv portable("TESSERA_PREFILL_KERNEL", "sm80");  // chosen at plan time
    run_public("public plan on the sm80 kernels");
  }
  test::TestPlanOptions split;
  split.q_tile_rows = 16;
  split.kv_chunk = 17;
  split.num_workers = 5;
  const Outputs clean = run_hand_made(c.clean, split);
  const Outputs poisoned = run_hand_made(c.poisoned, split);
  EXPECT_EQ(test::check_nonfinite(c, poisoned, &clean, reference, kOutputTolerance, lse_tolerance),
            "")
      << "hand-made split plan (kv pieces of 17), kernel " << last_kernel(ac);
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

class CudaNonfiniteMatrix : public ::testing::TestWithParam<std::tuple<Layout, Poison>> {};

TEST_P(CudaNonfiniteMatrix, TouchedRowsOnly) {
  TESSERA_SKIP_WITHOUT_GPU();
  const auto [layout, poison] = GetParam();
  uint64_t seed = 5000 + 1000 * static_cast<uint64_t>(layout) + static_cast<uint64_t>(poison);
  const std::vector<bool> causals =
      reduced_run() ? std::vector<bool>{true} : std::vector<bool>{false, true};
  const std::vector<int> groups =
      reduced_run() ? std::vector<int>{1, 8} : std::vector<int>{1, 4, 8};
  const std::vector<int> head_dims =
      reduced_run() ? std::vector<int>{128} : std::vector<int>{64, 128, 256};
  int turn = 0;
  for (bool causal : causals) {
    for (int group : groups) {
      for (int head_dim : head_dims) {
        NonfiniteShape shape;
        shape.paged = layout != Layout::kRagged;
        shape.decode = layout == Layout::kDecode1 || layout == Layout::kDecode16;
        shape.page_size = layout == Layout::kPaged1 || layout == Layout::kDecode1 ? 1 : 16;
        shape.causal = causal;
        shape.group_size = group;
        shape.head_dim = head_dim;
        shape.dtype = turn % 2 == 0 ? DType::kFloat16 : DType::kBFloat16;
        shape.q_per_request = 1 + turn % 4;  // decode: 1 .. 4 query tokens per request
        ++turn;
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

INSTANTIATE_TEST_SUITE_P(Gpu, CudaNonfiniteMatrix,
                         ::testing::Combine(::testing::Values(Layout::kRagged, Layout::kPaged1,
                                                              Layout::kPaged16, Layout::kDecode1,
                                                              Layout::kDecode16),
                                            ::testing::ValuesIn(test::kAllPoisons)),
                         matrix_name);

TEST(CudaNonfinite, LongKeyRangesSplitByThePlanner) {
  // One long request among short ones: the planner splits its keys, so a NaN partial meets
  // finite and empty ones in the split-KV merge (decode's in-kernel merge, prefill's merge).
  TESSERA_SKIP_WITHOUT_GPU();
  const int32_t kv = reduced_run() ? 2048 : 4096;
  for (Poison poison : test::kAllPoisons) {
    for (int q_per_request = 1; q_per_request <= 4; ++q_per_request) {
      NonfiniteShape shape;
      shape.decode = true;
      shape.page_size = 16;
      shape.causal = true;
      shape.group_size = 4;
      shape.head_dim = 128;
      shape.dtype = q_per_request % 2 ? DType::kBFloat16 : DType::kFloat16;
      shape.q_per_request = q_per_request;
      shape.long_kv = kv;
      check_point(shape, poison, 9000 + 10 * static_cast<uint64_t>(poison) + q_per_request,
                  {.expect_planner_split = true});
    }
    NonfiniteShape prefill;
    prefill.paged = true;
    prefill.page_size = 16;
    prefill.causal = true;
    prefill.group_size = 8;
    prefill.head_dim = 128;
    prefill.dtype = DType::kBFloat16;
    prefill.long_kv = kv;
    prefill.long_q = 8;
    check_point(prefill, poison, 9500 + static_cast<uint64_t>(poison),
                {.expect_planner_split = true});
  }
}

TEST(CudaNonfinite, Sm90PrefillPath) {
  // bf16, head_dim 128, a few hundred queries over twice the keys: the sm90 warp-specialised
  // kernels serve it on Hopper (checked), the sm80 ones elsewhere.
  TESSERA_SKIP_WITHOUT_GPU();
  for (Poison poison : test::kAllPoisons) {
    for (bool paged : {false, true}) {
      for (bool causal : {false, true}) {
        NonfiniteShape shape;
        shape.paged = paged;
        shape.page_size = 16;
        shape.causal = causal;
        shape.group_size = 4;
        shape.head_dim = 128;
        shape.dtype = DType::kBFloat16;
        shape.long_q = reduced_run() ? 130 : 200;
        shape.long_kv = reduced_run() ? 260 : 400;
        check_point(shape, poison, 9800 + 4 * static_cast<uint64_t>(poison) + 2 * paged + causal,
                    {.expect_sm90 = true});
      }
    }
  }
}

// ---- merge_state / merge_states on the device ----

TEST(CudaNonfiniteMerge, MergeStateNaNAndEmptyPartials) {
  TESSERA_SKIP_WITHOUT_GPU();
  const test::MergeStateCase m = test::merge_state_case();
  const DeviceBuffer o_a(m.o_a), lse_a(m.lse_a), o_b(m.o_b), lse_b(m.lse_b);
  DeviceBuffer o(std::vector<float>(m.o_a.size(), 7.0f));
  DeviceBuffer lse(std::vector<float>(m.lse_a.size(), 7.0f));
  auto view3 = [&](const DeviceBuffer& b) {
    return test::gpu_view(b, DType::kFloat32, {m.n, m.h, m.d}, {m.h * m.d, m.d, 1});
  };
  auto view2 = [&](const DeviceBuffer& b) {
    return test::gpu_view(b, DType::kFloat32, {m.n, m.h}, {m.h, 1});
  };
  merge_state(view3(o_a), view2(lse_a), view3(o_b), view2(lse_b), view3(o), view2(lse));
  detail::cuda_synchronize(nullptr);
  EXPECT_EQ(test::check_merge_state(m, o.download<float>(), lse.download<float>()), "");
}

TEST(CudaNonfiniteMerge, MergeStatesNaNAndEmptyPartials) {
  TESSERA_SKIP_WITHOUT_GPU();
  const test::MergeStatesCase m = test::merge_states_case();
  const int64_t states = static_cast<int64_t>(m.lse.size()), rows = m.rows();
  const DeviceBuffer v(m.states), s(m.lse), indptr(m.indptr);
  DeviceBuffer o(std::vector<float>(rows * m.h * m.d, 7.0f));
  DeviceBuffer lse(std::vector<float>(rows * m.h, 7.0f));
  merge_states(test::gpu_view(v, DType::kFloat32, {states, m.h, m.d}, {m.h * m.d, m.d, 1}),
               test::gpu_view(s, DType::kFloat32, {states, m.h}, {m.h, 1}),
               test::gpu_index_view(indptr, rows + 1),
               test::gpu_view(o, DType::kFloat32, {rows, m.h, m.d}, {m.h * m.d, m.d, 1}),
               test::gpu_view(lse, DType::kFloat32, {rows, m.h}, {m.h, 1}));
  detail::cuda_synchronize(nullptr);
  EXPECT_EQ(test::check_merge_states(m, o.download<float>(), lse.download<float>()), "");
}

// ---- checked mode on device tensors ----

// Runs `buffers` on the GPU with checked mode on; returns the error text ("" if none).
std::string checked_run(AttentionBuffers& buffers) {
  set_index_checking(true);
  std::string text;
  try {
    (void)test::run_through_api(buffers, kGpu);
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kInvalidArgument) << error.what();
    text = error.what();
  }
  set_index_checking(false);
  return text;
}

TEST(CudaNonfiniteChecked, RejectsTheFirstBadInputNamingIt) {
  TESSERA_SKIP_WITHOUT_GPU();
  for (Layout layout : {Layout::kRagged, Layout::kPaged16, Layout::kDecode1}) {
    NonfiniteShape shape;
    shape.paged = layout != Layout::kRagged;
    shape.decode = layout == Layout::kDecode1;
    shape.page_size = layout == Layout::kDecode1 ? 1 : 16;
    shape.causal = true;
    shape.group_size = 4;
    shape.head_dim = 128;
    shape.dtype = DType::kBFloat16;
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
    }
  }
}

TEST(CudaNonfiniteChecked, FirstIndexAcrossManyBlocks) {
  // Bad values in many keys of a long cache (thousands of rows, many CTAs of the scan): the
  // reported one is the first in (request, key, head, dim) order, whichever CTA finds it first.
  TESSERA_SKIP_WITHOUT_GPU();
  NonfiniteShape shape;
  shape.decode = true;
  shape.page_size = 16;
  shape.group_size = 4;
  shape.head_dim = 128;
  shape.dtype = DType::kBFloat16;
  shape.long_kv = 4096;
  std::mt19937_64 rng(90);
  AttentionCase ac = test::nonfinite_shape(shape);
  AttentionBuffers buffers = test::make_buffers(ac, rng);
  const detail::AttentionProblem problem = test::make_problem(buffers);
  const float kInf = std::numeric_limits<float>::infinity();
  for (const auto& [key, head, dim] : std::vector<std::tuple<int32_t, int32_t, int32_t>>{
           {4000, 0, 0}, {3000, 1, 5}, {2500, 1, 2}, {2500, 0, 100}, {3999, 0, 1}}) {
    detail::store_from_float(buffers.v.data(), ac.kv_dtype, problem.kv.v_offset(1, head, key) + dim,
                             kInf);
  }
  const std::string error = checked_run(buffers);
  EXPECT_NE(error.find("'v_cache': non-finite value inf at "), std::string::npos) << error;
  EXPECT_NE(error.find("(request 1, key 2500), head 0, dim 100"), std::string::npos) << error;
}

TEST(CudaNonfiniteChecked, IgnoresWhatTheCallDoesNotRead) {
  // NaN in stride padding, spare pages and page tails, in a q row that sees no key and in keys
  // outside every row's window: not read, so not reported, and the run matches the reference.
  TESSERA_SKIP_WITHOUT_GPU();
  NonfiniteShape shape;
  shape.paged = true;
  shape.page_size = 16;
  shape.group_size = 4;
  shape.head_dim = 128;
  std::mt19937_64 rng(60);
  AttentionCase ac = test::nonfinite_shape(shape);
  ac.window_left = 4;
  ac.causal = true;
  AttentionBuffers buffers = test::make_buffers(ac, rng);
  const detail::AttentionProblem problem = test::make_problem(buffers);
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (int32_t d = 0; d < ac.head_dim; ++d) {
    detail::store_from_float(buffers.q.data(), ac.q_dtype, d, kNaN);  // request 0: no key
    for (int32_t j : {0, 10, 44}) {
      detail::store_from_float(buffers.k.data(), ac.kv_dtype, problem.kv.k_offset(1, 1, j) + d,
                               kNaN);
    }
  }
  EXPECT_EQ(checked_run(buffers), "");
  const Outputs expected = test::run_reference(buffers);
  const test::Comparison result =
      test::compare_outputs(buffers, test::run_through_api(buffers, kGpu), expected);
  EXPECT_TRUE(result.ok(kOutputTolerance, test::default_lse_tolerance(ac))) << result.describe();
}

TEST(CudaNonfiniteChecked, Fp8CacheNaNAndInf) {
  TESSERA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    NonfiniteShape shape;
    shape.decode = true;
    shape.head_dim = 128;
    shape.dtype = DType::kBFloat16;
    AttentionCase ac = test::nonfinite_shape(shape);
    ac.kv_dtype = dtype;
    std::mt19937_64 rng(70);
    AttentionBuffers buffers = test::make_buffers(ac, rng);
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

// ---- a few small cases for compute-sanitizer (tools/gpu-check.sh runs *Sanitizer*) ----

TEST(CudaNonfiniteSanitizer, FewPointsAndTheCheckedScan) {
  TESSERA_SKIP_WITHOUT_GPU();
  NonfiniteShape decode;
  decode.decode = true;
  decode.page_size = 16;
  decode.causal = true;
  decode.group_size = 4;
  decode.head_dim = 128;
  decode.dtype = DType::kBFloat16;
  decode.q_per_request = 2;
  NonfiniteShape prefill;
  prefill.causal = true;
  prefill.group_size = 8;
  prefill.head_dim = 64;
  for (Poison poison : {Poison::kQNaN, Poison::kKNaN, Poison::kVInfZeroWeight}) {
    check_point(decode, poison, 9900 + static_cast<uint64_t>(poison));
    check_point(prefill, poison, 9950 + static_cast<uint64_t>(poison));
  }
  std::mt19937_64 rng(99);
  NonfiniteCase c = test::make_nonfinite_case(test::nonfinite_shape(decode), Poison::kVNaN, rng);
  EXPECT_EQ(checked_run(c.clean), "");
  EXPECT_EQ(checked_run(c.poisoned).rfind(test::checked_message(c), 0), 0u);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaNonfinite, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
