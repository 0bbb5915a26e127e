#include "common/nonfinite_testing.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "common/api_runner.hpp"
#include "core/half.hpp"

namespace tessera::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const char* kind_name(RowKind kind) {
  switch (kind) {
    case RowKind::kClean: return "clean";
    case RowKind::kNaN: return "NaN";
    case RowKind::kEmpty: return "empty";
    case RowKind::kFeature: return "feature";
    case RowKind::kChanged: return "changed";
    case RowKind::kMaskedFeature: return "clean or masked feature";
  }
  return "?";
}

// Element offsets of the case's tensors (host buffers; valid for device copies alike).
struct Offsets {
  const AttentionBuffers& buffers;
  detail::AttentionProblem problem;

  explicit Offsets(AttentionBuffers& b) : buffers(b), problem(make_problem(b)) {}
  int64_t q(int32_t request, int32_t token, int32_t head, int32_t dim) const {
    return (static_cast<int64_t>(buffers.qo_indptr[request]) + token) * buffers.q_stride_token +
           head * buffers.q_stride_head + dim;
  }
  int64_t k(int32_t request, int32_t key, int32_t head, int32_t dim) const {
    return problem.kv.k_offset(request, head, key) + dim;
  }
  int64_t v(int32_t request, int32_t key, int32_t head, int32_t dim) const {
    return problem.kv.v_offset(request, head, key) + dim;
  }
};

void set(std::vector<uint8_t>* bytes, DType dtype, int64_t offset, float value) {
  detail::store_from_float(bytes->data(), dtype, offset, value);
}
float get(const std::vector<uint8_t>& bytes, DType dtype, int64_t offset) {
  return detail::load_as_float(bytes.data(), dtype, offset);
}

PoisonSite choose_site(const AttentionCase& c) {
  PoisonSite site;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    if (c.q_lens[b] > 0 && c.kv_lens[b] > c.kv_lens[site.request]) site.request = b;
  }
  const int32_t q_len = c.q_lens[site.request], kv_len = c.kv_lens[site.request];
  site.kv_head = c.num_kv_heads - 1;
  site.qo_head = site.kv_head * c.group_size() + c.group_size() - 1;
  site.dim = c.head_dim - 3;
  site.token = q_len - 1;  // sees every key under a causal mask too
  // The diagonal key of the middle query: under a causal mask the earlier rows do not see it.
  site.key = std::clamp(kv_len - q_len + q_len / 2, 0, kv_len - 1);
  const detail::MaskSpec mask = c.mask();
  for (int32_t b = 0; b < c.batch_size() && site.empty_request < 0; ++b) {
    for (int32_t i = 0; i < c.q_lens[b]; ++i) {
      int32_t first = 0, last = 0;
      mask.visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
      if (first >= last) {
        site.empty_request = b;
        site.empty_token = i;
        break;
      }
    }
  }
  return site;
}

bool q_poison(Poison poison) {
  return poison == Poison::kQNaN || poison == Poison::kQPosInf || poison == Poison::kQNegInf;
}

// Signs the definition needs: q . k must be +inf (or -inf) at the site's dim.
void force_signs(const AttentionCase& c, const PoisonSite& site, Poison poison,
                 AttentionBuffers* buffers) {
  const Offsets at(*buffers);
  const int32_t b = site.request;
  if (poison == Poison::kQPosInf || poison == Poison::kQNegInf) {
    for (int32_t j = 0; j < c.kv_lens[b]; ++j) {
      const int64_t offset = at.k(b, j, site.kv_head, site.dim);
      set(&buffers->k, c.kv_dtype, offset, std::fabs(get(buffers->k, c.kv_dtype, offset)));
    }
  }
  if (poison == Poison::kKPosInf || poison == Poison::kKNegInfKey ||
      poison == Poison::kAllScoresNegInf || poison == Poison::kVInfZeroWeight) {
    const int32_t group = c.group_size();
    for (int32_t i = 0; i < c.q_lens[b]; ++i) {
      for (int32_t h = site.kv_head * group; h < (site.kv_head + 1) * group; ++h) {
        const int64_t offset = at.q(b, i, h, site.dim);
        set(&buffers->q, c.q_dtype, offset, std::fabs(get(buffers->q, c.q_dtype, offset)));
      }
    }
  }
}

