// Checked mode's scan of q, k and v for NaN / inf, and of the attention sinks for NaN / +inf
// (see nonfinite_check.hpp). The elements a call reads are listed as rows (one token or key of
// one tensor, all its heads) in the order the message counts them: requests in order, then
// tokens / keys, then heads, then dims. The first non-finite element in that order is the one
// reported, on the host and on the device. The sinks (num_qo_heads floats) are read on the host,
// a device tensor through one small copy: -inf is a valid sink ("no sink"), which the exponent
// test of the q / k / v scan would flag.
#include "core/nonfinite_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/device_backend.hpp"
#include "core/half.hpp"
#include "core/validate.hpp"

namespace tessera::detail {
namespace {

template <class Bits>
int64_t scan_rows(const void* data, uint32_t mask_bits, std::span<const int64_t> row_offsets,
                  int32_t heads, int64_t head_stride, int32_t head_dim) {
  const Bits* base = static_cast<const Bits*>(data);
  const Bits mask = static_cast<Bits>(mask_bits);
  for (size_t r = 0; r < row_offsets.size(); ++r) {
    for (int32_t h = 0; h < heads; ++h) {
      const Bits* row = base + row_offsets[r] + h * head_stride;
      bool any = false;  // branch-free over the row; the exact dim only once one is found
      for (int32_t d = 0; d < head_dim; ++d) any |= (row[d] & mask) == mask;
      if (!any) continue;
      for (int32_t d = 0; d < head_dim; ++d) {
        if ((row[d] & mask) == mask) {
          return (static_cast<int64_t>(r) * heads + h) * head_dim + d;
        }
      }
    }
  }
  return -1;
}

// The rows one tensor is checked over: element offset of head 0 of each, and which request and
// position (query token or key, 0-based in the request) it is.
struct CheckedRows {
  std::vector<int64_t> offsets;
  std::vector<int32_t> request;
  std::vector<int32_t> position;

