// Tests of the auxiliary ops on the CPU: RoPE, paged-KV append, block_table -> CSR, merge of
// attention states, called through the public entry points (validation, then the CPU backend).
// Every expected value comes from code written here, independently of the backend: RoPE from the
// rotation formula in double, appends from the source rows, merges from a double-precision
// attention over the union of the key sets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "core/half.hpp"
#include "core/problem.hpp"
#include "tessera/ops.hpp"

namespace tessera {
namespace {

using detail::KVSource;

constexpr double kPi = 3.14159265358979323846;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Owns the bytes of a host tensor of any float dtype.
struct HostTensor {
  HostTensor() = default;
  HostTensor(DType dtype, int64_t elements, unsigned char fill = 0)
      : dtype(dtype), bytes(static_cast<size_t>(elements) * dtype_size(dtype), fill) {}
  int64_t elements() const { return static_cast<int64_t>(bytes.size() / dtype_size(dtype)); }
  void fill_normal(std::mt19937& rng, double scale) {
    std::normal_distribution<double> normal(0.0, scale);
    for (int64_t i = 0; i < elements(); ++i) set(i, static_cast<float>(normal(rng)));
  }
  void set(int64_t i, float value) { detail::store_from_float(bytes.data(), dtype, i, value); }
  float get(int64_t i) const { return detail::load_as_float(bytes.data(), dtype, i); }
  void* data() { return bytes.data(); }
  const unsigned char* element(int64_t i) const {
    return bytes.data() + static_cast<size_t>(i) * dtype_size(dtype);
  }

  DType dtype = DType::kFloat32;
  std::vector<unsigned char> bytes;
};

// A contiguous int32 array as the 1-D view the public entry points take.
TensorView int_view(const std::vector<int32_t>& values) {
  return make_view(const_cast<int32_t*>(values.data()), DType::kInt32,
                   {static_cast<int64_t>(values.size())});
}

// A [rows, heads, head_dim] tensor whose rows are `padding` elements longer than heads * head_dim,
// as a slice of a wider buffer would be.
struct RowTensor : HostTensor {
  RowTensor(DType dtype, int64_t rows, int heads, int head_dim, int padding)
      : HostTensor(dtype, rows * (heads * head_dim + padding)),
        rows(rows),
        heads(heads),
        head_dim(head_dim),
        row_stride(heads * head_dim + padding) {}
  int64_t index(int64_t row, int head, int d) const {
    return row * row_stride + head * head_dim + d;
  }
  TensorView view() {
    return make_view(data(), dtype, {rows, heads, head_dim}, {row_stride, head_dim, 1});
  }

  int64_t rows;
  int heads, head_dim;
  int64_t row_stride;
};

int uniform_int(std::mt19937& rng, int low, int high) {
  return std::uniform_int_distribution<int>(low, high)(rng);
}

// ============================================================================ RoPE

// The frequency of pair i, written from the definitions (theta power, Meta's apply_scaling for
// Llama 3.1, then linear position interpolation).
double reference_frequency(int i, int rotary_dim, const RopeOptions& options) {
  double frequency =
      std::pow(static_cast<double>(options.rope_theta), -2.0 * i / static_cast<double>(rotary_dim));
  if (options.llama31) {
    const double old_context = options.llama31_original_max_position;
    const double low_freq_wavelen = old_context / options.llama31_low_freq_factor;
    const double high_freq_wavelen = old_context / options.llama31_high_freq_factor;
    const double wavelen = 2.0 * kPi / frequency;
    if (wavelen > low_freq_wavelen) {
      frequency /= options.llama31_factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (old_context / wavelen - options.llama31_low_freq_factor) /
                            (options.llama31_high_freq_factor - options.llama31_low_freq_factor);
      frequency = (1.0 - smooth) * frequency / options.llama31_factor + smooth * frequency;
    }
  }
  return frequency / options.rope_scale;
}

// q and k as views into one fused QKV buffer [nnz, hq + 2 hk, head_dim], so strides are
// non-trivial and the V part must come out untouched.
struct FusedQkv : RowTensor {
  FusedQkv(DType dtype, int nnz, int hq, int hk, int head_dim, std::mt19937& rng)
      : RowTensor(dtype, nnz, hq + 2 * hk, head_dim, 0), hq(hq), hk(hk) {
    fill_normal(rng, 1.0);
  }
  TensorView q() {
    return make_view(data(), dtype, {rows, hq, head_dim}, {row_stride, head_dim, 1});
  }
  TensorView k() {
    void* base = bytes.data() + static_cast<size_t>(hq) * head_dim * dtype_size(dtype);
    return make_view(base, dtype, {rows, hk, head_dim}, {row_stride, head_dim, 1});
  }

