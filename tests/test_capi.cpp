// Tests of the C ABI (tessera/tessera.h). Every call under test goes through the C functions
// with DLPack tensors; the C++ API is used only to compute the results the C calls must match,
// on separate copies of the same inputs. Failing calls must return the right status, name the
// argument in tessera_last_error(), and leave every output exactly as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/half.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kE4M3{TESSERA_DL_FLOAT8_E4M3FN, 8, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr float kSentinel = -4321.0f;

// This test's own DLPack -> tessera dtype table, so the C layer's conversion is checked against
// an independent statement of the mapping.
tessera::DType dtype_of(DLDataType type) {
  if (type.code == kDLFloat)
    return type.bits == 32 ? tessera::DType::kFloat32 : tessera::DType::kFloat16;
  if (type.code == kDLBfloat) return tessera::DType::kBFloat16;
  if (type.code == TESSERA_DL_FLOAT8_E4M3FN) return tessera::DType::kFloat8E4M3;
  if (type.code == TESSERA_DL_FLOAT8_E5M2) return tessera::DType::kFloat8E5M2;
  return type.bits == 32 ? tessera::DType::kInt32 : tessera::DType::kInt64;
}

// A contiguous host tensor that owns its bytes and hands out a DLTensor describing them.
class HostTensor {
 public:
  HostTensor(std::vector<int64_t> shape, DLDataType dtype) : shape_(std::move(shape)) {
    tensor_.ndim = static_cast<int32_t>(shape_.size());
    tensor_.dtype = dtype;
    tensor_.device = DLDevice{kDLCPU, 0};
    bytes_.resize(static_cast<size_t>(numel()) * dtype.bits / 8);
  }
  int64_t numel() const {
    int64_t count = 1;
    for (int64_t size : shape_) count *= size;
    return count;
  }
  // Pointers are refreshed on every call, so copies of a HostTensor stay valid.
  DLTensor* dl() {
    tensor_.data = bytes_.data();
    tensor_.shape = shape_.data();
    tensor_.strides = nullptr;
    return &tensor_;
  }
  tessera::TensorView view() {
    tessera::TensorView view;
    view.data = bytes_.data();
    view.dtype = dtype_of(tensor_.dtype);
    view.ndim = static_cast<int>(shape_.size());
    int64_t stride = 1;
    for (int d = view.ndim - 1; d >= 0; --d) {
      view.shape[d] = shape_[d];
      view.stride[d] = stride;
      stride *= shape_[d];
    }
    return view;
  }
  float get(int64_t i) const {
    return tessera::detail::load_as_float(bytes_.data(), dtype_of(tensor_.dtype), i);
  }
  void set(int64_t i, float value) {
    tessera::detail::store_from_float(bytes_.data(), dtype_of(tensor_.dtype), i, value);
  }
  void fill(float value) {
    for (int64_t i = 0; i < numel(); ++i) set(i, value);
  }
  // Smooth pseudo-random values in [-1, 1], different per seed.
  void fill_pattern(int seed) {
    for (int64_t i = 0; i < numel(); ++i) set(i, std::sin(0.37f * i + 1.3f * seed));
  }
  int32_t* ints() { return reinterpret_cast<int32_t*>(bytes_.data()); }
  const std::vector<unsigned char>& bytes() const { return bytes_; }
  DLTensor& descriptor() { return *dl(); }

 private:
  std::vector<int64_t> shape_;
  std::vector<unsigned char> bytes_;
  DLTensor tensor_{};
};

HostTensor int_tensor(const std::vector<int32_t>& values) {
  HostTensor tensor({static_cast<int64_t>(values.size())}, kI32);
  if (!values.empty()) std::memcpy(tensor.ints(), values.data(), values.size() * sizeof(int32_t));
  return tensor;
}

void expect_close(const HostTensor& actual, const HostTensor& expected, float tolerance) {
  ASSERT_EQ(actual.numel(), expected.numel());
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const float a = actual.get(i), e = expected.get(i);
    if (std::isinf(e)) {
      ASSERT_EQ(a, e) << "element " << i;
    } else {
      ASSERT_NEAR(a, e, tolerance) << "element " << i;
    }
  }
}

