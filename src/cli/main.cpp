// The `tessera` command: bench (the main job), check, plan --explain, tune, info.
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "cli/bench.hpp"
#include "cli/check.hpp"
#include "cli/tune.hpp"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera;

DType parse_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  throw Error(Error::Kind::kInvalidArgument, "--dtype: expected bf16 or fp16, got '" + name + "'");
}

std::vector<int32_t> parse_lengths(const std::string& text, const char* flag) {
  std::vector<int32_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    // "4x512" repeats 512 four times.
    const size_t x = item.find('x');
    try {
      if (x == std::string::npos) {
        values.push_back(std::stoi(item));
      } else {
        const int count = std::stoi(item.substr(0, x));
        values.insert(values.end(), count, std::stoi(item.substr(x + 1)));
      }
    } catch (const std::exception&) {
      throw Error(Error::Kind::kInvalidArgument,
                  std::string(flag) + ": expected comma-separated lengths like 4x512,16384, got '" +
                      text + "'");
    }
  }
  return values;
}

std::vector<int32_t> indptr_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> indptr(1, 0);
  for (int32_t len : lengths) indptr.push_back(indptr.back() + len);
  return indptr;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tessera: attention kernels for LLM inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(version_string()));

  cli::BenchOptions bench;
  std::string dtype = "bf16";
  int threads = 0;
  auto* bench_cmd = app.add_subcommand(
      "bench", "Time the standard suite on the device found (GPU if present, else CPU)");
  bench_cmd->add_option("--backend", bench.backend, "auto, cpu, cpu-reference or cuda");
  bench_cmd->add_option("--suite", bench.suite,
                        "quick, standard, plan (plan() time), overhead (host time per run) or roofline (DRAM read ceiling of the decode shapes)");
  bench_cmd->add_option("--filter", bench.filter, "only cases whose name contains this text");
  bench_cmd->add_option("--json", bench.json_path, "also write the results as JSON to FILE");
  bench_cmd->add_option("--dtype", dtype, "bf16 or fp16");
  bench_cmd->add_option("--iterations", bench.iterations, "timed runs per case (0: automatic)");
  bench_cmd->add_option("--threads", threads, "CPU threads (0: all)");
  bench_cmd->add_flag("!--no-check", bench.check, "skip the sampled check against the reference");
  bench_cmd->add_flag("!--quiet", bench.progress, "no progress lines");

  cli::CheckOptions check;
  auto* check_cmd =
      app.add_subcommand("check", "Correctness sweep: random configurations vs the reference");
  check_cmd->add_option("--backend", check.backend, "auto, cpu or cuda");
  check_cmd->add_option("--configs", check.num_configs, "number of random configurations");
  check_cmd->add_option("--seed", check.seed, "random seed");
  check_cmd->add_option("--threads", threads, "CPU threads (0: all)");

  std::string q_lens_text, kv_lens_text, op = "prefill", backend = "auto";
  int num_qo_heads = 32, num_kv_heads = 8, head_dim = 128, page_size = 16;
  bool causal = false, explain = false;
  AttentionOptions plan_options;
  auto* plan_cmd = app.add_subcommand("plan", "Build a plan for given lengths and describe it");
  plan_cmd->add_option("--op", op, "prefill, paged or decode");
  plan_cmd->add_option("--q-lens", q_lens_text,
                       "query lengths, e.g. 1x16384,63x256 (decode: tokens per request)");
  plan_cmd->add_option("--kv-lens", kv_lens_text, "kv lengths (default: the query lengths)");
  plan_cmd->add_option("--heads", num_qo_heads, "query heads");
  plan_cmd->add_option("--kv-heads", num_kv_heads, "kv heads");
  plan_cmd->add_option("--head-dim", head_dim, "head dimension");
  plan_cmd->add_option("--page-size", page_size, "page size (paged, decode)");
  plan_cmd->add_option("--window-left", plan_options.window_left, "sliding window, -1: none");
  plan_cmd->add_option("--backend", backend, "auto, cpu or cuda");
  plan_cmd->add_flag("--causal", causal, "causal mask");
  plan_cmd->add_flag("--explain", explain, "print the work partition (default)");

  cli::TuneOptions tune;
  auto* tune_cmd = app.add_subcommand(
      "tune", "Time the decode kernel variants on the GPU, write the tuning file decode reads");
  tune_cmd->add_option("--out", tune.out_path,
                       "tuning file to write (default: $TESSERA_TUNE_FILE, else "
                       "$XDG_CACHE_HOME/tessera/tune.txt or ~/.cache/tessera/tune.txt)");
  tune_cmd->add_flag("--dry-run", tune.dry_run, "measure and print only, write nothing");
  tune_cmd->add_option("--iterations", tune.iterations, "timed runs per candidate and shape");
  tune_cmd->add_option("--filter", tune.filter,
                       "only the shapes whose label contains these whole words, e.g. "
                       "\"d64 group 8\" "
                       "(labels: d<head_dim> group <g> <bf16|fp16>; other entries of the file "
                       "are kept)");
  tune_cmd->add_flag("!--quiet", tune.progress, "no progress lines");

  auto* info_cmd = app.add_subcommand("info", "Describe the devices and the build");

  CLI11_PARSE(app, argc, argv);
  try {
    if (threads > 0) set_num_threads(threads);
    if (*bench_cmd) {
      bench.dtype = parse_dtype(dtype);
      return cli::run_bench(bench);
    }
    if (*check_cmd) return cli::run_check(check);
    if (*tune_cmd) return cli::run_tune(tune);
    if (*plan_cmd) {
      const Device device = cli::resolve_backend(backend);
      plan_options.causal = causal;
      std::vector<int32_t> q_lens = parse_lengths(q_lens_text, "--q-lens");
      const std::vector<int32_t> kv_lens =
          kv_lens_text.empty() ? q_lens : parse_lengths(kv_lens_text, "--kv-lens");
      if (kv_lens.empty()) {
        throw Error(Error::Kind::kInvalidArgument, "--q-lens / --kv-lens: expected lengths");
      }
      if (op == "decode") q_lens.assign(kv_lens.size(), q_lens.empty() ? 1 : q_lens[0]);
      if (kv_lens.size() != q_lens.size()) {
        throw Error(Error::Kind::kInvalidArgument,
                    "--kv-lens: expected as many lengths as --q-lens (" +
                        std::to_string(q_lens.size()) + "), got " + std::to_string(kv_lens.size()));
      }
      Plan plan;
      if (op == "prefill") {
        plan = plan_ragged_prefill(indptr_of(q_lens), indptr_of(kv_lens), num_qo_heads,
                                   num_kv_heads, head_dim, plan_options, device);
      } else if (op == "paged" || op == "decode") {
        std::vector<int32_t> pages, last;
        for (int32_t len : kv_lens) {
          const int32_t count = (len + page_size - 1) / page_size;
          pages.push_back(count);
          last.push_back(count ? len - (count - 1) * page_size : 0);
        }
        if (op == "paged") {
          plan = plan_paged_prefill(indptr_of(q_lens), indptr_of(pages), last, page_size,
                                    num_qo_heads, num_kv_heads, head_dim, plan_options, device);
        } else {
          plan = plan_decode(indptr_of(pages), last, page_size, num_qo_heads, num_kv_heads,
                             head_dim, plan_options, device, q_lens.empty() ? 1 : q_lens[0]);
        }
      } else {
        throw Error(Error::Kind::kInvalidArgument,
                    "--op: expected prefill, paged or decode, got '" + op + "'");
      }
      std::cout << plan.explain();
      return 0;
    }
    if (*info_cmd) {
      std::cout << "tessera " << version_string() << "\n"
                << describe_device(Device{DeviceType::kCPU, 0}) << "\n"
                << "cuda devices: " << cuda_device_count() << "\n";
      for (int i = 0; i < cuda_device_count(); ++i) {
        std::cout << "  " << describe_device(Device{DeviceType::kCUDA, i}) << "\n";
      }
      return 0;
    }
  } catch (const std::exception& error) {
    std::cerr << "tessera: " << error.what() << "\n";
    return 2;
  }
  return 0;
}