  int hq, hk;
};

// Rotates the fused buffer with apply_rope_inplace and checks every element of it against the
// rotation formula evaluated in double on the (already rounded) inputs.
void check_rope_case(DType dtype, int head_dim, const RopeOptions& options, std::mt19937& rng) {
  SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " head_dim " << head_dim << " rotary_dim "
                                  << options.rotary_dim << " interleave " << options.interleave
                                  << " llama31 " << options.llama31 << " scale "
                                  << options.rope_scale);
  const int nnz = 29, hq = 4, hk = 2;
  FusedQkv qkv(dtype, nnz, hq, hk, head_dim, rng);
  const FusedQkv original = qkv;
  // Short and long contexts: large angles are where float-angle and sin/cos accuracy matter.
  const bool wide = dtype == DType::kFloat32;
  std::vector<int32_t> positions(nnz);
  for (int t = 0; t < nnz; ++t) {
    positions[t] = t % 2 == 0 ? uniform_int(rng, 0, 64) : uniform_int(rng, 0, wide ? 131072 : 4096);
  }
  positions[0] = positions[1] = 0;

  apply_rope_inplace(qkv.q(), qkv.k(), int_view(positions), options);

  const int rotary_dim = options.rotary_dim == 0 ? head_dim : options.rotary_dim;
  const int half = rotary_dim / 2;
  double error_squared = 0.0, reference_squared = 0.0;
  for (int t = 0; t < nnz; ++t) {
    for (int head = 0; head < hq + 2 * hk; ++head) {
      const bool rotated = head < hq + hk;
      for (int d = 0; d < head_dim; ++d) {
        const int64_t index = qkv.index(t, head, d);
        ASSERT_FALSE(std::isnan(qkv.get(index)));
        // V, the features past rotary_dim, and everything at position 0 (the identity) keep
        // their exact bits.
        if (!rotated || d >= rotary_dim || positions[t] == 0) {
          ASSERT_EQ(0, std::memcmp(qkv.element(index), original.element(index), dtype_size(dtype)))
              << "token " << t << " head " << head << " d " << d;
        }
      }
      if (!rotated) continue;
      for (int i = 0; i < half; ++i) {
        const int first = options.interleave ? 2 * i : i;
        const int second = options.interleave ? 2 * i + 1 : i + half;
        const double x = original.get(qkv.index(t, head, first));
        const double y = original.get(qkv.index(t, head, second));
        const double angle = positions[t] * reference_frequency(i, rotary_dim, options);
        const double want_first = x * std::cos(angle) - y * std::sin(angle);
        const double want_second = y * std::cos(angle) + x * std::sin(angle);
        const double got_first = qkv.get(qkv.index(t, head, first));
        const double got_second = qkv.get(qkv.index(t, head, second));
        error_squared += (got_first - want_first) * (got_first - want_first) +
                         (got_second - want_second) * (got_second - want_second);
        reference_squared += want_first * want_first + want_second * want_second;
        if (dtype == DType::kFloat32) {
          // The angle is float(position) * float(frequency), rounded to float: its error grows
          // with the angle (two roundings), on top of a few ulp for the rotation itself.
          const double tolerance = std::hypot(x, y) * (2e-6 + 2.5e-7 * std::fabs(angle));
          ASSERT_NEAR(got_first, want_first, tolerance) << "token " << t << " pair " << i;
          ASSERT_NEAR(got_second, want_second, tolerance) << "token " << t << " pair " << i;
        }
      }
    }
  }
  EXPECT_LT(std::sqrt(error_squared / reference_squared), 1e-2);
}

TEST(CpuRope, MatchesRotationFormula) {
  std::mt19937 rng(1234);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool interleave : {false, true}) {
      for (bool llama31 : {false, true}) {
        // Full and partial rotation (rotary_dim < head_dim), with and without linear scaling;
        // Llama 3.1 with its own theta.
        const float theta = llama31 ? 5e5f : 1e4f;
        for (auto [head_dim, rotary_dim, scale] :
             {std::tuple{128, 0, 1.0f}, {128, 64, 1.0f}, {64, 32, 2.5f}, {64, 0, 4.0f}}) {
          const RopeOptions options{.rotary_dim = rotary_dim,
                                    .interleave = interleave,
                                    .rope_theta = theta,
                                    .rope_scale = scale,
                                    .llama31 = llama31};
          check_rope_case(dtype, head_dim, options, rng);
        }
      }
    }
  }
}

