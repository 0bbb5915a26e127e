// Micro-benchmark of the tensor-core rate of the GEMM shapes a d128 key tile of 128 keys can be
// computed with. Written for 16-key pages: can S = Q K^T run as one wgmma of N = 16 per page
// (each page's K rows a TMA box of its own, 8 boxes per tile instead of 16) at the tensor rate
// of the N = 128 form the kernels use? (No: 0.64 of it, 0.77 for a whole tile, on the H200;
// docs/log/PERF.md, 2026-12-06 sixth, where that kernel was timed and removed.)
//
// Two warpgroups per CTA (the consumers' count), one CTA per SM, each warpgroup computing
// 64 x 128 x 128 products (one S tile: 8 k-steps of 16 over the head dim) back to back:
//   n128-ss    8 x m64n128k16, A (Q) and B (K) from shared memory        (the kernels' S today)
//   n64-ss     8 x 2 x m64n64k16, A and B from shared memory             (K page by page at 64)
//   n16-ss     8 x 8 x m64n16k16, A and B from shared memory        (per page at 16, Q read 8x)
//   n16-rs     8 x 8 x m64n16k16, A from registers, B from shared memory (per page, Q in registers)
//   n128-rs-v  8 x m64n128k16, A from registers, B MN-major              (the kernels' P V today)
// and whole tiles (S, then O += P V with N = head_dim):
//   tile-n128  n128-ss + n128-rs-v          tile-n16rs  n16-rs + n128-rs-v
// Every product accumulates onto the previous iteration's (scale-d 1, accumulators zeroed once):
// a product that started from zero would leave the previous iteration's results dead, and
// ptxas drops such wgmma (it did, unrolling by two: the first version reported S at 1791
// TFLOP/s, twice what ran, docs/log/PERF.md 2026-12-06 sixth).
// Operands are a fixed bf16 pattern (the rate, not the values, is measured). Prints TFLOP/s of
// the whole GPU and the ratio to the kernels' form.
// Build (sm_90a) and run on an H100/H200:
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     bench/wgmma_rates.cu -o wgmma_rates
//   ./wgmma_rates
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/ptx/shared_memory.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/ptx/wgmma_ops.cuh"

