// The oracle's row-level entry point: attention of selected query rows, accumulated in double.
// The full reference (cpu_reference_attention) and the sampled checks of `tessera bench` both
// compute through reference_row(), so there is one definition of the semantics.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/problem.hpp"

namespace tessera::detail {

struct ReferenceRow {
  int32_t request;
  int32_t token;  // 0-based within the request
  int32_t qo_head;
};

// Attention of one query row against the already-converted K/V rows (float, [kv_len, head_dim]
// and [kv_len, head_dim_vo]) of its request and kv head. Writes head_dim_vo values to `out`; returns the natural-log lse
// (-inf when the row sees no key or every visible score is -inf, and then `out` is all zeros;
// NaN when a visible score is NaN or +inf, and then `out` is all NaN: the non-finite semantics
// of include/tessera/attention.hpp). With problem.sinks the row's sink joins the softmax
// (sink.hpp): a row without keys then gives o = 0 and lse = the sink.
double reference_row(const AttentionProblem& problem, int32_t request, int32_t token,
                     int32_t qo_head, const float* keys, const float* values, double* out);

// Converts K or V rows [0, kv_len) of (request, kv_head) to float.
void reference_load_kv(const AttentionProblem& problem, bool values, int32_t request,
                       int32_t kv_head, std::vector<float>* out);

// The oracle for a list of rows: o_out gets rows.size() x head_dim_vo values, lse_out rows.size().
void cpu_reference_rows(const AttentionProblem& problem, std::span<const ReferenceRow> rows,
                        std::vector<double>* o_out, std::vector<double>* lse_out);

}  // namespace tessera::detail
