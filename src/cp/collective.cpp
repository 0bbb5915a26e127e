// The NCCL drivers of context parallelism: prefill with a ring (or all-gather) of K/V overlapped
// with the attention blocks of each step, and decode with an all-gather of the partial (o, lse).
// Only the communication and stream ordering live here; the attention and merge are the pieces
// in runner.cpp that the CPU simulation of the tests runs too.
//
// Streams: attention runs on the caller's stream; NCCL runs on a second (non-blocking) stream
// created per call, ordered against the attention by events:
//   ring, step t:  comm waits "compute of step t-1 done" (it overwrites that step's buffer),
//                  send buffer[t % 2] to rank + 1, receive buffer[(t + 1) % 2] from rank - 1;
//                  compute runs step t on buffer[t % 2], then waits "received" before step t+1.
//   all-gather:    comm gathers every rank's slot while compute runs step 0 on the local slot;
//                  compute waits "gathered" before step 1.
// At the end the caller's stream waits for the communication stream, so everything the call
// started is ordered before the caller's next work on `stream`.
#include <string>

#include "core/validate.hpp"
#include "cp/cp_internal.hpp"
#include "tessera/context_parallel.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace tessera {
namespace {

using detail::ArgChecker;

#if defined(TESSERA_HAVE_CUDA)

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kRuntime, std::string("context parallel: ") + what + ": " +
                                           cudaGetErrorString(status));
  }
}

