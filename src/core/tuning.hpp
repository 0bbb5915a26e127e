// Tuned kernel parameters per device and shape: the table that `tessera tune` measures and
// writes, the file it lives in, and the order in which the decode kernel's knobs are chosen.
// Host-only (no CUDA); the CUDA decode dispatch (src/cuda/sm80/decode.cu) reads it.
//
// Precedence, per knob (ResolvedDecodeTuning records which one won):
//   1. the in-process override (set_decode_tuning_override; `tessera tune` while it measures),
//   2. the environment (TESSERA_DECODE_VARIANT, TESSERA_DECODE_MIN_CHUNK),
//   3. the tuning file's entry for (device name, head_dim bucket, GQA group, K/V dtype),
//   4. the built-in defaults.
//
// File location: $TESSERA_TUNE_FILE if set, else $XDG_CACHE_HOME/tessera/tune.txt, else
// $HOME/.cache/tessera/tune.txt. Read once per process, on the first decode plan on a GPU.
//
// File format: UTF-8 text, one entry per line.
//   # comment                       '#' starts a comment (outside quotes); blank lines are skipped
//   tessera-tune 1                  version line: must be the first line that is not a comment
//   decode device="NVIDIA H200" head_dim=128 group=4 kv=bf16 variant=1 min_chunk=512
// Entry fields, all required, in any order, `key=value` without spaces around '=':
//   device     the CUDA device name as cudaGetDeviceProperties reports it, in double quotes
//   head_dim   kernel bucket 64, 128 or 256 (a head_dim of 96 uses the 128 entry)
//   group      GQA group size num_qo_heads / num_kv_heads, 1..256
//   kv         K/V cache dtype: bf16, fp16, fp8_e4m3 or fp8_e5m2
//   variant    decode kernel family 0..5, as TESSERA_DECODE_VARIANT (0: CUDA cores; 1: tensor
//              cores 4 warps x 3 stages; 2: 4 warps x 4 stages; 3: 2 warps x 6 stages; 4: 2 warps
//              x 3 stages; 5: 2 warps x 4 stages)
//   min_chunk  smallest split-KV piece in keys, a multiple of 64 in [64, 4096], as
//              TESSERA_DECODE_MIN_CHUNK
// A later entry for the same (device, head_dim, group, kv) replaces an earlier one.
//
// Faults (tests/test_faults.cpp): a file that cannot be used is never an error of a call; it is
// ignored as a whole, the built-in defaults serve every shape, and the process says so once on
// stderr ("tessera: ignoring the tuning file: <why> (the built-in decode defaults are used)"):
// any malformed line (file:line: problem; a wrong version, an unknown or missing field, garbage,
// a line cut short), an empty file, one that cannot be opened or read (permissions, a folder).
// No file at the default location is the normal state and is silent; a TESSERA_TUNE_FILE that
// does not exist is reported. A file cut short at the end of a line is a valid, shorter file.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "tessera/types.hpp"

namespace tessera::detail {

inline constexpr int kTuningFileVersion = 1;
inline constexpr int kMaxTunedDecodeVariant = 5;  // tuning.cpp names the range in its error
inline constexpr int kMaxTunedGroupSize = 256;

// The decode kernel's tunable knobs (the built-in defaults are in src/cuda/sm80/decode.cu).
struct DecodeTuning {
  int variant = 0;           // kernel family, as TESSERA_DECODE_VARIANT
  int32_t min_kv_chunk = 0;  // smallest split-KV piece in keys, as TESSERA_DECODE_MIN_CHUNK

  bool operator==(const DecodeTuning&) const = default;
};

bool is_valid_decode_variant(int64_t variant);      // 0..kMaxTunedDecodeVariant
bool is_valid_decode_min_kv_chunk(int64_t chunk);   // a multiple of 64 in [64, 4096]
// 64, 128 or 256 for a head_dim the decode kernels serve (a multiple of 8 up to 256), else 0.
int tuning_head_dim_bucket(int head_dim);

// What an entry is for. `device` is the CUDA device name (CudaDeviceInfo::name).
struct DecodeTuningKey {
  std::string device;
  int head_dim = 128;  // bucket: 64, 128 or 256
  int group = 1;       // num_qo_heads / num_kv_heads
  DType kv_dtype = DType::kBFloat16;
};

// A key whose device name is borrowed: lookups on the plan path build no std::string.
struct DecodeTuningQuery {
  std::string_view device;
  int head_dim = 128;
  int group = 1;
  DType kv_dtype = DType::kBFloat16;
};

struct DecodeTuningKeyLess {
  using is_transparent = void;
  static auto as_tuple(const DecodeTuningKey& key) {
    return std::tuple(std::string_view(key.device), key.head_dim, key.group,
                      static_cast<int>(key.kv_dtype));
  }
  static auto as_tuple(const DecodeTuningQuery& query) {
    return std::tuple(query.device, query.head_dim, query.group,
                      static_cast<int>(query.kv_dtype));
  }
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    return as_tuple(a) < as_tuple(b);
  }
};

struct TuningTable {
  std::map<DecodeTuningKey, DecodeTuning, DecodeTuningKeyLess> decode;

  // The entry for `query`, or nullptr.
  const DecodeTuning* find_decode(const DecodeTuningQuery& query) const;
  bool empty() const { return decode.empty(); }
};

