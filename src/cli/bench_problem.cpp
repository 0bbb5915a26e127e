// The pieces of a bench case (bench.hpp): its problem on the device, one run, the sampled check
// against the reference and the timing; shared by `tessera bench` and `tessera tune`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "cli/bench.hpp"
#include "cli/bench_internal.hpp"
#include "cli/buffers.hpp"
#include "core/half.hpp"
#include "core/settings.hpp"
#include "cpu/reference.hpp"
#include "devtools/timing.hpp"
#include "tessera/backend.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "devtools/bench_support.hpp"
#endif

namespace tessera::cli {
namespace {

// Query tokens and heads sampled per checked request.
constexpr int kSampledTokens = 6;
constexpr int kSampledHeads = 3;

// ---- problem construction ----

Buffer int_buffer(Device device, const std::vector<int32_t>& values) {
  Buffer buffer(device, std::max<size_t>(values.size(), 1) * sizeof(int32_t));
  if (!values.empty()) buffer.copy_from_host(values.data(), values.size() * sizeof(int32_t));
  return buffer;
}

TensorView int_view(const Buffer& buffer, size_t count, Device device) {
  return make_view(buffer.data(), DType::kInt32, {static_cast<int64_t>(count)}, device);
}

// Shared-prefix decode: the first shared_prefix / page_size pages of every request become the
// same pages (those of request 0), and the pages no request uses any more are dropped from the
// pool, so the cache holds the prefix once.
void share_prefix_pages(BenchProblem& p) {
  const BenchCase& c = p.spec;
  const int32_t shared = c.shared_prefix / c.page_size;
  std::vector<int32_t> indices;
  for (int b = 0; b < c.batch; ++b) {
    for (int32_t i = p.page_indptr[b]; i < p.page_indptr[b + 1]; ++i) {
      const int32_t local = i - p.page_indptr[b];
      indices.push_back(local < shared ? p.page_indices[local] : p.page_indices[i]);
    }
  }
  // Renumber the pages in use densely (the order of first use; shuffled ids stay shuffled).
  std::vector<int32_t> renumber(p.num_pages, -1);
  int32_t next = 0;
  for (int32_t& page : indices) {
    if (renumber[page] < 0) renumber[page] = next++;
    page = renumber[page];
  }
  p.page_indices = std::move(indices);
  p.num_pages = next;
}

// Cascade cases: level 0 = the shared prefix, one group of every query row; level 1 = each
// request's own pages after it.
void plan_cascade_levels(BenchProblem& p, const AttentionOptions& options) {
  const BenchCase& c = p.spec;
  const int32_t shared = c.shared_prefix / c.page_size;
  std::vector<int32_t> own_indptr = {0}, own_indices;
  for (int b = 0; b < c.batch; ++b) {
    for (int32_t i = p.page_indptr[b] + shared; i < p.page_indptr[b + 1]; ++i) {
      own_indices.push_back(p.page_indices[i]);
    }
    own_indptr.push_back(static_cast<int32_t>(own_indices.size()));
  }
  p.level_arrays = {{0, static_cast<int32_t>(p.total_q)},
                    {0, shared},
                    std::vector<int32_t>(p.page_indices.begin(), p.page_indices.begin() + shared),
                    {c.page_size},
                    p.qo_indptr,
                    own_indptr,
                    own_indices,
                    p.last_page_len};
  p.level_buffers.clear();
  for (const std::vector<int32_t>& values : p.level_arrays) {
    p.level_buffers.push_back(int_buffer(p.device, values));
  }
  p.levels.clear();
  for (size_t l = 0; l < 2; ++l) {
    auto view = [&](size_t i) {
      return int_view(p.level_buffers[4 * l + i], p.level_arrays[4 * l + i].size(), p.device);
    };
    p.levels.push_back({view(0), view(1), view(2), view(3)});
  }
  const std::vector<CascadeLevelLengths> lengths = {
      {p.level_arrays[0], p.level_arrays[1], p.level_arrays[3]},
      {p.level_arrays[4], p.level_arrays[5], p.level_arrays[7]}};
  p.cascade = plan_cascade(lengths, c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                           options, p.device);
}

// Custom-mask cases: random blocks of each request's (row, key) plane, packed little-endian
// per request (core/masks.hpp), and the pairs that the mask and causal leave visible.
void build_block_mask(BenchProblem& p, uint64_t seed) {
  const BenchCase& c = p.spec;
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution visible(c.mask_density);
  p.mask_bytes.clear();
  p.mask_offsets.assign(1, 0);
  p.masked_pairs = 0;
  for (int b = 0; b < c.batch; ++b) {
    const int q_len = c.q_len_of(b), kv_len = c.kv_len_of(b), block = c.mask_block;
    const int row_blocks = (q_len + block - 1) / block, key_blocks = (kv_len + block - 1) / block;
    std::vector<uint8_t> on(static_cast<size_t>(row_blocks) * key_blocks);
    for (uint8_t& x : on) x = visible(rng);
    const size_t start = p.mask_bytes.size();
    p.mask_bytes.resize(start + (static_cast<size_t>(q_len) * kv_len + 7) / 8, 0);
    for (int i = 0; i < q_len; ++i) {
      for (int j = 0; j < kv_len; ++j) {
        if (!on[static_cast<size_t>(i / block) * key_blocks + j / block]) continue;
        const size_t bit = static_cast<size_t>(i) * kv_len + j;
        p.mask_bytes[start + bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
        p.masked_pairs += !c.causal || j <= i + kv_len - q_len;
      }
    }
    p.mask_offsets.push_back(static_cast<int32_t>(p.mask_bytes.size()));
  }
  p.mask_view =
      make_view(p.mask_bytes.data(), DType::kUInt8, {static_cast<int64_t>(p.mask_bytes.size())});
  p.mask_indptr_view = make_view(p.mask_offsets.data(), DType::kInt32,
                                 {static_cast<int64_t>(p.mask_offsets.size())});
}

// MLA cases: views of the combined q and cache buffers (q_nope / q_pe, ckv / kpe) and the plan.
void plan_mla_case(BenchProblem& p) {
  const BenchCase& c = p.spec;
  const int64_t width = c.qk_dim(), heads = c.num_qo_heads;
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  const auto q_part = [&](int64_t offset, int64_t dim) {
    return make_view(static_cast<char*>(p.q.data()) + offset * elem, p.dtype,
                     {p.total_q, heads, dim}, {heads * width, width, 1}, p.device);
  };
  p.q_view = q_part(0, c.head_dim);
  p.q_pe_view = q_part(c.head_dim, c.rope_dim);
  const TensorView cache =
      make_view(p.k.data(), p.dtype, {p.num_pages, c.page_size, width}, p.device);
  p.mla_cache = split_mla_cache(cache, c.head_dim);
  p.mla_cache.page_indptr = p.paged.page_indptr;
  p.mla_cache.page_indices = p.paged.page_indices;
  p.mla_cache.last_page_len = p.paged.last_page_len;
  MlaOptions options;
  options.causal = c.causal;
  p.mla_plan = plan_mla(p.qo_indptr, p.page_indptr, p.last_page_len, c.page_size, c.num_qo_heads,
                        c.head_dim, c.rope_dim, options, p.device);
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
  const int64_t row = static_cast<int64_t>(c.num_kv_heads) * c.qk_dim();
  if (p.is_paged()) {
    p.num_pages = p.page_indptr.back();
    // Pages in a shuffled order, as a serving engine's allocator hands them out
    // (TESSERA_BENCH_PAGES=ordered keeps them in order, to tell the cost of scattered pages
    // from that of small ones).
    p.page_indices.resize(p.num_pages);
    std::iota(p.page_indices.begin(), p.page_indices.end(), 0);
    const bool ordered = detail::settings().bench_pages_ordered;
    std::mt19937_64 rng(seed);
    if (!ordered) std::shuffle(p.page_indices.begin(), p.page_indices.end(), rng);
    if (c.shared_prefix > 0) share_prefix_pages(p);
    const size_t cache_bytes = p.num_pages * c.page_size * row * elem;
    p.k = Buffer(p.device, cache_bytes);
    p.v = Buffer(p.device, c.mla ? 0 : cache_bytes);  // MLA: V is the ckv part of k
  } else {
    p.k = Buffer(p.device, p.total_kv * row * elem);
    p.v = Buffer(p.device, p.total_kv * row * elem);
  }
  const int64_t q_elems = p.total_q * c.num_qo_heads * c.qk_dim();
  const int64_t o_elems = p.total_q * c.num_qo_heads * c.head_dim;
  p.q = Buffer(p.device, q_elems * elem);
  p.o = Buffer(p.device, o_elems * elem);
  p.lse = Buffer(p.device, p.total_q * c.num_qo_heads * sizeof(float));
  p.q.fill_random(p.dtype, seed + 1);
  p.k.fill_random(p.dtype, seed + 2);
  if (!c.mla) p.v.fill_random(p.dtype, seed + 3);
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
    if (c.mla) {
      plan_mla_case(p);
    } else if (c.cascade) {
      plan_cascade_levels(p, options);
    } else if (c.op == AttentionOp::kDecode) {
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
  if (c.mask_block > 0) build_block_mask(p, seed + 4);
  p.workspace = Buffer(p.device, c.cascade ? p.cascade.workspace_bytes
                                 : c.mla   ? p.mla_plan.workspace_bytes()
                                           : p.plan.workspace_bytes);
  // A serving engine plans once per step and runs the plan in every layer: the plan's lists are
  // uploaded here, outside the timed call (TESSERA_BENCH_UPLOAD=0 times run()'s own upload).
  if (p.device.type == DeviceType::kCUDA && detail::settings().bench_upload) {
    const Workspace workspace{p.workspace.data(), p.workspace.bytes()};
    if (c.cascade) {
      upload_cascade(p.cascade, workspace);
    } else {
      upload_plan(p.plan, workspace);
    }
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
  RunOptions run_options;
  run_options.enable_pdl = p.spec.pdl;
  if (p.spec.mask_block > 0) {
    run_options.custom_mask = p.mask_view;
    run_options.mask_indptr = p.mask_indptr_view;
  }
  if (p.spec.mla) {
    run_mla(p.mla_plan, p.q_view, p.q_pe_view, p.mla_cache, p.qo_view, p.o_view, p.lse_view,
            workspace, stream);
    return;
  }
  if (p.spec.cascade) {
    run_cascade(p.cascade, p.q_view, p.paged.k_cache, p.paged.v_cache, p.paged.layout, p.levels,
                p.o_view, p.lse_view, workspace, stream, run_options);
    return;
  }
  switch (p.spec.op) {
    case AttentionOp::kRaggedPrefill:
      run_ragged_prefill(p.plan, p.q_view, p.k_view, p.v_view, p.qo_view, p.kv_view, p.o_view,
                         p.lse_view, workspace, stream, run_options);
      break;
    case AttentionOp::kPagedPrefill:
      run_paged_prefill(p.plan, p.q_view, p.paged, p.qo_view, p.o_view, p.lse_view, workspace,
                        stream, run_options);
      break;
    case AttentionOp::kDecode:
      run_decode(p.plan, p.q_view, p.paged, p.o_view, p.lse_view, workspace, stream, run_options);
      break;
  }
}

// ---- sampled correctness check ----

SampledReference sampled_reference(const BenchProblem& p, int b, std::mt19937_64& rng) {
  const BenchCase& c = p.spec;
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t q_row = static_cast<int64_t>(c.num_qo_heads) * c.qk_dim();
  const int64_t kv_row = static_cast<int64_t>(c.num_kv_heads) * c.qk_dim();
  const Buffer& v_buffer = c.mla ? p.k : p.v;  // MLA: V = the ckv part of the key rows
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
      v_buffer.copy_to_host(v.data() + local * page_bytes, bytes, p.page_indices[i] * page_bytes);
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
  host.head_dim = c.qk_dim();
  host.head_dim_vo = c.head_dim;
  host.q = q.data();
  host.q_stride_token = q_row;
  host.q_stride_head = c.qk_dim();
  host.qo_indptr = qo_indptr;
  host.kv.dtype = p.dtype;
  host.kv.k = k.data();
  host.kv.v = v.data();
  host.kv.k_stride_token = host.kv.v_stride_token = kv_row;
  host.kv.k_stride_head = host.kv.v_stride_head = c.qk_dim();
  host.kv.kv_indptr = kv_indptr;
  host.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.qk_dim())));
  host.mask.causal = c.causal;
  // A custom mask: request b's segment, as the one request of this host problem.
  const int32_t mask_segment[2] = {c.mask_block > 0 ? p.mask_offsets[b] : 0, 0};
  if (c.mask_block > 0) {
    host.key_mask.custom = p.mask_bytes.data();
    host.key_mask.custom_indptr = mask_segment;
  }

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
    const double out_lse =
        lse[static_cast<size_t>(rows[r].token) * c.num_qo_heads + rows[r].qo_head];
    if (std::isinf(ref_lse[r])
            ? out_lse != ref_lse[r]
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

std::string format_double(double value, int precision) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", precision, value);
  return text;
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

}  // namespace

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

#if defined(TESSERA_HAVE_CUDA)
namespace {
void launch_trampoline(void* context) {
  run_once(*static_cast<BenchProblem*>(context));
}
void launch_on_stream(void* context, void* stream) {
  run_once(*static_cast<BenchProblem*>(context), stream);
}
}  // namespace
#endif

devtools::TimingStats time_stats(BenchProblem& p, int iterations) {
  if (p.device.type == DeviceType::kCPU) {
    return devtools::time_host_ms([&] { run_once(p); }, iterations);
  }
#if defined(TESSERA_HAVE_CUDA)
  const int iters = iterations > 0 ? iterations : 30;
  if (p.spec.graph) {
    return devtools::cuda_graph_time_ms(&launch_on_stream, &p, 3, iters, kL2FlushBytes);
  }
  return devtools::cuda_time_ms(&launch_trampoline, &p, 3, iters, nullptr, kL2FlushBytes);
#else
  return {};
#endif
}

double time_ms(BenchProblem& p, int iterations) {
  return time_stats(p, iterations).median;
}

}  // namespace tessera::cli
