#include "common/attention_testing.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

#include "core/half.hpp"
#include "core/workspace_layout.hpp"

namespace tessera::test {
namespace {

// 0xff bytes are NaN in every float format used here (fp32, fp16, bf16, e4m3, e5m2).
constexpr uint8_t kNaNByte = 0xff;

const char* short_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    default: return "?";
  }
}

size_t element_bytes(DType dtype) {
  return dtype_size(dtype);
}

int32_t uniform_int(std::mt19937_64& rng, int32_t lo, int32_t hi) {  // inclusive
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}
bool chance(std::mt19937_64& rng, double p) {
  return std::bernoulli_distribution(p)(rng);
}
template <typename T>
T pick(std::mt19937_64& rng, const std::vector<T>& values) {
  return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
}

// A value of magnitude in [lo, hi] with a random sign: never zero, so a kernel that skips or
// zeroes an element cannot agree with the reference by accident.
float nonzero_value(std::mt19937_64& rng, float lo, float hi) {
  const float magnitude = std::uniform_real_distribution<float>(lo, hi)(rng);
  return chance(rng, 0.5) ? magnitude : -magnitude;
}

int64_t reference_macs(const AttentionCase& c) {
  int64_t pairs = 0;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    pairs += static_cast<int64_t>(c.q_lens[b]) * std::max(c.kv_lens[b], 1);
  }
  return pairs * c.num_qo_heads * c.head_dim;
}

int32_t random_length(std::mt19937_64& rng, int32_t max_len) {
  const int32_t kind = uniform_int(rng, 0, 9);
  if (kind == 0) return 0;                                          // empty request
  if (kind <= 2) return uniform_int(rng, 1, std::min(4, max_len));  // decode-like
  if (kind <= 5) return uniform_int(rng, 1, std::max(1, max_len / 4));
  return uniform_int(rng, 1, max_len);
}

void fill_tensor(std::vector<uint8_t>* bytes, DType dtype, int64_t offset, float value) {
  detail::store_from_float(bytes->data(), dtype, offset, value);
}

bool is_nan_bytes(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != kNaNByte) return false;
  }
  return true;
}

}  // namespace

int64_t AttentionCase::total_q() const {
  return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
}
int64_t AttentionCase::total_kv() const {
  return std::accumulate(kv_lens.begin(), kv_lens.end(), int64_t{0});
}
float AttentionCase::resolved_sm_scale() const {
  return sm_scale != 0.0f ? sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}
detail::MaskSpec AttentionCase::mask() const {
  detail::MaskSpec mask;
  mask.causal = causal;
  mask.window_left = window_left;
  mask.window_right = window_right;
  return mask;
}

int64_t AttentionCase::visible_pairs() const {
  const detail::MaskSpec spec = mask();
  int64_t pairs = 0;
  for (int32_t b = 0; b < batch_size(); ++b) {
    for (int32_t i = 0; i < q_lens[b]; ++i) {
      int32_t first = 0, last = 0;
      spec.visible_range(i, q_lens[b], kv_lens[b], &first, &last);
      pairs += last - first;
    }
  }
  return pairs * num_qo_heads;
}

std::string AttentionCase::describe() const {
  std::ostringstream text;
  text << "q_lens=[";
  for (size_t i = 0; i < q_lens.size(); ++i) text << (i ? "," : "") << q_lens[i];
  text << "] kv_lens=[";
  for (size_t i = 0; i < kv_lens.size(); ++i) text << (i ? "," : "") << kv_lens[i];
  text << "] heads=" << num_qo_heads << "/" << num_kv_heads << " d=" << head_dim;
  if (head_dim_v() != head_dim) text << " d_vo=" << head_dim_v();
  text << " q=" << short_name(q_dtype) << " kv=" << short_name(kv_dtype);
  if (paged) {
    text << " paged(page=" << page_size << (layout == KVLayout::kHND ? ",HND" : ",NHD")
         << ",spare=" << spare_pages << ")";
  } else {
    text << " ragged";
  }
  if (uniform_q) text << " uniform_q";
  if (causal) text << " causal";
  if (window_left >= 0 || window_right >= 0) {
    text << " window=(" << window_left << "," << window_right << ")";
  }
  if (soft_cap > 0) text << " cap=" << soft_cap;
  if (sm_scale != 0) text << " sm_scale=" << sm_scale;
  if (k_scale != 1 || v_scale != 1) text << " kv_scale=" << k_scale << "," << v_scale;
  text << (with_lse ? " lse" : " no-lse");
  if (with_sinks) text << " sinks";
  text << " pads(q " << q_head_pad << "," << q_token_pad << " o " << o_head_pad << ","
       << o_token_pad << " kv " << kv_head_pad << "," << kv_token_pad << " lse " << lse_token_pad
       << ")";
  return text.str();
}

