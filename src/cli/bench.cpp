#include "cli/bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>

#include "cli/buffers.hpp"
#include "core/half.hpp"
#include "core/planner.hpp"
#include "core/tuning.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/reference.hpp"
#include "tessera/backend.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera::cli {
namespace {

// Query tokens and heads sampled per checked request.
constexpr int kSampledTokens = 6;
constexpr int kSampledHeads = 3;

std::string format_double(double value, int precision) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", precision, value);
  return text;
}

// ---- problem construction ----

Buffer int_buffer(Device device, const std::vector<int32_t>& values) {
  Buffer buffer(device, std::max<size_t>(values.size(), 1) * sizeof(int32_t));
  if (!values.empty()) buffer.copy_from_host(values.data(), values.size() * sizeof(int32_t));
  return buffer;
}

TensorView int_view(const Buffer& buffer, size_t count, Device device) {
  return make_view(buffer.data(), DType::kInt32, {static_cast<int64_t>(count)}, device);
}

}  // namespace

void build_problem(BenchProblem& p, uint64_t seed) {
  const BenchCase& c = p.spec;
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  p.qo_indptr.assign(1, 0);
  p.kv_indptr.assign(1, 0);
  p.page_indptr.assign(1, 0);
  for (int b = 0; b < c.batch; ++b) {
    p.qo_indptr.push_back(p.qo_indptr.back() + c.q_len_of(b));
    p.kv_indptr.push_back(p.kv_indptr.back() + c.kv_len_of(b));
    if (p.is_paged()) {
      const int pages = (c.kv_len_of(b) + c.page_size - 1) / c.page_size;
      p.page_indptr.push_back(p.page_indptr.back() + pages);
      p.last_page_len.push_back(c.kv_len_of(b) - (pages - 1) * c.page_size);
    }
  }
  p.total_q = p.qo_indptr.back();
  p.total_kv = p.kv_indptr.back();
  const int64_t row = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  if (p.is_paged()) {
    p.num_pages = p.page_indptr.back();
    // Pages in a shuffled order, as a serving engine's allocator hands them out
    // (TESSERA_BENCH_PAGES=ordered keeps them in order, to tell the cost of scattered pages
    // from that of small ones).
    p.page_indices.resize(p.num_pages);
    std::iota(p.page_indices.begin(), p.page_indices.end(), 0);
    static const bool ordered = [] {
      const char* pages = std::getenv("TESSERA_BENCH_PAGES");
      return pages != nullptr && std::string(pages) == "ordered";
    }();
    std::mt19937_64 rng(seed);
    if (!ordered) std::shuffle(p.page_indices.begin(), p.page_indices.end(), rng);
    const size_t cache_bytes = p.num_pages * c.page_size * row * elem;
    p.k = Buffer(p.device, cache_bytes);
    p.v = Buffer(p.device, cache_bytes);
  } else {
    p.k = Buffer(p.device, p.total_kv * row * elem);
    p.v = Buffer(p.device, p.total_kv * row * elem);
  }
  const int64_t q_elems = p.total_q * c.num_qo_heads * c.head_dim;
  p.q = Buffer(p.device, q_elems * elem);
  p.o = Buffer(p.device, q_elems * elem);
  p.lse = Buffer(p.device, p.total_q * c.num_qo_heads * sizeof(float));
  p.q.fill_random(p.dtype, seed + 1);
  p.k.fill_random(p.dtype, seed + 2);
  p.v.fill_random(p.dtype, seed + 3);
  p.qo_indptr_buf = int_buffer(p.device, p.qo_indptr);
  p.kv_indptr_buf = int_buffer(p.device, p.kv_indptr);

  p.q_view = make_view(p.q.data(), p.dtype, {p.total_q, c.num_qo_heads, c.head_dim}, p.device);
  p.o_view = make_view(p.o.data(), p.dtype, {p.total_q, c.num_qo_heads, c.head_dim}, p.device);
  p.lse_view = make_view(p.lse.data(), DType::kFloat32, {p.total_q, c.num_qo_heads}, p.device);
  p.qo_view = int_view(p.qo_indptr_buf, p.qo_indptr.size(), p.device);
  AttentionOptions options;
  options.causal = c.causal;
  if (p.is_paged()) {
    p.page_indptr_buf = int_buffer(p.device, p.page_indptr);
    p.page_indices_buf = int_buffer(p.device, p.page_indices);
    p.last_page_len_buf = int_buffer(p.device, p.last_page_len);
    const std::initializer_list<int64_t> shape = {p.num_pages, c.page_size, c.num_kv_heads,
                                                  c.head_dim};
    p.paged.k_cache = make_view(p.k.data(), p.dtype, shape, p.device);
    p.paged.v_cache = make_view(p.v.data(), p.dtype, shape, p.device);
    p.paged.layout = KVLayout::kNHD;
    p.paged.page_indptr = int_view(p.page_indptr_buf, p.page_indptr.size(), p.device);
    p.paged.page_indices = int_view(p.page_indices_buf, p.page_indices.size(), p.device);
    p.paged.last_page_len = int_view(p.last_page_len_buf, p.last_page_len.size(), p.device);
    if (c.op == AttentionOp::kDecode) {
      p.plan = plan_decode(p.page_indptr, p.last_page_len, c.page_size, c.num_qo_heads,
                           c.num_kv_heads, c.head_dim, options, p.device, c.q_len);
    } else {
      p.plan = plan_paged_prefill(p.qo_indptr, p.page_indptr, p.last_page_len, c.page_size,
                                  c.num_qo_heads, c.num_kv_heads, c.head_dim, options, p.device);
    }
  } else {
    p.k_view = make_view(p.k.data(), p.dtype, {p.total_kv, c.num_kv_heads, c.head_dim}, p.device);
    p.v_view = make_view(p.v.data(), p.dtype, {p.total_kv, c.num_kv_heads, c.head_dim}, p.device);
    p.kv_view = int_view(p.kv_indptr_buf, p.kv_indptr.size(), p.device);
    p.plan = plan_ragged_prefill(p.qo_indptr, p.kv_indptr, c.num_qo_heads, c.num_kv_heads,
                                 c.head_dim, options, p.device);
  }
  p.workspace = Buffer(p.device, p.plan.workspace_bytes);
  // A serving engine plans once per step and runs the plan in every layer: the plan's lists are
  // uploaded here, outside the timed call (TESSERA_BENCH_UPLOAD=0 times run()'s own upload).
  const char* upload = std::getenv("TESSERA_BENCH_UPLOAD");
  if (p.device.type == DeviceType::kCUDA && (upload == nullptr || std::string(upload) != "0")) {
    upload_plan(p.plan, Workspace{p.workspace.data(), p.workspace.bytes()});
  }
}

