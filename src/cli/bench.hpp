// `tessera bench`: the standard suite of prefill, paged prefill and decode shapes for the device
// found (GPU when present, else CPU), timed, checked against the reference on a sample, and
// printed as a table (and optionally JSON).
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cli/buffers.hpp"
#include "cpu/reference.hpp"
#include "devtools/timing.hpp"
#include "tessera/attention.hpp"
#include "tessera/cascade.hpp"
#include "tessera/mla.hpp"
#include "tessera/types.hpp"

namespace tessera::cli {

struct BenchCase {
  std::string name;
  AttentionOp op = AttentionOp::kRaggedPrefill;
  int batch = 1;
  int q_len = 0;   // per request (decode: query tokens per request)
  int kv_len = 0;  // per request
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 0;  // paged ops
  bool causal = false;
  // Skewed and mixed batches: requests 0 .. first_count - 1 have these lengths instead (0: the
  // same as the others).
  int first_q_len = 0;
  int first_kv_len = 0;
  int first_count = 1;
  // Runs with index checking on (set_index_checking): the cost of checked mode.
  bool checked = false;
  // Times a CUDA graph replay of the call (captured once on a stream) instead of the call:
  // the per-call latency a graph-captured serving step sees (GPU only).
  bool graph = false;
  // Launches with programmatic dependent launch (RunOptions::enable_pdl; GPU only).
  bool pdl = false;
  // Decode with a shared prefix: the first shared_prefix keys (whole pages) of every request
  // are the same pages of the cache. cascade: run it as cascade attention (the prefix as level
  // 0, read once for the batch) instead of plain decode over each request's full page list.
  int shared_prefix = 0;
  bool cascade = false;
  // Prefill with a custom mask (RunOptions::custom_mask; CPU backend only): every request's
  // (query row, key) plane cut into mask_block x mask_block blocks, each visible with
  // probability mask_density (0: no mask). FLOPs count the visible pairs only.
  int mask_block = 0;
  double mask_density = 0.5;
  // MLA (include/tessera/mla.hpp; CPU backend only): head_dim is kv_lora_rank, rope_dim the
  // rotary part, one latent head; q and the cache are combined [.., head_dim + rope_dim] buffers
  // read through q_nope / q_pe and ckv / kpe views, o is [.., head_dim].
  bool mla = false;
  int rope_dim = 0;

  int qk_dim() const { return head_dim + rope_dim; }  // q / key width (head_dim unless MLA)

  int q_len_of(int b) const { return b < first_count && first_q_len > 0 ? first_q_len : q_len; }
  int kv_len_of(int b) const { return b < first_count && first_kv_len > 0 ? first_kv_len : kv_len; }
  int num_first() const { return std::clamp(first_count, 0, batch); }
};

struct BenchOptions {
  std::string backend = "auto";    // auto | cpu | cpu-reference | cuda
  std::string suite = "standard";  // quick | standard | serving | plan | overhead | roofline
  std::string filter;              // substring of the case name; empty: all
  std::string json_path;
  DType dtype = DType::kBFloat16;
  int iterations = 0;  // 0: automatic
  bool check = true;
  bool progress = true;
};

struct BenchResult {
  BenchCase bench_case;
  double milliseconds = 0;  // median of the timed runs
  double min_milliseconds = 0, max_milliseconds = 0;
  int runs = 0;
  double flops = 0;  // FA convention: 4 * visible (row, key) pairs * head_dim * heads
  double bytes = 0;  // K + V bytes read (decode)
  double rate = 0;   // TFLOP/s (prefill) or TB/s (decode)
  double percent_of_peak = -1;
  double max_rel_error = -1;  // sampled rows vs the reference; -1: not checked
  int nan_count = 0;
  std::string status = "ok";

