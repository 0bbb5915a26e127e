// Fixed-capacity plans, upload_plan and CUDA graphs.
//
// CPU part (runs everywhere): a plan over its capacity fails with a clear error, plans of one
// capacity share one workspace size, and plan_capacity() bounds every batch it promises to.
//
// GPU part (skips without a device): a CUDA graph captured around run_decode /
// run_ragged_prefill with the largest batch's plan is replayed for many random smaller batches:
// each step writes the batch's indices and q into the same device buffers, plans with the same
// capacity, upload_plan()s on the stream (outside the graph), poisons o / lse with NaN and
// replays; rows are compared with a double-precision reference (every row every 50th step, a few
// random rows otherwise). Also: upload_plan + run equals plain run bit for bit, a stale upload
// (another plan uploaded into the workspace since) is detected by run, upload_plan refuses a
// capturing stream, and capturing run with a plan that was not uploaded (the pre-upload_plan
// way, used by the Python wrapper) still replays that plan. The ragged prefill graph:
// test_cuda_graph_prefill.cpp; the helpers both use: common/cuda_graph_testing.hpp.
// TESSERA_TEST_REDUCED=1 shrinks the step counts; TESSERA_TEST_SEED varies the random run.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_graph_support.hpp"
#include "common/cuda_graph_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "core/half.hpp"
#include "core/planner.hpp"
#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/backend.hpp"
#include "tessera/types.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

// ============================================================================ CPU: capacity

using test::indptr_of;
using test::paged_lengths;

TEST(PlanCapacity, PlanOverCapacityIsAClearError) {
  std::vector<int32_t> indptr, last;
  paged_lengths({4096, 4096, 300}, 16, &indptr, &last);
  PlanCapacity capacity;
  capacity.max_work_items = 2;  // far too small
  capacity.max_merges = 1;
  capacity.max_partial_rows = 16;
  try {
    (void)plan_decode(indptr, last, 16, 8, 2, 64, {}, Device{}, 1, capacity);
    FAIL() << "expected tessera::Error";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kInvalidArgument);
    const std::string message = error.what();
    EXPECT_NE(message.find("exceeds its fixed capacity"), std::string::npos) << message;
    EXPECT_NE(message.find("max_work_items"), std::string::npos) << message;
  }
  // Set maxima without max_work_items: refused (ambiguous).
  PlanCapacity partial;
  partial.max_merges = 4;
  EXPECT_THROW((void)plan_decode(indptr, last, 16, 8, 2, 64, {}, Device{}, 1, partial), Error);
}

TEST(PlanCapacity, ExtremeMaximaSaturateInsteadOfWrapping) {
  // The bound's products exceed int64 here (UBSan in tools/asan-test.sh flags a wrap); the
  // capacity is the largest a plan can use, never a wrapped (small or negative) one.
  for (const bool deterministic : {false, true}) {
    const PlanCapacity capacity =
        plan_capacity(AttentionOp::kPagedPrefill, INT32_MAX, INT32_MAX, INT32_MAX, 65536, 65536,
                      128, Device{}, deterministic);
    EXPECT_EQ(capacity.max_work_items, INT32_MAX);
    EXPECT_EQ(capacity.max_merges, INT32_MAX);
    EXPECT_EQ(capacity.max_partial_rows, INT32_MAX);
  }
  // More query tokens than an int32 qo_indptr can count: refused, naming the argument.
  try {
    (void)plan_capacity(AttentionOp::kRaggedPrefill, 1, int64_t{INT32_MAX} + 1, 16, 8, 2, 64);
    FAIL() << "expected tessera::Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'max_total_q'"), std::string::npos)
        << error.what();
  }
}

TEST(PlanCapacity, FixedCapacityWithoutMergeRoomTurnsSplitKvOff) {
  std::vector<int32_t> indptr, last;
  paged_lengths({8192}, 16, &indptr, &last);
  PlanCapacity capacity;
  capacity.max_work_items = 64;
  const Plan plan = plan_decode(indptr, last, 16, 8, 2, 64, {}, Device{}, 1, capacity);
  EXPECT_TRUE(plan.merges.empty());
  EXPECT_EQ(plan.num_partial_rows, 0);
  EXPECT_FALSE(plan.config.split_kv);
}

