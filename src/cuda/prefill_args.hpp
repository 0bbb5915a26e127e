// Launch arguments shared by the prefill kernel families (sm80/, sm90/): the validated problem,
// the uploaded plan lists and the softmax constants. Host-visible, no CUDA headers.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

// Everything a prefill kernel reads (sm80 and sm90 families), built on the host and passed by
// value (__grid_constant__, or inside the sm90 kernel parameters).
struct PrefillArgs {
  AttentionProblem problem;                // device pointers
  const WorkItem* work = nullptr;          // uploaded plan.work
  const int32_t* worker_indptr = nullptr;  // [num_workers + 1]
  int32_t num_workers = 0;                 // grid size: one persistent CTA per worker
  float* partial_o = nullptr;              // [num_partial_rows, head_dim] float32 (split-KV pieces)
  float* partial_lse = nullptr;            // [num_partial_rows] float32, natural log
  // Softmax runs in base 2: p = 2^(s * score_scale_log2 - m). Without soft-cap,
  // score_scale_log2 = sm_scale * log2(e). With soft-cap the logits are first mapped to
  // log2(e) * cap * tanh(sm_scale * s / cap), already in base 2 (score_scale_log2 = 1), through
  // e^(2x) = 2^(soft_cap_pre * s) with soft_cap_pre = 2 * log2(e) * sm_scale / cap and
  // soft_cap_post = log2(e) * cap.
  float score_scale_log2 = 0.0f;
  float soft_cap_pre = 0.0f;
  float soft_cap_post = 0.0f;
};

// Instantiated head_dim that serves `head_dim` in both prefill families (next of 64, 128, 256;
// smaller multiples of 8 are zero-padded), 0 when none does.
constexpr int prefill_head_dim_bucket(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0) return 0;
  if (head_dim <= 64) return 64;
  if (head_dim <= 128) return 128;
  if (head_dim <= 256) return 256;
  return 0;
}

}  // namespace tessera::detail