void put_bad_value(const AttentionCase& c, const PoisonSite& site, Poison poison,
                   AttentionBuffers* buffers) {
  const Offsets at(*buffers);
  const int32_t b = site.request;
  const float q_value =
      poison == Poison::kQNaN ? kNaN : (poison == Poison::kQPosInf ? kInf : -kInf);
  switch (poison) {
    case Poison::kQNaN:
    case Poison::kQPosInf:
    case Poison::kQNegInf:
      set(&buffers->q, c.q_dtype, at.q(b, site.token, site.qo_head, site.dim), q_value);
      if (site.empty_request >= 0) {
        set(&buffers->q, c.q_dtype,
            at.q(site.empty_request, site.empty_token, site.qo_head, site.dim), q_value);
      }
      return;
    case Poison::kKNaN:
    case Poison::kKPosInf:
    case Poison::kKNegInfKey:
      set(&buffers->k, c.kv_dtype, at.k(b, site.key, site.kv_head, site.dim),
          poison == Poison::kKNaN ? kNaN : (poison == Poison::kKPosInf ? kInf : -kInf));
      return;
    case Poison::kAllScoresNegInf:
      for (int32_t j = 0; j < c.kv_lens[b]; ++j) {
        set(&buffers->k, c.kv_dtype, at.k(b, j, site.kv_head, site.dim), -kInf);
      }
      return;
    case Poison::kVNaN:
    case Poison::kVInf:
      set(&buffers->v, c.kv_dtype, at.v(b, site.key, site.kv_head, site.dim),
          poison == Poison::kVNaN ? kNaN : kInf);
      return;
    case Poison::kVInfZeroWeight:
      set(&buffers->k, c.kv_dtype, at.k(b, site.key, site.kv_head, site.dim), -kInf);
      set(&buffers->v, c.kv_dtype, at.v(b, site.key, site.kv_head, site.dim), kInf);
      return;
  }
}

// What row (request b, token i, query head h) must hold, from the definition.
RowExpectation expect_row(const AttentionCase& c, const PoisonSite& site, Poison poison, int32_t b,
                          int32_t i, int32_t h) {
  RowExpectation e;
  int32_t first = 0, last = 0;
  c.mask().visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
  if (first >= last) {
    e.kind = RowKind::kEmpty;  // whatever q holds
    return e;
  }
  const bool site_row = b == site.request && i == site.token && h == site.qo_head;
  const bool site_group = b == site.request && h / c.group_size() == site.kv_head;
  const bool sees_key = site_group && first <= site.key && site.key < last;
  const bool only_key = sees_key && last - first == 1;
  switch (poison) {
    case Poison::kQNaN:
    case Poison::kQPosInf:
      if (site_row) e.kind = RowKind::kNaN;
      break;
    case Poison::kQNegInf:
      if (site_row) e.kind = RowKind::kEmpty;
      break;
    case Poison::kKNaN:
    case Poison::kKPosInf:
      if (sees_key) e.kind = RowKind::kNaN;
      break;
    case Poison::kKNegInfKey:
      if (sees_key) e.kind = only_key ? RowKind::kEmpty : RowKind::kChanged;
      break;
    case Poison::kAllScoresNegInf:
      if (site_group) e.kind = RowKind::kEmpty;
      break;
    case Poison::kVNaN:
    case Poison::kVInf:
      if (sees_key) {
        e.kind = RowKind::kFeature;
        e.feature_nan = poison == Poison::kVNaN;
        e.or_nan = true;
      } else if (site_group) {
        e.kind = RowKind::kMaskedFeature;  // masked out: clean, or 0 * NaN / inf in its tile
      }
      break;
    case Poison::kVInfZeroWeight:
      if (sees_key) {
        e.kind = only_key ? RowKind::kEmpty : RowKind::kFeature;
        e.feature_nan = true;  // 0 * inf
        e.versus_poisoned = true;
        e.or_dropped = true;
      } else if (site_group) {
        e.kind = RowKind::kMaskedFeature;
      }
      break;
  }
  return e;
}

}  // namespace

