// Soak (issue 7, item 6): many plan / upload_plan / CUDA-graph replay cycles with random batch
// compositions, watching for errors, wrong results and memory growth. A standalone program, not
// a ctest test (it needs a GPU and minutes); tools/gpu-check.sh runs it when TESSERA_SOAK_CYCLES
// is set, tools/stage-gpu.sh copies it.
//
//   soak_cuda_graph [CYCLES]        (default: $TESSERA_SOAK_CYCLES, else 100000)
//
// Three graphs, each captured once (tests/test_cuda_graph.cpp's recipe: size every buffer for
// the largest batch, plan it with a fixed PlanCapacity, upload_plan, one plain run outside the
// capture, capture run_*() around views of the full buffers):
//   * decode, balanced plans:      paged bf16, GQA 32/8, head_dim 128, page size 16, up to 32
//                                  requests of up to 2048 keys (split-KV included);
//   * decode, deterministic plans: the same with PlanCapacity::deterministic;
//   * ragged prefill, causal:      bf16, GQA 32/8, head_dim 128, up to 8 requests of up to 128
//                                  queries over up to 1024 keys.
// Cycle i is a ragged prefill cycle when i % 10 == 9 (10% of the cycles), otherwise a decode
// cycle (balanced for even i, deterministic for odd i). Each cycle: draw a random batch (size
// and lengths; decode also a fresh page table), write the indices (cudaMemcpyAsync) and q (a
// random fill kernel) into the graph's device buffers, plan with the graph's capacity (the
// workspace size must not change), upload_plan on the stream, replay the graph, synchronise the
// stream (a serving step). Every TESSERA_SOAK_CHECK_EVERY cycles (default 1000) the next cycle
// of each graph is spot-checked: o / lse poisoned with NaN before the replay, no NaN left in the
// batch's outputs afterwards, and 9 sampled rows (8 random + the batch's last) compared with the
// double-precision oracle (detail::cpu_reference_rows): relative L2 of the row below
// test::default_tolerance (bf16: 1e-2), |lse - ref| <= test::default_lse_tolerance (5e-4), rows
// that see no key exactly o = 0, lse = -inf.
//
// Memory: device memory in use (cudaMemGetInfo: total - free, the whole device, so run it on an
// otherwise idle GPU) and this process's resident set (/proc/self/statm) after the warm-up (the
// first 1% of the cycles, at least 200), at every 10% mark and at the end. Pass criteria, end vs
// warm-up: device growth <= TESSERA_SOAK_DEVICE_SLACK_BYTES (default 0: every device buffer, the
// graphs and the library's per-device state exist after the warm-up, so any growth is a leak);
// host RSS growth <= TESSERA_SOAK_RSS_SLACK_KIB (default 1024). Why host slack: a cycle frees
// everything it allocates (plans, the oracle's scratch), but glibc keeps freed small blocks in
// its heap and the resident size of that heap moves by a few pages with fragmentation, and the
// CUDA driver keeps small host-side pools of its own; 1 MiB over 100,000 cycles is ~10 bytes per
// cycle, so a real per-cycle leak of a plan or a vector still shows. To keep that noise small the
// mmap threshold of malloc is pinned at 128 KiB (glibc's initial value; pinning stops glibc from
// raising it after big frees, which would move big transient blocks into the heap).
//
// Exit status: 0 when there was no error (any CUDA error or tessera::Error is one), no failed
// spot check and no memory growth above the slack; 1 otherwise. 0 with a skip message without a
// CUDA device (or in a build without the CUDA backend).
// Environment: TESSERA_SOAK_CYCLES, TESSERA_SOAK_CHECK_EVERY, TESSERA_SOAK_RSS_SLACK_KIB,
// TESSERA_SOAK_DEVICE_SLACK_BYTES, TESSERA_SOAK_SEED (else TESSERA_TEST_SEED, else fixed).
// Last line: `soak: N cycles, E errors, C spot checks ok, device memory +X B, host RSS +Y KiB,
// T s` then `soak: PASS` or `soak: FAIL (...)`.
//
// Files: this one (the cycles, the memory samples, the verdict); the two workloads in
// soak_cuda_graph_decode.cpp and soak_cuda_graph_prefill.cpp; what they share (buffers, CUDA
// errors, the spot check's helpers) in soak_cuda_graph_common.cpp; all declared in
// soak_cuda_graph.hpp.
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "common/attention_testing.hpp"
#include "common/cuda_graph_support.hpp"
#include "common/gpu_test_support.hpp"
#include "cuda/cuda_backend.hpp"
#include "soak_cuda_graph.hpp"
#endif