void run_once(BenchProblem& p, void* stream) {
  const Workspace workspace{p.workspace.data(), p.workspace.bytes()};
  // Checked cases time the index validation with the call (restored afterwards).
  struct CheckingScope {
    bool saved = index_checking();
    explicit CheckingScope(bool on) { set_index_checking(on || saved); }
    ~CheckingScope() { set_index_checking(saved); }
  } checking(p.spec.checked);
  switch (p.spec.op) {
    case AttentionOp::kRaggedPrefill:
      run_ragged_prefill(p.plan, p.q_view, p.k_view, p.v_view, p.qo_view, p.kv_view, p.o_view,
                         p.lse_view, workspace, stream);
      break;
    case AttentionOp::kPagedPrefill:
      run_paged_prefill(p.plan, p.q_view, p.paged, p.qo_view, p.o_view, p.lse_view, workspace,
                        stream);
      break;
    case AttentionOp::kDecode:
      run_decode(p.plan, p.q_view, p.paged, p.o_view, p.lse_view, workspace, stream);
      break;
  }
}

// ---- sampled correctness check ----

SampledReference sampled_reference(const BenchProblem& p, int b, std::mt19937_64& rng) {
  const BenchCase& c = p.spec;
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t q_row = static_cast<int64_t>(c.num_qo_heads) * c.head_dim;
  const int64_t kv_row = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const int64_t q_begin = p.qo_indptr[b];
  const int q_len = c.q_len_of(b), kv_len = c.kv_len_of(b);
  std::vector<uint8_t> q(q_len * q_row * elem);
  std::vector<uint8_t> k(static_cast<size_t>(kv_len) * kv_row * elem), v(k.size());
  p.q.copy_to_host(q.data(), q.size(), q_begin * q_row * elem);
  if (p.is_paged()) {
    // NHD pages of one request, concatenated in page-table order, are its ragged K/V rows.
    const int64_t page_bytes = static_cast<int64_t>(c.page_size) * kv_row * elem;
    for (int32_t i = p.page_indptr[b]; i < p.page_indptr[b + 1]; ++i) {
      const int64_t local = i - p.page_indptr[b];
      const int64_t bytes = std::min<int64_t>(page_bytes, k.size() - local * page_bytes);
      p.k.copy_to_host(k.data() + local * page_bytes, bytes, p.page_indices[i] * page_bytes);
      p.v.copy_to_host(v.data() + local * page_bytes, bytes, p.page_indices[i] * page_bytes);
    }
  } else {
    p.k.copy_to_host(k.data(), k.size(), p.kv_indptr[b] * kv_row * elem);
    p.v.copy_to_host(v.data(), v.size(), p.kv_indptr[b] * kv_row * elem);
  }
  const int32_t qo_indptr[2] = {0, q_len}, kv_indptr[2] = {0, kv_len};
  detail::AttentionProblem host;
  host.q_dtype = p.dtype;
  host.batch_size = 1;
  host.num_qo_heads = c.num_qo_heads;
  host.num_kv_heads = c.num_kv_heads;
  host.head_dim = c.head_dim;
  host.q = q.data();
  host.q_stride_token = q_row;
  host.q_stride_head = c.head_dim;
  host.qo_indptr = qo_indptr;
  host.kv.dtype = p.dtype;
  host.kv.k = k.data();
  host.kv.v = v.data();
  host.kv.k_stride_token = host.kv.v_stride_token = kv_row;
  host.kv.k_stride_head = host.kv.v_stride_head = c.head_dim;
  host.kv.kv_indptr = kv_indptr;
  host.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  host.mask.causal = c.causal;

  SampledReference reference;
  reference.request = b;
  std::vector<detail::ReferenceRow>& rows = reference.rows;
  std::uniform_int_distribution<int> token_dist(0, q_len - 1), head_dist(0, c.num_qo_heads - 1);
  for (int t = 0; t < kSampledTokens; ++t) {
    const int token = t == 0 ? 0 : t == 1 ? q_len - 1 : token_dist(rng);
    for (int h = 0; h < kSampledHeads; ++h) {
      const int head = h == 0 ? 0 : h == 1 ? c.num_qo_heads - 1 : head_dist(rng);
      rows.push_back({0, token, head});
    }
  }
  detail::cpu_reference_rows(host, rows, &reference.o, &reference.lse);
  return reference;
}

