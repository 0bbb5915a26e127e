// Bad-input tests of the C++ API's attention calls, plans, options and devices (the fixture and
// its contract: common/validation_fixture.hpp; RoPE, append, block table and merge:
// test_validation_ops.cpp). Each fixture call is also run once unmodified (the *Valid* tests), so
// a rejection can only come from the one thing a case breaks.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "common/validation_fixture.hpp"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using test::fails_with;
using test::kHeadDim;
using test::kKvHeads;
using test::kNumPages;
using test::kOutputSentinel;
using test::kPageSize;
using test::kQoHeads;
using test::kTotalKv;
using test::kTotalQ;
using test::pattern;
using test::ValidationTest;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- the unmodified calls work

TEST_F(ValidationTest, ValidCallsSucceed) {
  EXPECT_NO_THROW(run_ragged());
  EXPECT_NO_THROW(run_paged());
  EXPECT_NO_THROW(run_decode_call());
  EXPECT_NO_THROW(one_shot_ragged());
  EXPECT_NO_THROW(paged_prefill(q, cache, qo_indptr, o, lse));
  EXPECT_NO_THROW(decode(q_decode, cache, o_decode, lse_decode));
  EXPECT_NO_THROW(rope());
  EXPECT_NO_THROW(append());
  EXPECT_NO_THROW(to_csr());
  EXPECT_NO_THROW(merge());
  EXPECT_NO_THROW(merge_many());
  EXPECT_FALSE(out == snapshot);
}

// ---------------------------------------------------------------- ranks, shapes, dtypes

TEST_F(ValidationTest, QueryWrongRank) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, kQoHeads * kHeadDim});
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, QueryHeadsDifferFromPlan) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, 2, 2 * kHeadDim});
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, QueryHeadDimDiffersFromPlan) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, kQoHeads, 8});
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, QueryTokensDifferFromPlan) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ - 1, kQoHeads, kHeadDim});
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, QueryIntegerDtype) {
  q.dtype = DType::kInt32;
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, QueryFp8Dtype) {
  q.dtype = DType::kFloat8E4M3;
  expect_invalid([&] { run_paged(); }, "q");
}

TEST_F(ValidationTest, OutputDtypeDiffersFromQuery) {
  o.dtype = DType::kFloat16;
  expect_invalid([&] { run_ragged(); }, "o");
}

TEST_F(ValidationTest, OutputShapeDiffersFromQuery) {
  o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, kQoHeads / 2, 2 * kHeadDim});
  expect_invalid([&] { run_ragged(); }, "o");
}

TEST_F(ValidationTest, LseNotFloat32) {
  lse.dtype = DType::kFloat16;
  expect_invalid([&] { run_ragged(); }, "lse");
}

TEST_F(ValidationTest, LseWrongShape) {
  lse_decode = make_view(out.lse_decode.data(), DType::kFloat32, {2, kQoHeads - 1});
  expect_invalid([&] { run_decode_call(); }, "lse");
}

TEST_F(ValidationTest, KeyHeadsDifferFromPlan) {
  k = make_view(out.k.data(), DType::kFloat32, {kTotalKv / 2, 2 * kKvHeads, kHeadDim});
  expect_invalid([&] { run_ragged(); }, "k");
}

TEST_F(ValidationTest, KeyIntegerDtype) {
  k.dtype = DType::kInt32;
  expect_invalid([&] { run_ragged(); }, "k");
}

TEST_F(ValidationTest, KeyValueDtypeMismatch) {
  v.dtype = DType::kFloat16;
  expect_invalid([&] { run_ragged(); }, "v");
}

TEST_F(ValidationTest, KeyRowsFewerThanKvIndptrEnd) {
  k = make_view(out.k.data(), DType::kFloat32, {kTotalKv - 1, kKvHeads, kHeadDim});
  expect_invalid([&] { run_ragged(); }, "k");
}

// ---------------------------------------------------------------- strides

