// Tests of the CPU attention backend. The double-precision reference is first checked against
// hand-computed tiny cases; the fast path is then compared with it over hundreds of random
// cases (ragged and paged, every GQA ratio, head_dim, mask, dtype and stride variant), with and
// without split-KV, on every ISA the host supports and with varying thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/attention_testing.hpp"
#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "tessera/backend.hpp"

namespace tessera {
namespace {

using detail::CpuIsa;
using test::AttentionBuffers;
using test::AttentionCase;
using test::Comparison;
using test::Outputs;
using test::TestPlanOptions;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Seed of the random suites; TESSERA_TEST_SEED reproduces another run.
uint64_t base_seed() {
  const char* env = std::getenv("TESSERA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : 20240611ull;
}

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (detail::cpu_supports(isa)) isas.push_back(isa);
  }
  return isas;
}

// Restores the default thread count when a test ends, whatever happened.
class ThreadCountGuard {
 public:
  explicit ThreadCountGuard(int threads) { set_num_threads(threads); }
  ~ThreadCountGuard() { set_num_threads(0); }
};

Outputs run_reference(AttentionBuffers& buffers) {
  test::poison_outputs(buffers);
  detail::cpu_reference_attention(test::make_problem(buffers));
  return test::copy_outputs(buffers);
}

struct FastRun {
  TestPlanOptions plan;
  CpuIsa isa = CpuIsa::kGeneric;
  int threads = 1;
  std::string describe() const {
    return std::string("isa=") + detail::cpu_isa_name(isa) + " threads=" + std::to_string(threads) +
           " q_tile_rows=" + std::to_string(plan.q_tile_rows) +
           " kv_chunk=" + std::to_string(plan.kv_chunk) +
           " workers=" + std::to_string(plan.num_workers);
  }
};

Outputs run_fast(AttentionBuffers& buffers, const FastRun& run) {
  test::poison_outputs(buffers);
  const Plan plan = test::make_test_plan(buffers.test_case, run.plan);
  // NaN-filled workspace: a merge reading a partial nobody wrote shows up as NaN.
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  ThreadCountGuard threads(run.threads);
  detail::cpu_fast_attention_with_isa(plan, test::make_problem(buffers),
                                      Workspace{workspace.data(), workspace.size()}, run.isa);
  return test::copy_outputs(buffers);
}

// Runs the fast path as configured and checks it against the reference.
void expect_matches_reference(AttentionBuffers& buffers, const Outputs& expected,
                              const FastRun& run) {
  const Outputs actual = run_fast(buffers, run);
  const Comparison result = test::compare_outputs(buffers, actual, expected);
  const AttentionCase& c = buffers.test_case;
  EXPECT_TRUE(result.ok(test::default_tolerance(c), test::default_lse_tolerance(c)))
      << result.describe() << "\n  case: " << c.describe() << "\n  run: " << run.describe();
}

void check_case(const AttentionCase& c, std::mt19937_64& rng, const std::vector<FastRun>& runs) {
  AttentionBuffers buffers = test::make_buffers(c, rng);
  const Outputs expected = run_reference(buffers);
  for (const FastRun& run : runs) expect_matches_reference(buffers, expected, run);
}

FastRun default_run(CpuIsa isa = detail::selected_cpu_isa()) {
  FastRun run;
  run.isa = isa;
  run.threads = 2;
  return run;
}

// Every supported ISA, unsplit and split along keys.
std::vector<FastRun> all_isas_split_and_not(int32_t kv_chunk) {
  std::vector<FastRun> runs;
  for (CpuIsa isa : supported_isas()) {
    FastRun run = default_run(isa);
    runs.push_back(run);
    run.plan.kv_chunk = kv_chunk;
    runs.push_back(run);
  }
  return runs;
}

// ---- the reference against hand-computed cases ----

// A small fp32 case whose q/k/v the test sets element by element.
struct TinyCase {
  AttentionBuffers buffers;
  detail::AttentionProblem problem;

