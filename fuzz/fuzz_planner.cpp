// libFuzzer target for the planner (detail::make_plan): random lengths, heads, masks and
// PlanConfig knobs in; the plan invariants of fuzz/plan_invariants.hpp checked, plus
// determinism (the same input plans identically twice). A quarter of the inputs plan a
// multi-level cascade (plan_cascade, CPU) instead: every level's plan holds the invariants for
// its own lengths, the op per level and the masks follow the cascade's rules, and the workspace
// regions are aligned, disjoint and inside workspace_bytes. Build and run: tools/fuzz.sh.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <utility>
#include <vector>

#include "fuzz/plan_invariants.hpp"
#include "tessera/cascade.hpp"
#include "tessera/types.hpp"

using namespace tessera;
using namespace tessera::detail;

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_planner: cascade: %s\n", what);
  std::abort();
}

int fuzz_cascade(FuzzedDataProvider& fdp) {
  const int num_levels = fdp.ConsumeIntegralInRange<int>(1, 4);
  const int batch = fdp.ConsumeIntegralInRange<int>(1, 8);
  const int kv_heads = fdp.ConsumeIntegralInRange<int>(1, 4);
  const int qo_heads = kv_heads * fdp.ConsumeIntegralInRange<int>(1, 8);
  const int head_dim = 8 * fdp.ConsumeIntegralInRange<int>(1, 32);
  const int page_size = fdp.ConsumeIntegralInRange<int>(1, 32);
  std::vector<int32_t> q_lens;
  for (int b = 0; b < batch; ++b) q_lens.push_back(fdp.ConsumeIntegralInRange<int32_t>(0, 40));
  std::vector<int32_t> qo = {0};
  for (int32_t q : q_lens) qo.push_back(qo.back() + q);
  std::vector<std::vector<int32_t>> arrays;  // per level: qo, page_indptr, last_page_len
  for (int l = 0; l < num_levels; ++l) {
    std::vector<int32_t> level_qo = {0};
    if (l + 1 == num_levels) {
      level_qo = qo;
    } else {
      for (int b = 1; b < batch; ++b) {
        if (fdp.ConsumeBool()) level_qo.push_back(qo[static_cast<size_t>(b)]);
      }
      level_qo.push_back(qo.back());
    }
    std::vector<int32_t> indptr = {0}, last;
    for (size_t g = 0; g + 1 < level_qo.size(); ++g) {
      const int32_t pages = fdp.ConsumeIntegralInRange<int32_t>(0, 40);
      indptr.push_back(indptr.back() + pages);
      last.push_back(fdp.ConsumeIntegralInRange<int32_t>(1, page_size));
    }
    arrays.push_back(level_qo);
    arrays.push_back(indptr);
    arrays.push_back(last);
  }
  std::vector<CascadeLevelLengths> lengths;
  for (int l = 0; l < num_levels; ++l) {
    lengths.push_back({arrays[3 * l], arrays[3 * l + 1], arrays[3 * l + 2]});
  }
  AttentionOptions options;
  options.causal = fdp.ConsumeBool();
  options.logits_soft_cap = fdp.ConsumeBool() ? 30.0f : 0.0f;
  const CascadePlan plan = plan_cascade(lengths, page_size, qo_heads, kv_heads, head_dim, options);
  if (plan.num_levels() != num_levels || plan.total_q != qo.back()) fail("levels or rows");
  std::vector<std::pair<size_t, size_t>> regions;  // [begin, end) of every workspace part
  for (int l = 0; l < num_levels; ++l) {
    const Plan& level = plan.levels[static_cast<size_t>(l)];
    const bool last = l + 1 == num_levels;
    bool one_row = arrays[3 * l].size() >= 2;
    for (size_t g = 0; g < arrays[3 * l].size(); ++g) one_row &= arrays[3 * l][g] == static_cast<int32_t>(g);
    if ((level.op == AttentionOp::kDecode) != one_row) fail("decode iff one row per request");
    if (level.options.causal != (last && options.causal)) fail("causal only on the last level");
    if (level.options.logits_soft_cap != options.logits_soft_cap) fail("soft-cap on every level");
    PlanShape shape;
    shape.op = level.op;
    shape.q_lens = level.q_lens;
    shape.kv_lens = level.kv_lens;
    shape.num_qo_heads = qo_heads;
    shape.num_kv_heads = kv_heads;
    shape.head_dim = head_dim;
    shape.page_size = page_size;
    shape.options = level.options;
    const std::string violation = plan_violation(shape, level);
    if (!violation.empty()) {
      std::fprintf(stderr, "fuzz_planner: cascade level %d: %s\n", l, violation.c_str());
      std::abort();
    }
    regions.emplace_back(plan.level_offsets[static_cast<size_t>(l)],
                         plan.level_offsets[static_cast<size_t>(l)] + level.workspace_bytes);
  }
  const size_t rows = static_cast<size_t>(plan.total_q) * static_cast<size_t>(qo_heads);
  const size_t state = rows * static_cast<size_t>(head_dim) * 4 + rows * 4;  // o, lse at least
  for (size_t offset : plan.state_offsets) regions.emplace_back(offset, offset + state);
  if (num_levels > 2) {
    regions.emplace_back(plan.accumulator_offset, plan.accumulator_offset + 2 * state);
  }
  if (plan.state_offsets.size() != (num_levels > 1 ? static_cast<size_t>(num_levels) : 0)) {
    fail("one state per level (with more than one level)");
  }
  std::sort(regions.begin(), regions.end());
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].first % 256 != 0) fail("a workspace region is not 256-byte aligned");
    if (regions[i].second > plan.workspace_bytes) fail("a region ends past workspace_bytes");
    if (i > 0 && regions[i].first < regions[i - 1].second) fail("workspace regions overlap");
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) return fuzz_cascade(fdp);
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
