// Bad-input tests of the C++ API. Every case asserts that (a) tessera::Error of the right kind is
// thrown, (b) its message names the offending argument, and (c) nothing was written: every
// buffer an op may write (o, lse, caches, CSR outputs, merge outputs, q/k for RoPE) is compared
// with a snapshot taken before the call. Each fixture call is also run once unmodified
// (the *Valid* tests), so a rejection can only come from the one thing a case breaks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

namespace tessera {
namespace {

constexpr float kOutputSentinel = -12345.0f;
constexpr int32_t kIndexSentinel = -777;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfinity = std::numeric_limits<float>::infinity();

// Shapes of the fixture: two requests, GQA 4:2, head_dim 16, pages of 2 tokens.
constexpr int kQoHeads = 4, kKvHeads = 2, kHeadDim = 16, kPageSize = 2, kNumPages = 6;
constexpr int kTotalQ = 5, kTotalKv = 7, kAppendRows = 3;

const char* kind_name(Error::Kind kind) {
  switch (kind) {
    case Error::Kind::kInvalidArgument: return "kInvalidArgument";
    case Error::Kind::kUnsupported: return "kUnsupported";
    case Error::Kind::kRuntime: return "kRuntime";
  }
  return "unknown";
}

// Succeeds when `call` throws tessera::Error of `kind` whose message contains `needle`.
::testing::AssertionResult fails_with(const std::function<void()>& call, Error::Kind kind,
                                      const std::string& needle) {
  try {
    call();
  } catch (const Error& error) {
    if (error.kind() != kind) {
      return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", got "
                                           << kind_name(error.kind()) << ": " << error.what();
    }
    if (std::string(error.what()).find(needle) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "message \"" << error.what() << "\" does not contain " << needle;
    }
    return ::testing::AssertionSuccess() << error.what();
  } catch (const std::exception& error) {
    return ::testing::AssertionFailure() << "not a tessera::Error: " << error.what();
  }
  return ::testing::AssertionFailure() << "no exception was thrown";
}

std::vector<float> pattern(size_t size) {
  std::vector<float> values(size);
  for (size_t i = 0; i < size; ++i) values[i] = static_cast<float>(i % 13) * 0.125f - 0.75f;
  return values;
}

// Every buffer some op of the fixture may write.
struct Writable {
  std::vector<float> q = pattern(kTotalQ * kQoHeads * kHeadDim);
  std::vector<float> k = pattern(kTotalKv * kKvHeads * kHeadDim);
  std::vector<float> o = std::vector<float>(kTotalQ * kQoHeads * kHeadDim, kOutputSentinel);
  std::vector<float> lse = std::vector<float>(kTotalQ * kQoHeads, kOutputSentinel);
  std::vector<float> k_cache = pattern(kNumPages * kPageSize * kKvHeads * kHeadDim);
  std::vector<float> v_cache = pattern(kNumPages * kPageSize * kKvHeads * kHeadDim);
  std::vector<float> o_decode = std::vector<float>(2 * kQoHeads * kHeadDim, kOutputSentinel);
  std::vector<float> lse_decode = std::vector<float>(2 * kQoHeads, kOutputSentinel);
  std::vector<int32_t> csr_indptr = std::vector<int32_t>(3, kIndexSentinel);
  std::vector<int32_t> csr_indices = std::vector<int32_t>(6, kIndexSentinel);
  std::vector<int32_t> csr_last = std::vector<int32_t>(2, kIndexSentinel);
  std::vector<float> merge_out = std::vector<float>(3 * 2 * 8, kOutputSentinel);
  std::vector<float> merge_lse_out = std::vector<float>(3 * 2, kOutputSentinel);
  bool operator==(const Writable&) const = default;
};

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    q = make_view(out.q.data(), DType::kFloat32, {kTotalQ, kQoHeads, kHeadDim});
    k = make_view(out.k.data(), DType::kFloat32, {kTotalKv, kKvHeads, kHeadDim});
    v = make_view(v_data.data(), DType::kFloat32, {kTotalKv, kKvHeads, kHeadDim});
    o = make_view(out.o.data(), DType::kFloat32, {kTotalQ, kQoHeads, kHeadDim});
    lse = make_view(out.lse.data(), DType::kFloat32, {kTotalQ, kQoHeads});
    qo_indptr = make_view(qo_indptr_values.data(), DType::kInt32, {3});
    kv_indptr = make_view(kv_indptr_values.data(), DType::kInt32, {3});