double sampled_error(const BenchProblem& p, const SampledReference& reference, int* nan_count) {
  const BenchCase& c = p.spec;
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t q_row = static_cast<int64_t>(c.num_qo_heads) * c.head_dim;
  const int64_t q_begin = p.qo_indptr[reference.request];
  const int q_len = c.q_len_of(reference.request);
  std::vector<uint8_t> o(q_len * q_row * elem);
  std::vector<float> lse(static_cast<size_t>(q_len) * c.num_qo_heads);
  p.o.copy_to_host(o.data(), o.size(), q_begin * q_row * elem);
  p.lse.copy_to_host(lse.data(), lse.size() * sizeof(float),
                     q_begin * c.num_qo_heads * sizeof(float));
  for (int64_t i = 0; i < q_len * q_row; ++i) {
    *nan_count += std::isnan(detail::load_as_float(o.data(), p.dtype, i));
  }
  const std::vector<detail::ReferenceRow>& rows = reference.rows;
  const std::vector<double>& ref_o = reference.o;
  const std::vector<double>& ref_lse = reference.lse;
  double worst = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    double diff = 0, norm = 0;
    const int64_t base = rows[r].token * q_row + static_cast<int64_t>(rows[r].qo_head) * c.head_dim;
    for (int d = 0; d < c.head_dim; ++d) {
      const double out = detail::load_as_float(o.data(), p.dtype, base + d);
      const double ref = ref_o[r * c.head_dim + d];
      diff += (out - ref) * (out - ref);
      norm += ref * ref;
    }
    double err = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    const double out_lse = lse[static_cast<size_t>(rows[r].token) * c.num_qo_heads +
                               rows[r].qo_head];
    if (std::isinf(ref_lse[r]) ? out_lse != ref_lse[r]
                               : std::fabs(out_lse - ref_lse[r]) > 1e-2 * (1 + std::fabs(ref_lse[r]))) {
      err = std::max(err, 1.0);  // a wrong lse fails the case
    }
    if (std::isnan(err)) err = INFINITY;
    worst = std::max(worst, err);
  }
  return worst;
}

double check_request(const BenchProblem& p, int b, std::mt19937_64& rng, int* nan_count) {
  return sampled_error(p, sampled_reference(p, b, rng), nan_count);
}

