// Random cascade cases and their double-precision reference (cascade_testing.hpp).
#include "common/cascade_testing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>

#include "core/half.hpp"

namespace tessera::test {
namespace {

int32_t draw(std::mt19937_64& rng, int32_t low, int32_t high) {  // inclusive
  return std::uniform_int_distribution<int32_t>(low, high)(rng);
}

std::vector<int32_t> prefix_sum(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> indptr(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), indptr.begin() + 1);
  return indptr;
}

// Group of level l that holds request b.
size_t group_of(const CascadeCase& c, int l, int32_t b) {
  const std::vector<int32_t>& g = c.groups[static_cast<size_t>(l)];
  return static_cast<size_t>(std::upper_bound(g.begin(), g.end(), b) - g.begin()) - 1;
}

}  // namespace

int64_t CascadeCase::total_q() const {
  return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
}

std::string CascadeCase::describe() const {
  std::ostringstream out;
  out << "cascade " << num_levels() << " levels, heads " << num_qo_heads << "/" << num_kv_heads
      << " d" << head_dim << " page " << page_size << " " << dtype_name(dtype)
      << (layout == KVLayout::kNHD ? " NHD" : " HND") << (causal ? " causal" : "")
      << (soft_cap > 0 ? " soft-cap" : "") << (with_sinks ? " sinks" : "")
      << (with_lse ? "" : " no-lse") << ", q_lens [";
  for (int32_t q : q_lens) out << q << " ";
  out << "]";
  for (int l = 0; l < num_levels(); ++l) {
    out << ", level " << l << " groups [";
    for (int32_t g : groups[static_cast<size_t>(l)]) out << g << " ";
    out << "] kv [";
    for (int32_t k : kv_lens[static_cast<size_t>(l)]) out << k << " ";
    out << "]";
  }
  return out.str();
}

CascadeCase random_cascade_case(std::mt19937_64& rng, const RandomCascadeOptions& options) {
  CascadeCase c;
  static constexpr int32_t kHeads[][2] = {{4, 4}, {8, 2}, {8, 1}, {6, 3}, {16, 2}};
  const auto& heads = kHeads[draw(rng, 0, 4)];
  c.num_qo_heads = heads[0];
  c.num_kv_heads = heads[1];
  static constexpr int32_t kDims[] = {64, 128, 64, 256};
  c.head_dim = kDims[draw(rng, 0, 3)];
  static constexpr int32_t kPages[] = {1, 7, 16, 64, 128};
  c.page_size = kPages[draw(rng, 0, 4)];
  c.dtype = options.dtypes[static_cast<size_t>(
      draw(rng, 0, static_cast<int32_t>(options.dtypes.size()) - 1))];
  c.layout = draw(rng, 0, 1) ? KVLayout::kHND : KVLayout::kNHD;
  c.causal = draw(rng, 0, 1) == 1;
  c.soft_cap = draw(rng, 0, 3) == 0 ? 2.0f : 0.0f;
  c.with_sinks = draw(rng, 0, 2) == 0;
  c.with_lse = draw(rng, 0, 4) != 0;
  const int32_t batch = draw(rng, 1, options.max_batch);
  for (int32_t b = 0; b < batch; ++b) {
    c.q_lens.push_back(options.decode_only ? 1 : draw(rng, 0, options.max_q_len));
  }
  const int levels = draw(rng, 1, 3);
  // Upper levels: nested partitions of the requests (each refines the one above).
  std::set<int32_t> cuts = {0, batch};
  for (int l = 0; l + 1 < levels; ++l) {
    if (batch > 1 && draw(rng, 0, 1)) cuts.insert(draw(rng, 1, batch - 1));
    c.groups.emplace_back(cuts.begin(), cuts.end());
    std::vector<int32_t> kv;
    for (size_t g = 0; g + 1 < c.groups.back().size(); ++g) {
      kv.push_back(draw(rng, 0, 5) == 0 ? 0 : draw(rng, 1, options.max_prefix_len));
    }
    c.kv_lens.push_back(kv);
  }
  std::vector<int32_t> own(static_cast<size_t>(batch) + 1);
  std::iota(own.begin(), own.end(), 0);
  c.groups.push_back(own);
  std::vector<int32_t> kv;
  for (int32_t b = 0; b < batch; ++b) {
    kv.push_back(draw(rng, 0, 6) == 0 ? 0 : draw(rng, 1, options.max_own_len));
  }
  c.kv_lens.push_back(kv);
  return c;
}

std::vector<CascadeLevelLengths> CascadeData::lengths() const {
  std::vector<CascadeLevelLengths> levels;
  for (size_t l = 0; l < qo_indptr.size(); ++l) {
    levels.push_back({qo_indptr[l], page_indptr[l], last_page_len[l]});
  }
  return levels;
}

std::vector<int64_t> CascadeData::pool_shape() const {
  const CascadeCase& c = test_case;
  if (c.layout == KVLayout::kNHD) return {num_pages, c.page_size, c.num_kv_heads, c.head_dim};
  return {num_pages, c.num_kv_heads, c.page_size, c.head_dim};
}

