// Attention sinks on the CUDA backend (issue 34; the definition in include/tessera/attention.hpp,
// the kernels' in src/cuda/row_finish.cuh) against the CPU reference, over the matrix of
// tests/common/sinks_testing.hpp: ragged prefill, paged prefill (pages of 1 and 16) and decode
// (1..4 queries per request) x no mask / causal / window / causal + soft cap x GQA 1 / 4 / 8 x
// head_dim 64 / 128 / 256, fp16 and bf16 in turn, with a request without keys (o = 0,
// lse = the sink) in every case. Each point runs the public plan (the planner's kernel), on
// Hopper the prefill once more on the portable sm80 kernels (TESSERA_PREFILL_KERNEL=sm80), and a
// hand-made split-KV plan (pieces of 17 keys: every row through partials and the standalone
// merge, which folds the sink once). Then a bf16 head_dim 128 prefill that the sm90 kernels
// serve on Hopper, long decodes the planner splits (the fused merge), a paged prefill the
// planner splits (the standalone merge), NaN / -inf sinks, and checked mode's rejection of a
// NaN / +inf sink. Outputs and workspaces are poisoned (NaN) before every run.
//
// Without a CUDA device every test skips (exit 77 under ctest). TESSERA_TEST_REDUCED=1 shrinks
// the matrix; TESSERA_TEST_SEED varies the random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_hand_made.hpp"
#include "common/gpu_test_support.hpp"
#include "common/scoped_env.hpp"
#include "common/sinks_testing.hpp"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
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
using test::kGpu;
using test::Outputs;
using test::reduced_run;
using test::SinksMask;
using test::SinksOp;
using test::SinksShape;

// P is rounded to the input dtype before P x V on the GPU (FlashAttention-2), so fp16/bf16
// outputs are held to 1e-2 relative L2, as in test_cuda_prefill.
constexpr double kOutputTolerance = 1e-2;

struct PointChecks {
  bool expect_planner_split = false;  // the public plan must split some key range
  bool expect_sm90 = false;           // on Hopper the public plan must run an sm90 kernel
  bool hand_made_split = true;        // also run the hand-made plan of 17-key pieces
};

// One point: the public plan, the sm80 prefill on Hopper, a hand-made split plan.
void check_point(const SinksShape& shape, uint64_t seed, const PointChecks& checks = {}) {
  std::mt19937_64 rng(seed + test::seed_from_env(0));  // TESSERA_TEST_SEED shifts every point
  const AttentionCase c = test::sinks_case(shape, rng);
  AttentionBuffers buffers = test::make_buffers(c, rng);
  SCOPED_TRACE(shape.describe() + ": " + c.describe());
  const double lse_tolerance = test::default_lse_tolerance(c);
  const Outputs expected = test::run_reference(buffers);
  const auto run_public = [&](const std::string& name) {
    const Plan plan = test::plan_for(buffers, kGpu);
    const Outputs actual = test::run_through_api(buffers, kGpu, &plan);
    EXPECT_EQ(test::check_sinks(buffers, actual, expected, kOutputTolerance, lse_tolerance), "")
        << name << ", kernel " << last_kernel(c) << "\n  " << plan.kernel;
    return plan;
  };
  const Plan plan = run_public("public plan");
  if (checks.expect_planner_split) {
    EXPECT_FALSE(plan.merges.empty()) << "the planner did not split:\n" << plan.explain();
  }
  if (checks.expect_sm90 && hopper() && !detail::settings().prefill_force_sm80) {
    EXPECT_EQ(last_kernel(c).rfind("tessera::sm90::", 0), 0u) << "ran " << last_kernel(c);
  }
  if (test::op_of(c) != AttentionOp::kDecode && hopper()) {
    const test::ScopedEnv portable("TESSERA_PREFILL_KERNEL", "sm80");  // chosen at plan time
    run_public("public plan on the sm80 kernels");
  }
  if (!checks.hand_made_split) return;
  test::TestPlanOptions split;
  split.q_tile_rows = 16;
  split.kv_chunk = 17;
  split.num_workers = 5;
  const Outputs actual = test::run_hand_made_on_gpu(buffers, split);
  EXPECT_EQ(test::check_sinks(buffers, actual, expected, kOutputTolerance, lse_tolerance), "")
      << "hand-made split plan (kv pieces of 17), kernel " << last_kernel(c);
}

class CudaSinksMatrix : public ::testing::TestWithParam<SinksOp> {};

TEST_P(CudaSinksMatrix, MatchesTheReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> head_dims =
      reduced_run() ? std::vector<int32_t>{128} : std::vector<int32_t>{64, 128, 256};
  uint64_t seed = 34000 + 1000 * static_cast<uint64_t>(GetParam());
  for (const SinksShape& shape : test::sinks_matrix(GetParam(), head_dims)) {
    if (reduced_run() && shape.group_size == 4) continue;
    check_point(shape, ++seed);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaSinksMatrix,
                         ::testing::Values(SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode),
                         [](const auto& info) { return test::sinks_op_name(info.param); });

TEST(CudaSinks, Sm90PrefillPath) {
  // bf16, head_dim 128, a few hundred queries over twice the keys: the sm90 warp-specialised
  // kernels serve it on Hopper (checked), the sm80 ones elsewhere.
  TESSERA_SKIP_WITHOUT_GPU();
  uint64_t seed = 37000;
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged}) {
    for (SinksMask mask : test::kAllSinksMasks) {
      SinksShape shape;
      shape.op = op;
      shape.mask = mask;
      shape.group_size = 4;
      shape.head_dim = 128;
      shape.dtype = DType::kBFloat16;
      shape.long_q = reduced_run() ? 130 : 256;
      shape.long_kv = reduced_run() ? 260 : 512;
      check_point(shape, ++seed, {.expect_sm90 = true});
    }
  }
}

