// Failing calls of the C ABI (tessera/tessera.h): each must return the right status, name the
// argument in tessera_last_error(), and leave every output exactly as it was. The fixture and
// its host tensors: common/capi_fixture.hpp; the calls that succeed: test_capi.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/capi_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera::test::capi;

// ---------------------------------------------------------------- errors

TEST_F(CApiTest, NullRequiredTensorIsNamed) {
  const tessera_paged_kv kv = paged_kv();
  expect_failure(tessera_decode(nullptr, &kv, o_decode.dl(), nullptr, nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "q");
  EXPECT_NE(std::string(tessera_last_error()).find("tessera_decode"), std::string::npos);
  expect_failure(tessera_decode(q_decode.dl(), &kv, nullptr, lse_decode.dl(), nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "o");
  expect_failure(tessera_decode(q_decode.dl(), nullptr, o_decode.dl(), nullptr, nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "kv");
  tessera_paged_kv missing = kv;
  missing.page_indices = nullptr;
  expect_failure(
      tessera_decode(q_decode.dl(), &missing, o_decode.dl(), lse_decode.dl(), nullptr, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "page_indices");
  expect_failure(tessera_ragged_prefill(q.dl(), k.dl(), nullptr, qo_indptr.dl(), kv_indptr.dl(),
                                        o.dl(), lse.dl(), nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "v");
  expect_failure(tessera_merge_state(o.dl(), nullptr, o.dl(), lse.dl(), o.dl(), nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "lse_a");
  expect_failure(tessera_apply_rope_inplace(nullptr, nullptr, qo_indptr.dl(), nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "q");
  EXPECT_TRUE(decode_outputs_untouched());
  EXPECT_EQ(o.get(0), kSentinel);
}

TEST_F(CApiTest, RunWithNullPlanOrWrongPlan) {
  const tessera_paged_kv kv = paged_kv();
  expect_failure(tessera_run_decode(nullptr, q_decode.dl(), &kv, o_decode.dl(), lse_decode.dl(),
                                    nullptr, 0, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "plan");
  EXPECT_NE(std::string(tessera_last_error()).find("tessera_run_decode"), std::string::npos);
  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                        kQoHeads, kKvHeads, kHeadDim, nullptr, kDLCPU, 0, &plan),
            TESSERA_OK);
  std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan) + 64);
  expect_failure(tessera_run_decode(plan, q_decode.dl(), &kv, o_decode.dl(), lse_decode.dl(),
                                    workspace.data(), workspace.size(), nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "plan");
  tessera_plan_destroy(plan);
  EXPECT_TRUE(decode_outputs_untouched());
}

TEST_F(CApiTest, WorkspaceTooSmall) {
  // One long request planned for two workers: the key range is split, so partials need room.
  std::vector<int32_t> qo_host{0, 1}, kv_host{0, 1500};
  ASSERT_EQ(tessera_set_num_threads(2), TESSERA_OK);
  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_ragged_prefill(qo_host.data(), kv_host.data(), 1, 2, 1, kHeadDim, nullptr,
                                        kDLCPU, 0, &plan),
            TESSERA_OK);
  ASSERT_EQ(tessera_set_num_threads(0), TESSERA_OK);
  const size_t bytes = tessera_plan_workspace_bytes(plan);
  ASSERT_GT(bytes, 0u);
  std::vector<unsigned char> workspace(bytes);
  HostTensor q_one({1, 2, kHeadDim}, kF32), o_one = q_one, keys({1500, 1, kHeadDim}, kF32);
  q_one.fill_pattern(18);
  keys.fill_pattern(19);
  o_one.fill(kSentinel);
  HostTensor qo_one = int_tensor(qo_host), kv_one = int_tensor(kv_host);
  expect_failure(
      tessera_run_ragged_prefill(plan, q_one.dl(), keys.dl(), keys.dl(), qo_one.dl(), kv_one.dl(),
                                 o_one.dl(), nullptr, workspace.data(), bytes - 1, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "workspace");
  EXPECT_EQ(o_one.get(0), kSentinel);
  EXPECT_EQ(
      tessera_run_ragged_prefill(plan, q_one.dl(), keys.dl(), keys.dl(), qo_one.dl(), kv_one.dl(),
                                 o_one.dl(), nullptr, workspace.data(), bytes, nullptr),
      TESSERA_OK)
      << tessera_last_error();
  EXPECT_NE(o_one.get(0), kSentinel);
  tessera_plan_destroy(plan);
}

TEST_F(CApiTest, BadDescriptorsAreRejected) {
  const tessera_paged_kv kv = paged_kv();
  const auto decode_with_q = [&](DLTensor* query) {
    return tessera_decode(query, &kv, o_decode.dl(), lse_decode.dl(), nullptr, nullptr);
  };
  DLTensor bad = q_decode.descriptor();
  bad.dtype.lanes = 2;
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.dtype = DLDataType{kDLComplex, 64, 1};
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.dtype = DLDataType{kDLUInt, 8, 1};  // fp8 must use the DLPack 1.x float8 codes
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.dtype = kI32;  // converts, but the core rejects integer queries
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.ndim = 5;
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.ndim = 0;
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.shape = nullptr;
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  bad = q_decode.descriptor();
  bad.device = DLDevice{kDLCUDAManaged, 0};
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  EXPECT_NE(std::string(tessera_last_error()).find("managed"), std::string::npos);
  bad = q_decode.descriptor();
  bad.device = DLDevice{kDLOpenCL, 0};
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  int64_t negative_strides[3] = {-kQoHeads * kHeadDim, kHeadDim, 1};
  bad = q_decode.descriptor();
  bad.strides = negative_strides;
  bad.byte_offset = (kBatch * kQPerRequest - 1) * kQoHeads * kHeadDim * sizeof(float);
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  int64_t huge_shape[3] = {int64_t{1} << 40, int64_t{1} << 40, kHeadDim};
  bad = q_decode.descriptor();
  bad.shape = huge_shape;
  expect_failure(decode_with_q(&bad), TESSERA_ERROR_INVALID_ARGUMENT, "q");
  tessera_paged_kv bad_layout = kv;
  bad_layout.layout = 5;
  expect_failure(
      tessera_decode(q_decode.dl(), &bad_layout, o_decode.dl(), lse_decode.dl(), nullptr, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "kv.layout");
  EXPECT_TRUE(decode_outputs_untouched());
}

TEST_F(CApiTest, CoreValidationErrorsPassThrough) {
  const tessera_paged_kv kv = paged_kv();
  HostTensor lse_half({kBatch * kQPerRequest, kQoHeads}, kF16);
  expect_failure(tessera_decode(q_decode.dl(), &kv, o_decode.dl(), lse_half.dl(), nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "lse");
  EXPECT_NE(std::string(tessera_last_error()).find("float32"), std::string::npos);
  HostTensor bad_pages = int_tensor({6, 1, 3, 0, 8, 2});  // 8 >= num_pages
  tessera_paged_kv out_of_range = kv;
  out_of_range.page_indices = bad_pages.dl();
  expect_failure(tessera_decode(q_decode.dl(), &out_of_range, o_decode.dl(), lse_decode.dl(),
                                nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "page_indices");
  tessera_attention_options bad_options = options;
  bad_options.window_left = -3;
  expect_failure(
      tessera_decode(q_decode.dl(), &kv, o_decode.dl(), lse_decode.dl(), &bad_options, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "options.window_left");
  EXPECT_TRUE(decode_outputs_untouched());

  const std::vector<unsigned char> k_cache_before = k_cache.bytes();
  HostTensor k_new({2, kKvHeads, kHeadDim}, kF32), append_indptr = int_tensor({0, 2, 2, 3});
  expect_failure(tessera_append_paged_kv_cache(k_new.dl(), k_new.dl(), append_indptr.dl(), &kv,
                                               nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "append_indptr");
  EXPECT_EQ(k_cache.bytes(), k_cache_before);

  HostTensor block_table({3, 1}, kI32), seq_lens = int_tensor({4, 5, 0});
  HostTensor indptr = int_tensor({-1, -1, -1, -1}), indices = int_tensor({-1, -1, -1});
  HostTensor last = int_tensor({-1, -1, -1});
  const std::vector<unsigned char> indptr_before = indptr.bytes();
  expect_failure(tessera_block_table_to_csr(block_table.dl(), seq_lens.dl(), kPageSize, indptr.dl(),
                                            indices.dl(), last.dl(), nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "seq_lens");
  EXPECT_EQ(indptr.bytes(), indptr_before);

  HostTensor merged({kTotalQ, kQoHeads, kHeadDim}, kF32), lse_ints({kTotalQ, kQoHeads}, kI32);
  merged.fill(kSentinel);
  expect_failure(
      tessera_merge_state(o.dl(), lse_ints.dl(), o.dl(), lse.dl(), merged.dl(), nullptr, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "lse_a");
  EXPECT_EQ(merged.get(0), kSentinel);

  tessera_rope_options odd;
  tessera_rope_options_default(&odd);
  odd.rotary_dim = 5;
  HostTensor positions = int_tensor({0, 1, 2, 3, 4, 5, 6, 7});
  const std::vector<unsigned char> q_before = q.bytes();
  expect_failure(tessera_apply_rope_inplace(q.dl(), nullptr, positions.dl(), &odd, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "rope.rotary_dim");
  EXPECT_EQ(q.bytes(), q_before);
}

TEST_F(CApiTest, PlanArgumentErrors) {
  tessera_plan* plan = reinterpret_cast<tessera_plan*>(&options);  // must be reset to NULL
  expect_failure(
      tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), -1, kQoHeads,
                                  kKvHeads, kHeadDim, nullptr, kDLCPU, 0, &plan),
      TESSERA_ERROR_INVALID_ARGUMENT, "batch_size");
  EXPECT_EQ(plan, nullptr);
  expect_failure(tessera_plan_ragged_prefill(nullptr, kv_indptr_host.data(), kBatch, kQoHeads,
                                             kKvHeads, kHeadDim, nullptr, kDLCPU, 0, &plan),
                 TESSERA_ERROR_INVALID_ARGUMENT, "qo_indptr_host");
  expect_failure(tessera_plan_paged_prefill(qo_indptr_host.data(), page_indptr_host.data(), nullptr,
                                            kBatch, kPageSize, kQoHeads, kKvHeads, kHeadDim,
                                            nullptr, kDLCPU, 0, &plan),
                 TESSERA_ERROR_INVALID_ARGUMENT, "last_page_len_host");
  expect_failure(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, kHeadDim, 1, nullptr, 7, 0, &plan),
      TESSERA_ERROR_INVALID_ARGUMENT, "device_type");
  expect_failure(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, kHeadDim, 1, nullptr, kDLCPU, 0, nullptr),
      TESSERA_ERROR_INVALID_ARGUMENT, "out");
  expect_failure(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, 12, 1, nullptr, kDLCPU, 0, &plan),
      TESSERA_ERROR_INVALID_ARGUMENT, "head_dim");
  expect_failure(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, kHeadDim, 0, nullptr, kDLCPU, 0, &plan),
      TESSERA_ERROR_INVALID_ARGUMENT, "q_per_request");
  EXPECT_EQ(plan, nullptr);
  // An empty batch is a valid plan: its indptr has one element and last_page_len none.
  const int32_t zero = 0;
  ASSERT_EQ(tessera_plan_decode(&zero, nullptr, 0, kPageSize, kQoHeads, kKvHeads, kHeadDim, 1,
                                nullptr, kDLCPU, 0, &plan),
            TESSERA_OK)
      << tessera_last_error();
  tessera_plan_destroy(plan);
}

TEST_F(CApiTest, CudaRequestWithoutCudaIsUnsupported) {
  if (tessera_cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible on this host";
  tessera_plan* plan = nullptr;
  expect_failure(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, kHeadDim, 1, nullptr, kDLCUDA, 0, &plan),
      TESSERA_ERROR_UNSUPPORTED, "device");
  EXPECT_EQ(plan, nullptr);
  // CUDA-labelled descriptors (over host memory, never dereferenced) are refused as well.
  HostTensor positions = int_tensor({0, 1, 2, 3, 4, 5, 6, 7});
  DLTensor q_cuda = q.descriptor(), positions_cuda = positions.descriptor();
  q_cuda.device = positions_cuda.device = DLDevice{kDLCUDA, 0};
  const std::vector<unsigned char> q_before = q.bytes();
  expect_failure(tessera_apply_rope_inplace(&q_cuda, nullptr, &positions_cuda, nullptr, nullptr),
                 TESSERA_ERROR_UNSUPPORTED, "device");
  EXPECT_EQ(q.bytes(), q_before);
}

TEST_F(CApiTest, LastErrorIsPerThreadAndClearedBySuccess) {
  const tessera_paged_kv kv = paged_kv();
  expect_failure(tessera_decode(nullptr, &kv, o_decode.dl(), nullptr, nullptr, nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "q");
  const std::string mine = tessera_last_error();
  std::string other_before, other_after;
  std::thread other([&] {
    other_before = tessera_last_error();
    tessera_merge_state(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    other_after = tessera_last_error();
  });
  other.join();
  EXPECT_EQ(other_before, "");
  EXPECT_NE(other_after.find("'o_a'"), std::string::npos) << other_after;
  EXPECT_EQ(tessera_last_error(), mine);
  ASSERT_EQ(tessera_decode(q_decode.dl(), &kv, o_decode.dl(), nullptr, nullptr, nullptr),
            TESSERA_OK);
  EXPECT_STREQ(tessera_last_error(), "");
}

}  // namespace
