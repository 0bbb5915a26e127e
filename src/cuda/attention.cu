// CUDA backend entry for attention: uploads the plan's lists into the workspace (upload_plan's
// pinned one-copy path, or run()'s own fallback), checks what the kernels need from the
// arguments and the device, and launches the plan's registry row (prefill or decode), then the
// merge of split-KV partials.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <bit>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "core/workspace_layout.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"
#include "cuda/kernel_select.hpp"
#include "cuda/sm80/decode_api.hpp"
#include "cuda/sm80/prefill_api.hpp"

namespace tessera::detail {
namespace {

// The kernels copy rows with 16-byte cp.async / vector stores: a tensor's base must be 16-byte
// aligned and every stride that is actually stepped (extent > 1) a multiple of 8 elements.
constexpr uintptr_t kVectorBytes = 16;
constexpr int64_t kVectorElements = 8;

void check_vector_access(const char* name, const void* data, bool required,
                         std::initializer_list<std::pair<int64_t, bool>> strides) {
  if (!required) return;
  if (reinterpret_cast<uintptr_t>(data) % kVectorBytes != 0) {
    throw Error(Error::Kind::kUnsupported,
                std::string("tessera: '") + name +
                    "': CUDA prefill needs a 16-byte aligned data pointer");
  }
  for (const auto& [stride, stepped] : strides) {
    if (stepped && stride % kVectorElements != 0) {
      throw Error(Error::Kind::kUnsupported,
                  std::string("tessera: '") + name + "': stride " + std::to_string(stride) +
                      " is not a multiple of 8 elements (16 bytes), which CUDA prefill needs");
    }
  }
}

template <class T>
void upload_list(const std::vector<T>& list, void* device_base, size_t offset,
                 cudaStream_t stream) {
  if (list.empty()) return;
  check_cuda(cudaMemcpyAsync(static_cast<unsigned char*>(device_base) + offset, list.data(),
                             list.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (plan upload into the workspace)");
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// ---- pinned staging for upload_plan ----
// Blocks of pinned host memory, each with an event recorded after the copy that reads it; a
// block is reused only once its event has completed (polled, never waited for; with the cap of
// blocks in flight reached, an upload goes through pageable memory instead). Blocks live until
// the process ends (the pool is leaked on purpose: no CUDA calls from static destructors).
struct StagingBlock {
  int device = 0;
  void* host = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;
  bool recorded = false;
  bool dead = false;  // its event failed (context reset): never reused
};

class StagingPool {
 public:
  static StagingPool& instance() {
    static StagingPool* pool = new StagingPool();
    return *pool;
  }

  // Copies `bytes` produced by `fill` to `device_dst` with one cudaMemcpyAsync on `stream`.
  // With kMaxBlocksPerDevice uploads in flight on the device (the host far ahead of the GPU,
  // e.g. many wrappers sharing one workspace), the image goes through pageable memory instead.
  // The driver has read a pageable source when cudaMemcpyAsync returns (it stages it into its
  // own pinned memory, or copies synchronously), so the buffer is reused at once. The CUDA
  // documentation allows that call to wait for the stream; the H200 host's driver did not
  // (CudaGraph.UploadsBeyondTheStagingPoolGoThroughPageableMemory), where the pool used to wait
  // for its oldest upload every time.
  template <class Fill>
  void upload(int device, void* device_dst, size_t bytes, cudaStream_t stream, Fill&& fill) {
    std::lock_guard<std::mutex> lock(mutex_);
    StagingBlock* block = acquire(device, bytes);
    if (block == nullptr) {
      overflow_.resize(std::max(overflow_.size(), bytes));
      fill(overflow_.data());
      check_cuda(
          cudaMemcpyAsync(device_dst, overflow_.data(), bytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (upload_plan: pageable image -> workspace, staging pool full)");
      ++overflow_uploads_;
      return;
    }
    fill(block->host);
    check_cuda(cudaMemcpyAsync(device_dst, block->host, bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (upload_plan: pinned staging -> workspace)");
    check_cuda(cudaEventRecord(block->done, stream), "cudaEventRecord (upload_plan staging)");
    block->recorded = true;
  }

  // Uploads that went through pageable memory because the pool was full (tests).
  uint64_t overflow_uploads() {
    std::lock_guard<std::mutex> lock(mutex_);
    return overflow_uploads_;
  }

  // After a reset of `device`: its blocks' events and pinned memory belonged to the destroyed
  // context. Released (errors ignored and cleared: the context may have taken them already).
  void drop_device(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(blocks_, [&](const std::unique_ptr<StagingBlock>& block) {
      if (block->device != device) return false;
      if (block->done != nullptr) (void)cudaEventDestroy(block->done);
      if (block->host != nullptr) (void)cudaFreeHost(block->host);
      (void)cudaGetLastError();
      return true;
    });
  }

 private:
  static constexpr size_t kMinBlockBytes = size_t{64} << 10;
  static constexpr size_t kMaxBlocksPerDevice = 64;

  bool is_free(StagingBlock& block) {
    if (!block.recorded) return true;
    const cudaError_t status = cudaEventQuery(block.done);
    if (status == cudaSuccess) {
      block.recorded = false;
      return true;
    }
    (void)cudaGetLastError();  // not-ready is no error; any other is handled here: keep it out
                               // of later launch checks
    if (status == cudaErrorNotReady) return false;
    // The event is gone (its context was destroyed: cudaDeviceReset) or its copy failed: the
    // block is never reused (its memory may have gone with the context), so one failure does
    // not fail every later upload. Its memory is released by drop_device, or leaked.
    block.dead = true;
    return false;
  }

  // A free block of at least `bytes` on `device`, else a new one while fewer than
  // kMaxBlocksPerDevice of the device's blocks are in flight; nullptr when that many are (free
  // blocks too small for this image do not count: they never make a large image pageable).
  StagingBlock* acquire(int device, size_t bytes) {
    size_t in_flight = 0;
    for (auto& block : blocks_) {
      if (block->device != device || block->dead) continue;
      if (!is_free(*block)) {
        if (!block->dead) ++in_flight;
      } else if (block->bytes >= bytes) {
        return block.get();
      }
    }
    if (in_flight >= kMaxBlocksPerDevice) return nullptr;
    auto block = std::make_unique<StagingBlock>();
    block->device = device;
    block->bytes = std::max(kMinBlockBytes, std::bit_ceil(bytes));
    // No pinned memory or event to be had (pinned host memory exhausted, a broken context):
    // this upload goes through pageable memory, as with the pool full, rather than failing.
    if (cudaHostAlloc(&block->host, block->bytes, cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    if (cudaEventCreateWithFlags(&block->done, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaFreeHost(block->host);
      (void)cudaGetLastError();
      return nullptr;
    }
    blocks_.push_back(std::move(block));
    return blocks_.back().get();
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<StagingBlock>> blocks_;
  std::vector<unsigned char> overflow_;
  uint64_t overflow_uploads_ = 0;
};

// Which upload each workspace holds last: the generation of an upload through pinned staging
// (upload_plan's, or run()'s for a plan the workspace did not hold; no Plan records the latter,
// the plan is const there), or 0 after run()'s pageable copies inside a capture (no header).
// run() skips its upload only for a plan whose generation is still its workspace's.
class UploadRegistry {
 public:
  static UploadRegistry& instance() {
    static UploadRegistry* registry = new UploadRegistry();
    return *registry;
  }
  uint64_t next_generation() { return next_.fetch_add(1, std::memory_order_relaxed); }
  void set(const void* workspace, uint64_t generation) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (generation == 0) {
      latest_.erase(workspace);
    } else {
      latest_[workspace] = generation;
    }
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    latest_.clear();
  }
  bool holds(const void* workspace, uint64_t generation) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = latest_.find(workspace);
    return it != latest_.end() && it->second == generation;
  }

 private:
  std::atomic<uint64_t> next_{1};
  std::mutex mutex_;
  std::unordered_map<const void*, uint64_t> latest_;
};

std::string& last_prefill_kernel() {
  thread_local std::string name;
  return name;
}

std::string& last_prefill_fallback() {
  thread_local std::string reason;
  return reason;
}

void check_workspace_fits(const WorkspaceLayout& layout, Workspace workspace, const char* who) {
  if (workspace.bytes < layout.total || (layout.total > 0 && workspace.data == nullptr)) {
    throw Error(Error::Kind::kInvalidArgument,
                std::string(who) + ": workspace: the plan needs " + std::to_string(layout.total) +
                    " bytes, got " +
                    std::to_string(workspace.data == nullptr ? 0 : workspace.bytes));
  }
  if (reinterpret_cast<uintptr_t>(workspace.data) % kVectorBytes != 0) {
    throw Error(Error::Kind::kInvalidArgument,
                std::string(who) + ": workspace: data must be 16-byte aligned");
  }
}

void check_prefill_arguments(const Plan& plan, const AttentionProblem& problem,
                             const CudaDeviceInfo& info) {
  if (info.sm_major < 8) {
    throw Error(Error::Kind::kUnsupported,
                "CUDA prefill needs compute capability 8.0 or newer; device " +
                    std::to_string(info.device) + " (" + info.name + ") is sm_" +
                    std::to_string(info.sm_major) + std::to_string(info.sm_minor));
  }
  if (problem.q_dtype != DType::kFloat16 && problem.q_dtype != DType::kBFloat16) {
    throw Error(Error::Kind::kUnsupported, std::string("tessera: 'q': dtype ") + dtype_name(problem.q_dtype) +
                                               " is not supported by CUDA prefill (fp16, bf16)");
  }
  if (problem.kv.dtype != problem.q_dtype) {
    throw Error(Error::Kind::kUnsupported,
                std::string("tessera: 'k': dtype ") + dtype_name(problem.kv.dtype) +
                    " is not supported by CUDA prefill with q dtype " +
                    dtype_name(problem.q_dtype) +
                    " (k/v must have q's dtype; fp8 KV caches are served by decode)");
  }
  if (!(problem.sm_scale > 0.0f) || !std::isfinite(problem.sm_scale)) {
    throw Error(Error::Kind::kUnsupported,
                "sm_scale " + std::to_string(problem.sm_scale) +
                    " must be a positive finite number for CUDA prefill");
  }
  if (!std::isfinite(problem.soft_cap)) {
    throw Error(Error::Kind::kInvalidArgument, "logits_soft_cap must be finite");
  }
  int64_t total_kv = 0;
  for (const int32_t kv_len : plan.kv_lens) total_kv += kv_len;
  const bool many_tokens = plan.total_q > 1;
  const bool many_qo_heads = problem.num_qo_heads > 1;
  const bool many_kv_heads = problem.num_kv_heads > 1;
  // Ragged keys of all requests share one token stride; paged keys step it inside a page.
  const bool many_keys = problem.kv.paged ? problem.kv.page_size > 1 : total_kv > 1;
  const bool paged = problem.kv.paged;
  check_vector_access(
      "q", problem.q, plan.total_q > 0,
      {{problem.q_stride_token, many_tokens}, {problem.q_stride_head, many_qo_heads}});
  check_vector_access(
      "o", problem.o, plan.total_q > 0,
      {{problem.o_stride_token, many_tokens}, {problem.o_stride_head, many_qo_heads}});
  check_vector_access("k", problem.kv.k, total_kv > 0,
                      {{problem.kv.k_stride_token, many_keys},
                       {problem.kv.k_stride_head, many_kv_heads},
                       {problem.kv.k_stride_page, paged}});
  check_vector_access("v", problem.kv.v, total_kv > 0,
                      {{problem.kv.v_stride_token, many_keys},
                       {problem.kv.v_stride_head, many_kv_heads},
                       {problem.kv.v_stride_page, paged}});
}

// header_uploaded: see cuda_decode_attention.
void run_prefill(const Plan& plan, const AttentionProblem& problem, unsigned char* workspace,
                 const WorkspaceLayout& layout, const CudaDeviceInfo& info, cudaStream_t stream,
                 bool header_uploaded) {
  check_prefill_arguments(plan, problem, info);
  const bool soft_cap = problem.soft_cap != 0.0f;
  // A plan from plan_*() carries its row; one built by hand (tests) is given one here, by the
  // same selection.
  const KernelChoice chosen = plan.kernel_id >= 0
                                  ? KernelChoice{plan.kernel_id, plan.kernel_options, {}}
                                  : select_kernel(plan);
  const KernelRow& row = kernel_row(chosen.kernel_id);
  const uint32_t options = chosen.options;
  PrefillArgs args;
  args.problem = problem;
  args.work = reinterpret_cast<const WorkItem*>(workspace + layout.work);
  args.worker_indptr = reinterpret_cast<const int32_t*>(workspace + layout.worker_indptr);
  args.num_workers =
      plan.worker_indptr.empty() ? 0 : static_cast<int32_t>(plan.worker_indptr.size() - 1);
  args.partial_o = reinterpret_cast<float*>(workspace + layout.partial_o);
  args.partial_lse = reinterpret_cast<float*>(workspace + layout.partial_lse);
  constexpr float kLog2e = std::numbers::log2e_v<float>;
  if (soft_cap) {
    args.soft_cap_pre = 2.0f * kLog2e * problem.sm_scale / problem.soft_cap;
    args.soft_cap_post = problem.soft_cap * kLog2e;
    args.score_scale_log2 = 1.0f;
  } else {
    args.score_scale_log2 = problem.sm_scale * kLog2e;
  }
  // Nothing to attend (no queries). A fixed-capacity plan launches anyway: a graph captured
  // with it must serve later plans of that capacity (an empty worker range is a no-op).
  if (args.num_workers == 0 || (plan.work.empty() && !plan.capacity.fixed())) return;
  std::string& fallback = last_prefill_fallback();
  fallback.clear();
  const KernelInstance* kernel = row.instance(problem.q_dtype, problem.kv.dtype);
  if (kernel != nullptr && kernel->try_prefill != nullptr) {
    if (kernel->try_prefill(args, options, stream, &fallback)) {
      last_prefill_kernel() = kernel->name;
      kernel = nullptr;  // launched
    } else {
      // TMA cannot describe q (the reason is in `fallback`): the sm80 row of this shape.
      const KernelRow* portable = sm80_prefill_row(problem.head_dim, soft_cap);
      kernel = portable != nullptr ? portable->instance(problem.q_dtype, problem.kv.dtype)
                                   : nullptr;
      if (kernel == nullptr) throw Error(Error::Kind::kUnsupported, "CUDA prefill: " + fallback);
    }
  }
  if (kernel != nullptr) {
    kernel->prefill(args, stream);
    last_prefill_kernel() = kernel->name;
  }

  const int64_t merge_slots =
      header_uploaded ? layout.merge_slots : static_cast<int64_t>(plan.merges.size());
  if (merge_slots > 0) {
    sm80::MergeArgs merge;
    merge.problem = problem;
    merge.merges = reinterpret_cast<const MergeItem*>(workspace + layout.merges);
    merge.header = header_uploaded
                       ? reinterpret_cast<const PlanHeader*>(workspace + layout.header)
                       : nullptr;
    merge.max_merges = static_cast<int32_t>(merge_slots);
    merge.partial_o = args.partial_o;
    merge.partial_lse = args.partial_lse;
    sm80::launch_merge_partials(merge, info.num_sms, stream);
  }
}

}  // namespace

const char* cuda_last_prefill_kernel() { return last_prefill_kernel().c_str(); }
const char* cuda_last_prefill_fallback() { return last_prefill_fallback().c_str(); }

uint64_t cuda_staging_overflow_uploads() { return StagingPool::instance().overflow_uploads(); }

namespace {

// The plan's header and lists into the workspace as one image through the staging pool, under
// a new generation that the registry then records for the workspace; returns the generation.
uint64_t upload_image(const Plan& plan, const WorkspaceLayout& layout, Workspace workspace,
                      cudaStream_t stream) {
  UploadRegistry& registry = UploadRegistry::instance();
  const uint64_t generation = registry.next_generation();
  StagingPool::instance().upload(
      plan.device.index, static_cast<unsigned char*>(workspace.data) + layout.header,
      layout.upload_bytes(plan), stream,
      [&](void* image) { layout.write_upload_image(plan, generation, image); });
  registry.set(workspace.data, generation);
  return generation;
}

}  // namespace

uint64_t cuda_upload_plan(const Plan& plan, Workspace workspace, void* stream) {
  if (plan.device.type != DeviceType::kCUDA) {
    throw Error(Error::Kind::kInvalidArgument,
                "upload_plan: plan built for " + device_name(plan.device) +
                    ", not for a CUDA device");
  }
  CudaDeviceGuard guard(plan.device.index);
  const WorkspaceLayout layout = WorkspaceLayout::of(plan);
  check_workspace_fits(layout, workspace, "upload_plan");
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (stream_is_capturing(cuda_stream)) {
    throw Error(Error::Kind::kInvalidArgument,
                "upload_plan: the stream is being captured into a CUDA graph; upload plans "
                "outside the capture (before it, and before each replay)");
  }
  return upload_image(plan, layout, workspace, cuda_stream);
}

void cuda_forget_uploads(const void* workspace) {
  UploadRegistry::instance().set(workspace, 0);
}

void cuda_after_device_reset(int device) {
  // Every workspace of every device is forgotten (the registry is keyed by address alone, and
  // a reset frees every allocation of the device, whose addresses the next allocations reuse):
  // each plan's next run_*() uploads again, a cost of one copy on other devices' plans.
  UploadRegistry::instance().clear();
  StagingPool::instance().drop_device(device);
  cuda_context_epoch().fetch_add(1, std::memory_order_acq_rel);
  (void)cudaGetLastError();
}

bool cuda_stream_is_capturing(void* stream) {
  return stream_is_capturing(static_cast<cudaStream_t>(stream));
}

void cuda_run_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                        void* stream) {
  if (plan.device.type != DeviceType::kCUDA) {
    throw Error(Error::Kind::kInvalidArgument,
                "plan: built for " + device_name(plan.device) + ", not for a CUDA device");
  }
  CudaDeviceGuard guard(plan.device.index);
  const CudaDeviceInfo& info = cuda_device_info(plan.device.index);
  const WorkspaceLayout layout = WorkspaceLayout::of(plan);
  check_workspace_fits(layout, workspace, "run");
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  auto* base = static_cast<unsigned char*>(workspace.data);
  UploadRegistry& registry = UploadRegistry::instance();
  bool uploaded = plan.upload_generation != 0 && plan.uploaded_workspace == workspace.data &&
                  registry.holds(workspace.data, plan.upload_generation);
  if (!uploaded && !stream_is_capturing(cuda_stream)) {
    // A plan not uploaded (or overwritten since, e.g. by another plan sharing the workspace):
    // the lists go in as upload_plan sends them, one copy from pinned staging (the pageable
    // copies below cost about 1 us of host time each). The plan is const here, so its next
    // run() uploads again unless upload_plan is called.
    upload_image(plan, layout, workspace, cuda_stream);
    uploaded = true;
  } else if (!uploaded) {
    // Inside a CUDA-graph capture, the behaviour from before upload_plan: the lists go from the
    // plan's pageable host vectors into the workspace, in stream order before the kernels that
    // read them (the capture records these copies from the plan's memory, which must then
    // outlive the graph; the Python wrapper relies on that). No header: the merge count is
    // passed by value.
    registry.set(workspace.data, 0);
    upload_list(plan.worker_indptr, base, layout.worker_indptr, cuda_stream);
    upload_list(plan.merges, base, layout.merges, cuda_stream);
    upload_list(plan.work, base, layout.work, cuda_stream);
  }

  if (plan.op == AttentionOp::kDecode) {
    cuda_decode_attention(plan, problem, workspace, stream, uploaded);
    return;
  }
  run_prefill(plan, problem, base, layout, info, cuda_stream, uploaded);
}

}  // namespace tessera::detail