TEST_F(ValidationTest, KeyLastDimNotContiguous) {
  std::vector<float> every_other(2 * kTotalKv * kKvHeads * kHeadDim);
  k = make_view(every_other.data(), DType::kFloat32, {kTotalKv, kKvHeads, kHeadDim},
                {2 * kKvHeads * kHeadDim, 2 * kHeadDim, 2});
  expect_invalid([&] { run_ragged(); }, "k");
}

TEST_F(ValidationTest, QueryNegativeStride) {
  q = make_view(out.q.data() + (kTotalQ - 1) * kQoHeads * kHeadDim, DType::kFloat32,
                {kTotalQ, kQoHeads, kHeadDim}, {-kQoHeads * kHeadDim, kHeadDim, 1});
  expect_invalid([&] { run_ragged(); }, "q");
}

TEST_F(ValidationTest, CacheLastDimNotContiguous) {
  cache.v_cache.stride[3] = 2;
  expect_invalid([&] { run_decode_call(); }, "v_cache");
}

TEST_F(ValidationTest, StatesOffsetsBeyondInt64) {
  // A row stride of 2^62 over 3 rows: the last row's offset, 2 * 2^62, does not fit in int64
  // (no tensor spans 2^63 bytes). indptr reads only state 0, so nothing else would be read.
  states = make_view(merge_a.data(), DType::kFloat32, {3, 2, 8}, {int64_t{1} << 62, 8, 1});
  states_indptr_values = {0, 1, 1};
  expect_invalid([&] { merge_many(); }, "states");
  // The last offset exactly INT64_MAX: one element past it does not fit either.
  states = make_view(merge_a.data(), DType::kFloat32, {2, 1, 1}, {INT64_MAX, 1, 1});
  states_indptr_values = {0, 1, 1};
  expect_invalid([&] { merge_many(); }, "states");
}

// ---------------------------------------------------------------- heads and head_dim

TEST_F(ValidationTest, HeadDimNotMultipleOfEight) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, kQoHeads, 12});
  k = make_view(out.k.data(), DType::kFloat32, {kTotalKv, kKvHeads, 12});
  v = make_view(v_data.data(), DType::kFloat32, {kTotalKv, kKvHeads, 12});
  o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, kQoHeads, 12});
  expect_invalid([&] { one_shot_ragged(); }, "head_dim");
}

TEST_F(ValidationTest, HeadDimAboveLimit) {
  expect_invalid(
      [] {
        plan_ragged_prefill(std::vector<int32_t>{0, 1}, std::vector<int32_t>{0, 1}, 1, 1, 264, {});
      },
      "head_dim");
}

TEST_F(ValidationTest, HeadsAboveLimit) {
  // The planner makes one work item per (query tile, kv head): 2^30 heads made a 1-token plan
  // allocate tens of GB.
  expect_invalid(
      [] {
        plan_ragged_prefill(std::vector<int32_t>{0, 1}, std::vector<int32_t>{0, 1}, 131072, 131072,
                            kHeadDim, {});
      },
      "num_qo_heads");
}

TEST_F(ValidationTest, HeadDimZero) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, kQoHeads, 0});
  k = make_view(out.k.data(), DType::kFloat32, {kTotalKv, kKvHeads, 0});
  v = make_view(v_data.data(), DType::kFloat32, {kTotalKv, kKvHeads, 0});
  o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, kQoHeads, 0});
  expect_invalid([&] { one_shot_ragged(); }, "head_dim");
}

TEST_F(ValidationTest, GqaRatioNotInteger) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, 3, kHeadDim});
  o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, 3, kHeadDim});
  expect_invalid([&] { one_shot_ragged(); }, "num_qo_heads");
}

TEST_F(ValidationTest, ZeroQueryHeads) {
  q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, 0, kHeadDim});
  o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, 0, kHeadDim});
  expect_invalid([&] { one_shot_ragged(); }, "num_qo_heads");
}

TEST_F(ValidationTest, ZeroKvHeads) {
  expect_invalid(
      [&] {
        plan_decode(page_indptr_values, last_page_len_values, kPageSize, kQoHeads, 0, kHeadDim, {});
      },
      "num_kv_heads");
}

