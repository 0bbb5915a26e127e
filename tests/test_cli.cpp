// The tessera command end to end: bench (CPU, quick suite, JSON, the spread of the timings and
// devtools' loaded-machine warning), plan --explain (prefill and decode; the decode kernel note on
// a GPU), info, settings, check, tune without a GPU, and unknown words and bad values (a bad or
// GPU-only suite among them) named in the error.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "core/settings.hpp"
#include "devtools/timing.hpp"

namespace {

std::string cli_path() {
  if (const char* env = std::getenv("TESSERA_CLI")) return env;
  // Next to the test binaries' folder (a copied build tree): tests/../tessera.
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  return (self.parent_path().parent_path() / "tessera").string();
}

struct Result {
  int status;
  std::string output;
};

// `environment`: assignments put before the command, e.g. "CUDA_VISIBLE_DEVICES=-1".
Result run(const std::string& args, const std::string& environment = "") {
  const std::string command =
      (environment.empty() ? "" : environment + " ") + cli_path() + " " + args + " 2>&1";
  Result result{-1, ""};
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(cli_path())) GTEST_SKIP() << "tessera command not found";
  }
};

TEST_F(Cli, BenchQuickOnTheCpuPrintsATableAndJson) {
  const std::string json = (std::filesystem::temp_directory_path() / "tessera_bench_test.json");
  const Result result = run("bench --backend cpu --suite quick --iterations 2 --quiet --json " + json);
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("GFLOP/s"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("prefill d128"), std::string::npos);
  EXPECT_NE(result.output.find("decode gqa32/8"), std::string::npos);
  EXPECT_EQ(result.output.find("WRONG"), std::string::npos) << result.output;
  std::ifstream file(json);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_NE(text.str().find("\"results\""), std::string::npos);
  EXPECT_NE(text.str().find("\"status\": \"ok\""), std::string::npos);
  EXPECT_EQ(text.str().find("\"status\": \"failed\""), std::string::npos);
}

TEST_F(Cli, BenchPrintsTheSpreadOfItsTimings) {
  const std::string json =
      (std::filesystem::temp_directory_path() / "tessera_bench_spread_test.json");
  const Result result =
      run("bench --backend cpu --suite quick --iterations 3 --quiet --filter decode --json " + json);
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("median ms"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("min ms"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("spread"), std::string::npos) << result.output;
  std::ifstream file(json);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_NE(text.str().find("\"min_ms\": "), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"runs\": 3"), std::string::npos) << text.str();
}

// devtools' timing summary and the loaded-machine warning the CPU bench prints once.
TEST(Devtools, TimingStatsAndTheLoadWarning) {
  const tessera::devtools::TimingStats stats = tessera::devtools::summarize({3.0, 1.0, 2.0, 9.0});
  EXPECT_EQ(stats.count, 4);
  EXPECT_EQ(stats.min, 1.0);
  EXPECT_EQ(stats.median, 3.0);
  EXPECT_EQ(stats.max, 9.0);
  EXPECT_DOUBLE_EQ(stats.spread(), 8.0 / 3.0);
  EXPECT_EQ(tessera::devtools::summarize({}).spread(), 0.0);

  const tessera::devtools::HostLoad busy{3.5, 2};
  EXPECT_TRUE(busy.loaded());
  EXPECT_NE(busy.warning().find("1-minute load 3.5 on 2 CPUs"), std::string::npos)
      << busy.warning();
  EXPECT_NE(busy.warning().find("20-30%"), std::string::npos) << busy.warning();
  const tessera::devtools::HostLoad idle{0.5, 2};
  EXPECT_FALSE(idle.loaded());
  EXPECT_EQ(idle.warning(), "");
  EXPECT_FALSE(tessera::devtools::HostLoad{}.loaded());  // unreadable /proc/loadavg
  const tessera::devtools::HostLoad here = tessera::devtools::host_load();
  EXPECT_GT(here.cpus, 0);
}

TEST_F(Cli, PlanExplainDescribesTheWorkPartition) {
  const Result result =
      run("plan --backend cpu --q-lens 1x2048,7x64 --heads 32 --kv-heads 8 --causal --explain");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("batch 8"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("group 4"), std::string::npos);
  EXPECT_NE(result.output.find("imbalance"), std::string::npos);
}

