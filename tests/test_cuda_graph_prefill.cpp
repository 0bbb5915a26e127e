// The ragged prefill CUDA graph (the decode graphs, uploads and the CPU capacity tests:
// test_cuda_graph.cpp): a graph captured around run_ragged_prefill with the largest batch's plan
// (causal, fp16, GQA 8:2, head_dim 128, up to 8 requests of up to 128 queries over up to 1024
// keys) is replayed for many random smaller batches: each step writes the batch's indptr arrays
// and q into the same device buffers, plans with the same capacity, upload_plan()s on the stream
// (outside the graph), poisons o / lse with NaN and replays; rows are compared with a
// double-precision reference (every row every 50th step, a few random rows otherwise).
// Without a CUDA device the test skips. TESSERA_TEST_REDUCED=1 shrinks the step count;
// TESSERA_TEST_SEED varies the random run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/cuda_graph_support.hpp"
#include "common/cuda_graph_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/types.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::compare_row;
using test::DeviceBuffer;
using test::indptr_of;
using test::kGpu;
using test::random_fp16;
using test::reduced_run;
using test::reference_row;
using test::RowReference;
using test::rows_to_check;
using Graph = test::CudaGraph;
using Stream = test::CudaStream;

// test_cuda_graph.cpp's seed (so the ragged test's random run is the one it had there).
uint64_t base_seed() { return test::seed_from_env(20251204ull); }

