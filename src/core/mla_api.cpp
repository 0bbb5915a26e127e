// MLA entry points (include/tessera/mla.hpp): validate by MLA's own names, then plan and run as
// multi-query attention whose key rows are [ckv | kpe] and whose values are the ckv part of the
// same rows. One definition of the maths: the problem built here goes to dispatch_attention like
// any other, and the CPU reference and fast path read the rope segment (AttentionProblem::q_rope,
// KVSource::k_rope) where q_pe / kpe_cache are tensors of their own.
#include <cmath>
#include <string>
#include <vector>

#include "core/attention_run.hpp"
#include "core/dispatch.hpp"
#include "core/mla_internal.hpp"
#include "core/problem.hpp"
#include "core/validate.hpp"
#include "tessera/mla.hpp"

namespace tessera {
namespace detail {

void check_mla_widths(const ArgChecker& check, int kv_lora_rank, int rope_dim) {
  check.require(kv_lora_rank >= 8 && kv_lora_rank <= kMaxMlaLoraRank && kv_lora_rank % 8 == 0,
                "kv_lora_rank", [&] {
                  return "expected a multiple of 8 in [8, " + std::to_string(kMaxMlaLoraRank) +
                         "], got " + std::to_string(kv_lora_rank);
                });
  check.require(rope_dim >= 0 && rope_dim <= kMaxMlaRopeDim && rope_dim % 8 == 0, "rope_dim", [&] {
    return "expected a multiple of 8 in [0, " + std::to_string(kMaxMlaRopeDim) + "], got " +
           std::to_string(rope_dim);
  });
}

void check_mla_device(const ArgChecker& check, Device device) {
  if (device.type == DeviceType::kCPU) return;
  check.unsupported("device", "MLA runs on the CPU backend only for now (got " +
                                  device_name(device) + "); issue 37's CUDA kernels are not built");
}

}  // namespace detail

namespace {

using detail::ArgChecker;

constexpr std::initializer_list<DType> kMlaDtypes = {DType::kFloat32, DType::kFloat16,
                                                     DType::kBFloat16};

// True when `second` continues `first`'s rows: its data starts right after first's last element
// of a row and every other stride agrees (a combined q or cache, passed as two views).
bool continues(const TensorView& first, const TensorView& second) {
  if (second.ndim != first.ndim || second.dtype != first.dtype) return false;
  const int last = first.ndim - 1;
  for (int d = 0; d < last; ++d) {
    if (first.stride[d] != second.stride[d] && first.shape[d] > 1) return false;
  }
  const char* end = static_cast<const char*>(first.data) +
                    first.shape[last] * static_cast<int64_t>(dtype_size(first.dtype));
  return end == static_cast<const char*>(second.data);
}

// q_nope / q_pe / o [total_q, num_heads, width] and lse [total_q, num_heads] against the plan.
void check_queries(const ArgChecker& check, const MlaPlan& plan, const TensorView& q_nope,
                   const TensorView& q_pe, const TensorView& o, const TensorView& lse) {
  const Plan& p = plan.attention;
  check.tensor(q_nope, "q_nope", 3, "[total_q, num_heads, kv_lora_rank]");
  check.dtype_in(q_nope, "q_nope", kMlaDtypes);
  check.device_is(q_nope, "q_nope", p.device);
  check.dim_is(q_nope, "q_nope", 0, p.total_q, "total query tokens of the plan");
  check.dim_is(q_nope, "q_nope", 1, p.num_qo_heads, "num_heads of the plan");
  check.dim_is(q_nope, "q_nope", 2, plan.kv_lora_rank, "kv_lora_rank of the plan");
  if (plan.rope_dim > 0) {
    check.tensor(q_pe, "q_pe", 3, "[total_q, num_heads, rope_dim]");
    check.dtype_is(q_pe, "q_pe", q_nope.dtype);
    check.device_is(q_pe, "q_pe", p.device);
    check.dim_is(q_pe, "q_pe", 0, p.total_q, "total query tokens of the plan");
    check.dim_is(q_pe, "q_pe", 1, p.num_qo_heads, "num_heads of the plan");
    check.dim_is(q_pe, "q_pe", 2, plan.rope_dim, "rope_dim of the plan");
  }
  check.tensor(o, "o", 3, "[total_q, num_heads, kv_lora_rank]");
  check.output(o, "o");
  check.dtype_is(o, "o", q_nope.dtype);
  check.device_is(o, "o", p.device);
  check.dim_is(o, "o", 0, p.total_q, "total query tokens of the plan");
  check.dim_is(o, "o", 1, p.num_qo_heads, "num_heads of the plan");
  check.dim_is(o, "o", 2, plan.kv_lora_rank, "kv_lora_rank of the plan");
  if (has_value(lse)) {
    check.tensor(lse, "lse", 2, "[total_q, num_heads] of float32");
    check.output(lse, "lse");
    check.dtype_is(lse, "lse", DType::kFloat32);
    check.device_is(lse, "lse", p.device);
    check.dim_is(lse, "lse", 0, p.total_q, "total query tokens of the plan");
    check.dim_is(lse, "lse", 1, p.num_qo_heads, "num_heads of the plan");
  }
}

}  // namespace

void detail::check_mla_caches(const ArgChecker& check, const MlaPagedCache& cache, int kv_lora_rank,
                              int rope_dim, int64_t page_size, DType dtype, Device device,
                              bool written) {
  constexpr std::string_view ckv_layout = "[num_pages, page_size, kv_lora_rank]";
  check.tensor(cache.ckv_cache, "ckv_cache", 3, ckv_layout);
  check.dtype_is(cache.ckv_cache, "ckv_cache", dtype);
  check.device_is(cache.ckv_cache, "ckv_cache", device);
  if (written) check.output(cache.ckv_cache, "ckv_cache");
  check.dim_is(cache.ckv_cache, "ckv_cache", 1, page_size, "page_size");
  check.dim_is(cache.ckv_cache, "ckv_cache", 2, kv_lora_rank, "kv_lora_rank");
  if (rope_dim == 0) return;
  check.tensor(cache.kpe_cache, "kpe_cache", 3, "[num_pages, page_size, rope_dim]");
  check.dtype_is(cache.kpe_cache, "kpe_cache", dtype);
  check.device_is(cache.kpe_cache, "kpe_cache", device);
  if (written) check.output(cache.kpe_cache, "kpe_cache");
  check.dim_is(cache.kpe_cache, "kpe_cache", 0, cache.ckv_cache.shape[0], "num_pages of ckv_cache");
  check.dim_is(cache.kpe_cache, "kpe_cache", 1, page_size, "page_size");
  check.dim_is(cache.kpe_cache, "kpe_cache", 2, rope_dim, "rope_dim");
}

detail::KVSource detail::mla_kv_source(const MlaPagedCache& cache, int rope_dim) {
  KVSource kv;
  const TensorView& ckv = cache.ckv_cache;
  kv.dtype = ckv.dtype;
  kv.paged = true;
  kv.k = kv.v = ckv.data;
  kv.k_stride_page = kv.v_stride_page = ckv.stride[0];
  kv.k_stride_token = kv.v_stride_token = ckv.stride[1];
  kv.k_stride_head = kv.v_stride_head = 0;  // one latent head, shared by every query head
  kv.k_extent = kv.v_extent = ckv.shape[0];
  kv.page_size = static_cast<int32_t>(ckv.shape[1]);
  kv.page_indptr = cache.page_indptr.ptr<const int32_t>();
  kv.page_indices = cache.page_indices.ptr<const int32_t>();
  kv.last_page_len = cache.last_page_len.ptr<const int32_t>();
  // A combined cache ([ckv | kpe] rows) is one segment: the key rows are read in one piece.
  if (rope_dim > 0 && !continues(ckv, cache.kpe_cache)) {
    kv.k_rope = cache.kpe_cache.data;
    kv.k_rope_stride_page = cache.kpe_cache.stride[0];
    kv.k_rope_stride_token = cache.kpe_cache.stride[1];
  }
  return kv;
}

MlaPagedCache split_mla_cache(const TensorView& cache, int kv_lora_rank) {
  const ArgChecker check("split_mla_cache");
  check.tensor(cache, "cache", 3, "[num_pages, page_size, kv_lora_rank + rope_dim]");
  check.require(kv_lora_rank >= 1 && kv_lora_rank <= cache.shape[2], "kv_lora_rank", [&] {
    return "expected a value in [1, " + std::to_string(cache.shape[2]) +
           "] (the cache's last dim), got " + std::to_string(kv_lora_rank);
  });
  MlaPagedCache views;
  views.ckv_cache = cache;
  views.ckv_cache.shape[2] = kv_lora_rank;
  if (cache.shape[2] > kv_lora_rank) {
    views.kpe_cache = cache;
    views.kpe_cache.shape[2] = cache.shape[2] - kv_lora_rank;
    views.kpe_cache.data = static_cast<char*>(cache.data) +
                           kv_lora_rank * static_cast<int64_t>(dtype_size(cache.dtype));
  }
  return views;
}

std::string MlaPlan::explain() const {
  return "MLA (kv_lora_rank " + std::to_string(kv_lora_rank) + ", rope_dim " +
         std::to_string(rope_dim) + ", " + std::to_string(attention.num_qo_heads) +
         " heads over one latent head) as MQA: " + attention.explain();
}

MlaPlan plan_mla(std::span<const int32_t> qo_indptr, std::span<const int32_t> page_indptr,
                 std::span<const int32_t> last_page_len, int page_size, int num_heads,
                 int kv_lora_rank, int rope_dim, const MlaOptions& options, Device device,
                 const PlanCapacity& capacity) {
  const ArgChecker check("plan_mla");
  check.require(num_heads >= 1 && num_heads <= detail::kMaxHeads, "num_heads", [&] {
    return "expected 1.." + std::to_string(detail::kMaxHeads) + ", got " +
           std::to_string(num_heads);
  });
  detail::check_mla_widths(check, kv_lora_rank, rope_dim);
  check.require(std::isfinite(options.sm_scale) && options.sm_scale >= 0.0f, "options.sm_scale",
                [&] {
                  return "expected a finite value >= 0 (0 = 1/sqrt(kv_lora_rank + rope_dim)), "
                         "got " +
                         std::to_string(options.sm_scale);
                });
  detail::check_mla_device(check, device);
  AttentionOptions attention;
  attention.causal = options.causal;
  attention.sm_scale = options.sm_scale;
  attention.head_dim_vo = kv_lora_rank;
  MlaPlan plan;
  plan.attention = detail::plan_paged_prefill_as(
      check, qo_indptr, page_indptr, last_page_len, page_size, num_heads, /*num_kv_heads=*/1,
      kv_lora_rank + rope_dim, attention, device, capacity,
      detail::kMaxMlaLoraRank + detail::kMaxMlaRopeDim);
  plan.kv_lora_rank = kv_lora_rank;
  plan.rope_dim = rope_dim;
  plan.options = options;
  return plan;
}

void run_mla(const MlaPlan& plan, const TensorView& q_nope, const TensorView& q_pe,
             const MlaPagedCache& cache, const TensorView& qo_indptr, const TensorView& o,
             const TensorView& lse, Workspace workspace, void* stream) {
  const ArgChecker check("run_mla");
  const Plan& p = plan.attention;
  check.require(p.op == AttentionOp::kPagedPrefill && p.num_kv_heads == 1 &&
                    plan.kv_lora_rank > 0 && p.head_dim == plan.kv_lora_rank + plan.rope_dim &&
                    p.head_dim_v() == plan.kv_lora_rank,
                "plan", "expected a plan made by plan_mla");
  detail::check_mla_device(check, p.device);
  check_queries(check, plan, q_nope, q_pe, o, lse);
  detail::check_mla_caches(check, cache, plan.kv_lora_rank, plan.rope_dim, p.page_size,
                           q_nope.dtype, p.device, /*written=*/false);
  check.index_array(qo_indptr, "qo_indptr", p.batch_size + 1, p.device);
  {  // CPU: the values are on the host
    const int32_t* values = qo_indptr.ptr<const int32_t>();
    check.indptr(std::span<const int32_t>(values, p.batch_size + 1), "qo_indptr");
    for (int32_t b = 0; b < p.batch_size; ++b) {
      if (values[b + 1] - values[b] != p.q_lens[b]) {
        check.fail("qo_indptr", "does not match the plan: request " + std::to_string(b) +
                                    " has q_len " + std::to_string(values[b + 1] - values[b]) +
                                    " here but " + std::to_string(p.q_lens[b]) + " in the plan");
      }
    }
  }
  PagedKVCache table;
  table.page_indptr = cache.page_indptr;
  table.page_indices = cache.page_indices;
  table.last_page_len = cache.last_page_len;
  detail::check_page_table(check, p, table, cache.ckv_cache.shape[0], stream);
  check.require(workspace.bytes >= p.workspace_bytes, "workspace", [&] {
    return "too small: the plan needs " + std::to_string(p.workspace_bytes) + " bytes, got " +
           std::to_string(workspace.bytes);
  });
  check.require(p.workspace_bytes == 0 || workspace.data != nullptr, "workspace",
                "data pointer is null");

  detail::AttentionProblem problem;
  problem.q_dtype = q_nope.dtype;
  problem.batch_size = p.batch_size;
  problem.num_qo_heads = p.num_qo_heads;
  problem.num_kv_heads = 1;
  problem.head_dim = p.head_dim;
  problem.head_dim_vo = plan.kv_lora_rank;
  problem.rope_dim = plan.rope_dim;
  problem.mla = true;
  problem.q = q_nope.data;
  problem.q_stride_token = q_nope.stride[0];
  problem.q_stride_head = q_nope.stride[1];
  problem.q_extent = q_nope.shape[0];
  if (plan.rope_dim > 0 && !continues(q_nope, q_pe)) {
    problem.q_rope = q_pe.data;
    problem.q_rope_stride_token = q_pe.stride[0];
    problem.q_rope_stride_head = q_pe.stride[1];
  }
  problem.qo_indptr = qo_indptr.ptr<const int32_t>();
  problem.kv = detail::mla_kv_source(cache, plan.rope_dim);
  problem.o = o.data;
  problem.o_stride_token = o.stride[0];
  problem.o_stride_head = o.stride[1];
  problem.o_extent = o.shape[0];
  if (has_value(lse)) {
    problem.lse = lse.ptr<float>();
    problem.lse_stride_token = lse.stride[0];
  }
  problem.sm_scale = plan.options.sm_scale > 0.0f
                         ? plan.options.sm_scale
                         : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  problem.mask.causal = plan.options.causal;
  detail::finish_run_checks(check, p, problem, stream);
  detail::dispatch_attention(p, problem, workspace, stream);
}

void mla_attention(const TensorView& q_nope, const TensorView& q_pe, const MlaPagedCache& cache,
                   const TensorView& qo_indptr, const TensorView& o, const TensorView& lse,
                   const MlaOptions& options, void* stream) {
  const ArgChecker check("mla_attention");
  check.tensor(q_nope, "q_nope", 3, "[total_q, num_heads, kv_lora_rank]");
  detail::check_mla_device(check, q_nope.device);
  const bool has_rope = has_value(q_pe) || q_pe.ndim == 3;
  if (has_rope) check.tensor(q_pe, "q_pe", 3, "[total_q, num_heads, rope_dim]");
  check.tensor(cache.ckv_cache, "ckv_cache", 3, "[num_pages, page_size, kv_lora_rank]");
  for (const auto& [view, name] : {std::pair{qo_indptr, "qo_indptr"},
                                   {cache.page_indptr, "page_indptr"},
                                   {cache.page_indices, "page_indices"},
                                   {cache.last_page_len, "last_page_len"}}) {
    check.index_array(view, name, -1, q_nope.device);
  }
  const int64_t batch = qo_indptr.shape[0] - 1;
  check.require(batch >= 0, "qo_indptr", "expected batch_size + 1 >= 1 elements");
  check.index_array(cache.page_indptr, "page_indptr", batch + 1, q_nope.device);
  check.index_array(cache.last_page_len, "last_page_len", batch, q_nope.device);
  const std::span<const int32_t> qo(qo_indptr.ptr<const int32_t>(), batch + 1);
  const std::span<const int32_t> pages(cache.page_indptr.ptr<const int32_t>(), batch + 1);
  const std::span<const int32_t> last(cache.last_page_len.ptr<const int32_t>(), batch);
  // The totals must fit the tensors before the planner sizes a work list by them.
  check.require(qo.back() == q_nope.shape[0], "qo_indptr", [&] {
    return "qo_indptr[batch_size] = " + std::to_string(qo.back()) + " does not equal the " +
           std::to_string(q_nope.shape[0]) + " rows of q_nope";
  });
  check.require(pages.back() <= cache.page_indices.shape[0], "page_indptr", [&] {
    return "page_indptr[batch_size] = " + std::to_string(pages.back()) + " exceeds the " +
           std::to_string(cache.page_indices.shape[0]) + " entries of page_indices";
  });
  const auto narrow = [&](int64_t value, const char* name) {
    check.require(value >= 0 && value <= INT32_MAX, name, "has a dimension beyond 2^31 - 1");
    return static_cast<int>(value);
  };
  const MlaPlan plan =
      plan_mla(qo, pages, last, narrow(cache.ckv_cache.shape[1], "ckv_cache"),
               narrow(q_nope.shape[1], "q_nope"), narrow(q_nope.shape[2], "q_nope"),
               has_rope ? narrow(q_pe.shape[2], "q_pe") : 0, options, q_nope.device);
  detail::ScratchBuffer scratch(check, q_nope.device, plan.workspace_bytes());
  run_mla(plan, q_nope, q_pe, cache, qo_indptr, o, lse, scratch.workspace(), stream);
}

}  // namespace tessera