// The dtype names of the file format (bf16, fp16, fp8_e4m3, fp8_e5m2); nullopt for any other.
std::optional<DType> parse_tuning_dtype(std::string_view name);
const char* tuning_dtype_name(DType dtype);

// Parses a whole file's text. On the first malformed line returns nullopt and sets *error to
// "origin:line: what is wrong".
std::optional<TuningTable> parse_tuning_table(std::string_view text, const std::string& origin,
                                              std::string* error);
// The file text of `table`: `comment` lines (each prefixed with "# "), the version line, then
// one line per entry in key order. parse_tuning_table(format_tuning_table(t)) == t.
std::string format_tuning_table(const TuningTable& table, std::string_view comment = {});

// ---- files ----

// kMalformed: a line does not parse, the file is empty, or it cannot be opened or read.
enum class TuningFileStatus { kNoPath, kMissing, kLoaded, kMalformed };

struct TuningFile {
  std::string path;  // empty: no location (none of the variables above is set)
  TuningFileStatus status = TuningFileStatus::kNoPath;
  TuningTable table;  // empty unless kLoaded
  std::string error;  // kMalformed: "path:line: what"; an unreadable file: why
};

// $TESSERA_TUNE_FILE, else $XDG_CACHE_HOME/tessera/tune.txt, else $HOME/.cache/tessera/tune.txt
// (read from the environment on every call); empty when none of them is set.
std::string default_tuning_file_path();
// Reads and parses `path`; a missing file is kMissing (not an error).
TuningFile read_tuning_file(const std::string& path);
// Writes `table` to `path` (creating its folder) through a temporary file renamed over it.
// Throws tessera::Error(kRuntime) naming the path when it cannot.
void write_tuning_file(const std::string& path, const TuningTable& table,
                       std::string_view comment = {});

// The process's tuning file: read from default_tuning_file_path() on the first call (thread
// safe), never again. A malformed or unreadable file is reported once to stderr and serves no
// entries.
const TuningFile& process_tuning_file();
// The line process_tuning_file() writes to stderr for `file` ("" for none: a file loaded, no
// location, no file at the default location); `named` is whether TESSERA_TUNE_FILE named it.
std::string tuning_file_warning(const TuningFile& file, bool named);

// ---- precedence ----

// In-process override of every decode knob for every shape (thread safe); nullopt clears it.
void set_decode_tuning_override(std::optional<DecodeTuning> tuning);
std::optional<DecodeTuning> decode_tuning_override();

enum class TuningSource { kDefault, kEnvironment, kFile, kOverride };
const char* tuning_source_name(TuningSource source);  // "default", "environment", ...

struct ResolvedDecodeTuning {
  DecodeTuning value;
  TuningSource variant_source = TuningSource::kDefault;
  TuningSource min_kv_chunk_source = TuningSource::kDefault;
  // The built-in default variant was replaced by kHeavyBatchDecodeVariant (apply_batch_rule).
  bool heavy_batch = false;
};

// The built-in default's batch rule, head_dim bucket 128 only. A batch with at least
// kHeavyBatchTilesPerSm (request, kv head) tiles per SM keeps every CTA busy without split-KV,
// and there the small-CTA variant 4 (2 warps x 3 stages, twice the CTAs per SM of variant 1)
// covers one CTA's per-item latency with others; on fewer tiles it loses. At d64 it loses on
// every batch and d256 is unmeasured, so both keep variant 1 (timings: docs/log/PERF.md,
// 2026-12-03). Only the built-in default follows the rule: a variant
// from the environment, a tuning file or an override is kept. Plans with a fixed capacity
// (CUDA graphs) never use it, so every plan of one capacity has the same worker count.
inline constexpr int kHeavyBatchDecodeVariant = 4;
inline constexpr int kHeavyBatchTilesPerSm = 2;
inline constexpr int kHeavyBatchHeadDimBucket = 128;
// head_dim in bucket 128 (tuning_head_dim_bucket) and batch x num_kv_heads >=
// kHeavyBatchTilesPerSm x num_sms (batch 0: unknown, never heavy).
bool is_heavy_decode_batch(int64_t batch, int num_kv_heads, int head_dim, int num_sms);
// `resolved` with the rule applied: the variant becomes kHeavyBatchDecodeVariant when
// `heavy_batch` and the variant is the built-in default; otherwise unchanged.
ResolvedDecodeTuning apply_batch_rule(ResolvedDecodeTuning resolved, bool heavy_batch);

// The knobs in force, per knob: override > environment > file entry > defaults. Pure.
ResolvedDecodeTuning resolve_decode_tuning(const std::optional<DecodeTuning>& override_tuning,
                                           std::optional<int> env_variant,
                                           std::optional<int32_t> env_min_kv_chunk,
                                           const DecodeTuning* file_entry,
                                           const DecodeTuning& defaults);
// The same with this process's override and tuning file (process_tuning_file()); the
// environment values are the caller's (decode.cu parses them once).
ResolvedDecodeTuning resolve_decode_tuning(const DecodeTuningQuery& query,
                                           std::optional<int> env_variant,
                                           std::optional<int32_t> env_min_kv_chunk,
                                           const DecodeTuning& defaults);

}  // namespace tessera::detail
