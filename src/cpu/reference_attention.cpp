// The oracle every attention test compares against: plain loops over (request, query head,
// query row, key), double accumulation, no tiling, no plan. Speed is secondary; being obviously
// right is the point. The per-row formula lives in reference_row() (reference_rows.cpp), shared
// with the sampled checks of `tessera bench`:
//   s_j = (q . k_j) * k_scale * sm_scale, s_j = cap * tanh(s_j / cap) if cap > 0,
//   p_j = softmax over the visible keys, o = v_scale * sum_j p_j v_j, lse = log sum_j exp(s_j);
//   with a sink z of the query head, the softmax's denominator and lse gain exp(z) (sink.hpp).
// Non-finite inputs follow include/tessera/attention.hpp: a NaN or +inf visible score makes the
// row NaN (o and lse), a -inf score is weight 0, a row of only -inf scores is empty (o = 0,
// lse = -inf), and NaN / inf in v reach o per IEEE.
// K and V rows of one (request, kv head) are converted to float once (exact for every supported
// dtype) and shared by the query heads of its group.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "cpu/reference.hpp"

namespace tessera::detail {

void cpu_reference_attention(const AttentionProblem& problem) {
  const int32_t group_size = problem.group_size();
  const int32_t head_dim = problem.head_dim_v();  // o rows
  std::vector<float> keys, values;
  std::vector<double> out(head_dim);
  for (int32_t b = 0; b < problem.batch_size; ++b) {
    const int32_t q_len = problem.q_len(b);
    if (q_len == 0) continue;
    for (int32_t kv_head = 0; kv_head < problem.num_kv_heads; ++kv_head) {
      reference_load_kv(problem, false, b, kv_head, &keys);
      reference_load_kv(problem, true, b, kv_head, &values);
      for (int32_t qo_head = kv_head * group_size; qo_head < (kv_head + 1) * group_size;
           ++qo_head) {
        for (int32_t i = 0; i < q_len; ++i) {
          const double lse =
              reference_row(problem, b, i, qo_head, keys.data(), values.data(), out.data());
          const int64_t token = problem.q_begin(b) + i;
          const int64_t o_offset = token * problem.o_stride_token +
                                   static_cast<int64_t>(qo_head) * problem.o_stride_head;
          for (int32_t d = 0; d < head_dim; ++d) {
            store_from_float(problem.o, problem.q_dtype, o_offset + d, static_cast<float>(out[d]));
          }
          if (problem.lse) {
            problem.lse[token * problem.lse_stride_token + qo_head] = static_cast<float>(lse);
          }
        }
      }
    }
  }
}

}  // namespace tessera::detail