  void add(int64_t offset, int32_t b, int32_t i) {
    offsets.push_back(offset);
    request.push_back(b);
    position.push_back(i);
  }
};

// The keys [*lo, *hi) that some query row of a request sees (the visible ranges of consecutive
// rows shift by at most one key, so their union is one range); empty when none sees a key.
void seen_keys(const MaskSpec& mask, int32_t q_len, int32_t kv_len, int32_t* lo, int32_t* hi) {
  *lo = kv_len;
  *hi = 0;
  for (int32_t i = 0; i < q_len; ++i) {
    int32_t first = 0, last = 0;
    mask.visible_range(i, q_len, kv_len, &first, &last);
    if (first >= last) continue;
    *lo = std::min(*lo, first);
    *hi = std::max(*hi, last);
  }
  if (*lo >= *hi) *lo = *hi = 0;
}

CheckedRows query_rows(const Plan& plan, const AttentionProblem& problem, int64_t stride_token) {
  CheckedRows rows;
  int64_t token = 0;
  for (int32_t b = 0; b < plan.batch_size; ++b) {
    const int32_t q_len = plan.q_lens[b], kv_len = plan.kv_lens[b];
    for (int32_t i = 0; i < q_len; ++i) {
      int32_t first = 0, last = 0;
      problem.mask.visible_range(i, q_len, kv_len, &first, &last);
      if (first < last) rows.add((token + i) * stride_token, b, i);
    }
    token += q_len;
  }
  return rows;
}

// Where a call's keys live: request b's pages start at entry first_page[b] of page_indices
// (the prefix of its page counts: page_indptr was checked against the plan's lengths), `pages`
// being page_indices on the host (paged caches only).
struct CallIndex {
  const Plan& plan;
  const AttentionProblem& problem;
  std::vector<int64_t> first_page;
  const int32_t* pages = nullptr;
  void* stream = nullptr;
};

// One scanned tensor: its name in messages and its elements' layout.
struct ScannedTensor {
  const char* name;
  const void* data;
  DType dtype;
  int32_t heads;
  int64_t head_stride;
  int32_t head_dim;  // elements of a row of one head (v: head_dim_vo)
};

CheckedRows key_rows(const CallIndex& call, int64_t stride_token, int64_t stride_page) {
  const Plan& plan = call.plan;
  const KVSource& kv = call.problem.kv;
  CheckedRows rows;
  int64_t row0 = 0;  // ragged: the request's first row (kv_indptr[b], = the plan's prefix)
  for (int32_t b = 0; b < plan.batch_size; ++b) {
    const int32_t kv_len = plan.kv_lens[b];
    int32_t lo = 0, hi = 0;
    seen_keys(call.problem.mask, plan.q_lens[b], kv_len, &lo, &hi);
    for (int32_t j = lo; j < hi; ++j) {
      const int64_t offset =
          kv.paged ? static_cast<int64_t>(call.pages[call.first_page[b] + j / kv.page_size]) *
                             stride_page +
                         static_cast<int64_t>(j % kv.page_size) * stride_token
                   : (row0 + j) * stride_token;
      rows.add(offset, b, j);
    }
    row0 += kv_len;
  }
  return rows;
}

std::string value_text(float value) {
  if (std::isnan(value)) return "nan";
  return value > 0 ? "inf" : "-inf";
}

// "token 7 (request 1, query 2)", "page 3, token 5 (request 0, key 21)", "row 12 (request 1,
// key 4)": the row of a checked element.
std::string row_text(const CallIndex& call, bool query, int32_t b, int32_t position) {
  const Plan& plan = call.plan;
  const std::string who = " (request " + std::to_string(b) + (query ? ", query " : ", key ") +
                          std::to_string(position) + ")";
  const std::vector<int32_t>& lengths = query ? plan.q_lens : plan.kv_lens;
  int64_t before = 0;
  for (int32_t i = 0; i < b; ++i) before += lengths[i];
  if (query) return "token " + std::to_string(before + position) + who;
  if (!call.problem.kv.paged) return "row " + std::to_string(before + position) + who;
  const int32_t page_size = call.problem.kv.page_size;
  return "page " + std::to_string(call.pages[call.first_page[b] + position / page_size]) +
         ", token " + std::to_string(position % page_size) + who;
}

// Scans one tensor's rows and throws naming its first non-finite element.
void check_tensor(const ArgChecker& check, const CallIndex& call, const ScannedTensor& tensor,
                  const CheckedRows& rows, bool query) {
  if (rows.offsets.empty() || nonfinite_bits(tensor.dtype) == 0) return;
  const Plan& plan = call.plan;
  const int32_t head_dim = tensor.head_dim;
  const bool on_host = plan.device.type == DeviceType::kCPU;
  const DeviceBackend* gpu = on_host ? nullptr : gpu_backend();
  const int64_t found =
      on_host ? first_nonfinite_host(tensor.data, tensor.dtype, rows.offsets, tensor.heads,
                                     tensor.head_stride, head_dim)
              : gpu->first_nonfinite(plan.device.index, tensor.data, tensor.dtype,
                                     rows.offsets.data(), static_cast<int64_t>(rows.offsets.size()),
                                     tensor.heads, tensor.head_stride, head_dim, call.stream);
  if (found < 0) return;
  const int64_t per_row = static_cast<int64_t>(tensor.heads) * head_dim;
  const size_t r = static_cast<size_t>(found / per_row);
  const int32_t head = static_cast<int32_t>(found % per_row / head_dim);
  const int32_t dim = static_cast<int32_t>(found % head_dim);
  // The element itself, for its value (nan, inf or -inf).
  const size_t element = dtype_size(tensor.dtype);
  const int64_t offset = rows.offsets[r] + head * tensor.head_stride + dim;
  const unsigned char* at = static_cast<const unsigned char*>(tensor.data) + offset * element;
  unsigned char bytes[4] = {};
  if (on_host) {
    std::memcpy(bytes, at, element);
  } else {
    gpu->copy_to_host(bytes, at, element, call.stream);
  }
  check.fail(tensor.name, "non-finite value " + value_text(load_as_float(bytes, tensor.dtype, 0)) +
                              " at " + row_text(call, query, rows.request[r], rows.position[r]) +
                              ", head " + std::to_string(head) + ", dim " + std::to_string(dim) +
                              " (checked mode: TESSERA_CHECK / set_index_checking)");
}

// Throws naming the first NaN / +inf sink (a -inf sink is no sink: valid). Every query row
// reads its head's sink (a row without keys too: lse = the sink), so all are checked when the
// call has query rows.
void check_sinks(const ArgChecker& check, const Plan& plan, const AttentionProblem& problem,
                 void* stream) {
  if (problem.sinks == nullptr || plan.total_q <= 0 || problem.num_qo_heads <= 0) return;
  const size_t heads = static_cast<size_t>(problem.num_qo_heads);
  std::vector<float> copy;
  const float* sinks = problem.sinks;
  if (plan.device.type != DeviceType::kCPU) {
    copy.resize(heads);
    gpu_backend()->copy_to_host(copy.data(), problem.sinks, heads * sizeof(float), stream);
    sinks = copy.data();
  }
  for (size_t h = 0; h < heads; ++h) {
    const float sink = sinks[h];
    if (!std::isnan(sink) && !(std::isinf(sink) && sink > 0)) continue;
    check.fail("sinks", "non-finite value " + value_text(sink) + " at index " + std::to_string(h) +
                            " (query head " + std::to_string(h) +
                            ") (checked mode: TESSERA_CHECK / set_index_checking; a sink of -inf "
                            "is valid: no sink)");
  }
}

}  // namespace

int64_t first_nonfinite_host(const void* data, DType dtype, std::span<const int64_t> row_offsets,
                             int32_t heads, int64_t head_stride, int32_t head_dim) {
  const uint32_t mask = nonfinite_bits(dtype);
  switch (dtype_size(dtype)) {
    case 4: return scan_rows<uint32_t>(data, mask, row_offsets, heads, head_stride, head_dim);
    case 2: return scan_rows<uint16_t>(data, mask, row_offsets, heads, head_stride, head_dim);
    case 1: return scan_rows<uint8_t>(data, mask, row_offsets, heads, head_stride, head_dim);
    default: return -1;
  }
}

void check_finite_inputs(const ArgChecker& check, const Plan& plan, const AttentionProblem& problem,
                         void* stream) {
  const KVSource& kv = problem.kv;
  CallIndex call{plan, problem, std::vector<int64_t>(plan.batch_size + 1, 0), nullptr, stream};
  std::vector<int32_t> pages_copy;
  if (kv.paged) {
    for (int32_t b = 0; b < plan.batch_size; ++b) {
      const int64_t len = plan.kv_lens[b];
      call.first_page[b + 1] = call.first_page[b] + (len + kv.page_size - 1) / kv.page_size;
    }
    call.pages = kv.page_indices;
    if (plan.device.type != DeviceType::kCPU && call.first_page.back() > 0) {
      pages_copy.resize(static_cast<size_t>(call.first_page.back()));
      gpu_backend()->copy_to_host(pages_copy.data(), kv.page_indices,
                                  pages_copy.size() * sizeof(int32_t), stream);
      call.pages = pages_copy.data();
    }
  }
  // MLA (problem.mla) names its own tensors; its q / key rows may be two segments each.
  const bool mla = problem.mla;
  const char* k_name = mla ? "ckv_cache" : kv.paged ? "k_cache" : "k";
  const char* v_name = mla ? "ckv_cache" : kv.paged ? "v_cache" : "v";
  check_tensor(check, call,
               {mla ? "q_nope" : "q", problem.q, problem.q_dtype, problem.num_qo_heads,
                problem.q_stride_head, problem.q_main_dim()},
               query_rows(plan, problem, problem.q_stride_token), /*query=*/true);
  if (problem.q_rope != nullptr) {
    check_tensor(check, call,
                 {"q_pe", problem.q_rope, problem.q_dtype, problem.num_qo_heads,
                  problem.q_rope_stride_head, problem.rope_dim},
                 query_rows(plan, problem, problem.q_rope_stride_token), /*query=*/true);
  }
  check_tensor(
      check, call,
      {k_name, kv.k, kv.dtype, problem.num_kv_heads, kv.k_stride_head, problem.k_main_dim()},
      key_rows(call, kv.k_stride_token, kv.k_stride_page), /*query=*/false);
  if (kv.k_rope != nullptr) {
    check_tensor(check, call,
                 {"kpe_cache", kv.k_rope, kv.dtype, problem.num_kv_heads, kv.k_rope_stride_head,
                  problem.rope_dim},
                 key_rows(call, kv.k_rope_stride_token, kv.k_rope_stride_page), /*query=*/false);
  }
  check_tensor(
      check, call,
      {v_name, kv.v, kv.dtype, problem.num_kv_heads, kv.v_stride_head, problem.head_dim_v()},
      key_rows(call, kv.v_stride_token, kv.v_stride_page), /*query=*/false);
  check_sinks(check, plan, problem, stream);
}

}  // namespace tessera::detail
