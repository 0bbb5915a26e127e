// `tessera bench --suite quick|standard`: every case of the suite built, checked on a sample
// against the reference, timed, and printed as a table (and optionally JSON). The other suites
// are bench_plan.cpp and bench_floor.cpp; the cases bench_suites.cpp.
#include "cli/bench.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>

#include "cli/bench_internal.hpp"
#include "cpu/cpu_info.hpp"
#include "devtools/timing.hpp"
#include "tessera/backend.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "devtools/bench_support.hpp"
#endif

namespace tessera::cli {
namespace {

// A CPU case whose runs disagree by more than this ((max - min) / median) says the machine is
// busy, when the load average did not.
constexpr double kNoisySpread = 0.3;

// The device's peaks: compute in TFLOP/s, memory in TB/s (0: unknown), and how they were found.
struct Peaks {
  double compute = 0, memory = 0;
  std::string how;
};

Peaks device_peaks(Device device) {
  Peaks peaks;
  if (device.type == DeviceType::kCPU) {
    peaks.compute = detail::cpu_peak_gflops(&peaks.how) / 1e3;
  } else {
#if defined(TESSERA_HAVE_CUDA)
    devtools::cuda_device_peaks(device.index, &peaks.compute, &peaks.memory, &peaks.how);
#endif
  }
  return peaks;
}

// Builds, checks and times one case.
BenchResult run_case(const BenchCase& c, const BenchOptions& options, Device device, bool reference,
                     const Peaks& peaks, uint64_t seed, std::mt19937_64& rng) {
  BenchResult result;
  result.bench_case = c;
  try {
    BenchProblem problem;
    problem.spec = c;
    problem.device = device;
    problem.dtype = options.dtype;
    build_problem(problem, seed);
    problem.o.poison();
    problem.lse.poison();
    run_once(problem);
    if (options.check) {
      int nans = 0;
      double worst = check_request(problem, 0, rng, &nans);
      if (c.batch > 1) worst = std::max(worst, check_request(problem, c.batch - 1, rng, &nans));
      result.max_rel_error = worst;
      result.nan_count = nans;
      if (worst > kMaxRelError || nans > 0) result.status = "WRONG";
    }
    const devtools::TimingStats timing = time_stats(problem, reference ? 1 : options.iterations);
    result.milliseconds = timing.median;
    result.min_milliseconds = timing.min;
    result.max_milliseconds = timing.max;
    result.runs = timing.count;
    const double seconds = result.milliseconds * 1e-3;
    const double elem = static_cast<double>(dtype_size(options.dtype));
    const double pairs = problem.masked_pairs >= 0 ? problem.masked_pairs : visible_pairs(c);
    // MLA: q.k over head_dim + rope_dim and p.v over head_dim per pair, one latent row per key.
    result.flops = c.mla ? 2.0 * pairs * (c.qk_dim() + c.head_dim) * c.num_qo_heads
                         : 4.0 * pairs * c.head_dim * c.num_qo_heads;
    result.bytes = c.mla ? total_keys(c) * c.qk_dim() * elem
                         : 2.0 * total_keys(c) * c.num_kv_heads * c.head_dim * elem;
    if (c.op == AttentionOp::kDecode) {
      result.rate = result.bytes / seconds / 1e12;
      if (peaks.memory > 0) result.percent_of_peak = 100.0 * result.rate / peaks.memory;
    } else {
      result.rate = result.flops / seconds / 1e12;
      if (peaks.compute > 0) result.percent_of_peak = 100.0 * result.rate / peaks.compute;
    }
  } catch (const std::exception& error) {
    result.status = std::string("error: ") + error.what();
  }
  return result;
}

// The table: median time and rate first (tools/ab-table.py reads those two numbers after the
// name), then the fastest run and the spread of the runs.
void print_table(const std::vector<BenchResult>& results, bool cpu) {
  std::printf("\n%-44s %10s %12s %10s %7s %8s %10s %s\n", "case", "median ms",
              cpu ? "GFLOP|GB/s" : "TFLOP|TB/s", "min ms", "spread", "% peak", "max err", "status");
  for (const BenchResult& r : results) {
    const double shown = cpu ? r.rate * 1e3 : r.rate;
    const std::string unit = r.bench_case.op == AttentionOp::kDecode ? (cpu ? " GB/s" : " TB/s")
                                                                     : (cpu ? " GF/s" : " TF/s");
    const std::string spread =
        r.runs > 1 ? format_double(100.0 * r.spread(), 1) + "%" : std::string("-");
    std::printf("%-44s %10.3f %7.2f%s %10.3f %7s %8s %10s %s\n", r.bench_case.name.c_str(),
                r.milliseconds, shown, unit.c_str(), r.min_milliseconds, spread.c_str(),
                r.percent_of_peak >= 0 ? format_double(r.percent_of_peak, 1).c_str() : "-",
                r.max_rel_error >= 0 ? format_double(r.max_rel_error, 5).c_str() : "-",
                r.status.c_str());
  }
}

void write_json(const std::string& path, const std::string& device_text, DType dtype,
                const Peaks& peaks, const std::vector<BenchResult>& results) {
  std::ofstream json(path);
  json << "{\n  \"device\": \"" << device_text << "\",\n  \"dtype\": \"" << dtype_name(dtype)
       << "\",\n  \"peak_tflops\": " << peaks.compute << ",\n  \"peak_tbps\": " << peaks.memory
       << ",\n  \"results\": [\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const BenchResult& r = results[i];
    const BenchCase& c = r.bench_case;
    json << "    {\"name\": \"" << c.name << "\", \"op\": \"" << op_name(c.op)
         << "\", \"batch\": " << c.batch << ", \"q_len\": " << c.q_len
         << ", \"kv_len\": " << c.kv_len << ", \"num_qo_heads\": " << c.num_qo_heads
         << ", \"num_kv_heads\": " << c.num_kv_heads << ", \"head_dim\": " << c.head_dim
         << ", \"page_size\": " << c.page_size << ", \"causal\": " << (c.causal ? 1 : 0)
         << ", \"first_q_len\": " << c.q_len_of(0) << ", \"first_kv_len\": " << c.kv_len_of(0)
         << ", \"first_count\": " << c.num_first() << ", \"checked\": " << (c.checked ? 1 : 0)
         << ", \"graph\": " << (c.graph ? 1 : 0) << ", \"pdl\": " << (c.pdl ? 1 : 0)
         << ", \"shared_prefix\": " << c.shared_prefix << ", \"cascade\": " << (c.cascade ? 1 : 0)
         << ", \"mask_block\": " << c.mask_block << ", \"ms\": " << r.milliseconds
         << ", \"min_ms\": " << r.min_milliseconds << ", \"max_ms\": " << r.max_milliseconds
         << ", \"runs\": " << r.runs << ", \"tflops\": " << r.flops / 1e12
         << ", \"bytes\": " << r.bytes << ", \"rate\": " << r.rate
         << ", \"percent_of_peak\": " << r.percent_of_peak
         << ", \"max_rel_error\": " << r.max_rel_error << ", \"nan_count\": " << r.nan_count
         << ", \"status\": \"" << (r.status == "ok" ? "ok" : "failed") << "\"}"
         << (i + 1 < results.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
}

// CPU timings on a busy machine vary 20-30% from run to run: says so once, before the cases when
// the load average is above the CPU count, else after them when a case's runs disagreed widely.
class LoadWarning {
 public:
  explicit LoadWarning(bool cpu) : cpu_(cpu) {
    if (!cpu_) return;
    const devtools::HostLoad load = devtools::host_load();
    if (load.loaded()) say(load.warning());
  }
  void after(const std::vector<BenchResult>& results) {
    if (!cpu_ || warned_) return;
    double worst = 0;
    for (const BenchResult& r : results) {
      if (r.runs >= 3) worst = std::max(worst, r.spread());
    }
    if (worst > kNoisySpread) {
      say("the runs of one case differed by up to " + format_double(100 * worst, 0) +
          "% (min to max): the machine is busy or throttling; CPU timings vary 20-30% from run "
          "to run on a loaded machine");
    }
  }

 private:
  void say(const std::string& text) {
    std::cerr << "tessera bench: warning: " << text << "\n";
    warned_ = true;
  }
  bool cpu_ = false;
  bool warned_ = false;
};

}  // namespace

int run_bench(const BenchOptions& options) {
  if (options.suite == "plan") return run_plan_bench(options);
  if (options.suite == "overhead") return run_overhead_bench(options);
  if (options.suite == "roofline") return run_roofline_bench(options);
  bool reference = false;
  const Device device = resolve_backend(options.backend, &reference);
  const CpuImpl saved_impl = cpu_impl();
  if (reference) set_cpu_impl(CpuImpl::kReference);

  const Peaks peaks = device_peaks(device);
  const std::string device_text = describe_device(device);
  std::cout << "tessera bench: " << device_text << (reference ? " (reference oracle)" : "")
            << ", dtype " << dtype_name(options.dtype) << "\n"
            << "peak: " << format_double(peaks.compute * 1e3, 1) << " GFLOP/s"
            << (peaks.memory > 0 ? ", " + format_double(peaks.memory, 2) + " TB/s" : "") << " ("
            << peaks.how << ")" << std::endl;
  const bool cpu = device.type == DeviceType::kCPU;
  LoadWarning load_warning(cpu && !reference);

  std::vector<BenchCase> cases = bench_suite(options.suite, device);
  if (!options.filter.empty()) {
    std::erase_if(cases, [&](const BenchCase& c) {
      return c.name.find(options.filter) == std::string::npos;
    });
  }
  std::vector<BenchResult> results;
  std::mt19937_64 rng(1234);
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (options.progress) {
      std::cerr << "[" << i + 1 << "/" << cases.size() << "] " << cases[i].name << " ..."
                << std::endl;
    }
    results.push_back(run_case(cases[i], options, device, reference, peaks, 100 + i, rng));
    failures += results.back().status != "ok";
  }
  if (reference) set_cpu_impl(saved_impl);

  load_warning.after(results);
  print_table(results, cpu);
  if (!options.json_path.empty()) {
    write_json(options.json_path, device_text, options.dtype, peaks, results);
  }
  if (failures) std::printf("\n%d case(s) failed\n", failures);
  return failures ? 1 : 0;
}

}  // namespace tessera::cli