AttentionCase random_case(std::mt19937_64& rng, const RandomCaseOptions& options) {
  AttentionCase c;
  c.num_kv_heads = uniform_int(rng, 1, options.max_kv_heads);
  c.num_qo_heads = c.num_kv_heads * uniform_int(rng, 1, options.max_group);
  c.head_dim = chance(rng, options.any_head_dim_probability) ? 8 * uniform_int(rng, 1, 32)
                                                             : pick(rng, options.head_dims);
  c.q_dtype = pick(rng, options.q_dtypes);
  c.kv_dtype = c.q_dtype;
  if (options.allow_fp8_kv && chance(rng, 0.15)) {
    c.kv_dtype = chance(rng, 0.5) ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
    c.k_scale = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
    c.v_scale = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
  }

  const int32_t batch = uniform_int(rng, 1, options.max_batch);
  c.uniform_q = chance(rng, 0.15);
  const int32_t uniform_len = uniform_int(rng, 1, 4);
  for (int32_t b = 0; b < batch; ++b) {
    c.q_lens.push_back(c.uniform_q ? uniform_len : random_length(rng, options.max_q_len));
    c.kv_lens.push_back(random_length(rng, options.max_kv_len));
  }
  while (reference_macs(c) > options.max_reference_macs) {
    for (int32_t b = 0; b < batch; ++b) {
      if (!c.uniform_q) c.q_lens[b] = (c.q_lens[b] + 1) / 2;
      c.kv_lens[b] /= 2;
    }
  }

  if (options.allow_paged && chance(rng, 0.5)) {
    c.paged = true;
    const int32_t kind = uniform_int(rng, 0, 3);
    c.page_size = kind == 0 ? 1 : kind == 1 ? 16 : kind == 2 ? 64 : uniform_int(rng, 1, 128);
    c.layout = chance(rng, 0.5) ? KVLayout::kNHD : KVLayout::kHND;
    c.spare_pages = uniform_int(rng, 0, 3);
  }
  c.causal = chance(rng, 0.4);
  if (chance(rng, 0.2)) {
    c.window_left = chance(rng, 0.8) ? uniform_int(rng, 0, 64) : -1;
    c.window_right = chance(rng, 0.5) ? uniform_int(rng, 0, 16) : -1;
  }
  if (chance(rng, 0.2)) c.soft_cap = std::uniform_real_distribution<float>(2.0f, 50.0f)(rng);
  if (chance(rng, 0.3)) c.sm_scale = std::uniform_real_distribution<float>(0.03f, 0.3f)(rng);
  c.with_lse = chance(rng, 0.8);
  if (chance(rng, 0.5)) {
    c.q_head_pad = uniform_int(rng, 0, 24);
    c.q_token_pad = uniform_int(rng, 0, 40);
    c.o_head_pad = uniform_int(rng, 0, 24);
    c.o_token_pad = uniform_int(rng, 0, 40);
    c.kv_head_pad = uniform_int(rng, 0, 24);
    c.kv_token_pad = uniform_int(rng, 0, 40);
    c.lse_token_pad = uniform_int(rng, 0, 5);
  }
  return c;
}