TEST(CudaGraph, RaggedPrefillGraphReplaysAnyPlanOfItsCapacity) {
  TESSERA_SKIP_WITHOUT_GPU();
  constexpr int kMaxBatch = 8, kMaxQ = 128, kMaxKv = 1024;
  constexpr int kQoHeads = 8, kKvHeads = 2, kHeadDim = 128;
  constexpr int kMaxTotalQ = kMaxBatch * kMaxQ, kMaxTotalKv = kMaxBatch * kMaxKv;
  constexpr int64_t kQRow = int64_t{kQoHeads} * kHeadDim, kKvRow = int64_t{kKvHeads} * kHeadDim;
  std::mt19937_64 rng(base_seed() + 3);
  const std::vector<uint16_t> k_host = random_fp16(rng, size_t{kMaxTotalKv} * kKvRow);
  const std::vector<uint16_t> v_host = random_fp16(rng, size_t{kMaxTotalKv} * kKvRow);
  DeviceBuffer k(k_host), v(v_host);
  DeviceBuffer q(size_t{kMaxTotalQ} * kQRow * 2), o(size_t{kMaxTotalQ} * kQRow * 2);
  DeviceBuffer lse(size_t{kMaxTotalQ} * kQoHeads * 4);
  DeviceBuffer qo_indptr(size_t{kMaxBatch + 1} * 4), kv_indptr(size_t{kMaxBatch + 1} * 4);
  Stream stream;
  const cudaStream_t s = stream.get();
  AttentionOptions options;
  options.causal = true;

  std::vector<int32_t> q_lens, kv_lens, qo_host, kv_host;
  std::vector<uint16_t> q_host;
  const auto set_batch = [&](std::vector<int32_t> qs, std::vector<int32_t> kvs) {
    q_lens = std::move(qs);
    kv_lens = std::move(kvs);
    qo_host = indptr_of(q_lens);
    kv_host = indptr_of(kv_lens);
    q_host = random_fp16(rng, std::max<size_t>(1, size_t(qo_host.back()) * kQRow));
    ASSERT_EQ(cudaMemcpyAsync(qo_indptr.data(), qo_host.data(), qo_host.size() * 4,
                              cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(kv_indptr.data(), kv_host.data(), kv_host.size() * 4,
                              cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(q.data(), q_host.data(), q_host.size() * 2,
                              cudaMemcpyHostToDevice, s), cudaSuccess);
  };
  const auto view3 = [&](const DeviceBuffer& buffer, int64_t rows, int heads) {
    return test::gpu_view(buffer, DType::kFloat16, {rows, heads, kHeadDim},
                          {int64_t{heads} * kHeadDim, kHeadDim, 1});
  };
  const auto check = [&](int step) -> std::string {
    const int64_t total_q = qo_host.back();
    std::vector<uint16_t> o_host(size_t(total_q) * kQRow);
    std::vector<float> lse_host(size_t(total_q) * kQoHeads);
    if (cudaMemcpyAsync(o_host.data(), o.data(), o_host.size() * 2, cudaMemcpyDeviceToHost,
                        s) != cudaSuccess ||
        cudaMemcpyAsync(lse_host.data(), lse.data(), lse_host.size() * 4,
                        cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess) {
      return "CUDA error";
    }
    detail::MaskSpec mask;
    mask.causal = true;
    const double scale = 1.0 / std::sqrt(double{kHeadDim});
    for (const int64_t row : rows_to_check(rng, step, total_q * kQoHeads)) {
      const int64_t token = row / kQoHeads;
      const int h = static_cast<int>(row % kQoHeads);
      const int b = static_cast<int>(
          std::upper_bound(qo_host.begin(), qo_host.end(), static_cast<int32_t>(token)) -
          qo_host.begin() - 1);
      int32_t first, last;
      mask.visible_range(static_cast<int32_t>(token - qo_host[b]), q_lens[b], kv_lens[b], &first,
                         &last);
      std::vector<int64_t> keys;
      for (int32_t j = first; j < last; ++j) {
        keys.push_back((kv_host[b] + j) * kKvRow + (h / (kQoHeads / kKvHeads)) * kHeadDim);
      }
      const RowReference ref =
          reference_row(q_host.data() + row * kHeadDim, k_host, v_host, keys, kHeadDim, scale);
      const std::string error =
          compare_row(o_host.data() + row * kHeadDim, lse_host[row], ref, kHeadDim);
      if (!error.empty()) {
        return "request " + std::to_string(b) + " token " + std::to_string(token) + " head " +
               std::to_string(h) + ": " + error;
      }
    }
    return "";
  };
  const auto poison = [&] {
    ASSERT_EQ(cudaMemsetAsync(o.data(), 0xff, o.bytes(), s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(lse.data(), 0xff, lse.bytes(), s), cudaSuccess);
  };

  const PlanCapacity capacity = plan_capacity(AttentionOp::kRaggedPrefill, kMaxBatch, kMaxTotalQ,
                                              kMaxKv, kQoHeads, kKvHeads, kHeadDim, kGpu);
  set_batch(std::vector<int32_t>(kMaxBatch, kMaxQ), std::vector<int32_t>(kMaxBatch, kMaxKv));
  Plan max_plan = plan_ragged_prefill(qo_host, kv_host, kQoHeads, kKvHeads, kHeadDim, options,
                                      kGpu, capacity);
  DeviceBuffer workspace(max_plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  upload_plan(max_plan, ws, s);
  Graph graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  try {
    run_ragged_prefill(max_plan, view3(q, kMaxTotalQ, kQoHeads), view3(k, kMaxTotalKv, kKvHeads),
                       view3(v, kMaxTotalKv, kKvHeads),
                       test::gpu_index_view(qo_indptr, kMaxBatch + 1),
                       test::gpu_index_view(kv_indptr, kMaxBatch + 1),
                       view3(o, kMaxTotalQ, kQoHeads),
                       test::gpu_view(lse, DType::kFloat32, {kMaxTotalQ, kQoHeads},
                                      {kQoHeads, 1}),
                       ws, s);
  } catch (const std::exception& e) {
    cudaStreamEndCapture(s, &graph.graph);
    FAIL() << "run_ragged_prefill during capture: " << e.what();
  }
  CUDA_OK(cudaStreamEndCapture(s, &graph.graph));
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  poison();
  CUDA_OK(cudaGraphLaunch(graph.exec, s));
  ASSERT_EQ(check(0), "") << "max plan replay";

  const int steps = reduced_run() ? 20 : 200;
  for (int step = 1; step <= steps; ++step) {
    const int batch = test::uniform(rng, 1, kMaxBatch);
    std::vector<int32_t> qs(batch), kvs(batch);
    for (int b = 0; b < batch; ++b) {
      qs[b] = test::chance(rng, 0.05) ? 0 : test::uniform(rng, 1, kMaxQ);
      kvs[b] = test::uniform(rng, qs[b], kMaxKv);
    }
    set_batch(qs, kvs);
    if (qo_host.back() == 0) continue;
    Plan plan;
    ASSERT_NO_THROW(plan = plan_ragged_prefill(qo_host, kv_host, kQoHeads, kKvHeads, kHeadDim,
                                               options, kGpu, capacity))
        << "step " << step;
    upload_plan(plan, ws, s);
    poison();
    CUDA_OK(cudaGraphLaunch(graph.exec, s));
    const std::string error = check(step);
    ASSERT_EQ(error, "") << "step " << step << ", batch " << batch << ", " << plan.work.size()
                         << " work items, " << plan.merges.size() << " merges";
  }
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaGraph, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
