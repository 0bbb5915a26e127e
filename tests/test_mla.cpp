// MLA (issue 37) on the CPU: the reference against a brute force of the formula written in the
// test helpers (common/mla_testing.cpp, double loops, no library code), then the fast path and
// plan/run (the real planner, split-KV included) against the same brute force for H in
// {16, 32, 128}, kv_lora_rank / rope_dim 512 / 64 and smaller pairs, page sizes 1 / 16 / 64,
// skewed batches, empty requests, decode (one and two query tokens per request) and causal
// prefill, LSE; two-tensor and combined caches; the one-shot call; the append with and without
// RoPE; and bad input, each named with the outputs left as they were (NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/mla_testing.hpp"
#include "tessera/backend.hpp"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using test::MlaBuffers;
using test::MlaCase;

// Restores the CPU implementation and thread count a test changes.
class MlaTest : public ::testing::Test {
 protected:
  void TearDown() override {
    set_cpu_impl(CpuImpl::kFast);
    set_num_threads(saved_threads_);
  }
  int saved_threads_ = num_threads();
};

MlaPlan plan_for(const MlaBuffers& buffers) {
  const MlaCase& c = buffers.c;
  MlaOptions options;
  options.causal = c.causal;
  options.sm_scale = c.sm_scale;
  return plan_mla(buffers.qo_indptr, buffers.page_indptr, buffers.last_page_len, c.page_size,
                  c.num_heads, c.kv_lora_rank, c.rope_dim, options);
}

// Plans and runs the case (outputs poisoned first); returns the plan.
MlaPlan run_case(MlaBuffers& buffers, bool with_lse = true) {
  const MlaPlan plan = plan_for(buffers);
  std::vector<uint8_t> workspace(plan.workspace_bytes());
  buffers.poison_outputs();
  run_mla(plan, buffers.q_nope(), buffers.q_pe(), buffers.paged_cache(),
          buffers.index_view(buffers.qo_indptr), buffers.o_view(),
          with_lse ? buffers.lse_view() : TensorView{}, {workspace.data(), workspace.size()});
  return plan;
}

void expect_matches_brute_force(const MlaBuffers& buffers, const std::string& what,
                                bool check_lse = true) {
  const test::MlaDiff diff =
      test::mla_diff(test::mla_outputs(buffers), test::mla_brute_force(buffers));
  const double tolerance = test::mla_tolerance(buffers.c.dtype);
  EXPECT_LE(diff.o, tolerance) << what << ": " << buffers.c.describe();
  if (check_lse) {
    EXPECT_LE(diff.lse, 1e-4) << what << ": " << buffers.c.describe();
  }
}

template <class Call>
void expect_error(Call&& call, const std::string& arg,
                  Error::Kind kind = Error::Kind::kInvalidArgument) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'" + arg + "'"), std::string::npos) << error.what();
    EXPECT_EQ(static_cast<int>(error.kind()), static_cast<int>(kind)) << error.what();
  }
}

TEST_F(MlaTest, ReferenceMatchesTheFormula) {
  set_cpu_impl(CpuImpl::kReference);
  std::mt19937_64 rng(37);
  const int32_t pages[] = {1, 16, 64};
  for (int trial = 0; trial < 18; ++trial) {
    const bool wide = trial % 3 == 0;
    MlaCase c = test::random_mla_case(rng, trial % 2 ? 16 : 4, wide ? 512 : 64, wide ? 64 : 16,
                                      pages[trial % 3], wide ? 40 : 150);
    if (trial % 6 == 5) c.rope_dim = 0;  // no rope part: plain MQA with V = K
    MlaBuffers buffers = test::make_mla_buffers(c, rng);
    run_case(buffers);
    const test::MlaDiff diff =
        test::mla_diff(test::mla_outputs(buffers), test::mla_brute_force(buffers));
    EXPECT_LE(diff.o, 1e-5) << c.describe();
    EXPECT_LE(diff.lse, 1e-5) << c.describe();
  }
}

TEST_F(MlaTest, FastPathMatchesTheFormula) {
  std::mt19937_64 rng(38);
  const int32_t heads[] = {16, 32, 128};
  const int32_t pages[] = {1, 16, 64};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int trial = 0; trial < 18; ++trial) {
    const bool wide = trial % 2 == 0;
    MlaCase c = test::random_mla_case(rng, heads[trial % 3], wide ? 512 : 64, wide ? 64 : 16,
                                      pages[(trial / 3) % 3], wide ? 70 : 300);
    c.dtype = dtypes[(trial / 2) % 3];
    MlaBuffers buffers = test::make_mla_buffers(c, rng);
    run_case(buffers);
    expect_matches_brute_force(buffers, "fast path");
  }
}

