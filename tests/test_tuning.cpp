// The tuning table (src/core/tuning.hpp) on the CPU: file round trip, malformed files reported
// with file:line, a missing file, the file location variables, and the precedence override >
// environment > tuning file > defaults, including the process-wide lazily loaded file.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "common/scoped_env.hpp"
#include "core/tuning.hpp"

namespace tessera::detail {
namespace {

constexpr DecodeTuning kDefaults{1, 512};

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("tessera_test_tuning_" + std::to_string(::getpid()) + "_" + name);
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

using test::ScopedEnv;

TuningTable sample_table() {
  TuningTable table;
  table.decode[{"NVIDIA H200", 128, 4, DType::kBFloat16}] = {3, 256};
  table.decode[{"NVIDIA H200", 128, 4, DType::kFloat16}] = {2, 1024};
  table.decode[{"NVIDIA H200", 64, 1, DType::kBFloat16}] = {0, 128};
  table.decode[{"NVIDIA A100-SXM4-80GB", 256, 8, DType::kFloat8E4M3}] = {1, 4096};
  return table;
}

std::string parse_error_of(const std::string& text) {
  std::string error;
  const std::optional<TuningTable> table = parse_tuning_table(text, "tune.txt", &error);
  EXPECT_FALSE(table.has_value()) << "parsed although malformed:\n" << text;
  return error;
}

TEST(Tuning, FormatThenParseGivesTheSameTable) {
  const TuningTable table = sample_table();
  const std::string text = format_tuning_table(table, "written by a test\nsecond line");
  EXPECT_EQ(text.rfind("# written by a test\n# second line\ntessera-tune 1\n", 0), 0u) << text;
  std::string error;
  const std::optional<TuningTable> parsed = parse_tuning_table(text, "memory", &error);
  ASSERT_TRUE(parsed.has_value()) << error;
  ASSERT_EQ(parsed->decode.size(), table.decode.size());
  for (const auto& [key, tuning] : table.decode) {
    const DecodeTuning* found =
        parsed->find_decode({key.device, key.head_dim, key.group, key.kv_dtype});
    ASSERT_NE(found, nullptr) << key.device << " d" << key.head_dim << " g" << key.group;
    EXPECT_EQ(*found, tuning);
  }
  EXPECT_EQ(parsed->find_decode({"NVIDIA H200", 128, 8, DType::kBFloat16}), nullptr);
  EXPECT_EQ(parsed->find_decode({"NVIDIA H20", 128, 4, DType::kBFloat16}), nullptr);
}

TEST(Tuning, WriteThenReadAFile) {
  const std::filesystem::path folder = temp_path("dir");
  std::filesystem::remove_all(folder);
  const std::string path = (folder / "nested" / "tune.txt").string();
  write_tuning_file(path, sample_table(), "round trip");
  const TuningFile file = read_tuning_file(path);
  ASSERT_EQ(file.status, TuningFileStatus::kLoaded) << file.error;
  EXPECT_EQ(file.table.decode.size(), sample_table().decode.size());
  const DecodeTuning* entry = file.table.find_decode({"NVIDIA H200", 128, 4, DType::kFloat16});
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(*entry, (DecodeTuning{2, 1024}));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove_all(folder);
}

TEST(Tuning, CommentsBlankLinesFieldOrderAndLaterEntriesWin) {
  const std::string text =
      "# a comment\n"
      "\n"
      "   tessera-tune 1   # version\n"
      "decode min_chunk=256 variant=2 kv=fp16 group=8 head_dim=64 device=\"GPU #1 x\"\n"
      "\t# indented comment\r\n"
      "decode device=\"GPU #1 x\" head_dim=64 group=8 kv=fp16 variant=3 min_chunk=768 # later\r\n";
  std::string error;
  const std::optional<TuningTable> table = parse_tuning_table(text, "t", &error);
  ASSERT_TRUE(table.has_value()) << error;
  ASSERT_EQ(table->decode.size(), 1u);
  const DecodeTuning* entry = table->find_decode({"GPU #1 x", 64, 8, DType::kFloat16});
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(*entry, (DecodeTuning{3, 768}));
}

TEST(Tuning, MalformedLinesAreReportedWithFileAndLine) {
  const std::string version = "tessera-tune 1\n";
  const std::string good =
      "decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=1 min_chunk=512\n";
  EXPECT_NE(parse_error_of("decode device=\"D\" head_dim=128\n").find("tune.txt:1:"),
            std::string::npos);
  EXPECT_NE(parse_error_of("tessera-tune 2\n").find("version 2"), std::string::npos);
  EXPECT_NE(parse_error_of("# only a comment\n").find("no version line"), std::string::npos);
  struct Case {
    std::string line;
    std::string expected;
  };
  const Case cases[] = {
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=1", "missing field 'min_chunk'"},
      {"decode device=\"D\" head_dim=96 group=4 kv=bf16 variant=1 min_chunk=512", "head_dim"},
      {"decode device=\"D\" head_dim=128 group=0 kv=bf16 variant=1 min_chunk=512", "group"},
      {"decode device=\"D\" head_dim=128 group=4 kv=fp32 variant=1 min_chunk=512", "kv"},
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=6 min_chunk=512", "variant"},
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=1 min_chunk=500", "min_chunk"},
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=1 min_chunk=8192", "min_chunk"},
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=x1 min_chunk=512", "variant"},
      {"decode device=D head_dim=128 group=4 kv=bf16 variant=1 min_chunk=512", "double quotes"},
      {"decode device=\"D head_dim=128 group=4 kv=bf16 variant=1 min_chunk=512", "quote"},
      {"decode device=\"D\" head_dim=128 group=4 kv=bf16 variant=1 min_chunk=512 speed=3",
       "unknown field 'speed'"},
      {"decode device=\"D\" head_dim=128 group=4 group=4 kv=bf16 variant=1 min_chunk=512",
       "given twice"},
      {"decode device=\"D\" head_dim 128 group=4 kv=bf16 variant=1 min_chunk=512",
       "key=value"},
      {"prefill device=\"D\" head_dim=128", "'decode'"},
  };
  for (const Case& c : cases) {
    const std::string error = parse_error_of(version + good + c.line + "\n" + good);
    EXPECT_NE(error.find("tune.txt:3: "), std::string::npos) << c.line << " -> " << error;
    EXPECT_NE(error.find(c.expected), std::string::npos) << c.line << " -> " << error;
  }
}

TEST(Tuning, MissingAndMalformedFiles) {
  const std::string missing = temp_path("missing.txt").string();
  std::filesystem::remove(missing);
  EXPECT_EQ(read_tuning_file(missing).status, TuningFileStatus::kMissing);
  EXPECT_EQ(read_tuning_file("").status, TuningFileStatus::kNoPath);

  const std::filesystem::path bad = temp_path("bad.txt");
  write_text(bad, "tessera-tune 1\ndecode device=\"D\" head_dim=128 group=4\n");
  const TuningFile file = read_tuning_file(bad.string());
  EXPECT_EQ(file.status, TuningFileStatus::kMalformed);
  EXPECT_TRUE(file.table.empty());  // ignored as a whole
  EXPECT_NE(file.error.find(bad.string() + ":2: "), std::string::npos) << file.error;
  std::filesystem::remove(bad);
}

TEST(Tuning, FileLocationFromTheEnvironment) {
  {
    ScopedEnv tune("TESSERA_TUNE_FILE", "/somewhere/mine.txt");
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(default_tuning_file_path(), "/somewhere/mine.txt");
  }
  {
    ScopedEnv tune("TESSERA_TUNE_FILE", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    ScopedEnv home("HOME", "/home/me");
    EXPECT_EQ(default_tuning_file_path(), "/xdg/tessera/tune.txt");
  }
  {
    ScopedEnv tune("TESSERA_TUNE_FILE", "");
    ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    ScopedEnv home("HOME", "/home/me");
    EXPECT_EQ(default_tuning_file_path(), "/home/me/.cache/tessera/tune.txt");
  }
  {
    ScopedEnv tune("TESSERA_TUNE_FILE", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    ScopedEnv home("HOME", nullptr);
    EXPECT_EQ(default_tuning_file_path(), "");
  }
}

TEST(Tuning, PrecedenceOverrideThenEnvironmentThenFileThenDefaults) {
  const DecodeTuning file{3, 256};
  const DecodeTuning override_tuning{0, 1024};

  ResolvedDecodeTuning r = resolve_decode_tuning(std::nullopt, std::nullopt, std::nullopt,
                                                 nullptr, kDefaults);
  EXPECT_EQ(r.value, kDefaults);
  EXPECT_EQ(r.variant_source, TuningSource::kDefault);
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kDefault);

  r = resolve_decode_tuning(std::nullopt, std::nullopt, std::nullopt, &file, kDefaults);
  EXPECT_EQ(r.value, file);
  EXPECT_EQ(r.variant_source, TuningSource::kFile);
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kFile);

  // The environment wins per knob: one variable set, the other knob still from the file.
  r = resolve_decode_tuning(std::nullopt, 2, std::nullopt, &file, kDefaults);
  EXPECT_EQ(r.value, (DecodeTuning{2, 256}));
  EXPECT_EQ(r.variant_source, TuningSource::kEnvironment);
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kFile);
  r = resolve_decode_tuning(std::nullopt, std::nullopt, 640, nullptr, kDefaults);
  EXPECT_EQ(r.value, (DecodeTuning{1, 640}));
  EXPECT_EQ(r.variant_source, TuningSource::kDefault);
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kEnvironment);

