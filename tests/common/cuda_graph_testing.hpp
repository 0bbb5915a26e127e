// Helpers of the CUDA-graph tests (test_cuda_graph.cpp: plan capacity, decode graphs, uploads;
// test_cuda_graph_prefill.cpp: the ragged prefill graph): index arrays of a batch from its
// lengths (host only), and for the GPU part random fp16 data, the double-precision reference of
// one (token, head) row, its comparison with the kernel's row and the rows checked at a step.
// Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(TESSERA_HAVE_CUDA)
#include <gtest/gtest.h>

#include "core/half.hpp"
#endif

namespace tessera::test {

inline std::vector<int32_t> indptr_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> indptr(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) indptr[i + 1] = indptr[i] + lengths[i];
  return indptr;
}

// Paged indices for kv lengths: page counts (indptr) and last page lengths.
inline void paged_lengths(const std::vector<int32_t>& kv_lens, int page_size,
                          std::vector<int32_t>* page_indptr, std::vector<int32_t>* last_page_len) {
  page_indptr->assign(kv_lens.size() + 1, 0);
  last_page_len->assign(kv_lens.size(), 1);
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    const int32_t pages = (kv_lens[b] + page_size - 1) / page_size;
    (*page_indptr)[b + 1] = (*page_indptr)[b] + pages;
    (*last_page_len)[b] = pages == 0 ? 1 : kv_lens[b] - (pages - 1) * page_size;
  }
}

#if defined(TESSERA_HAVE_CUDA)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

inline std::vector<uint16_t> random_fp16(std::mt19937_64& rng, size_t count) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> values(count);
  for (auto& v : values) v = detail::float_to_fp16(dist(rng));
  return values;
}

// Reference of one (token, head) row: softmax(q k^T * scale) v over the visible keys `keys`
// (row indices into the K/V element arrays, stride `kv_row_stride` per key, plus the head
// offset). Returns false when no key is visible (o = 0, lse = -inf).
struct RowReference {
  std::vector<double> o;
  double lse = -INFINITY;
};

inline RowReference reference_row(const uint16_t* q_row, const std::vector<uint16_t>& k,
                                  const std::vector<uint16_t>& v,
                                  const std::vector<int64_t>& key_offsets, int head_dim,
                                  double scale) {
  RowReference ref;
  ref.o.assign(head_dim, 0.0);
  if (key_offsets.empty()) return ref;
  std::vector<double> q(head_dim);
  for (int d = 0; d < head_dim; ++d) q[d] = detail::fp16_to_float(q_row[d]);
  std::vector<double> scores(key_offsets.size());
  double max_score = -INFINITY;
  for (size_t j = 0; j < key_offsets.size(); ++j) {
    const uint16_t* k_row = k.data() + key_offsets[j];
    double dot = 0;
    for (int d = 0; d < head_dim; ++d) dot += q[d] * detail::fp16_to_float(k_row[d]);
    scores[j] = dot * scale;
    max_score = std::max(max_score, scores[j]);
  }
  double sum = 0;
  for (size_t j = 0; j < key_offsets.size(); ++j) {
    const double w = std::exp(scores[j] - max_score);
    sum += w;
    const uint16_t* v_row = v.data() + key_offsets[j];
    for (int d = 0; d < head_dim; ++d) ref.o[d] += w * detail::fp16_to_float(v_row[d]);
  }
  for (double& x : ref.o) x /= sum;
  ref.lse = max_score + std::log(sum);
  return ref;
}

// Compares one row of o (fp16) and lse against the reference; returns an error text or "".
inline std::string compare_row(const uint16_t* o_row, float lse, const RowReference& ref,
                               int head_dim) {
  double worst = 0;
  for (int d = 0; d < head_dim; ++d) {
    const double got = detail::fp16_to_float(o_row[d]);
    const double err = std::abs(got - ref.o[d]) - 1e-2 * std::abs(ref.o[d]);
    if (!(err <= 3e-3)) return "o[" + std::to_string(d) + "] = " + std::to_string(got) +
                               ", reference " + std::to_string(ref.o[d]);
    worst = std::max(worst, err);
  }
  if (std::isinf(ref.lse)) {
    if (!(std::isinf(lse) && lse < 0)) return "lse = " + std::to_string(lse) + ", expected -inf";
  } else if (!(std::abs(lse - ref.lse) <= 1e-2 + 1e-3 * std::abs(ref.lse))) {
    return "lse = " + std::to_string(lse) + ", reference " + std::to_string(ref.lse);
  }
  return "";
}

// Rows to check at a step: all of them every 50th step (and the first), else a few random ones.
inline std::vector<int64_t> rows_to_check(std::mt19937_64& rng, int step, int64_t rows) {
  std::vector<int64_t> picked;
  if (step % 50 == 0) {
    picked.resize(rows);
    std::iota(picked.begin(), picked.end(), 0);
    return picked;
  }
  for (int i = 0; i < 6 && rows > 0; ++i) {
    picked.push_back(std::uniform_int_distribution<int64_t>(0, rows - 1)(rng));
  }
  picked.push_back(rows - 1);  // the last row of the batch
  return picked;
}

#endif  // TESSERA_HAVE_CUDA

}  // namespace tessera::test
