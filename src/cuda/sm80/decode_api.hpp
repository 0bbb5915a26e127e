// Interface of the sm80 batch-decode kernel (src/cuda/sm80/decode.cu). The CUDA backend's
// dispatch (device.cu, attention.cu) calls these for AttentionOp::kDecode.
#pragma once

#include "core/problem.hpp"
#include "cuda/cuda_backend.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// Planner knobs for decode on this device (tile rows, persistent workers, split-KV policy).
// batch: the plan's request count, for the built-in default's batch rule (core/tuning.hpp);
// 0 where the rule must not apply (fixed-capacity or deterministic plans, plan_capacity).
PlanConfig cuda_decode_plan_config(int num_qo_heads, int num_kv_heads, int head_dim,
                                   const CudaDeviceInfo& device, int64_t batch = 0);

// Runs a decode plan: the plan's lists are already uploaded into `workspace`
// (WorkspaceLayout); launches the decode kernel and the merge of its split-KV partials.
// header_uploaded: the workspace's PlanHeader is this plan's (upload_plan), so the merge grid
// covers the capacity and reads its count from the header; otherwise (run()'s own upload) the
// count is the plan's, passed by value.
void cuda_decode_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace,
                           void* stream, bool header_uploaded);

}  // namespace tessera::detail
