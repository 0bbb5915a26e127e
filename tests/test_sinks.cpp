// Attention sinks on the CPU (include/tessera/attention.hpp, issue 34): the reference against
// hand-computed rows and against the definition's identity from the sink-free reference
// (lse' = log(e^lse + e^z), o' = o e^(lse - lse')); then the fast path (every ISA the host has,
// unsplit and split along keys by hand-made plans) and the public plan/run API (the real
// planner, its own splits included) against the reference over the matrix of
// tests/common/sinks_testing.hpp: ragged prefill, paged prefill and decode (1..4 queries per
// request) x no mask / causal / window / causal + soft cap x GQA 1 / 4 / 8, fp16 and bf16 (and
// float32), requests without keys (o = 0, lse = the sink). Non-finite sinks, validation of the
// `sinks` argument and the one-shot calls close the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/sinks_testing.hpp"
#include "common/validation_fixture.hpp"
#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "tessera/backend.hpp"

namespace tessera {
namespace {

using test::AttentionBuffers;
using test::AttentionCase;
using test::Outputs;
using test::SinksOp;
using test::SinksShape;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

float lse_at(const AttentionBuffers& buffers, const Outputs& outputs, int64_t token, int32_t h) {
  float value = 0;
  std::memcpy(&value,
              outputs.lse.data() + (token * buffers.lse_stride_token + h) * sizeof(float),
              sizeof(float));
  return value;
}

double o_at(const AttentionBuffers& buffers, const Outputs& outputs, int64_t token, int32_t h,
            int32_t d) {
  return detail::load_as_float(outputs.o.data(), buffers.test_case.q_dtype,
                               token * buffers.o_stride_token + h * buffers.o_stride_head + d);
}

// The fast path with a hand-made plan on one ISA (2 threads), NaN-filled outputs and workspace.
Outputs run_fast(AttentionBuffers& buffers, const test::TestPlanOptions& options,
                 detail::CpuIsa isa) {
  test::poison_outputs(buffers);
  const Plan plan = test::make_test_plan(buffers.test_case, options);
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  set_num_threads(2);
  detail::cpu_fast_attention_with_isa(plan, test::make_problem(buffers),
                                      Workspace{workspace.data(), workspace.size()}, isa);
  set_num_threads(0);
  return test::copy_outputs(buffers);
}

// ---- the reference ----

// q = 0: every visible score is 0, so a row of n keys has lse log(n + e^z) and o = mean(v) x
// n / (n + e^z); a row without keys o = 0, lse = z.
TEST(SinksReference, HandComputedRows) {
  AttentionCase c;
  c.q_lens = {2, 1};
  c.kv_lens = {3, 0};
  c.num_qo_heads = c.num_kv_heads = 2;
  c.head_dim = 8;
  c.q_dtype = c.kv_dtype = DType::kFloat32;
  c.with_sinks = true;
  std::mt19937_64 rng(7);
  AttentionBuffers buffers = test::make_buffers(c, rng);
  std::fill(buffers.q.begin(), buffers.q.end(), uint8_t{0});
  buffers.sinks = {0.5f, -1.25f};
  const Outputs out = test::run_reference(buffers);
  for (int32_t h = 0; h < 2; ++h) {
    const double z = buffers.sinks[h];
    for (int64_t token = 0; token < 2; ++token) {
      EXPECT_NEAR(lse_at(buffers, out, token, h), std::log(3.0 + std::exp(z)), 1e-6);
      for (int32_t d = 0; d < c.head_dim; ++d) {
        double mean = 0;
        for (int32_t j = 0; j < 3; ++j) {
          mean += detail::load_as_float(buffers.v.data(), c.kv_dtype,
                                        j * buffers.kv_stride_token +
                                            (h / c.group_size()) * buffers.kv_stride_head + d) /
                  3.0;
        }
        EXPECT_NEAR(o_at(buffers, out, token, h, d), mean * 3.0 / (3.0 + std::exp(z)), 1e-6);
      }
    }
    EXPECT_FLOAT_EQ(lse_at(buffers, out, 2, h), buffers.sinks[h]);  // request 1: no key
    for (int32_t d = 0; d < c.head_dim; ++d) EXPECT_EQ(o_at(buffers, out, 2, h, d), 0.0);
  }
}

// Over random float32 cases, the reference with sinks is the sink-free reference's rows with
// the sink folded in as the definition says.
TEST(SinksReference, FoldsTheSinkIntoTheSinkFreeRow) {
  std::mt19937_64 rng(test::sinks_seed(34001));
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode}) {
    for (test::SinksMask mask : test::kAllSinksMasks) {
      SinksShape shape;
      shape.op = op;
      shape.mask = mask;
      shape.group_size = 4;
      shape.dtype = DType::kFloat32;
      AttentionCase c = test::sinks_case(shape, rng);
      AttentionBuffers with = test::make_buffers(c, rng);
      AttentionBuffers without = with;
      without.test_case.with_sinks = false;
      const Outputs folded = test::run_reference(with);
      const Outputs plain = test::run_reference(without);
      for (int64_t token = 0; token < c.total_q(); ++token) {
        for (int32_t h = 0; h < c.num_qo_heads; ++h) {
          const double lse = lse_at(without, plain, token, h), z = with.sinks[h];
          const double expected_lse = lse == -kInf ? z : std::log(std::exp(lse) + std::exp(z));
          ASSERT_NEAR(lse_at(with, folded, token, h), expected_lse, 1e-5) << c.describe();
          const double share = lse == -kInf ? 0.0 : std::exp(lse - expected_lse);
          for (int32_t d = 0; d < c.head_dim; ++d) {
            ASSERT_NEAR(o_at(with, folded, token, h, d), o_at(without, plain, token, h, d) * share,
                        1e-5)
                << c.describe();
          }
        }
      }
    }
  }
}