TEST(PlanCapacity, BoundHoldsAndFixesTheWorkspace) {
  std::mt19937_64 rng(20251203ull);
  const auto uniform = [&](int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
  };
  for (const bool deterministic : {false, true}) {
    // Decode: 32 requests, up to 4096 keys.
    const PlanCapacity decode_capacity =
        plan_capacity(AttentionOp::kDecode, 32, 32 * 2, 4096, 16, 4, 128, Device{}, deterministic);
    EXPECT_TRUE(decode_capacity.fixed());
    EXPECT_EQ(decode_capacity.deterministic, deterministic);
    size_t workspace_bytes = 0;
    for (int step = 0; step < 200; ++step) {
      const int32_t batch = step == 0 ? 32 : uniform(1, 32);
      std::vector<int32_t> kv_lens(batch);
      for (auto& len : kv_lens) len = uniform(0, 4) == 0 ? uniform(0, 4096) : uniform(3000, 4096);
      if (step % 7 == 1) kv_lens.assign(1, 4096);  // one long request: the most splits
      std::vector<int32_t> indptr, last;
      paged_lengths(kv_lens, 16, &indptr, &last);
      Plan plan;
      ASSERT_NO_THROW(plan = plan_decode(indptr, last, 16, 16, 4, 128, {}, Device{}, 2,
                                         decode_capacity))
          << "step " << step;
      EXPECT_EQ(plan.config.deterministic, deterministic);
      if (workspace_bytes == 0) workspace_bytes = plan.workspace_bytes;
      EXPECT_EQ(plan.workspace_bytes, workspace_bytes) << "step " << step;
    }
    // Ragged causal prefill: 8 requests, 1024 query tokens in all, up to 2048 keys each.
    AttentionOptions causal;
    causal.causal = true;
    const PlanCapacity prefill_capacity = plan_capacity(AttentionOp::kRaggedPrefill, 8, 1024,
                                                        2048, 8, 2, 64, Device{}, deterministic);
    workspace_bytes = 0;
    for (int step = 0; step < 200; ++step) {
      const int32_t batch = uniform(1, 8);
      std::vector<int32_t> q_lens(batch), kv_lens(batch);
      int32_t budget = 1024;
      for (int32_t b = 0; b < batch; ++b) {
        q_lens[b] = std::min(budget, uniform(0, 1024 / batch + 40));
        budget -= q_lens[b];
        kv_lens[b] = uniform(q_lens[b], 2048);
      }
      Plan plan;
      ASSERT_NO_THROW(plan = plan_ragged_prefill(indptr_of(q_lens), indptr_of(kv_lens), 8, 2, 64,
                                                 causal, Device{}, prefill_capacity))
          << "step " << step;
      if (workspace_bytes == 0) workspace_bytes = plan.workspace_bytes;
      EXPECT_EQ(plan.workspace_bytes, workspace_bytes) << "step " << step;
    }
  }
}

// capacity_bound's balanced-split bound (at most 3 workers + tiles items) holds for any batch,
// worker count and chunk size, fixed capacity or not: make_plan with the bound as the capacity
// never throws, and the plan without a capacity never exceeds it.
TEST(PlanCapacity, BalancedSplitBoundHoldsForAnyWorkerCount) {
  std::mt19937_64 rng(20261203ull);
  const auto uniform = [&](int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 300; ++trial) {
    detail::PlanShape shape;
    shape.op = trial % 2 ? AttentionOp::kDecode : AttentionOp::kRaggedPrefill;
    const int32_t group = 1 << uniform(0, 3);
    shape.num_kv_heads = uniform(1, 4);
    shape.num_qo_heads = shape.num_kv_heads * group;
    shape.head_dim = 64;
    shape.options.causal = uniform(0, 1) == 1;
    PlanConfig config;
    config.q_tile_rows = 64;
    config.num_workers = uniform(1, 300);
    config.min_kv_chunk = 64 * uniform(1, 8);
    config.split_kv = true;
    const int32_t batch = uniform(1, 24);
    const int32_t max_kv = uniform(1, 40000);
    int64_t total_q = 0;
    for (int32_t b = 0; b < batch; ++b) {
      const int32_t kv_len = uniform(0, 3) == 0 ? max_kv : uniform(0, max_kv);
      const int32_t q_len = shape.op == AttentionOp::kDecode ? 1 : uniform(0, std::min(kv_len, 300));
      shape.q_lens.push_back(q_len);
      shape.kv_lens.push_back(kv_len);
      total_q += q_len;
    }
    const PlanCapacity bound = detail::capacity_bound(batch, total_q, max_kv, shape.num_qo_heads,
                                                      shape.num_kv_heads, config);
    const Plan free_plan = detail::make_plan(shape, config);
    EXPECT_LE(static_cast<int64_t>(free_plan.work.size()), bound.max_work_items) << "trial " << trial;
    EXPECT_LE(static_cast<int64_t>(free_plan.merges.size()), bound.max_merges) << "trial " << trial;
    EXPECT_LE(free_plan.num_partial_rows, bound.max_partial_rows) << "trial " << trial;
    shape.capacity = bound;
    EXPECT_NO_THROW((void)detail::make_plan(shape, config)) << "trial " << trial;
  }
}