    cache.k_cache =
        make_view(out.k_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, kHeadDim});
    cache.v_cache =
        make_view(out.v_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, kHeadDim});
    cache.page_indptr = make_view(page_indptr_values.data(), DType::kInt32, {3});
    cache.page_indices = make_view(page_indices_values.data(), DType::kInt32, {4});
    cache.last_page_len = make_view(last_page_len_values.data(), DType::kInt32, {2});
    q_decode = make_view(q_decode_data.data(), DType::kFloat32, {2, kQoHeads, kHeadDim});
    o_decode = make_view(out.o_decode.data(), DType::kFloat32, {2, kQoHeads, kHeadDim});
    lse_decode = make_view(out.lse_decode.data(), DType::kFloat32, {2, kQoHeads});

    ragged_plan =
        plan_ragged_prefill(qo_indptr_values, kv_indptr_values, kQoHeads, kKvHeads, kHeadDim, {});
    paged_plan = plan_paged_prefill(qo_indptr_values, page_indptr_values, last_page_len_values,
                                    kPageSize, kQoHeads, kKvHeads, kHeadDim, {});
    decode_plan = plan_decode(page_indptr_values, last_page_len_values, kPageSize, kQoHeads,
                              kKvHeads, kHeadDim, {});
    workspace_memory.resize(std::max({ragged_plan.workspace_bytes, paged_plan.workspace_bytes,
                                      decode_plan.workspace_bytes, size_t{1}}));
    workspace = {workspace_memory.data(), workspace_memory.size()};

    positions = make_view(positions_values.data(), DType::kInt32, {kTotalQ});
    k_rope = make_view(out.k.data(), DType::kFloat32, {kTotalQ, kKvHeads, kHeadDim});
    k_new = make_view(k_new_data.data(), DType::kFloat32, {kAppendRows, kKvHeads, kHeadDim});
    v_new = make_view(v_new_data.data(), DType::kFloat32, {kAppendRows, kKvHeads, kHeadDim});
    append_indptr = make_view(append_indptr_values.data(), DType::kInt32, {3});

    block_table = make_view(block_table_values.data(), DType::kInt32, {2, 3});
    seq_lens = make_view(seq_lens_values.data(), DType::kInt32, {2});
    csr_indptr = make_view(out.csr_indptr.data(), DType::kInt32, {3});
    csr_indices = make_view(out.csr_indices.data(), DType::kInt32, {6});
    csr_last = make_view(out.csr_last.data(), DType::kInt32, {2});

    o_a = make_view(merge_a.data(), DType::kFloat32, {3, 2, 8});
    o_b = make_view(merge_b.data(), DType::kFloat32, {3, 2, 8});
    lse_a = make_view(merge_lse_a.data(), DType::kFloat32, {3, 2});
    lse_b = make_view(merge_lse_b.data(), DType::kFloat32, {3, 2});
    merge_out = make_view(out.merge_out.data(), DType::kFloat32, {3, 2, 8});
    merge_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {3, 2});
    states = make_view(merge_a.data(), DType::kFloat32, {3, 2, 8});
    states_indptr = make_view(states_indptr_values.data(), DType::kInt32, {3});
    states_out = make_view(out.merge_out.data(), DType::kFloat32, {2, 2, 8});
    states_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {2, 2});

    snapshot = out;
  }

  void run_ragged() const {
    run_ragged_prefill(ragged_plan, q, k, v, qo_indptr, kv_indptr, o, lse, workspace);
  }
  void run_paged() const { run_paged_prefill(paged_plan, q, cache, qo_indptr, o, lse, workspace); }
  void run_decode_call() const {
    run_decode(decode_plan, q_decode, cache, o_decode, lse_decode, workspace);
  }
  void one_shot_ragged(const AttentionOptions& options = {}) const {
    ragged_prefill(q, k, v, qo_indptr, kv_indptr, o, lse, options);
  }
  void rope(const RopeOptions& options = {}) const {
    apply_rope_inplace(q, k_rope, positions, options);
  }
  void append() const { append_paged_kv_cache(k_new, v_new, append_indptr, cache); }
  void to_csr() const {
    block_table_to_csr(block_table, seq_lens, kPageSize, csr_indptr, csr_indices, csr_last);
  }
  void merge() const { merge_state(o_a, lse_a, o_b, lse_b, merge_out, merge_lse_out); }
  void merge_many() const {
    merge_states(states, lse_a, states_indptr, states_out, states_lse_out);
  }

  // The whole contract of one bad-input case.
  void expect_rejected(const std::function<void()>& call, Error::Kind kind,
                       const std::string& argument) {
    EXPECT_TRUE(fails_with(call, kind, "'" + argument + "'"));
    EXPECT_TRUE(out == snapshot) << "a rejected call wrote to an output buffer";
  }
  void expect_invalid(const std::function<void()>& call, const std::string& argument) {
    expect_rejected(call, Error::Kind::kInvalidArgument, argument);
  }

  Writable out, snapshot;
  std::vector<float> v_data = pattern(kTotalKv * kKvHeads * kHeadDim);
  std::vector<float> q_decode_data = pattern(2 * kQoHeads * kHeadDim);
  std::vector<int32_t> qo_indptr_values{0, 3, 5};
  std::vector<int32_t> kv_indptr_values{0, 4, 7};
  // Request 0: pages {0, 1}, 4 keys; request 1: pages {2, 3}, 3 keys.
  std::vector<int32_t> page_indptr_values{0, 2, 4};
  std::vector<int32_t> page_indices_values{0, 1, 2, 3};
  std::vector<int32_t> last_page_len_values{2, 1};
  std::vector<int32_t> positions_values{0, 1, 2, 3, 4};
  std::vector<float> k_new_data = pattern(kAppendRows * kKvHeads * kHeadDim);
  std::vector<float> v_new_data = pattern(kAppendRows * kKvHeads * kHeadDim);
  std::vector<int32_t> append_indptr_values{0, 2, 3};
  std::vector<int32_t> block_table_values{0, 1, 5, 2, 3, 4};
  std::vector<int32_t> seq_lens_values{4, 3};
  std::vector<float> merge_a = pattern(3 * 2 * 8), merge_b = pattern(3 * 2 * 8);
  std::vector<float> merge_lse_a = pattern(3 * 2), merge_lse_b = pattern(3 * 2);
  std::vector<int32_t> states_indptr_values{0, 2, 3};
  std::vector<unsigned char> workspace_memory;

  TensorView q, k, v, o, lse, qo_indptr, kv_indptr, q_decode, o_decode, lse_decode;
  TensorView positions, k_rope, k_new, v_new, append_indptr;
  TensorView block_table, seq_lens, csr_indptr, csr_indices, csr_last;
  TensorView o_a, o_b, lse_a, lse_b, merge_out, merge_lse_out;
  TensorView states, states_indptr, states_out, states_lse_out;
  PagedKVCache cache;
  Plan ragged_plan, paged_plan, decode_plan;
  Workspace workspace;
};

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

