// Shared machinery of the attention tests (CPU now, GPU later): random attention cases, host
// buffers holding their data, an AttentionProblem over those buffers (or over device copies of
// them), hand-made plans, output poisoning and the comparison against the reference.
//
// Typical use:
//   std::mt19937_64 rng(seed);
//   AttentionCase c = random_case(rng);
//   AttentionBuffers buffers = make_buffers(c, rng);
//   poison_outputs(buffers);
//   detail::cpu_reference_attention(make_problem(buffers));
//   Outputs expected = copy_outputs(buffers);
//   poison_outputs(buffers);
//   ... run the implementation under test into buffers.o / buffers.lse ...
//   Comparison result = compare_outputs(buffers, copy_outputs(buffers), expected);
// A GPU test copies the byte vectors of `buffers` to the device, fills a BufferPointers with the
// device addresses, and builds the problem with make_problem(buffers, device_pointers).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "tessera/attention.hpp"
#include "tessera/types.hpp"

namespace tessera::test {

// One attention call: lengths, shapes, dtypes, K/V layout, mask and strides.
struct AttentionCase {
  std::vector<int32_t> q_lens;   // per request; 0 allowed
  std::vector<int32_t> kv_lens;  // per request; 0 allowed
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 8;
  int32_t head_dim = 128;
  // Width of v and o rows (AttentionOptions::head_dim_vo); 0: head_dim. K and V share their
  // strides, sized for the wider of the two (the narrower one's rows end in NaN padding).
  int32_t head_dim_vo = 0;
  DType q_dtype = DType::kFloat16;  // q and o
  DType kv_dtype = DType::kFloat16;
  bool paged = false;
  int32_t page_size = 16;
  KVLayout layout = KVLayout::kNHD;
  int32_t spare_pages = 0;  // pool pages no request uses (NaN-filled: reading one shows up)
  // Decode-style queries: no qo_indptr, request b owns rows [b * q, (b + 1) * q) with
  // q = q_lens[0] (all q_lens equal).
  bool uniform_q = false;
  bool causal = false;
  int32_t window_left = -1;  // -1: unbounded
  int32_t window_right = -1;
  float soft_cap = 0.0f;  // 0: off
  float sm_scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  bool with_lse = true;
  // Attention sinks (RunOptions::sinks): one random float32 logit per query head, drawn by
  // make_buffers after everything else (cases without sinks draw exactly as before).
  bool with_sinks = false;
  // Extra elements after every head row / every token of a tensor (non-contiguous strides).
  int32_t q_head_pad = 0, q_token_pad = 0;
  int32_t o_head_pad = 0, o_token_pad = 0;
  int32_t kv_head_pad = 0, kv_token_pad = 0;
  int32_t lse_token_pad = 0;