TEST(PlanCapacity, UploadPlanIsANoOpOnTheCpu) {
  std::vector<int32_t> indptr, last;
  paged_lengths({100, 7}, 16, &indptr, &last);
  Plan plan = plan_decode(indptr, last, 16, 4, 2, 64, {}, Device{});
  std::vector<unsigned char> scratch(plan.workspace_bytes + 16);
  upload_plan(plan, Workspace{scratch.data(), scratch.size()});
  EXPECT_EQ(plan.upload_generation, 0u);
}

#if defined(TESSERA_HAVE_CUDA)

using test::DeviceBuffer;
using test::kGpu;
using test::reduced_run;


uint64_t base_seed() { return test::seed_from_env(20251204ull); }

using test::compare_row;
using test::random_fp16;
using test::reference_row;
using test::RowReference;
using test::rows_to_check;

using Stream = test::CudaStream;
using Graph = test::CudaGraph;

// ---------------------------------------------------------------------------- decode

// Device buffers of a decode batch, sized for the largest batch.
struct DecodeSetup {
  static constexpr int kMaxBatch = 32, kMaxKv = 2048, kPageSize = 16;
  static constexpr int kQoHeads = 16, kKvHeads = 4, kHeadDim = 128;
  static constexpr int kPagesPerRequest = kMaxKv / kPageSize;
  static constexpr int kNumPages = kMaxBatch * kPagesPerRequest;
  // NHD cache: [page][token][kv head][dim].
  static constexpr int64_t kTokenStride = int64_t{kKvHeads} * kHeadDim;
  static constexpr int64_t kPageStride = kPageSize * kTokenStride;

  std::mt19937_64 rng;
  std::vector<uint16_t> k_host, v_host, q_host;
  DeviceBuffer k, v, q, o, lse, page_indptr, page_indices, last_page_len;
  // Host copies of the current batch.
  std::vector<int32_t> kv_lens, indptr_host, indices_host, last_host;

  explicit DecodeSetup(uint64_t seed)
      : rng(seed),
        k_host(random_fp16(rng, size_t{kNumPages} * kPageStride)),
        v_host(random_fp16(rng, size_t{kNumPages} * kPageStride)),
        k(k_host),
        v(v_host),
        q(size_t{kMaxBatch} * kQoHeads * kHeadDim * 2),
        o(size_t{kMaxBatch} * kQoHeads * kHeadDim * 2),
        lse(size_t{kMaxBatch} * kQoHeads * 4),
        page_indptr(size_t{kMaxBatch + 1} * 4),
        page_indices(size_t{kNumPages} * 4),
        last_page_len(size_t{kMaxBatch} * 4) {}

