// The public attention entry points: validate -> plan -> dispatch.
#include <bit>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/attention_run.hpp"
#include "core/dispatch.hpp"
#include "core/nonfinite_check.hpp"
#include "core/paged_source.hpp"
#include "core/planner.hpp"
#include "core/validate.hpp"
#include "tessera/attention.hpp"
#include "tessera/backend.hpp"

namespace tessera {
namespace {

using detail::ArgChecker;
using detail::AttentionProblem;
using detail::KVSource;

void check_options(const ArgChecker& check, const AttentionOptions& options) {
  check.require(options.window_left >= -1, "options.window_left", [&] {
    return "expected -1 (unbounded) or >= 0, got " + std::to_string(options.window_left);
  });
  check.require(options.window_right >= -1, "options.window_right", [&] {
    return "expected -1 (unbounded) or >= 0, got " + std::to_string(options.window_right);
  });
  check.require(std::isfinite(options.logits_soft_cap) && options.logits_soft_cap >= 0.0f,
                "options.logits_soft_cap", [&] {
                  return "expected a finite value >= 0 (0 = off), got " +
                         std::to_string(options.logits_soft_cap);
                });
  check.require(std::isfinite(options.sm_scale) && options.sm_scale >= 0.0f, "options.sm_scale",
                [&] {
                  return "expected a finite value >= 0 (0 = 1/sqrt(head_dim)), got " +
                         std::to_string(options.sm_scale);
                });
  check.require(std::isfinite(options.k_scale) && options.k_scale > 0.0f, "options.k_scale", [&] {
    return "expected a finite value > 0, got " + std::to_string(options.k_scale);
  });
  check.require(std::isfinite(options.v_scale) && options.v_scale > 0.0f, "options.v_scale", [&] {
    return "expected a finite value > 0, got " + std::to_string(options.v_scale);
  });
}

// options.head_dim_vo: 0 (= head_dim) or a multiple of 8 in [8, 512]; a pair other than the
// equal one runs on the CPU backend only. Returns the resolved width.
int32_t check_head_dim_vo(const ArgChecker& check, const AttentionOptions& options, int head_dim,
                          Device device) {
  const int32_t vo = options.head_dim_vo;
  check.require(vo == 0 || (vo >= 8 && vo <= 512 && vo % 8 == 0), "options.head_dim_vo", [&] {
    return "expected 0 (= head_dim) or a multiple of 8 in [8, 512], got " + std::to_string(vo);
  });
  const int32_t resolved = vo == 0 ? head_dim : vo;
  if (resolved != head_dim && device.type != DeviceType::kCPU) {
    check.unsupported("options.head_dim_vo",
                      "head_dim_vo " + std::to_string(resolved) + " != head_dim " +
                          std::to_string(head_dim) +
                          " runs on the CPU backend only; the CUDA kernels support head_dim_vo = "
                          "head_dim");
  }
  return resolved;
}

std::vector<int32_t> diffs(std::span<const int32_t> indptr) {
  std::vector<int32_t> lengths(indptr.size() - 1);
  for (size_t i = 0; i + 1 < indptr.size(); ++i) lengths[i] = indptr[i + 1] - indptr[i];
  return lengths;
}

// Plans count requests in int32 (Plan::batch_size, and run_* adds 1 for the indptr lengths): at
// most 2^31 - 1 indptr entries, the C ABI's batch_size bound. Checked before any value is read.
void check_batch_size(const ArgChecker& check, std::span<const int32_t> indptr, const char* arg) {
  check.require(indptr.size() <= INT32_MAX, arg, [&] {
    return "expected at most 2^31 - 1 elements (batch_size + 1), got " +
           std::to_string(indptr.size());
  });
}

// kv_len per request of a paged cache; checks last_page_len.
std::vector<int32_t> paged_kv_lens(const ArgChecker& check, std::span<const int32_t> page_indptr,
                                   std::span<const int32_t> last_page_len, int page_size) {
  check.require(page_size >= 1, "page_size",
                [&] { return "expected >= 1, got " + std::to_string(page_size); });
  check.indptr(page_indptr, "page_indptr");
  check.require(last_page_len.size() + 1 == page_indptr.size(), "last_page_len", [&] {
    return "expected batch_size = " + std::to_string(page_indptr.size() - 1) +
           " elements (one per request), got " + std::to_string(last_page_len.size());
  });
  std::vector<int32_t> kv_lens(last_page_len.size());
  for (size_t b = 0; b < last_page_len.size(); ++b) {
    const int64_t pages = page_indptr[b + 1] - page_indptr[b];
    if (pages == 0) {
      kv_lens[b] = 0;
      continue;
    }
    if (last_page_len[b] < 1 || last_page_len[b] > page_size) {
      check.fail("last_page_len",
                 "expected values in [1, page_size = " + std::to_string(page_size) +
                     "], got last_page_len[" + std::to_string(b) +
                     "] = " + std::to_string(last_page_len[b]));
    }
    const int64_t len = (pages - 1) * page_size + last_page_len[b];
    check.require(len <= INT32_MAX, "page_indptr", [&] {
      return "request " + std::to_string(b) + " holds more than 2^31 - 1 keys";
    });
    kv_lens[b] = static_cast<int32_t>(len);
  }
  return kv_lens;
}

Plan build_plan(const ArgChecker& check, AttentionOp op, std::vector<int32_t> q_lens,
                std::vector<int32_t> kv_lens, int num_qo_heads, int num_kv_heads, int head_dim,
                int page_size, const AttentionOptions& options, Device device,
                const PlanCapacity& capacity, int max_head_dim = 256) {
  detail::check_heads(check, num_qo_heads, num_kv_heads, head_dim, max_head_dim);
  check_options(check, options);
  detail::check_device_usable(check, device);
  const int32_t head_dim_vo = check_head_dim_vo(check, options, head_dim, device);
  detail::PlanShape shape;
  shape.op = op;
  shape.device = device;
  shape.q_lens = std::move(q_lens);
  shape.kv_lens = std::move(kv_lens);
  shape.num_qo_heads = num_qo_heads;
  shape.num_kv_heads = num_kv_heads;
  shape.head_dim = head_dim;
  shape.page_size = page_size;
  shape.options = options;
  shape.options.head_dim_vo = head_dim_vo;
  shape.capacity = capacity;
  // Knobs that follow the batch (CUDA decode's batch rule) only where every plan may differ:
  // plans of one fixed capacity must agree on their worker count, deterministic ones on their
  // kernel.
  const int64_t batch =
      capacity.fixed() || capacity.deterministic ? 0 : static_cast<int64_t>(shape.q_lens.size());
  Plan plan = detail::make_plan(
      shape, detail::plan_config_for(op, device, num_qo_heads, num_kv_heads, head_dim, batch));
  detail::choose_kernel(plan);
  return plan;
}

// ---- run-time checks shared by the three ops ----

void check_plan_op(const ArgChecker& check, const Plan& plan, AttentionOp op) {
  check.require(plan.op == op, "plan", [&] {
    return std::string("expected a plan made by plan_") + op_name(op) + ", got one for " +
           op_name(plan.op);
  });
}

// Checked mode copies the index arrays to the host and scans the inputs, synchronising the
// stream: refused, before any of it, on a stream being captured (the capture stays valid).
void check_checked_mode_stream(const ArgChecker& check, const Plan& plan, void* stream) {
  if (plan.device.type == DeviceType::kCPU || !index_checking()) return;
  detail::check_not_capturing(check, plan.device, stream,
                              "checked mode (set_index_checking / TESSERA_CHECK=1) copies the "
                              "index arrays to the host and synchronises the stream");
}

std::initializer_list<DType> q_dtypes(Device device) {
  static constexpr std::initializer_list<DType> kCpu = {DType::kFloat16, DType::kBFloat16,
                                                        DType::kFloat32};
  static constexpr std::initializer_list<DType> kGpu = {DType::kFloat16, DType::kBFloat16};
  return device.type == DeviceType::kCPU ? kCpu : kGpu;
}

void check_q_o_lse(const ArgChecker& check, const Plan& plan, const TensorView& q,
                   const TensorView& o, const TensorView& lse) {
  constexpr std::string_view q_layout = "[total_q, num_qo_heads, head_dim]";
  check.tensor(q, "q", 3, q_layout);
  check.dtype_in(q, "q", q_dtypes(plan.device));
  check.device_is(q, "q", plan.device);
  check.dim_is(q, "q", 0, plan.total_q, "total query tokens of the plan");
  check.dim_is(q, "q", 1, plan.num_qo_heads, "num_qo_heads of the plan");
  check.dim_is(q, "q", 2, plan.head_dim, "head_dim of the plan");
  check.tensor(o, "o", 3, "[total_q, num_qo_heads, head_dim_vo]");
  check.output(o, "o");
  check.dtype_is(o, "o", q.dtype);
  check.device_is(o, "o", plan.device);
  for (int d = 0; d < 2; ++d) check.dim_is(o, "o", d, q.shape[d], "same as q");
  check.dim_is(o, "o", 2, plan.head_dim_v(), "head_dim_vo of the plan");
  if (has_value(lse)) {
    check.tensor(lse, "lse", 2, "[total_q, num_qo_heads] of float32");
    check.output(lse, "lse");
    check.dtype_is(lse, "lse", DType::kFloat32);
    check.device_is(lse, "lse", plan.device);
    check.dim_is(lse, "lse", 0, plan.total_q, "total query tokens");
    check.dim_is(lse, "lse", 1, plan.num_qo_heads, "num_qo_heads");
  }
}

// RunOptions::sinks: float32 [num_qo_heads], contiguous, on the plan's device (or absent).
// Sets problem.sinks, and problem.enable_pdl.
void set_sinks(const ArgChecker& check, const Plan& plan, const RunOptions& run_options,
               AttentionProblem& problem) {
  problem.enable_pdl = run_options.enable_pdl;
  const TensorView& sinks = run_options.sinks;
  if (!has_value(sinks)) return;
  // tensor(): a unit stride on the (only) dim, data for the num_qo_heads >= 1 elements.
  check.tensor(sinks, "sinks", 1, "[num_qo_heads] of float32");
  check.dtype_is(sinks, "sinks", DType::kFloat32);
  check.device_is(sinks, "sinks", plan.device);
  check.dim_is(sinks, "sinks", 0, plan.num_qo_heads, "num_qo_heads of the plan");
  problem.sinks = sinks.ptr<const float>();
}

void check_kv_dtype(const ArgChecker& check, const TensorView& k, const TensorView& v,
                    const TensorView& q, const char* k_name, const char* v_name) {
  check.dtype_in(k, k_name, {q.dtype, DType::kFloat8E4M3, DType::kFloat8E5M2});
  check.dtype_is(v, v_name, k.dtype);
}

void check_workspace(const ArgChecker& check, const Plan& plan, Workspace workspace) {
  check.require(workspace.bytes >= plan.workspace_bytes, "workspace", [&] {
    return "too small: the plan needs " + std::to_string(plan.workspace_bytes) + " bytes, got " +
           std::to_string(workspace.bytes);
  });
  check.require(plan.workspace_bytes == 0 || workspace.data != nullptr, "workspace",
                "data pointer is null");
}

// On the CPU the index arrays can be read: they must describe the same batch as the plan.
void check_lengths_match(const ArgChecker& check, const char* arg,
                         const std::vector<int32_t>& actual, const std::vector<int32_t>& planned,
                         const char* what) {
  for (size_t b = 0; b < planned.size(); ++b) {
    if (actual[b] != planned[b]) {
      check.fail(arg, "does not match the plan: request " + std::to_string(b) + " has " + what +
                          " " + std::to_string(actual[b]) + " here but " +
                          std::to_string(planned[b]) + " in the plan");
    }
  }
}

AttentionProblem base_problem(const Plan& plan, const TensorView& q, const TensorView& o,
                              const TensorView& lse) {
  AttentionProblem problem;
  problem.q_dtype = q.dtype;
  problem.batch_size = plan.batch_size;
  problem.num_qo_heads = plan.num_qo_heads;
  problem.num_kv_heads = plan.num_kv_heads;
  problem.head_dim = plan.head_dim;
  problem.head_dim_vo = plan.head_dim_v();
  problem.q = q.data;
  problem.q_stride_token = q.stride[0];
  problem.q_stride_head = q.stride[1];
  problem.q_extent = q.shape[0];
  problem.o = o.data;
  problem.o_stride_token = o.stride[0];
  problem.o_stride_head = o.stride[1];
  problem.o_extent = o.shape[0];
  if (has_value(lse)) {
    problem.lse = static_cast<float*>(lse.data);
    problem.lse_stride_token = lse.stride[0];
  }
  const AttentionOptions& options = plan.options;
  problem.sm_scale = options.sm_scale > 0.0f
                         ? options.sm_scale
                         : static_cast<float>(1.0 / std::sqrt(static_cast<double>(plan.head_dim)));
  problem.soft_cap = options.logits_soft_cap;
  problem.k_scale = options.k_scale;
  problem.v_scale = options.v_scale;
  problem.mask = detail::mask_of(options);
  return problem;
}

// The last checks of a run, after which it only launches: k_scale / v_scale dequantise an fp8
// cache (for fp16/bf16 K/V they are documented as ignored, so every backend sees 1 there), and
// checked mode rejects a NaN / inf input the call reads.
void finish_checks(const ArgChecker& check, const Plan& plan, AttentionProblem& problem,
                   void* stream) {
  const bool fp8 = problem.kv.dtype == DType::kFloat8E4M3 || problem.kv.dtype == DType::kFloat8E5M2;
  if (!fp8) problem.k_scale = problem.v_scale = 1.0f;
  if (index_checking()) detail::check_finite_inputs(check, plan, problem, stream);
}

void dispatch(const ArgChecker& check, const Plan& plan, AttentionProblem& problem,
              Workspace workspace, void* stream) {
  finish_checks(check, plan, problem, stream);
  detail::dispatch_attention(plan, problem, workspace, stream);
}

int64_t total_of(const std::vector<int32_t>& lengths) {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
}

// The values of an int32 index array on the host, when run_* checks them: a CPU tensor's own
// memory, or for a device tensor in checked mode (index_checking()) a synchronous copy. Empty
// (`checked` false) for device tensors otherwise: the kernels trust them.
struct HostIndices {
  std::vector<int32_t> copy;
  const int32_t* data = nullptr;
  bool checked = false;
};

HostIndices host_indices(const TensorView& view, const Plan& plan, void* stream) {
  HostIndices host;
  if (plan.device.type == DeviceType::kCPU) {
    host.data = view.ptr<const int32_t>();
    host.checked = true;
  } else if (index_checking()) {
    host.copy = detail::read_int32_array(view, stream);
    host.data = host.copy.data();
    host.checked = true;
  }
  return host;
}

// Validates a paged cache against the plan and fills the KV source.
KVSource paged_source(const ArgChecker& check, const Plan& plan, const PagedKVCache& kv,
                      const TensorView& q, void* stream) {
  const bool nhd = kv.layout == KVLayout::kNHD;
  check.require(kv.layout == KVLayout::kNHD || kv.layout == KVLayout::kHND, "kv.layout",
                "expected NHD (0) or HND (1)");
  const std::string_view layout = nhd ? "[num_pages, page_size, num_kv_heads, head_dim] (NHD)"
                                      : "[num_pages, num_kv_heads, page_size, head_dim] (HND)";
  const int token_dim = nhd ? 1 : 2, head_dim_index = nhd ? 2 : 1;
  check.require(plan.page_size >= 1, "plan", "expected a paged plan with page_size >= 1");
  for (const auto& [view, name] : {std::pair{kv.k_cache, "k_cache"}, {kv.v_cache, "v_cache"}}) {
    check.tensor(view, name, 4, layout);
    check.device_is(view, name, plan.device);
    check.dim_is(view, name, token_dim, plan.page_size, "page_size of the plan");
    check.dim_is(view, name, head_dim_index, plan.num_kv_heads, "num_kv_heads of the plan");
  }
  check.dim_is(kv.k_cache, "k_cache", 3, plan.head_dim, "head_dim of the plan");
  check.dim_is(kv.v_cache, "v_cache", 3, plan.head_dim_v(), "head_dim_vo of the plan");
  check.dim_is(kv.v_cache, "v_cache", 0, kv.k_cache.shape[0], "num_pages of k_cache");
  check_kv_dtype(check, kv.k_cache, kv.v_cache, q, "k_cache", "v_cache");
  detail::check_page_table(check, plan, kv, kv.k_cache.shape[0], stream);
  return detail::paged_kv_source(kv);
}

}  // namespace

void detail::check_page_table(const ArgChecker& check, const Plan& plan, const PagedKVCache& kv,
                              int64_t num_pages, void* stream) {
  check.index_array(kv.page_indptr, "page_indptr", plan.batch_size + 1, plan.device);
  check.index_array(kv.page_indices, "page_indices", -1, plan.device);
  check.index_array(kv.last_page_len, "last_page_len", plan.batch_size, plan.device);
  // Per run and O(batch): a shift for the usual power-of-two page sizes (vectorised), counted
  // in 64 bits (a length near 2^31 must not wrap).
  int64_t planned_pages = 0;
  const int64_t page_size = plan.page_size;
  if (std::has_single_bit(static_cast<uint64_t>(page_size))) {  // >= 1, checked above
    const int shift = std::countr_zero(static_cast<uint64_t>(page_size));
    for (int32_t len : plan.kv_lens) planned_pages += (int64_t{len} + page_size - 1) >> shift;
  } else {
    for (int32_t len : plan.kv_lens) planned_pages += (int64_t{len} + page_size - 1) / page_size;
  }
  check.require(kv.page_indices.shape[0] >= planned_pages, "page_indices", [&] {
    return "expected at least " + std::to_string(planned_pages) +
           " entries (the pages of the plan's requests), got " +
           std::to_string(kv.page_indices.shape[0]);
  });
  const HostIndices host_indptr = host_indices(kv.page_indptr, plan, stream);
  if (host_indptr.checked) {
    const HostIndices host_last = host_indices(kv.last_page_len, plan, stream);
    const std::span<const int32_t> indptr(host_indptr.data, plan.batch_size + 1);
    const std::span<const int32_t> last(host_last.data, plan.batch_size);
    const std::vector<int32_t> kv_lens = paged_kv_lens(check, indptr, last, plan.page_size);
    check_lengths_match(check, "page_indptr", kv_lens, plan.kv_lens, "kv_len");
    check.require(indptr.back() <= kv.page_indices.shape[0], "page_indices", [&] {
      return "page_indptr[batch_size] = " + std::to_string(indptr.back()) + " exceeds its " +
             std::to_string(kv.page_indices.shape[0]) + " entries";
    });
    const HostIndices host_pages = host_indices(kv.page_indices, plan, stream);
    const int32_t* indices = host_pages.data;
    for (int32_t i = 0; i < indptr.back(); ++i) {
      if (indices[i] < 0 || indices[i] >= num_pages) {
        check.fail("page_indices",
                   "entry " + std::to_string(i) + " = " + std::to_string(indices[i]) +
                       " is out of range [0, num_pages = " + std::to_string(num_pages) + ")");
      }
    }
  }
}

namespace {

void check_qo_indptr(const ArgChecker& check, const Plan& plan, const TensorView& qo_indptr,
                     void* stream) {
  check.index_array(qo_indptr, "qo_indptr", plan.batch_size + 1, plan.device);
  const HostIndices host = host_indices(qo_indptr, plan, stream);
  if (host.checked) {
    const std::span<const int32_t> values(host.data, plan.batch_size + 1);
    check.indptr(values, "qo_indptr");
    check_lengths_match(check, "qo_indptr", diffs(values), plan.q_lens, "q_len");
  }
}

}  // namespace

// ---------------------------------------------------------------- plan

Plan plan_ragged_prefill(std::span<const int32_t> qo_indptr, std::span<const int32_t> kv_indptr,
                         int num_qo_heads, int num_kv_heads, int head_dim,
                         const AttentionOptions& options, Device device,
                         const PlanCapacity& capacity) {
  const ArgChecker check("plan_ragged_prefill");
  check_batch_size(check, qo_indptr, "qo_indptr");
  check.indptr(qo_indptr, "qo_indptr");
  check.indptr(kv_indptr, "kv_indptr");
  check.require(kv_indptr.size() == qo_indptr.size(), "kv_indptr", [&] {
    return "expected batch_size + 1 = " + std::to_string(qo_indptr.size()) +
           " elements like qo_indptr, got " + std::to_string(kv_indptr.size());
  });
  return build_plan(check, AttentionOp::kRaggedPrefill, diffs(qo_indptr), diffs(kv_indptr),
                    num_qo_heads, num_kv_heads, head_dim, 0, options, device, capacity);
}

Plan plan_paged_prefill(std::span<const int32_t> qo_indptr, std::span<const int32_t> page_indptr,
                        std::span<const int32_t> last_page_len, int page_size, int num_qo_heads,
                        int num_kv_heads, int head_dim, const AttentionOptions& options,
                        Device device, const PlanCapacity& capacity) {
  return detail::plan_paged_prefill_as(ArgChecker("plan_paged_prefill"), qo_indptr, page_indptr,
                                       last_page_len, page_size, num_qo_heads, num_kv_heads,
                                       head_dim, options, device, capacity, 256);
}

Plan detail::plan_paged_prefill_as(const ArgChecker& check, std::span<const int32_t> qo_indptr,
                                   std::span<const int32_t> page_indptr,
                                   std::span<const int32_t> last_page_len, int page_size,
                                   int num_qo_heads, int num_kv_heads, int head_dim,
                                   const AttentionOptions& options, Device device,
                                   const PlanCapacity& capacity, int max_head_dim) {
  check_batch_size(check, qo_indptr, "qo_indptr");
  check.indptr(qo_indptr, "qo_indptr");
  std::vector<int32_t> kv_lens = paged_kv_lens(check, page_indptr, last_page_len, page_size);
  check.require(page_indptr.size() == qo_indptr.size(), "page_indptr", [&] {
    return "expected batch_size + 1 = " + std::to_string(qo_indptr.size()) +
           " elements like qo_indptr, got " + std::to_string(page_indptr.size());
  });
  return build_plan(check, AttentionOp::kPagedPrefill, diffs(qo_indptr), std::move(kv_lens),
                    num_qo_heads, num_kv_heads, head_dim, page_size, options, device, capacity,
                    max_head_dim);
}

Plan plan_decode(std::span<const int32_t> page_indptr, std::span<const int32_t> last_page_len,
                 int page_size, int num_qo_heads, int num_kv_heads, int head_dim,
                 const AttentionOptions& options, Device device, int q_per_request,
                 const PlanCapacity& capacity) {
  const ArgChecker check("plan_decode");
  check.require(q_per_request >= 1 && q_per_request <= 64, "q_per_request", [&] {
    return "expected 1..64 query tokens per request, got " + std::to_string(q_per_request);
  });
  check_batch_size(check, page_indptr, "page_indptr");
  // Decode finds request b's query rows at b * q_per_request in int32 (AttentionProblem::q_begin).
  const int64_t batch = page_indptr.empty() ? 0 : static_cast<int64_t>(page_indptr.size()) - 1;
  check.require(batch * q_per_request <= INT32_MAX, "q_per_request", [&] {
    return "expected batch_size x q_per_request <= 2^31 - 1 query rows, got " +
           std::to_string(batch) + " x " + std::to_string(q_per_request);
  });
  std::vector<int32_t> kv_lens = paged_kv_lens(check, page_indptr, last_page_len, page_size);
  std::vector<int32_t> q_lens(kv_lens.size(), q_per_request);
  return build_plan(check, AttentionOp::kDecode, std::move(q_lens), std::move(kv_lens),
                    num_qo_heads, num_kv_heads, head_dim, page_size, options, device, capacity);
}

PlanCapacity plan_capacity(AttentionOp op, int max_batch, int64_t max_total_q, int max_kv_len,
                           int num_qo_heads, int num_kv_heads, int head_dim, Device device,
                           bool deterministic) {
  const ArgChecker check("plan_capacity");
  detail::check_heads(check, num_qo_heads, num_kv_heads, head_dim);
  detail::check_device_usable(check, device);
  check.require(max_batch >= 1, "max_batch",
                [&] { return "expected >= 1, got " + std::to_string(max_batch); });
  check.require(max_total_q >= 0 && max_total_q <= INT32_MAX, "max_total_q", [&] {
    return "expected a value in [0, 2^31 - 1] (query tokens are counted by an int32 "
           "qo_indptr), got " +
           std::to_string(max_total_q);
  });
  check.require(max_kv_len >= 0, "max_kv_len",
                [&] { return "expected >= 0, got " + std::to_string(max_kv_len); });
  PlanConfig config = detail::plan_config_for(op, device, num_qo_heads, num_kv_heads, head_dim);
  if (deterministic) config.deterministic = true;
  PlanCapacity capacity = detail::capacity_bound(max_batch, max_total_q, max_kv_len, num_qo_heads,
                                                 num_kv_heads, config);
  capacity.deterministic = deterministic;
  return capacity;
}

// ---------------------------------------------------------------- upload

void upload_plan(Plan& plan, Workspace workspace, void* stream) {
  const ArgChecker check("upload_plan");
  if (plan.device.type == DeviceType::kCPU) return;
  check_workspace(check, plan, workspace);
  plan.upload_generation = detail::dispatch_upload_plan(plan, workspace, stream);
  plan.uploaded_workspace = plan.upload_generation != 0 ? workspace.data : nullptr;
}

void forget_uploads(const void* workspace) {
  detail::dispatch_forget_uploads(workspace);
}

// ---------------------------------------------------------------- run

void run_ragged_prefill(const Plan& plan, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& qo_indptr,
                        const TensorView& kv_indptr, const TensorView& o, const TensorView& lse,
                        Workspace workspace, void* stream, const RunOptions& run_options) {
  const ArgChecker check("run_ragged_prefill");
  check_plan_op(check, plan, AttentionOp::kRaggedPrefill);
  check_checked_mode_stream(check, plan, stream);
  check_q_o_lse(check, plan, q, o, lse);
  const int64_t total_kv = total_of(plan.kv_lens);
  for (const auto& [view, name] : {std::pair{k, "k"}, {v, "v"}}) {
    const bool is_k = name[0] == 'k';
    check.tensor(
        view, name, 3,
        is_k ? "[total_kv, num_kv_heads, head_dim]" : "[total_kv, num_kv_heads, head_dim_vo]");
    check.device_is(view, name, plan.device);
    check.dim_is(view, name, 1, plan.num_kv_heads, "num_kv_heads of the plan");
    check.dim_is(view, name, 2, is_k ? plan.head_dim : plan.head_dim_v(),
                 is_k ? "head_dim of the plan" : "head_dim_vo of the plan");
    const int64_t rows = view.shape[0];  // (clang < 16 cannot capture a structured binding)
    check.require(rows >= total_kv, name, [&] {
      return "expected at least " + std::to_string(total_kv) +
             " rows (the plan's kv tokens), got " + std::to_string(rows);
    });
  }
  check_kv_dtype(check, k, v, q, "k", "v");
  check_qo_indptr(check, plan, qo_indptr, stream);
  check.index_array(kv_indptr, "kv_indptr", plan.batch_size + 1, plan.device);
  const HostIndices host_kv_indptr = host_indices(kv_indptr, plan, stream);
  if (host_kv_indptr.checked) {
    const std::span<const int32_t> values(host_kv_indptr.data, plan.batch_size + 1);
    check.indptr(values, "kv_indptr");
    check_lengths_match(check, "kv_indptr", diffs(values), plan.kv_lens, "kv_len");
    check.require(values.back() <= k.shape[0], "kv_indptr", [&] {
      return "kv_indptr[batch_size] = " + std::to_string(values.back()) + " exceeds the " +
             std::to_string(k.shape[0]) + " rows of k";
    });
  }
  check_workspace(check, plan, workspace);

  AttentionProblem problem = base_problem(plan, q, o, lse);
  problem.qo_indptr = qo_indptr.ptr<const int32_t>();
  problem.kv.dtype = k.dtype;
  problem.kv.paged = false;
  problem.kv.k = k.data;
  problem.kv.v = v.data;
  problem.kv.k_stride_token = k.stride[0];
  problem.kv.k_stride_head = k.stride[1];
  problem.kv.v_stride_token = v.stride[0];
  problem.kv.v_stride_head = v.stride[1];
  problem.kv.k_extent = k.shape[0];
  problem.kv.v_extent = v.shape[0];
  problem.kv.kv_indptr = kv_indptr.ptr<const int32_t>();
  set_sinks(check, plan, run_options, problem);
  detail::set_key_mask(check, plan, run_options, problem);
  dispatch(check, plan, problem, workspace, stream);
}

void run_paged_prefill(const Plan& plan, const TensorView& q, const PagedKVCache& kv,
                       const TensorView& qo_indptr, const TensorView& o, const TensorView& lse,
                       Workspace workspace, void* stream, const RunOptions& run_options) {
  detail::dispatch_attention(
      plan,
      detail::prepare_paged_run(AttentionOp::kPagedPrefill, plan, q, kv, qo_indptr, o, lse,
                                workspace, stream, run_options),
      workspace, stream);
}

void run_decode(const Plan& plan, const TensorView& q, const PagedKVCache& kv, const TensorView& o,
                const TensorView& lse, Workspace workspace, void* stream,
                const RunOptions& run_options) {
  detail::dispatch_attention(plan,
                             detail::prepare_paged_run(AttentionOp::kDecode, plan, q, kv, {}, o,
                                                       lse, workspace, stream, run_options),
                             workspace, stream);
}

void detail::finish_run_checks(const ArgChecker& check, const Plan& plan, AttentionProblem& problem,
                               void* stream) {
  finish_checks(check, plan, problem, stream);
}

void detail::check_run_outputs(const ArgChecker& check, const Plan& plan, const TensorView& q,
                               const TensorView& o, const TensorView& lse) {
  check_q_o_lse(check, plan, q, o, lse);
}

detail::AttentionProblem detail::prepare_paged_run(AttentionOp op, const Plan& plan,
                                                   const TensorView& q, const PagedKVCache& kv,
                                                   const TensorView& qo_indptr, const TensorView& o,
                                                   const TensorView& lse, Workspace workspace,
                                                   void* stream, const RunOptions& run_options) {
  const bool decode = op == AttentionOp::kDecode;
  const ArgChecker check(decode ? "run_decode" : "run_paged_prefill");
  check_plan_op(check, plan, op);
  check_checked_mode_stream(check, plan, stream);
  check_q_o_lse(check, plan, q, o, lse);
  KVSource source = paged_source(check, plan, kv, q, stream);
  if (!decode) check_qo_indptr(check, plan, qo_indptr, stream);
  check_workspace(check, plan, workspace);
  AttentionProblem problem = base_problem(plan, q, o, lse);
  problem.qo_indptr = decode ? nullptr : qo_indptr.ptr<const int32_t>();
  if (decode) problem.q_per_request = plan.batch_size > 0 ? plan.q_lens[0] : 1;
  problem.kv = source;
  set_sinks(check, plan, run_options, problem);
  detail::set_key_mask(check, plan, run_options, problem);
  finish_checks(check, plan, problem, stream);
  return problem;
}

// ---------------------------------------------------------------- one-shot

namespace {

// Why a one-shot call cannot run inside a CUDA-graph capture (detail::check_not_capturing).
constexpr const char* kOneShotSyncs =
    "a one-shot call reads its index arrays back to the host (synchronising the stream) and "
    "allocates its workspace";

void check_one_shot_q(const ArgChecker& check, const TensorView& q) {
  check.tensor(q, "q", 3, "[total_q, num_qo_heads, head_dim]");
}

// A one-shot call without options.head_dim_vo takes it from v's (or v_cache's) last dimension,
// as FlashAttention does, where k's matches q's (otherwise k is the argument in error, and the
// run's checks name it); a malformed v is left to those checks too.
AttentionOptions one_shot_options(const AttentionOptions& options, const TensorView& k,
                                  const TensorView& v, int64_t head_dim) {
  AttentionOptions resolved = options;
  const bool k_matches = k.ndim >= 1 && k.shape[k.ndim - 1] == head_dim;
  if (resolved.head_dim_vo == 0 && k_matches && v.ndim >= 1 && v.shape[v.ndim - 1] != head_dim &&
      v.shape[v.ndim - 1] > 0 && v.shape[v.ndim - 1] <= INT32_MAX) {
    resolved.head_dim_vo = static_cast<int32_t>(v.shape[v.ndim - 1]);
  }
  return resolved;
}

// One-shot calls read the index arrays before planning: their totals must fit the tensors
// first, or a corrupt array (qo_indptr[B] = 2^31 - 1 for a 10-row q) would make the planner
// build a work list of millions of tiles before the run-time checks reject the call.
void check_total_fits(const ArgChecker& check, const std::vector<int32_t>& indptr, const char* arg,
                      int64_t available, const char* what, bool exact) {
  if (indptr.empty()) return;  // rejected by the planner's checks with a clearer message
  const int64_t total = indptr.back();
  if (exact ? total != available : total > available) {
    check.fail(arg, std::string(arg) + "[batch_size] = " + std::to_string(total) +
                        (exact ? " does not equal the " : " exceeds the ") +
                        std::to_string(available) + " " + what);
  }
}

}  // namespace

void ragged_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& qo_indptr, const TensorView& kv_indptr, const TensorView& o,
                    const TensorView& lse, const AttentionOptions& options, void* stream,
                    const RunOptions& run_options) {
  const ArgChecker check("ragged_prefill");
  check_one_shot_q(check, q);
  detail::check_device_usable(check, q.device);  // before any CUDA call
  check.tensor(k, "k", 3, "[total_kv, num_kv_heads, head_dim]");
  check.index_array(qo_indptr, "qo_indptr", -1, q.device);
  check.index_array(kv_indptr, "kv_indptr", -1, q.device);
  detail::check_not_capturing(check, q.device, stream, kOneShotSyncs);
  const std::vector<int32_t> qo = detail::read_int32_array(qo_indptr, stream);
  const std::vector<int32_t> kvp = detail::read_int32_array(kv_indptr, stream);
  check_total_fits(check, qo, "qo_indptr", q.shape[0], "rows of q", /*exact=*/true);
  check_total_fits(check, kvp, "kv_indptr", k.shape[0], "rows of k", /*exact=*/false);
  const Plan plan = plan_ragged_prefill(qo, kvp, static_cast<int>(q.shape[1]),
                                        static_cast<int>(k.shape[1]), static_cast<int>(q.shape[2]),
                                        one_shot_options(options, k, v, q.shape[2]), q.device);
  detail::ScratchBuffer scratch(check, q.device, plan.workspace_bytes);
  run_ragged_prefill(plan, q, k, v, qo_indptr, kv_indptr, o, lse, scratch.workspace(), stream,
                     run_options);
}

