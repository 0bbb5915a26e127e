// Shared machinery of the non-finite input tests (tests/test_nonfinite.cpp on the CPU,
// tests/test_cuda_nonfinite.cpp on the GPU), for the semantics of include/tessera/attention.hpp:
// a case is a random attention case with one bad value (NaN, +inf or -inf in q, k or v) put at a
// chosen site, the same inputs without it, and what every output row (query token, query head)
// must then hold, derived from the definition independently of the reference:
//   kClean    untouched: as the run without the bad value (bit for bit), and close to the
//             reference on the inputs without it;
//   kNaN      o = NaN in every feature, lse = NaN;
//   kEmpty    o = 0 exactly, lse = -inf (no visible key, or only -inf scores);
//   kFeature  o[site.dim] NaN (or +inf), the other features and lse close to a reference;
//   kChanged  finite and close to the reference on the poisoned inputs (a -inf score dropped a
//             key);
//   kMaskedFeature  a row of the site's request and kv head whose mask excludes the poisoned v
//             key: either kClean, or o[site.dim] NaN with the rest as kFeature (the key shared
//             the row's key tile: P = 0 times NaN / inf in the tile's P V product).
// Sites are chosen so that the bad value touches some rows and leaves others (other requests,
// the other kv head, rows whose causal mask excludes the key) alone, and signs are forced where
// the definition needs them (q . k = +inf needs k > 0 against q = +inf).
//
//   std::mt19937_64 rng(seed);
//   NonfiniteCase c = make_nonfinite_case(nonfinite_shape(point), Poison::kKNaN, rng);
//   const NonfiniteReference reference = nonfinite_reference(c);
//   const Outputs clean = ..., poisoned = ...;  // the implementation on c.clean / c.poisoned
//   EXPECT_EQ(check_nonfinite(c, poisoned, clean, reference, tolerance, lse_tolerance), "");
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/attention_testing.hpp"

namespace tessera::test {

enum class Poison : int32_t {
  kQNaN,             // NaN in one q element: that row NaN (and an empty row stays empty)
  kQPosInf,          // +inf in q, k > 0 at that dim: every score +inf, the row NaN
  kQNegInf,          // -inf in q, k > 0 at that dim: every score -inf, the row empty
  kKNaN,             // NaN in one k element: every row seeing that key NaN
  kKPosInf,          // +inf in k, q > 0 at that dim: rows seeing the key NaN
  kKNegInfKey,       // -inf in one k element, q > 0: the key has weight 0 (dropped)
  kAllScoresNegInf,  // -inf in every key of one (request, kv head), q > 0: those rows empty
  kVNaN,             // NaN in one v element: that feature NaN in rows seeing the key
  kVInf,             // +inf in one v element: that feature +inf in rows seeing the key
  kVInfZeroWeight,   // +inf in v of a key whose score is -inf: 0 * inf, that feature NaN
};
inline constexpr Poison kAllPoisons[] = {
    Poison::kQNaN,    Poison::kQPosInf,       Poison::kQNegInf,         Poison::kKNaN,
    Poison::kKPosInf, Poison::kKNegInfKey,    Poison::kAllScoresNegInf, Poison::kVNaN,
    Poison::kVInf,    Poison::kVInfZeroWeight};
const char* poison_name(Poison poison);

// Where the bad value goes: request, query token (0-based in the request) and query head for
// q; key and kv head for k / v; the feature for both. (empty_request, empty_token): a q row
// that sees no key (-1: the case has none), which the q cases poison too: it must stay empty.
struct PoisonSite {
  int32_t request = 0, token = 0, qo_head = 0, key = 0, kv_head = 0, dim = 0;
  int32_t empty_request = -1, empty_token = -1;
};

enum class RowKind : int32_t { kClean, kNaN, kEmpty, kFeature, kChanged, kMaskedFeature };
struct RowExpectation {
  RowKind kind = RowKind::kClean;
  bool feature_nan = false;      // kFeature: NaN (else +inf) at site.dim
  bool versus_poisoned = false;  // kFeature: other features against the poisoned reference
  // kFeature +inf: NaN accepted too (a split-KV piece or a masked row's tile multiplied the
  // inf by P = 0 before the merge); kFeature NaN of a zero-weight key: the value without the key
  // accepted too (a piece whose only visible key it was finishes as an empty row, o = 0).
  bool or_nan = false;
  bool or_dropped = false;
};

struct NonfiniteCase {
  Poison poison = Poison::kQNaN;
  PoisonSite site;
  AttentionBuffers clean;            // the inputs without the bad value (signs forced alike)
  AttentionBuffers poisoned;         // the same with it
  std::vector<RowExpectation> rows;  // [total_q x num_qo_heads], token-major
  int64_t touched = 0;               // rows that see a key and are not kClean