  // The override wins over everything.
  r = resolve_decode_tuning(override_tuning, 2, 640, &file, kDefaults);
  EXPECT_EQ(r.value, override_tuning);
  EXPECT_EQ(r.variant_source, TuningSource::kOverride);
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kOverride);
}

// The only test that touches the process-wide file: it points TESSERA_TUNE_FILE at a file
// before the first (lazy) load, then resolves through the override, the environment values
// and the file.
TEST(Tuning, ProcessFileIsLoadedOnceAndUsedBelowOverrideAndEnvironment) {
  const std::filesystem::path path = temp_path("process.txt");
  TuningTable table;
  table.decode[{"Test GPU", 128, 4, DType::kBFloat16}] = {3, 256};
  write_tuning_file(path.string(), table);
  ScopedEnv tune("TESSERA_TUNE_FILE", path.c_str());

  const DecodeTuningQuery tuned{"Test GPU", 128, 4, DType::kBFloat16};
  const DecodeTuningQuery untuned{"Test GPU", 128, 8, DType::kBFloat16};
  ResolvedDecodeTuning r = resolve_decode_tuning(tuned, std::nullopt, std::nullopt, kDefaults);
  ASSERT_EQ(process_tuning_file().status, TuningFileStatus::kLoaded) << process_tuning_file().error;
  EXPECT_EQ(process_tuning_file().path, path.string());
  EXPECT_EQ(r.value, (DecodeTuning{3, 256}));
  EXPECT_EQ(r.variant_source, TuningSource::kFile);
  r = resolve_decode_tuning(untuned, std::nullopt, std::nullopt, kDefaults);
  EXPECT_EQ(r.value, kDefaults);
  EXPECT_EQ(r.variant_source, TuningSource::kDefault);
  r = resolve_decode_tuning(tuned, 1, std::nullopt, kDefaults);
  EXPECT_EQ(r.value, (DecodeTuning{1, 256}));

  set_decode_tuning_override(DecodeTuning{2, 2048});
  r = resolve_decode_tuning(tuned, 1, 640, kDefaults);
  EXPECT_EQ(r.value, (DecodeTuning{2, 2048}));
  EXPECT_EQ(r.min_kv_chunk_source, TuningSource::kOverride);
  ASSERT_TRUE(decode_tuning_override().has_value());
  set_decode_tuning_override(std::nullopt);
  EXPECT_FALSE(decode_tuning_override().has_value());

  // Loaded once: rewriting or removing the file changes nothing in this process.
  std::filesystem::remove(path);
  r = resolve_decode_tuning(tuned, std::nullopt, std::nullopt, kDefaults);
  EXPECT_EQ(r.value, (DecodeTuning{3, 256}));
}

