// What the C ABI's translation units share (src/capi/c_api.cpp, c_api_cascade.cpp): the
// thread's last error, the exception-to-status guard, the DLPack-to-TensorView converter and the
// option structs' conversions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <span>
#include <string>
#include <utility>

#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

// The opaque plan handle: immutable after creation, so concurrent runs of one plan are safe.
struct tessera_plan {
  tessera::Plan plan;
};

namespace tessera::capi {

using tessera::Device;
using tessera::DeviceType;
using tessera::DType;
using tessera::Error;
using tessera::TensorView;

inline thread_local std::string g_last_error;

// Records `message` without ever throwing: if the copy cannot allocate, a short literal that
// fits the string's existing capacity (at least the small-string buffer) is stored instead.
inline void set_last_error(const char* message) noexcept {
  try {
    g_last_error.assign(message);
  } catch (...) {
    g_last_error.assign("out of memory");
  }
}

inline tessera_status status_of(Error::Kind kind) {
  switch (kind) {
    case Error::Kind::kInvalidArgument: return TESSERA_ERROR_INVALID_ARGUMENT;
    case Error::Kind::kUnsupported: return TESSERA_ERROR_UNSUPPORTED;
    case Error::Kind::kRuntime: return TESSERA_ERROR_RUNTIME;
    case Error::Kind::kOutOfMemory: return TESSERA_ERROR_OUT_OF_MEMORY;
  }
  return TESSERA_ERROR_RUNTIME;
}

// Runs `body` (which reports failure by throwing) and maps the outcome to a status. `function`
// prefixes the text of exceptions that do not come from tessera (their message lacks the op).
template <typename Body>
tessera_status guarded(const char* function, Body&& body) noexcept {
  try {
    std::forward<Body>(body)();
    g_last_error.clear();
    return TESSERA_OK;
  } catch (const Error& error) {
    set_last_error(error.what());
    return status_of(error.kind());
  } catch (const std::bad_alloc&) {
    set_last_error((std::string(function) + ": out of memory").c_str());
    return TESSERA_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& error) {
    try {
      set_last_error((std::string(function) + ": " + error.what()).c_str());
    } catch (...) {
      set_last_error(error.what());
    }
    return TESSERA_ERROR_RUNTIME;
  } catch (...) {
    set_last_error("tessera: unknown C++ exception");
    return TESSERA_ERROR_RUNTIME;
  }
}

// Builds "tessera_<function>: '<arg>': <message>" errors for the checks done in this layer, in
// the same shape as the C++ ArgChecker's messages.
class Converter {
 public:
  explicit Converter(const char* function) : function_(function) {}

  [[noreturn]] void fail(const char* arg, const std::string& message) const {
    throw Error(Error::Kind::kInvalidArgument,
                std::string(function_) + ": '" + arg + "': " + message);
  }

  // A required tensor.
  TensorView tensor(const DLTensor* tensor, const char* arg) const {
    if (tensor == nullptr) fail(arg, "expected a DLTensor, got NULL");
    return convert(*tensor, arg);
  }
  // An optional tensor: NULL becomes the C++ API's empty view.
  TensorView optional(const DLTensor* tensor, const char* arg) const {
    return tensor == nullptr ? TensorView{} : convert(*tensor, arg);
  }

  tessera::PagedKVCache paged_kv(const tessera_paged_kv* kv) const {
    if (kv == nullptr) fail("kv", "expected a tessera_paged_kv, got NULL");
    tessera::PagedKVCache cache;
    cache.k_cache = tensor(kv->k_cache, "k_cache");
    cache.v_cache = tensor(kv->v_cache, "v_cache");
    cache.page_indptr = tensor(kv->page_indptr, "page_indptr");
    cache.page_indices = tensor(kv->page_indices, "page_indices");
    cache.last_page_len = tensor(kv->last_page_len, "last_page_len");
    // Out-of-range layouts pass through unchanged: the C++ API rejects them by name.
    cache.layout = static_cast<tessera::KVLayout>(kv->layout);
    return cache;
  }

