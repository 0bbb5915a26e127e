#include <sstream>

#include "tessera/attention.hpp"
#include "tessera/types.hpp"
#include "tessera/version.hpp"

namespace tessera {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

std::string device_name(Device device) {
  return device.type == DeviceType::kCPU ? std::string("cpu")
                                         : "cuda:" + std::to_string(device.index);
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device) {
  if (shape.size() > TensorView::kMaxDims) {
    throw Error(Error::Kind::kInvalidArgument, "tessera::make_view: 'shape': expected at most 4 dimensions");
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) view.shape[i++] = s;
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.stride[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride, Device device) {
  if (shape.size() != stride.size()) {
    throw Error(Error::Kind::kInvalidArgument, "tessera::make_view: 'stride': expected as many strides as shape dimensions");
  }
  TensorView view = make_view(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : stride) view.stride[i++] = s;
  return view;
}

const char* op_name(AttentionOp op) {
  switch (op) {
    case AttentionOp::kRaggedPrefill: return "ragged_prefill";
    case AttentionOp::kPagedPrefill: return "paged_prefill";
    case AttentionOp::kDecode: return "decode";
  }
  return "unknown";
}

const char* version_string() { return TESSERA_VERSION; }

}  // namespace tessera