TEST_F(Cli, PlanExplainOfADecodeNamesTheKernel) {
  const Result result = run(
      "plan --backend cpu --op decode --kv-lens 1x32768,15x4096 --heads 32 --kv-heads 8 "
      "--explain");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("decode"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("batch 16"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("kernel: CPU"), std::string::npos) << result.output;
}

// On a GPU: the decode note names the kernel family, the minimum chunk and where each came
// from; a tuning file entry for this device (TESSERA_TUNE_FILE) and the environment show up.
TEST_F(Cli, PlanExplainOfADecodeOnTheGpuNamesTheTuningSources) {
  const Result info = run("info");
  if (info.output.find("cuda devices: 0") != std::string::npos ||
      info.output.find("cuda devices:") == std::string::npos) {
    GTEST_SKIP() << "no CUDA device";
  }
  const std::string plan = "plan --backend cuda --op decode --kv-lens 4x4096 --heads 32 "
                           "--kv-heads 8 --head-dim 128 --explain";
  const std::filesystem::path missing =
      std::filesystem::temp_directory_path() / "tessera_cli_no_tune_file.txt";
  std::filesystem::remove(missing);
  Result result = run(plan, "TESSERA_DECODE_VARIANT= TESSERA_DECODE_MIN_CHUNK= "
                            "TESSERA_TUNE_FILE=" + missing.string());
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("tensor-core mma variant 1"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("keys, from built-in default (no tuning file"),
            std::string::npos) << result.output;
  EXPECT_NE(result.output.find("at run time"), std::string::npos) << result.output;

  // The device name as `info` prints it: "cuda:0 NAME sm_XY, N SMs".
  const size_t begin = info.output.find("cuda:0 ");
  const size_t end = info.output.find(" sm_", begin);
  ASSERT_NE(end, std::string::npos) << info.output;
  const std::string name = info.output.substr(begin + 7, end - begin - 7);
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / "tessera_cli_tune_file.txt";
  std::ofstream(file) << "tessera-tune 1\ndecode device=\"" << name
                      << "\" head_dim=128 group=4 kv=bf16 variant=3 min_chunk=256\n";
  result = run(plan, "TESSERA_DECODE_VARIANT= TESSERA_DECODE_MIN_CHUNK= "
                     "TESSERA_TUNE_FILE=" + file.string());
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("tensor-core mma variant 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("warps 2, stages 6"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("chunk 256 keys, from tuning file " + file.string()),
            std::string::npos) << result.output;
  result = run(plan, "TESSERA_DECODE_VARIANT=0 TESSERA_DECODE_MIN_CHUNK= "
                     "TESSERA_TUNE_FILE=" + file.string());
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("CUDA-core kernel (variant 0"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("variant from TESSERA_DECODE_VARIANT"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("chunk 256 keys, from tuning file"), std::string::npos)
      << result.output;
  std::filesystem::remove(file);
}

TEST_F(Cli, TuneWithoutAGpuExitsWithAClearMessage) {
  // CUDA_VISIBLE_DEVICES=-1 hides every GPU, so this runs the same with or without one.
  const Result result = run("tune --dry-run", "CUDA_VISIBLE_DEVICES=-1");
  EXPECT_NE(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("tune needs a CUDA device; none visible"), std::string::npos)
      << result.output;
}

TEST_F(Cli, TuneFilterMatchesWholeWords) {
  // Checked before the device, so this runs the same with or without a GPU.
  for (const char* filter : {"roup 4", "group 16", "d12", "bf1"}) {
    const Result result =
        run(std::string("tune --dry-run --filter \"") + filter + "\"", "CUDA_VISIBLE_DEVICES=-1");
    EXPECT_NE(result.status, 0) << result.output;
    EXPECT_NE(result.output.find("no tuned shape matches '" + std::string(filter) + "'"),
              std::string::npos)
        << filter << ": " << result.output;
  }
  // Whole words (surrounding spaces ignored) pass the filter and reach the device check.
  for (const char* filter : {"group 1 fp16", " d64 "}) {
    const Result result = run(std::string("tune --dry-run --filter \"") + filter + "\"",
                              "CUDA_VISIBLE_DEVICES=-1");
    EXPECT_NE(result.output.find("tune needs a CUDA device; none visible"), std::string::npos)
        << filter << ": " << result.output;
  }
}

TEST_F(Cli, InfoDescribesTheBuild) {
  Result result = run("info");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_EQ(result.output.rfind("tessera ", 0), 0u) << result.output;
  const bool cuda =
      result.output.find("build: CUDA backend compiled in, archs ") != std::string::npos;
  EXPECT_TRUE(cuda || result.output.find("build: no CUDA backend") != std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("cpu kernels: "), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("cuda devices: "), std::string::npos) << result.output;
  // The ISA in use follows TESSERA_CPU_ISA (which only lowers it).
  result = run("info", "TESSERA_CPU_ISA=generic");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("cpu kernels: generic"), std::string::npos) << result.output;
}

TEST_F(Cli, SettingsListsTheRegistryAndTheValuesInForce) {
  const Result result =
      run("settings", "TESSERA_BACKEND=cpu TESSERA_PLAN_L2_MB=lots TESSERA_CHECK=");
  ASSERT_EQ(result.status, 0) << result.output;
  for (const tessera::detail::SettingDoc& doc : tessera::detail::setting_docs()) {
    EXPECT_NE(result.output.find(std::string("\n") + doc.name + " ("), std::string::npos)
        << doc.name << ": " << result.output;
    EXPECT_NE(result.output.find(doc.doc), std::string::npos) << doc.name;
  }
  EXPECT_NE(result.output.find("in force: 'cpu' (from the environment)"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("in force: 16 (default; the environment's 'lots' is ignored)"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("in force: 0 (default)"), std::string::npos) << result.output;
}

TEST_F(Cli, SettingsMarkdownIsTheRegistrysTable) {
  using tessera::detail::SettingScope;
  for (const auto& [word, scope] : {std::pair{"developer", SettingScope::kDeveloper},
                                    std::pair{"user", SettingScope::kUser}}) {
    const Result result = run(std::string("settings --markdown ") + word);
    ASSERT_EQ(result.status, 0) << result.output;
    EXPECT_EQ(result.output, tessera::detail::settings_markdown(scope)) << word;
  }
  const Result result = run("settings --markdown everyone");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("--markdown: expected user, developer or external, got 'everyone'"),
            std::string::npos)
      << result.output;
}

TEST_F(Cli, CheckRunsTheCorrectnessSweep) {
  const Result result = run("check --backend cpu --configs 20 --seed 5");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("20 passed, 0 failed"), std::string::npos) << result.output;
}

TEST_F(Cli, UnknownWordsAreNamed) {
  Result result = run("bogus");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("unknown subcommand 'bogus' (expected one of: bench, check, plan, "
                               "tune, info, settings)"),
            std::string::npos)
      << result.output;
  result = run("");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("expected a subcommand (one of: bench,"), std::string::npos)
      << result.output;
  result = run("bench --bogus");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("tessera bench: unknown option '--bogus'"), std::string::npos)
      << result.output;
  result = run("--bogus");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("unknown option '--bogus'"), std::string::npos) << result.output;
  result = run("plan stray");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("tessera plan: unexpected argument 'stray'"), std::string::npos)
      << result.output;
  result = run("bench --iterations many");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_NE(result.output.find("--iterations"), std::string::npos) << result.output;
  EXPECT_EQ(run("--help").status, 0);
  EXPECT_EQ(run("bench --help").status, 0);
}

TEST_F(Cli, BadArgumentsGiveAClearError) {
  Result result = run("bench --backend tpu");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("--backend"), std::string::npos) << result.output;
  result = run("plan --backend cpu --q-lens 4 --heads 6 --kv-heads 4");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("num_qo_heads"), std::string::npos) << result.output;
  // The serving suite's shapes are the GPU's (minutes each on a CPU): said, not attempted.
  result = run("bench --backend cpu --suite serving --quiet");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("--suite serving: needs a CUDA device"), std::string::npos)
      << result.output;
  EXPECT_EQ(result.output.find("prefill d"), std::string::npos) << result.output;
  result = run("bench --suite fast");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("expected quick, standard, serving"), std::string::npos)
      << result.output;
}

}  // namespace