TEST(CpuRope, EmptyQOrKRotatesOnlyTheOther) {
  std::mt19937 rng(99);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const FusedQkv start(dtype, 17, 4, 2, 64, rng);
    std::vector<int32_t> positions(17);
    for (int32_t& position : positions) position = uniform_int(rng, 0, 5000);
    RopeOptions options;
    options.rotary_dim = 48;

    const auto rotate = [&](bool rotate_q, bool rotate_k) {
      FusedQkv copy = start;
      apply_rope_inplace(rotate_q ? copy.q() : TensorView{}, rotate_k ? copy.k() : TensorView{},
                         int_view(positions), options);
      return copy;
    };
    const FusedQkv both = rotate(true, true), only_q = rotate(true, false);
    const FusedQkv only_k = rotate(false, true);
    EXPECT_THROW(rotate(false, false), Error);  // neither q nor k: rejected, nothing written

    for (int64_t i = 0; i < start.elements(); ++i) {
      const int64_t head = i % start.row_stride / start.head_dim;  // q: 0-3, k: 4-5, v: 6-7
      const float rotated = both.get(i), unrotated = start.get(i);
      EXPECT_EQ(only_q.get(i), head < 4 ? rotated : unrotated);
      EXPECT_EQ(only_k.get(i), head == 4 || head == 5 ? rotated : unrotated);
    }
  }
}

TEST(CpuRope, Llama31KeepsHighAndDividesLowFrequencies) {
  // At position 1 a NeoX pair (1, 0) becomes (cos f, sin f): read each frequency back.
  const int head_dim = 128, half = 64;
  std::vector<float> row(head_dim, 0.0f);
  std::fill(row.begin(), row.begin() + half, 1.0f);
  const TensorView k =
      make_view(row.data(), DType::kFloat32, {1, 1, head_dim}, {head_dim, head_dim, 1});
  RopeOptions options;
  options.rope_theta = 5e5f;
  options.llama31 = true;
  apply_rope_inplace(TensorView{}, k, int_view({1}), options);

  double previous = 1e9;
  for (int i = 0; i < half; ++i) {
    const double frequency = std::atan2(row[i + half], row[i]);
    const double base = std::pow(5e5, -2.0 * i / head_dim);
    const double wavelen = 2.0 * kPi / base;
    if (wavelen < 8192.0 / 4.0) {
      EXPECT_NEAR(frequency / base, 1.0, 1e-5) << i;
    } else if (wavelen > 8192.0) {
      EXPECT_NEAR(frequency / base, 1.0 / 8.0, 1e-5) << i;
    }
    EXPECT_GE(frequency / base, 1.0 / 8.0 - 1e-6);
    EXPECT_LE(frequency / base, 1.0 + 1e-6);
    EXPECT_LT(frequency, previous) << "frequencies must decrease, pair " << i;
    previous = frequency;
  }
}

// ============================================================================ block table

int32_t pages_for(int32_t len, int page_size) {
  return (len + page_size - 1) / page_size;
}

// The page ids 0 .. count-1 in random order.
std::vector<int32_t> shuffled_pages(int64_t count, std::mt19937& rng) {
  std::vector<int32_t> pages(count);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  return pages;
}

struct CsrTable {
  std::vector<int32_t> page_indptr, page_indices, last_page_len;
};

// block_table is [batch, max_pages] with row stride `row_stride` (>= max_pages).
CsrTable convert_block_table(const std::vector<int32_t>& block_table, int64_t batch,
                             int64_t max_pages, int64_t row_stride,
                             const std::vector<int32_t>& seq_lens, int page_size) {
  CsrTable csr;
  csr.page_indptr.assign(batch + 1, -5);
  csr.page_indices.assign(batch * max_pages + 1, -5);
  csr.last_page_len.assign(batch, -5);
  const TensorView table = make_view(const_cast<int32_t*>(block_table.data()), DType::kInt32,
                                     {batch, max_pages}, {row_stride, 1});
  block_table_to_csr(table, int_view(seq_lens), page_size, int_view(csr.page_indptr),
                     int_view(csr.page_indices), int_view(csr.last_page_len));
  return csr;
}

