// Faults on the GPU (issue 38 item 4; docs/RELIABILITY.md, "Faults"): device memory exhausted
// during plan, upload_plan, run, a one-shot call and checked mode; a stream being captured into
// a CUDA graph on the paths that synchronise (one-shot calls, checked mode, upload_plan); a
// cudaDeviceReset between plan and run. Each case checks the error's kind and text, that the
// outputs were not written, and that the next valid call gives the CPU reference's answer.
//
// Written without a GPU (2026-12-07) and not yet run on one. Without a CUDA device every test
// skips (exit 77 under ctest). The reset test runs last: it destroys the device's context.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_graph_support.hpp"
#include "common/gpu_test_support.hpp"
#include "common/validation_fixture.hpp"
#include "core/half.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::CudaGraph;
using test::CudaStream;
using test::DeviceBuffer;
using test::kGpu;

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

using test::error_of;
using test::expect_contains;

// Decode of 2 requests (100 and 37 keys over shuffled pages of 16), GQA 8:2, head_dim 128,
// fp16; the expected output from the CPU backend on the same fp16 values. Device buffers can be
// made again (after a device reset).
struct DecodeCase {
  static constexpr int kQoHeads = 8, kKvHeads = 2, kHeadDim = 128, kPageSize = 16;
  static constexpr int kBatch = 2, kPages = 10;
  const std::vector<int32_t> page_indptr{0, 7, 10}, last_page_len{4, 5};
  std::vector<int32_t> page_indices{9, 3, 7, 1, 5, 0, 8, 2, 6, 4};
  std::vector<uint16_t> q, k, v;
  std::vector<uint16_t> o_expected;
  std::vector<float> lse_expected;
  std::unique_ptr<DeviceBuffer> q_d, k_d, v_d, indptr_d, indices_d, last_d, o_d, lse_d;

  DecodeCase() {
    q = pattern(kBatch * kQoHeads * kHeadDim, 1);
    k = pattern(kPages * kPageSize * kKvHeads * kHeadDim, 2);
    v = pattern(kPages * kPageSize * kKvHeads * kHeadDim, 3);
    o_expected.assign(q.size(), 0);
    lse_expected.assign(kBatch * kQoHeads, 0.0f);
    PagedKVCache cache;
    cache.k_cache = make_view(k.data(), DType::kFloat16, {kPages, kPageSize, kKvHeads, kHeadDim});
    cache.v_cache = make_view(v.data(), DType::kFloat16, {kPages, kPageSize, kKvHeads, kHeadDim});
    cache.page_indptr = make_view(const_cast<int32_t*>(page_indptr.data()), DType::kInt32, {3});
    cache.page_indices = make_view(page_indices.data(), DType::kInt32, {kPages});
    cache.last_page_len = make_view(const_cast<int32_t*>(last_page_len.data()), DType::kInt32, {2});
    decode(make_view(q.data(), DType::kFloat16, {kBatch, kQoHeads, kHeadDim}), cache,
           make_view(o_expected.data(), DType::kFloat16, {kBatch, kQoHeads, kHeadDim}),
           make_view(lse_expected.data(), DType::kFloat32, {kBatch, kQoHeads}));
    allocate();
  }

  static std::vector<uint16_t> pattern(size_t count, int seed) {
    std::vector<uint16_t> values(count);
    for (size_t i = 0; i < count; ++i) {
      detail::store_from_float(values.data(), DType::kFloat16, static_cast<int64_t>(i),
                               std::sin(0.37f * static_cast<float>(i) + 1.3f * seed));
    }
    return values;
  }

