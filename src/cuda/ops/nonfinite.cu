// cuda_first_nonfinite: checked mode's scan of one attention input on the device for NaN / inf
// (core/nonfinite_check.hpp; the semantics of non-finite inputs are in
// include/tessera/attention.hpp).
//
// The host lists the rows the call reads (element offsets of head 0 of each token or key, in
// the order its message counts them); one launch checks heads x head_dim elements per row. A CTA
// walks rows (grid-stride), its threads the elements of a row; a thread that finds a non-finite
// element lowers one 64-bit minimum (atomicMin), so the result is the first element in the
// host's order whatever the schedule, the same one the host scan of a CPU tensor reports. A CTA
// stops once its next row lies past a minimum already found. An element is non-finite when all
// the bits of its dtype's exponent field are set (nonfinite_bits: no float conversion).
//
// Checked mode only (it synchronises the stream and allocates): never on a graph's path.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/nonfinite_check.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_utils.hpp"

namespace tessera::detail {
namespace {

constexpr int kScanThreads = 256;
constexpr int64_t kMaxScanBlocks = 4096;  // rows per CTA beyond this: grid-stride
constexpr unsigned long long kNone = ~0ull;

struct NonfiniteParams {
  const void* data = nullptr;
  const int64_t* row_offsets = nullptr;  // [rows], device
  int64_t rows = 0;
  int32_t heads = 0;
  int64_t head_stride = 0;
  int32_t head_dim = 0;
  uint32_t mask = 0;                    // nonfinite_bits(dtype)
  unsigned long long* first = nullptr;  // in: kNone; out: the lowest index found
};

template <class Bits>
__global__ void __launch_bounds__(kScanThreads)
    first_nonfinite_kernel(const __grid_constant__ NonfiniteParams params) {
  const Bits* base = static_cast<const Bits*>(params.data);
  const Bits mask = static_cast<Bits>(params.mask);
  const int64_t per_row = static_cast<int64_t>(params.heads) * params.head_dim;
  for (int64_t r = blockIdx.x; r < params.rows; r += gridDim.x) {
    // Rows only grow along this loop: once one before it holds a hit, nothing here can win.
    const unsigned long long found = *static_cast<volatile unsigned long long*>(params.first);
    if (static_cast<unsigned long long>(r * per_row) > found) return;
    const int64_t offset = params.row_offsets[r];
    for (int64_t e = threadIdx.x; e < per_row; e += blockDim.x) {
      const int64_t head = e / params.head_dim;
      const int64_t dim = e - head * params.head_dim;
      const Bits bits = base[offset + head * params.head_stride + dim];
      if ((bits & mask) == mask) {
        atomicMin(params.first, static_cast<unsigned long long>(r * per_row + e));
      }
    }
  }
}

// Device memory for the scan, freed on every exit (a throw included).
class ScanBuffer {
 public:
  explicit ScanBuffer(size_t bytes) : data_(cuda_alloc(bytes)) {}
  ~ScanBuffer() { cuda_free(data_); }
  ScanBuffer(const ScanBuffer&) = delete;
  ScanBuffer& operator=(const ScanBuffer&) = delete;
  void* data() const { return data_; }

 private:
  void* data_;
};

}  // namespace

int64_t cuda_first_nonfinite(int device, const void* data, DType dtype, const int64_t* row_offsets,
                             int64_t rows, int32_t heads, int64_t head_stride, int32_t head_dim,
                             void* stream) {
  const uint32_t mask = nonfinite_bits(dtype);
  if (rows <= 0 || heads <= 0 || head_dim <= 0 || mask == 0) return -1;
  const CudaDeviceGuard guard(device);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  // One allocation: the result word first (8-byte aligned), then the row offsets.
  const size_t offsets_bytes = static_cast<size_t>(rows) * sizeof(int64_t);
  const ScanBuffer buffer(sizeof(unsigned long long) + offsets_bytes);
  auto* first = static_cast<unsigned long long*>(buffer.data());
  auto* offsets = reinterpret_cast<int64_t*>(first + 1);
  check_cuda(
      cudaMemcpyAsync(offsets, row_offsets, offsets_bytes, cudaMemcpyHostToDevice, cuda_stream),
      "checked mode: copy of the scanned row offsets");
  check_cuda(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), cuda_stream),
             "checked mode: clear of the scan result");

  NonfiniteParams params;
  params.data = data;
  params.row_offsets = offsets;
  params.rows = rows;
  params.heads = heads;
  params.head_stride = head_stride;
  params.head_dim = head_dim;
  params.mask = mask;
  params.first = first;
  const dim3 grid(static_cast<unsigned>(std::min(rows, kMaxScanBlocks))), block(kScanThreads);
  switch (dtype_size(dtype)) {
    case 4: first_nonfinite_kernel<uint32_t><<<grid, block, 0, cuda_stream>>>(params); break;
    case 2: first_nonfinite_kernel<uint16_t><<<grid, block, 0, cuda_stream>>>(params); break;
    default: first_nonfinite_kernel<uint8_t><<<grid, block, 0, cuda_stream>>>(params); break;
  }
  check_kernel_launch("first_nonfinite_kernel", grid, block, 0);
  unsigned long long result = kNone;
  cuda_copy_to_host(&result, first, sizeof(result), stream);  // synchronises the stream
  return result == kNone ? -1 : static_cast<int64_t>(result);
}

}  // namespace tessera::detail