TEST(CpuBlockTable, ConvertsToCsr) {
  std::mt19937 rng(2024);
  for (int page_size : {1, 16, 64, uniform_int(rng, 2, 128)}) {
    SCOPED_TRACE(testing::Message() << "page_size " << page_size);
    // Edge lengths first (empty, exactly one page, one past a page), then random ones.
    std::vector<int32_t> seq_lens = {0, page_size, page_size + 1, 1};
    for (int i = uniform_int(rng, 1, 8); i > 0; --i) {
      seq_lens.push_back(uniform_int(rng, 0, 5 * page_size + 3));
    }
    const int64_t batch = static_cast<int64_t>(seq_lens.size());
    int64_t max_pages = 0;
    for (int32_t len : seq_lens)
      max_pages = std::max<int64_t>(max_pages, pages_for(len, page_size) + 2);
    // A view into a wider table: row stride max_pages + 3, the 3 extra columns never read.
    const int64_t row_stride = max_pages + 3;
    const std::vector<int32_t> block_table = shuffled_pages(batch * row_stride, rng);

    const CsrTable csr =
        convert_block_table(block_table, batch, max_pages, row_stride, seq_lens, page_size);
    EXPECT_EQ(csr.page_indptr[0], 0);
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t pages = pages_for(seq_lens[b], page_size);
      ASSERT_EQ(csr.page_indptr[b + 1] - csr.page_indptr[b], pages) << "request " << b;
      for (int32_t p = 0; p < pages; ++p) {
        EXPECT_EQ(csr.page_indices[csr.page_indptr[b] + p], block_table[b * row_stride + p]);
      }
      if (pages == 0) {
        EXPECT_EQ(csr.last_page_len[b], 0);
      } else {
        EXPECT_GE(csr.last_page_len[b], 1);
        EXPECT_LE(csr.last_page_len[b], page_size);
        EXPECT_EQ((pages - 1) * page_size + csr.last_page_len[b], seq_lens[b]);
      }
    }
    // Nothing is written past the pages in use.
    EXPECT_EQ(csr.page_indices[csr.page_indptr[batch]], -5);
  }
}

// ============================================================================ paged-KV append

// A poisoned paged cache plus a page table built through cpu_block_table_to_csr from a shuffled
// block table (every request's pages are scattered over the pool).
struct PagedCache {
  static constexpr unsigned char kPoison = 0x5a;

  PagedCache(DType dtype, KVLayout layout, int page_size, int heads, int head_dim,
             const std::vector<int32_t>& final_lens, std::mt19937& rng)
      : dtype(dtype), layout(layout), page_size(page_size), heads(heads), head_dim(head_dim) {
    batch = static_cast<int64_t>(final_lens.size());
    for (int32_t len : final_lens) max_pages = std::max(max_pages, pages_for(len, page_size));
    max_pages += 1;
    // Spare pages that nobody owns; the rest dealt out in random order.
    block_table = shuffled_pages(batch * max_pages + 3, rng);
    block_table.resize(batch * max_pages);
    const int64_t elements = (batch * max_pages + 3) * page_size * heads * head_dim;
    k = HostTensor(dtype, elements, kPoison);
    v = HostTensor(dtype, elements, kPoison);
  }

  // Describes the cache as holding `seq_lens` tokens per request.
  void set_lengths(const std::vector<int32_t>& seq_lens) {
    csr = convert_block_table(block_table, batch, max_pages, max_pages, seq_lens, page_size);
  }

  // The cache as the public API takes it: NHD [pages, page_size, heads, head_dim] or
  // HND [pages, heads, page_size, head_dim].
  PagedKVCache paged() {
    const int64_t pages = k.elements() / (static_cast<int64_t>(page_size) * heads * head_dim);
    const bool nhd = layout == KVLayout::kNHD;
    const int64_t dim1 = nhd ? page_size : heads, dim2 = nhd ? heads : page_size;
    return {make_view(k.data(), dtype, {pages, dim1, dim2, head_dim}),
            make_view(v.data(), dtype, {pages, dim1, dim2, head_dim}),
            layout,
            int_view(csr.page_indptr),
            int_view(csr.page_indices),
            int_view(csr.last_page_len)};
  }

  // The read side, written here from the layouts (not taken from the core): NHD and HND differ
  // only in the token and head strides.
  KVSource source() {
    const int64_t page = static_cast<int64_t>(page_size) * heads * head_dim;
    const int64_t token = layout == KVLayout::kNHD ? heads * head_dim : head_dim;
    const int64_t head = layout == KVLayout::kNHD ? head_dim : page_size * head_dim;
    KVSource source;
    source.dtype = dtype;
    source.paged = true;
    source.k = k.data(), source.v = v.data();
    source.k_stride_page = source.v_stride_page = page;
    source.k_stride_token = source.v_stride_token = token;
    source.k_stride_head = source.v_stride_head = head;
    source.page_indptr = csr.page_indptr.data();
    source.page_indices = csr.page_indices.data();
    source.last_page_len = csr.last_page_len.data();
    source.page_size = page_size;
    return source;
  }

  DType dtype;
  KVLayout layout;
  int page_size, heads, head_dim;
  int64_t batch;
  int32_t max_pages = 0;
  std::vector<int32_t> block_table;
  CsrTable csr;
  HostTensor k, v;
};

// New rows of one append call: ragged k/v [nnz, heads, head_dim]. K has a padded row stride, as
// a slice of a fused QKV projection would.
struct AppendChunk {
  AppendChunk(DType dtype, const std::vector<int32_t>& lens, int heads, int head_dim,
              std::mt19937& rng)
      : indptr(lens.size() + 1, 0),
        k(dtype, total(lens), heads, head_dim, head_dim),
        v(dtype, total(lens), heads, head_dim, 0) {
    std::partial_sum(lens.begin(), lens.end(), indptr.begin() + 1);
    k.fill_normal(rng, 3.0);
    v.fill_normal(rng, 3.0);
  }
  static int64_t total(const std::vector<int32_t>& lens) {
    return std::accumulate(lens.begin(), lens.end(), int64_t{0});
  }

