// CPU merge of partial attention states (split-KV, cascade / shared prefix, context parallel).
//
// A state over key set S is (o_S, lse_S) with lse_S = log sum_{j in S} exp(s_j) and o_S the
// softmax-weighted mean of the values. For disjoint sets the union is exact:
//   lse = m + log(sum_S exp(lse_S - m)),  o = sum_S exp(lse_S - m) o_S / sum_S exp(lse_S - m)
// with m = max_S lse_S, so no exponential overflows. A state with lse = -inf saw no key: it has
// weight 0 and its o is never read (an empty partial's o may be uninitialised memory, and
// 0 * NaN would poison the result). If every state is empty the result is o = 0, lse = -inf.
// A state with lse = NaN (a row that met a NaN or +inf score, include/tessera/attention.hpp) or
// +inf (no finite weight) makes the merged row NaN: o = NaN in every feature, lse = NaN. NaN or
// inf inside the o of a finite state propagates to the features holding it, per IEEE.
//
// Accumulation is in double; the output row is written element by element only after its inputs
// at that element are read, so o_out may alias an input (in-place merge into o_a).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"

namespace tessera::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// lse NaN or +inf: the state cannot be weighed, and the merged row is NaN.
bool poisoned_lse(float lse) { return !(lse < std::numeric_limits<float>::infinity()); }

int64_t head_row_offset(const TensorView& view, int64_t row, int64_t head) {
  return row * view.stride[0] + head * view.stride[1];
}

// o = value in every feature of the row; lse_out (when given) = lse.
void write_constant_row(const TensorView& o_out, float* lse_out, int64_t row, int64_t head,
                        int64_t head_dim, float value, float lse) {
  const int64_t offset = head_row_offset(o_out, row, head);
  for (int64_t d = 0; d < head_dim; ++d)
    store_from_float(o_out.data, o_out.dtype, offset + d, value);
  if (lse_out != nullptr) lse_out[row * o_out.shape[1] + head] = lse;
}

}  // namespace

void cpu_merge_state(const TensorView& o_a, const float* lse_a, const TensorView& o_b,
                     const float* lse_b, const TensorView& o_out, float* lse_out) {
  const int64_t rows = o_a.shape[0];
  const int64_t heads = o_a.shape[1];
  const int64_t head_dim = o_a.shape[2];
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t lse_index = row * heads + head;
      const float a = lse_a[lse_index];
      const float b = lse_b[lse_index];
      const bool a_empty = a == kNegativeInfinity;
      const bool b_empty = b == kNegativeInfinity;
      if (poisoned_lse(a) || poisoned_lse(b)) {
        write_constant_row(o_out, lse_out, row, head, head_dim, kNaN, kNaN);
        continue;
      }
      if (a_empty && b_empty) {
        write_constant_row(o_out, lse_out, row, head, head_dim, 0.0f, kNegativeInfinity);
        continue;
      }
      const double max_lse = a_empty ? b : (b_empty ? a : std::fmax(a, b));
      const double weight_a = a_empty ? 0.0 : std::exp(static_cast<double>(a) - max_lse);
      const double weight_b = b_empty ? 0.0 : std::exp(static_cast<double>(b) - max_lse);
      const double total = weight_a + weight_b;  // >= 1: the larger side has weight exp(0)
      const double scale_a = weight_a / total;
      const double scale_b = weight_b / total;

      const int64_t offset_a = head_row_offset(o_a, row, head);
      const int64_t offset_b = head_row_offset(o_b, row, head);
      const int64_t offset_out = head_row_offset(o_out, row, head);
      for (int64_t d = 0; d < head_dim; ++d) {
        double value = 0.0;
        if (!a_empty) value += scale_a * load_as_float(o_a.data, o_a.dtype, offset_a + d);
        if (!b_empty) value += scale_b * load_as_float(o_b.data, o_b.dtype, offset_b + d);
        store_from_float(o_out.data, o_out.dtype, offset_out + d, static_cast<float>(value));
      }
      if (lse_out != nullptr) {
        lse_out[lse_index] = static_cast<float>(max_lse + std::log(total));
      }
    }
  }
}

void cpu_merge_states(const TensorView& states, const float* lse, const int32_t* indptr,
                      const TensorView& o_out, float* lse_out) {
  const int64_t rows = o_out.shape[0];
  const int64_t heads = o_out.shape[1];
  const int64_t head_dim = o_out.shape[2];
  std::vector<double> accumulator(static_cast<size_t>(head_dim));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t first_state = indptr[row];
    const int64_t end_state = indptr[row + 1];
    for (int64_t head = 0; head < heads; ++head) {
      double max_lse = kNegativeInfinity;
      bool poisoned = false;
      for (int64_t state = first_state; state < end_state; ++state) {
        const float value = lse[state * heads + head];
        poisoned = poisoned || poisoned_lse(value);
        if (value != kNegativeInfinity && value > max_lse) max_lse = value;
      }
      if (poisoned) {
        write_constant_row(o_out, lse_out, row, head, head_dim, kNaN, kNaN);
        continue;
      }
      if (max_lse == kNegativeInfinity) {
        write_constant_row(o_out, lse_out, row, head, head_dim, 0.0f, kNegativeInfinity);
        continue;
      }

      std::fill(accumulator.begin(), accumulator.end(), 0.0);
      double total = 0.0;
      for (int64_t state = first_state; state < end_state; ++state) {
        const float value = lse[state * heads + head];
        if (value == kNegativeInfinity) continue;
        const double weight = std::exp(static_cast<double>(value) - max_lse);
        total += weight;
        const int64_t offset = head_row_offset(states, state, head);
        for (int64_t d = 0; d < head_dim; ++d) {
          accumulator[d] += weight * load_as_float(states.data, states.dtype, offset + d);
        }
      }
      const int64_t offset_out = head_row_offset(o_out, row, head);
      for (int64_t d = 0; d < head_dim; ++d) {
        store_from_float(o_out.data, o_out.dtype, offset_out + d,
                         static_cast<float>(accumulator[d] / total));
      }
      if (lse_out != nullptr) {
        lse_out[row * heads + head] = static_cast<float>(max_lse + std::log(total));
      }
    }
  }
}

}  // namespace tessera::detail
