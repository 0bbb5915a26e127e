// Random MLA problems for the C++ and C ABI tests (issue 37): host buffers of a paged latent
// cache (two tensors, or one combined [.., kv_lora_rank + rope_dim] cache), q_nope / q_pe, and an
// independent brute force of the formula of include/tessera/mla.hpp in double loops (it shares
// no code with the library: the CPU reference is what it checks).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tessera/mla.hpp"

namespace tessera::test {

struct MlaCase {
  std::vector<int32_t> q_lens, kv_lens;  // per request
  int32_t num_heads = 16, kv_lora_rank = 64, rope_dim = 16, page_size = 16;
  bool causal = false;
  float sm_scale = 0.0f;
  DType dtype = DType::kFloat32;
  bool combined_cache = false;  // one [num_pages, page_size, lora + rope] cache, two views
  bool combined_q = false;      // q_nope / q_pe as views of one [total_q, H, lora + rope] buffer
  std::string describe() const;
};

// Host buffers; every element outside the tokens the call may read is NaN (spare pages, the tail
// of last pages), and o / lse are NaN until a run writes them.
struct MlaBuffers {
  MlaCase c;
  int64_t total_q = 0, num_pages = 0;
  std::vector<uint8_t> q, q_pe_separate, cache, kpe_separate, o;
  std::vector<float> lse;
  std::vector<int32_t> qo_indptr, page_indptr, page_indices, last_page_len;

  TensorView q_nope() const;
  TensorView q_pe() const;
  TensorView ckv_cache() const;
  TensorView kpe_cache() const;
  TensorView o_view() const;
  TensorView lse_view() const;
  TensorView index_view(const std::vector<int32_t>& v) const;
  MlaPagedCache paged_cache() const;
  void poison_outputs();
  // Element (token, head, d) of q (d < lora: q_nope, else q_pe) and of the cache row of key j of
  // request b (d < lora: ckv, else kpe), as the call sees them (after dtype rounding).
  double q_at(int64_t token, int32_t head, int32_t d) const;
  double kv_at(int32_t b, int32_t j, int32_t d) const;
};

MlaBuffers make_mla_buffers(const MlaCase& c, std::mt19937_64& rng);

struct MlaResult {
  std::vector<double> o;  // [total_q, H, lora]
  std::vector<double> lse;
};

// The formula, directly: s_j = scale (q_nope . ckv_j + q_pe . kpe_j), o = softmax(s) . ckv.
MlaResult mla_brute_force(const MlaBuffers& buffers);
MlaResult mla_outputs(const MlaBuffers& buffers);  // what the last run wrote

// Largest |a - b| of o (NaN counts as infinite) and of lse (both -inf counts as equal).
struct MlaDiff {
  double o = 0, lse = 0;
};
MlaDiff mla_diff(const MlaResult& actual, const MlaResult& expected);
double mla_tolerance(DType dtype);

MlaCase random_mla_case(std::mt19937_64& rng, int32_t num_heads, int32_t kv_lora_rank,
                        int32_t rope_dim, int32_t page_size, int32_t max_kv);

}  // namespace tessera::test