  std::vector<int32_t> indptr;
  RowTensor k, v;
};

void append(PagedCache& cache, AppendChunk& chunk, const RopeOptions* rope) {
  append_paged_kv_cache(chunk.k.view(), chunk.v.view(), int_view(chunk.indptr), cache.paged(),
                        rope);
}

// Lengths of two successive appends to a batch (the first one into empty requests); about one
// request in five appends nothing in a given call.
struct TwoAppends {
  TwoAppends(std::mt19937& rng, int batch, int page_size) {
    const int longest = std::min(2 * page_size + 7, 300);
    for (std::vector<int32_t>* lens : {&first, &second}) {
      for (int b = 0; b < batch; ++b) {
        lens->push_back(uniform_int(rng, 0, 4) == 0 ? 0 : uniform_int(rng, 1, longest));
      }
    }
    for (int b = 0; b < batch; ++b) total.push_back(first[b] + second[b]);
  }
  std::vector<int32_t> first, second, total;
};

// Whether the cache element holds `value` converted to the cache dtype, bit for bit.
bool holds_converted(float value, const HostTensor& cache, int64_t offset) {
  HostTensor expected(cache.dtype, 1);
  expected.set(0, value);
  return std::memcmp(cache.element(offset), expected.element(0), dtype_size(cache.dtype)) == 0;
}

struct AppendCase {
  DType source_dtype;
  DType cache_dtype;
};

TEST(CpuAppendPagedKv, TwoAppendsReadBackThroughKvSource) {
  std::mt19937 rng(31337);
  const AppendCase cases[] = {
      {DType::kFloat16, DType::kFloat16},    {DType::kBFloat16, DType::kBFloat16},
      {DType::kFloat32, DType::kFloat32},    {DType::kFloat32, DType::kFloat16},
      {DType::kFloat16, DType::kFloat32},    {DType::kFloat32, DType::kBFloat16},
      {DType::kFloat16, DType::kFloat8E4M3}, {DType::kBFloat16, DType::kFloat8E5M2},
      {DType::kFloat32, DType::kFloat8E4M3},
  };
  for (const AppendCase& append_case : cases) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      for (int page_size : {1, 16, 64, uniform_int(rng, 2, 128)}) {
        SCOPED_TRACE(testing::Message()
                     << dtype_name(append_case.source_dtype) << " -> "
                     << dtype_name(append_case.cache_dtype)
                     << (layout == KVLayout::kNHD ? " NHD" : " HND") << " page_size " << page_size);
        const int batch = uniform_int(rng, 1, 6), heads = uniform_int(rng, 1, 3);
        const int head_dim = uniform_int(rng, 0, 1) ? 16 : 64;
        const TwoAppends lens(rng, batch, page_size);

        PagedCache cache(append_case.cache_dtype, layout, page_size, heads, head_dim, lens.total,
                         rng);
        AppendChunk first(append_case.source_dtype, lens.first, heads, head_dim, rng);
        AppendChunk second(append_case.source_dtype, lens.second, heads, head_dim, rng);
        cache.set_lengths(lens.first);
        append(cache, first, nullptr);
        cache.set_lengths(lens.total);
        append(cache, second, nullptr);

        const KVSource source = cache.source();
        const size_t bytes = dtype_size(cache.dtype);
        std::vector<char> k_written(cache.k.bytes.size() / bytes, 0);
        std::vector<char> v_written(k_written.size(), 0);
        for (int b = 0; b < batch; ++b) {
          ASSERT_EQ(source.kv_len(b), lens.total[b]);
          for (int j = 0; j < lens.total[b]; ++j) {
            const bool in_first = j < lens.first[b];
            const AppendChunk& chunk = in_first ? first : second;
            const int64_t row = chunk.indptr[b] + (in_first ? j : j - lens.first[b]);
            for (int h = 0; h < heads; ++h) {
              for (int d = 0; d < head_dim; ++d) {
                const int64_t k_offset = source.k_offset(b, h, j) + d;
                const int64_t v_offset = source.v_offset(b, h, j) + d;
                ASSERT_TRUE(
                    holds_converted(chunk.k.get(chunk.k.index(row, h, d)), cache.k, k_offset) &&
                    holds_converted(chunk.v.get(chunk.v.index(row, h, d)), cache.v, v_offset))
                    << "request " << b << " position " << j << " head " << h << " d " << d;
                k_written[k_offset] = v_written[v_offset] = 1;
              }
            }
          }
        }
        // Every slot that no request owns at these positions keeps its poison.
        for (size_t i = 0; i < cache.k.bytes.size(); ++i) {
          ASSERT_TRUE(k_written[i / bytes] || cache.k.bytes[i] == PagedCache::kPoison) << i;
          ASSERT_TRUE(v_written[i / bytes] || cache.v.bytes[i] == PagedCache::kPoison) << i;
        }
      }
    }
  }
}