  explicit TinyCase(AttentionCase c) {
    std::mt19937_64 rng(1);
    buffers = test::make_buffers(c, rng);
    problem = test::make_problem(buffers);
  }
  void set_q(int64_t token, int32_t head, std::vector<float> values) {
    for (size_t d = 0; d < values.size(); ++d) {
      detail::store_from_float(buffers.q.data(), buffers.test_case.q_dtype,
                               token * buffers.q_stride_token + head * buffers.q_stride_head + d,
                               values[d]);
    }
  }
  void set_kv(int32_t request, int32_t head, int32_t key, std::vector<float> k,
              std::vector<float> v) {
    for (size_t d = 0; d < k.size(); ++d) {
      detail::store_from_float(buffers.k.data(), buffers.test_case.kv_dtype,
                               problem.kv.k_offset(request, head, key) + d, k[d]);
      detail::store_from_float(buffers.v.data(), buffers.test_case.kv_dtype,
                               problem.kv.v_offset(request, head, key) + d, v[d]);
    }
  }
  void run() {
    test::poison_outputs(buffers);
    detail::cpu_reference_attention(problem);
  }
  float o(int64_t token, int32_t head, int32_t d) const {
    return detail::load_as_float(buffers.o.data(), buffers.test_case.q_dtype,
                                 token * buffers.o_stride_token + head * buffers.o_stride_head + d);
  }
  float lse(int64_t token, int32_t head) const {
    float value;
    std::memcpy(&value, buffers.lse.data() + (token * buffers.lse_stride_token + head) * 4, 4);
    return value;
  }
};

AttentionCase tiny_case(int32_t q_len, int32_t kv_len, int32_t heads = 1, int32_t kv_heads = 1) {
  AttentionCase c;
  c.q_lens = {q_len};
  c.kv_lens = {kv_len};
  c.num_qo_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 8;
  c.q_dtype = c.kv_dtype = DType::kFloat32;
  c.sm_scale = 0.5f;
  return c;
}

const std::vector<float> kQuery = {1, 0.5f, -1, 2, 0, 0, 0.25f, 1};

TEST(ReferenceAttention, OneKeyGivesItsValue) {
  TinyCase t(tiny_case(1, 1));
  t.set_q(0, 0, kQuery);
  t.set_kv(0, 0, 0, {1, 1, 1, 1, 1, 1, 1, 1}, {3, -2, 0.5f, 7, 1, 2, 3, 4});
  t.run();
  const float expected[] = {3, -2, 0.5f, 7, 1, 2, 3, 4};
  for (int d = 0; d < 8; ++d) EXPECT_FLOAT_EQ(t.o(0, 0, d), expected[d]);
  // q . k = 3.75, times sm_scale 0.5; a single key: lse is its logit.
  EXPECT_FLOAT_EQ(t.lse(0, 0), 1.875f);
}

TEST(ReferenceAttention, EqualLogitsGiveTheMean) {
  TinyCase t(tiny_case(1, 2));
  t.set_q(0, 0, kQuery);
  const std::vector<float> key = {0.5f, 0, 1, 1, 0, 0, 2, 0};
  t.set_kv(0, 0, 0, key, {1, 2, 3, 4, 5, 6, 7, 8});
  t.set_kv(0, 0, 1, key, {3, 2, 1, 0, -1, -2, -3, -4});
  t.run();
  for (int d = 0; d < 8; ++d) EXPECT_FLOAT_EQ(t.o(0, 0, d), 2.0f);
  const double logit = (0.5 - 1 + 2 + 0.5) * 0.5;
  EXPECT_NEAR(t.lse(0, 0), logit + std::log(2.0), 1e-6);
}

TEST(ReferenceAttention, LogitsWeighValuesBySoftmax) {
  // Logits 0 and log(3) (sm_scale 1): weights 1/4 and 3/4.
  AttentionCase c = tiny_case(1, 2);
  c.sm_scale = 1.0f;
  TinyCase t(c);
  const float log3 = std::log(3.0f);
  t.set_q(0, 0, {1, 0, 0, 0, 0, 0, 0, 0});
  t.set_kv(0, 0, 0, {0, 1, 1, 1, 1, 1, 1, 1}, {4, 0, 0, 0, 0, 0, 0, 8});
  t.set_kv(0, 0, 1, {log3, 1, 1, 1, 1, 1, 1, 1}, {0, 4, 0, 0, 0, 0, 0, 0});
  t.run();
  EXPECT_NEAR(t.o(0, 0, 0), 1.0f, 1e-6);
  EXPECT_NEAR(t.o(0, 0, 1), 3.0f, 1e-6);
  EXPECT_NEAR(t.o(0, 0, 7), 2.0f, 1e-6);
  EXPECT_NEAR(t.lse(0, 0), std::log(4.0), 1e-6);  // log(e^0 + e^log3)
}

TEST(ReferenceAttention, SoftCapSquashesLogits) {
  // Logits 0 and 100 capped at 2: 2 * tanh(50) ~= 2, so weights 1 / (1 + e^2), e^2 / (1 + e^2).
  AttentionCase c = tiny_case(1, 2);
  c.sm_scale = 1.0f;
  c.soft_cap = 2.0f;
  TinyCase t(c);
  t.set_q(0, 0, {1, 0, 0, 0, 0, 0, 0, 0});
  t.set_kv(0, 0, 0, {0, 1, 1, 1, 1, 1, 1, 1}, {1, 0, 0, 0, 0, 0, 0, 0});
  t.set_kv(0, 0, 1, {100, 1, 1, 1, 1, 1, 1, 1}, {0, 1, 0, 0, 0, 0, 0, 0});
  t.run();
  const double capped = 2.0 * std::tanh(50.0);
  const double w1 = std::exp(capped) / (1.0 + std::exp(capped));
  EXPECT_NEAR(t.o(0, 0, 0), 1.0 - w1, 1e-6);
  EXPECT_NEAR(t.o(0, 0, 1), w1, 1e-6);
  EXPECT_NEAR(t.lse(0, 0), std::log(1.0 + std::exp(capped)), 1e-6);
}

TEST(ReferenceAttention, CausalIsBottomRightAlignedAndEmptyRowsAreZero) {
  // q_len 3, kv_len 2: row i sees keys j <= i - 1, so row 0 sees nothing.
  AttentionCase c = tiny_case(3, 2);
  c.causal = true;
  TinyCase t(c);
  for (int token = 0; token < 3; ++token) t.set_q(token, 0, kQuery);
  t.set_kv(0, 0, 0, {1, 0, 0, 0, 0, 0, 0, 0}, {5, 5, 5, 5, 5, 5, 5, 5});
  t.set_kv(0, 0, 1, {1, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1});
  t.run();
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(t.o(0, 0, d), 0.0f);
    EXPECT_FLOAT_EQ(t.o(1, 0, d), 5.0f);  // key 0 only
    EXPECT_FLOAT_EQ(t.o(2, 0, d), 3.0f);  // keys 0 and 1, equal logits
  }
  EXPECT_EQ(t.lse(0, 0), kMinusInf);
  EXPECT_FLOAT_EQ(t.lse(1, 0), 0.5f);  // q . k = 1, times 0.5
}