namespace tessera::soak {
namespace {

// A non-negative integer from the environment, or `fallback` when unset or malformed.
long long env_count(const char* name, long long fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 0) {
    std::fprintf(stderr, "soak_cuda_graph: ignoring %s=%s (expected a non-negative integer)\n",
                 name, text);
    return fallback;
  }
  return value;
}

// Resident set size in bytes (/proc/self/statm, second field, in pages), -1 if unreadable. Read
// into a stack buffer: measuring allocates nothing.
long long host_rss_bytes() {
  const int fd = open("/proc/self/statm", O_RDONLY);
  if (fd < 0) return -1;
  char text[256];
  const ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0) return -1;
  text[n] = '\0';
  long long size = 0, resident = 0;
  if (std::sscanf(text, "%lld %lld", &size, &resident) != 2) return -1;
  return resident * static_cast<long long>(sysconf(_SC_PAGESIZE));
}

#if defined(TESSERA_HAVE_CUDA)

long long device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return static_cast<long long>(total_bytes) - static_cast<long long>(free_bytes);
}

using Stream = test::CudaStream;
using Graph = test::CudaGraph;

// ---------------------------------------------------------------------------- the soak

// One captured graph: its capacity, workspace and counters.
struct GraphSlot {
  const char* name = "";
  PlanCapacity capacity;
  size_t workspace_bytes = 0;
  std::unique_ptr<DeviceBuffer> workspace;
  Graph graph;
  long long cycles = 0, split_plans = 0, checks_ok = 0, checks_failed = 0;
  bool check_pending = true;

  Workspace ws() const { return Workspace{workspace->data(), workspace->bytes()}; }
};

struct Counters {
  long long errors = 0, checks_ok = 0, checks_failed = 0;
};

void report_problem(const char* what, const std::string& message, long long count) {
  constexpr long long kPrinted = 10;
  if (count <= kPrinted) std::printf("soak: %s: %s\n", what, message.c_str());
  if (count == kPrinted) std::printf("soak: (further %ss not printed)\n", what);
}

// One cycle of `slot`: the current lengths of `workload` (drawn by the caller) written to the
// device, planned, uploaded, replayed; checked when `check`. Throws on errors.
template <class Workload>
void run_cycle(Workload& workload, GraphSlot& slot, std::mt19937_64& rng, uint64_t q_seed,
               bool check, const Tolerance& tolerance, cudaStream_t stream, Counters& counters) {
  workload.write_batch(rng, q_seed, stream);
  Plan plan = workload.plan(slot.capacity);
  if (plan.workspace_bytes != slot.workspace_bytes) {
    throw std::runtime_error(std::string(slot.name) + ": a plan of the graph's capacity needs " +
                             std::to_string(plan.workspace_bytes) +
                             " workspace bytes, the graph's " +
                             std::to_string(slot.workspace_bytes));
  }
  slot.split_plans += !plan.merges.empty();
  upload_plan(plan, slot.ws(), stream);
  if (check) workload.poison_outputs(stream);
  cuda_check(cudaGraphLaunch(slot.graph.exec, stream), "cudaGraphLaunch");
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (after replay)");
  ++slot.cycles;
  if (!check) return;
  slot.check_pending = false;
  const std::string error = workload.check(stream, rng, tolerance);
  if (error.empty()) {
    ++slot.checks_ok;
    ++counters.checks_ok;
  } else {
    ++slot.checks_failed;
    ++counters.checks_failed;
    report_problem("spot check FAILED", std::string(slot.name) + ": " + error,
                   counters.checks_failed);
  }
}

