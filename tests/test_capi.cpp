// Tests of the C ABI (tessera/tessera.h): queries and defaults, attention, ops. The fixture and
// its host tensors: common/capi_fixture.hpp; failing calls (status, the argument named in
// tessera_last_error(), every output left exactly as it was): test_capi_errors.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/capi_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera::test::capi;

// ---------------------------------------------------------------- queries and defaults

TEST(CApiInfo, VersionAndAbi) {
  EXPECT_STREQ(tessera_version(), tessera::version_string());
  EXPECT_EQ(tessera_abi_version(), TESSERA_ABI_VERSION);
  EXPECT_EQ(tessera_abi_version(), 1);
  EXPECT_EQ(tessera_cuda_device_count(), tessera::cuda_device_count());
  EXPECT_STREQ(tessera_last_error(), "");
}

TEST(CApiInfo, StreamCaptureIdOfAStreamNotCapturing) {
  // The default stream is not being captured (test_cuda_graph checks ids during captures).
  uint64_t id = 12345;
  ASSERT_EQ(tessera_stream_capture_id(nullptr, &id), TESSERA_OK) << tessera_last_error();
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(tessera_stream_capture_id(nullptr, nullptr), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tessera_last_error()).find("'capture_id'"), std::string::npos)
      << tessera_last_error();
}

TEST(CApiInfo, OptionDefaultsMatchCpp) {
  tessera_attention_options options;
  std::memset(&options, 0x5a, sizeof(options));
  tessera_attention_options_default(&options);
  const tessera::AttentionOptions cpp;
  EXPECT_EQ(options.causal, 0);
  EXPECT_EQ(options.window_left, cpp.window_left);
  EXPECT_EQ(options.window_right, cpp.window_right);
  EXPECT_EQ(options.logits_soft_cap, cpp.logits_soft_cap);
  EXPECT_EQ(options.sm_scale, cpp.sm_scale);
  EXPECT_EQ(options.k_scale, cpp.k_scale);
  EXPECT_EQ(options.v_scale, cpp.v_scale);

  tessera_rope_options rope;
  std::memset(&rope, 0x5a, sizeof(rope));
  tessera_rope_options_default(&rope);
  const tessera::RopeOptions rope_cpp;
  EXPECT_EQ(rope.rotary_dim, rope_cpp.rotary_dim);
  EXPECT_EQ(rope.interleave, 0);
  EXPECT_EQ(rope.rope_theta, rope_cpp.rope_theta);
  EXPECT_EQ(rope.rope_scale, rope_cpp.rope_scale);
  EXPECT_EQ(rope.llama31, 0);
  EXPECT_EQ(rope.llama31_factor, rope_cpp.llama31_factor);
  EXPECT_EQ(rope.llama31_low_freq_factor, rope_cpp.llama31_low_freq_factor);
  EXPECT_EQ(rope.llama31_high_freq_factor, rope_cpp.llama31_high_freq_factor);
  EXPECT_EQ(rope.llama31_original_max_position, rope_cpp.llama31_original_max_position);
  tessera_attention_options_default(nullptr);  // documented as a no-op
  tessera_rope_options_default(nullptr);
}

TEST(CApiInfo, CpuControls) {
  EXPECT_EQ(tessera_set_num_threads(2), TESSERA_OK);
  EXPECT_EQ(tessera::num_threads(), 2);
  EXPECT_EQ(tessera_set_num_threads(0), TESSERA_OK);
  EXPECT_EQ(tessera_set_num_threads(-1), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tessera_last_error()).find("threads"), std::string::npos);
  EXPECT_EQ(tessera_set_cpu_reference(1), TESSERA_OK);
  EXPECT_EQ(tessera::cpu_impl(), tessera::CpuImpl::kReference);
  EXPECT_EQ(tessera_set_cpu_reference(0), TESSERA_OK);
  EXPECT_EQ(tessera::cpu_impl(), tessera::CpuImpl::kFast);
  const int checking = tessera_index_checking();
  EXPECT_EQ(tessera_set_index_checking(1), TESSERA_OK);
  EXPECT_EQ(tessera_index_checking(), 1);
  EXPECT_TRUE(tessera::index_checking());
  EXPECT_EQ(tessera_set_index_checking(0), TESSERA_OK);
  EXPECT_EQ(tessera_index_checking(), 0);
  EXPECT_EQ(tessera_set_index_checking(checking), TESSERA_OK);
  EXPECT_STREQ(tessera_last_error(), "");
}