// Decode: one or two query tokens per request (MTP), a skewed batch (one long request beside
// short and empty ones), DeepSeek's widths; the long request is split along its keys.
TEST_F(MlaTest, DecodeSkewedBatchWithSplitKv) {
  set_num_threads(4);
  std::mt19937_64 rng(39);
  for (int q_per_request : {1, 2}) {
    for (int page_size : {1, 64}) {
      MlaCase c;
      c.num_heads = 16;
      c.kv_lora_rank = 512;
      c.rope_dim = 64;
      c.page_size = page_size;
      c.causal = true;
      c.kv_lens = {1500, 3, 0, 64, 1};
      c.q_lens.assign(c.kv_lens.size(), q_per_request);
      c.q_lens[2] = 0;  // an empty request
      c.combined_cache = page_size == 64;
      MlaBuffers buffers = test::make_mla_buffers(c, rng);
      const MlaPlan plan = run_case(buffers);
      EXPECT_FALSE(plan.attention.merges.empty()) << "no split-KV: " << plan.explain();
      expect_matches_brute_force(buffers, "decode");
      set_cpu_impl(CpuImpl::kReference);
      run_case(buffers);
      expect_matches_brute_force(buffers, "decode, reference");
      set_cpu_impl(CpuImpl::kFast);
    }
  }
}

// Causal prefill (q_len up to kv_len, and a request with more queries than keys: its first rows
// see nothing, o = 0 and lse = -inf) at 128 heads.
TEST_F(MlaTest, CausalPrefill) {
  std::mt19937_64 rng(40);
  MlaCase c;
  c.num_heads = 128;
  c.kv_lora_rank = 64;
  c.rope_dim = 16;
  c.page_size = 16;
  c.causal = true;
  c.q_lens = {37, 5, 9};
  c.kv_lens = {37, 90, 4};
  MlaBuffers buffers = test::make_mla_buffers(c, rng);
  run_case(buffers);
  expect_matches_brute_force(buffers, "prefill");
  const int64_t last_request_row = (37 + 5) * c.num_heads;  // request 2, query 0, head 0
  EXPECT_EQ(buffers.lse[last_request_row], -std::numeric_limits<float>::infinity());
  run_case(buffers, /*with_lse=*/false);
  expect_matches_brute_force(buffers, "prefill without lse",
                             /*check_lse=*/false);  // lse untouched: still NaN
  EXPECT_TRUE(std::isnan(buffers.lse[0]));
}

TEST_F(MlaTest, OneShotAndCombinedViews) {
  std::mt19937_64 rng(41);
  MlaCase c = test::random_mla_case(rng, 32, 512, 64, 64, 200);
  c.combined_cache = true;
  MlaBuffers buffers = test::make_mla_buffers(c, rng);
  // split_mla_cache gives the views the buffers describe by hand.
  const TensorView whole =
      make_view(buffers.cache.data(), c.dtype, {buffers.num_pages, c.page_size, 576});
  const MlaPagedCache views = split_mla_cache(whole, 512);
  EXPECT_EQ(views.kpe_cache.data, buffers.kpe_cache().data);
  EXPECT_EQ(views.kpe_cache.shape[2], 64);
  MlaPagedCache cache = buffers.paged_cache();
  cache.ckv_cache = views.ckv_cache;
  cache.kpe_cache = views.kpe_cache;
  MlaOptions options;
  options.causal = c.causal;
  options.sm_scale = c.sm_scale;
  mla_attention(buffers.q_nope(), buffers.q_pe(), cache, buffers.index_view(buffers.qo_indptr),
                buffers.o_view(), buffers.lse_view(), options);
  expect_matches_brute_force(buffers, "one-shot");
}

