// Streams sharing one library state (issue 38 item 2): 4 host threads, each with its own
// non-blocking cudaStream_t, plan and run 1,000 mixed cases in all (250 per stream): ragged
// prefill, paged prefill (pages of 1, 16, 64 or any size) and decode (1..4 queries per request,
// fp8 K/V too), fp16 and bf16, GQA 1..8 and 16, masks, soft caps, sinks, strides, PDL on some.
// The threads plan concurrently (first touch of the kernel registry, the device table and the
// tuning file among them), upload half the plans with upload_plan (the pinned staging pool and
// the upload registry shared by all streams) and let run() upload the rest, and queue a batch
// of runs on their stream before reading any back, so the streams' kernels overlap. Every
// output and workspace is poisoned (NaN) before its run; every result is compared with the CPU
// reference (relative L2 < 1e-2 over o, lse within the default tolerance).
//
// Without a CUDA device every test skips (exit 77 under ctest). TESSERA_TEST_REDUCED=1 runs 40
// cases per stream; TESSERA_TEST_SEED varies the random cases.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::AttentionBuffers;
using test::AttentionCase;
using test::chance;
using test::kGpu;
using test::Outputs;
using test::uniform;

constexpr int kStreams = 4;
constexpr int kBatch = 8;  // runs queued on a stream before the first is read back
constexpr double kOutputTolerance = 1e-2;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// A device copy of one host vector, allocated, filled and freed in the order of `stream`.
class StreamBuffer {
 public:
  StreamBuffer(const void* host, size_t bytes, cudaStream_t stream)
      : bytes_(bytes), stream_(stream) {
    if (bytes_ == 0) return;
    check(cudaMallocAsync(&data_, bytes_, stream_), "cudaMallocAsync");
    check(cudaMemcpyAsync(data_, host, bytes_, cudaMemcpyHostToDevice, stream_),
          "cudaMemcpyAsync (to the device)");
  }
  template <class T>
  StreamBuffer(const std::vector<T>& host, cudaStream_t stream)
      : StreamBuffer(host.data(), host.size() * sizeof(T), stream) {}
  // `bytes` of `byte` (0xff: NaN in every float format).
  StreamBuffer(size_t bytes, int byte, cudaStream_t stream) : bytes_(bytes), stream_(stream) {
    if (bytes_ == 0) return;
    check(cudaMallocAsync(&data_, bytes_, stream_), "cudaMallocAsync");
    check(cudaMemsetAsync(data_, byte, bytes_, stream_), "cudaMemsetAsync");
  }
  ~StreamBuffer() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;