  // tessera_run_options (NULL: defaults); only the fields its struct_size covers are read.
  tessera::RunOptions run_options(const tessera_run_options* options) const {
    tessera::RunOptions result;
    if (options == nullptr) return result;
    if (options->struct_size < offsetof(tessera_run_options, sinks) + sizeof(options->sinks)) {
      if (options->struct_size < sizeof(options->struct_size)) {
        fail("run_options", "struct_size " + std::to_string(options->struct_size) +
                                " is too small; set it to sizeof(tessera_run_options)");
      }
      return result;
    }
    result.sinks = optional(options->sinks, "sinks");
    if (options->struct_size >=
        offsetof(tessera_run_options, enable_pdl) + sizeof(options->enable_pdl)) {
      result.enable_pdl = options->enable_pdl != 0;
    }
    // The masks came later: a caller whose struct stops before a field never set it.
    auto covers = [&](size_t offset, size_t size) { return options->struct_size >= offset + size; };
    if (covers(offsetof(tessera_run_options, custom_mask), sizeof(options->custom_mask))) {
      result.custom_mask = optional(options->custom_mask, "run_options.custom_mask");
    }
    if (covers(offsetof(tessera_run_options, mask_indptr), sizeof(options->mask_indptr))) {
      result.mask_indptr = optional(options->mask_indptr, "run_options.mask_indptr");
    }
    if (covers(offsetof(tessera_run_options, tree_mask), sizeof(options->tree_mask))) {
      result.tree_mask = optional(options->tree_mask, "run_options.tree_mask");
    }
    return result;
  }

  // tessera_plan_options (NULL: defaults) folded into `options`; only the fields its
  // struct_size covers are read.
  tessera::AttentionOptions plan_options(tessera::AttentionOptions options,
                                         const tessera_plan_options* plan_options) const {
    if (plan_options == nullptr) return options;
    if (plan_options->struct_size < sizeof(plan_options->struct_size)) {
      fail("plan_options", "struct_size " + std::to_string(plan_options->struct_size) +
                               " is too small; set it to sizeof(tessera_plan_options)");
    }
    if (plan_options->struct_size >=
        offsetof(tessera_plan_options, head_dim_vo) + sizeof(plan_options->head_dim_vo)) {
      options.head_dim_vo = plan_options->head_dim_vo;
    }
    return options;
  }

  const tessera::Plan& plan(const tessera_plan* plan) const {
    if (plan == nullptr) fail("plan", "expected a tessera_plan, got NULL");
    return plan->plan;
  }

  Device device(int device_type, int device_id) const {
    if (device_type == kDLCPU) return Device{DeviceType::kCPU, 0};
    if (device_type == kDLCUDA) return Device{DeviceType::kCUDA, device_id};
    fail("device_type", "expected kDLCPU (1) or kDLCUDA (2), got " + std::to_string(device_type));
  }

  // `count` host int32 values behind `values` (count is batch-derived and already checked).
  std::span<const int32_t> host_array(const int32_t* values, int64_t count, const char* arg) const {
    if (count == 0) return {};
    if (values == nullptr) {
      fail(arg, "expected " + std::to_string(count) + " host int32 values, got NULL");
    }
    return {values, static_cast<size_t>(count)};
  }

  // Plans index int32 requests; indptr arrays hold batch_size + 1 values.
  void batch_size(int64_t batch_size) const {
    if (batch_size < 0 || batch_size >= INT32_MAX) {
      fail("batch_size", "expected a value in [0, 2^31 - 2], got " + std::to_string(batch_size));
    }
  }

 private:
  TensorView convert(const DLTensor& tensor, const char* arg) const {
    TensorView view;
    if (tensor.ndim < 1 || tensor.ndim > TensorView::kMaxDims) {
      fail(arg, "expected 1 to " + std::to_string(TensorView::kMaxDims) + " dimensions, got " +
                    std::to_string(tensor.ndim));
    }
    if (tensor.shape == nullptr) fail(arg, "shape is NULL");
    view.ndim = tensor.ndim;
    view.dtype = dtype(tensor.dtype, arg);
    view.device = device_of(tensor.device, arg);
    for (int i = 0; i < view.ndim; ++i) view.shape[i] = tensor.shape[i];
    if (tensor.strides != nullptr) {
      for (int i = 0; i < view.ndim; ++i) view.stride[i] = tensor.strides[i];
    } else {
      // DLPack: NULL strides mean a compact row-major tensor. Negative sizes are left for the
      // C++ checks to reject; overflow is caught here because it would be undefined.
      int64_t stride = 1;
      for (int i = view.ndim - 1; i >= 0; --i) {
        view.stride[i] = stride;
        if (view.shape[i] > 0 && __builtin_mul_overflow(stride, view.shape[i], &stride)) {
          fail(arg, "shape " + shape_text(tensor) + " has more than 2^63 elements");
        }
      }
    }
    view.data = tensor.data == nullptr
                    ? nullptr
                    : static_cast<void*>(static_cast<char*>(tensor.data) + tensor.byte_offset);
    return view;
  }

