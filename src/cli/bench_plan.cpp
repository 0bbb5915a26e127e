// `tessera bench --suite plan`: the host time of plan_*() for serving-sized batches (with a GPU
// the real calls, without one the planner with an H200's knobs).
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cli/bench.hpp"
#include "cli/bench_internal.hpp"
#include "core/planner.hpp"
#include "core/tuning.hpp"
#include "tessera/backend.hpp"

namespace tessera::cli {
namespace {

// ---- planner speed (`--suite plan`) ----

// A serving engine calls plan() once per step on the host: these cases time it. With a GPU
// the real plan_* calls (validation, lengths, the device's planner knobs); without one the
// planner itself (detail::make_plan) with knobs like an H200's, so the numbers mean the same
// on a build host.
struct PlanBenchCase {
  std::string name;
  AttentionOp op = AttentionOp::kDecode;
  std::vector<int32_t> q_lens, kv_lens;
  bool causal = false;
};

std::vector<PlanBenchCase> plan_bench_cases() {
  std::vector<PlanBenchCase> cases;
  std::mt19937_64 rng(5);
  const auto random_lens = [&](int count, int lo, int hi) {
    std::vector<int32_t> lens(count);
    for (auto& len : lens) len = std::uniform_int_distribution<int32_t>(lo, hi)(rng);
    return lens;
  };
  const auto add = [&](std::string name, AttentionOp op, std::vector<int32_t> q_lens,
                       std::vector<int32_t> kv_lens, bool causal) {
    cases.push_back({std::move(name), op, std::move(q_lens), std::move(kv_lens), causal});
  };
  add("plan decode 256x512..32k", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      random_lens(256, 512, 32768), false);
  add("plan decode 256x16k", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      std::vector<int32_t>(256, 16384), false);
  std::vector<int32_t> skewed(256, 512);
  skewed[0] = 32768;
  add("plan decode skewed 1x32k+255x512", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      skewed, false);
  add("plan decode 16x4k", AttentionOp::kDecode, std::vector<int32_t>(16, 1),
      std::vector<int32_t>(16, 4096), false);
  const std::vector<int32_t> prefill_lens = random_lens(64, 128, 4096);
  add("plan prefill causal 64x128..4k", AttentionOp::kRaggedPrefill, prefill_lens, prefill_lens,
      true);
  std::vector<int32_t> skewed_prefill(64, 256);
  skewed_prefill[0] = 16384;
  add("plan prefill causal skewed 1x16k+63x256", AttentionOp::kRaggedPrefill, skewed_prefill,
      skewed_prefill, true);
  std::vector<int32_t> mixed_q(256, 1);
  std::fill(mixed_q.begin(), mixed_q.begin() + 4, 2048);
  add("plan paged prefill causal mixed 4x2048+252x1", AttentionOp::kPagedPrefill, mixed_q,
      std::vector<int32_t>(256, 2048), true);
  return cases;
}

}  // namespace

int run_plan_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  const bool gpu = device.type == DeviceType::kCUDA;
  constexpr int kQoHeads = 32, kKvHeads = 8, kHeadDim = 128, kPageSize = 16;
  // Without a GPU: the knobs an H200 gets for this shape (GQA 32/8, d128, bf16), written out
  // here so that a CPU-only build (no CUDA headers) times the planner on the same work.
  // Decode (cuda_decode_plan_config): 132 SMs x 2 CTAs (x 4 for a heavy batch, core/tuning.hpp's
  // batch rule: variant 4), 64-row tiles, 128-key minimum split piece (512 in deterministic
  // mode). Prefill (cuda_plan_config, sm90 kernels): one CTA per
  // SM, 128-row tiles (2 consumer warpgroups), 4 x 128-key tiles minimum piece.
  constexpr int kH200Sms = 132;
  constexpr int kDecodeCtasPerSm = 2;       // variant 1 (4 warps x 3 stages), d128 bf16
  constexpr int kHeavyDecodeCtasPerSm = 4;  // variant 4 (2 warps x 3 stages)
  constexpr int kPrefillKeyTile = 128;
  PlanConfig h200_decode;
  h200_decode.q_tile_rows = 64;
  h200_decode.num_workers = kH200Sms * kDecodeCtasPerSm;
  h200_decode.split_kv = true;
  h200_decode.min_kv_chunk = 128;
  h200_decode.deterministic_kv_chunk = 512;
  PlanConfig h200_prefill;
  h200_prefill.q_tile_rows = 128;
  h200_prefill.num_workers = kH200Sms;
  h200_prefill.split_kv = true;
  h200_prefill.min_kv_chunk = 4 * kPrefillKeyTile;
  std::cout << "tessera bench --suite plan: "
            << (gpu ? "plan_* for " + describe_device(device)
                    : std::string("detail::make_plan, no GPU: an H200's knobs (decode: 264 "
                                  "workers, 528 for a heavy batch, 64-row tiles, min chunk 128; "
                                  "prefill: 132 workers, 128-row tiles, min chunk 512)"))
            << "\nhost: " << describe_device(Device{DeviceType::kCPU, 0})
            << "\nGQA 32/8, head_dim 128, page 16; microseconds per plan(), median of many calls\n";
  std::printf("\n%-44s %10s %10s %10s %8s %8s %8s\n", "case", "median us", "min us", "cpu us",
              "calls", "items", "merges");
  for (const PlanBenchCase& c : plan_bench_cases()) {
    if (!options.filter.empty() && c.name.find(options.filter) == std::string::npos) continue;
    AttentionOptions attention;
    attention.causal = c.causal;
    std::vector<int32_t> qo_indptr(1, 0), kv_indptr(1, 0), page_indptr(1, 0), last_page_len;
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      qo_indptr.push_back(qo_indptr.back() + c.q_lens[b]);
      kv_indptr.push_back(kv_indptr.back() + c.kv_lens[b]);
      const int32_t pages = (c.kv_lens[b] + kPageSize - 1) / kPageSize;
      page_indptr.push_back(page_indptr.back() + pages);
      last_page_len.push_back(pages == 0 ? 1 : c.kv_lens[b] - (pages - 1) * kPageSize);
    }
    detail::PlanShape shape;
    shape.op = c.op;
    shape.q_lens = c.q_lens;
    shape.kv_lens = c.kv_lens;
    shape.num_qo_heads = kQoHeads;
    shape.num_kv_heads = kKvHeads;
    shape.head_dim = kHeadDim;
    shape.page_size = c.op == AttentionOp::kRaggedPrefill ? 0 : kPageSize;
    shape.options = attention;
    PlanConfig cpu_config = c.op == AttentionOp::kDecode ? h200_decode : h200_prefill;
    if (c.op == AttentionOp::kDecode &&
        detail::is_heavy_decode_batch(static_cast<int64_t>(c.q_lens.size()), kKvHeads, kHeadDim,
                                      kH200Sms)) {
      cpu_config.num_workers = kH200Sms * kHeavyDecodeCtasPerSm;
      cpu_config.heavy_batch = true;
    }
    const auto plan_once = [&]() -> Plan {
      if (!gpu) return detail::make_plan(shape, cpu_config);
      switch (c.op) {
        case AttentionOp::kRaggedPrefill:
          return plan_ragged_prefill(qo_indptr, kv_indptr, kQoHeads, kKvHeads, kHeadDim, attention,
                                     device);
        case AttentionOp::kPagedPrefill:
          return plan_paged_prefill(qo_indptr, page_indptr, last_page_len, kPageSize, kQoHeads,
                                    kKvHeads, kHeadDim, attention, device);
        case AttentionOp::kDecode: break;
      }
      return plan_decode(page_indptr, last_page_len, kPageSize, kQoHeads, kKvHeads, kHeadDim,
                         attention, device, c.q_lens.empty() ? 1 : c.q_lens[0]);
    };
    const Plan sample = plan_once();  // warm-up
    // Wall time, and this thread's CPU time (less disturbed on a shared build host).
    const auto thread_cpu_us = [] {
      timespec now{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
      return now.tv_sec * 1e6 + now.tv_nsec * 1e-3;
    };
    std::vector<double> times, cpu_times;
    const int wanted = options.iterations > 0 ? options.iterations : 2000;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (int i = 0; i < wanted; ++i) {
      const double cpu_start = thread_cpu_us();
      const auto start = std::chrono::steady_clock::now();
      const Plan plan = plan_once();
      const auto stop = std::chrono::steady_clock::now();
      cpu_times.push_back(thread_cpu_us() - cpu_start);
      times.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
      if (options.iterations == 0 && i >= 20 && stop > deadline) break;
    }
    std::sort(times.begin(), times.end());
    std::sort(cpu_times.begin(), cpu_times.end());
    std::printf("%-44s %10.2f %10.2f %10.2f %8zu %8zu %8zu\n", c.name.c_str(),
                times[times.size() / 2], times.front(), cpu_times[cpu_times.size() / 2],
                times.size(), sample.work.size(), sample.merges.size());
  }
  return 0;
}

}  // namespace tessera::cli
