// Asynchronous global -> shared copies (sm_80+), the load path of every FA2-style pipeline.
//
// A thread issues copies, closes them into a group with commit_group, and later waits until at
// most N of its groups are still in flight with wait_group N. Groups complete in commit order,
// so a pipeline with a fixed number of committed groups per step can wait for "the tile issued
// k steps ago" with a compile-time N. Completion is per thread: a __syncthreads() after the wait
// makes every thread's copies visible to the whole CTA.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits cp.async.cg.shared.global [dst], [src], 16, src_size
// (PTX ISA, "Data Movement and Conversion Instructions: cp.async").
// .cg caches in L2 only: K/V tiles are streamed once per CTA, L1 would only be polluted.
// With valid == false, src_size is 0: nothing is read from `src` and the 16 destination bytes are
// zero-filled, which is how out-of-range rows and padded head_dim columns become exact zeros.
// `src` must still be a valid-looking global address; callers pass the tensor base.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_address, const void* src,
                                                  bool valid) {
  const uint32_t src_size = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address),
               "l"(__cvta_generic_to_global(src)), "r"(src_size)
               : "memory");
}

// Emits cp.async.commit_group (PTX ISA, "Data Movement and Conversion Instructions:
// cp.async.commit_group"). An empty group is legal and completes at once; pipelines commit one
// every step so that wait_group counts stay compile-time constants.
__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Emits cp.async.wait_group N (PTX ISA, "Data Movement and Conversion Instructions:
// cp.async.wait_group"): waits until at most N of this thread's groups are pending.
// The "memory" clobber keeps the compiler from hoisting shared-memory reads above the wait.
template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait_group() {
  static_assert(kPendingGroups >= 0 && kPendingGroups <= 7, "wait_group takes 0..7");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups) : "memory");
}

}  // namespace tessera::detail::ptx
