// The `tessera` command: bench (the main job), check, plan --explain, tune, info, settings.
#include <CLI/CLI.hpp>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/bench.hpp"
#include "cli/check.hpp"
#include "cli/info.hpp"
#include "cli/plan.hpp"
#include "cli/tune.hpp"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera;

DType parse_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  throw Error(Error::Kind::kInvalidArgument, "--dtype: expected bf16 or fp16, got '" + name + "'");
}

// The command line, parsed into these.
struct Commands {
  cli::BenchOptions bench;
  std::string dtype = "bf16";
  int threads = 0;
  cli::CheckOptions check;
  cli::PlanOptions plan;
  cli::TuneOptions tune;
  CLI::App* bench_cmd = nullptr;
  CLI::App* check_cmd = nullptr;
  CLI::App* plan_cmd = nullptr;
  CLI::App* tune_cmd = nullptr;
  CLI::App* info_cmd = nullptr;
  std::string settings_markdown;
  CLI::App* settings_cmd = nullptr;
};

void add_bench(CLI::App& app, Commands& c) {
  cli::BenchOptions& bench = c.bench;
  auto* cmd = app.add_subcommand(
      "bench", "Time the standard suite on the device found (GPU if present, else CPU)");
  cmd->add_option("--backend", bench.backend, "auto, cpu, cpu-reference or cuda");
  cmd->add_option("--suite", bench.suite,
                  "quick, standard, serving (decode grid, short and chunked prefill, mixed, "
                  "graph replay with and without PDL), plan (plan() time), overhead (host time "
                  "per run) or roofline (DRAM read ceiling of the decode shapes)");
  cmd->add_option("--filter", bench.filter, "only cases whose name contains this text");
  cmd->add_option("--json", bench.json_path, "also write the results as JSON to FILE");
  cmd->add_option("--dtype", c.dtype, "bf16 or fp16");
  cmd->add_option("--iterations", bench.iterations, "timed runs per case (0: automatic)");
  cmd->add_option("--threads", c.threads, "CPU threads (0: all)");
  cmd->add_flag("!--no-check", bench.check, "skip the sampled check against the reference");
  cmd->add_flag("!--quiet", bench.progress, "no progress lines");
  c.bench_cmd = cmd;
}

void add_check(CLI::App& app, Commands& c) {
  auto* cmd =
      app.add_subcommand("check", "Correctness sweep: random configurations vs the reference");
  cmd->add_option("--backend", c.check.backend, "auto, cpu or cuda");
  cmd->add_option("--configs", c.check.num_configs, "number of random configurations");
  cmd->add_option("--seed", c.check.seed, "random seed");
  cmd->add_option("--threads", c.threads, "CPU threads (0: all)");
  c.check_cmd = cmd;
}

void add_plan(CLI::App& app, Commands& c) {
  cli::PlanOptions& plan = c.plan;
  auto* cmd = app.add_subcommand("plan", "Build a plan for given lengths and describe it");
  cmd->add_option("--op", plan.op, "prefill, paged or decode");
  cmd->add_option("--q-lens", plan.q_lens,
                  "query lengths, e.g. 1x16384,63x256 (decode: tokens per request)");
  cmd->add_option("--kv-lens", plan.kv_lens, "kv lengths (default: the query lengths)");
  cmd->add_option("--heads", plan.num_qo_heads, "query heads");
  cmd->add_option("--kv-heads", plan.num_kv_heads, "kv heads");
  cmd->add_option("--head-dim", plan.head_dim, "head dimension");
  cmd->add_option("--page-size", plan.page_size, "page size (paged, decode)");
  cmd->add_option("--window-left", plan.attention.window_left, "sliding window, -1: none");
  cmd->add_option("--backend", plan.backend, "auto, cpu or cuda");
  cmd->add_flag("--causal", plan.causal, "causal mask");
  cmd->add_flag("--explain", plan.explain, "print the work partition (default)");
  c.plan_cmd = cmd;
}

