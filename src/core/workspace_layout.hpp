// Where things live inside a caller's Workspace for one Plan. Shared by the planner (which sizes
// it), the CPU backend and the CUDA backend.
//
//   [partial o: partial_rows x head_dim_vo float32]
//   [partial lse: partial_rows float32]               (natural log)
//   --- GPU plans only: the plan's lists, uploaded by upload_plan() or run() ---
//   [header: PlanHeader]
//   [merge counters: int32 x merge slots]            (zero after every upload and every run)
//   [worker_indptr: int32 x (num_workers + 1)]
//   [merges: MergeItem x merge slots]
//   [work items: WorkItem x work slots]
// Every region starts on a 256-byte boundary. Without a fixed capacity the slots / rows are the
// plan's own sizes; with one (PlanCapacity::fixed()) they are the capacity's, so every plan of
// that capacity has the same layout. The header .. end of the used work items is one contiguous
// span, uploaded with one copy (upload_image()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tessera/attention.hpp"

namespace tessera::detail {

// Per-plan counts, read by the kernels from the workspace (never passed by value), so a CUDA
// graph replays any uploaded plan of the same capacity.
struct PlanHeader {
  int32_t num_work = 0;
  int32_t num_merges = 0;
  int32_t num_workers = 0;
  int32_t reserved = 0;
  int64_t num_partial_rows = 0;
  uint64_t generation = 0;  // of the upload (upload_plan's, or run()'s for a plan not resident)
};

struct WorkspaceLayout {
  static constexpr size_t kAlign = 256;
  size_t partial_o = 0;
  size_t partial_lse = 0;
  size_t header = 0;
  size_t merge_counters = 0;  // pieces of each split tile done so far (fused decode merge)
  size_t worker_indptr = 0;
  size_t merges = 0;
  size_t work = 0;
  size_t total = 0;
  int64_t partial_rows = 0;  // rows the partial regions hold
  int64_t merge_slots = 0;   // MergeItems the merges region holds
  int64_t work_slots = 0;    // WorkItems the work region holds

  static size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

  static WorkspaceLayout of(const Plan& plan) {
    WorkspaceLayout layout;
    const bool fixed = plan.capacity.fixed();
    layout.partial_rows = fixed ? plan.capacity.max_partial_rows : plan.num_partial_rows;
    layout.merge_slots =
        fixed ? plan.capacity.max_merges : static_cast<int64_t>(plan.merges.size());
    layout.work_slots =
        fixed ? plan.capacity.max_work_items : static_cast<int64_t>(plan.work.size());
    const size_t rows = static_cast<size_t>(layout.partial_rows);
    size_t offset = 0;
    layout.partial_o = offset;
    offset = align_up(offset + rows * static_cast<size_t>(plan.head_dim_v()) * sizeof(float));
    layout.partial_lse = offset;
    offset = align_up(offset + rows * sizeof(float));
    if (plan.device.type == DeviceType::kCUDA) {
      layout.header = offset;
      offset = align_up(offset + sizeof(PlanHeader));
      layout.merge_counters = offset;
      offset = align_up(offset + static_cast<size_t>(layout.merge_slots) * sizeof(int32_t));
      layout.worker_indptr = offset;
      offset = align_up(offset + plan.worker_indptr.size() * sizeof(int32_t));
      layout.merges = offset;
      offset = align_up(offset + static_cast<size_t>(layout.merge_slots) * sizeof(MergeItem));
      layout.work = offset;
      offset = align_up(offset + static_cast<size_t>(layout.work_slots) * sizeof(WorkItem));
    }
    layout.total = offset;
    return layout;
  }

  // Bytes of the upload span [header, end of the plan's work items).
  size_t upload_bytes(const Plan& plan) const {
    return work + plan.work.size() * sizeof(WorkItem) - header;
  }

  static PlanHeader header_of(const Plan& plan, uint64_t generation) {
    PlanHeader head;
    head.num_work = static_cast<int32_t>(plan.work.size());
    head.num_merges = static_cast<int32_t>(plan.merges.size());
    head.num_workers =
        plan.worker_indptr.empty() ? 0 : static_cast<int32_t>(plan.worker_indptr.size() - 1);
    head.num_partial_rows = plan.num_partial_rows;
    head.generation = generation;
    return head;
  }

  // Writes the upload span's image (header, zeroed merge counters, worker_indptr, merges, work;
  // padding zeroed) to `image`, which holds upload_bytes(plan) bytes.
  void write_upload_image(const Plan& plan, uint64_t generation, void* image) const {
    auto* out = static_cast<unsigned char*>(image);
    std::memset(out, 0, upload_bytes(plan));
    const PlanHeader head = header_of(plan, generation);
    std::memcpy(out, &head, sizeof(head));
    copy_list(plan.worker_indptr, out + (worker_indptr - header));
    copy_list(plan.merges, out + (merges - header));
    copy_list(plan.work, out + (work - header));
  }

 private:
  template <class T>
  static void copy_list(const std::vector<T>& list, unsigned char* out) {
    if (!list.empty()) std::memcpy(out, list.data(), list.size() * sizeof(T));
  }
};

}  // namespace tessera::detail
