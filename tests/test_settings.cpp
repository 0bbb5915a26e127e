// The settings registry (core/settings.hpp): parsing, the read-once snapshot, the rule that no
// other library file reads the environment, and the docs generated from it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/scoped_env.hpp"
#include "core/settings.hpp"

namespace tessera {
namespace {

using detail::settings;
using detail::SettingScope;
using test::ScopedEnv;

// The repository root, from this file's path (CMake compiles it by its absolute path).
std::filesystem::path source_root() {
  return std::filesystem::path(__FILE__).parent_path().parent_path();
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Settings, DefaultsWhenUnset) {
  const ScopedEnv a("TESSERA_SM90_WIDE", nullptr);
  const ScopedEnv b("TESSERA_PLAN_L2_MB", nullptr);
  const ScopedEnv c("TESSERA_DECODE_VARIANT", nullptr);
  const ScopedEnv d("TESSERA_BENCH_UPLOAD", nullptr);
  EXPECT_EQ(settings().sm90_wide, detail::WideTilesSetting::kLongKeys);
  EXPECT_EQ(settings().plan_section_bytes, int64_t{16} << 20);
  EXPECT_FALSE(settings().decode_variant.has_value());
  EXPECT_TRUE(settings().bench_upload);
}

TEST(Settings, ParsesEachType) {
  const ScopedEnv a("TESSERA_SM90_WIDE", "0");
  const ScopedEnv b("TESSERA_PLAN_L2_MB", "0");
  const ScopedEnv c("TESSERA_DECODE_VARIANT", "4");
  const ScopedEnv d("TESSERA_SM90_KV", "gather");
  const ScopedEnv e("TESSERA_BENCH_FLUSH", "read");
  const ScopedEnv f("TESSERA_DECODE_MIN_CHUNK", "256");
  EXPECT_EQ(settings().sm90_wide, detail::WideTilesSetting::kOff);
  EXPECT_EQ(settings().plan_section_bytes, 0);
  EXPECT_EQ(settings().decode_variant, 4);
  EXPECT_TRUE(settings().sm90_gather_kv);
  EXPECT_EQ(settings().bench_flush, detail::BenchFlush::kRead);
  EXPECT_EQ(settings().decode_min_chunk, 256);
}

TEST(Settings, MalformedValuesWarnAndKeepTheDefault) {
  const ScopedEnv a("TESSERA_SM90_WIDE", "sometimes");
  const ScopedEnv b("TESSERA_DECODE_VARIANT", "9");
  const ScopedEnv c("TESSERA_DECODE_MIN_CHUNK", "100");  // not a multiple of 64
  const ScopedEnv d("TESSERA_NUM_THREADS", "-3");
  testing::internal::CaptureStderr();
  detail::reload_settings();
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_EQ(settings().sm90_wide, detail::WideTilesSetting::kLongKeys);
  EXPECT_FALSE(settings().decode_variant.has_value());
  EXPECT_FALSE(settings().decode_min_chunk.has_value());
  EXPECT_EQ(settings().num_threads, 0);
  for (const char* name : {"TESSERA_SM90_WIDE='sometimes'", "TESSERA_DECODE_VARIANT='9'",
                           "TESSERA_DECODE_MIN_CHUNK='100'", "TESSERA_NUM_THREADS='-3'"}) {
    EXPECT_NE(warnings.find(name), std::string::npos) << name << " not in:\n" << warnings;
  }
}

TEST(Settings, SnapshotIsReadOnce) {
  const ScopedEnv a("TESSERA_PLAN_L2_MB", "8");
  const detail::Settings& before = settings();
  setenv("TESSERA_PLAN_L2_MB", "4", 1);  // not re-read until reload_settings()
  EXPECT_EQ(settings().plan_section_bytes, int64_t{8} << 20);
  EXPECT_EQ(&settings(), &before);
  detail::reload_settings();
  EXPECT_EQ(settings().plan_section_bytes, int64_t{4} << 20);
}

TEST(Settings, EveryVariableIsRegisteredOnce) {
  std::set<std::string> names;
  for (const detail::SettingDoc& doc : detail::setting_docs()) {
    EXPECT_TRUE(names.insert(doc.name).second) << doc.name << " registered twice";
    EXPECT_NE(std::string(doc.doc), "") << doc.name;
  }
  EXPECT_THROW(detail::environment_value("TESSERA_NOT_A_SETTING"), std::logic_error);
  EXPECT_NO_THROW(detail::environment_value("HOME"));
}

// The rule the registry exists for: no other file of the library reads the environment.
TEST(Settings, OnlyTheRegistryReadsTheEnvironment) {
  const std::filesystem::path src = source_root() / "src";
  ASSERT_TRUE(std::filesystem::exists(src)) << src;
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    const std::string ext = entry.path().extension().string();
    if (ext != ".cpp" && ext != ".hpp" && ext != ".cu" && ext != ".cuh" && ext != ".h") continue;
    ++files;
    if (entry.path() == src / "core" / "settings.cpp") continue;
    const std::string text = read_text(entry.path());
    // Plain search (std::regex trips GCC 12's -Wmaybe-uninitialized under ASan).
    EXPECT_EQ(text.find("getenv("), std::string::npos)
        << entry.path() << " reads the environment: use core/settings.hpp";
  }
  EXPECT_GT(files, 50);
}

// The README's user table and docs/DEVELOPING.md's developer table are the registry's, as
// `tessera settings --markdown user|developer` prints it (tools/settings-doc.py rewrites them).
void expect_generated_table(const std::filesystem::path& doc, const char* scope,
                            SettingScope which) {
  const std::string text = read_text(doc);
  const std::string begin = std::string("<!-- settings:") + scope + " -->\n";
  const size_t start = text.find(begin);
  ASSERT_NE(start, std::string::npos) << doc << " has no " << begin;
  const size_t end = text.find("<!-- /settings -->", start);
  ASSERT_NE(end, std::string::npos) << doc;
  const std::string table = text.substr(start + begin.size(), end - start - begin.size());
  EXPECT_EQ(table, detail::settings_markdown(which))
      << doc << " is out of date: run tools/settings-doc.py";
}

TEST(Settings, DocsShowTheRegistry) {
  expect_generated_table(source_root() / "README.md", "user", SettingScope::kUser);
  expect_generated_table(source_root() / "docs" / "DEVELOPING.md", "developer",
                         SettingScope::kDeveloper);
}

}  // namespace
}  // namespace tessera
