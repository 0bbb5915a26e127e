#include "common/mla_testing.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "core/half.hpp"

namespace tessera::test {

std::string MlaCase::describe() const {
  std::ostringstream text;
  text << "mla H" << num_heads << " " << kv_lora_rank << "+" << rope_dim << " page " << page_size
       << " " << dtype_name(dtype) << (causal ? " causal" : "")
       << (combined_cache ? " combined-cache" : "") << (combined_q ? " combined-q" : "")
       << " q/kv:";
  for (size_t b = 0; b < q_lens.size(); ++b) text << " " << q_lens[b] << "/" << kv_lens[b];
  return text.str();
}

namespace {

int64_t q_width(const MlaCase& c) {
  return c.combined_q ? c.kv_lora_rank + c.rope_dim : c.kv_lora_rank;
}
int64_t cache_width(const MlaCase& c) {
  return c.combined_cache ? c.kv_lora_rank + c.rope_dim : c.kv_lora_rank;
}

void fill_nan(std::vector<uint8_t>& bytes, DType dtype) {
  const int64_t n = static_cast<int64_t>(bytes.size() / dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    detail::store_from_float(bytes.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
  }
}

}  // namespace

MlaBuffers make_mla_buffers(const MlaCase& c, std::mt19937_64& rng) {
  MlaBuffers buffers;
  buffers.c = c;
  const size_t batch = c.q_lens.size();
  const size_t element = dtype_size(c.dtype);
  buffers.qo_indptr.assign(1, 0);
  buffers.page_indptr.assign(1, 0);
  for (size_t b = 0; b < batch; ++b) {
    buffers.qo_indptr.push_back(buffers.qo_indptr.back() + c.q_lens[b]);
    const int32_t pages = (c.kv_lens[b] + c.page_size - 1) / c.page_size;
    buffers.page_indptr.push_back(buffers.page_indptr.back() + pages);
    buffers.last_page_len.push_back(pages == 0 ? 0 : c.kv_lens[b] - (pages - 1) * c.page_size);
  }
  buffers.total_q = buffers.qo_indptr.back();
  const int32_t used_pages = buffers.page_indptr.back();
  buffers.num_pages = used_pages + 3;  // spare pages: NaN, never read
  std::vector<int32_t> ids(buffers.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  buffers.page_indices.assign(ids.begin(), ids.begin() + used_pages);

  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random_fill = [&](std::vector<uint8_t>& bytes, int64_t count) {
    bytes.resize(static_cast<size_t>(count) * element);
    for (int64_t i = 0; i < count; ++i)
      detail::store_from_float(bytes.data(), c.dtype, i, normal(rng));
  };
  const int64_t heads = c.num_heads;
  random_fill(buffers.q, buffers.total_q * heads * q_width(c));
  if (!c.combined_q) random_fill(buffers.q_pe_separate, buffers.total_q * heads * c.rope_dim);

  const int64_t rows = buffers.num_pages * c.page_size;
  buffers.cache.resize(static_cast<size_t>(rows * cache_width(c)) * element);
  fill_nan(buffers.cache, c.dtype);
  if (!c.combined_cache) {
    buffers.kpe_separate.resize(static_cast<size_t>(rows * c.rope_dim) * element);
    fill_nan(buffers.kpe_separate, c.dtype);
  }
  for (size_t b = 0; b < batch; ++b) {
    for (int32_t j = 0; j < c.kv_lens[b]; ++j) {
      const int64_t page = buffers.page_indices[buffers.page_indptr[b] + j / c.page_size];
      const int64_t row = page * c.page_size + j % c.page_size;
      for (int64_t d = 0; d < cache_width(c); ++d) {
        detail::store_from_float(buffers.cache.data(), c.dtype, row * cache_width(c) + d,
                                 normal(rng));
      }
      for (int64_t d = 0; d < c.rope_dim && !c.combined_cache; ++d) {
        detail::store_from_float(buffers.kpe_separate.data(), c.dtype, row * c.rope_dim + d,
                                 normal(rng));
      }
    }
  }
  buffers.o.resize(static_cast<size_t>(buffers.total_q * heads * c.kv_lora_rank) * element);
  buffers.lse.resize(static_cast<size_t>(buffers.total_q * heads));
  buffers.poison_outputs();
  return buffers;
}

void MlaBuffers::poison_outputs() {
  fill_nan(o, c.dtype);
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
}

TensorView MlaBuffers::q_nope() const {
  const int64_t w = q_width(c);
  return make_view(const_cast<uint8_t*>(q.data()), c.dtype, {total_q, c.num_heads, c.kv_lora_rank},
                   {c.num_heads * w, w, 1});
}

TensorView MlaBuffers::q_pe() const {
  if (c.rope_dim == 0) return {};
  if (!c.combined_q) {
    return make_view(const_cast<uint8_t*>(q_pe_separate.data()), c.dtype,
                     {total_q, c.num_heads, c.rope_dim});
  }
  const int64_t w = q_width(c);
  return make_view(const_cast<uint8_t*>(q.data()) + c.kv_lora_rank * dtype_size(c.dtype), c.dtype,
                   {total_q, c.num_heads, c.rope_dim}, {c.num_heads * w, w, 1});
}

TensorView MlaBuffers::ckv_cache() const {
  const int64_t w = cache_width(c);
  return make_view(const_cast<uint8_t*>(cache.data()), c.dtype,
                   {num_pages, c.page_size, c.kv_lora_rank}, {c.page_size * w, w, 1});
}

TensorView MlaBuffers::kpe_cache() const {
  if (c.rope_dim == 0) return {};
  if (!c.combined_cache) {
    return make_view(const_cast<uint8_t*>(kpe_separate.data()), c.dtype,
                     {num_pages, c.page_size, c.rope_dim});
  }
  const int64_t w = cache_width(c);
  return make_view(const_cast<uint8_t*>(cache.data()) + c.kv_lora_rank * dtype_size(c.dtype),
                   c.dtype, {num_pages, c.page_size, c.rope_dim}, {c.page_size * w, w, 1});
}

TensorView MlaBuffers::o_view() const {
  return make_view(const_cast<uint8_t*>(o.data()), c.dtype, {total_q, c.num_heads, c.kv_lora_rank});
}

TensorView MlaBuffers::lse_view() const {
  return make_view(const_cast<float*>(lse.data()), DType::kFloat32, {total_q, c.num_heads});
}

TensorView MlaBuffers::index_view(const std::vector<int32_t>& v) const {
  return make_view(const_cast<int32_t*>(v.data()), DType::kInt32, {static_cast<int64_t>(v.size())});
}

MlaPagedCache MlaBuffers::paged_cache() const {
  MlaPagedCache paged;
  paged.ckv_cache = ckv_cache();
  paged.kpe_cache = kpe_cache();
  paged.page_indptr = index_view(page_indptr);
  paged.page_indices = index_view(page_indices);
  paged.last_page_len = index_view(last_page_len);
  return paged;
}

double MlaBuffers::q_at(int64_t token, int32_t head, int32_t d) const {
  const int64_t w = q_width(c);
  if (d < c.kv_lora_rank || c.combined_q) {
    return detail::load_as_float(q.data(), c.dtype, (token * c.num_heads + head) * w + d);
  }
  return detail::load_as_float(q_pe_separate.data(), c.dtype,
                               (token * c.num_heads + head) * c.rope_dim + d - c.kv_lora_rank);
}

double MlaBuffers::kv_at(int32_t b, int32_t j, int32_t d) const {
  const int64_t page = page_indices[page_indptr[b] + j / c.page_size];
  const int64_t row = page * c.page_size + j % c.page_size;
  if (d < c.kv_lora_rank || c.combined_cache) {
    return detail::load_as_float(cache.data(), c.dtype, row * cache_width(c) + d);
  }
  return detail::load_as_float(kpe_separate.data(), c.dtype, row * c.rope_dim + d - c.kv_lora_rank);
}

MlaResult mla_brute_force(const MlaBuffers& buffers) {
  const MlaCase& c = buffers.c;
  const int32_t lora = c.kv_lora_rank, width = c.kv_lora_rank + c.rope_dim;
  const double scale = c.sm_scale > 0 ? c.sm_scale : 1.0 / std::sqrt(static_cast<double>(width));
  MlaResult result;
  result.o.assign(static_cast<size_t>(buffers.total_q * c.num_heads * lora), 0.0);
  result.lse.assign(static_cast<size_t>(buffers.total_q * c.num_heads),
                    -std::numeric_limits<double>::infinity());
  for (size_t b = 0; b < c.q_lens.size(); ++b) {
    const int32_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
    for (int32_t i = 0; i < q_len; ++i) {
      const int64_t token = buffers.qo_indptr[b] + i;
      const int32_t visible = c.causal ? std::clamp(i + kv_len - q_len + 1, 0, kv_len) : kv_len;
      for (int32_t h = 0; h < c.num_heads; ++h) {
        if (visible == 0) continue;
        std::vector<double> s(visible);
        double max_s = -std::numeric_limits<double>::infinity();
        for (int32_t j = 0; j < visible; ++j) {
          double dot = 0;  // q_nope . ckv_j + q_pe . kpe_j
          for (int32_t d = 0; d < width; ++d) {
            dot += buffers.q_at(token, h, d) * buffers.kv_at(static_cast<int32_t>(b), j, d);
          }
          s[j] = dot * scale;
          max_s = std::max(max_s, s[j]);
        }
        double sum = 0;
        double* o = result.o.data() + (token * c.num_heads + h) * lora;
        for (int32_t j = 0; j < visible; ++j) {
          const double p = std::exp(s[j] - max_s);
          sum += p;
          for (int32_t d = 0; d < lora; ++d) {
            o[d] += p * buffers.kv_at(static_cast<int32_t>(b), j, d);
          }
        }
        for (int32_t d = 0; d < lora; ++d) o[d] /= sum;
        result.lse[token * c.num_heads + h] = max_s + std::log(sum);
      }
    }
  }
  return result;
}

MlaResult mla_outputs(const MlaBuffers& buffers) {
  MlaResult result;
  const int64_t n = static_cast<int64_t>(buffers.o.size() / dtype_size(buffers.c.dtype));
  result.o.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    result.o[i] = detail::load_as_float(buffers.o.data(), buffers.c.dtype, i);
  }
  result.lse.assign(buffers.lse.begin(), buffers.lse.end());
  return result;
}

MlaDiff mla_diff(const MlaResult& actual, const MlaResult& expected) {
  MlaDiff diff;
  const double inf = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < expected.o.size(); ++i) {
    const double d = std::abs(actual.o[i] - expected.o[i]);
    diff.o = std::max(diff.o, std::isnan(d) ? inf : d);
  }
  for (size_t i = 0; i < expected.lse.size(); ++i) {
    if (std::isinf(expected.lse[i]) && actual.lse[i] == expected.lse[i]) continue;
    const double d = std::abs(actual.lse[i] - expected.lse[i]);
    diff.lse = std::max(diff.lse, std::isnan(d) ? inf : d);
  }
  return diff;
}

double mla_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 2e-4;
    case DType::kFloat16: return 4e-3;
    default: return 3e-2;  // bf16: 8 bits of mantissa in o
  }
}

MlaCase random_mla_case(std::mt19937_64& rng, int32_t num_heads, int32_t kv_lora_rank,
                        int32_t rope_dim, int32_t page_size, int32_t max_kv) {
  MlaCase c;
  c.num_heads = num_heads;
  c.kv_lora_rank = kv_lora_rank;
  c.rope_dim = rope_dim;
  c.page_size = page_size;
  const int batch = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int b = 0; b < batch; ++b) {
    c.kv_lens.push_back(std::uniform_int_distribution<int32_t>(0, max_kv)(rng));
    c.q_lens.push_back(std::uniform_int_distribution<int32_t>(0, 6)(rng));
  }
  c.causal = rng() % 2 == 0;
  c.combined_cache = rng() % 2 == 0;
  c.combined_q = rng() % 3 == 0;
  c.sm_scale = rng() % 2 == 0 ? 0.0f : 0.05f;
  return c;
}

}  // namespace tessera::test
