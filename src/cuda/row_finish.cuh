// The last step of a softmax row, shared by every CUDA kernel that writes o: from the row's
// exponent base (max score x scale, base 2; -inf for a row without keys) and its sum of
// 2^(s x scale - base), the factor o is multiplied by and the natural-log lse.
//  * no key (sum exactly 0): o = 0, lse = -inf;
//  * a NaN or +inf score made base and sum NaN (ptx::max_nan): o and lse NaN;
//  * with a sink logit z (natural-log units, problem.sinks): the denominator gains e^z, which
//    has no value row: with t = z log2(e) and M = max(base, t),
//      sum' = sum 2^(base - M) + 2^(t - M),  factor = 2^(base - M) / sum',
//      lse = (M + log2 sum') ln 2;
//    a sink of -inf is no sink.
//    A row without keys then gets o = 0 and lse = z.
#pragma once

#include <cuda_runtime.h>

#include <numbers>

#include "cuda/ptx/math.cuh"

namespace tessera::detail {

struct RowFinish {
  float factor;  // multiplies the row's unnormalised o
  float lse;     // natural log
};

__device__ __forceinline__ RowFinish finish_row(float base, float sum) {
  constexpr float kLn2 = std::numbers::ln2_v<float>;
  const bool any_key = sum != 0.0f;  // true for NaN
  return {any_key ? 1.0f / sum : 0.0f, any_key ? (base + log2f(sum)) * kLn2 : -INFINITY};
}

__device__ __forceinline__ RowFinish finish_row_with_sink(float base, float sum, float sink) {
  if (sink == -INFINITY) return finish_row(base, sum);  // e^-inf = 0: no sink (no -inf - -inf)
  constexpr float kLn2 = std::numbers::ln2_v<float>;
  const float t = sink * std::numbers::log2e_v<float>;
  const float top = ptx::max_nan(base, t);
  const float shift = ptx::ex2_approx(base - top);  // 0 for a row without keys (base -inf)
  const float total = sum * shift + ptx::ex2_approx(t - top);
  return {shift / total, (top + log2f(total)) * kLn2};
}

// finish_row, with the sink of `head` when the call has sinks and the row is final (not a
// split-KV partial).
__device__ __forceinline__ RowFinish finish_row(float base, float sum, const float* sinks,
                                                int32_t head, bool final_row) {
  if (sinks != nullptr && final_row) return finish_row_with_sink(base, sum, sinks[head]);
  return finish_row(base, sum);
}

}  // namespace tessera::detail