void add_tune(CLI::App& app, Commands& c) {
  cli::TuneOptions& tune = c.tune;
  auto* cmd = app.add_subcommand(
      "tune", "Time the decode kernel variants on the GPU, write the tuning file decode reads");
  cmd->add_option("--out", tune.out_path,
                  "tuning file to write (default: $TESSERA_TUNE_FILE, else "
                  "$XDG_CACHE_HOME/tessera/tune.txt or ~/.cache/tessera/tune.txt)");
  cmd->add_flag("--dry-run", tune.dry_run, "measure and print only, write nothing");
  cmd->add_option("--iterations", tune.iterations, "timed runs per candidate and shape");
  cmd->add_option("--filter", tune.filter,
                  "only the shapes whose label contains these whole words, e.g. \"d64 group 8\" "
                  "(labels: d<head_dim> group <g> <bf16|fp16>; other entries of the file are "
                  "kept)");
  cmd->add_flag("!--quiet", tune.progress, "no progress lines");
  c.tune_cmd = cmd;
}

int run(const Commands& c) {
  if (c.threads > 0) set_num_threads(c.threads);
  if (*c.bench_cmd) {
    cli::BenchOptions bench = c.bench;
    bench.dtype = parse_dtype(c.dtype);
    return cli::run_bench(bench);
  }
  if (*c.check_cmd) return cli::run_check(c.check);
  if (*c.tune_cmd) return cli::run_tune(c.tune);
  if (*c.plan_cmd) return cli::run_plan(c.plan);
  if (*c.info_cmd) return cli::run_info();
  if (*c.settings_cmd) return cli::run_settings(c.settings_markdown);
  return 0;
}

// The subcommands' names, "bench, check, plan, tune, info".
std::string subcommand_names(const CLI::App& app) {
  std::string names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  return names;
}

// The arguments CLI11 did not expect, from its message "... not expected: B A" (last first).
std::vector<std::string> unexpected_arguments(const CLI::ExtrasError& error) {
  const std::string text = error.what();
  const size_t colon = text.find(": ");
  std::vector<std::string> words;
  std::istringstream stream(colon == std::string::npos ? "" : text.substr(colon + 2));
  for (std::string word; stream >> word;) words.insert(words.begin(), word);
  return words;
}

// Parses the command line; on a usage error prints one line naming the word at fault and returns
// the exit status (2), on --help / --version prints them and returns 0; nullopt: run.
std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  const std::string names = subcommand_names(app);
  if (argc < 2) {
    std::cerr << "tessera: expected a subcommand (one of: " << names << "); tessera --help\n";
    return 2;
  }
  const std::string first = argv[1];
  const bool known_flag =
      first == "-h" || first == "--help" || first == "--help-all" || first == "--version";
  if (!first.empty() && first[0] == '-' && !known_flag) {
    std::cerr << "tessera: unknown option '" << first
              << "' (expected a subcommand first, one of: " << names << ")\n";
    return 2;
  }
  if (first.empty() || first[0] != '-') {
    const auto subs =
        app.get_subcommands([&](const CLI::App* sub) { return sub->check_name(first); });
    if (subs.empty()) {
      std::cerr << "tessera: unknown subcommand '" << first << "' (expected one of: " << names
                << ")\n";
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help, --version
    const std::vector<CLI::App*> parsed = app.get_subcommands();
    const std::string where = parsed.empty() ? "tessera" : "tessera " + parsed.back()->get_name();
    const auto* extras = dynamic_cast<const CLI::ExtrasError*>(&error);
    if (extras == nullptr) {
      std::cerr << where << ": " << error.what() << " (" << where << " --help)\n";
      return 2;
    }
    for (const std::string& word : unexpected_arguments(*extras)) {
      std::cerr << where << ": "
                << (word.rfind('-', 0) == 0 ? "unknown option '" : "unexpected argument '") << word
                << "' (" << where << " --help lists the options)\n";
    }
    return 2;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tessera: attention kernels for LLM inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(version_string()));
  Commands commands;
  add_bench(app, commands);
  add_check(app, commands);
  add_plan(app, commands);
  add_tune(app, commands);
  commands.info_cmd = app.add_subcommand("info", "Describe the build and the devices");
  commands.settings_cmd = app.add_subcommand(
      "settings", "List the environment variables Tessera reads and the values in force");
  commands.settings_cmd->add_option(
      "--markdown", commands.settings_markdown,
      "print the table of one scope (user, developer or external) as the docs have it");

  if (const std::optional<int> status = parse(app, argc, argv)) return *status;
  try {
    return run(commands);
  } catch (const std::exception& error) {
    std::cerr << "tessera: " << error.what() << "\n";
    return 2;
  }
}
