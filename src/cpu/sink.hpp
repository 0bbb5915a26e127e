// Attention sinks on the CPU (include/tessera/attention.hpp): folding a sink logit z into a
// finished softmax row. The row's sink-free lse L (natural log; -inf for a row without keys,
// NaN for a NaN row) becomes L' = log(e^L + e^z) and o is multiplied by e^(L - L'), the share
// the keys keep. The reference (reference_rows.cpp), the fast path's final rows (write_rows)
// and its split-KV merge (merge_partials) all finish rows through fold_sink, once per row: a
// split-KV partial never holds the sink.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace tessera::detail {

struct SinkFold {
  double factor;  // multiplies the sink-free o (NaN: the row is NaN)
  double lse;     // natural log
};

// z = -inf is no sink; a NaN or +inf z makes the row NaN (as a NaN or +inf score would); a row
// without keys (L = -inf) gets factor 0 and lse z.
inline SinkFold fold_sink(double lse, double sink) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  if (std::isnan(lse) || std::isnan(sink) || sink == kInf) return {kNaN, kNaN};
  if (sink == -kInf) return {1.0, lse};
  if (lse == -kInf) return {0.0, sink};
  const double top = std::max(lse, sink);
  const double total = std::exp(lse - top) + std::exp(sink - top);
  const double folded = top + std::log(total);
  return {std::exp(lse - folded), folded};
}

}  // namespace tessera::detail