// The communication stream and events of one call, released when the call returns (CUDA defers
// the release of a stream or event with pending work until that work completes).
class CommResources {
 public:
  explicit CommResources(int device) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    cuda_check(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (cudaEvent_t* event : {&start_, &computed_, &communicated_}) {
      cuda_check(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "cudaEventCreate");
    }
  }
  ~CommResources() {
    for (cudaEvent_t event : {start_, computed_, communicated_}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (comm_ != nullptr) cudaStreamDestroy(comm_);
  }
  CommResources(const CommResources&) = delete;
  CommResources& operator=(const CommResources&) = delete;

  cudaStream_t comm() const { return comm_; }
  // `waiter` waits for everything enqueued so far on `signaller`, through `event`.
  static void order(cudaStream_t signaller, cudaEvent_t event, cudaStream_t waiter) {
    cuda_check(cudaEventRecord(event, signaller), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
  }
  cudaEvent_t start() const { return start_; }
  cudaEvent_t computed() const { return computed_; }
  cudaEvent_t communicated() const { return communicated_; }

 private:
  cudaStream_t comm_ = nullptr;
  cudaEvent_t start_ = nullptr, computed_ = nullptr, communicated_ = nullptr;
};

// Copies the rows of a [rows, H, D] view (head dim contiguous within each token) into a
// contiguous buffer.
void pack_rows(void* dst, const TensorView& src, cudaStream_t stream) {
  const size_t row_bytes = static_cast<size_t>(src.shape[1] * src.shape[2]) * dtype_size(src.dtype);
  if (src.shape[0] == 0) return;
  cuda_check(cudaMemcpy2DAsync(dst, row_bytes, src.data,
                               static_cast<size_t>(src.stride[0]) * dtype_size(src.dtype),
                               row_bytes, static_cast<size_t>(src.shape[0]),
                               cudaMemcpyDeviceToDevice, stream),
             "packing local K/V");
}

void check_communicator(const ArgChecker& check, const detail::NcclApi& nccl, void* comm,
                        int world_size, int rank) {
  check.require(comm != nullptr, "nccl_comm", "expected an ncclComm_t, got null");
  int count = 0, user_rank = 0;
  detail::nccl_check(nccl, nccl.comm_count(comm, &count), "ncclCommCount");
  detail::nccl_check(nccl, nccl.comm_user_rank(comm, &user_rank), "ncclCommUserRank");
  check.require(count == world_size && user_rank == rank, "nccl_comm", [&] {
    return "expected a communicator of " + std::to_string(world_size) + " ranks at rank " +
           std::to_string(rank) + ", got " + std::to_string(count) + " ranks at rank " +
           std::to_string(user_rank);
  });
}

#endif  // TESSERA_HAVE_CUDA

void check_cuda_view(const ArgChecker& check, const TensorView& view, const char* name,
                     bool optional = false) {
  if (optional && !has_value(view)) return;
  check.require(view.device.type == DeviceType::kCUDA, name,
                "expected a CUDA tensor (the NCCL path runs on GPUs; the CPU simulation calls "
                "run_context_parallel_step / merge_context_parallel_states directly)");
}

#if !defined(TESSERA_HAVE_CUDA)
[[noreturn]] void no_cuda(const ArgChecker& check) {
  check.unsupported("device", "this build has no CUDA backend: context parallelism over NCCL "
                              "needs a CUDA build");
}
#endif

}  // namespace

void run_context_parallel_prefill(const ContextParallelPlan& plan, const TensorView& q,
                                  const TensorView& k, const TensorView& v, const TensorView& o,
                                  const TensorView& lse, Workspace workspace, void* nccl_comm,
                                  void* stream) {
  const ArgChecker check("run_context_parallel_prefill");
  check.require(plan.device.type == DeviceType::kCUDA, "plan", [&] {
    return "expected a plan for a CUDA device, got " + device_name(plan.device);
  });
  for (const auto& [view, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&o, "o"}}) {
    check_cuda_view(check, *view, name);
  }
  check_cuda_view(check, lse, "lse", true);
#if !defined(TESSERA_HAVE_CUDA)
  no_cuda(check);
#else
  check.require(workspace.bytes >= plan.workspace_bytes && workspace.data != nullptr, "workspace",
                [&] {
                  return "expected at least " + std::to_string(plan.workspace_bytes) +
                         " bytes, got " + std::to_string(workspace.bytes);
                });
  const int32_t n = plan.world_size(), rank = plan.rank;
  for (const auto& [view, name] : {std::pair{&k, "k"}, {&v, "v"}}) {
    check.tensor(*view, name, 3, "[local_rows, num_kv_heads, head_dim]");
    check.dtype_is(*view, name, plan.dtype);
    check.dim_is(*view, name, 0, plan.local_rows(), "local_rows");
    check.dim_is(*view, name, 1, plan.num_kv_heads, "num_kv_heads");
    check.dim_is(*view, name, 2, plan.head_dim, "head_dim");
    check.require(view->stride[1] == plan.head_dim || view->shape[1] == 1, name,
                  "expected the heads of a token to be contiguous (stride[1] == head_dim)");
  }
  const detail::NcclApi* nccl = nullptr;
  if (n > 1) {
    nccl = &detail::nccl_api();
    check_communicator(check, *nccl, nccl_comm, n, rank);
  }
  const auto compute = static_cast<cudaStream_t>(stream);
  CommResources resources(plan.device.index);
  const cudaStream_t comm = resources.comm();

  prepare_context_parallel_workspace(plan, workspace, compute);
  const bool ring = plan.exchange == KVExchange::kRing;
  const int32_t local_slot = ring ? 0 : rank;
  pack_rows(context_parallel_kv_slot(plan, workspace, local_slot, false).data, k, compute);
  pack_rows(context_parallel_kv_slot(plan, workspace, local_slot, true).data, v, compute);
  if (n > 1) CommResources::order(compute, resources.start(), comm);

