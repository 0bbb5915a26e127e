// The CUDA-graph soak's pieces (the program and its description: soak_cuda_graph.cpp): the two
// workloads whose graphs it replays, decode (soak_cuda_graph_decode.cpp) and ragged prefill
// (soak_cuda_graph_prefill.cpp), each sized for its largest batch, and the buffers, CUDA error
// and spot-check helpers they share (soak_cuda_graph_common.cpp). Only in builds with the CUDA
// backend.
#pragma once

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/gpu_test_support.hpp"
#include "core/problem.hpp"
#include "cpu/reference.hpp"
#include "tessera/tessera.hpp"

namespace tessera::soak {

using test::DeviceBuffer;
using test::kGpu;

// A CUDA error: the context may be unusable afterwards, so the soak stops.
class CudaFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws CudaFailure naming `what` when `status` is not cudaSuccess.
void cuda_check(cudaError_t status, const char* what);

void copy_to_device(const DeviceBuffer& dst, const void* src, size_t bytes, cudaStream_t stream);

struct Tolerance {
  double o = 0;    // relative L2 of one row
  double lse = 0;  // absolute
};

// Compares `rows` of the downloaded o (bf16, [token][head][dim] packed) and lse ([token][head])
// with the oracle over the host problem `host` (the same batch's q, K/V and indices).
std::string compare_rows(const detail::AttentionProblem& host,
                         std::vector<detail::ReferenceRow>& rows, const std::vector<uint16_t>& o,
                         const std::vector<float>& lse, const Tolerance& tolerance);

// What both workloads keep: K/V on the device, mirrored on the host for the oracle; q / o / lse
// sized for the largest batch; the host copies a spot check downloads them into. Rows are
// [token][head][dim] bf16 (lse: [token][head] float32).
struct GraphBuffers {
  GraphBuffers(int64_t kv_elements, int64_t max_tokens, int num_qo_heads, int head_dim);

  // Random K/V (uniform in [-1, 1), the bench's generator), mirrored on the host.
  void fill_kv(uint64_t seed, cudaStream_t stream);

  void poison_outputs(cudaStream_t stream) const;

  // After a replay: downloads the batch's `tokens` rows of q / o / lse (synchronises the
  // stream) and scans o and lse for NaN: "" when every row was written.
  std::string download(int64_t tokens, cudaStream_t stream);

  // The oracle's problem over the downloaded q and the host K/V: bf16, `batch` requests of
  // `q_extent` query rows in all, K/V rows `kv_stride_token` elements apart (heads head_dim
  // apart), `kv_extent` of them. The caller adds the batch's layout (qo_indptr or
  // q_per_request, the page table or kv_indptr, the mask).
  detail::AttentionProblem problem(int32_t batch, int64_t q_extent, int num_kv_heads,
                                   int64_t kv_stride_token, int64_t kv_extent) const;

  int num_qo_heads, head_dim;
  int64_t kv_elements, q_row;  // q_row: elements of one token's q / o row
  DeviceBuffer k, v, q, o, lse;
  std::vector<uint16_t> k_host, v_host, q_check, o_check;
  std::vector<float> lse_check;
};

// ---------------------------------------------------------------------------- decode

struct DecodeSoak : GraphBuffers {
  static constexpr int kMaxBatch = 32, kMaxKv = 2048, kPageSize = 16;
  static constexpr int kQoHeads = 32, kKvHeads = 8, kHeadDim = 128;
  static constexpr int kNumPages = kMaxBatch * (kMaxKv / kPageSize);
  static_assert((kNumPages & (kNumPages - 1)) == 0, "the page permutation needs a power of two");
  // NHD cache: [page][token][kv head][dim].
  static constexpr int64_t kTokenStride = int64_t{kKvHeads} * kHeadDim;
  static constexpr int64_t kPageStride = kPageSize * kTokenStride;
  static constexpr int64_t kPoolElements = kNumPages * kPageStride;
  static constexpr int64_t kQRow = int64_t{kQoHeads} * kHeadDim;

  DeviceBuffer page_indptr{static_cast<size_t>(kMaxBatch + 1) * 4};
  DeviceBuffer page_indices{static_cast<size_t>(kNumPages) * 4};
  DeviceBuffer last_page_len{static_cast<size_t>(kMaxBatch) * 4};
  // Host copies of the current batch (the K/V pool and the downloads: GraphBuffers).
  std::vector<int32_t> kv_lens, indptr_host, indices_host, last_host;

  DecodeSoak();

  void max_lengths() { kv_lens.assign(kMaxBatch, kMaxKv); }

  void random_lengths(std::mt19937_64& rng);

  // Page table of the current lengths (distinct pages, a random affine permutation of the pool)
  // and random q, written into the device buffers on `stream`.
  void write_batch(std::mt19937_64& rng, uint64_t q_seed, cudaStream_t stream);

  Plan plan(const PlanCapacity& capacity) const;

  // run_decode over views of the full buffers (what the graph captures).
  void run(const Plan& plan, Workspace workspace, cudaStream_t stream) const;

  // After a replay: downloads the batch's q / o / lse (synchronises), checks for NaN and
  // compares 9 sampled rows with the oracle. "" when right.
  std::string check(cudaStream_t stream, std::mt19937_64& rng, const Tolerance& tolerance);
};

// ---------------------------------------------------------------------------- ragged prefill

struct PrefillSoak : GraphBuffers {
  static constexpr int kMaxBatch = 8, kMaxQ = 128, kMaxKv = 1024;
  static constexpr int kQoHeads = 32, kKvHeads = 8, kHeadDim = 128;
  static constexpr int kMaxTotalQ = kMaxBatch * kMaxQ, kMaxTotalKv = kMaxBatch * kMaxKv;
  static constexpr int64_t kQRow = int64_t{kQoHeads} * kHeadDim;
  static constexpr int64_t kKvRow = int64_t{kKvHeads} * kHeadDim;

  DeviceBuffer qo_indptr{static_cast<size_t>(kMaxBatch + 1) * 4};
  DeviceBuffer kv_indptr{static_cast<size_t>(kMaxBatch + 1) * 4};
  std::vector<int32_t> q_lens, kv_lens, qo_host, kv_host;

  PrefillSoak();

  static AttentionOptions options();

  void max_lengths();

  void random_lengths(std::mt19937_64& rng);

  void write_batch(std::mt19937_64& /*rng*/, uint64_t q_seed, cudaStream_t stream);

  Plan plan(const PlanCapacity& capacity) const;

  void run(const Plan& plan, Workspace workspace, cudaStream_t stream) const;

  std::string check(cudaStream_t stream, std::mt19937_64& rng, const Tolerance& tolerance);
};

}  // namespace tessera::soak

#endif  // TESSERA_HAVE_CUDA
