// Multi-level cascade attention on the CPU (include/tessera/cascade.hpp, issue 34 item 7):
// random cases against the per-row double reference of tests/common/cascade_testing.hpp (1-3
// levels, nested groups, GQA, page sizes 1..128, NHD / HND, causal, soft-cap, sinks, rows without
// keys, unused cache slots NaN), on the fast path and on the reference backend; the equivalence
// with one paged prefill over the concatenated pages; the decode / prefill choice per level;
// bad input (named; outputs and workspace untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/cascade_testing.hpp"
#include "core/half.hpp"
#include "tessera/backend.hpp"
#include "tessera/cascade.hpp"

namespace tessera {
namespace {

using test::CascadeCase;
using test::CascadeData;

struct HostRun {
  std::vector<uint8_t> o;
  std::vector<float> lse;
};

std::vector<CascadeLevel> level_views(const CascadeData& data) {
  std::vector<CascadeLevel> levels;
  for (size_t l = 0; l < data.qo_indptr.size(); ++l) {
    auto view = [](const std::vector<int32_t>& v) {
      return make_view(const_cast<int32_t*>(v.data()), DType::kInt32,
                       {static_cast<int64_t>(v.size())});
    };
    levels.push_back({view(data.qo_indptr[l]), view(data.page_indptr[l]), view(data.page_indices[l]),
                      view(data.last_page_len[l])});
  }
  return levels;
}

TensorView pool_view(const CascadeData& data, const std::vector<uint8_t>& pool) {
  const std::vector<int64_t> s = data.pool_shape();
  return make_view(const_cast<uint8_t*>(pool.data()), data.test_case.dtype, {s[0], s[1], s[2], s[3]});
}

// Plans and runs the case on the CPU into NaN-poisoned outputs.
HostRun run_case(const CascadeData& data, CascadePlan* plan_out = nullptr) {
  const CascadeCase& c = data.test_case;
  const std::vector<CascadeLevelLengths> lengths = data.lengths();
  AttentionOptions options;
  options.causal = c.causal;
  options.logits_soft_cap = c.soft_cap;
  CascadePlan plan = plan_cascade(lengths, c.page_size, c.num_qo_heads, c.num_kv_heads,
                                  c.head_dim, options);
  const int64_t total_q = c.total_q();
  HostRun run;
  run.o.assign(static_cast<size_t>(std::max<int64_t>(total_q * c.num_qo_heads * c.head_dim, 1)) *
                   dtype_size(c.dtype),
               0xff);
  if (c.with_lse) run.lse.assign(static_cast<size_t>(total_q * c.num_qo_heads), std::nanf(""));
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  RunOptions run_options;
  if (c.with_sinks) {
    run_options.sinks = make_view(const_cast<float*>(data.sinks.data()), DType::kFloat32,
                                  {c.num_qo_heads});
  }
  const TensorView q = make_view(const_cast<uint8_t*>(data.q.data()), c.dtype,
                                 {total_q, c.num_qo_heads, c.head_dim});
  const TensorView o = make_view(run.o.data(), c.dtype, {total_q, c.num_qo_heads, c.head_dim});
  const TensorView lse = c.with_lse ? make_view(run.lse.data(), DType::kFloat32,
                                                {total_q, c.num_qo_heads})
                                    : TensorView{};
  const std::vector<CascadeLevel> levels = level_views(data);
  run_cascade(plan, q, pool_view(data, data.k_pool), pool_view(data, data.v_pool), c.layout, levels,
              o, lse, {workspace.data(), workspace.size()}, nullptr, run_options);
  if (plan_out) *plan_out = plan;
  return run;
}

double tolerance_of(DType dtype) { return dtype == DType::kFloat32 ? 2e-4 : 1e-2; }

class CpuReferenceMode {
 public:
  explicit CpuReferenceMode(bool on) { set_cpu_impl(on ? CpuImpl::kReference : CpuImpl::kFast); }
  ~CpuReferenceMode() { set_cpu_impl(CpuImpl::kFast); }
};

TEST(Cascade, RandomCasesMatchTheReference) {
  std::mt19937_64 rng(0xca5cade);
  for (int trial = 0; trial < 60; ++trial) {
    test::RandomCascadeOptions options;
    options.decode_only = trial % 3 == 0;
    const CascadeData data = make_cascade_data(random_cascade_case(rng, options), rng);
    const test::CascadeExpected expected = test::reference_cascade(data);
    for (bool reference : {false, true}) {
      const CpuReferenceMode mode(reference);
      const HostRun run = run_case(data);
      const std::string diff = test::compare_cascade(data, expected, run.o, run.lse,
                                                     tolerance_of(data.test_case.dtype));
      EXPECT_EQ(diff, "") << data.test_case.describe() << (reference ? " (reference)" : " (fast)");
    }
  }
}

// The planner picks decode for a level whose requests each hold one query row, paged prefill
// otherwise; upper levels are planned without the causal mask.
TEST(Cascade, PlansDecodeForOneRowLevelsAndDropsCausalAbove) {
  CascadeCase c;
  c.causal = true;
  c.q_lens = {1, 1, 1};
  c.groups = {{0, 3}, {0, 1, 2, 3}};
  c.kv_lens = {{100}, {5, 9, 1}};
  std::mt19937_64 rng(1);
  CascadeData data = make_cascade_data(c, rng);
  CascadePlan plan;
  run_case(data, &plan);
  ASSERT_EQ(plan.num_levels(), 2);
  EXPECT_EQ(plan.levels[0].op, AttentionOp::kPagedPrefill);  // one group of 3 rows
  EXPECT_FALSE(plan.levels[0].options.causal);
  EXPECT_EQ(plan.levels[1].op, AttentionOp::kDecode);
  EXPECT_TRUE(plan.levels[1].options.causal);
  EXPECT_NE(plan.explain().find("level 0 (shared prefix)"), std::string::npos);
  c.q_lens = {2, 1, 1};
  data = make_cascade_data(c, rng);
  run_case(data, &plan);
  EXPECT_EQ(plan.levels[1].op, AttentionOp::kPagedPrefill);
}

// With full pages above and nested groups, the cascade is one paged prefill over each request's
// concatenated page list (causal: every request holds at least q_len - 1 own keys).
TEST(Cascade, EqualsPagedPrefillOverConcatenatedPages) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 12; ++trial) {
    CascadeCase c;
    c.page_size = trial % 2 ? 16 : 4;
    c.causal = trial % 3 != 0;
    c.num_qo_heads = 8;
    c.num_kv_heads = 2;
    c.q_lens = {3, 1, 4, 2};
    c.groups = {{0, 4}, {0, 2, 4}, {0, 1, 2, 3, 4}};
    c.kv_lens = {{3 * c.page_size}, {c.page_size, 2 * c.page_size}, {5, 3, 9, 2}};
    const CascadeData data = make_cascade_data(c, rng);
    const HostRun run = run_case(data);
    std::vector<int32_t> qo = {0}, indptr = {0}, indices, last;
    for (int32_t b = 0; b < c.batch_size(); ++b) {
      qo.push_back(qo.back() + c.q_lens[static_cast<size_t>(b)]);
      for (int l = 0; l < 3; ++l) {
        const size_t g = l == 0 ? 0 : l == 1 ? static_cast<size_t>(b / 2) : static_cast<size_t>(b);
        for (int32_t p = data.page_indptr[static_cast<size_t>(l)][g]; p < data.page_indptr[static_cast<size_t>(l)][g + 1]; ++p) {
          indices.push_back(data.page_indices[static_cast<size_t>(l)][static_cast<size_t>(p)]);
        }
      }
      indptr.push_back(static_cast<int32_t>(indices.size()));
      last.push_back(data.last_page_len[2][static_cast<size_t>(b)]);
    }
    auto idx = [](std::vector<int32_t>& v) {
      return make_view(v.data(), DType::kInt32, {static_cast<int64_t>(v.size())});
    };
    const int64_t total_q = c.total_q();
    std::vector<uint8_t> o(run.o.size(), 0xff);
    std::vector<float> lse(run.lse.size(), std::nanf(""));
    AttentionOptions options;
    options.causal = c.causal;
    const PagedKVCache kv{pool_view(data, data.k_pool), pool_view(data, data.v_pool), c.layout,
                          idx(indptr), idx(indices), idx(last)};
    paged_prefill(make_view(const_cast<uint8_t*>(data.q.data()), c.dtype, {total_q, 8, 64}), kv,
                  idx(qo), make_view(o.data(), c.dtype, {total_q, 8, 64}),
                  make_view(lse.data(), DType::kFloat32, {total_q, 8}), options);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < total_q * 8 * 64; ++i) {
      const double a = detail::load_as_float(run.o.data(), c.dtype, i);
      const double b = detail::load_as_float(o.data(), c.dtype, i);
      err += (a - b) * (a - b);
      ref += b * b;
    }
    EXPECT_LT(std::sqrt(err / ref), 1e-2) << c.describe();
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(run.lse[i], lse[i], 1e-3) << i;
  }
}

