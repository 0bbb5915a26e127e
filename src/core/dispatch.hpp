// Dispatch: which backend (and which planner knobs) serves a call on a given device.
#pragma once

#include "core/problem.hpp"
#include "core/validate.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// Throws a clear error when `device` cannot run anything in this build / on this host.
void check_device_usable(const ArgChecker& check, Device device);

// The planner knobs of the backend that will serve (op, device, heads, head_dim). batch: the
// plan's request count where a knob may depend on it (CUDA decode's batch rule,
// core/tuning.hpp); 0 for plans whose knobs must not (fixed capacity, deterministic).
PlanConfig plan_config_for(AttentionOp op, Device device, int num_qo_heads, int num_kv_heads,
                           int head_dim, int64_t batch = 0);

// Records in `plan` (made by make_plan) the kernel that will serve it, chosen once here:
// plan.kernel_id / kernel_options (the GPU backend's registry row) and plan.kernel (which and why).
void choose_kernel(Plan& plan);

// Runs a validated problem with its plan on the plan's device.
void dispatch_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                        void* stream);

// Copies a GPU plan's lists into the workspace (one async copy from pinned staging) and returns
// the upload's generation (never 0). CPU plans: nothing, returns 0.
uint64_t dispatch_upload_plan(const Plan& plan, Workspace workspace, void* stream);
void dispatch_forget_uploads(const void* workspace);  // no-op without the CUDA backend

// Throws Error(kInvalidArgument) naming 'stream' when `stream` is being captured into a CUDA
// graph (device: a CUDA device; the CPU never captures): `why` says what the call would do that
// a capture forbids ("synchronises the stream"). Asks before any other CUDA call, so the
// capture stays valid and the caller can end it.
void check_not_capturing(const ArgChecker& check, Device device, void* stream, const char* why);

// Scratch memory on a device for the one-shot calls (malloc or cudaMalloc). Throws
// Error(kOutOfMemory) naming check's op and 'workspace' with the bytes asked for when it
// cannot be had.
class ScratchBuffer {
 public:
  ScratchBuffer(const ArgChecker& check, Device device, size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  Workspace workspace() const { return {data_, bytes_}; }

 private:
  Device device_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Reads a small int32 device or host array into a host vector (synchronises a CUDA stream).
std::vector<int32_t> read_int32_array(const TensorView& view, void* stream);
// The same for a contiguous int32 or int64 array, widened to int64.
std::vector<int64_t> read_index_values(const TensorView& view, void* stream);

}  // namespace tessera::detail
