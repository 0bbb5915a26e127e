// cuda_block_table_to_csr: a vLLM / FlashAttention block table [B, max_pages] + seq_lens [B]
// into Tessera's CSR page table (page_indptr [B+1], page_indices, last_page_len [B]).
//
// Semantics are the CPU backend's (src/cpu/block_table.cpp): request b owns
// pages_b = ceil(seq_lens[b] / page_size) pages, the first pages_b entries of its block-table row;
// its last page holds seq_lens[b] - (pages_b - 1) * page_size tokens; a request with no token has
// no page and last_page_len 0.
//
// Two launches:
//  1. one CTA scans the page counts (B up to a few 64k: each thread sums a contiguous run of
//     requests, a warp-shuffle scan combines the runs) and writes page_indptr and last_page_len;
//  2. one CTA per request copies its block-table entries into page_indices (coalesced along the
//     row), reading its offset from the page_indptr the first launch wrote (same stream).
// seq_lens lives on the device, so the host cannot check it: a negative length counts as 0 and a
// length needing more than max_pages pages is clamped to max_pages, so nothing is ever read or
// written out of bounds (the CPU path rejects such input before running).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"

namespace tessera::detail {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kScanWarps = kScanThreads / 32;
constexpr int kGatherThreads = 128;
constexpr int64_t kMaxGridX = 2147483647;  // one CTA per request in the gather

struct BlockTableParams {
  const int32_t* block_table = nullptr;
  int64_t row_stride = 0;
  int64_t column_stride = 0;
  int32_t max_pages = 0;
  const int32_t* seq_lens = nullptr;
  int32_t page_size = 0;
  int32_t batch_size = 0;
  int32_t* page_indptr = nullptr;
  int32_t* page_indices = nullptr;
  int32_t* last_page_len = nullptr;
};

__device__ __forceinline__ int32_t pages_of(const BlockTableParams& params, int32_t request) {
  const int64_t seq_len = params.seq_lens[request] > 0 ? params.seq_lens[request] : 0;
  const int64_t pages = (seq_len + params.page_size - 1) / params.page_size;
  return static_cast<int32_t>(pages < params.max_pages ? pages : params.max_pages);
}

// Inclusive scan of `value` across the 32 lanes of a warp (Hillis-Steele with shuffles).
__device__ __forceinline__ int64_t warp_inclusive_scan(int64_t value) {
  const int lane = threadIdx.x % 32;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int64_t other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

__global__ void __launch_bounds__(kScanThreads)
    block_table_scan_kernel(const __grid_constant__ BlockTableParams params) {
  __shared__ int64_t warp_totals[kScanWarps];
  const int32_t per_thread = (params.batch_size + kScanThreads - 1) / kScanThreads;
  const int32_t begin = min(params.batch_size, static_cast<int32_t>(threadIdx.x) * per_thread);
  const int32_t end = min(params.batch_size, begin + per_thread);

  int64_t run_total = 0;
  for (int32_t request = begin; request < end; ++request) run_total += pages_of(params, request);

  // Exclusive prefix of the runs: scan within each warp, then across the warps' totals.
  const int64_t inclusive = warp_inclusive_scan(run_total);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int64_t total = lane < kScanWarps ? warp_totals[lane] : 0;
    const int64_t scanned = warp_inclusive_scan(total);
    if (lane < kScanWarps) warp_totals[lane] = scanned - total;  // exclusive
  }
  __syncthreads();
  int64_t offset = warp_totals[warp] + inclusive - run_total;

  if (threadIdx.x == 0) params.page_indptr[0] = 0;
  for (int32_t request = begin; request < end; ++request) {
    const int32_t pages = pages_of(params, request);
    offset += pages;
    params.page_indptr[request + 1] = static_cast<int32_t>(offset);
    int32_t last = 0;
    if (pages > 0) {
      const int64_t in_last_page = static_cast<int64_t>(params.seq_lens[request]) -
                                   static_cast<int64_t>(pages - 1) * params.page_size;
      last =
          static_cast<int32_t>(in_last_page < params.page_size ? in_last_page : params.page_size);
    }
    params.last_page_len[request] = last;
  }
}

__global__ void __launch_bounds__(kGatherThreads)
    block_table_gather_kernel(const __grid_constant__ BlockTableParams params) {
  const int32_t request = blockIdx.x;
  const int32_t first = params.page_indptr[request];
  const int32_t pages = params.page_indptr[request + 1] - first;
  const int32_t* row = params.block_table + request * params.row_stride;
  for (int32_t page = threadIdx.x; page < pages; page += blockDim.x) {
    params.page_indices[first + page] = row[page * params.column_stride];
  }
}

}  // namespace

void cuda_block_table_to_csr(const TensorView& block_table, const int32_t* seq_lens, int page_size,
                             int32_t* page_indptr, int32_t* page_indices, int32_t* last_page_len,
                             void* stream) {
  const int64_t batch_size = block_table.shape[0];
  if (batch_size > kMaxGridX) {
    throw Error(Error::Kind::kUnsupported,
                "block_table_to_csr: more than 2^31 - 1 requests is not supported");
  }
  BlockTableParams params;
  params.block_table = block_table.ptr<const int32_t>();
  params.row_stride = block_table.stride[0];
  params.column_stride = block_table.stride[1];
  params.max_pages = static_cast<int32_t>(block_table.shape[1]);
  params.seq_lens = seq_lens;
  params.page_size = page_size;
  params.batch_size = static_cast<int32_t>(batch_size);
  params.page_indptr = page_indptr;
  params.page_indices = page_indices;
  params.last_page_len = last_page_len;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);

  const dim3 scan_grid(1), scan_block(kScanThreads);
  block_table_scan_kernel<<<scan_grid, scan_block, 0, cuda_stream>>>(params);
  check_kernel_launch("block_table_scan_kernel", scan_grid, scan_block, 0);
  if (batch_size == 0 || params.max_pages == 0) return;
  const dim3 gather_grid(static_cast<unsigned>(batch_size)), gather_block(kGatherThreads);
  block_table_gather_kernel<<<gather_grid, gather_block, 0, cuda_stream>>>(params);
  check_kernel_launch("block_table_gather_kernel", gather_grid, gather_block, 0);
}

}  // namespace tessera::detail
