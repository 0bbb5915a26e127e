// The fixture of the bad-input tests of the C++ API (test_validation.cpp: attention calls,
// plans, options, devices; test_validation_ops.cpp: RoPE, paged-KV append, block table -> CSR,
// merge). Every case asserts that (a) tessera::Error of the right kind is thrown, (b) its message
// names the offending argument, and (c) nothing was written: every buffer an op may write (o,
// lse, caches, CSR outputs, merge outputs, q/k for RoPE) is compared with a snapshot taken before
// the call (ValidationTest::expect_rejected). Header-only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

namespace tessera::test {

constexpr float kOutputSentinel = -12345.0f;
constexpr int32_t kIndexSentinel = -777;

// Shapes of the fixture: two requests, GQA 4:2, head_dim 16, pages of 2 tokens.
constexpr int kQoHeads = 4, kKvHeads = 2, kHeadDim = 16, kPageSize = 2, kNumPages = 6;
constexpr int kTotalQ = 5, kTotalKv = 7, kAppendRows = 3;

inline const char* kind_name(Error::Kind kind) {
  switch (kind) {
    case Error::Kind::kInvalidArgument: return "kInvalidArgument";
    case Error::Kind::kUnsupported: return "kUnsupported";
    case Error::Kind::kRuntime: return "kRuntime";
    case Error::Kind::kOutOfMemory: return "kOutOfMemory";
  }
  return "unknown";
}

// Succeeds when `call` throws tessera::Error of `kind` whose message contains `needle`.
inline ::testing::AssertionResult fails_with(const std::function<void()>& call, Error::Kind kind,
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

// Fails the test unless `call` throws tessera::Error of `kind`; returns its message (empty when
// it did not throw).
inline std::string error_of(const std::function<void()>& call, Error::Kind kind) {
  try {
    call();
  } catch (const Error& error) {
    EXPECT_EQ(static_cast<int>(error.kind()), static_cast<int>(kind)) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "the call did not throw";
  return {};
}

inline void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "\"" << text << "\" lacks \"" << part << "\"";
}

inline std::vector<float> pattern(size_t size) {
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

}  // namespace tessera::test
