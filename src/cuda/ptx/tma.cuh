// Tensor Memory Accelerator (TMA) bulk tensor copies (sm_90): one thread hands the copy engine a
// tensor map (built on the host with cuTensorMapEncodeTiled, passed as a __grid_constant__
// kernel parameter) and box coordinates; the engine moves the whole box between global and
// shared memory, zero-filling loads outside the tensor and clipping stores, and applies the
// 128-byte swizzle the map asks for (PTX ISA, "Data Movement and Conversion Instructions:
// cp.async.bulk.tensor").
//
// Coordinates are in elements, innermost dimension first, and signed: a box may start before
// the tensor or run past its end; the missing part reads as zeros.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Generic address of a tensor map held in kernel parameter space (a __grid_constant__ struct
// member): what the .tensor instructions take as their [tensorMap] operand.
__device__ __forceinline__ uint64_t tensor_map_address(const void* tensor_map) {
  return reinterpret_cast<uint64_t>(tensor_map);
}

// Emits prefetch.tensormap [map] (PTX ISA, "prefetch"): pulls the 128-byte map into the
// descriptor cache ahead of the first copy that uses it.
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map_address(tensor_map)) : "memory");
}

// Emits cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
// [dst], [map, {c0, c1, c2}], [bar]: loads one 3-d box into shared memory at `dst` (1024-byte
// aligned for the 128-byte swizzle) and signals `bar` with the box's byte count.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(tensor_map_address(tensor_map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Same as tma_load_3d for a 4-d box (paged K/V caches: head_dim, row in page, head, page).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(tensor_map_address(tensor_map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Same as tma_load_3d for a 5-d box (paged V with the column blocks of a row in one box: head_dim
// column, row in page, column block, head, page).
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3,
                                            int32_t c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(dst),
      "l"(tensor_map_address(tensor_map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Emits cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [map, {c0, c1, c2}], [src]:
// stores one 3-d box from shared memory; the part outside the tensor is not written. The copy
// joins the thread's current bulk group (tma_store_commit / tma_store_wait_read).
__device__ __forceinline__ void tma_store_3d(const void* tensor_map, uint32_t src, int32_t c0,
                                             int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::
          "l"(tensor_map_address(tensor_map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Emits cp.async.bulk.commit_group: closes this thread's pending bulk stores into a group.
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Emits cp.async.bulk.wait_group.read 0: returns once every committed bulk store of this thread
// has finished reading its shared-memory source (the global writes may still be in flight), so
// the staging buffer can be overwritten.
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Emits cp.async.bulk.wait_group 0: every committed bulk store of this thread is complete
// (its global writes are performed). Needed before the kernel's last use of the data in
// global memory by this thread; a kernel's end also waits for them.
__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

}  // namespace tessera::detail::ptx
