// Cascade attention through the C ABI (tessera.h): tessera_plan_cascade / tessera_run_cascade on
// random cases of tests/common/cascade_testing.hpp (fp16 and float32) match the per-row
// reference (the C++ API is tested in test_cascade.cpp); the plan queries; bad calls fail by name and
// write nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cascade_testing.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using tessera::test::CascadeCase;
using tessera::test::CascadeData;

DLDataType dl_dtype(tessera::DType dtype) {
  switch (dtype) {
    case tessera::DType::kFloat16: return {kDLFloat, 16, 1};
    case tessera::DType::kBFloat16: return {kDLBfloat, 16, 1};
    default: return {kDLFloat, 32, 1};
  }
}

// A DLTensor over caller-owned host memory (contiguous).
struct Dl {
  Dl(const void* data, DLDataType dtype, std::vector<int64_t> dims) : shape(std::move(dims)) {
    tensor.data = const_cast<void*>(data);
    tensor.device = {kDLCPU, 0};
    tensor.ndim = static_cast<int32_t>(shape.size());
    tensor.dtype = dtype;
    tensor.shape = shape.data();
  }
  Dl(const std::vector<int32_t>& values)  // NOLINT: index arrays convert implicitly
      : Dl(values.data(), {kDLInt, 32, 1}, {static_cast<int64_t>(values.size())}) {}
  Dl(const Dl& other) : Dl(other.tensor.data, other.tensor.dtype, other.shape) {}
  DLTensor tensor{};
  std::vector<int64_t> shape;
};

struct CRun {
  tessera_status status = TESSERA_OK;
  std::string error;
  std::vector<uint8_t> o;
  std::vector<float> lse;
};

CRun run_c(const CascadeData& data, int num_levels_at_run = -1) {
  const CascadeCase& c = data.test_case;
  std::vector<tessera_cascade_level_lengths> lengths;
  for (size_t l = 0; l < data.qo_indptr.size(); ++l) {
    lengths.push_back({data.qo_indptr[l].data(), data.page_indptr[l].data(),
                       data.last_page_len[l].data(),
                       static_cast<int64_t>(data.last_page_len[l].size())});
  }
  tessera_attention_options options;
  tessera_attention_options_default(&options);
  options.causal = c.causal;
  options.logits_soft_cap = c.soft_cap;
  tessera_cascade_plan* plan = nullptr;
  CRun run;
  run.status = tessera_plan_cascade(lengths.data(), static_cast<int>(lengths.size()), c.page_size,
                                    c.num_qo_heads, c.num_kv_heads, c.head_dim, &options, kDLCPU,
                                    0, &plan);
  if (run.status != TESSERA_OK) {
    run.error = tessera_last_error();
    return run;
  }
  const int64_t total_q = c.total_q();
  run.o.assign(static_cast<size_t>(std::max<int64_t>(total_q * c.num_qo_heads * c.head_dim, 1)) *
                   tessera::dtype_size(c.dtype),
               0x5a);
  run.lse.assign(static_cast<size_t>(total_q * c.num_qo_heads), -7.0f);
  const std::vector<int64_t> pool = data.pool_shape();
  const Dl q(data.q.data(), dl_dtype(c.dtype), {total_q, c.num_qo_heads, c.head_dim});
  const Dl o(run.o.data(), dl_dtype(c.dtype), {total_q, c.num_qo_heads, c.head_dim});
  const Dl lse(run.lse.data(), {kDLFloat, 32, 1}, {total_q, c.num_qo_heads});
  const Dl k(data.k_pool.data(), dl_dtype(c.dtype), pool), v(data.v_pool.data(), dl_dtype(c.dtype), pool);
  const Dl sinks(data.sinks.data(), {kDLFloat, 32, 1}, {c.num_qo_heads});
  std::vector<Dl> indices;
  for (size_t l = 0; l < data.qo_indptr.size(); ++l) {
    indices.emplace_back(data.qo_indptr[l]);
    indices.emplace_back(data.page_indptr[l]);
    indices.emplace_back(data.page_indices[l]);
    indices.emplace_back(data.last_page_len[l]);
  }
  std::vector<tessera_cascade_level> levels;
  for (size_t l = 0; l < data.qo_indptr.size(); ++l) {
    levels.push_back({&indices[4 * l].tensor, &indices[4 * l + 1].tensor,
                      &indices[4 * l + 2].tensor, &indices[4 * l + 3].tensor});
  }
  tessera_run_options run_options;
  tessera_run_options_default(&run_options);
  if (c.with_sinks) run_options.sinks = &sinks.tensor;
  std::vector<uint8_t> workspace(tessera_cascade_plan_workspace_bytes(plan) + 1);
  const int num_levels = num_levels_at_run >= 0 ? num_levels_at_run : static_cast<int>(levels.size());
  run.status = tessera_run_cascade(plan, &q.tensor, &k.tensor, &v.tensor,
                                   c.layout == tessera::KVLayout::kNHD ? TESSERA_KV_LAYOUT_NHD
                                                                       : TESSERA_KV_LAYOUT_HND,
                                   levels.data(), num_levels, &o.tensor,
                                   c.with_lse ? &lse.tensor : nullptr, workspace.data(),
                                   workspace.size(), nullptr, &run_options);
  if (run.status != TESSERA_OK) run.error = tessera_last_error();
  tessera_cascade_plan_destroy(plan);
  if (!c.with_lse) run.lse.clear();
  return run;
}

