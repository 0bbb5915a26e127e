// The CUDA-graph soak's decode workload (DecodeSoak, soak_cuda_graph.hpp): a paged bf16 K/V
// pool, random batches and page tables, run_decode over the full buffers, the spot check.
#if defined(TESSERA_HAVE_CUDA)
#include <string>
#include <vector>

#include "devtools/bench_support.hpp"
#include "soak_cuda_graph.hpp"

namespace tessera::soak {

DecodeSoak::DecodeSoak() : GraphBuffers(kPoolElements, kMaxBatch, kQoHeads, kHeadDim) {
  kv_lens.reserve(kMaxBatch);
  indptr_host.reserve(kMaxBatch + 1);
  last_host.reserve(kMaxBatch);
  indices_host.reserve(kNumPages);
}

void DecodeSoak::random_lengths(std::mt19937_64& rng) {
  const int kind = test::uniform(rng, 0, 4);
  int32_t batch = test::uniform(rng, 1, kMaxBatch);
  if (kind == 0) batch = test::uniform(rng, 1, 3);  // a few long requests: many splits
  if (kind == 4) batch = kMaxBatch;
  kv_lens.resize(static_cast<size_t>(batch));
  for (int32_t& len : kv_lens) {
    len = test::chance(rng, 0.03) ? 0 : test::uniform(rng, 1, kMaxKv);
    if (kind == 0) len = test::uniform(rng, kMaxKv / 2, kMaxKv);
  }
}

void DecodeSoak::write_batch(std::mt19937_64& rng, uint64_t q_seed, cudaStream_t stream) {
  const int32_t batch = static_cast<int32_t>(kv_lens.size());
  indptr_host.resize(static_cast<size_t>(batch) + 1);
  last_host.resize(static_cast<size_t>(batch));
  indptr_host[0] = 0;
  for (int32_t b = 0; b < batch; ++b) {
    const int32_t pages = (kv_lens[b] + kPageSize - 1) / kPageSize;
    indptr_host[b + 1] = indptr_host[b] + pages;
    last_host[b] = pages == 0 ? 1 : kv_lens[b] - (pages - 1) * kPageSize;
  }
  const int32_t total_pages = indptr_host[batch];
  const int32_t stride = 2 * test::uniform(rng, 0, kNumPages / 2 - 1) + 1;  // odd: a bijection
  const int32_t offset = test::uniform(rng, 0, kNumPages - 1);
  indices_host.resize(static_cast<size_t>(total_pages));
  for (int32_t j = 0; j < total_pages; ++j) {
    indices_host[j] = (offset + j * stride) & (kNumPages - 1);
  }
  copy_to_device(page_indptr, indptr_host.data(), indptr_host.size() * 4, stream);
  copy_to_device(last_page_len, last_host.data(), last_host.size() * 4, stream);
  copy_to_device(page_indices, indices_host.data(), indices_host.size() * 4, stream);
  devtools::cuda_fill_random(q.data(), batch * kQRow, DType::kBFloat16, q_seed, 1.0f, stream);
}

Plan DecodeSoak::plan(const PlanCapacity& capacity) const {
  return plan_decode(indptr_host, last_host, kPageSize, kQoHeads, kKvHeads, kHeadDim,
                     AttentionOptions{}, kGpu, 1, capacity);
}

void DecodeSoak::run(const Plan& plan, Workspace workspace, cudaStream_t stream) const {
  PagedKVCache cache;
  cache.layout = KVLayout::kNHD;
  cache.k_cache = test::gpu_view(k, DType::kBFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                 {kPageStride, kTokenStride, kHeadDim, 1});
  cache.v_cache = test::gpu_view(v, DType::kBFloat16, {kNumPages, kPageSize, kKvHeads, kHeadDim},
                                 {kPageStride, kTokenStride, kHeadDim, 1});
  cache.page_indptr = test::gpu_index_view(page_indptr, kMaxBatch + 1);
  cache.page_indices = test::gpu_index_view(page_indices, kNumPages);
  cache.last_page_len = test::gpu_index_view(last_page_len, kMaxBatch);
  run_decode(
      plan,
      test::gpu_view(q, DType::kBFloat16, {kMaxBatch, kQoHeads, kHeadDim}, {kQRow, kHeadDim, 1}),
      cache,
      test::gpu_view(o, DType::kBFloat16, {kMaxBatch, kQoHeads, kHeadDim}, {kQRow, kHeadDim, 1}),
      test::gpu_view(lse, DType::kFloat32, {kMaxBatch, kQoHeads}, {kQoHeads, 1}), workspace,
      stream);
}

std::string DecodeSoak::check(cudaStream_t stream, std::mt19937_64& rng,
                              const Tolerance& tolerance) {
  const int32_t batch = static_cast<int32_t>(kv_lens.size());
  std::string error = download(batch, stream);
  if (!error.empty()) return error;

  detail::AttentionProblem host = problem(batch, batch, kKvHeads, kTokenStride, kNumPages);
  host.qo_indptr = nullptr;
  host.q_per_request = 1;
  host.kv.paged = true;
  host.kv.k_stride_page = host.kv.v_stride_page = kPageStride;
  host.kv.page_indptr = indptr_host.data();
  host.kv.page_indices = indices_host.data();
  host.kv.last_page_len = last_host.data();
  host.kv.page_size = kPageSize;
  std::vector<detail::ReferenceRow> rows;
  for (int i = 0; i < 8; ++i) {
    rows.push_back({test::uniform(rng, 0, batch - 1), 0, test::uniform(rng, 0, kQoHeads - 1)});
  }
  rows.push_back({batch - 1, 0, kQoHeads - 1});
  error = compare_rows(host, rows, o_check, lse_check, tolerance);
  return error.empty() ? "" : error + " (batch of " + std::to_string(batch) + ")";
}

}  // namespace tessera::soak

#endif  // TESSERA_HAVE_CUDA