// ---- the fast path and the public API against the reference ----

void check_shape(const SinksShape& shape, std::mt19937_64& rng) {
  const AttentionCase c = test::sinks_case(shape, rng);
  AttentionBuffers buffers = test::make_buffers(c, rng);
  SCOPED_TRACE(shape.describe() + ": " + c.describe());
  const double tolerance = test::default_tolerance(c), lse_tolerance = test::default_lse_tolerance(c);
  const Outputs expected = test::run_reference(buffers);
  for (detail::CpuIsa isa : {detail::CpuIsa::kGeneric, detail::CpuIsa::kAvx2,
                             detail::CpuIsa::kAvx512}) {
    if (!detail::cpu_supports(isa)) continue;
    test::TestPlanOptions unsplit, split;
    split.q_tile_rows = 16;
    split.kv_chunk = 17;
    split.num_workers = 3;
    for (const auto& [options, name] : {std::pair{unsplit, "unsplit"}, {split, "split by 17"}}) {
      const Outputs actual = run_fast(buffers, options, isa);
      EXPECT_EQ(test::check_sinks(buffers, actual, expected, tolerance, lse_tolerance), "")
          << "fast path, " << detail::cpu_isa_name(isa) << ", " << name;
    }
  }
  const Outputs api = test::run_through_api(buffers, Device{});
  EXPECT_EQ(test::check_sinks(buffers, api, expected, tolerance, lse_tolerance), "")
      << "public plan/run";
}

class SinksMatrix : public ::testing::TestWithParam<SinksOp> {};

TEST_P(SinksMatrix, FastPathAndApiMatchTheReference) {
  std::mt19937_64 rng(test::sinks_seed(34100 + static_cast<uint64_t>(GetParam())));
  for (const SinksShape& shape : test::sinks_matrix(GetParam(), {64, 128})) {
    check_shape(shape, rng);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, SinksMatrix,
                         ::testing::Values(SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode),
                         [](const auto& info) { return test::sinks_op_name(info.param); });

TEST(Sinks, Float32AndOddHeadDims) {
  std::mt19937_64 rng(test::sinks_seed(34200));
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode}) {
    for (int32_t head_dim : {8, 80, 256}) {
      SinksShape shape;
      shape.op = op;
      shape.mask = test::SinksMask::kCausal;
      shape.group_size = 8;
      shape.head_dim = head_dim;
      shape.dtype = DType::kFloat32;
      shape.q_per_request = 3;
      check_shape(shape, rng);
    }
  }
}