// ---------------------------------------------------------------- RoPE

TEST_F(ValidationTest, RopeRotaryDimOdd) {
  RopeOptions options;
  options.rotary_dim = 7;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopeRotaryDimAboveHeadDim) {
  RopeOptions options;
  options.rotary_dim = kHeadDim + 2;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopePositionsWrongLength) {
  positions = make_view(positions_values.data(), DType::kInt32, {kTotalQ - 1});
  expect_invalid([&] { rope(); }, "positions");
}

TEST_F(ValidationTest, RopeKeyHeadDimDiffers) {
  k_rope = make_view(out.k.data(), DType::kFloat32, {kTotalQ, 2 * kKvHeads, kHeadDim / 2});
  expect_invalid([&] { rope(); }, "k");
}

TEST_F(ValidationTest, RopeHeadsOrHeadDimBeyondLimit) {
  // No token, so nothing would be read, and every other argument agrees (k, positions, a
  // rotary_dim within the kernels' table): only the extent bound rejects these. The kernels
  // index heads and features in 32 bits.
  positions = make_view(positions_values.data(), DType::kInt32, {0});
  RopeOptions options;
  options.rotary_dim = 64;
  q = make_view(out.q.data(), DType::kFloat32, {0, kQoHeads, int64_t{1} << 32});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, int64_t{1} << 32});
  expect_invalid([&] { rope(options); }, "q");
  q = make_view(out.q.data(), DType::kFloat32, {0, 65537, kHeadDim});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, kHeadDim});
  expect_invalid([&] { rope(); }, "q");
  // The limits themselves are accepted.
  q = make_view(out.q.data(), DType::kFloat32, {0, 65536, 4096});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, 65536, 4096});
  EXPECT_NO_THROW(rope(options));
}