// ---------------------------------------------------------------- attention

TEST_F(CApiTest, RaggedPrefillOneShotPlanRunAndCppAgree) {
  ASSERT_EQ(tessera_ragged_prefill(q.dl(), k.dl(), v.dl(), qo_indptr.dl(), kv_indptr.dl(), o.dl(),
                                   lse.dl(), &options, nullptr),
            TESSERA_OK)
      << tessera_last_error();
  EXPECT_STREQ(tessera_last_error(), "");

  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                        kQoHeads, kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan),
            TESSERA_OK)
      << tessera_last_error();
  std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan) + 1);
  HostTensor o_run = o, lse_run = lse;
  o_run.fill(kSentinel);
  ASSERT_EQ(tessera_run_ragged_prefill(plan, q.dl(), k.dl(), v.dl(), qo_indptr.dl(), kv_indptr.dl(),
                                       o_run.dl(), lse_run.dl(), workspace.data(), workspace.size(),
                                       nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera_plan_destroy(plan);

  HostTensor o_cpp = o, lse_cpp = lse;
  tessera::ragged_prefill(q.view(), k.view(), v.view(), qo_indptr.view(), kv_indptr.view(),
                          o_cpp.view(), lse_cpp.view(), options_cpp());
  expect_close(o, o_cpp, 0.0f);
  expect_close(lse, lse_cpp, 0.0f);
  expect_close(o_run, o_cpp, 0.0f);
  expect_close(lse_run, lse_cpp, 0.0f);

  // The double-accumulating reference agrees with the fast path to fp32 rounding.
  ASSERT_EQ(tessera_set_cpu_reference(1), TESSERA_OK);
  HostTensor o_reference = o;
  ASSERT_EQ(tessera_ragged_prefill(q.dl(), k.dl(), v.dl(), qo_indptr.dl(), kv_indptr.dl(),
                                   o_reference.dl(), nullptr, &options, nullptr),
            TESSERA_OK);
  ASSERT_EQ(tessera_set_cpu_reference(0), TESSERA_OK);
  expect_close(o_reference, o_cpp, 1e-4f);
}

// q and k as strided views into one fused QKV buffer: explicit DLPack strides and byte_offset.
TEST_F(CApiTest, RaggedPrefillHonoursStridesAndByteOffset) {
  constexpr int64_t kRowWidth = (kQoHeads + 2 * kKvHeads) * kHeadDim;
  std::vector<float> fused(kTotalKv * kRowWidth, 0.0f);
  for (int64_t t = 0; t < kTotalKv; ++t) {
    for (int64_t i = 0; i < kKvHeads * kHeadDim; ++i) {
      fused[t * kRowWidth + kQoHeads * kHeadDim + i] = k.get(t * kKvHeads * kHeadDim + i);
    }
    for (int64_t i = 0; t < kTotalQ && i < kQoHeads * kHeadDim; ++i) {
      fused[t * kRowWidth + i] = q.get(t * kQoHeads * kHeadDim + i);
    }
  }
  int64_t q_shape[3] = {kTotalQ, kQoHeads, kHeadDim}, k_shape[3] = {kTotalKv, kKvHeads, kHeadDim};
  int64_t strides[3] = {kRowWidth, kHeadDim, 1};
  DLTensor q_fused{fused.data(), {kDLCPU, 0}, 3, kF32, q_shape, strides, 0};
  DLTensor k_fused{fused.data(),
                   {kDLCPU, 0},
                   3,
                   kF32,
                   k_shape,
                   strides,
                   static_cast<uint64_t>(kQoHeads * kHeadDim * sizeof(float))};
  ASSERT_EQ(tessera_ragged_prefill(&q_fused, &k_fused, v.dl(), qo_indptr.dl(), kv_indptr.dl(),
                                   o.dl(), lse.dl(), &options, nullptr),
            TESSERA_OK)
      << tessera_last_error();
  HostTensor o_contiguous = o, lse_contiguous = lse;
  ASSERT_EQ(tessera_ragged_prefill(q.dl(), k.dl(), v.dl(), qo_indptr.dl(), kv_indptr.dl(),
                                   o_contiguous.dl(), lse_contiguous.dl(), &options, nullptr),
            TESSERA_OK);
  expect_close(o, o_contiguous, 0.0f);
  expect_close(lse, lse_contiguous, 0.0f);
}

TEST_F(CApiTest, PagedPrefillOneShotPlanRunAndCppAgree) {
  const tessera_paged_kv kv = paged_kv();
  ASSERT_EQ(tessera_paged_prefill(q.dl(), &kv, qo_indptr.dl(), o.dl(), lse.dl(), &options, nullptr),
            TESSERA_OK)
      << tessera_last_error();

  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_paged_prefill(qo_indptr_host.data(), page_indptr_host.data(),
                                       last_page_len_host.data(), kBatch, kPageSize, kQoHeads,
                                       kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan),
            TESSERA_OK)
      << tessera_last_error();
  std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan));
  HostTensor o_run = o;
  o_run.fill(kSentinel);
  ASSERT_EQ(tessera_run_paged_prefill(plan, q.dl(), &kv, qo_indptr.dl(), o_run.dl(), nullptr,
                                      workspace.data(), workspace.size(), nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera_plan_destroy(plan);

  HostTensor o_cpp = o, lse_cpp = lse;
  tessera::paged_prefill(q.view(), paged_kv_cpp(), qo_indptr.view(), o_cpp.view(), lse_cpp.view(),
                         options_cpp());
  expect_close(o, o_cpp, 0.0f);
  expect_close(lse, lse_cpp, 0.0f);
  expect_close(o_run, o_cpp, 0.0f);
}

TEST_F(CApiTest, DecodeOneShotPlanRunAndCppAgree) {
  const tessera_paged_kv kv = paged_kv();
  ASSERT_EQ(tessera_decode(q_decode.dl(), &kv, o_decode.dl(), lse_decode.dl(), nullptr, nullptr),
            TESSERA_OK)
      << tessera_last_error();

  tessera_plan* plan = nullptr;
  ASSERT_EQ(
      tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch, kPageSize,
                          kQoHeads, kKvHeads, kHeadDim, kQPerRequest, nullptr, kDLCPU, 0, &plan),
      TESSERA_OK)
      << tessera_last_error();
  std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan));
  HostTensor o_run = sentinel_decode, lse_run = lse_sentinel;
  ASSERT_EQ(tessera_run_decode(plan, q_decode.dl(), &kv, o_run.dl(), lse_run.dl(), workspace.data(),
                               workspace.size(), nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera_plan_destroy(plan);

  HostTensor o_cpp = sentinel_decode, lse_cpp = lse_sentinel;
  tessera::decode(q_decode.view(), paged_kv_cpp(), o_cpp.view(), lse_cpp.view());
  expect_close(o_decode, o_cpp, 0.0f);
  expect_close(lse_decode, lse_cpp, 0.0f);
  expect_close(o_run, o_cpp, 0.0f);
  expect_close(lse_run, lse_cpp, 0.0f);
}

// Half-precision q/o and an fp8 (DLPack 1.x code) KV cache pass through the dtype conversion.
TEST_F(CApiTest, DecodeWithHalfQueryAndFp8Cache) {
  for (const DLDataType q_type : {kF16, kBF16}) {
    HostTensor q_half({kBatch * kQPerRequest, kQoHeads, kHeadDim}, q_type);
    HostTensor o_half = q_half, o_cpp = q_half;
    q_half.fill_pattern(7);
    HostTensor k_fp8({kNumPages, kPageSize, kKvHeads, kHeadDim}, kE4M3), v_fp8 = k_fp8;
    k_fp8.fill_pattern(8);
    v_fp8.fill_pattern(9);
    const tessera_paged_kv kv{k_fp8.dl(),        v_fp8.dl(),         page_indptr.dl(),
                              page_indices.dl(), last_page_len.dl(), TESSERA_KV_LAYOUT_NHD};
    tessera_attention_options scaled = options;
    scaled.k_scale = 0.5f;
    scaled.v_scale = 2.0f;
    ASSERT_EQ(tessera_decode(q_half.dl(), &kv, o_half.dl(), nullptr, &scaled, nullptr), TESSERA_OK)
        << tessera_last_error();
    tessera::PagedKVCache cache = paged_kv_cpp();
    cache.k_cache = k_fp8.view();
    cache.v_cache = v_fp8.view();
    tessera::AttentionOptions scaled_cpp = options_cpp();
    scaled_cpp.k_scale = 0.5f;
    scaled_cpp.v_scale = 2.0f;
    tessera::decode(q_half.view(), cache, o_cpp.view(), {}, scaled_cpp);
    EXPECT_EQ(o_half.bytes(), o_cpp.bytes());
  }
}

TEST_F(CApiTest, PlanExplainAndDestroy) {
  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                        kQoHeads, kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan),
            TESSERA_OK);
  size_t needed = 0;
  ASSERT_EQ(tessera_plan_explain(plan, nullptr, 0, &needed), TESSERA_OK);
  ASSERT_GT(needed, 1u);
  std::string text(needed, 'x');
  ASSERT_EQ(tessera_plan_explain(plan, text.data(), text.size(), nullptr), TESSERA_OK);
  EXPECT_EQ(text.back(), '\0');
  EXPECT_NE(text.find("ragged_prefill"), std::string::npos) << text;

  std::vector<char> small(8, 'x');
  expect_failure(tessera_plan_explain(plan, small.data(), small.size(), &needed),
                 TESSERA_ERROR_INVALID_ARGUMENT, "capacity");
  EXPECT_EQ(std::string(small.data()), text.substr(0, 7));  // truncated, NUL-terminated
  expect_failure(tessera_plan_explain(plan, nullptr, 16, nullptr), TESSERA_ERROR_INVALID_ARGUMENT,
                 "buffer");
  expect_failure(tessera_plan_explain(nullptr, text.data(), text.size(), nullptr),
                 TESSERA_ERROR_INVALID_ARGUMENT, "plan");
  tessera_plan_destroy(plan);
  tessera_plan_destroy(nullptr);
  EXPECT_EQ(tessera_plan_workspace_bytes(nullptr), 0u);
}

