// Mixed batches (issue 5): requests prefilling hundreds to thousands of tokens beside requests
// decoding one token, in one paged-prefill plan (ragged qo_indptr: a decoding request is a
// request with q_len 1). Causal, GQA, page sizes 1 / 16 / 64.
//
// Through the public plan/run API against the double-precision reference, outputs poisoned with
// NaN first (tests/common/api_runner.hpp): on the CPU always, on CUDA when a device is present
// (skipped with a message otherwise). GPU only: a CUDA graph captured once around
// run_paged_prefill at the capacity of the largest batch, then replayed for 200 random mixed
// compositions (upload_plan between replays), every decoding row and sampled prefilling rows
// compared with the reference. TESSERA_TEST_REDUCED=1 shrinks the replay count;
// TESSERA_TEST_SEED varies the random run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/cuda_graph_support.hpp"
#include "common/gpu_test_support.hpp"
#include "core/half.hpp"
#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/backend.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace tessera::test {
namespace {

int32_t draw(std::mt19937_64& rng, int32_t low, int32_t high) {  // inclusive
  return std::uniform_int_distribution<int32_t>(low, high)(rng);
}

// A mixed batch: `prefills` requests with q_len in [300, 2000] over their own tokens
// plus a cached prefix, and `decodes` requests with q_len 1 over 1..3000 cached keys, in a
// random order.
AttentionCase mixed_case(std::mt19937_64& rng, Device device, int32_t page_size, int prefills,
                         int decodes) {
  AttentionCase c;
  c.paged = true;
  c.uniform_q = false;
  c.causal = true;
  c.page_size = page_size;
  // GQA groups of 4 and 8. The double reference dominates the CPU test's time: fewer heads
  // and a smaller head_dim there.
  const bool gpu = device.type == DeviceType::kCUDA;
  c.num_kv_heads = gpu ? 2 : 1;
  c.num_qo_heads = c.num_kv_heads * (draw(rng, 0, 1) == 0 ? 4 : 8);
  c.head_dim = gpu ? 128 : 64;
  c.q_dtype = c.kv_dtype = draw(rng, 0, 1) == 0 ? DType::kFloat16 : DType::kBFloat16;
  c.layout = draw(rng, 0, 1) == 0 ? KVLayout::kNHD : KVLayout::kHND;
  c.spare_pages = draw(rng, 0, 3);
  std::vector<std::pair<int32_t, int32_t>> requests;  // (q_len, kv_len)
  for (int i = 0; i < prefills; ++i) {
    const int32_t q_len = draw(rng, 300, 2000);
    requests.push_back({q_len, q_len + (draw(rng, 0, 1) == 0 ? 0 : draw(rng, 1, 600))});
  }
  for (int i = 0; i < decodes; ++i) requests.push_back({1, draw(rng, 1, 3000)});
  std::shuffle(requests.begin(), requests.end(), rng);
  for (auto [q_len, kv_len] : requests) {
    c.q_lens.push_back(q_len);
    c.kv_lens.push_back(kv_len);
  }
  return c;
}

void run_mixed_batches(Device device, int cases_per_page_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const int32_t page_size : {1, 16, 64}) {
    for (int i = 0; i < cases_per_page_size; ++i) {
      const AttentionCase c = mixed_case(rng, device, page_size, 1 + i % 2, draw(rng, 4, 40));
      SCOPED_TRACE("page size " + std::to_string(page_size) + ", case " + std::to_string(i) +
                   ": " + c.describe());
      AttentionBuffers buffers = make_buffers(c, rng);
      const Plan plan = plan_for(buffers, device);
      // One plan for the whole batch, with items of the decoding requests (one token) and of
      // the prefilling ones.
      ASSERT_EQ(plan.op, AttentionOp::kPagedPrefill);
      ASSERT_EQ(plan.batch_size, c.batch_size());
      const auto has_item = [&](bool decoding) {
        return std::any_of(plan.work.begin(), plan.work.end(), [&](const WorkItem& item) {
          return (c.q_lens[item.request] == 1) == decoding;
        });
      };
      EXPECT_TRUE(has_item(true) && has_item(false)) << plan.explain();
      const Outputs expected = run_reference(buffers);
      const Outputs actual = run_through_api(buffers, device, &plan);
      const Comparison result = compare_outputs(buffers, actual, expected);
      ASSERT_TRUE(result.ok(default_tolerance(c), default_lse_tolerance(c))) << result.describe();
    }
  }
}

TEST(MixedBatch, CpuPrefillAndDecodeInOnePlanMatchTheReference) {
  run_mixed_batches(Device{DeviceType::kCPU, 0}, 2, 5001);
}

TEST(MixedBatch, CudaPrefillAndDecodeInOnePlanMatchTheReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  run_mixed_batches(Device{DeviceType::kCUDA, 0}, 2, 5002);
}