TEST(CpuAppendPagedKv, FusedRopeEqualsRopeThenAppend) {
  std::mt19937 rng(4242);
  const AppendCase cases[] = {
      {DType::kFloat16, DType::kFloat16},    {DType::kBFloat16, DType::kBFloat16},
      {DType::kFloat32, DType::kFloat32},    {DType::kFloat32, DType::kFloat16},
      {DType::kFloat32, DType::kFloat8E4M3},
  };
  for (const AppendCase& append_case : cases) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      for (int variant = 0; variant < 3; ++variant) {
        // NeoX; GPT-J interleaved; partial rotary_dim with Llama 3.1 scaling.
        const RopeOptions rope{.rotary_dim = variant == 2 ? 32 : 0,
                               .interleave = variant == 1,
                               .llama31 = variant == 2};
        const int page_size = variant == 0 ? 16 : uniform_int(rng, 1, 128);
        SCOPED_TRACE(testing::Message() << dtype_name(append_case.source_dtype) << " -> "
                                        << dtype_name(append_case.cache_dtype) << " variant "
                                        << variant << " page_size " << page_size);
        const int batch = uniform_int(rng, 1, 5), heads = 2, head_dim = 64;
        const TwoAppends lens(rng, batch, page_size);

        PagedCache fused(append_case.cache_dtype, layout, page_size, heads, head_dim, lens.total,
                         rng);
        PagedCache separate = fused;  // same pages, same poison, its own buffers

        AppendChunk chunks[] = {
            AppendChunk(append_case.source_dtype, lens.first, heads, head_dim, rng),
            AppendChunk(append_case.source_dtype, lens.second, heads, head_dim, rng)};
        const std::vector<int32_t>* lens_after[] = {&lens.first, &lens.total};
        for (int c = 0; c < 2; ++c) {
          fused.set_lengths(*lens_after[c]);
          separate.set_lengths(*lens_after[c]);
          append(fused, chunks[c], &rope);

          // Rotate a copy of k_new in place by the positions the rows will take, then append.
          AppendChunk rotated = chunks[c];
          std::vector<int32_t> positions(rotated.k.rows);
          for (int b = 0; b < batch; ++b) {
            const int32_t len = rotated.indptr[b + 1] - rotated.indptr[b];
            for (int32_t i = 0; i < len; ++i) {
              positions[rotated.indptr[b] + i] = (*lens_after[c])[b] - len + i;
            }
          }
          apply_rope_inplace(TensorView{}, rotated.k.view(), int_view(positions), rope);
          append(separate, rotated, nullptr);
        }
        EXPECT_EQ(fused.k.bytes, separate.k.bytes);
        EXPECT_EQ(fused.v.bytes, separate.v.bytes);
      }
    }
  }
}

// ============================================================================ merge of states

// Keys and values of one (row, head): the full key set whose subsets the partial states cover.
struct KeySet {
  std::vector<double> q;
  std::vector<std::vector<double>> keys, values;
  std::vector<int> all;  // 0 .. keys.size() - 1
};

KeySet random_keys(std::mt19937& rng, int count, int head_dim) {
  std::normal_distribution<double> normal;
  KeySet set;
  // A large query spreads the logits over many units, so the states' lse differ markedly.
  for (int d = 0; d < head_dim; ++d) set.q.push_back(3.0 * normal(rng));
  set.keys.assign(count, std::vector<double>(head_dim));
  set.values = set.keys;
  set.all.resize(count);
  std::iota(set.all.begin(), set.all.end(), 0);
  for (int j = 0; j < count; ++j) {
    for (int d = 0; d < head_dim; ++d) set.keys[j][d] = normal(rng), set.values[j][d] = normal(rng);
  }
  return set;
}

struct State {
  std::vector<double> o;
  double lse;
};

// Softmax attention of one query row over the keys in `subset`, in double. An empty subset is
// the empty state: o = 0, lse = -inf.
State attend(const KeySet& set, const std::vector<int>& subset) {
  const size_t head_dim = set.q.size();
  State state{std::vector<double>(head_dim, 0.0), -std::numeric_limits<double>::infinity()};
  if (subset.empty()) return state;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> logits;
  for (int j : subset) {
    double dot = 0.0;
    for (size_t d = 0; d < head_dim; ++d) dot += set.q[d] * set.keys[j][d];
    logits.push_back(dot * scale);
  }
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (size_t s = 0; s < subset.size(); ++s) {
    const double weight = std::exp(logits[s] - max_logit);
    total += weight;
    for (size_t d = 0; d < head_dim; ++d) state.o[d] += weight * set.values[subset[s]][d];
  }
  for (double& value : state.o) value /= total;
  state.lse = max_logit + std::log(total);
  return state;
}

