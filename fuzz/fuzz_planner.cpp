// libFuzzer target for the planner (detail::make_plan): random lengths, heads, masks and
// PlanConfig knobs in; the plan invariants of fuzz/plan_invariants.hpp checked, plus
// determinism (the same input plans identically twice). Build and run: tools/fuzz.sh.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fuzz/plan_invariants.hpp"
#include "tessera/types.hpp"

using namespace tessera;
using namespace tessera::detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  PlanShape shape;
  shape.op = static_cast<AttentionOp>(fdp.ConsumeIntegralInRange<int>(0, 2));
  const int batch = fdp.ConsumeIntegralInRange<int>(0, 16);
  const int q_per_request = fdp.ConsumeIntegralInRange<int>(1, 64);
  const bool big = fdp.ConsumeBool();
  int64_t cells = 0;
  for (int b = 0; b < batch; ++b) {
    const int32_t kv = fdp.ConsumeIntegralInRange<int32_t>(0, big ? 20000 : 600);
    int32_t q = shape.op == AttentionOp::kDecode
                    ? q_per_request
                    : fdp.ConsumeIntegralInRange<int32_t>(0, big ? 4000 : 300);
    if (shape.op != AttentionOp::kDecode && fdp.ConsumeBool()) q = std::min(q, kv);
    shape.q_lens.push_back(q);
    shape.kv_lens.push_back(kv);
    cells += static_cast<int64_t>(q) * 8;  // the checker walks every (token, kv head)
  }
  if (cells > 400000) return 0;
  shape.num_kv_heads = fdp.ConsumeIntegralInRange<int>(1, 8);
  shape.num_qo_heads = shape.num_kv_heads * fdp.ConsumeIntegralInRange<int>(1, 16);
  shape.head_dim = 8 * fdp.ConsumeIntegralInRange<int>(1, 32);
  shape.page_size = fdp.ConsumeIntegralInRange<int>(1, 64);
  shape.options.causal = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) shape.options.window_left = fdp.ConsumeIntegralInRange<int32_t>(0, 5000);
  if (fdp.ConsumeBool()) shape.options.window_right = fdp.ConsumeIntegralInRange<int32_t>(0, 500);
  PlanConfig config;
  const int group = shape.num_qo_heads / shape.num_kv_heads;
  config.q_tile_rows = std::max(group, fdp.ConsumeIntegralInRange<int32_t>(1, 256));
  config.num_workers = fdp.ConsumeIntegralInRange<int32_t>(1, 300);
  config.split_kv = fdp.ConsumeBool();
  config.min_kv_chunk = fdp.ConsumeIntegralInRange<int32_t>(16, 2048);
  config.deterministic = fdp.ConsumeBool();
  // Keep one input cheap: skip configurations whose plan would hold millions of items (tiny
  // chunks on long requests; real backends use chunks of hundreds of keys).
  int64_t items = 0;
  const int32_t tokens_per_tile = std::max(1, config.q_tile_rows / group);
  for (size_t b = 0; b < shape.q_lens.size(); ++b) {
    const int64_t tiles = (shape.q_lens[b] + tokens_per_tile - 1) / tokens_per_tile;
    items += tiles * shape.num_kv_heads * (1 + shape.kv_lens[b] / config.min_kv_chunk);
  }
  if (items > 200000) return 0;

  const Plan plan = make_plan(shape, config);
  const std::string violation = plan_violation(shape, plan);
  if (!violation.empty()) {
    std::fprintf(stderr, "fuzz_planner: %s\n", violation.c_str());
    std::abort();
  }
  const Plan again = make_plan(shape, config);
  if (again.work.size() != plan.work.size() || again.merges.size() != plan.merges.size() ||
      again.worker_indptr != plan.worker_indptr ||
      (!plan.work.empty() &&
       std::memcmp(again.work.data(), plan.work.data(), plan.work.size() * sizeof(WorkItem)) != 0)) {
    std::fprintf(stderr, "fuzz_planner: make_plan is not deterministic\n");
    std::abort();
  }
  return 0;
}