TEST(ReferenceAttention, SlidingWindowKeepsOnlyNearbyKeys) {
  // Non-causal, window (0, 0): every row sees exactly its diagonal key.
  AttentionCase c = tiny_case(3, 3);
  c.window_left = 0;
  c.window_right = 0;
  TinyCase t(c);
  for (int token = 0; token < 3; ++token) t.set_q(token, 0, kQuery);
  for (int key = 0; key < 3; ++key) {
    const float value = 10.0f * (key + 1);
    t.set_kv(0, 0, key, {1, 1, 1, 1, 1, 1, 1, 1},
             {value, value, value, value, value, value, value, value});
  }
  t.run();
  for (int token = 0; token < 3; ++token) EXPECT_FLOAT_EQ(t.o(token, 0, 3), 10.0f * (token + 1));
}

TEST(ReferenceAttention, QueryHeadReadsKvHeadOfItsGroup) {
  // 6 query heads over 2 kv heads: heads 0-2 read kv head 0, heads 3-5 kv head 1.
  TinyCase t(tiny_case(1, 1, 6, 2));
  for (int h = 0; h < 6; ++h) t.set_q(0, h, kQuery);
  t.set_kv(0, 0, 0, {1, 1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1, 1});
  t.set_kv(0, 1, 0, {1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2});
  t.run();
  for (int h = 0; h < 6; ++h) EXPECT_FLOAT_EQ(t.o(0, h, 0), h < 3 ? 1.0f : 2.0f);
}