TEST(CApiCascade, RandomCasesMatchTheReference) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 16; ++trial) {
    tessera::test::RandomCascadeOptions options;
    options.dtypes = {tessera::DType::kFloat16, tessera::DType::kFloat32};
    options.decode_only = trial % 4 == 0;
    const CascadeData data = make_cascade_data(random_cascade_case(rng, options), rng);
    const CRun run = run_c(data);
    ASSERT_EQ(run.status, TESSERA_OK) << run.error << " " << data.test_case.describe();
    const double tolerance = data.test_case.dtype == tessera::DType::kFloat32 ? 2e-4 : 1e-2;
    EXPECT_EQ(tessera::test::compare_cascade(data, tessera::test::reference_cascade(data), run.o,
                                             run.lse, tolerance),
              "")
        << data.test_case.describe();
  }
}

TEST(CApiCascade, QueriesAndBadCallsFailByNameAndWriteNothing) {
  CascadeCase c;
  c.q_lens = {2, 1};
  c.groups = {{0, 2}, {0, 1, 2}};
  c.kv_lens = {{40}, {7, 3}};
  std::mt19937_64 rng(3);
  const CascadeData data = make_cascade_data(c, rng);
  EXPECT_EQ(tessera_cascade_plan_workspace_bytes(nullptr), 0u);
  EXPECT_EQ(tessera_cascade_plan_num_levels(nullptr), 0);
  tessera_cascade_plan* plan = reinterpret_cast<tessera_cascade_plan*>(&rng);  // must be reset
  EXPECT_EQ(tessera_plan_cascade(nullptr, 2, 16, 8, 2, 64, nullptr, kDLCPU, 0, &plan),
            TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(plan, nullptr);
  EXPECT_NE(std::string(tessera_last_error()).find("'levels'"), std::string::npos);
  tessera_cascade_level_lengths level{data.qo_indptr[0].data(), data.page_indptr[0].data(),
                                      data.last_page_len[0].data(), 1};
  EXPECT_EQ(tessera_plan_cascade(&level, 0, 16, 8, 2, 64, nullptr, kDLCPU, 0, &plan),
            TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tessera_last_error()).find("'num_levels'"), std::string::npos);
  level.page_indptr = nullptr;
  EXPECT_EQ(tessera_plan_cascade(&level, 1, 16, 8, 2, 64, nullptr, kDLCPU, 0, &plan),
            TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tessera_last_error()).find("levels[0].page_indptr"), std::string::npos);
  level.page_indptr = data.page_indptr[0].data();
  ASSERT_EQ(tessera_plan_cascade(&level, 1, 16, 8, 2, 64, nullptr, kDLCPU, 0, &plan), TESSERA_OK);
  EXPECT_EQ(tessera_cascade_plan_num_levels(plan), 1);
  size_t needed = 0;
  EXPECT_EQ(tessera_cascade_plan_explain(plan, nullptr, 0, &needed), TESSERA_OK);
  std::vector<char> text(needed);
  EXPECT_EQ(tessera_cascade_plan_explain(plan, text.data(), text.size(), nullptr), TESSERA_OK);
  EXPECT_NE(std::string(text.data()).find("cascade: 1 levels"), std::string::npos);
  tessera_cascade_plan_destroy(plan);
  tessera_cascade_plan_destroy(nullptr);

  const CRun wrong = run_c(data, 1);  // planned with 2 levels
  EXPECT_EQ(wrong.status, TESSERA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(wrong.error.find("expected 2 levels"), std::string::npos) << wrong.error;
  for (uint8_t byte : wrong.o) ASSERT_EQ(byte, 0x5a);
  for (float value : wrong.lse) ASSERT_EQ(value, -7.0f);
  const CRun none = run_c(data, 0);
  EXPECT_NE(none.error.find("'num_levels'"), std::string::npos) << none.error;
}

}  // namespace