  int64_t count(RowKind kind) const;
  std::string describe() const;
};

// The shape of a case of the test matrix: three requests, one without keys, one long (the
// site), one with fewer keys than queries (causal rows without keys). Decode (uniform queries
// over a paged cache) when `decode`; long_kv: thousands of keys (split-KV).
struct NonfiniteShape {
  bool paged = false;
  bool decode = false;
  int32_t page_size = 16;
  bool causal = false;
  int32_t group_size = 1;  // query heads per kv head (2 kv heads)
  DType dtype = DType::kFloat16;
  int32_t head_dim = 64;
  int32_t q_per_request = 1;  // decode
  int32_t long_kv = 0;        // > 0: the site request has this many keys
  int32_t long_q = 0;         // > 0 (prefill): the site request has this many queries
  std::string describe() const;
};
AttentionCase nonfinite_shape(const NonfiniteShape& shape);

// Builds a case over `c`: its site request is the one with the most keys (it must have queries).
NonfiniteCase make_nonfinite_case(const AttentionCase& c, Poison poison, std::mt19937_64& rng);

// The reference (double, src/cpu/reference_*.cpp) on both inputs.
struct NonfiniteReference {
  Outputs clean, poisoned;
};
NonfiniteReference nonfinite_reference(NonfiniteCase& c);

// "" when `actual` (an implementation's outputs on c.poisoned) meets every row's expectation,
// `clean_run` being the same implementation's outputs on c.clean (kClean rows must match it bit
// for bit; pass nullptr to skip that); else what failed, a few rows at most. tolerance: relative
// L2 over every compared feature; lse_tolerance: absolute, per row.
std::string check_nonfinite(const NonfiniteCase& c, const Outputs& actual, const Outputs* clean_run,
                            const NonfiniteReference& reference, double tolerance,
                            double lse_tolerance);

// ---- checked mode (set_index_checking): the text naming the site's bad element ----

// "tessera::<op>: 'q': non-finite value nan at token 24 (request 1, query 20), head 7, dim 61"
// for a q poison, or the same for k / v ('k' / 'v' ragged, 'k_cache' / 'v_cache' paged) with
// "at row R (request b, key j)" / "at page P, token T (request b, key j)". op: run_decode,
// run_paged_prefill or run_ragged_prefill. The q / k / v the case poisons, with its value.
std::string checked_message(const NonfiniteCase& c);
// "page P, token T (request b, key j), head h, dim d" (paged) or "row R (...)" (ragged) of the
// site's key, kv head and dim.
std::string checked_key_where(const NonfiniteCase& c);

// ---- merge_state / merge_states with NaN, +inf and empty partials ----

// merge_state rows (a, b): NaN + finite, finite + NaN, NaN + empty, empty + empty, +inf +
// finite, a finite a whose o holds NaN / inf in feature 3 (two rows), finite + empty. Empty
// states' o hold NaN (never read). float32, [n, h, d].
struct MergeStateCase {
  int64_t n = 0, h = 2, d = 8;
  std::vector<float> o_a, lse_a, o_b, lse_b;
};
MergeStateCase merge_state_case();
// "" when (o, lse) of merge_state(case) are as the definition says, else what is not.
std::string check_merge_state(const MergeStateCase& m, const std::vector<float>& o,
                              const std::vector<float>& lse);

// merge_states rows: all-NaN states, NaN among finite ones, NaN + empty, all empty, +inf +
// finite, finite + empty + finite. float32 states [S, h, d], lse [S, h], indptr [rows + 1].
struct MergeStatesCase {
  int64_t h = 1, d = 4;
  std::vector<int32_t> indptr;
  std::vector<float> states, lse;
  int64_t rows() const { return static_cast<int64_t>(indptr.size()) - 1; }
};
MergeStatesCase merge_states_case();
std::string check_merge_states(const MergeStatesCase& m, const std::vector<float>& o,
                               const std::vector<float>& lse);

}  // namespace tessera::test