namespace {

int kv_heads_of(const ArgChecker& check, const PagedKVCache& kv) {
  check.tensor(kv.k_cache, "k_cache", 4,
               "[num_pages, page_size, num_kv_heads, head_dim] (NHD) or "
               "[num_pages, num_kv_heads, page_size, head_dim] (HND)");
  return static_cast<int>(kv.layout == KVLayout::kNHD ? kv.k_cache.shape[2] : kv.k_cache.shape[1]);
}

int page_size_of(const PagedKVCache& kv) {
  return static_cast<int>(kv.layout == KVLayout::kNHD ? kv.k_cache.shape[1] : kv.k_cache.shape[2]);
}

}  // namespace

void paged_prefill(const TensorView& q, const PagedKVCache& kv, const TensorView& qo_indptr,
                   const TensorView& o, const TensorView& lse, const AttentionOptions& options,
                   void* stream, const RunOptions& run_options) {
  const ArgChecker check("paged_prefill");
  check_one_shot_q(check, q);
  detail::check_device_usable(check, q.device);  // before any CUDA call
  const int num_kv_heads = kv_heads_of(check, kv);
  check.index_array(qo_indptr, "qo_indptr", -1, q.device);
  check.index_array(kv.page_indptr, "page_indptr", qo_indptr.shape[0], q.device);
  check.index_array(kv.last_page_len, "last_page_len", qo_indptr.shape[0] - 1, q.device);
  detail::check_not_capturing(check, q.device, stream, kOneShotSyncs);
  const std::vector<int32_t> qo = detail::read_int32_array(qo_indptr, stream);
  const std::vector<int32_t> pages = detail::read_int32_array(kv.page_indptr, stream);
  const std::vector<int32_t> last = detail::read_int32_array(kv.last_page_len, stream);
  check.index_array(kv.page_indices, "page_indices", -1, q.device);
  check_total_fits(check, qo, "qo_indptr", q.shape[0], "rows of q", /*exact=*/true);
  check_total_fits(check, pages, "page_indptr", kv.page_indices.shape[0], "entries of page_indices",
                   /*exact=*/false);
  const Plan plan =
      plan_paged_prefill(qo, pages, last, page_size_of(kv), static_cast<int>(q.shape[1]),
                         num_kv_heads, static_cast<int>(q.shape[2]),
                         one_shot_options(options, kv.k_cache, kv.v_cache, q.shape[2]), q.device);
  detail::ScratchBuffer scratch(check, q.device, plan.workspace_bytes);
  run_paged_prefill(plan, q, kv, qo_indptr, o, lse, scratch.workspace(), stream, run_options);
}