// ---------------------------------------------------------------- ops

TEST_F(CApiTest, RopeMatchesCpp) {
  HostTensor positions = int_tensor({0, 5, 9, 2, 7, 1, 3, 100});
  HostTensor k_rows({kTotalQ, kKvHeads, kHeadDim}, kF32);
  k_rows.fill_pattern(11);
  HostTensor q_cpp = q, k_cpp = k_rows;
  tessera_rope_options rope;
  tessera_rope_options_default(&rope);
  rope.interleave = 1;
  rope.rotary_dim = kHeadDim / 2;
  ASSERT_EQ(tessera_apply_rope_inplace(q.dl(), k_rows.dl(), positions.dl(), &rope, nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera::RopeOptions rope_cpp;
  rope_cpp.interleave = true;
  rope_cpp.rotary_dim = kHeadDim / 2;
  tessera::apply_rope_inplace(q_cpp.view(), k_cpp.view(), positions.view(), rope_cpp);
  EXPECT_EQ(q.bytes(), q_cpp.bytes());
  EXPECT_EQ(k_rows.bytes(), k_cpp.bytes());
  // k alone, default options (NULL).
  ASSERT_EQ(tessera_apply_rope_inplace(nullptr, k_rows.dl(), positions.dl(), nullptr, nullptr),
            TESSERA_OK);
  tessera::apply_rope_inplace({}, k_cpp.view(), positions.view(), {});
  EXPECT_EQ(k_rows.bytes(), k_cpp.bytes());
}

TEST_F(CApiTest, AppendPagedKvCacheMatchesCpp) {
  // Append 2 rows to request 0 and 3 to request 2 (the page table already includes them).
  HostTensor k_new({5, kKvHeads, kHeadDim}, kF32), v_new = k_new;
  k_new.fill_pattern(12);
  v_new.fill_pattern(13);
  HostTensor append_indptr = int_tensor({0, 2, 2, 5});
  HostTensor k_cache_cpp = k_cache, v_cache_cpp = v_cache;
  const std::vector<unsigned char> k_cache_before = k_cache.bytes();
  tessera_rope_options rope;
  tessera_rope_options_default(&rope);
  const tessera_paged_kv kv = paged_kv();
  ASSERT_EQ(tessera_append_paged_kv_cache(k_new.dl(), v_new.dl(), append_indptr.dl(), &kv, &rope,
                                          nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera::PagedKVCache cache = paged_kv_cpp();
  cache.k_cache = k_cache_cpp.view();
  cache.v_cache = v_cache_cpp.view();
  const tessera::RopeOptions rope_cpp;
  tessera::append_paged_kv_cache(k_new.view(), v_new.view(), append_indptr.view(), cache,
                                 &rope_cpp);
  EXPECT_EQ(k_cache.bytes(), k_cache_cpp.bytes());
  EXPECT_EQ(v_cache.bytes(), v_cache_cpp.bytes());
  EXPECT_NE(k_cache.bytes(), k_cache_before);
}

TEST_F(CApiTest, BlockTableToCsr) {
  HostTensor block_table({3, 3}, kI32);
  const int32_t table[9] = {4, 2, 9, 7, 8, 8, 1, 3, 5};
  std::memcpy(block_table.ints(), table, sizeof(table));
  HostTensor seq_lens = int_tensor({6, 0, 12});
  HostTensor indptr = int_tensor({-1, -1, -1, -1}),
             indices = int_tensor(std::vector<int32_t>(9, -1));
  HostTensor last = int_tensor({-1, -1, -1});
  ASSERT_EQ(tessera_block_table_to_csr(block_table.dl(), seq_lens.dl(), kPageSize, indptr.dl(),
                                       indices.dl(), last.dl(), nullptr),
            TESSERA_OK)
      << tessera_last_error();
  EXPECT_EQ(std::vector<int32_t>(indptr.ints(), indptr.ints() + 4),
            (std::vector<int32_t>{0, 2, 2, 5}));
  EXPECT_EQ(std::vector<int32_t>(indices.ints(), indices.ints() + 5),
            (std::vector<int32_t>{4, 2, 1, 3, 5}));
  EXPECT_EQ(last.ints()[0], 2);
  EXPECT_EQ(last.ints()[2], 4);
}

TEST_F(CApiTest, MergeStateAndMergeStatesMatchCpp) {
  HostTensor o_a({5, 2, 16}, kF32), o_b = o_a, lse_a({5, 2}, kF32), lse_b = lse_a;
  o_a.fill_pattern(14);
  o_b.fill_pattern(15);
  lse_a.fill_pattern(16);
  lse_b.fill_pattern(17);
  lse_b.set(3, -INFINITY);  // an empty state
  HostTensor merged = o_a, merged_lse = lse_a, merged_cpp = o_a, merged_lse_cpp = lse_a;
  ASSERT_EQ(tessera_merge_state(o_a.dl(), lse_a.dl(), o_b.dl(), lse_b.dl(), merged.dl(),
                                merged_lse.dl(), nullptr),
            TESSERA_OK)
      << tessera_last_error();
  tessera::merge_state(o_a.view(), lse_a.view(), o_b.view(), lse_b.view(), merged_cpp.view(),
                       merged_lse_cpp.view());
  EXPECT_EQ(merged.bytes(), merged_cpp.bytes());
  EXPECT_EQ(merged_lse.bytes(), merged_lse_cpp.bytes());

  HostTensor indptr = int_tensor({0, 2, 2, 5});
  HostTensor rows({3, 2, 16}, kF32), rows_cpp = rows, rows_lse({3, 2}, kF32),
                                     rows_lse_cpp = rows_lse;
  ASSERT_EQ(
      tessera_merge_states(o_a.dl(), lse_a.dl(), indptr.dl(), rows.dl(), rows_lse.dl(), nullptr),
      TESSERA_OK)
      << tessera_last_error();
  tessera::merge_states(o_a.view(), lse_a.view(), indptr.view(), rows_cpp.view(),
                        rows_lse_cpp.view());
  EXPECT_EQ(rows.bytes(), rows_cpp.bytes());
  EXPECT_EQ(rows_lse.bytes(), rows_lse_cpp.bytes());
  // lse_out is optional.
  ASSERT_EQ(tessera_merge_states(o_a.dl(), lse_a.dl(), indptr.dl(), rows.dl(), nullptr, nullptr),
            TESSERA_OK);
  EXPECT_EQ(rows.bytes(), rows_cpp.bytes());
}

}  // namespace
