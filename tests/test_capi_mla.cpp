// MLA through the C ABI (tessera.h: tessera_plan_mla / tessera_run_mla / tessera_mla_attention /
// tessera_append_paged_mla_cache): results against the brute force of common/mla_testing.cpp
// (two-tensor and combined caches, strided views), the explain text, the append, and failing
// calls: status codes, tessera_last_error naming the argument, outputs left as they were.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/mla_testing.hpp"
#include "tessera/tessera.h"

namespace {

using tessera::test::MlaBuffers;
using tessera::test::MlaCase;

// A DLTensor over a TensorView (strides included), owning its shape / stride arrays.
struct Dl {
  DLTensor tensor{};
  int64_t shape[4] = {};
  int64_t strides[4] = {};
  explicit Dl(const tessera::TensorView& view) {
    tensor.data = view.data;
    tensor.device = DLDevice{kDLCPU, 0};
    tensor.ndim = view.ndim;
    switch (view.dtype) {
      case tessera::DType::kFloat32: tensor.dtype = {kDLFloat, 32, 1}; break;
      case tessera::DType::kFloat16: tensor.dtype = {kDLFloat, 16, 1}; break;
      case tessera::DType::kBFloat16: tensor.dtype = {kDLBfloat, 16, 1}; break;
      default: tensor.dtype = {kDLInt, 32, 1}; break;
    }
    for (int d = 0; d < view.ndim; ++d) {
      shape[d] = view.shape[d];
      strides[d] = view.stride[d];
    }
    tensor.shape = shape;
    tensor.strides = strides;
  }
  const DLTensor* get() const { return view_or_null(); }
  const DLTensor* view_or_null() const { return tensor.ndim == 0 ? nullptr : &tensor; }
};

// The tessera_mla_cache of a case, with the Dl holders alive as long as it.
struct CCache {
  Dl ckv, kpe, page_indptr, page_indices, last_page_len;
  tessera_mla_cache cache{};
  explicit CCache(const MlaBuffers& buffers)
      : ckv(buffers.ckv_cache()),
        kpe(buffers.kpe_cache()),
        page_indptr(buffers.index_view(buffers.page_indptr)),
        page_indices(buffers.index_view(buffers.page_indices)),
        last_page_len(buffers.index_view(buffers.last_page_len)) {
    cache = {ckv.get(), kpe.get(), page_indptr.get(), page_indices.get(), last_page_len.get()};
  }
};

MlaCase small_case(bool combined) {
  MlaCase c;
  c.num_heads = 16;
  c.kv_lora_rank = 512;
  c.rope_dim = 64;
  c.page_size = 64;
  c.causal = true;
  c.q_lens = {1, 2, 0, 3};
  c.kv_lens = {300, 2, 10, 65};
  c.combined_cache = combined;
  c.combined_q = combined;
  return c;
}

void expect_brute_force(const MlaBuffers& buffers) {
  const tessera::test::MlaDiff diff = tessera::test::mla_diff(
      tessera::test::mla_outputs(buffers), tessera::test::mla_brute_force(buffers));
  EXPECT_LE(diff.o, 2e-4) << buffers.c.describe();
  EXPECT_LE(diff.lse, 1e-4) << buffers.c.describe();
}

std::string last_error() {
  return tessera_last_error();
}

TEST(CApiMla, PlanRunMatchesTheFormula) {
  std::mt19937_64 rng(51);
  for (bool combined : {false, true}) {
    MlaBuffers buffers = tessera::test::make_mla_buffers(small_case(combined), rng);
    const MlaCase& c = buffers.c;
    tessera_mla_options options{1, 0.0f};
    tessera_mla_plan* plan = nullptr;
    ASSERT_EQ(tessera_plan_mla(buffers.qo_indptr.data(), buffers.page_indptr.data(),
                               buffers.last_page_len.data(), 4, c.page_size, c.num_heads,
                               c.kv_lora_rank, c.rope_dim, &options, kDLCPU, 0, &plan),
              TESSERA_OK)
        << last_error();
    size_t needed = 0;
    ASSERT_EQ(tessera_mla_plan_explain(plan, nullptr, 0, &needed), TESSERA_OK);
    std::string text(needed, '\0');
    ASSERT_EQ(tessera_mla_plan_explain(plan, text.data(), text.size(), nullptr), TESSERA_OK);
    EXPECT_NE(text.find("kv_lora_rank 512"), std::string::npos) << text;
    std::vector<unsigned char> workspace(tessera_mla_plan_workspace_bytes(plan) + 1);
    const CCache cache(buffers);
    const Dl q_nope(buffers.q_nope()), q_pe(buffers.q_pe()), o(buffers.o_view()),
        lse(buffers.lse_view()), qo(buffers.index_view(buffers.qo_indptr));
    ASSERT_EQ(tessera_run_mla(plan, q_nope.get(), q_pe.get(), &cache.cache, qo.get(), o.get(),
                              lse.get(), workspace.data(), workspace.size(), nullptr),
              TESSERA_OK)
        << last_error();
    expect_brute_force(buffers);
    tessera_mla_plan_destroy(plan);

    buffers.poison_outputs();
    ASSERT_EQ(tessera_mla_attention(q_nope.get(), q_pe.get(), &cache.cache, qo.get(), o.get(),
                                    lse.get(), &options, nullptr),
              TESSERA_OK)
        << last_error();
    expect_brute_force(buffers);
  }
}

TEST(CApiMla, AppendWritesTheRows) {
  std::mt19937_64 rng(52);
  MlaCase c = small_case(false);
  c.kv_lens = {4, 0, 0, 0};
  MlaBuffers buffers = tessera::test::make_mla_buffers(c, rng);
  std::vector<float> ckv(2 * 512), kpe(2 * 64);
  for (size_t i = 0; i < ckv.size(); ++i) ckv[i] = static_cast<float>(i % 97) * 0.25f;
  for (size_t i = 0; i < kpe.size(); ++i) kpe[i] = -static_cast<float>(i % 31);
  const std::vector<int32_t> append = {0, 2, 2, 2, 2};
  const Dl ckv_new(tessera::make_view(ckv.data(), tessera::DType::kFloat32, {2, 512}));
  const Dl kpe_new(tessera::make_view(kpe.data(), tessera::DType::kFloat32, {2, 64}));
  const Dl indptr(buffers.index_view(append));
  const CCache cache(buffers);
  ASSERT_EQ(tessera_append_paged_mla_cache(ckv_new.get(), kpe_new.get(), indptr.get(), &cache.cache,
                                           nullptr, nullptr),
            TESSERA_OK)
      << last_error();
  for (int i = 0; i < 2; ++i) {
    for (int d = 0; d < 576; ++d) {
      const double expected = d < 512 ? ckv[i * 512 + d] : kpe[i * 64 + d - 512];
      ASSERT_EQ(buffers.kv_at(0, 2 + i, d), expected) << i << " " << d;
    }
  }
  // The kpe rows are required when the cache has a rope part.
  EXPECT_EQ(tessera_append_paged_mla_cache(ckv_new.get(), nullptr, indptr.get(), &cache.cache,
                                           nullptr, nullptr),
            TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'kpe_new'"), std::string::npos) << last_error();
}

TEST(CApiMla, FailuresNameTheArgumentAndWriteNothing) {
  std::mt19937_64 rng(53);
  MlaBuffers buffers = tessera::test::make_mla_buffers(small_case(false), rng);
  const MlaCase& c = buffers.c;
  tessera_mla_plan* plan = nullptr;
  const auto plan_with = [&](int heads, int lora, int rope, int device_type) {
    return tessera_plan_mla(buffers.qo_indptr.data(), buffers.page_indptr.data(),
                            buffers.last_page_len.data(), 4, c.page_size, heads, lora, rope,
                            nullptr, device_type, 0, &plan);
  };
  EXPECT_EQ(plan_with(16, 520, 64, kDLCPU), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'kv_lora_rank'"), std::string::npos) << last_error();
  EXPECT_EQ(plan, nullptr);
  EXPECT_EQ(plan_with(16, 512, 60, kDLCPU), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'rope_dim'"), std::string::npos) << last_error();
  EXPECT_EQ(plan_with(0, 512, 64, kDLCPU), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'num_heads'"), std::string::npos) << last_error();
  EXPECT_EQ(plan_with(16, 512, 64, kDLCUDA), TESSERA_ERROR_UNSUPPORTED);
  EXPECT_NE(last_error().find("MLA runs on the CPU backend only"), std::string::npos)
      << last_error();
  EXPECT_EQ(
      tessera_plan_mla(nullptr, nullptr, nullptr, 4, 64, 16, 512, 64, nullptr, kDLCPU, 0, &plan),
      TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'qo_indptr'"), std::string::npos) << last_error();

  ASSERT_EQ(plan_with(16, 512, 64, kDLCPU), TESSERA_OK) << last_error();
  std::vector<unsigned char> workspace(tessera_mla_plan_workspace_bytes(plan) + 1);
  const CCache cache(buffers);
  const Dl q_nope(buffers.q_nope()), q_pe(buffers.q_pe()), o(buffers.o_view()),
      lse(buffers.lse_view()), qo(buffers.index_view(buffers.qo_indptr));
  const auto run = [&](const DLTensor* nope, const DLTensor* pe, const tessera_mla_cache* kv,
                       const tessera_mla_plan* p) {
    return tessera_run_mla(p, nope, pe, kv, qo.get(), o.get(), lse.get(), workspace.data(),
                           workspace.size(), nullptr);
  };
  EXPECT_EQ(run(q_nope.get(), nullptr, &cache.cache, plan), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'q_pe'"), std::string::npos) << last_error();
  EXPECT_EQ(run(q_pe.get(), q_pe.get(), &cache.cache, plan), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'q_nope'"), std::string::npos) << last_error();
  EXPECT_EQ(run(q_nope.get(), q_pe.get(), nullptr, plan), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'cache'"), std::string::npos) << last_error();
  EXPECT_EQ(run(q_nope.get(), q_pe.get(), &cache.cache, nullptr), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'plan'"), std::string::npos) << last_error();
  tessera_mla_cache swapped = cache.cache;
  swapped.ckv_cache = cache.cache.kpe_cache;
  EXPECT_EQ(run(q_nope.get(), q_pe.get(), &swapped, plan), TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("'ckv_cache'"), std::string::npos) << last_error();
  const tessera::test::MlaResult after = tessera::test::mla_outputs(buffers);
  for (double x : after.o) ASSERT_TRUE(std::isnan(x));
  for (double x : after.lse) ASSERT_TRUE(std::isnan(x));
  tessera_mla_plan_destroy(plan);
}

}  // namespace