TEST(Tuning, HeadDimBucketsAndValidKnobs) {
  EXPECT_EQ(tuning_head_dim_bucket(64), 64);
  EXPECT_EQ(tuning_head_dim_bucket(96), 128);
  EXPECT_EQ(tuning_head_dim_bucket(256), 256);
  EXPECT_EQ(tuning_head_dim_bucket(100), 0);
  EXPECT_EQ(tuning_head_dim_bucket(512), 0);
  EXPECT_TRUE(is_valid_decode_variant(0));
  EXPECT_TRUE(is_valid_decode_variant(5));
  EXPECT_FALSE(is_valid_decode_variant(6));
  EXPECT_TRUE(is_valid_decode_min_kv_chunk(4096));
  EXPECT_FALSE(is_valid_decode_min_kv_chunk(0));
  EXPECT_FALSE(is_valid_decode_min_kv_chunk(4160));
}

TEST(Tuning, HeavyBatchRuleReplacesOnlyTheBuiltInDefaultVariant) {
  // 132 SMs x 2 tiles per SM = 264 (request, kv head) tiles: 33 requests of 8 kv heads.
  EXPECT_FALSE(is_heavy_decode_batch(32, 8, 128, 132));
  EXPECT_TRUE(is_heavy_decode_batch(33, 8, 128, 132));
  EXPECT_TRUE(is_heavy_decode_batch(256, 8, 128, 132));
  EXPECT_TRUE(is_heavy_decode_batch(256, 8, 96, 132));   // bucket 128
  EXPECT_FALSE(is_heavy_decode_batch(256, 8, 64, 132));  // measured slower at d64
  EXPECT_FALSE(is_heavy_decode_batch(256, 8, 256, 132)); // not measured
  EXPECT_FALSE(is_heavy_decode_batch(0, 8, 128, 132));  // unknown batch (fixed capacity)
  EXPECT_FALSE(is_heavy_decode_batch(1000, 0, 128, 132));
  EXPECT_FALSE(is_heavy_decode_batch(1000, 8, 128, 0));

  const ResolvedDecodeTuning by_default =
      resolve_decode_tuning(std::nullopt, std::nullopt, std::nullopt, nullptr, kDefaults);
  ResolvedDecodeTuning r = apply_batch_rule(by_default, true);
  EXPECT_EQ(r.value.variant, kHeavyBatchDecodeVariant);
  EXPECT_EQ(r.value.min_kv_chunk, kDefaults.min_kv_chunk);
  EXPECT_TRUE(r.heavy_batch);
  r = apply_batch_rule(by_default, false);
  EXPECT_EQ(r.value, kDefaults);
  EXPECT_FALSE(r.heavy_batch);

  // A variant from the file, the environment or an override is kept for any batch.
  const DecodeTuning file{3, 256};
  for (const ResolvedDecodeTuning& chosen :
       {resolve_decode_tuning(std::nullopt, std::nullopt, std::nullopt, &file, kDefaults),
        resolve_decode_tuning(std::nullopt, 2, std::nullopt, nullptr, kDefaults),
        resolve_decode_tuning(DecodeTuning{5, 512}, std::nullopt, std::nullopt, nullptr,
                              kDefaults)}) {
    r = apply_batch_rule(chosen, true);
    EXPECT_EQ(r.value, chosen.value);
    EXPECT_FALSE(r.heavy_batch);
  }
  // The default variant with a chunk from the environment still follows the rule.
  r = apply_batch_rule(resolve_decode_tuning(std::nullopt, std::nullopt, 640, nullptr, kDefaults),
                       true);
  EXPECT_EQ(r.value, (DecodeTuning{kHeavyBatchDecodeVariant, 640}));
}

}  // namespace
}  // namespace tessera::detail