#if defined(TESSERA_HAVE_CUDA)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Reference of one (token, head) row over the keys at `key_offsets` (element offsets into the
// fp16 K/V arrays, head included): o (head_dim doubles) and the natural-log lse.
void reference_row(const uint16_t* q_row, const std::vector<uint16_t>& k,
                   const std::vector<uint16_t>& v, const std::vector<int64_t>& key_offsets,
                   int head_dim, double scale, std::vector<double>* o, double* lse) {
  o->assign(head_dim, 0.0);
  *lse = -INFINITY;
  if (key_offsets.empty()) return;
  std::vector<double> q(head_dim), scores(key_offsets.size());
  for (int d = 0; d < head_dim; ++d) q[d] = detail::fp16_to_float(q_row[d]);
  double max_score = -INFINITY;
  for (size_t j = 0; j < key_offsets.size(); ++j) {
    double dot = 0;
    for (int d = 0; d < head_dim; ++d) dot += q[d] * detail::fp16_to_float(k[key_offsets[j] + d]);
    scores[j] = dot * scale;
    max_score = std::max(max_score, scores[j]);
  }
  double sum = 0;
  for (size_t j = 0; j < key_offsets.size(); ++j) {
    const double w = std::exp(scores[j] - max_score);
    sum += w;
    for (int d = 0; d < head_dim; ++d) (*o)[d] += w * detail::fp16_to_float(v[key_offsets[j] + d]);
  }
  for (double& x : *o) x /= sum;
  *lse = max_score + std::log(sum);
}

using Stream = test::CudaStream;
using Graph = test::CudaGraph;