  // (max - min) / median of the timed runs (0 for fewer than two).
  double spread() const {
    return runs > 1 && milliseconds > 0 ? (max_milliseconds - min_milliseconds) / milliseconds : 0;
  }
};

// auto: TESSERA_BACKEND (settings().backend) if set, else the GPU when one is visible, else the
// CPU. `reference` (optional) is set when the double-precision oracle was asked for
// (cpu-reference).
Device resolve_backend(const std::string& backend, bool* reference = nullptr);
std::vector<BenchCase> bench_suite(const std::string& suite, Device device);
int run_bench(const BenchOptions& options);

// ---- the pieces of a bench case, shared with `tessera tune` ----

// Relative L2 error above which a sampled check fails (bf16/fp16 operands).
inline constexpr double kMaxRelError = 1e-2;

// One case's inputs and outputs on the device, its plan and its workspace.
struct BenchProblem {
  BenchCase spec;
  Device device;
  DType dtype;
  std::vector<int32_t> qo_indptr, kv_indptr, page_indptr, page_indices, last_page_len;
  Buffer q, k, v, o, lse, qo_indptr_buf, kv_indptr_buf, page_indptr_buf, page_indices_buf,
      last_page_len_buf, workspace;
  int64_t total_q = 0, total_kv = 0, num_pages = 0;
  TensorView q_view, k_view, v_view, o_view, lse_view, qo_view, kv_view;
  PagedKVCache paged;
  Plan plan;
  // Cascade cases: the plan, each level's host arrays, device buffers and views.
  CascadePlan cascade;
  std::vector<std::vector<int32_t>> level_arrays;  // per level: qo, page indptr, indices, last
  std::vector<Buffer> level_buffers;
  std::vector<CascadeLevel> levels;
  // Custom-mask cases: the packed bits (host memory, as the CPU backend reads them), each
  // request's byte offset, their views, and the (row, key) pairs the mask and causal leave.
  std::vector<uint8_t> mask_bytes;
  std::vector<int32_t> mask_offsets;
  TensorView mask_view, mask_indptr_view;
  double masked_pairs = -1;  // -1: no mask
  // MLA cases: the plan, the q_pe view (q_view is q_nope) and the latent cache's views.
  MlaPlan mla_plan;
  TensorView q_pe_view;
  MlaPagedCache mla_cache;

  bool is_paged() const { return spec.op != AttentionOp::kRaggedPrefill; }
};

// Allocates and fills p's buffers for p.spec / p.device / p.dtype (random values from `seed`,
// pages shuffled), plans it and uploads the plan (GPU).
void build_problem(BenchProblem& p, uint64_t seed);
// One call of the case's run_* (stream: a cudaStream_t, nullptr the default stream).
void run_once(BenchProblem& p, void* stream = nullptr);

// The double-precision oracle's o / lse for sampled (token, head) rows of request `request`,
// from its q and K/V copied to the host; independent of the output, so computed once and
// compared with many runs.
struct SampledReference {
  int request = 0;
  std::vector<detail::ReferenceRow> rows;
  std::vector<double> o, lse;  // rows x head_dim, rows
};
SampledReference sampled_reference(const BenchProblem& p, int request, std::mt19937_64& rng);
// Largest relative L2 error of p's current output against `reference` (a wrong lse counts as
// 1, NaN as infinity); adds the NaNs in all of the request's output rows to *nan_count.
double sampled_error(const BenchProblem& p, const SampledReference& reference, int* nan_count);
// Both of the above for request b.
double check_request(const BenchProblem& p, int b, std::mt19937_64& rng, int* nan_count);

// Median, min and max milliseconds of `iterations` calls (0: automatic), as bench times them: on
// the CPU a steady clock around each call (devtools::time_host_ms), on a GPU CUDA events around
// each call after an L2 flush (devtools::cuda_time_ms), or a graph replay for graph cases.
devtools::TimingStats time_stats(BenchProblem& p, int iterations);
// The median of time_stats.
double time_ms(BenchProblem& p, int iterations);

}  // namespace tessera::cli