  if (!ring && n > 1) {
    // In place: every rank's slot r already holds its shard (slot r = recvbuff + r * count).
    const TensorView base = context_parallel_kv_slot(plan, workspace, 0, false);
    const char* own = static_cast<const char*>(base.data) + plan.kv_slot_bytes * rank;
    detail::nccl_check(*nccl,
                       nccl->all_gather(own, base.data, plan.kv_slot_bytes,
                                        detail::NcclApi::kUint8, nccl_comm, comm),
                       "ncclAllGather of K/V");
  }
  for (int32_t step = 0; step < n; ++step) {
    const int32_t slot = ring ? step % 2 : plan.source_rank(step);
    if (ring && step + 1 < n) {
      const TensorView current = context_parallel_kv_slot(plan, workspace, step % 2, false);
      const TensorView next = context_parallel_kv_slot(plan, workspace, (step + 1) % 2, false);
      if (step > 0) CommResources::order(compute, resources.computed(), comm);
      detail::nccl_check(*nccl, nccl->group_start(), "ncclGroupStart");
      detail::nccl_check(*nccl,
                         nccl->send(current.data, plan.kv_slot_bytes, detail::NcclApi::kUint8,
                                    (rank + 1) % n, nccl_comm, comm),
                         "ncclSend of K/V");
      detail::nccl_check(*nccl,
                         nccl->recv(next.data, plan.kv_slot_bytes, detail::NcclApi::kUint8,
                                    (rank + n - 1) % n, nccl_comm, comm),
                         "ncclRecv of K/V");
      detail::nccl_check(*nccl, nccl->group_end(), "ncclGroupEnd");
    }
    run_context_parallel_step(plan, step, q, context_parallel_kv_slot(plan, workspace, slot, false),
                              context_parallel_kv_slot(plan, workspace, slot, true), workspace,
                              compute);
    if (step + 1 < n && (ring || step == 0)) {
      CommResources::order(comm, resources.communicated(), compute);
    }
  }
  merge_context_parallel_states(plan, o, lse, workspace, compute);
  if (n > 1) CommResources::order(comm, resources.communicated(), compute);
  cuda_check(cudaGetLastError(), "context-parallel prefill");
#endif
}

void run_context_parallel_decode(const Plan& local_plan, int world_size, int rank,
                                 const TensorView& q, const PagedKVCache& kv_shard,
                                 const TensorView& o, const TensorView& lse,
                                 Workspace workspace, void* nccl_comm, void* stream) {
  const ArgChecker check("run_context_parallel_decode");
  check.require(local_plan.device.type == DeviceType::kCUDA, "local_plan", [&] {
    return "expected a plan for a CUDA device, got " + device_name(local_plan.device);
  });
  check_cuda_view(check, q, "q");
  check_cuda_view(check, o, "o");
  check_cuda_view(check, lse, "lse", true);
#if !defined(TESSERA_HAVE_CUDA)
  no_cuda(check);
#else
  check.require(rank >= 0 && rank < world_size, "rank",
                [&] { return "expected 0 <= rank < world_size = " + std::to_string(world_size); });
  check.require(workspace.bytes >= context_parallel_decode_workspace_bytes(local_plan, world_size,
                                                                           q.dtype),
                "workspace", "expected context_parallel_decode_workspace_bytes() bytes");
  const auto compute = static_cast<cudaStream_t>(stream);
  run_context_parallel_decode_local(local_plan, world_size, rank, q, kv_shard, workspace,
                                    compute);
  if (world_size > 1) {
    const detail::NcclApi& nccl = detail::nccl_api();
    check_communicator(check, nccl, nccl_comm, world_size, rank);
    // In place, on the caller's stream: the gather needs the local partial and the merge needs
    // the gather, so there is nothing to overlap.
    for (const bool is_lse : {false, true}) {
      const TensorView first =
          context_parallel_decode_slot(local_plan, world_size, q.dtype, workspace, 0, is_lse);
      const size_t slot_bytes = static_cast<size_t>(first.numel()) * dtype_size(first.dtype);
      if (slot_bytes == 0) continue;
      detail::nccl_check(nccl, nccl.group_start(), "ncclGroupStart");
      detail::nccl_check(nccl,
                         nccl.all_gather(static_cast<char*>(first.data) + slot_bytes * rank,
                                         first.data, slot_bytes, detail::NcclApi::kUint8,
                                         nccl_comm, compute),
                         is_lse ? "ncclAllGather of lse" : "ncclAllGather of o");
      detail::nccl_check(nccl, nccl.group_end(), "ncclGroupEnd");
    }
  }
  merge_context_parallel_decode(local_plan, world_size, q.dtype, o, lse, workspace, compute);
  cuda_check(cudaGetLastError(), "context-parallel decode");
#endif
}

}  // namespace tessera