TEST_F(ValidationTest, RopeRotaryDimBeyondKernelTable) {
  // head_dim 512 is within the ops' limit, but the CUDA RoPE kernels hold the cos/sin of at most
  // 128 pairs (a larger rotary_dim overflowed their host and shared-memory tables). No token.
  q = make_view(out.q.data(), DType::kFloat32, {0, kQoHeads, 512});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, 512});
  positions = make_view(positions_values.data(), DType::kInt32, {0});
  expect_invalid([&] { rope(); }, "rope.rotary_dim");
  RopeOptions options;
  options.rotary_dim = 258;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopeThetaNotPositive) {
  RopeOptions options;
  options.rope_theta = 0.0f;
  expect_invalid([&] { rope(options); }, "rope.rope_theta");
}

// ---------------------------------------------------------------- paged-KV append

TEST_F(ValidationTest, AppendBeyondPageTable) {
  // Request 1 appends 3 rows, but its one page (page 2, last page length 2) holds only 2 keys.
  append_indptr_values = {0, 0, 3};
  page_indptr_values = {0, 2, 3};
  last_page_len_values = {2, 2};
  expect_invalid([&] { append(); }, "page_indptr");
}

TEST_F(ValidationTest, AppendIndptrEndDiffersFromRows) {
  append_indptr_values = {0, 1, 2};
  expect_invalid([&] { append(); }, "append_indptr");
}

TEST_F(ValidationTest, AppendKeyValueShapesDiffer) {
  v_new = make_view(v_new_data.data(), DType::kFloat32, {kAppendRows - 1, kKvHeads, kHeadDim});
  expect_invalid([&] { append(); }, "v_new");
}

TEST_F(ValidationTest, AppendCacheHeadsDiffer) {
  k_new = make_view(k_new_data.data(), DType::kFloat32, {kAppendRows, 1, 2 * kHeadDim});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {kAppendRows, 1, 2 * kHeadDim});
  expect_invalid([&] { append(); }, "k_cache");
}

TEST_F(ValidationTest, AppendHeadDimBeyondLimit) {
  // No row is appended and the cache has the same head_dim: only the extent bound rejects it
  // (the cache views, larger than their buffers, are never touched).
  append_indptr_values = {0, 0, 0};
  k_new = make_view(k_new_data.data(), DType::kFloat32, {0, kKvHeads, 4100});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {0, kKvHeads, 4100});
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 4100});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 4100});
  expect_invalid([&] { append(); }, "k_new");
}

TEST_F(ValidationTest, AppendFusedRopeRotaryDimBeyondKernelTable) {
  k_new = make_view(k_new_data.data(), DType::kFloat32, {0, kKvHeads, 512});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {0, kKvHeads, 512});
  // No row is appended: the cache views, larger than their buffers, are never touched.
  append_indptr_values = {0, 0, 0};
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 512});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 512});
  const RopeOptions rope_options;
  expect_invalid([&] { append_paged_kv_cache(k_new, v_new, append_indptr, cache, &rope_options); },
                 "rope.rotary_dim");
}