// ---------------------------------------------------------------- indptr arrays

TEST_F(ValidationTest, QoIndptrNotStartingAtZero) {
  qo_indptr_values = {1, 3, 5};
  expect_invalid([&] { run_ragged(); }, "qo_indptr");
}

TEST_F(ValidationTest, QoIndptrNotMonotone) {
  qo_indptr_values = {0, 4, 3};
  expect_invalid([&] { run_paged(); }, "qo_indptr");
}

TEST_F(ValidationTest, QoIndptrWrongLength) {
  qo_indptr = make_view(qo_indptr_values.data(), DType::kInt32, {2});
  expect_invalid([&] { run_ragged(); }, "qo_indptr");
}

TEST_F(ValidationTest, QoIndptrDiffersFromPlan) {
  qo_indptr_values = {0, 2, 5};
  expect_invalid([&] { run_ragged(); }, "qo_indptr");
}

TEST_F(ValidationTest, QoIndptrNotInt32) {
  std::vector<int64_t> wide{0, 3, 5};
  qo_indptr = make_view(wide.data(), DType::kInt64, {3});
  expect_invalid([&] { run_ragged(); }, "qo_indptr");
}

TEST_F(ValidationTest, KvIndptrDiffersFromPlan) {
  kv_indptr_values = {0, 3, 7};
  expect_invalid([&] { run_ragged(); }, "kv_indptr");
}

TEST_F(ValidationTest, KvIndptrNotMonotoneInPlan) {
  expect_invalid(
      [] {
        plan_ragged_prefill(std::vector<int32_t>{0, 1, 2}, std::vector<int32_t>{0, 5, 4}, 1, 1, 16,
                            {});
      },
      "kv_indptr");
}

TEST_F(ValidationTest, KvIndptrLengthDiffersFromQoIndptrInPlan) {
  expect_invalid(
      [] {
        plan_ragged_prefill(std::vector<int32_t>{0, 1, 2}, std::vector<int32_t>{0, 5}, 1, 1, 16,
                            {});
      },
      "kv_indptr");
}

TEST_F(ValidationTest, PageIndptrDiffersFromPlan) {
  page_indptr_values = {0, 1, 4};
  page_indices_values = {0, 1, 2, 3};
  expect_invalid([&] { run_paged(); }, "page_indptr");
}

// ---------------------------------------------------------------- paged cache

TEST_F(ValidationTest, PageIndexNegative) {
  page_indices_values[2] = -1;
  expect_invalid([&] { run_decode_call(); }, "page_indices");
}

TEST_F(ValidationTest, PageIndexBeyondNumPages) {
  page_indices_values[1] = kNumPages;
  expect_invalid([&] { run_paged(); }, "page_indices");
}

TEST_F(ValidationTest, PageIndicesTooShort) {
  cache.page_indices = make_view(page_indices_values.data(), DType::kInt32, {3});
  expect_invalid([&] { run_decode_call(); }, "page_indices");
}

TEST_F(ValidationTest, LastPageLenZero) {
  last_page_len_values[1] = 0;
  expect_invalid([&] { decode(q_decode, cache, o_decode, lse_decode); }, "last_page_len");
}

TEST_F(ValidationTest, LastPageLenAbovePageSize) {
  expect_invalid(
      [&] {
        plan_decode(page_indptr_values, std::vector<int32_t>{2, kPageSize + 1}, kPageSize, kQoHeads,
                    kKvHeads, kHeadDim, {});
      },
      "last_page_len");
}

TEST_F(ValidationTest, PageSizeDiffersFromPlan) {
  for (TensorView* view : {&cache.k_cache, &cache.v_cache}) {
    *view =
        make_view(view->data, DType::kFloat32, {kNumPages / 2, 2 * kPageSize, kKvHeads, kHeadDim});
  }
  expect_invalid([&] { run_decode_call(); }, "k_cache");
}