const char* poison_name(Poison poison) {
  switch (poison) {
    case Poison::kQNaN: return "QNaN";
    case Poison::kQPosInf: return "QPosInf";
    case Poison::kQNegInf: return "QNegInf";
    case Poison::kKNaN: return "KNaN";
    case Poison::kKPosInf: return "KPosInf";
    case Poison::kKNegInfKey: return "KNegInfKey";
    case Poison::kAllScoresNegInf: return "AllScoresNegInf";
    case Poison::kVNaN: return "VNaN";
    case Poison::kVInf: return "VInf";
    case Poison::kVInfZeroWeight: return "VInfZeroWeight";
  }
  return "?";
}

int64_t NonfiniteCase::count(RowKind kind) const {
  return std::count_if(rows.begin(), rows.end(),
                       [kind](const RowExpectation& e) { return e.kind == kind; });
}

std::string NonfiniteCase::describe() const {
  std::ostringstream text;
  text << poison_name(poison) << " at request " << site.request << " token " << site.token
       << " qo_head " << site.qo_head << " key " << site.key << " kv_head " << site.kv_head
       << " dim " << site.dim << " (empty row: request " << site.empty_request << " token "
       << site.empty_token << "); rows NaN " << count(RowKind::kNaN) << ", empty "
       << count(RowKind::kEmpty) << ", feature " << count(RowKind::kFeature) << ", changed "
       << count(RowKind::kChanged) << ", masked " << count(RowKind::kMaskedFeature) << ", clean "
       << count(RowKind::kClean) << " (touched "
       << touched << "); " << clean.test_case.describe();
  return text.str();
}

std::string NonfiniteShape::describe() const {
  std::ostringstream text;
  text << (decode ? "decode" : (paged ? "paged" : "ragged"));
  if (paged || decode) text << " page " << page_size;
  if (decode) text << " q/request " << q_per_request;
  text << (causal ? " causal" : "") << " group " << group_size << " d" << head_dim << " "
       << dtype_name(dtype);
  if (long_kv > 0) text << " kv " << long_kv;
  if (long_q > 0) text << " q " << long_q;
  return text.str();
}

AttentionCase nonfinite_shape(const NonfiniteShape& shape) {
  AttentionCase c;
  c.num_kv_heads = 2;
  c.num_qo_heads = 2 * shape.group_size;
  c.head_dim = shape.head_dim;
  c.q_dtype = c.kv_dtype = shape.dtype;
  c.paged = shape.paged || shape.decode;
  c.page_size = shape.page_size;
  c.spare_pages = c.paged ? 2 : 0;  // NaN-filled: reading one shows up
  c.causal = shape.causal;
  // Request 0 sees no key, request 1 is the site, request 2 has fewer keys than queries.
  const int32_t site_kv = shape.long_kv > 0 ? shape.long_kv : 70;
  c.kv_lens = {0, site_kv, 2};
  if (shape.decode) {
    c.uniform_q = true;
    c.q_lens.assign(3, shape.q_per_request);
  } else {
    c.q_lens = {3, shape.long_q > 0 ? shape.long_q : 21, 4};
  }
  // NaN-filled stride padding (multiples of 8: 16-byte rows for the GPU copies).
  c.q_head_pad = 8;
  c.kv_token_pad = 8;
  c.o_token_pad = 8;
  return c;
}