AttentionBuffers make_buffers(const AttentionCase& c, std::mt19937_64& rng) {
  AttentionBuffers buffers;
  buffers.test_case = c;
  const int32_t batch = c.batch_size();
  const int32_t head_dim = c.head_dim, head_dim_v = c.head_dim_v();
  const int32_t kv_width = std::max(head_dim, head_dim_v);  // K and V share strides
  const int64_t total_q = c.total_q();

  buffers.q_stride_head = head_dim + c.q_head_pad;
  buffers.q_stride_token = c.num_qo_heads * buffers.q_stride_head + c.q_token_pad;
  buffers.o_stride_head = head_dim_v + c.o_head_pad;
  buffers.o_stride_token = c.num_qo_heads * buffers.o_stride_head + c.o_token_pad;
  buffers.lse_stride_token = c.num_qo_heads + c.lse_token_pad;

  buffers.qo_indptr.assign(batch + 1, 0);
  for (int32_t b = 0; b < batch; ++b) buffers.qo_indptr[b + 1] = buffers.qo_indptr[b] + c.q_lens[b];

  // K/V geometry: ragged [tokens, heads, d] or paged NHD [pages, page, heads, d] /
  // HND [pages, heads, page, d], each level with its padding.
  int64_t kv_elements = 0;
  std::vector<int32_t> request_pages(batch, 0);
  if (!c.paged) {
    buffers.kv_stride_head = kv_width + c.kv_head_pad;
    buffers.kv_stride_token = c.num_kv_heads * buffers.kv_stride_head + c.kv_token_pad;
    buffers.kv_indptr.assign(batch + 1, 0);
    for (int32_t b = 0; b < batch; ++b) {
      buffers.kv_indptr[b + 1] = buffers.kv_indptr[b] + c.kv_lens[b];
    }
    kv_elements = std::max<int64_t>(c.total_kv(), 1) * buffers.kv_stride_token;
  } else {
    if (c.layout == KVLayout::kNHD) {
      buffers.kv_stride_head = kv_width + c.kv_head_pad;
      buffers.kv_stride_token = c.num_kv_heads * buffers.kv_stride_head + c.kv_token_pad;
      buffers.kv_stride_page = c.page_size * buffers.kv_stride_token;
    } else {
      buffers.kv_stride_token = kv_width + c.kv_token_pad;
      buffers.kv_stride_head = c.page_size * buffers.kv_stride_token + c.kv_head_pad;
      buffers.kv_stride_page = c.num_kv_heads * buffers.kv_stride_head;
    }
    int64_t used_pages = 0;
    for (int32_t b = 0; b < batch; ++b) {
      request_pages[b] = (c.kv_lens[b] + c.page_size - 1) / c.page_size;
      used_pages += request_pages[b];
    }
    buffers.num_pages = used_pages + c.spare_pages;
    // Shuffled page indices: consecutive keys of a request live on scattered pages.
    std::vector<int32_t> pool(buffers.num_pages);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    buffers.page_indptr.assign(batch + 1, 0);
    buffers.last_page_len.assign(batch, 0);
    for (int32_t b = 0; b < batch; ++b) {
      buffers.page_indptr[b + 1] = buffers.page_indptr[b] + request_pages[b];
      if (request_pages[b] > 0) {
        buffers.last_page_len[b] = c.kv_lens[b] - (request_pages[b] - 1) * c.page_size;
      }
    }
    buffers.page_indices.assign(pool.begin(), pool.begin() + used_pages);
    kv_elements = std::max<int64_t>(buffers.num_pages, 1) * buffers.kv_stride_page;
  }

  const size_t q_bytes = element_bytes(c.q_dtype);
  const size_t kv_bytes = element_bytes(c.kv_dtype);
  buffers.q.assign(std::max<int64_t>(total_q, 1) * buffers.q_stride_token * q_bytes, kNaNByte);
  buffers.o.assign(std::max<int64_t>(total_q, 1) * buffers.o_stride_token * q_bytes, kNaNByte);
  if (c.with_lse) {
    buffers.lse.assign(std::max<int64_t>(total_q, 1) * buffers.lse_stride_token * sizeof(float),
                       kNaNByte);
  }
  buffers.k.assign(kv_elements * kv_bytes, kNaNByte);
  buffers.v.assign(kv_elements * kv_bytes, kNaNByte);

  for (int64_t token = 0; token < total_q; ++token) {
    for (int32_t h = 0; h < c.num_qo_heads; ++h) {
      for (int32_t d = 0; d < head_dim; ++d) {
        fill_tensor(&buffers.q, c.q_dtype,
                    token * buffers.q_stride_token + h * buffers.q_stride_head + d,
                    nonzero_value(rng, 0.05f, 2.0f));
      }
    }
  }
  // Fill through the same offset function the kernels use, request by request.
  const detail::AttentionProblem problem = make_problem(buffers);
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t j = 0; j < c.kv_lens[b]; ++j) {
      for (int32_t h = 0; h < c.num_kv_heads; ++h) {
        const int64_t k_offset = problem.kv.k_offset(b, h, j);
        const int64_t v_offset = problem.kv.v_offset(b, h, j);
        for (int32_t d = 0; d < kv_width; ++d) {
          // Equal widths draw exactly as before (k then v per element).
          if (d < head_dim) {
            fill_tensor(&buffers.k, c.kv_dtype, k_offset + d, nonzero_value(rng, 0.05f, 2.0f));
          }
          if (d < head_dim_v) {
            fill_tensor(&buffers.v, c.kv_dtype, v_offset + d, nonzero_value(rng, 0.05f, 1.0f));
          }
        }
      }
    }
  }
  // Sinks around the scores' range: some rows dominated by their keys, some by the sink (so
  // the sink's side of the max shift is exercised too).
  if (c.with_sinks) {
    std::uniform_real_distribution<float> logit(-4.0f, 6.0f);
    buffers.sinks.resize(c.num_qo_heads);
    for (float& sink : buffers.sinks) sink = logit(rng);
  }
  return buffers;
}

