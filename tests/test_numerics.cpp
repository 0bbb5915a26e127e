// Numerical edge cases through the public API, pinned on every backend: rows that see no key
// (o = 0, lse = -inf), empty and single-token requests, logits near the fp16 range, infinite
// inputs under a soft-cap, and merges of empty / one-sided states. No output may hold a NaN.
// CPU cases run on the fast path and on the reference path; the same bodies run on CUDA when a
// device is present (NumericsCuda.*), and skip with a message otherwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "core/half.hpp"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

const Device kCpu{DeviceType::kCPU, 0};
const Device kCuda{DeviceType::kCUDA, 0};

// The q dtypes a device serves (the CPU also takes float32).
std::vector<DType> q_dtypes(Device device) {
  if (device.type == DeviceType::kCPU) return {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  return {DType::kFloat16, DType::kBFloat16};
}

AttentionCase base_case(DType dtype, std::vector<int32_t> q_lens, std::vector<int32_t> kv_lens) {
  AttentionCase c;
  c.q_lens = std::move(q_lens);
  c.kv_lens = std::move(kv_lens);
  c.num_qo_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.q_dtype = c.kv_dtype = dtype;
  return c;
}

float read_lse(const AttentionBuffers& b, const Outputs& out, int64_t token, int head) {
  float value;
  std::memcpy(&value, out.lse.data() + (token * b.lse_stride_token + head) * sizeof(float),
              sizeof value);
  return value;
}

float read_o(const AttentionBuffers& b, const Outputs& out, int64_t token, int head, int d) {
  const int64_t i = token * b.o_stride_token + head * b.o_stride_head + d;
  return detail::load_as_float(out.o.data(), b.test_case.q_dtype, i);
}

// Runs the case through the API on `device` and against the reference; expects agreement, no
// NaN, no padding write, and rows that see no key to hold exactly o = 0 and lse = -inf.
// Returns the API outputs.
Outputs check_case(AttentionBuffers& buffers, Device device, double tolerance = -1,
                   double lse_tolerance = -1) {
  const AttentionCase& c = buffers.test_case;
  const Outputs expected = run_reference(buffers);
  const Outputs actual = run_through_api(buffers, device);
  const Comparison result = compare_outputs(buffers, actual, expected);
  const double tol = tolerance > 0 ? tolerance : default_tolerance(c);
  const double lse_tol = lse_tolerance > 0 ? lse_tolerance : default_lse_tolerance(c);
  EXPECT_TRUE(result.ok(tol, lse_tol))
      << result.describe() << "\n  case: " << c.describe() << " on " << device_name(device);
  EXPECT_EQ(result.nan_count, 0);
  EXPECT_EQ(result.empty_row_violations, 0);
  EXPECT_EQ(result.padding_writes, 0);
  // Explicit pin of the empty-row contract (independent of compare_outputs).
  const detail::MaskSpec mask = c.mask();
  for (int b = 0; b < c.batch_size(); ++b) {
    for (int i = 0; i < c.q_lens[b]; ++i) {
      int32_t first, last;
      mask.visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
      const int64_t token = buffers.qo_indptr.empty() ? int64_t{b} * c.q_lens[0] + i
                                                      : buffers.qo_indptr[b] + i;
      for (int h = 0; h < c.num_qo_heads; ++h) {
        for (int d = 0; d < c.head_dim; ++d) {
          const float o = read_o(buffers, actual, token, h, d);
          EXPECT_FALSE(std::isnan(o)) << "o NaN at token " << token << " head " << h;
          if (first == last && o != 0.0f) {
            ADD_FAILURE() << "row without keys has o = " << o << ": token " << token << " head "
                          << h << " on " << device_name(device) << "; " << c.describe();
            return actual;
          }
        }
        if (c.with_lse) {
          const float lse = read_lse(buffers, actual, token, h);
          EXPECT_FALSE(std::isnan(lse));
          if (first == last && lse != -kInf) {
            ADD_FAILURE() << "row without keys has lse = " << lse << ": token " << token
                          << " head " << h << " on " << device_name(device) << "; "
                          << c.describe();
            return actual;
          }
        }
      }
    }
  }
  return actual;
}

// Runs `body` on the CPU fast path and the CPU reference path.
template <class Body>
void on_cpu_paths(Body&& body) {
  set_cpu_impl(CpuImpl::kFast);
  body(kCpu);
  set_cpu_impl(CpuImpl::kReference);
  body(kCpu);
  set_cpu_impl(CpuImpl::kFast);
}

#define NUMERICS_TEST(Name)                                                     \
  void Name##_body(Device device);                                              \
  TEST(NumericsCpu, Name) { on_cpu_paths([](Device d) { Name##_body(d); }); }   \
  TEST(NumericsCuda, Name) {                                                    \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU numerics skipped"; \
    Name##_body(kCuda);                                                         \
  }                                                                             \
  void Name##_body(Device device)

// The three ops over the same lengths: ragged, paged (NHD and HND), and decode when q lengths
// are uniform.
template <class Mutate>
void for_each_layout(Device device, const AttentionCase& base, uint64_t seed, Mutate&& mutate) {
  std::mt19937_64 rng(seed);
  for (int variant = 0; variant < 3; ++variant) {
    AttentionCase c = base;
    c.paged = variant > 0;
    c.layout = variant == 2 ? KVLayout::kHND : KVLayout::kNHD;
    c.page_size = 4;
    SCOPED_TRACE(c.describe());
    AttentionBuffers buffers = make_buffers(c, rng);
    mutate(buffers);
    check_case(buffers, device);
  }
}

void no_change(AttentionBuffers&) {}

// ---- rows that see no key ----

NUMERICS_TEST(CausalQueriesBeyondKeys) {
  // Causal, bottom-right aligned: with q_len > kv_len the first q_len - kv_len rows see nothing.
  for (DType dtype : q_dtypes(device)) {
    AttentionCase c = base_case(dtype, {10, 3, 7}, {4, 0, 7});
    c.causal = true;
    for_each_layout(device, c, 1, no_change);
  }
}

NUMERICS_TEST(WindowExcludingEverything) {
  for (DType dtype : q_dtypes(device)) {
    // Window (0, 0): only the diagonal key; rows whose diagonal is before key 0 see nothing.
    AttentionCase c = base_case(dtype, {6, 5}, {2, 9});
    c.window_left = 0;
    c.window_right = 0;
    for_each_layout(device, c, 2, no_change);
    // Causal with a left window on q_len >> kv_len.
    c = base_case(dtype, {12}, {3});
    c.causal = true;
    c.window_left = 1;
    for_each_layout(device, c, 3, no_change);
  }
}

NUMERICS_TEST(ZeroKeyRequests) {
  for (DType dtype : q_dtypes(device)) {
    for_each_layout(device, base_case(dtype, {3, 2, 1, 4}, {0, 5, 0, 0}), 4, no_change);
    // Every request empty of keys.
    for_each_layout(device, base_case(dtype, {2, 3}, {0, 0}), 5, no_change);
    // Decode over a cache whose requests have no pages.
    AttentionCase c = base_case(dtype, {1, 1, 1}, {0, 17, 0});
    c.paged = true;
    c.uniform_q = true;
    std::mt19937_64 rng(6);
    AttentionBuffers buffers = make_buffers(c, rng);
    check_case(buffers, device);
  }
}

NUMERICS_TEST(EmptyRequests) {
  for (DType dtype : q_dtypes(device)) {
    // Requests with no queries between others, and a batch with no query at all.
    for_each_layout(device, base_case(dtype, {0, 4, 0, 2, 0}, {5, 6, 0, 2, 3}), 7, no_change);
    for_each_layout(device, base_case(dtype, {0, 0}, {5, 0}), 8, no_change);
  }
}

NUMERICS_TEST(EmptyBatch) {
  // batch_size 0: plan and run succeed and write nothing.
  const std::vector<int32_t> indptr = {0};
  const Plan plan = plan_ragged_prefill(indptr, indptr, 4, 2, 64, {}, device);
  EXPECT_EQ(plan.total_q, 0);
  AttentionCase c = base_case(DType::kFloat16, {}, {});
  std::mt19937_64 rng(9);
  AttentionBuffers buffers = make_buffers(c, rng);
  const Outputs out = run_through_api(buffers, device, &plan);
  (void)out;
}

NUMERICS_TEST(SingleToken) {
  // One query, one key: softmax weight 1, so o == v exactly (rounded to o's dtype, which v
  // already has) and lse == the scaled logit.
  for (DType dtype : q_dtypes(device)) {
    AttentionCase c = base_case(dtype, {1, 1}, {1, 1});
    std::mt19937_64 rng(10);
    AttentionBuffers buffers = make_buffers(c, rng);
    const Outputs out = check_case(buffers, device);
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < c.num_qo_heads; ++h) {
        const int kv_head = h / c.group_size();
        for (int d = 0; d < c.head_dim; ++d) {
          const float v = detail::load_as_float(
              buffers.v.data(), dtype, b * buffers.kv_stride_token + kv_head * buffers.kv_stride_head + d);
          ASSERT_EQ(read_o(buffers, out, b, h, d), v) << "b " << b << " h " << h << " d " << d;
        }
      }
    }
  }
}

// ---- large and infinite logits ----

// Sets every q / k element of a ragged case from `q_value(token, head, d)` / `k_value(...)`.
template <class Q, class K>
void fill_ragged(AttentionBuffers& b, Q&& q_value, K&& k_value) {
  const AttentionCase& c = b.test_case;
  for (int64_t t = 0; t < c.total_q(); ++t) {
    for (int h = 0; h < c.num_qo_heads; ++h) {
      for (int d = 0; d < c.head_dim; ++d) {
        detail::store_from_float(b.q.data(), c.q_dtype, t * b.q_stride_token + h * b.q_stride_head + d,
                                 q_value(t, h, d));
      }
    }
  }
  for (int64_t t = 0; t < c.total_kv(); ++t) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      for (int d = 0; d < c.head_dim; ++d) {
        detail::store_from_float(b.k.data(), c.kv_dtype,
                                 t * b.kv_stride_token + h * b.kv_stride_head + d, k_value(t, h, d));
      }
    }
  }
}

NUMERICS_TEST(Fp16NearMaxInputs) {
  // q and k near the fp16 maximum: logits ~1e10, far beyond fp16 but finite in float. The
  // softmax is then (nearly) one-hot on the largest logit; results must match the reference.
  for (bool soft_cap : {false, true}) {
    for (bool causal : {false, true}) {
      AttentionCase c = base_case(DType::kFloat16, {5, 1, 8}, {9, 33, 8});
      c.causal = causal;
      c.soft_cap = soft_cap ? 30.0f : 0.0f;
      std::mt19937_64 rng(11);
      AttentionBuffers buffers = make_buffers(c, rng);
      std::uniform_real_distribution<float> near(0.5f, 1.0f);
      std::vector<float> qv(c.total_q() * c.num_qo_heads * c.head_dim);
      std::vector<float> kv(c.total_kv() * c.num_kv_heads * c.head_dim);
      for (auto& x : qv) x = (rng() & 1 ? 1.0f : -1.0f) * 65504.0f * near(rng);
      for (auto& x : kv) x = (rng() & 1 ? 1.0f : -1.0f) * 65504.0f * near(rng);
      fill_ragged(
          buffers, [&](int64_t t, int h, int d) { return qv[(t * c.num_qo_heads + h) * c.head_dim + d]; },
          [&](int64_t t, int h, int d) { return kv[(t * c.num_kv_heads + h) * c.head_dim + d]; });
      SCOPED_TRACE(c.describe());
      // lse ~ 1e9 here: float accumulation of the logits is good to ~1e-5 relative.
      check_case(buffers, device, -1, soft_cap ? -1 : 1e5);
    }
  }
}

NUMERICS_TEST(SoftCapSaturatesInfiniteLogits) {
  // q holds +inf in feature 0 (zeros elsewhere), k holds +-[0.5, 1] there: every logit is +inf
  // or -inf, and cap * tanh(s / cap) maps them to +-cap. The result is finite and equals the
  // reference (the average of v over the keys with a +inf logit).
  for (DType dtype : q_dtypes(device)) {
    AttentionCase c = base_case(dtype, {3, 4}, {7, 4});
    c.soft_cap = 20.0f;
    c.causal = true;
    std::mt19937_64 rng(12);
    AttentionBuffers buffers = make_buffers(c, rng);
    std::uniform_real_distribution<float> mag(0.5f, 1.0f);
    std::vector<float> k0(c.total_kv() * c.num_kv_heads);
    for (auto& x : k0) x = (rng() & 1 ? 1.0f : -1.0f) * mag(rng);
    fill_ragged(
        buffers, [&](int64_t, int, int d) { return d == 0 ? kInf : 0.0f; },
        [&](int64_t t, int h, int d) { return d == 0 ? k0[t * c.num_kv_heads + h] : 0.5f; });
    SCOPED_TRACE(c.describe());
    check_case(buffers, device);
    // Huge finite logits (sm_scale 1e30 on fp32 inputs where supported) saturate the same way.
    AttentionCase big = c;
    big.sm_scale = 1e30f;
    AttentionBuffers buffers2 = make_buffers(big, rng);
    SCOPED_TRACE("sm_scale 1e30");
    check_case(buffers2, device);
  }
}

// ---- merge of attention states ----

// Runs merge_state on `device` over host buffers (copied to the GPU for CUDA).
struct MergeResult {
  std::vector<float> o, lse;
};

MergeResult merge_on(Device device, const std::vector<float>& oa, const std::vector<float>& la,
                     const std::vector<float>& ob, const std::vector<float>& lb, int64_t n,
                     int64_t h, int64_t d) {
  MergeResult r;
  r.o.assign(oa.size(), std::numeric_limits<float>::quiet_NaN());
  r.lse.assign(la.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<const std::vector<float>*> inputs = {&oa, &la, &ob, &lb};
  std::vector<void*> ptrs;
  std::vector<std::vector<float>*> outputs = {&r.o, &r.lse};
  auto place = [&](const std::vector<float>& host) -> void* {
    if (device.type == DeviceType::kCPU) return const_cast<float*>(host.data());
#if defined(TESSERA_HAVE_CUDA)
    void* p = detail::cuda_alloc(host.size() * sizeof(float));
    detail::cuda_copy_to_device(p, host.data(), host.size() * sizeof(float), nullptr);
    ptrs.push_back(p);
    return p;
#else
    return nullptr;
#endif
  };
  void* pa = place(oa);
  void* pla = place(la);
  void* pb = place(ob);
  void* plb = place(lb);
  void* po = place(r.o);
  void* plo = place(r.lse);
  merge_state(make_view(pa, DType::kFloat32, {n, h, d}, device),
              make_view(pla, DType::kFloat32, {n, h}, device),
              make_view(pb, DType::kFloat32, {n, h, d}, device),
              make_view(plb, DType::kFloat32, {n, h}, device),
              make_view(po, DType::kFloat32, {n, h, d}, device),
              make_view(plo, DType::kFloat32, {n, h}, device));
#if defined(TESSERA_HAVE_CUDA)
  if (device.type == DeviceType::kCUDA) {
    detail::cuda_copy_to_host(r.o.data(), po, r.o.size() * sizeof(float), nullptr);
    detail::cuda_copy_to_host(r.lse.data(), plo, r.lse.size() * sizeof(float), nullptr);
    for (void* p : ptrs) detail::cuda_free(p);
  }
#endif
  (void)outputs;
  return r;
}

NUMERICS_TEST(MergeEmptyAndOneSided) {
  // Row 0: both states empty -> o = 0, lse = -inf. Row 1: only a. Row 2: only b.
  // Row 3: both present (checked against the closed form).
  const int64_t n = 4, h = 2, d = 16;
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<float> oa(n * h * d), ob(n * h * d), la(n * h), lb(n * h);
  for (auto& x : oa) x = value(rng);
  for (auto& x : ob) x = value(rng);
  for (auto& x : la) x = value(rng);
  for (auto& x : lb) x = value(rng);
  for (int64_t j = 0; j < h; ++j) {
    la[0 * h + j] = lb[0 * h + j] = -kInf;
    lb[1 * h + j] = -kInf;
    la[2 * h + j] = -kInf;
  }
  // Empty states may carry garbage (even NaN) in o: their weight is zero.
  for (int64_t j = 0; j < h * d; ++j) {
    oa[0 * h * d + j] = ob[0 * h * d + j] = 0.0f;
    ob[1 * h * d + j] = 0.0f;
    oa[2 * h * d + j] = 0.0f;
  }
  const MergeResult r = merge_on(device, oa, la, ob, lb, n, h, d);
  for (int64_t j = 0; j < h; ++j) {
    EXPECT_EQ(r.lse[0 * h + j], -kInf);
    EXPECT_EQ(r.lse[1 * h + j], la[1 * h + j]);
    EXPECT_EQ(r.lse[2 * h + j], lb[2 * h + j]);
    const double m = std::max(la[3 * h + j], lb[3 * h + j]);
    const double expected_lse =
        m + std::log(std::exp(la[3 * h + j] - m) + std::exp(lb[3 * h + j] - m));
    EXPECT_NEAR(r.lse[3 * h + j], expected_lse, 1e-5);
    for (int64_t k = 0; k < d; ++k) {
      const int64_t i = j * d + k;
      EXPECT_EQ(r.o[0 * h * d + i], 0.0f);
      EXPECT_NEAR(r.o[1 * h * d + i], oa[1 * h * d + i], 1e-6);
      EXPECT_NEAR(r.o[2 * h * d + i], ob[2 * h * d + i], 1e-6);
      const double wa = std::exp(la[3 * h + j] - expected_lse);
      const double wb = std::exp(lb[3 * h + j] - expected_lse);
      EXPECT_NEAR(r.o[3 * h * d + i], wa * oa[3 * h * d + i] + wb * ob[3 * h * d + i], 1e-5);
    }
  }
  for (float x : r.o) EXPECT_FALSE(std::isnan(x));
  for (float x : r.lse) EXPECT_FALSE(std::isnan(x));
}

NUMERICS_TEST(MergeStatesEmptyRows) {
  // merge_states (CPU here; the CUDA variant is covered by test_cuda_ops): a row with no
  // state and a row whose states are all empty both give o = 0, lse = -inf.
  if (device.type != DeviceType::kCPU) GTEST_SKIP() << "host buffers only";
  const int64_t h = 2, d = 8;
  const std::vector<int32_t> indptr = {0, 0, 2, 3};  // row 0: none; row 1: 2 empty; row 2: one
  std::vector<float> states(3 * h * d, 1.0f), lse = {-kInf, -kInf, -kInf, -kInf, 0.5f, -1.0f};
  std::vector<float> o(3 * h * d, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse_out(3 * h, std::numeric_limits<float>::quiet_NaN());
  std::vector<int32_t> ip = indptr;
  merge_states(make_view(states.data(), DType::kFloat32, {3, h, d}),
               make_view(lse.data(), DType::kFloat32, {3, h}),
               make_view(ip.data(), DType::kInt32, {4}),
               make_view(o.data(), DType::kFloat32, {3, h, d}),
               make_view(lse_out.data(), DType::kFloat32, {3, h}));
  for (int64_t i = 0; i < 2 * h * d; ++i) EXPECT_EQ(o[i], 0.0f) << i;
  for (int64_t i = 0; i < 2 * h; ++i) EXPECT_EQ(lse_out[i], -kInf) << i;
  EXPECT_EQ(lse_out[2 * h + 0], 0.5f);
  EXPECT_EQ(lse_out[2 * h + 1], -1.0f);
  for (int64_t i = 2 * h * d; i < 3 * h * d; ++i) EXPECT_EQ(o[i], 1.0f);
}

}  // namespace
}  // namespace tessera::test