NonfiniteCase make_nonfinite_case(const AttentionCase& c, Poison poison, std::mt19937_64& rng) {
  NonfiniteCase out;
  out.poison = poison;
  out.site = choose_site(c);
  out.clean = make_buffers(c, rng);
  force_signs(c, out.site, poison, &out.clean);
  out.poisoned = out.clean;
  put_bad_value(c, out.site, poison, &out.poisoned);
  if (!q_poison(poison)) out.site.empty_request = out.site.empty_token = -1;
  out.rows.assign(static_cast<size_t>(c.total_q() * c.num_qo_heads), {});
  int64_t token = 0;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    for (int32_t i = 0; i < c.q_lens[b]; ++i, ++token) {
      for (int32_t h = 0; h < c.num_qo_heads; ++h) {
        const RowExpectation e = expect_row(c, out.site, poison, b, i, h);
        out.rows[token * c.num_qo_heads + h] = e;
        int32_t first = 0, last = 0;
        c.mask().visible_range(i, c.q_lens[b], c.kv_lens[b], &first, &last);
        if (first < last && e.kind != RowKind::kClean && e.kind != RowKind::kMaskedFeature) {
          ++out.touched;
        }
      }
    }
  }
  return out;
}

NonfiniteReference nonfinite_reference(NonfiniteCase& c) {
  NonfiniteReference reference;
  reference.clean = run_reference(c.clean);
  reference.poisoned = run_reference(c.poisoned);
  return reference;
}

namespace {

// Reads row (token, head) of a run's outputs.
struct RowView {
  const AttentionBuffers& buffers;
  const Outputs& out;
  float o(int64_t token, int32_t head, int32_t d) const {
    return get(out.o, buffers.test_case.q_dtype,
               token * buffers.o_stride_token + head * buffers.o_stride_head + d);
  }
  float lse(int64_t token, int32_t head) const {
    if (!buffers.test_case.with_lse) return 0.0f;
    float value = 0;
    std::memcpy(&value, out.lse.data() + (token * buffers.lse_stride_token + head) * sizeof(float),
                sizeof value);
    return value;
  }
  bool same_bits(const Outputs& other, int64_t token, int32_t head) const {
    const size_t element = dtype_size(buffers.test_case.q_dtype);
    const size_t o_at = (token * buffers.o_stride_token + head * buffers.o_stride_head) * element;
    if (std::memcmp(out.o.data() + o_at, other.o.data() + o_at,
                    element * buffers.test_case.head_dim) != 0) {
      return false;
    }
    if (!buffers.test_case.with_lse) return true;
    const size_t lse_at = (token * buffers.lse_stride_token + head) * sizeof(float);
    return std::memcmp(out.lse.data() + lse_at, other.lse.data() + lse_at, sizeof(float)) == 0;
  }
};

// One row's check; returns "" or what is wrong. Adds its compared features to the sums.
std::string check_row(const NonfiniteCase& c, const RowExpectation& expected, const RowView& actual,
                      const RowView& clean_ref, const RowView& poisoned_ref,
                      const Outputs* clean_run, int64_t token, int32_t h, double lse_tolerance,
                      double* diff_sq, double* ref_sq) {
  const AttentionCase& shape = c.poisoned.test_case;
  RowExpectation e = expected;
  if (e.kind == RowKind::kMaskedFeature) {
    // The definition allows either: as without the bad value, or NaN in its feature alone.
    e.kind = std::isnan(actual.o(token, h, c.site.dim)) ? RowKind::kFeature : RowKind::kClean;
    e.feature_nan = true;
    e.versus_poisoned = false;
  }
  const float lse = actual.lse(token, h);
  std::ostringstream why;
  if (e.kind == RowKind::kNaN || e.kind == RowKind::kEmpty) {
    const bool nan = e.kind == RowKind::kNaN;
    for (int32_t d = 0; d < shape.head_dim; ++d) {
      const float o = actual.o(token, h, d);
      if (nan ? !std::isnan(o) : o != 0.0f) {
        why << "o[" << d << "] = " << o;
        return why.str();
      }
    }
    if (shape.with_lse && (nan ? !std::isnan(lse) : lse != -kInf)) {
      why << "lse = " << lse;
      return why.str();
    }
    return "";
  }
  if (e.kind == RowKind::kClean && clean_run != nullptr &&
      !actual.same_bits(*clean_run, token, h)) {
    return "differs from the run without the bad value";
  }
  const bool versus_poisoned = e.kind == RowKind::kChanged || e.versus_poisoned;
  const RowView& ref = versus_poisoned ? poisoned_ref : clean_ref;
  for (int32_t d = 0; d < shape.head_dim; ++d) {
    const float o = actual.o(token, h, d);
    if (e.kind == RowKind::kFeature && d == c.site.dim) {
      // or_dropped: a finite value there is the key's drop, which the other features (against
      // the poisoned reference, where the key has weight 0) already show.
      if (e.or_dropped && std::isfinite(o)) continue;
      if (e.feature_nan ? !std::isnan(o) : !(o == kInf || (e.or_nan && std::isnan(o)))) {
        why << "o[" << d << "] = " << o << ", expected " << (e.feature_nan ? "NaN" : "+inf");
        return why.str();
      }
      continue;
    }
    const double r = ref.o(token, h, d);
    if (!std::isfinite(o) || !std::isfinite(r)) {
      why << "o[" << d << "] = " << o << " (reference " << r << ")";
      return why.str();
    }
    *diff_sq += (o - r) * (o - r);
    *ref_sq += r * r;
  }
  const float ref_lse = ref.lse(token, h);
  if (shape.with_lse && !(std::isfinite(lse) && std::fabs(lse - ref_lse) <= lse_tolerance)) {
    why << "lse = " << lse << " (reference " << ref_lse << ")";
    return why.str();
  }
  return "";
}

}  // namespace