TEST(CudaSinks, LongDecodeSplitByThePlanner) {
  // One long request among short ones: the planner splits its keys and the decode kernels'
  // fused merge folds the sink once.
  TESSERA_SKIP_WITHOUT_GPU();
  const int32_t kv = reduced_run() ? 2048 : 4096;
  uint64_t seed = 38000;
  for (int32_t q_per_request = 1; q_per_request <= 4; ++q_per_request) {
    for (int32_t head_dim : {64, 128}) {
      SinksShape shape;
      shape.op = SinksOp::kDecode;
      // Masks that keep the long key range visible (a sliding window would leave ~15 keys,
      // nothing to split).
      shape.mask = q_per_request % 2 ? SinksMask::kNone : SinksMask::kCausal;
      shape.group_size = head_dim == 64 ? 8 : 4;
      shape.head_dim = head_dim;
      shape.dtype = q_per_request % 2 ? DType::kBFloat16 : DType::kFloat16;
      shape.q_per_request = q_per_request;
      shape.long_kv = kv;
      check_point(shape, ++seed, {.expect_planner_split = true, .hand_made_split = false});
    }
  }
}

TEST(CudaSinks, PagedPrefillSplitByThePlanner) {
  // A few queries over thousands of keys: split by the planner, merged by the standalone merge.
  TESSERA_SKIP_WITHOUT_GPU();
  uint64_t seed = 39000;
  for (SinksMask mask : {SinksMask::kCausal, SinksMask::kCausalSoftCap}) {
    SinksShape shape;
    shape.op = SinksOp::kPaged;
    shape.mask = mask;
    shape.group_size = 8;
    shape.head_dim = 128;
    shape.dtype = DType::kBFloat16;
    shape.long_kv = reduced_run() ? 2048 : 4096;
    shape.long_q = 8;
    check_point(shape, ++seed, {.expect_planner_split = true, .hand_made_split = false});
  }
}

// A NaN sink makes every row of its head NaN; a -inf one is no sink (rows with keys; a row
// without keys and a -inf sink is o = 0, lse = -inf by the definition).
TEST(CudaSinks, NonfiniteSinks) {
  TESSERA_SKIP_WITHOUT_GPU();
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kDecode}) {
    SinksShape shape;
    shape.op = op;
    shape.mask = SinksMask::kCausal;
    shape.group_size = 4;
    shape.head_dim = 128;
    std::mt19937_64 rng(39500 + static_cast<uint64_t>(op));
    const AttentionCase c = test::sinks_case(shape, rng);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    buffers.sinks[1] = std::numeric_limits<float>::quiet_NaN();
    buffers.sinks[2] = -std::numeric_limits<float>::infinity();
    const Outputs expected = test::run_reference(buffers);
    const Outputs actual = test::run_through_api(buffers, kGpu);
    int64_t token = 0;
    for (int32_t b = 0; b < c.batch_size(); ++b) {
      for (int32_t i = 0; i < c.q_lens[b]; ++i, ++token) {
        int32_t first = 0, last = 0;
        c.mask().visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
        for (int32_t h = 1; h <= 2; ++h) {
          const int64_t at = token * buffers.lse_stride_token + h;
          float out = 0, ref = 0;
          std::memcpy(&out, actual.lse.data() + at * sizeof(float), sizeof(float));
          std::memcpy(&ref, expected.lse.data() + at * sizeof(float), sizeof(float));
          if (h == 1) {
            EXPECT_TRUE(std::isnan(out)) << "token " << token << ": NaN sink, lse " << out;
          } else if (first < last) {  // -inf sink, a row with keys: as without a sink
            EXPECT_NEAR(out, ref, test::default_lse_tolerance(c)) << "token " << token;
          }
        }
      }
    }
  }
}

// Checked mode on device sinks (one copy to the host): a NaN or +inf sink is rejected naming
// `sinks` and its index, the first bad one; a -inf sink (no sink) runs.
TEST(CudaSinks, CheckedModeRejectsNaNAndPlusInf) {
  TESSERA_SKIP_WITHOUT_GPU();
  const auto checked_error = [](AttentionBuffers& buffers) {
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
  };
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode}) {
    SCOPED_TRACE(test::sinks_op_name(op));
    SinksShape shape;
    shape.op = op;
    shape.mask = SinksMask::kCausal;
    shape.group_size = 4;
    std::mt19937_64 rng(39600 + static_cast<uint64_t>(op));
    const AttentionCase c = test::sinks_case(shape, rng);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    EXPECT_EQ(checked_error(buffers), "");
    const int32_t head = c.num_qo_heads - 1;
    for (float sink : {std::numeric_limits<float>::quiet_NaN(), kInf}) {
      AttentionBuffers changed = buffers;
      changed.sinks[head] = sink;
      const std::string error = checked_error(changed);
      const std::string expected = std::string("'sinks': non-finite value ") +
                                   (std::isnan(sink) ? "nan" : "inf") + " at index " +
                                   std::to_string(head) + " (query head " +
                                   std::to_string(head) + ")";
      EXPECT_NE(error.find(expected), std::string::npos) << error;
    }
    AttentionBuffers two = buffers;  // the first bad sink is the one reported
    two.sinks[1] = kInf;
    two.sinks[head] = std::numeric_limits<float>::quiet_NaN();
    const std::string error = checked_error(two);
    EXPECT_NE(error.find("'sinks': non-finite value inf at index 1 "), std::string::npos)
        << error;
    AttentionBuffers none = buffers;
    none.sinks[0] = -kInf;
    EXPECT_EQ(checked_error(none), "");
  }
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaSinks, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
