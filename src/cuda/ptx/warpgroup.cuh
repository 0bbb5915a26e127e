// Warpgroup-level control on sm_90: register reallocation between warp-specialised roles, named
// barriers between warpgroups, and the proxy fence between ordinary shared-memory stores and the
// async proxy (TMA, wgmma).
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits shfl.sync.idx.b32 d, value, 0, 0x1f, 0xffffffff (through __shfl_sync, which the
// compiler understands): lane 0's value in every lane. For a value every lane already holds (a
// warpgroup index, a ring stage) it changes nothing, but the compiler then knows the result is
// warp-uniform and keeps what is derived from it - wgmma descriptors, barrier addresses - in
// uniform registers instead of moving it there (R2UR) before each use (CUTLASS's
// canonical_warp_idx_sync does the same).
__device__ __forceinline__ int warp_uniform(int value) {
  return __shfl_sync(0xffffffffu, value, 0);
}

// Emits setmaxnreg.inc.sync.aligned.u32 N (PTX ISA, "Miscellaneous Instructions: setmaxnreg",
// sm_90a): the executing warpgroup's per-thread register budget grows to N (a multiple of 8 in
// 24..256), taking registers another warpgroup released. Every warp of the warpgroup executes it.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Emits setmaxnreg.dec.sync.aligned.u32 N: the warpgroup gives its registers above N back.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Emits bar.sync id, count (PTX ISA, "Parallel Synchronization and Communication Instructions:
// bar"): waits until `count` threads (a multiple of 32) have arrived at named barrier `id`
// (1..15; 0 is __syncthreads), counting this warp. Orders shared-memory accesses among them.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Emits bar.arrive id, count: counts this warp towards the barrier without waiting.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Emits fence.proxy.async.shared::cta (PTX ISA, "membar/fence"): orders this thread's ordinary
// (generic-proxy) shared-memory accesses against async-proxy accesses (TMA stores reading the
// staging tile, wgmma reading operands). A writer issues it after its stores and before the
// barrier that hands the buffer over.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace tessera::detail::ptx