std::string check_nonfinite(const NonfiniteCase& c, const Outputs& actual, const Outputs* clean_run,
                            const NonfiniteReference& reference, double tolerance,
                            double lse_tolerance) {
  const AttentionCase& shape = c.poisoned.test_case;
  const RowView out{c.poisoned, actual};
  const RowView clean_ref{c.clean, reference.clean};
  const RowView poisoned_ref{c.poisoned, reference.poisoned};
  std::ostringstream failures;
  int bad_rows = 0;
  double diff_sq = 0.0, ref_sq = 0.0;
  for (int64_t token = 0; token < shape.total_q(); ++token) {
    for (int32_t h = 0; h < shape.num_qo_heads; ++h) {
      const RowExpectation& e = c.rows[token * shape.num_qo_heads + h];
      const std::string why = check_row(c, e, out, clean_ref, poisoned_ref, clean_run, token, h,
                                        lse_tolerance, &diff_sq, &ref_sq);
      if (why.empty()) continue;
      if (++bad_rows <= 6) {
        failures << "\n    row token " << token << " head " << h << " (expected "
                 << kind_name(e.kind) << "): " << why;
      }
    }
  }
  const double rel_l2 = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  if (!(rel_l2 < tolerance)) failures << "\n    rel L2 " << rel_l2 << " >= " << tolerance;
  const int64_t padding = compare_outputs(c.poisoned, actual, reference.poisoned).padding_writes;
  if (padding != 0) failures << "\n    " << padding << " writes to stride padding";
  if (bad_rows > 6) failures << "\n    ... " << bad_rows << " rows wrong in all";
  const std::string text = failures.str();
  return text.empty() ? text : c.describe() + text;
}

// ---- checked mode ----

