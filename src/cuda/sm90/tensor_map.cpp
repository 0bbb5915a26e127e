#include "cuda/sm90/tensor_map.hpp"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <mutex>

namespace tessera::detail::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_entry_point(std::string* why) {
  static PFN_cuTensorMapEncodeTiled_v12000 entry = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function,
                                                               12000, cudaEnableDefault, &status);
    if (error != cudaSuccess || status != cudaDriverEntryPointSuccess || function == nullptr) {
      (void)cudaGetLastError();
      failure = "the CUDA driver does not provide cuTensorMapEncodeTiled";
      return;
    }
    entry = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  });
  if (entry == nullptr && why != nullptr) *why = failure;
  return entry;
}

}  // namespace

bool encode_tensor_map(CUtensorMap* map, DType dtype, const void* base, const TensorMapDim* dims,
                       int rank, std::string* why, bool any_stride_order) {
  constexpr int64_t kElementBytes = 2;
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    *why = "TMA maps here are for fp16/bf16 tensors";
    return false;
  }
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    *why = "the data pointer is not 16-byte aligned";
    return false;
  }
  cuuint64_t extents[5];
  cuuint64_t strides[4];  // bytes, dimensions 1 .. rank-1
  cuuint32_t box[5];
  cuuint32_t element_strides[5];
  int64_t previous_stride_bytes = kElementBytes;
  int64_t previous_span_bytes = dims[0].extent * kElementBytes;
  for (int d = 0; d < rank; ++d) {
    if (dims[d].extent < 1 || dims[d].extent > (int64_t{1} << 32)) {
      *why = "dimension " + std::to_string(d) + " has extent " + std::to_string(dims[d].extent) +
             " (TMA takes 1 .. 2^32)";
      return false;
    }
    extents[d] = static_cast<cuuint64_t>(dims[d].extent);
    box[d] = dims[d].box;
    element_strides[d] = 1;
    if (d == 0) continue;
    // A dimension of extent 1 is never stepped: give it the contiguous stride.
    const int64_t stride_bytes =
        dims[d].extent == 1 ? previous_span_bytes : dims[d].stride * kElementBytes;
    if (stride_bytes % 16 != 0 || stride_bytes >= (int64_t{1} << 40)) {
      *why = "the stride of dimension " + std::to_string(d) + " (" + std::to_string(stride_bytes) +
             " bytes) is not a multiple of 16 below 2^40";
      return false;
    }
    if (stride_bytes < previous_stride_bytes && !any_stride_order) {
      *why =
          "strides decrease from dimension " + std::to_string(d - 1) + " to " + std::to_string(d);
      return false;
    }
    strides[d - 1] = static_cast<cuuint64_t>(stride_bytes);
    previous_stride_bytes = stride_bytes;
    previous_span_bytes = stride_bytes * dims[d].extent;
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_entry_point(why);
  if (encode == nullptr) return false;
  const CUresult result =
      encode(map,
             dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             static_cast<cuuint32_t>(rank), const_cast<void*>(base), extents, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    *why =
        "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(result));
    return false;
  }
  return true;
}

}  // namespace tessera::detail::sm90