TEST_F(ValidationTest, AppendRequestBeyondInt32Keys) {
  // Pages of 2^30 tokens: request 0's five pages hold 4 * 2^30 + 1 keys, which KVSource::kv_len
  // (int32) wrapped to 1, so the row was appended at position 0 instead of being refused.
  const int64_t page_size = int64_t{1} << 30;
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {1, page_size, kKvHeads, kHeadDim});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {1, page_size, kKvHeads, kHeadDim});
  page_indptr_values = {0, 5, 5};
  page_indices_values = {0, 0, 0, 0, 0};
  cache.page_indices = make_view(page_indices_values.data(), DType::kInt32, {5});
  last_page_len_values = {1, 1};
  append_indptr_values = {0, 1, 1};
  k_new = make_view(k_new_data.data(), DType::kFloat32, {1, kKvHeads, kHeadDim});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {1, kKvHeads, kHeadDim});
  expect_invalid([&] { append(); }, "page_indptr");
}

TEST_F(ValidationTest, AppendBatchBeyondInt32) {
  // 2^31 requests: the backends count requests in int32. Rejected before any array is read.
  // The page table's arrays have the lengths such a batch needs, so only the bound rejects it
  // (none of these views, larger than their buffers, is read).
  const int64_t batch = int64_t{1} << 31;
  append_indptr = make_view(append_indptr_values.data(), DType::kInt32, {batch + 1});
  cache.page_indptr = make_view(page_indptr_values.data(), DType::kInt32, {batch + 1});
  cache.last_page_len = make_view(last_page_len_values.data(), DType::kInt32, {batch});
  expect_invalid([&] { append(); }, "append_indptr");
}

TEST_F(ValidationTest, AppendPageIndexOutOfRange) {
  page_indices_values[3] = kNumPages + 3;
  expect_invalid([&] { append(); }, "page_indices");
}

TEST_F(ValidationTest, AppendLastPageLenAbovePageSize) {
  last_page_len_values[0] = kPageSize + 1;
  expect_invalid([&] { append(); }, "last_page_len");
}

TEST_F(ValidationTest, AppendRopeRotaryDimOdd) {
  RopeOptions options;
  options.rotary_dim = 3;
  expect_invalid([&] { append_paged_kv_cache(k_new, v_new, append_indptr, cache, &options); },
                 "rope.rotary_dim");
}

// ---------------------------------------------------------------- block table -> CSR

TEST_F(ValidationTest, BlockTableTooNarrowForSeqLens) {
  seq_lens_values[1] = 3 * kPageSize + 1;  // needs 4 pages, the table has 3 columns
  expect_invalid([&] { to_csr(); }, "seq_lens");
}

TEST_F(ValidationTest, BlockTableSeqLenNegative) {
  seq_lens_values[0] = -1;
  expect_invalid([&] { to_csr(); }, "seq_lens");
}

TEST_F(ValidationTest, BlockTableNotInt32) {
  block_table.dtype = DType::kInt64;
  expect_invalid([&] { to_csr(); }, "block_table");
}

TEST_F(ValidationTest, BlockTablePageIndptrWrongLength) {
  csr_indptr = make_view(out.csr_indptr.data(), DType::kInt32, {2});
  expect_invalid([&] { to_csr(); }, "page_indptr");
}

TEST_F(ValidationTest, BlockTableWiderThanInt32) {
  block_table = make_view(block_table_values.data(), DType::kInt32, {0, int64_t{1} << 31});
  seq_lens = make_view(seq_lens_values.data(), DType::kInt32, {0});
  csr_indptr = make_view(out.csr_indptr.data(), DType::kInt32, {1});
  csr_last = make_view(out.csr_last.data(), DType::kInt32, {0});
  expect_invalid([&] { to_csr(); }, "block_table");
}

