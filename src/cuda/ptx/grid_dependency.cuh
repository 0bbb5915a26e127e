// Programmatic dependent launch (PTX ISA, "Parallel Synchronization and Communication
// Instructions: griddepcontrol", sm_90+). A kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream is still running:
//   wait():               blocks until every prerequisite grid has completed and its memory is
//                         visible; a kernel calls it before its first access (read or write) of
//                         memory another kernel may touch. Without a programmatic launch it
//                         returns at once.
//   launch_dependents():  lets the next programmatically launched kernel be scheduled before
//                         this one ends (that kernel's wait() still waits for this one's end).
// Below sm_90 both are empty: there is no programmatic launch there (the host never asks).
#pragma once

namespace tessera::detail::ptx {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace tessera::detail::ptx
