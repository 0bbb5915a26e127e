// Faults on the CPU (issue 38 item 4; docs/RELIABILITY.md, "Faults"): a missing, empty,
// truncated, garbage, wrong-version, wrong-field, unreadable tuning file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/capi_fixture.hpp"
#include "common/scoped_env.hpp"
#include "core/dispatch.hpp"
#include "core/tuning.hpp"
#include "core/validate.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using test::ScopedEnv;
using test::capi::HostTensor;
using test::capi::int_tensor;
using test::capi::kF32;

// ---------------------------------------------------------------- tuning file

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("tessera_test_faults_" + std::to_string(::getpid()) + "_" + name);
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

const std::string kGoodEntry =
    "decode device=\"NVIDIA H200\" head_dim=128 group=4 kv=bf16 variant=3 min_chunk=256\n";

// Every file that cannot be used is kMalformed with "path[:line]: why", serves no entry, and
// gets the same one-line warning naming the fallback; only an absent file at the default
// location is silent.
TEST(FaultsTuningFile, EveryUnusableFileIsReportedTheSameWay) {
  struct Case {
    const char* name;
    std::string bytes;
    std::string expected;  // what the error says after the path (it may go on)
  };
  const Case cases[] = {
      {"empty", "", ": empty file: no version line 'tessera-tune 1'"},
      {"comments only", "# written by hand\n\n", ":2: no version line 'tessera-tune 1'"},
      {"truncated version line", "tessera-tu", ":1: expected the version line 'tessera-tune 1'"},
      {"truncated entry", "tessera-tune 1\n" + kGoodEntry + "decode device=\"NVIDIA H200\" hea",
       ":3: expected key=value, got 'hea'"},
      {"truncated in a quote", "tessera-tune 1\ndecode device=\"NVIDIA H2",
       ":2: unterminated quote"},
      {"truncated value", "tessera-tune 1\ndecode device=\"D\" head_dim=12",
       ":2: head_dim: expected 64, 128 or 256, got '12'"},
      {"binary garbage", std::string("\x7f" "ELF\x02\x01\x01\0\0\0\xff\xfe\n", 14),
       ":1: expected the version line 'tessera-tune 1' first"},
      {"wrong version", "tessera-tune 7\n" + kGoodEntry,
       ":1: version 7 is not supported (this build reads 1)"},
      {"unknown field", "tessera-tune 1\n" + kGoodEntry.substr(0, kGoodEntry.size() - 1) +
                            " speed=9\n",
       ":2: unknown field 'speed'"},
      {"missing field", "tessera-tune 1\ndecode device=\"D\" head_dim=128 group=4 kv=bf16\n",
       ":2: missing field 'variant'"},
      {"wrong value", "tessera-tune 1\ndecode device=\"D\" head_dim=128 group=4 kv=int8 "
                      "variant=1 min_chunk=512\n",
       ":2: kv: expected bf16, fp16, fp8_e4m3 or fp8_e5m2, got 'int8'"},
      {"wrong keyword", "tessera-tune 1\nprefill device=\"D\"\n",
       ":2: expected an entry starting with 'decode', got 'prefill'"},
  };
  const std::filesystem::path path = temp_path("case.txt");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    write_bytes(path, c.bytes);
    const detail::TuningFile file = detail::read_tuning_file(path.string());
    EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
    EXPECT_TRUE(file.table.empty());
    EXPECT_EQ(file.error.rfind(path.string() + c.expected, 0), 0u)
        << file.error << "\ndoes not start with\n" << path.string() + c.expected;
    const std::string warning = detail::tuning_file_warning(file, /*named=*/false);
    EXPECT_EQ(warning, "tessera: ignoring the tuning file: " + file.error +
                           " (the built-in decode defaults are used)\n");
    EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/true), warning);
  }
  // The same entry in a whole file loads (so the cases above fail for their fault alone).
  write_bytes(path, "tessera-tune 1\n" + kGoodEntry);
  const detail::TuningFile good = detail::read_tuning_file(path.string());
  ASSERT_EQ(good.status, detail::TuningFileStatus::kLoaded) << good.error;
  EXPECT_EQ(good.table.decode.size(), 1u);
  EXPECT_EQ(detail::tuning_file_warning(good, true), "");
  std::filesystem::remove(path);
}

