// Random multi-level cascade cases (include/tessera/cascade.hpp) on the host, and their
// reference: per query row and head, one double-precision softmax over the keys of the row's
// group at every level (the last level under the causal mask), plus the sink. Shared by the CPU
// test (test_cascade.cpp) and the GPU test (test_cuda_cascade.cpp), which copy the host data to
// the device.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tessera/attention.hpp"
#include "tessera/cascade.hpp"
#include "tessera/types.hpp"

namespace tessera::test {

struct CascadeCase {
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t page_size = 16;
  DType dtype = DType::kFloat16;  // q, o and the cache
  KVLayout layout = KVLayout::kNHD;
  bool causal = false;
  float soft_cap = 0.0f;
  bool with_sinks = false;
  bool with_lse = true;
  std::vector<int32_t> q_lens;  // per request (0 allowed)
  // Per level: the groups as ranges of requests, group g = requests
  // [groups[l][g], groups[l][g + 1]); the last level is one group per request.
  std::vector<std::vector<int32_t>> groups;
  std::vector<std::vector<int32_t>> kv_lens;  // per level, per group

  int num_levels() const { return static_cast<int>(groups.size()); }
  int32_t batch_size() const { return static_cast<int32_t>(q_lens.size()); }
  int64_t total_q() const;
  std::string describe() const;
};

struct RandomCascadeOptions {
  std::vector<DType> dtypes = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  int32_t max_batch = 6;
  int32_t max_q_len = 6;        // 1 for decode-only cases
  int32_t max_prefix_len = 200;
  int32_t max_own_len = 60;
  bool decode_only = false;     // every request holds one query row
};

CascadeCase random_cascade_case(std::mt19937_64& rng, const RandomCascadeOptions& options);

// Host data of a case: a page pool (unused slots and spare pages NaN: nothing may read them), q,
// sinks, and each level's CSR arrays.
struct CascadeData {
  CascadeCase test_case;
  int64_t num_pages = 0;
  std::vector<uint8_t> k_pool, v_pool;  // [num_pages, page_size, H_kv, D] (NHD) or HND
  std::vector<uint8_t> q;               // [total_q, H_qo, D]
  std::vector<float> sinks;             // [H_qo] when with_sinks
  std::vector<std::vector<int32_t>> qo_indptr, page_indptr, page_indices, last_page_len;

  std::vector<CascadeLevelLengths> lengths() const;
  std::vector<int64_t> pool_shape() const;  // the 4-D shape of k_pool / v_pool
};

CascadeData make_cascade_data(const CascadeCase& test_case, std::mt19937_64& rng);

struct CascadeExpected {
  std::vector<double> o;    // [total_q, H_qo, D]
  std::vector<double> lse;  // [total_q, H_qo]
  std::vector<char> empty;  // [total_q, H_qo]: the row saw no key
};

CascadeExpected reference_cascade(const CascadeData& data);

// Checks o (q's dtype, contiguous) and lse (float32, may be empty) against the reference: no
// NaN, relative L2 of o within `tolerance`, lse within 1e-2 absolute, rows without keys exactly
// o = 0 and lse = -inf (the sink with sinks). Returns "" or what differs.
std::string compare_cascade(const CascadeData& data, const CascadeExpected& expected,
                            const std::vector<uint8_t>& o, const std::vector<float>& lse,
                            double tolerance);

}  // namespace tessera::test
