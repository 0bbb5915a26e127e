#include "core/tuning.hpp"

#include "core/settings.hpp"

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <system_error>
#include <vector>

namespace tessera::detail {
namespace {

constexpr std::string_view kVersionKeyword = "tessera-tune";
constexpr std::string_view kDecodeKeyword = "decode";

// One `key=value` field of an entry line; value without its quotes.
struct Field {
  std::string_view key;
  std::string_view value;
};

// Splits a line into whitespace-separated words, a double-quoted value being part of its word
// ('#' outside quotes ends the line). Returns false with *error set on an unterminated quote.
bool split_words(std::string_view line, std::vector<std::string_view>* words,
                 std::string* error) {
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    if (i >= line.size() || line[i] == '#') break;
    const size_t start = i;
    bool quoted = false;
    while (i < line.size() && (quoted || (line[i] != ' ' && line[i] != '\t' && line[i] != '\r' &&
                                          line[i] != '#'))) {
      if (line[i] == '"') quoted = !quoted;
      ++i;
    }
    if (quoted) {
      *error = "unterminated quote";
      return false;
    }
    words->push_back(line.substr(start, i - start));
  }
  return true;
}

bool parse_int(std::string_view text, int64_t* value) {
  if (text.empty()) return false;
  const auto [end, status] = std::from_chars(text.data(), text.data() + text.size(), *value);
  return status == std::errc() && end == text.data() + text.size();
}

// Parses the fields of a `decode` entry (words after the keyword). Returns false with *error.
bool parse_decode_entry(const std::vector<std::string_view>& words, DecodeTuningKey* key,
                        DecodeTuning* tuning, std::string* error) {
  constexpr std::string_view kFields[] = {"device", "head_dim", "group", "kv", "variant",
                                          "min_chunk"};
  bool seen[std::size(kFields)] = {};
  for (size_t w = 1; w < words.size(); ++w) {
    const std::string_view word = words[w];
    const size_t equals = word.find('=');
    if (equals == std::string_view::npos || equals == 0) {
      *error = "expected key=value, got '" + std::string(word) + "'";
      return false;
    }
    const Field field{word.substr(0, equals), word.substr(equals + 1)};
    size_t index = 0;
    while (index < std::size(kFields) && kFields[index] != field.key) ++index;
    if (index == std::size(kFields)) {
      *error = "unknown field '" + std::string(field.key) +
               "' (expected device, head_dim, group, kv, variant, min_chunk)";
      return false;
    }
    if (seen[index]) {
      *error = "field '" + std::string(field.key) + "' given twice";
      return false;
    }
    seen[index] = true;
    int64_t number = 0;
    const auto bad_value = [&](const char* expected) {
      *error = std::string(field.key) + ": expected " + expected + ", got '" +
               std::string(field.value) + "'";
      return false;
    };
    if (field.key == "device") {
      const std::string_view value = field.value;
      if (value.size() < 3 || value.front() != '"' || value.back() != '"' ||
          value.substr(1, value.size() - 2).find('"') != std::string_view::npos) {
        return bad_value("a non-empty name in double quotes");
      }
      key->device = std::string(value.substr(1, value.size() - 2));
    } else if (field.key == "head_dim") {
      if (!parse_int(field.value, &number) || (number != 64 && number != 128 && number != 256)) {
        return bad_value("64, 128 or 256");
      }
      key->head_dim = static_cast<int>(number);
    } else if (field.key == "group") {
      if (!parse_int(field.value, &number) || number < 1 || number > kMaxTunedGroupSize) {
        return bad_value("a GQA group size in [1, 256]");
      }
      key->group = static_cast<int>(number);
    } else if (field.key == "kv") {
      const std::optional<DType> dtype = parse_tuning_dtype(field.value);
      if (!dtype) return bad_value("bf16, fp16, fp8_e4m3 or fp8_e5m2");
      key->kv_dtype = *dtype;
    } else if (field.key == "variant") {
      if (!parse_int(field.value, &number) || !is_valid_decode_variant(number)) {
        return bad_value("a decode variant in [0, 5]");
      }
      tuning->variant = static_cast<int>(number);
    } else {  // min_chunk
      if (!parse_int(field.value, &number) || !is_valid_decode_min_kv_chunk(number)) {
        return bad_value("a multiple of 64 in [64, 4096]");
      }
      tuning->min_kv_chunk = static_cast<int32_t>(number);
    }
  }
  for (size_t index = 0; index < std::size(kFields); ++index) {
    if (!seen[index]) {
      *error = "missing field '" + std::string(kFields[index]) + "'";
      return false;
    }
  }
  return true;
}

std::mutex& override_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::optional<DecodeTuning>& override_slot() {
  static std::optional<DecodeTuning> slot;
  return slot;
}

}  // namespace

