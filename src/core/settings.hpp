// The settings registry: every environment variable Tessera reads, with its type, default and
// one-line doc, read once per process into one immutable snapshot. This file and settings.cpp
// are the only places that read the environment; everything else asks settings().
//
// User settings are documented in the README; developer settings (timing and test switches) in
// docs/DEVELOPING.md, whose table is generated from this registry (tests/test_settings.cpp
// checks that it is current; `tessera settings --markdown` prints it).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace tessera::detail {

enum class SettingScope {
  kUser,       // for users: README
  kDeveloper,  // for timing and tests: docs/DEVELOPING.md
  kExternal,   // another program's variable that Tessera reads (HOME, NCCL_NVLS_ENABLE)
};

struct SettingDoc {
  const char* name;
  const char* type;           // "bool", "int", "path", or the accepted words "a|b|c"
  const char* default_value;  // as the user would write it; "" for unset
  SettingScope scope;
  const char* doc;            // one line
};

// Every registered setting, in documentation order.
std::span<const SettingDoc> setting_docs();
const char* setting_scope_name(SettingScope scope);
// The registry as a markdown table of one scope (docs/DEVELOPING.md, README).
std::string settings_markdown(SettingScope scope);

// How the wide-tile sm90 kernels are chosen (TESSERA_SM90_WIDE).
enum class WideTilesSetting { kLongKeys, kOff, kAlways };
// How `tessera bench` evicts the L2 before each timed call (TESSERA_BENCH_FLUSH).
enum class BenchFlush { kWrite, kRead, kNone };

// The parsed values. A malformed value is reported once on stderr (naming the variable and what
// it accepts) and the default is used.
struct Settings {
  // ---- user ----
  bool check = false;                  // TESSERA_CHECK
  int num_threads = 0;                 // TESSERA_NUM_THREADS (0: the usable CPU count)
  std::string cpu_isa;                 // TESSERA_CPU_ISA ("": best supported)
  std::string tune_file;               // TESSERA_TUNE_FILE ("": the XDG / HOME default)
  std::string xdg_cache_home, home;    // XDG_CACHE_HOME, HOME (the tuning file's default)
  std::string nccl_library;            // TESSERA_NCCL_LIBRARY ("": libnccl.so.2)
  std::string backend;                 // TESSERA_BACKEND (the CLI's default --backend; "": auto)
  // ---- developer ----
  bool prefill_force_sm80 = false;     // TESSERA_PREFILL_KERNEL=sm80
  int prefill_variant = -1;            // TESSERA_PREFILL_VARIANT (-1: per-head_dim default)
  std::optional<int> decode_variant;   // TESSERA_DECODE_VARIANT
  std::optional<int32_t> decode_min_chunk;  // TESSERA_DECODE_MIN_CHUNK
  bool sm90_gather_kv = false;         // TESSERA_SM90_KV=gather
  WideTilesSetting sm90_wide = WideTilesSetting::kLongKeys;  // TESSERA_SM90_WIDE
  int64_t plan_section_bytes = int64_t{16} << 20;  // TESSERA_PLAN_L2_MB (0: plain LPT)
  // ---- devtools (tessera bench) ----
  bool bench_pages_ordered = false;    // TESSERA_BENCH_PAGES=ordered
  bool bench_upload = true;            // TESSERA_BENCH_UPLOAD
  std::string bench_seqs;              // TESSERA_BENCH_SEQS
  BenchFlush bench_flush = BenchFlush::kWrite;  // TESSERA_BENCH_FLUSH
};

// The process's settings: read on first use (thread-safe), then fixed.
const Settings& settings();
// Reads the environment again (tests that change a variable; not safe while other threads plan).
void reload_settings();

// The current value of a registered variable, read now (nullopt: unset). For the rare reader
// that must see a change the process itself made (NCCL_NVLS_ENABLE after setenv). Throws
// std::logic_error for a name not in the registry.
std::optional<std::string> environment_value(const char* name);

}  // namespace tessera::detail
