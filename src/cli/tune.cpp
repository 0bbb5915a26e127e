#include "cli/tune.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "cli/bench.hpp"
#include "core/settings.hpp"
#include "core/tuning.hpp"
#include "tessera/backend.hpp"
#include "tessera/version.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera::cli {
namespace {

// The grid tuned: GQA groups over kNumKvHeads kv heads (below), head_dims, K/V dtypes (q has
// the K/V dtype), kPageSize-token pages, one query token per request.
constexpr int kHeadDims[] = {128, 64};
constexpr int kGroups[] = {1, 4, 8};
constexpr DType kKvDtypes[] = {DType::kBFloat16, DType::kFloat16};

// One (head_dim, group, K/V dtype) of the grid and its label, "d128 group 4 bf16".
struct GridShape {
  int head_dim, group;
  DType kv_dtype;
  std::string label;
};

// The grid's shapes whose label holds `filter` as whole words ("group 1" is not "group 16");
// every shape when it is empty (or only spaces). Throws kInvalidArgument when none does.
std::vector<GridShape> select_shapes(std::string filter) {
  // Surrounding spaces are not part of a word ("d64 " is "d64").
  filter.erase(0, filter.find_first_not_of(' '));
  filter.erase(filter.find_last_not_of(' ') + 1);
  const auto words_match = [&](const std::string& label) {
    for (size_t at = label.find(filter); at != std::string::npos;
         at = label.find(filter, at + 1)) {
      const size_t end = at + filter.size();
      if ((at == 0 || label[at - 1] == ' ') && (end == label.size() || label[end] == ' ')) {
        return true;
      }
    }
    return false;
  };
  std::vector<GridShape> shapes;
  for (int head_dim : kHeadDims) {
    for (DType kv_dtype : kKvDtypes) {
      for (int group : kGroups) {
        // Appended piece by piece: g++ 12 -O3 warns (-Wrestrict, a false positive) on the chain
        // of operator+ here.
        std::string label = "d";
        label.append(std::to_string(head_dim)).append(" group ").append(std::to_string(group));
        label.append(" ").append(detail::tuning_dtype_name(kv_dtype));
        if (filter.empty() || words_match(label)) {
          shapes.push_back({head_dim, group, kv_dtype, std::move(label)});
        }
      }
    }
  }
  if (shapes.empty()) {
    throw Error(Error::Kind::kInvalidArgument,
                "--filter: no tuned shape matches '" + filter +
                    "' as whole words (labels look like \"d128 group 4 bf16\")");
  }
  return shapes;
}

}  // namespace