  int32_t batch_size() const { return static_cast<int32_t>(q_lens.size()); }
  int32_t group_size() const { return num_qo_heads / num_kv_heads; }
  int32_t head_dim_v() const { return head_dim_vo > 0 ? head_dim_vo : head_dim; }
  int64_t total_q() const;
  int64_t total_kv() const;
  float resolved_sm_scale() const;
  detail::MaskSpec mask() const;
  // Query-key pairs that the mask lets through, summed over requests and query heads.
  int64_t visible_pairs() const;
  // One line for failure messages: every field that distinguishes this case.
  std::string describe() const;
};

// Limits of random_case. Defaults keep one case cheap enough for the double reference.
struct RandomCaseOptions {
  int32_t max_batch = 4;
  int32_t max_q_len = 80;
  int32_t max_kv_len = 300;
  int32_t max_kv_heads = 3;
  int32_t max_group = 8;
  std::vector<int32_t> head_dims = {64, 80, 96, 128, 256};
  double any_head_dim_probability = 0.1;  // else from head_dims: any multiple of 8 up to 256
  std::vector<DType> q_dtypes = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  bool allow_fp8_kv = true;
  bool allow_paged = true;
  // Lengths are halved until sum(q_len * kv_len) * num_qo_heads * head_dim is below this.
  int64_t max_reference_macs = 12'000'000;
};

AttentionCase random_case(std::mt19937_64& rng, const RandomCaseOptions& options = {});

// Host data of one case. Tensors are raw bytes in their dtype (a GPU test copies them as they
// are); strides are in elements. Stride padding, spare pages and unused tails are NaN so that
// reading them poisons the result.
struct AttentionBuffers {
  AttentionCase test_case;
  int64_t q_stride_token = 0, q_stride_head = 0;
  int64_t o_stride_token = 0, o_stride_head = 0;
  int64_t lse_stride_token = 0;
  int64_t kv_stride_token = 0, kv_stride_head = 0, kv_stride_page = 0;  // K and V alike
  int64_t num_pages = 0;
  std::vector<uint8_t> q, k, v, o, lse;                           // lse: float32
  std::vector<int32_t> qo_indptr, kv_indptr;                      // ragged
  std::vector<int32_t> page_indptr, page_indices, last_page_len;  // paged
  std::vector<float> sinks;                                       // [num_qo_heads] or empty
};

AttentionBuffers make_buffers(const AttentionCase& test_case, std::mt19937_64& rng);

// Addresses of the buffers an AttentionProblem points at.
struct BufferPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // null when the case has no lse
  const int32_t* qo_indptr = nullptr;
  const int32_t* kv_indptr = nullptr;
  const int32_t* page_indptr = nullptr;
  const int32_t* page_indices = nullptr;
  const int32_t* last_page_len = nullptr;
  const float* sinks = nullptr;  // null when the case has no sinks
};

BufferPointers host_pointers(AttentionBuffers& buffers);
detail::AttentionProblem make_problem(const AttentionBuffers& buffers,
                                      const BufferPointers& pointers);
detail::AttentionProblem make_problem(AttentionBuffers& buffers);  // over the host buffers

// Fills o and lse (stride padding included) with NaN bytes.
void poison_outputs(AttentionBuffers& buffers);

struct Outputs {
  std::vector<uint8_t> o;
  std::vector<uint8_t> lse;
};
Outputs copy_outputs(const AttentionBuffers& buffers);

struct Comparison {
  double rel_l2 = 0.0;               // ||out - ref|| / ||ref|| over o (||out|| when ref is 0)
  double max_abs_err = 0.0;          // over o
  int64_t nan_count = 0;             // non-finite o values, NaN lse values
  double lse_max_abs_err = 0.0;      // over rows whose reference lse is finite
  int64_t lse_inf_mismatches = 0;    // rows where exactly one of out / ref lse is -inf
  int64_t empty_row_violations = 0;  // rows seeing no key whose o != 0 or lse != -inf (the
                                     // head's sink with sinks)
  int64_t padding_writes = 0;        // o / lse elements outside the logical tensor written
  bool ok(double tolerance, double lse_tolerance) const;
  std::string describe() const;
};

Comparison compare_outputs(const AttentionBuffers& buffers, const Outputs& actual,
                           const Outputs& expected);

// Relative-L2 bound for an implementation computing in float against the reference:
// limited by the rounding of o to the output dtype.
double default_tolerance(const AttentionCase& test_case);
double default_lse_tolerance(const AttentionCase& test_case);

// Hand-made plans (independent of the core planner): one work item per (request, kv head,
// q tile); with kv_chunk > 0 the key range of a tile is split into pieces of kv_chunk keys that
// write partials combined by merge items. Items are dealt round-robin to num_workers workers.
struct TestPlanOptions {
  int32_t q_tile_rows = 64;  // packed rows (tokens x group heads) per work item
  int32_t kv_chunk = 0;      // 0: never split
  int32_t num_workers = 1;
};

Plan make_test_plan(const AttentionCase& test_case, const TestPlanOptions& options);

}  // namespace tessera::test