namespace {

double visible_pairs_of(const BenchCase& c, int q_len, int kv_len) {
  detail::MaskSpec mask;
  mask.causal = c.causal;
  double pairs = 0;
  for (int i = 0; i < q_len; ++i) {
    int32_t first, last;
    mask.visible_range(i, q_len, kv_len, &first, &last);
    pairs += last - first;
  }
  return pairs;
}

double visible_pairs(const BenchCase& c) {
  const int first = c.num_first();
  double pairs = visible_pairs_of(c, c.q_len, c.kv_len) * (c.batch - first);
  return pairs + visible_pairs_of(c, c.q_len_of(0), c.kv_len_of(0)) * first;
}

double total_keys(const BenchCase& c) {
  const int first = c.num_first();
  return static_cast<double>(c.kv_len) * (c.batch - first) +
         static_cast<double>(c.kv_len_of(0)) * first;
}

// ---- timing ----

double time_cpu_ms(BenchProblem& p, int iterations) {
  run_once(p);  // warm-up
  std::vector<double> times;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  const int wanted = iterations > 0 ? iterations : 30;
  for (int i = 0; i < wanted; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run_once(p);
    const auto stop = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    if (iterations == 0 && i >= 2 && stop > deadline) break;
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

#if defined(TESSERA_HAVE_CUDA)
void launch_trampoline(void* context) { run_once(*static_cast<BenchProblem*>(context)); }
void launch_on_stream(void* context, void* stream) {
  run_once(*static_cast<BenchProblem*>(context), stream);
}
// Larger than the 50-60 MB L2 of current data-centre GPUs.
constexpr size_t kL2FlushBytes = 256ull << 20;
#endif

}  // namespace

double time_ms(BenchProblem& p, int iterations) {
  if (p.device.type == DeviceType::kCPU) return time_cpu_ms(p, iterations);
#if defined(TESSERA_HAVE_CUDA)
  const int iters = iterations > 0 ? iterations : 30;
  if (p.spec.graph) {
    return detail::cuda_graph_median_ms(&launch_on_stream, &p, 3, iters, kL2FlushBytes);
  }
  return detail::cuda_median_ms(&launch_trampoline, &p, 3, iters, nullptr, kL2FlushBytes);
#else
  return 0;
#endif
}

namespace {

// ---- suites ----

BenchCase prefill_case(int head_dim, int seq, bool causal, int tokens, int hidden) {
  BenchCase c;
  c.op = AttentionOp::kRaggedPrefill;
  c.batch = std::max(1, tokens / seq);
  c.q_len = c.kv_len = seq;
  c.num_qo_heads = c.num_kv_heads = hidden / head_dim;
  c.head_dim = head_dim;
  c.causal = causal;
  c.name = "prefill d" + std::to_string(head_dim) + (causal ? " causal" : "") + " " +
           std::to_string(c.batch) + "x" + std::to_string(seq) + " h" +
           std::to_string(c.num_qo_heads);
  return c;
}

BenchCase gqa_case(AttentionOp op, int batch, int q_len, int kv_len, bool causal, int page);

// The decode cases of the standard CUDA suite (GQA 32/8, d128, page 16; `--suite roofline` reads
// the same shapes): batch x kv_len from one request to 256, and a skewed batch of one long
// request beside many short ones.
std::vector<BenchCase> decode_suite_cases() {
  std::vector<BenchCase> cases;
  for (auto [batch, len] : {std::pair{1, 1024}, {1, 32768}, {16, 4096}, {16, 32768}, {64, 4096},
                            {64, 32768}, {256, 16384}}) {
    cases.push_back(gqa_case(AttentionOp::kDecode, batch, 1, len, false, 16));
  }
  BenchCase skewed = gqa_case(AttentionOp::kDecode, 256, 1, 512, false, 16);
  skewed.first_kv_len = 32768;
  skewed.name = "decode gqa32/8 d128 p16 skewed 1x32k+255x512";
  cases.push_back(skewed);
  return cases;
}

BenchCase gqa_case(AttentionOp op, int batch, int q_len, int kv_len, bool causal, int page) {
  BenchCase c;
  c.op = op;
  c.batch = batch;
  c.q_len = q_len;
  c.kv_len = kv_len;
  c.num_qo_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_size = page;
  c.causal = causal;
  const std::string shape = std::to_string(batch) + "x" + std::to_string(kv_len);
  if (op == AttentionOp::kDecode) {
    c.name = "decode gqa32/8 d128 p" + std::to_string(page) + " " + shape;
  } else {
    c.name = std::string(op == AttentionOp::kPagedPrefill ? "paged prefill p" +
                                                                std::to_string(page) + " "
                                                          : "prefill ") +
             "gqa32/8 d128" + (causal ? " causal " : " ") + shape;
  }
  return c;
}

// ---- planner speed (`--suite plan`) ----

// A serving engine calls plan() once per step on the host: these cases time it. With a GPU
// the real plan_* calls (validation, lengths, the device's planner knobs); without one the
// planner itself (detail::make_plan) with knobs like an H200's, so the numbers mean the same
// on a build host.
struct PlanBenchCase {
  std::string name;
  AttentionOp op = AttentionOp::kDecode;
  std::vector<int32_t> q_lens, kv_lens;
  bool causal = false;
};

std::vector<PlanBenchCase> plan_bench_cases() {
  std::vector<PlanBenchCase> cases;
  std::mt19937_64 rng(5);
  const auto random_lens = [&](int count, int lo, int hi) {
    std::vector<int32_t> lens(count);
    for (auto& len : lens) len = std::uniform_int_distribution<int32_t>(lo, hi)(rng);
    return lens;
  };
  const auto add = [&](std::string name, AttentionOp op, std::vector<int32_t> q_lens,
                       std::vector<int32_t> kv_lens, bool causal) {
    cases.push_back({std::move(name), op, std::move(q_lens), std::move(kv_lens), causal});
  };
  add("plan decode 256x512..32k", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      random_lens(256, 512, 32768), false);
  add("plan decode 256x16k", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      std::vector<int32_t>(256, 16384), false);
  std::vector<int32_t> skewed(256, 512);
  skewed[0] = 32768;
  add("plan decode skewed 1x32k+255x512", AttentionOp::kDecode, std::vector<int32_t>(256, 1),
      skewed, false);
  add("plan decode 16x4k", AttentionOp::kDecode, std::vector<int32_t>(16, 1),
      std::vector<int32_t>(16, 4096), false);
  const std::vector<int32_t> prefill_lens = random_lens(64, 128, 4096);
  add("plan prefill causal 64x128..4k", AttentionOp::kRaggedPrefill, prefill_lens, prefill_lens,
      true);
  std::vector<int32_t> skewed_prefill(64, 256);
  skewed_prefill[0] = 16384;
  add("plan prefill causal skewed 1x16k+63x256", AttentionOp::kRaggedPrefill, skewed_prefill,
      skewed_prefill, true);
  std::vector<int32_t> mixed_q(256, 1);
  std::fill(mixed_q.begin(), mixed_q.begin() + 4, 2048);
  add("plan paged prefill causal mixed 4x2048+252x1", AttentionOp::kPagedPrefill, mixed_q,
      std::vector<int32_t>(256, 2048), true);
  return cases;
}

int run_plan_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  const bool gpu = device.type == DeviceType::kCUDA;
  constexpr int kQoHeads = 32, kKvHeads = 8, kHeadDim = 128, kPageSize = 16;
  // Without a GPU: the knobs an H200 gets for this shape (GQA 32/8, d128, bf16), written out
  // here so that a CPU-only build (no CUDA headers) times the planner on the same work.
  // Decode (cuda_decode_plan_config): 132 SMs x 2 CTAs (x 4 for a heavy batch, core/tuning.hpp's
  // batch rule: variant 4), 64-row tiles, 128-key minimum split piece (512 in deterministic
  // mode). Prefill (cuda_plan_config, sm90 kernels): one CTA per
  // SM, 128-row tiles (2 consumer warpgroups), 4 x 128-key tiles minimum piece.
  constexpr int kH200Sms = 132;
  constexpr int kDecodeCtasPerSm = 2;       // variant 1 (4 warps x 3 stages), d128 bf16
  constexpr int kHeavyDecodeCtasPerSm = 4;  // variant 4 (2 warps x 3 stages)
  constexpr int kPrefillKeyTile = 128;
  PlanConfig h200_decode;
  h200_decode.q_tile_rows = 64;
  h200_decode.num_workers = kH200Sms * kDecodeCtasPerSm;
  h200_decode.split_kv = true;
  h200_decode.min_kv_chunk = 128;
  h200_decode.deterministic_kv_chunk = 512;
  PlanConfig h200_prefill;
  h200_prefill.q_tile_rows = 128;
  h200_prefill.num_workers = kH200Sms;
  h200_prefill.split_kv = true;
  h200_prefill.min_kv_chunk = 4 * kPrefillKeyTile;
  std::cout << "tessera bench --suite plan: "
            << (gpu ? "plan_* for " + describe_device(device)
                    : std::string("detail::make_plan, no GPU: an H200's knobs (decode: 264 "
                                  "workers, 528 for a heavy batch, 64-row tiles, min chunk 128; "
                                  "prefill: 132 workers, 128-row tiles, min chunk 512)"))
            << "\nhost: " << describe_device(Device{DeviceType::kCPU, 0})
            << "\nGQA 32/8, head_dim 128, page 16; microseconds per plan(), median of many calls\n";
  std::printf("\n%-44s %10s %10s %10s %8s %8s %8s\n", "case", "median us", "min us", "cpu us",
              "calls", "items", "merges");
  for (const PlanBenchCase& c : plan_bench_cases()) {
    if (!options.filter.empty() && c.name.find(options.filter) == std::string::npos) continue;
    AttentionOptions attention;
    attention.causal = c.causal;
    std::vector<int32_t> qo_indptr(1, 0), kv_indptr(1, 0), page_indptr(1, 0), last_page_len;
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      qo_indptr.push_back(qo_indptr.back() + c.q_lens[b]);
      kv_indptr.push_back(kv_indptr.back() + c.kv_lens[b]);
      const int32_t pages = (c.kv_lens[b] + kPageSize - 1) / kPageSize;
      page_indptr.push_back(page_indptr.back() + pages);
      last_page_len.push_back(pages == 0 ? 1 : c.kv_lens[b] - (pages - 1) * kPageSize);
    }
    detail::PlanShape shape;
    shape.op = c.op;
    shape.q_lens = c.q_lens;
    shape.kv_lens = c.kv_lens;
    shape.num_qo_heads = kQoHeads;
    shape.num_kv_heads = kKvHeads;
    shape.head_dim = kHeadDim;
    shape.page_size = c.op == AttentionOp::kRaggedPrefill ? 0 : kPageSize;
    shape.options = attention;
    PlanConfig cpu_config = c.op == AttentionOp::kDecode ? h200_decode : h200_prefill;
    if (c.op == AttentionOp::kDecode &&
        detail::is_heavy_decode_batch(static_cast<int64_t>(c.q_lens.size()), kKvHeads, kHeadDim,
                                      kH200Sms)) {
      cpu_config.num_workers = kH200Sms * kHeavyDecodeCtasPerSm;
      cpu_config.heavy_batch = true;
    }
    const auto plan_once = [&]() -> Plan {
      if (!gpu) return detail::make_plan(shape, cpu_config);
      switch (c.op) {
        case AttentionOp::kRaggedPrefill:
          return plan_ragged_prefill(qo_indptr, kv_indptr, kQoHeads, kKvHeads, kHeadDim,
                                     attention, device);
        case AttentionOp::kPagedPrefill:
          return plan_paged_prefill(qo_indptr, page_indptr, last_page_len, kPageSize, kQoHeads,
                                    kKvHeads, kHeadDim, attention, device);
        case AttentionOp::kDecode:
          break;
      }
      return plan_decode(page_indptr, last_page_len, kPageSize, kQoHeads, kKvHeads, kHeadDim,
                         attention, device, c.q_lens.empty() ? 1 : c.q_lens[0]);
    };
    const Plan sample = plan_once();  // warm-up
    // Wall time, and this thread's CPU time (less disturbed on a shared build host).
    const auto thread_cpu_us = [] {
      timespec now{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
      return now.tv_sec * 1e6 + now.tv_nsec * 1e-3;
    };
    std::vector<double> times, cpu_times;
    const int wanted = options.iterations > 0 ? options.iterations : 2000;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (int i = 0; i < wanted; ++i) {
      const double cpu_start = thread_cpu_us();
      const auto start = std::chrono::steady_clock::now();
      const Plan plan = plan_once();
      const auto stop = std::chrono::steady_clock::now();
      cpu_times.push_back(thread_cpu_us() - cpu_start);
      times.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
      if (options.iterations == 0 && i >= 20 && stop > deadline) break;
    }
    std::sort(times.begin(), times.end());
    std::sort(cpu_times.begin(), cpu_times.end());
    std::printf("%-44s %10.2f %10.2f %10.2f %8zu %8zu %8zu\n", c.name.c_str(),
                times[times.size() / 2], times.front(), cpu_times[cpu_times.size() / 2],
                times.size(), sample.work.size(), sample.merges.size());
  }
  return 0;
}

}  // namespace

Device resolve_backend(const std::string& requested, bool* reference) {
  // TESSERA_BACKEND picks the backend when the command line leaves it at auto.
  const char* env = std::getenv("TESSERA_BACKEND");
  const std::string backend = requested == "auto" && env && *env ? std::string(env) : requested;
  if (reference) *reference = backend == "cpu-reference";
  if (backend == "cpu" || backend == "cpu-reference") return Device{DeviceType::kCPU, 0};
  if (backend == "cuda") return Device{DeviceType::kCUDA, 0};
  if (backend != "auto") {
    throw Error(Error::Kind::kInvalidArgument,
                "--backend / TESSERA_BACKEND: expected auto, cpu, cpu-reference or cuda, got '" +
                    backend + "'");
  }
  return cuda_available() ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
}

std::vector<BenchCase> bench_suite(const std::string& suite, Device device) {
  std::vector<BenchCase> cases;
  const bool quick = suite == "quick";
  if (suite != "quick" && suite != "standard") {
    throw Error(Error::Kind::kInvalidArgument,
                "--suite: expected quick, standard, plan, overhead or roofline, got '" + suite + "'");
  }
  if (device.type == DeviceType::kCUDA) {
    // The grid of ANCHORS.md: B x S = 16k tokens, H x D = 2048.
    std::vector<int> seqs = quick ? std::vector<int>{4096} : std::vector<int>{512, 4096, 16384};
    // TESSERA_BENCH_SEQS=4096,6000,8192,...: the grid's sequence lengths instead (batch =
    // 16384 / length requests, at least one), to time the kernel choice between lengths (the
    // wide-tile rule) without a separate suite.
    if (const char* text = std::getenv("TESSERA_BENCH_SEQS"); text != nullptr && *text != '\0') {
      seqs.clear();
      for (const char* at = text; *at != '\0';) {
        char* end = nullptr;
        const long value = std::strtol(at, &end, 10);
        if (end == at || value < 1 || value > (1 << 20)) {
          throw Error(Error::Kind::kInvalidArgument,
                      std::string("TESSERA_BENCH_SEQS: expected comma-separated lengths in "
                                  "1..1048576, got '") + text + "'");
        }
        if (*end != ',' && *end != '\0') {
          throw Error(Error::Kind::kInvalidArgument,
                      std::string("TESSERA_BENCH_SEQS: expected comma-separated lengths, got '") +
                          text + "'");
        }
        seqs.push_back(static_cast<int>(value));
        at = *end == ',' ? end + 1 : end;
      }
    }
    const std::vector<int> dims = quick ? std::vector<int>{128} : std::vector<int>{64, 128, 256};
    for (int d : dims) {
      for (bool causal : {false, true}) {
        for (int s : seqs) cases.push_back(prefill_case(d, s, causal, 16384, 2048));
      }
    }
    cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 4, 4096, 4096, true, 0));
    if (!quick) cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 1, 16384, 16384, true, 0));
    for (int page : quick ? std::vector<int>{16} : std::vector<int>{16, 64}) {
      cases.push_back(gqa_case(AttentionOp::kPagedPrefill, 4, 4096, 4096, true, page));
    }
    if (quick) {
      cases.push_back(gqa_case(AttentionOp::kDecode, 64, 1, 4096, false, 16));
    } else {
      // Decode of every batch shape, then a skewed batch (issue 5).
      for (const BenchCase& c : decode_suite_cases()) cases.push_back(c);
      BenchCase skewed_prefill = gqa_case(AttentionOp::kRaggedPrefill, 64, 256, 256, true, 0);
      skewed_prefill.first_q_len = skewed_prefill.first_kv_len = 16384;
      skewed_prefill.name = "prefill gqa32/8 d128 causal skewed 1x16k+63x256";
      cases.push_back(skewed_prefill);
      BenchCase uniform_prefill = gqa_case(AttentionOp::kRaggedPrefill, 64, 2048, 2048, true, 0);
      uniform_prefill.name = "prefill gqa32/8 d128 causal uniform 64x2048";  // ~ equal work
      cases.push_back(uniform_prefill);
      // A mixed batch in one plan (issue 5): 4 requests prefilling 2048 tokens beside 252
      // decoding one token, all over 2048 cached keys (paged prefill with ragged q lengths).
      BenchCase mixed = gqa_case(AttentionOp::kPagedPrefill, 256, 1, 2048, true, 16);
      mixed.first_q_len = 2048;
      mixed.first_count = 4;
      mixed.name = "prefill gqa32/8 d128 p16 causal mixed 4x2048+252x1";
      cases.push_back(mixed);
      // Checked mode (issue 7): the same decode with index validation on.
      BenchCase checked = gqa_case(AttentionOp::kDecode, 64, 1, 4096, false, 16);
      checked.checked = true;
      checked.name += " (checked)";
      cases.push_back(checked);
      // Latency of one decode step replayed from a CUDA graph (issue 5: 1 x 1k <= 8 us).
      BenchCase graph = gqa_case(AttentionOp::kDecode, 1, 1, 1024, false, 16);
      graph.graph = true;
      graph.name += " (graph)";
      cases.push_back(graph);
    }
    return cases;
  }
  // CPU: the foundation's target shape first (D=128, S=2048, 8 heads), then the rest scaled to
  // what two to a few dozen cores finish in seconds.
  const int s = quick ? 512 : 2048;
  cases.push_back(prefill_case(128, s, false, s, 128 * 8));
  cases.push_back(prefill_case(128, s, true, s, 128 * 8));
  if (!quick) {
    cases.push_back(prefill_case(64, 2048, false, 2048, 64 * 8));
    cases.push_back(prefill_case(256, 1024, false, 1024, 256 * 4));
  }
  cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 1, s / 2, s / 2, true, 0));
  cases.push_back(gqa_case(AttentionOp::kPagedPrefill, 1, s / 2, s / 2, true, 16));
  cases.push_back(gqa_case(AttentionOp::kDecode, 8, 1, quick ? 1024 : 4096, false, 16));
  if (!quick) cases.push_back(gqa_case(AttentionOp::kDecode, 1, 1, 32768, false, 16));
  return cases;
}

