// What the CPU backend knows about the host: which vector ISA its kernels may use and what the
// fp32 FMA peak of the machine is (the yardstick `tessera bench` reports efficiency against).
#pragma once

#include <string>

namespace tessera::detail {

// Instruction sets the fast CPU kernels are compiled for (one translation unit each).
enum class CpuIsa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// True when this CPU (and OS) can run the kernels built for `isa`.
bool cpu_supports(CpuIsa isa);

// The ISA the fast path uses: the best one supported, lowered (never raised) by the environment
// variable TESSERA_CPU_ISA=generic|avx2|avx512, which lets users and tests exercise the
// narrower kernels on a wide machine. Read once per process.
CpuIsa selected_cpu_isa();

// Logical CPUs this process may run on (its affinity mask, so a container or `taskset` limit
// counts), else the hardware concurrency.
int usable_logical_cpus();

const char* cpu_isa_name(CpuIsa isa);
// Name of selected_cpu_isa(): "avx512", "avx2" or "generic".
std::string cpu_isa_name();

// Theoretical fp32 FMA peak of the cores this process may run on, in GFLOP/s:
// cores x clock x fp32 lanes of one FMA pipe x FMA pipes x 2 flop. `explanation` (optional)
// receives the numbers used and where each came from.
double cpu_peak_gflops(std::string* explanation);

}  // namespace tessera::detail
