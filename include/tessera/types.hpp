// Tessera public types: dtypes, devices, tensor views and the error type.
// This header needs no CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace tessera {

// Element types. Values are part of the C ABI (tessera.h mirrors them): never renumber.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,  // bytes: bit-packed masks (RunOptions::custom_mask, tree_mask)
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA device ordinal; ignored for the CPU
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
  }
};

std::string device_name(Device device);

// Error thrown by every C++ entry point. The message names the argument and what was expected.
// kOutOfMemory: memory the library allocates itself could not be had (the one-shot calls'
// workspace, checked mode's scan buffer, a failed cudaMalloc); the C ABI's
// TESSERA_ERROR_OUT_OF_MEMORY. Nothing was written and the library stays usable.
class Error : public std::runtime_error {
 public:
  enum class Kind { kInvalidArgument, kUnsupported, kRuntime, kOutOfMemory };
  Error(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// A non-owning strided view. Strides are in elements. At most 4 dims are used by any op.
struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};

  // Element count; 0 for an empty view. Never overflows: a view whose sizes multiply past
  // 2^63 - 1 gives INT64_MAX, one with a negative size gives -1 (validation rejects both).
  int64_t numel() const {
    if (ndim == 0) return 0;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] == 0) return 0;
    }
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] < 0) return -1;
      if (n > INT64_MAX / shape[i]) return INT64_MAX;
      n *= shape[i];
    }
    return n;
  }
  int64_t size(int dim) const { return shape[dim]; }
  bool is_contiguous() const;

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// Builds a contiguous (row-major) view.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = {});
// Builds a view with explicit strides (in elements).
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride, Device device = {});

// An optional tensor argument (lse out, for example) is an empty view: ndim == 0.
inline bool has_value(const TensorView& view) { return view.ndim > 0; }

}  // namespace tessera
