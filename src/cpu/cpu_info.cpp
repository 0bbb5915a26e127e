#include "cpu/cpu_info.hpp"

#include "core/settings.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define TESSERA_X86 1
#endif

namespace tessera::detail {
namespace {

// Fallback when neither /proc/cpuinfo nor cpuid reveal a clock: a conservative server clock.
constexpr double kFallbackClockGhz = 2.0;
// Every x86 core the kernels target (Haswell and later, Zen 1 and later) has two FMA pipes.
constexpr int kFmaPipes = 2;
constexpr int kFlopsPerFma = 2;

struct X86Identity {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ...
  unsigned family = 0;
  unsigned model = 0;
  std::string brand;
};

X86Identity identify_x86() {
  X86Identity id;
#if defined(TESSERA_X86)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return id;
  char vendor[13] = {};
  std::memcpy(vendor + 0, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  id.vendor = vendor;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    const unsigned base_family = (eax >> 8) & 0xf;
    const unsigned base_model = (eax >> 4) & 0xf;
    const unsigned ext_family = (eax >> 20) & 0xff;
    const unsigned ext_model = (eax >> 16) & 0xf;
    id.family = base_family == 0xf ? base_family + ext_family : base_family;
    id.model =
        (base_family == 0xf || base_family == 0x6) ? (ext_model << 4) | base_model : base_model;
  }
  unsigned max_ext = __get_cpuid_max(0x80000000u, nullptr);
  if (max_ext >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      __get_cpuid(0x80000002u + leaf, &eax, &ebx, &ecx, &edx);
      std::memcpy(brand + 16 * leaf + 0, &eax, 4);
      std::memcpy(brand + 16 * leaf + 4, &ebx, 4);
      std::memcpy(brand + 16 * leaf + 8, &ecx, 4);
      std::memcpy(brand + 16 * leaf + 12, &edx, 4);
    }
    id.brand = brand;
  }
#endif
  return id;
}

// Reads the first value of a "key : value" line of /proc/cpuinfo (0 when absent).
double proc_cpuinfo_number(const char* key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  const size_t key_len = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, key_len, key) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    return std::atof(line.c_str() + colon + 1);
  }
  return 0.0;
}

struct ClockEstimate {
  double ghz = kFallbackClockGhz;
  std::string source = "fallback guess (no clock found)";
};

ClockEstimate estimate_clock(const X86Identity& id) {
  ClockEstimate clock;
  if (const double mhz = proc_cpuinfo_number("cpu MHz"); mhz > 0) {
    clock.ghz = mhz / 1000.0;
    clock.source = "/proc/cpuinfo \"cpu MHz\"";
    return clock;
  }
#if defined(TESSERA_X86)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) >= 0x16 && __get_cpuid(0x16, &eax, &ebx, &ecx, &edx) &&
      (eax & 0xffff) != 0) {
    clock.ghz = (eax & 0xffff) / 1000.0;
    clock.source = "cpuid leaf 0x16 base frequency";
    return clock;
  }
#endif
  // Brand strings such as "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz".
  if (const size_t at = id.brand.find('@'); at != std::string::npos) {
    const double ghz = std::atof(id.brand.c_str() + at + 1);
    if (ghz > 0) {
      clock.ghz = ghz;
      clock.source = "cpuid brand string";
    }
  }
  return clock;
}

// The clock this core actually runs at, from a chain of dependent integer adds (one per cycle
// on every x86 core since the Pentium Pro). Reported clocks are nominal: under turbo, or in a VM
// where "cpu MHz" is the TSC rate, they can be far below the real one, and a peak built on them
// is no upper bound. Best of a few short trials, so a busy machine lowers it only a little.
// Returns 0 where it cannot measure.
double measure_clock_ghz() {
#if defined(TESSERA_X86)
  constexpr int kTrials = 5;
  constexpr int64_t kIterations = 200'000;
  constexpr int kAddsPerIteration = 32;
  double best_ghz = 0.0;
  for (int trial = 0; trial < kTrials; ++trial) {
    uint64_t chain = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kIterations; ++i) {
      asm volatile(
          ".rept 32\n\t"
          "add $1, %0\n\t"
          ".endr"
          : "+r"(chain));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0) {
      best_ghz = std::max(best_ghz, kIterations * kAddsPerIteration / seconds / 1e9);
    }
  }
  return best_ghz;
#else
  return 0.0;
#endif
}

struct LaneEstimate {
  int lanes = 4;
  std::string reason;
};

