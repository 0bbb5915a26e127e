// The tessera command end to end: bench (CPU, quick suite, JSON), plan --explain, check, and a
// bad flag giving a clear error.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

Result run(const std::string& args) {
  const std::string command = cli_path() + " " + args + " 2>&1";
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

TEST_F(Cli, PlanExplainDescribesTheWorkPartition) {
  const Result result =
      run("plan --backend cpu --q-lens 1x2048,7x64 --heads 32 --kv-heads 8 --causal --explain");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("batch 8"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("group 4"), std::string::npos);
  EXPECT_NE(result.output.find("imbalance"), std::string::npos);
}

TEST_F(Cli, CheckRunsTheCorrectnessSweep) {
  const Result result = run("check --backend cpu --configs 20 --seed 5");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_NE(result.output.find("20 passed, 0 failed"), std::string::npos) << result.output;
}

TEST_F(Cli, BadArgumentsGiveAClearError) {
  Result result = run("bench --backend tpu");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("--backend"), std::string::npos) << result.output;
  result = run("plan --backend cpu --q-lens 4 --heads 6 --kv-heads 4");
  EXPECT_NE(result.status, 0);
  EXPECT_NE(result.output.find("num_qo_heads"), std::string::npos) << result.output;
}

}  // namespace