TEST_F(ValidationTest, HandBuiltPlanWithoutPageSize) {
  // A plan edited by hand to page_size 0, with a cache of 0-token pages to match: refused by
  // name (the run's page count divides by it).
  decode_plan.page_size = 0;
  for (TensorView* view : {&cache.k_cache, &cache.v_cache}) {
    *view = make_view(view->data, DType::kFloat32, {kNumPages, 0, kKvHeads, kHeadDim});
  }
  expect_invalid([&] { run_decode_call(); }, "plan");
}

TEST_F(ValidationTest, PageSizeZeroInPlan) {
  expect_invalid(
      [&] {
        plan_paged_prefill(qo_indptr_values, page_indptr_values, last_page_len_values, 0, kQoHeads,
                           kKvHeads, kHeadDim, {});
      },
      "page_size");
}

TEST_F(ValidationTest, CacheDtypeMismatch) {
  cache.v_cache.dtype = DType::kFloat16;
  expect_invalid([&] { run_paged(); }, "v_cache");
}

TEST_F(ValidationTest, CachePageCountsDiffer) {
  cache.v_cache.shape[0] = kNumPages - 1;
  expect_invalid([&] { run_paged(); }, "v_cache");
}

TEST_F(ValidationTest, CacheLayoutUnknown) {
  cache.layout = static_cast<KVLayout>(7);
  expect_invalid([&] { run_decode_call(); }, "kv.layout");
}

TEST_F(ValidationTest, PlanBatchBeyondInt32) {
  // 2^31 requests: Plan::batch_size (int32) wrapped negative, and run_* then took index arrays of
  // any length. Checked before the arrays are read: the spans are never dereferenced.
  const size_t entries = size_t{1} << 31;
  const std::span<const int32_t> huge(qo_indptr_values.data(), entries);
  const std::string needle = "at most 2^31 - 1 elements";
  EXPECT_TRUE(fails_with([&] { plan_ragged_prefill(huge, huge, kQoHeads, kKvHeads, kHeadDim, {}); },
                         Error::Kind::kInvalidArgument, "'qo_indptr': expected " + needle));
  EXPECT_TRUE(fails_with(
      [&] {
        plan_decode(huge, std::span<const int32_t>(last_page_len_values.data(), entries - 1),
                    kPageSize, kQoHeads, kKvHeads, kHeadDim, {});
      },
      Error::Kind::kInvalidArgument, "'page_indptr': expected " + needle));
}

TEST_F(ValidationTest, DecodeQueryRowsBeyondInt32) {
  // 2^25 + 1 requests of 64 queries: the rows of the last requests, b * 64, overflow int32
  // (AttentionProblem::q_begin). The bound comes before the arrays are read, so the spans (longer
  // than their vectors) are never dereferenced.
  const size_t batch = (size_t{1} << 25) + 1;
  expect_invalid(
      [&] {
        plan_decode(std::span<const int32_t>(page_indptr_values.data(), batch + 1),
                    std::span<const int32_t>(last_page_len_values.data(), batch), kPageSize,
                    kQoHeads, kKvHeads, kHeadDim, {}, {}, 64);
      },
      "q_per_request");
}