CascadeData make_cascade_data(const CascadeCase& c, std::mt19937_64& rng) {
  CascadeData data;
  data.test_case = c;
  std::vector<std::vector<int32_t>> pages_of;  // per (level, group), flattened below
  int64_t needed = 0;
  for (int l = 0; l < c.num_levels(); ++l) {
    for (int32_t len : c.kv_lens[static_cast<size_t>(l)])
      needed += (len + c.page_size - 1) / c.page_size;
  }
  const int64_t spare = draw(rng, 0, 3);
  data.num_pages = needed + spare;
  std::vector<int32_t> order(static_cast<size_t>(data.num_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const size_t elem = dtype_size(c.dtype);
  const int64_t page_elems = int64_t{c.page_size} * c.num_kv_heads * c.head_dim;
  const int64_t pool_elems = data.num_pages * page_elems;
  data.k_pool.resize(static_cast<size_t>(pool_elems) * elem);
  data.v_pool.resize(static_cast<size_t>(pool_elems) * elem);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < pool_elems; ++i) {  // NaN until a visible key is written
    detail::store_from_float(data.k_pool.data(), c.dtype, i, nan);
    detail::store_from_float(data.v_pool.data(), c.dtype, i, nan);
  }
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  size_t next = 0;
  for (int l = 0; l < c.num_levels(); ++l) {
    const std::vector<int32_t>& kv = c.kv_lens[static_cast<size_t>(l)];
    const std::vector<int32_t>& groups = c.groups[static_cast<size_t>(l)];
    std::vector<int32_t> q_per_group;
    for (size_t g = 0; g + 1 < groups.size(); ++g) {
      int32_t rows = 0;
      for (int32_t b = groups[g]; b < groups[g + 1]; ++b) rows += c.q_lens[static_cast<size_t>(b)];
      q_per_group.push_back(rows);
    }
    data.qo_indptr.push_back(prefix_sum(q_per_group));
    std::vector<int32_t> indptr = {0}, indices, last;
    for (int32_t len : kv) {
      const int32_t pages = (len + c.page_size - 1) / c.page_size;
      for (int32_t p = 0; p < pages; ++p) indices.push_back(order[next++]);
      indptr.push_back(static_cast<int32_t>(indices.size()));
      last.push_back(pages == 0 ? 1 : len - (pages - 1) * c.page_size);
      for (int32_t j = 0; j < len; ++j) {
        const int64_t page =
            indices[static_cast<size_t>(indptr[indptr.size() - 2] + j / c.page_size)];
        const int64_t slot = j % c.page_size;
        for (int32_t h = 0; h < c.num_kv_heads; ++h) {
          const int64_t row = c.layout == KVLayout::kNHD
                                  ? (page * c.page_size + slot) * c.num_kv_heads + h
                                  : (page * c.num_kv_heads + h) * c.page_size + slot;
          for (int32_t d = 0; d < c.head_dim; ++d) {
            detail::store_from_float(data.k_pool.data(), c.dtype, row * c.head_dim + d, value(rng));
            detail::store_from_float(data.v_pool.data(), c.dtype, row * c.head_dim + d, value(rng));
          }
        }
      }
    }
    data.page_indptr.push_back(indptr);
    data.page_indices.push_back(indices.empty() ? std::vector<int32_t>{0} : indices);
    data.last_page_len.push_back(last);
  }
  const int64_t q_elems = c.total_q() * c.num_qo_heads * c.head_dim;
  data.q.resize(static_cast<size_t>(std::max<int64_t>(q_elems, 1)) * elem);
  for (int64_t i = 0; i < q_elems; ++i) {
    detail::store_from_float(data.q.data(), c.dtype, i, 2.0f * value(rng));
  }
  if (c.with_sinks) {
    std::normal_distribution<float> sink(0.0f, 2.0f);
    for (int32_t h = 0; h < c.num_qo_heads; ++h) data.sinks.push_back(sink(rng));
  }
  return data;
}

CascadeExpected reference_cascade(const CascadeData& data) {
  const CascadeCase& c = data.test_case;
  const int64_t total_q = c.total_q();
  const int32_t hq = c.num_qo_heads, hk = c.num_kv_heads, dim = c.head_dim;
  const int32_t group = hq / hk;
  CascadeExpected expected;
  expected.o.assign(static_cast<size_t>(total_q * hq * dim), 0.0);
  expected.lse.assign(static_cast<size_t>(total_q * hq), 0.0);
  expected.empty.assign(static_cast<size_t>(total_q * hq), 0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  auto key_row = [&](int l, size_t g, int32_t j, int32_t h) {
    const int32_t page = data.page_indices[static_cast<size_t>(l)][static_cast<size_t>(
        data.page_indptr[static_cast<size_t>(l)][g] + j / c.page_size)];
    const int64_t slot = j % c.page_size;
    return c.layout == KVLayout::kNHD ? (int64_t{page} * c.page_size + slot) * hk + h
                                      : (int64_t{page} * hk + h) * c.page_size + slot;
  };
  int64_t row = 0;
  for (int32_t b = 0; b < c.batch_size(); ++b) {
    const int32_t q_len = c.q_lens[static_cast<size_t>(b)];
    for (int32_t i = 0; i < q_len; ++i, ++row) {
      for (int32_t h = 0; h < hq; ++h) {
        const int32_t kvh = h / group;
        std::vector<double> scores;
        std::vector<int64_t> rows;
        for (int l = 0; l < c.num_levels(); ++l) {
          const size_t g = group_of(c, l, b);
          const int32_t kv_len = c.kv_lens[static_cast<size_t>(l)][g];
          int32_t end = kv_len;
          if (l + 1 == c.num_levels() && c.causal) end = std::min(kv_len, i + kv_len - q_len + 1);
          for (int32_t j = 0; j < end; ++j) {
            const int64_t kr = key_row(l, g, j, kvh);
            double s = 0;
            for (int32_t d = 0; d < dim; ++d) {
              s += static_cast<double>(
                       detail::load_as_float(data.q.data(), c.dtype, (row * hq + h) * dim + d)) *
                   detail::load_as_float(data.k_pool.data(), c.dtype, kr * dim + d);
            }
            s *= scale;
            if (c.soft_cap > 0) s = c.soft_cap * std::tanh(s / c.soft_cap);
            scores.push_back(s);
            rows.push_back(kr);
          }
        }
        const size_t out = static_cast<size_t>(row * hq + h);
        const double sink = c.with_sinks ? data.sinks[static_cast<size_t>(h)]
                                         : -std::numeric_limits<double>::infinity();
        if (scores.empty()) {
          expected.empty[out] = 1;
          expected.lse[out] = sink;
          continue;
        }
        const double m = std::max(*std::max_element(scores.begin(), scores.end()), sink);
        double den = std::isinf(sink) ? 0.0 : std::exp(sink - m);
        for (double s : scores) den += std::exp(s - m);
        for (size_t j = 0; j < scores.size(); ++j) {
          const double p = std::exp(scores[j] - m) / den;
          for (int32_t d = 0; d < dim; ++d) {
            expected.o[out * static_cast<size_t>(dim) + static_cast<size_t>(d)] +=
                p * detail::load_as_float(data.v_pool.data(), c.dtype, rows[j] * dim + d);
          }
        }
        expected.lse[out] = m + std::log(den);
      }
    }
  }
  return expected;
}

std::string compare_cascade(const CascadeData& data, const CascadeExpected& expected,
                            const std::vector<uint8_t>& o, const std::vector<float>& lse,
                            double tolerance) {
  const CascadeCase& c = data.test_case;
  const size_t dim = static_cast<size_t>(c.head_dim);
  double err = 0, ref = 0;
  for (size_t r = 0; r < expected.empty.size(); ++r) {
    const bool check_lse = c.with_lse && !lse.empty();
    if (expected.empty[r]) {
      for (size_t d = 0; d < dim; ++d) {
        const float value =
            detail::load_as_float(o.data(), c.dtype, static_cast<int64_t>(r * dim + d));
        if (value != 0.0f)
          return "row " + std::to_string(r) + " saw no key but o = " + std::to_string(value);
      }
      // lse is the sink (or -inf without one): exact for -inf, within float rounding of the
      // sink otherwise (the GPU kernels fold it in float arithmetic).
      const double want = expected.lse[r];
      const double slack = 1e-5 * std::max(1.0, std::abs(want));
      const bool lse_ok = !check_lse || (std::isinf(want) ? lse[r] == static_cast<float>(want)
                                                          : std::abs(lse[r] - want) <= slack);
      if (check_lse && !lse_ok) {
        return "row " + std::to_string(r) + " saw no key but lse = " + std::to_string(lse[r]) +
               ", expected " + std::to_string(expected.lse[r]);
      }
      continue;
    }
    for (size_t d = 0; d < dim; ++d) {
      const double value =
          detail::load_as_float(o.data(), c.dtype, static_cast<int64_t>(r * dim + d));
      if (!std::isfinite(value)) return "row " + std::to_string(r) + " o is not finite";
      const double want = expected.o[r * dim + d];
      err += (value - want) * (value - want);
      ref += want * want;
    }
    if (check_lse && !(std::fabs(lse[r] - expected.lse[r]) <= 1e-2)) {
      return "row " + std::to_string(r) + " lse = " + std::to_string(lse[r]) + ", expected " +
             std::to_string(expected.lse[r]);
    }
  }
  const double rel = std::sqrt(err / std::max(ref, 1e-30));
  if (ref > 0 && !(rel < tolerance)) return "relative L2 of o " + std::to_string(rel);
  return "";
}

}  // namespace tessera::test
