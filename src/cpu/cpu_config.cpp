// Process-wide settings of the CPU backend: which implementation serves CPU calls and how many
// threads the fast path uses.
#include <atomic>
#include <cstdlib>
#include <string>

#include "core/settings.hpp"
#include "cpu/cpu_info.hpp"
#include "tessera/backend.hpp"

namespace tessera {
namespace {

// 0 means "not set by set_num_threads": the default below applies.
std::atomic<int> g_num_threads{0};
std::atomic<CpuImpl> g_cpu_impl{CpuImpl::kFast};
std::atomic<bool> g_index_checking{detail::settings().check};

// TESSERA_NUM_THREADS wins over the CPU count (the process's affinity mask) so a deployment can
// leave cores to the serving framework; an unparsable or non-positive value is ignored.
int default_num_threads() {
  static const int threads = [] {
    const int configured = detail::settings().num_threads;
    return configured > 0 ? configured : detail::usable_logical_cpus();
  }();
  return threads;
}

}  // namespace

void set_index_checking(bool on) { g_index_checking.store(on, std::memory_order_relaxed); }
bool index_checking() { return g_index_checking.load(std::memory_order_relaxed); }

void set_cpu_impl(CpuImpl impl) {
  if (impl != CpuImpl::kFast && impl != CpuImpl::kReference) {
    throw Error(Error::Kind::kInvalidArgument,
                "set_cpu_impl: impl must be CpuImpl::kFast or CpuImpl::kReference, got " +
                    std::to_string(static_cast<int>(impl)));
  }
  g_cpu_impl.store(impl, std::memory_order_relaxed);
}

CpuImpl cpu_impl() {
  return g_cpu_impl.load(std::memory_order_relaxed);
}

// threads >= 1 pins the count; 0 restores the default (TESSERA_NUM_THREADS or hardware count).
void set_num_threads(int threads) {
  if (threads < 0) {
    throw Error(Error::Kind::kInvalidArgument,
                "set_num_threads: threads must be >= 1 (or 0 for the default), got " +
                    std::to_string(threads));
  }
  g_num_threads.store(threads, std::memory_order_relaxed);
}

int num_threads() {
  const int threads = g_num_threads.load(std::memory_order_relaxed);
  return threads > 0 ? threads : default_num_threads();
}

}  // namespace tessera