BufferPointers host_pointers(AttentionBuffers& buffers) {
  BufferPointers pointers;
  pointers.q = buffers.q.data();
  pointers.k = buffers.k.data();
  pointers.v = buffers.v.data();
  pointers.o = buffers.o.data();
  pointers.lse =
      buffers.test_case.with_lse ? reinterpret_cast<float*>(buffers.lse.data()) : nullptr;
  pointers.qo_indptr = buffers.qo_indptr.data();
  pointers.kv_indptr = buffers.kv_indptr.empty() ? nullptr : buffers.kv_indptr.data();
  pointers.page_indptr = buffers.page_indptr.empty() ? nullptr : buffers.page_indptr.data();
  pointers.page_indices = buffers.page_indices.data();
  pointers.last_page_len = buffers.last_page_len.empty() ? nullptr : buffers.last_page_len.data();
  pointers.sinks = buffers.test_case.with_sinks ? buffers.sinks.data() : nullptr;
  return pointers;
}

detail::AttentionProblem make_problem(const AttentionBuffers& buffers,
                                      const BufferPointers& pointers) {
  const AttentionCase& c = buffers.test_case;
  detail::AttentionProblem problem;
  problem.q_dtype = c.q_dtype;
  problem.batch_size = c.batch_size();
  problem.num_qo_heads = c.num_qo_heads;
  problem.num_kv_heads = c.num_kv_heads;
  problem.head_dim = c.head_dim;
  problem.head_dim_vo = c.head_dim_v();
  problem.q = pointers.q;
  problem.q_stride_token = buffers.q_stride_token;
  problem.q_stride_head = buffers.q_stride_head;
  problem.q_extent = c.total_q();
  problem.o_extent = c.total_q();
  if (c.uniform_q) {
    problem.qo_indptr = nullptr;
    problem.q_per_request = c.q_lens.empty() ? 1 : c.q_lens[0];
  } else {
    problem.qo_indptr = pointers.qo_indptr;
  }
  detail::KVSource& kv = problem.kv;
  kv.dtype = c.kv_dtype;
  kv.paged = c.paged;
  kv.k = pointers.k;
  kv.v = pointers.v;
  kv.k_stride_token = kv.v_stride_token = buffers.kv_stride_token;
  kv.k_stride_head = kv.v_stride_head = buffers.kv_stride_head;
  kv.k_stride_page = kv.v_stride_page = buffers.kv_stride_page;
  if (c.paged) {
    kv.page_indptr = pointers.page_indptr;
    kv.page_indices = pointers.page_indices;
    kv.last_page_len = pointers.last_page_len;
    kv.page_size = c.page_size;
    kv.k_extent = kv.v_extent = buffers.num_pages;
  } else {
    kv.kv_indptr = pointers.kv_indptr;
    kv.k_extent = kv.v_extent = c.total_kv();
  }
  problem.o = pointers.o;
  problem.o_stride_token = buffers.o_stride_token;
  problem.o_stride_head = buffers.o_stride_head;
  problem.lse = c.with_lse ? pointers.lse : nullptr;
  problem.lse_stride_token = buffers.lse_stride_token;
  problem.sm_scale = c.resolved_sm_scale();
  problem.soft_cap = c.soft_cap;
  problem.k_scale = c.k_scale;
  problem.v_scale = c.v_scale;
  problem.mask = c.mask();
  problem.sinks = c.with_sinks ? pointers.sinks : nullptr;
  return problem;
}

detail::AttentionProblem make_problem(AttentionBuffers& buffers) {
  return make_problem(buffers, host_pointers(buffers));
}