#if defined(TESSERA_HAVE_CUDA)
namespace {

using detail::DecodeTuning;
using detail::DecodeTuningKey;

constexpr int kNumKvHeads = 8;
constexpr int kPageSize = 16;

// The candidates: every kernel family x every minimum split chunk.
constexpr int kVariants[] = {0, 1, 2, 3, 4, 5};
constexpr int32_t kMinKvChunks[] = {128, 256, 512, 1024};

// Batch shapes a candidate is timed on: a tiny batch (split-KV and latency), one long request,
// and growing batches of mid-length requests.
struct TuneShape {
  int batch;
  int kv_len;
  const char* name;
};
constexpr TuneShape kShapes[] = {
    {1, 1024, "1x1k"}, {1, 32768, "1x32k"}, {16, 4096, "16x4k"}, {64, 4096, "64x4k"},
    {256, 4096, "256x4k"}};
constexpr size_t kNumShapes = std::size(kShapes);

const char* variant_text(int variant) {
  switch (variant) {
    case 0: return "CUDA cores";
    case 1: return "mma 4w x 3st";
    case 2: return "mma 4w x 4st";
    case 3: return "mma 2w x 6st";
    case 4: return "mma 2w x 3st";
    case 5: return "mma 2w x 4st";
    default: return "?";
  }
}

struct Candidate {
  DecodeTuning tuning;
  std::vector<double> tbps = std::vector<double>(kNumShapes, 0.0);  // per shape
  std::string failure;  // non-empty: wrong output or an error on some shape; never chosen
  double geomean = 0;
};

// One tuned (head_dim, group, K/V dtype): every candidate's rates and the one chosen.
struct TuneConfig {
  DecodeTuningKey key;
  std::vector<Candidate> candidates;
  int chosen = -1;
  // What decode used before tuning (environment, existing tuning file or built-in default),
  // and its index among the candidates (-1: none of them).
  detail::ResolvedDecodeTuning before;
  int before_index = -1;
};

// Clears the in-process override however the measurement ends.
struct OverrideScope {
  ~OverrideScope() { detail::set_decode_tuning_override(std::nullopt); }
};

BenchCase tune_case(int head_dim, int group, const TuneShape& shape) {
  BenchCase c;
  c.op = AttentionOp::kDecode;
  c.batch = shape.batch;
  c.q_len = 1;
  c.kv_len = shape.kv_len;
  c.num_kv_heads = kNumKvHeads;
  c.num_qo_heads = kNumKvHeads * group;
  c.head_dim = head_dim;
  c.page_size = kPageSize;
  c.name = "decode d" + std::to_string(head_dim) + " group " + std::to_string(group) + " " +
           shape.name;
  return c;
}

// Plans p again (under the override in force: worker count and minimum chunk follow the
// candidate), grows the workspace when needed and uploads the plan, as build_problem does.
void replan(BenchProblem& p) {
  const BenchCase& c = p.spec;
  p.plan = plan_decode(p.page_indptr, p.last_page_len, c.page_size, c.num_qo_heads,
                       c.num_kv_heads, c.head_dim, AttentionOptions{}, p.device, c.q_len);
  if (p.workspace.bytes() < p.plan.workspace_bytes) {
    p.workspace = Buffer(p.device, p.plan.workspace_bytes);
  }
  upload_plan(p.plan, Workspace{p.workspace.data(), p.workspace.bytes()});
}

double kv_bytes(const BenchCase& c, DType dtype) {
  return 2.0 * c.batch * static_cast<double>(c.kv_len) * c.num_kv_heads * c.head_dim *
         static_cast<double>(dtype_size(dtype));
}

// Runs and checks one candidate on a built problem; returns TB/s or sets *failure.
double measure(BenchProblem& p, const DecodeTuning& tuning,
               const std::vector<SampledReference>& references, int iterations,
               std::string* failure) {
  detail::set_decode_tuning_override(tuning);
  replan(p);
  p.o.poison();
  p.lse.poison();
  run_once(p);
  int nans = 0;
  double worst = 0;
  for (const SampledReference& reference : references) {
    worst = std::max(worst, sampled_error(p, reference, &nans));
  }
  if (nans > 0 || !(worst <= kMaxRelError)) {
    char text[96];
    std::snprintf(text, sizeof(text), "WRONG (max rel error %.3g, %d NaN)", worst, nans);
    *failure = text;
    return 0;
  }
  const double milliseconds = time_ms(p, iterations);
  return kv_bytes(p.spec, p.dtype) / (milliseconds * 1e-3) / 1e12;
}

TuneConfig tune_config(const std::string& device_name, int head_dim, int group, DType kv_dtype,
                       const TuneOptions& options, const std::string& progress_prefix) {
  TuneConfig config;
  config.key = DecodeTuningKey{device_name, head_dim, group, kv_dtype};
  config.before = detail::cuda_decode_selection(kNumKvHeads * group, kNumKvHeads, head_dim,
                                                kv_dtype, detail::cuda_device_info(0))
                      .tuning;
  for (int variant : kVariants) {
    for (int32_t chunk : kMinKvChunks) {
      Candidate candidate;
      candidate.tuning = DecodeTuning{variant, chunk};
      if (candidate.tuning == config.before.value) {
        config.before_index = static_cast<int>(config.candidates.size());
      }
      config.candidates.push_back(candidate);
    }
  }
  const OverrideScope clear_override;
  for (size_t s = 0; s < kNumShapes; ++s) {
    const TuneShape& shape = kShapes[s];
    if (options.progress) {
      std::cerr << progress_prefix << " " << shape.name << " ..." << std::endl;
    }
    // The inputs once per shape (the plan is redone per candidate); the reference rows once.
    BenchProblem p;
    p.spec = tune_case(head_dim, group, shape);
    p.device = Device{DeviceType::kCUDA, 0};
    p.dtype = kv_dtype;
    build_problem(p, 7000 + 100 * s + static_cast<uint64_t>(group));
    std::mt19937_64 rng(4321 + s);
    std::vector<SampledReference> references;
    references.push_back(sampled_reference(p, 0, rng));
    if (shape.batch > 1) references.push_back(sampled_reference(p, shape.batch - 1, rng));
    for (Candidate& candidate : config.candidates) {
      if (!candidate.failure.empty()) continue;  // already out
      try {
        candidate.tbps[s] =
            measure(p, candidate.tuning, references, options.iterations, &candidate.failure);
      } catch (const std::exception& error) {
        candidate.failure = std::string("error: ") + error.what();
      }
      if (!candidate.failure.empty()) {
        candidate.failure = std::string(shape.name) + ": " + candidate.failure;
      }
    }
  }
  double best = 0;
  for (size_t i = 0; i < config.candidates.size(); ++i) {
    Candidate& candidate = config.candidates[i];
    if (!candidate.failure.empty()) continue;
    double log_sum = 0;
    for (double rate : candidate.tbps) log_sum += std::log(rate);
    candidate.geomean = std::exp(log_sum / static_cast<double>(kNumShapes));
    if (candidate.geomean > best) {
      best = candidate.geomean;
      config.chosen = static_cast<int>(i);
    }
  }
  return config;
}

void print_config(const TuneConfig& config) {
  const DecodeTuningKey& key = config.key;
  std::printf("\ndecode d%d, group %d (%d/%d heads), %s K/V, page %d on %s: TB/s of K+V read\n",
              key.head_dim, key.group, key.group * kNumKvHeads, kNumKvHeads,
              detail::tuning_dtype_name(key.kv_dtype), kPageSize, key.device.c_str());
  std::printf("%-26s", "candidate");
  for (const TuneShape& shape : kShapes) std::printf(" %8s", shape.name);
  std::printf(" %8s\n", "geomean");
  for (size_t i = 0; i < config.candidates.size(); ++i) {
    const Candidate& c = config.candidates[i];
    char name[64];
    std::snprintf(name, sizeof(name), "v%d %s, chunk %d", c.tuning.variant,
                  variant_text(c.tuning.variant), c.tuning.min_kv_chunk);
    std::printf("%-26s", name);
    for (double rate : c.tbps) {
      if (rate > 0) {
        std::printf(" %8.3f", rate);
      } else {
        std::printf(" %8s", "-");
      }
    }
    if (c.failure.empty()) {
      std::printf(" %8.3f", c.geomean);
    } else {
      std::printf(" %8s", "-");
    }
    if (static_cast<int>(i) == config.chosen) std::printf("  <- chosen");
    if (static_cast<int>(i) == config.before_index) {
      const detail::ResolvedDecodeTuning& before = config.before;
      if (before.variant_source == before.min_kv_chunk_source) {
        std::printf("  (before tuning: %s)", detail::tuning_source_name(before.variant_source));
      } else {
        std::printf("  (before tuning: variant from %s, chunk from %s)",
                    detail::tuning_source_name(before.variant_source),
                    detail::tuning_source_name(before.min_kv_chunk_source));
      }
    }
    if (!c.failure.empty()) std::printf("  %s", c.failure.c_str());
    std::printf("\n");
  }
  if (config.chosen < 0) {
    std::printf("no correct candidate: no entry\n");
    return;
  }
  const Candidate& chosen = config.candidates[config.chosen];
  std::printf("chosen: variant %d, min_chunk %d, geomean %.3f TB/s", chosen.tuning.variant,
              chosen.tuning.min_kv_chunk, chosen.geomean);
  if (config.before_index >= 0 && config.candidates[config.before_index].failure.empty()) {
    std::printf(" (%+.1f%% over the choice before tuning)",
                100.0 * (chosen.geomean / config.candidates[config.before_index].geomean - 1.0));
  }
  std::printf("\n");
}

void warn_about_environment() {
  const detail::Settings& settings = detail::settings();
  const auto note = [](const char* name, int value) {
    std::cerr << "tessera tune: note: " << name << "=" << value
              << " is set; tune measures every candidate regardless, but at run time the "
                 "variable overrides the tuning file\n";
  };
  if (settings.decode_variant) note("TESSERA_DECODE_VARIANT", *settings.decode_variant);
  if (settings.decode_min_chunk) note("TESSERA_DECODE_MIN_CHUNK", *settings.decode_min_chunk);
}

}  // namespace
#endif  // TESSERA_HAVE_CUDA

