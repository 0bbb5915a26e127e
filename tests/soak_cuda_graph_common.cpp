// What the CUDA-graph soak's workloads share (soak_cuda_graph.hpp): CUDA errors as exceptions,
// copies and poisoning on the stream, the spot check's NaN scan and oracle comparison, and the
// K/V and q / o / lse buffers of both graphs (GraphBuffers).
#if defined(TESSERA_HAVE_CUDA)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "devtools/bench_support.hpp"
#include "soak_cuda_graph.hpp"

namespace tessera::soak {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw CudaFailure(std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                      cudaGetErrorString(status) + ")");
  }
}

void copy_to_device(const DeviceBuffer& dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  cuda_check(cudaMemcpyAsync(dst.data(), src, bytes, cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (host to device)");
}

namespace {

void copy_to_host(void* dst, const DeviceBuffer& src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  cuda_check(cudaMemcpyAsync(dst, src.data(), bytes, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync (device to host)");
}

void poison(const DeviceBuffer& buffer, cudaStream_t stream) {  // 0xff bytes: NaN in bf16 / fp32
  cuda_check(cudaMemsetAsync(buffer.data(), 0xff, buffer.bytes(), stream), "cudaMemsetAsync");
}

bool bf16_is_nan(uint16_t bits) { return (bits & 0x7fffu) > 0x7f80u; }

// No NaN in the batch's o (rows x heads x head_dim bf16) or lse: every row was written.
std::string scan_for_nan(const std::vector<uint16_t>& o, size_t o_count,
                         const std::vector<float>& lse, size_t lse_count, int64_t row_elements) {
  for (size_t i = 0; i < o_count; ++i) {
    if (bf16_is_nan(o[i])) {
      return "NaN in o (token " + std::to_string(static_cast<int64_t>(i) / row_elements) +
             ", element " + std::to_string(static_cast<int64_t>(i) % row_elements) + ")";
    }
  }
  for (size_t i = 0; i < lse_count; ++i) {
    if (std::isnan(lse[i])) return "NaN in lse (entry " + std::to_string(i) + ")";
  }
  return "";
}

}  // namespace

// Compares `rows` of the downloaded o (bf16, [token][head][dim] packed) and lse ([token][head])
// with the oracle over the host problem `host` (the same batch's q, K/V and indices).
std::string compare_rows(const detail::AttentionProblem& host,
                         std::vector<detail::ReferenceRow>& rows, const std::vector<uint16_t>& o,
                         const std::vector<float>& lse, const Tolerance& tolerance) {
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.request != b.request ? a.request < b.request : a.qo_head < b.qo_head;
  });
  std::vector<double> ref_o, ref_lse;
  detail::cpu_reference_rows(host, rows, &ref_o, &ref_lse);
  const int32_t head_dim = host.head_dim;
  for (size_t r = 0; r < rows.size(); ++r) {
    const detail::ReferenceRow& row = rows[r];
    const int64_t token = int64_t{host.q_begin(row.request)} + row.token;
    const int64_t entry = token * host.num_qo_heads + row.qo_head;
    double diff = 0, norm = 0;
    for (int32_t d = 0; d < head_dim; ++d) {
      const double got = detail::bf16_to_float(o[static_cast<size_t>(entry * head_dim + d)]);
      const double ref = ref_o[r * head_dim + d];
      diff += (got - ref) * (got - ref);
      norm += ref * ref;
    }
    const double error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    const double got_lse = lse[static_cast<size_t>(entry)];
    const bool lse_ok = std::isinf(ref_lse[r])
                            ? (std::isinf(got_lse) && got_lse < 0)
                            : std::fabs(got_lse - ref_lse[r]) <= tolerance.lse;
    if (!(error < tolerance.o) || !lse_ok) {
      char text[320];
      std::snprintf(text, sizeof(text),
                    "request %d (q_len %d, kv_len %d) token %d head %d: relative L2 %.3g "
                    "(limit %.3g), lse %.7g vs reference %.7g",
                    row.request, host.q_len(row.request), host.kv.kv_len(row.request),
                    row.token, row.qo_head, error, tolerance.o, got_lse, ref_lse[r]);
      return text;
    }
  }
  return "";
}

// ---------------------------------------------------------------------------- GraphBuffers

GraphBuffers::GraphBuffers(int64_t kv_count, int64_t max_tokens, int qo_heads, int dim)
    : num_qo_heads(qo_heads),
      head_dim(dim),
      kv_elements(kv_count),
      q_row(int64_t{qo_heads} * dim),
      k(static_cast<size_t>(kv_elements) * 2),
      v(static_cast<size_t>(kv_elements) * 2),
      q(static_cast<size_t>(max_tokens * q_row) * 2),
      o(static_cast<size_t>(max_tokens * q_row) * 2),
      lse(static_cast<size_t>(max_tokens) * num_qo_heads * 4),
      q_check(static_cast<size_t>(max_tokens * q_row)),
      o_check(static_cast<size_t>(max_tokens * q_row)),
      lse_check(static_cast<size_t>(max_tokens) * num_qo_heads) {}

void GraphBuffers::fill_kv(uint64_t seed, cudaStream_t stream) {
  devtools::cuda_fill_random(k.data(), kv_elements, DType::kBFloat16, seed, 1.0f, stream);
  devtools::cuda_fill_random(v.data(), kv_elements, DType::kBFloat16, seed + 1, 1.0f, stream);
  k_host.resize(static_cast<size_t>(kv_elements));
  v_host.resize(static_cast<size_t>(kv_elements));
  copy_to_host(k_host.data(), k, k.bytes(), stream);
  copy_to_host(v_host.data(), v, v.bytes(), stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (K/V)");
}

void GraphBuffers::poison_outputs(cudaStream_t stream) const {
  poison(o, stream);
  poison(lse, stream);
}

std::string GraphBuffers::download(int64_t tokens, cudaStream_t stream) {
  const size_t elements = static_cast<size_t>(tokens * q_row);
  const size_t entries = static_cast<size_t>(tokens) * num_qo_heads;
  copy_to_host(q_check.data(), q, elements * 2, stream);
  copy_to_host(o_check.data(), o, elements * 2, stream);
  copy_to_host(lse_check.data(), lse, entries * 4, stream);
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (spot check)");
  return scan_for_nan(o_check, elements, lse_check, entries, q_row);
}

detail::AttentionProblem GraphBuffers::problem(int32_t batch, int64_t q_extent, int num_kv_heads,
                                               int64_t kv_stride_token, int64_t kv_extent) const {
  detail::AttentionProblem host;
  host.q_dtype = DType::kBFloat16;
  host.batch_size = batch;
  host.num_qo_heads = num_qo_heads;
  host.num_kv_heads = num_kv_heads;
  host.head_dim = head_dim;
  host.q = q_check.data();
  host.q_stride_token = q_row;
  host.q_stride_head = head_dim;
  host.q_extent = q_extent;
  host.kv.dtype = DType::kBFloat16;
  host.kv.k = k_host.data();
  host.kv.v = v_host.data();
  host.kv.k_stride_token = host.kv.v_stride_token = kv_stride_token;
  host.kv.k_stride_head = host.kv.v_stride_head = head_dim;
  host.kv.k_extent = host.kv.v_extent = kv_extent;
  host.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  return host;
}

}  // namespace tessera::soak

#endif  // TESSERA_HAVE_CUDA