// Host cost of one run_*() call on tiny problems (one request of 16 keys, 2 query heads / 1 kv
// head, head_dim 64, as bench/python_overhead.py): batches of 200 calls timed from an idle device
// to the last call's return (fewer calls than the launch queue holds, so the GPU's time is not
// in it), best of 20 batches. The C++ floor under the Python wrappers' run().
int run_overhead_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  std::cout << "tessera bench --suite overhead: " << describe_device(device)
            << ", host microseconds per run_*() call (best of 20 x 200 calls)\n";
  BenchCase decode;
  decode.name = "decode run_decode (plan uploaded)";
  decode.op = AttentionOp::kDecode;
  decode.q_len = 1;
  decode.kv_len = 16;
  decode.page_size = 16;
  BenchCase ragged = decode;
  ragged.name = "ragged run_ragged_prefill (plan uploaded)";
  ragged.op = AttentionOp::kRaggedPrefill;
  ragged.page_size = 0;
  int failures = 0;
  for (BenchCase c : {decode, ragged}) {
    c.num_qo_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 64;
    try {
      BenchProblem problem;
      problem.spec = c;
      problem.device = device;
      problem.dtype = DType::kFloat16;
      build_problem(problem, 7);
      const auto synchronize = [&] {
#if defined(TESSERA_HAVE_CUDA)
        if (device.type == DeviceType::kCUDA) detail::cuda_synchronize(nullptr);
#endif
      };
      for (int i = 0; i < 200; ++i) run_once(problem);
      double best = INFINITY;
      for (int batch = 0; batch < 20; ++batch) {
        synchronize();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < 200; ++i) run_once(problem);
        const auto stop = std::chrono::steady_clock::now();
        best = std::min(best, std::chrono::duration<double, std::micro>(stop - start).count() / 200);
        synchronize();
      }
      std::printf("  %-44s %8.2f us\n", c.name.c_str(), best);
    } catch (const std::exception& error) {
      std::printf("  %-44s error: %s\n", c.name.c_str(), error.what());
      ++failures;
    }
  }