bool is_valid_decode_variant(int64_t variant) {
  return variant >= 0 && variant <= kMaxTunedDecodeVariant;
}

bool is_valid_decode_min_kv_chunk(int64_t chunk) {
  return chunk >= 64 && chunk <= 4096 && chunk % 64 == 0;
}

int tuning_head_dim_bucket(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0) return 0;
  if (head_dim <= 64) return 64;
  if (head_dim <= 128) return 128;
  if (head_dim <= 256) return 256;
  return 0;
}

const DecodeTuning* TuningTable::find_decode(const DecodeTuningQuery& query) const {
  const auto found = decode.find(query);
  return found != decode.end() ? &found->second : nullptr;
}

std::optional<DType> parse_tuning_dtype(std::string_view name) {
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16") return DType::kFloat16;
  if (name == "fp8_e4m3") return DType::kFloat8E4M3;
  if (name == "fp8_e5m2") return DType::kFloat8E5M2;
  return std::nullopt;
}

const char* tuning_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat8E4M3: return "fp8_e4m3";
    case DType::kFloat8E5M2: return "fp8_e5m2";
    default: return "unsupported";
  }
}

std::optional<TuningTable> parse_tuning_table(std::string_view text, const std::string& origin,
                                              std::string* error) {
  TuningTable table;
  bool have_version = false;
  int line_number = 0;
  size_t position = 0;
  while (position < text.size()) {
    size_t end = text.find('\n', position);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(position, end - position);
    position = end + 1;
    ++line_number;
    const auto fail = [&](const std::string& what) {
      *error = origin + ":" + std::to_string(line_number) + ": " + what;
      return std::nullopt;
    };
    std::vector<std::string_view> words;
    std::string problem;
    if (!split_words(line, &words, &problem)) return fail(problem);
    if (words.empty()) continue;
    if (!have_version) {
      int64_t version = 0;
      if (words[0] != kVersionKeyword || words.size() != 2 || !parse_int(words[1], &version)) {
        return fail("expected the version line 'tessera-tune " +
                    std::to_string(kTuningFileVersion) + "' first");
      }
      if (version != kTuningFileVersion) {
        return fail("version " + std::to_string(version) + " is not supported (this build reads " +
                    std::to_string(kTuningFileVersion) + ")");
      }
      have_version = true;
      continue;
    }
    if (words[0] != kDecodeKeyword) {
      return fail("expected an entry starting with 'decode', got '" + std::string(words[0]) +
                  "'");
    }
    DecodeTuningKey key;
    DecodeTuning tuning;
    if (!parse_decode_entry(words, &key, &tuning, &problem)) return fail(problem);
    table.decode.insert_or_assign(std::move(key), tuning);
  }
  if (!have_version) {
    *error = origin + (line_number == 0 ? ": empty file" : ":" + std::to_string(line_number)) +
             ": no version line 'tessera-tune " + std::to_string(kTuningFileVersion) + "'";
    return std::nullopt;
  }
  return table;
}

