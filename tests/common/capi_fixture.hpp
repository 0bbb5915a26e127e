// The C ABI tests' host tensors and fixture (test_capi.cpp: queries, attention, ops;
// test_capi_errors.cpp: failing calls). Every call under test goes through the C functions with
// DLPack tensors; the C++ API is used only to compute the results the C calls must match, on
// separate copies of the same inputs. Header-only.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/half.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace tessera::test::capi {

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kE4M3{TESSERA_DL_FLOAT8_E4M3FN, 8, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};
constexpr float kSentinel = -4321.0f;

// This test's own DLPack -> tessera dtype table, so the C layer's conversion is checked against
// an independent statement of the mapping.
inline tessera::DType dtype_of(DLDataType type) {
  if (type.code == kDLFloat)
    return type.bits == 32 ? tessera::DType::kFloat32 : tessera::DType::kFloat16;
  if (type.code == kDLBfloat) return tessera::DType::kBFloat16;
  if (type.code == TESSERA_DL_FLOAT8_E4M3FN) return tessera::DType::kFloat8E4M3;
  if (type.code == TESSERA_DL_FLOAT8_E5M2) return tessera::DType::kFloat8E5M2;
  if (type.code == kDLUInt && type.bits == 8) return tessera::DType::kUInt8;
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

inline HostTensor int_tensor(const std::vector<int32_t>& values) {
  HostTensor tensor({static_cast<int64_t>(values.size())}, kI32);
  if (!values.empty()) std::memcpy(tensor.ints(), values.data(), values.size() * sizeof(int32_t));
  return tensor;
}

inline void expect_close(const HostTensor& actual, const HostTensor& expected, float tolerance) {
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
inline void expect_failure(tessera_status status, tessera_status expected,
                           const std::string& argument) {
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

}  // namespace tessera::test::capi