TEST(ReferenceAttention, Fp8ScalesDequantise) {
  AttentionCase c = tiny_case(1, 1);
  c.kv_dtype = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 4.0f;
  TinyCase t(c);
  t.set_q(0, 0, {1, 0, 0, 0, 0, 0, 0, 0});
  t.set_kv(0, 0, 0, {2, 1, 1, 1, 1, 1, 1, 1}, {1.5f, -0.25f, 1, 1, 1, 1, 1, 1});
  t.run();
  EXPECT_FLOAT_EQ(t.o(0, 0, 0), 6.0f);
  EXPECT_FLOAT_EQ(t.o(0, 0, 1), -1.0f);
  EXPECT_FLOAT_EQ(t.lse(0, 0), 0.5f);  // q . k = 2, times k_scale 0.5, times sm_scale 0.5
}

// ---- the fast path against the reference ----

TEST(FastAttention, MatchesReferenceOnRandomCases) {
  constexpr int kCases = 400;
  std::mt19937_64 rng(base_seed());
  const std::vector<CpuIsa> isas = supported_isas();
  for (int i = 0; i < kCases; ++i) {
    const AttentionCase c = test::random_case(rng);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs expected = run_reference(buffers);
    FastRun run;
    run.isa = isas[i % isas.size()];
    run.threads = 1 + i % 3;
    const int32_t tile_rows[] = {8, 16, 64, 64, 128, 200};
    run.plan.q_tile_rows = tile_rows[std::uniform_int_distribution<int>(0, 5)(rng)];
    run.plan.num_workers = std::uniform_int_distribution<int>(1, 5)(rng);
    if (i % 2 == 1) run.plan.kv_chunk = std::uniform_int_distribution<int>(1, 160)(rng);
    SCOPED_TRACE("random case " + std::to_string(i));
    expect_matches_reference(buffers, expected, run);
  }
}

TEST(FastAttention, MatchesReferenceOnLongerRandomCases) {
  // Fewer, longer cases: many key tiles per item, long online-softmax chains, big q tiles.
  constexpr int kCases = 30;
  std::mt19937_64 rng(base_seed() + 100);
  test::RandomCaseOptions options;
  options.max_batch = 2;
  options.max_q_len = 300;
  options.max_kv_len = 1200;
  options.max_kv_heads = 2;
  options.max_reference_macs = 40'000'000;
  const std::vector<CpuIsa> isas = supported_isas();
  for (int i = 0; i < kCases; ++i) {
    const AttentionCase c = test::random_case(rng, options);
    FastRun run = default_run(isas[i % isas.size()]);
    run.plan.q_tile_rows = i % 3 == 0 ? 256 : 64;
    run.plan.kv_chunk = i % 2 ? 300 : 0;
    SCOPED_TRACE("long random case " + std::to_string(i));
    check_case(c, rng, {run});
  }
}

