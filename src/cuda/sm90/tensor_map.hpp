// Host construction of TMA tensor maps (cuTensorMapEncodeTiled, reached through the runtime's
// driver entry point: the library does not link libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "tessera/types.hpp"

namespace tessera::detail::sm90 {

// One dimension of a tensor as TMA sees it: extent and stride in elements. Dimension 0 is the
// contiguous one (stride 1).
struct TensorMapDim {
  int64_t extent;
  int64_t stride;
  uint32_t box;  // elements of a box along this dimension (1 .. 256)
};

// Encodes a 128-byte-swizzled tiled map of 16-bit elements (fp16 / bf16) over `base` with up to
// 5 dimensions. Dimensions of extent 1 get a virtual contiguous stride (they are never stepped).
// Returns false, with the reason in *why, when TMA cannot describe the tensor: an address or a
// stride that is not a multiple of 16 bytes, strides that decrease from one dimension to the
// next (unless any_stride_order: the driver takes any order, and a map whose box spans the
// column blocks of a row after its rows needs it), an extent beyond 2^32, or the driver refusing
// the map.
bool encode_tensor_map(CUtensorMap* map, DType dtype, const void* base, const TensorMapDim* dims,
                       int rank, std::string* why, bool any_stride_order = false);

}  // namespace tessera::detail::sm90