// Partial states: o [rows, heads, head_dim] with a padded row stride, lse [rows, heads].
struct StateTensor : RowTensor {
  StateTensor(DType dtype, int64_t rows, int heads, int head_dim)
      : RowTensor(dtype, rows, heads, head_dim, 8), lse(rows * heads, 0.0f) {}
  TensorView lse_view() { return make_view(lse.data(), DType::kFloat32, {rows, heads}); }
  // Stores a state. An empty state's o is filled with NaN: the merge must never read it.
  void store(int64_t row, int head, const State& state) {
    const bool empty = std::isinf(state.lse);
    for (int d = 0; d < head_dim; ++d) {
      set(index(row, head, d),
          empty ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(state.o[d]));
    }
    lse[row * heads + head] = static_cast<float>(state.lse);
  }

  std::vector<float> lse;
};

// Compares every merged row with the attention over the union of its key sets: an empty union
// gives exactly o = 0, lse = -inf; otherwise lse to 1e-5 relative, o to 1e-5 relative per row when
// everything is fp32, and a relative L2 error under 1e-2 over the tensor with 16-bit storage.
void check_merged(const StateTensor& merged, const std::vector<State>& want, bool all_fp32) {
  double total_error_squared = 0.0, total_reference_squared = 0.0;
  for (int64_t row = 0; row < merged.rows; ++row) {
    for (int head = 0; head < merged.heads; ++head) {
      SCOPED_TRACE(testing::Message() << "row " << row << " head " << head);
      const State& expected = want[row * merged.heads + head];
      const float got_lse = merged.lse[row * merged.heads + head];
      if (std::isinf(expected.lse)) {
        EXPECT_EQ(got_lse, kNegativeInfinity);
        for (int d = 0; d < merged.head_dim; ++d) {
          EXPECT_EQ(merged.get(merged.index(row, head, d)), 0.0f);
        }
        continue;
      }
      EXPECT_NEAR(got_lse, expected.lse, 1e-5 * std::max(1.0, std::fabs(expected.lse)));
      double error_squared = 0.0, reference_squared = 0.0;
      for (int d = 0; d < merged.head_dim; ++d) {
        const double got = merged.get(merged.index(row, head, d));
        ASSERT_FALSE(std::isnan(got));
        error_squared += (got - expected.o[d]) * (got - expected.o[d]);
        reference_squared += expected.o[d] * expected.o[d];
      }
      if (all_fp32) {
        EXPECT_LE(std::sqrt(error_squared), 1e-5 * std::sqrt(reference_squared) + 1e-6);
      }
      total_error_squared += error_squared;
      total_reference_squared += reference_squared;
    }
  }
  EXPECT_LE(std::sqrt(total_error_squared), 1e-2 * std::sqrt(total_reference_squared));
}

const DType kOutputDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

TEST(CpuMergeState, MergeOfDisjointPartsEqualsAttentionOverUnion) {
  std::mt19937 rng(777);
  const int rows = 9, heads = 3, head_dim = 40;
  for (DType a_dtype : kOutputDTypes) {
    for (DType b_dtype : kOutputDTypes) {
      for (DType out_dtype : kOutputDTypes) {
        SCOPED_TRACE(testing::Message() << dtype_name(a_dtype) << " + " << dtype_name(b_dtype)
                                        << " -> " << dtype_name(out_dtype));
        StateTensor a(a_dtype, rows, heads, head_dim), b(b_dtype, rows, heads, head_dim);
        StateTensor out(out_dtype, rows, heads, head_dim);
        std::vector<State> want;
        for (int row = 0; row < rows; ++row) {
          for (int head = 0; head < heads; ++head) {
            // Scenarios: both empty, A empty, B empty, and random splits.
            const int scenario = (row * heads + head) % 5;
            const KeySet set =
                random_keys(rng, scenario == 0 ? 0 : uniform_int(rng, 1, 30), head_dim);
            std::vector<int> part_a, part_b;
            for (int j = 0; j < static_cast<int>(set.keys.size()); ++j) {
              const bool to_a = scenario == 2 || (scenario != 1 && uniform_int(rng, 0, 1) == 0);
              (to_a ? part_a : part_b).push_back(j);
            }
            a.store(row, head, attend(set, part_a));
            b.store(row, head, attend(set, part_b));
            want.push_back(attend(set, set.all));
          }
        }
        merge_state(a.view(), a.lse_view(), b.view(), b.lse_view(), out.view(), out.lse_view());
        check_merged(out, want,
                     a_dtype == DType::kFloat32 && b_dtype == DType::kFloat32 &&
                         out_dtype == DType::kFloat32);

        // Without an lse output, and in place into o_a / lse_a (the split-KV pattern): same bits.
        StateTensor no_lse(out_dtype, rows, heads, head_dim);
        merge_state(a.view(), a.lse_view(), b.view(), b.lse_view(), no_lse.view(), TensorView{});
        EXPECT_EQ(no_lse.bytes, out.bytes);
        if (a_dtype == out_dtype) {
          merge_state(a.view(), a.lse_view(), b.view(), b.lse_view(), a.view(), a.lse_view());
          EXPECT_EQ(a.bytes, out.bytes);
          EXPECT_EQ(0, std::memcmp(a.lse.data(), out.lse.data(), a.lse.size() * sizeof(float)));
        }
      }
    }
  }
}