TEST(FastAttention, EveryPackedRowCount) {
  // Row counts around the vector widths and the dot-product / register-blocked switch.
  std::mt19937_64 rng(base_seed() + 9);
  for (int32_t group : {1, 3}) {
    for (int32_t tokens = 1; tokens <= 34; ++tokens) {
      AttentionCase c;
      c.q_lens = {tokens};
      c.kv_lens = {tokens + 90};
      c.num_kv_heads = 1;
      c.num_qo_heads = group;
      c.head_dim = 72;
      c.causal = tokens % 2 == 0;
      std::vector<FastRun> runs;
      for (CpuIsa isa : supported_isas()) {
        FastRun run = default_run(isa);
        run.plan.q_tile_rows = tokens * group;  // one work item holding every row
        runs.push_back(run);
      }
      check_case(c, rng, runs);
    }
  }
}

TEST(FastAttention, EveryGroupRatio) {
  std::mt19937_64 rng(base_seed() + 1);
  for (int32_t group : {1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 14}) {
    AttentionCase c;
    c.q_lens = {37, 1};
    c.kv_lens = {150, 77};
    c.num_kv_heads = group > 8 ? 1 : 2;
    c.num_qo_heads = c.num_kv_heads * group;
    c.head_dim = 64;
    c.causal = group % 2 == 1;
    check_case(c, rng, all_isas_split_and_not(64));
  }
}

TEST(FastAttention, EveryHeadDim) {
  std::mt19937_64 rng(base_seed() + 2);
  for (int32_t head_dim = 8; head_dim <= 256; head_dim += 8) {
    AttentionCase c;
    c.q_lens = {19, 3};
    c.kv_lens = {70, 131};
    c.num_qo_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = head_dim;
    c.q_dtype = c.kv_dtype = head_dim % 16 == 0 ? DType::kBFloat16 : DType::kFloat16;
    c.q_head_pad = 3;
    c.kv_token_pad = 5;
    c.causal = head_dim % 24 == 0;
    check_case(c, rng, all_isas_split_and_not(50));
  }
}

TEST(FastAttention, PagedCacheLayoutsAndPageSizes) {
  std::mt19937_64 rng(base_seed() + 3);
  for (int32_t page_size : {1, 16, 64, 5, 37, 128}) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      AttentionCase c;
      c.q_lens = {5, 0, 33};
      c.kv_lens = {200, 17, 64};
      c.num_qo_heads = 6;
      c.num_kv_heads = 3;
      c.head_dim = 96;
      c.paged = true;
      c.page_size = page_size;
      c.layout = layout;
      c.spare_pages = 2;
      c.kv_head_pad = 8;
      c.causal = true;
      check_case(c, rng, all_isas_split_and_not(96));
    }
  }
}

TEST(FastAttention, DecodeAgainstLongPagedContextWithSplitKv) {
  std::mt19937_64 rng(base_seed() + 4);
  for (int32_t q_per_request : {1, 2, 3, 4}) {
    AttentionCase c;
    c.q_lens = {q_per_request, q_per_request, q_per_request};
    c.kv_lens = {1500, 3, 0};
    c.uniform_q = true;
    c.num_qo_heads = 8;
    c.num_kv_heads = 1;
    c.head_dim = 128;
    c.paged = true;
    c.page_size = 16;
    c.causal = true;
    check_case(c, rng, all_isas_split_and_not(256));
  }
}

TEST(FastAttention, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  std::mt19937_64 rng(base_seed() + 5);
  // Causal with q_len > kv_len: the first q_len - kv_len rows see nothing. The window variant
  // additionally empties rows whose window falls before key 0.
  for (int variant = 0; variant < 3; ++variant) {
    AttentionCase c;
    c.q_lens = {90, 7};
    c.kv_lens = {40, 0};
    c.num_qo_heads = 4;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.causal = variant != 2;
    if (variant >= 1) {
      c.window_left = 3;
      c.window_right = variant == 2 ? 1 : -1;
    }
    c.soft_cap = variant == 1 ? 20.0f : 0.0f;
    check_case(c, rng, all_isas_split_and_not(16));
  }
}