// Checked mode scans the rope segments too and names MLA's tensors.
TEST_F(MlaTest, CheckedModeNamesTheLatentTensors) {
  struct Checking {
    ~Checking() { set_index_checking(false); }
  } restore;
  set_index_checking(true);
  std::mt19937_64 rng(44);
  MlaCase c;
  c.kv_lora_rank = 64;
  c.rope_dim = 16;
  c.q_lens = {1, 2};
  c.kv_lens = {10, 30};
  MlaBuffers buffers = test::make_mla_buffers(c, rng);
  run_case(buffers);  // clean inputs (NaN only where no call reads) pass
  expect_matches_brute_force(buffers, "checked mode");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto poison_and_expect = [&](std::vector<uint8_t>& bytes, int64_t element,
                                     const char* name) {
    float saved;
    std::memcpy(&saved, bytes.data() + element * 4, 4);
    std::memcpy(bytes.data() + element * 4, &nan, 4);
    expect_error([&] { run_case(buffers); }, name);
    std::memcpy(bytes.data() + element * 4, &saved, 4);
  };
  poison_and_expect(buffers.q_pe_separate, 5, "q_pe");
  poison_and_expect(buffers.q, 7, "q_nope");
  const int64_t page = buffers.page_indices[0];  // request 0, key 0
  poison_and_expect(buffers.kpe_separate, page * c.page_size * c.rope_dim + 3, "kpe_cache");
  poison_and_expect(buffers.cache, page * c.page_size * c.kv_lora_rank + 3, "ckv_cache");
}

// ---- append ----

TEST_F(MlaTest, AppendWritesLatentRowsAndRotatesKpe) {
  std::mt19937_64 rng(42);
  for (bool with_rope : {false, true}) {
    MlaCase c;
    c.kv_lora_rank = 64;
    c.rope_dim = 16;
    c.page_size = 16;
    c.kv_lens = {20, 0, 33};
    c.q_lens = {1, 0, 1};
    c.combined_cache = with_rope;
    MlaBuffers buffers = test::make_mla_buffers(c, rng);
    const std::vector<int32_t> append_indptr = {0, 3, 3, 8};  // the last 3 / 0 / 5 tokens
    const int64_t nnz = 8;
    std::vector<float> ckv(nnz * 64), kpe(nnz * 16), kpe_rotated;
    std::normal_distribution<float> normal;
    for (float& x : ckv) x = normal(rng);
    for (float& x : kpe) x = normal(rng);
    RopeOptions rope;
    rope.interleave = true;
    kpe_rotated = kpe;
    std::vector<int32_t> positions = {17, 18, 19, 28, 29, 30, 31, 32};
    if (with_rope) {  // the expected rows: RoPE on kpe by the tokens' positions, op by op
      apply_rope_inplace({}, make_view(kpe_rotated.data(), DType::kFloat32, {nnz, 1, 16}),
                         make_view(positions.data(), DType::kInt32, {nnz}), rope);
    }
    append_paged_mla_cache(make_view(ckv.data(), DType::kFloat32, {nnz, 64}),
                           make_view(kpe.data(), DType::kFloat32, {nnz, 16}),
                           buffers.index_view(append_indptr), buffers.paged_cache(),
                           with_rope ? &rope : nullptr);
    const int32_t request_of[] = {0, 0, 0, 2, 2, 2, 2, 2};
    for (int64_t i = 0; i < nnz; ++i) {
      const int32_t b = request_of[i];
      for (int d = 0; d < 80; ++d) {
        const double expected = d < 64 ? ckv[i * 64 + d] : kpe_rotated[i * 16 + d - 64];
        ASSERT_EQ(buffers.kv_at(b, positions[i], d), expected) << "row " << i << " dim " << d;
      }
    }
  }
}

// ---- bad input: named, nothing written ----

TEST_F(MlaTest, BadPlansAreNamed) {
  const std::vector<int32_t> qo = {0, 1}, pages = {0, 1}, last = {5};
  const auto plan_with = [&](int heads, int lora, int rope) {
    return [=] { plan_mla(qo, pages, last, 16, heads, lora, rope); };
  };
  expect_error(plan_with(16, 500, 64), "kv_lora_rank");
  expect_error(plan_with(16, 1024, 64), "kv_lora_rank");
  expect_error(plan_with(16, 512, 12), "rope_dim");
  expect_error(plan_with(16, 512, 256), "rope_dim");
  expect_error(plan_with(0, 512, 64), "num_heads");
  expect_error([&] { plan_mla(qo, pages, {}, 16, 16, 512, 64); }, "last_page_len");
  MlaOptions bad_scale;
  bad_scale.sm_scale = -1.0f;
  expect_error([&] { plan_mla(qo, pages, last, 16, 16, 512, 64, bad_scale); }, "options.sm_scale");
  expect_error(
      [&] {
        plan_mla(qo, pages, last, 16, 16, 512, 64, {}, Device{DeviceType::kCUDA, 0});
      },
      "device", Error::Kind::kUnsupported);
  // The generic ops keep their head_dim bound: 576 is MLA's only.
  expect_error([&] { plan_decode(pages, last, 16, 16, 1, 576, {}); }, "head_dim");
}