  // A batch: lengths, a random page table (random distinct pages), random q. Written into the
  // device buffers on `stream` (pageable sources are staged before cudaMemcpyAsync returns).
  void set_batch(std::vector<int32_t> lens, cudaStream_t stream) {
    kv_lens = std::move(lens);
    paged_lengths(kv_lens, kPageSize, &indptr_host, &last_host);
    std::vector<int32_t> pages(kNumPages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    indices_host.assign(pages.begin(), pages.begin() + indptr_host.back());
    if (indices_host.empty()) indices_host.push_back(0);
    q_host = random_fp16(rng, kv_lens.size() * kQoHeads * kHeadDim);
    const auto put = [&](const DeviceBuffer& dst, const void* src, size_t bytes) {
      ASSERT_EQ(cudaMemcpyAsync(dst.data(), src, bytes, cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    };
    put(page_indptr, indptr_host.data(), indptr_host.size() * 4);
    put(page_indices, indices_host.data(), indices_host.size() * 4);
    put(last_page_len, last_host.data(), last_host.size() * 4);
    put(q, q_host.data(), q_host.size() * 2);
  }

  Plan plan(const PlanCapacity& capacity) const {
    return plan_decode(indptr_host, last_host, kPageSize, kQoHeads, kKvHeads, kHeadDim, {}, kGpu,
                       1, capacity);
  }

  // A plan of another batch, one request of kMaxKv keys (to overwrite a workspace's lists).
  static Plan other_plan(const PlanCapacity& capacity) {
    std::vector<int32_t> indptr, last;
    paged_lengths({kMaxKv}, kPageSize, &indptr, &last);
    return plan_decode(indptr, last, kPageSize, kQoHeads, kKvHeads, kHeadDim, {}, kGpu, 1,
                       capacity);
  }

  // Views for `batch` requests (the graph is captured with kMaxBatch).
  TensorView q_view(int batch) const {
    return test::gpu_view(q, DType::kFloat16, {batch, kQoHeads, kHeadDim},
                          {kQoHeads * kHeadDim, kHeadDim, 1});
  }
  TensorView o_view(int batch) const {
    return test::gpu_view(o, DType::kFloat16, {batch, kQoHeads, kHeadDim},
                          {kQoHeads * kHeadDim, kHeadDim, 1});
  }
  TensorView lse_view(int batch) const {
    return test::gpu_view(lse, DType::kFloat32, {batch, kQoHeads}, {kQoHeads, 1});
  }
  PagedKVCache cache(int batch) const {
    PagedKVCache cache;
    cache.layout = KVLayout::kNHD;
    cache.k_cache = test::gpu_view(k, DType::kFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                   {kPageStride, kTokenStride, kHeadDim, 1});
    cache.v_cache = test::gpu_view(v, DType::kFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                   {kPageStride, kTokenStride, kHeadDim, 1});
    cache.page_indptr = test::gpu_index_view(page_indptr, batch + 1);
    cache.page_indices = test::gpu_index_view(page_indices, kNumPages);
    cache.last_page_len = test::gpu_index_view(last_page_len, batch);
    return cache;
  }

  void poison(cudaStream_t stream) {
    ASSERT_EQ(cudaMemsetAsync(o.data(), 0xff, o.bytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(lse.data(), 0xff, lse.bytes(), stream), cudaSuccess);
  }

  // Downloads o / lse of the current batch (synchronises the stream) and checks `rows`
  // (row = token * kQoHeads + head). Returns the first mismatch or "".
  std::string check(cudaStream_t stream, const std::vector<int64_t>& rows) {
    const int batch = static_cast<int>(kv_lens.size());
    std::vector<uint16_t> o_host(static_cast<size_t>(batch) * kQoHeads * kHeadDim);
    std::vector<float> lse_host(static_cast<size_t>(batch) * kQoHeads);
    if (cudaMemcpyAsync(o_host.data(), o.data(), o_host.size() * 2, cudaMemcpyDeviceToHost,
                        stream) != cudaSuccess ||
        cudaMemcpyAsync(lse_host.data(), lse.data(), lse_host.size() * 4,
                        cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      return "CUDA error: " + std::string(cudaGetErrorString(cudaGetLastError()));
    }
    const double scale = 1.0 / std::sqrt(double{kHeadDim});
    const int group = kQoHeads / kKvHeads;
    for (const int64_t row : rows) {
      const int b = static_cast<int>(row / kQoHeads), h = static_cast<int>(row % kQoHeads);
      std::vector<int64_t> keys(kv_lens[b]);
      for (int j = 0; j < kv_lens[b]; ++j) {
        const int32_t page = indices_host[indptr_host[b] + j / kPageSize];
        keys[j] = page * kPageStride + (j % kPageSize) * kTokenStride + (h / group) * kHeadDim;
      }
      const RowReference ref =
          reference_row(q_host.data() + row * kHeadDim, k_host, v_host, keys, kHeadDim, scale);
      const std::string error =
          compare_row(o_host.data() + row * kHeadDim, lse_host[row], ref, kHeadDim);
      if (!error.empty()) {
        return "request " + std::to_string(b) + " (kv_len " + std::to_string(kv_lens[b]) +
               ") head " + std::to_string(h) + ": " + error;
      }
    }
    return "";
  }
};

std::vector<int32_t> random_decode_lengths(std::mt19937_64& rng, int step) {
  using S = DecodeSetup;
  const auto uniform = [&](int32_t lo, int32_t hi) { return test::uniform(rng, lo, hi); };
  const int kind = step % 5;
  int32_t batch = kind == 0 ? uniform(1, 3) : uniform(1, S::kMaxBatch);
  if (kind == 4) batch = S::kMaxBatch;
  std::vector<int32_t> lens(batch);
  for (auto& len : lens) {
    len = test::chance(rng, 0.03) ? 0 : uniform(1, S::kMaxKv);
    if (kind == 0) len = uniform(S::kMaxKv / 2, S::kMaxKv);  // few long requests: many splits
  }
  return lens;
}

TEST(CudaGraph, DecodeGraphReplaysAnyPlanOfItsCapacity) {
  TESSERA_SKIP_WITHOUT_GPU();
  using S = DecodeSetup;
  DecodeSetup setup(base_seed());
  Stream stream;
  const cudaStream_t s = stream.get();
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "balanced");
    const PlanCapacity capacity =
        plan_capacity(AttentionOp::kDecode, S::kMaxBatch, S::kMaxBatch, S::kMaxKv, S::kQoHeads,
                      S::kKvHeads, S::kHeadDim, kGpu, deterministic);
    // The largest batch: its plan, uploaded, is what the graph is captured with.
    setup.set_batch(std::vector<int32_t>(S::kMaxBatch, S::kMaxKv), s);
    Plan max_plan = setup.plan(capacity);
    DeviceBuffer workspace(max_plan.workspace_bytes);
    const Workspace ws{workspace.data(), workspace.bytes()};
    upload_plan(max_plan, ws, s);
    ASSERT_NE(max_plan.upload_generation, 0u);

    Graph graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    try {
      run_decode(max_plan, setup.q_view(S::kMaxBatch), setup.cache(S::kMaxBatch),
                 setup.o_view(S::kMaxBatch), setup.lse_view(S::kMaxBatch), ws, s);
    } catch (const std::exception& e) {
      cudaStreamEndCapture(s, &graph.graph);
      FAIL() << "run_decode during capture: " << e.what();
    }
    CUDA_OK(cudaStreamEndCapture(s, &graph.graph));
    CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));

    // The captured plan itself first.
    setup.poison(s);
    CUDA_OK(cudaGraphLaunch(graph.exec, s));
    {
      std::mt19937_64 pick(1);
      const std::string error = setup.check(s, rows_to_check(pick, 0, S::kMaxBatch * S::kQoHeads));
      ASSERT_EQ(error, "") << "max plan replay";
    }

    const int steps = reduced_run() ? 50 : 1000;
    int splits_seen = 0;
    for (int step = 1; step <= steps; ++step) {
      setup.set_batch(random_decode_lengths(setup.rng, step), s);
      Plan plan;
      ASSERT_NO_THROW(plan = setup.plan(capacity)) << "step " << step;
      ASSERT_EQ(plan.workspace_bytes, max_plan.workspace_bytes);
      splits_seen += !plan.merges.empty();
      upload_plan(plan, ws, s);
      setup.poison(s);
      CUDA_OK(cudaGraphLaunch(graph.exec, s));
      const int64_t rows = static_cast<int64_t>(setup.kv_lens.size()) * S::kQoHeads;
      const std::string error = setup.check(s, rows_to_check(setup.rng, step, rows));
      ASSERT_EQ(error, "") << "step " << step << ", batch " << setup.kv_lens.size() << ", "
                           << plan.work.size() << " work items, " << plan.merges.size()
                           << " merges";
    }
    EXPECT_GT(splits_seen, 0) << "no step exercised split-KV merges";
  }
}

TEST(CudaGraph, UploadedRunMatchesPlainRunAndStaleUploadsAreRedone) {
  TESSERA_SKIP_WITHOUT_GPU();
  using S = DecodeSetup;
  DecodeSetup setup(base_seed() + 1);
  Stream stream;
  const cudaStream_t s = stream.get();
  const PlanCapacity capacity = plan_capacity(AttentionOp::kDecode, S::kMaxBatch, S::kMaxBatch,
                                              S::kMaxKv, S::kQoHeads, S::kKvHeads, S::kHeadDim,
                                              kGpu);
  for (int step = 0; step < (reduced_run() ? 4 : 20); ++step) {
    setup.set_batch(random_decode_lengths(setup.rng, step), s);
    const int batch = static_cast<int>(setup.kv_lens.size());
    for (const bool fixed : {false, true}) {
      const Plan plain = setup.plan(fixed ? capacity : PlanCapacity{});
      DeviceBuffer workspace(plain.workspace_bytes);
      const Workspace ws{workspace.data(), workspace.bytes()};
      // Plain run (uploads itself).
      setup.poison(s);
      run_decode(plain, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
                 setup.lse_view(batch), ws, s);
      CUDA_OK(cudaStreamSynchronize(s));
      const std::vector<unsigned char> o_plain = setup.o.download<unsigned char>();
      // upload_plan + run.
      Plan uploaded = plain;
      upload_plan(uploaded, ws, s);
      setup.poison(s);
      run_decode(uploaded, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
                 setup.lse_view(batch), ws, s);
      CUDA_OK(cudaStreamSynchronize(s));
      ASSERT_EQ(setup.o.download<unsigned char>(), o_plain) << "step " << step;
      std::mt19937_64 pick(step);
      ASSERT_EQ(setup.check(s, rows_to_check(pick, step, int64_t{batch} * S::kQoHeads)), "");

      // Stale: another plan (a one-request batch) uploaded into the workspace since; run with
      // the first plan must upload again rather than use the other plan's lists.
      if (fixed) {
        Plan other = S::other_plan(capacity);
        upload_plan(other, ws, s);
        setup.poison(s);
        run_decode(uploaded, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
                   setup.lse_view(batch), ws, s);
        CUDA_OK(cudaStreamSynchronize(s));
        ASSERT_EQ(setup.o.download<unsigned char>(), o_plain)
            << "stale upload, step " << step;
      }
    }
  }
}

TEST(CudaGraph, ForgetUploadsMakesTheNextRunUploadAgain) {
  // A workspace overwritten behind the library's back (as freed memory handed out again would
  // be): after forget_uploads the run copies the plan's lists again instead of trusting them.
  TESSERA_SKIP_WITHOUT_GPU();
  DecodeSetup setup(base_seed() + 3);
  Stream stream;
  const cudaStream_t s = stream.get();
  setup.set_batch({700, 33, 2048, 1}, s);
  const int batch = static_cast<int>(setup.kv_lens.size());
  Plan plan = setup.plan({});
  DeviceBuffer workspace(plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  upload_plan(plan, ws, s);
  setup.poison(s);
  run_decode(plan, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
             setup.lse_view(batch), ws, s);
  CUDA_OK(cudaStreamSynchronize(s));
  const std::vector<unsigned char> expected = setup.o.download<unsigned char>();
  CUDA_OK(cudaMemsetAsync(workspace.data(), 0xff, workspace.bytes(), s));
  forget_uploads(ws.data);
  setup.poison(s);
  run_decode(plan, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
             setup.lse_view(batch), ws, s);
  CUDA_OK(cudaStreamSynchronize(s));
  ASSERT_EQ(setup.o.download<unsigned char>(), expected);
  std::mt19937_64 pick(3);
  EXPECT_EQ(setup.check(s, rows_to_check(pick, 0, int64_t{batch} * DecodeSetup::kQoHeads)), "");
}

// More uploads in flight than the pinned staging pool holds (the stream held back 1.5 s by a
// host function while the host queues alternating uploads of two plans into one workspace): the
// uploads beyond the pool go through pageable memory, the host never waits for the stream, and
// the last run reads its own plan's lists.
TEST(CudaGraph, UploadsBeyondTheStagingPoolGoThroughPageableMemory) {
  TESSERA_SKIP_WITHOUT_GPU();
  using S = DecodeSetup;
  DecodeSetup setup(base_seed() + 3);
  Stream stream;
  const cudaStream_t s = stream.get();
  setup.set_batch(random_decode_lengths(setup.rng, 1), s);
  const int batch = static_cast<int>(setup.kv_lens.size());
  const Plan plan = setup.plan(PlanCapacity{});
  const Plan other = S::other_plan(PlanCapacity{});
  DeviceBuffer workspace(std::max(plan.workspace_bytes, other.workspace_bytes));
  const Workspace ws{workspace.data(), workspace.bytes()};
  setup.poison(s);
  run_decode(plan, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
             setup.lse_view(batch), ws, s);
  CUDA_OK(cudaStreamSynchronize(s));
  const std::vector<unsigned char> expected = setup.o.download<unsigned char>();

  const uint64_t overflow_before = detail::cuda_staging_overflow_uploads();
  const auto hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); };
  CUDA_OK(cudaLaunchHostFunc(s, hold, nullptr));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 80; ++i) {
    Plan copy = other;
    upload_plan(copy, ws, s);  // overwrites the lists: the run below uploads its own again
    run_decode(plan, setup.q_view(batch), setup.cache(batch), setup.o_view(batch),
               setup.lse_view(batch), ws, s);
  }
  const double queued_ms = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - start)
                               .count();
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_GT(detail::cuda_staging_overflow_uploads(), overflow_before);
  EXPECT_LT(queued_ms, 1000.0) << "the host waited for the held-back stream";
  ASSERT_EQ(setup.o.download<unsigned char>(), expected);
}