// fp32 lanes that one FMA pipe retires per cycle: the datapath width, not the register width.
LaneEstimate estimate_fma_lanes(const X86Identity& id) {
  LaneEstimate estimate;
  char family[64];
  std::snprintf(family, sizeof(family), "family 0x%x model 0x%x", id.family, id.model);
  const bool amd = id.vendor == "AuthenticAMD" || id.vendor == "HygonGenuine";
  if (cpu_supports(CpuIsa::kAvx512)) {
    if (amd && id.family == 0x19) {
      estimate.lanes = 8;
      estimate.reason =
          std::string("AMD ") + family + " (Zen 4): AVX-512 executed on 256-bit FMA datapaths";
    } else if (amd && id.family == 0x1a &&
               ((id.model >= 0x20 && id.model <= 0x2f) || (id.model >= 0x60 && id.model <= 0x6f))) {
      estimate.lanes = 8;
      estimate.reason = std::string("AMD ") + family +
                        " (mobile Zen 5): AVX-512 executed on 256-bit FMA datapaths";
    } else if (amd) {
      estimate.lanes = 16;
      estimate.reason = std::string("AMD ") + family + " (Zen 5 or later): 512-bit FMA datapaths";
    } else {
      estimate.lanes = 16;
      estimate.reason = std::string(id.vendor.empty() ? "x86" : id.vendor) + " " + family +
                        ": AVX-512, 512-bit FMA";
    }
  } else if (cpu_supports(CpuIsa::kAvx2)) {
    estimate.lanes = 8;
    estimate.reason = "AVX2 + FMA: 256-bit FMA";
  } else {
    estimate.lanes = 4;
    estimate.reason = "no AVX2/FMA: 128-bit SSE (a mul and an add pipe counted as one FMA pipe)";
  }
  return estimate;
}

CpuIsa best_supported_isa() {
  if (cpu_supports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_supports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kGeneric;
}

}  // namespace

int usable_logical_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

#if defined(TESSERA_X86)
// F16C straight from CPUID leaf 1 (ECX bit 29): clang < 15 rejects
// __builtin_cpu_supports("f16c"). The OS-saves-YMM part is covered by the avx2 check.
// Read once: CPUID traps (and is slow) in a VM, and every fast-path run checks the ISA.
static bool cpu_has_f16c() {
  static const bool has_f16c = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  }();
  return has_f16c;
}
#endif

bool cpu_supports(CpuIsa isa) {
#if defined(TESSERA_X86)
  // libgcc's feature bits also check that the OS saves the wide registers (XCR0).
  switch (isa) {
    case CpuIsa::kGeneric: return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             cpu_has_f16c();
    case CpuIsa::kAvx512:
      return cpu_supports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  }
  return false;
#else
  return isa == CpuIsa::kGeneric;
#endif
}

CpuIsa selected_cpu_isa() {
  static const CpuIsa selected = [] {
    CpuIsa isa = best_supported_isa();
    if (const std::string& env = settings().cpu_isa; !env.empty()) {
      CpuIsa requested = isa;
      if (env == "generic") requested = CpuIsa::kGeneric;
      if (env == "avx2") requested = CpuIsa::kAvx2;
      if (env == "avx512") requested = CpuIsa::kAvx512;
      isa = std::min(isa, requested);
    }
    return isa;
  }();
  return selected;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::string cpu_isa_name() {
  return cpu_isa_name(selected_cpu_isa());
}

double cpu_peak_gflops(std::string* explanation) {
  const X86Identity id = identify_x86();
  const int logical = usable_logical_cpus();
  // SMT siblings share one core's FMA pipes, so count physical cores.
  const double siblings = proc_cpuinfo_number("siblings");
  const double cores_per_package = proc_cpuinfo_number("cpu cores");
  int threads_per_core = 1;
  if (siblings > 0 && cores_per_package > 0 && siblings >= cores_per_package) {
    threads_per_core = static_cast<int>(siblings / cores_per_package + 0.5);
  }
  const int cores = std::max(1, logical / std::max(1, threads_per_core));
  ClockEstimate clock = estimate_clock(id);
  // Measured once per process (about 10 ms).
  static const double measured_ghz = measure_clock_ghz();
  if (measured_ghz > clock.ghz * 1.02) {
    std::ostringstream source;
    source.precision(4);
    source << "measured with a dependent-add chain; " << clock.source << " says " << clock.ghz
           << " GHz";
    clock.ghz = measured_ghz;
    clock.source = source.str();
  }
  const LaneEstimate lanes = estimate_fma_lanes(id);
  const double peak = cores * clock.ghz * lanes.lanes * kFmaPipes * kFlopsPerFma;
  if (explanation) {
    std::ostringstream text;
    text << cores << " cores (" << logical << " usable logical CPUs, " << threads_per_core
         << " per core) x " << clock.ghz << " GHz (" << clock.source << ") x " << lanes.lanes
         << " fp32 lanes per FMA pipe (" << lanes.reason << ") x " << kFmaPipes << " FMA pipes x "
         << kFlopsPerFma << " flop = " << peak << " GFLOP/s";
    *explanation = text.str();
  }
  return peak;
}

}  // namespace tessera::detail
