// Multi-level cascade attention (include/tessera/cascade.hpp): one attention per level into the
// workspace, then an exact merge of the level states into o / lse.
#include "tessera/cascade.hpp"

#include <algorithm>
#include <sstream>
#include <utility>

#include "core/attention_run.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "tessera/ops.hpp"

namespace tessera {
namespace {

using detail::ArgChecker;

constexpr int kMaxLevels = 16;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

std::string level_arg(int level, const char* name) {
  return "levels[" + std::to_string(level) + "]." + name;
}

// The decode kernels serve a level whose every request holds exactly one query row (its
// qo_indptr is 0, 1, ..., B, so row b is request b, as decode expects).
bool one_row_per_request(std::span<const int32_t> qo_indptr) {
  for (size_t b = 0; b < qo_indptr.size(); ++b) {
    if (qo_indptr[b] != static_cast<int32_t>(b)) return false;
  }
  return qo_indptr.size() >= 2;
}

// Offsets of an (o, lse) state of total_q rows: o sized for 4-byte elements (float32 CPU q, or
// the float32 accumulators), lse float32 after it.
size_t state_bytes(int64_t total_q, int heads, int head_dim) {
  const size_t rows = static_cast<size_t>(total_q) * static_cast<size_t>(heads);
  return align_up(rows * static_cast<size_t>(head_dim) * 4) + align_up(rows * 4);
}

struct StateViews {
  TensorView o;
  TensorView lse;
};

StateViews state_views(const CascadePlan& plan, Workspace workspace, size_t offset, DType dtype) {
  char* base = static_cast<char*>(workspace.data) + offset;
  // o rows are v-width (the levels' head_dim_vo).
  const int64_t rows = plan.total_q, heads = plan.num_qo_heads, dim = plan.levels[0].head_dim_v();
  const size_t o_bytes = align_up(static_cast<size_t>(rows) * static_cast<size_t>(heads) *
                                  static_cast<size_t>(dim) * 4);
  StateViews views;
  views.o = make_view(base, dtype, {rows, heads, dim}, plan.device);
  views.lse = make_view(base + o_bytes, DType::kFloat32, {rows, heads}, plan.device);
  return views;
}

// Level l's own part of the workspace.
Workspace level_workspace(const CascadePlan& plan, int l, Workspace workspace) {
  return {static_cast<char*>(workspace.data) + plan.level_offsets[static_cast<size_t>(l)],
          plan.levels[static_cast<size_t>(l)].workspace_bytes};
}

// Prefixes a level's error with the level, keeping its kind.
template <typename Body>
void for_level(int l, Body&& body) {
  try {
    std::forward<Body>(body)();
  } catch (const Error& error) {
    throw Error(error.kind(), "cascade level " + std::to_string(l) + ": " + error.what());
  }
}

}  // namespace

CascadePlan plan_cascade(std::span<const CascadeLevelLengths> levels, int page_size,
                         int num_qo_heads, int num_kv_heads, int head_dim,
                         const AttentionOptions& options, Device device) {
  const ArgChecker check("plan_cascade");
  const int num_levels = static_cast<int>(levels.size());
  check.require(levels.size() >= 1 && levels.size() <= kMaxLevels, "levels", [&] {
    return "expected 1.." + std::to_string(kMaxLevels) + " levels, got " +
           std::to_string(levels.size());
  });
  check.require(
      options.window_left == -1 && options.window_right == -1, "options.window_left", [&] {
        return "a sliding window is not supported by cascade attention (a window over the "
               "concatenated levels is not a per-level mask); got window (" +
               std::to_string(options.window_left) + ", " + std::to_string(options.window_right) +
               ")";
      });
  CascadePlan plan;
  plan.page_size = page_size;
  plan.num_qo_heads = num_qo_heads;
  plan.num_kv_heads = num_kv_heads;
  plan.head_dim = head_dim;
  plan.device = device;
  plan.options = options;
  for (int l = 0; l < num_levels; ++l) {
    const CascadeLevelLengths& level = levels[static_cast<size_t>(l)];
    check.require(!level.qo_indptr.empty(), level_arg(l, "qo_indptr"),
                  "expected batch_size + 1 >= 1 elements");
    const int64_t total_q = level.qo_indptr.back();
    if (l == 0) plan.total_q = total_q;
    check.require(total_q == plan.total_q, level_arg(l, "qo_indptr"), [&] {
      return "expected every level to cover the same query rows: it ends at " +
             std::to_string(total_q) + ", level 0 at " + std::to_string(plan.total_q);
    });
    AttentionOptions level_options = options;
    if (l + 1 < num_levels) level_options.causal = false;  // a shared prefix precedes its queries
    for_level(l, [&] {
      if (one_row_per_request(level.qo_indptr)) {
        plan.levels.push_back(plan_decode(level.page_indptr, level.last_page_len, page_size,
                                          num_qo_heads, num_kv_heads, head_dim, level_options,
                                          device));
      } else {
        plan.levels.push_back(plan_paged_prefill(level.qo_indptr, level.page_indptr,
                                                 level.last_page_len, page_size, num_qo_heads,
                                                 num_kv_heads, head_dim, level_options, device));
      }
    });
  }
  size_t offset = 0;
  for (const Plan& level : plan.levels) {
    plan.level_offsets.push_back(offset);
    offset += align_up(level.workspace_bytes);
  }
  if (num_levels > 1) {
    const size_t state = state_bytes(plan.total_q, num_qo_heads, plan.levels[0].head_dim_v());
    for (int l = 0; l < num_levels; ++l) {
      plan.state_offsets.push_back(offset);
      offset += state;
    }
    if (num_levels > 2) {
      plan.accumulator_offset = offset;
      offset += 2 * state;
    }
  }
  plan.workspace_bytes = offset;
  return plan;
}

void upload_cascade(CascadePlan& plan, Workspace workspace, void* stream) {
  const ArgChecker check("upload_cascade");
  check.require(workspace.bytes >= plan.workspace_bytes, "workspace", [&] {
    return "too small: the cascade plan needs " + std::to_string(plan.workspace_bytes) +
           " bytes, got " + std::to_string(workspace.bytes);
  });
  for (int l = 0; l < plan.num_levels(); ++l) {
    Plan& level = plan.levels[static_cast<size_t>(l)];
    for_level(l, [&] { upload_plan(level, level_workspace(plan, l, workspace), stream); });
  }
}

void run_cascade(const CascadePlan& plan, const TensorView& q, const TensorView& k_cache,
                 const TensorView& v_cache, KVLayout layout, std::span<const CascadeLevel> levels,
                 const TensorView& o, const TensorView& lse, Workspace workspace, void* stream,
                 const RunOptions& run_options) {
  const ArgChecker check("run_cascade");
  const int num_levels = plan.num_levels();
  check.require(num_levels >= 1, "plan", "expected a plan made by plan_cascade");
  check.require(static_cast<int>(levels.size()) == num_levels, "levels", [&] {
    return "expected " + std::to_string(num_levels) + " levels (as planned), got " +
           std::to_string(levels.size());
  });
  // Masks index a request's own keys; a cascade level sees only part of them.
  for (const auto& [mask, name] : {std::pair{run_options.custom_mask, "run_options.custom_mask"},
                                   {run_options.mask_indptr, "run_options.mask_indptr"},
                                   {run_options.tree_mask, "run_options.tree_mask"}}) {
    check.require(!has_value(mask), name,
                  "cascade attention takes no custom or tree mask (run the request's own "
                  "plan_paged_prefill / plan_decode with it)");
  }
  // The levels share total_q, heads, head_dim and device: the last one's plan checks q, o, lse.
  detail::check_run_outputs(check, plan.levels.back(), q, o, lse);
  // The merges read and write lse rows contiguously.
  check.require(num_levels == 1 || !has_value(lse) || lse.is_contiguous(), "lse",
                "expected a contiguous tensor");
  check.require(workspace.bytes >= plan.workspace_bytes, "workspace", [&] {
    return "too small: the cascade plan needs " + std::to_string(plan.workspace_bytes) +
           " bytes, got " + std::to_string(workspace.bytes);
  });
  check.require(plan.workspace_bytes == 0 || workspace.data != nullptr, "workspace",
                "data pointer is null");
  auto cache_of = [&](int l) {
    const CascadeLevel& level = levels[static_cast<size_t>(l)];
    return PagedKVCache{
        k_cache, v_cache, layout, level.page_indptr, level.page_indices, level.last_page_len};
  };
  // The sink joins the softmax once: in the last level's state.
  RunOptions upper_options = run_options;
  upper_options.sinks = TensorView{};
  std::vector<StateViews> states;
  for (int l = 0; l < num_levels; ++l) {
    states.push_back(
        num_levels == 1
            ? StateViews{o, lse}
            : state_views(plan, workspace, plan.state_offsets[static_cast<size_t>(l)], q.dtype));
  }
  // Every level is checked before any runs: a bad argument writes nothing, workspace included.
  std::vector<detail::AttentionProblem> problems;
  for (int l = 0; l < num_levels; ++l) {
    for_level(l, [&] {
      const Plan& level = plan.levels[static_cast<size_t>(l)];
      problems.push_back(detail::prepare_paged_run(
          level.op, level, q, cache_of(l), levels[static_cast<size_t>(l)].qo_indptr,
          states[static_cast<size_t>(l)].o, states[static_cast<size_t>(l)].lse,
          level_workspace(plan, l, workspace), stream,
          l + 1 == num_levels ? run_options : upper_options));
    });
  }
  for (int l = 0; l < num_levels; ++l) {
    detail::dispatch_attention(plan.levels[static_cast<size_t>(l)],
                               problems[static_cast<size_t>(l)],
                               level_workspace(plan, l, workspace), stream);
  }
  if (num_levels == 1) return;
  if (num_levels == 2) {
    merge_state(states[0].o, states[0].lse, states[1].o, states[1].lse, o, lse, stream);
    return;
  }
  const size_t half = state_bytes(plan.total_q, plan.num_qo_heads, plan.levels[0].head_dim_v());
  const StateViews acc[2] = {
      state_views(plan, workspace, plan.accumulator_offset, DType::kFloat32),
      state_views(plan, workspace, plan.accumulator_offset + half, DType::kFloat32)};
  merge_state(states[0].o, states[0].lse, states[1].o, states[1].lse, acc[0].o, acc[0].lse, stream);
  for (int l = 2; l < num_levels; ++l) {
    const StateViews& in = acc[l % 2];
    const StateViews& next = acc[(l + 1) % 2];
    const StateViews& state = states[static_cast<size_t>(l)];
    if (l + 1 == num_levels) {
      merge_state(in.o, in.lse, state.o, state.lse, o, lse, stream);
    } else {
      merge_state(in.o, in.lse, state.o, state.lse, next.o, next.lse, stream);
    }
  }
}

std::string CascadePlan::explain() const {
  std::ostringstream out;
  out << "cascade: " << levels.size() << " levels, query rows " << total_q << ", workspace "
      << workspace_bytes << " bytes\n";
  for (size_t l = 0; l < levels.size(); ++l) {
    out << "level " << l << (l + 1 == levels.size() ? " (own keys)" : " (shared prefix)") << ":\n"
        << levels[l].explain();
  }
  return out.str();
}

}  // namespace tessera