TEST(FastAttention, EveryDtypeCombination) {
  std::mt19937_64 rng(base_seed() + 6);
  for (DType q_dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType kv_dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                           DType::kFloat8E5M2}) {
      AttentionCase c;
      c.q_lens = {65, 2};
      c.kv_lens = {129, 300};
      c.num_qo_heads = 4;
      c.num_kv_heads = 1;
      c.head_dim = 80;
      c.q_dtype = q_dtype;
      c.kv_dtype = kv_dtype;
      c.k_scale = 0.75f;
      c.v_scale = 1.5f;
      c.soft_cap = kv_dtype == DType::kFloat16 ? 30.0f : 0.0f;
      check_case(c, rng, all_isas_split_and_not(100));
    }
  }
}

TEST(FastAttention, ResultsDoNotDependOnThreadCount) {
  std::mt19937_64 rng(base_seed() + 7);
  for (int trial = 0; trial < 6; ++trial) {
    const AttentionCase c = test::random_case(rng);
    AttentionBuffers buffers = test::make_buffers(c, rng);
    FastRun run = default_run();
    run.plan.q_tile_rows = 32;
    run.plan.kv_chunk = trial % 2 ? 48 : 0;
    run.threads = 1;
    const Outputs single = run_fast(buffers, run);
    for (int threads : {2, 3, 4, 7}) {
      run.threads = threads;
      const Outputs multi = run_fast(buffers, run);
      EXPECT_TRUE(multi.o == single.o && multi.lse == single.lse)
          << "threads=" << threads << " case: " << c.describe();
    }
  }
}

TEST(FastAttention, RejectsPlansThatDoNotFitTheTensors) {
  std::mt19937_64 rng(base_seed() + 8);
  AttentionCase c;
  c.q_lens = {10};
  c.kv_lens = {100};
  c.num_qo_heads = c.num_kv_heads = 2;
  c.head_dim = 64;
  AttentionBuffers buffers = test::make_buffers(c, rng);
  const detail::AttentionProblem problem = test::make_problem(buffers);

  TestPlanOptions split;
  split.kv_chunk = 30;
  Plan plan = test::make_test_plan(c, split);
  std::vector<uint8_t> workspace(plan.workspace_bytes);
  EXPECT_THROW(detail::cpu_fast_attention(plan, problem, Workspace{workspace.data(), 16}), Error);

  Plan stale = test::make_test_plan(c, {});
  stale.work[0].kv_end = 101;  // one key past the request
  EXPECT_THROW(detail::cpu_fast_attention(stale, problem, Workspace{}), Error);

  Plan other_shape = test::make_test_plan(c, {});
  other_shape.head_dim = 128;
  EXPECT_THROW(detail::cpu_fast_attention(other_shape, problem, Workspace{}), Error);
}

TEST(CpuInfo, PeakAndIsaAreDescribed) {
  std::string explanation;
  const double peak = detail::cpu_peak_gflops(&explanation);
  EXPECT_GT(peak, 0.0);
  EXPECT_NE(explanation.find("GHz"), std::string::npos) << explanation;
  const std::string isa = detail::cpu_isa_name();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "generic") << isa;
  EXPECT_TRUE(detail::cpu_supports(detail::selected_cpu_isa()));
}

TEST(CpuConfig, ThreadCountCanBeSetAndReset) {
  const int default_threads = num_threads();
  EXPECT_GE(default_threads, 1);
  set_num_threads(3);
  EXPECT_EQ(num_threads(), 3);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), default_threads);
  EXPECT_THROW(set_num_threads(-1), Error);
}

}  // namespace
}  // namespace tessera
