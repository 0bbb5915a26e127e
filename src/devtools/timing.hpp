// Host-side timing support of tessera_devtools: the summary of a set of timed runs (median and
// spread), a host timing loop, and how loaded the machine is (CPU timings on a loaded machine
// vary 20-30% from run to run).
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace tessera::devtools {

struct TimingStats {
  double median = 0, min = 0, max = 0;  // milliseconds (or the unit of the samples)
  int count = 0;
  // (max - min) / median: how much the runs of one measurement disagree; 0 for fewer than two.
  double spread() const { return count > 1 && median > 0 ? (max - min) / median : 0; }
};
TimingStats summarize(std::vector<double> samples);

// Times `call` with a steady clock after one warm-up call: `iterations` runs, or when it is 0,
// 30 runs or as many (at least 3) as fit in `budget_seconds`.
TimingStats time_host_ms(const std::function<void()>& call, int iterations,
                         double budget_seconds = 2.0);

// The machine's 1-minute load average (/proc/loadavg; -1 when unreadable) against the CPUs
// this process may use.
struct HostLoad {
  double load1 = -1;
  int cpus = 0;
  bool loaded() const { return cpus > 0 && load1 > cpus; }
  // One line saying that timings will vary, naming the load; "" when not loaded.
  std::string warning() const;
};
HostLoad host_load();

}  // namespace tessera::devtools