void poison_outputs(AttentionBuffers& buffers) {
  std::fill(buffers.o.begin(), buffers.o.end(), kNaNByte);
  std::fill(buffers.lse.begin(), buffers.lse.end(), kNaNByte);
}

Outputs copy_outputs(const AttentionBuffers& buffers) {
  return {buffers.o, buffers.lse};
}

bool Comparison::ok(double tolerance, double lse_tolerance) const {
  return rel_l2 < tolerance && nan_count == 0 && lse_max_abs_err <= lse_tolerance &&
         lse_inf_mismatches == 0 && empty_row_violations == 0 && padding_writes == 0;
}

std::string Comparison::describe() const {
  std::ostringstream text;
  text << "rel_l2=" << rel_l2 << " max_abs=" << max_abs_err << " nan=" << nan_count
       << " lse_err=" << lse_max_abs_err << " lse_inf_mismatch=" << lse_inf_mismatches
       << " empty_row_violations=" << empty_row_violations << " padding_writes=" << padding_writes;
  return text.str();
}

Comparison compare_outputs(const AttentionBuffers& buffers, const Outputs& actual,
                           const Outputs& expected) {
  const AttentionCase& c = buffers.test_case;
  const detail::MaskSpec mask = c.mask();
  const size_t q_bytes = element_bytes(c.q_dtype);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  Comparison result;
  std::vector<bool> o_logical(buffers.o.size() / q_bytes, false);
  std::vector<bool> lse_logical(buffers.lse.size() / sizeof(float), false);
  double diff_sq = 0.0, ref_sq = 0.0, out_sq = 0.0;
  int64_t token = 0;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    for (int32_t i = 0; i < c.q_lens[b]; ++i, ++token) {
      int32_t first = 0, last = 0;
      mask.visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
      const bool empty_row = first >= last;
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        const int64_t base = token * buffers.o_stride_token + h * buffers.o_stride_head;
        bool row_nonzero = false;
        for (int32_t d = 0; d < c.head_dim_v(); ++d) {
          o_logical[base + d] = true;
          const double out = detail::load_as_float(actual.o.data(), c.q_dtype, base + d);
          const double ref = detail::load_as_float(expected.o.data(), c.q_dtype, base + d);
          if (!std::isfinite(out)) {
            ++result.nan_count;
            continue;
          }
          row_nonzero = row_nonzero || out != 0.0;
          diff_sq += (out - ref) * (out - ref);
          ref_sq += ref * ref;
          out_sq += out * out;
          result.max_abs_err = std::max(result.max_abs_err, std::fabs(out - ref));
        }
        bool lse_wrong_for_empty = false;
        if (c.with_lse) {
          const int64_t at = token * buffers.lse_stride_token + h;
          lse_logical[at] = true;
          float out = 0, ref = 0;
          std::memcpy(&out, actual.lse.data() + at * sizeof(float), sizeof(float));
          std::memcpy(&ref, expected.lse.data() + at * sizeof(float), sizeof(float));
          if (std::isnan(out)) {
            ++result.nan_count;
          } else if ((out == minus_inf) != (ref == minus_inf)) {
            ++result.lse_inf_mismatches;
          } else if (ref != minus_inf) {
            result.lse_max_abs_err = std::max<double>(result.lse_max_abs_err, std::fabs(out - ref));
          }
          // With a sink an empty row's lse is the sink (to float rounding of its base-2 form).
          lse_wrong_for_empty =
              c.with_sinks ? !(std::fabs(out - buffers.sinks[h]) <= 1e-5f * (1.0f + std::fabs(out)))
                           : out != minus_inf;
        }
        if (empty_row && (row_nonzero || lse_wrong_for_empty)) ++result.empty_row_violations;
      }
    }
  }
  result.rel_l2 = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(out_sq);
  for (size_t e = 0; e < o_logical.size(); ++e) {
    if (!o_logical[e] && !is_nan_bytes(actual.o.data() + e * q_bytes, q_bytes)) {
      ++result.padding_writes;
    }
  }
  for (size_t e = 0; e < lse_logical.size(); ++e) {
    if (!lse_logical[e] && !is_nan_bytes(actual.lse.data() + e * sizeof(float), sizeof(float))) {
      ++result.padding_writes;
    }
  }
  return result;
}