// Long key ranges the CPU planner itself splits (8 threads): the merge folds the sink once.
TEST(Sinks, PlannerSplitsLongRanges) {
  set_num_threads(8);
  std::mt19937_64 rng(test::sinks_seed(34300));
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode}) {
    SinksShape shape;
    shape.op = op;
    shape.mask = op == SinksOp::kDecode ? test::SinksMask::kNone : test::SinksMask::kCausal;
    shape.group_size = 4;
    shape.dtype = DType::kBFloat16;
    shape.q_per_request = 2;
    shape.long_kv = 3000;
    shape.long_q = op == SinksOp::kDecode ? 0 : 8;
    const AttentionCase c = test::sinks_case(shape, rng);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Plan plan = test::plan_for(buffers, Device{});
    EXPECT_FALSE(plan.merges.empty()) << "the planner did not split:\n" << plan.explain();
    const Outputs expected = test::run_reference(buffers);
    const Outputs actual = test::run_through_api(buffers, Device{}, &plan);
    EXPECT_EQ(test::check_sinks(buffers, actual, expected, test::default_tolerance(c),
                                test::default_lse_tolerance(c)),
              "")
        << shape.describe();
  }
  set_num_threads(0);
}

// ---- non-finite sinks ----

// Head 1's sink set to `sink`: the other heads are bit for bit the run with the drawn sinks.
void check_nonfinite_sink(float sink, bool expect_nan) {
  std::mt19937_64 rng(test::sinks_seed(34400));
  SinksShape shape;
  shape.op = SinksOp::kPaged;
  shape.mask = test::SinksMask::kCausal;
  shape.group_size = 2;
  const AttentionCase c = test::sinks_case(shape, rng);
  AttentionBuffers buffers = test::make_buffers(c, rng);
  AttentionBuffers changed = buffers;
  changed.sinks[1] = sink;
  AttentionBuffers no_sinks = buffers;
  no_sinks.test_case.with_sinks = false;
  for (bool reference : {true, false}) {
    set_cpu_impl(reference ? CpuImpl::kReference : CpuImpl::kFast);
    const Outputs base = test::run_through_api(buffers, Device{});
    const Outputs out = test::run_through_api(changed, Device{});
    const Outputs plain = test::run_through_api(no_sinks, Device{});
    for (int64_t token = 0; token < c.total_q(); ++token) {
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        const Outputs& same = h == 1 ? plain : base;  // -inf: head 1 as without sinks
        for (int32_t d = 0; d < c.head_dim; ++d) {
          const double value = o_at(changed, out, token, h, d);
          if (h == 1 && expect_nan) {
            ASSERT_TRUE(std::isnan(value)) << "token " << token << " d " << d;
          } else {
            ASSERT_EQ(value, o_at(changed, same, token, h, d)) << "token " << token << " h " << h;
          }
        }
        const float lse = lse_at(changed, out, token, h);
        if (h == 1 && expect_nan) {
          ASSERT_TRUE(std::isnan(lse));
        } else {
          ASSERT_EQ(lse, lse_at(changed, same, token, h)) << "token " << token << " h " << h;
        }
      }
    }
  }
  set_cpu_impl(CpuImpl::kFast);
}

TEST(SinksNonfinite, NaNSinkMakesItsHeadNaN) { check_nonfinite_sink(kNaN, true); }
TEST(SinksNonfinite, PlusInfSinkMakesItsHeadNaN) { check_nonfinite_sink(kInf, true); }
TEST(SinksNonfinite, MinusInfSinkIsNoSink) { check_nonfinite_sink(-kInf, false); }

// Runs `buffers` through the API on the CPU with checked mode on; the error text ("" if none).
std::string checked_error(AttentionBuffers& buffers) {
  set_index_checking(true);
  std::string error;
  try {
    (void)test::run_through_api(buffers, Device{});
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::kInvalidArgument) << e.what();
    error = e.what();
  }
  set_index_checking(false);
  return error;
}