TEST(CpuMergeState, ExtremeLseNeitherOverflowsNorLosesTheLargerSide) {
  const int head_dim = 4;
  StateTensor a(DType::kFloat32, 3, 1, head_dim), b(DType::kFloat32, 3, 1, head_dim);
  const std::vector<double> o_a = {1, 2, 3, 4}, o_b = {-4, 0, 4, 8};
  const double lse_a[] = {1e4, -1e4, 1e4};
  const double lse_b[] = {1e4 - 1.0, -1e4 - 80.0, -1e4};
  std::vector<State> want;
  for (int row = 0; row < 3; ++row) {
    a.store(row, 0, State{o_a, lse_a[row]});
    b.store(row, 0, State{o_b, lse_b[row]});
    const double m = std::max(lse_a[row], lse_b[row]);
    const double weight_a = std::exp(lse_a[row] - m), weight_b = std::exp(lse_b[row] - m);
    want.push_back({std::vector<double>(head_dim), m + std::log(weight_a + weight_b)});
    for (int d = 0; d < head_dim; ++d) {
      want[row].o[d] = (weight_a * o_a[d] + weight_b * o_b[d]) / (weight_a + weight_b);
    }
  }
  StateTensor out(DType::kFloat32, 3, 1, head_dim);
  merge_state(a.view(), a.lse_view(), b.view(), b.lse_view(), out.view(), out.lse_view());
  check_merged(out, want, true);
}

TEST(CpuMergeStates, VariableLengthMergeEqualsAttentionOverUnion) {
  std::mt19937 rng(555);
  const int rows = 23, heads = 2, head_dim = 24;
  for (DType state_dtype : kOutputDTypes) {
    for (DType out_dtype : kOutputDTypes) {
      SCOPED_TRACE(testing::Message()
                   << dtype_name(state_dtype) << " -> " << dtype_name(out_dtype));
      std::vector<int32_t> indptr = {0};
      for (int row = 0; row < rows; ++row) {
        // 0..8 states per row; rows 0 and 1 are forced to 0 and 1 states.
        const int count = row == 0 ? 0 : row == 1 ? 1 : uniform_int(rng, 0, 8);
        indptr.push_back(indptr.back() + count);
      }
      StateTensor states(state_dtype, indptr.back(), heads, head_dim);
      StateTensor out(out_dtype, rows, heads, head_dim);
      std::vector<State> want;
      for (int row = 0; row < rows; ++row) {
        const int count = indptr[row + 1] - indptr[row];
        for (int head = 0; head < heads; ++head) {
          // Some rows have states but no key at all: every state is empty.
          const int keys = count == 0 || uniform_int(rng, 0, 6) == 0 ? 0 : uniform_int(rng, 1, 40);
          const KeySet set = random_keys(rng, keys, head_dim);
          std::vector<std::vector<int>> parts(count);
          for (int j = 0; j < keys; ++j) parts[uniform_int(rng, 0, count - 1)].push_back(j);
          for (int s = 0; s < count; ++s)
            states.store(indptr[row] + s, head, attend(set, parts[s]));
          want.push_back(attend(set, set.all));
        }
      }
      merge_states(states.view(), states.lse_view(), int_view(indptr), out.view(), out.lse_view());
      check_merged(out, want, state_dtype == DType::kFloat32 && out_dtype == DType::kFloat32);

      // Without an lse output the o rows are the same.
      StateTensor no_lse(out_dtype, rows, heads, head_dim);
      merge_states(states.view(), states.lse_view(), int_view(indptr), no_lse.view(), TensorView{});
      EXPECT_EQ(no_lse.bytes, out.bytes);
    }
  }
}

}  // namespace
}  // namespace tessera
