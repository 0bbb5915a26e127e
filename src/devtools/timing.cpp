#include "devtools/timing.hpp"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

namespace tessera::devtools {

TimingStats summarize(std::vector<double> samples) {
  TimingStats stats;
  if (samples.empty()) return stats;
  std::sort(samples.begin(), samples.end());
  stats.count = static_cast<int>(samples.size());
  stats.median = samples[samples.size() / 2];
  stats.min = samples.front();
  stats.max = samples.back();
  return stats;
}

TimingStats time_host_ms(const std::function<void()>& call, int iterations, double budget_seconds) {
  call();  // warm-up
  std::vector<double> times;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(budget_seconds));
  const int wanted = iterations > 0 ? iterations : 30;
  for (int i = 0; i < wanted; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto stop = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    if (iterations == 0 && i >= 2 && stop > deadline) break;
  }
  return summarize(std::move(times));
}

std::string HostLoad::warning() const {
  if (!loaded()) return "";
  char text[256];
  std::snprintf(text, sizeof(text),
                "the machine is loaded (1-minute load %.1f on %d CPUs): CPU timings vary 20-30%% "
                "from run to run; compare cases of one run, or rerun on an idle machine",
                load1, cpus);
  return text;
}

HostLoad host_load() {
  HostLoad load;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) load.cpus = CPU_COUNT(&set);
  if (load.cpus <= 0) load.cpus = static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream file("/proc/loadavg");
  double value = -1;
  if (file >> value) load.load1 = value;
  return load;
}

}  // namespace tessera::devtools