// ---- bad input: named, and o / lse untouched ----

class CascadeErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    c_.q_lens = {2, 1};
    c_.groups = {{0, 2}, {0, 1, 2}};
    c_.kv_lens = {{40}, {7, 3}};
    std::mt19937_64 rng(3);
    data_ = make_cascade_data(c_, rng);
    plan_ = plan_cascade(data_.lengths(), c_.page_size, c_.num_qo_heads, c_.num_kv_heads,
                         c_.head_dim, {});
    o_.assign(static_cast<size_t>(3 * c_.num_qo_heads * c_.head_dim) * 2, 0x5a);
    lse_.assign(static_cast<size_t>(3 * c_.num_qo_heads), 7.0f);
    workspace_.assign(plan_.workspace_bytes, 0);
  }
  // Runs with the given pieces (defaults: the valid ones) and returns the error text.
  std::string run(const std::vector<CascadeLevel>* levels = nullptr, size_t workspace_bytes = 0,
                  DType o_dtype = DType::kFloat16) {
    const std::vector<CascadeLevel> good = level_views(data_);
    const TensorView q = make_view(data_.q.data(), c_.dtype, {3, c_.num_qo_heads, c_.head_dim});
    const TensorView o = make_view(o_.data(), o_dtype, {3, c_.num_qo_heads, c_.head_dim});
    const TensorView lse = make_view(lse_.data(), DType::kFloat32, {3, c_.num_qo_heads});
    try {
      run_cascade(plan_, q, pool_view(data_, data_.k_pool), pool_view(data_, data_.v_pool),
                  c_.layout, levels ? *levels : good, o, lse,
                  {workspace_.data(), workspace_bytes ? workspace_bytes : workspace_.size()});
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  }
  void expect_untouched() {  // outputs and workspace (every level is checked before any runs)
    for (uint8_t byte : o_) ASSERT_EQ(byte, 0x5a);
    for (float value : lse_) ASSERT_EQ(value, 7.0f);
    for (uint8_t byte : workspace_) ASSERT_EQ(byte, 0);
  }
  CascadeCase c_;
  CascadeData data_;
  CascadePlan plan_;
  std::vector<uint8_t> o_;
  std::vector<float> lse_;
  std::vector<uint8_t> workspace_;
};

