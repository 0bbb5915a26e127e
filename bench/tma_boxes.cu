// Micro-benchmark of the TMA box shapes the sm90 prefill producer uses for one d128 key tile
// (128 rows x 128 bf16 columns = 32 KiB), without any consumer: how fast the copy engine
// delivers key tiles to every SM when they come as
//   ragged3d  2 boxes {64 columns, 1 head, 128 rows}, one per 128-byte column block (ragged K/V);
//   ragged4d  1 box  {64 columns, 1 head, 128 rows, 2 column blocks};
//   pageR/4d  2 x 128/R boxes {64, R rows, 1 head, 1 page} (paged, per column block and page);
//   pageR/5d  128/R boxes {64, R rows, 2 column blocks, 1 head, 1 page} (page-by-page V);
// from one 32 MiB bf16 cache [16384 tokens][8 heads][128] (NHD; L2-resident after the first
// pass), pages taken in a scrambled order. One warp per CTA, one CTA per SM; lane l issues boxes
// l, l + 32, ...; `stages` tiles in flight per SM (1: latency, 4: rate).
// Build (sm_90a) and run on an H100/H200:
//   nvcc -std=c++20 -O3 -arch=sm_90a -Isrc -Iinclude bench/tma_boxes.cu \
//     src/cuda/sm90/tensor_map.cpp -o tma_boxes && ./tma_boxes
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/tensor_map.hpp"

