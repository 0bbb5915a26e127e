// The oracle, one query row at a time (double accumulation). See reference.hpp.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/half.hpp"
#include "cpu/reference.hpp"
#include "cpu/sink.hpp"

namespace tessera::detail {

void reference_load_kv(const AttentionProblem& problem, bool values, int32_t request,
                       int32_t kv_head, std::vector<float>* out) {
  const KVSource& kv = problem.kv;
  const int32_t kv_len = kv.kv_len(request);
  const int32_t head_dim = values ? problem.head_dim_v() : problem.head_dim;
  // A key row may be two segments (k, then k_rope: MLA's ckv and kpe).
  const int32_t main_dim = values ? head_dim : problem.k_main_dim();
  const void* base = values ? kv.v : kv.k;
  out->resize(static_cast<size_t>(kv_len) * head_dim);
  for (int32_t j = 0; j < kv_len; ++j) {
    const int64_t offset =
        values ? kv.v_offset(request, kv_head, j) : kv.k_offset(request, kv_head, j);
    float* row = out->data() + static_cast<size_t>(j) * head_dim;
    for (int32_t d = 0; d < main_dim; ++d) row[d] = load_as_float(base, kv.dtype, offset + d);
    if (main_dim == head_dim) continue;
    const int64_t rope_offset = kv.k_rope_offset(request, kv_head, j);
    for (int32_t d = main_dim; d < head_dim; ++d) {
      row[d] = load_as_float(kv.k_rope, kv.dtype, rope_offset + d - main_dim);
    }
  }
}

namespace {

// reference_row without the sink: o and lse of the visible keys alone.
double sink_free_row(const AttentionProblem& problem, int32_t request, int32_t token,
                     int32_t qo_head, const float* keys, const float* values, double* out) {
  const int32_t head_dim = problem.head_dim, head_dim_v = problem.head_dim_v();
  const int32_t q_len = problem.q_len(request), kv_len = problem.kv.kv_len(request);
  const int64_t q_offset =
      static_cast<int64_t>(problem.q_begin(request) + token) * problem.q_stride_token +
      static_cast<int64_t>(qo_head) * problem.q_stride_head;
  std::vector<double> query(head_dim);
  const int32_t main_dim = problem.q_main_dim();  // the rest from q_rope (MLA's q_pe)
  for (int32_t d = 0; d < main_dim; ++d) {
    query[d] = load_as_float(problem.q, problem.q_dtype, q_offset + d);
  }
  if (main_dim < head_dim) {
    const int64_t rope_offset =
        static_cast<int64_t>(problem.q_begin(request) + token) * problem.q_rope_stride_token +
        static_cast<int64_t>(qo_head) * problem.q_rope_stride_head;
    for (int32_t d = main_dim; d < head_dim; ++d) {
      query[d] = load_as_float(problem.q_rope, problem.q_dtype, rope_offset + d - main_dim);
    }
  }
  std::fill(out, out + head_dim_v, 0.0);
  int32_t first = 0, last = 0;
  problem.mask.visible_range(token, q_len, kv_len, &first, &last);
  if (first >= last) return -std::numeric_limits<double>::infinity();

  const double logit_scale = static_cast<double>(problem.sm_scale) * problem.k_scale;
  const double soft_cap = problem.soft_cap;
  std::vector<double> logits(last - first);
  double max_logit = -std::numeric_limits<double>::infinity();
  bool poisoned = false;  // a visible score is NaN or +inf: the whole row is NaN
  const KeyMask& key_mask = problem.key_mask;  // custom / tree mask (core/masks.hpp)
  auto masked = [&](int32_t j) {
    return key_mask.active() && !key_mask.visible(request, token, j, q_len, kv_len);
  };
  for (int32_t j = first; j < last; ++j) {
    if (masked(j)) continue;  // excluded, like a key outside [first, last)
    const float* key = keys + static_cast<size_t>(j) * head_dim;
    double dot = 0.0;
    for (int32_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
    double s = dot * logit_scale;
    if (soft_cap > 0.0) s = soft_cap * std::tanh(s / soft_cap);
    logits[j - first] = s;
    poisoned = poisoned || std::isnan(s) || s == std::numeric_limits<double>::infinity();
    max_logit = std::max(max_logit, s);
  }
  if (poisoned) {
    std::fill(out, out + head_dim_v, std::numeric_limits<double>::quiet_NaN());
    return std::numeric_limits<double>::quiet_NaN();
  }
  // Every visible score is -inf (finite q against infinite keys): each has weight 0, as a
  // masked key does, so the row is empty whatever v holds.
  if (max_logit == -std::numeric_limits<double>::infinity()) return max_logit;
  double sum = 0.0;
  for (int32_t j = first; j < last; ++j) {
    if (masked(j)) continue;
    // A -inf score gives p = 0 exactly; 0 * an infinite v is NaN (IEEE, as torch).
    const double p = std::exp(logits[j - first] - max_logit);
    sum += p;
    const float* value = values + static_cast<size_t>(j) * head_dim_v;
    for (int32_t d = 0; d < head_dim_v; ++d) out[d] += p * value[d];
  }
  const double v_scale = problem.v_scale;
  for (int32_t d = 0; d < head_dim_v; ++d) out[d] = out[d] * v_scale / sum;
  return max_logit + std::log(sum);
}

}  // namespace

double reference_row(const AttentionProblem& problem, int32_t request, int32_t token,
                     int32_t qo_head, const float* keys, const float* values, double* out) {
  const double lse = sink_free_row(problem, request, token, qo_head, keys, values, out);
  if (problem.sinks == nullptr) return lse;
  const SinkFold fold = fold_sink(lse, problem.sinks[qo_head]);
  // factor 0 (a row without keys) keeps o = 0 exactly; NaN makes the row NaN.
  for (int32_t d = 0; d < problem.head_dim_v(); ++d) {
    out[d] = std::isnan(fold.factor) ? fold.factor : out[d] * fold.factor;
  }
  return fold.lse;
}

void cpu_reference_rows(const AttentionProblem& problem, std::span<const ReferenceRow> rows,
                        std::vector<double>* o_out, std::vector<double>* lse_out) {
  const int32_t head_dim = problem.head_dim_v();
  o_out->assign(rows.size() * head_dim, 0.0);
  lse_out->assign(rows.size(), 0.0);
  std::vector<float> keys, values;
  int32_t loaded_request = -1, loaded_head = -1;
  for (size_t r = 0; r < rows.size(); ++r) {
    const ReferenceRow& row = rows[r];
    const int32_t kv_head = row.qo_head / problem.group_size();
    if (row.request != loaded_request || kv_head != loaded_head) {
      reference_load_kv(problem, false, row.request, kv_head, &keys);
      reference_load_kv(problem, true, row.request, kv_head, &values);
      loaded_request = row.request;
      loaded_head = kv_head;
    }
    (*lse_out)[r] = reference_row(problem, row.request, row.token, row.qo_head, keys.data(),
                                  values.data(), o_out->data() + r * head_dim);
  }
}

}  // namespace tessera::detail