// Checks a failed call: its status, the argument named in the last error, and the error text.
void expect_failure(tessera_status status, tessera_status expected, const std::string& argument) {
  EXPECT_EQ(status, expected) << tessera_last_error();
  EXPECT_NE(std::string(tessera_last_error()).find("'" + argument + "'"), std::string::npos)
      << "last error \"" << tessera_last_error() << "\" does not name '" << argument << "'";
}

// ---------------------------------------------------------------- fixture

// Shapes: 3 requests, GQA 4:2, head_dim 32; pages of 4 tokens.
constexpr int kQoHeads = 4, kKvHeads = 2, kHeadDim = 32, kPageSize = 4, kNumPages = 8;
constexpr int kTotalQ = 8, kTotalKv = 13, kBatch = 3, kQPerRequest = 2;

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(tessera_set_cpu_reference(0), TESSERA_OK);
    q.fill_pattern(1);
    k.fill_pattern(2);
    v.fill_pattern(3);
    k_cache.fill_pattern(4);
    v_cache.fill_pattern(5);
    q_decode.fill_pattern(6);
    for (HostTensor* output : {&o, &lse, &o_decode, &lse_decode}) output->fill(kSentinel);
    tessera_attention_options_default(&options);
    options.causal = 1;
  }

  tessera_paged_kv paged_kv() {
    return {k_cache.dl(),      v_cache.dl(),       page_indptr.dl(),
            page_indices.dl(), last_page_len.dl(), TESSERA_KV_LAYOUT_NHD};
  }
  tessera::PagedKVCache paged_kv_cpp() {
    tessera::PagedKVCache cache;
    cache.k_cache = k_cache.view();
    cache.v_cache = v_cache.view();
    cache.page_indptr = page_indptr.view();
    cache.page_indices = page_indices.view();
    cache.last_page_len = last_page_len.view();
    return cache;
  }
  tessera::AttentionOptions options_cpp() const {
    tessera::AttentionOptions result;
    result.causal = options.causal != 0;
    return result;
  }
  bool decode_outputs_untouched() const {
    return o_decode.bytes() == sentinel_decode.bytes() &&
           lse_decode.bytes() == lse_sentinel.bytes();
  }

  std::vector<int32_t> qo_indptr_host{0, 3, 4, 8}, kv_indptr_host{0, 5, 7, 13};
  // Request kv lengths 5, 2, 9 over shuffled pages.
  std::vector<int32_t> page_indptr_host{0, 2, 3, 6}, last_page_len_host{1, 2, 1};
  HostTensor q{{kTotalQ, kQoHeads, kHeadDim}, kF32}, o{{kTotalQ, kQoHeads, kHeadDim}, kF32};
  HostTensor lse{{kTotalQ, kQoHeads}, kF32};
  HostTensor k{{kTotalKv, kKvHeads, kHeadDim}, kF32}, v{{kTotalKv, kKvHeads, kHeadDim}, kF32};
  HostTensor qo_indptr = int_tensor(qo_indptr_host), kv_indptr = int_tensor(kv_indptr_host);
  HostTensor k_cache{{kNumPages, kPageSize, kKvHeads, kHeadDim}, kF32};
  HostTensor v_cache{{kNumPages, kPageSize, kKvHeads, kHeadDim}, kF32};
  HostTensor page_indptr = int_tensor(page_indptr_host);
  HostTensor page_indices = int_tensor({6, 1, 3, 0, 7, 2});
  HostTensor last_page_len = int_tensor(last_page_len_host);
  HostTensor q_decode{{kBatch * kQPerRequest, kQoHeads, kHeadDim}, kF32};
  HostTensor o_decode{{kBatch * kQPerRequest, kQoHeads, kHeadDim}, kF32};
  HostTensor lse_decode{{kBatch * kQPerRequest, kQoHeads}, kF32};
  HostTensor sentinel_decode = o_decode_filled(), lse_sentinel = lse_decode_filled();
  tessera_attention_options options{};

 private:
  static HostTensor o_decode_filled() {
    HostTensor tensor({kBatch * kQPerRequest, kQoHeads, kHeadDim}, kF32);
    tensor.fill(kSentinel);
    return tensor;
  }
  static HostTensor lse_decode_filled() {
    HostTensor tensor({kBatch * kQPerRequest, kQoHeads}, kF32);
    tensor.fill(kSentinel);
    return tensor;
  }
};

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