namespace {

using tessera::DType;
using tessera::detail::sm90::encode_tensor_map;
using tessera::detail::sm90::TensorMapDim;
namespace ptx = tessera::detail::ptx;

constexpr int kTokens = 16384, kHeads = 8, kDim = 128, kTileRows = 128;
constexpr uint32_t kTileBytes = kTileRows * kDim * 2;
constexpr int kMaxStages = 4;

enum class Mode : int { kRagged3d, kRagged4d, kPage4d, kPage5d };

struct Params {
  CUtensorMap map;
  Mode mode;
  int boxes;  // per key tile
  int page_rows;
  int pages;
  int iterations;
  int stages;
};

__global__ void __launch_bounds__(32, 1) copy_tiles(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t raw = ptx::shared_address(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bars = base + kMaxStages * kTileBytes;
  const int lane = static_cast<int>(threadIdx.x);
  if (lane == 0) {
    for (int s = 0; s < kMaxStages; ++s) ptx::mbarrier_init(bars + 8 * s, 1);
    ptx::fence_mbarrier_init();
  }
  __syncwarp();
  const int tiles_per_head = kTokens / kTileRows;
  for (int i = 0; i < p.iterations; ++i) {
    const int stage = i % p.stages;
    const uint32_t bar = bars + 8 * stage;
    if (i >= p.stages) ptx::mbarrier_wait(bar, static_cast<uint32_t>((i / p.stages - 1) & 1));
    const int tile = (blockIdx.x * 131 + i * 7) % tiles_per_head;
    const int head = i % kHeads;
    const uint32_t dst = base + stage * kTileBytes;
    if (lane == 0) ptx::mbarrier_arrive_expect_tx(bar, kTileBytes);
    __syncwarp();
    for (int box = lane; box < p.boxes; box += 32) {
      switch (p.mode) {
        case Mode::kRagged3d:
          ptx::tma_load_3d(dst + box * (kTileBytes / 2), &p.map, bar, box * 64, head,
                           tile * kTileRows);
          break;
        case Mode::kRagged4d:
          ptx::tma_load_4d(dst, &p.map, bar, 0, head, tile * kTileRows, 0);
          break;
        case Mode::kPage4d: {
          const int j = box / 2, block = box % 2;
          const int logical = tile * (kTileRows / p.page_rows) + j;
          const int page = (logical * 37 + 11) % p.pages;  // scrambled: 37 is odd, pages 2^k
          ptx::tma_load_4d(dst + block * (kTileBytes / 2) + j * p.page_rows * 128, &p.map, bar,
                           block * 64, 0, head, page);
          break;
        }
        case Mode::kPage5d: {
          const int logical = tile * (kTileRows / p.page_rows) + box;
          const int page = (logical * 37 + 11) % p.pages;
          ptx::tma_load_5d(dst + box * p.page_rows * 256, &p.map, bar, 0, 0, 0, head, page);
          break;
        }
      }
    }
  }
  // Drain: the last `stages` tiles.
  for (int i = p.iterations; i < p.iterations + p.stages; ++i) {
    if (i < p.stages) continue;
    const int stage = i % p.stages;
    ptx::mbarrier_wait(bars + 8 * stage, static_cast<uint32_t>((i / p.stages - 1) & 1));
  }
}

int boxes_per_tile(Mode mode, int page_rows) {
  switch (mode) {
    case Mode::kRagged3d: return 2;  // one per column block
    case Mode::kRagged4d: return 1;
    case Mode::kPage4d: return 2 * (kTileRows / page_rows);
    case Mode::kPage5d: return kTileRows / page_rows;
  }
  return 0;
}

bool make_map(CUtensorMap* map, const void* data, Mode mode, int page_rows, std::string* why) {
  const int64_t token = kHeads * kDim;  // elements per token row
  switch (mode) {
    case Mode::kRagged3d: {
      const TensorMapDim dims[3] = {{kDim, 1, 64}, {kHeads, kDim, 1}, {kTokens, token, kTileRows}};
      return encode_tensor_map(map, DType::kBFloat16, data, dims, 3, why);
    }
    case Mode::kRagged4d: {
      const TensorMapDim dims[4] = {
          {64, 1, 64}, {kHeads, kDim, 1}, {kTokens, token, kTileRows}, {2, 64, 2}};
      return encode_tensor_map(map, DType::kBFloat16, data, dims, 4, why, true);
    }
    case Mode::kPage4d: {
      const TensorMapDim dims[4] = {{kDim, 1, 64},
                                    {page_rows, token, static_cast<uint32_t>(page_rows)},
                                    {kHeads, kDim, 1},
                                    {kTokens / page_rows, page_rows * token, 1}};
      return encode_tensor_map(map, DType::kBFloat16, data, dims, 4, why, true);
    }
    case Mode::kPage5d: {
      const TensorMapDim dims[5] = {{64, 1, 64},
                                    {page_rows, token, static_cast<uint32_t>(page_rows)},
                                    {2, 64, 2},
                                    {kHeads, kDim, 1},
                                    {kTokens / page_rows, page_rows * token, 1}};
      return encode_tensor_map(map, DType::kBFloat16, data, dims, 5, why, true);
    }
  }
  return false;
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  void* data = nullptr;
  const size_t bytes = size_t{kTokens} * kHeads * kDim * 2;
  if (cudaMalloc(&data, bytes) != cudaSuccess) return 1;
  cudaMemset(data, 0, bytes);
  const int smem = kMaxStages * kTileBytes + 1024 + 64;
  cudaFuncSetAttribute(copy_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  struct Case {
    const char* name;
    Mode mode;
    int page_rows;
  };
  const std::vector<Case> cases = {{"ragged3d (2 boxes)", Mode::kRagged3d, 128},
                                   {"ragged4d (1 box)", Mode::kRagged4d, 128},
                                   {"page64/4d (4 boxes)", Mode::kPage4d, 64},
                                   {"page64/5d (2 boxes)", Mode::kPage5d, 64},
                                   {"page16/4d (16 boxes)", Mode::kPage4d, 16},
                                   {"page16/5d (8 boxes)", Mode::kPage5d, 16}};
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::printf("%d SMs, %d-byte key tiles, one CTA per SM\n", sms, kTileBytes);
  std::printf("%-22s %6s %12s %14s\n", "boxes", "stages", "TB/s", "us in flight");
  for (const Case& c : cases) {
    for (int stages : {1, 2, 4}) {
      Params p{};
      std::string why;
      if (!make_map(&p.map, data, c.mode, c.page_rows, &why)) {
        std::printf("%-22s map failed: %s\n", c.name, why.c_str());
        break;
      }
      p.mode = c.mode;
      p.boxes = boxes_per_tile(c.mode, c.page_rows);
      p.page_rows = c.page_rows;
      p.pages = kTokens / c.page_rows;
      p.stages = stages;
      p.iterations = 2000;
      copy_tiles<<<sms, 32, smem>>>(p);  // warm-up: L2-resident afterwards
      cudaEventRecord(start);
      copy_tiles<<<sms, 32, smem>>>(p);
      cudaEventRecord(stop);
      if (cudaEventSynchronize(stop) != cudaSuccess) {
        std::printf("%-22s kernel failed: %s\n", c.name, cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      const double moved = double(sms) * p.iterations * kTileBytes;
      std::printf("%-22s %6d %12.2f %14.3f\n", c.name, stages, moved / (ms * 1e-3) / 1e12,
                  ms * 1e3 / p.iterations * stages);
    }
  }
  cudaFree(data);
  return 0;
}