int run_tune(const TuneOptions& options) {
  (void)select_shapes(options.filter);  // a bad --filter is reported with or without a GPU
#if !defined(TESSERA_HAVE_CUDA)
  std::cerr << "tessera tune: tune needs a CUDA device; none visible (this build of tessera has "
               "no CUDA backend)\n";
  return 1;
#else
  if (!cuda_available()) {
    std::cerr << "tessera tune: tune needs a CUDA device; none visible\n";
    return 1;
  }
  if (options.iterations < 1) {
    throw Error(Error::Kind::kInvalidArgument,
                "--iterations: expected at least 1, got " + std::to_string(options.iterations));
  }
  const std::string path =
      options.out_path.empty() ? detail::default_tuning_file_path() : options.out_path;
  if (!options.dry_run && path.empty()) {
    throw Error(Error::Kind::kInvalidArgument,
                "no place for the tuning file: pass --out FILE or set TESSERA_TUNE_FILE, "
                "XDG_CACHE_HOME or HOME (or --dry-run)");
  }
  warn_about_environment();
  const Device device{DeviceType::kCUDA, 0};
  const std::string device_name = detail::cuda_device_info(device.index).name;
  std::cout << "tessera tune: " << describe_device(device) << "\n"
            << "decode, " << kNumKvHeads << " kv heads, page " << kPageSize << ", "
            << options.iterations << " timed runs per point (median, L2 flushed); each "
            << "candidate checked against the reference; chosen: best geometric mean of TB/s\n";

  const std::vector<GridShape> shapes = select_shapes(options.filter);
  std::vector<TuneConfig> configs;
  for (const GridShape& shape : shapes) {
    const std::string prefix = "[" + std::to_string(configs.size() + 1) + "/" +
                               std::to_string(shapes.size()) + "] " + shape.label;
    configs.push_back(
        tune_config(device_name, shape.head_dim, shape.group, shape.kv_dtype, options, prefix));
    print_config(configs.back());
    std::fflush(stdout);
  }

  int failures = 0;
  detail::TuningTable tuned;
  for (const TuneConfig& config : configs) {
    if (config.chosen < 0) {
      ++failures;
      continue;
    }
    tuned.decode[config.key] = config.candidates[config.chosen].tuning;
  }
  std::printf("\n%zu entries tuned for %s%s\n", tuned.decode.size(), device_name.c_str(),
              failures ? (", " + std::to_string(failures) + " shape(s) without one").c_str()
                       : "");
  if (options.dry_run) {
    std::printf("--dry-run: nothing written; the entries would be:\n%s",
                detail::format_tuning_table(tuned).c_str());
    return failures ? 1 : 0;
  }
  // Keep the file's entries for other devices and shapes; replace the ones tuned now.
  const detail::TuningFile existing = detail::read_tuning_file(path);
  detail::TuningTable table;
  if (existing.status == detail::TuningFileStatus::kLoaded) {
    table = existing.table;
  } else if (existing.status == detail::TuningFileStatus::kMalformed) {
    std::cerr << "tessera tune: replacing the unreadable tuning file (" << existing.error
              << ")\n";
  }
  for (const auto& [key, tuning] : tuned.decode) table.decode.insert_or_assign(key, tuning);
  const std::string comment =
      std::string("Written by tessera tune ") + version_string() + " (decode kernel family and " +
      "minimum split-KV chunk per device and shape).\nEdit or delete freely; format: "
      "src/core/tuning.hpp. Read once per process; TESSERA_TUNE_FILE picks another file.";
  detail::write_tuning_file(path, table, comment);
  std::printf("wrote %zu entries (%zu in all) to %s\n", tuned.decode.size(), table.decode.size(),
              path.c_str());
  return failures ? 1 : 0;
#endif
}

}  // namespace tessera::cli