TEST_F(CascadeErrors, PlanRejectsWindowsLevelCountsAndMismatchedRows) {
  AttentionOptions window;
  window.window_left = 8;
  const auto lengths = data_.lengths();
  auto message = [&](auto&& call) {
    try {
      call();
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  EXPECT_NE(message([&] { plan_cascade(lengths, 16, 8, 2, 64, window); }).find("sliding window"),
            std::string::npos);
  EXPECT_NE(message([&] {
              plan_cascade(std::span<const CascadeLevelLengths>{}, 16, 8, 2, 64, {});
            }).find("expected 1..16 levels"),
            std::string::npos);
  std::vector<CascadeLevelLengths> bad = lengths;
  const std::vector<int32_t> short_qo = {0, 2};
  const std::vector<int32_t> one_page = {0, 3};
  const std::vector<int32_t> last = {8};
  bad[1] = {short_qo, one_page, last};
  EXPECT_NE(message([&] { plan_cascade(bad, 16, 8, 2, 64, {}); }).find("levels[1].qo_indptr"),
            std::string::npos);
  const std::vector<int32_t> bad_last = {17};
  const std::vector<int32_t> full_qo = {0, 3};
  bad[0] = {full_qo, one_page, bad_last};
  EXPECT_NE(message([&] { plan_cascade(bad, 16, 8, 2, 64, {}); }).find("cascade level 0"),
            std::string::npos);
}

TEST_F(CascadeErrors, RunRejectsBadLevelsWorkspaceAndOutputsAndWritesNothing) {
  const std::vector<CascadeLevel> all = level_views(data_);
  const std::vector<CascadeLevel> one(all.begin(), all.begin() + 1);
  EXPECT_NE(run(&one).find("expected 2 levels"), std::string::npos);
  expect_untouched();
  EXPECT_NE(run(nullptr, plan_.workspace_bytes - 1).find("workspace"), std::string::npos);
  expect_untouched();
  EXPECT_NE(run(nullptr, 0, DType::kBFloat16).find("'o'"), std::string::npos);
  expect_untouched();
  // A page table of level 0 that no longer matches its plan: found before any merge writes o.
  std::vector<CascadeLevel> levels = level_views(data_);
  std::vector<int32_t> wrong_last = {3};
  levels[0].last_page_len = make_view(wrong_last.data(), DType::kInt32, {1});
  const std::string error = run(&levels);
  EXPECT_NE(error.find("cascade level 0"), std::string::npos) << error;
  expect_untouched();
  EXPECT_EQ(run(), "");  // and the valid call still works
}

}  // namespace
}  // namespace tessera