TEST_F(ValidationTest, PagedPlanPagesCountedIn64Bits) {
  // One request of 2^31 - 1 keys in two pages of 1.5 * 2^30 tokens. The run-time count of its
  // pages, (kv_len + page_size - 1) / page_size, overflowed int32 to 0, so a one-entry
  // page_indices passed the check that guards the GPU kernels (which read it unchecked); on the
  // CPU only the later host-side check caught it.
  const int page_size = 3 << 29;
  page_indptr_values = {0, 2};
  last_page_len_values = {(1 << 29) - 1};
  const Plan plan = plan_decode(page_indptr_values, last_page_len_values, page_size, kQoHeads,
                                kKvHeads, kHeadDim, {});
  ASSERT_EQ(plan.kv_lens, std::vector<int32_t>{INT32_MAX});
  for (TensorView* view : {&cache.k_cache, &cache.v_cache}) {
    *view = make_view(view->data, DType::kFloat32, {2, page_size, kKvHeads, kHeadDim});
  }
  cache.page_indptr = make_view(page_indptr_values.data(), DType::kInt32, {2});
  cache.page_indices = make_view(page_indices_values.data(), DType::kInt32, {1});
  cache.last_page_len = make_view(last_page_len_values.data(), DType::kInt32, {1});
  q_decode = make_view(q_decode_data.data(), DType::kFloat32, {1, kQoHeads, kHeadDim});
  o_decode = make_view(out.o_decode.data(), DType::kFloat32, {1, kQoHeads, kHeadDim});
  lse_decode = make_view(out.lse_decode.data(), DType::kFloat32, {1, kQoHeads});
  EXPECT_TRUE(
      fails_with([&] { run_decode(plan, q_decode, cache, o_decode, lse_decode, workspace); },
                 Error::Kind::kInvalidArgument, "'page_indices': expected at least 2 entries"));
  EXPECT_TRUE(out == snapshot) << "a rejected call wrote to an output buffer";
}

TEST_F(ValidationTest, DecodeRowsNotMultipleOfBatch) {
  q_decode = make_view(q_decode_data.data(), DType::kFloat32, {3, kQoHeads, kHeadDim / 2});
  expect_invalid([&] { decode(q_decode, cache, o_decode, lse_decode); }, "q");
}

// ---------------------------------------------------------------- plan and workspace

TEST_F(ValidationTest, PlanOfAnotherOp) {
  ragged_plan = decode_plan;
  expect_invalid([&] { run_ragged(); }, "plan");
}

TEST_F(ValidationTest, DecodeWithPrefillPlan) {
  decode_plan = paged_plan;
  expect_invalid([&] { run_decode_call(); }, "plan");
}

// A single long request planned for two workers splits its key range, so the plan needs a
// workspace for the float32 partials.
class WorkspaceValidationTest : public ::testing::Test {
 protected:
  static constexpr int kKeys = 1100;
  void SetUp() override {
    set_num_threads(2);
    plan = plan_ragged_prefill(indptr_q, indptr_kv, 1, 1, kHeadDim, {});
    set_num_threads(0);
    memory.resize(plan.workspace_bytes);
  }
  void run(Workspace workspace) {
    const TensorView kv_view = make_view(kv.data(), DType::kFloat32, {kKeys, 1, kHeadDim});
    run_ragged_prefill(plan, make_view(q.data(), DType::kFloat32, {1, 1, kHeadDim}), kv_view,
                       kv_view, make_view(indptr_q.data(), DType::kInt32, {2}),
                       make_view(indptr_kv.data(), DType::kInt32, {2}),
                       make_view(o.data(), DType::kFloat32, {1, 1, kHeadDim}), {}, workspace);
  }

  std::vector<int32_t> indptr_q{0, 1}, indptr_kv{0, kKeys};
  std::vector<float> q = pattern(kHeadDim), kv = pattern(kKeys * kHeadDim);
  std::vector<float> o = std::vector<float>(kHeadDim, kOutputSentinel);
  std::vector<unsigned char> memory;
  Plan plan;
};

TEST_F(WorkspaceValidationTest, TooSmall) {
  ASSERT_GT(plan.workspace_bytes, 0u) << plan.explain();
  EXPECT_TRUE(fails_with(
      [&] {
        run({memory.data(), memory.size() - 1});
      },
      Error::Kind::kInvalidArgument, "'workspace'"));
  EXPECT_EQ(o, std::vector<float>(kHeadDim, kOutputSentinel));
  EXPECT_NO_THROW(run({memory.data(), memory.size()}));
  EXPECT_NE(o, std::vector<float>(kHeadDim, kOutputSentinel));
}

