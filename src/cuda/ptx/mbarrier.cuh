// mbarrier: the shared-memory transaction barrier that TMA loads complete on (sm_90).
//
// A barrier counts arrivals and, since sm_90, transaction bytes. A phase completes when its
// pending arrival count reaches zero and every byte announced with expect_tx has landed; the
// barrier then flips to the next phase (parity 0, 1, 0, ...). Waiters name the parity of the
// phase they wait for, so a ring of buffers only needs one bit of state per buffer
// (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier").
//
// Convention in this code base: a "full" barrier's phase k completes when buffer use k has
// landed; consumers wait on parity (k & 1). An "empty" barrier's phase k completes when the
// consumers released use k; the producer, before filling use k + stages, waits on parity
// ((k / stages) & 1) ^ 1 - which for the first pass over the ring is parity 1, the phase "before"
// a fresh barrier, and so returns at once.
#pragma once

#include <cstdint>

namespace tessera::detail::ptx {

// Emits mbarrier.init.shared::cta.b64 [bar], count: phase 0, `count` arrivals expected.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Emits fence.mbarrier_init.release.cluster (PTX ISA, "membar/fence"): makes the mbarrier.init
// writes visible to the async proxy (the TMA unit) before any copy signals them. Followed by a
// CTA barrier so that no thread uses a barrier before it is initialised.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Emits mbarrier.arrive.shared::cta.b64 _, [bar]: one arrival (release semantics).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Emits mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes: announces `bytes` of
// transactions (the TMA copies about to be issued) for the current phase, then arrives once.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Emits cp.async.mbarrier.arrive.noinc.shared::cta.b64 [bar] (PTX ISA, "Data Movement and
// Conversion Instructions: cp.async.mbarrier.arrive"): one arrival on `bar` once every cp.async
// this thread issued before it has completed. .noinc: the arrival is one of the `count` the
// barrier was initialised with (it does not raise the pending count first).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Emits mbarrier.try_wait.parity.shared::cta.b64 in a loop until the phase of parity `parity`
// has completed (acquire semantics). try_wait suspends the thread for a hardware-chosen time
// before reporting "not yet", so the loop does not spin hot.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}

}  // namespace tessera::detail::ptx