  void allocate() {
    q_d = std::make_unique<DeviceBuffer>(q);
    k_d = std::make_unique<DeviceBuffer>(k);
    v_d = std::make_unique<DeviceBuffer>(v);
    indptr_d = std::make_unique<DeviceBuffer>(page_indptr);
    indices_d = std::make_unique<DeviceBuffer>(page_indices);
    last_d = std::make_unique<DeviceBuffer>(last_page_len);
    o_d = std::make_unique<DeviceBuffer>(q.size() * sizeof(uint16_t));
    lse_d = std::make_unique<DeviceBuffer>(lse_expected.size() * sizeof(float));
  }

  Plan plan() const {
    return plan_decode(page_indptr, last_page_len, kPageSize, kQoHeads, kKvHeads, kHeadDim, {},
                       kGpu);
  }
  TensorView q_view() const {
    return test::gpu_view(*q_d, DType::kFloat16, {kBatch, kQoHeads, kHeadDim},
                          {kQoHeads * kHeadDim, kHeadDim, 1});
  }
  TensorView o_view() const {
    return test::gpu_view(*o_d, DType::kFloat16, {kBatch, kQoHeads, kHeadDim},
                          {kQoHeads * kHeadDim, kHeadDim, 1});
  }
  TensorView lse_view() const {
    return test::gpu_view(*lse_d, DType::kFloat32, {kBatch, kQoHeads}, {kQoHeads, 1});
  }
  PagedKVCache cache() const {
    PagedKVCache cache;
    const int64_t page = kPageSize * kKvHeads * kHeadDim;
    cache.k_cache = test::gpu_view(*k_d, DType::kFloat16, {kPages, kPageSize, kKvHeads, kHeadDim},
                                   {page, kKvHeads * kHeadDim, kHeadDim, 1});
    cache.v_cache = test::gpu_view(*v_d, DType::kFloat16, {kPages, kPageSize, kKvHeads, kHeadDim},
                                   {page, kKvHeads * kHeadDim, kHeadDim, 1});
    cache.page_indptr = test::gpu_index_view(*indptr_d, 3);
    cache.page_indices = test::gpu_index_view(*indices_d, kPages);
    cache.last_page_len = test::gpu_index_view(*last_d, 2);
    return cache;
  }

