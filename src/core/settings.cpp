#include "core/settings.hpp"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace tessera::detail {
namespace {

constexpr SettingDoc kSettings[] = {
    // ---- user ----
    {"TESSERA_BACKEND", "auto|cpu|cpu-reference|cuda", "auto", SettingScope::kUser,
     "the `tessera` command's default --backend"},
    {"TESSERA_NUM_THREADS", "int", "", SettingScope::kUser,
     "threads of the CPU backend (default: the CPUs this process may use)"},
    {"TESSERA_CPU_ISA", "generic|avx2|avx512", "", SettingScope::kUser,
     "caps the CPU kernels' instruction set (default: the best the CPU has)"},
    {"TESSERA_CHECK", "bool", "0", SettingScope::kUser,
     "checked mode: before every run, validate device-resident index arrays and reject NaN / "
     "inf in the q, k, v elements it reads and NaN / +inf sinks (synchronises)"},
    {"TESSERA_TUNE_FILE", "path", "", SettingScope::kUser,
     "the decode tuning file (default: $XDG_CACHE_HOME/tessera/tune.txt, else "
     "~/.cache/tessera/tune.txt)"},
    {"TESSERA_NCCL_LIBRARY", "path", "libnccl.so.2", SettingScope::kUser,
     "the NCCL library context parallelism loads"},
    {"TESSERA_LIBRARY", "path", "", SettingScope::kUser,
     "Python package: the libtessera.so to load (default: the one installed with it)"},
    {"TESSERA_FASTCALL", "0|path", "", SettingScope::kUser,
     "Python package: 0 turns the C fast path of run() off; a path loads that _fastcall.abi3.so"},
    // ---- developer ----
    {"TESSERA_PREFILL_KERNEL", "auto|sm80", "auto", SettingScope::kDeveloper,
     "sm80: plan prefill on the portable mma.sync kernels on Hopper too (side-by-side timing)"},
    {"TESSERA_PREFILL_VARIANT", "0|1|2", "", SettingScope::kDeveloper,
     "tile variant of the sm80 prefill kernels (default: each head_dim's measured best)"},
    {"TESSERA_DECODE_VARIANT", "0..5", "", SettingScope::kDeveloper,
     "decode kernel variant; overrides the tuning file (0: CUDA cores, 1..5: mma.sync shapes)"},
    {"TESSERA_DECODE_MIN_CHUNK", "int", "", SettingScope::kDeveloper,
     "shortest split-KV decode piece in keys (multiple of 64, 64..4096); overrides the tuning "
     "file"},
    {"TESSERA_SM90_KV", "auto|gather", "auto", SettingScope::kDeveloper,
     "gather: the sm90 producer copies every K/V tile with cp.async instead of TMA (tests the "
     "fallback)"},
    {"TESSERA_SM90_WIDE", "auto|0|1", "auto", SettingScope::kDeveloper,
     "wide-tile sm90 kernels (d128 176 keys, d64 192 keys): auto = long ragged non-causal "
     "requests, 0 = never, 1 = whenever the mask allows"},
    {"TESSERA_PLAN_L2_MB", "int", "16", SettingScope::kDeveloper,
     "size of the planner's L2 sections of K/V in MiB (0: plain longest-first scheduling)"},
    {"TESSERA_BENCH_PAGES", "shuffled|ordered", "shuffled", SettingScope::kDeveloper,
     "page order of the bench's paged caches"},
    {"TESSERA_BENCH_UPLOAD", "bool", "1", SettingScope::kDeveloper,
     "0: the bench times run()'s own plan upload too"},
    {"TESSERA_BENCH_SEQS", "int,int,...", "", SettingScope::kDeveloper,
     "replaces the sequence lengths of the bench's prefill grid"},
    {"TESSERA_BENCH_FLUSH", "write|read|none", "write", SettingScope::kDeveloper,
     "how timed loops evict the L2 before each call (write leaves it dirty, read clean)"},
    // ---- read from other programs' variables ----
    {"XDG_CACHE_HOME", "path", "", SettingScope::kExternal, "the tuning file's default folder"},
    {"HOME", "path", "", SettingScope::kExternal, "the tuning file's last-resort folder"},
    {"NCCL_NVLS_ENABLE", "bool", "0", SettingScope::kExternal,
     "set to 0 before NCCL loads unless already set (NVLink multicast off)"},
};

bool registered(std::string_view name) {
  return std::any_of(std::begin(kSettings), std::end(kSettings),
                     [&](const SettingDoc& doc) { return name == doc.name; });
}

std::optional<std::string> read(const char* name) {
  const char* value = std::getenv(name);  // the only getenv in the library
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

void warn(const char* name, const std::string& value, const char* expected) {
  std::cerr << "tessera: ignoring " << name << "='" << value << "': expected " << expected
            << "\n";
}

std::optional<int64_t> parse_int(const std::string& text) {
  int64_t value = 0;
  const auto [end, status] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (status != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// An integer in [low, high], else the default (with a warning when set but malformed).
template <class T>
std::optional<T> read_int(const char* name, int64_t low, int64_t high, const char* expected) {
  const auto text = read(name);
  if (!text || text->empty()) return std::nullopt;
  const auto value = parse_int(*text);
  if (!value || *value < low || *value > high) {
    warn(name, *text, expected);
    return std::nullopt;
  }
  return static_cast<T>(*value);
}

// One of `words` (index returned), else nullopt (with a warning when set but not a word).
std::optional<size_t> read_word(const char* name, std::initializer_list<const char*> words) {
  const auto text = read(name);
  if (!text || text->empty()) return std::nullopt;
  size_t index = 0;
  std::string expected;
  for (const char* word : words) {
    if (*text == word) return index;
    if (index > 0) expected.push_back('|');
    expected.append(word);
    ++index;
  }
  warn(name, *text, expected.c_str());
  return std::nullopt;
}

bool read_bool(const char* name, bool fallback) {
  const auto word = read_word(name, {"0", "1"});
  return word ? *word == 1 : fallback;
}

Settings parse() {
  Settings s;
  s.check = read_bool("TESSERA_CHECK", false);
  s.num_threads = read_int<int>("TESSERA_NUM_THREADS", 1, 4096, "an integer in 1..4096").value_or(0);
  if (const auto isa = read_word("TESSERA_CPU_ISA", {"generic", "avx2", "avx512"})) {
    s.cpu_isa = *isa == 0 ? "generic" : (*isa == 1 ? "avx2" : "avx512");
  }
  s.tune_file = read("TESSERA_TUNE_FILE").value_or("");
  s.xdg_cache_home = read("XDG_CACHE_HOME").value_or("");
  s.home = read("HOME").value_or("");
  s.nccl_library = read("TESSERA_NCCL_LIBRARY").value_or("");
  s.backend = read("TESSERA_BACKEND").value_or("");  // the CLI checks the word (and says so)

  s.prefill_force_sm80 = read_word("TESSERA_PREFILL_KERNEL", {"auto", "sm80"}).value_or(0) == 1;
  s.prefill_variant = read_int<int>("TESSERA_PREFILL_VARIANT", 0, 2, "0, 1 or 2").value_or(-1);
  s.decode_variant = read_int<int>("TESSERA_DECODE_VARIANT", 0, 5, "a variant in 0..5");
  if (const auto chunk = read_int<int32_t>("TESSERA_DECODE_MIN_CHUNK", 64, 4096,
                                           "a multiple of 64 in 64..4096")) {
    if (*chunk % 64 == 0) {
      s.decode_min_chunk = chunk;
    } else {
      warn("TESSERA_DECODE_MIN_CHUNK", std::to_string(*chunk), "a multiple of 64 in 64..4096");
    }
  }
  s.sm90_gather_kv = read_word("TESSERA_SM90_KV", {"auto", "gather"}).value_or(0) == 1;
  switch (read_word("TESSERA_SM90_WIDE", {"auto", "0", "1"}).value_or(0)) {
    case 1: s.sm90_wide = WideTilesSetting::kOff; break;
    case 2: s.sm90_wide = WideTilesSetting::kAlways; break;
    default: s.sm90_wide = WideTilesSetting::kLongKeys; break;
  }
  if (const auto mib = read_int<int64_t>("TESSERA_PLAN_L2_MB", 0, int64_t{1} << 20,
                                         "MiB in 0..1048576")) {
    s.plan_section_bytes = *mib << 20;
  }

  s.bench_pages_ordered =
      read_word("TESSERA_BENCH_PAGES", {"shuffled", "ordered"}).value_or(0) == 1;
  s.bench_upload = read_bool("TESSERA_BENCH_UPLOAD", true);
  s.bench_seqs = read("TESSERA_BENCH_SEQS").value_or("");
  s.bench_flush =
      static_cast<BenchFlush>(read_word("TESSERA_BENCH_FLUSH", {"write", "read", "none"})
                                  .value_or(0));
  return s;
}

// Snapshots are immutable and kept until the process ends (in g_snapshots, so they stay
// reachable for LeakSanitizer), so a reference handed out stays valid after a reload (tests).
std::atomic<const Settings*> g_settings{nullptr};
std::mutex g_settings_mutex;

const Settings* keep(Settings fresh) {
  static std::vector<std::unique_ptr<Settings>>* snapshots =
      new std::vector<std::unique_ptr<Settings>>();  // never destroyed: no exit-time order
  snapshots->push_back(std::make_unique<Settings>(std::move(fresh)));
  return snapshots->back().get();
}

}  // namespace

std::span<const SettingDoc> setting_docs() { return kSettings; }

const char* setting_scope_name(SettingScope scope) {
  switch (scope) {
    case SettingScope::kUser: return "user";
    case SettingScope::kDeveloper: return "developer";
    case SettingScope::kExternal: return "external";
  }
  return "?";
}

std::string settings_markdown(SettingScope scope) {
  std::string out = "| variable | values | default | what it does |\n|---|---|---|---|\n";
  for (const SettingDoc& doc : kSettings) {
    if (doc.scope != scope) continue;
    std::string type = doc.type;
    std::replace(type.begin(), type.end(), '|', '/');  // keep the table's columns
    const auto quoted = [](const char* text) {
      return std::string("`").append(text).append("`");
    };
    const std::string cells[] = {quoted(doc.name), type,
                                 *doc.default_value ? quoted(doc.default_value) : "unset",
                                 doc.doc};
    for (const std::string& cell : cells) out.append("| ").append(cell).append(" ");
    out.append("|\n");
  }
  return out;
}

const Settings& settings() {
  if (const Settings* current = g_settings.load(std::memory_order_acquire)) return *current;
  std::lock_guard<std::mutex> lock(g_settings_mutex);
  if (const Settings* current = g_settings.load(std::memory_order_acquire)) return *current;
  const Settings* fresh = keep(parse());
  g_settings.store(fresh, std::memory_order_release);
  return *fresh;
}

void reload_settings() {
  std::lock_guard<std::mutex> lock(g_settings_mutex);
  g_settings.store(keep(parse()), std::memory_order_release);
}

std::optional<std::string> environment_value(const char* name) {
  if (!registered(name)) {
    throw std::logic_error(std::string("environment_value: ") + name +
                           " is not in the settings registry (core/settings.cpp)");
  }
  return read(name);
}

}  // namespace tessera::detail