TEST_F(MlaTest, BadRunsAreNamedAndWriteNothing) {
  std::mt19937_64 rng(43);
  MlaCase c;
  c.num_heads = 16;
  c.kv_lora_rank = 64;
  c.rope_dim = 16;
  c.page_size = 16;
  c.q_lens = {1, 2};
  c.kv_lens = {10, 40};
  MlaBuffers buffers = test::make_mla_buffers(c, rng);
  MlaBuffers wider = test::make_mla_buffers(
      [&] {
        MlaCase w = c;
        w.kv_lora_rank = 72;
        w.rope_dim = 24;
        w.num_heads = 8;
        return w;
      }(),
      rng);
  const MlaPlan plan = plan_for(buffers);
  std::vector<uint8_t> workspace(plan.workspace_bytes() + 1);
  const Workspace ws{workspace.data(), workspace.size()};
  const TensorView qo = buffers.index_view(buffers.qo_indptr);
  const auto run_with = [&](TensorView q_nope, TensorView q_pe, MlaPagedCache cache, TensorView o) {
    return [=, &plan] { run_mla(plan, q_nope, q_pe, cache, qo, o, buffers.lse_view(), ws); };
  };
  const MlaPagedCache good = buffers.paged_cache();
  MlaPagedCache wrong_ckv = good, wrong_kpe = good, wrong_pages = good, wrong_page_size = good;
  wrong_ckv.ckv_cache = wider.ckv_cache();
  wrong_kpe.kpe_cache = wider.kpe_cache();
  wrong_pages.kpe_cache.shape[0] -= 1;
  wrong_page_size.ckv_cache.shape[1] = 8;
  expect_error(run_with(wider.q_nope(), buffers.q_pe(), good, buffers.o_view()), "q_nope");
  expect_error(run_with(buffers.q_nope(), wider.q_pe(), good, buffers.o_view()), "q_pe");
  expect_error(run_with(buffers.q_nope(), {}, good, buffers.o_view()), "q_pe");
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), wrong_ckv, buffers.o_view()),
               "ckv_cache");
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), wrong_kpe, buffers.o_view()),
               "kpe_cache");
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), wrong_pages, buffers.o_view()),
               "kpe_cache");
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), wrong_page_size, buffers.o_view()),
               "ckv_cache");
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), good, wider.o_view()), "o");
  MlaPagedCache bad_index = good;
  std::vector<int32_t> indices = buffers.page_indices;
  indices[0] = static_cast<int32_t>(buffers.num_pages);
  bad_index.page_indices = buffers.index_view(indices);
  expect_error(run_with(buffers.q_nope(), buffers.q_pe(), bad_index, buffers.o_view()),
               "page_indices");
  MlaPlan not_mla = plan;
  not_mla.attention = plan_decode(buffers.page_indptr, buffers.last_page_len, 16, 16, 1, 64, {});
  expect_error(
      [&] {
        run_mla(not_mla, buffers.q_nope(), buffers.q_pe(), good, qo, buffers.o_view(), {}, ws);
      },
      "plan");
  MlaPlan split = plan;  // a plan with split-KV partials needs its workspace
  split.attention.workspace_bytes = 64;
  expect_error(
      [&] {
        run_mla(split, buffers.q_nope(), buffers.q_pe(), good, qo, buffers.o_view(), {},
                {nullptr, 0});
      },
      "workspace");
  for (size_t i = 0; i < buffers.lse.size(); ++i) ASSERT_TRUE(std::isnan(buffers.lse[i])) << i;
  const test::MlaResult untouched = test::mla_outputs(buffers);
  for (double x : untouched.o) ASSERT_TRUE(std::isnan(x));
  // The one-shot and the append name the device, and their own arguments.
  TensorView cuda_q = buffers.q_nope();
  cuda_q.device = {DeviceType::kCUDA, 0};
  expect_error([&] { mla_attention(cuda_q, buffers.q_pe(), good, qo, buffers.o_view()); }, "device",
               Error::Kind::kUnsupported);
  std::vector<float> rows(64 * 3);
  const std::vector<int32_t> append = {0, 1, 3};
  expect_error(
      [&] {
        append_paged_mla_cache(make_view(rows.data(), DType::kFloat32, {3, 64}),
                               make_view(rows.data(), DType::kFloat32, {3, 8}),
                               buffers.index_view(append), good);
      },
      "kpe_cache");
  expect_error(
      [&] {
        append_paged_mla_cache(make_view(rows.data(), DType::kFloat32, {3, 60}),
                               make_view(rows.data(), DType::kFloat32, {3, 16}),
                               buffers.index_view(append), good);
      },
      "kv_lora_rank");
}

}  // namespace
}  // namespace tessera