void decode(const TensorView& q, const PagedKVCache& kv, const TensorView& o, const TensorView& lse,
            const AttentionOptions& options, void* stream, const RunOptions& run_options) {
  const ArgChecker check("decode");
  check_one_shot_q(check, q);
  detail::check_device_usable(check, q.device);  // before any CUDA call
  const int num_kv_heads = kv_heads_of(check, kv);
  check.index_array(kv.page_indptr, "page_indptr", -1, q.device);
  const int64_t batch = kv.page_indptr.shape[0] - 1;
  check.require(batch >= 0, "page_indptr", "expected batch_size + 1 >= 1 elements");
  const int64_t q_per_request = batch > 0 ? q.shape[0] / batch : 1;
  check.require(
      batch > 0 ? q.shape[0] % batch == 0 && q_per_request >= 1 && q_per_request <= 64
                : q.shape[0] == 0,
      "q", [&] {
        return "expected batch_size x q_per_request rows with 1 <= q_per_request <= 64, got " +
               std::to_string(q.shape[0]) + " rows for a batch of " + std::to_string(batch);
      });
  check.index_array(kv.last_page_len, "last_page_len", batch, q.device);
  detail::check_not_capturing(check, q.device, stream, kOneShotSyncs);
  const std::vector<int32_t> pages = detail::read_int32_array(kv.page_indptr, stream);
  const std::vector<int32_t> last = detail::read_int32_array(kv.last_page_len, stream);
  check.index_array(kv.page_indices, "page_indices", -1, q.device);
  check_total_fits(check, pages, "page_indptr", kv.page_indices.shape[0], "entries of page_indices",
                   /*exact=*/false);
  const Plan plan = plan_decode(pages, last, page_size_of(kv), static_cast<int>(q.shape[1]),
                                num_kv_heads, static_cast<int>(q.shape[2]),
                                one_shot_options(options, kv.k_cache, kv.v_cache, q.shape[2]),
                                q.device, static_cast<int>(q_per_request));
  detail::ScratchBuffer scratch(check, q.device, plan.workspace_bytes);
  run_decode(plan, q, kv, o, lse, scratch.workspace(), stream, run_options);
}

}  // namespace tessera