// Plans the largest batch with the slot's capacity, runs it once outside the capture (one-time
// per-device kernel setup), captures run_*() into the slot's graph and replays it once, checked.
template <class Workload>
void capture(Workload& workload, GraphSlot& slot, std::mt19937_64& rng, uint64_t q_seed,
             const Tolerance& tolerance, cudaStream_t stream, Counters& counters) {
  workload.max_lengths();
  workload.write_batch(rng, q_seed, stream);
  Plan max_plan = workload.plan(slot.capacity);
  slot.workspace_bytes = max_plan.workspace_bytes;
  slot.workspace = std::make_unique<DeviceBuffer>(std::max<size_t>(max_plan.workspace_bytes, 16));
  upload_plan(max_plan, slot.ws(), stream);
  workload.run(max_plan, slot.ws(), stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (run before capture)");
  upload_plan(max_plan, slot.ws(), stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (upload before capture)");
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
             "cudaStreamBeginCapture");
  try {
    workload.run(max_plan, slot.ws(), stream);
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    throw;
  }
  cuda_check(cudaStreamEndCapture(stream, &slot.graph.graph), "cudaStreamEndCapture");
  cuda_check(cudaGraphInstantiate(&slot.graph.exec, slot.graph.graph, 0), "cudaGraphInstantiate");
  // The captured plan itself, replayed and checked (not counted as a soak cycle).
  const long long failed_before = counters.checks_failed;
  run_cycle(workload, slot, rng, q_seed + 1, /*check=*/true, tolerance, stream, counters);
  slot.cycles = 0;
  slot.split_plans = 0;
  slot.check_pending = true;
  std::printf("soak: %s graph captured: workspace %zu B, max-batch plan %zu work items, %zu "
              "merges, replay check %s\n",
              slot.name, slot.workspace_bytes, max_plan.work.size(), max_plan.merges.size(),
              counters.checks_failed == failed_before ? "ok" : "FAILED");
}

struct MemorySample {
  long long device = 0;  // bytes in use on the device
  long long rss = 0;     // host resident bytes
};

MemorySample sample_memory() { return MemorySample{device_used_bytes(), host_rss_bytes()}; }

int soak_main(long long cycles) {
  if (detail::cuda_device_count_or_zero() == 0) {
    std::printf("soak_cuda_graph: no CUDA device: soak skipped\n");
    return 0;
  }
  const long long check_every = std::max(1LL, env_count("TESSERA_SOAK_CHECK_EVERY", 1000));
  const long long rss_slack = env_count("TESSERA_SOAK_RSS_SLACK_KIB", 1024) * 1024;
  const long long device_slack = env_count("TESSERA_SOAK_DEVICE_SLACK_BYTES", 0);
  const uint64_t seed = static_cast<uint64_t>(env_count(
      "TESSERA_SOAK_SEED", static_cast<long long>(test::seed_from_env(20251207ull))));
  const long long warmup = std::min(cycles, std::max(200LL, cycles / 100));
  test::AttentionCase bf16_case;
  bf16_case.q_dtype = bf16_case.kv_dtype = DType::kBFloat16;
  const Tolerance tolerance{test::default_tolerance(bf16_case),
                            test::default_lse_tolerance(bf16_case)};

  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  Counters counters;
  std::mt19937_64 rng(seed);
  long long done = 0;
  bool fatal = false;
  MemorySample warm{}, last{};
  long long peak_device_growth = 0, peak_rss_growth = 0;

  try {
    const detail::CudaDeviceInfo& info = detail::cuda_device_info(0);
    std::printf("soak: device %s (sm_%d%d, %d SMs); %lld cycles (decode balanced / deterministic "
                "and ragged prefill every 10th), spot check every %lld cycles per graph, "
                "warm-up %lld cycles, seed %llu\n",
                info.name.c_str(), info.sm_major, info.sm_minor, info.num_sms, cycles,
                check_every, warmup, static_cast<unsigned long long>(seed));
    std::printf("soak: limits: device memory growth <= %lld B, host RSS growth <= %lld KiB; "
                "tolerance: row relative L2 < %.3g, |lse error| <= %.3g\n",
                device_slack, rss_slack / 1024, tolerance.o, tolerance.lse);
    std::printf("soak: before setup: device used %lld B, host RSS %lld KiB\n",
                device_used_bytes(), host_rss_bytes() / 1024);

    Stream stream;
    const cudaStream_t s = stream.get();
    DecodeSoak decode;
    PrefillSoak prefill;
    decode.fill_kv(seed * 7 + 1, s);
    prefill.fill_kv(seed * 7 + 3, s);

    using D = DecodeSoak;
    using P = PrefillSoak;
    GraphSlot balanced, deterministic, ragged;
    balanced.name = "decode (balanced)";
    balanced.capacity = plan_capacity(AttentionOp::kDecode, D::kMaxBatch, D::kMaxBatch, D::kMaxKv,
                                      D::kQoHeads, D::kKvHeads, D::kHeadDim, kGpu, false);
    deterministic.name = "decode (deterministic)";
    deterministic.capacity =
        plan_capacity(AttentionOp::kDecode, D::kMaxBatch, D::kMaxBatch, D::kMaxKv, D::kQoHeads,
                      D::kKvHeads, D::kHeadDim, kGpu, true);
    ragged.name = "ragged prefill";
    ragged.capacity = plan_capacity(AttentionOp::kRaggedPrefill, P::kMaxBatch, P::kMaxTotalQ,
                                    P::kMaxKv, P::kQoHeads, P::kKvHeads, P::kHeadDim, kGpu, false);
    uint64_t q_seed = seed * 1000003ull;
    capture(decode, balanced, rng, q_seed += 2, tolerance, s, counters);
    capture(decode, deterministic, rng, q_seed += 2, tolerance, s, counters);
    capture(prefill, ragged, rng, q_seed += 2, tolerance, s, counters);
    std::printf("soak: setup done after %.1f s: device used %lld B, host RSS %lld KiB\n",
                elapsed(), device_used_bytes(), host_rss_bytes() / 1024);

    const auto soak_start = elapsed();
    int next_mark = 1;
    for (long long cycle = 0; cycle < cycles && !fatal; ++cycle) {
      if (cycle % check_every == 0) {
        balanced.check_pending = deterministic.check_pending = ragged.check_pending = true;
      }
      const bool is_prefill = cycle % 10 == 9;
      GraphSlot& slot = is_prefill ? ragged : (cycle % 2 == 0 ? balanced : deterministic);
      try {
        if (is_prefill) {
          prefill.random_lengths(rng);
          run_cycle(prefill, slot, rng, ++q_seed, slot.check_pending, tolerance, s, counters);
        } else {
          decode.random_lengths(rng);
          run_cycle(decode, slot, rng, ++q_seed, slot.check_pending, tolerance, s, counters);
        }
      } catch (const CudaFailure& e) {
        ++counters.errors;
        report_problem("ERROR", "cycle " + std::to_string(cycle) + " (" + slot.name + "): " +
                                    e.what(), counters.errors);
        fatal = true;  // a CUDA error may leave the context unusable
      } catch (const std::exception& e) {
        ++counters.errors;
        report_problem("ERROR", "cycle " + std::to_string(cycle) + " (" + slot.name + "): " +
                                    e.what(), counters.errors);
        // Go on after a host-side error while the device is healthy; stop after 100.
        if (cudaStreamSynchronize(s) != cudaSuccess || counters.errors >= 100) fatal = true;
      }
      ++done;
      if (done == warmup) {
        warm = sample_memory();
        std::printf("soak: warm-up done (%lld cycles, %.1f s): device used %lld B, host RSS %lld "
                    "KiB (the baseline)\n",
                    done, elapsed(), warm.device, warm.rss / 1024);
      }
      while (next_mark <= 10 && done >= cycles * next_mark / 10) {
        last = sample_memory();
        if (done >= warmup) {
          peak_device_growth = std::max(peak_device_growth, last.device - warm.device);
          peak_rss_growth = std::max(peak_rss_growth, last.rss - warm.rss);
        }
        std::printf("soak: %3d%% %lld/%lld cycles, %.1f s: device used %lld B (%+lld B), host RSS "
                    "%lld KiB (%+lld KiB), %lld errors, %lld spot checks ok, %lld failed\n",
                    next_mark * 10, done, cycles, elapsed(), last.device,
                    done >= warmup ? last.device - warm.device : 0, last.rss / 1024,
                    done >= warmup ? (last.rss - warm.rss) / 1024 : 0, counters.errors,
                    counters.checks_ok, counters.checks_failed);
        ++next_mark;
      }
    }
    if (!fatal) {
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (end)");
      last = sample_memory();
    }
    const double soak_seconds = elapsed() - soak_start;
    for (const GraphSlot* slot : {&balanced, &deterministic, &ragged}) {
      std::printf("soak: %s: %lld cycles (%lld with split-KV merges), %lld spot checks ok, %lld "
                  "failed\n",
                  slot->name, slot->cycles, slot->split_plans, slot->checks_ok,
                  slot->checks_failed);
    }
    if (done > 0) {
      std::printf("soak: %.1f s for the cycles, %.1f us per cycle (plan + upload + replay + "
                  "synchronise)\n",
                  soak_seconds, 1e6 * soak_seconds / static_cast<double>(done));
    }
  } catch (const std::exception& e) {
    ++counters.errors;
    std::printf("soak: ERROR (setup or teardown): %s\n", e.what());
    fatal = true;
  }

  const long long device_growth = done >= warmup && warmup > 0 ? last.device - warm.device : 0;
  const long long rss_growth = done >= warmup && warmup > 0 ? last.rss - warm.rss : 0;
  peak_device_growth = std::max(peak_device_growth, device_growth);
  peak_rss_growth = std::max(peak_rss_growth, rss_growth);
  std::printf("soak: memory, end vs warm-up: device %+lld B (peak at a 10%% mark %+lld B), host "
              "RSS %+lld KiB (peak %+lld KiB)\n",
              device_growth, peak_device_growth, rss_growth / 1024, peak_rss_growth / 1024);
  std::string failures;
  const auto fail = [&](const std::string& why) {
    failures += (failures.empty() ? "" : "; ") + why;
  };
  if (counters.errors > 0) fail(std::to_string(counters.errors) + " errors");
  if (fatal && done < cycles) {
    fail("stopped after " + std::to_string(done) + " of " + std::to_string(cycles) + " cycles");
  }
  if (counters.checks_failed > 0) {
    fail(std::to_string(counters.checks_failed) + " spot checks failed");
  }
  if (device_growth > device_slack) {
    fail("device memory grew by " + std::to_string(device_growth) + " B (limit " +
         std::to_string(device_slack) + ")");
  }
  if (rss_growth > rss_slack) {
    fail("host RSS grew by " + std::to_string(rss_growth / 1024) + " KiB (limit " +
         std::to_string(rss_slack / 1024) + ")");
  }
  std::printf("soak: %lld cycles, %lld errors, %lld spot checks ok, device memory %+lld B, host "
              "RSS %+lld KiB, %.1f s\n",
              done, counters.errors, counters.checks_ok, device_growth, rss_growth / 1024,
              elapsed());
  if (failures.empty()) {
    std::printf("soak: PASS\n");
    return 0;
  }
  std::printf("soak: FAIL (%s)\n", failures.c_str());
  return 1;
}

#endif  // TESSERA_HAVE_CUDA

}  // namespace
}  // namespace tessera::soak

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach a log even if killed
  long long cycles = tessera::soak::env_count("TESSERA_SOAK_CYCLES", 100000);
  if (argc > 2 || (argc == 2 && (std::string(argv[1]) == "-h" ||
                                 std::string(argv[1]) == "--help"))) {
    std::printf("usage: soak_cuda_graph [CYCLES]   (default $TESSERA_SOAK_CYCLES, else 100000)\n"
                "See the header of tests/soak_cuda_graph.cpp for the environment knobs.\n");
    return argc > 2 ? 2 : 0;
  }
  if (argc == 2) {
    char* end = nullptr;
    cycles = std::strtoll(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || cycles <= 0) {
      std::fprintf(stderr, "soak_cuda_graph: CYCLES must be a positive integer, got '%s'\n",
                   argv[1]);
      return 2;
    }
  }
  if (cycles <= 0) cycles = 100000;
  // Pin malloc's mmap threshold (see the header): big transient blocks go back to the OS.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#if defined(TESSERA_HAVE_CUDA)
  try {
    return tessera::soak::soak_main(cycles);
  } catch (const std::exception& e) {
    std::printf("soak: ERROR: %s\nsoak: FAIL\n", e.what());
    return 1;
  }
#else
  (void)tessera::soak::host_rss_bytes;
  std::printf("soak_cuda_graph: built without the CUDA backend: soak skipped (%lld cycles "
              "requested)\n",
              cycles);
  return 0;
#endif
}