TEST(MixedBatch, CudaGraphReplaysRandomMixedCompositions) {
  TESSERA_SKIP_WITHOUT_GPU();
  constexpr int kMaxBatch = 32, kMaxTotalQ = 4096, kMaxKv = 2600, kPageSize = 16;
  constexpr int kQoHeads = 16, kKvHeads = 4, kHeadDim = 128, kGroup = kQoHeads / kKvHeads;
  constexpr int kPagesPerRequest = (kMaxKv + kPageSize - 1) / kPageSize;
  constexpr int kNumPages = kMaxBatch * kPagesPerRequest;
  // NHD cache [page][token][kv head][dim]; q / o [token][head][dim].
  constexpr int64_t kTokenStride = int64_t{kKvHeads} * kHeadDim;
  constexpr int64_t kPageStride = kPageSize * kTokenStride;
  constexpr int64_t kQRow = int64_t{kQoHeads} * kHeadDim;
  std::mt19937_64 rng(test::seed_from_env(20260105ull));

  const auto random_fp16 = [&](size_t count) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<uint16_t> values(count);
    for (auto& x : values) x = detail::float_to_fp16(dist(rng));
    return values;
  };
  const std::vector<uint16_t> k_host = random_fp16(size_t{kNumPages} * kPageStride);
  const std::vector<uint16_t> v_host = random_fp16(size_t{kNumPages} * kPageStride);
  DeviceBuffer k(k_host), v(v_host);
  DeviceBuffer q(size_t{kMaxTotalQ} * kQRow * 2), o(size_t{kMaxTotalQ} * kQRow * 2);
  DeviceBuffer lse(size_t{kMaxTotalQ} * kQoHeads * 4);
  DeviceBuffer qo_indptr(size_t{kMaxBatch + 1} * 4), page_indptr(size_t{kMaxBatch + 1} * 4);
  DeviceBuffer page_indices(size_t{kNumPages} * 4), last_page_len(size_t{kMaxBatch} * 4);
  Stream stream;
  const cudaStream_t s = stream.get();
  AttentionOptions options;
  options.causal = true;

  // The current batch, on the host.
  std::vector<int32_t> q_lens, kv_lens, qo_host, indptr_host, indices_host, last_host;
  std::vector<uint16_t> q_host;
  const auto set_batch = [&](std::vector<int32_t> qs, std::vector<int32_t> kvs) {
    q_lens = std::move(qs);
    kv_lens = std::move(kvs);
    qo_host.assign(1, 0);
    indptr_host.assign(1, 0);
    last_host.clear();
    for (size_t b = 0; b < q_lens.size(); ++b) {
      qo_host.push_back(qo_host.back() + q_lens[b]);
      const int32_t pages = (kv_lens[b] + kPageSize - 1) / kPageSize;
      indptr_host.push_back(indptr_host.back() + pages);
      last_host.push_back(pages == 0 ? 1 : kv_lens[b] - (pages - 1) * kPageSize);
    }
    std::vector<int32_t> pool(kNumPages);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    indices_host.assign(pool.begin(), pool.begin() + indptr_host.back());
    q_host = random_fp16(std::max<size_t>(1, size_t(qo_host.back()) * kQRow));
    const auto put = [&](const DeviceBuffer& dst, const void* src, size_t bytes) {
      if (bytes == 0) return;
      ASSERT_EQ(cudaMemcpyAsync(dst.data(), src, bytes, cudaMemcpyHostToDevice, s), cudaSuccess);
    };
    put(qo_indptr, qo_host.data(), qo_host.size() * 4);
    put(page_indptr, indptr_host.data(), indptr_host.size() * 4);
    put(page_indices, indices_host.data(), indices_host.size() * 4);
    put(last_page_len, last_host.data(), last_host.size() * 4);
    put(q, q_host.data(), q_host.size() * 2);
  };
  // Every decoding request and the first, last and a few random tokens of each prefilling
  // request, two random heads of each; every 50th step all heads and more tokens.
  const auto check = [&](int step) -> std::string {
    const int64_t total_q = qo_host.back();
    std::vector<uint16_t> o_host(size_t(total_q) * kQRow);
    std::vector<float> lse_host(size_t(total_q) * kQoHeads);
    if (cudaMemcpyAsync(o_host.data(), o.data(), o_host.size() * 2, cudaMemcpyDeviceToHost,
                        s) != cudaSuccess ||
        cudaMemcpyAsync(lse_host.data(), lse.data(), lse_host.size() * 4,
                        cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess) {
      return "CUDA error: " + std::string(cudaGetErrorString(cudaGetLastError()));
    }
    detail::MaskSpec mask;
    mask.causal = true;
    const double scale = 1.0 / std::sqrt(double{kHeadDim});
    std::vector<double> ref_o;
    double ref_lse = 0;
    for (size_t b = 0; b < q_lens.size(); ++b) {
      std::vector<int32_t> tokens;
      if (q_lens[b] == 1) {
        tokens = {0};
      } else if (q_lens[b] > 1) {
        tokens = {0, q_lens[b] - 1};
        for (int i = 0; i < (step % 50 == 0 ? 24 : 3); ++i) tokens.push_back(draw(rng, 0, q_lens[b] - 1));
      }
      for (const int32_t t : tokens) {
        int32_t first, last;
        mask.visible_range(t, q_lens[b], kv_lens[b], &first, &last);
        std::vector<int> heads(kQoHeads);
        std::iota(heads.begin(), heads.end(), 0);
        if (step % 50 != 0) heads = {draw(rng, 0, kQoHeads - 1), draw(rng, 0, kQoHeads - 1)};
        for (const int h : heads) {
          std::vector<int64_t> keys;
          for (int32_t j = first; j < last; ++j) {
            keys.push_back(int64_t{indices_host[indptr_host[b] + j / kPageSize]} * kPageStride +
                           (j % kPageSize) * kTokenStride + (h / kGroup) * kHeadDim);
          }
          const int64_t row = (qo_host[b] + t) * kQoHeads + h;
          reference_row(q_host.data() + row * kHeadDim, k_host, v_host, keys, kHeadDim, scale,
                        &ref_o, &ref_lse);
          const uint16_t* got = o_host.data() + row * kHeadDim;
          for (int d = 0; d < kHeadDim; ++d) {
            const double value = detail::fp16_to_float(got[d]);
            if (!(std::abs(value - ref_o[d]) <= 3e-3 + 1e-2 * std::abs(ref_o[d]))) {
              return "request " + std::to_string(b) + " (q_len " + std::to_string(q_lens[b]) +
                     ", kv_len " + std::to_string(kv_lens[b]) + ") token " + std::to_string(t) +
                     " head " + std::to_string(h) + ": o[" + std::to_string(d) +
                     "] = " + std::to_string(value) + ", reference " + std::to_string(ref_o[d]);
            }
          }
          const float got_lse = lse_host[row];
          const bool lse_ok = std::isinf(ref_lse)
                                  ? std::isinf(got_lse) && got_lse < 0
                                  : std::abs(got_lse - ref_lse) <= 1e-2 + 1e-3 * std::abs(ref_lse);
          if (!lse_ok) {
            return "request " + std::to_string(b) + " token " + std::to_string(t) + " head " +
                   std::to_string(h) + ": lse = " + std::to_string(got_lse) + ", reference " +
                   std::to_string(ref_lse);
          }
        }
      }
    }
    return "";
  };
  const auto poison = [&] {
    ASSERT_EQ(cudaMemsetAsync(o.data(), 0xff, o.bytes(), s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(lse.data(), 0xff, lse.bytes(), s), cudaSuccess);
  };
  const auto plan_batch = [&](const PlanCapacity& capacity) {
    return plan_paged_prefill(qo_host, indptr_host, last_host, kPageSize, kQoHeads, kKvHeads,
                              kHeadDim, options, kGpu, capacity);
  };

  const PlanCapacity capacity = plan_capacity(AttentionOp::kPagedPrefill, kMaxBatch, kMaxTotalQ,
                                              kMaxKv, kQoHeads, kKvHeads, kHeadDim, kGpu);
  // The largest batch: two long prompts beside 30 decoding requests, kMaxTotalQ tokens in all
  // (run checks q against the plan's total, so the captured views hold every row).
  {
    std::vector<int32_t> qs(kMaxBatch, 1), kvs(kMaxBatch, kMaxKv);
    qs[0] = qs[1] = (kMaxTotalQ - (kMaxBatch - 2)) / 2;
    qs[1] += kMaxTotalQ - (kMaxBatch - 2) - 2 * qs[0];
    set_batch(qs, kvs);
  }
  ASSERT_EQ(qo_host.back(), kMaxTotalQ);
  Plan max_plan = plan_batch(capacity);
  DeviceBuffer workspace(max_plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  upload_plan(max_plan, ws, s);
  ASSERT_NE(max_plan.upload_generation, 0u);

  PagedKVCache cache;
  cache.layout = KVLayout::kNHD;
  cache.k_cache = test::gpu_view(k, DType::kFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                 {kPageStride, kTokenStride, kHeadDim, 1});
  cache.v_cache = test::gpu_view(v, DType::kFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                 {kPageStride, kTokenStride, kHeadDim, 1});
  cache.page_indptr = test::gpu_index_view(page_indptr, kMaxBatch + 1);
  cache.page_indices = test::gpu_index_view(page_indices, kNumPages);
  cache.last_page_len = test::gpu_index_view(last_page_len, kMaxBatch);
  Graph graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  try {
    run_paged_prefill(max_plan,
                      test::gpu_view(q, DType::kFloat16, {kMaxTotalQ, kQoHeads, kHeadDim},
                                     {kQRow, kHeadDim, 1}),
                      cache, test::gpu_index_view(qo_indptr, kMaxBatch + 1),
                      test::gpu_view(o, DType::kFloat16, {kMaxTotalQ, kQoHeads, kHeadDim},
                                     {kQRow, kHeadDim, 1}),
                      test::gpu_view(lse, DType::kFloat32, {kMaxTotalQ, kQoHeads}, {kQoHeads, 1}),
                      ws, s);
  } catch (const std::exception& e) {
    cudaStreamEndCapture(s, &graph.graph);
    FAIL() << "run_paged_prefill during capture: " << e.what();
  }
  CUDA_OK(cudaStreamEndCapture(s, &graph.graph));
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  poison();
  CUDA_OK(cudaGraphLaunch(graph.exec, s));
  ASSERT_EQ(check(0), "") << "max plan replay";

  const int steps = test::reduced_run() ? 20 : 200;
  int splits_seen = 0;
  for (int step = 1; step <= steps; ++step) {
    // 0..3 prompts of 300..2000 tokens (within the token budget), the rest decoding, shuffled.
    const int batch = draw(rng, 1, kMaxBatch);
    const int prefills = std::min(batch, draw(rng, 0, 3));
    std::vector<std::pair<int32_t, int32_t>> requests;
    int32_t budget = kMaxTotalQ - (batch - prefills);
    for (int i = 0; i < prefills; ++i) {
      const int32_t q_len = std::min(budget, draw(rng, 300, 2000));
      budget -= q_len;
      requests.push_back({q_len, std::min(kMaxKv, q_len + draw(rng, 0, 600))});
    }
    for (int i = prefills; i < batch; ++i) {
      requests.push_back({1, test::chance(rng, 0.03) ? 0 : draw(rng, 1, kMaxKv)});
    }
    std::shuffle(requests.begin(), requests.end(), rng);
    std::vector<int32_t> qs, kvs;
    for (auto [q_len, kv_len] : requests) {
      qs.push_back(q_len);
      kvs.push_back(kv_len);
    }
    set_batch(qs, kvs);
    Plan plan;
    ASSERT_NO_THROW(plan = plan_batch(capacity)) << "step " << step;
    ASSERT_EQ(plan.workspace_bytes, max_plan.workspace_bytes);
    splits_seen += !plan.merges.empty();
    upload_plan(plan, ws, s);
    poison();
    CUDA_OK(cudaGraphLaunch(graph.exec, s));
    const std::string error = check(step);
    ASSERT_EQ(error, "") << "step " << step << ", batch " << batch << " (" << prefills
                         << " prefilling), " << plan.work.size() << " work items, "
                         << plan.merges.size() << " merges";
  }
  EXPECT_GT(splits_seen, 0) << "no step exercised split-KV merges";
}

#endif  // TESSERA_HAVE_CUDA

}  // namespace
}  // namespace tessera::test