TEST(CudaGraph, UploadDuringCaptureIsRefusedAndLegacyCaptureStillWorks) {
  TESSERA_SKIP_WITHOUT_GPU();
  DecodeSetup setup(base_seed() + 2);
  Stream stream;
  const cudaStream_t s = stream.get();
  setup.set_batch({100, 2000, 37}, s);
  const Plan plan = setup.plan({});  // not uploaded: run uploads it inside the capture
  DeviceBuffer workspace(plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  CUDA_OK(cudaStreamSynchronize(s));
  Graph graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  std::string upload_message, run_message;
  Plan copy = plan;
  try {
    upload_plan(copy, ws, s);
  } catch (const Error& e) {
    upload_message = e.what();
  }
  try {
    run_decode(plan, setup.q_view(3), setup.cache(3), setup.o_view(3), setup.lse_view(3), ws, s);
  } catch (const std::exception& e) {
    run_message = e.what();
  }
  CUDA_OK(cudaStreamEndCapture(s, &graph.graph));
  EXPECT_NE(upload_message.find("captured"), std::string::npos) << upload_message;
  ASSERT_EQ(run_message, "") << "legacy capture (run uploading the plan itself)";
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  setup.poison(s);
  CUDA_OK(cudaGraphLaunch(graph.exec, s));
  std::mt19937_64 pick(7);
  EXPECT_EQ(setup.check(s, rows_to_check(pick, 0, 3 * DecodeSetup::kQoHeads)), "");
}

TEST(CudaGraph, StreamCaptureIdNamesEachCapture) {
  TESSERA_SKIP_WITHOUT_GPU();
  Stream stream;
  const cudaStream_t s = stream.get();
  EXPECT_EQ(cuda_stream_capture_id(s), 0u);
  uint64_t ids[2] = {0, 0};
  for (uint64_t& id : ids) {
    Graph graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    id = cuda_stream_capture_id(s);
    const uint64_t again = cuda_stream_capture_id(s);
    CUDA_OK(cudaStreamEndCapture(s, &graph.graph));
    EXPECT_NE(id, 0u);
    EXPECT_EQ(again, id);
    EXPECT_EQ(cuda_stream_capture_id(s), 0u);
  }
  EXPECT_NE(ids[0], ids[1]);
}


#endif  // TESSERA_HAVE_CUDA

}  // namespace
}  // namespace tessera
