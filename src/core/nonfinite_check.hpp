// Checked mode's scan of the attention inputs for NaN / inf (issue 38; the semantics of
// non-finite inputs are in include/tessera/attention.hpp). With index checking on, run_* scans
// the q, k and v elements that the call reads, and the attention sinks, before anything runs and
// throws naming the first non-finite one (a -inf sink is valid): host tensors on the CPU here,
// device tensors with one small kernel through the backend table (DeviceBackend::first_nonfinite,
// src/cuda/ops/nonfinite.cu; the sinks, num_qo_heads floats, through one copy to the host).
#pragma once

#include <cstdint>
#include <span>

#include "core/problem.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail {

class ArgChecker;  // core/validate.hpp (not included: the CUDA scan includes this header)

// The bits of `dtype`'s exponent field (fp8 e4m3: exponent and mantissa, whose only non-finite
// pattern is NaN, S.1111.111); an element is NaN or +-inf exactly when all of them are set.
// 0 for dtypes that are not floating point.
inline uint32_t nonfinite_bits(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 0x7f800000u;
    case DType::kFloat16: return 0x7c00u;
    case DType::kBFloat16: return 0x7f80u;
    case DType::kFloat8E4M3: return 0x7fu;
    case DType::kFloat8E5M2: return 0x7cu;
    default: return 0;
  }
}

// The first non-finite element of rows x heads x head_dim elements of a host tensor, element
// (r, h, d) at row_offsets[r] + h * head_stride + d: r * heads * head_dim + h * head_dim + d, or
// -1 when all are finite. The device version (same arguments, device data) is
// DeviceBackend::first_nonfinite.
int64_t first_nonfinite_host(const void* data, DType dtype, std::span<const int64_t> row_offsets,
                             int32_t heads, int64_t head_stride, int32_t head_dim);

// Throws (check.fail) naming the tensor (q, k / v or k_cache / v_cache) and the first index
// (token / row / page and position, head, dim) of a NaN or inf among the elements the call
// reads: q rows that see at least one key, and for each request with queries the keys its rows
// see (their union), every kv head and dim; then, with attention sinks, the first NaN or +inf
// sink (index = query head; -inf is valid, "no sink"), when the call has query rows. Elements
// the call does not read (padding, other pages, keys outside every row's mask, rows that see no
// key) are not checked: their values do not change the result. `plan` and `problem` are
// validated; for device tensors the index arrays were checked against the plan (checked mode),
// so request starts follow from the plan's lengths and only page_indices (and the sinks) is read
// (copied to the host, synchronising `stream`).
void check_finite_inputs(const ArgChecker& check, const Plan& plan, const AttentionProblem& problem,
                         void* stream);

}  // namespace tessera::detail