std::string format_tuning_table(const TuningTable& table, std::string_view comment) {
  std::ostringstream out;
  size_t position = 0;
  while (position < comment.size()) {
    size_t end = comment.find('\n', position);
    if (end == std::string_view::npos) end = comment.size();
    out << "# " << comment.substr(position, end - position) << "\n";
    position = end + 1;
  }
  out << kVersionKeyword << " " << kTuningFileVersion << "\n";
  for (const auto& [key, tuning] : table.decode) {
    out << kDecodeKeyword << " device=\"" << key.device << "\" head_dim=" << key.head_dim
        << " group=" << key.group << " kv=" << tuning_dtype_name(key.kv_dtype)
        << " variant=" << tuning.variant << " min_chunk=" << tuning.min_kv_chunk << "\n";
  }
  return out.str();
}

std::string default_tuning_file_path() {
  const Settings& s = settings();
  if (!s.tune_file.empty()) return s.tune_file;
  if (const std::string& cache = s.xdg_cache_home; !cache.empty()) {
    return (std::filesystem::path(cache) / "tessera" / "tune.txt").string();
  }
  if (const std::string& home = s.home; !home.empty()) {
    return (std::filesystem::path(home) / ".cache" / "tessera" / "tune.txt").string();
  }
  return {};
}

TuningFile read_tuning_file(const std::string& path) {
  TuningFile file;
  file.path = path;
  if (path.empty()) return file;  // kNoPath
  const auto unreadable = [&](const std::string& why) {
    file.status = TuningFileStatus::kMalformed;
    file.error = path + ": " + why;
    return file;
  };
  std::error_code code;
  const std::filesystem::file_status status = std::filesystem::status(path, code);
  if (status.type() == std::filesystem::file_type::not_found) {
    file.status = TuningFileStatus::kMissing;
    return file;
  }
  // Anything else that stops status() (a folder on the way that may not be searched) is not
  // "missing": the file may well be there.
  if (code) return unreadable("cannot be read (" + code.message() + ")");
  if (std::filesystem::is_directory(status)) return unreadable("is a folder, not a tuning file");
  errno = 0;
  std::ifstream stream(path, std::ios::binary);
  if (!stream.is_open()) {
    return unreadable(std::string("cannot be opened (") +
                      (errno != 0 ? std::strerror(errno) : "unknown error") + ")");
  }
  // (Not `text << stream.rdbuf()`: that sets failbit when it copies no character, so an
  // empty file read as "cannot be read".)
  const std::string text{std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
  if (stream.bad()) {
    return unreadable(std::string("cannot be read (") +
                      (errno != 0 ? std::strerror(errno) : "I/O error") + ")");
  }
  std::optional<TuningTable> table = parse_tuning_table(text, path, &file.error);
  if (!table) {
    file.status = TuningFileStatus::kMalformed;
    return file;
  }
  file.status = TuningFileStatus::kLoaded;
  file.table = std::move(*table);
  return file;
}

void write_tuning_file(const std::string& path, const TuningTable& table,
                       std::string_view comment) {
  const std::filesystem::path target(path);
  std::error_code code;
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), code);
  if (code) {
    throw Error(Error::Kind::kRuntime, "cannot create the folder of the tuning file " + path +
                                           ": " + code.message());
  }
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << format_tuning_table(table, comment);
    out.flush();
    if (!out) {
      throw Error(Error::Kind::kRuntime, "cannot write the tuning file " + temporary);
    }
  }
  std::filesystem::rename(temporary, target, code);
  if (code) {
    std::filesystem::remove(temporary, code);
    throw Error(Error::Kind::kRuntime,
                "cannot replace the tuning file " + path + ": " + code.message());
  }
}

std::string tuning_file_warning(const TuningFile& file, bool named) {
  constexpr std::string_view kFallback = " (the built-in decode defaults are used)\n";
  if (file.status == TuningFileStatus::kMalformed) {
    return "tessera: ignoring the tuning file: " + file.error + std::string(kFallback);
  }
  // The default location's absence is the normal state before `tessera tune`; a file named by
  // TESSERA_TUNE_FILE that is not there is probably a mistake, so it is said.
  if (file.status == TuningFileStatus::kMissing && named) {
    return "tessera: ignoring the tuning file: " + file.path +
           " (TESSERA_TUNE_FILE) does not exist" + std::string(kFallback);
  }
  return {};
}