double default_tolerance(const AttentionCase& c) {
  // fp16 keeps 11 significant bits, bf16 8: the output rounding alone costs ~2^-12 / 2^-9
  // relative. fp32 outputs see only float accumulation and the exp2 polynomial.
  switch (c.q_dtype) {
    case DType::kFloat32: return 1e-4;
    case DType::kFloat16: return 2e-3;
    default: return 1e-2;
  }
}

double default_lse_tolerance(const AttentionCase& c) {
  // lse is float in every case; its error grows with the logit magnitudes (|s| <~ 20 here).
  return c.q_dtype == DType::kFloat32 ? 1e-4 : 5e-4;
}

Plan make_test_plan(const AttentionCase& c, const TestPlanOptions& options) {
  Plan plan;
  // Decode in the public API means paged K/V; uniform queries over ragged K/V are a prefill.
  plan.op = c.uniform_q && c.paged
                ? AttentionOp::kDecode
                : (c.paged ? AttentionOp::kPagedPrefill : AttentionOp::kRaggedPrefill);
  plan.batch_size = c.batch_size();
  plan.num_qo_heads = c.num_qo_heads;
  plan.num_kv_heads = c.num_kv_heads;
  plan.head_dim = c.head_dim;
  plan.options.head_dim_vo = c.head_dim_v();
  plan.page_size = c.paged ? c.page_size : 0;
  plan.options.causal = c.causal;
  plan.options.window_left = c.window_left;
  plan.options.window_right = c.window_right;
  plan.options.logits_soft_cap = c.soft_cap;
  plan.options.sm_scale = c.sm_scale;
  plan.options.k_scale = c.k_scale;
  plan.options.v_scale = c.v_scale;
  plan.config.q_tile_rows = options.q_tile_rows;
  plan.config.num_workers = options.num_workers;
  plan.config.split_kv = options.kv_chunk > 0;
  plan.config.min_kv_chunk = options.kv_chunk;
  plan.total_q = c.total_q();
  plan.q_lens = c.q_lens;
  plan.kv_lens = c.kv_lens;

  const int32_t group_size = c.group_size();
  const int32_t tile_tokens = std::max(1, options.q_tile_rows / group_size);
  std::vector<WorkItem> items;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    const int32_t kv_len = c.kv_lens[b];
    for (int32_t h = 0; h < c.num_kv_heads; ++h) {
      for (int32_t q0 = 0; q0 < c.q_lens[b]; q0 += tile_tokens) {
        const int32_t q_len = std::min(tile_tokens, c.q_lens[b] - q0);
        const int32_t splits = options.kv_chunk > 0
                                   ? std::max(1, (kv_len + options.kv_chunk - 1) / options.kv_chunk)
                                   : 1;
        if (splits == 1) {
          items.push_back({b, h, q0, q_len, 0, kv_len, -1});
          continue;
        }
        const int32_t rows = q_len * group_size;
        const int32_t first_row = static_cast<int32_t>(plan.num_partial_rows);
        const int32_t merge_index = static_cast<int32_t>(plan.merges.size());
        for (int32_t s = 0; s < splits; ++s) {
          const int32_t kv_start = s * options.kv_chunk;
          const int32_t kv_end = std::min(kv_len, kv_start + options.kv_chunk);
          items.push_back({b, h, q0, q_len, kv_start, kv_end, first_row + s * rows, merge_index});
        }
        plan.merges.push_back({b, h, q0, q_len, first_row, splits});
        plan.num_partial_rows += static_cast<int64_t>(splits) * rows;
      }
    }
  }
  const int32_t workers = std::max(1, options.num_workers);
  plan.worker_indptr.assign(workers + 1, 0);
  for (int32_t w = 0; w < workers; ++w) {
    for (size_t i = w; i < items.size(); i += workers) plan.work.push_back(items[i]);
    plan.worker_indptr[w + 1] = static_cast<int32_t>(plan.work.size());
  }
  plan.workspace_bytes = detail::WorkspaceLayout::of(plan).total;
  // Cost in the planner's units: packed query rows x keys.
  for (int32_t w = 0; w < workers; ++w) {
    double worker_cost = 0;
    for (int32_t i = plan.worker_indptr[w]; i < plan.worker_indptr[w + 1]; ++i) {
      const WorkItem& item = plan.work[i];
      worker_cost += static_cast<double>(item.q_len) * group_size * (item.kv_end - item.kv_start);
    }
    plan.total_cost += worker_cost;
    plan.max_worker_cost = std::max(plan.max_worker_cost, worker_cost);
  }
  return plan;
}

}  // namespace tessera::test