  void* data() const { return data_; }
  // Pageable destination: returns once the copy is done (after the stream's earlier work).
  template <class T>
  void download(std::vector<T>& host) const {
    if (bytes_ == 0) return;
    check(cudaMemcpyAsync(host.data(), data_, bytes_, cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (to the host)");
  }

 private:
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  void* data_ = nullptr;
};

// A random case of op `kind` (0 ragged prefill, 1 paged prefill, 2 decode) the CUDA backend
// serves, small enough for the double reference.
AttentionCase stream_case(std::mt19937_64& rng, int kind) {
  test::RandomCaseOptions limits;
  limits.max_batch = 4;
  limits.max_q_len = 96;
  limits.max_kv_len = 400;
  limits.q_dtypes = {DType::kFloat16, DType::kBFloat16};
  limits.allow_fp8_kv = kind == 2;  // fp8 K/V: decode only
  limits.allow_paged = false;       // set below
  limits.max_reference_macs = 4'000'000;
  AttentionCase c = test::random_case(rng, limits);
  if (kind == 2 && chance(rng, 0.1)) c.num_qo_heads = c.num_kv_heads * 16;
  c.uniform_q = kind == 2;
  if (c.uniform_q) {
    const int32_t q = uniform(rng, 1, 4);
    for (int32_t& len : c.q_lens) len = q;
  }
  c.paged = kind != 0;
  if (c.paged) {
    const int32_t page_kind = uniform(rng, 0, 3);
    c.page_size = page_kind == 0   ? 1
                  : page_kind == 1 ? 16
                  : page_kind == 2 ? 64
                                   : uniform(rng, 1, 128);
    c.layout = chance(rng, 0.5) ? KVLayout::kNHD : KVLayout::kHND;
    c.spare_pages = uniform(rng, 0, 3);
  }
  if (kind != 2) {
    // CUDA prefill copies 16-byte rows: strides are multiples of 8 elements (test_api_sweep).
    for (int32_t* pad : {&c.q_head_pad, &c.q_token_pad, &c.o_head_pad, &c.o_token_pad,
                         &c.kv_head_pad, &c.kv_token_pad}) {
      *pad = (*pad + 7) / 8 * 8;
    }
  }
  c.with_sinks = chance(rng, 0.15);
  auto macs = [&] {
    int64_t sum = 0;
    for (int32_t b = 0; b < c.batch_size(); ++b) sum += int64_t{c.q_lens[b]} * c.kv_lens[b];
    return sum * c.num_qo_heads * c.head_dim;
  };
  while (macs() > limits.max_reference_macs) {  // GQA 16 may have raised it
    for (int32_t& len : c.kv_lens) len /= 2;
  }
  return c;
}

// One case in flight on a stream: its host data and reference, its plan, its device copies.
struct InFlight {
  AttentionBuffers buffers;
  Outputs expected;
  Plan plan;
  bool pdl = false;
  std::vector<std::unique_ptr<StreamBuffer>> device;  // freed in the stream's order
  StreamBuffer* o = nullptr;
  StreamBuffer* lse = nullptr;
  void* workspace = nullptr;
};

// Copies the case to the device on `stream` (outputs NaN, workspace 0xff), uploads the plan or
// leaves that to run(), and queues the run. Returns without waiting.
void launch(InFlight& f, cudaStream_t stream, bool upload) {
  AttentionBuffers& b = f.buffers;
  const AttentionCase& c = b.test_case;
  test::poison_outputs(b);
  auto copy = [&](const auto& host) {
    f.device.push_back(std::make_unique<StreamBuffer>(host, stream));
    return f.device.back().get();
  };
  StreamBuffer* q = copy(b.q);
  StreamBuffer* k = copy(b.k);
  StreamBuffer* v = copy(b.v);
  f.o = copy(b.o);
  f.lse = copy(b.lse);
  StreamBuffer* qo_indptr = copy(b.qo_indptr);
  StreamBuffer* kv_indptr = copy(b.kv_indptr);
  StreamBuffer* page_indptr = copy(b.page_indptr);
  StreamBuffer* page_indices = copy(b.page_indices);
  StreamBuffer* last_page_len = copy(b.last_page_len);
  StreamBuffer* sinks = copy(b.sinks);
  f.device.push_back(std::make_unique<StreamBuffer>(f.plan.workspace_bytes, 0xff, stream));
  f.workspace = f.device.back()->data();
  const Workspace ws{f.workspace, f.plan.workspace_bytes};
  if (upload) upload_plan(f.plan, ws, stream);

  RunOptions options;
  options.enable_pdl = f.pdl;
  if (c.with_sinks) {
    options.sinks = make_view(sinks->data(), DType::kFloat32, {c.num_qo_heads}, kGpu);
  }
  const TensorView q_view =
      make_view(q->data(), c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                {b.q_stride_token, b.q_stride_head, 1}, kGpu);
  const TensorView o_view =
      make_view(f.o->data(), c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                {b.o_stride_token, b.o_stride_head, 1}, kGpu);
  const TensorView lse_view =
      c.with_lse ? make_view(f.lse->data(), DType::kFloat32, {c.total_q(), c.num_qo_heads},
                             {b.lse_stride_token, 1}, kGpu)
                 : TensorView{};
  auto index_view = [](StreamBuffer* buffer, size_t count) {
    return make_view(buffer->data(), DType::kInt32, {static_cast<int64_t>(count)}, kGpu);
  };
  PagedKVCache cache;
  if (c.paged) {
    cache.layout = c.layout;
    const bool nhd = c.layout == KVLayout::kNHD;
    for (auto [target, buffer] : {std::pair{&cache.k_cache, k}, {&cache.v_cache, v}}) {
      *target = nhd ? make_view(buffer->data(), c.kv_dtype,
                                {b.num_pages, c.page_size, c.num_kv_heads, c.head_dim},
                                {b.kv_stride_page, b.kv_stride_token, b.kv_stride_head, 1}, kGpu)
                    : make_view(buffer->data(), c.kv_dtype,
                                {b.num_pages, c.num_kv_heads, c.page_size, c.head_dim},
                                {b.kv_stride_page, b.kv_stride_head, b.kv_stride_token, 1}, kGpu);
    }
    cache.page_indptr = index_view(page_indptr, b.page_indptr.size());
    cache.page_indices = index_view(page_indices, b.page_indices.size());
    cache.last_page_len = index_view(last_page_len, b.last_page_len.size());
  }
  switch (test::op_of(c)) {
    case AttentionOp::kRaggedPrefill: {
      const TensorView k_view =
          make_view(k->data(), c.kv_dtype, {c.total_kv(), c.num_kv_heads, c.head_dim},
                    {b.kv_stride_token, b.kv_stride_head, 1}, kGpu);
      const TensorView v_view =
          make_view(v->data(), c.kv_dtype, {c.total_kv(), c.num_kv_heads, c.head_dim},
                    {b.kv_stride_token, b.kv_stride_head, 1}, kGpu);
      run_ragged_prefill(f.plan, q_view, k_view, v_view, index_view(qo_indptr, b.qo_indptr.size()),
                         index_view(kv_indptr, b.kv_indptr.size()), o_view, lse_view, ws, stream,
                         options);
      break;
    }
    case AttentionOp::kPagedPrefill:
      run_paged_prefill(f.plan, q_view, cache, index_view(qo_indptr, b.qo_indptr.size()), o_view,
                        lse_view, ws, stream, options);
      break;
    case AttentionOp::kDecode:
      run_decode(f.plan, q_view, cache, o_view, lse_view, ws, stream, options);
      break;
  }
}

// Reads the case's outputs back (waiting for its run) and compares them with the reference;
// "" when they match. Then frees its device copies in the stream's order.
std::string finish(InFlight& f) {
  AttentionBuffers& b = f.buffers;
  f.o->download(b.o);
  f.lse->download(b.lse);
  const test::Comparison result = test::compare_outputs(b, test::copy_outputs(b), f.expected);
  forget_uploads(f.workspace);  // before the free: the address may serve another plan next
  f.device.clear();
  if (result.ok(kOutputTolerance, test::default_lse_tolerance(b.test_case))) return {};
  return b.test_case.describe() + (f.pdl ? " pdl" : "") + "\n" + result.describe();
}

// What one stream's thread saw: mismatches (counted; the first few described) and the error
// that stopped it, if any.
struct StreamResult {
  int cases_run = 0;
  int mismatches = 0;
  std::vector<std::string> first_mismatches;
  std::string error;
};

// One host thread: its stream, `cases` mixed cases in batches of kBatch.
void stream_worker(int index, int cases, uint64_t seed, StreamResult& out) {
  cudaStream_t stream = nullptr;
  check(cudaSetDevice(kGpu.index), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::mt19937_64 rng(seed * 100 + static_cast<uint64_t>(index));
  for (int first = 0; first < cases; first += kBatch) {
    std::vector<InFlight> batch(static_cast<size_t>(std::min(kBatch, cases - first)));
    for (size_t i = 0; i < batch.size(); ++i) {
      InFlight& f = batch[i];
      const int kind = (first + static_cast<int>(i) + index) % 3;
      f.buffers = test::make_buffers(stream_case(rng, kind), rng);
      f.expected = test::run_reference(f.buffers);
      f.plan = test::plan_for(f.buffers, kGpu);  // planned on this thread, concurrently
      f.pdl = chance(rng, 0.25);
    }
    for (size_t i = 0; i < batch.size(); ++i) launch(batch[i], stream, i % 2 == 0);
    for (size_t i = 0; i < batch.size(); ++i) {
      std::string failure = finish(batch[i]);
      ++out.cases_run;
      if (failure.empty()) continue;
      ++out.mismatches;
      if (out.first_mismatches.size() < 5) {
        out.first_mismatches.push_back("stream " + std::to_string(index) + " case " +
                                       std::to_string(first + static_cast<int>(i)) + ": " +
                                       failure);
      }
    }
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
}

TEST(CudaStreams, FourStreamsOfMixedPlansMatchTheReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  const int per_stream = test::reduced_run() ? 40 : 250;
  const uint64_t seed = test::seed_from_env(3802);
  std::vector<StreamResult> results(kStreams);
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      try {
        stream_worker(s, per_stream, seed, results[s]);
      } catch (const std::exception& error) {
        results[s].error = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int s = 0; s < kStreams; ++s) {
    const StreamResult& r = results[s];
    EXPECT_EQ(r.error, "") << "stream " << s << " stopped after " << r.cases_run << " cases";
    EXPECT_EQ(r.cases_run, per_stream) << "stream " << s;
    EXPECT_EQ(r.mismatches, 0) << "of " << r.cases_run << " cases on stream " << s;
    for (const std::string& failure : r.first_mismatches) ADD_FAILURE() << failure;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaStreams, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
