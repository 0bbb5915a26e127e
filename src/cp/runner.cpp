// Context parallelism, the per-rank pieces that need no communication: writing the plan's index
// arrays into the workspace, running one ring step's blocks through run_ragged_prefill, merging
// the partial states with merge_states, and the local half of context-parallel decode. The NCCL
// driver (collective.cpp) and the CPU simulation of the tests call exactly these.
#include <cstring>
#include <vector>

#include "core/validate.hpp"
#include "cp/cp_internal.hpp"
#include "tessera/context_parallel.hpp"
#include "tessera/ops.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace tessera {
namespace {

using detail::ArgChecker;

constexpr size_t kAlignment = 256;
size_t align_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

char* at(Workspace workspace, size_t offset) { return static_cast<char*>(workspace.data) + offset; }

// Rows [begin, begin + rows) of a [N, H, D] (or [N, H]) view.
TensorView row_slice(const TensorView& view, int64_t begin, int64_t rows) {
  TensorView slice = view;
  slice.data = static_cast<char*>(view.data) +
               static_cast<size_t>(begin * view.stride[0]) * dtype_size(view.dtype);
  slice.shape[0] = rows;
  return slice;
}

void check_workspace(const ArgChecker& check, Workspace workspace, size_t needed) {
  check.require(workspace.bytes >= needed && (needed == 0 || workspace.data != nullptr),
                "workspace", [&] {
                  return "expected at least " + std::to_string(needed) + " bytes, got " +
                         std::to_string(workspace.bytes);
                });
}

void check_plan_tensor(const ArgChecker& check, const ContextParallelPlan& plan,
                       const TensorView& view, const char* name, int64_t min_rows, int heads,
                       bool exact_rows) {
  check.tensor(view, name, 3, "[rows, heads, head_dim]");
  check.dtype_is(view, name, plan.dtype);
  check.device_is(view, name, plan.device);
  if (exact_rows) {
    check.dim_is(view, name, 0, min_rows, "rows");
  } else {
    check.require(view.shape[0] >= min_rows, name, [&] {
      return "expected at least " + std::to_string(min_rows) + " rows, got " +
             std::to_string(view.shape[0]);
    });
  }
  check.dim_is(view, name, 1, heads, "heads");
  check.dim_is(view, name, 2, plan.head_dim, "head_dim");
}

// Views of the index arrays written by prepare_context_parallel_workspace.
TensorView index_view(const ContextParallelPlan& plan, Workspace workspace, size_t first,
                      int64_t count) {
  return make_view(at(workspace, plan.index_offset) + first * sizeof(int32_t), DType::kInt32,
                   {count}, plan.device);
}

}  // namespace

namespace detail {

void cp_copy_host_to_device(void* dst, const void* src, size_t bytes, Device device,
                            void* stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  // From pageable memory: returns once `src` is staged, so it may be freed right after.
  const cudaError_t status = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice,
                                             static_cast<cudaStream_t>(stream));
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kRuntime, std::string("context parallel: index upload failed: ") +
                                           cudaGetErrorString(status));
  }
#else
  throw Error(Error::Kind::kUnsupported, "context parallel: this build has no CUDA backend");
#endif
}

}  // namespace detail

TensorView context_parallel_kv_slot(const ContextParallelPlan& plan, Workspace workspace,
                                    int32_t slot, bool value) {
  const ArgChecker check("context_parallel_kv_slot");
  check.require(slot >= 0 && slot < plan.num_kv_slots, "slot",
                [&] { return "expected 0 <= slot < " + std::to_string(plan.num_kv_slots); });
  check_workspace(check, workspace, plan.workspace_bytes);
  const int64_t rows = plan.sharding.max_rank_length();
  const size_t half = static_cast<size_t>(rows) * plan.num_kv_heads * plan.head_dim *
                      dtype_size(plan.dtype);
  char* base = at(workspace, plan.kv_buffers_offset + plan.kv_slot_bytes * slot);
  return make_view(base + (value ? half : 0), plan.dtype,
                   {rows, plan.num_kv_heads, plan.head_dim}, plan.device);
}

void prepare_context_parallel_workspace(const ContextParallelPlan& plan, Workspace workspace,
                                        void* stream) {
  const ArgChecker check("prepare_context_parallel_workspace");
  check_workspace(check, workspace, plan.workspace_bytes);
  std::vector<int32_t> indices;
  indices.reserve(4 * plan.blocks.size() + plan.merge_indptr.size());
  for (const ContextParallelBlock& block : plan.blocks) {
    indices.insert(indices.end(), {0, block.q_end - block.q_begin, 0, block.kv_end - block.kv_begin});
  }
  indices.insert(indices.end(), plan.merge_indptr.begin(), plan.merge_indptr.end());
  detail::cp_copy_host_to_device(at(workspace, plan.index_offset), indices.data(),
                                 indices.size() * sizeof(int32_t), plan.device, stream);
}