#if defined(TESSERA_HAVE_CUDA)
  if (device.type == DeviceType::kCUDA) {
    // What any run() on CUDA pays at least: the launch of one kernel, measured the same way.
    std::printf("  %-44s %8.2f us\n", "floor: empty kernel launch",
                detail::cuda_launch_floor_us(200, false));
    std::printf("  %-44s %8.2f us\n", "floor: empty kernel launch, 512-byte params",
                detail::cuda_launch_floor_us(200, true));
  }
#endif
  return failures == 0 ? 0 : 1;
}

// The DRAM read ceiling of each decode shape of the standard suite (`--suite roofline`): a plain
// 16-byte-load kernel reading as many bytes as the shape's K and V, timed like the bench (median,
// L2 flushed before each call as TESSERA_BENCH_FLUSH says). The best TB/s any decode kernel of
// that shape can show under the same timing.
int run_roofline_bench(const BenchOptions& options) {
  const Device device = resolve_backend(options.backend);
  if (device.type != DeviceType::kCUDA) {
    std::cout << "tessera bench --suite roofline: needs a CUDA device; skipped\n";
    return 0;
  }
#if defined(TESSERA_HAVE_CUDA)
  const char* flush = std::getenv("TESSERA_BENCH_FLUSH");
  std::cout << "tessera bench --suite roofline: " << describe_device(device)
            << ", plain read of each decode shape's K+V bytes, L2 flush "
            << (flush != nullptr && *flush != 0 ? flush : "write") << "\n";
  const int iterations = options.iterations > 0 ? options.iterations : 30;
  for (const BenchCase& c : decode_suite_cases()) {
    // K and V of every key, bf16 (the bench's default dtype).
    const auto bytes = static_cast<size_t>(2.0 * total_keys(c) * c.num_kv_heads * c.head_dim * 2);
    const double ms = detail::cuda_read_ceiling_ms(bytes, iterations, kL2FlushBytes);
    const std::string shape = c.name.substr(c.name.find(" p16 ") + 5);
    std::printf("  read %-26s %9.1f MB %10.4f ms %7.3f TB/s\n", shape.c_str(), bytes / 1e6, ms,
                bytes / (ms * 1e-3) / 1e12);
  }
  return 0;
#else
  return 0;
#endif
}