// Checked mode: a NaN or +inf sink is rejected before anything runs, naming `sinks` and its
// index (the first bad one); -inf (no sink) runs. Every op, the reference and the fast path.
TEST(SinksNonfinite, CheckedModeRejectsNaNAndPlusInf) {
  for (SinksOp op : {SinksOp::kRagged, SinksOp::kPaged, SinksOp::kDecode}) {
    for (bool reference : {true, false}) {
      set_cpu_impl(reference ? CpuImpl::kReference : CpuImpl::kFast);
      SCOPED_TRACE(std::string(test::sinks_op_name(op)) + (reference ? ", reference" : ", fast"));
      std::mt19937_64 rng(test::sinks_seed(34500 + static_cast<int>(op)));
      SinksShape shape;
      shape.op = op;
      shape.mask = test::SinksMask::kCausal;
      shape.group_size = 2;
      const AttentionCase c = test::sinks_case(shape, rng);
      AttentionBuffers buffers = test::make_buffers(c, rng);
      EXPECT_EQ(checked_error(buffers), "");
      const int32_t head = c.num_qo_heads - 1;
      for (float sink : {kNaN, kInf}) {
        AttentionBuffers changed = buffers;
        changed.sinks[head] = sink;
        const std::string error = checked_error(changed);
        const std::string expected = std::string("'sinks': non-finite value ") +
                                     (std::isnan(sink) ? "nan" : "inf") + " at index " +
                                     std::to_string(head) + " (query head " +
                                     std::to_string(head) + ")";
        EXPECT_NE(error.find(expected), std::string::npos) << error;
        // Nothing ran: the outputs keep the poison run_through_api wrote into them.
        for (uint8_t byte : changed.o) ASSERT_EQ(byte, 0xff);
      }
      AttentionBuffers two = buffers;  // the first bad sink is the one reported
      two.sinks[1] = kInf;
      two.sinks[head] = kNaN;
      const std::string error = checked_error(two);
      EXPECT_NE(error.find("'sinks': non-finite value inf at index 1 "), std::string::npos)
          << error;
      AttentionBuffers none = buffers;  // -inf: no sink, valid; head 0 as without sinks
      none.sinks[0] = -kInf;
      EXPECT_EQ(checked_error(none), "");
    }
  }
  set_cpu_impl(CpuImpl::kFast);
}

// ---- validation and the one-shot calls ----

class SinksValidation : public test::ValidationTest {
 protected:
  std::vector<float> sink_values = std::vector<float>(test::kQoHeads, 0.25f);
  std::vector<uint16_t> half_values = std::vector<uint16_t>(test::kQoHeads, 0);
  RunOptions with(const TensorView& sinks) const { return RunOptions{sinks}; }
};

TEST_F(SinksValidation, RejectsBadSinksByName) {
  const std::vector<TensorView> bad = {
      make_view(half_values.data(), DType::kFloat16, {test::kQoHeads}),     // dtype
      make_view(sink_values.data(), DType::kFloat32, {test::kQoHeads - 1}),  // shape
      make_view(sink_values.data(), DType::kFloat32, {1, test::kQoHeads}),   // 2-D
      make_view(sink_values.data(), DType::kFloat32, {test::kQoHeads}, {2}),  // strided
      make_view(nullptr, DType::kFloat32, {test::kQoHeads}),                 // no data
      make_view(sink_values.data(), DType::kFloat32, {test::kQoHeads},
                Device{DeviceType::kCUDA, 0}),  // another device
  };
  for (const TensorView& sinks : bad) {
    expect_invalid(
        [&] {
          run_ragged_prefill(ragged_plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace,
                             nullptr, with(sinks));
        },
        "sinks");
    expect_invalid(
        [&] {
          run_paged_prefill(paged_plan, q, cache, qo_indptr, o, lse, workspace, nullptr,
                            with(sinks));
        },
        "sinks");
    expect_invalid(
        [&] {
          run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace, nullptr,
                     with(sinks));
        },
        "sinks");
    expect_invalid([&] { decode(q_decode, cache, o_decode, lse_decode, {}, nullptr, with(sinks)); },
                   "sinks");
  }
}

TEST_F(SinksValidation, OneShotCallsMatchPlanAndRun) {
  const TensorView sinks = make_view(sink_values.data(), DType::kFloat32, {test::kQoHeads});
  const RunOptions options = with(sinks);
  run_ragged_prefill(ragged_plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace, nullptr,
                     options);
  test::Writable planned = out;
  ragged_prefill(q, k, v, qo_indptr, kv_indptr, o, lse, {}, nullptr, options);
  EXPECT_TRUE(out == planned) << "ragged_prefill";
  run_paged_prefill(paged_plan, q, cache, qo_indptr, o, lse, workspace, nullptr, options);
  planned = out;
  paged_prefill(q, cache, qo_indptr, o, lse, {}, nullptr, options);
  EXPECT_TRUE(out == planned) << "paged_prefill";
  run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace, nullptr, options);
  planned = out;
  decode(q_decode, cache, o_decode, lse_decode, {}, nullptr, options);
  EXPECT_TRUE(out == planned) << "decode";
  // The sink reached the rows: without it the lse differs.
  run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace);
  EXPECT_NE(out.lse_decode, planned.lse_decode);
}

}  // namespace
}  // namespace tessera