std::string checked_key_where(const NonfiniteCase& c) {
  const AttentionBuffers& b = c.poisoned;
  const AttentionCase& shape = b.test_case;
  const int32_t key = c.site.key, request = c.site.request;
  std::string where;
  if (shape.paged) {
    const int32_t page = b.page_indices[b.page_indptr[request] + key / shape.page_size];
    where = "page " + std::to_string(page) + ", token " + std::to_string(key % shape.page_size);
  } else {
    where = "row " + std::to_string(b.kv_indptr[request] + key);
  }
  return where + " (request " + std::to_string(request) + ", key " + std::to_string(key) +
         "), head " + std::to_string(c.site.kv_head) + ", dim " + std::to_string(c.site.dim);
}

std::string checked_message(const NonfiniteCase& c) {
  const AttentionCase& shape = c.poisoned.test_case;
  const AttentionOp op = op_of(shape);
  const std::string prefix =
      std::string("tessera::") +
      (op == AttentionOp::kDecode
           ? "run_decode"
           : (op == AttentionOp::kPagedPrefill ? "run_paged_prefill" : "run_ragged_prefill")) +
      ": ";
  const std::string k = shape.paged ? "'k_cache'" : "'k'", v = shape.paged ? "'v_cache'" : "'v'";
  switch (c.poison) {
    case Poison::kQNaN:
    case Poison::kQPosInf:
    case Poison::kQNegInf: {
      const int32_t token = c.poisoned.qo_indptr[c.site.request] + c.site.token;
      const char* value =
          c.poison == Poison::kQNaN ? "nan" : (c.poison == Poison::kQPosInf ? "inf" : "-inf");
      return prefix + "'q': non-finite value " + value + " at token " + std::to_string(token) +
             " (request " + std::to_string(c.site.request) + ", query " +
             std::to_string(c.site.token) + "), head " + std::to_string(c.site.qo_head) + ", dim " +
             std::to_string(c.site.dim);
    }
    case Poison::kKNaN: return prefix + k + ": non-finite value nan at " + checked_key_where(c);
    case Poison::kKPosInf: return prefix + k + ": non-finite value inf at " + checked_key_where(c);
    case Poison::kKNegInfKey:
    case Poison::kVInfZeroWeight:
      return prefix + k + ": non-finite value -inf at " + checked_key_where(c);
    case Poison::kVNaN: return prefix + v + ": non-finite value nan at " + checked_key_where(c);
    case Poison::kVInf: return prefix + v + ": non-finite value inf at " + checked_key_where(c);
    case Poison::kAllScoresNegInf:  // every key: the first one the rows see
      break;
  }
  return "";
}

// ---- merges ----

MergeStateCase merge_state_case() {
  const std::vector<std::array<float, 3>> rows = {
      // lse_a, lse_b, o_a[..][3] (0: as drawn)
      {kNaN, 0.5f, 0}, {0.5f, kNaN, 0},    {kNaN, -kInf, 0},   {-kInf, -kInf, 0},
      {kInf, 0.5f, 0}, {0.2f, 0.7f, kNaN}, {0.2f, 0.7f, kInf}, {0.3f, -kInf, 0}};
  MergeStateCase m;
  m.n = static_cast<int64_t>(rows.size());
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  m.o_a.resize(m.n * m.h * m.d);
  m.o_b.resize(m.n * m.h * m.d);
  for (float& x : m.o_a) x = value(rng);
  for (float& x : m.o_b) x = value(rng);
  for (int64_t r = 0; r < m.n; ++r) {
    for (int64_t j = 0; j < m.h; ++j) {
      m.lse_a.push_back(rows[r][0]);
      m.lse_b.push_back(rows[r][1]);
      if (rows[r][2] != 0.0f) m.o_a[(r * m.h + j) * m.d + 3] = rows[r][2];
      if (rows[r][0] == -kInf) m.o_a[(r * m.h + j) * m.d + 5] = kNaN;  // empty: never read
      if (rows[r][1] == -kInf) m.o_b[(r * m.h + j) * m.d + 5] = kNaN;
    }
  }
  return m;
}

