// Where things live inside a caller's Workspace for one Plan. Shared by the planner (which sizes
// it), the CPU backend and the CUDA backend.
//
//   [partial o: num_partial_rows x head_dim float32]
//   [partial lse: num_partial_rows float32]            (natural log)
//   --- GPU plans only: the plan's lists, uploaded by run() ---
//   [work items: WorkItem x work.size()]
//   [worker_indptr: int32 x (num_workers + 1)]
//   [merges: MergeItem x merges.size()]
// Every region starts on a 256-byte boundary.
#pragma once

#include <cstddef>

#include "tessera/attention.hpp"

namespace tessera::detail {

struct WorkspaceLayout {
  static constexpr size_t kAlign = 256;
  size_t partial_o = 0;
  size_t partial_lse = 0;
  size_t work = 0;
  size_t worker_indptr = 0;
  size_t merges = 0;
  size_t total = 0;

  static size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

  static WorkspaceLayout of(const Plan& plan) {
    WorkspaceLayout layout;
    const size_t rows = static_cast<size_t>(plan.num_partial_rows);
    size_t offset = 0;
    layout.partial_o = offset;
    offset = align_up(offset + rows * static_cast<size_t>(plan.head_dim) * sizeof(float));
    layout.partial_lse = offset;
    offset = align_up(offset + rows * sizeof(float));
    if (plan.device.type == DeviceType::kCUDA) {
      layout.work = offset;
      offset = align_up(offset + plan.work.size() * sizeof(WorkItem));
      layout.worker_indptr = offset;
      offset = align_up(offset + plan.worker_indptr.size() * sizeof(int32_t));
      layout.merges = offset;
      offset = align_up(offset + plan.merges.size() * sizeof(MergeItem));
    }
    layout.total = offset;
    return layout;
  }
};

}  // namespace tessera::detail