namespace {

namespace ptx = tessera::detail::ptx;
using tessera::DType;

constexpr int kDim = 128, kKeys = 128, kRows = 64;
constexpr uint32_t kQBytes = 2 * kRows * kDim * 2;  // both warpgroups' 64 rows
constexpr uint32_t kKBytes = kKeys * kDim * 2;      // one K (or V) tile, 2 column blocks
constexpr uint32_t kBlockBytes = kKeys * 128;       // one 64-column block of K

enum class Mode : int { kN128Ss, kN64Ss, kN16Ss, kN16Rs, kN128RsV, kTileN128, kTileN16Rs };

// Descriptor of k-step `step` (16 columns) of a [rows][128] tile stored as 64-column blocks of
// `block_bytes`, 128-byte swizzle, starting `row_bytes` into each block.
__device__ __forceinline__ uint64_t step_descriptor(uint32_t base, uint32_t block_bytes, int step,
                                                    uint32_t row_bytes = 0) {
  const uint32_t address = base + static_cast<uint32_t>(step / 4) * block_bytes +
                           static_cast<uint32_t>(step % 4) * 32 + row_bytes;
  return ptx::wgmma_descriptor_sw128(address, 16, 1024);
}

// The 64 x kN slice `part` of an S accumulator of 128 keys (kN / 2 registers per thread).
template <int kN>
__device__ __forceinline__ float (&s_part(float (&s)[64], int part))[kN / 2] {
  return reinterpret_cast<float(&)[kN / 2]>(s[kN / 2 * part]);
}

// S = Q K^T of one key tile as 128 / kN products of N = kN per k-step, Q and K from shared
// memory (kN = 128: the kernels' form; 64 and 16: K page by page at pages of 64 and 16 keys).
template <int kN>
__device__ __forceinline__ void scores_ss(float (&s)[64], uint32_t q, uint32_t q_block,
                                          uint32_t k) {
#pragma unroll
  for (int step = 0; step < 8; ++step) {
#pragma unroll
    for (int part = 0; part < kKeys / kN; ++part) {
      ptx::Wgmma<kN, DType::kBFloat16>::ss(s_part<kN>(s, part), step_descriptor(q, q_block, step),
                                           step_descriptor(k, kBlockBytes, step, kN * 128u * part),
                                           1);
    }
  }
}

template <Mode kMode>
__global__ void __launch_bounds__(256, 1) gemm_rates(int iterations, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t raw = ptx::shared_address(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* generic = smem + (base - raw);
  // A fixed pattern of small bf16 values (0x3C00 + i % 64: 2^-7 .. about 2^-6.5).
  for (uint32_t i = threadIdx.x; i < (kQBytes + 2 * kKBytes) / 2; i += blockDim.x) {
    reinterpret_cast<uint16_t*>(generic)[i] = static_cast<uint16_t>(0x3C00u + i % 64u);
  }
  __syncthreads();
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const uint32_t q = base + static_cast<uint32_t>(warpgroup) * (kQBytes / 2);
  const uint32_t k = base + kQBytes;
  const uint32_t v = k + kKBytes;
  const uint32_t q_block = kRows * 128;
  float s[64];
  float o[64];
  uint32_t a[8][4];  // Q (or P) as A fragments, one per k-step
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // From shared memory, and opaque: computed values would be rematerialised next to each
      // wgmma (a register write there serialises the wgmma pipeline).
      a[i][j] = reinterpret_cast<const uint32_t*>(generic)[(threadIdx.x * 32 + i * 4 + j) % 4096];
      asm volatile("" : "+r"(a[i][j]));
    }
  }
  for (int it = 0; it < iterations; ++it) {
    ptx::wgmma_fence();
    if constexpr (kMode == Mode::kN128Ss || kMode == Mode::kTileN128) {
      scores_ss<128>(s, q, q_block, k);
    } else if constexpr (kMode == Mode::kN64Ss) {
      scores_ss<64>(s, q, q_block, k);
    } else if constexpr (kMode == Mode::kN16Ss) {
      scores_ss<16>(s, q, q_block, k);
    } else if constexpr (kMode == Mode::kN16Rs || kMode == Mode::kTileN16Rs) {
      // One page's 16 keys at a time, all 8 k-steps, Q from registers.
#pragma unroll
      for (int page = 0; page < 8; ++page) {
#pragma unroll
        for (int step = 0; step < 8; ++step) {
          ptx::Wgmma<16, DType::kBFloat16>::rs(
              s_part<16>(s, page), a[step],
              step_descriptor(k, kBlockBytes, step, 16u * 128u * page), 1);
        }
      }
    }
    if constexpr (kMode == Mode::kN128RsV || kMode == Mode::kTileN128 ||
                  kMode == Mode::kTileN16Rs) {
      // O += P V: B = V MN-major (column blocks kBlockBytes apart, 8-row groups 1024 apart).
      const uint64_t b0 = ptx::wgmma_descriptor_sw128(v, kBlockBytes, 1024);
#pragma unroll
      for (int step = 0; step < 8; ++step) {
        ptx::Wgmma<128, DType::kBFloat16>::rs_b_mn_major(
            o, a[step], ptx::wgmma_descriptor_advance(b0, static_cast<uint32_t>(step) * 16 * 128),
            1);
      }
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(s);
    ptx::wgmma_fence_operands(o);
  }
  float total = 0;
#pragma unroll
  for (int i = 0; i < 64; ++i) total += s[i] + o[i];
  if (total == 12345.0f) sink[threadIdx.x] = total;  // keeps the accumulators live
}

struct Case {
  const char* name;
  void (*kernel)(int, float*);
  double flop_per_iteration;  // per warpgroup
};

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, 256 * sizeof(float));
  const int smem = static_cast<int>(kQBytes + 2 * kKBytes + 1024);
  const double gemm = 2.0 * kRows * kKeys * kDim;  // one 64 x 128 x 128 product
  const Case cases[] = {
      {"n128-ss (S today)", gemm_rates<Mode::kN128Ss>, gemm},
      {"n64-ss x2", gemm_rates<Mode::kN64Ss>, gemm},
      {"n16-ss x8", gemm_rates<Mode::kN16Ss>, gemm},
      {"n16-rs x8", gemm_rates<Mode::kN16Rs>, gemm},
      {"n128-rs-v (PV today)", gemm_rates<Mode::kN128RsV>, gemm},
      {"tile n128-ss + PV", gemm_rates<Mode::kTileN128>, 2 * gemm},
      {"tile n16-rs x8 + PV", gemm_rates<Mode::kTileN16Rs>, 2 * gemm},
  };
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::printf("%d SMs, 2 warpgroups per CTA, one CTA per SM, bf16 -> f32\n", sms);
  std::printf("%-24s %10s %8s\n", "form", "TFLOP/s", "x S/tile today");
  double reference[2] = {0, 0};
  for (const Case& c : cases) {
    cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int iterations = 20000;
    c.kernel<<<sms, 256, smem>>>(200, sink);  // warm-up (clocks)
    double best = 0;
    for (int round = 0; round < 3; ++round) {
      cudaEventRecord(start);
      c.kernel<<<sms, 256, smem>>>(iterations, sink);
      cudaEventRecord(stop);
      if (cudaEventSynchronize(stop) != cudaSuccess) {
        std::printf("%-24s failed: %s\n", c.name, cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      const double rate = double(sms) * 2 * iterations * c.flop_per_iteration / (ms * 1e-3) / 1e12;
      if (rate > best) best = rate;
    }
    const bool tile = c.flop_per_iteration > gemm;
    if (c.kernel == gemm_rates<Mode::kN128Ss>) reference[0] = best;
    if (c.kernel == gemm_rates<Mode::kTileN128>) reference[1] = best;
    std::printf("%-24s %10.1f %8.2f\n", c.name, best, best / reference[tile ? 1 : 0]);
  }
  return 0;
}