std::string check_merge_state(const MergeStateCase& m, const std::vector<float>& o,
                              const std::vector<float>& lse) {
  std::ostringstream why;
  for (int64_t j = 0; j < m.h; ++j) {
    auto at = [&](int64_t r, int64_t f) { return o[(r * m.h + j) * m.d + f]; };
    auto lse_at = [&](int64_t r) { return lse[r * m.h + j]; };
    for (int64_t r : {0, 1, 2, 4}) {  // a NaN (or +inf) state: the row is NaN
      if (!std::isnan(lse_at(r))) why << " row " << r << " lse " << lse_at(r) << ";";
      for (int64_t f = 0; f < m.d; ++f) {
        if (!std::isnan(at(r, f))) why << " row " << r << " o[" << f << "] " << at(r, f) << ";";
      }
    }
    if (lse_at(3) != -kInf) why << " row 3 lse " << lse_at(3) << ";";
    for (int64_t f = 0; f < m.d; ++f) {
      if (at(3, f) != 0.0f) why << " row 3 o[" << f << "] " << at(3, f) << ";";
    }
    for (int64_t r : {5, 6}) {  // NaN / inf in one feature of a finite state
      if (!std::isfinite(lse_at(r))) why << " row " << r << " lse " << lse_at(r) << ";";
      for (int64_t f = 0; f < m.d; ++f) {
        const bool ok =
            f != 3 ? std::isfinite(at(r, f)) : (r == 5 ? std::isnan(at(r, f)) : at(r, f) == kInf);
        if (!ok) why << " row " << r << " o[" << f << "] " << at(r, f) << ";";
      }
    }
    if (lse_at(7) != 0.3f) why << " row 7 lse " << lse_at(7) << ";";
    for (int64_t f = 0; f < m.d; ++f) {
      const float expected = m.o_a[(7 * m.h + j) * m.d + f];
      if (std::fabs(at(7, f) - expected) > 1e-6f)
        why << " row 7 o[" << f << "] " << at(7, f) << ";";
    }
  }
  return why.str();
}

MergeStatesCase merge_states_case() {
  MergeStatesCase m;
  m.indptr = {0, 2, 5, 7, 9, 11, 14};
  m.lse = {kNaN, kNaN, 0.1f, kNaN, 0.4f, kNaN, -kInf, -kInf, -kInf, kInf, 0.2f, 0.5f, -kInf, 0.25f};
  m.states.assign(m.lse.size() * m.h * m.d, 0.5f);
  for (size_t s = 0; s < m.lse.size(); ++s) {
    if (m.lse[s] == -kInf) m.states[s * m.d + 1] = kNaN;  // an empty state's o: never read
  }
  return m;
}

std::string check_merge_states(const MergeStatesCase& m, const std::vector<float>& o,
                               const std::vector<float>& lse) {
  std::ostringstream why;
  const int64_t d = m.d;
  for (int64_t r : {0, 1, 2, 4}) {
    if (!std::isnan(lse[r])) why << " row " << r << " lse " << lse[r] << ";";
    for (int64_t f = 0; f < d; ++f) {
      if (!std::isnan(o[r * d + f]))
        why << " row " << r << " o[" << f << "] " << o[r * d + f] << ";";
    }
  }
  if (lse[3] != -kInf) why << " row 3 lse " << lse[3] << ";";
  for (int64_t f = 0; f < d; ++f) {
    if (o[3 * d + f] != 0.0f) why << " row 3 o[" << f << "] " << o[3 * d + f] << ";";
  }
  const double expected = 0.5 + std::log(1.0 + std::exp(0.25 - 0.5));
  if (std::fabs(lse[5] - expected) > 1e-5) why << " row 5 lse " << lse[5] << ";";
  for (int64_t f = 0; f < d; ++f) {
    if (std::fabs(o[5 * d + f] - 0.5f) > 1e-5f)
      why << " row 5 o[" << f << "] " << o[5 * d + f] << ";";
  }
  return why.str();
}

}  // namespace tessera::test