void run_context_parallel_step(const ContextParallelPlan& plan, int32_t step,
                               const TensorView& q, const TensorView& k_shard,
                               const TensorView& v_shard, Workspace workspace, void* stream) {
  const ArgChecker check("run_context_parallel_step");
  check.require(step >= 0 && step < plan.world_size(), "step", [&] {
    return "expected 0 <= step < world_size = " + std::to_string(plan.world_size());
  });
  check_workspace(check, workspace, plan.workspace_bytes);
  const int64_t source_rows = plan.sharding.rank_length(plan.source_rank(step));
  check_plan_tensor(check, plan, q, "q", plan.local_rows(), plan.num_qo_heads, true);
  check_plan_tensor(check, plan, k_shard, "k_shard", source_rows, plan.num_kv_heads, false);
  check_plan_tensor(check, plan, v_shard, "v_shard", source_rows, plan.num_kv_heads, false);

  const int64_t row_elements = int64_t{plan.num_qo_heads} * plan.head_dim;
  char* states = at(workspace, plan.states_offset);
  float* lse = reinterpret_cast<float*>(at(workspace, plan.lse_offset));
  const Workspace attention{at(workspace, plan.attention_offset), plan.attention_bytes};
  for (int32_t i = plan.step_indptr[step]; i < plan.step_indptr[step + 1]; ++i) {
    const ContextParallelBlock& block = plan.blocks[static_cast<size_t>(i)];
    const int64_t q_rows = block.q_end - block.q_begin;
    const int64_t kv_rows = block.kv_end - block.kv_begin;
    const TensorView o_partial = make_view(
        states + static_cast<size_t>(block.state_begin * row_elements) * dtype_size(plan.dtype),
        plan.dtype, {q_rows, plan.num_qo_heads, plan.head_dim},
        {block.state_stride * row_elements, plan.head_dim, 1}, plan.device);
    const TensorView lse_partial =
        make_view(lse + block.state_begin * plan.num_qo_heads, DType::kFloat32,
                  {q_rows, plan.num_qo_heads},
                  {int64_t{block.state_stride} * plan.num_qo_heads, 1}, plan.device);
    run_ragged_prefill(plan.block_plans[static_cast<size_t>(i)], row_slice(q, block.q_begin, q_rows),
                       row_slice(k_shard, block.kv_begin, kv_rows),
                       row_slice(v_shard, block.kv_begin, kv_rows),
                       index_view(plan, workspace, 4 * static_cast<size_t>(i), 2),
                       index_view(plan, workspace, 4 * static_cast<size_t>(i) + 2, 2), o_partial,
                       lse_partial, attention, stream);
  }
}

void merge_context_parallel_states(const ContextParallelPlan& plan, const TensorView& o,
                                   const TensorView& lse, Workspace workspace, void* stream) {
  const ArgChecker check("merge_context_parallel_states");
  check_workspace(check, workspace, plan.workspace_bytes);
  check_plan_tensor(check, plan, o, "o", plan.local_rows(), plan.num_qo_heads, true);
  if (plan.local_rows() == 0) return;
  const TensorView states =
      make_view(at(workspace, plan.states_offset), plan.dtype,
                {plan.num_states, plan.num_qo_heads, plan.head_dim}, plan.device);
  const TensorView states_lse = make_view(at(workspace, plan.lse_offset), DType::kFloat32,
                                          {plan.num_states, plan.num_qo_heads}, plan.device);
  merge_states(states, states_lse,
               index_view(plan, workspace, 4 * plan.blocks.size(),
                          static_cast<int64_t>(plan.merge_indptr.size())),
               o, lse, stream);
}

// ---- decode ----

namespace {

struct DecodeLayout {
  int64_t rows = 0;  // query rows of the batch
  size_t o_slot_bytes = 0, lse_slot_bytes = 0;
  size_t o_offset = 0, lse_offset = 0, index_offset = 0, attention_offset = 0, total = 0;
};

DecodeLayout decode_layout(const ArgChecker& check, const Plan& plan, int world_size,
                           DType dtype) {
  check.require(plan.op == AttentionOp::kDecode, "local_plan", "expected a plan_decode plan");
  check.require(world_size >= 1 && world_size <= 4096, "world_size",
                [&] { return "expected 1..4096 ranks, got " + std::to_string(world_size); });
  check.require(dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32,
                "dtype", [&] {
                  return std::string("expected q's dtype (float16, bfloat16 or float32), got ") +
                         dtype_name(dtype);
                });
  if (plan.options.causal) {
    for (const int32_t q_len : plan.q_lens) {
      if (q_len > 1) {
        check.unsupported("local_plan.options.causal",
                          "causal context-parallel decode needs one query per request (a shard "
                          "that is not the sequence's tail would apply the mask at the wrong "
                          "keys); plan without causal or with q_per_request = 1");
      }
    }
  }
  DecodeLayout layout;
  layout.rows = plan.total_q;
  layout.o_slot_bytes = static_cast<size_t>(layout.rows) * plan.num_qo_heads * plan.head_dim *
                        dtype_size(dtype);
  layout.lse_slot_bytes = static_cast<size_t>(layout.rows) * plan.num_qo_heads * sizeof(float);
  layout.o_offset = 0;
  layout.lse_offset = align_up(layout.o_slot_bytes * world_size);
  layout.index_offset = align_up(layout.lse_offset + layout.lse_slot_bytes * world_size);
  layout.attention_offset = layout.index_offset + kAlignment;  // the merge's indptr {0, N}
  layout.total = layout.attention_offset + plan.workspace_bytes;
  return layout;
}

}  // namespace