TEST_F(ValidationTest, BlockTablePagesBeyondInt32) {
  // Two requests of 2^31 - 1 one-token pages: 2^32 - 2 pages in all, which page_indptr (int32)
  // cannot count. page_indices is large enough, so only that bound stops the conversion (which
  // wrapped page_indptr and wrote out of bounds). Nothing is read past the two lengths.
  block_table = make_view(block_table_values.data(), DType::kInt32, {2, INT32_MAX});
  seq_lens_values = {INT32_MAX, INT32_MAX};
  csr_indices = make_view(out.csr_indices.data(), DType::kInt32, {int64_t{1} << 32});
  expect_invalid(
      [&] { block_table_to_csr(block_table, seq_lens, 1, csr_indptr, csr_indices, csr_last); },
      "seq_lens");
}

TEST_F(ValidationTest, BlockTablePageSizeZero) {
  expect_invalid(
      [&] { block_table_to_csr(block_table, seq_lens, 0, csr_indptr, csr_indices, csr_last); },
      "page_size");
}

// ---------------------------------------------------------------- merge

TEST_F(ValidationTest, MergeShapeMismatch) {
  o_b = make_view(merge_b.data(), DType::kFloat32, {3, 1, 16});
  expect_invalid([&] { merge(); }, "o_b");
}

TEST_F(ValidationTest, MergeLseWrongDtype) {
  lse_a.dtype = DType::kFloat16;
  expect_invalid([&] { merge(); }, "lse_a");
}

TEST_F(ValidationTest, MergeOutputRowsDiffer) {
  merge_out = make_view(out.merge_out.data(), DType::kFloat32, {2, 2, 8});
  expect_invalid([&] { merge(); }, "o_out");
}

TEST_F(ValidationTest, MergeStatesIndptrBeyondStates) {
  states_indptr_values = {0, 2, 4};
  expect_invalid([&] { merge_many(); }, "indptr");
}

TEST_F(ValidationTest, MergeStatesIndptrNotMonotone) {
  states_indptr_values = {0, 2, 1};
  expect_invalid([&] { merge_many(); }, "indptr");
}

TEST_F(ValidationTest, MergeHeadDimBeyondLimit) {
  // Zero rows: no element is touched, yet a head_dim past 4096 (the fuzzer found 2^34, which
  // made the CPU merge allocate 128 GiB) is refused for every operand.
  o_a = make_view(merge_a.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  o_b = make_view(merge_b.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  merge_out = make_view(out.merge_out.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  lse_a = make_view(merge_lse_a.data(), DType::kFloat32, {0, 1});
  lse_b = make_view(merge_lse_b.data(), DType::kFloat32, {0, 1});
  merge_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {0, 1});
  expect_invalid([&] { merge(); }, "o_a");
  // At the limit: accepted.
  for (TensorView* view : {&o_a, &o_b, &merge_out}) view->shape[2] = 4096;
  EXPECT_NO_THROW(merge());
}

TEST_F(ValidationTest, MergeStatesHeadsAndHeadDimBeyondLimit) {
  // No state and no output row, every operand of the same shape: only the bound rejects.
  states_indptr = make_view(states_indptr_values.data(), DType::kInt32, {1});
  const auto shapes = [&](int64_t heads, int64_t dim) {
    states = make_view(merge_a.data(), DType::kFloat32, {0, heads, dim});
    lse_a = make_view(merge_lse_a.data(), DType::kFloat32, {0, heads});
    states_out = make_view(out.merge_out.data(), DType::kFloat32, {0, heads, dim});
    states_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {0, heads});
  };
  shapes(1, 4097);
  expect_invalid([&] { merge_many(); }, "states");
  shapes(65537, 8);
  expect_invalid([&] { merge_many(); }, "states");
  shapes(65536, 4096);
  EXPECT_NO_THROW(merge_many());
}

TEST_F(ValidationTest, MergeStatesLseOutWrongShape) {
  states_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {2, 3});
  expect_invalid([&] { merge_many(); }, "lse_out");
}

}  // namespace
}  // namespace tessera