  // o and lse set to all-ones bytes (NaN in fp16 and fp32), synchronously.
  void poison(cudaStream_t stream = nullptr) const {
    ASSERT_EQ(cudaMemsetAsync(o_d->data(), 0xff, o_d->bytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(lse_d->data(), 0xff, lse_d->bytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  // True when every byte of o and lse is still 0xff.
  bool untouched() const {
    for (const auto& buffer : {o_d.get(), lse_d.get()}) {
      for (const unsigned char byte : buffer->download<unsigned char>()) {
        if (byte != 0xff) return false;
      }
    }
    return true;
  }
  // "" when o and lse match the CPU's, else the first difference.
  std::string check() const {
    const std::vector<uint16_t> o = o_d->download<uint16_t>();
    const std::vector<float> lse = lse_d->download<float>();
    for (size_t i = 0; i < o.size(); ++i) {
      const float got = detail::load_as_float(o.data(), DType::kFloat16, static_cast<int64_t>(i));
      const float want =
          detail::load_as_float(o_expected.data(), DType::kFloat16, static_cast<int64_t>(i));
      if (!(std::fabs(got - want) <= 1e-2f)) {
        return "o[" + std::to_string(i) + "] = " + std::to_string(got) + ", expected " +
               std::to_string(want);
      }
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      if (!(std::fabs(lse[i] - lse_expected[i]) <= 1e-2f)) {
        return "lse[" + std::to_string(i) + "] = " + std::to_string(lse[i]) + ", expected " +
               std::to_string(lse_expected[i]);
      }
    }
    return {};
  }
};

// Takes device memory with cudaMalloc, halving the request on each failure down to 256 bytes,
// until not even that can be had; frees it all when destroyed. The test's own failed cudaMalloc
// calls leave an error for cudaGetLastError, cleared here so that only the library's count.
class DeviceMemoryHog {
 public:
  DeviceMemoryHog() {
    for (size_t bytes = size_t{1} << 30; bytes >= 256;) {
      void* block = nullptr;
      if (cudaMalloc(&block, bytes) == cudaSuccess) {
        blocks_.push_back(block);
      } else {
        bytes /= 2;
      }
    }
    (void)cudaGetLastError();
  }
  ~DeviceMemoryHog() { release(); }
  void release() {
    for (void* block : blocks_) cudaFree(block);
    blocks_.clear();
  }
  DeviceMemoryHog(const DeviceMemoryHog&) = delete;
  DeviceMemoryHog& operator=(const DeviceMemoryHog&) = delete;

 private:
  std::vector<void*> blocks_;
};

// With every byte of device memory taken: plan (host only) and run with a workspace allocated
// beforehand still work (they allocate nothing), upload_plan too (pinned host staging); the
// one-shot call, whose workspace is its own, and checked mode, whose scan needs a buffer, fail
// with kOutOfMemory naming what they could not allocate, write nothing, and leave no CUDA error
// behind: once memory is free again the same calls give the reference's answer.
TEST(CudaFaults, OutOfDeviceMemory) {
  TESSERA_SKIP_WITHOUT_GPU();
  DecodeCase c;
  const Plan warm = c.plan();
  // Warm-up outside the fault: kernels loaded (lazy module loading allocates device memory),
  // staging pool filled, one-shot path exercised once.
  ASSERT_NO_THROW(decode(c.q_view(), c.cache(), c.o_view(), c.lse_view()));
  ASSERT_EQ(c.check(), "");
  DeviceBuffer workspace(warm.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};

  DeviceMemoryHog hog;
  c.poison();
  const size_t one_shot_bytes = warm.workspace_bytes;
  const std::string message = error_of(
      [&] { decode(c.q_view(), c.cache(), c.o_view(), c.lse_view()); }, Error::Kind::kOutOfMemory);
  expect_contains(message, "tessera::decode: 'workspace'");
  expect_contains(message, std::to_string(one_shot_bytes) + " bytes could not be allocated");
  expect_contains(message, "cudaErrorMemoryAllocation");
  EXPECT_TRUE(c.untouched()) << "a failed one-shot call wrote its outputs";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed cudaMalloc was left pending";

  // The C ABI reports it as TESSERA_ERROR_OUT_OF_MEMORY with the same text.
  {
    DLTensor q{}, o{}, lse{};
    int64_t q_shape[3] = {DecodeCase::kBatch, DecodeCase::kQoHeads, DecodeCase::kHeadDim};
    int64_t lse_shape[2] = {DecodeCase::kBatch, DecodeCase::kQoHeads};
    for (DLTensor* t : {&q, &o}) {
      t->ndim = 3;
      t->shape = q_shape;
      t->dtype = DLDataType{kDLFloat, 16, 1};
      t->device = DLDevice{kDLCUDA, 0};
    }
    q.data = c.q_d->data();
    o.data = c.o_d->data();
    lse.ndim = 2;
    lse.shape = lse_shape;
    lse.dtype = DLDataType{kDLFloat, 32, 1};
    lse.device = DLDevice{kDLCUDA, 0};
    lse.data = c.lse_d->data();
    int64_t page_shape[4] = {DecodeCase::kPages, DecodeCase::kPageSize, DecodeCase::kKvHeads,
                             DecodeCase::kHeadDim};
    int64_t indptr_shape[1] = {3}, indices_shape[1] = {DecodeCase::kPages}, last_shape[1] = {2};
    DLTensor k{}, v{}, indptr{}, indices{}, last{};
    for (DLTensor* t : {&k, &v}) {
      t->ndim = 4;
      t->shape = page_shape;
      t->dtype = DLDataType{kDLFloat, 16, 1};
      t->device = DLDevice{kDLCUDA, 0};
    }
    k.data = c.k_d->data();
    v.data = c.v_d->data();
    const std::pair<DLTensor*, std::pair<int64_t*, void*>> index_arrays[] = {
        {&indptr, {indptr_shape, c.indptr_d->data()}},
        {&indices, {indices_shape, c.indices_d->data()}},
        {&last, {last_shape, c.last_d->data()}}};
    for (const auto& [t, shape_data] : index_arrays) {
      t->ndim = 1;
      t->shape = shape_data.first;
      t->data = shape_data.second;
      t->dtype = DLDataType{kDLInt, 32, 1};
      t->device = DLDevice{kDLCUDA, 0};
    }
    const tessera_paged_kv kv{&k, &v, &indptr, &indices, &last, TESSERA_KV_LAYOUT_NHD};
    EXPECT_EQ(tessera_decode(&q, &kv, &o, &lse, nullptr, nullptr), TESSERA_ERROR_OUT_OF_MEMORY);
    expect_contains(tessera_last_error(), "'workspace'");
    EXPECT_TRUE(c.untouched());
  }

  // Plan, upload and run need no device memory of their own.
  Plan plan;
  ASSERT_NO_THROW(plan = c.plan());
  ASSERT_NO_THROW(upload_plan(plan, ws, nullptr));
  ASSERT_NO_THROW(run_decode(plan, c.q_view(), c.cache(), c.o_view(), c.lse_view(), ws, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(c.check(), "") << "run under exhausted memory";

  // Checked mode's scan buffer.
  c.poison();
  set_index_checking(true);
  const std::string checked = error_of(
      [&] { run_decode(plan, c.q_view(), c.cache(), c.o_view(), c.lse_view(), ws, nullptr); },
      Error::Kind::kOutOfMemory);
  set_index_checking(false);
  expect_contains(checked, "cudaMalloc of ");
  expect_contains(checked, "cudaErrorMemoryAllocation");
  EXPECT_TRUE(c.untouched()) << "a failed checked-mode run wrote its outputs";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  hog.release();
  c.poison();
  ASSERT_NO_THROW(decode(c.q_view(), c.cache(), c.o_view(), c.lse_view()));
  EXPECT_EQ(c.check(), "") << "one-shot call after memory was freed";
  c.poison();
  set_index_checking(true);
  EXPECT_NO_THROW(run_decode(plan, c.q_view(), c.cache(), c.o_view(), c.lse_view(), ws, nullptr));
  set_index_checking(false);
  EXPECT_EQ(c.check(), "") << "checked run after memory was freed";
}

// A stream being captured (global mode, the strictest): the one-shot call, checked mode and
// upload_plan each refuse it naming 'stream' before any CUDA call, so the capture stays valid;
// a plain run_* of a plan uploaded beforehand is then captured, and the graph replays it.
TEST(CudaFaults, CapturingStreamOnTheSynchronisingPaths) {
  TESSERA_SKIP_WITHOUT_GPU();
  DecodeCase c;
  CudaStream stream;
  const cudaStream_t s = stream.get();
  ASSERT_NE(s, nullptr);
  Plan plan = c.plan();
  DeviceBuffer workspace(plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  ASSERT_NO_THROW(decode(c.q_view(), c.cache(), c.o_view(), c.lse_view(), {}, s));  // warm-up
  ASSERT_NO_THROW(upload_plan(plan, ws, s));
  CUDA_OK(cudaStreamSynchronize(s));
  c.poison();

  CudaGraph graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const std::string one_shot =
      error_of([&] { decode(c.q_view(), c.cache(), c.o_view(), c.lse_view(), {}, s); },
               Error::Kind::kInvalidArgument);
  set_index_checking(true);
  const std::string checked =
      error_of([&] { run_decode(plan, c.q_view(), c.cache(), c.o_view(), c.lse_view(), ws, s); },
               Error::Kind::kInvalidArgument);
  set_index_checking(false);
  Plan copy = plan;
  const std::string upload =
      error_of([&] { upload_plan(copy, ws, s); }, Error::Kind::kInvalidArgument);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(s, &status);
  std::string captured_run;
  try {
    run_decode(plan, c.q_view(), c.cache(), c.o_view(), c.lse_view(), ws, s);
  } catch (const std::exception& error) {
    captured_run = error.what();
  }
  const cudaError_t ended = cudaStreamEndCapture(s, &graph.graph);

  expect_contains(one_shot, "tessera::decode: 'stream': is being captured into a CUDA graph");
  expect_contains(one_shot, "the capture is still valid");
  expect_contains(checked, "tessera::run_decode: 'stream': is being captured");
  expect_contains(checked, "checked mode");
  expect_contains(upload, "captured");
  EXPECT_EQ(query, cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "a refused call invalidated the capture";
  EXPECT_EQ(captured_run, "");
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorName(ended);
  EXPECT_TRUE(c.untouched()) << "a refused call wrote its outputs";
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  CUDA_OK(cudaGraphLaunch(graph.exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(c.check(), "") << "replay of the capture the refused calls left";
  // Outside the capture the one-shot call and checked mode work on the same stream.
  c.poison();
  set_index_checking(true);
  EXPECT_NO_THROW(decode(c.q_view(), c.cache(), c.o_view(), c.lse_view(), {}, s));
  set_index_checking(false);
  EXPECT_EQ(c.check(), "");
}

// cudaDeviceReset between plan and run frees every allocation and forgets the context's
// function attributes. Documented recovery: cuda_after_device_reset(device), new tensors and
// workspace; the plan made (and uploaded) before the reset then runs right, and so do the
// one-shot calls (prefill with head_dim 128 takes a kernel that opts into more than 48 KiB of
// shared memory on sm_90, which a reset forgets). Last in the file: it resets the device.
TEST(CudaFaults, ZzDeviceResetBetweenPlanAndRun) {
  TESSERA_SKIP_WITHOUT_GPU();
  DecodeCase c;
  const Plan plan = c.plan();
  Plan uploaded = plan;
  auto workspace = std::make_unique<DeviceBuffer>(plan.workspace_bytes);
  const void* old_address = workspace->data();
  ASSERT_NO_THROW(upload_plan(uploaded, {workspace->data(), workspace->bytes()}, nullptr));
  ASSERT_NO_THROW(run_decode(uploaded, c.q_view(), c.cache(), c.o_view(), c.lse_view(),
                             {workspace->data(), workspace->bytes()}, nullptr));
  ASSERT_EQ(c.check(), "");
  // A prefill one-shot call too (the smem opt-in of its kernel is made before the reset).
  constexpr int kQ = 64, kKv = 200, kHeads = 8, kKvHeads = 2, kDim = 128;
  const std::vector<uint16_t> q_host = DecodeCase::pattern(kQ * kHeads * kDim, 4);
  const std::vector<uint16_t> k_host = DecodeCase::pattern(kKv * kKvHeads * kDim, 5);
  const std::vector<uint16_t> v_host = DecodeCase::pattern(kKv * kKvHeads * kDim, 6);
  std::vector<uint16_t> o_expected(q_host.size());
  std::vector<int32_t> qo_indptr{0, kQ}, kv_indptr{0, kKv};
  std::vector<uint16_t> q_copy = q_host, k_copy = k_host, v_copy = v_host;
  ragged_prefill(make_view(q_copy.data(), DType::kFloat16, {kQ, kHeads, kDim}),
                 make_view(k_copy.data(), DType::kFloat16, {kKv, kKvHeads, kDim}),
                 make_view(v_copy.data(), DType::kFloat16, {kKv, kKvHeads, kDim}),
                 make_view(qo_indptr.data(), DType::kInt32, {2}),
                 make_view(kv_indptr.data(), DType::kInt32, {2}),
                 make_view(o_expected.data(), DType::kFloat16, {kQ, kHeads, kDim}));
  const auto prefill_on_gpu = [&]() -> std::string {
    DeviceBuffer q(q_host), k(k_host), v(v_host), qo(qo_indptr), kv(kv_indptr);
    DeviceBuffer o(o_expected.size() * sizeof(uint16_t));
    const int64_t row = kHeads * kDim, kv_row = kKvHeads * kDim;
    try {
      ragged_prefill(test::gpu_view(q, DType::kFloat16, {kQ, kHeads, kDim}, {row, kDim, 1}),
                     test::gpu_view(k, DType::kFloat16, {kKv, kKvHeads, kDim}, {kv_row, kDim, 1}),
                     test::gpu_view(v, DType::kFloat16, {kKv, kKvHeads, kDim}, {kv_row, kDim, 1}),
                     test::gpu_index_view(qo, 2), test::gpu_index_view(kv, 2),
                     test::gpu_view(o, DType::kFloat16, {kQ, kHeads, kDim}, {row, kDim, 1}));
    } catch (const Error& error) {
      return error.what();
    }
    const std::vector<uint16_t> got = o.download<uint16_t>();
    for (size_t i = 0; i < got.size(); ++i) {
      const float a = detail::load_as_float(got.data(), DType::kFloat16, static_cast<int64_t>(i));
      const float b =
          detail::load_as_float(o_expected.data(), DType::kFloat16, static_cast<int64_t>(i));
      if (!(std::fabs(a - b) <= 1e-2f)) return "prefill o[" + std::to_string(i) + "] differs";
    }
    return {};
  };
  ASSERT_EQ(prefill_on_gpu(), "");

  // The reset: every device pointer above is now dangling; the buffers are dropped without
  // freeing them (their memory went with the context; a leak of a few host objects).
  (void)c.q_d.release();
  (void)c.k_d.release();
  (void)c.v_d.release();
  (void)c.indptr_d.release();
  (void)c.indices_d.release();
  (void)c.last_d.release();
  (void)c.o_d.release();
  (void)c.lse_d.release();
  (void)workspace.release();
  CUDA_OK(cudaDeviceReset());

  EXPECT_EQ(tessera_cuda_after_device_reset(cuda_device_count()), TESSERA_ERROR_INVALID_ARGUMENT);
  expect_contains(tessera_last_error(), "'device'");
  ASSERT_EQ(tessera_cuda_after_device_reset(0), TESSERA_OK) << tessera_last_error();
  c.allocate();
  workspace = std::make_unique<DeviceBuffer>(plan.workspace_bytes);
  std::printf("workspace before the reset at %p, after at %p%s\n", old_address, workspace->data(),
              old_address == workspace->data() ? " (the same address)" : "");
  c.poison();
  // The plan uploaded before the reset (its record names a workspace address that may be the
  // new workspace's): run must upload it again.
  ASSERT_NO_THROW(run_decode(uploaded, c.q_view(), c.cache(), c.o_view(), c.lse_view(),
                             {workspace->data(), workspace->bytes()}, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(c.check(), "") << "the pre-reset plan after recovery";
  // upload_plan (its staging buffers went with the old context) and the one-shot calls.
  c.poison();
  Plan again = plan;
  ASSERT_NO_THROW(upload_plan(again, {workspace->data(), workspace->bytes()}, nullptr));
  ASSERT_NO_THROW(run_decode(again, c.q_view(), c.cache(), c.o_view(), c.lse_view(),
                             {workspace->data(), workspace->bytes()}, nullptr));
  EXPECT_EQ(c.check(), "");
  c.poison();
  ASSERT_NO_THROW(decode(c.q_view(), c.cache(), c.o_view(), c.lse_view()));
  EXPECT_EQ(c.check(), "");
  EXPECT_EQ(prefill_on_gpu(), "") << "prefill after the reset (shared-memory opt-in again)";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaFaults, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
