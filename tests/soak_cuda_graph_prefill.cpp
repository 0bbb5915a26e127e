// The CUDA-graph soak's ragged prefill workload (PrefillSoak, soak_cuda_graph.hpp): ragged bf16
// K/V, random causal batches, run_ragged_prefill over the full buffers, the spot check.
#if defined(TESSERA_HAVE_CUDA)
#include <algorithm>
#include <string>
#include <vector>

#include "devtools/bench_support.hpp"
#include "soak_cuda_graph.hpp"

namespace tessera::soak {

PrefillSoak::PrefillSoak() : GraphBuffers(kMaxTotalKv * kKvRow, kMaxTotalQ, kQoHeads, kHeadDim) {
  q_lens.reserve(kMaxBatch);
  kv_lens.reserve(kMaxBatch);
  qo_host.reserve(kMaxBatch + 1);
  kv_host.reserve(kMaxBatch + 1);
}

AttentionOptions PrefillSoak::options() {
  AttentionOptions causal;
  causal.causal = true;
  return causal;
}

void PrefillSoak::max_lengths() {
  q_lens.assign(kMaxBatch, kMaxQ);
  kv_lens.assign(kMaxBatch, kMaxKv);
}

void PrefillSoak::random_lengths(std::mt19937_64& rng) {
  const int32_t batch = test::uniform(rng, 1, kMaxBatch);
  q_lens.resize(static_cast<size_t>(batch));
  kv_lens.resize(static_cast<size_t>(batch));
  int32_t total_q = 0;
  for (int32_t b = 0; b < batch; ++b) {
    q_lens[b] = test::chance(rng, 0.05) ? 0 : test::uniform(rng, 1, kMaxQ);
    kv_lens[b] = test::uniform(rng, q_lens[b], kMaxKv);
    total_q += q_lens[b];
  }
  if (total_q == 0) {  // keep at least one query row
    q_lens[0] = 1;
    kv_lens[0] = std::max(kv_lens[0], 1);
  }
}

void PrefillSoak::write_batch(std::mt19937_64& /*rng*/, uint64_t q_seed, cudaStream_t stream) {
  const size_t batch = q_lens.size();
  qo_host.resize(batch + 1);
  kv_host.resize(batch + 1);
  qo_host[0] = kv_host[0] = 0;
  for (size_t b = 0; b < batch; ++b) {
    qo_host[b + 1] = qo_host[b] + q_lens[b];
    kv_host[b + 1] = kv_host[b] + kv_lens[b];
  }
  copy_to_device(qo_indptr, qo_host.data(), qo_host.size() * 4, stream);
  copy_to_device(kv_indptr, kv_host.data(), kv_host.size() * 4, stream);
  devtools::cuda_fill_random(q.data(), qo_host[batch] * kQRow, DType::kBFloat16, q_seed, 1.0f,
                             stream);
}

Plan PrefillSoak::plan(const PlanCapacity& capacity) const {
  return plan_ragged_prefill(qo_host, kv_host, kQoHeads, kKvHeads, kHeadDim, options(), kGpu,
                             capacity);
}

void PrefillSoak::run(const Plan& plan, Workspace workspace, cudaStream_t stream) const {
  const auto view3 = [](const DeviceBuffer& buffer, int64_t rows, int heads) {
    return test::gpu_view(buffer, DType::kBFloat16, {rows, heads, kHeadDim},
                          {int64_t{heads} * kHeadDim, kHeadDim, 1});
  };
  run_ragged_prefill(plan, view3(q, kMaxTotalQ, kQoHeads), view3(k, kMaxTotalKv, kKvHeads),
                     view3(v, kMaxTotalKv, kKvHeads),
                     test::gpu_index_view(qo_indptr, kMaxBatch + 1),
                     test::gpu_index_view(kv_indptr, kMaxBatch + 1), view3(o, kMaxTotalQ, kQoHeads),
                     test::gpu_view(lse, DType::kFloat32, {kMaxTotalQ, kQoHeads}, {kQoHeads, 1}),
                     workspace, stream);
}

std::string PrefillSoak::check(cudaStream_t stream, std::mt19937_64& rng,
                               const Tolerance& tolerance) {
  const int32_t batch = static_cast<int32_t>(q_lens.size());
  const int32_t total_q = qo_host[batch];
  std::string error = download(total_q, stream);
  if (!error.empty()) return error;

  detail::AttentionProblem host = problem(batch, total_q, kKvHeads, kKvRow, kMaxTotalKv);
  host.qo_indptr = qo_host.data();
  host.kv.paged = false;
  host.kv.kv_indptr = kv_host.data();
  host.mask.causal = true;
  // Tokens of the batch; the request of a token from qo_indptr (empty requests own none).
  const auto row_of_token = [&](int32_t token, int32_t head) {
    const int32_t b = static_cast<int32_t>(std::upper_bound(qo_host.begin(), qo_host.end(), token) -
                                           qo_host.begin() - 1);
    return detail::ReferenceRow{b, token - qo_host[b], head};
  };
  std::vector<detail::ReferenceRow> rows;
  for (int i = 0; i < 8; ++i) {
    rows.push_back(
        row_of_token(test::uniform(rng, 0, total_q - 1), test::uniform(rng, 0, kQoHeads - 1)));
  }
  rows.push_back(row_of_token(total_q - 1, kQoHeads - 1));
  error = compare_rows(host, rows, o_check, lse_check, tolerance);
  return error.empty() ? ""
                       : error + " (batch of " + std::to_string(batch) + ", " +
                             std::to_string(total_q) + " query tokens)";
}

}  // namespace tessera::soak

#endif  // TESSERA_HAVE_CUDA
