// `tessera bench --suite overhead` (host time per run_*() call, and the CUDA launch floor under
// it) and `--suite roofline` (the DRAM read ceiling of the decode shapes).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli/bench.hpp"
#include "cli/bench_internal.hpp"
#include "tessera/backend.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#include "devtools/bench_support.hpp"
#endif

namespace tessera::cli {

// Host cost of one run_*() call on tiny problems (one request of 16 keys, 2 query heads / 1 kv
// head, head_dim 64, as bench/python_overhead.py): batches of 200 calls timed from an idle device
// to the last call's return (fewer calls than the launch queue holds, so the GPU's time is not
// in it), best of 20 batches. The C++ floor under the Python wrappers' run().
int run_overhead_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  std::cout << "tessera bench --suite overhead: " << describe_device(device)
            << ", host microseconds per run_*() call (best of 20 x 200 calls)\n";
  BenchCase decode;
  decode.name = "decode run_decode (plan uploaded)";
  decode.op = AttentionOp::kDecode;
  decode.q_len = 1;
  decode.kv_len = 16;
  decode.page_size = 16;
  BenchCase ragged = decode;
  ragged.name = "ragged run_ragged_prefill (plan uploaded)";
  ragged.op = AttentionOp::kRaggedPrefill;
  ragged.page_size = 0;
  int failures = 0;
  for (BenchCase c : {decode, ragged}) {
    c.num_qo_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 64;
    try {
      BenchProblem problem;
      problem.spec = c;
      problem.device = device;
      problem.dtype = DType::kFloat16;
      build_problem(problem, 7);
      const auto synchronize = [&] {
#if defined(TESSERA_HAVE_CUDA)
        if (device.type == DeviceType::kCUDA) detail::cuda_synchronize(nullptr);
#endif
      };
      for (int i = 0; i < 200; ++i) run_once(problem);
      double best = INFINITY;
      for (int batch = 0; batch < 20; ++batch) {
        synchronize();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < 200; ++i) run_once(problem);
        const auto stop = std::chrono::steady_clock::now();
        best =
            std::min(best, std::chrono::duration<double, std::micro>(stop - start).count() / 200);
        synchronize();
      }
      std::printf("  %-44s %8.2f us\n", c.name.c_str(), best);
    } catch (const std::exception& error) {
      std::printf("  %-44s error: %s\n", c.name.c_str(), error.what());
      ++failures;
    }
  }
#if defined(TESSERA_HAVE_CUDA)
  if (device.type == DeviceType::kCUDA) {
    // What any run() on CUDA pays at least: the launch of one kernel, measured the same way.
    std::printf("  %-44s %8.2f us\n", "floor: empty kernel launch",
                devtools::cuda_launch_floor_us(200, false));
    std::printf("  %-44s %8.2f us\n", "floor: empty kernel launch, 512-byte params",
                devtools::cuda_launch_floor_us(200, true));
  }
#endif
  return failures == 0 ? 0 : 1;
}

// The DRAM read ceiling of each decode shape of the standard suite (`--suite roofline`): a plain
// 16-byte-load kernel reading as many bytes as the shape's K and V, timed like the bench (median,
// L2 flushed before each call as TESSERA_BENCH_FLUSH says). The best TB/s any decode kernel of
// that shape can show under the same timing.
int run_roofline_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  if (device.type != DeviceType::kCUDA) {
    std::cout << "tessera bench --suite roofline: needs a CUDA device; skipped\n";
    return 0;
  }
#if defined(TESSERA_HAVE_CUDA)
  std::cout << "tessera bench --suite roofline: " << describe_device(device)
            << ", plain read of each decode shape's K+V bytes, L2 flush "
            << devtools::bench_flush_name() << "\n";
  const int iterations = options.iterations > 0 ? options.iterations : 30;
  for (const BenchCase& c : decode_suite_cases()) {
    // K and V of every key, bf16 (the bench's default dtype).
    const auto bytes = static_cast<size_t>(2.0 * total_keys(c) * c.num_kv_heads * c.head_dim * 2);
    const double ms = devtools::cuda_read_ceiling_ms(bytes, iterations, kL2FlushBytes);
    const std::string shape = c.name.substr(c.name.find(" p16 ") + 5);
    std::printf("  read %-26s %9.1f MB %10.4f ms %7.3f TB/s\n", shape.c_str(), bytes / 1e6, ms,
                bytes / (ms * 1e-3) / 1e12);
  }
  return 0;
#else
  return 0;
#endif
}

}  // namespace tessera::cli