  DType dtype(DLDataType type, const char* arg) const {
    if (type.lanes != 1) {
      fail(arg, "expected lanes == 1 (vector dtypes are not supported), got lanes " +
                    std::to_string(type.lanes));
    }
    const int code = type.code, bits = type.bits;
    if (code == kDLFloat && bits == 32) return DType::kFloat32;
    if (code == kDLFloat && bits == 16) return DType::kFloat16;
    if (code == kDLBfloat && bits == 16) return DType::kBFloat16;
    if (code == TESSERA_DL_FLOAT8_E4M3FN && bits == 8) return DType::kFloat8E4M3;
    if (code == TESSERA_DL_FLOAT8_E5M2 && bits == 8) return DType::kFloat8E5M2;
    if (code == kDLInt && bits == 32) return DType::kInt32;
    if (code == kDLInt && bits == 64) return DType::kInt64;
    if (code == kDLUInt && bits == 8) return DType::kUInt8;
    fail(arg, "unsupported DLPack dtype (code " + std::to_string(code) + ", bits " +
                  std::to_string(bits) +
                  "); expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, "
                  "int64 or uint8");
  }

  Device device_of(DLDevice device, const char* arg) const {
    // Read the device type as the int a C caller stored: a value outside DLDeviceType's
    // enumerators (a newer DLPack, garbage) must be rejected, and loading it as the C++ enum
    // would be undefined behaviour (UBSan: "not a valid value for type 'DLDeviceType'").
    static_assert(sizeof(DLDeviceType) == sizeof(int32_t));
    int32_t device_type;
    std::memcpy(&device_type, &device.device_type, sizeof device_type);
    switch (device_type) {
      case kDLCPU:
      case kDLCUDAHost:  // pinned host memory: the CPU reads it like any host memory
        return Device{DeviceType::kCPU, 0};
      case kDLCUDA: return Device{DeviceType::kCUDA, device.device_id};
      case kDLCUDAManaged:
        fail(arg,
             "CUDA managed (unified) memory is not supported; pass a kDLCUDA or kDLCPU "
             "tensor");
      default:
        fail(arg, "unsupported DLPack device type " + std::to_string(device_type) +
                      "; expected kDLCPU (1) or kDLCUDA (2)");
    }
  }

  static std::string shape_text(const DLTensor& tensor) {
    std::string text = "[";
    for (int i = 0; i < tensor.ndim; ++i) {
      text += (i ? ", " : "") + std::to_string(tensor.shape[i]);
    }
    return text + "]";
  }

  const char* function_;
};

inline tessera::AttentionOptions attention_options(const tessera_attention_options* options) {
  tessera::AttentionOptions result;
  if (options == nullptr) return result;
  result.causal = options->causal != 0;
  result.window_left = options->window_left;
  result.window_right = options->window_right;
  result.logits_soft_cap = options->logits_soft_cap;
  result.sm_scale = options->sm_scale;
  result.k_scale = options->k_scale;
  result.v_scale = options->v_scale;
  return result;
}

inline tessera::RopeOptions rope_options(const tessera_rope_options* options) {
  tessera::RopeOptions result;
  if (options == nullptr) return result;
  result.rotary_dim = options->rotary_dim;
  result.interleave = options->interleave != 0;
  result.rope_theta = options->rope_theta;
  result.rope_scale = options->rope_scale;
  result.llama31 = options->llama31 != 0;
  result.llama31_factor = options->llama31_factor;
  result.llama31_low_freq_factor = options->llama31_low_freq_factor;
  result.llama31_high_freq_factor = options->llama31_high_freq_factor;
  result.llama31_original_max_position = options->llama31_original_max_position;
  return result;
}

// Stores a freshly built plan in *out, which is NULL whenever the call fails.
template <typename Build>
tessera_status make_plan(const char* function, tessera_plan** out, Build&& build) noexcept {
  if (out != nullptr) *out = nullptr;
  return guarded(function, [&] {
    if (out == nullptr) Converter(function).fail("out", "expected a tessera_plan**, got NULL");
    tessera_plan* plan = new tessera_plan{std::forward<Build>(build)()};
    *out = plan;
  });
}

// Copies `text` and its NUL into buffer[capacity] for the *_explain calls: *needed (optional)
// gets the size; a NULL buffer with capacity 0 is a size query; a short buffer gets the text
// truncated (NUL-terminated) and an error.
inline void copy_text(const Converter& convert, const std::string& text, char* buffer,
                      size_t capacity, size_t* needed) {
  const size_t size = text.size() + 1;
  if (needed != nullptr) *needed = size;
  if (buffer == nullptr && capacity == 0) return;  // a size query
  if (buffer == nullptr) convert.fail("buffer", "is NULL but capacity is not 0");
  if (capacity > 0) {
    const size_t copied = std::min(capacity - 1, text.size());
    std::memcpy(buffer, text.data(), copied);
    buffer[copied] = '\0';
  }
  if (capacity < size) {
    convert.fail("capacity", "the text needs " + std::to_string(size) +
                                 " bytes (NUL included), got " + std::to_string(capacity) +
                                 "; the text was truncated");
  }
}

}  // namespace tessera::capi