int run_bench(const BenchOptions& options) {
  if (options.suite == "plan") return run_plan_bench(options);
  if (options.suite == "overhead") return run_overhead_bench(options);
  if (options.suite == "roofline") return run_roofline_bench(options);
  bool reference = false;
  const Device device = resolve_backend(options.backend, &reference);
  const CpuImpl saved_impl = cpu_impl();
  if (reference) set_cpu_impl(CpuImpl::kReference);

  double peak_compute = 0, peak_memory = 0;  // TFLOP/s, TB/s
  std::string peak_how;
  std::string device_text = describe_device(device);
  if (device.type == DeviceType::kCPU) {
    peak_compute = detail::cpu_peak_gflops(&peak_how) / 1e3;
  } else {
#if defined(TESSERA_HAVE_CUDA)
    detail::cuda_device_peaks(device.index, &peak_compute, &peak_memory, &peak_how);
#endif
  }
  std::cout << "tessera bench: " << device_text << (reference ? " (reference oracle)" : "")
            << ", dtype " << dtype_name(options.dtype) << "\n"
            << "peak: " << format_double(peak_compute * 1e3, 1) << " GFLOP/s"
            << (peak_memory > 0 ? ", " + format_double(peak_memory, 2) + " TB/s" : "") << " ("
            << peak_how << ")\n";

  std::vector<BenchCase> cases = bench_suite(options.suite, device);
  if (!options.filter.empty()) {
    std::erase_if(cases, [&](const BenchCase& c) {
      return c.name.find(options.filter) == std::string::npos;
    });
  }
  std::vector<BenchResult> results;
  std::mt19937_64 rng(1234);
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const BenchCase& c = cases[i];
    if (options.progress) {
      std::cerr << "[" << i + 1 << "/" << cases.size() << "] " << c.name << " ..." << std::endl;
    }
    BenchResult result;
    result.bench_case = c;
    try {
      BenchProblem problem;
      problem.spec = c;
      problem.device = device;
      problem.dtype = options.dtype;
      build_problem(problem, 100 + i);
      problem.o.poison();
      problem.lse.poison();
      run_once(problem);
      if (options.check) {
        int nans = 0;
        double worst = check_request(problem, 0, rng, &nans);
        if (c.batch > 1) worst = std::max(worst, check_request(problem, c.batch - 1, rng, &nans));
        result.max_rel_error = worst;
        result.nan_count = nans;
        if (worst > kMaxRelError || nans > 0) result.status = "WRONG";
      }
      const int iterations =
          reference ? 1 : options.iterations;
      result.milliseconds = time_ms(problem, iterations);
      const double seconds = result.milliseconds * 1e-3;
      const double elem = static_cast<double>(dtype_size(options.dtype));
      result.flops = 4.0 * visible_pairs(c) * c.head_dim * c.num_qo_heads;
      result.bytes = 2.0 * total_keys(c) * c.num_kv_heads * c.head_dim * elem;
      if (c.op == AttentionOp::kDecode) {
        result.rate = result.bytes / seconds / 1e12;
        if (peak_memory > 0) result.percent_of_peak = 100.0 * result.rate / peak_memory;
      } else {
        result.rate = result.flops / seconds / 1e12;
        if (peak_compute > 0) result.percent_of_peak = 100.0 * result.rate / peak_compute;
      }
    } catch (const std::exception& error) {
      result.status = std::string("error: ") + error.what();
    }
    failures += result.status != "ok";
    results.push_back(result);
  }
  if (reference) set_cpu_impl(saved_impl);

  const bool cpu = device.type == DeviceType::kCPU;
  std::printf("\n%-44s %10s %12s %8s %10s %s\n", "case", "time ms",
              cpu ? "GFLOP|GB/s" : "TFLOP|TB/s", "% peak", "max err", "status");
  for (const BenchResult& r : results) {
    const double shown = cpu ? r.rate * 1e3 : r.rate;
    const std::string unit = r.bench_case.op == AttentionOp::kDecode
                                 ? (cpu ? " GB/s" : " TB/s")
                                 : (cpu ? " GF/s" : " TF/s");
    std::printf("%-44s %10.3f %7.2f%s %8s %10s %s\n", r.bench_case.name.c_str(), r.milliseconds,
                shown, unit.c_str(),
                r.percent_of_peak >= 0 ? format_double(r.percent_of_peak, 1).c_str() : "-",
                r.max_rel_error >= 0 ? format_double(r.max_rel_error, 5).c_str() : "-",
                r.status.c_str());
  }
  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    json << "{\n  \"device\": \"" << device_text << "\",\n  \"dtype\": \""
         << dtype_name(options.dtype) << "\",\n  \"peak_tflops\": " << peak_compute
         << ",\n  \"peak_tbps\": " << peak_memory << ",\n  \"results\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const BenchResult& r = results[i];
      const BenchCase& c = r.bench_case;
      json << "    {\"name\": \"" << c.name << "\", \"op\": \"" << op_name(c.op)
           << "\", \"batch\": " << c.batch << ", \"q_len\": " << c.q_len
           << ", \"kv_len\": " << c.kv_len << ", \"num_qo_heads\": " << c.num_qo_heads
           << ", \"num_kv_heads\": " << c.num_kv_heads << ", \"head_dim\": " << c.head_dim
           << ", \"page_size\": " << c.page_size << ", \"causal\": " << (c.causal ? 1 : 0)
           << ", \"first_q_len\": " << c.q_len_of(0) << ", \"first_kv_len\": " << c.kv_len_of(0)
           << ", \"first_count\": " << c.num_first()
           << ", \"checked\": " << (c.checked ? 1 : 0) << ", \"graph\": " << (c.graph ? 1 : 0)
           << ", \"ms\": " << r.milliseconds << ", \"tflops\": " << r.flops / 1e12
           << ", \"bytes\": " << r.bytes << ", \"rate\": " << r.rate
           << ", \"percent_of_peak\": " << r.percent_of_peak
           << ", \"max_rel_error\": " << r.max_rel_error << ", \"nan_count\": " << r.nan_count
           << ", \"status\": \"" << (r.status == "ok" ? "ok" : "failed") << "\"}"
           << (i + 1 < results.size() ? "," : "") << "\n";
    }
    json << "  ]\n}\n";
  }
  if (failures) std::printf("\n%d case(s) failed\n", failures);
  return failures ? 1 : 0;
}

}  // namespace tessera::cli