TEST(FaultsTuningFile, MissingFolderAndUnreadableFiles) {
  const std::filesystem::path missing = temp_path("missing.txt");
  std::filesystem::remove(missing);
  detail::TuningFile file = detail::read_tuning_file(missing.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMissing);
  EXPECT_EQ(file.error, "");
  EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/false), "");  // the default location
  EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/true),
            "tessera: ignoring the tuning file: " + missing.string() +
                " (TESSERA_TUNE_FILE) does not exist (the built-in decode defaults are used)\n");

  const std::filesystem::path folder = temp_path("folder");
  std::filesystem::create_directories(folder);
  file = detail::read_tuning_file(folder.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, folder.string() + ": is a folder, not a tuning file");

  if (::geteuid() == 0) {
    std::filesystem::remove_all(folder);
    GTEST_SKIP() << "running as root: permissions do not stop root from reading a file, so the "
                    "unreadable-file cases cannot be made here";
  }
  const std::filesystem::path locked = folder / "tune.txt";
  write_bytes(locked, "tessera-tune 1\n" + kGoodEntry);
  ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, locked.string() + ": cannot be opened (Permission denied)");
  EXPECT_TRUE(file.table.empty());
  ASSERT_EQ(::chmod(locked.c_str(), 0600), 0);
  // A folder on the way that may not be searched: the file may be there, so not "missing".
  ASSERT_EQ(::chmod(folder.c_str(), 0), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, locked.string() + ": cannot be read (Permission denied)");
  ASSERT_EQ(::chmod(folder.c_str(), 0700), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kLoaded) << file.error;
  std::filesystem::remove_all(folder);
}

// The only test of this binary that loads the process-wide file: TESSERA_TUNE_FILE names a
// file cut short mid-entry. One warning on stderr, however often it is asked for; every decode
// knob then comes from the built-in defaults; attention keeps working.
TEST(FaultsTuningFile, ProcessFileThatIsCutShortFallsBackWithOneWarning) {
  const std::filesystem::path path = temp_path("process.txt");
  write_bytes(path, "tessera-tune 1\n" + kGoodEntry + "decode device=\"NVIDIA H200\" head_di");
  ScopedEnv tune("TESSERA_TUNE_FILE", path.c_str());
  ::testing::internal::CaptureStderr();
  const detail::TuningFile& file = detail::process_tuning_file();
  (void)detail::process_tuning_file();
  const detail::DecodeTuning defaults{1, 512};
  const detail::ResolvedDecodeTuning resolved = detail::resolve_decode_tuning(
      {"NVIDIA H200", 128, 4, DType::kBFloat16}, std::nullopt, std::nullopt, defaults);
  const std::string stderr_text = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(file.path, path.string()) << "the process file was loaded before this test";
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(stderr_text, "tessera: ignoring the tuning file: " + path.string() +
                             ":3: expected key=value, got 'head_di' (the built-in decode "
                             "defaults are used)\n");
  // The entry on line 2 is well-formed but the file is ignored as a whole.
  EXPECT_EQ(resolved.value, defaults);
  EXPECT_EQ(resolved.variant_source, detail::TuningSource::kDefault);
  HostTensor q({1, 2, 8}, kF32), k({2, 1, 8}, kF32), v({2, 1, 8}, kF32), o({1, 2, 8}, kF32);
  q.fill_pattern(1);
  k.fill_pattern(2);
  v.fill(-0.25f);
  HostTensor qo = int_tensor({0, 1}), kv = int_tensor({0, 2});
  ASSERT_NO_THROW(ragged_prefill(q.view(), k.view(), v.view(), qo.view(), kv.view(), o.view()));
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_NEAR(o.get(i), -0.25f, 1e-6f) << i;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tessera
