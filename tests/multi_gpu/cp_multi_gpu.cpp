// Multi-GPU check of context-parallel prefill over NCCL (issue 8): for N = 2, 4, 8 (those that
// fit the visible GPUs) one process drives N GPUs, one thread per rank, with communicators from
// ncclCommInitAll. It checks the N-rank result against the single-GPU ragged_prefill of the
// same sequence (bf16, relative L2 < 1e-2, no NaN), for the ring and the all-gather exchange,
// and with --scaling measures a causal prefill (default 131072 tokens, 32/8 heads, head_dim 128)
// on 1 GPU and on N GPUs, printing time and scaling efficiency T1 / (N * TN).
//
//   cp_multi_gpu [--scaling] [--seq-len L] [--iters I]
// Exit status: 0 pass, 1 failure, 77 skipped (fewer than 2 GPUs, no NCCL, or a CPU-only build).
// NCCL_NVLS_ENABLE=0 is set before any communicator is created.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tessera/backend.hpp"
#include "tessera/context_parallel.hpp"

#if !defined(TESSERA_HAVE_CUDA)
int main() {
  std::printf("SKIP: cp_multi_gpu needs a CUDA build of tessera (this build has no CUDA backend)\n");
  return 77;
}
#else
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "core/half.hpp"

namespace {

using namespace tessera;

#define CUDA_OK(call)                                                                   \
  do {                                                                                  \
    const cudaError_t status_ = (call);                                                 \
    if (status_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(status_));                                        \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

using CommInitAll = int (*)(void** comms, int ndev, const int* devlist);
using CommDestroy = int (*)(void* comm);

struct Problem {
  int64_t seq_len = 0;
  int hq = 32, hkv = 8, dim = 128;
  std::vector<uint16_t> q, k, v;  // bf16 bits, [seq_len, heads, dim]
};

Problem make_problem(int64_t seq_len, uint64_t seed) {
  Problem p;
  p.seq_len = seq_len;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill = [&](std::vector<uint16_t>& x, int heads) {
    x.resize(static_cast<size_t>(seq_len) * heads * p.dim);
    for (uint16_t& e : x) e = detail::float_to_bf16(normal(rng));
  };
  fill(p.q, p.hq);
  fill(p.k, p.hkv);
  fill(p.v, p.hkv);
  return p;
}

struct DeviceTensor {
  void* data = nullptr;
  size_t bytes = 0;
  explicit DeviceTensor(size_t n) : bytes(n) { CUDA_OK(cudaMalloc(&data, std::max<size_t>(n, 1))); }
  ~DeviceTensor() { cudaFree(data); }
};

TensorView device_view(void* data, DType dtype, std::initializer_list<int64_t> shape, int dev) {
  return make_view(data, dtype, shape, Device{DeviceType::kCUDA, dev});
}

// Single-GPU prefill of the whole sequence on device 0; returns o (bf16 bits) and the time.
std::vector<uint16_t> single_gpu(const Problem& p, int iters, double* ms) {
  CUDA_OK(cudaSetDevice(0));
  DeviceTensor q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(p.q.size() * 2);
  CUDA_OK(cudaMemcpy(q.data, p.q.data(), q.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(k.data, p.k.data(), k.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v.data, p.v.data(), v.bytes, cudaMemcpyHostToDevice));
  const std::vector<int32_t> indptr = {0, static_cast<int32_t>(p.seq_len)};
  DeviceTensor indptr_d(8);
  CUDA_OK(cudaMemcpy(indptr_d.data, indptr.data(), 8, cudaMemcpyHostToDevice));
  AttentionOptions options;
  options.causal = true;
  const Device dev{DeviceType::kCUDA, 0};
  Plan plan = plan_ragged_prefill(indptr, indptr, p.hq, p.hkv, p.dim, options, dev);
  DeviceTensor workspace(plan.workspace_bytes);
  const auto run = [&] {
    run_ragged_prefill(plan, device_view(q.data, DType::kBFloat16, {p.seq_len, p.hq, p.dim}, 0),
                       device_view(k.data, DType::kBFloat16, {p.seq_len, p.hkv, p.dim}, 0),
                       device_view(v.data, DType::kBFloat16, {p.seq_len, p.hkv, p.dim}, 0),
                       device_view(indptr_d.data, DType::kInt32, {2}, 0),
                       device_view(indptr_d.data, DType::kInt32, {2}, 0),
                       device_view(o.data, DType::kBFloat16, {p.seq_len, p.hq, p.dim}, 0), {},
                       {workspace.data, workspace.bytes}, nullptr);
  };
  run();
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  CUDA_OK(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) run();
  CUDA_OK(cudaEventRecord(stop));
  CUDA_OK(cudaEventSynchronize(stop));
  float total = 0;
  CUDA_OK(cudaEventElapsedTime(&total, start, stop));
  *ms = total / iters;
  std::vector<uint16_t> out(p.q.size());
  CUDA_OK(cudaMemcpy(out.data(), o.data, o.bytes, cudaMemcpyDeviceToHost));
  return out;
}

// N ranks, one thread each; returns the reassembled o and the slowest rank's mean time.
std::vector<uint16_t> context_parallel(const Problem& p, int world, KVExchange exchange,
                                       void** comms, int iters, double* ms) {
  std::vector<uint16_t> out(p.q.size());
  std::vector<double> times(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        CUDA_OK(cudaSetDevice(rank));
        AttentionOptions options;
        options.causal = true;
        const Device dev{DeviceType::kCUDA, rank};
        const ContextParallelPlan plan = plan_context_parallel_prefill(
            p.seq_len, world, rank, p.hq, p.hkv, p.dim, DType::kBFloat16, options, dev, exchange);
        const int64_t rows = plan.local_rows();
        const size_t row_q = static_cast<size_t>(p.hq) * p.dim, row_kv = static_cast<size_t>(p.hkv) * p.dim;
        std::vector<uint16_t> q(rows * row_q), k(rows * row_kv), v(rows * row_kv);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t g = plan.sharding.global_position(rank, i);
          std::memcpy(&q[i * row_q], &p.q[g * row_q], row_q * 2);
          std::memcpy(&k[i * row_kv], &p.k[g * row_kv], row_kv * 2);
          std::memcpy(&v[i * row_kv], &p.v[g * row_kv], row_kv * 2);
        }
        DeviceTensor qd(q.size() * 2), kd(k.size() * 2), vd(v.size() * 2), od(q.size() * 2);
        DeviceTensor workspace(plan.workspace_bytes);
        CUDA_OK(cudaMemcpy(qd.data, q.data(), qd.bytes, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(kd.data, k.data(), kd.bytes, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(vd.data, v.data(), vd.bytes, cudaMemcpyHostToDevice));
        cudaStream_t stream;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const auto run = [&] {
          run_context_parallel_prefill(
              plan, device_view(qd.data, DType::kBFloat16, {rows, p.hq, p.dim}, rank),
              device_view(kd.data, DType::kBFloat16, {rows, p.hkv, p.dim}, rank),
              device_view(vd.data, DType::kBFloat16, {rows, p.hkv, p.dim}, rank),
              device_view(od.data, DType::kBFloat16, {rows, p.hq, p.dim}, rank), {},
              {workspace.data, workspace.bytes}, comms[rank], stream);
        };
        run();
        CUDA_OK(cudaStreamSynchronize(stream));
        cudaEvent_t start, stop;
        CUDA_OK(cudaEventCreate(&start));
        CUDA_OK(cudaEventCreate(&stop));
        CUDA_OK(cudaEventRecord(start, stream));
        for (int i = 0; i < iters; ++i) run();
        CUDA_OK(cudaEventRecord(stop, stream));
        CUDA_OK(cudaEventSynchronize(stop));
        float total = 0;
        CUDA_OK(cudaEventElapsedTime(&total, start, stop));
        times[rank] = total / iters;
        CUDA_OK(cudaMemcpy(q.data(), od.data, od.bytes, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t g = plan.sharding.global_position(rank, i);
          std::memcpy(&out[g * row_q], &q[i * row_q], row_q * 2);
        }
        CUDA_OK(cudaStreamDestroy(stream));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    if (!errors[rank].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, errors[rank].c_str());
      std::exit(1);
    }
  }
  *ms = *std::max_element(times.begin(), times.end());
  return out;
}

double rel_l2(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t* bad) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = detail::bf16_to_float(a[i]), y = detail::bf16_to_float(b[i]);
    if (!std::isfinite(x)) ++*bad;
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace

int main(int argc, char** argv) {
  bool scaling = false;
  int64_t seq_len = 0;
  int iters = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--scaling") scaling = true;
    else if (arg == "--seq-len" && i + 1 < argc) seq_len = std::atoll(argv[++i]);
    else if (arg == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: cp_multi_gpu [--scaling] [--seq-len L] [--iters I]\n");
      return 2;
    }
  }
  if (seq_len == 0) seq_len = scaling ? 131072 : 12345;  // odd: uneven chunks
  std::printf("NCCL_NVLS_ENABLE=%s\n", disable_nccl_nvls().c_str());
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    std::printf("SKIP: context-parallel multi-GPU test needs >= 2 GPUs, %d visible\n", gpus);
    return 77;
  }
  std::string why;
  if (!nccl_available(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  const char* library = std::getenv("TESSERA_NCCL_LIBRARY");
  void* nccl = dlopen(library && *library ? library : "libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  const auto init_all = reinterpret_cast<CommInitAll>(dlsym(nccl, "ncclCommInitAll"));
  const auto destroy = reinterpret_cast<CommDestroy>(dlsym(nccl, "ncclCommDestroy"));
  if (init_all == nullptr || destroy == nullptr) {
    std::fprintf(stderr, "NCCL without ncclCommInitAll / ncclCommDestroy\n");
    return 1;
  }
  std::printf("%s, %d GPUs\n", why.c_str(), gpus);
  const Problem problem = make_problem(seq_len, 8);
  double t1 = 0;
  const std::vector<uint16_t> expected = single_gpu(problem, iters, &t1);
  std::printf("seq_len %lld causal bf16 heads %d/%d dim %d: 1 GPU %.3f ms\n",
              static_cast<long long>(seq_len), problem.hq, problem.hkv, problem.dim, t1);
  bool ok = true;
  for (int world : {2, 4, 8}) {
    if (world > gpus) break;
    std::vector<void*> comms(static_cast<size_t>(world));
    std::vector<int> devices(static_cast<size_t>(world));
    for (int d = 0; d < world; ++d) devices[d] = d;
    if (init_all(comms.data(), world, devices.data()) != 0) {
      std::fprintf(stderr, "ncclCommInitAll(%d) failed\n", world);
      return 1;
    }
    for (KVExchange exchange : {KVExchange::kRing, KVExchange::kAllGather}) {
      double tn = 0;
      const std::vector<uint16_t> got =
          context_parallel(problem, world, exchange, comms.data(), iters, &tn);
      int64_t bad = 0;
      const double err = rel_l2(got, expected, &bad);
      const bool pass = err < 1e-2 && bad == 0;
      ok = ok && pass;
      std::printf("N=%d %-10s %.3f ms  efficiency %.2f  rel_l2 %.2e  non-finite %lld  %s\n", world,
                  kv_exchange_name(exchange), tn, t1 / (world * tn), err,
                  static_cast<long long>(bad), pass ? "ok" : "FAIL");
    }
    for (void* comm : comms) destroy(comm);
  }
  return ok ? 0 : 1;
}
#endif