size_t context_parallel_decode_workspace_bytes(const Plan& local_plan, int world_size,
                                               DType dtype) {
  return decode_layout(ArgChecker("context_parallel_decode_workspace_bytes"), local_plan,
                       world_size, dtype)
      .total;
}

TensorView context_parallel_decode_slot(const Plan& local_plan, int world_size, DType dtype,
                                        Workspace workspace, int32_t slot, bool lse) {
  const ArgChecker check("context_parallel_decode_slot");
  const DecodeLayout layout = decode_layout(check, local_plan, world_size, dtype);
  check_workspace(check, workspace, layout.total);
  check.require(slot >= 0 && slot < world_size, "slot",
                [&] { return "expected 0 <= slot < world_size = " + std::to_string(world_size); });
  if (lse) {
    return make_view(at(workspace, layout.lse_offset + layout.lse_slot_bytes * slot),
                     DType::kFloat32, {layout.rows, local_plan.num_qo_heads}, local_plan.device);
  }
  return make_view(at(workspace, layout.o_offset + layout.o_slot_bytes * slot), dtype,
                   {layout.rows, local_plan.num_qo_heads, local_plan.head_dim},
                   local_plan.device);
}

void run_context_parallel_decode_local(const Plan& local_plan, int world_size, int rank,
                                       const TensorView& q, const PagedKVCache& kv_shard,
                                       Workspace workspace, void* stream) {
  const ArgChecker check("run_context_parallel_decode_local");
  check.require(rank >= 0 && rank < world_size, "rank",
                [&] { return "expected 0 <= rank < world_size = " + std::to_string(world_size); });
  check.tensor(q, "q", 3, "[rows, num_qo_heads, head_dim]");
  const DecodeLayout layout = decode_layout(check, local_plan, world_size, q.dtype);
  check_workspace(check, workspace, layout.total);
  run_decode(local_plan, q, kv_shard,
             context_parallel_decode_slot(local_plan, world_size, q.dtype, workspace, rank, false),
             context_parallel_decode_slot(local_plan, world_size, q.dtype, workspace, rank, true),
             Workspace{at(workspace, layout.attention_offset), local_plan.workspace_bytes},
             stream);
}

void merge_context_parallel_decode(const Plan& local_plan, int world_size, DType dtype,
                                   const TensorView& o, const TensorView& lse,
                                   Workspace workspace, void* stream) {
  const ArgChecker check("merge_context_parallel_decode");
  const DecodeLayout layout = decode_layout(check, local_plan, world_size, dtype);
  check_workspace(check, workspace, layout.total);
  const int64_t heads = local_plan.num_qo_heads, dim = local_plan.head_dim;
  check.tensor(o, "o", 3, "[rows, num_qo_heads, head_dim]");
  check.dim_is(o, "o", 0, layout.rows, "rows");
  check.dim_is(o, "o", 1, heads, "num_qo_heads");
  check.dim_is(o, "o", 2, dim, "head_dim");
  check.require(o.is_contiguous(), "o", "expected a contiguous tensor");
  if (has_value(lse)) {
    check.tensor(lse, "lse", 2, "[rows, num_qo_heads] of float32");
    check.dim_is(lse, "lse", 0, layout.rows, "rows");
    check.dim_is(lse, "lse", 1, heads, "num_qo_heads");
  }
  if (layout.rows == 0) return;
  // Slot r holds rank r's [rows, H, D] partial: seen as [N, rows * H, D] states (row-major over
  // ranks), one merged "row" of rows * H heads is exactly the per-(query, head) merge over ranks.
  const int64_t flat_heads = layout.rows * heads;
  const TensorView states = make_view(at(workspace, layout.o_offset), dtype,
                                      {world_size, flat_heads, dim}, local_plan.device);
  const TensorView states_lse = make_view(at(workspace, layout.lse_offset), DType::kFloat32,
                                          {world_size, flat_heads}, local_plan.device);
  TensorView o_flat = make_view(o.data, o.dtype, {1, flat_heads, dim}, o.device);
  TensorView lse_flat;
  if (has_value(lse)) {
    check.require(lse.is_contiguous(), "lse", "expected a contiguous tensor");
    lse_flat = make_view(lse.data, lse.dtype, {1, flat_heads}, lse.device);
  }
  // indptr {0, N}: one output row merging all N states, on the states' device.
  const int32_t indptr_host[2] = {0, world_size};
  int32_t* indptr = reinterpret_cast<int32_t*>(at(workspace, layout.index_offset));
  detail::cp_copy_host_to_device(indptr, indptr_host, sizeof(indptr_host), local_plan.device,
                                 stream);
  merge_states(states, states_lse, make_view(indptr, DType::kInt32, {2}, local_plan.device),
               o_flat, lse_flat, stream);
}

}  // namespace tessera