TEST_F(WorkspaceValidationTest, NullData) {
  ASSERT_GT(plan.workspace_bytes, 0u) << plan.explain();
  EXPECT_TRUE(fails_with(
      [&] {
        run({nullptr, memory.size()});
      },
      Error::Kind::kInvalidArgument, "'workspace'"));
  EXPECT_EQ(o, std::vector<float>(kHeadDim, kOutputSentinel));
}

// ---------------------------------------------------------------- options

TEST_F(ValidationTest, WindowLeftBelowMinusOne) {
  AttentionOptions options;
  options.window_left = -2;
  expect_invalid([&] { one_shot_ragged(options); }, "options.window_left");
}

TEST_F(ValidationTest, WindowRightBelowMinusOne) {
  AttentionOptions options;
  options.window_right = -5;
  expect_invalid([&] { one_shot_ragged(options); }, "options.window_right");
}

TEST_F(ValidationTest, SoftCapNegative) {
  AttentionOptions options;
  options.logits_soft_cap = -1.0f;
  expect_invalid([&] { one_shot_ragged(options); }, "options.logits_soft_cap");
}

TEST_F(ValidationTest, SoftCapNaN) {
  AttentionOptions options;
  options.logits_soft_cap = kNaN;
  expect_invalid([&] { paged_prefill(q, cache, qo_indptr, o, lse, options); },
                 "options.logits_soft_cap");
}

TEST_F(ValidationTest, SmScaleNegative) {
  AttentionOptions options;
  options.sm_scale = -0.5f;
  expect_invalid([&] { one_shot_ragged(options); }, "options.sm_scale");
}

TEST_F(ValidationTest, SmScaleInfinite) {
  AttentionOptions options;
  options.sm_scale = kInfinity;
  expect_invalid([&] { decode(q_decode, cache, o_decode, lse_decode, options); },
                 "options.sm_scale");
}

TEST_F(ValidationTest, KScaleZero) {
  AttentionOptions options;
  options.k_scale = 0.0f;
  expect_invalid([&] { one_shot_ragged(options); }, "options.k_scale");
}

TEST_F(ValidationTest, VScaleNaN) {
  AttentionOptions options;
  options.v_scale = kNaN;
  expect_invalid([&] { one_shot_ragged(options); }, "options.v_scale");
}

TEST_F(ValidationTest, QPerRequestZero) {
  expect_invalid(
      [&] {
        plan_decode(page_indptr_values, last_page_len_values, kPageSize, kQoHeads, kKvHeads,
                    kHeadDim, {}, {}, 0);
      },
      "q_per_request");
}

// ---------------------------------------------------------------- devices

// A CPU-only build (or a host without a GPU) cannot serve CUDA tensors: kUnsupported, before
// any pointer is used (the "CUDA" tensors below point at host memory).
class CudaUnavailableTest : public ValidationTest {
 protected:
  void SetUp() override {
    if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible on this host";
    ValidationTest::SetUp();
  }
  static constexpr Device kCuda{DeviceType::kCUDA, 0};
};

TEST_F(CudaUnavailableTest, PlanOnCuda) {
  expect_rejected(
      [&] {
        plan_ragged_prefill(qo_indptr_values, kv_indptr_values, kQoHeads, kKvHeads, kHeadDim, {},
                            kCuda);
      },
      Error::Kind::kUnsupported, "device");
}

TEST_F(CudaUnavailableTest, RopeOnCuda) {
  q.device = k_rope.device = positions.device = kCuda;
  expect_rejected([&] { rope(); }, Error::Kind::kUnsupported, "device");
}

TEST_F(CudaUnavailableTest, MergeOnCuda) {
  for (TensorView* view : {&o_a, &o_b, &lse_a, &lse_b, &merge_out, &merge_lse_out}) {
    view->device = kCuda;
  }
  expect_rejected([&] { merge(); }, Error::Kind::kUnsupported, "device");
}

TEST_F(ValidationTest, TensorsOnDifferentDevices) {
  lse.device = Device{DeviceType::kCUDA, 0};
  expect_invalid([&] { run_ragged(); }, "lse");
}

}  // namespace
}  // namespace tessera