const TuningFile& process_tuning_file() {
  // A function-local static: initialised once, by the first caller, even under concurrent
  // calls; immutable afterwards, so lookups take no lock.
  static const TuningFile file = [] {
    TuningFile loaded = read_tuning_file(default_tuning_file_path());
    const std::string warning = tuning_file_warning(loaded, !settings().tune_file.empty());
    if (!warning.empty()) std::cerr << warning;
    return loaded;
  }();
  return file;
}

void set_decode_tuning_override(std::optional<DecodeTuning> tuning) {
  std::lock_guard<std::mutex> lock(override_mutex());
  override_slot() = tuning;
}

std::optional<DecodeTuning> decode_tuning_override() {
  std::lock_guard<std::mutex> lock(override_mutex());
  return override_slot();
}

const char* tuning_source_name(TuningSource source) {
  switch (source) {
    case TuningSource::kDefault: return "default";
    case TuningSource::kEnvironment: return "environment";
    case TuningSource::kFile: return "tuning file";
    case TuningSource::kOverride: return "in-process override";
  }
  return "unknown";
}

ResolvedDecodeTuning resolve_decode_tuning(const std::optional<DecodeTuning>& override_tuning,
                                           std::optional<int> env_variant,
                                           std::optional<int32_t> env_min_kv_chunk,
                                           const DecodeTuning* file_entry,
                                           const DecodeTuning& defaults) {
  ResolvedDecodeTuning resolved;
  if (override_tuning) {
    resolved.value = *override_tuning;
    resolved.variant_source = resolved.min_kv_chunk_source = TuningSource::kOverride;
    return resolved;
  }
  if (env_variant) {
    resolved.value.variant = *env_variant;
    resolved.variant_source = TuningSource::kEnvironment;
  } else if (file_entry != nullptr) {
    resolved.value.variant = file_entry->variant;
    resolved.variant_source = TuningSource::kFile;
  } else {
    resolved.value.variant = defaults.variant;
    resolved.variant_source = TuningSource::kDefault;
  }
  if (env_min_kv_chunk) {
    resolved.value.min_kv_chunk = *env_min_kv_chunk;
    resolved.min_kv_chunk_source = TuningSource::kEnvironment;
  } else if (file_entry != nullptr) {
    resolved.value.min_kv_chunk = file_entry->min_kv_chunk;
    resolved.min_kv_chunk_source = TuningSource::kFile;
  } else {
    resolved.value.min_kv_chunk = defaults.min_kv_chunk;
    resolved.min_kv_chunk_source = TuningSource::kDefault;
  }
  return resolved;
}

ResolvedDecodeTuning resolve_decode_tuning(const DecodeTuningQuery& query,
                                           std::optional<int> env_variant,
                                           std::optional<int32_t> env_min_kv_chunk,
                                           const DecodeTuning& defaults) {
  std::optional<DecodeTuning> override_tuning = decode_tuning_override();
  if (override_tuning) {
    return resolve_decode_tuning(override_tuning, std::nullopt, std::nullopt, nullptr, defaults);
  }
  // Both environment values set: the file is not needed (and not read).
  const DecodeTuning* file_entry =
      env_variant && env_min_kv_chunk ? nullptr : process_tuning_file().table.find_decode(query);
  return resolve_decode_tuning(std::nullopt, env_variant, env_min_kv_chunk, file_entry, defaults);
}

bool is_heavy_decode_batch(int64_t batch, int num_kv_heads, int head_dim, int num_sms) {
  return tuning_head_dim_bucket(head_dim) == kHeavyBatchHeadDimBucket && batch > 0 &&
         num_kv_heads > 0 && num_sms > 0 &&
         batch * num_kv_heads >= int64_t{kHeavyBatchTilesPerSm} * num_sms;
}

ResolvedDecodeTuning apply_batch_rule(ResolvedDecodeTuning resolved, bool heavy_batch) {
  if (heavy_batch && resolved.variant_source == TuningSource::kDefault) {
    resolved.value.variant = kHeavyBatchDecodeVariant;
    resolved.heavy_batch = true;
  }
  return resolved;
}

}  // namespace tessera::detail
